#include "loongforge/data/jinja/interp.h"

#include <utf8proc.h>

#include <algorithm>
#include <cctype>
#include <cfenv>
#include <cmath>
#include <ctime>
#include <stdexcept>

#include "loongforge/core/error.h"

namespace lf::data::jinja {

namespace {

struct Frame {
  Frame* parent = nullptr;
  Dict vars;
  const Value* find(const std::string& n) const {
    for (const Frame* f = this; f; f = f->parent)
      for (const auto& [k, v] : f->vars)
        if (k == n) return &v;
    return nullptr;
  }
  void set(const std::string& n, Value v) {
    for (auto& [k, x] : vars)
      if (k == n) { x = std::move(v); return; }
    vars.emplace_back(n, std::move(v));
  }
};

enum class Flow { Normal, Break, Continue };

// ------------------------------------------------------------------------------------------------ string helpers

size_t cp_len(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}
std::u32string map_cp(const std::u32string& s, utf8proc_int32_t (*f)(utf8proc_int32_t)) {
  std::u32string o(s);
  for (auto& c : o) c = char32_t(f(utf8proc_int32_t(c)));
  return o;
}
std::string upper(const std::string& s) { return utf8_encode(map_cp(utf8_decode(s), utf8proc_toupper)); }
std::string lower(const std::string& s) { return utf8_encode(map_cp(utf8_decode(s), utf8proc_tolower)); }
bool is_cat(char32_t c, std::initializer_list<utf8proc_category_t> cats) {
  auto k = utf8proc_category(utf8proc_int32_t(c));
  for (auto x : cats)
    if (k == x) return true;
  return false;
}
std::string py_title(const std::string& s) {  // str.title()
  std::u32string u = utf8_decode(s);
  bool prev = false;
  for (auto& c : u) {
    if (is_cat(c, {UTF8PROC_CATEGORY_LU, UTF8PROC_CATEGORY_LT})) {
      if (prev) c = char32_t(utf8proc_tolower(utf8proc_int32_t(c)));
      prev = true;
    } else if (is_cat(c, {UTF8PROC_CATEGORY_LL})) {
      if (!prev) c = char32_t(utf8proc_totitle(utf8proc_int32_t(c)));
      prev = true;
    } else {
      prev = false;
    }
  }
  return utf8_encode(u);
}
std::string py_capitalize(const std::string& s) {
  std::u32string u = map_cp(utf8_decode(s), utf8proc_tolower);
  if (!u.empty()) u[0] = char32_t(utf8proc_totitle(utf8proc_int32_t(u[0])));
  return utf8_encode(u);
}
std::string jinja_title(const std::string& s) {  // the `title` filter: words start after - whitespace ( { [ <
  std::u32string u = utf8_decode(s);
  bool start = true;
  for (auto& c : u) {
    bool sep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c);
    if (sep) start = true;
    else {
      c = char32_t(start ? utf8proc_toupper(utf8proc_int32_t(c)) : utf8proc_tolower(utf8proc_int32_t(c)));
      start = false;
    }
  }
  return utf8_encode(u);
}
std::string strip(const std::string& s, const Value* chars, bool left, bool right) {
  std::u32string u = utf8_decode(s), set;
  bool ws = !chars || chars->t == T::None || chars->t == T::Undef;
  if (!ws) set = utf8_decode(to_str(*chars));
  auto drop = [&](char32_t c) { return ws ? py_isspace(c) : set.find(c) != std::u32string::npos; };
  size_t b = 0, e = u.size();
  if (left) while (b < e && drop(u[b])) ++b;
  if (right) while (e > b && drop(u[e - 1])) --e;
  return utf8_encode(u.substr(b, e - b));
}
std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  std::string o;
  if (from.empty()) {  // Python inserts `to` around every character
    std::u32string u = utf8_decode(s);
    int64_t n = 0;
    for (char32_t c : u) {
      if (count < 0 || n++ < count) o += to;
      o += utf8_encode(std::u32string(1, c));
    }
    if (count < 0 || n < count) o += to;
    return o;
  }
  size_t p = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    size_t q = s.find(from, p);
    if (q == std::string::npos) break;
    o.append(s, p, q - p);
    o += to;
    p = q + from.size();
    ++n;
  }
  return o + s.substr(p);
}
std::vector<std::string> split_lines(const std::string& s) {  // str.splitlines() (\n, \r\n, \r)
  std::vector<std::string> out;
  size_t p = 0;
  while (p < s.size()) {
    size_t q = s.find_first_of("\r\n", p);
    if (q == std::string::npos) { out.push_back(s.substr(p)); break; }
    out.push_back(s.substr(p, q - p));
    p = q + (s[q] == '\r' && q + 1 < s.size() && s[q + 1] == '\n' ? 2 : 1);
  }
  return out;
}
std::string html_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&#34;"; break;
      case '\'': o += "&#39;"; break;
      default: o += c;
    }
  }
  return o;
}
Value str_list(const std::vector<std::string>& v) {
  List l;
  for (const auto& s : v) l.push_back(Value::str(s));
  return Value::list(std::move(l));
}

// ------------------------------------------------------------------------------------------------ interpreter

}  // namespace

struct Interp {
  const Program& prog;
  int line = 0;

  [[noreturn]] void fail(const std::string& what) const {
    std::string msg = prog.origin + ":" + std::to_string(line) + ": " + what;
    for (char& c : msg)
      if (c == '\n' || c == '\r') c = ' ';
    throw lf::Error(msg);
  }
  void need_defined(const Value& v) const {
    if (v.t == T::Undef) fail(v.s);
  }
  int64_t need_int(const Value* v, int64_t dflt, const char* what) const {
    if (!v || v->t == T::None) return dflt;
    if (!v->is_int()) fail(std::string(what) + " must be an integer, not " + type_name(*v));
    return v->as_int();
  }

  // ---------------------------------------------------------------------------------- access
  static Value no_attr(const Value& o, const std::string& n) {
    std::string why = "'";  // built by append: GCC 12 warns falsely (-Wstringop-overflow) on the + chain
    why.append(type_name(o)).append(" object' has no attribute '").append(n).append("'");
    return Value::undef(std::move(why));
  }
  Value getattr(const Value& o, const std::string& n) const {
    need_defined(o);
    if (const Value* v = o.find(n)) return *v;
    return no_attr(o, n);
  }
  Value getitem(const Value& o, const Value& key) const {
    need_defined(o);
    if (o.t == T::Dict || o.t == T::NS) {
      if (const Value* v = o.find(key.t == T::Str ? key.s : to_str(key))) return *v;
      return Value::undef("'" + std::string(type_name(o)) + " object' has no attribute " + repr(key));
    }
    if ((o.t == T::List || o.t == T::Str) && key.is_int()) {
      int64_t n = o.t == T::List ? int64_t(o.l->size()) : int64_t(cp_len(o.s)), k = key.as_int();
      if (k < 0) k += n;
      if (k < 0 || k >= n) return Value::undef(std::string(type_name(o)) + " object has no element " + to_str(key));
      if (o.t == T::List) return (*o.l)[size_t(k)];
      return Value::str(utf8_encode(utf8_decode(o.s).substr(size_t(k), 1)));
    }
    if (key.t == T::Str) return no_attr(o, key.s);
    return Value::undef(std::string(type_name(o)) + " object has no element " + repr(key));
  }
  Value slice(const Value& o, const Value& a, const Value& b, const Value& c) const {
    need_defined(o);
    if (o.t != T::List && o.t != T::Str) fail(std::string("'") + type_name(o) + "' object is not subscriptable");
    auto opt = [&](const Value& v) { return v.t == T::None || v.t == T::Undef; };
    std::u32string u;
    if (o.t == T::Str) u = utf8_decode(o.s);
    int64_t n = o.t == T::List ? int64_t(o.l->size()) : int64_t(u.size());
    int64_t step = opt(c) ? 1 : need_int(&c, 1, "slice step");
    if (step == 0) fail("slice step cannot be zero");
    auto clamp = [&](const Value& v, int64_t dflt, int64_t lo, int64_t hi) {
      if (opt(v)) return dflt;
      int64_t x = need_int(&v, 0, "slice index");
      if (x < 0) x += n;
      return std::clamp(x, lo, hi);
    };
    int64_t start = step > 0 ? clamp(a, 0, 0, n) : clamp(a, n - 1, -1, n - 1);
    int64_t stop = step > 0 ? clamp(b, n, 0, n) : clamp(b, -1, -1, n - 1);
    List l;
    std::u32string s;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
      if (o.t == T::List) l.push_back((*o.l)[size_t(k)]);
      else s.push_back(u[size_t(k)]);
    }
    return o.t == T::List ? Value::list(std::move(l)) : Value::str(utf8_encode(s));
  }
  List iterate(const Value& v) const {
    switch (v.t) {
      case T::Undef: return {};
      case T::List: return *v.l;
      case T::Dict: {
        List l;
        for (const auto& kv : *v.d) l.push_back(Value::str(kv.first));
        return l;
      }
      case T::Str: {
        List l;
        for (char32_t c : utf8_decode(v.s)) l.push_back(Value::str(utf8_encode(std::u32string(1, c))));
        return l;
      }
      default: fail(std::string("'") + type_name(v) + "' object is not iterable");
    }
  }
  bool contains(const Value& c, const Value& x) const {
    switch (c.t) {
      case T::Undef: return false;
      case T::Str:
        if (x.t != T::Str) fail(std::string("'in <string>' requires string as left operand, not ") + type_name(x));
        return c.s.find(x.s) != std::string::npos;
      case T::List:
        for (const auto& e : *c.l)
          if (equal(e, x)) return true;
        return false;
      case T::Dict: case T::NS: return x.t == T::Str && c.find(x.s);
      default: fail(std::string("argument of type '") + type_name(c) + "' is not iterable");
    }
  }
  int order(const Value& a, const Value& b, const std::string& op) const {
    need_defined(a);
    need_defined(b);
    if (a.is_num() && b.is_num()) {
      if (a.t == T::Float || b.t == T::Float) return a.as_real() < b.as_real() ? -1 : a.as_real() > b.as_real();
      return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int();
    }
    if (a.t == T::Str && b.t == T::Str) return a.s < b.s ? -1 : a.s > b.s;
    if (a.t == T::List && b.t == T::List) {
      for (size_t k = 0; k < std::min(a.l->size(), b.l->size()); ++k)
        if (!equal((*a.l)[k], (*b.l)[k])) return order((*a.l)[k], (*b.l)[k], op);
      return a.l->size() < b.l->size() ? -1 : a.l->size() > b.l->size();
    }
    fail("'" + op + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
  }
  bool compare(const std::string& op, const Value& a, const Value& b) const {
    if (op == "==") return equal(a, b);
    if (op == "!=") return !equal(a, b);
    if (op == "in") return contains(b, a);
    if (op == "notin") return !contains(b, a);
    int c = order(a, b, op);
    return op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
  }
  Value binop(const std::string& op, const Value& a, const Value& b) const {
    if (op == "~") return Value::str(to_str(a) + to_str(b));
    need_defined(a);
    need_defined(b);
    if (a.is_num() && b.is_num()) {
      bool fl = a.t == T::Float || b.t == T::Float;
      double x = a.as_real(), y = b.as_real();
      int64_t i = a.as_int(), j = b.as_int();
      if (op == "+") return fl ? Value::real(x + y) : Value::integer(i + j);
      if (op == "-") return fl ? Value::real(x - y) : Value::integer(i - j);
      if (op == "*") return fl ? Value::real(x * y) : Value::integer(i * j);
      if ((op == "/" || op == "//" || op == "%") && y == 0) fail("division by zero");
      if (op == "/") return Value::real(x / y);
      if (op == "//") {
        if (fl) return Value::real(std::floor(x / y));
        int64_t q = i / j;
        return Value::integer((i % j != 0 && ((i < 0) != (j < 0))) ? q - 1 : q);
      }
      if (op == "%") {
        if (fl) return Value::real(x - std::floor(x / y) * y);
        int64_t r = i % j;
        return Value::integer(r != 0 && ((r < 0) != (j < 0)) ? r + j : r);
      }
      if (op == "**") {
        if (fl || j < 0) return Value::real(std::pow(x, y));
        int64_t r = 1;
        for (int64_t k = 0; k < j; ++k) r *= i;
        return Value::integer(r);
      }
    }
    if (op == "+" && a.t == T::Str && b.t == T::Str) return Value::str(a.s + b.s);
    if (op == "+" && a.t == T::List && b.t == T::List) {
      List l(*a.l);
      l.insert(l.end(), b.l->begin(), b.l->end());
      return Value::list(std::move(l));
    }
    if (op == "*" && (a.is_int() || b.is_int()) && (a.t == T::Str || b.t == T::Str || a.t == T::List || b.t == T::List)) {
      const Value& seq = a.is_int() ? b : a;
      int64_t n = a.is_int() ? a.as_int() : b.as_int();
      if (seq.t == T::Str) {
        std::string s;
        for (int64_t k = 0; k < n; ++k) s += seq.s;
        return Value::str(s);
      }
      List l;
      for (int64_t k = 0; k < n; ++k) l.insert(l.end(), seq.l->begin(), seq.l->end());
      return Value::list(std::move(l));
    }
    fail("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  }
  Value call(const Value& fn, Args& a) {
    if (fn.t == T::Func) return (*fn.fn)(*this, a);
    need_defined(fn);
    fail(std::string("'") + type_name(fn) + "' object is not callable");
  }
  Value attr_path(const Value& v, const std::string& path) const {  // "a.b.0" as in jinja's make_attrgetter
    Value cur = v;
    size_t p = 0;
    while (true) {
      size_t q = path.find('.', p);
      std::string part = path.substr(p, q == std::string::npos ? std::string::npos : q - p);
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
      cur = cur.t == T::Undef ? cur : getitem(cur, digits ? Value::integer(std::stoll(part)) : Value::str(part));
      if (q == std::string::npos) return cur;
      p = q + 1;
    }
  }

  // ---------------------------------------------------------------------------------- methods
  bool method(const Value& o, const std::string& n, Args& a, Value& out) {
    auto arg = [&](size_t i, const char* name) { return a.get(i, name); };
    if (o.t == T::Str) {
      const std::string& s = o.s;
      if (n == "strip" || n == "lstrip" || n == "rstrip") {
        out = Value::str(strip(s, arg(0, "chars"), n != "rstrip", n != "lstrip"));
      } else if (n == "split" || n == "rsplit") {
        const Value* sep = arg(0, "sep");
        int64_t maxsplit = need_int(arg(1, "maxsplit"), -1, "maxsplit");
        std::vector<std::string> parts;
        if (!sep || sep->t == T::None) {
          std::u32string u = utf8_decode(s);
          size_t p = 0;
          while (true) {
            while (p < u.size() && py_isspace(u[p])) ++p;
            if (p >= u.size()) break;
            if (maxsplit >= 0 && int64_t(parts.size()) == maxsplit) {
              size_t e = u.size();
              while (e > p && py_isspace(u[e - 1])) --e;
              parts.push_back(utf8_encode(u.substr(p, e - p)));
              break;
            }
            size_t q = p;
            while (q < u.size() && !py_isspace(u[q])) ++q;
            parts.push_back(utf8_encode(u.substr(p, q - p)));
            p = q;
          }
        } else {
          std::string d = to_str(*sep);
          if (d.empty()) fail("empty separator");
          size_t p = 0;
          while (true) {
            size_t q = s.find(d, p);
            if (q == std::string::npos || (maxsplit >= 0 && int64_t(parts.size()) == maxsplit)) break;
            parts.push_back(s.substr(p, q - p));
            p = q + d.size();
          }
          parts.push_back(s.substr(p));
        }
        out = str_list(parts);
      } else if (n == "startswith" || n == "endswith") {
        const Value* x = arg(0, "prefix");
        if (!x) fail(n + "() takes at least 1 argument");
        List cands = x->t == T::List ? *x->l : List{*x};
        bool r = false;
        for (const auto& c : cands) {
          if (c.t != T::Str) fail(n + " first arg must be str or a tuple of str, not " + type_name(c));
          r = r || (n == "startswith" ? s.compare(0, c.s.size(), c.s) == 0
                                      : s.size() >= c.s.size() && s.compare(s.size() - c.s.size(), c.s.size(), c.s) == 0);
        }
        out = Value::boolean(r);
      } else if (n == "replace") {
        const Value *x = arg(0, "old"), *y = arg(1, "new");
        if (!x || !y) fail("replace() takes at least 2 arguments");
        out = Value::str(replace_all(s, to_str(*x), to_str(*y), need_int(arg(2, "count"), -1, "count")));
      } else if (n == "lower" || n == "upper" || n == "title" || n == "capitalize") {
        out = Value::str(n == "lower" ? lower(s) : n == "upper" ? upper(s) : n == "title" ? py_title(s) : py_capitalize(s));
      } else if (n == "find" || n == "count") {
        const Value* x = arg(0, "sub");
        if (!x || x->t != T::Str) fail(n + "() needs a string argument");
        if (n == "find") {
          size_t p = s.find(x->s);
          out = Value::integer(p == std::string::npos ? -1 : int64_t(cp_len(s.substr(0, p))));
        } else {
          out = Value::integer(x->s.empty() ? int64_t(cp_len(s)) + 1 : 0);
          for (size_t p = 0; !x->s.empty() && (p = s.find(x->s, p)) != std::string::npos; p += x->s.size()) ++out.i;
        }
      } else if (n == "join") {
        const Value* x = arg(0, "iterable");
        if (!x) fail("join() takes exactly one argument");
        std::string r;
        List items = iterate(*x);
        for (size_t k = 0; k < items.size(); ++k) {
          if (items[k].t != T::Str) fail(std::string("sequence item ") + std::to_string(k) + ": expected str instance, " + type_name(items[k]) + " found");
          r += (k ? s : "") + items[k].s;
        }
        out = Value::str(r);
      } else if (n == "splitlines") {
        out = str_list(split_lines(s));
      } else if (n == "isdigit" || n == "isspace" || n == "isalpha" || n == "isalnum") {
        std::u32string u = utf8_decode(s);
        bool r = !u.empty();
        for (char32_t c : u) {
          bool d = is_cat(c, {UTF8PROC_CATEGORY_ND}), al = is_cat(c, {UTF8PROC_CATEGORY_LU, UTF8PROC_CATEGORY_LL, UTF8PROC_CATEGORY_LT, UTF8PROC_CATEGORY_LM, UTF8PROC_CATEGORY_LO});
          r = r && (n == "isdigit" ? d : n == "isspace" ? py_isspace(c) : n == "isalpha" ? al : (al || d));
        }
        out = Value::boolean(r);
      } else if (n == "format") {
        out = Value::str(format(s, a));
      } else {
        return false;
      }
      return true;
    }
    if (o.t == T::Dict) {
      if (n == "get") {
        const Value* k = arg(0, "key");
        if (!k) fail("get expected at least 1 argument");
        const Value* v = o.find(k->t == T::Str ? k->s : to_str(*k));
        const Value* d = arg(1, "default");
        out = v ? *v : d ? *d : Value::none();
      } else if (n == "items") {
        List l;
        for (const auto& [k, v] : *o.d) l.push_back(Value::tuple({Value::str(k), v}));
        out = Value::list(std::move(l));
      } else if (n == "keys") {
        out = Value::list(iterate(o));
      } else if (n == "values") {
        List l;
        for (const auto& kv : *o.d) l.push_back(kv.second);
        out = Value::list(std::move(l));
      } else {
        return false;
      }
      return true;
    }
    if (o.t == T::List && (n == "index" || n == "count")) {
      const Value* x = arg(0, "value");
      if (!x) fail(n + "() takes exactly one argument");
      int64_t c = 0, idx = -1;
      for (size_t k = 0; k < o.l->size(); ++k)
        if (equal((*o.l)[k], *x)) { ++c; if (idx < 0) idx = int64_t(k); }
      if (n == "index" && idx < 0) fail(repr(*x) + " is not in list");
      out = Value::integer(n == "index" ? idx : c);
      return true;
    }
    return false;
  }
  std::string format(const std::string& s, const Args& a) {  // str.format with {}, {0}, {name}
    std::string o;
    size_t auto_idx = 0;
    for (size_t p = 0; p < s.size(); ++p) {
      if ((s[p] == '{' || s[p] == '}') && p + 1 < s.size() && s[p + 1] == s[p]) { o += s[p++]; continue; }
      if (s[p] != '{') { o += s[p]; continue; }
      size_t q = s.find('}', p);
      if (q == std::string::npos) fail("Single '{' encountered in format string");
      std::string field = s.substr(p + 1, q - p - 1);
      field = field.substr(0, field.find(':'));
      const Value* v = nullptr;
      if (field.empty()) v = a.get(auto_idx++, "");
      else if (std::all_of(field.begin(), field.end(), ::isdigit)) v = a.get(std::stoul(field), "");
      else v = a.get(size_t(-1), field.c_str());
      if (!v) fail("format(): missing argument '" + field + "'");
      o += to_str(*v);
      p = q;
    }
    return o;
  }

  // ---------------------------------------------------------------------------------- tests
  bool test(const std::string& n, const Value& v, const Args& a) {
    const Value* x = a.get(0, "value");
    auto need = [&]() -> const Value& {
      if (!x) fail("test '" + n + "' needs an argument");
      return *x;
    };
    if (n == "defined") return v.t != T::Undef;
    if (n == "undefined") return v.t == T::Undef;
    if (n == "none") return v.t == T::None;
    if (n == "boolean") return v.t == T::Bool;
    if (n == "true") return v.t == T::Bool && v.b;
    if (n == "false") return v.t == T::Bool && !v.b;
    if (n == "string") return v.t == T::Str;
    if (n == "number") return v.is_num();
    if (n == "integer") return v.t == T::Int;
    if (n == "float") return v.t == T::Float;
    if (n == "mapping") return v.t == T::Dict;
    if (n == "iterable" || n == "sequence") return v.t == T::List || v.t == T::Dict || v.t == T::Str || v.t == T::Undef;
    if (n == "callable") return v.t == T::Func;
    if (n == "odd" || n == "even") {
      if (!v.is_int()) fail("test '" + n + "' needs an integer");
      return (v.as_int() % 2 != 0) == (n == "odd");
    }
    if (n == "divisibleby") {
      int64_t d = need_int(&need(), 1, "divisor");
      if (d == 0) fail("division by zero");
      return v.is_int() ? v.as_int() % d == 0 : std::fmod(v.as_real(), double(d)) == 0;
    }
    if (n == "eq" || n == "equalto" || n == "==") return equal(v, need());
    if (n == "ne" || n == "!=") return !equal(v, need());
    if (n == "lt" || n == "<") return order(v, need(), "<") < 0;
    if (n == "le" || n == "<=") return order(v, need(), "<=") <= 0;
    if (n == "gt" || n == ">") return order(v, need(), ">") > 0;
    if (n == "ge" || n == ">=") return order(v, need(), ">=") >= 0;
    if (n == "in") return contains(need(), v);
    if (n == "sameas") return v.t == need().t && (v.t == T::List ? v.l == x->l : v.t == T::Dict || v.t == T::NS ? v.d == x->d : equal(v, *x));
    if (n == "lower" || n == "upper") {
      std::string s = to_str(v);
      return (n == "lower" ? lower(s) : upper(s)) == s && lower(s) != upper(s);
    }
    fail("unknown test '" + n + "'");
  }

  // ---------------------------------------------------------------------------------- filters
  Value select(const Value& v, const Args& a, bool by_attr, bool keep) {
    List out;
    size_t first = by_attr ? 1 : 0;
    std::string attr;
    if (by_attr) {
      const Value* x = a.get(0, "attr");
      if (!x) fail("selectattr/rejectattr needs an attribute name");
      attr = to_str(*x);
    }
    const Value* tn = a.get(first, "");
    Args targs;
    for (size_t k = first + 1; k < a.pos.size(); ++k) targs.pos.push_back(a.pos[k]);
    if (tn && !known_test(to_str(*tn))) fail("unknown test '" + to_str(*tn) + "'");
    for (const auto& item : iterate(v)) {
      Value x = by_attr ? attr_path(item, attr) : item;
      bool r = tn ? test(to_str(*tn), x, targs) : x.truthy();
      if (r == keep) out.push_back(item);
    }
    return Value::list(std::move(out));
  }
  Value sorted(const Value& v, bool reverse, bool case_sensitive, const Value* attr) {
    List l = iterate(v);
    auto key = [&](const Value& x) {
      Value k = attr && attr->t != T::None ? attr_path(x, to_str(*attr)) : x;
      return (!case_sensitive && k.t == T::Str) ? Value::str(lower(k.s)) : k;
    };
    std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
      return reverse ? order(key(y), key(x), "<") < 0 : order(key(x), key(y), "<") < 0;
    });
    return Value::list(std::move(l));
  }
  Value filter(const std::string& n, const Value& v, Args& a) {
    auto arg = [&](size_t i, const char* name) { return a.get(i, name); };
    auto flag = [&](size_t i, const char* name) { const Value* x = arg(i, name); return x && x->truthy(); };
    if (n == "safe" || n == "string") return v.t == T::Str ? v : Value::str(to_str(v));
    if (n == "trim") return Value::str(strip(to_str(v), arg(0, "chars"), true, true));
    if (n == "length" || n == "count") {
      switch (v.t) {
        case T::Undef: return Value::integer(0);
        case T::Str: return Value::integer(int64_t(cp_len(v.s)));
        case T::List: return Value::integer(int64_t(v.l->size()));
        case T::Dict: case T::NS: return Value::integer(int64_t(v.d->size()));
        default: fail(std::string("object of type '") + type_name(v) + "' has no len()");
      }
    }
    if (n == "lower") return Value::str(lower(to_str(v)));
    if (n == "upper") return Value::str(upper(to_str(v)));
    if (n == "capitalize") return Value::str(py_capitalize(to_str(v)));
    if (n == "title") return Value::str(jinja_title(to_str(v)));
    if (n == "escape" || n == "e") return Value::str(html_escape(to_str(v)));
    if (n == "tojson") {  // transformers: json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
      const Value* ind = arg(1, "indent");
      const Value* seps = arg(2, "separators");
      std::string is, ks;
      if (seps && seps->t == T::List && seps->l->size() == 2) is = to_str((*seps->l)[0]), ks = to_str((*seps->l)[1]);
      try {
        return Value::str(to_json(v, flag(0, "ensure_ascii"), ind && ind->t != T::None ? int(need_int(ind, 0, "indent")) : -1,
                                  is, ks, flag(3, "sort_keys")));
      } catch (const std::invalid_argument& e) {
        fail(e.what());
      }
    }
    if (n == "join") {
      const Value* sep = arg(0, "d");
      const Value* attr = arg(1, "attribute");
      std::string o, d = sep ? to_str(*sep) : "";
      List items = iterate(v);
      for (size_t k = 0; k < items.size(); ++k)
        o += (k ? d : "") + to_str(attr && attr->t != T::None ? attr_path(items[k], to_str(*attr)) : items[k]);
      return Value::str(o);
    }
    if (n == "first" || n == "last") {
      List items = iterate(v);
      if (items.empty()) return Value::undef("No " + n + " item, sequence was empty.");
      return n == "first" ? items.front() : items.back();
    }
    if (n == "default" || n == "d") {
      const Value* d = arg(0, "default_value");
      if (v.t == T::Undef || (flag(1, "boolean") && !v.truthy())) return d ? *d : Value::str("");
      return v;
    }
    if (n == "items") {
      if (v.t == T::Undef) return Value::list({});
      if (v.t != T::Dict) fail("can only get item pairs from a mapping.");
      List l;
      for (const auto& [k, x] : *v.d) l.push_back(Value::tuple({Value::str(k), x}));
      return Value::list(std::move(l));
    }
    if (n == "dictsort") {
      if (v.t != T::Dict) fail("dictsort needs a mapping");
      Value items = filter("items", v, a);
      List l = *items.l;
      bool cs = flag(0, "case_sensitive"), by_value = arg(1, "by") && to_str(*arg(1, "by")) == "value";
      std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
        Value kx = (*x.l)[by_value], ky = (*y.l)[by_value];
        if (!cs && kx.t == T::Str && ky.t == T::Str) kx.s = lower(kx.s), ky.s = lower(ky.s);
        return flag(2, "reverse") ? order(ky, kx, "<") < 0 : order(kx, ky, "<") < 0;
      });
      return Value::list(std::move(l));
    }
    if (n == "list") return Value::list(iterate(v));
    if (n == "int" || n == "float") {
      const Value* d = arg(0, "default");
      Value dflt = d ? *d : n == "int" ? Value::integer(0) : Value::real(0);
      double x = 0;
      if (v.is_num()) {
        x = v.as_real();
        if (n == "int" && v.is_int()) return Value::integer(v.as_int());
      } else if (v.t == T::Str) {
        std::string s = strip(v.s, nullptr, true, true);
        s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
        char* end = nullptr;
        if (n == "int") {
          long long i = std::strtoll(s.c_str(), &end, int(need_int(arg(1, "base"), 10, "base")));
          if (!s.empty() && *end == 0) return Value::integer(i);
        }
        x = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != 0) return dflt;
      } else {
        return dflt;
      }
      return n == "int" ? Value::integer(int64_t(x)) : Value::real(x);
    }
    if (n == "replace") {
      const Value *x = arg(0, "old"), *y = arg(1, "new");
      if (!x || !y) fail("replace needs two arguments");
      return Value::str(replace_all(to_str(v), to_str(*x), to_str(*y), need_int(arg(2, "count"), -1, "count")));
    }
    if (n == "selectattr" || n == "rejectattr") return select(v, a, true, n == "selectattr");
    if (n == "select" || n == "reject") return select(v, a, false, n == "select");
    if (n == "map") {
      List out;
      const Value* attr = a.get(size_t(-1), "attribute");
      if (attr) {
        const Value* d = a.get(size_t(-1), "default");
        for (const auto& item : iterate(v)) {
          Value x = attr_path(item, to_str(*attr));
          out.push_back(x.t == T::Undef && d ? *d : x);
        }
      } else {
        if (a.pos.empty()) fail("map needs a filter name or attribute=");
        std::string f = to_str(a.pos[0]);
        if (!known_filter(f)) fail("unknown filter '" + f + "'");
        Args fa;
        fa.pos.assign(a.pos.begin() + 1, a.pos.end());
        fa.kw = a.kw;
        for (const auto& item : iterate(v)) out.push_back(filter(f, item, fa));
      }
      return Value::list(std::move(out));
    }
    if (n == "abs") {
      need_defined(v);
      if (v.t == T::Float) return Value::real(std::fabs(v.f));
      if (v.is_int()) return Value::integer(std::llabs(v.as_int()));
      fail(std::string("bad operand type for abs(): '") + type_name(v) + "'");
    }
    if (n == "round") {
      need_defined(v);
      if (!v.is_num()) fail(std::string("round needs a number, not ") + type_name(v));
      int64_t prec = need_int(arg(0, "precision"), 0, "precision");
      std::string method = arg(1, "method") ? to_str(*arg(1, "method")) : "common";
      double scale = std::pow(10.0, double(prec)), x = v.as_real() * scale;
      if (method == "common") {
        if (v.t != T::Float) return Value::integer(v.as_int());
        std::fesetround(FE_TONEAREST);
        return Value::real(std::nearbyint(x) / scale);
      }
      if (method != "ceil" && method != "floor") fail("method must be common, ceil or floor");
      return Value::real((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
    }
    if (n == "attr") {
      const Value* x = arg(0, "name");
      if (!x) fail("attr needs a name");
      return v.t == T::Undef ? v : getattr(v, to_str(*x));
    }
    if (n == "indent") {
      const Value* w = arg(0, "width");
      std::string ind = w && w->t == T::Str ? w->s : std::string(size_t(need_int(w, 4, "width")), ' ');
      std::vector<std::string> lines = split_lines(to_str(v) + "\n");
      std::string o;
      for (size_t k = 0; k < lines.size(); ++k) {
        if (k) o += "\n";
        bool pad = k ? (flag(2, "blank") || !lines[k].empty()) : flag(1, "first");
        o += (pad ? ind : "") + lines[k];
      }
      return Value::str(o);
    }
    if (n == "max" || n == "min") {
      List l = iterate(v);
      if (l.empty()) return Value::undef("No aggregated item, sequence was empty.");
      Value s = sorted(Value::list(l), n == "max", flag(0, "case_sensitive"), arg(1, "attribute"));
      return s.l->front();
    }
    if (n == "sum") {
      const Value* attr = arg(0, "attribute");
      const Value* start = arg(1, "start");
      Value total = start ? *start : Value::integer(0);
      for (const auto& x : iterate(v))
        total = binop("+", total, attr && attr->t != T::None ? attr_path(x, to_str(*attr)) : x);
      return total;
    }
    if (n == "reverse") {
      if (v.t == T::Str) {
        std::u32string u = utf8_decode(v.s);
        std::reverse(u.begin(), u.end());
        return Value::str(utf8_encode(u));
      }
      List l = iterate(v);
      std::reverse(l.begin(), l.end());
      return Value::list(std::move(l));
    }
    if (n == "sort") return sorted(v, flag(0, "reverse"), flag(1, "case_sensitive"), arg(2, "attribute"));
    if (n == "unique") {
      List out;
      bool cs = flag(0, "case_sensitive");
      const Value* attr = arg(1, "attribute");
      std::vector<Value> seen;
      for (const auto& x : iterate(v)) {
        Value k = attr && attr->t != T::None ? attr_path(x, to_str(*attr)) : x;
        if (!cs && k.t == T::Str) k.s = lower(k.s);
        if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, k); })) {
          seen.push_back(k);
          out.push_back(x);
        }
      }
      return Value::list(std::move(out));
    }
    if (n == "wordcount") {
      int64_t c = 0;
      bool in = false;
      for (char32_t ch : utf8_decode(to_str(v))) {
        bool w = ch == '_' || is_cat(ch, {UTF8PROC_CATEGORY_LU, UTF8PROC_CATEGORY_LL, UTF8PROC_CATEGORY_LT, UTF8PROC_CATEGORY_LM,
                                           UTF8PROC_CATEGORY_LO, UTF8PROC_CATEGORY_ND});
        c += w && !in;
        in = w;
      }
      return Value::integer(c);
    }
    fail("unknown filter '" + n + "'");
  }

  // ---------------------------------------------------------------------------------- evaluation
  Args args(const Expr& e, Frame& f, size_t from) {
    Args a;
    for (size_t k = from; k < e.a.size(); ++k) a.pos.push_back(eval(*e.a[k], f));
    for (const auto& [k, x] : e.kw) a.kw.emplace_back(k, eval(*x, f));
    return a;
  }
  Value eval(const Expr& e, Frame& f) {
    line = e.line;
    switch (e.k) {
      case Expr::Lit: return e.lit;
      case Expr::Name: {
        const Value* v = f.find(e.name);
        return v ? *v : Value::undef("'" + e.name + "' is undefined");
      }
      case Expr::Attr: {
        Value o = eval(*e.a[0], f);
        line = e.line;
        return getattr(o, e.name);
      }
      case Expr::Item: {
        Value o = eval(*e.a[0], f), k = eval(*e.a[1], f);
        line = e.line;
        return getitem(o, k);
      }
      case Expr::Slice: {
        Value o = eval(*e.a[0], f), p[3];
        for (int k = 0; k < 3; ++k) p[k] = e.a[k + 1] ? eval(*e.a[k + 1], f) : Value::none();
        line = e.line;
        return slice(o, p[0], p[1], p[2]);
      }
      case Expr::Call: {
        const Expr& callee = *e.a[0];
        if (callee.k == Expr::Attr) {
          Value o = eval(*callee.a[0], f);
          Args a = args(e, f, 1);
          line = e.line;
          Value out;
          if (method(o, callee.name, a, out)) return out;
          return call(getattr(o, callee.name), a);
        }
        Value fn = eval(callee, f);
        Args a = args(e, f, 1);
        line = e.line;
        return call(fn, a);
      }
      case Expr::Filter: {
        Value v = eval(*e.a[0], f);
        Args a = args(e, f, 1);
        line = e.line;
        return filter(e.name, v, a);
      }
      case Expr::Test: {
        Value v = eval(*e.a[0], f);
        Args a = args(e, f, 1);
        line = e.line;
        return Value::boolean(test(e.name, v, a) != e.negate);
      }
      case Expr::Neg: case Expr::Pos: {
        Value v = eval(*e.a[0], f);
        line = e.line;
        need_defined(v);
        if (!v.is_num()) fail(std::string("bad operand type for unary ") + (e.k == Expr::Neg ? "-" : "+") + ": '" + type_name(v) + "'");
        if (e.k == Expr::Pos) return v.t == T::Bool ? Value::integer(v.as_int()) : v;
        return v.t == T::Float ? Value::real(-v.f) : Value::integer(-v.as_int());
      }
      case Expr::Not: return Value::boolean(!eval(*e.a[0], f).truthy());
      case Expr::And: {
        Value l = eval(*e.a[0], f);
        return l.truthy() ? eval(*e.a[1], f) : l;
      }
      case Expr::Or: {
        Value l = eval(*e.a[0], f);
        return l.truthy() ? l : eval(*e.a[1], f);
      }
      case Expr::Bin: {
        Value l = eval(*e.a[0], f), r = eval(*e.a[1], f);
        line = e.line;
        return binop(e.name, l, r);
      }
      case Expr::Cmp: {
        Value l = eval(*e.a[0], f);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value r = eval(*e.a[k + 1], f);
          line = e.line;
          if (!compare(e.ops[k], l, r)) return Value::boolean(false);
          l = std::move(r);
        }
        return Value::boolean(true);
      }
      case Expr::Cond:
        if (eval(*e.a[1], f).truthy()) return eval(*e.a[0], f);
        return e.a[2] ? eval(*e.a[2], f) : Value::undef("the inline if-expression evaluated to false and no else section was defined");
      case Expr::ListL: {
        List l;
        for (const auto& x : e.a) l.push_back(eval(*x, f));
        return e.name == "tuple" ? Value::tuple(std::move(l)) : Value::list(std::move(l));
      }
      case Expr::DictL: {
        Dict d;
        for (size_t k = 0; k + 1 < e.a.size(); k += 2) {
          Value key = eval(*e.a[k], f);
          std::string ks = key.t == T::Str ? key.s : to_str(key);
          Value v = eval(*e.a[k + 1], f);
          auto it = std::find_if(d.begin(), d.end(), [&](const auto& kv) { return kv.first == ks; });
          if (it != d.end()) it->second = std::move(v);
          else d.emplace_back(ks, std::move(v));
        }
        return Value::dict(std::move(d));
      }
    }
    fail("bad expression");
  }

  // ---------------------------------------------------------------------------------- statements
  void bind(Frame& f, const std::vector<std::string>& names, const Value& v) {
    if (names.size() == 1) return f.set(names[0], v);
    List items = iterate(v);
    if (items.size() != names.size())
      fail("cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(names.size()) + " names");
    for (size_t k = 0; k < names.size(); ++k) f.set(names[k], items[k]);
  }
  Value macro(const Stmt& s, Frame* defining) {
    return Value::func([&s, defining](Interp& in, Args& a) -> Value {
      if (a.pos.size() > s.names.size()) in.fail("macro '" + s.text + "' takes " + std::to_string(s.names.size()) + " arguments");
      Frame f;
      f.parent = defining;
      for (size_t k = 0; k < s.names.size(); ++k) {
        const Value* v = a.get(k, s.names[k].c_str());
        f.set(s.names[k], v ? *v : s.defaults[k] ? in.eval(*s.defaults[k], f) : Value::undef("'" + s.names[k] + "' is undefined"));
      }
      std::string out;
      in.exec(s.bodies[0], f, out);
      return Value::str(out);
    });
  }
  Flow exec(const Body& body, Frame& f, std::string& out) {
    for (const auto& sp : body) {
      const Stmt& s = *sp;
      line = s.line;
      switch (s.k) {
        case Stmt::Text: out += s.text; break;
        case Stmt::Out: out += to_str(eval(*s.e[0], f)); break;
        case Stmt::If: {
          size_t k = 0;
          while (k < s.e.size() && !eval(*s.e[k], f).truthy()) ++k;
          if (k < s.bodies.size()) {
            Flow fl = exec(s.bodies[k], f, out);
            if (fl != Flow::Normal) return fl;
          }
          break;
        }
        case Stmt::For: {
          List items = iterate(eval(*s.e[0], f));
          if (s.e[1]) {
            List kept;
            for (const auto& item : items) {
              Frame tmp;
              tmp.parent = &f;
              bind(tmp, s.names, item);
              if (eval(*s.e[1], tmp).truthy()) kept.push_back(item);
            }
            items.swap(kept);
          }
          if (items.empty()) {
            Flow fl = exec(s.bodies[1], f, out);
            if (fl != Flow::Normal) return fl;
            break;
          }
          int64_t n = int64_t(items.size());
          for (int64_t k = 0; k < n; ++k) {
            Frame it;
            it.parent = &f;
            bind(it, s.names, items[size_t(k)]);
            Dict loop = {{"index", Value::integer(k + 1)},
                         {"index0", Value::integer(k)},
                         {"revindex", Value::integer(n - k)},
                         {"revindex0", Value::integer(n - k - 1)},
                         {"first", Value::boolean(k == 0)},
                         {"last", Value::boolean(k == n - 1)},
                         {"length", Value::integer(n)},
                         {"depth", Value::integer(1)},
                         {"depth0", Value::integer(0)},
                         {"previtem", k > 0 ? items[size_t(k - 1)] : Value::undef("there is no previous item")},
                         {"nextitem", k + 1 < n ? items[size_t(k + 1)] : Value::undef("there is no next item")},
                         {"cycle", Value::func([k](Interp& in, Args& a) -> Value {
                            if (a.pos.empty()) in.fail("no items for cycling given");
                            return a.pos[size_t(k) % a.pos.size()];
                          })}};
            it.set("loop", Value::dict(std::move(loop)));
            if (exec(s.bodies[0], it, out) == Flow::Break) break;
          }
          break;
        }
        case Stmt::Set: {
          Value v = eval(*s.e[0], f);
          line = s.line;
          if (!s.text.empty()) {
            const Value* ns = f.find(s.names[0]);
            if (!ns || ns->t != T::NS) fail("cannot assign attribute on non-namespace object '" + s.names[0] + "'");
            Dict& d = *ns->d;
            auto it = std::find_if(d.begin(), d.end(), [&](const auto& kv) { return kv.first == s.text; });
            if (it != d.end()) it->second = std::move(v);
            else d.emplace_back(s.text, std::move(v));
          } else {
            bind(f, s.names, v);
          }
          break;
        }
        case Stmt::SetBlock: {
          std::string o;
          exec(s.bodies[0], f, o);
          f.set(s.names[0], Value::str(o));
          break;
        }
        case Stmt::Macro: f.set(s.text, macro(s, &f)); break;
        case Stmt::Break: return Flow::Break;
        case Stmt::Continue: return Flow::Continue;
      }
    }
    return Flow::Normal;
  }
};

namespace {

Dict mapping_args(Interp& in, Args& a, const char* what) {
  Dict d;
  if (!a.pos.empty()) {
    if (a.pos.size() > 1 || a.pos[0].t != T::Dict) in.fail(std::string(what) + "() takes a mapping or keyword arguments");
    d = *a.pos[0].d;
  }
  for (auto& [k, v] : a.kw) {
    if (std::string(what) == "namespace" && !k.empty() && k[0] == '_')
      in.fail("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + k + "'");
    auto it = std::find_if(d.begin(), d.end(), [&](const auto& kv) { return kv.first == k; });
    if (it != d.end()) it->second = v;
    else d.emplace_back(k, v);
  }
  return d;
}

Dict globals() {
  Dict g;
  g.reserve(8);  // (also keeps GCC 12 from a false -Warray-bounds on emplace_back)
  g.emplace_back("range", Value::func([](Interp& in, Args& a) -> Value {
    if (a.pos.empty() || a.pos.size() > 3) in.fail("range expected 1 to 3 arguments");
    int64_t start = 0, stop, step = 1;
    if (a.pos.size() == 1) stop = in.need_int(&a.pos[0], 0, "range() argument");
    else {
      start = in.need_int(&a.pos[0], 0, "range() argument");
      stop = in.need_int(&a.pos[1], 0, "range() argument");
      if (a.pos.size() == 3) step = in.need_int(&a.pos[2], 1, "range() argument");
    }
    if (step == 0) in.fail("range() arg 3 must not be zero");
    List l;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
      if (l.size() >= 100000) in.fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
      l.push_back(Value::integer(k));
    }
    return Value::list(std::move(l));
  }));
  g.emplace_back("raise_exception", Value::func([](Interp& in, Args& a) -> Value {
    in.fail(a.pos.empty() ? std::string("raise_exception") : to_str(a.pos[0]));
  }));
  g.emplace_back("strftime_now", Value::func([](Interp& in, Args& a) -> Value {
    if (a.pos.empty()) in.fail("strftime_now() needs a format");
    std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[512];
    size_t n = std::strftime(buf, sizeof buf, to_str(a.pos[0]).c_str(), &tm);
    return Value::str(std::string(buf, n));
  }));
  g.emplace_back("namespace", Value::func([](Interp& in, Args& a) { return Value::ns(mapping_args(in, a, "namespace")); }));
  g.emplace_back("dict", Value::func([](Interp& in, Args& a) { return Value::dict(mapping_args(in, a, "dict")); }));
  return g;
}

}  // namespace

std::string render(const Program& prog, const Dict& context) {
  Interp in{prog};
  Frame base;
  base.vars = globals();
  for (const auto& [k, v] : context) base.set(k, v);
  Frame root;
  root.parent = &base;
  std::string out;
  in.exec(prog.body, root, out);
  return out;
}

}  // namespace lf::data::jinja
