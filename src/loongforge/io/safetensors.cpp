#include "loongforge/io/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "loongforge/core/error.h"
#include "loongforge/core/fs.h"
#include "loongforge/core/json.h"

namespace lf::io {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the Rust library's limit

struct DtypeInfo {
  const char* name;
  at::ScalarType type;
  int rank;  // the Rust library's Dtype order; files list higher ranks first
};

const DtypeInfo kDtypes[] = {
    {"BOOL", at::kBool, 0},
    {"U8", at::kByte, 4},
    {"I8", at::kChar, 5},
    {"F8_E5M2", at::kFloat8_e5m2, 6},
    {"F8_E4M3", at::kFloat8_e4m3fn, 7},
    {"F8_E8M0", at::kFloat8_e8m0fnu, 8},
    {"F8_E4M3FNUZ", at::kFloat8_e4m3fnuz, 9},
    {"F8_E5M2FNUZ", at::kFloat8_e5m2fnuz, 10},
    {"I16", at::kShort, 11},
    {"U16", at::kUInt16, 12},
    {"F16", at::kHalf, 13},
    {"BF16", at::kBFloat16, 14},
    {"I32", at::kInt, 15},
    {"U32", at::kUInt32, 16},
    {"F32", at::kFloat, 17},
    {"C64", at::kComplexFloat, 18},
    {"F64", at::kDouble, 19},
    {"I64", at::kLong, 20},
    {"U64", at::kUInt64, 21},
};

const DtypeInfo* find_dtype(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return &d;
  return nullptr;
}

// Control characters escaped so that every message stays on one line.
std::string show(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

Error err(const std::string& file, const std::string& field, const std::string& what) {
  return file_error(show(file), show(field), show(what));
}

// JSON string as serde_json writes it.
void put_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

bool checked_mul(uint64_t a, uint64_t b, uint64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

// Byte size of a tensor of DTYPE and SHAPE, or nullopt on overflow.
std::optional<uint64_t> byte_size(const std::vector<int64_t>& shape, size_t elem) {
  uint64_t n = elem;
  for (int64_t d : shape)
    if (!checked_mul(n, static_cast<uint64_t>(d), n)) return std::nullopt;
  return n;
}

// Reads an array of non-negative integers; false when VALUE is not one.
bool read_uints(const ojson& value, std::vector<uint64_t>& out, bool& negative) {
  negative = false;
  if (!value.is_array()) return false;
  for (const auto& v : value) {
    if (v.is_number_unsigned()) {
      out.push_back(v.get<uint64_t>());
    } else if (v.is_number_integer()) {
      negative = true;
      return false;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// dtypes

std::string dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  throw Error(std::string("safetensors: no dtype for tensor type ") + c10::toString(t));
}

at::ScalarType scalar_type(const std::string& name) {
  if (const DtypeInfo* d = find_dtype(name)) return d->type;
  throw Error("safetensors: unknown dtype '" + show(name) + "'");
}

size_t dtype_size(const std::string& name) { return c10::elementSize(scalar_type(name)); }

void sort_like_safetensors(NamedTensors& tensors) {
  auto rank = [](const at::Tensor& t) { return find_dtype(dtype_name(t.scalar_type()))->rank; };
  std::stable_sort(tensors.begin(), tensors.end(), [&](const auto& a, const auto& b) {
    int ra = rank(a.second), rb = rank(b.second);
    return ra != rb ? ra > rb : a.first < b.first;  // std::string compares bytewise, like Rust
  });
}

// ---------------------------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw err(path, "", std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw err(path, "", "not a regular file");
  }
  size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    throw err(path, "header", "file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED) throw err(path, "", std::string("cannot mmap: ") + std::strerror(map_errno));
  f->map_ = map;
  f->map_size_ = size;
  const auto* bytes = static_cast<const uint8_t*>(map);

  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];  // little-endian u64
  if (n > kMaxHeaderBytes)
    throw err(path, "header", "header length " + std::to_string(n) + " exceeds the 100 MB limit");
  if (n > size - 8)
    throw err(path, "header", "header length " + std::to_string(n) + " runs past the end of the file (" +
                                  std::to_string(size) + " bytes)");
  f->header_size_ = n;
  f->data_ = bytes + 8 + n;
  const size_t data_size = size - 8 - n;

  // Parse keeping key order; reject duplicate keys (nlohmann silently keeps one).
  struct Frame {
    std::set<std::string> keys;
    std::string owner;  // the key this object is the value of
    std::string last;
  };
  std::vector<Frame> stack;
  ojson header;
  const char* text = reinterpret_cast<const char*>(bytes + 8);
  try {
    header = ojson::parse(text, text + n, [&](int, ojson::parse_event_t ev, ojson& parsed) {
      if (ev == ojson::parse_event_t::object_start) {
        stack.push_back({{}, stack.empty() ? "" : stack.back().last, ""});
      } else if (ev == ojson::parse_event_t::object_end) {
        stack.pop_back();
      } else if (ev == ojson::parse_event_t::key) {
        const auto& key = parsed.get_ref<const std::string&>();
        Frame& top = stack.back();
        if (!top.keys.insert(key).second) {
          if (stack.size() == 1) throw err(path, key, "duplicate tensor name");
          throw err(path, top.owner, "duplicate key '" + key + "'");
        }
        top.last = key;
      }
      return true;
    });
  } catch (const nlohmann::json::exception& e) {
    std::string what = e.what();
    auto pos = what.find("parse error");
    throw err(path, "header", "invalid JSON: " + (pos == std::string::npos ? what : what.substr(pos)));
  }
  if (!header.is_object()) throw err(path, "header", "not a JSON object");

  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) throw err(path, "__metadata__", "must be an object of strings");
      MetadataItems items;
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) throw err(path, "__metadata__." + k, "must be a string");
        items.emplace_back(k, v.get<std::string>());
        f->metadata_[k] = v.get<std::string>();
      }
      f->metadata_items_ = std::move(items);
      continue;
    }
    if (!value.is_object()) throw err(path, name, "must be an object with 'dtype', 'shape' and 'data_offsets'");
    TensorEntry e;
    e.name = name;
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!value.contains(key)) throw err(path, name, std::string("missing '") + key + "'");
    const ojson& dtype = value["dtype"];
    if (!dtype.is_string()) throw err(path, name, "'dtype' must be a string");
    e.dtype = dtype.get<std::string>();
    const DtypeInfo* info = find_dtype(e.dtype);
    if (!info) throw err(path, name, "unknown dtype '" + e.dtype + "'");

    std::vector<uint64_t> dims, offsets;
    bool negative = false;
    if (!read_uints(value["shape"], dims, negative))
      throw err(path, name, negative ? "'shape' has a negative dimension" : "'shape' must be an array of integers");
    for (uint64_t d : dims) {
      if (d > static_cast<uint64_t>(INT64_MAX)) throw err(path, name, "'shape' dimension too large");
      e.shape.push_back(static_cast<int64_t>(d));
    }
    if (!read_uints(value["data_offsets"], offsets, negative) || offsets.size() != 2)
      throw err(path, name, "'data_offsets' must be an array of two non-negative integers");
    if (offsets[1] < offsets[0]) throw err(path, name, "'data_offsets' end is before begin");
    if (offsets[1] > data_size)
      throw err(path, name, "'data_offsets' end " + std::to_string(offsets[1]) + " is past the data section (" +
                                std::to_string(data_size) + " bytes)");
    e.begin = offsets[0];
    e.end = offsets[1];
    auto nbytes = byte_size(e.shape, c10::elementSize(info->type));
    if (!nbytes || *nbytes != e.end - e.begin)
      throw err(path, name, "'data_offsets' span " + std::to_string(e.end - e.begin) + " bytes but shape and " +
                                e.dtype + " need " + (nbytes ? std::to_string(*nbytes) : std::string("too many")));
    f->entries_.push_back(std::move(e));
  }

  std::stable_sort(f->entries_.begin(), f->entries_.end(),
                   [](const TensorEntry& a, const TensorEntry& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  size_t expected = 0;
  for (size_t i = 0; i < f->entries_.size(); ++i) {
    const TensorEntry& e = f->entries_[i];
    if (e.begin != expected)
      throw err(path, e.name, "'data_offsets' not contiguous: begins at " + std::to_string(e.begin) + ", expected " +
                                  std::to_string(expected));
    expected = e.end;
    f->index_[e.name] = i;
  }
  if (expected != data_size)
    throw err(path, "data", "data section is " + std::to_string(data_size) + " bytes but the tensors cover " +
                                std::to_string(expected));
  return f;
}

const TensorEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) throw err(path_, name, "no such tensor");
  return entries_[it->second];
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorEntry& e = entry(name);
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(scalar_type(e.dtype)));
  if (e.end > e.begin) std::memcpy(t.data_ptr(), data_ + e.begin, e.end - e.begin);
  return t;
}

// ---------------------------------------------------------------------------------------------------------------
// SafetensorsCheckpoint

SafetensorsCheckpoint SafetensorsCheckpoint::open(const std::string& path) {
  SafetensorsCheckpoint ck;
  ck.path_ = path;
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) {
    fs::path dir(path);
    file.clear();
    // transformers' names, then diffusers'
    for (const char* stem : {"model", "diffusion_pytorch_model"}) {
      if (fs::exists(dir / (std::string(stem) + ".safetensors.index.json"), ec)) {
        file = (dir / (std::string(stem) + ".safetensors.index.json")).string();
      } else if (fs::exists(dir / (std::string(stem) + ".safetensors"), ec)) {
        file = (dir / (std::string(stem) + ".safetensors")).string();
      }
      if (!file.empty()) break;
    }
    if (file.empty())
      throw err(path, "", "no model.safetensors, diffusion_pytorch_model.safetensors or their .index.json in this folder");
  }
  const std::string suffix = ".index.json";
  bool is_index = file.size() >= suffix.size() && file.compare(file.size() - suffix.size(), suffix.size(), suffix) == 0;
  if (!is_index) {
    ck.files_.push_back(SafetensorsFile::open(file));
    for (const auto& e : ck.files_[0]->entries()) ck.where_[e.name] = ck.files_[0].get();
    return ck;
  }

  nlohmann::json index = read_json_file(file);
  if (!index.is_object()) throw err(file, "", "not a JSON object");
  if (!index.contains("weight_map")) throw err(file, "weight_map", "missing");
  const auto& map = index["weight_map"];
  if (!map.is_object()) throw err(file, "weight_map", "must be an object {tensor: shard file}");
  fs::path dir = fs::path(file).parent_path();
  std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;
  for (const auto& [name, shard] : map.items()) {
    const std::string field = "weight_map." + name;
    if (!shard.is_string()) throw err(file, field, "must be a string (a shard file name)");
    const std::string shard_name = shard.get<std::string>();
    if (!is_plain_name(shard_name)) throw err(file, field, "'" + shard_name + "' is not a file of this folder");
    auto it = shards.find(shard_name);
    if (it == shards.end()) {
      fs::path shard_path = dir / shard_name;
      if (!fs::is_regular_file(shard_path, ec)) throw err(file, field, "shard '" + shard_name + "' not found");
      it = shards.emplace(shard_name, SafetensorsFile::open(shard_path.string())).first;
      ck.files_.push_back(it->second);
    }
    if (!it->second->contains(name))
      throw err(file, field, "shard '" + shard_name + "' has no tensor '" + name + "'");
    ck.where_[name] = it->second.get();
  }
  return ck;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, f] : where_) out.push_back(name);
  return out;
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) throw err(path_, name, "no such tensor in the checkpoint");
  return *it->second;
}

const TensorEntry& SafetensorsCheckpoint::entry(const std::string& name) const { return file_of(name).entry(name); }
at::Tensor SafetensorsCheckpoint::tensor(const std::string& name) const { return file_of(name).tensor(name); }
std::string SafetensorsCheckpoint::dtype(const std::string& name) const { return entry(name).dtype; }
std::vector<int64_t> SafetensorsCheckpoint::shape(const std::string& name) const { return entry(name).shape; }

// ---------------------------------------------------------------------------------------------------------------
// Writing

namespace {

// An open temporary file next to PATH that becomes PATH on commit() and is removed otherwise.
class AtomicFile {
 public:
  explicit AtomicFile(const std::string& path) : path_(path) {
    static std::atomic<unsigned> counter{0};
    tmp_ = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw err(path, "", std::string("cannot write: ") + std::strerror(errno));
  }
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  void write(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      ssize_t w = ::write(fd_, c, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        throw err(path_, "", std::string("write failed: ") + std::strerror(errno));
      }
      c += w;
      n -= static_cast<size_t>(w);
    }
  }
  void commit() {
    if (::fsync(fd_) != 0) throw err(path_, "", std::string("fsync failed: ") + std::strerror(errno));
    int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) throw err(path_, "", std::string("close failed: ") + std::strerror(errno));
    if (::rename(tmp_.c_str(), path_.c_str()) != 0)
      throw err(path_, "", std::string("rename failed: ") + std::strerror(errno));
    committed_ = true;
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

uint64_t tensor_bytes(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

}  // namespace

void save_file_ordered(const std::string& path, const NamedTensors& tensors,
                       const std::optional<MetadataItems>& metadata) {
  std::string header = "{";
  if (metadata) {
    header += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata->size(); ++i) {
      if (i) header += ',';
      put_json_string(header, (*metadata)[i].first);
      header += ':';
      put_json_string(header, (*metadata)[i].second);
    }
    header += '}';
  }
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") throw err(path, name, "reserved name, not a tensor name");
    if (!seen.insert(name).second) throw err(path, name, "duplicate tensor name");
    if (!t.defined()) throw err(path, name, "undefined tensor");
    std::string dtype;
    try {
      dtype = dtype_name(t.scalar_type());
    } catch (const Error& e) {
      throw err(path, name, e.what());
    }
    if (header.size() > 1) header += ',';
    put_json_string(header, name);
    header += ":{\"dtype\":\"" + dtype + "\",\"shape\":[";
    for (int64_t i = 0; i < t.dim(); ++i) {
      if (i) header += ',';
      header += std::to_string(t.size(i));
    }
    uint64_t end = offset + tensor_bytes(t);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(end) + "]}";
    offset = end;
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');

  AtomicFile out(path);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  out.write(len, 8);
  out.write(header.data(), header.size());
  for (const auto& [name, t] : tensors) {
    if (t.numel() == 0) continue;
    at::Tensor c = t;
    if (!c.device().is_cpu()) c = c.to(at::kCPU);
    c = c.resolve_conj().resolve_neg().contiguous();
    out.write(c.data_ptr(), tensor_bytes(c));
  }
  out.commit();
}

void save_file(const std::string& path, const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  std::optional<MetadataItems> items;
  if (!metadata.empty()) items = MetadataItems(metadata.begin(), metadata.end());
  save_file_ordered(path, tensors, items);
}

void rewrite_file(const SafetensorsFile& file, const std::string& out_path) {
  NamedTensors tensors;
  for (const auto& e : file.entries()) tensors.emplace_back(e.name, file.tensor(e.name));
  save_file_ordered(out_path, tensors, file.metadata_items());
}

std::vector<std::string> save_sharded(const std::string& dir, const NamedTensors& tensors, size_t max_shard_bytes,
                                      const std::map<std::string, std::string>& metadata, const std::string& prefix) {
  // Split as huggingface_hub's split_torch_state_dict_into_shards does.
  std::vector<NamedTensors> shards;
  NamedTensors current;
  uint64_t current_size = 0, total = 0;
  for (const auto& nt : tensors) {
    uint64_t n = nt.second.defined() ? tensor_bytes(nt.second) : 0;
    total += n;
    if (n > max_shard_bytes) {
      shards.push_back({nt});
      continue;
    }
    if (current_size + n > max_shard_bytes && !current.empty()) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(nt);
    current_size += n;
  }
  if (!current.empty() || shards.empty()) shards.push_back(std::move(current));

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (shards.size() == 1) {
    std::string name = prefix + ".safetensors";
    save_file((fs::path(dir) / name).string(), shards[0], metadata);
    return {name};
  }
  std::vector<std::string> written;
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    char suffix[32];
    std::snprintf(suffix, sizeof suffix, "-%05zu-of-%05zu", i + 1, shards.size());
    std::string name = prefix + suffix + ".safetensors";
    save_file((fs::path(dir) / name).string(), shards[i], metadata);
    for (const auto& nt : shards[i]) weight_map[nt.first] = name;
    written.push_back(name);
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  std::string index_name = prefix + ".safetensors.index.json";
  write_file_atomic((fs::path(dir) / index_name).string(), index.dump(2, ' ', true) + "\n");
  written.push_back(index_name);
  return written;
}

}  // namespace lf::io
