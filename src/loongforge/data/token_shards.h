// Token shards: a pair of files PREFIX.bin (the token ids of all documents, back to back, little-endian uint16 or
// uint32) and PREFIX.idx (a header and the document offsets). Layout: docs/data_format.md. Plain C++ (no torch).
#pragma once
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace lf::data {

enum class TokenDType : uint32_t { UInt16 = 2, UInt32 = 4 };  // the value is the width in bytes (the .idx code)

inline constexpr char kShardMagic[8] = {'L', 'F', 'I', 'D', 'X', 0, 0, 0};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr uint64_t kShardHeaderBytes = 32;

// uint16 when every id < VOCAB_SIZE fits (vocab_size <= 65536), else uint32.
TokenDType dtype_for_vocab(int64_t vocab_size);
const char* dtype_name(TokenDType dtype);

// Writes one shard. Documents stream to PREFIX.bin.tmp.PID; finish() writes PREFIX.idx.tmp.PID, fsyncs both and
// renames them over PREFIX.bin then PREFIX.idx. Destroyed without finish() (an error, an exception) it removes its
// temporary files, so existing PREFIX.bin/.idx are never touched by a run that fails.
class TokenShardWriter {
 public:
  TokenShardWriter(std::string prefix, TokenDType dtype);
  ~TokenShardWriter();
  TokenShardWriter(const TokenShardWriter&) = delete;
  TokenShardWriter& operator=(const TokenShardWriter&) = delete;

  void add_doc(std::span<const int64_t> ids);  // lf::Error if an id does not fit the dtype
  void finish();
  uint64_t num_docs() const { return offsets_.size() - 1; }
  uint64_t num_tokens() const { return offsets_.back(); }

 private:
  void discard();
  std::string prefix_, bin_tmp_, idx_tmp_;
  TokenDType dtype_;
  std::FILE* bin_ = nullptr;
  std::vector<uint64_t> offsets_{0};
  std::vector<char> buf_;
  bool done_ = false;
};

// Read-only view of a shard, memory-mapped. The constructor validates the header, the sizes of both files and the
// offsets (0, non-decreasing, ending at num_tokens); a bad shard is an lf::Error naming the file and the field.
class TokenShard {
 public:
  explicit TokenShard(const std::string& prefix);
  ~TokenShard();
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&&) = delete;
  TokenShard(const TokenShard&) = delete;

  const std::string& prefix() const { return prefix_; }
  TokenDType dtype() const { return dtype_; }
  uint64_t num_docs() const { return num_docs_; }
  uint64_t num_tokens() const { return num_tokens_; }
  uint64_t doc_offset(uint64_t i) const;  // first token of document I; doc_offset(num_docs()) == num_tokens()
  uint64_t doc_length(uint64_t i) const { return doc_offset(i + 1) - doc_offset(i); }
  std::vector<int64_t> doc(uint64_t i) const;
  std::vector<int64_t> tokens(uint64_t begin, uint64_t count) const;
  // Copies COUNT ids starting at token BEGIN into OUT (no allocation); lf::Error when out of range.
  void read(uint64_t begin, uint64_t count, int64_t* out) const;

 private:
  void check_range(uint64_t begin, uint64_t count) const;
  std::string prefix_;
  TokenDType dtype_ = TokenDType::UInt16;
  uint64_t num_docs_ = 0, num_tokens_ = 0;
  void* idx_map_ = nullptr;
  size_t idx_size_ = 0;
  void* bin_map_ = nullptr;
  size_t bin_size_ = 0;
  const uint64_t* offsets_ = nullptr;
};

}  // namespace lf::data
