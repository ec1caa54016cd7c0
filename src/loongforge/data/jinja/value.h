// Values of the Jinja subset used by chat templates: Python-like semantics (truthiness, str(), repr(), ==, <),
// ordered dicts (as Python dicts), UTF-8 strings indexed by code point, and json.dumps as transformers calls it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lf::data::jinja {

struct Value;
struct Interp;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion-ordered, as Python dicts

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* get(size_t i, const char* name) const;  // positional i, else keyword name, else nullptr
};
using Fn = std::function<Value(Interp&, Args&)>;

enum class T : uint8_t { Undef, None, Bool, Int, Float, Str, List, Dict, NS, Func };

// Templates are untrusted programs: the values they build are bounded (interp.h has the other limits). A value over
// a bound throws LimitError, which the interpreter reports as "ORIGIN:LINE: what".
inline constexpr size_t kMaxStringBytes = size_t(32) << 20;  // one string, and the rendered output
inline constexpr size_t kMaxListItems = size_t(1) << 20;     // one list or dict
inline constexpr int kMaxNesting = 200;                      // lists / dicts inside each other
struct LimitError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Throws LimitError when a string of N bytes / a container of N items would be over the bound.
void check_string_size(size_t n);
void check_list_size(size_t n);

struct Value {
  T t = T::Undef;
  bool b = false;                  // Bool; List: a tuple (repr only)
  int64_t i = 0;
  double f = 0;
  std::string s;                    // Str; Undef: the message used when it is misused
  std::shared_ptr<const List> l;    // List
  std::shared_ptr<Dict> d;          // Dict (never mutated once built) or NS (mutable, shared)
  std::shared_ptr<const Fn> fn;     // Func
  int depth = 0;                    // List / Dict / NS: 1 + the deepest item's depth (a namespace's as built)

  static Value undef(std::string why = "value is undefined") { Value v; v.s = std::move(why); return v; }
  static Value none() { Value v; v.t = T::None; return v; }
  static Value boolean(bool x) { Value v; v.t = T::Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.t = T::Int; v.i = x; return v; }
  static Value real(double x) { Value v; v.t = T::Float; v.f = x; return v; }
  static Value str(std::string x) {
    check_string_size(x.size());
    Value v; v.t = T::Str; v.s = std::move(x); return v;
  }
  static Value list(List x);
  static Value dict(Dict x);
  static Value tuple(List x) { Value v = list(std::move(x)); v.b = true; return v; }
  static Value ns(Dict x) { Value v = dict(std::move(x)); v.t = T::NS; return v; }
  static Value func(Fn f) { Value v; v.t = T::Func; v.fn = std::make_shared<const Fn>(std::move(f)); return v; }

  bool is_num() const { return t == T::Int || t == T::Float || t == T::Bool; }
  bool is_int() const { return t == T::Int || t == T::Bool; }
  int64_t as_int() const { return t == T::Bool ? b : i; }
  double as_real() const { return t == T::Float ? f : double(as_int()); }
  bool truthy() const;
  const Value* find(const std::string& key) const;  // Dict/NS lookup
};

const char* type_name(const Value& v);
std::string to_str(const Value& v);  // Python str(); undefined renders as ""
std::string repr(const Value& v);    // Python repr()
bool equal(const Value& a, const Value& b);
std::string py_float(double x);  // Python float repr
// json.dumps(v, ensure_ascii, indent (<0: None), separators (empty: default), sort_keys); throws std::invalid_argument
// naming the type that is not JSON serializable.
std::string to_json(const Value& v, bool ensure_ascii, int indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys);

// UTF-8 <-> code points, Python's str.isspace.
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);
bool py_isspace(char32_t c);

}  // namespace lf::data::jinja
