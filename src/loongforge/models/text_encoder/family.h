// The text-encoder family's registry entry: the caption encoders of diffusion models, picked by the config's
// model_type — T5 and UMT5 encoders (models/text_encoder/t5.h).
#pragma once
#include "loongforge/models/registry.h"

namespace lf::models::text_encoder {

Family family();

}  // namespace lf::models::text_encoder
