// The diffusion family's registry entry (models/diffusion/family.h).
#include "loongforge/models/diffusion/family.h"

#include <functional>
#include <string>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/diffusion/dit.h"
#include "loongforge/models/diffusion/wan.h"
#include "loongforge/models/diffusion/vae.h"
#include "loongforge/models/diffusion/wan_vae.h"

namespace lf::models::diffusion {

namespace {

// One diffusers class: how to build it and describe it (`loongforge info`).
struct Entry {
  const char* class_name;
  std::function<std::shared_ptr<Model>(const nlohmann::json&, const std::string&)> build;
  std::function<nlohmann::json(const nlohmann::json&, const std::string&)> describe;
};

// One line per class.
const std::vector<Entry>& entries() {
  static const std::vector<Entry> e = {
      {"DiTTransformer2DModel", build_dit, describe_dit},
      {"WanTransformer3DModel", build_wan, describe_wan},
      {"AutoencoderKL", build_autoencoder_kl, describe_autoencoder_kl},
      {"AutoencoderKLWan", build_autoencoder_kl_wan, describe_autoencoder_kl_wan},
  };
  return e;
}

const Entry& entry_for(const nlohmann::json& j, const std::string& file) {
  const std::string c = JsonReader(j, file).string("_class_name");
  for (const Entry& e : entries())
    if (c == e.class_name) return e;
  throw file_error(file, "_class_name", "'" + c + "' is not a diffusion model class LoongForge builds");
}

}  // namespace

Family family() {
  Family f;
  f.name = "diffusion";
  for (const Entry& e : entries()) f.class_names.push_back(e.class_name);
  f.build = [](const nlohmann::json& j, const std::string& file) { return entry_for(j, file).build(j, file); };
  f.describe = [](const nlohmann::json& j, const std::string& file) { return entry_for(j, file).describe(j, file); };
  return f;
}

}  // namespace lf::models::diffusion
