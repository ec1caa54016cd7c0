// Internal to data/jinja: Python's str methods on UTF-8 strings (code points, case mapping and categories from
// utf8proc) and jinja's own string filters, for the built-ins (builtins.cpp) and the interpreter.
#pragma once
#include <utf8proc.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "loongforge/data/jinja/value.h"

namespace lf::data::jinja {

size_t cp_len(const std::string& s);  // length in code points
std::string upper(const std::string& s);
std::string lower(const std::string& s);
bool is_cat(char32_t c, std::initializer_list<utf8proc_category_t> cats);  // c's Unicode category is one of cats
std::string py_title(const std::string& s);                                 // str.title()
std::string py_capitalize(const std::string& s);                            // str.capitalize()
std::string jinja_title(const std::string& s);  // the `title` filter: words start after - whitespace ( { [ <
// str.strip(chars) / lstrip / rstrip; chars None or undefined: whitespace
std::string strip(const std::string& s, const Value* chars, bool left, bool right);
std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count);  // str.replace
std::vector<std::string> split_lines(const std::string& s);  // str.splitlines() (\n, \r\n, \r)
std::string html_escape(const std::string& s);               // the `escape` filter

}  // namespace lf::data::jinja
