#include "loongforge/data/jinja/pystr.h"

#include "loongforge/data/jinja/value.h"

namespace lf::data::jinja {

namespace {

std::u32string map_cp(const std::u32string& s, utf8proc_int32_t (*f)(utf8proc_int32_t)) {
  std::u32string o(s);
  for (auto& c : o) c = char32_t(f(utf8proc_int32_t(c)));
  return o;
}

}  // namespace

size_t cp_len(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
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

}  // namespace lf::data::jinja
