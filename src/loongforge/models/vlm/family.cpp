// The vision-language family's registry entry (models/vlm/family.h).
#include "loongforge/models/vlm/family.h"

#include "loongforge/models/vlm/llava.h"
#include "loongforge/models/vlm/qwen3_vl.h"
#include "loongforge/models/vlm/qwen_compose.h"
#include "loongforge/models/vlm/qwen_vl.h"

namespace lf::models::vlm {

namespace {
std::string type_of(const nlohmann::json& j) {
  const std::string t = j.value("model_type", std::string());
  return t == "qwen3_5" || t == "qwen3_5_moe" ? "qwen3_vl" : t;  // Qwen3-VL's model with Qwen3.5's parts
}
}  // namespace

Family family() {
  Family f;
  f.name = "vlm";
  f.model_types = {"llava", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"};
  f.projectors = {"mlp2x_gelu", "patch_merger"};
  f.compose = [](const ComposeParts& p) { return p.projector == "patch_merger" ? compose_qwen_vl(p) : compose_llava(p); };
  f.build = [](const nlohmann::json& j, const std::string& file) {
    const std::string t = type_of(j);
    return t == "qwen3_vl" ? build_qwen3_vl(j, file) : t == "qwen2_5_vl" ? build_qwen_vl(j, file) : build_llava(j, file);
  };
  f.describe = [](const nlohmann::json& j, const std::string& file) {
    const std::string t = type_of(j);
    return t == "qwen3_vl" ? describe_qwen3_vl(j, file)
                           : t == "qwen2_5_vl" ? describe_qwen_vl(j, file) : describe_llava(j, file);
  };
  return f;
}

}  // namespace lf::models::vlm
