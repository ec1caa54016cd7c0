// Internal to data/jinja: the lexer of the Jinja subset. Template text -> segments (text, {{ }} and {% %}; comments
// dropped) with jinja2's whitespace control, and the content of a tag -> tokens; parser.cpp builds the tree.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lf::data::jinja {

// Throws lf::Error "ORIGIN:LINE: what" (newlines in WHAT become spaces).
[[noreturn]] void syntax_error(const std::string& origin, int line, const std::string& what);

struct Seg {
  enum K { Text, Var, Block, Comment } k;
  std::string text;
  int line;
};

// Splits a template into segments. Newlines are normalized to \n and one trailing newline is dropped
// (keep_trailing_newline=False); whitespace control as jinja2 with trim_blocks=True, lstrip_blocks=True.
std::vector<Seg> split_segments(std::string src, const std::string& origin);

struct Tok {
  enum K { Name, Str, Int, Float, Op, End } k;
  std::string s;
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

// The tokens of one tag's content, which starts at LINE; the last token is End.
std::vector<Tok> tokenize(const std::string& src, int line, const std::string& origin);

}  // namespace lf::data::jinja
