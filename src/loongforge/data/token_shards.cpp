#include "loongforge/data/token_shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>

#include "loongforge/core/error.h"

namespace lf::data {

static_assert(std::endian::native == std::endian::little, "token shards are little-endian; add byte swaps");

TokenDType dtype_for_vocab(int64_t vocab_size) {
  return vocab_size <= 65536 ? TokenDType::UInt16 : TokenDType::UInt32;
}

const char* dtype_name(TokenDType dtype) { return dtype == TokenDType::UInt16 ? "uint16" : "uint32"; }

// ------------------------------------------------------------------------------------------------------ writer

namespace {

std::string errno_text() { return std::strerror(errno); }

// Writes all of BYTES to a new file and fsyncs it.
void write_synced(const std::string& path, const std::string& shown, const void* data, size_t n) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw file_error(shown, "", "cannot write: " + errno_text());
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      std::string what = errno_text();
      ::close(fd);
      throw file_error(shown, "", "write failed: " + what);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) throw file_error(shown, "", "write failed: " + errno_text());
}

}  // namespace

TokenShardWriter::TokenShardWriter(std::string prefix, TokenDType dtype) : prefix_(std::move(prefix)), dtype_(dtype) {
  std::string pid = std::to_string(::getpid());
  bin_tmp_ = prefix_ + ".bin.tmp." + pid;
  idx_tmp_ = prefix_ + ".idx.tmp." + pid;
  bin_ = std::fopen(bin_tmp_.c_str(), "wb");
  if (!bin_) throw file_error(prefix_ + ".bin", "", "cannot write: " + errno_text());
}

TokenShardWriter::~TokenShardWriter() {
  if (!done_) discard();
}

void TokenShardWriter::discard() {
  if (bin_) std::fclose(bin_);
  bin_ = nullptr;
  ::unlink(bin_tmp_.c_str());
  ::unlink(idx_tmp_.c_str());
}

void TokenShardWriter::add_doc(std::span<const int64_t> ids) {
  if (done_) throw Error(prefix_ + ": add_doc after finish");
  const size_t width = static_cast<size_t>(dtype_);
  const int64_t limit = dtype_ == TokenDType::UInt16 ? (int64_t{1} << 16) : (int64_t{1} << 32);
  buf_.resize(ids.size() * width);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= limit)
      throw file_error(prefix_ + ".bin", "dtype",
                       "token id " + std::to_string(ids[i]) + " does not fit " + dtype_name(dtype_));
    if (dtype_ == TokenDType::UInt16) {
      uint16_t v = static_cast<uint16_t>(ids[i]);
      std::memcpy(&buf_[i * 2], &v, 2);
    } else {
      uint32_t v = static_cast<uint32_t>(ids[i]);
      std::memcpy(&buf_[i * 4], &v, 4);
    }
  }
  if (!buf_.empty() && std::fwrite(buf_.data(), 1, buf_.size(), bin_) != buf_.size())
    throw file_error(prefix_ + ".bin", "", "write failed: " + errno_text());
  offsets_.push_back(offsets_.back() + ids.size());
}

void TokenShardWriter::finish() {
  if (done_) return;
  const std::string bin = prefix_ + ".bin", idx = prefix_ + ".idx";
  if (std::fflush(bin_) != 0 || ::fsync(::fileno(bin_)) != 0)
    throw file_error(bin, "", "write failed: " + errno_text());
  int rc = std::fclose(bin_);
  bin_ = nullptr;
  if (rc != 0) throw file_error(bin, "", "write failed: " + errno_text());

  std::string header(kShardHeaderBytes, '\0');
  const uint32_t version = kShardVersion, code = static_cast<uint32_t>(dtype_);
  const uint64_t docs = num_docs(), tokens = num_tokens();
  std::memcpy(&header[0], kShardMagic, 8);
  std::memcpy(&header[8], &version, 4);
  std::memcpy(&header[12], &code, 4);
  std::memcpy(&header[16], &docs, 8);
  std::memcpy(&header[24], &tokens, 8);
  header.append(reinterpret_cast<const char*>(offsets_.data()), offsets_.size() * sizeof(uint64_t));
  write_synced(idx_tmp_, idx, header.data(), header.size());

  // .bin first: a reader that sees the new .idx also sees the new .bin.
  if (std::rename(bin_tmp_.c_str(), bin.c_str()) != 0) throw file_error(bin, "", "rename failed: " + errno_text());
  if (std::rename(idx_tmp_.c_str(), idx.c_str()) != 0) throw file_error(idx, "", "rename failed: " + errno_text());
  done_ = true;
}

// ------------------------------------------------------------------------------------------------------ reader

namespace {

// Maps PATH read-only; an empty file maps to nullptr with size 0.
void* map_file(const std::string& path, size_t* size) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw file_error(path, "", "cannot open: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string what = errno_text();
    ::close(fd);
    throw file_error(path, "", "cannot stat: " + what);
  }
  *size = static_cast<size_t>(st.st_size);
  void* p = nullptr;
  if (*size > 0) {
    p = ::mmap(nullptr, *size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      std::string what = errno_text();
      ::close(fd);
      throw file_error(path, "", "cannot mmap: " + what);
    }
  }
  ::close(fd);
  return p;
}

void unmap(void* p, size_t n) {
  if (p) ::munmap(p, n);
}

}  // namespace

TokenShard::TokenShard(const std::string& prefix) : prefix_(prefix) {
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  try {
    idx_map_ = map_file(idx, &idx_size_);
    const char* h = static_cast<const char*>(idx_map_);
    if (idx_size_ < kShardHeaderBytes)
      throw file_error(idx, "header",
                       "truncated: " + std::to_string(idx_size_) + " bytes, a header needs " +
                           std::to_string(kShardHeaderBytes));
    if (std::memcmp(h, kShardMagic, 8) != 0) throw file_error(idx, "magic", "not a LoongForge token index (LFIDX)");
    uint32_t version = 0, code = 0;
    std::memcpy(&version, h + 8, 4);
    std::memcpy(&code, h + 12, 4);
    std::memcpy(&num_docs_, h + 16, 8);
    std::memcpy(&num_tokens_, h + 24, 8);
    if (version != kShardVersion)
      throw file_error(idx, "version",
                       "unsupported version " + std::to_string(version) + " (this build reads " +
                           std::to_string(kShardVersion) + ")");
    if (code != 2 && code != 4)
      throw file_error(idx, "dtype", "unknown code " + std::to_string(code) + " (2 = uint16, 4 = uint32)");
    dtype_ = static_cast<TokenDType>(code);
    const uint64_t room = (idx_size_ - kShardHeaderBytes) / 8;
    if (num_docs_ >= room || kShardHeaderBytes + 8 * (num_docs_ + 1) != idx_size_)
      throw file_error(idx, "num_docs",
                       std::to_string(num_docs_) + " documents need " +
                           (num_docs_ >= room ? std::string("more than ") + std::to_string(idx_size_)
                                              : std::to_string(kShardHeaderBytes + 8 * (num_docs_ + 1))) +
                           " bytes but the file has " + std::to_string(idx_size_) + " (truncated or corrupt)");
    offsets_ = reinterpret_cast<const uint64_t*>(h + kShardHeaderBytes);
    if (offsets_[0] != 0) throw file_error(idx, "offsets[0]", "is " + std::to_string(offsets_[0]) + ", expected 0");
    for (uint64_t i = 1; i <= num_docs_; ++i)
      if (offsets_[i] < offsets_[i - 1])
        throw file_error(idx, "offsets[" + std::to_string(i) + "]",
                         std::to_string(offsets_[i]) + " is less than the previous offset " +
                             std::to_string(offsets_[i - 1]));
    if (offsets_[num_docs_] != num_tokens_)
      throw file_error(idx, "num_tokens",
                       "is " + std::to_string(num_tokens_) + " but the last offset is " +
                           std::to_string(offsets_[num_docs_]));

    bin_map_ = map_file(bin, &bin_size_);
    const uint64_t width = code;
    if (num_tokens_ > bin_size_ / width || num_tokens_ * width != bin_size_)
      throw file_error(bin, "num_tokens",
                       "the index says " + std::to_string(num_tokens_) + " " + dtype_name(dtype_) + " tokens (" +
                           (num_tokens_ > bin_size_ / width ? std::string("more than ") + std::to_string(bin_size_)
                                                            : std::to_string(num_tokens_ * width)) +
                           " bytes) but the file has " + std::to_string(bin_size_) +
                           " bytes (truncated or not the pair of this .idx)");
  } catch (...) {
    unmap(idx_map_, idx_size_);
    unmap(bin_map_, bin_size_);
    throw;
  }
}

TokenShard::~TokenShard() {
  unmap(idx_map_, idx_size_);
  unmap(bin_map_, bin_size_);
}

TokenShard::TokenShard(TokenShard&& o) noexcept
    : prefix_(std::move(o.prefix_)),
      dtype_(o.dtype_),
      num_docs_(o.num_docs_),
      num_tokens_(o.num_tokens_),
      idx_map_(o.idx_map_),
      idx_size_(o.idx_size_),
      bin_map_(o.bin_map_),
      bin_size_(o.bin_size_),
      offsets_(o.offsets_) {
  o.idx_map_ = o.bin_map_ = nullptr;
  o.offsets_ = nullptr;
}

uint64_t TokenShard::doc_offset(uint64_t i) const {
  if (i > num_docs_)
    throw Error(prefix_ + ": document " + std::to_string(i) + " out of range (" + std::to_string(num_docs_) +
                " documents)");
  return offsets_[i];
}

void TokenShard::check_range(uint64_t begin, uint64_t count) const {
  if (begin > num_tokens_ || count > num_tokens_ - begin)
    throw Error(prefix_ + ": tokens [" + std::to_string(begin) + ", +" + std::to_string(count) +
                ") out of range (" + std::to_string(num_tokens_) + " tokens)");
}

void TokenShard::read(uint64_t begin, uint64_t count, int64_t* out) const {
  check_range(begin, count);
  if (dtype_ == TokenDType::UInt16) {
    const uint16_t* p = static_cast<const uint16_t*>(bin_map_) + begin;
    for (uint64_t i = 0; i < count; ++i) out[i] = p[i];
  } else {
    const uint32_t* p = static_cast<const uint32_t*>(bin_map_) + begin;
    for (uint64_t i = 0; i < count; ++i) out[i] = p[i];
  }
}

std::vector<int64_t> TokenShard::tokens(uint64_t begin, uint64_t count) const {
  check_range(begin, count);
  std::vector<int64_t> out(count);
  read(begin, count, out.data());
  return out;
}

std::vector<int64_t> TokenShard::doc(uint64_t i) const {
  if (i >= num_docs_)
    throw Error(prefix_ + ": document " + std::to_string(i) + " out of range (" + std::to_string(num_docs_) +
                " documents)");
  return tokens(offsets_[i], offsets_[i + 1] - offsets_[i]);
}

}  // namespace lf::data
