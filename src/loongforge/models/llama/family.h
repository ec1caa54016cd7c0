// The decoder-LM family's registry entry (models/registry.h): transformers' model types llama, mistral, qwen2,
// qwen3, qwen3_moe, mixtral, deepseek_v3, glm4_moe, minimax_m2, mistral4, deepseek_v32 and glm_moe_dsa (and the
// Qwen3-Next / Qwen3.5 text decoders), built as CausalLM.
#pragma once
#include "loongforge/models/registry.h"

namespace lf::models::llama {

Family family();

}  // namespace lf::models::llama
