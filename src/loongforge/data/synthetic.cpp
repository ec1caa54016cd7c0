#include "loongforge/data/synthetic.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::data {

// A character-level BPE tokenizer.json (no merges): special tokens, then one token per character.
std::string char_tokenizer_json(const std::string& chars, const std::vector<std::string>& specials) {
  nlohmann::json vocab = nlohmann::json::object();
  nlohmann::json added = nlohmann::json::array();
  int id = 0;
  for (const auto& sp : specials) {
    vocab[sp] = id;
    added.push_back({{"id", id}, {"content", sp}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
    ++id;
  }
  for (char c : chars) vocab[std::string(1, c)] = id++;
  nlohmann::json tok = {
      {"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", added},
      {"normalizer", nullptr}, {"pre_tokenizer", nullptr}, {"post_processor", nullptr},
      {"decoder", {{"type", "Fuse"}}},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                 {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
                 {"ignore_merges", false}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  return tok.dump(2) + "\n";
}

void write_synthetic_task(const std::string& task, const std::string& out_dir, int64_t docs, int digits, uint64_t seed) {
  if (task == "shapes") return write_shapes_task(out_dir, docs, seed);
  if (task == "shape_classes") return write_shape_classes_task(out_dir, docs, seed);
  if (task != "addition") throw Error("data synth: unknown task '" + task + "' (tasks: addition, shapes, shape_classes)");
  if (digits < 1 || digits > 9) throw Error("data synth: --digits must be in 1..9");
  std::filesystem::create_directories(out_dir);
  std::mt19937_64 rng(seed);
  int64_t limit = 1;
  for (int i = 0; i < digits; ++i) limit *= 10;
  std::uniform_int_distribution<int64_t> pick(0, limit - 1);
  std::ostringstream lines;
  for (int64_t i = 0; i < docs; ++i) {
    int64_t a = pick(rng), b = pick(rng);
    nlohmann::json j = {{"text", std::to_string(a) + "+" + std::to_string(b) + "=" + std::to_string(a + b)}};
    lines << j.dump() << "\n";
  }
  namespace fs = std::filesystem;
  write_file_atomic((fs::path(out_dir) / "train.jsonl").string(), lines.str());
  write_file_atomic((fs::path(out_dir) / "tokenizer.json").string(), char_tokenizer_json("0123456789+=\n ", {"<pad>", "<s>", "</s>"}));
  nlohmann::json cfg = {{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"pad_token", "<pad>"},
                        {"model_max_length", 1024}, {"tokenizer_class", "PreTrainedTokenizerFast"}};
  write_file_atomic((fs::path(out_dir) / "tokenizer_config.json").string(), cfg.dump(2) + "\n");
}

}  // namespace lf::data
