// LeRobot policy configs' features and normalisation mapping (models/policy/spec.h).
#include "loongforge/models/policy/spec.h"

#include "loongforge/core/json.h"

namespace lf::models::policy {

PolicySpec lerobot_policy_spec(const nlohmann::json& config, const std::string& file) {
  PolicySpec s;
  JsonReader r(config, file);
  auto features = [&](const char* key, std::vector<PolicyFeature>& out) {
    const JsonReader fs = r.object(key);
    for (const auto& item : fs.json().items()) {
      const JsonReader f = fs.object(item.key());
      out.push_back({item.key(), f.string("type"), f.int_list("shape")});
    }
  };
  features("input_features", s.inputs);
  features("output_features", s.outputs);
  if (r.has("normalization_mapping")) {
    const JsonReader m = r.object("normalization_mapping");
    for (const auto& item : m.json().items()) s.norm_map[item.key()] = m.string(item.key());
  }
  // lerobot_train reads getattr(cfg, "drop_n_last_frames", 0): configs without it keep every frame.
  if (r.has("drop_n_last_frames")) {
    s.drop_n_last_frames = r.integer("drop_n_last_frames");
    if (s.drop_n_last_frames < 0) r.fail("drop_n_last_frames", "must be >= 0, got " + std::to_string(s.drop_n_last_frames));
  }
  return s;
}

}  // namespace lf::models::policy
