// ACT (models/policy/act.h): `info`'s parameter counts from the config alone = the built policy's; temporal
// ensembling (models/policy/temporal_ensemble.h) = the offline weighted average it stands for, and the hook that
// tests/python/test_act_parity.py runs against LeRobot's ACTTemporalEnsembler; ACT's dropout kernel (kernels/dropout.h).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "loongforge/io/safetensors.h"
#include "loongforge/kernels/dropout.h"
#include "loongforge/models/policy/act.h"
#include "loongforge/models/policy/temporal_ensemble.h"
#include "test_util.h"

using lf::models::policy::TemporalEnsembler;

namespace {

nlohmann::json act_config(nlohmann::json inputs, int64_t action_dim, nlohmann::json extra) {
  nlohmann::json j = {{"type", "act"}, {"input_features", nlohmann::json::object()},
                      {"output_features", {{"action", {{"type", "ACTION"}, {"shape", {action_dim}}}}}}};
  for (auto& [name, f] : inputs.items()) j["input_features"][name] = {{"type", f[0]}, {"shape", f[1]}};
  // LeRobot's defaults, as its config.json always holds them
  j.update({{"n_encoder_layers", 4}, {"n_decoder_layers", 1}, {"latent_dim", 32}, {"dim_feedforward", 3200}});
  j.update(extra);
  return j;
}

}  // namespace

TEST(Act, DescribeCountsEqualTheBuiltModel) {
  const std::vector<nlohmann::json> configs = {
      // the real defaults: one camera, state, resnet18 at full width, dim_model 512
      act_config({{"observation.state", {"STATE", {14}}}, {"observation.images.top", {"VISUAL", {3, 96, 128}}}}, 14,
                 {{"chunk_size", 50}, {"n_action_steps", 50}}),
      // resnet50 with the dilated last stage, two cameras, environment state, pre-norm
      act_config({{"observation.state", {"STATE", {6}}}, {"observation.environment_state", {"ENV", {5}}},
                  {"observation.images.left", {"VISUAL", {3, 64, 64}}},
                  {"observation.images.right", {"VISUAL", {3, 64, 64}}}},
                 7, {{"vision_backbone", "resnet50"}, {"replace_final_stride_with_dilation", true}, {"pre_norm", true},
                     {"dim_model", 64}, {"dim_feedforward", 96}, {"n_decoder_layers", 2}, {"chunk_size", 10},
                     {"n_action_steps", 1}, {"temporal_ensemble_coeff", 0.01}}),
      // resnet34, no state, no CVAE
      act_config({{"observation.images.top", {"VISUAL", {3, 32, 32}}}}, 3,
                 {{"vision_backbone", "resnet34"}, {"use_vae", false}, {"dim_model", 32}, {"n_heads", 4},
                  {"dim_feedforward", 40}, {"chunk_size", 4}, {"n_action_steps", 4}}),
      // no camera: environment state only, the CVAE without a state token
      act_config({{"observation.environment_state", {"ENV", {9}}}}, 2,
                 {{"dim_model", 16}, {"n_heads", 2}, {"dim_feedforward", 24}, {"n_encoder_layers", 3},
                  {"n_vae_encoder_layers", 2}, {"latent_dim", 8}, {"chunk_size", 5}, {"n_action_steps", 5}}),
  };
  for (const auto& j : configs) {
    const nlohmann::json info = lf::models::policy::describe_act(j, "config.json");
    auto model = std::dynamic_pointer_cast<lf::models::policy::ACTPolicyImpl>(lf::models::policy::build_act(j, "config.json"));
    ASSERT_TRUE(model);
    int64_t total = 0;
    nlohmann::json built = nlohmann::json::object();
    for (const auto& child : model->model->named_children()) {
      int64_t n = 0;
      for (const auto& p : child.value()->parameters()) n += p.numel();
      built[child.key()] = {{"parameters", n}};
      total += n;
    }
    EXPECT_EQ(info["components"], built) << j.dump();
    EXPECT_EQ(info["parameters"].get<int64_t>(), total) << j.dump();
    int64_t all = 0;
    for (const auto& p : model->parameters()) all += p.numel();
    EXPECT_EQ(total, all);
  }
}

// The online average equals the offline one: step t's action averages the predictions for t of the chunks from
// steps max(0, t - chunk + 1) .. t, weights exp(-coeff * i), i = 0 the oldest.
TEST(ActTemporalEnsemble, EqualsTheOfflineAverage) {
  for (const double coeff : {0.01, 0.0, -0.3, 0.5}) {
    const int64_t B = 2, chunk = 5, A = 3, steps = 12;
    at::manual_seed(3);
    const at::Tensor chunks = at::randn({steps, B, chunk, A}, at::kFloat);
    TemporalEnsembler e(coeff, chunk);
    for (int64_t t = 0; t < steps; ++t) {
      const at::Tensor got = e.update(chunks[t]);
      at::Tensor num = at::zeros({B, A}, at::kDouble);
      double den = 0;
      for (int64_t s = std::max<int64_t>(0, t - chunk + 1), i = 0; s <= t; ++s, ++i) {
        const double w = std::exp(-coeff * static_cast<double>(i));
        num += w * chunks[s].select(1, t - s).to(at::kDouble);
        den += w;
      }
      EXPECT_LE((got.to(at::kDouble) - num / den).abs().max().item<double>(), 2e-6) << "coeff " << coeff << " step " << t;
      EXPECT_EQ(e.pending(), chunk - 1);
    }
    e.reset();
    EXPECT_EQ(e.pending(), 0);
    EXPECT_TRUE(at::equal(e.update(chunks[3]), chunks[3].select(1, 0)));  // a new episode starts from the chunk
  }
  TemporalEnsembler e(0.01, 4);
  EXPECT_NE(lf::test::error_of([&] { e.update(at::zeros({1, 3, 2})); }).find("[B, 4, action_dim], got [1, 3, 2]"),
            std::string::npos);
  e.update(at::zeros({1, 4, 2}));
  EXPECT_NE(lf::test::error_of([&] { e.update(at::zeros({2, 4, 2})); }).find("does not continue"), std::string::npos);
}

// LF_TEST_ACT_ENSEMBLE=FILE (tests/python/test_act_parity.py): FILE holds `coeff` [1] (float64), `chunks` [T, B,
// chunk, A], `reset_at` [1] (the step before which the episode restarts) and LeRobot's `actions` [T, B, A]; ours must
// equal them to 1e-6.
TEST(ActTemporalEnsemble, LeRobotHook) {
  const char* path = std::getenv("LF_TEST_ACT_ENSEMBLE");
  if (!path) GTEST_SKIP() << "LF_TEST_ACT_ENSEMBLE not set";
  const auto f = lf::io::SafetensorsFile::open(path);
  const at::Tensor chunks = f->tensor("chunks"), want = f->tensor("actions");
  const int64_t reset_at = f->tensor("reset_at").item<int64_t>();
  TemporalEnsembler e(f->tensor("coeff").item<double>(), chunks.size(2));
  for (int64_t t = 0; t < chunks.size(0); ++t) {
    if (t == reset_at) e.reset();
    const at::Tensor got = e.update(chunks[t]);
    ASSERT_EQ(got.sizes(), want[t].sizes());
    const double diff = (got - want[t]).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6) << "step " << t;
  }
}

// kernels/dropout.h (ACT's dropout): the kept share is 1 - p, kept elements scaled by 1 / (1 - p), the gradient uses
// the forward's mask, the masks repeat after at::manual_seed and do not depend on the thread count.
TEST(KernelsDropout, MaskScaleGradientAndSeed) {
  const double p = 0.1;
  const at::Tensor x = at::rand({1001, 257}, at::kFloat) + 1;  // no zeros: a zero output means dropped
  at::manual_seed(7);
  at::Tensor xr = x.clone().requires_grad_(true);
  const at::Tensor y = lf::kernels::dropout(xr, p);
  const at::Tensor kept = y != 0;
  const double share = kept.to(at::kDouble).mean().item<double>();
  EXPECT_NEAR(share, 1 - p, 0.005);
  EXPECT_TRUE(at::allclose(y.masked_select(kept), x.masked_select(kept) / (1 - p), 1e-6, 0));
  const at::Tensor g = at::randn_like(x);
  y.backward(g);
  EXPECT_TRUE(at::equal(xr.grad(), at::where(kept, g * static_cast<float>(1 / (1 - p)), at::zeros_like(g))));
  // the same seed, another thread count: the same mask
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  at::manual_seed(7);
  const at::Tensor y1 = lf::kernels::dropout(x, p);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(y1, y.detach()));
  // the next draw differs; neighbouring elements are independent (no pair always kept or dropped together)
  const at::Tensor y2 = lf::kernels::dropout(x, p);
  EXPECT_FALSE(at::equal(y2, y1));
  const at::Tensor k = (y2 != 0).flatten().to(at::kDouble);
  const double both = (k.narrow(0, 0, k.numel() - 1) * k.narrow(0, 1, k.numel() - 1)).mean().item<double>();
  EXPECT_NEAR(both, (1 - p) * (1 - p), 0.005);
  EXPECT_TRUE(at::equal(lf::kernels::dropout(x, 0), x));
}
