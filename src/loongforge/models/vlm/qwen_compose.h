// The patch_merger composition: a Qwen2.5-VL, Qwen3-VL or Qwen3.5 (-MoE) from a Qwen vision tower (a whole Qwen VLM
// folder, whose vision half is taken, or a vision model's own folder) and a language-model folder of the decoder
// transformers' class fixes for it (Qwen2 for Qwen2.5-VL, Qwen3 for Qwen3-VL, the Qwen3.5 text decoder for Qwen3.5:
// qwen3_5_text makes a qwen3_5, qwen3_5_moe_text a qwen3_5_moe, with either Qwen3.5 folder's tower). The merger's
// output width becomes the language model's hidden size (its output layers newly initialised when that changes the
// tower's), multimodal rope sections are fitted to the language model's (rotated part of its) head, and Qwen's vision
// tokens come from (or are added to) its tokenizer.
#pragma once
#include "loongforge/models/registry.h"

namespace lf::models::vlm {

Composition compose_qwen_vl(const ComposeParts& parts);

}  // namespace lf::models::vlm
