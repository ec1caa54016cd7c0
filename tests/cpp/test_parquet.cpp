// data/parquet.h: the C++ API. The hook Parquet.ApiOnPyarrowFile runs on a file tests/python/test_parquet.py writes
// with pyarrow (LF_TEST_PARQUET; the values themselves are compared with pyarrow's there): schema, row groups,
// several columns at once, ranges across row groups, threads sharing one file, metadata, errors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>
#include <vector>

#include "loongforge/data/parquet.h"
#include "test_util.h"

namespace lf::data {
namespace {

TEST(Parquet, MissingFileIsOneLine) {
  const std::string msg = test::error_of([] { ParquetFile f("/nonexistent/episode.parquet"); });
  EXPECT_EQ(msg.find('\n'), std::string::npos);
  if (parquet_available()) {
    EXPECT_EQ(msg, "/nonexistent/episode.parquet: no such file");
  } else {
    EXPECT_NE(msg.find("this build has no Apache Arrow (pip install pyarrow==26.0.1"), std::string::npos) << msg;
    EXPECT_EQ(parquet_backend_description().rfind("none: ", 0), 0u);
  }
}

TEST(Parquet, ApiOnPyarrowFile) {
  const char* path = std::getenv("LF_TEST_PARQUET");
  if (!path) GTEST_SKIP() << "run by tests/python/test_parquet.py";
  const ParquetFile f(path);
  ASSERT_EQ(f.num_rows(), 30);
  ASSERT_EQ(f.num_row_groups(), 5);
  EXPECT_EQ(f.row_group_starts(), (std::vector<int64_t>{0, 7, 14, 21, 28, 30}));

  EXPECT_TRUE(f.has_column("observation.state"));
  EXPECT_FALSE(f.has_column("observation.velocity"));
  EXPECT_EQ(f.column("observation.state").kind, ParquetColumnKind::numeric);
  EXPECT_EQ(f.column("observation.state").dtype, at::kFloat);
  EXPECT_EQ(f.column("observation.state").shape, std::vector<int64_t>{6});
  EXPECT_EQ(f.column("action").shape, std::vector<int64_t>{-1});
  EXPECT_EQ(f.row_shape("action"), std::vector<int64_t>{4});
  EXPECT_EQ(f.row_shape("stats"), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.column("observation.image").kind, ParquetColumnKind::image);
  EXPECT_EQ(f.column("note").kind, ParquetColumnKind::bytes);
  EXPECT_EQ(f.column("tags").kind, ParquetColumnKind::byte_lists);
  EXPECT_EQ(f.column("other").kind, ParquetColumnKind::other);
  EXPECT_EQ(f.metadata("fps").value_or(""), "30");
  EXPECT_FALSE(f.metadata("nope").has_value());
  EXPECT_TRUE(f.metadata().count("ARROW:schema"));

  // The indices the test wrote: episode i / 12, frame i % 12.
  const std::vector<std::string> names{"episode_index", "frame_index", "observation.state", "action", "stats",
                                       "next.done"};
  const std::vector<at::Tensor> all = f.read_tensors(names);
  const at::Tensor i = at::arange(30, at::kLong);
  EXPECT_TRUE(at::equal(all[0], at::div(i, 12, "floor")));
  EXPECT_TRUE(at::equal(all[1], at::remainder(i, 12)));
  EXPECT_EQ(all[2].sizes(), (std::vector<int64_t>{30, 6}));
  EXPECT_EQ(all[4].sizes(), (std::vector<int64_t>{30, 2, 3}));
  EXPECT_EQ(all[4].scalar_type(), at::kDouble);
  EXPECT_EQ(all[5].scalar_type(), at::kBool);

  // Ranges inside, across and at the edges of row groups agree with the whole read.
  for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {5, 17}, {7, 14}, {13, 29}, {29, 30}, {4, 4}}) {
    const std::vector<at::Tensor> part = f.read_tensors(names, b, e);
    for (size_t k = 0; k < names.size(); ++k)
      EXPECT_TRUE(at::equal(part[k], all[k].slice(0, b, e))) << names[k] << " rows " << b << ":" << e;
  }
  // Threads sharing the file, each reading the row groups in its own order.
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      bool good = true;
      for (int g = 0; g < 5; ++g) {
        const int gg = (g * (t + 1) + t) % 5;
        const int64_t b = f.row_group_starts()[gg], e = f.row_group_starts()[gg + 1];
        good = good && at::equal(f.read_tensor("observation.state", b, e), all[2].slice(0, b, e));
      }
      ok[t] = good;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok, std::vector<int>(4, 1));

  const std::vector<std::string> images = f.read_bytes("observation.image", 6, 9);
  ASSERT_EQ(images.size(), 3u);
  const std::vector<std::string> notes = f.read_bytes("note");
  ASSERT_EQ(notes.size(), 30u);
  EXPECT_EQ(notes[0], "");
  EXPECT_EQ(notes[4], "row 4 \xc3\xa9");
  const auto tags = f.read_byte_lists("tags", 1, 4);  // rows i hold the first i % 4 of a, bé, c
  ASSERT_EQ(tags.size(), 3u);
  EXPECT_EQ(tags[0], std::vector<std::string>{"a"});
  EXPECT_EQ(tags[2], (std::vector<std::string>{"a", "b\xc3\xa9", "c"}));

  const std::string p(path);
  EXPECT_EQ(test::error_of([&] { f.column("observation.velocity"); }).rfind(
                p + ": column 'observation.velocity': no such column (the file has: episode_index, ", 0),
            0u);
  EXPECT_EQ(test::error_of([&] { f.read_tensor("note"); }),
            p + ": column 'note': holds bytes (string), not numbers or lists of numbers");
  EXPECT_EQ(test::error_of([&] { f.read_bytes("action"); }).rfind(p + ": column 'action': holds numbers (list<", 0),
            0u);
  EXPECT_EQ(test::error_of([&] { f.read_byte_lists("note"); }),
            p + ": column 'note': holds bytes (string), not lists of strings");
  EXPECT_EQ(test::error_of([&] { f.read_tensor("action", 3, 31); }),
            p + ": rows [3, 31) are outside the file's 30 rows");
}

}  // namespace
}  // namespace lf::data
