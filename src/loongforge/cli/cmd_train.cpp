// loongforge train / eval: recipes in, checkpoints and metrics out.
#include <cstdio>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/train/policy_eval.h"
#include "loongforge/train/recipe.h"
#include "loongforge/train/trainer.h"

namespace lf::cli {
namespace {
struct TrainArgs {
  std::string recipe;
  std::vector<std::string> sets;
  bool resume = false, show = false;
};
struct EvalArgs {
  std::string recipe, model;
  std::vector<std::string> sets;
  int64_t batches = 0;
  std::string open_loop;
};
}  // namespace

void add_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  auto* sub = app.add_subcommand("train", "Train a model from a YAML recipe (configs/); checkpoints and metrics go to output_dir");
  sub->add_option("recipe", a->recipe, "recipe YAML file")->required();
  sub->add_option("--set", a->sets, "override a recipe key: --set train.steps=100 (repeatable)")->allow_extra_args(false);
  sub->add_flag("--resume", a->resume, "continue from output_dir/checkpoints/latest (bitwise identical)");
  sub->add_flag("--show", a->show, "print the resolved recipe and exit");
  sub->callback([a] {
    auto recipe = train::load_recipe(a->recipe, a->sets);
    if (a->show) {
      std::printf("%s", train::recipe_to_yaml(recipe).c_str());
      return;
    }
    auto out = train::train(recipe, a->resume);
    std::printf("done: %lld steps, last loss %.4f, checkpoint %s\n", static_cast<long long>(out.steps), out.last_loss,
                out.last_checkpoint.c_str());
  });
}

void add_eval(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  auto* sub = app.add_subcommand("eval", "Validation loss of a checkpoint (or HF folder) on a recipe's held-out data");
  sub->add_option("recipe", a->recipe, "recipe YAML file (its data block is used)")->required();
  sub->add_option("--model", a->model, "checkpoint folder or HF folder")->required();
  sub->add_option("--set", a->sets, "override a recipe key (repeatable)");
  sub->add_option("--batches", a->batches, "batches to evaluate (default: eval.batches)");
  sub->add_option("--open-loop", a->open_loop,
                  "robot policies: open-loop action errors on the held-out episodes, with plots, written to this folder");
  sub->callback([a] {
    auto recipe = train::load_recipe(a->recipe, a->sets);
    if (!a->open_loop.empty()) {
      auto model = io::load_model(a->model, at::kFloat, recipe["model"]["family"].get<std::string>());
      const train::OpenLoopReport rep = train::open_loop_eval(recipe, *model, a->open_loop);
      std::printf("%s\n", rep.to_json().dump().c_str());
      return;
    }
    int64_t n = a->batches > 0 ? a->batches : recipe["eval"]["batches"].get<int64_t>();
    double loss = train::evaluate(recipe, a->model, n);
    std::printf("{\"valid_loss\": %.6f, \"batches\": %lld}\n", loss, static_cast<long long>(n));
  });
}

}  // namespace lf::cli
