// Errors that reach the user. Every error LoongForge raises on bad input is an lf::Error whose message is one
// line naming the file and the field ("config.json: field 'rope_scaling.type': unsupported value 'foo'").
#pragma once
#include <stdexcept>
#include <string>

namespace lf {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// "FILE: field 'FIELD': WHAT"
inline Error file_error(const std::string& file, const std::string& field, const std::string& what) {
  if (field.empty()) return Error(file + ": " + what);
  return Error(file + ": field '" + field + "': " + what);
}

}  // namespace lf
