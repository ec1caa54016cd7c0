// loongforge info: what a model config describes (family, shapes, parameter count, parameters a token goes through
// (MoE: top_k of the routed experts), training FLOPs per token).
#include <cstdio>
#include <filesystem>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/registry.h"

namespace lf::cli {

void add_info(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  auto* sub = app.add_subcommand("info", "Summarise a model config: family, shapes, parameters, FLOPs per token");
  sub->add_option("model", *path, "a Hugging Face folder or a config.json (or a robot dataset)")->required();
  sub->callback([path] {
    if (print_robot_dataset_info(*path)) return;
    std::string file = *path;
    if (std::filesystem::is_directory(file)) file = (std::filesystem::path(file) / "config.json").string();
    const nlohmann::json config = read_json_file(file);
    const nlohmann::json j = models::family_for(config, file).describe(config, file);
    std::printf("%s\n", j.dump(2).c_str());
  });
}

}  // namespace lf::cli
