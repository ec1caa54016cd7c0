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

// An error about one option of a lower layer's API (a parallel layout's size, an optimizer's mode, a model's
// training option), named as that layer names it ("tp", "cp_mode", "bias_update_rate"). Layers below train/ never
// speak in recipe keys: the layer that read the option (train/, from a recipe) rethrows it naming its key
// ("recipe: field 'parallel.tp': 3 does not divide num_attention_heads 8").
class OptionError : public Error {
 public:
  OptionError(std::string option, std::string why)
      : Error(option + ": " + why), option_(std::move(option)), why_(std::move(why)) {}
  const std::string& option() const { return option_; }
  const std::string& why() const { return why_; }

 private:
  std::string option_, why_;
};

// "FILE: field 'FIELD': WHAT"
inline Error file_error(const std::string& file, const std::string& field, const std::string& what) {
  if (field.empty()) return Error(file + ": " + what);
  return Error(file + ": field '" + field + "': " + what);
}

}  // namespace lf
