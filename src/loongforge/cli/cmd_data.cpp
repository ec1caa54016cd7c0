// loongforge data tokenize: text / JSON-lines corpora -> a token shard (PREFIX.bin + PREFIX.idx, docs/data_format.md).
// loongforge data synth: synthetic tasks. loongforge data preprocess: a model's image processor on image files.
// loongforge data frames / write-video / clips: video decoding, encoding and video folders (data/video*.h).
// loongforge data parquet: columns of a Parquet file (data/parquet.h) into a .safetensors file, or its schema.
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/image/processor.h"
#include "loongforge/data/parquet.h"
#include "loongforge/data/synthetic.h"
#include "loongforge/data/token_shards.h"
#include "loongforge/data/video.h"
#include "loongforge/data/video_folder.h"
#include "loongforge/data/tokenizer/tokenizer.h"
#include "loongforge/io/safetensors.h"

namespace lf::cli {

namespace {

namespace fs = std::filesystem;

struct DataTokenizeOptions {
  std::string tokenizer, out, field = "text", dtype = "auto", eos_token;
  std::vector<std::string> inputs;
  bool append_eos = true, no_add_special = false;
  unsigned threads = 0;
};

struct Doc {
  std::string text;
  uint64_t line = 0;  // 1-based line where the document starts
};

bool blank(const std::string& s) { return s.find_first_not_of(" \t\r\f\v") == std::string::npos; }

bool is_jsonl(const std::string& path) {
  const std::string ext = fs::path(path).extension().string();
  if (ext == ".jsonl" || ext == ".ndjson") return true;
  if (ext == ".txt" || ext == ".text" || ext == ".md") return false;
  throw Error(path + ": unsupported input type '" + ext + "' (expected .txt, .text, .md, .jsonl or .ndjson)");
}

// Reads one input file in batches of documents. Text: documents are separated by blank (whitespace-only) lines and
// are their lines joined by "\n" ("\r\n" counts as "\n"). JSON lines: one object per line, the document is its
// string field FIELD; blank lines are skipped. Empty documents are skipped.
class DocReader {
 public:
  DocReader(std::string path, std::string field) : path_(std::move(path)), field_(std::move(field)) {
    jsonl_ = is_jsonl(path_);
    in_.open(path_, std::ios::binary);
    if (!in_) throw Error(path_ + ": cannot open: " + std::strerror(errno));
  }

  // Fills BATCH with up to ~MAX_BYTES of documents; false when the file is done and BATCH is empty.
  bool next(std::vector<Doc>& batch, size_t max_bytes) {
    batch.clear();
    size_t bytes = 0;
    std::string line;
    Doc cur;
    while (bytes < max_bytes && std::getline(in_, line)) {
      ++lineno_;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (jsonl_) {
        if (blank(line)) continue;
        Doc d{parse_json_line(line), lineno_};
        bytes += d.text.size();
        if (!d.text.empty()) batch.push_back(std::move(d));
      } else if (blank(line)) {
        if (!para_.text.empty()) bytes += para_.text.size(), batch.push_back(std::move(para_)), para_ = Doc{};
      } else {
        if (para_.text.empty()) para_.line = lineno_;
        else para_.text += '\n';
        para_.text += line;
      }
    }
    if (in_.bad()) throw Error(path_ + ": read failed");
    if (in_.eof() && !para_.text.empty()) batch.push_back(std::move(para_)), para_ = Doc{};
    return !batch.empty();
  }

  std::string where(uint64_t line) const { return path_ + ":" + std::to_string(line); }

 private:
  std::string parse_json_line(const std::string& line) const {
    const std::string at = where(lineno_);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      std::string what = e.what();
      auto pos = what.find("parse error");
      throw file_error(at, field_, "invalid JSON: " + (pos == std::string::npos ? what : what.substr(pos)));
    }
    if (!j.is_object()) throw file_error(at, field_, "the line is not a JSON object");
    auto it = j.find(field_);
    if (it == j.end()) throw file_error(at, field_, "missing");
    if (!it->is_string()) throw file_error(at, field_, std::string("expected a string, got ") + it->type_name());
    return it->get<std::string>();
  }

  std::string path_, field_;
  bool jsonl_ = false;
  std::ifstream in_;
  uint64_t lineno_ = 0;
  Doc para_;
};

// The EOS id to append, or none. --eos-token wins; else tokenizer_config.json's eos_token next to the tokenizer.
std::optional<int64_t> resolve_eos(const DataTokenizeOptions& o, bool eos_flag_given, const data::Tokenizer& tok) {
  if (eos_flag_given && !o.append_eos) return std::nullopt;
  std::string token, origin;
  if (!o.eos_token.empty()) {
    token = o.eos_token, origin = "--eos-token";
  } else {
    fs::path dir = fs::is_directory(o.tokenizer) ? fs::path(o.tokenizer) : fs::path(o.tokenizer).parent_path();
    fs::path cfg_path = dir / "tokenizer_config.json";
    if (fs::exists(cfg_path)) {
      nlohmann::json cfg = read_json_file(cfg_path.string());
      auto it = cfg.find("eos_token");
      if (it != cfg.end() && !it->is_null()) {
        if (it->is_string()) token = it->get<std::string>();
        else if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
          token = (*it)["content"].get<std::string>();
        else
          throw file_error(cfg_path.string(), "eos_token", "expected a string or an object with \"content\"");
        origin = cfg_path.string() + ": field 'eos_token'";
      }
    }
  }
  if (token.empty()) {
    if (eos_flag_given)
      throw Error("data tokenize: --append-eos: the tokenizer has no eos_token in tokenizer_config.json; pass "
                  "--eos-token");
    return std::nullopt;  // run() prints a note at the end
  }
  auto id = tok.token_to_id(token);
  if (!id) throw Error(origin + ": '" + token + "' is not a token of " + o.tokenizer);
  return id;
}

void run(const DataTokenizeOptions& o, bool eos_flag_given) {
  for (const auto& in : o.inputs) DocReader(in, o.field);  // fail on a missing file or a bad type before any work
  auto tok = data::Tokenizer::load(o.tokenizer);
  const int64_t vocab = tok->vocab_size();
  data::TokenDType dtype = data::dtype_for_vocab(vocab);
  if (o.dtype == "uint32") dtype = data::TokenDType::UInt32;
  if (o.dtype == "uint16") {
    if (vocab > 65536)
      throw Error("data tokenize: --dtype uint16: the vocabulary has " + std::to_string(vocab) +
                  " tokens, more than uint16 holds");
    dtype = data::TokenDType::UInt16;
  }
  const std::optional<int64_t> eos = resolve_eos(o, eos_flag_given, *tok);
  const unsigned threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  const bool add_special = !o.no_add_special;

  const auto t0 = std::chrono::steady_clock::now();
  data::TokenShardWriter writer(o.out, dtype);
  std::vector<Doc> batch;
  std::vector<std::vector<int64_t>> ids;
  for (const auto& path : o.inputs) {
    DocReader reader(path, o.field);
    while (reader.next(batch, size_t{16} << 20)) {
      ids.assign(batch.size(), {});
      std::vector<std::exception_ptr> errors(batch.size());
      std::atomic<size_t> next_doc{0};
      auto work = [&] {
        for (size_t i; (i = next_doc.fetch_add(1)) < batch.size();) {
          try {
            ids[i] = tok->encode(batch[i].text, add_special);
            if (eos) ids[i].push_back(*eos);
          } catch (...) {
            errors[i] = std::current_exception();
          }
        }
      };
      const unsigned n = static_cast<unsigned>(std::min<size_t>(threads, batch.size()));
      std::vector<std::thread> pool;
      for (unsigned t = 1; t < n; ++t) pool.emplace_back(work);
      work();
      for (auto& th : pool) th.join();
      for (size_t i = 0; i < batch.size(); ++i) {
        if (errors[i]) {
          try {
            std::rethrow_exception(errors[i]);
          } catch (const Error& e) {
            throw Error(reader.where(batch[i].line) + ": " + e.what());
          }
        }
        writer.add_doc(ids[i]);
      }
    }
  }
  writer.finish();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("data tokenize: wrote %s.bin/.idx: %llu docs, %llu tokens (%s%s) from %zu file(s) in %.2fs, "
              "%.0f tokens/s\n",
              o.out.c_str(), static_cast<unsigned long long>(writer.num_docs()),
              static_cast<unsigned long long>(writer.num_tokens()), data::dtype_name(dtype),
              eos ? (", EOS " + std::to_string(*eos)).c_str() : ", no EOS", o.inputs.size(), secs,
              secs > 0 ? static_cast<double>(writer.num_tokens()) / secs : 0.0);
  std::fflush(stdout);
  if (!eos && !eos_flag_given)
    std::fprintf(stderr,
                 "loongforge: note: no eos_token in tokenizer_config.json: documents are stored without EOS "
                 "(pass --eos-token to add one)\n");
}

struct PreprocessOptions {
  std::string model, out, backend = "pil";
  std::vector<std::string> images;
};

std::string shape(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

void preprocess(const PreprocessOptions& o) {
  namespace img = data::image;
  const img::ImageProcessor proc = img::ImageProcessor::from_pretrained(o.model, img::backend_from_name(o.backend));
  const img::ProcessedImages r = proc.preprocess_files(o.images);
  io::NamedTensors out{{"pixel_values", r.pixel_values}};
  if (r.image_grid_thw.defined()) out.emplace_back("image_grid_thw", r.image_grid_thw);
  io::save_file(o.out, out);
  std::printf("data preprocess: wrote %s: pixel_values %s%s (%s, %s backend) from %zu image(s)\n", o.out.c_str(),
              shape(r.pixel_values).c_str(),
              r.image_grid_thw.defined() ? (", image_grid_thw " + shape(r.image_grid_thw)).c_str() : "",
              proc.config().class_name.c_str(), o.backend.c_str(), o.images.size());
}

struct FramesOptions {
  std::string video, out;
  int64_t num_frames = 0, stride = 1, start = 0;
};

void frames(const FramesOptions& o) {
  data::DecodeOptions d;
  d.num_frames = o.num_frames, d.stride = o.stride, d.start = o.start;
  const data::DecodedVideo v = data::decode_video(o.video, d);
  io::save_file(o.out, {{"frames", v.frames}, {"fps", at::tensor({v.fps}, at::kDouble)},
                        {"num_frames", at::tensor({v.num_frames}, at::kLong)}});
  std::printf("data frames: wrote %s: frames %s (uint8) of %lld, %.6g fps\n", o.out.c_str(), shape(v.frames).c_str(),
              static_cast<long long>(v.num_frames), v.fps);
}

struct WriteVideoOptions {
  std::string frames, out;
  double fps = 8;
};

void write_video(const WriteVideoOptions& o) {
  const auto file = io::SafetensorsFile::open(o.frames);
  const at::Tensor f = file->tensor("frames");
  const std::string encoder = data::encode_video(o.out, f, o.fps);
  std::printf("data write-video: wrote %s: %s frames, %g fps (%s)\n", o.out.c_str(), shape(f).c_str(), o.fps,
              encoder.c_str());
}

struct ClipsOptions {
  data::VideoFolderOptions folder;
  int64_t count = 0, resolution = 0;
  std::string out;
};

void clips(ClipsOptions o) {
  if (o.resolution > 0) o.folder.height = o.folder.width = o.resolution;
  const data::VideoFolderDataset ds(o.folder);
  const int64_t n = o.count > 0 ? o.count : ds.size();
  io::NamedTensors out;
  nlohmann::json captions = nlohmann::json::array(), items = nlohmann::json::array();
  for (int64_t k = 0; k < n; ++k) {
    data::VideoSample s = ds.get(k);
    out.emplace_back("pixels." + std::to_string(k), s.pixels);
    captions.push_back(s.caption);
    items.push_back(ds.items()[static_cast<size_t>(s.item)].path);
  }
  io::save_file(o.out, out, {{"captions", captions.dump()}, {"items", items.dump()}});
  std::printf("data clips: wrote %s: %lld clip(s) of %lld item(s)\n", o.out.c_str(), static_cast<long long>(n),
              static_cast<long long>(ds.size()));
}

struct ParquetOptions {
  std::string file, columns, rows, out;
};

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBool: return "bool";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kByte: return "uint8";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    default: return "";
  }
}

// The file's schema, row groups and key-value metadata as JSON.
nlohmann::json parquet_description(const data::ParquetFile& f) {
  nlohmann::json cols = nlohmann::json::array();
  for (const auto& c : f.columns()) {
    const char* kinds[] = {"numeric", "bytes", "image", "byte_lists", "other"};
    nlohmann::json j = {{"name", c.name}, {"type", c.type}, {"kind", kinds[static_cast<int>(c.kind)]},
                        {"nullable", c.nullable}};
    if (c.kind == data::ParquetColumnKind::numeric)
      j["dtype"] = dtype_name(c.dtype), j["shape"] = c.shape, j["row_shape"] = f.row_shape(c.name);
    cols.push_back(j);
  }
  return {{"file", f.path()}, {"num_rows", f.num_rows()}, {"row_group_starts", f.row_group_starts()},
          {"columns", cols}, {"metadata", f.metadata()}};
}

void parquet(const ParquetOptions& o) {
  const data::ParquetFile f(o.file);
  const nlohmann::json desc = parquet_description(f);
  if (o.out.empty()) {
    std::printf("%s\n", desc.dump(2).c_str());
    return;
  }
  int64_t begin = 0, end = -1;
  if (!o.rows.empty()) {
    const auto colon = o.rows.find(':');
    auto number = [&](const std::string& s, int64_t dflt) -> int64_t {
      if (s.empty()) return dflt;
      size_t used = 0;
      int64_t v = -1;
      try {
        v = std::stoll(s, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != s.size() || v < 0) throw Error("data parquet: --rows '" + o.rows + "': expected BEGIN:END");
      return v;
    };
    if (colon == std::string::npos) throw Error("data parquet: --rows '" + o.rows + "': expected BEGIN:END");
    begin = number(o.rows.substr(0, colon), 0), end = number(o.rows.substr(colon + 1), -1);
  }
  std::vector<std::string> names, skipped;
  if (o.columns.empty()) {
    for (const auto& c : f.columns())
      (c.kind == data::ParquetColumnKind::other ? skipped : names).push_back(c.name);
  } else {
    for (size_t at = 0; at <= o.columns.size();) {
      size_t comma = std::min(o.columns.find(',', at), o.columns.size());
      if (comma > at) names.push_back(o.columns.substr(at, comma - at));
      at = comma + 1;
    }
  }
  std::vector<std::string> numeric;
  for (const auto& n : names)
    if (f.column(n).kind == data::ParquetColumnKind::numeric) numeric.push_back(n);
  const std::vector<at::Tensor> tensors = f.read_tensors(numeric, begin, end);
  io::NamedTensors out;
  size_t k = 0;
  for (const auto& n : names) {
    if (f.column(n).kind == data::ParquetColumnKind::numeric) {
      out.emplace_back(n, tensors[k++]);
      continue;
    }
    // Bytes / images (or an error for another kind): the rows' bytes end to end, and where each row starts; lists
    // of strings: their strings so, and which strings each row holds.
    std::vector<std::string> rows;
    if (f.column(n).kind == data::ParquetColumnKind::byte_lists) {
      const auto lists = f.read_byte_lists(n, begin, end);
      at::Tensor row_offsets = at::zeros({static_cast<int64_t>(lists.size()) + 1}, at::kLong);
      for (size_t i = 0; i < lists.size(); ++i) {
        row_offsets[static_cast<int64_t>(i) + 1] = static_cast<int64_t>(rows.size() + lists[i].size());
        rows.insert(rows.end(), lists[i].begin(), lists[i].end());
      }
      out.emplace_back(n + ".row_offsets", row_offsets);
    } else {
      rows = f.read_bytes(n, begin, end);
    }
    at::Tensor offsets = at::empty({static_cast<int64_t>(rows.size()) + 1}, at::kLong);
    auto* off = offsets.data_ptr<int64_t>();
    off[0] = 0;
    for (size_t i = 0; i < rows.size(); ++i) off[i + 1] = off[i] + static_cast<int64_t>(rows[i].size());
    at::Tensor bytes = at::empty({off[rows.size()]}, at::kByte);
    for (size_t i = 0; i < rows.size(); ++i)
      std::memcpy(bytes.data_ptr<uint8_t>() + off[i], rows[i].data(), rows[i].size());
    out.emplace_back(n, bytes);
    out.emplace_back(n + ".offsets", offsets);
  }
  io::save_file(o.out, out, {{"parquet", desc.dump()}});
  std::printf("data parquet: wrote %s: %zu column(s) of rows [%lld, %lld) of %lld%s%s\n", o.out.c_str(), names.size(),
              static_cast<long long>(begin), static_cast<long long>(end < 0 ? f.num_rows() : end),
              static_cast<long long>(f.num_rows()), skipped.empty() ? "" : "; skipped (not readable): ",
              [&] {
                std::string s;
                for (const auto& n : skipped) s += (s.empty() ? "" : ", ") + n;
                return s;
              }().c_str());
}

}  // namespace

void add_data(CLI::App& app) {
  auto* data = app.add_subcommand("data", "Prepare training data");
  data->require_subcommand(1);
  add_data_encode(*data);
  add_data_bench_loader(*data);
  add_data_export(*data);
  add_data_stats(*data);
  auto* sub = data->add_subcommand("tokenize", "Tokenize text / JSON-lines files into a token shard (.bin + .idx)");
  auto o = std::make_shared<DataTokenizeOptions>();
  sub->add_option("--tokenizer", o->tokenizer, "A folder with tokenizer.json or tokenizer.model, or either file")
      ->required();
  sub->add_option("--input", o->inputs, "Input files: .txt/.text/.md (documents separated by blank lines) or "
                                        ".jsonl/.ndjson (one JSON object per line)")
      ->required();
  sub->add_option("--out", o->out, "Output prefix: writes PREFIX.bin and PREFIX.idx")->required();
  sub->add_option("--field", o->field, "The JSON-lines field holding the text")->capture_default_str();
  auto* eos_flag = sub->add_flag("--append-eos,!--no-append-eos", o->append_eos,
                                 "Append the EOS id to every document (default: on when an EOS token is known)");
  sub->add_option("--eos-token", o->eos_token,
                  "The EOS token's text (default: eos_token of tokenizer_config.json next to the tokenizer)");
  sub->add_option("--dtype", o->dtype, "Token id type: auto (uint16 when the vocabulary fits), uint16, uint32")
      ->check(CLI::IsMember({"auto", "uint16", "uint32"}))
      ->capture_default_str();
  sub->add_option("--threads", o->threads, "Tokenizer threads (default: all cores)");
  sub->add_flag("--no-add-special-tokens", o->no_add_special,
                "Encode without the post-processor's special tokens (e.g. no BOS)");
  sub->footer(
      "Writes PREFIX.bin/.idx atomically (temporary files renamed at the end): a failed run leaves any existing\n"
      "shard untouched. Empty documents are skipped. File layout: docs/data_format.md.\n"
      "Example:\n"
      "  loongforge data tokenize --tokenizer path/to/llama3 --input corpus/*.jsonl --out data/corpus");
  sub->callback([o, eos_flag] { run(*o, eos_flag->count() > 0); });

  struct SynthOptions {
    std::string task = "addition", out;
    int64_t docs = 20000;
    int digits = 2;
    uint64_t seed = 0;
  };
  auto so = std::make_shared<SynthOptions>();
  auto* synth = data->add_subcommand("synth", "Generate a synthetic task (train.jsonl + a character tokenizer)");
  synth->add_option("--task", so->task, "task: addition (documents 'A+B=C'), shapes (images of coloured shapes "
                                       "with questions, for the vision-language demo), shape_classes (the same "
                                       "images in colour class folders, for the diffusion demo)")->capture_default_str();
  synth->add_option("--out", so->out, "output folder")->required();
  synth->add_option("--docs", so->docs, "number of documents")->capture_default_str()->check(CLI::PositiveNumber);
  synth->add_option("--digits", so->digits, "digits of each operand")->capture_default_str();
  synth->add_option("--seed", so->seed, "random seed")->capture_default_str();
  synth->callback([so] {
    data::write_synthetic_task(so->task, so->out, so->docs, so->digits, so->seed);
    if (so->task == "shape_classes") {
      std::printf("data synth: wrote %lld images in %s/<colour>/\n", static_cast<long long>(so->docs), so->out.c_str());
      return;
    }
    const char* what = so->task == "shapes" ? "train.json, images/, test.tsv" : "train.jsonl";
    std::printf("data synth: wrote %s/%s (%lld documents) and %s/tokenizer.json\n", so->out.c_str(), what,
                static_cast<long long>(so->docs), so->out.c_str());
  });

  auto po = std::make_shared<PreprocessOptions>();
  auto* pre = data->add_subcommand(
      "preprocess", "Run a model's image processor (its preprocessor_config.json) on images, as transformers does");
  pre->add_option("--model", po->model, "Model folder with preprocessor_config.json (a VLM or vision encoder)")
      ->required();
  pre->add_option("--image", po->images, "JPEG or PNG file; repeat for several (processed in order)")->required();
  pre->add_option("--out", po->out, "Output .safetensors")->required();
  pre->add_option("--backend", po->backend,
                  "Which transformers backend to reproduce: pil (what transformers uses without torchvision) or "
                  "torchvision")
      ->check(CLI::IsMember({"pil", "torchvision"}))
      ->capture_default_str();
  pre->footer(
      "Writes pixel_values (float32; CLIP / SigLIP: [N, 3, H, W]; Qwen2-VL / Qwen2.5-VL / Qwen3-VL: flattened\n"
      "patches [sum of patches, C * T * P * P]) and, for the Qwen processors, image_grid_thw (int64 [N, 3]).\n"
      "Example:\n"
      "  loongforge data preprocess --model path/to/Qwen2.5-VL-3B --image a.jpg --image b.png --out px.safetensors");
  pre->callback([po] { preprocess(*po); });

  auto fo = std::make_shared<FramesOptions>();
  auto* fr = data->add_subcommand("frames", "Decode a video's frames (RGB) into a .safetensors file");
  fr->add_option("--video", fo->video, "Video file (anything FFmpeg reads: MP4, MKV, WebM, ...)")->required();
  fr->add_option("--out", fo->out, "Output .safetensors")->required();
  fr->add_option("--num-frames", fo->num_frames, "Frames to take (0: all)")->capture_default_str();
  fr->add_option("--stride", fo->stride, "Take every STRIDE-th frame")->capture_default_str();
  fr->add_option("--start", fo->start, "The first frame taken")->capture_default_str();
  fr->footer("Writes frames (uint8 [F, H, W, 3]), fps (float64 [1]) and num_frames (int64 [1]: the clip's count).");
  fr->callback([fo] { frames(*fo); });

  auto wo = std::make_shared<WriteVideoOptions>();
  auto* wv = data->add_subcommand("write-video", "Write frames (uint8 [F, H, W, 3] from a .safetensors) as an MP4");
  wv->add_option("--frames", wo->frames, ".safetensors with a tensor `frames` (as `data frames` writes)")->required();
  wv->add_option("--fps", wo->fps, "Frames per second")->capture_default_str();
  wv->add_option("--out", wo->out, "Output .mp4 (H.264 when FFmpeg has libx264, else MPEG-4 part 2)")->required();
  wv->callback([wo] { write_video(*wo); });

  auto co = std::make_shared<ClipsOptions>();
  auto* cl = data->add_subcommand("clips", "Read a captioned video folder as training does (a check and preview)");
  cl->add_option("--folder", co->folder.roots, "Folder of videos (and images) with metadata.jsonl; repeatable")
      ->required();
  cl->add_option("--out", co->out, "Output .safetensors")->required();
  cl->add_option("--num-frames", co->folder.num_frames, "Frames per clip")->capture_default_str();
  cl->add_option("--stride", co->folder.stride, "Take every STRIDE-th frame")->capture_default_str();
  cl->add_option("--resolution", co->resolution, "Square size (sets --height and --width)");
  cl->add_option("--height", co->folder.height, "Frame height")->capture_default_str();
  cl->add_option("--width", co->folder.width, "Frame width")->capture_default_str();
  cl->add_flag("--random-start", co->folder.random_start, "Start each clip at a drawn frame");
  cl->add_flag("--random-flip", co->folder.random_flip, "Flip clips left-right when drawn so");
  cl->add_flag("!--no-images", co->folder.images, "Leave the folder's images out");
  cl->add_option("--seed", co->folder.seed, "Seed of the order, starts and flips")->capture_default_str();
  cl->add_option("--count", co->count, "Stream samples to write (default: one epoch)");
  cl->footer("Writes pixels.K (float32 [3, F, H, W] in [-1, 1]) for stream index K, and the metadata captions and\n"
             "items (JSON lists: caption and file of each K).");
  cl->callback([co] { clips(*co); });

  auto pq = std::make_shared<ParquetOptions>();
  auto* pqc = data->add_subcommand("parquet", "Read columns of a Parquet file (Apache Arrow) into a .safetensors file");
  pqc->add_option("--file", pq->file, "Parquet file")->required();
  pqc->add_option("--columns", pq->columns, "Comma-separated column names (default: every numeric / bytes column)");
  pqc->add_option("--rows", pq->rows, "Row range BEGIN:END (either may be empty: 0 / the last row)");
  pqc->add_option("--out", pq->out, "Output .safetensors (without it: print the schema as JSON)");
  pqc->footer(
      "Numeric columns (and lists of numbers) go under their names as [rows, list sizes...]; binary / string /\n"
      "image {bytes, path} columns as NAME (uint8: the rows' bytes end to end) and NAME.offsets (int64 [rows + 1]);\n"
      "lists of strings as NAME / NAME.offsets over their strings and NAME.row_offsets (int64 [rows + 1]).\n"
      "The metadata key \"parquet\" holds the schema, row groups and the file's key-value metadata (JSON).");
  pqc->callback([pq] { parquet(*pq); });
}

}  // namespace lf::cli
