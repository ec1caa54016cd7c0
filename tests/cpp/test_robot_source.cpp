// The robot batch source (train/robot_source.h) on a dataset and policy the Python test writes with LeRobot
// (tests/python/test_policy_train.py): the hook writes a batch and the frames it holds for the comparison with
// LeRobot's own batch, and checks here that data-parallel shares and resume give the same rows.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "loongforge/io/safetensors.h"
#include "loongforge/train/builders.h"
#include "loongforge/train/recipe.h"
#include "loongforge/train/robot_source.h"

namespace {

using lf::train::Batch;

void expect_same(const Batch& a, const Batch& b, const std::string& what) {
  ASSERT_EQ(a.tensors().size(), b.tensors().size()) << what;
  for (const auto& [n, t] : a.tensors()) EXPECT_TRUE(t.equal(b.at(n))) << what << ": " << n;
}

}  // namespace

TEST(RobotSource, BatchHook) {
  const char* recipe_path = std::getenv("LF_TEST_ROBOT_RECIPE");
  const char* out = std::getenv("LF_TEST_ROBOT_OUT");
  if (!recipe_path || !out) GTEST_SKIP() << "LF_TEST_ROBOT_RECIPE / _OUT not set";
  const nlohmann::json r = lf::train::load_recipe(recipe_path);
  const lf::train::ModelBundle b = lf::train::build_model(r);
  auto make = [&] { return lf::train::build_data(r, lf::data::Split::Train, "", b.model.get()); };

  auto src = make();
  auto* rs = dynamic_cast<lf::train::RobotSource*>(src.get());
  ASSERT_NE(rs, nullptr);
  // LF_TEST_ROBOT_ROWS: rows per batch (default 6; "epoch": a whole pass over the training frames)
  const char* rows_env = std::getenv("LF_TEST_ROBOT_ROWS");
  const std::string rows_s = rows_env ? rows_env : "6";
  const int64_t rows = rows_s == "epoch" ? rs->rows_per_epoch() : std::stoll(rows_s);
  const Batch first = src->next(rows);
  const Batch second = src->next(rows);

  // The frames of the first batch (the source's stream rows 0..rows-1).
  std::vector<int64_t> index;
  for (int64_t k = 0; k < rows; ++k) {
    const auto f = rs->frame_of(k);
    index.push_back(rs->dataset().episodes()[static_cast<size_t>(f.episode)].from + f.frame);
  }

  lf::io::NamedTensors t;
  for (const auto& [n, x] : first.tensors()) t.emplace_back(n, x.contiguous());
  t.emplace_back("index", at::tensor(index, at::kLong));
  lf::io::save_file((std::filesystem::path(out) / "batch.safetensors").string(), t);
  rs->write_model_files((std::filesystem::path(out) / "model_files").string());

  // Two data-parallel ranks' shares of each global batch = the whole batch, draws included (LF_TEST_ROBOT_SHARES=0:
  // not checked, for prompts a share pads to its own longest row).
  const char* shares = std::getenv("LF_TEST_ROBOT_SHARES");
  if (!shares || std::string(shares) != "0") {
    auto a = make(), c = make();
    for (const Batch* whole : {&first, &second}) {
      Batch lo = a->next_rows(rows, 0, 2), hi = c->next_rows(rows, 2, rows - 2);
      const Batch both = Batch::concat({lo, hi});  // item fields (patches, images) renumbered
      for (const auto& [n, x] : whole->tensors()) EXPECT_TRUE(both.at(n).equal(x)) << "shares: " << n;
    }
  }
  // Resume: a fresh source restored to the state after the first batch gives the second.
  {
    auto a = make();
    a->next(rows);
    const nlohmann::json st = a->state();
    auto c = make();
    c->restore(st);
    expect_same(c->next(rows), second, "resume");
  }
}
