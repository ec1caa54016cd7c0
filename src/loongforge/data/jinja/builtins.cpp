// The built-ins of the Jinja subset: filters, tests, the methods of str/dict/list values that chat templates call,
// and the global functions of transformers' environment (range, raise_exception, strftime_now, namespace, dict).
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cfenv>
#include <cmath>
#include <ctime>
#include <limits>
#include <stdexcept>

#include "loongforge/data/jinja/interp_impl.h"
#include "loongforge/data/jinja/pystr.h"

namespace lf::data::jinja {

namespace {

Value str_list(const std::vector<std::string>& v) {
  List l;
  for (const auto& s : v) l.push_back(Value::str(s));
  return Value::list(std::move(l));
}

}  // namespace

// ------------------------------------------------------------------------------------------------ methods

bool Interp::method(const Value& o, const std::string& n, Args& a, Value& out) {
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

std::string Interp::format(const std::string& s, const Args& a) {  // str.format with {}, {0}, {name}
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

// ------------------------------------------------------------------------------------------------ tests

bool Interp::test(const std::string& n, const Value& v, const Args& a) {
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
    if (v.is_int()) return d == -1 || v.as_int() % d == 0;  // (INT64_MIN % -1 traps on x86)
    return std::fmod(v.as_real(), double(d)) == 0;
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

// ------------------------------------------------------------------------------------------------ filters

Value Interp::select(const Value& v, const Args& a, bool by_attr, bool keep) {
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

Value Interp::sorted(const Value& v, bool reverse, bool case_sensitive, const Value* attr) {
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

Value Interp::filter(const std::string& n, const Value& v, Args& a) {
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
        const int64_t base = need_int(arg(1, "base"), 10, "base");
        errno = 0;  // (a base out of 2..36 converts nothing, as Python's ValueError: then the float path, as jinja)
        long long i = std::strtoll(s.c_str(), &end, base == 0 || (base >= 2 && base <= 36) ? int(base) : 1);
        if (!s.empty() && *end == 0) {
          if (errno == ERANGE) fail("int(): '" + s + "' does not fit in 64 bits");
          return Value::integer(i);
        }
      }
      x = std::strtod(s.c_str(), &end);
      if (s.empty() || *end != 0) return dflt;
    } else {
      return dflt;
    }
    if (n == "int" && !(x > -9223372036854775808.0 - 1024 && x < 9223372036854775808.0))  // NaN, inf, past 64 bits
      fail("cannot convert " + to_str(v) + " to a 64-bit integer");
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
    if (v.is_int()) {
      if (v.as_int() == std::numeric_limits<int64_t>::min()) fail("integer overflow: abs(" + to_str(v) + ") does not fit in 64 bits");
      return Value::integer(std::llabs(v.as_int()));
    }
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
    int64_t width = w && w->t == T::Str ? 0 : need_int(w, 4, "width");
    if (width < 0) width = 0;
    check_string_size(size_t(width));
    std::string ind = w && w->t == T::Str ? w->s : std::string(size_t(width), ' ');
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

// ------------------------------------------------------------------------------------------------ globals

namespace {

Dict mapping_args(Interp& in, Args& a, const char* what) {
  Dict d;
  if (!a.pos.empty()) {
    if (a.pos.size() > 1 || a.pos[0].t != T::Dict) in.fail(std::string(what) + "() takes a mapping or keyword arguments");
    d = *a.pos[0].d;
  }
  for (auto& kw : a.kw) {
    const std::string& k = kw.first;  // (a named reference, not a structured binding: clang 14 cannot capture one)
    auto& v = kw.second;
    if (std::string(what) == "namespace" && !k.empty() && k[0] == '_')
      in.fail("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + k + "'");
    auto it = std::find_if(d.begin(), d.end(), [&](const auto& kv) { return kv.first == k; });
    if (it != d.end()) it->second = v;
    else d.emplace_back(k, v);
  }
  return d;
}

}  // namespace

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
    for (int64_t k = start; step > 0 ? k < stop : k > stop;) {
      if (l.size() >= 100000) in.fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
      l.push_back(Value::integer(k));
      if (__builtin_add_overflow(k, step, &k)) break;  // past the 64-bit range: past stop too
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

}  // namespace lf::data::jinja
