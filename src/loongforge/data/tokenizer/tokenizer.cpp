#include "loongforge/data/tokenizer/tokenizer.h"

#include <nlohmann/json.hpp>

#include <filesystem>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/tokenizer/loaders.h"

namespace lf::data {

namespace {
namespace fs = std::filesystem;

// The sentencepiece model of a folder: tokenizer.model, or spiece.model (T5's name); empty when none.
fs::path sentencepiece_file(const fs::path& dir) {
  std::error_code ec;
  for (const char* f : {"tokenizer.model", "spiece.model"})
    if (fs::exists(dir / f, ec)) return dir / f;
  return {};
}

// The special tokens a TemplateProcessing post-processor puts before and after a single sequence's ids (T5: none
// before, </s> after); `file` and `field` name the post-processor in errors.
void template_ids(const nlohmann::json& post, const std::string& file, std::vector<int64_t>& prefix,
                  std::vector<int64_t>& suffix) {
  if (post.is_null()) return;
  JsonReader r(post, file, "post_processor");
  const std::string type = r.string("type");
  if (type != "TemplateProcessing")
    r.fail("type", "'" + type + "' is not supported with a Unigram model (TemplateProcessing is)");
  const nlohmann::json& specials = r.required("special_tokens");
  const nlohmann::json& single = r.required("single");
  if (!single.is_array()) r.fail("single", "expected an array");
  bool after = false;
  for (const auto& item : single) {
    if (item.is_object() && item.contains("Sequence")) {
      after = true;
      continue;
    }
    if (!item.is_object() || !item.contains("SpecialToken") || !item["SpecialToken"].contains("id"))
      r.fail("single", "expected Sequence or SpecialToken items");
    const std::string name = item["SpecialToken"]["id"].get<std::string>();
    if (!specials.is_object() || !specials.contains(name) || !specials[name].contains("ids"))
      r.fail("special_tokens", "no ids for '" + name + "'");
    for (const auto& id : specials[name]["ids"]) (after ? suffix : prefix).push_back(id.get<int64_t>());
  }
}

// tokenizer.json. A Unigram model (T5's, converted from sentencepiece) is run by libsentencepiece on the folder's
// sentencepiece model, with the special tokens of the tokenizer.json's post-processor around its ids.
std::unique_ptr<Tokenizer> load_json(const fs::path& path) {
  const nlohmann::json j = read_json_file(path.string());
  const bool unigram = j.is_object() && j.contains("model") && j["model"].is_object() &&
                       j["model"].value("type", std::string()) == "Unigram";
  if (!unigram) return tok::load_hf_tokenizer(path.string());
  const fs::path sp = sentencepiece_file(path.parent_path());
  if (sp.empty())
    throw file_error(path.string(), "model.type", "Unigram models are read through their sentencepiece model: put "
                                                  "spiece.model or tokenizer.model beside tokenizer.json");
  std::vector<int64_t> prefix, suffix;
  if (j.contains("post_processor")) template_ids(j["post_processor"], path.string(), prefix, suffix);
  return tok::load_sentencepiece(sp.string(), prefix, suffix);
}

// A sentencepiece model alone. A T5 tokenizer (tokenizer_config.json's tokenizer_class) appends its eos_token.
std::unique_ptr<Tokenizer> load_sp(const fs::path& path) {
  const fs::path cfg_path = path.parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (!fs::exists(cfg_path, ec)) return tok::load_sentencepiece(path.string());
  const nlohmann::json cfg = read_json_file(cfg_path.string());
  const std::string cls = cfg.is_object() ? cfg.value("tokenizer_class", std::string()) : "";
  if (cls != "T5Tokenizer" && cls != "T5TokenizerFast") return tok::load_sentencepiece(path.string());
  const std::string eos = JsonReader(cfg, cfg_path.string()).string("eos_token", "</s>");
  auto plain = tok::load_sentencepiece(path.string());
  const auto id = plain->token_to_id(eos);
  if (!id) throw file_error(cfg_path.string(), "eos_token", "'" + eos + "' is not a piece of " + path.string());
  return tok::load_sentencepiece(path.string(), {}, {*id});
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  std::error_code ec;
  fs::path p(path);
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "tokenizer.json", ec)) return load_json(p / "tokenizer.json");
    const fs::path sp = sentencepiece_file(p);
    if (!sp.empty()) return load_sp(sp);
    throw Error(path + ": no tokenizer.json, tokenizer.model or spiece.model in this folder");
  }
  if (!fs::exists(p, ec))
    throw Error(path + ": no such file or folder (expected a folder with tokenizer.json or tokenizer.model, or "
                       "either file)");
  if (p.extension() == ".json") return load_json(p);
  return tok::load_sentencepiece(path);
}

}  // namespace lf::data
