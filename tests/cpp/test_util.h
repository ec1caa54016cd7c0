// Helpers shared by the C++ tests.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <map>
#include <fstream>
#include <sstream>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/core/fs.h"
#include "loongforge/models/model.h"

namespace lf::test {

// The message of the lf::Error f() throws, or "(no error)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const lf::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A fresh, empty folder named after the running test (and TAG), under the system temp folder.
inline std::filesystem::path temp_dir(const std::string& tag = "") {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = "lf_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name();
  if (!tag.empty()) name += "_" + tag;
  std::filesystem::path dir = std::filesystem::temp_directory_path() / name;
  lf::remove_tree(dir.string());
  std::filesystem::create_directories(dir);
  return dir;
}

// d(sum(f() * dy))/d(input) by central differences, in float64 (f reads `input`, which is perturbed in place).
inline at::Tensor numeric_grad(const std::function<at::Tensor()>& f, at::Tensor& input, const at::Tensor& dy, double h = 1e-6) {
  at::NoGradGuard no_grad;
  at::Tensor g = at::zeros_like(input);
  auto flat = input.view({-1});
  auto gflat = g.view({-1});
  for (int64_t i = 0; i < flat.numel(); ++i) {
    double orig = flat[i].item<double>();
    flat[i] = orig + h;
    double up = (f() * dy).sum().item<double>();
    flat[i] = orig - h;
    double down = (f() * dy).sum().item<double>();
    flat[i] = orig;
    gflat[i] = (up - down) / (2 * h);
  }
  return g;
}

inline std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_bytes(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// A batch for the Qwen VL tests (image token 99, patches of 3 x 2 x 2 x 2): two rows of 16 tokens, row 0 with an image
// of 4x6 patches and row 1 with one of 6x4 (6 image tokens each); the images as item fields.
struct QwenVLBatch {
  at::Tensor ids, grid, px, labels;
  lf::models::Batch batch;
  std::map<std::string, at::Tensor> reference() const {
    return {{"input_ids", ids}, {"labels", labels}, {"pixel_values", px}, {"image_grid_thw", grid}};
  }
};
inline QwenVLBatch qwen_vl_batch() {
  QwenVLBatch q;
  q.ids = at::randint(3, 90, {2, 16}, at::kLong);
  q.ids.narrow(1, 2, 6).fill_(99);
  q.ids[1].narrow(0, 5, 6).fill_(99);
  q.ids[1].narrow(0, 2, 3).fill_(7);
  q.grid = at::tensor({1, 4, 6, 1, 6, 4}, at::kLong).view({2, 3});
  q.px = at::randn({48, 24});
  q.labels = q.ids.masked_fill(q.ids == 99, -100);
  at::Tensor targets = at::cat({q.labels.narrow(1, 1, 15), at::full({2, 1}, -100, at::kLong)}, 1);
  q.batch = lf::models::Batch{{"input_ids", q.ids}, {"targets", targets}};
  q.batch.set_items("pixel_values", q.px, at::cat({at::zeros({24}, at::kLong), at::ones({24}, at::kLong)}));
  q.batch.set_items("image_grid_thw", q.grid, at::tensor({0, 1}, at::kLong));
  return q;
}
// The training loss of q.batch equals `dump`'s reference loss, and its rows' losses sum to it; returns the loss sum.
inline at::Tensor check_qwen_vl_loss(lf::models::Model& model, const QwenVLBatch& q) {
  auto [sum, terms] = model.loss(q.batch);
  auto ref = model.reference_forward(q.reference(), "batch.safetensors");
  EXPECT_NEAR(sum.item<double>() / static_cast<double>(terms), ref.loss.item<double>(), 1e-6);
  auto [s0, t0] = model.loss(q.batch.rows(0, 1));
  auto [s1, t1] = model.loss(q.batch.rows(1, 1));
  EXPECT_EQ(t0 + t1, terms);
  EXPECT_NEAR((s0 + s1).item<double>(), sum.item<double>(), 1e-5 * sum.item<double>());
  return sum;
}

}  // namespace lf::test
