#include "loongforge/data/jinja/value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace lf::data::jinja {

const Value* Args::get(size_t idx, const char* name) const {
  if (idx < pos.size()) return &pos[idx];
  for (const auto& [k, v] : kw)
    if (k == name) return &v;
  return nullptr;
}

void check_string_size(size_t n) {
  if (n > kMaxStringBytes)
    throw LimitError("the template built a string of " + std::to_string(n) + " bytes (the limit is " +
                     std::to_string(kMaxStringBytes) + ")");
}

void check_list_size(size_t n) {
  if (n > kMaxListItems)
    throw LimitError("the template built a sequence of " + std::to_string(n) + " items (the limit is " +
                     std::to_string(kMaxListItems) + ")");
}

static int nest(int depth) {
  if (depth > kMaxNesting)
    throw LimitError("the template nested values more than " + std::to_string(kMaxNesting) + " levels deep");
  return depth;
}

Value Value::list(List x) {
  check_list_size(x.size());
  int depth = 0;
  for (const auto& e : x) depth = std::max(depth, e.depth);
  Value v;
  v.t = T::List;
  v.depth = nest(depth + 1);
  v.l = std::make_shared<const List>(std::move(x));
  return v;
}

Value Value::dict(Dict x) {
  check_list_size(x.size());
  int depth = 0;
  for (const auto& kv : x) depth = std::max(depth, kv.second.depth);
  Value v;
  v.t = T::Dict;
  v.depth = nest(depth + 1);
  v.d = std::make_shared<Dict>(std::move(x));
  return v;
}

bool Value::truthy() const {
  switch (t) {
    case T::Undef: case T::None: return false;
    case T::Bool: return b;
    case T::Int: return i != 0;
    case T::Float: return f != 0;
    case T::Str: return !s.empty();
    case T::List: return !l->empty();
    case T::Dict: return !d->empty();
    default: return true;
  }
}

const Value* Value::find(const std::string& key) const {
  if (t != T::Dict && t != T::NS) return nullptr;
  for (const auto& [k, v] : *d)
    if (k == key) return &v;
  return nullptr;
}

const char* type_name(const Value& v) {
  switch (v.t) {
    case T::Undef: return "Undefined";
    case T::None: return "NoneType";
    case T::Bool: return "bool";
    case T::Int: return "int";
    case T::Float: return "float";
    case T::Str: return "str";
    case T::List: return "list";
    case T::Dict: return "dict";
    case T::NS: return "Namespace";
    default: return "function";
  }
}

// ------------------------------------------------------------------------------------------------ UTF-8

std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    unsigned char c = s[i];
    int n = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : -1;
    if (n < 0 || i + n >= s.size()) { out.push_back(0xFFFD); ++i; continue; }
    char32_t cp = n == 0 ? c : n == 1 ? (c & 0x1F) : n == 2 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k <= n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += n + 1;
  }
  return out;
}

static void put_utf8(std::string& o, char32_t c) {
  if (c < 0x80) {
    o += char(c);
  } else if (c < 0x800) {
    o += char(0xC0 | (c >> 6));
    o += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    o += char(0xE0 | (c >> 12));
    o += char(0x80 | ((c >> 6) & 0x3F));
    o += char(0x80 | (c & 0x3F));
  } else {
    o += char(0xF0 | (c >> 18));
    o += char(0x80 | ((c >> 12) & 0x3F));
    o += char(0x80 | ((c >> 6) & 0x3F));
    o += char(0x80 | (c & 0x3F));
  }
}

std::string utf8_encode(std::u32string_view s) {
  std::string o;
  o.reserve(s.size());
  for (char32_t c : s) put_utf8(o, c);
  return o;
}

bool py_isspace(char32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// ------------------------------------------------------------------------------------------------ str / repr

std::string py_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  char buf[40];
  for (int p = 1; p <= 17; ++p) {  // shortest round-tripping digits
    std::snprintf(buf, sizeof buf, "%.*e", p - 1, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::string s(buf);
  bool neg = s[0] == '-';
  if (neg) s.erase(0, 1);
  size_t epos = s.find('e');
  int exp = std::atoi(s.c_str() + epos + 1);
  std::string digits;
  for (size_t k = 0; k < epos; ++k)
    if (s[k] != '.') digits += s[k];
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (exp >= -4 && exp < 16) {  // Python repr uses fixed notation for 1e-4 <= |x| < 1e16
    if (exp < 0) {
      out = "0." + std::string(-exp - 1, '0') + digits;
    } else if (int(digits.size()) <= exp + 1) {
      out = digits + std::string(exp + 1 - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return neg ? "-" + out : out;
}

static std::string repr_str(const std::string& s) {
  char q = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
  std::string o(1, q);
  for (char32_t c : utf8_decode(s)) {
    if (c == char32_t(q) || c == '\\') {
      o += '\\';
      o += char(c);
    } else if (c == '\n') {
      o += "\\n";
    } else if (c == '\r') {
      o += "\\r";
    } else if (c == '\t') {
      o += "\\t";
    } else if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", unsigned(c));
      o += b;
    } else {
      put_utf8(o, c);
    }
  }
  return o + q;
}

std::string repr(const Value& v) {
  switch (v.t) {
    case T::Str: return repr_str(v.s);
    case T::List: {
      std::string o = v.b ? "(" : "[";
      for (size_t k = 0; k < v.l->size(); ++k) o += (k ? ", " : "") + repr((*v.l)[k]);
      return o + (v.b ? (v.l->size() == 1 ? ",)" : ")") : "]");
    }
    case T::Dict: {
      std::string o = "{";
      for (size_t k = 0; k < v.d->size(); ++k) o += (k ? ", " : "") + repr_str((*v.d)[k].first) + ": " + repr((*v.d)[k].second);
      return o + "}";
    }
    case T::Undef: return "Undefined";
    default: return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.t) {
    case T::Undef: return "";
    case T::None: return "None";
    case T::Bool: return v.b ? "True" : "False";
    case T::Int: return std::to_string(v.i);
    case T::Float: return py_float(v.f);
    case T::Str: return v.s;
    case T::NS: return "<Namespace>";
    case T::Func: return "<function>";
    default: return repr(v);
  }
}

bool equal(const Value& a, const Value& b) {
  if (a.is_num() && b.is_num()) {
    if (a.t == T::Float || b.t == T::Float) return a.as_real() == b.as_real();
    return a.as_int() == b.as_int();
  }
  if (a.t != b.t) return false;
  switch (a.t) {
    case T::Undef: case T::None: return true;
    case T::Str: return a.s == b.s;
    case T::List:
      if (a.l->size() != b.l->size()) return false;
      for (size_t k = 0; k < a.l->size(); ++k)
        if (!equal((*a.l)[k], (*b.l)[k])) return false;
      return true;
    case T::Dict:
      if (a.d->size() != b.d->size()) return false;
      for (const auto& [k, x] : *a.d) {
        const Value* y = b.find(k);
        if (!y || !equal(x, *y)) return false;
      }
      return true;
    case T::NS: return a.d == b.d;
    default: return a.fn == b.fn;
  }
}

// ------------------------------------------------------------------------------------------------ json.dumps

static void json_str(std::string& o, const std::string& s, bool ensure_ascii) {
  o += '"';
  for (char32_t c : utf8_decode(s)) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\r': o += "\\r"; break;
      case '\t': o += "\\t"; break;
      case '\b': o += "\\b"; break;
      case '\f': o += "\\f"; break;
      default: {
        char b[16];
        if (c < 0x20 || (ensure_ascii && c > 0x7E)) {
          if (c >= 0x10000) {
            char32_t u = c - 0x10000;
            std::snprintf(b, sizeof b, "\\u%04x\\u%04x", unsigned(0xD800 + (u >> 10)), unsigned(0xDC00 + (u & 0x3FF)));
          } else {
            std::snprintf(b, sizeof b, "\\u%04x", unsigned(c));
          }
          o += b;
        } else {
          put_utf8(o, c);
        }
      }
    }
  }
  o += '"';
}

namespace {
struct JsonWriter {
  bool ensure_ascii, sort_keys;
  int indent;
  std::string item_sep, key_sep, out;

  void newline(int level) {
    out += '\n';
    out.append(size_t(indent) * level, ' ');
  }
  void write(const Value& v, int level) {
    switch (v.t) {
      case T::None: out += "null"; return;
      case T::Bool: out += v.b ? "true" : "false"; return;
      case T::Int: out += std::to_string(v.i); return;
      case T::Float:
        out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity") : py_float(v.f);
        return;
      case T::Str: json_str(out, v.s, ensure_ascii); return;
      case T::List: {
        if (v.l->empty()) { out += "[]"; return; }
        out += '[';
        for (size_t k = 0; k < v.l->size(); ++k) {
          if (k) out += item_sep;
          if (indent >= 0) newline(level + 1);
          write((*v.l)[k], level + 1);
        }
        if (indent >= 0) newline(level);
        out += ']';
        return;
      }
      case T::Dict: {
        if (v.d->empty()) { out += "{}"; return; }
        std::vector<const std::pair<std::string, Value>*> items;
        for (const auto& kv : *v.d) items.push_back(&kv);
        if (sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
        out += '{';
        for (size_t k = 0; k < items.size(); ++k) {
          if (k) out += item_sep;
          if (indent >= 0) newline(level + 1);
          json_str(out, items[k]->first, ensure_ascii);
          out += key_sep;
          write(items[k]->second, level + 1);
        }
        if (indent >= 0) newline(level);
        out += '}';
        return;
      }
      default:
        throw std::invalid_argument(std::string("Object of type ") + type_name(v) + " is not JSON serializable");
    }
  }
};
}  // namespace

std::string to_json(const Value& v, bool ensure_ascii, int indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys) {
  JsonWriter w{ensure_ascii, sort_keys, indent, item_sep, key_sep, {}};
  if (w.item_sep.empty()) w.item_sep = indent >= 0 ? "," : ", ";
  if (w.key_sep.empty()) w.key_sep = ": ";
  w.write(v, 0);
  return w.out;
}

}  // namespace lf::data::jinja
