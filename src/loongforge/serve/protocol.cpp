// openpi's msgpack messages (protocol.h) through msgpack-cxx (header-only; MSGPACK_NO_BOOST). Without its headers
// (LF_HAVE_SERVE unset) every function throws the line saying what to install.
#include "loongforge/serve/protocol.h"

#include "loongforge/core/error.h"
#include "loongforge/serve/websocket.h"

#if LF_HAVE_SERVE

#include <msgpack.hpp>

#include <ATen/ATen.h>

#include <cstring>
#include <limits>
#include <string_view>
#include <vector>

namespace lf::serve {
namespace {

using Obj = msgpack::object;
namespace mt = msgpack::type;

// Bounds on what one message may declare (msgpack-cxx allocates a container's slots when it reads its header, before
// its elements: these keep a small hostile message from asking for much memory). Bigger data goes in NumPy arrays.
constexpr size_t kMaxArray = 1 << 16;  // elements of one msgpack array (lists of numbers, shapes)
constexpr size_t kMaxMap = 1024;       // entries of one map
constexpr size_t kMaxStr = 1 << 20;    // bytes of one str (the prompt)
constexpr size_t kMaxDepth = 16;
constexpr int kMaxDims = 8;

Error bad(const std::string& field, const std::string& what) {
  if (field.empty()) return Error("request: " + what);
  return Error("request: field '" + field + "': " + what);
}

bool is_text(const Obj& o) { return o.type == mt::STR || o.type == mt::BIN; }
std::string_view text(const Obj& o) {
  if (o.type == mt::STR) return {o.via.str.ptr, o.via.str.size};
  return {o.via.bin.ptr, o.via.bin.size};
}
bool is_number(const Obj& o) {
  return o.type == mt::POSITIVE_INTEGER || o.type == mt::NEGATIVE_INTEGER || o.type == mt::FLOAT32 ||
         o.type == mt::FLOAT64 || o.type == mt::BOOLEAN;
}

// The value of KEY in the map M (str or bin keys, as msgpack_numpy writes bin), or nullptr.
const Obj* field_of(const Obj& m, std::string_view key) {
  for (uint32_t i = 0; i < m.via.map.size; ++i) {
    const auto& kv = m.via.map.ptr[i];
    if (is_text(kv.key) && text(kv.key) == key) return &kv.val;
  }
  return nullptr;
}

std::string printable(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 40)) out += (c >= 32 && c < 127) ? c : '?';
  return out;
}

// A NumPy dtype string ("<f4", "|u1", "|b1", "=i8") -> (ATen dtype, item size). Big-endian arrays of more than one
// byte are refused (every platform the clients run on is little-endian; NumPy sends native order).
std::pair<at::ScalarType, size_t> numpy_dtype(const std::string& field, std::string_view s) {
  const std::string shown = printable(s);
  if (s.size() < 3 || std::string_view("<>|=").find(s[0]) == std::string_view::npos)
    throw bad(field, "dtype '" + shown + "' is not a NumPy dtype string such as '<f4'");
  const char kind = s[1];
  const std::string_view bytes = s.substr(2);
  int n = 0;
  for (char c : bytes) {
    if (c < '0' || c > '9' || n > 64) throw bad(field, "dtype '" + shown + "': bad item size");
    n = n * 10 + (c - '0');
  }
  if (s[0] == '>' && n > 1) throw bad(field, "dtype '" + shown + "' is big-endian: send little-endian arrays");
  auto pick = [&]() -> std::optional<at::ScalarType> {
    switch (kind) {
      case 'b': if (n == 1) return at::kBool; break;
      case 'i':
        if (n == 1) return at::kChar;
        if (n == 2) return at::kShort;
        if (n == 4) return at::kInt;
        if (n == 8) return at::kLong;
        break;
      case 'u':
        if (n == 1) return at::kByte;
        if (n == 2) return at::kUInt16;
        if (n == 4) return at::kUInt32;
        break;
      case 'f':
        if (n == 2) return at::kHalf;
        if (n == 4) return at::kFloat;
        if (n == 8) return at::kDouble;
        break;
      default: break;
    }
    return std::nullopt;
  }();
  if (!pick)
    throw bad(field, "dtype '" + shown + "' is not supported (bool, int8..64, uint8..32, float16/32/64; text goes in "
                     "'prompt' as a str)");
  return {*pick, static_cast<size_t>(n)};
}

at::Tensor ndarray(const std::string& field, const Obj& m) {
  const Obj* data = field_of(m, "data");
  const Obj* dtype = field_of(m, "dtype");
  const Obj* shape = field_of(m, "shape");
  if (!data || !dtype || !shape) throw bad(field, "a NumPy array needs 'data', 'dtype' and 'shape'");
  if (!is_text(*data)) throw bad(field, "a NumPy array's 'data' is not bytes");
  if (!is_text(*dtype)) throw bad(field, "a NumPy array's 'dtype' is not a string");
  if (shape->type != mt::ARRAY) throw bad(field, "a NumPy array's 'shape' is not a list");
  auto [st, item] = numpy_dtype(field, text(*dtype));
  if (shape->via.array.size > static_cast<uint32_t>(kMaxDims))
    throw bad(field, "a NumPy array of more than " + std::to_string(kMaxDims) + " dimensions");
  std::vector<int64_t> dims;
  uint64_t count = 1;
  for (uint32_t i = 0; i < shape->via.array.size; ++i) {
    const Obj& d = shape->via.array.ptr[i];
    if (d.type != mt::POSITIVE_INTEGER) throw bad(field, "a NumPy array's 'shape' holds a non-integer or negative size");
    if (d.via.u64 > (uint64_t(1) << 40)) throw bad(field, "a NumPy array dimension of " + std::to_string(d.via.u64));
    dims.push_back(static_cast<int64_t>(d.via.u64));
    count *= d.via.u64;
    if (count > (uint64_t(1) << 40)) throw bad(field, "a NumPy array of too many elements");
  }
  const std::string_view bytes = text(*data);
  if (bytes.size() != count * item) {
    std::string shp;
    for (size_t i = 0; i < dims.size(); ++i) shp += (i ? ", " : "") + std::to_string(dims[i]);
    throw bad(field, "a NumPy array of shape [" + shp + "] and dtype '" + printable(text(*dtype)) + "' takes " +
                         std::to_string(count * item) + " bytes, 'data' holds " + std::to_string(bytes.size()));
  }
  at::Tensor t = at::empty(dims, at::TensorOptions().dtype(st));
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  if (st == at::kBool) {
    // NumPy's bools are bytes 0 / 1; anything else would be an invalid bool in ATen
    auto* p = static_cast<uint8_t*>(t.data_ptr());
    for (int64_t i = 0; i < t.numel(); ++i)
      if (p[i] > 1) throw bad(field, "a bool array holds a byte other than 0 or 1");
  }
  return t;
}

at::Tensor number(const std::string& field, const Obj& o, std::optional<at::ScalarType> st = std::nullopt) {
  switch (o.type) {
    case mt::BOOLEAN: return at::scalar_tensor(o.via.boolean, at::TensorOptions().dtype(st.value_or(at::kBool)));
    case mt::POSITIVE_INTEGER:
      if (o.via.u64 > uint64_t(std::numeric_limits<int64_t>::max())) throw bad(field, "an integer beyond int64");
      return at::scalar_tensor(static_cast<int64_t>(o.via.u64), at::TensorOptions().dtype(st.value_or(at::kLong)));
    case mt::NEGATIVE_INTEGER:
      return at::scalar_tensor(o.via.i64, at::TensorOptions().dtype(st.value_or(at::kLong)));
    case mt::FLOAT32:
    case mt::FLOAT64: return at::scalar_tensor(o.via.f64, at::TensorOptions().dtype(st.value_or(at::kDouble)));
    default: throw bad(field, "not a number");
  }
}

// A NumPy scalar: {__npgeneric__, data: <number>, dtype}.
at::Tensor npgeneric(const std::string& field, const Obj& m) {
  const Obj* data = field_of(m, "data");
  const Obj* dtype = field_of(m, "dtype");
  if (!data || !dtype || !is_text(*dtype)) throw bad(field, "a NumPy scalar needs 'data' and 'dtype'");
  if (!is_number(*data)) throw bad(field, "a NumPy scalar's 'data' is not a number");
  const at::ScalarType st = numpy_dtype(field, text(*dtype)).first;
  try {
    return number(field, *data, st);
  } catch (const Error&) {
    throw;
  } catch (const std::exception&) {  // ATen refuses a value out of the dtype's range
    throw bad(field, "a NumPy scalar whose value does not fit its dtype '" + printable(text(*dtype)) + "'");
  }
}

// A rectangular list of numbers (nested lists) -> int64 (all integers) or float64. The first path down fixes the
// shape; every list at a depth must have that depth's length and every number must sit at the last depth.
void list_shape(const std::string& field, const Obj& o, size_t depth, std::vector<int64_t>& shape, int& leaf_depth) {
  const char* ragged = "a list whose items are not all lists of the same length";
  if (o.type != mt::ARRAY) {
    if (!is_number(o)) throw bad(field, "a list holding something other than numbers");
    if (depth != shape.size() || (leaf_depth >= 0 && leaf_depth != static_cast<int>(depth))) throw bad(field, ragged);
    leaf_depth = static_cast<int>(depth);
    return;
  }
  if (depth == shape.size()) {
    if (leaf_depth >= 0) throw bad(field, ragged);
    if (depth >= static_cast<size_t>(kMaxDims)) throw bad(field, "a list nested too deep");
    shape.push_back(o.via.array.size);
  } else if (depth > shape.size() || shape[depth] != static_cast<int64_t>(o.via.array.size)) {
    throw bad(field, ragged);
  }
  for (uint32_t i = 0; i < o.via.array.size; ++i) list_shape(field, o.via.array.ptr[i], depth + 1, shape, leaf_depth);
}
void list_values(const Obj& o, std::vector<double>& f, std::vector<int64_t>& i, bool& all_int) {
  if (o.type == mt::ARRAY) {
    for (uint32_t k = 0; k < o.via.array.size; ++k) list_values(o.via.array.ptr[k], f, i, all_int);
    return;
  }
  switch (o.type) {
    case mt::BOOLEAN: i.push_back(o.via.boolean); f.push_back(o.via.boolean); break;
    case mt::POSITIVE_INTEGER: i.push_back(static_cast<int64_t>(o.via.u64)); f.push_back(double(o.via.u64)); break;
    case mt::NEGATIVE_INTEGER: i.push_back(o.via.i64); f.push_back(double(o.via.i64)); break;
    default: all_int = false; i.push_back(0); f.push_back(o.via.f64); break;
  }
}
at::Tensor list(const std::string& field, const Obj& o) {
  std::vector<int64_t> shape;
  int leaf_depth = -1;
  list_shape(field, o, 0, shape, leaf_depth);
  std::vector<double> f;
  std::vector<int64_t> i;
  bool all_int = true;
  list_values(o, f, i, all_int);
  if (all_int) return at::tensor(i, at::kLong).reshape(shape);
  return at::tensor(f, at::kDouble).reshape(shape);
}

void flatten(const std::string& prefix, const Obj& m, Request& out) {
  for (uint32_t k = 0; k < m.via.map.size; ++k) {
    const auto& kv = m.via.map.ptr[k];
    if (!is_text(kv.key))
      throw bad(prefix, "a map key that is not a string (observations are named by their feature names)");
    const std::string key(text(kv.key));
    const std::string name = prefix.empty() ? key : prefix + "." + key;
    const Obj& v = kv.val;
    if (name == "prompt") {
      if (v.type != mt::STR) throw bad(name, "the prompt is not a str");
      out.prompt = std::string(text(v));
      continue;
    }
    at::Tensor t;
    if (v.type == mt::MAP) {
      if (field_of(v, "__ndarray__")) {
        t = ndarray(name, v);
      } else if (field_of(v, "__npgeneric__")) {
        t = npgeneric(name, v);
      } else {
        flatten(name, v, out);
        continue;
      }
    } else if (v.type == mt::ARRAY) {
      t = list(name, v);
    } else if (is_number(v)) {
      t = number(name, v);
    } else if (v.type == mt::STR) {
      throw bad(name, "text (a str): only 'prompt' is text");
    } else {
      throw bad(name, "neither a NumPy array, a number nor a list of numbers");
    }
    if (!out.observation.emplace(name, std::move(t)).second) throw bad(name, "given twice");
  }
}

// JSON -> msgpack (str keys).
void pack_json(msgpack::packer<msgpack::sbuffer>& pk, const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: pk.pack_nil(); break;
    case nlohmann::json::value_t::boolean: v.get<bool>() ? pk.pack_true() : pk.pack_false(); break;
    case nlohmann::json::value_t::number_integer: pk.pack_int64(v.get<int64_t>()); break;
    case nlohmann::json::value_t::number_unsigned: pk.pack_uint64(v.get<uint64_t>()); break;
    case nlohmann::json::value_t::number_float: pk.pack_double(v.get<double>()); break;
    case nlohmann::json::value_t::string: {
      const auto& s = v.get_ref<const std::string&>();
      pk.pack_str(static_cast<uint32_t>(s.size()));
      pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
      break;
    }
    case nlohmann::json::value_t::array:
      pk.pack_array(static_cast<uint32_t>(v.size()));
      for (const auto& x : v) pack_json(pk, x);
      break;
    case nlohmann::json::value_t::object:
      pk.pack_map(static_cast<uint32_t>(v.size()));
      for (const auto& [k, x] : v.items()) {
        pk.pack_str(static_cast<uint32_t>(k.size()));
        pk.pack_str_body(k.data(), static_cast<uint32_t>(k.size()));
        pack_json(pk, x);
      }
      break;
    default: throw Error("serve: cannot send a JSON value of this type: " + std::string(v.type_name()));
  }
}

void pack_key(msgpack::packer<msgpack::sbuffer>& pk, std::string_view k, bool bin) {
  if (bin) {
    pk.pack_bin(static_cast<uint32_t>(k.size()));
    pk.pack_bin_body(k.data(), static_cast<uint32_t>(k.size()));
  } else {
    pk.pack_str(static_cast<uint32_t>(k.size()));
    pk.pack_str_body(k.data(), static_cast<uint32_t>(k.size()));
  }
}

const char* dtype_string(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return "<f4";
    case at::kDouble: return "<f8";
    case at::kHalf: return "<f2";
    case at::kLong: return "<i8";
    case at::kInt: return "<i4";
    case at::kShort: return "<i2";
    case at::kChar: return "|i1";
    case at::kByte: return "|u1";
    case at::kBool: return "|b1";
    default: throw Error(std::string("serve: cannot send a tensor of dtype ") + c10::toString(st));
  }
}

// A tensor as msgpack_numpy's array map (its keys as bin, as Python's msgpack packs bytes).
void pack_array(msgpack::packer<msgpack::sbuffer>& pk, const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  const char* dt = dtype_string(c.scalar_type());
  pk.pack_map(4);
  pack_key(pk, "__ndarray__", true);
  pk.pack_true();
  pack_key(pk, "data", true);
  const size_t n = c.numel() * c.element_size();
  pk.pack_bin(static_cast<uint32_t>(n));
  pk.pack_bin_body(static_cast<const char*>(c.data_ptr()), static_cast<uint32_t>(n));
  pack_key(pk, "dtype", true);
  pack_key(pk, dt, false);
  pack_key(pk, "shape", true);
  pk.pack_array(static_cast<uint32_t>(c.dim()));
  for (int64_t d : c.sizes()) pk.pack_int64(d);
}

}  // namespace

Request decode_request(const char* data, size_t size) {
  msgpack::object_handle oh;
  size_t off = 0;
  // reference the message's bytes instead of copying them: they outlive the decoded object
  auto refer = [](mt::object_type, size_t, void*) { return true; };
  try {
    msgpack::unpack_limit limit(kMaxArray, kMaxMap, kMaxStr, size, 0, kMaxDepth);
    oh = msgpack::unpack(data, size, off, refer, nullptr, limit);
  } catch (const std::bad_alloc&) {
    throw bad("", "not a msgpack message (it declares more than memory allows)");
  } catch (const std::exception& e) {
    throw bad("", std::string("not a msgpack message (") + e.what() + ")");
  }
  if (off != size) throw bad("", "not one msgpack message (" + std::to_string(size - off) + " bytes after its end)");
  const Obj& top = oh.get();
  if (top.type != mt::MAP) throw bad("", "not a map of observations");
  Request r;
  flatten("", top, r);
  return r;
}

std::string encode_reply(const at::Tensor& actions, const nlohmann::json& extra) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(static_cast<uint32_t>(1 + (extra.is_object() ? extra.size() : 0)));
  pack_key(pk, "actions", false);
  pack_array(pk, actions);
  if (extra.is_object()) {
    for (const auto& [k, v] : extra.items()) {
      pack_key(pk, k, false);
      pack_json(pk, v);
    }
  }
  return std::string(buf.data(), buf.size());
}

std::string encode_json(const nlohmann::json& value) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pack_json(pk, value);
  return std::string(buf.data(), buf.size());
}

std::string encode_array(const at::Tensor& t) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pack_array(pk, t);
  return std::string(buf.data(), buf.size());
}

}  // namespace lf::serve

#else  // no msgpack-cxx headers

namespace lf::serve {
Request decode_request(const char*, size_t) { throw Error(missing_message()); }
std::string encode_reply(const at::Tensor&, const nlohmann::json&) { throw Error(missing_message()); }
std::string encode_json(const nlohmann::json&) { throw Error(missing_message()); }
std::string encode_array(const at::Tensor&) { throw Error(missing_message()); }
}  // namespace lf::serve

#endif
