// The vision-language family's registry entry: LLaVA (models/vlm/llava.h) and Qwen2.5-VL (models/vlm/qwen_vl.h),
// picked by the config's model_type.
#pragma once
#include "loongforge/models/registry.h"

namespace lf::models::vlm {

Family family();

}  // namespace lf::models::vlm
