#include "loongforge/models/registry.h"

#include <algorithm>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/diffusion/family.h"
#include "loongforge/models/llama/family.h"
#include "loongforge/models/policy/family.h"
#include "loongforge/models/text_encoder/family.h"
#include "loongforge/models/vlm/family.h"

namespace lf::models {
namespace {

std::vector<Family> builtin() {
  std::vector<Family> out;
  out.push_back(llama::family());
  out.push_back(vlm::family());
  out.push_back(diffusion::family());
  out.push_back(text_encoder::family());
  out.push_back(policy::family());
  return out;
}

std::string join(std::vector<std::string> v) {
  if (v.empty()) return "none yet";
  std::sort(v.begin(), v.end());
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

const std::vector<Family>& families() {
  static const std::vector<Family> all = builtin();
  return all;
}

const Family& family_for(const nlohmann::json& config, const std::string& file, const std::string& family) {
  if (!config.is_object()) throw file_error(file, "", "expected a JSON object");
  if (!family.empty()) {
    std::vector<std::string> names;
    for (const auto& f : families()) {
      if (f.name == family) return f;
      names.push_back(f.name);
    }
    throw OptionError("family", "unknown family '" + family + "' (known: " + join(names) + ")");
  }
  // The identity fields, most specific first.
  struct Key {
    const char* field;
    std::vector<std::string> Family::*values;
  };
  for (const Key& k : {Key{"_class_name", &Family::class_names}, Key{"type", &Family::policy_types},
                       Key{"model_type", &Family::model_types}}) {
    if (!config.contains(k.field)) continue;
    const auto& v = config.at(k.field);
    if (!v.is_string()) throw file_error(file, k.field, "expected a string, got " + v.dump());
    const std::string id = v.get<std::string>();
    std::vector<std::string> known;
    for (const auto& f : families()) {
      const auto& vals = f.*k.values;
      if (std::find(vals.begin(), vals.end(), id) != vals.end()) return f;
      known.insert(known.end(), vals.begin(), vals.end());
    }
    throw file_error(file, k.field, "unsupported " + std::string(k.field) + " '" + id + "' (known: " + join(known) + ")");
  }
  std::vector<std::string> known;
  for (const auto& f : families()) known.insert(known.end(), f.model_types.begin(), f.model_types.end());
  throw file_error(file, "model_type", "missing (no model_type, _class_name or type names the model; known model types: " +
                                           join(known) + ")");
}

std::shared_ptr<Model> build_model(const nlohmann::json& config, const std::string& file, const std::string& family) {
  return family_for(config, file, family).build(config, file);
}

Composition compose(const ComposeParts& parts, const std::string& where) {
  std::vector<std::string> known;
  for (const auto& f : families()) {
    for (const auto& p : f.projectors)
      if (p == parts.projector && f.compose) return f.compose(parts);
    known.insert(known.end(), f.projectors.begin(), f.projectors.end());
  }
  throw Error(where + ": unknown projector '" + parts.projector + "' (known: " + join(known) + ")");
}

std::shared_ptr<Model> build_model_from_file(const std::string& path, const std::string& family) {
  return build_model(read_json_file(path), path, family);
}

}  // namespace lf::models
