// Reading and writing safetensors files (https://github.com/huggingface/safetensors), single or sharded.
//
// File layout: 8 bytes little-endian u64 N, then N bytes of UTF-8 JSON (the header), then the data section. The
// header maps tensor names to {"dtype","shape","data_offsets":[begin,end]} (offsets relative to the data section)
// and may hold "__metadata__": {string: string}. Every malformed input is an lf::Error whose one-line message names
// the file and the field or tensor.
//
// The writer produces the exact bytes of the Python/Rust library: compact JSON ("," and ":" separators, no spaces),
// "__metadata__" first, then the tensors in data order, each as {"dtype":..,"shape":[..],"data_offsets":[b,e]},
// strings escaped as serde_json does (\" \\ \b \f \n \r \t, other control characters \u00xx, nothing else), then
// spaces up to a multiple of 8 bytes. The library orders tensors by dtype (descending, see sort_like_safetensors)
// then by name; save_file keeps the order it is given.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lf::io {

struct TensorEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", ... as in the file
  std::vector<int64_t> shape;
  size_t begin = 0, end = 0;  // byte offsets in the data section
};

// "__metadata__" in the order the file holds it (the Python library writes a hash map, so the order varies).
using MetadataItems = std::vector<std::pair<std::string, std::string>>;

// One .safetensors file, mmap'd read-only.
class SafetensorsFile {
 public:
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);  // validates; throws lf::Error
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorEntry>& entries() const { return entries_; }  // in data-offset order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The metadata in file order; nullopt when the header has no "__metadata__" key at all.
  const std::optional<MetadataItems>& metadata_items() const { return metadata_items_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  const TensorEntry& entry(const std::string& name) const;  // throws lf::Error naming file+tensor
  at::Tensor tensor(const std::string& name) const;          // CPU tensor (a copy) in the file's dtype
  const uint8_t* data(const TensorEntry& e) const { return data_ + e.begin; }  // raw bytes in the mapping
  size_t header_size() const { return header_size_; }                          // N, the JSON header's length

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  const uint8_t* data_ = nullptr;
  size_t header_size_ = 0;
  std::vector<TensorEntry> entries_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::optional<MetadataItems> metadata_items_;
};

// A folder with model.safetensors, or model.safetensors.index.json + shards; or the path of one .safetensors file
// or of a *.safetensors.index.json. All shards are opened (and validated) by open().
class SafetensorsCheckpoint {
 public:
  static SafetensorsCheckpoint open(const std::string& path);
  std::vector<std::string> names() const;  // all tensor names (sorted)
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  at::Tensor tensor(const std::string& name) const;
  std::string dtype(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  const TensorEntry& entry(const std::string& name) const;
  const SafetensorsFile& file_of(const std::string& name) const;
  const std::string& path() const { return path_; }
  const std::vector<std::shared_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::string path_;  // what open() was given
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Writes one file atomically (temporary file in the same folder, fsync, rename). Tensors are written in the given
// order (contiguous, CPU; non-contiguous/non-CPU inputs are copied). metadata goes to "__metadata__" (omitted when
// empty, like the Python library's metadata=None).
void save_file(const std::string& path, const NamedTensors& tensors,
               const std::map<std::string, std::string>& metadata = {});
// The same with the metadata's order given; nullopt writes no "__metadata__" key, an empty list writes "{}".
void save_file_ordered(const std::string& path, const NamedTensors& tensors,
                       const std::optional<MetadataItems>& metadata);
// Writes FILE's tensors and metadata back in file order: for a file the Python library wrote, the same bytes.
void rewrite_file(const SafetensorsFile& file, const std::string& out_path);

// Sorts as the Python/Rust library does before writing: dtype rank descending (U64 I64 F64 C64 F32 U32 I32 BF16 F16
// U16 I16 F8_E5M2FNUZ F8_E4M3FNUZ F8_E8M0 F8_E4M3 F8_E5M2 I8 U8 BOOL), then name (bytewise). Stable.
void sort_like_safetensors(NamedTensors& tensors);

// Writes DIR/PREFIX.safetensors if everything fits in max_shard_bytes, else DIR/PREFIX-00001-of-0000N.safetensors
// ... plus DIR/PREFIX.safetensors.index.json ({"metadata": {"total_size": N}, "weight_map": {name: shard}}, indent 2,
// sorted keys, trailing newline, as transformers writes it). Tensors are split like huggingface_hub: in order, a new
// shard when the next tensor would pass the limit, a tensor larger than the limit alone in its own shard. Returns the
// file names written (shards in order, then the index).
std::vector<std::string> save_sharded(const std::string& dir, const NamedTensors& tensors, size_t max_shard_bytes,
                                      const std::map<std::string, std::string>& metadata = {},
                                      const std::string& prefix = "model");

// at::ScalarType <-> safetensors dtype string
std::string dtype_name(at::ScalarType t);                    // throws lf::Error for types safetensors lacks
at::ScalarType scalar_type(const std::string& dtype_name);  // throws lf::Error
size_t dtype_size(const std::string& dtype_name);            // bytes per element; throws lf::Error

}  // namespace lf::io
