// The robot-policy family's registry entry (models/policy/family.h).
#include "loongforge/models/policy/family.h"

#include <functional>
#include <string>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/policy/act.h"
#include "loongforge/models/policy/diffusion.h"
#include "loongforge/models/policy/groot.h"
#include "loongforge/models/policy/pi0.h"

namespace lf::models::policy {

namespace {

// One LeRobot policy type: how to build it and describe it (`loongforge info`).
struct Entry {
  const char* type;
  std::function<std::shared_ptr<Model>(const nlohmann::json&, const std::string&)> build;
  std::function<nlohmann::json(const nlohmann::json&, const std::string&)> describe;
  decltype(Family::build_for_weights) build_for_weights;
};

const std::vector<Entry>& entries() {
  static const std::vector<Entry> e = {
      {"act", build_act, describe_act, build_act_for_weights},
      {"pi0", build_pi0, describe_pi0, nullptr},
      {"pi05", build_pi0, describe_pi0, nullptr},
      {"diffusion", build_diffusion, describe_diffusion, build_diffusion_for_weights},
      {"groot", build_groot, describe_groot, nullptr},
  };
  return e;
}

const Entry& entry_for(const nlohmann::json& j, const std::string& file) {
  const std::string t = JsonReader(j, file).string("type");
  for (const Entry& e : entries())
    if (t == e.type) return e;
  throw file_error(file, "type", "'" + t + "' is not a LeRobot policy type LoongForge builds");
}

}  // namespace

Family family() {
  Family f;
  f.name = "policy";
  for (const Entry& e : entries()) f.policy_types.push_back(e.type);
  f.build = [](const nlohmann::json& j, const std::string& file) { return entry_for(j, file).build(j, file); };
  f.describe = [](const nlohmann::json& j, const std::string& file) { return entry_for(j, file).describe(j, file); };
  f.build_for_weights = [](const nlohmann::json& j, const std::string& file, const Family::TensorShapes& shapes) {
    const Entry& e = entry_for(j, file);
    return e.build_for_weights ? e.build_for_weights(j, file, shapes) : e.build(j, file);
  };
  return f;
}

}  // namespace lf::models::policy
