// The vision-language family's registry entry: LLaVA (models/vlm/llava.h), Qwen2.5-VL (models/vlm/qwen_vl.h) and
// Qwen3-VL (models/vlm/qwen3_vl.h), picked by the config's model_type.
#pragma once
#include "loongforge/models/registry.h"

namespace lf::models::vlm {

Family family();

}  // namespace lf::models::vlm
