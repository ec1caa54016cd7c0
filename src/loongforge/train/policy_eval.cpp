#include "loongforge/train/policy_eval.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/robot/normalize.h"
#include "loongforge/io/plot.h"
#include "loongforge/models/policy_io.h"
#include "loongforge/train/builders.h"
#include "loongforge/train/robot_source.h"

namespace lf::train {

namespace fs = std::filesystem;

nlohmann::json OpenLoopReport::to_json() const {
  return {{"episodes", episodes},         {"chunks", chunks},           {"mse", mse},
          {"mae", mae},                   {"mse_per_dim", mse_per_dim}, {"mae_per_dim", mae_per_dim},
          {"mse_per_step", mse_per_step}, {"mae_per_step", mae_per_step}, {"plots", plots}};
}

OpenLoopReport open_loop_eval(const nlohmann::json& r, models::Model& model, const std::string& plot_dir,
                              int64_t max_plot_episodes) {
  models::Policy* policy = models::as_policy(model);
  if (!policy) throw Error("open-loop evaluation: the " + model.model_type() + " model is not a robot policy");
  if (r["data"]["format"] != "robot")
    throw Error("recipe: field 'data.format': open-loop evaluation reads a robot dataset (data.format: robot)");
  if (r["data"]["robot"]["valid_episodes"].get<int64_t>() < 1)
    throw Error("recipe: field 'data.robot.valid_episodes': open-loop evaluation needs held-out episodes");
  const models::PolicySpec spec = policy->policy_spec();
  RobotSourceOptions o = robot_source_options(r, data::Split::Valid);
  o.stride = spec.n_action_steps;
  RobotSource src(o, model);
  const std::string action = "action";
  const data::robot::NormMode mode = src.modes().count(action) ? src.modes().at(action) : data::robot::NormMode::identity;
  auto unnorm = [&](const at::Tensor& x) {
    // a policy with its own postprocessor (GR00T) unpacks its chunk itself
    if (at::Tensor own = policy->unpack_action(x, src.stats()); own.defined()) return own;
    return mode == data::robot::NormMode::identity ? x : data::robot::unnormalize(x, src.stats().at(action), mode, action);
  };
  // Where each predicted step's recorded action sits in the batch's action window.
  const std::vector<int64_t>& offsets = spec.action_offsets;

  const bool was_training = model.is_training();
  model.eval();
  torch::NoGradGuard no_grad;
  at::manual_seed(static_cast<uint64_t>(r["seed"].get<int64_t>()));
  const at::Device device = model.parameters().empty() ? at::Device(at::kCPU) : model.parameters().front().device();
  const at::ScalarType dtype = model.parameters().empty() ? at::kFloat : model.parameters().front().scalar_type();

  const int64_t total = src.rows_per_epoch(), mb = std::max<int64_t>(1, r["train"]["micro_batch_size"].get<int64_t>());
  std::vector<double> sq_dim, ab_dim, sq_step, ab_step, n_dim, n_step;
  double sq = 0, ab = 0, n_all = 0;
  // per episode position: frame -> (recorded, predicted) actions of the executed steps
  std::map<int64_t, std::map<int64_t, std::pair<at::Tensor, at::Tensor>>> traj;
  OpenLoopReport rep;
  for (int64_t done = 0; done < total;) {
    const int64_t n = std::min(mb, total - done);
    Batch b = src.next(n).map([&](const std::string&, const at::Tensor& t) {
      return t.is_floating_point() ? t.to(device, dtype) : t.to(device);
    });
    const at::Tensor pred = unnorm(policy->predict_action_chunk(b).to(at::kCPU, at::kFloat));  // [n, P, A]
    const at::Tensor rec = unnorm(b.at(action).to(at::kCPU, at::kFloat));                      // [n, W, A]
    const at::Tensor pad = b.at(action + "_is_pad").to(at::kCPU);                             // [n, W]
    const int64_t P = pred.size(1), A = pred.size(2);
    if (sq_dim.empty()) {
      sq_dim.assign(A, 0), ab_dim.assign(A, 0), n_dim.assign(A, 0);
      sq_step.assign(P, 0), ab_step.assign(P, 0), n_step.assign(P, 0);
    }
    for (int64_t j = 0; j < P; ++j) {
      auto it = std::find(offsets.begin(), offsets.end(), j);
      if (it == offsets.end()) continue;  // a predicted step with no recorded counterpart in the window
      const int64_t w = it - offsets.begin();
      const at::Tensor err = (pred.select(1, j) - rec.select(1, w)).to(at::kDouble);  // [n, A]
      const at::Tensor valid = pad.select(1, w).logical_not().to(at::kDouble).unsqueeze(1);  // [n, 1]
      const at::Tensor e2 = (err * err * valid), e1 = (err.abs() * valid);
      const double v = valid.sum().item<double>();
      sq_step[j] += e2.sum().item<double>(), ab_step[j] += e1.sum().item<double>(), n_step[j] += v * A;
      const at::Tensor s2 = e2.sum(0), s1 = e1.sum(0);
      for (int64_t a = 0; a < A; ++a) sq_dim[a] += s2[a].item<double>(), ab_dim[a] += s1[a].item<double>(), n_dim[a] += v;
      sq += e2.sum().item<double>(), ab += e1.sum().item<double>(), n_all += v * A;
    }
    for (int64_t i = 0; i < n; ++i) {
      const data::robot::FrameRef f = src.frame_of(done + i);
      auto& t = traj[f.episode];
      const int64_t length = src.dataset().episodes()[static_cast<size_t>(f.episode)].length;
      for (int64_t j = 0; j < std::min(P, spec.n_action_steps); ++j) {
        auto it = std::find(offsets.begin(), offsets.end(), j);
        if (it == offsets.end() || f.frame + j >= length) continue;
        t[f.frame + j] = {rec[i][it - offsets.begin()], pred[i][j]};
      }
    }
    rep.chunks += n;
    done += n;
  }
  model.train(was_training);
  auto ratio = [](const std::vector<double>& s, const std::vector<double>& c) {
    std::vector<double> out(s.size());
    for (size_t i = 0; i < s.size(); ++i) out[i] = c[i] > 0 ? s[i] / c[i] : 0;
    return out;
  };
  rep.episodes = static_cast<int64_t>(traj.size());
  rep.mse = n_all > 0 ? sq / n_all : 0, rep.mae = n_all > 0 ? ab / n_all : 0;
  rep.mse_per_dim = ratio(sq_dim, n_dim), rep.mae_per_dim = ratio(ab_dim, n_dim);
  rep.mse_per_step = ratio(sq_step, n_step), rep.mae_per_step = ratio(ab_step, n_step);
  if (plot_dir.empty()) return rep;
  fs::create_directories(plot_dir);
  int64_t plotted = 0;
  for (const auto& [episode, frames] : traj) {
    if (plotted++ >= max_plot_episodes) break;
    const int64_t index = src.dataset().episodes()[static_cast<size_t>(episode)].index;
    const int64_t A = frames.begin()->second.first.size(0);
    for (int64_t a = 0; a < A; ++a) {
      io::Series recorded{"recorded", {}, {}, 0x1f77b4}, predicted{"predicted", {}, {}, 0xff7f0e};
      for (const auto& [frame, ra] : frames) {
        recorded.x.push_back(static_cast<double>(frame)), recorded.y.push_back(ra.first[a].item<double>());
        predicted.x.push_back(static_cast<double>(frame)), predicted.y.push_back(ra.second[a].item<double>());
      }
      const std::string path = (fs::path(plot_dir) / ("episode_" + std::to_string(index) + "_action_" +
                                                      std::to_string(a) + ".png")).string();
      io::write_line_plot(path, "episode " + std::to_string(index) + ", action[" + std::to_string(a) +
                                    "]: recorded vs open-loop prediction (every " +
                                    std::to_string(spec.n_action_steps) + " frames)",
                          {recorded, predicted}, 700, 320);
      rep.plots.push_back(path);
    }
  }
  write_file_atomic((fs::path(plot_dir) / "open_loop.json").string(), rep.to_json().dump(2) + "\n");
  return rep;
}

}  // namespace lf::train
