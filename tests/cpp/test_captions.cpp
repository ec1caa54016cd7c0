// Caption files (data/captions.h) and captioned image folders (data/image_folder.h with a metadata.jsonl).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "loongforge/data/captions.h"
#include "loongforge/data/image/decode.h"
#include "loongforge/data/image_folder.h"
#include "test_util.h"

namespace fs = std::filesystem;
using lf::test::error_of;
using lf::test::temp_dir;

namespace {

void write(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

void png(const fs::path& p, int64_t seed) {
  lf::data::image::write_png(p.string(), at::full({10, 12, 3}, seed * 40, at::kByte));
}

}  // namespace

TEST(Captions, ReadsBothKeySpellings) {
  const fs::path d = temp_dir();
  write(d / "m.jsonl", "{\"file_name\": \"./a/../x.mp4\", \"text\": \"one\"}\n\n"
                       "{\"file\": \"sub/y.png\", \"caption\": \"two\", \"extra\": 3}\r\n");
  const auto e = lf::data::read_captions((d / "m.jsonl").string());
  ASSERT_EQ(e.size(), 2u);
  EXPECT_EQ(e[0].file, "x.mp4");
  EXPECT_EQ(e[0].text, "one");
  EXPECT_EQ(e[0].line, 1);
  EXPECT_EQ(e[1].file, "sub/y.png");
  EXPECT_EQ(e[1].text, "two");
  EXPECT_EQ(e[1].line, 3);
  EXPECT_EQ(e[1].file_key, "file");
}

TEST(Captions, ErrorsNameTheFileLineAndField) {
  const fs::path d = temp_dir();
  const std::string m = (d / "m.jsonl").string();
  const std::pair<std::string, std::string> cases[] = {
      {"{\"file_name\": \"a.png\", \"text\": \"x\"}\n[1, 2]\n", m + ":2: the line is not a JSON object"},
      {"{\"file_name\": \"a.png\"}\n", m + ":1: field 'text' or 'caption': missing"},
      {"{\"text\": \"x\"}\n", m + ":1: field 'file_name' or 'file': missing"},
      {"{\"file_name\": 3, \"text\": \"x\"}\n", m + ":1: field 'file_name': expected a string, got 3"},
      {"{\"file\": \"../a.png\", \"text\": \"x\"}\n", m + ":1: field 'file': '../a.png' is not a file inside"},
      {"{\"file_name\": \"a.png\", \"text\": \"x\"}\n{\"file_name\": \"./a.png\", \"text\": \"y\"}\n",
       m + ":2: field 'file_name': './a.png' is listed twice (first on line 1)"},
      {"{\"file_name\": \"a.png\", \"text\": \"x\"\n", m + ":1: invalid JSON"},
  };
  for (const auto& [text, want] : cases) {
    write(m, text);
    const std::string err = error_of([&] { lf::data::read_captions(m); });
    EXPECT_EQ(err.rfind(want, 0), 0u) << err << "\nwanted: " << want;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  }
}

TEST(ImageFolderCaptions, ClassFoldersKeepTheirLabelsAndGainCaptions) {
  const fs::path d = temp_dir();
  fs::create_directories(d / "cat");
  fs::create_directories(d / "dog");
  png(d / "cat" / "0.png", 1);
  png(d / "dog" / "0.png", 2);
  png(d / "dog" / "1.png", 3);
  write(d / "metadata.jsonl", "{\"file_name\": \"dog/1.png\", \"text\": \"dog one\"}\n"
                              "{\"file_name\": \"cat/0.png\", \"text\": \"cat zero\"}\n"
                              "{\"file_name\": \"dog/0.png\", \"caption\": \"dog zero\"}\n");
  lf::data::ImageFolderOptions o;
  o.roots = {d.string()};
  o.resolution = 8;
  o.seed = 3;
  lf::data::ImageFolderDataset ds(o);
  ASSERT_TRUE(ds.has_captions());
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.classes(), (std::vector<std::string>{"cat", "dog"}));
  EXPECT_EQ(ds.captions(), (std::vector<std::string>{"cat zero", "dog zero", "dog one"}));
  for (int64_t k = 0; k < 6; ++k) {  // the stream's caption is that of the image get(k) returns
    const auto [img, label] = ds.get(k);
    const std::string& cap = ds.caption(k);
    const int64_t value = static_cast<int64_t>(((img[0][0][0].item<float>() * 0.5 + 0.5) * 255.0) + 0.5);
    const std::string want = value == 40 ? "cat zero" : value == 80 ? "dog zero" : "dog one";
    EXPECT_EQ(cap, want) << k;
    EXPECT_EQ(label, value == 40 ? 0 : 1) << k;
  }
}

TEST(ImageFolderCaptions, FlatFolderAndErrors) {
  const fs::path d = temp_dir();
  png(d / "b.png", 1);
  png(d / "a.png", 2);
  write(d / "metadata.jsonl", "{\"file_name\": \"a.png\", \"text\": \"A\"}\n{\"file_name\": \"b.png\", \"text\": \"B\"}\n");
  lf::data::ImageFolderOptions o;
  o.roots = {d.string()};
  o.resolution = 8;
  lf::data::ImageFolderDataset ds(o);
  EXPECT_TRUE(ds.classes().empty());
  EXPECT_EQ(ds.captions(), (std::vector<std::string>{"A", "B"}));
  EXPECT_EQ(ds.files()[1].second, 0);

  png(d / "c.png", 3);  // an image without a caption
  std::string err = error_of([&] { lf::data::ImageFolderDataset{o}; });
  EXPECT_EQ(err, (d / "metadata.jsonl").string() + ": no caption for c.png (no line with \"file_name\": \"c.png\")");
  fs::remove(d / "c.png");
  write(d / "metadata.jsonl", "{\"file_name\": \"a.png\", \"text\": \"A\"}\n{\"file_name\": \"z.png\", \"text\": \"Z\"}\n");
  err = error_of([&] { lf::data::ImageFolderDataset{o}; });
  EXPECT_EQ(err.rfind((d / "metadata.jsonl").string() + ":2: field 'file_name': z.png does not exist", 0), 0u) << err;

  // without metadata.jsonl a flat folder is still an error (class folders needed), and roots must agree
  const fs::path e = temp_dir("plain");
  png(e / "a.png", 1);
  o.roots = {e.string()};
  err = error_of([&] { lf::data::ImageFolderDataset{o}; });
  EXPECT_NE(err.find("no class folders"), std::string::npos) << err;
  o.roots = {d.string(), e.string()};
  write(d / "metadata.jsonl", "{\"file_name\": \"a.png\", \"text\": \"A\"}\n{\"file_name\": \"b.png\", \"text\": \"B\"}\n");
  err = error_of([&] { lf::data::ImageFolderDataset{o}; });
  EXPECT_NE(err.find(e.string() + ": no metadata.jsonl"), std::string::npos) << err;
}
