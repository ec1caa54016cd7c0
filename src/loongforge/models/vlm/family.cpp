// The vision-language family's registry entry (models/vlm/family.h).
#include "loongforge/models/vlm/family.h"

#include "loongforge/models/vlm/llava.h"
#include "loongforge/models/vlm/qwen_vl.h"

namespace lf::models::vlm {

namespace {
bool is_qwen(const nlohmann::json& j) { return j.value("model_type", std::string()) == "qwen2_5_vl"; }
}  // namespace

Family family() {
  Family f;
  f.name = "vlm";
  f.model_types = {"llava", "qwen2_5_vl"};
  f.build = [](const nlohmann::json& j, const std::string& file) {
    return is_qwen(j) ? build_qwen_vl(j, file) : build_llava(j, file);
  };
  f.describe = [](const nlohmann::json& j, const std::string& file) {
    return is_qwen(j) ? describe_qwen_vl(j, file) : describe_llava(j, file);
  };
  return f;
}

}  // namespace lf::models::vlm
