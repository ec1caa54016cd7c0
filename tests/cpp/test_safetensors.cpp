// Tests of the safetensors reader/writer. The SafetensorsOracle.* tests do nothing (GTEST_SKIP) unless their
// environment variables are set; tests/python/test_safetensors.py drives them to compare with the Python library.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loongforge/core/error.h"
#include "loongforge/core/fs.h"
#include "loongforge/io/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using lf::io::NamedTensors;

namespace {

using lf::test::temp_dir;
using lf::test::read_bytes;
using lf::test::write_bytes;




std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

// A safetensors file with HEADER (raw JSON) and DATA_BYTES zero bytes of data.
fs::path raw_file(const fs::path& dir, const std::string& name, const std::string& header, size_t data_bytes) {
  fs::path p = dir / name;
  write_bytes(p, le64(header.size()) + header + std::string(data_bytes, '\0'));
  return p;
}

// Same dtype, shape and bytes (NaN-safe, works for every dtype).
void expect_same(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  at::Tensor ca = a.contiguous(), cb = b.contiguous();
  size_t n = ca.numel() * ca.element_size();
  EXPECT_TRUE(n == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), n) == 0) << what;
}

// Deterministic tensor of type T: arange(numel) (mod 2 for bool), shaped.
at::Tensor sample(at::ScalarType t, at::IntArrayRef shape, double scale = 0.5) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  at::Tensor x = at::arange(n, at::kDouble);
  if (t == at::kBool) return (x.fmod(2) == 1).reshape(shape);
  if (at::isFloatingType(t)) x = x * scale - 1.0;
  return x.to(t).reshape(shape);
}

const std::vector<at::ScalarType> kAllTypes = {
    at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kLong, at::kInt,
    at::kShort,  at::kChar,  at::kByte, at::kUInt16,    at::kUInt32,         at::kUInt64,       at::kBool};

// Runs FN, expects an lf::Error whose message is one line holding every string of PARTS.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const lf::Error& e) {
    std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    return;
  }
  ADD_FAILURE() << "no lf::Error";
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

}  // namespace

TEST(Safetensors, DtypeNames) {
  for (auto t : kAllTypes) EXPECT_EQ(lf::io::scalar_type(lf::io::dtype_name(t)), t);
  EXPECT_EQ(lf::io::dtype_name(at::kBFloat16), "BF16");
  EXPECT_EQ(lf::io::dtype_name(at::kFloat8_e4m3fn), "F8_E4M3");
  EXPECT_EQ(lf::io::dtype_size("F8_E5M2"), 1u);
  expect_error([] { lf::io::scalar_type("F12"); }, {"F12"});
}

TEST(Safetensors, RoundTripEveryDtype) {
  fs::path dir = temp_dir();
  NamedTensors tensors;
  for (auto t : kAllTypes) {
    std::string d = lf::io::dtype_name(t);
    tensors.emplace_back(d + ".matrix", sample(t, {3, 5}));
    tensors.emplace_back(d + ".scalar", sample(t, {}));
    tensors.emplace_back(d + ".empty", sample(t, {0}));
    tensors.emplace_back(d + ".empty2", sample(t, {4, 0, 2}));
    tensors.emplace_back(d + ".strided", sample(t, {4, 6}).t());  // non-contiguous input
  }
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "quote \" backslash \\ newline \n é"}};
  fs::path p = dir / "all.safetensors";
  lf::io::save_file(p.string(), tensors, meta);
  auto f = lf::io::SafetensorsFile::open(p.string());
  EXPECT_EQ(f->path(), p.string());
  EXPECT_EQ(f->metadata(), meta);
  ASSERT_EQ(f->entries().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    EXPECT_EQ(f->entries()[i].name, name);  // written in the given order
    ASSERT_TRUE(f->contains(name));
    EXPECT_EQ(f->entry(name).dtype, lf::io::dtype_name(t.scalar_type()));
    EXPECT_EQ(f->entry(name).shape, t.sizes().vec());
    expect_same(f->tensor(name), t, name);
  }
  EXPECT_EQ(f->tensor("F32.scalar").dim(), 0);
  EXPECT_FALSE(f->contains("nope"));
  expect_error([&] { f->entry("nope"); }, {p.string(), "nope"});
  // Reading and writing back gives the same bytes.
  lf::io::rewrite_file(*f, (dir / "again.safetensors").string());
  EXPECT_EQ(read_bytes(dir / "again.safetensors"), read_bytes(p));
  // No temporary files left behind.
  size_t files = 0;
  for (auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 2u);
}

TEST(Safetensors, HeaderFormatMatchesPythonLibrary) {
  // Bytes written by safetensors 0.8 (Python) for these tensors, sorted as it sorts them.
  fs::path dir = temp_dir();
  NamedTensors tensors = {{"b", at::zeros({3}, at::kFloat)},          {"a", at::zeros({2}, at::kBFloat16)},
                          {"c", at::zeros({1}, at::kDouble)},         {"z", at::zeros({}, at::kBool)},
                          {"e", at::zeros({0, 3}, at::kChar)}};
  lf::io::sort_like_safetensors(tensors);
  std::vector<std::string> order;
  for (auto& nt : tensors) order.push_back(nt.first);
  EXPECT_EQ(order, (std::vector<std::string>{"c", "b", "a", "e", "z"}));
  lf::io::save_file((dir / "x.safetensors").string(), tensors, {{"format", "pt"}});
  std::string header =
      "{\"__metadata__\":{\"format\":\"pt\"},\"c\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[8,20]},"
      "\"a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[20,24]},"
      "\"e\":{\"dtype\":\"I8\",\"shape\":[0,3],\"data_offsets\":[24,24]},"
      "\"z\":{\"dtype\":\"BOOL\",\"shape\":[],\"data_offsets\":[24,25]}}";
  header.append((8 - header.size() % 8) % 8, ' ');
  EXPECT_EQ(read_bytes(dir / "x.safetensors"), le64(header.size()) + header + std::string(25, '\0'));
  // No tensors, no metadata: "{}" padded to 8.
  lf::io::save_file((dir / "empty.safetensors").string(), {});
  EXPECT_EQ(read_bytes(dir / "empty.safetensors"), le64(8) + "{}      ");
  // serde_json escaping: control characters as \u00xx, DEL and non-ASCII as they are.
  lf::io::save_file_ordered((dir / "esc.safetensors").string(), {}, lf::io::MetadataItems{{"s", "\x01\x7f\t\\/é"}});
  std::string esc = "{\"__metadata__\":{\"s\":\"\\u0001\x7f\\t\\\\/é\"}}";
  esc.append((8 - esc.size() % 8) % 8, ' ');
  EXPECT_EQ(read_bytes(dir / "esc.safetensors"), le64(esc.size()) + esc);
  auto f = lf::io::SafetensorsFile::open((dir / "esc.safetensors").string());
  EXPECT_EQ(f->metadata().at("s"), "\x01\x7f\t\\/é");
}

TEST(Safetensors, ShardedSaveAndLoad) {
  fs::path dir = temp_dir();
  NamedTensors tensors;
  for (int i = 0; i < 5; ++i)  // 100 floats = 400 bytes each
    tensors.emplace_back("layers." + std::to_string(i) + ".w", sample(at::kFloat, {10, 10}, i + 1.0));
  tensors.emplace_back("big", sample(at::kBFloat16, {1000}));  // 2000 bytes: a shard of its own
  tensors.emplace_back("tail", sample(at::kLong, {3}));
  auto files = lf::io::save_sharded(dir.string(), tensors, 1000, {{"format", "pt"}});
  // [l0 l1] [l2 l3] [big] [l4 tail]: huggingface_hub emits an oversized tensor at once, alone.
  std::vector<std::string> expected = {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                                       "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
                                       "model.safetensors.index.json"};
  EXPECT_EQ(files, expected);
  auto index = nlohmann::json::parse(read_bytes(dir / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 5 * 400 + 2000 + 24);
  EXPECT_EQ(index["weight_map"]["big"], "model-00003-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["layers.4.w"], "model-00004-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["tail"], "model-00004-of-00004.safetensors");
  EXPECT_EQ(read_bytes(dir / "model.safetensors.index.json").back(), '\n');
  EXPECT_EQ(lf::io::SafetensorsFile::open((dir / files[2]).string())->metadata().at("format"), "pt");

  for (const std::string& path : {dir.string(), (dir / "model.safetensors.index.json").string()}) {
    auto ck = lf::io::SafetensorsCheckpoint::open(path);
    std::vector<std::string> names;
    for (auto& nt : tensors) names.push_back(nt.first);
    std::sort(names.begin(), names.end());
    EXPECT_EQ(ck.names(), names);
    for (auto& [name, t] : tensors) {
      ASSERT_TRUE(ck.contains(name));
      EXPECT_EQ(ck.dtype(name), lf::io::dtype_name(t.scalar_type()));
      EXPECT_EQ(ck.shape(name), t.sizes().vec());
      expect_same(ck.tensor(name), t, name);
    }
    EXPECT_FALSE(ck.contains("nope"));
    expect_error([&] { ck.tensor("nope"); }, {path, "nope"});
  }

  // Everything fits: one model.safetensors, no index; the checkpoint opens it from the folder.
  fs::path one = dir / "one";
  EXPECT_EQ(lf::io::save_sharded(one.string(), tensors, 1 << 20), std::vector<std::string>{"model.safetensors"});
  EXPECT_FALSE(fs::exists(one / "model.safetensors.index.json"));
  auto ck = lf::io::SafetensorsCheckpoint::open(one.string());
  EXPECT_EQ(ck.names().size(), tensors.size());
  expect_same(ck.tensor("big"), tensors[5].second, "big");
  auto ck2 = lf::io::SafetensorsCheckpoint::open((one / "model.safetensors").string());
  EXPECT_EQ(ck2.names(), ck.names());
}

TEST(Safetensors, MalformedFiles) {
  fs::path dir = temp_dir();
  auto open = [](const fs::path& p) { return [p] { lf::io::SafetensorsFile::open(p.string()); }; };
  const std::string w = "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}";

  fs::path p = dir / "short.safetensors";
  write_bytes(p, "1234");
  expect_error(open(p), {p.string(), "header", "8"});
  p = dir / "huge_header.safetensors";
  write_bytes(p, le64(200'000'000) + "{}");
  expect_error(open(p), {p.string(), "header", "100 MB"});
  p = dir / "past_end.safetensors";
  write_bytes(p, le64(1000) + "{}");
  expect_error(open(p), {p.string(), "header", "end of the file"});
  expect_error(open(raw_file(dir, "bad_json.safetensors", "{\"w\":", 0)), {"bad_json.safetensors", "header", "JSON"});
  expect_error(open(raw_file(dir, "bad_utf8.safetensors", "{\"\xff\xfe\":{}}", 0)),
               {"bad_utf8.safetensors", "header", "JSON"});
  expect_error(open(raw_file(dir, "array.safetensors", "[1,2]", 0)), {"array.safetensors", "header", "object"});
  expect_error(open(raw_file(dir, "entry.safetensors", "{\"w\":3}", 0)), {"entry.safetensors", "'w'"});

  struct Case {
    std::string file, header;
    size_t data;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"no_dtype", "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, {"'w'", "dtype"}},
      {"no_shape", "{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, {"'w'", "shape"}},
      {"no_offsets", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, {"'w'", "data_offsets"}},
      {"dtype_type", "{\"w\":{\"dtype\":5,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, {"'w'", "dtype"}},
      {"shape_type", "{\"w\":{\"dtype\":\"F32\",\"shape\":\"1\",\"data_offsets\":[0,4]}}", 4, {"'w'", "shape"}},
      {"shape_float", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}}", 4, {"'w'", "shape"}},
      {"offsets_type", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, {"'w'", "data_offsets"}},
      {"offsets_str", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":\"0,4\"}}", 4, {"'w'", "data_offsets"}},
      {"offsets_neg", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, {"'w'", "data_offsets"}},
      {"offsets_reversed", "{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,0]}}", 4, {"'w'", "data_offsets"}},
      {"unknown_dtype", "{\"w\":{\"dtype\":\"F12\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, {"'w'", "F12"}},
      {"negative_dim", "{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, {"'w'", "negative"}},
      {"gap", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
              "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}", 12, {"'b'", "contiguous"}},
      {"overlap", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, {"'b'", "contiguous"}},
      {"first_not_zero", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, {"'w'", "contiguous"}},
      {"past_data", "{" + w + "}", 2, {"'w'", "past the data section"}},
      {"data_too_long", "{" + w + "}", 8, {"data section"}},
      {"size_mismatch", "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4, {"'w'", "need 8"}},
      {"size_overflow", "{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,4]}}", 4,
       {"'w'", "data_offsets"}},
      {"duplicate", "{" + w + "," + w + "}", 4, {"'w'", "duplicate"}},
      {"metadata_type", "{\"__metadata__\":{\"format\":1}," + w + "}", 4, {"__metadata__.format", "string"}},
      {"metadata_not_object", "{\"__metadata__\":[]," + w + "}", 4, {"__metadata__"}},
      {"newline_name", "{\"a\\nb\":{\"dtype\":\"F12\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, {"a\\x0ab", "F12"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.file);
    fs::path f = raw_file(dir, c.file + ".safetensors", c.header, c.data);
    auto parts = c.parts;
    parts.push_back(f.string());
    expect_error(open(f), parts);
  }
  // The valid variant of the same file opens.
  EXPECT_NO_THROW(lf::io::SafetensorsFile::open(raw_file(dir, "ok.safetensors", "{" + w + "}", 4).string()));
}

TEST(Safetensors, MalformedCheckpoints) {
  fs::path dir = temp_dir();
  lf::io::save_file((dir / "shard.safetensors").string(), {{"a", at::ones({2})}});
  auto open = [](const fs::path& p) { return [p] { lf::io::SafetensorsCheckpoint::open(p.string()); }; };
  auto index = [&](const std::string& name, const std::string& json) {
    write_bytes(dir / name, json);
    return dir / name;
  };
  fs::path p = index("no_map.safetensors.index.json", "{\"metadata\":{}}");
  expect_error(open(p), {p.string(), "weight_map"});
  p = index("map_type.safetensors.index.json", "{\"weight_map\":[]}");
  expect_error(open(p), {p.string(), "weight_map"});
  p = index("shard_type.safetensors.index.json", "{\"weight_map\":{\"a\":1}}");
  expect_error(open(p), {p.string(), "weight_map.a"});
  p = index("missing_shard.safetensors.index.json", "{\"weight_map\":{\"a\":\"nope.safetensors\"}}");
  expect_error(open(p), {p.string(), "weight_map.a", "nope.safetensors"});
  p = index("missing_tensor.safetensors.index.json",
            "{\"weight_map\":{\"a\":\"shard.safetensors\",\"b\":\"shard.safetensors\"}}");
  expect_error(open(p), {p.string(), "weight_map.b", "shard.safetensors"});
  p = index("bad.safetensors.index.json", "{\"weight_map\":");
  expect_error(open(p), {p.string(), "JSON"});
  fs::create_directories(dir / "empty");
  expect_error(open(dir / "empty"), {(dir / "empty").string(), "model.safetensors"});
  // A malformed shard names the shard.
  write_bytes(dir / "broken.safetensors", "xx");
  p = index("broken.safetensors.index.json", "{\"weight_map\":{\"a\":\"broken.safetensors\"}}");
  expect_error(open(p), {(dir / "broken.safetensors").string(), "header"});
}

TEST(Safetensors, WriterRejectsBadInput) {
  fs::path dir = temp_dir();
  std::string p = (dir / "x.safetensors").string();
  expect_error([&] { lf::io::save_file(p, {{"a", at::ones({1})}, {"a", at::ones({1})}}); }, {p, "'a'", "duplicate"});
  expect_error([&] { lf::io::save_file(p, {{"__metadata__", at::ones({1})}}); }, {p, "__metadata__"});
  expect_error([&] { lf::io::save_file(p, {{"c", at::ones({1}, at::kComplexDouble)}}); }, {p, "'c'"});
  EXPECT_FALSE(fs::exists(p));
  EXPECT_TRUE(fs::is_empty(dir));  // no temporary file left behind
}

// ---- Driven by tests/python/test_safetensors.py -----------------------------------------------------------------

// LF_ST_ROUNDTRIP_IN=file LF_ST_ROUNDTRIP_OUT=file: reads IN and writes its tensors and metadata back in file order.
// LF_ST_F64_OUT=file (optional): also writes every tensor of IN converted to F64 (to check values against Python).
TEST(SafetensorsOracle, Rewrite) {
  const char* in = env("LF_ST_ROUNDTRIP_IN");
  const char* out = env("LF_ST_ROUNDTRIP_OUT");
  if (!in || !out) GTEST_SKIP() << "LF_ST_ROUNDTRIP_IN/OUT not set";
  auto f = lf::io::SafetensorsFile::open(in);
  lf::io::rewrite_file(*f, out);
  if (const char* f64 = env("LF_ST_F64_OUT")) {
    NamedTensors converted;
    for (const auto& e : f->entries()) converted.emplace_back(e.name, f->tensor(e.name).to(at::kDouble));
    lf::io::save_file(f64, converted, f->metadata());
  }
}

// LF_ST_CHECKPOINT_IN=folder LF_ST_CHECKPOINT_OUT=file: loads the checkpoint and writes all its tensors to one file
// (sorted by name); metadata "dtypes" lists "name=DTYPE" per line, as the checkpoint reports them.
TEST(SafetensorsOracle, CheckpointDump) {
  const char* in = env("LF_ST_CHECKPOINT_IN");
  const char* out = env("LF_ST_CHECKPOINT_OUT");
  if (!in || !out) GTEST_SKIP() << "LF_ST_CHECKPOINT_IN/OUT not set";
  auto ck = lf::io::SafetensorsCheckpoint::open(in);
  NamedTensors all;
  std::string dtypes;
  for (const auto& name : ck.names()) {
    all.emplace_back(name, ck.tensor(name));
    dtypes += name + "=" + ck.dtype(name) + "\n";
  }
  lf::io::save_file(out, all, {{"dtypes", dtypes}});
}

// LF_ST_WRITE_DIR=folder: writes sample.safetensors (sample(dtype, {3, 4}) etc. for every dtype, see sample()) and
// a sharded checkpoint in folder/sharded (max 64 bytes a shard).
TEST(SafetensorsOracle, WriteSamples) {
  const char* dir = env("LF_ST_WRITE_DIR");
  if (!dir) GTEST_SKIP() << "LF_ST_WRITE_DIR not set";
  NamedTensors tensors;
  for (auto t : kAllTypes) {
    std::string d = lf::io::dtype_name(t);
    tensors.emplace_back(d + ".matrix", sample(t, {3, 4}));
    tensors.emplace_back(d + ".scalar", sample(t, {}));
    tensors.emplace_back(d + ".empty", sample(t, {2, 0}));
  }
  lf::io::save_file((fs::path(dir) / "sample.safetensors").string(), tensors, {{"format", "pt"}, {"by", "lf"}});
  NamedTensors matrices;
  for (auto& nt : tensors)
    if (nt.first.ends_with(".matrix")) matrices.push_back(nt);
  lf::io::save_sharded((fs::path(dir) / "sharded").string(), matrices, 64, {{"format", "pt"}});
}
