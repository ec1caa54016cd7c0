// The evaluator: attribute and item access, operators, expressions and statements with jinja2's scoping. The
// filters, tests, methods and global functions are in builtins.cpp.
#include "loongforge/data/jinja/interp.h"

#include <cerrno>
#include <algorithm>
#include <cctype>
#include <cmath>

#include "loongforge/data/jinja/interp_impl.h"
#include "loongforge/data/jinja/pystr.h"

namespace lf::data::jinja {

// ------------------------------------------------------------------------------------------------ access and operators

Value Interp::no_attr(const Value& o, const std::string& n) {
  std::string why = "'";  // built by append: GCC 12 warns falsely (-Wstringop-overflow) on the + chain
  why.append(type_name(o)).append(" object' has no attribute '").append(n).append("'");
  return Value::undef(std::move(why));
}

Value Interp::getattr(const Value& o, const std::string& n) const {
  need_defined(o);
  if (const Value* v = o.find(n)) return *v;
  return no_attr(o, n);
}

Value Interp::getitem(const Value& o, const Value& key) const {
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

Value Interp::slice(const Value& o, const Value& a, const Value& b, const Value& c) const {
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
  for (int64_t k = start; step > 0 ? k < stop : k > stop;) {
    if (o.t == T::List) l.push_back((*o.l)[size_t(k)]);
    else s.push_back(u[size_t(k)]);
    if (__builtin_add_overflow(k, step, &k)) break;  // a step past the 64-bit range leaves the sequence too
  }
  return o.t == T::List ? Value::list(std::move(l)) : Value::str(utf8_encode(s));
}

List Interp::iterate(const Value& v) const {
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

bool Interp::contains(const Value& c, const Value& x) const {
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

int Interp::order(const Value& a, const Value& b, const std::string& op) const {
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

bool Interp::compare(const std::string& op, const Value& a, const Value& b) const {
  if (op == "==") return equal(a, b);
  if (op == "!=") return !equal(a, b);
  if (op == "in") return contains(b, a);
  if (op == "notin") return !contains(b, a);
  int c = order(a, b, op);
  return op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
}

Value Interp::binop(const std::string& op, const Value& a, const Value& b) const {
  if (op == "~") return Value::str(to_str(a) + to_str(b));
  need_defined(a);
  need_defined(b);
  if (a.is_num() && b.is_num()) {
    bool fl = a.t == T::Float || b.t == T::Float;
    double x = a.as_real(), y = b.as_real();
    int64_t i = a.as_int(), j = b.as_int();
    // Python's integers are unbounded, ours are 64-bit: a result that does not fit is an error, not a wrap-around.
    int64_t r = 0;
    auto fits = [&](bool overflow) {
      if (overflow) fail("integer overflow: " + to_str(a) + " " + op + " " + to_str(b) + " does not fit in 64 bits");
      return Value::integer(r);
    };
    if (op == "+") return fl ? Value::real(x + y) : fits(__builtin_add_overflow(i, j, &r));
    if (op == "-") return fl ? Value::real(x - y) : fits(__builtin_sub_overflow(i, j, &r));
    if (op == "*") return fl ? Value::real(x * y) : fits(__builtin_mul_overflow(i, j, &r));
    if ((op == "/" || op == "//" || op == "%") && y == 0) fail("division by zero");
    if (op == "/") return Value::real(x / y);
    if (!fl && j == -1) {  // the one quotient that overflows (INT64_MIN / -1); any remainder by -1 is 0
      if (op == "%") return Value::integer(0);
      if (op == "//") return fits(__builtin_sub_overflow(int64_t(0), i, &r));
    }
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
      // by squaring: at most 63 squarings before an overflow, whatever the exponent
      int64_t base = i, acc = 1;
      bool overflow = false;
      for (int64_t e = j; e > 0 && !overflow; e >>= 1) {
        if (e & 1) overflow = __builtin_mul_overflow(acc, base, &acc);
        if (e > 1 && !overflow) overflow = __builtin_mul_overflow(base, base, &base);
      }
      r = acc;
      return fits(overflow);
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
    if (n > 0 && seq.t == T::Str) check_string_size(seq.s.size() * size_t(std::min<int64_t>(n, int64_t(kMaxStringBytes) + 1)));
    if (n > 0 && seq.t == T::List) check_list_size(seq.l->size() * size_t(std::min<int64_t>(n, int64_t(kMaxListItems) + 1)));
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

Value Interp::call(const Value& fn, Args& a) {
  if (fn.t == T::Func) return (*fn.fn)(*this, a);
  need_defined(fn);
  fail(std::string("'") + type_name(fn) + "' object is not callable");
}

Value Interp::attr_path(const Value& v, const std::string& path) const {  // "a.b.0" as in jinja's make_attrgetter
  Value cur = v;
  size_t p = 0;
  while (true) {
    size_t q = path.find('.', p);
    std::string part = path.substr(p, q == std::string::npos ? std::string::npos : q - p);
    bool digits = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
    errno = 0;
    const long long index = digits ? std::strtoll(part.c_str(), nullptr, 10) : 0;
    if (digits && errno == ERANGE) return Value::undef("no element " + part);  // past any list's length
    cur = cur.t == T::Undef ? cur : getitem(cur, digits ? Value::integer(index) : Value::str(part));
    if (q == std::string::npos) return cur;
    p = q + 1;
  }
}

// ------------------------------------------------------------------------------------------------ evaluation

Args Interp::args(const Expr& e, Frame& f, size_t from) {
  Args a;
  for (size_t k = from; k < e.a.size(); ++k) a.pos.push_back(eval(*e.a[k], f));
  for (const auto& [k, x] : e.kw) a.kw.emplace_back(k, eval(*x, f));
  return a;
}

Value Interp::eval(const Expr& e, Frame& f) {
  Nest nest(*this);
  step();
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
      if (v.t == T::Float) return Value::real(-v.f);
      int64_t r = 0;
      if (__builtin_sub_overflow(int64_t(0), v.as_int(), &r)) fail("integer overflow: -(" + to_str(v) + ") does not fit in 64 bits");
      return Value::integer(r);
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

// ------------------------------------------------------------------------------------------------ statements

void Interp::bind(Frame& f, const std::vector<std::string>& names, const Value& v) {
  if (names.size() == 1) return f.set(names[0], v);
  List items = iterate(v);
  if (items.size() != names.size())
    fail("cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(names.size()) + " names");
  for (size_t k = 0; k < names.size(); ++k) f.set(names[k], items[k]);
}

Value Interp::macro(const Stmt& s, Frame* defining) {
  return Value::func([&s, defining](Interp& in, Args& a) -> Value {
    if (a.pos.size() > s.names.size()) in.fail("macro '" + s.text + "' takes " + std::to_string(s.names.size()) + " arguments");
    if (in.macro_depth >= kMaxMacroDepth)
      in.fail("macro '" + s.text + "' recursed deeper than " + std::to_string(kMaxMacroDepth) + " calls");
    struct Depth {
      int& d;
      explicit Depth(int& x) : d(++x) {}
      ~Depth() { --d; }
    } depth(in.macro_depth);
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

// Whether V holds the namespace whose attributes are NS (walking lists, dicts and namespaces once each).
static bool holds_namespace(const Value& v, std::vector<const void*>& seen) {
  const void* id = v.t == T::List ? static_cast<const void*>(v.l.get())
                   : (v.t == T::Dict || v.t == T::NS) ? static_cast<const void*>(v.d.get()) : nullptr;
  if (!id) return false;
  if (v.t == T::NS) return true;
  if (std::find(seen.begin(), seen.end(), id) != seen.end()) return false;
  seen.push_back(id);
  if (v.t == T::List) {
    for (const auto& e : *v.l)
      if (holds_namespace(e, seen)) return true;
  } else {
    for (const auto& kv : *v.d)
      if (holds_namespace(kv.second, seen)) return true;
  }
  return false;
}

static void append_output(std::string& out, const std::string& more) {
  check_string_size(out.size() + more.size());
  out += more;
}

Flow Interp::exec(const Body& body, Frame& f, std::string& out) {
  Nest nest(*this);
  for (const auto& sp : body) {
    const Stmt& s = *sp;
    line = s.line;
    step();
    switch (s.k) {
      case Stmt::Text: append_output(out, s.text); break;
      case Stmt::Out: append_output(out, to_str(eval(*s.e[0], f))); break;
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
          step();
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
          // Namespaces are the one mutable value: keeping them out of each other keeps values acyclic and their
          // depth bounded.
          std::vector<const void*> seen;
          if (holds_namespace(v, seen)) fail("cannot store a namespace in a namespace attribute ('" + s.names[0] + "." + s.text + "')");
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

std::string render(const Program& prog, const Dict& context) {
  Interp in{prog};
  Frame base;
  base.vars = globals();
  for (const auto& [k, v] : context) base.set(k, v);
  Frame root;
  root.parent = &base;
  std::string out;
  try {
    in.exec(prog.body, root, out);
  } catch (const LimitError& e) {
    in.fail(e.what());
  } catch (const std::bad_alloc&) {
    in.fail("out of memory while rendering the template");
  } catch (const std::out_of_range& e) {
    in.fail(std::string("a number out of range (") + e.what() + ")");
  }
  return out;
}

}  // namespace lf::data::jinja
