// The pipeline stages of a tokenizer.json, each built from its JSON object: normalizers, pre-tokenizers, decoders and
// post-processors, with the same behaviour as Hugging Face `tokenizers` (ids and text only, no offsets).
// components.cpp: the config helpers, patterns, normalizers, pre-tokenizers; decoders.cpp: decoders, post-processors.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "loongforge/data/tokenizer/unicode.h"

namespace lf::data::tok {

using json = nlohmann::json;

// Reads typed fields of a config object; every failure is an lf::Error "FILE: field 'a.b.c': what" (lf::JsonReader's
// checks, messages without the offending value).
struct Ctx {
  std::string file;
  [[noreturn]] void fail(const std::string& field, const std::string& what) const;
  const json& get(const json& obj, const std::string& key, const std::string& field) const;  // required key
  std::string str(const json& obj, const std::string& key, const std::string& field) const;
  std::string str_or(const json& obj, const std::string& key, const std::string& field, const std::string& dflt) const;
  bool boolean_or(const json& obj, const std::string& key, const std::string& field, bool dflt) const;
  int64_t integer_or(const json& obj, const std::string& key, const std::string& field, int64_t dflt) const;
  // The "type" of a component object, which must be an object.
  std::string type(const json& obj, const std::string& field) const;
};

// Each element of the array OBJ[KEY], with its field name.
template <class F>
void for_each_item(const Ctx& ctx, const json& obj, const std::string& key, const std::string& field, F&& f) {
  const json& arr = ctx.get(obj, key, field);
  if (!arr.is_array()) ctx.fail(field + "." + key, "expected an array");
  for (size_t i = 0; i < arr.size(); ++i) f(arr[i], field + "." + key + "[" + std::to_string(i) + "]");
}

// The one character of a "replacement"/"content" char field.
uint32_t single_char(const Ctx& ctx, const json& obj, const std::string& key, const std::string& field);

// Metaspace's prepend_scheme (or the older add_prefix_space), read by its pre-tokenizer and its decoder.
enum class Prepend3 { Always, First, Never };
Prepend3 parse_prepend_scheme(const json& j, const Ctx& ctx, const std::string& field);

// A literal string or a regex ({"String": ...} / {"Regex": ...} in tokenizer.json).
struct Pattern {
  std::string literal;
  std::shared_ptr<Regex> regex;
  std::vector<Regex::Match> find_all(std::string_view s) const;
  std::string replace_all(std::string_view s, const std::string& content) const;
};
Pattern parse_pattern(const json& j, const Ctx& ctx, const std::string& field);

// A span of text being pre-tokenized. AT_ORIGIN: it starts at offset 0 of the original input (Metaspace "first").
struct Piece {
  std::string text;
  bool at_origin = false;
};

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
// Splits S at the given matches (sorted, non-overlapping) as NormalizedString::split does; empty parts are dropped.
std::vector<Piece> split_with(const Piece& s, const std::vector<Regex::Match>& matches, SplitBehavior behavior,
                              bool invert = false);

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string normalize(std::string s) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void apply(std::vector<Piece>& pieces) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  virtual void process(std::vector<int64_t>& ids) const = 0;  // single sequence, add_special_tokens=true
};

// Each returns nullptr for JSON null and throws for an unsupported or malformed component.
std::unique_ptr<Normalizer> make_normalizer(const json& j, const Ctx& ctx, const std::string& field);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const Ctx& ctx, const std::string& field);
std::unique_ptr<Decoder> make_decoder(const json& j, const Ctx& ctx, const std::string& field);
std::unique_ptr<PostProcessor> make_post_processor(const json& j, const Ctx& ctx, const std::string& field);

}  // namespace lf::data::tok
