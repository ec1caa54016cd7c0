// Recipes are data: a YAML file under configs/, overlaid on the defaults below and overridden with
// `--set key=value`. Every key is validated against the schema (the defaults): an unknown key is an error naming the
// nearest valid key, a value of the wrong type or outside its choices is an error naming the key.
#pragma once
#include "loongforge/core/error.h"
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lf::train {

// The schema with its defaults, as JSON (documented in docs/recipes.md).
const nlohmann::json& recipe_defaults();

// Loads PATH (YAML; may be empty for defaults only), applies the overrides ("a.b.c=value", the value parsed as YAML
// and typed by the schema), validates, and returns the full recipe.
nlohmann::json load_recipe(const std::string& path, const std::vector<std::string>& overrides = {});

// The valid dotted keys of the schema (lists count as leaves).
std::vector<std::string> recipe_keys();

// Writes the recipe as YAML (stable key order), e.g. into checkpoints for reference.
std::string recipe_to_yaml(const nlohmann::json& recipe);

// The recipe key of a lower layer's option (lf::OptionError: "tp" -> "parallel.tp", "guest_slots" ->
// "moe.guest_slots", "target_modules" -> "lora.target_modules"), and the error naming it
// ("recipe: field 'parallel.tp': ...").
std::string recipe_key_of(const std::string& option);
Error recipe_error(const OptionError& e);
// f() with lower layers' OptionErrors rethrown as recipe errors.
template <class F>
auto with_recipe_keys(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const OptionError& e) {
    throw recipe_error(e);
  }
}

}  // namespace lf::train
