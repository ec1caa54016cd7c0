// The text-encoder family's registry entry (models/text_encoder/family.h).
#include "loongforge/models/text_encoder/family.h"

#include "loongforge/models/text_encoder/t5.h"

namespace lf::models::text_encoder {

Family family() {
  Family f;
  f.name = "text_encoder";
  f.model_types = {"t5", "umt5"};
  f.build = build_t5;
  f.describe = describe_t5;
  return f;
}

}  // namespace lf::models::text_encoder
