// The mixture-of-experts block (nn/moe.h): the grouped expert path against a naive per-expert loop, gradients
// against float64 finite differences, capacity dropping, router losses against their formulas, the bias update.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "loongforge/nn/moe.h"
#include "test_util.h"

namespace {

using lf::nn::MoE;
using lf::nn::MoEOptions;

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs().max() / b.to(at::kDouble).abs().max().clamp_min(1e-30))
      .item<double>();
}

void randomize(MoE& m, double gate_std = 1.0) {
  at::NoGradGuard ng;
  m->gate->weight.normal_(0.0, gate_std);
  m->experts->gate_up_proj.normal_(0.0, 0.3);
  m->experts->down_proj.normal_(0.0, 0.3);
}

// The grouped path (permute, at::_grouped_mm over stacked weights, unpermute) equals a loop over experts, forward
// and backward (all of x, both stacked weights and the routing weights), in float32; f = 6 (rows not 16-byte
// aligned) takes the per-expert GEMM fallback.
TEST(MoE, GroupedExpertsMatchPerExpertLoop) {
  for (int64_t f : {16, 6}) {
  at::manual_seed(0);
  const int64_t n = 40, d = 32, e = 5, k = 2;
  MoEOptions o;
  o.num_experts = e, o.top_k = k, o.hidden = d, o.expert_ffn = f;
  at::Tensor logits = at::randn({n, e});
  auto r = lf::nn::route(logits, o);
  at::Tensor x = at::randn({n, d}).requires_grad_();
  at::Tensor gu = (at::randn({e, 2 * f, d}) * 0.3).requires_grad_();
  at::Tensor dn = (at::randn({e, d, f}) * 0.3).requires_grad_();
  at::Tensor w = r.weights.detach().clone().requires_grad_();
  at::Tensor dy = at::randn({n, d});

  auto p = lf::nn::permute(x, r.expert_ids, e);
  EXPECT_EQ(p.counts.sum().item<int64_t>(), n * k);
  at::Tensor y = lf::nn::unpermute(lf::nn::grouped_expert_ffn(p.x, gu, dn, p.offsets), p, w);
  (y * dy).sum().backward();
  std::vector<at::Tensor> g1 = {x.grad().clone(), gu.grad().clone(), dn.grad().clone(), w.grad().clone()};
  for (auto* t : {&x, &gu, &dn, &w}) t->mutable_grad() = at::Tensor();

  at::Tensor yr = lf::nn::experts_reference(x, r.expert_ids, w, gu, dn);
  (yr * dy).sum().backward();
  std::vector<at::Tensor> g2 = {x.grad(), gu.grad(), dn.grad(), w.grad()};
  EXPECT_LE(max_rel(y, yr), 1e-5);
  for (size_t i = 0; i < g1.size(); ++i) EXPECT_LE(max_rel(g1[i], g2[i]), 1e-5) << i << " f=" << f;
  }
}

// Under CPU bf16 autocast (precision bf16) the grouped experts compute in bf16 from the fp32 master weights, like
// autocast's Linear: output bf16, equal (bf16 rounding) to the per-expert loop run under the same autocast (oneDNN's
// bf16 GEMMs; ours multiply the bf16 values in float32 on the CPU), and the fp32 weights receive fp32 gradients close
// to the fp32 run's.
TEST(MoE, GroupedExpertsFollowAutocast) {
  at::manual_seed(1);
  const int64_t n = 48, d = 32, e = 4, k = 2, f = 16;
  MoEOptions o;
  o.num_experts = e, o.top_k = k, o.hidden = d, o.expert_ffn = f;
  auto r = lf::nn::route(at::randn({n, e}), o);
  at::Tensor x = at::randn({n, d});
  at::Tensor gu = (at::randn({e, 2 * f, d}) * 0.3).requires_grad_();
  at::Tensor dn = (at::randn({e, d, f}) * 0.3).requires_grad_();
  at::Tensor dy = at::randn({n, d});
  auto run = [&](bool autocast, bool reference) {
    gu.mutable_grad() = at::Tensor();
    dn.mutable_grad() = at::Tensor();
    at::autocast::set_autocast_enabled(at::kCPU, autocast);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::Tensor y;
    if (reference) {
      y = lf::nn::experts_reference(x, r.expert_ids, r.weights, gu, dn);
    } else {
      auto p = lf::nn::permute(x, r.expert_ids, e);
      y = lf::nn::unpermute(lf::nn::grouped_expert_ffn(p.x, gu, dn, p.offsets), p, r.weights);
    }
    (y.to(at::kFloat) * dy).sum().backward();
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    return std::vector<at::Tensor>{y.detach(), gu.grad().clone(), dn.grad().clone()};
  };
  auto bf = run(true, false), ref = run(true, true), fp = run(false, false);
  EXPECT_EQ(bf[0].scalar_type(), at::kBFloat16);
  EXPECT_EQ(bf[1].scalar_type(), at::kFloat);
  EXPECT_LE(max_rel(bf[0], ref[0]), 2e-2);
  EXPECT_LE(max_rel(bf[0], fp[0]), 3e-2);
  EXPECT_GT(max_rel(bf[0], fp[0]), 1e-6);  // really computed in bf16
  for (size_t i = 1; i < 3; ++i) EXPECT_LE(max_rel(bf[i], fp[i]), 3e-2) << i;
}

// The whole block (router with top-k renormalization, experts, combine) in float64 against central differences:
// gradients of x, the router weight and both stacked expert weights.
TEST(MoE, BlockGradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(1);
  for (bool norm : {false, true}) {
    MoEOptions o;
    o.num_experts = 4, o.top_k = 2, o.hidden = 6, o.expert_ffn = 5, o.norm_topk_prob = norm;
    MoE m(o);
    m->to(at::kDouble);
    randomize(m);
    at::Tensor x = at::randn({2, 3, 6}, at::kDouble);
    at::Tensor dy = at::randn({2, 3, 6}, at::kDouble);
    at::Tensor xg = x.clone().requires_grad_();
    (m->forward(xg) * dy).sum().backward();
    auto f = [&] { return m->forward(x); };
    EXPECT_LE(max_rel(xg.grad(), lf::test::numeric_grad(f, x, dy)), 1e-6);
    for (at::Tensor* p : {&m->gate->weight, &m->experts->gate_up_proj, &m->experts->down_proj}) {
      at::Tensor analytic = p->grad().clone();
      at::Tensor data = p->detach();
      auto fp = [&] { return m->forward(x); };
      EXPECT_LE(max_rel(analytic, lf::test::numeric_grad(fp, data, dy)), 1e-6) << (norm ? "norm" : "plain");
    }
  }
}

// Capacity C = ceil(cf * N * k / E); per expert, assignments ranked by flat (token, slot) order beyond C dropped.
TEST(MoE, CapacityDropsExactlyTheAssignmentsOverCapacity) {
  const int64_t e = 3, n = 7, k = 2;
  at::Tensor ids = at::tensor({0, 1, 0, 2, 1, 0, 0, 1, 2, 0, 1, 2, 0, 2}, at::kLong).view({n, k});
  at::Tensor w = at::rand({n, k});
  const double cf = 0.5;
  const int64_t cap = lf::nn::expert_capacity(n, k, e, cf);
  EXPECT_EQ(cap, 3);  // ceil(0.5 * 14 / 3)
  auto [kept, kw] = lf::nn::apply_capacity(ids, w, e, cf);
  std::vector<int64_t> seen(e, 0);
  auto a = ids.accessor<int64_t, 2>();
  auto b = kept.accessor<int64_t, 2>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      bool keep = seen[a[t][j]]++ < cap;
      EXPECT_EQ(b[t][j], keep ? a[t][j] : -1) << t << "," << j;
      EXPECT_EQ(kw[t][j].item<float>(), keep ? w[t][j].item<float>() : 0.0f);
    }
  // The block with a capacity computes the experts of the kept assignments only.
  at::manual_seed(2);
  MoEOptions o;
  o.num_experts = 4, o.top_k = 2, o.hidden = 8, o.expert_ffn = 8, o.capacity_factor = 0.5;
  MoE m(o);
  randomize(m, 3.0);
  at::Tensor x = at::randn({1, 12, 8});
  at::Tensor y = m->forward(x);
  at::Tensor xf = x.view({12, 8});
  auto r = lf::nn::route(m->router_logits(xf), o);
  auto [ki, kw2] = lf::nn::apply_capacity(r.expert_ids, r.weights, 4, 0.5);
  EXPECT_GT((ki < 0).sum().item<int64_t>(), 0);
  at::Tensor ref = lf::nn::experts_reference(xf, ki, kw2, m->experts->gate_up_proj, m->experts->down_proj);
  EXPECT_LE(max_rel(y.view({12, 8}), ref), 1e-5);
}

// aux_loss = coef_lb * E * sum_e f_e P_e + coef_seq * mean_b sum_e f_be P_be + coef_z * mean logsumexp^2, from the
// router logits directly; and the pooled load-balancing loss of two layers as transformers' function pools them.
TEST(MoE, RouterLossesMatchTheirFormulas) {
  at::manual_seed(3);
  MoEOptions o;
  o.num_experts = 6, o.top_k = 2, o.hidden = 8, o.expert_ffn = 4;
  o.aux_loss_coef = 0.1, o.seq_aux_loss_coef = 0.2, o.z_loss_coef = 0.3;
  MoE m(o);
  randomize(m);
  const int64_t b = 2, t = 5, e = 6, k = 2, n = b * t;
  at::Tensor x = at::randn({b, t, 8}, at::kDouble);
  m->to(at::kDouble);
  m->forward(x);
  ASSERT_TRUE(m->aux_loss.defined());
  at::NoGradGuard ng;
  at::Tensor logits = at::matmul(x.view({n, 8}), m->gate->weight.t());
  at::Tensor p = at::softmax(logits, -1);
  at::Tensor sel = std::get<1>(at::topk(p, k, -1));
  double lb = 0, seq = 0, z = 0;
  for (int64_t ex = 0; ex < e; ++ex) {
    double cnt = (sel == ex).sum().item<double>();
    lb += cnt / n * p.select(1, ex).mean().item<double>();
  }
  lb *= e;
  for (int64_t bi = 0; bi < b; ++bi) {
    double s = 0;
    for (int64_t ex = 0; ex < e; ++ex) {
      double cnt = (sel.slice(0, bi * t, (bi + 1) * t) == ex).sum().item<double>();
      double pm = p.slice(0, bi * t, (bi + 1) * t).select(1, ex).mean().item<double>();
      s += (static_cast<double>(e) / (k * t)) * cnt * pm;
    }
    seq += s / b;
  }
  for (int64_t i = 0; i < n; ++i) {
    double l = at::logsumexp(logits[i], 0).item<double>();
    z += l * l / n;
  }
  EXPECT_NEAR(m->aux_loss.item<double>(), 0.1 * lb + 0.2 * seq + 0.3 * z, 1e-12);

  // Pooled over two layers: E * sum_e (c1 + c2)/(2N) * (P1 + P2)/(2N) (not the sum of the per-layer losses).
  MoE m2(o);
  randomize(m2);
  m2->to(at::kDouble);
  {
    at::AutoGradMode on(true);
    m2->forward(x);
  }
  at::Tensor pooled = lf::nn::load_balancing_loss({m.get(), m2.get()});
  at::Tensor c = m->lb_counts + m2->lb_counts, ps = m->lb_prob_sum + m2->lb_prob_sum;
  double want = 0;
  for (int64_t ex = 0; ex < e; ++ex) want += c[ex].item<double>() / (2 * n) * ps[ex].item<double>() / (2 * n);
  EXPECT_NEAR(pooled.item<double>(), e * want, 1e-12);
  EXPECT_NEAR(m->lb_counts.sum().item<double>(), n * k, 0);
}

// Aux-loss-free balancing: overloaded experts' correction bias goes down by the rate, underloaded ones' up.
TEST(MoE, BiasUpdateMovesTowardsBalance) {
  at::manual_seed(4);
  MoEOptions o;
  o.num_experts = 4, o.top_k = 1, o.hidden = 8, o.expert_ffn = 4, o.scoring = "sigmoid";
  o.score_correction_bias = true, o.bias_update_rate = 0.01;
  MoE m(o);
  randomize(m, 0.1);
  {
    at::NoGradGuard ng;
    m->gate->weight[0].fill_(0.0);
    m->gate->weight[0][0] = 5.0;  // expert 0 wins every token with x[:,0] > 0
  }
  at::Tensor x = at::randn({1, 16, 8});
  x.select(2, 0).abs_().add_(1.0);
  m->forward(x);
  at::Tensor load = m->load_since_update.clone();
  EXPECT_EQ(load[0].item<float>(), 16.0f);
  m->update_bias();
  at::Tensor bias = m->gate->e_score_correction_bias;
  EXPECT_FLOAT_EQ(bias[0].item<float>(), -0.01f);
  for (int i = 1; i < 4; ++i) EXPECT_FLOAT_EQ(bias[i].item<float>(), 0.01f);
  EXPECT_FALSE(m->load_since_update.defined());
  // the bias affects selection, not the combine weights: a large bias on expert 3 sends every token there with
  // its sigmoid score as weight
  {
    at::NoGradGuard ng;
    bias.fill_(0.0);
    bias[3] = 10.0;
  }
  at::Tensor xf = x.view({16, 8});
  at::Tensor logits = m->router_logits(xf);
  auto r = lf::nn::route(logits, o, bias);
  EXPECT_TRUE((r.expert_ids == 3).all().item<bool>());
  o.norm_topk_prob = false;
  r = lf::nn::route(logits, o, bias);
  EXPECT_LE(max_rel(r.weights.view({16}), at::sigmoid(logits.select(1, 3))), 1e-6);
}

// Group-limited top-k: the chosen experts lie in the topk_group groups with the best (top-2 sum) scores.
TEST(MoE, GroupLimitedRoutingStaysInBestGroups) {
  for (std::string scoring : {"sigmoid", "softmax"}) {  // DeepSeek-V3 / GLM-4-MoE, Mistral 4
    at::manual_seed(5);
    MoEOptions o;
    o.num_experts = 8, o.top_k = 2, o.scoring = scoring, o.n_group = 4, o.topk_group = 1;
    o.routed_scaling_factor = 2.5;
    at::Tensor logits = at::randn({20, 8});
    auto r = lf::nn::route(logits, o);
    at::Tensor s = scoring == "sigmoid" ? at::sigmoid(logits) : at::softmax(logits, -1);
    for (int64_t i = 0; i < 20; ++i) {
      at::Tensor gs = std::get<0>(at::topk(s[i].view({4, 2}), 2, -1)).sum(-1);
      int64_t best = gs.argmax().item<int64_t>();
      for (int64_t j = 0; j < 2; ++j) EXPECT_EQ(r.expert_ids[i][j].item<int64_t>() / 2, best) << scoring;
      at::Tensor w = s[i].index_select(0, r.expert_ids[i]);
      EXPECT_LE(max_rel(r.weights[i], w / w.sum() * 2.5), 1e-6) << scoring;
    }
  }
}

// The expert-parallel hook replaces the local experts with the same arguments; the free functions rebuild them.
TEST(MoE, ExpertsHookReceivesRoutingAndReplacesLocalExperts) {
  at::manual_seed(6);
  MoEOptions o;
  o.num_experts = 4, o.top_k = 2, o.hidden = 8, o.expert_ffn = 8;
  MoE m(o);
  randomize(m);
  at::Tensor x = at::randn({2, 3, 8});
  at::Tensor want = m->forward(x);
  int calls = 0;
  m->experts_fn = [&](const at::Tensor& xf, const at::Tensor& ids, const at::Tensor& w) {
    ++calls;
    EXPECT_EQ(xf.sizes().vec(), (std::vector<int64_t>{6, 8}));
    EXPECT_EQ(ids.sizes().vec(), (std::vector<int64_t>{6, 2}));
    auto p = lf::nn::permute(xf, ids, 4);
    return lf::nn::unpermute(lf::nn::grouped_expert_ffn(p.x, m->experts->gate_up_proj, m->experts->down_proj, p.offsets), p, w);
  };
  at::Tensor got = m->forward(x);
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(at::equal(got, want));
}

}  // namespace
