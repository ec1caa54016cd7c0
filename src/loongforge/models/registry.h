// The family registry: which family builds a model from a config, keyed by the identity each ecosystem writes into
// its config.json (transformers: `model_type` and `architectures`; diffusers: `_class_name`; LeRobot policies:
// `type`). `info`, `dump`, `convert`, `generate`, `eval` and `train` build every model through here; a config no
// family handles is one line naming the field and the known values.
#pragma once
#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loongforge/models/model.h"

namespace lf::models {

// A model composed from parts (the recipe's model.vision / model.projector / model.language, `loongforge compose`):
// the parts' config.json objects (the files name them in errors) and how they are joined.
struct ComposeParts {
  nlohmann::json vision, language;
  std::string vision_file, language_file;
  std::string vision_dir, language_dir;  // the folders whose weights fill the parts
  std::string projector;                 // the projector kind ("mlp2x_gelu", "patch_merger")
  std::string image_token;               // the recipe's image token ("": the family's usual one for the projector)
  // A token's id in the language model's tokenizer; the caller adds the token (at the first embedding row no token
  // uses) when the tokenizer lacks it, and fails with one line when it cannot.
  std::function<int64_t(const std::string& token)> token_id;
  int64_t feature_layer = -2;            // the vision layer whose features the projector takes
  std::string select_strategy = "default";  // "default" drops a class token; "full" keeps it
};
// The whole model's config.json, and where each part folder's checkpoint tensors go (prefix + stored name).
struct Composition {
  nlohmann::json config;
  // DIR's tensors, each under prefix + its stored name, fill the model's checkpoint tensors whose names start with
  // one of `take` (empty: with `prefix`), except those named in `skip` (left as initialised: a projector layer whose
  // width changed).
  struct Part {
    std::string dir, prefix;
    std::vector<std::string> take;
    std::vector<std::string> skip;
  };
  std::vector<Part> parts;
  // Each component's module-name prefixes in the whole ("vision", "projector", "language"), for per-component
  // freezing and learning rates.
  std::vector<std::pair<std::string, std::vector<std::string>>> components;
};

struct Family {
  std::string name;                       // "decoder_lm", ...
  std::vector<std::string> model_types;   // transformers' config.json `model_type`
  std::vector<std::string> class_names;   // diffusers' `_class_name`
  std::vector<std::string> policy_types;  // LeRobot's policy `type`
  // Builds the model from the parsed config (`file` names it in errors); parameters uninitialised.
  std::function<std::shared_ptr<Model>(const nlohmann::json& config, const std::string& file)> build;
  // Optional: the build for a folder with weights, given every stored tensor's shape (by stored name), for families
  // whose config does not fix every width (a policy's ResNet backbone named "resnet18" may be a narrow one).
  using TensorShapes = std::map<std::string, std::vector<int64_t>>;
  std::function<std::shared_ptr<Model>(const nlohmann::json& config, const std::string& file, const TensorShapes& shapes)>
      build_for_weights;
  // `loongforge info`: components, shapes and parameter counts from the config alone (no weights allocated).
  std::function<nlohmann::json(const nlohmann::json& config, const std::string& file)> describe;
  // Families that compose models from parts: the projector kinds they know, and the composition.
  std::vector<std::string> projectors;
  std::function<Composition(const ComposeParts& parts)> compose;
};

// Every registered family (the built-in ones are registered on first use).
const std::vector<Family>& families();
// The family that handles a config: its `_class_name`, else its `type`, else its `model_type`; `family` (the
// recipe's model.family, may be empty) picks one by name where the config alone cannot tell. lf::Error naming the
// file, the field and the known values when none does.
const Family& family_for(const nlohmann::json& config, const std::string& file, const std::string& family = "");
// family_for(...).build(config, file).
std::shared_ptr<Model> build_model(const nlohmann::json& config, const std::string& file, const std::string& family = "");
// The composition of the family that knows parts.projector; lf::Error naming `where` (the recipe field or flag) and
// the known kinds otherwise.
Composition compose(const ComposeParts& parts, const std::string& where);
// build_model of a config.json file.
std::shared_ptr<Model> build_model_from_file(const std::string& path, const std::string& family = "");

}  // namespace lf::models
