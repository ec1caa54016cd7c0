#include "loongforge/data/jinja/lexer.h"

#include <cerrno>
#include <cctype>
#include <cstdlib>

#include "loongforge/core/error.h"
#include "loongforge/data/jinja/value.h"

namespace lf::data::jinja {

[[noreturn]] void syntax_error(const std::string& origin, int line, const std::string& what) {
  std::string msg = origin + ":" + std::to_string(line) + ": " + what;
  for (char& c : msg)
    if (c == '\n' || c == '\r') c = ' ';
  throw lf::Error(msg);
}

namespace {

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

}  // namespace

// ------------------------------------------------------------------------------------------------ segments

std::vector<Seg> split_segments(std::string src, const std::string& origin) {
  // Newlines are normalized to \n and one trailing newline is dropped (keep_trailing_newline=False).
  std::string norm;
  norm.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == '\r') {
      norm += '\n';
      if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
    } else {
      norm += src[i];
    }
  }
  if (!norm.empty() && norm.back() == '\n') norm.pop_back();
  src.swap(norm);

  std::vector<Seg> segs;
  size_t pos = 0, line_pos = 0;
  int line = 1;
  auto line_at = [&](size_t p) {  // p never decreases
    for (; line_pos < p; ++line_pos)
      if (src[line_pos] == '\n') ++line;
    return line;
  };
  bool line_starting = true;
  while (pos < src.size()) {
    size_t tag = pos;
    for (; tag + 1 < src.size(); ++tag)
      if (src[tag] == '{' && (src[tag + 1] == '{' || src[tag + 1] == '%' || src[tag + 1] == '#')) break;
    if (tag + 1 >= src.size()) {
      segs.push_back({Seg::Text, src.substr(pos), line_at(pos)});
      break;
    }
    char kind = src[tag + 1];
    char sign = tag + 2 < src.size() && (src[tag + 2] == '-' || src[tag + 2] == '+') ? src[tag + 2] : 0;
    std::string text = src.substr(pos, tag - pos);
    int text_line = line_at(pos);
    if (sign == '-') {
      size_t e = text.size();
      while (e > 0 && is_ws(text[e - 1])) --e;
      text.resize(e);
    } else if (sign != '+' && kind != '{') {  // lstrip_blocks
      size_t l_pos = text.rfind('\n');
      l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
      if ((l_pos > 0 || line_starting) && l_pos < text.size()) {
        bool all_ws = true;
        for (size_t k = l_pos; k < text.size(); ++k) all_ws = all_ws && is_ws(text[k]);
        if (all_ws) text.resize(l_pos);
      }
    }
    if (!text.empty()) segs.push_back({Seg::Text, text, text_line});
    int tag_line = line_at(tag);
    size_t cstart = tag + 2 + (sign ? 1 : 0), end = std::string::npos, after = 0;
    char close_sign = 0;
    if (kind == '#') {
      size_t p = src.find("#}", cstart);
      if (p == std::string::npos) syntax_error(origin, tag_line, "unclosed comment '{#'");
      end = p;
      after = p + 2;
      if (p > cstart && (src[p - 1] == '-' || src[p - 1] == '+')) close_sign = src[p - 1], end = p - 1;
    } else {
      char closer = kind == '{' ? '}' : '%';
      int depth = 0;
      for (size_t p = cstart; p + 1 < src.size(); ++p) {
        char c = src[p];
        if (c == '\'' || c == '"') {
          size_t q = p + 1;
          while (q < src.size() && src[q] != c) q += src[q] == '\\' ? 2 : 1;
          p = q;
          continue;
        }
        if (depth == 0 && c == closer && src[p + 1] == '}') {
          end = p;
          after = p + 2;
          if (p > cstart && (src[p - 1] == '-' || (kind == '%' && src[p - 1] == '+'))) close_sign = src[p - 1], end = p - 1;
          break;
        }
        if (c == '(' || c == '[' || c == '{') ++depth;
        if ((c == ')' || c == ']' || c == '}') && depth > 0) --depth;
      }
      if (end == std::string::npos)
        syntax_error(origin, tag_line, std::string("unclosed tag '{") + kind + "', expected '" + closer + "}'");
    }
    std::string content = src.substr(cstart, end - cstart);
    if (close_sign == '-') {
      while (after < src.size() && is_ws(src[after])) ++after;
    } else if (close_sign != '+' && kind != '{' && after < src.size() && src[after] == '\n') {
      ++after;  // trim_blocks
    }
    line_starting = src[after - 1] == '\n';
    if (kind != '#') segs.push_back({kind == '{' ? Seg::Var : Seg::Block, content, tag_line});
    pos = after;
  }
  return segs;
}

// ------------------------------------------------------------------------------------------------ tokens

std::vector<Tok> tokenize(const std::string& src, int line, const std::string& origin) {
  std::vector<Tok> out;
  static const char* ops2[] = {"**", "//", "==", "!=", "<=", ">="};
  size_t p = 0;
  while (true) {
    while (p < src.size() && is_ws(src[p])) line += src[p++] == '\n';
    if (p >= src.size()) break;
    char c = src[p];
    Tok t;
    t.line = line;
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t q = p;
      while (q < src.size() && (std::isalnum(static_cast<unsigned char>(src[q])) || src[q] == '_')) ++q;
      t.k = Tok::Name;
      t.s = src.substr(p, q - p);
      p = q;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t q = p;
      bool after_dot = !out.empty() && out.back().k == Tok::Op && out.back().s == ".";
      std::string num;
      auto digits = [&] {
        while (q < src.size() && (std::isdigit(static_cast<unsigned char>(src[q])) || src[q] == '_'))
          if (src[q++] != '_') num += src[q - 1];
      };
      digits();
      bool is_float = false;
      if (!after_dot && q + 1 < src.size() && src[q] == '.' && std::isdigit(static_cast<unsigned char>(src[q + 1]))) {
        num += src[q++];
        digits();
        is_float = true;
      }
      if (!after_dot && q < src.size() && (src[q] == 'e' || src[q] == 'E')) {
        size_t r = q + 1;
        if (r < src.size() && (src[r] == '+' || src[r] == '-')) ++r;
        if (r < src.size() && std::isdigit(static_cast<unsigned char>(src[r]))) {
          num += 'e';
          num.append(src, q + 1, r - q - 1);
          q = r;
          digits();
          is_float = true;
        }
      }
      t.k = is_float ? Tok::Float : Tok::Int;
      if (is_float) t.f = std::strtod(num.c_str(), nullptr);
      else {
        errno = 0;
        t.i = std::strtoll(num.c_str(), nullptr, 10);
        if (errno == ERANGE) syntax_error(origin, t.line, "integer literal " + num + " does not fit in 64 bits");
      }
      p = q;
    } else if (c == '\'' || c == '"') {
      std::string s;
      size_t q = p + 1;
      for (; q < src.size() && src[q] != c; ++q) {
        if (src[q] == '\n') ++line;
        if (src[q] != '\\' || q + 1 >= src.size()) {
          s += src[q];
          continue;
        }
        char e = src[++q];
        auto hex = [&](int n) {
          uint32_t v = 0;
          for (int k = 0; k < n; ++k) {
            char h = q + 1 < src.size() ? src[++q] : 0;
            if (!std::isxdigit(static_cast<unsigned char>(h))) syntax_error(origin, line, "bad escape in string literal");
            v = v * 16 + (std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
          }
          s += utf8_encode(std::u32string(1, char32_t(v)));
        };
        switch (e) {
          case 'n': s += '\n'; break;
          case 't': s += '\t'; break;
          case 'r': s += '\r'; break;
          case '\\': s += '\\'; break;
          case '\'': s += '\''; break;
          case '"': s += '"'; break;
          case 'a': s += '\a'; break;
          case 'b': s += '\b'; break;
          case 'f': s += '\f'; break;
          case 'v': s += '\v'; break;
          case '0': s += '\0'; break;
          case '\n': ++line; break;
          case 'x': hex(2); break;
          case 'u': hex(4); break;
          case 'U': hex(8); break;
          default: s += '\\'; s += e;
        }
      }
      if (q >= src.size()) syntax_error(origin, t.line, "unterminated string literal");
      t.k = Tok::Str;
      t.s = s;
      p = q + 1;
    } else {
      t.k = Tok::Op;
      for (const char* o : ops2)
        if (src.compare(p, 2, o) == 0) t.s = o;
      if (t.s.empty()) {
        if (std::string("+-*/%~<>=()[]{}.,:|").find(c) == std::string::npos)
          syntax_error(origin, line, std::string("unexpected character '") + c + "'");
        t.s = std::string(1, c);
      }
      p += t.s.size();
    }
    out.push_back(std::move(t));
  }
  Tok end;
  end.k = Tok::End;
  end.line = line;
  out.push_back(end);
  return out;
}

}  // namespace lf::data::jinja
