// loongforge predict: one observation through a trained policy folder (train/policy_runner.h), as a robot would query
// it: the unnormalised action chunk, printed as JSON or written to a safetensors file. The observation file holds one
// tensor per input feature, named by its LeRobot feature name (raw: uint8 [H, W, C] camera frames, float state).
#include <cstdio>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/train/policy_runner.h"

namespace lf::cli {

namespace {
struct PredictArgs {
  std::string policy, observation, prompt, out, device = "cpu";
  uint64_t seed = 0;
};
}  // namespace

void add_predict(CLI::App& app) {
  auto a = std::make_shared<PredictArgs>();
  auto* sub = app.add_subcommand("predict", "Predict a robot policy's action chunk for one raw observation");
  sub->add_option("--policy", a->policy, "a policy folder (LeRobot's layout: config.json, model.safetensors, processors)")
      ->required();
  sub->add_option("--observation", a->observation,
                  "a safetensors file: one tensor per input feature, by its LeRobot name (raw values)")
      ->required();
  sub->add_option("--prompt", a->prompt, "the task text (policies that read one)");
  sub->add_option("--seed", a->seed, "the sampler's seed (flow matching / diffusion policies)");
  sub->add_option("--device", a->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  sub->add_option("--out", a->out, "write the chunk [chunk, action_dim] as 'action' to this safetensors file");
  sub->callback([a] {
    train::PolicyRunner runner(a->policy, a->device);
    std::map<std::string, at::Tensor> obs;
    auto f = io::SafetensorsFile::open(a->observation);
    for (const auto& e : f->entries()) obs[e.name] = f->tensor(e.name);
    at::Tensor chunk;
    try {
      chunk = runner.predict(obs, a->prompt, a->seed);
    } catch (const Error& e) {
      throw Error(a->observation + ": " + e.what());
    }
    if (!a->out.empty()) {
      io::save_file(a->out, {{"action", chunk}});
      return;
    }
    nlohmann::json j = runner.metadata();
    nlohmann::json rows = nlohmann::json::array();
    for (int64_t i = 0; i < chunk.size(0); ++i) {
      nlohmann::json r = nlohmann::json::array();
      for (int64_t k = 0; k < chunk.size(1); ++k) r.push_back(chunk[i][k].item<double>());
      rows.push_back(r);
    }
    j["actions"] = rows;
    std::printf("%s\n", j.dump().c_str());
  });
}

}  // namespace lf::cli
