// The diffusion family's registry entry: diffusers' model classes, picked by the config's `_class_name` — the
// transformers that denoise (DiT, Wan) and the VAEs that make their latents.
#pragma once
#include "loongforge/models/registry.h"

namespace lf::models::diffusion {

Family family();

}  // namespace lf::models::diffusion
