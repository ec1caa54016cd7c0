// data/image: decoding from bytes (PNG and JPEG encoded here with libpng / TurboJPEG), transparency modes,
// robustness on truncated and corrupted bytes, Pillow-style resizing and smart_resize. The parity with Pillow and
// transformers on real files is tests/python/test_image_processor.py.
#include <gtest/gtest.h>
#include <png.h>
#include <turbojpeg.h>
#include <zlib.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/data/image/decode.h"
#include "loongforge/data/image/processor.h"
#include "loongforge/data/image/resize.h"
#include "loongforge/io/safetensors.h"
#include "test_util.h"

using namespace lf::data::image;
using lf::test::error_of;

namespace {

// A W x H image of C channels whose samples are a function of (x, y, channel).
std::vector<uint8_t> pattern(int w, int h, int c) {
  std::vector<uint8_t> px(static_cast<size_t>(w) * h * c);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int k = 0; k < c; ++k)
        px[(static_cast<size_t>(y) * w + x) * c + k] = static_cast<uint8_t>(x * 7 + y * 13 + k * 50);
  return px;
}

std::string encode_png(const std::vector<uint8_t>& px, int w, int h, uint32_t format) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = w, img.height = h, img.format = format;
  png_alloc_size_t size = 0;
  EXPECT_TRUE(png_image_write_to_memory(&img, nullptr, &size, 0, px.data(), 0, nullptr));
  std::string out(size, '\0');
  EXPECT_TRUE(png_image_write_to_memory(&img, out.data(), &size, 0, px.data(), 0, nullptr));
  out.resize(size);
  return out;
}

std::string encode_jpeg(const std::vector<uint8_t>& px, int w, int h, bool grey) {
  tjhandle tj = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  EXPECT_EQ(tjCompress2(tj, px.data(), w, 0, h, grey ? TJPF_GRAY : TJPF_RGB, &buf, &size,
                        grey ? TJSAMP_GRAY : TJSAMP_444, 100, 0),
            0);
  std::string out(reinterpret_cast<char*>(buf), size);
  tjFree(buf);
  tjDestroy(tj);
  return out;
}

}  // namespace

TEST(ImageDecode, PngChannelsAndTransparency) {
  const int w = 13, h = 7;
  std::vector<uint8_t> rgba = pattern(w, h, 4);
  const std::string png = encode_png(rgba, w, h, PNG_FORMAT_RGBA);
  at::Tensor drop = decode_image(png, "a.png"), white = decode_image(png, "a.png", Alpha::white),
             keep = decode_image(png, "a.png", Alpha::keep);
  ASSERT_EQ(drop.sizes(), (at::IntArrayRef{h, w, 3}));
  ASSERT_EQ(keep.sizes(), (at::IntArrayRef{h, w, 4}));
  for (int i = 0; i < w * h; ++i) {
    const int a = rgba[i * 4 + 3];
    for (int k = 0; k < 3; ++k) {
      const int c = rgba[i * 4 + k];
      EXPECT_EQ(drop.data_ptr<uint8_t>()[i * 3 + k], c);
      EXPECT_EQ(keep.data_ptr<uint8_t>()[i * 4 + k], c);
      const double over = (c * a + 255.0 * (255 - a)) / 255.0;  // onto white, rounded half up
      EXPECT_EQ(white.data_ptr<uint8_t>()[i * 3 + k], static_cast<int>(std::floor(over + 0.5))) << c << " " << a;
    }
    EXPECT_EQ(keep.data_ptr<uint8_t>()[i * 4 + 3], a);
  }
  // grey: replicated; grey + alpha with Alpha::keep: RGBA
  std::vector<uint8_t> grey = pattern(w, h, 1);
  at::Tensor g = decode_image(encode_png(grey, w, h, PNG_FORMAT_GRAY), "g.png");
  for (int k = 0; k < 3; ++k) EXPECT_TRUE(at::equal(g.select(2, k), at::from_blob(grey.data(), {h, w}, at::kByte)));
  EXPECT_EQ(decode_image(encode_png(pattern(w, h, 2), w, h, PNG_FORMAT_GA), "ga.png", Alpha::keep).size(2), 4);
  // an opaque image is RGB in every mode
  EXPECT_EQ(decode_image(encode_png(pattern(w, h, 3), w, h, PNG_FORMAT_RGB), "rgb.png", Alpha::keep).size(2), 3);
}

TEST(ImageDecode, Jpeg) {
  const int w = 40, h = 24;
  std::vector<uint8_t> rgb(static_cast<size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int k = 0; k < 3; ++k) rgb[(y * w + x) * 3 + k] = static_cast<uint8_t>(x * 4 + y * 3 + k * 20);
  at::Tensor img = decode_image(encode_jpeg(rgb, w, h, false), "a.jpg");
  ASSERT_EQ(img.sizes(), (at::IntArrayRef{h, w, 3}));
  at::Tensor ref = at::from_blob(rgb.data(), {h, w, 3}, at::kByte);
  EXPECT_LE((img.to(at::kInt) - ref.to(at::kInt)).abs().max().item<int>(), 3);  // quality 100, smooth image
  at::Tensor grey = decode_image(encode_jpeg(pattern(w, h, 1), w, h, true), "g.jpg");
  EXPECT_TRUE(at::equal(grey.select(2, 0), grey.select(2, 2)));
}

TEST(ImageDecode, BadBytesAreErrorsNamingTheImage) {
  EXPECT_NE(error_of([] { decode_image(std::string_view(), "e.png"); }).find("e.png: the file is empty"),
            std::string::npos);
  EXPECT_NE(error_of([] { decode_image("GIF89a......", "x.gif"); }).find("x.gif: not a JPEG or PNG"),
            std::string::npos);
  // every truncation and a few hundred random corruptions of both formats: an lf::Error or an image, never a crash
  const std::string files[] = {encode_png(pattern(31, 17, 4), 31, 17, PNG_FORMAT_RGBA),
                               encode_jpeg(pattern(33, 19, 3), 33, 19, false)};
  std::mt19937 rng(7);
  int errors = 0;
  for (const std::string& file : files) {
    auto attempt = [&](const std::string& bytes) {
      try {
        at::Tensor t = decode_image(bytes, "fuzz");
        EXPECT_EQ(t.dim(), 3);
      } catch (const lf::Error& e) {
        ++errors;
        EXPECT_EQ(std::string(e.what()).rfind("fuzz: ", 0), 0u) << e.what();
      }
    };
    for (size_t n = 1; n < file.size(); n += 3) attempt(file.substr(0, n));
    for (int i = 0; i < 300; ++i) {
      std::string bytes = file;
      for (int k = 0; k < 1 + i % 4; ++k) bytes[rng() % bytes.size()] = static_cast<char>(rng());
      attempt(bytes);
    }
  }
  EXPECT_GT(errors, 100);
  // a header announcing more pixels than the limit (20000 x 20000), its CRC fixed: refused before any allocation
  std::string png = encode_png(pattern(4, 4, 3), 4, 4, PNG_FORMAT_RGB);
  for (int k = 0; k < 2; ++k) {
    const char dim[4] = {0, 0, static_cast<char>(20000 >> 8), static_cast<char>(20000 & 0xFF)};
    png.replace(16 + 4 * k, 4, dim, 4);
  }
  const uint32_t crc = static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(png.data() + 12), 17));
  for (int k = 0; k < 4; ++k) png[29 + k] = static_cast<char>(crc >> (24 - 8 * k));
  EXPECT_NE(error_of([&] { decode_image(png, "big.png"); }).find("big.png: 20000x20000"), std::string::npos);
}

TEST(ImageDecode, CheckAgreesWithDecode) {
  // check_image (pixels not kept) fails exactly where decode_image fails, with the same message, else gives its size:
  // on whole files, every truncation and random corruptions of both formats.
  const std::string files[] = {encode_png(pattern(31, 17, 4), 31, 17, PNG_FORMAT_RGBA),
                               encode_png(pattern(9, 5, 1), 9, 5, PNG_FORMAT_GRAY),
                               encode_jpeg(pattern(33, 19, 3), 33, 19, false),
                               encode_jpeg(pattern(20, 70, 1), 20, 70, true)};
  std::mt19937 rng(11);
  int errors = 0, images = 0;
  for (const std::string& file : files) {
    auto compare = [&](const std::string& bytes) {
      std::string decode_error, check_error;
      at::Tensor t;
      ImageDims size;
      try {
        t = decode_image(bytes, "f");
      } catch (const lf::Error& e) {
        decode_error = e.what();
      }
      try {
        size = check_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "f");
      } catch (const lf::Error& e) {
        check_error = e.what();
      }
      EXPECT_EQ(check_error, decode_error);
      if (decode_error.empty() && check_error.empty()) {
        ++images;
        EXPECT_EQ(size.height, t.size(0));
        EXPECT_EQ(size.width, t.size(1));
      } else {
        ++errors;
      }
    };
    compare(file);
    for (size_t n = 1; n < file.size(); n += 2) compare(file.substr(0, n));
    for (int i = 0; i < 200; ++i) {
      std::string bytes = file;
      for (int k = 0; k < 1 + i % 4; ++k) bytes[rng() % bytes.size()] = static_cast<char>(rng());
      compare(bytes);
    }
  }
  EXPECT_GT(errors, 100);
  EXPECT_GT(images, 4);
  EXPECT_EQ(error_of([] { check_image_file("/nonexistent/a.png"); }).rfind("/nonexistent/a.png: cannot open", 0), 0u);
}

TEST(ImageResize, PillowPaths) {
  at::Tensor flat = at::full({37, 53, 3}, 77, at::kByte);
  for (Filter f : {Filter::nearest, Filter::bilinear, Filter::bicubic, Filter::lanczos, Filter::box, Filter::hamming})
    for (auto [h, w] : {std::pair{100, 20}, {10, 200}, {37, 9}, {5, 53}}) {
      at::Tensor r = resize_pil(flat, h, w, f);
      ASSERT_EQ(r.sizes(), (at::IntArrayRef{h, w, 3}));
      EXPECT_TRUE(at::equal(r, at::full({h, w, 3}, 77, at::kByte))) << filter_name(f) << " " << h << "x" << w;
    }
  at::Tensor img = at::randint(0, 256, {20, 30, 3}, at::kByte);
  EXPECT_TRUE(at::equal(resize_pil(img, 20, 30, Filter::bicubic), img));
  EXPECT_TRUE(at::equal(resize_pil(img, 40, 60, Filter::nearest).slice(0, 0, 40, 2).slice(1, 0, 60, 2), img));
  EXPECT_NE(error_of([] { filter_from_pil(6, "cfg"); }).find("cfg: resampling filter 6"), std::string::npos);
}

// resize_opencv_area on the images of LF_TEST_AREA_IN (safetensors: image.K uint8 [H, W, 3], size.K int64 [2]) to
// LF_TEST_AREA_OUT (out.K): tests/python/test_image_resize_area.py compares them with OpenCV's cv2.resize.
TEST(ImageResize, OpenCvAreaHook) {
  const char* in = std::getenv("LF_TEST_AREA_IN");
  const char* out = std::getenv("LF_TEST_AREA_OUT");
  if (!in || !out) GTEST_SKIP() << "LF_TEST_AREA_IN / _OUT not set";
  const auto ck = lf::io::SafetensorsCheckpoint::open(in);
  lf::io::NamedTensors res;
  for (const std::string& name : ck.names()) {
    if (name.rfind("image.", 0) != 0) continue;
    const std::string k = name.substr(6);
    ASSERT_TRUE(ck.contains("size." + k)) << k;
    const at::Tensor size = ck.tensor("size." + k);
    res.emplace_back("out." + k, resize_opencv_area(ck.tensor(name), size[0].item<int64_t>(), size[1].item<int64_t>()));
  }
  ASSERT_FALSE(res.empty());
  lf::io::save_file(out, res);
}

TEST(ImageResize, OpenCvAreaShapesAndErrors) {
  const at::Tensor flat = at::full({37, 53, 3}, 77, at::kByte);
  for (auto [h, w] : {std::pair{100, 20}, {10, 200}, {37, 9}, {5, 53}, {74, 106}, {12, 13}}) {
    const at::Tensor r = resize_opencv_area(flat, h, w);
    ASSERT_EQ(r.sizes(), (at::IntArrayRef{h, w, 3}));
    EXPECT_TRUE(at::equal(r, at::full({h, w, 3}, 77, at::kByte))) << h << "x" << w;  // a flat image stays flat
  }
  EXPECT_NE(error_of([] { resize_opencv_area(at::zeros({4, 4, 3}), 2, 2); }).find("uint8"), std::string::npos);
}

TEST(ImageProcessor, SmartResizeAsTransformers) {
  // transformers' smart_resize on these sizes (factor 28 with Qwen2-VL's bounds; factor 32 with Qwen3-VL's)
  const std::vector<std::array<int64_t, 6>> cases = {
      {20, 30, 56, 84, 224, 320},        {1200, 1600, 840, 1148, 1216, 1600}, {480, 640, 476, 644, 480, 640},
      {100, 3000, 112, 2996, 96, 3008}, {28, 28, 56, 56, 256, 256},          {1001, 999, 980, 980, 992, 992}};
  for (const auto& c : cases) {
    EXPECT_EQ(smart_resize(c[0], c[1], 28, 56 * 56, 28 * 28 * 1280), (std::pair{c[2], c[3]}));
    EXPECT_EQ(smart_resize(c[0], c[1], 32, 65536, 16777216), (std::pair{c[4], c[5]}));
  }
  EXPECT_NE(error_of([] { smart_resize(10, 2010, 28, 3136, 1003520); }).find("aspect ratio"), std::string::npos);
  ImageProcessor qwen(ImageProcessorConfig::defaults("Qwen2VLImageProcessor"));
  EXPECT_EQ(qwen.patch_grid(20, 30), (std::pair<int64_t, int64_t>{4, 6}));
  ProcessedImages r = qwen.preprocess({at::zeros({20, 30, 3}, at::kByte)});
  EXPECT_EQ(r.pixel_values.sizes(), (at::IntArrayRef{24, 3 * 2 * 14 * 14}));
  EXPECT_EQ(r.image_grid_thw.sizes(), (at::IntArrayRef{1, 3}));
}
