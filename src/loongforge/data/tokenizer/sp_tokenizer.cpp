// tokenizer.model through libsentencepiece: ids and text as SentencePieceProcessor.encode(text) / .decode(ids).
#include <sentencepiece_processor.h>

#include "loongforge/core/error.h"
#include "loongforge/data/tokenizer/loaders.h"
#include "loongforge/data/tokenizer/unicode.h"

namespace lf::data::tok {

namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    auto st = sp_.Load(path);
    if (!st.ok()) throw Error(path + ": not a sentencepiece model: " + st.ToString());
  }

  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens) const override {
    if (!valid_utf8(text)) throw Error("tokenize: the text is not valid UTF-8");
    std::vector<int> ids;
    auto st = sp_.Encode(text, &ids);
    if (!st.ok()) throw Error(path_ + ": encode failed: " + st.ToString());
    return {ids.begin(), ids.end()};
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
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

}  // namespace lf::data::tok
