#include "loongforge/train/policy_runner.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <filesystem>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/robot/normalize.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/policy_processor.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/train/prompt_encoder.h"

namespace lf::train {

namespace fs = std::filesystem;
namespace robot = data::robot;

namespace {

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// The statistics a policy's own processor steps keep (GR00T's pack / unpack): every state file of the preprocessor's
// steps, "<feature>.<stat>" tensors; the normaliser's are read by io::read_policy_normalization.
void read_step_stats(const std::string& dir, std::map<std::string, std::map<std::string, at::Tensor>>& stats) {
  const fs::path file = fs::path(dir) / "policy_preprocessor.json";
  if (!fs::exists(file)) return;
  const nlohmann::json j = read_json_file(file.string());
  if (!j.contains("steps") || !j["steps"].is_array()) return;
  for (const auto& step : j["steps"]) {
    if (!step.is_object() || !step.contains("state_file") || !step["state_file"].is_string()) continue;
    const fs::path sf = fs::path(dir) / step["state_file"].get<std::string>();
    if (!fs::exists(sf)) throw file_error(file.string(), "state_file", sf.filename().string() + " is missing");
    auto st = io::SafetensorsFile::open(sf.string());
    for (const auto& e : st->entries()) {
      const size_t dot = e.name.rfind('.');
      if (dot == std::string::npos || dot == 0) continue;
      auto& dst = stats[e.name.substr(0, dot)];
      const std::string stat = e.name.substr(dot + 1);
      if (!dst.count(stat)) dst[stat] = st->tensor(e.name).to(at::kFloat);
    }
  }
}

}  // namespace

PolicyRunner::PolicyRunner(const std::string& dir, const std::string& device) : dir_(dir) {
  if (!fs::is_directory(dir)) throw Error(dir + ": not a policy folder (config.json, model.safetensors)");
  if (!fs::exists(fs::path(dir) / "config.json")) throw Error(dir + ": no config.json (a LeRobot policy folder)");
  if (device != "cpu" && device != "cuda") throw Error("device '" + device + "': expected cpu or cuda");
  model_ = io::load_model(dir);
  policy_ = models::as_policy(*model_);
  if (!policy_)
    throw file_error((fs::path(dir) / "config.json").string(), "type",
                     "the " + model_->model_type() + " model is not a robot policy");
  const at::Device dev = kernels::cuda::usable_device(device == "cuda");
  if (dev.is_cuda()) model_->to(dev);
  model_->eval();
  spec_ = policy_->policy_spec();

  // a policy with its own processor steps (GR00T: its pack step normalises with the statistics read below) may have
  // no normaliser step
  const std::optional<io::PolicyNormalization> n =
      io::read_policy_normalization(dir, !spec_.preprocessor_steps.is_null() && !spec_.stats_features.empty());
  if (n) {
    for (const auto& [name, mode] : n->modes) modes_[name] = static_cast<int>(mode);
    stats_ = n->stats;
    eps_ = n->eps;
  } else {  // a folder without LeRobot's processor files: only a policy that normalises nothing runs from it
    for (const auto* list : {&spec_.inputs, &spec_.outputs})
      for (const auto& f : *list)
        if (robot::parse_norm_mode(spec_.mode_of(f)) != robot::NormMode::identity)
          throw Error(dir + ": no policy_preprocessor.json (LeRobot's processor files with the normalisation "
                            "statistics) for a policy that normalises " + f.name);
  }
  if (!spec_.stats_features.empty()) read_step_stats(dir, stats_);
  for (const auto& name : spec_.stats_features)
    if (!stats_.count(name))
      throw file_error((fs::path(dir) / "policy_preprocessor.json").string(), "steps",
                       "no statistics of '" + name + "' in the processor steps' state files");
  if (PromptEncoder::needed(spec_))
    prompt_ = std::make_unique<PromptEncoder>(*policy_, spec_, prompt_tokenizer_folder("", dir, model_->model_type()),
                                              model_->model_type());
}

PolicyRunner::~PolicyRunner() = default;

nlohmann::json PolicyRunner::metadata() const {
  auto feats = [](const std::vector<models::PolicyFeature>& list) {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& f : list) j[f.name] = {{"type", f.type}, {"shape", f.shape}};
    return j;
  };
  int64_t action_dim = 0;
  for (const auto& f : spec_.outputs)
    if (f.name == "action" && !f.shape.empty()) action_dim = f.shape.back();
  const int64_t chunk = spec_.action_offsets.empty() ? 1 : static_cast<int64_t>(spec_.action_offsets.size());
  return {{"policy_type", model_->model_type()},
          {"input_features", feats(spec_.inputs)},
          {"output_features", feats(spec_.outputs)},
          {"action_shape", {chunk, action_dim}},
          {"n_action_steps", spec_.n_action_steps},
          {"prompt", PromptEncoder::needed(spec_)}};
}

at::Tensor PolicyRunner::predict(const std::map<std::string, at::Tensor>& observation, const std::string& prompt,
                                 uint64_t seed) {
  std::lock_guard<std::mutex> lock(mu_);
  Batch b;
  for (const auto& f : spec_.inputs) {
    if (f.type == "LANGUAGE") continue;  // the prompt's tokens, made below
    auto it = observation.find(f.name);
    if (it == observation.end()) {
      std::string have;
      for (const auto& [k, v] : observation) have += (have.empty() ? "" : ", ") + k;
      throw Error("observation '" + f.name + "': missing (the policy reads it; given: " +
                  (have.empty() ? std::string("nothing") : have) + ")");
    }
    at::Tensor x = it->second.to(at::kCPU);
    const std::string what = "observation '" + f.name + "'";
    const int64_t S = static_cast<int64_t>(spec_.observation_offsets.size());
    bool window = false;  // x holds the S frames of the policy's observation window
    if (f.type == "VISUAL") {
      if (f.shape.size() != 3) throw Error(what + ": the policy's camera shape is not [C, H, W]");
      const int64_t C = f.shape[0], H = f.shape[1], W = f.shape[2];
      const auto is = [&](int64_t a, int64_t b2, int64_t c) {
        return x.size(-3) == a && x.size(-2) == b2 && x.size(-1) == c;
      };
      window = S > 1 && x.dim() == 4 && x.size(0) == S && (is(C, H, W) || is(H, W, C));
      if (!window && x.dim() == 4 && x.size(0) == 1) x = x.squeeze(0);
      const bool chw = x.dim() == 3 + window && is(C, H, W), hwc = x.dim() == 3 + window && is(H, W, C);
      if (!chw && !hwc)
        throw Error(what + ": shape " + shape_str(x.sizes()) + ", the policy reads a camera of " + shape_str(f.shape) +
                    " ([C, H, W], or [H, W, C] as a robot sends it" +
                    (S > 1 ? "; or " + std::to_string(S) + " such frames, oldest first" : std::string()) + ")");
      if (x.is_complex() || x.scalar_type() == at::kBool) throw Error(what + ": not an image's dtype");
      const bool unit = chw && x.is_floating_point();  // LeRobot's float frames, already in [0, 1]
      if (!chw) x = window ? x.permute({0, 3, 1, 2}) : x.permute({2, 0, 1});
      x = x.to(at::kFloat);
      if (!unit) x = x.div(255.0);
    } else {
      if (x.is_complex() || x.scalar_type() == at::kBool) throw Error(what + ": not a numeric dtype");
      int64_t d = 1;
      for (int64_t s : f.shape) d *= s;
      window = S > 1 && x.numel() == S * d && x.dim() >= 2 && x.size(0) == S;
      if (x.numel() != d && !window)
        throw Error(what + ": shape " + shape_str(x.sizes()) + ", the policy reads " + shape_str(f.shape) +
                    (S > 1 ? " (or " + std::to_string(S) + " such frames, oldest first)" : std::string()));
      std::vector<int64_t> shape = f.shape;
      if (window) shape.insert(shape.begin(), S);
      x = x.to(at::kFloat).reshape(shape);
    }
    if (!at::isfinite(x).all().item<bool>()) throw Error(what + ": not finite");
    auto m = modes_.find(f.name);
    if (m != modes_.end() && m->second != static_cast<int>(robot::NormMode::identity))
      x = robot::normalize(x, stats_.at(f.name), static_cast<robot::NormMode>(m->second), f.name, eps_);
    // a policy with an observation window given one frame sees it at every offset (LeRobot's queues at an episode's
    // start, filled with copies of the first observation)
    if (S > 0 && !window) x = at::stack(std::vector<at::Tensor>(static_cast<size_t>(S), x));
    b.set(f.name, x.unsqueeze(0).contiguous());
  }
  if (prompt_) {
    if (prompt.empty()) throw Error("observation 'prompt': the " + model_->model_type() + " policy reads the task text");
    prompt_->add(b, {prompt});
  }
  b = policy_->pack_batch(b, stats_);

  torch::NoGradGuard no_grad;
  const auto params = model_->parameters();
  const at::Device device = params.empty() ? at::Device(at::kCPU) : params.front().device();
  const at::ScalarType dtype = params.empty() ? at::kFloat : params.front().scalar_type();
  b = b.map([&](const std::string&, const at::Tensor& t) {
    return t.is_floating_point() ? t.to(device, dtype) : t.to(device);
  });
  at::manual_seed(seed);
  const bool was_training = model_->is_training();
  model_->eval();
  at::Tensor chunk = policy_->predict_action_chunk(b).to(at::kCPU, at::kFloat);
  if (was_training) model_->train();
  if (at::Tensor own = policy_->unpack_action(chunk, stats_); own.defined()) {
    chunk = own;
  } else {
    auto m = modes_.find("action");
    if (m != modes_.end() && m->second != static_cast<int>(robot::NormMode::identity))
      chunk = robot::unnormalize(chunk, stats_.at("action"), static_cast<robot::NormMode>(m->second), "action", eps_);
  }
  return chunk.squeeze(0).to(at::kFloat).contiguous();
}

}  // namespace lf::train
