// Tokenizers that give the same ids and text as Hugging Face `tokenizers` (tokenizer.json) and as sentencepiece
// (tokenizer.model). Plain C++ (no torch). Thread-safe: encode/decode are const and may run concurrently.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lf::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // PATH: a folder with tokenizer.json (preferred), tokenizer.model or spiece.model, or either file. A tokenizer.json
  // with a Unigram model (T5's, converted from sentencepiece) runs on the folder's sentencepiece model, with the
  // special tokens of the json's TemplateProcessing around the ids; a T5 folder's sentencepiece model alone
  // (tokenizer_config.json's tokenizer_class T5Tokenizer) appends its eos_token. Errors: lf::Error, one line naming
  // the file and the field.
  static std::unique_ptr<Tokenizer> load(const std::string& path);
  // Same as tokenizers' Tokenizer.encode(text, add_special_tokens).ids (or SentencePieceProcessor.encode(text)).
  // TEXT must be valid UTF-8 (lf::Error otherwise).
  virtual std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = true) const = 0;
  // Same as tokenizers' Tokenizer.decode(ids, skip_special_tokens); an id out of range is an lf::Error.
  virtual std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = true) const = 0;
  virtual int64_t vocab_size() const = 0;  // including added tokens
  virtual std::optional<int64_t> token_to_id(const std::string& token) const = 0;
  virtual std::string id_to_token(int64_t id) const = 0;  // lf::Error when out of range
};

}  // namespace lf::data
