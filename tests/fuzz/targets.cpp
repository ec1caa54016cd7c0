// The fuzz targets (targets.h says what they check). Each one feeds the bytes to a parser the way a user's file
// reaches it; lf::Error is the expected answer to a malformed input and is swallowed; anything else escapes.
#include "targets.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string_view>

#include "loongforge/core/error.h"
#include "loongforge/core/fs.h"
#include "loongforge/core/json.h"
#include "loongforge/data/chat_template.h"
#include "loongforge/data/image/decode.h"
#include "loongforge/data/parquet.h"
#include "loongforge/data/robot/dataset.h"
#include "loongforge/data/sft_dataset.h"
#include "loongforge/data/token_shards.h"
#include "loongforge/data/tokenizer/tokenizer.h"
#include "loongforge/data/video.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/models/registry.h"
#include "loongforge/parallel/moe_plan.h"
#include "loongforge/serve/protocol.h"
#include "loongforge/train/recipe.h"

#ifndef LF_SOURCE_DIR
#error "LF_SOURCE_DIR must name the source tree (the fixture tokenizer lives there)"
#endif

namespace lf::fuzz {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string_view as_text(const uint8_t* d, size_t n) { return {reinterpret_cast<const char*>(d), n}; }

void write(const std::string& path, std::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("fuzz harness: cannot write " + path);
}

std::string path_in_scratch(const std::string& name) { return scratch_dir() + "/" + name; }

// Splits "A\0B" at the first NUL: (A, B); no NUL: (all, "").
std::pair<std::string_view, std::string_view> split_nul(std::string_view s) {
  auto k = s.find('\0');
  if (k == std::string_view::npos) return {s, {}};
  return {s.substr(0, k), s.substr(k + 1)};
}

// Splits S into PARTS files: each but the last after a 4-byte little-endian length (clamped to what is left), the last
// the rest. Files that hold NUL bytes (Parquet, HDF5, a token shard's .bin) cannot be NUL-separated. Empty when S ends
// before a length.
std::vector<std::string_view> split_lengths(std::string_view s, size_t parts) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i + 1 < parts; ++i) {
    if (s.size() < 4) return {};
    const auto* b = reinterpret_cast<const uint8_t*>(s.data());
    size_t len = uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
    s.remove_prefix(4);
    len = std::min(len, s.size());
    out.push_back(s.substr(0, len));
    s.remove_prefix(len);
  }
  out.push_back(s);
  return out;
}

const data::Tokenizer& fixture_tokenizer() {
  static std::unique_ptr<data::Tokenizer> tok =
      data::Tokenizer::load(std::string(LF_SOURCE_DIR) + "/tests/fixtures/tok_bytelevel_gpt2");
  return *tok;
}

// ---- io ------------------------------------------------------------------------------------------------------------

// A .safetensors file: header length, JSON header, offsets, then every tensor copied out.
void safetensors_file(const uint8_t* d, size_t n) {
  std::string p = path_in_scratch("x.safetensors");
  write(p, as_text(d, n));
  auto f = io::SafetensorsFile::open(p);
  for (const auto& e : f->entries()) {
    at::Tensor t = f->tensor(e.name);
    if (t.numel() > 0 && static_cast<size_t>(t.nbytes()) != e.end - e.begin)
      throw std::logic_error("tensor " + e.name + " holds " + std::to_string(t.nbytes()) + " bytes, its offsets " +
                             std::to_string(e.end - e.begin));
  }
}

// A sharded checkpoint's model.safetensors.index.json next to two valid shards (a.safetensors, b.safetensors).
void safetensors_index(const uint8_t* d, size_t n) {
  std::string dir = path_in_scratch("sharded");
  static std::once_flag once;
  std::call_once(once, [&] {
    fs::create_directories(dir);
    io::save_file(dir + "/a.safetensors", {{"w", at::ones({2, 3})}});
    io::save_file(dir + "/b.safetensors", {{"v", at::zeros({4}, at::kInt)}});
  });
  write(dir + "/model.safetensors.index.json", as_text(d, n));
  auto c = io::SafetensorsCheckpoint::open(dir);
  for (const auto& name : c.names()) (void)c.tensor(name);
}

// ---- models: config.json of every family ---------------------------------------------------------------------------

// config.json: the family it names (or every family, by `family`) describes itself from it (shapes, parameter
// counts), which reads and checks every field; no weights are allocated.
void model_config(const uint8_t* d, size_t n) {
  std::string p = path_in_scratch("config.json");
  write(p, as_text(d, n));
  json config = read_json_file(p);
  if (!config.is_object()) return;  // the registry's callers check this first (an lf::Error there)
  try {
    const auto& fam = models::family_for(config, p);
    (void)fam.describe(config, p).dump();
  } catch (const Error&) {
  }
  for (const auto& fam : models::families()) {
    try {
      (void)fam.describe(config, p).dump();
    } catch (const Error&) {
    }
  }
}

// ---- tokenizers ----------------------------------------------------------------------------------------------------

const char* const kProbeTexts[] = {"Hello world", "  two  spaces\n\nand lines", "<|im_start|>user\nhi<|im_end|>",
                                    "ünïcödé 漢字 🙂", ""};

void exercise(const data::Tokenizer& tok) {
  for (const char* text : kProbeTexts) {
    auto ids = tok.encode(text, true);
    for (int64_t id : ids)
      if (id < 0 || id >= tok.vocab_size())
        throw std::logic_error("encode gave id " + std::to_string(id) + " outside the vocabulary");
    (void)tok.decode(ids, true);
    (void)tok.decode(ids, false);
  }
  for (int64_t id = 0; id < std::min<int64_t>(tok.vocab_size(), 64); ++id) (void)tok.id_to_token(id);
}

// tokenizer.json: the whole model (BPE, WordPiece, ...), normalizers, pre-tokenizers (regex patterns), decoders and
// added tokens, then encode / decode of a few texts.
void tokenizer_json(const uint8_t* d, size_t n) {
  std::string dir = path_in_scratch("tok_json");
  fs::create_directories(dir);
  write(dir + "/tokenizer.json", as_text(d, n));
  exercise(*data::Tokenizer::load(dir + "/tokenizer.json"));
}

// A sentencepiece model file (tokenizer.model) through our loader, then encode / decode.
void sentencepiece_model(const uint8_t* d, size_t n) {
  std::string dir = path_in_scratch("tok_sp");
  fs::create_directories(dir);
  write(dir + "/tokenizer.model", as_text(d, n));
  exercise(*data::Tokenizer::load(dir + "/tokenizer.model"));
}

// Text through the byte-level BPE tokenizer of tests/fixtures: valid UTF-8 must round-trip exactly through
// encode / decode (without special-token skipping); ids after a NUL decode without crashing.
void bpe_text(const uint8_t* d, size_t n) {
  const auto& tok = fixture_tokenizer();
  auto [text, rest] = split_nul(as_text(d, n));
  try {
    auto ids = tok.encode(text, false);
    std::string back = tok.decode(ids, false);
    if (back != text) throw std::logic_error("decode(encode(text)) differs from text");
  } catch (const Error&) {
  }
  std::vector<int64_t> ids;
  for (size_t i = 0; i + 2 <= rest.size(); i += 2)
    ids.push_back(static_cast<int64_t>(static_cast<uint8_t>(rest[i]) | (static_cast<uint8_t>(rest[i + 1]) << 8)) - 100);
  try {
    (void)tok.decode(ids, true);
  } catch (const Error&) {
  }
}

// ---- recipes -------------------------------------------------------------------------------------------------------

// A recipe: YAML, then after a NUL one `--set key=value` per line.
void recipe(const uint8_t* d, size_t n) {
  auto [yaml, sets] = split_nul(as_text(d, n));
  std::string p = path_in_scratch("recipe.yaml");
  write(p, yaml);
  std::vector<std::string> overrides;
  size_t at = 0;
  while (at < sets.size()) {
    size_t e = sets.find('\n', at);
    if (e == std::string_view::npos) e = sets.size();
    if (e > at) overrides.emplace_back(sets.substr(at, e - at));
    at = e + 1;
  }
  json r = train::load_recipe(p, overrides);
  (void)train::recipe_to_yaml(r);
}

// ---- token shards --------------------------------------------------------------------------------------------------

// A shard: 4 bytes little-endian L, then L bytes of the .idx file, then the .bin file. Every document is read.
void token_shard(const uint8_t* d, size_t n) {
  auto parts = split_lengths(as_text(d, n), 2);
  if (parts.empty()) return;
  std::string prefix = path_in_scratch("shard");
  write(prefix + ".idx", parts[0]);
  write(prefix + ".bin", parts[1]);
  data::TokenShard s(prefix);
  uint64_t total = 0;
  for (uint64_t i = 0; i < s.num_docs() && i < 100000; ++i) total += s.doc(i).size();
  if (s.num_docs() <= 100000 && total != s.num_tokens())
    throw std::logic_error("documents hold " + std::to_string(total) + " tokens, the header says " +
                           std::to_string(s.num_tokens()));
  (void)s.tokens(0, std::min<uint64_t>(s.num_tokens(), 16));
}

// ---- SFT data and chat templates -----------------------------------------------------------------------------------

// SFT data: the first byte picks .jsonl / .json (LLaVA list) and skip_bad; the rest is the file. Rendered with the
// ChatML template and the fixture tokenizer, packed into 64-token samples.
void sft_data(const uint8_t* d, size_t n) {
  if (n < 1) return;
  bool list = d[0] & 1, skip_bad = d[0] & 2, packing = !(d[0] & 4);
  std::string p = path_in_scratch(list ? "sft.json" : "sft.jsonl");
  write(p, as_text(d + 1, n - 1));
  data::SftOptions o;
  o.files = {p};
  o.chat_template = data::ChatTemplate::builtin("chatml");
  o.eos_token = "<|im_end|>";
  o.seq_len = 64;
  o.skip_bad = skip_bad;
  o.packing = packing;
  data::SftDataset ds(o, fixture_tokenizer());
  for (int i = 0; i < 3 && ds.num_conversations() > 0; ++i) {
    auto s = ds.next();
    if (s.input_ids.size() != 64 || s.labels.size() != 64) throw std::logic_error("a sample is not seq_len long");
  }
}

// A chat template (the untrusted program), then after a NUL the JSON context it renders (default: a short chat).
void chat_template(const uint8_t* d, size_t n) {
  auto [source, context] = split_nul(as_text(d, n));
  data::ChatTemplate t{std::string(source), "fuzz.jinja"};
  nlohmann::ordered_json ctx;
  if (!context.empty()) {
    ctx = nlohmann::ordered_json::parse(context, nullptr, false);
    if (ctx.is_discarded() || !ctx.is_object()) return;  // callers hand the template JSON objects only
  } else {
    ctx = nlohmann::ordered_json::parse(
        R"({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},)"
        R"( {"role": "assistant", "content": "hello"}], "add_generation_prompt": true, "bos_token": "<s>",)"
        R"( "eos_token": "</s>", "tools": null})");
  }
  (void)t.render_ordered(ctx);
}

// ---- MoE plan input ------------------------------------------------------------------------------------------------

// `loongforge moe-plan`'s input file: parsed, validated, planned both ways.
void moe_plan(const uint8_t* d, size_t n) {
  std::string p = path_in_scratch("loads.json");
  write(p, as_text(d, n));
  json j = read_json_file(p);
  auto in = parallel::moe::parse_plan_input(j, p);
  parallel::moe::validate(in, p);
  (void)parallel::moe::run_plans(in, true, true).dump();
}

// ---- images, Parquet, video ----------------------------------------------------------------------------------------

// PNG / JPEG bytes (an image file or an image inside a Parquet column): checked, then decoded.
void image(const uint8_t* d, size_t n) {
  try {
    auto dims = data::image::check_image(d, n, "fuzz.img");
    (void)dims;
  } catch (const Error&) {
  }
  at::Tensor t = data::image::decode_image(d, n, "fuzz.img");
  if (t.dim() != 3 || t.size(2) != 3) throw std::logic_error("a decoded image is not [H, W, 3]");
}

// A depth image (LeRobot's TIFF: one channel of uint16 / float32): decoded through libtiff.
void depth_tiff(const uint8_t* d, size_t n) {
  at::Tensor t = data::image::decode_depth_image(d, n, "fuzz.tiff");
  if (t.dim() != 3 || t.size(2) != 1 || t.scalar_type() != at::kFloat)
    throw std::logic_error("a decoded depth image is not float32 [H, W, 1]");
}

// A Parquet file: footer, schema, then every readable column in full.
void parquet(const uint8_t* d, size_t n) {
  if (!data::parquet_available()) return;
  std::string p = path_in_scratch("x.parquet");
  write(p, as_text(d, n));
  data::ParquetFile f(p);
  for (const auto& c : f.columns()) {
    try {
      switch (c.kind) {
        case data::ParquetColumnKind::numeric: (void)f.read_tensor(c.name); break;
        case data::ParquetColumnKind::bytes:
        case data::ParquetColumnKind::image: (void)f.read_bytes(c.name); break;
        case data::ParquetColumnKind::byte_lists: (void)f.read_byte_lists(c.name); break;
        case data::ParquetColumnKind::other: break;
      }
    } catch (const Error&) {
    }
  }
}

// An MP4 file: probed, then its first frames decoded.
void video(const uint8_t* d, size_t n) {
  if (!data::video_available()) return;
  std::string p = path_in_scratch("x.mp4");
  write(p, as_text(d, n));
  auto info = data::probe_video(p);
  (void)info;
  data::DecodeOptions o;
  o.num_frames = 2;
  auto v = data::decode_video(p, o);
  if (v.frames.dim() != 4) throw std::logic_error("decoded frames are not [F, H, W, 3]");
}

// ---- robot datasets ------------------------------------------------------------------------------------------------

// Elements a robot target reads at most per feature and episode: a hostile file may declare any length; what it
// declares is checked, only the reading is bounded (as token_shard bounds its document count).
constexpr int64_t kRobotReadBudget = int64_t{1} << 22;

// Elements of SHAPE, or kRobotReadBudget + 1 when that is more (or a dimension is negative).
int64_t bounded_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t v : shape) {
    if (v < 0 || (v > 0 && n > kRobotReadBudget / v)) return kRobotReadBudget + 1;
    n *= v;
  }
  return n;
}

std::string shape_str(c10::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// What the robot targets check of an opened dataset: no negative dimension or length; every numeric feature of every
// episode read whole and its second half, shaped [frames, the feature's shape...]; every frame of every image camera
// read as uint8 [frames, H, W, C] (EXACT_CAMERAS: the camera's declared [H, W, C]). Video cameras are left out: their
// mp4 files are not in the input (the video target fuzzes the decoder).
void check_robot_dataset(const data::robot::RobotDataset& ds, bool exact_cameras) {
  using data::robot::FeatureKind;
  for (const auto& f : ds.features())
    for (int64_t v : f.shape)
      if (v < 0) throw std::logic_error("feature " + f.name + " declares the shape " + shape_str(f.shape));
  const auto& eps = ds.episodes();
  for (int64_t e = 0; e < static_cast<int64_t>(eps.size()); ++e) {
    const int64_t len = eps[e].length;
    const std::string ep = "episode " + std::to_string(eps[e].index);
    if (len < 0) throw std::logic_error(ep + " has the length " + std::to_string(len));
    for (const auto& f : ds.features()) {
      if (f.kind != FeatureKind::numeric && f.kind != FeatureKind::image) continue;
      std::vector<int64_t> want{len};
      want.insert(want.end(), f.shape.begin(), f.shape.end());
      if (bounded_numel(want) > kRobotReadBudget) continue;
      if (f.kind == FeatureKind::numeric) {
        for (int64_t begin : {int64_t{0}, len / 2}) {
          auto got = ds.read_numeric({f.name}, e, begin, len);
          want[0] = len - begin;
          if (got.size() != 1 || got[0].sizes().vec() != want)
            throw std::logic_error(ep + ": " + f.name + " reads as " + (got.size() == 1 ? shape_str(got[0].sizes()) : "?") +
                                   ", the dataset declares " + shape_str(want));
        }
      } else {
        std::vector<int64_t> frames(static_cast<size_t>(len));
        for (int64_t i = 0; i < len; ++i) frames[i] = i;
        at::Tensor t = ds.read_camera(f.name, e, frames);
        if (t.dim() != 4 || t.size(0) != len || t.scalar_type() != at::kByte ||
            (exact_cameras && t.sizes().vec() != want))
          throw std::logic_error(ep + ": camera " + f.name + " reads as " + shape_str(t.sizes()) + " " +
                                 std::string(c10::toString(t.scalar_type())) + ", the dataset declares uint8 " +
                                 shape_str(want));
      }
    }
  }
}

// Whether P (lexically normal) is BASE or below it.
bool lexically_under(const fs::path& p, const fs::path& base) {
  const fs::path rel = p.lexically_relative(base);
  return !rel.empty() && *rel.begin() != "..";
}

// A LeRobot path template with every placeholder 0 ({name:0Nd}: N zeros): the file of episode 0 in chunk 0 (v2.1),
// of file 0 in chunk 0 (v3.0).
std::string template_zero(const std::string& tmpl) {
  std::string out;
  for (size_t i = 0; i < tmpl.size(); ++i) {
    const size_t close = tmpl[i] == '{' ? tmpl.find('}', i) : std::string::npos;
    if (close == std::string::npos) {
      out += tmpl[i];
      continue;
    }
    const std::string spec = tmpl.substr(i + 1, close - i - 1);
    const size_t colon = spec.find(":0");
    const size_t width = colon == std::string::npos ? 1 : std::strtoul(spec.c_str() + colon + 2, nullptr, 10);
    out.append(std::clamp<size_t>(width, 1, 32), '0');
    i = close;
  }
  return out;
}

// A LeRobot dataset folder: five files framed as split_lengths' (four lengths, then the last file): meta/info.json,
// three metadata files as its codebase_version has them — v3.0: meta/episodes/chunk-000/file-000.parquet,
// meta/tasks.parquet, meta/stats.json; else (v2.1): meta/episodes.jsonl, meta/tasks.jsonl,
// meta/episodes_stats.jsonl — and the data Parquet file where info.json's data_path puts episode 0 (v2.1) / file 0
// (v3.0). Opened with open_lerobot_dataset, then check_robot_dataset. A data_path that leads outside the dataset
// folder (but not outside this target's scratch folder) gets its file written there too: a reader that opens episodes
// from it is a finding.
void lerobot(const uint8_t* d, size_t n) {
  if (!data::parquet_available()) return;
  const auto parts = split_lengths(as_text(d, n), 5);
  if (parts.empty()) return;
  const fs::path box = path_in_scratch("lerobot"), root = box / "dataset";
  remove_tree(box.string());
  fs::create_directories(root / "meta");
  write((root / "meta" / "info.json").string(), parts[0]);
  const json info = json::parse(std::string(parts[0]), nullptr, false);
  auto text = [&](const char* key) {
    auto it = info.is_object() ? info.find(key) : info.end();
    return it != info.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  const bool v3 = text("codebase_version") == "v3.0";
  const char* const meta[2][3] = {
      {"meta/episodes.jsonl", "meta/tasks.jsonl", "meta/episodes_stats.jsonl"},
      {"meta/episodes/chunk-000/file-000.parquet", "meta/tasks.parquet", "meta/stats.json"}};
  for (int i = 0; i < 3; ++i) {
    const fs::path p = root / meta[v3][i];
    fs::create_directories(p.parent_path());
    write(p.string(), parts[1 + i]);
  }
  const fs::path data = (root / template_zero(text("data_path"))).lexically_normal();
  if (lexically_under(data, box)) {  // else not ours to write; where a path fails (a folder, say), no data file
    std::error_code ec;
    fs::create_directories(data.parent_path(), ec);
    std::ofstream(data, std::ios::binary | std::ios::trunc)
        .write(parts[4].data(), static_cast<std::streamsize>(parts[4].size()));
  }
  auto ds = data::robot::open_lerobot_dataset(root.string());
  if (!lexically_under(data, root) && !ds->episodes().empty())
    throw std::logic_error("the dataset opened its episodes from " + data.string() + ", outside its folder");
  check_robot_dataset(*ds, false);
}

// One HDF5 file in ALOHA's or robomimic's layout: opened with open_hdf5_dataset (its features are the file's datasets), then
// check_robot_dataset with every camera's frames exactly the camera's [H, W, C].
void hdf5_episode(const uint8_t* d, size_t n) {
  if (!data::robot::hdf5_available()) return;
  std::string p = path_in_scratch("episode_0.hdf5");
  write(p, as_text(d, n));
  check_robot_dataset(*data::robot::open_hdf5_dataset(p), true);
}

// A policy server request (openpi's msgpack_numpy message, serve/protocol.h) as it arrives from the network: every
// observation decoded is a defined CPU tensor. (A build without msgpack-cxx answers every input with lf::Error.)
void serve_request(const uint8_t* d, size_t n) {
  const serve::Request r = serve::decode_request(reinterpret_cast<const char*>(d), n);
  for (const auto& [name, t] : r.observation)
    if (!t.defined() || !t.device().is_cpu())
      throw std::logic_error("serve_request: observation '" + name + "' is not a defined CPU tensor");
}

}  // namespace

const std::string& scratch_dir() {
  static std::string dir = [] {
    const char* t = std::getenv("TMPDIR");
    std::string base = (t && *t) ? t : "/tmp";
    std::string d = base + "/lf-fuzz-" + std::to_string(::getpid());
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

const std::vector<Target>& targets() {
  static const std::vector<Target> all = {
      {"safetensors", "safetensors file: header, dtypes, shapes, offsets", safetensors_file},
      {"safetensors_index", "sharded checkpoint index (model.safetensors.index.json)", safetensors_index},
      {"model_config", "config.json of every model family (describe)", model_config},
      {"tokenizer_json", "tokenizer.json (models, normalizers, pre-tokenizers, decoders)", tokenizer_json},
      {"sentencepiece", "sentencepiece model file through Tokenizer::load", sentencepiece_model},
      {"bpe_text", "byte-level BPE encode / decode round trip", bpe_text},
      {"recipe", "YAML recipe and --set overrides", recipe},
      {"token_shard", "token shard .idx / .bin", token_shard},
      {"sft_data", "SFT jsonl / json conversations (rendered and packed)", sft_data},
      {"chat_template", "chat template source and render context", chat_template},
      {"moe_plan", "MoE plan input (loads.json)", moe_plan},
      {"image", "PNG / JPEG decoding", image},
      {"depth_tiff", "TIFF depth images (libtiff, our reads)", depth_tiff},
      {"parquet", "Parquet file (Arrow C++ reader, our column reads)", parquet},
      {"video", "MP4 probe and decode (FFmpeg)", video},
      {"lerobot", "LeRobot v2.1 / v3.0 dataset folder (info.json, metadata, data Parquet)", lerobot},
      {"hdf5_episode", "HDF5 episode file, ALOHA / robomimic layout (libhdf5, our reads)", hdf5_episode},
      {"serve_request", "policy server request (openpi's msgpack_numpy messages)", serve_request},
  };
  return all;
}

const Target* find_target(const std::string& name) {
  for (const auto& t : targets())
    if (name == t.name) return &t;
  return nullptr;
}

bool run_checked(const Target& target, const uint8_t* data, size_t size, std::string* why) {
  try {
    target.run(data, size);
  } catch (const Error&) {
    // the expected answer to a malformed input
  } catch (const std::exception& e) {
    if (why) *why = std::string("escaped ") + typeid(e).name() + ": " + e.what();
    return false;
  } catch (...) {
    if (why) *why = "escaped a non-std exception";
    return false;
  }
  return true;
}

}  // namespace lf::fuzz
