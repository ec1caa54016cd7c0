// Helpers shared by the C++ tests.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/core/fs.h"

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

}  // namespace lf::test
