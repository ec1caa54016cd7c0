// Tests of the TensorBoard event writer (src/loongforge/io/tensorboard.*) and the PNG line plots (io/plot.*).
// ObservabilityOracle.Write does nothing (GTEST_SKIP) unless LF_OBS_OUT is set: tests/python/test_observability.py
// runs it to write event files and PNGs that it checks with the tensorboard package and Pillow.
#include <gtest/gtest.h>
#include <dirent.h>
#include <ftw.h>
#include <png.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/io/plot.h"
#include "loongforge/io/tensorboard.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace lf::io;
using namespace lf::io::tfrecord;

namespace {

using lf::test::temp_dir;
using lf::test::read_bytes;

// std::filesystem::remove_all and directory iteration crash in this binary (libtorch.so exports its own copies of
// those libstdc++ symbols), so the tests clean up and list directories with POSIX calls.
void remove_tree(const fs::path& p) {
  nftw(p.c_str(), [](const char* f, const struct stat*, int, struct FTW*) { return std::remove(f); }, 16,
       FTW_DEPTH | FTW_PHYS);
}

std::vector<std::string> list_dir(const fs::path& p) {
  std::vector<std::string> names;
  if (DIR* d = opendir(p.c_str())) {
    while (dirent* e = readdir(d))
      if (std::string n = e->d_name; n != "." && n != "..") names.push_back(n);
    closedir(d);
  }
  return names;
}



std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int v : b) s.push_back(static_cast<char>(v));
  return s;
}

uint64_t le(const std::string& s, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

// Splits a TFRecord file into payloads, checking lengths and both masked CRCs.
std::vector<std::string> read_records(const std::string& data) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < data.size()) {
    EXPECT_LE(at + 12, data.size());
    uint64_t n = le(data, at, 8);
    EXPECT_EQ(le(data, at + 8, 4), masked_crc32c(data.substr(at, 8)));
    EXPECT_LE(at + 12 + n + 4, data.size());
    std::string payload = data.substr(at + 12, n);
    EXPECT_EQ(le(data, at + 12 + n, 4), masked_crc32c(payload));
    out.push_back(payload);
    at += 12 + n + 4;
  }
  return out;
}

struct Image {
  int w = 0, h = 0;
  std::vector<uint8_t> rgb;
  size_t count(uint32_t c) const {
    size_t n = 0;
    for (size_t i = 0; i + 2 < rgb.size(); i += 3)
      n += rgb[i] == (c >> 16 & 0xFF) && rgb[i + 1] == (c >> 8 & 0xFF) && rgb[i + 2] == (c & 0xFF);
    return n;
  }
};

Image read_png(const fs::path& p) {  // decoded with libpng's own reader
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  Image out;
  if (!png_image_begin_read_from_file(&img, p.c_str())) {
    ADD_FAILURE() << p << ": " << img.message;
    return out;
  }
  img.format = PNG_FORMAT_RGB;
  out.w = img.width, out.h = img.height;
  out.rgb.resize(PNG_IMAGE_SIZE(img));
  EXPECT_TRUE(png_image_finish_read(&img, nullptr, out.rgb.data(), 0, nullptr)) << img.message;
  return out;
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN(), kInf = std::numeric_limits<double>::infinity();

}  // namespace

TEST(TfRecord, Crc32cKnownVectors) {
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c("a"), 0xC1D04330u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);  // RFC 3720 B.4 vectors
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string inc, dec;
  for (int i = 0; i < 32; ++i) inc.push_back(char(i)), dec.push_back(char(31 - i));
  EXPECT_EQ(crc32c(inc), 0x46DD794Eu);
  EXPECT_EQ(crc32c(dec), 0x113FDB5Cu);
  EXPECT_EQ(crc32c("6789", crc32c("12345")), 0xE3069283u);  // chaining
  EXPECT_EQ(masked_crc32c(""), 0xa282ead8u);
  uint32_t c = 0xE3069283u;
  EXPECT_EQ(masked_crc32c("123456789"), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TfRecord, Varint) {
  auto v = [](uint64_t x) {
    std::string s;
    put_varint(s, x);
    return s;
  };
  EXPECT_EQ(v(0), bytes({0x00}));
  EXPECT_EQ(v(1), bytes({0x01}));
  EXPECT_EQ(v(127), bytes({0x7F}));
  EXPECT_EQ(v(128), bytes({0x80, 0x01}));
  EXPECT_EQ(v(300), bytes({0xAC, 0x02}));
  EXPECT_EQ(v(16384), bytes({0x80, 0x80, 0x01}));
  EXPECT_EQ(v(uint64_t(1) << 63), bytes({0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01}));
  EXPECT_EQ(v(static_cast<uint64_t>(int64_t(-1))), bytes({0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01}));
}

TEST(TfRecord, EventEncodingAndFraming) {
  // Event{wall_time: 1.5, step: 3, summary{value{tag: "a", simple_value: 2.0}}}
  std::string ev = scalar_event(1.5, 3, "a", 2.0f);
  EXPECT_EQ(ev, bytes({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F, 0x10, 0x03, 0x2A, 0x0A, 0x0A, 0x08, 0x0A, 0x01, 'a', 0x15,
                       0, 0, 0, 0x40}));
  EXPECT_EQ(scalar_event(1.5, 0, "a", 2.0f), ev.substr(0, 9) + ev.substr(11));  // step 0 is omitted
  std::string fv = file_version_event(0.0);
  EXPECT_EQ(fv, bytes({0x09, 0, 0, 0, 0, 0, 0, 0, 0, 0x1A, 0x0D}) + "brain.Event:2");
  std::string rec = frame(ev);
  ASSERT_EQ(rec.size(), ev.size() + 16);
  EXPECT_EQ(le(rec, 0, 8), ev.size());
  EXPECT_EQ(rec.substr(12, ev.size()), ev);
  EXPECT_EQ(read_records(rec + frame(fv)), (std::vector<std::string>{ev, fv}));
}

TEST(TensorBoardWriter, WritesFramedEvents) {
  fs::path dir = temp_dir("tb") / "nested" / "run";
  std::string path;
  {
    TensorBoardWriter w(dir.string());
    path = w.path();
    EXPECT_EQ(fs::path(path).parent_path(), dir);
    EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u);
    for (int s = 0; s < 10; ++s) w.add_scalar("train/loss", 1.0 / (s + 1), s, 1000.0 + s);
    w.add_scalar("lr", 3e-4, 10);
    w.flush();
    EXPECT_EQ(read_records(read_bytes(path)).size(), 12u);  // flushed: readable while the writer lives
    w.add_scalar("lr", 2e-4, 11);
  }
  std::vector<std::string> recs = read_records(read_bytes(path));
  ASSERT_EQ(recs.size(), 13u);
  EXPECT_NE(recs[0].find("brain.Event:2"), std::string::npos);
  EXPECT_EQ(recs[5], scalar_event(1004.0, 4, "train/loss", float(1.0 / 5)));
  // A second writer in the same directory (same second, same pid) gets a file of its own.
  TensorBoardWriter a(dir.string()), b(dir.string());
  EXPECT_NE(a.path(), b.path());
  EXPECT_NE(a.path(), path);
  remove_tree(dir.parent_path().parent_path());
}

TEST(TensorBoardWriter, ErrorNamesThePath) {
  fs::path dir = temp_dir("tberr");
  std::ofstream(dir / "file") << "x";
  std::string bad = (dir / "file" / "logs").string();
  try {
    TensorBoardWriter w(bad);
    FAIL() << "no error";
  } catch (const lf::Error& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
  remove_tree(dir);
}

TEST(Plot, Ticks) {
  EXPECT_EQ(nice_ticks(0, 10, 5), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  EXPECT_EQ(nice_ticks(-0.95, 0.95, 4), (std::vector<double>{-0.5, 0, 0.5}));
  EXPECT_EQ(nice_ticks(3, 3, 5), (std::vector<double>{3}));
  EXPECT_EQ(tick_label(0, 1), "0");
  EXPECT_EQ(tick_label(2, 2), "2");
  EXPECT_EQ(tick_label(0.5, 0.5), "0.5");
  EXPECT_EQ(tick_label(-0.25, 0.05), "-0.25");
  EXPECT_EQ(tick_label(1500, 500), "1500");
  EXPECT_EQ(tick_label(1.5e-5, 5e-6), "1.5e-5");
  EXPECT_EQ(tick_label(2e6, 1e6), "2e+6");
  EXPECT_EQ(tick_label(1e-30, 1e-30), "1e-30");
}

TEST(Plot, DrawsSeriesAxesAndLegend) {
  fs::path dir = temp_dir("plot");
  Series train{"train", {}, {}, 0xD62728}, valid{"valid", {}, {}, 0x1F77B4};
  for (int s = 0; s <= 100; ++s) train.x.push_back(s), train.y.push_back(2.0 * std::exp(-s / 30.0) + 0.1);
  for (int s = 0; s <= 100; s += 10) valid.x.push_back(s), valid.y.push_back(2.2 * std::exp(-s / 35.0) + 0.15);
  std::string path = (dir / "sub" / "loss.png").string();
  write_line_plot(path, "loss vs step", {train, valid}, 640, 360);
  Image img = read_png(path);
  ASSERT_EQ(img.w, 640);
  ASSERT_EQ(img.h, 360);
  EXPECT_GT(img.count(0xD62728), 200u);
  EXPECT_GT(img.count(0x1F77B4), 200u);
  EXPECT_GT(img.count(0x000000), 500u);  // frame, ticks and text
  EXPECT_GT(img.count(0xFFFFFF), size_t(640 * 360 * 0.7));
  EXPECT_EQ(list_dir(dir / "sub"), std::vector<std::string>{"loss.png"});  // no temporary file left behind
  write_line_plot(path, "log", {train, valid}, 640, 360, true);
  EXPECT_EQ(read_png(path).w, 640);
  remove_tree(dir);
}

TEST(Plot, DegenerateDataDoesNotCrash) {
  fs::path dir = temp_dir("plotdeg");
  std::vector<std::pair<std::string, std::vector<Series>>> cases = {
      {"none", {}},
      {"empty", {{"empty", {}, {}, 0xFF0000}}},
      {"one_point", {{"one", {5}, {0.7}, 0xFF0000}}},
      {"constant", {{"flat", {0, 1, 2, 3}, {2, 2, 2, 2}, 0xFF0000}}},
      {"zeros", {{"zero", {0, 1, 2}, {0, 0, 0}, 0xFF0000}}},
      {"nan", {{"nan", {0, 1, 2, 3, 4, 5}, {1, kNaN, 2, kInf, -kInf, 3}, 0xFF0000}}},
      {"all_nan", {{"nan", {0, 1}, {kNaN, kNaN}, 0xFF0000}, {"x nan", {kNaN, kInf}, {1, 2}, 0x00FF00}}},
      {"huge", {{"huge", {-1e308, 1e308}, {-1.7e308, 1.7e308}, 0xFF0000}}},
      {"tiny", {{"tiny", {0, 1e-300}, {1e-310, 2e-310}, 0xFF0000}}},
      {"unicode", {{"\xce\xbb loss ~ \\ {}", {0, 1}, {1, 2}, 0xFF0000}}},
  };
  for (const auto& [name, series] : cases) {
    for (bool log_y : {false, true}) {
      std::string path = (dir / (name + (log_y ? "_log" : "") + ".png")).string();
      ASSERT_NO_THROW(write_line_plot(path, "degenerate " + name, series, 300, 200, log_y)) << name;
      Image img = read_png(path);
      EXPECT_EQ(img.w, 300);
      EXPECT_EQ(img.h, 200);
    }
  }
  // The lone point is visible; a constant series draws a line.
  EXPECT_GT(read_png(dir / "one_point.png").count(0xFF0000), 20u);
  EXPECT_GT(read_png(dir / "constant.png").count(0xFF0000), 100u);
  remove_tree(dir);
}

TEST(Plot, ErrorsNameThePath) {
  fs::path dir = temp_dir("ploterr");
  std::string path = (dir / "p.png").string();
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error";
    } catch (const lf::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { write_line_plot(path, "t", {{"bad", {1, 2}, {1}, 0}}); }, path);
  expect_error([&] { write_line_plot(path, "t", {}, 10, 10); }, path);
  std::ofstream(dir / "file") << "x";
  std::string under_file = (dir / "file" / "p.png").string();
  expect_error([&] { write_line_plot(under_file, "t", {}); }, under_file);
  fs::create_directories(dir / "ro");
  chmod((dir / "ro").c_str(), 0500);
  std::string ro = (dir / "ro" / "p.png").string();
  if (access((dir / "ro").c_str(), W_OK) != 0) expect_error([&] { write_line_plot(ro, "t", {}); }, ro);  // not root
  chmod((dir / "ro").c_str(), 0700);
  remove_tree(dir);
}

// Writes what tests/python/test_observability.py checks; the values are recomputed there.
TEST(ObservabilityOracle, Write) {
  const char* out = std::getenv("LF_OBS_OUT");
  if (!out) GTEST_SKIP() << "LF_OBS_OUT not set";
  fs::path dir(out);
  Series train{"train loss", {}, {}, 0xD62728}, valid{"valid loss", {}, {}, 0x1F77B4};
  {
    TensorBoardWriter w((dir / "tb").string());
    std::ofstream(dir / "event_file") << w.path();
    for (int s = 0; s < 200; ++s) {  // steps never decrease across tags (TensorBoard purges "orphaned" steps)
      double loss = 3.0 - 0.01 * s + 0.1 * (s % 7);
      w.add_scalar("train/loss", loss, s, 1700000000.0 + s * 0.25);
      train.x.push_back(s), train.y.push_back(loss);
      if (s % 20 == 0) {
        w.add_scalar("valid/loss", 2.5 - 0.005 * s, s, 1700000000.0 + s * 0.25 + 0.125);
        valid.x.push_back(s), valid.y.push_back(2.5 - 0.005 * s);
      }
      if (s % 50 == 0) w.add_scalar("lr", 1e-4 * (s + 1), s);  // wall time: now
    }
    const double edge[] = {0.1, -1e30, 1e-30, 1e-45, 123456789.0, 1e39, kInf, -kInf, kNaN};
    for (int i = 0; i < 9; ++i) w.add_scalar("edge", edge[i], 1000 + i, 1.0 + i);
    w.add_scalar("edge", 7.0, int64_t(1) << 40, 2e9);
    w.add_scalar("edge", 8.0, std::numeric_limits<int64_t>::max(), 2e9 + 0.5);
  }
  write_line_plot((dir / "curves.png").string(), "Training loss", {train, valid}, 900, 500);
  write_line_plot((dir / "curves_log.png").string(), "Training loss (log)", {train, valid}, 700, 400, true);
}
