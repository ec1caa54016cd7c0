// loongforge info: what a model config describes (family, shapes, parameter count, parameters a token goes through
// (MoE: top_k of the routed experts), training FLOPs per token).
#include <cstdio>
#include <filesystem>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/models/llama/config.h"

namespace lf::cli {

void add_info(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  auto* sub = app.add_subcommand("info", "Summarise a model config: family, shapes, parameters, FLOPs per token");
  sub->add_option("model", *path, "a Hugging Face folder or a config.json")->required();
  sub->callback([path] {
    std::string file = *path;
    if (std::filesystem::is_directory(file)) file = (std::filesystem::path(file) / "config.json").string();
    auto c = models::llama::DecoderConfig::from_file(file);
    nlohmann::json j = {{"model_type", c.model_type}, {"parameters", c.num_parameters()},
                        {"layers", c.num_hidden_layers}, {"hidden_size", c.hidden_size},
                        {"heads", c.num_attention_heads}, {"kv_heads", c.num_key_value_heads}, {"head_dim", c.head_dim},
                        {"vocab_size", c.vocab_size}, {"tied_embeddings", c.tie_word_embeddings},
                        {"rope", c.rope.type}, {"active_parameters", c.num_active_parameters()},
                        {"train_flops_per_token_excl_attention", 6 * c.num_active_parameters()}};
    std::printf("%s\n", j.dump(2).c_str());
  });
}

}  // namespace lf::cli
