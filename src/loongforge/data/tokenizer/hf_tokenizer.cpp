// tokenizer.json: added tokens, then normalizer -> pre-tokenizer -> BPE -> post-processor; decoding through the
// decoder. Same ids and text as Hugging Face tokenizers' Tokenizer.encode(...).ids and .decode(...).
#include <unordered_map>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/tokenizer/bpe.h"
#include "loongforge/data/tokenizer/components.h"
#include "loongforge/data/tokenizer/loaders.h"

namespace lf::data::tok {

namespace {

struct AddedToken {
  std::string content, decoded;  // DECODED: the content, normalized when the token is "normalized"
  int64_t id;
  bool special, lstrip, rstrip, single_word, normalized;
};

// Leftmost-longest matching of a set of strings (what tokenizers does with aho-corasick): a byte trie.
class Matcher {
 public:
  void add(const std::string& s, size_t token_index) {
    if (s.empty()) return;
    int node = 0;
    for (unsigned char c : s) {
      auto it = nodes_[node].next.find(c);
      if (it == nodes_[node].next.end()) {
        nodes_.push_back({});
        it = nodes_[node].next.emplace(c, int(nodes_.size() - 1)).first;
      }
      node = it->second;
    }
    if (nodes_[node].token < 0) nodes_[node].token = static_cast<int64_t>(token_index);
    first_[static_cast<unsigned char>(s[0])] = true;
  }
  bool empty() const { return nodes_.size() == 1; }
  // The first match at or after FROM: {start, end, token index}; start == npos when none.
  struct Found {
    size_t start, end;
    int64_t token;
  };
  Found find(std::string_view s, size_t from) const {
    for (size_t i = from; i < s.size(); ++i) {
      if (!first_[static_cast<unsigned char>(s[i])]) continue;
      Found best{std::string_view::npos, 0, -1};
      int node = 0;
      for (size_t k = i; k < s.size(); ++k) {
        auto it = nodes_[node].next.find(static_cast<unsigned char>(s[k]));
        if (it == nodes_[node].next.end()) break;
        node = it->second;
        if (nodes_[node].token >= 0) best = {i, k + 1, nodes_[node].token};
      }
      if (best.token >= 0) return best;
    }
    return {std::string_view::npos, 0, -1};
  }

 private:
  struct Node {
    std::unordered_map<unsigned char, int> next;
    int64_t token = -1;
  };
  std::vector<Node> nodes_{Node{}};
  std::array<bool, 256> first_{};
};

struct Segment {
  size_t start, end;
  int64_t id;  // an added token's id, or -1 for text
};

class HFTokenizer : public Tokenizer {
 public:
  explicit HFTokenizer(const std::string& path) : ctx_{path} {
    json j = read_json_file(path);
    if (!j.is_object()) ctx_.fail("", "expected a JSON object");
    for (const char* key : {"truncation", "padding"})
      if (j.contains(key) && !j[key].is_null()) ctx_.fail(key, "unsupported (must be null)");
    model_ = std::make_unique<BPE>(ctx_.get(j, "model", ""), ctx_, "model");
    if (j.contains("normalizer")) normalizer_ = make_normalizer(j["normalizer"], ctx_, "normalizer");
    if (j.contains("pre_tokenizer")) pre_ = make_pre_tokenizer(j["pre_tokenizer"], ctx_, "pre_tokenizer");
    if (j.contains("post_processor")) post_ = make_post_processor(j["post_processor"], ctx_, "post_processor");
    if (j.contains("decoder")) decoder_ = make_decoder(j["decoder"], ctx_, "decoder");
    if (j.contains("added_tokens") && !j["added_tokens"].is_null()) load_added(j["added_tokens"]);
    // One past the largest id: the number of tokens (tokenizers' get_vocab_size(with_added_tokens=True)) when ids are
    // dense, as in real tokenizers; a file with gaps in its ids (a fuzz finding) still gets a bound every id is under,
    // which token shards' dtype and new-token ids rely on.
    vocab_size_ = static_cast<int64_t>(model_->vocab().size());
    for (const auto& a : added_)
      if (!model_->token_to_id(a.content)) ++vocab_size_;
    for (const auto& [piece, id] : model_->vocab()) vocab_size_ = std::max(vocab_size_, id + 1);
    for (const auto& a : added_) vocab_size_ = std::max(vocab_size_, a.id + 1);
  }

  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens) const override {
    if (!valid_utf8(text)) throw Error("tokenize: the text is not valid UTF-8");
    std::vector<int64_t> ids;
    for (const auto& seg : split_added(text, raw_)) {
      if (seg.id >= 0) {
        ids.push_back(seg.id);
        continue;
      }
      std::string part(text.substr(seg.start, seg.end - seg.start));
      if (normalizer_) part = normalizer_->normalize(std::move(part));
      for (const auto& s2 : split_added(part, normalized_)) {
        if (s2.id >= 0) {
          ids.push_back(s2.id);
          continue;
        }
        std::vector<Piece> pieces{{part.substr(s2.start, s2.end - s2.start), seg.start == 0 && s2.start == 0}};
        if (pre_) pre_->apply(pieces);
        for (const auto& p : pieces) model_->tokenize(p.text, ids);
      }
    }
    if (add_special_tokens && post_) post_->process(ids);
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int64_t id : ids) {
      if (auto it = added_by_id_.find(id); it != added_by_id_.end()) {
        const AddedToken& a = added_[it->second];
        if (!(skip_special_tokens && a.special)) tokens.push_back(a.decoded);
      } else if (const std::string* t = model_->id_to_token(id)) {
        if (!(skip_special_tokens && special_contents_.count(*t))) tokens.push_back(*t);
      } else {
        throw Error(ctx_.file + ": decode: id " + std::to_string(id) + " is not in the vocabulary");
      }
    }
    if (!decoder_) {
      std::string out;
      for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
      return out;
    }
    decoder_->decode_chain(tokens);
    std::string out;
    for (const auto& t : tokens) out += t;
    return out;
  }

  int64_t vocab_size() const override { return vocab_size_; }

  std::optional<int64_t> token_to_id(const std::string& token) const override {
    if (auto it = added_by_content_.find(token); it != added_by_content_.end()) return it->second;
    return model_->token_to_id(token);
  }

  std::string id_to_token(int64_t id) const override {
    if (auto it = added_by_id_.find(id); it != added_by_id_.end()) return added_[it->second].decoded;
    if (const std::string* t = model_->id_to_token(id)) return *t;
    throw Error(ctx_.file + ": id " + std::to_string(id) + " is not in the vocabulary");
  }

 private:
  void load_added(const json& arr) {
    if (!arr.is_array()) ctx_.fail("added_tokens", "expected an array");
    for (size_t i = 0; i < arr.size(); ++i) {
      std::string f = "added_tokens[" + std::to_string(i) + "]";
      const json& e = arr[i];
      const json& id = ctx_.get(e, "id", f);
      if (!id.is_number_integer() || id.get<int64_t>() < 0) ctx_.fail(f + ".id", "expected a non-negative integer");
      AddedToken a;
      a.content = ctx_.str(e, "content", f);
      a.id = id.get<int64_t>();
      a.special = ctx_.boolean_or(e, "special", f, false);
      a.lstrip = ctx_.boolean_or(e, "lstrip", f, false);
      a.rstrip = ctx_.boolean_or(e, "rstrip", f, false);
      a.single_word = ctx_.boolean_or(e, "single_word", f, false);
      a.normalized = ctx_.boolean_or(e, "normalized", f, !a.special);
      added_by_id_[a.id] = added_.size();
      added_by_content_[a.content] = a.id;
      if (a.special) special_contents_[a.content] = a.id;
      // tokenizers matches (and decodes) a normalized added token by its normalized content
      if (a.normalized && normalizer_) a.decoded = normalizer_->normalize(a.content);
      else a.decoded = a.content;
      (a.normalized ? normalized_ : raw_).add(a.decoded, added_.size());
      added_.push_back(std::move(a));
    }
  }

  // Splits S at the added tokens of M, honouring single_word/lstrip/rstrip as tokenizers' AddedVocabulary does.
  std::vector<Segment> split_added(std::string_view s, const Matcher& m) const {
    std::vector<Segment> out;
    size_t done = 0;  // end of the last emitted segment
    if (!m.empty()) {
      for (size_t from = 0;;) {
        auto f = m.find(s, from);
        if (f.start == std::string_view::npos) break;
        from = f.end;
        const AddedToken& a = added_[f.token];
        size_t start = f.start, stop = f.end;
        if (a.single_word) {
          bool left_ok = start == 0 || !is_word_char(last_char(s.substr(0, start)));
          size_t k = stop;
          bool right_ok = stop == s.size() || !is_word_char(next_codepoint(s, k));
          if (!left_ok || !right_ok) continue;
        }
        if (a.lstrip) {
          size_t ns = start;
          while (ns > 0) {
            size_t j = ns - 1;
            while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
            size_t k = j;
            if (!is_whitespace(next_codepoint(s, k))) break;
            ns = j;
          }
          start = std::max(ns, done);
        }
        if (a.rstrip) {
          while (stop < s.size()) {
            size_t k = stop;
            if (!is_whitespace(next_codepoint(s, k))) break;
            stop = k;
          }
        }
        if (done < start) out.push_back({done, start, -1});
        out.push_back({start, stop, a.id});
        done = stop;
        from = std::max(from, stop);
      }
    }
    if (done < s.size()) out.push_back({done, s.size(), -1});
    return out;
  }

  static uint32_t last_char(std::string_view s) {
    size_t j = s.size() - 1;
    while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
    return next_codepoint(s, j);
  }

  Ctx ctx_;
  std::unique_ptr<BPE> model_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_;
  std::unique_ptr<PostProcessor> post_;
  std::unique_ptr<Decoder> decoder_;
  std::vector<AddedToken> added_;
  std::unordered_map<int64_t, size_t> added_by_id_;
  std::unordered_map<std::string, int64_t> added_by_content_, special_contents_;
  Matcher raw_, normalized_;  // added tokens matched before / after normalization
  int64_t vocab_size_ = 0;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path) { return std::make_unique<HFTokenizer>(path); }

}  // namespace lf::data::tok
