// tokenizer.model through libsentencepiece: ids and text as SentencePieceProcessor.encode(text) / .decode(ids), with
// the special tokens a model's tokenizer adds around them (T5's </s>) when asked to.
#include <sentencepiece_processor.h>

#include "loongforge/core/error.h"
#include "loongforge/data/tokenizer/loaders.h"
#include "loongforge/data/tokenizer/unicode.h"

namespace lf::data::tok {

namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& path, std::vector<int64_t> prefix, std::vector<int64_t> suffix)
      : path_(path), prefix_(std::move(prefix)), suffix_(std::move(suffix)) {
    sentencepiece::util::Status st;
    try {  // libsentencepiece also throws (its double-array trie rejects e.g. an empty piece: a fuzz finding)
      st = sp_.Load(path);
    } catch (const std::exception& e) {
      throw Error(path + ": not a sentencepiece model: " + e.what());
    }
    if (!st.ok()) throw Error(path + ": not a sentencepiece model: " + st.ToString());
    for (const auto* ids : {&prefix_, &suffix_})
      for (int64_t id : *ids) check_id(id);
  }

  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens) const override {
    if (!valid_utf8(text)) throw Error("tokenize: the text is not valid UTF-8");
    std::vector<int> ids;
    auto st = sp_.Encode(text, &ids);
    if (!st.ok()) throw Error(path_ + ": encode failed: " + st.ToString());
    if (!add_special_tokens) return {ids.begin(), ids.end()};
    std::vector<int64_t> out(prefix_);
    out.insert(out.end(), ids.begin(), ids.end());
    out.insert(out.end(), suffix_.begin(), suffix_.end());
    return out;
  }

  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override {
    std::vector<int> v;
    v.reserve(ids.size());
    for (int64_t id : ids) {
      check_id(id);
      v.push_back(static_cast<int>(id));
    }
    std::string text;
    auto st = sp_.Decode(v, &text);
    if (!st.ok()) throw Error(path_ + ": decode failed: " + st.ToString());
    return text;
  }

  int64_t vocab_size() const override { return sp_.GetPieceSize(); }

  std::optional<int64_t> token_to_id(const std::string& token) const override {
    int id = sp_.PieceToId(token);
    if (id < 0 || sp_.IdToPiece(id) != token) return std::nullopt;
    return id;
  }

  std::string id_to_token(int64_t id) const override {
    check_id(id);
    return sp_.IdToPiece(static_cast<int>(id));
  }

 private:
  void check_id(int64_t id) const {
    if (id < 0 || id >= sp_.GetPieceSize())
      throw Error(path_ + ": id " + std::to_string(id) + " is out of range [0, " +
                  std::to_string(sp_.GetPieceSize()) + ")");
  }
  std::string path_;
  std::vector<int64_t> prefix_, suffix_;  // added around the pieces by encode(text, true)
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path, std::vector<int64_t> prefix,
                                              std::vector<int64_t> suffix) {
  return std::make_unique<SentencePieceTokenizer>(path, std::move(prefix), std::move(suffix));
}

}  // namespace lf::data::tok
