// Lexer and parser of the Jinja subset: template text -> Program (statement tree of expression trees).
// Whitespace handling follows jinja2's lexer with trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loongforge/data/jinja/value.h"

namespace lf::data::jinja {

struct Expr;
using EP = std::unique_ptr<Expr>;
struct Expr {
  enum K { Lit, Name, Attr, Item, Slice, Call, Filter, Test, Neg, Pos, Not, Bin, And, Or, Cmp, Cond, ListL, DictL };
  K k;
  int line = 0;
  Value lit;
  std::string name;               // Name / Attr / Filter / Test name, Bin operator
  std::vector<EP> a;              // operands (Slice: obj, start, stop, step, any may be null; Cond: then, cond, else)
  std::vector<std::pair<std::string, EP>> kw;  // keyword arguments (Call / Filter / Test)
  std::vector<std::string> ops;   // Cmp: operators between a[0], a[1], ...
  bool negate = false;            // Test: `is not`
};

struct Stmt;
using SP = std::unique_ptr<Stmt>;
using Body = std::vector<SP>;
struct Stmt {
  enum K { Text, Out, If, For, Set, SetBlock, Macro, Break, Continue };
  K k;
  int line = 0;
  std::string text;                // Text; Set: attribute for `set ns.attr = ...`; Macro: name
  std::vector<EP> e;               // Out: value; If: conditions; For: iterable, filter (may be null); Set: value
  std::vector<Body> bodies;        // If: branch per condition (+ else); For: body, else; SetBlock/Macro: body
  std::vector<std::string> names;  // For / Set targets; Macro parameters
  std::vector<EP> defaults;        // Macro parameter defaults (null: required)
};

struct Program {
  std::string origin;
  Body body;
};

// Throws lf::Error "ORIGIN:LINE: what" on a syntax error or an unsupported construct.
std::shared_ptr<Program> parse(const std::string& source, const std::string& origin);

bool known_filter(const std::string& name);
bool known_test(const std::string& name);

}  // namespace lf::data::jinja
