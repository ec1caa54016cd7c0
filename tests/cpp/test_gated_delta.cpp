// The gated delta rule (nn/gated_delta.h), with a per-head decay (Gated DeltaNet) and a per-key-channel one (Kimi
// Delta Attention): the fused CPU kernel and the chunk-wise composite against a float64 token-by-token reference written here (values, final state
// and every input's gradient), for lengths below, at and above the chunk and not a multiple of it, grouped key heads,
// an initial state; the recurrent form (generation) against the same reference; the causal depthwise convolution
// against at::conv1d, also when continued from its state; and a float64 finite-difference check of the chunk-wise
// gradients.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "loongforge/kernels/gated_delta.h"
#include "loongforge/nn/gated_delta.h"

namespace {

using at::Tensor;

// Token by token in float64, straight from the definition: S = e^g S (per channel: diag(e^g) S);
// S += k (beta (v - S^T k))^T; o = S^T q.
std::pair<Tensor, Tensor> reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                    const Tensor& beta, const Tensor& s0) {
  const int64_t b = k.size(0), t = k.size(1), hk = k.size(2), dk = k.size(3), h = v.size(2), dv = v.size(3);
  Tensor s = s0.defined() ? s0 : at::zeros({b, h, dk, dv}, v.options());
  std::vector<Tensor> outs;
  for (int64_t i = 0; i < t; ++i) {
    std::vector<Tensor> heads;
    std::vector<Tensor> states;
    for (int64_t j = 0; j < h; ++j) {
      const int64_t kh = j / (h / hk);
      Tensor qi = q.select(1, i).select(1, kh), ki = k.select(1, i).select(1, kh);  // [b, dk]
      Tensor sj = s.select(1, j) * g.select(1, i).select(1, j).exp().view({b, g.dim() == 4 ? dk : 1, 1});
      Tensor pred = at::bmm(ki.unsqueeze(1), sj).squeeze(1);  // S^T k  [b, dv]
      Tensor delta = (v.select(1, i).select(1, j) - pred) * beta.select(1, i).select(1, j).unsqueeze(1);
      sj = sj + at::bmm(ki.unsqueeze(2), delta.unsqueeze(1));
      heads.push_back(at::bmm(qi.unsqueeze(1), sj).squeeze(1));
      states.push_back(sj);
    }
    s = at::stack(states, 1);
    outs.push_back(at::stack(heads, 1));
  }
  return {at::stack(outs, 1), s};
}

struct Inputs {
  Tensor q, k, v, g, beta, s0;
  std::vector<Tensor> all() const { return {q, k, v, g, beta, s0}; }
};

Inputs make(int64_t b, int64_t t, int64_t hk, int64_t h, int64_t dk, int64_t dv, bool with_state, int seed,
            bool channel = false) {
  at::manual_seed(seed);
  auto o = at::TensorOptions().dtype(at::kDouble);
  Inputs in;
  // L2-normalised keys (as the layers feed them: the delta rule is stable for |k| <= 1, beta in (0, 1))
  in.q = (at::randn({b, t, hk, dk}, o) * 0.5).requires_grad_();
  in.k = lf::nn::l2_normalize(at::randn({b, t, hk, dk}, o)).detach().requires_grad_();
  in.v = at::randn({b, t, h, dv}, o).requires_grad_();
  // per-channel decays spread widely (some channels forget fast, others hardly), as KDA's gates
  in.g = channel ? (-at::rand({b, t, h, dk}, o) * at::rand({1, 1, 1, dk}, o) * 2.0).requires_grad_()
                 : (-at::rand({b, t, h}, o) * 0.5).requires_grad_();
  in.beta = at::sigmoid(at::randn({b, t, h}, o)).detach().requires_grad_();
  if (with_state) in.s0 = (at::randn({b, h, dk, dv}, o) * 0.3).requires_grad_();
  return in;
}

double rel(const Tensor& a, const Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

// Chunk-wise vs reference for one shape: outputs, final state and the gradients of a random projection of both.
void check_chunk(int64_t t, int64_t chunk, int64_t hk, int64_t h, bool with_state, bool channel = false) {
  SCOPED_TRACE("t=" + std::to_string(t) + " chunk=" + std::to_string(chunk) + " hk=" + std::to_string(hk) +
               " h=" + std::to_string(h) + " state=" + std::to_string(with_state) + " channel=" + std::to_string(channel));
  Inputs in = make(2, t, hk, h, 5, 3, with_state, static_cast<int>(t * 7 + chunk), channel);
  auto [o_ref, s_ref] = reference(in.q, in.k, in.v, in.g, in.beta, in.s0);
  Tensor wo = at::randn_like(o_ref), ws = at::randn_like(s_ref);
  std::vector<Tensor> inputs;
  for (const Tensor& x : in.all())
    if (x.defined()) inputs.push_back(x);
  auto g_ref = torch::autograd::grad({(o_ref * wo).sum() + (s_ref * ws).sum()}, inputs);
  // the fused CPU kernel (what chunk_gated_delta_rule runs here) and the chunk-wise composite
  for (bool fused : {true, false}) {
    SCOPED_TRACE(fused ? "fused kernel" : "chunk-wise composite");
    auto [o, s] = fused ? lf::nn::chunk_gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, in.s0, chunk, true)
                        : lf::nn::chunk_gated_delta_rule_reference(in.q, in.k, in.v, in.g, in.beta, in.s0, chunk, true);
    ASSERT_EQ(o.sizes(), o_ref.sizes());
    EXPECT_LT(rel(o, o_ref), 1e-12);
    EXPECT_LT(rel(s, s_ref), 1e-12);
    auto g = torch::autograd::grad({(o * wo).sum() + (s * ws).sum()}, inputs);
    for (size_t i = 0; i < inputs.size(); ++i) EXPECT_LT(rel(g[i], g_ref[i]), 1e-10) << "input " << i;
  }
}

TEST(GatedDelta, ChunkMatchesSequentialReference) {
  check_chunk(1, 64, 2, 2, false);
  check_chunk(37, 64, 2, 2, false);     // shorter than a chunk
  check_chunk(64, 64, 1, 2, true);      // exactly one chunk, grouped key heads, initial state
  check_chunk(100, 64, 2, 4, false);    // not a multiple of the chunk, longer than one
  check_chunk(130, 64, 2, 2, true);     // three chunks, the last of 2 tokens
  check_chunk(45, 8, 1, 3, true);       // many small chunks
}

TEST(GatedDelta, PerChannelDecayChunkMatchesSequentialReference) {
  check_chunk(1, 64, 2, 2, true, true);    // one token (from a state: g reaches the outputs)
  check_chunk(37, 64, 2, 2, false, true);   // shorter than a chunk
  check_chunk(64, 64, 1, 2, true, true);    // exactly one chunk, grouped key heads, initial state
  check_chunk(100, 64, 2, 2, true, true);   // not a multiple of the chunk, longer than one
  check_chunk(45, 8, 1, 3, true, true);     // many small chunks
  check_chunk(150, 128, 1, 2, false, true); // sub-chunks of 16 in chunks of 128 (8 per chunk)
}

TEST(GatedDelta, Float32ChunkCloseToFloat64) {
  Inputs in = make(1, 150, 2, 4, 16, 8, false, 3);
  auto [o_ref, s_ref] = reference(in.q, in.k, in.v, in.g, in.beta, {});
  auto f = [](const Tensor& x) { return x.detach().to(at::kFloat); };
  for (bool fused : {true, false}) {
    auto [o, s] = fused ? lf::nn::chunk_gated_delta_rule(f(in.q), f(in.k), f(in.v), f(in.g), f(in.beta), {}, 64, true)
                        : lf::nn::chunk_gated_delta_rule_reference(f(in.q), f(in.k), f(in.v), f(in.g), f(in.beta), {}, 64, true);
    EXPECT_EQ(o.scalar_type(), at::kFloat);
    EXPECT_LT(rel(o.to(at::kDouble), o_ref), 1e-5) << fused;
    EXPECT_LT(rel(s.to(at::kDouble), s_ref), 1e-5) << fused;
  }
}

// The fused kernel in float32 (AVX2 rows: head dims of 64 as Qwen3-Next's, and 13 / 5 off the vector width) against
// the chunk-wise composite, values and gradients, per-head and per-channel decays; its gradients do not depend on the
// thread count.
TEST(GatedDelta, FusedFloat32MatchesCompositeAndThreadCount) {
  struct Case { int64_t t, hk, h, dk, dv; bool channel; };
  for (Case c : {Case{150, 2, 4, 64, 64, false}, Case{70, 1, 2, 13, 5, true}, Case{64, 2, 2, 64, 32, true}}) {
    SCOPED_TRACE("dk " + std::to_string(c.dk) + " dv " + std::to_string(c.dv));
    Inputs in = make(2, c.t, c.hk, c.h, c.dk, c.dv, true, 13, c.channel);
    std::vector<Tensor> x32, x32b;
    for (const Tensor& x : in.all()) {
      x32.push_back(x.detach().to(at::kFloat).requires_grad_());
      x32b.push_back(x.detach().to(at::kFloat).requires_grad_());
    }
    auto [o, s] = lf::nn::chunk_gated_delta_rule(x32[0], x32[1], x32[2], x32[3], x32[4], x32[5], 64, true);
    auto [o2, s2] = lf::nn::chunk_gated_delta_rule_reference(x32b[0], x32b[1], x32b[2], x32b[3], x32b[4], x32b[5], 64, true);
    EXPECT_LT(rel(o, o2), 1e-5);
    EXPECT_LT(rel(s, s2), 1e-5);
    Tensor wo = at::randn_like(o), ws = at::randn_like(s);
    auto g = torch::autograd::grad({(o * wo).sum() + (s * ws).sum()}, x32);
    auto g2 = torch::autograd::grad({(o2 * wo).sum() + (s2 * ws).sum()}, x32b);
    for (size_t i = 0; i < g.size(); ++i) EXPECT_LT(rel(g[i], g2[i]), 2e-4) << "input " << i;
    // the raw kernels on the heads-first operands, one thread and two
    auto hf = [](const Tensor& x) { return x.detach().transpose(1, 2).contiguous(); };
    const Tensor q = hf(x32[0].repeat_interleave(c.h / c.hk, 2)), k = hf(x32[1].repeat_interleave(c.h / c.hk, 2));
    const Tensor v = hf(x32[2]), gg = hf(x32[3]), b = hf(x32[4]), s0 = x32[5].detach();
    auto [out, fin, ckpt] = lf::kernels::gated_delta_forward_cpu(q, k, v, gg, b, s0, 64);
    const Tensor dout = at::randn_like(out), dfin = at::randn_like(fin);
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    auto one = lf::kernels::gated_delta_backward_cpu(dout, dfin, q, k, v, gg, b, ckpt, 64);
    at::set_num_threads(2);
    auto two = lf::kernels::gated_delta_backward_cpu(dout, dfin, q, k, v, gg, b, ckpt, 64);
    at::set_num_threads(threads);
    EXPECT_TRUE(at::equal(std::get<0>(one), std::get<0>(two)) && at::equal(std::get<1>(one), std::get<1>(two)) &&
                at::equal(std::get<3>(one), std::get<3>(two)) && at::equal(std::get<5>(one), std::get<5>(two)));
  }
}

void check_recurrent(bool channel) {
  SCOPED_TRACE(channel ? "per-channel decay" : "per-head decay");
  Inputs in = make(2, 20, 1, 2, 4, 6, true, 5, channel);
  at::NoGradGuard ng;
  auto [o_ref, s_ref] = reference(in.q, in.k, in.v, in.g, in.beta, in.s0);
  auto [o, s] = lf::nn::recurrent_gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, in.s0);
  EXPECT_LT(rel(o, o_ref), 1e-12);
  EXPECT_LT(rel(s, s_ref), 1e-12);
  // prefill 13 tokens chunk-wise, then step the remaining 7 one at a time from its state (generation)
  auto part = [](const Tensor& x, int64_t a, int64_t n) { return x.narrow(1, a, n); };
  auto [o1, s1] = lf::nn::chunk_gated_delta_rule(part(in.q, 0, 13), part(in.k, 0, 13), part(in.v, 0, 13),
                                                 part(in.g, 0, 13), part(in.beta, 0, 13), in.s0, 64, true);
  std::vector<Tensor> outs{o1};
  for (int64_t i = 13; i < 20; ++i) {
    auto [oi, si] = lf::nn::recurrent_gated_delta_rule(part(in.q, i, 1), part(in.k, i, 1), part(in.v, i, 1),
                                                       part(in.g, i, 1), part(in.beta, i, 1), s1);
    outs.push_back(oi);
    s1 = si;
  }
  EXPECT_LT(rel(at::cat(outs, 1), o_ref), 1e-12);
  EXPECT_LT(rel(s1, s_ref), 1e-12);
}

TEST(GatedDelta, RecurrentMatchesReferenceAndContinuesChunk) {
  check_recurrent(false);
  check_recurrent(true);
}

// chunk 4 (one block per chunk), and for per-channel decays also chunk 32 (sub-chunks of 16: the factored pairs)
void check_finite_differences(bool channel, int64_t t = 11, int64_t chunk = 4) {
  SCOPED_TRACE(std::string(channel ? "per-channel decay" : "per-head decay") + " chunk " + std::to_string(chunk));
  Inputs in = make(1, t, 1, 2, 3, 2, true, 9, channel);
  std::vector<Tensor> inputs;
  for (const Tensor& x : in.all()) inputs.push_back(x);
  Tensor wo = at::randn({1, t, 2, 2}, at::kDouble), ws = at::randn({1, 2, 3, 2}, at::kDouble);
  auto loss = [&](const std::vector<Tensor>& x) {  // the fused kernel's gradients vs finite differences of it
    auto [o, s] = lf::nn::chunk_gated_delta_rule(x[0], x[1], x[2], x[3], x[4], x[5], chunk, true);
    return (o * wo).sum() + (s * ws).sum();
  };
  auto grads = torch::autograd::grad({loss(inputs)}, inputs);
  const double eps = 1e-6;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor base = inputs[i].detach().clone();
    Tensor flat = base.view(-1);
    for (int64_t j = 0; j < flat.numel(); j += 3) {  // every third entry
      std::vector<Tensor> plus, minus;
      for (size_t m = 0; m < inputs.size(); ++m) {
        plus.push_back(inputs[m].detach().clone());
        minus.push_back(inputs[m].detach().clone());
      }
      plus[i].view(-1)[j] += eps;
      minus[i].view(-1)[j] -= eps;
      at::NoGradGuard ng;
      const double fd = (loss(plus).item<double>() - loss(minus).item<double>()) / (2 * eps);
      EXPECT_NEAR(grads[i].reshape(-1)[j].item<double>(), fd, 1e-6 * std::max(1.0, std::abs(fd))) << "input " << i << " entry " << j;
    }
  }
}

TEST(GatedDelta, ChunkGradientsMatchFiniteDifferences) {
  check_finite_differences(false);
  check_finite_differences(true);
  check_finite_differences(true, 40, 32);
}

TEST(GatedDelta, CausalConvMatchesConv1dAndContinues) {
  at::manual_seed(2);
  auto o = at::TensorOptions().dtype(at::kDouble);
  const int64_t b = 2, t = 9, c = 5, kernel = 4;
  Tensor x = at::randn({b, t, c}, o), w = at::randn({c, 1, kernel}, o);
  Tensor ref = at::silu(at::conv1d(x.transpose(1, 2), w, {}, 1, kernel - 1, 1, c).narrow(2, 0, t)).transpose(1, 2);
  auto [y, state] = lf::nn::causal_depthwise_conv_silu(x, w);
  EXPECT_LT(rel(y, ref), 1e-14);
  // 6 tokens, then 1 at a time from the state
  auto [y1, s1] = lf::nn::causal_depthwise_conv_silu(x.narrow(1, 0, 6), w);
  std::vector<Tensor> ys{y1};
  for (int64_t i = 6; i < t; ++i) {
    auto [yi, si] = lf::nn::causal_depthwise_conv_silu(x.narrow(1, i, 1), w, s1);
    ys.push_back(yi);
    s1 = si;
  }
  EXPECT_LT(rel(at::cat(ys, 1), ref), 1e-14);
  EXPECT_TRUE(at::equal(s1, state));
}

}  // namespace
