// Internal to data/jinja: the evaluator of a parsed Program, shared by interp.cpp (access, operators, expressions,
// statements, render) and builtins.cpp (filters, tests, methods of str/dict/list, the global functions).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/data/jinja/parser.h"
#include "loongforge/data/jinja/value.h"

namespace lf::data::jinja {

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

// Limits of one render (templates are untrusted programs; value sizes are bounded in value.h). jinja2's sandbox
// bounds only range(); these also stop deep recursion (a macro calling itself), runaway loops and slow renders.
inline constexpr int kMaxMacroDepth = 128;     // macro calls inside macro calls
inline constexpr int kMaxEvalDepth = 1500;     // nested expression evaluations and statements (the C++ stack)
inline constexpr uint64_t kMaxSteps = 5'000'000;  // expressions evaluated + loop iterations
inline constexpr double kMaxSeconds = 10.0;    // wall time of one render

struct Interp {
  const Program& prog;
  int line = 0;
  int depth = 0, macro_depth = 0;
  uint64_t steps = 0;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(kMaxSeconds));

  // One more evaluation step: fails past the step or time budget (the clock is read every 4096 steps).
  void step() {
    if (++steps > kMaxSteps)
      fail("the template ran more than " + std::to_string(kMaxSteps) + " steps (the limit of one render)");
    if ((steps & 4095) == 0 && std::chrono::steady_clock::now() > deadline)
      fail("the template ran longer than " + std::to_string(int(kMaxSeconds)) + " s (the limit of one render)");
  }
  // Held while evaluating a nested expression or statement list: fails past the nesting limit.
  struct Nest {
    Interp& in;
    explicit Nest(Interp& i) : in(i) {
      if (++in.depth > kMaxEvalDepth) {
        --in.depth;
        in.fail("the template nests deeper than " + std::to_string(kMaxEvalDepth) + " levels");
      }
    }
    ~Nest() { --in.depth; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;
  };

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

  // access and operators (interp.cpp)
  static Value no_attr(const Value& o, const std::string& n);
  Value getattr(const Value& o, const std::string& n) const;
  Value getitem(const Value& o, const Value& key) const;
  Value slice(const Value& o, const Value& a, const Value& b, const Value& c) const;
  List iterate(const Value& v) const;
  bool contains(const Value& c, const Value& x) const;
  int order(const Value& a, const Value& b, const std::string& op) const;
  bool compare(const std::string& op, const Value& a, const Value& b) const;
  Value binop(const std::string& op, const Value& a, const Value& b) const;
  Value call(const Value& fn, Args& a);
  Value attr_path(const Value& v, const std::string& path) const;

  // built-ins (builtins.cpp)
  bool method(const Value& o, const std::string& n, Args& a, Value& out);
  std::string format(const std::string& s, const Args& a);
  bool test(const std::string& n, const Value& v, const Args& a);
  Value select(const Value& v, const Args& a, bool by_attr, bool keep);
  Value sorted(const Value& v, bool reverse, bool case_sensitive, const Value* attr);
  Value filter(const std::string& n, const Value& v, Args& a);

  // evaluation and statements (interp.cpp)
  Args args(const Expr& e, Frame& f, size_t from);
  Value eval(const Expr& e, Frame& f);
  void bind(Frame& f, const std::vector<std::string>& names, const Value& v);
  Value macro(const Stmt& s, Frame* defining);
  Flow exec(const Body& body, Frame& f, std::string& out);
};

// The global functions of the environment (builtins.cpp): range, raise_exception, strftime_now, namespace, dict.
Dict globals();

}  // namespace lf::data::jinja
