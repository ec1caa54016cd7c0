// The BPE model of tokenizer.json ("model": {"type": "BPE", ...}), merging as tokenizers does: repeatedly the pair of
// lowest merge rank (leftmost among equals), with a priority queue, and a word cache.
#pragma once
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loongforge/data/tokenizer/components.h"

namespace lf::data::tok {

class BPE {
 public:
  BPE(const json& model, const Ctx& ctx, const std::string& field);
  // Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<int64_t>& out) const;
  std::optional<int64_t> token_to_id(const std::string& token) const;
  const std::string* id_to_token(int64_t id) const;
  const std::unordered_map<std::string, int64_t>& vocab() const { return vocab_; }

 private:
  std::vector<int64_t> merge_word(std::string_view word) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::unordered_map<int64_t, std::string> vocab_r_;
  struct Merge {
    int32_t rank;
    int64_t new_id;
  };
  std::unordered_map<uint64_t, Merge> merges_;  // key: (left id << 32) | right id
  std::optional<int64_t> unk_id_;
  std::string prefix_, suffix_;
  bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  std::array<int64_t, 256> byte_ids_{};  // ids of <0xNN>, -1 when absent

  static constexpr size_t kCacheCapacity = 100000, kCacheMaxWord = 256;
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace lf::data::tok
