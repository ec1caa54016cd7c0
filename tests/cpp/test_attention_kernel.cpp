// The CPU causal attention kernel (kernels/attention.h) against float64 finite differences, against the composite
// version (explicit mask + ATen's scaled_dot_product_attention) and against ATen's own causal flash attention.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "loongforge/kernels/attention.h"
#include "loongforge/nn/attention.h"
#include "test_util.h"

namespace {

using lf::kernels::causal_attention;
using lf::kernels::causal_attention_reference;

double max_abs(const at::Tensor& a) { return a.abs().max().item<double>(); }
double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return max_abs(a.to(at::kDouble) - b.to(at::kDouble)) / std::max(1e-30, max_abs(b.to(at::kDouble)));
}

// q/k/v as the model passes them: [B,H,T,D] views of [B,T,H,D] memory.
at::Tensor bthd(int64_t B, int64_t T, int64_t H, int64_t D, at::ScalarType dt) {
  return at::randn({B, T, H, D}, at::TensorOptions().dtype(dt)).transpose(1, 2);
}

// Reference forward and gradients by autograd through the composite version.
std::vector<at::Tensor> reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dy,
                                  double scale, int64_t window, const at::Tensor& seg) {
  at::Tensor q2 = q.detach().clone().requires_grad_(), k2 = k.detach().clone().requires_grad_();
  at::Tensor v2 = v.detach().clone().requires_grad_();
  at::Tensor o = causal_attention_reference(q2, k2, v2, scale, window, seg);
  auto g = torch::autograd::grad({o}, {q2, k2, v2}, {dy});
  return {o.detach(), g[0], g[1], g[2]};
}

// Gradients of the autograd Function against central differences of its own forward, float64; the forward against
// the composite version. Plain causal, a sliding window, packed segments, a segment id that comes back, GQA.
TEST(AttentionKernel, GradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(0);
  const int64_t B = 2, H = 4, Hkv = 2, T = 6, D = 3;
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor seg_runs = at::tensor({0, 0, 1, 1, 1, 2, 0, 0, 0, 1, 1, 1}, at::kLong).view({B, T});
  at::Tensor seg_back = at::tensor({0, 0, 1, 1, 0, 0, 3, 4, 3, 4, 3, 4}, at::kLong).view({B, T});
  struct Case {
    int64_t window;
    at::Tensor seg;
  };
  for (const Case& c : {Case{0, {}}, Case{2, {}}, Case{0, seg_runs}, Case{3, seg_back}}) {
    at::Tensor q = at::randn({B, H, T, D}, opts).requires_grad_(), k = at::randn({B, Hkv, T, D}, opts).requires_grad_();
    at::Tensor v = at::randn({B, Hkv, T, D}, opts).requires_grad_();
    at::Tensor dy = at::randn({B, H, T, D}, opts);
    const double scale = 0.7;
    at::Tensor o = causal_attention(q, k, v, scale, c.window, c.seg);
    auto ref = reference(q, k, v, dy, scale, c.window, c.seg);
    EXPECT_LT(max_abs(o - ref[0]), 1e-12);
    auto g = torch::autograd::grad({o}, {q, k, v}, {dy});
    at::Tensor qd = q.detach().clone(), kd = k.detach().clone(), vd = v.detach().clone();
    auto f = [&] { return causal_attention(qd, kd, vd, scale, c.window, c.seg); };
    EXPECT_LT(max_abs(g[0] - lf::test::numeric_grad(f, qd, dy)), 1e-7) << "window " << c.window;
    EXPECT_LT(max_abs(g[1] - lf::test::numeric_grad(f, kd, dy)), 1e-7) << "window " << c.window;
    EXPECT_LT(max_abs(g[2] - lf::test::numeric_grad(f, vd, dy)), 1e-7) << "window " << c.window;
  }
}

// The row blocks: every block size (1 row, sizes that do not divide T, one block for all) gives the composite's
// outputs and gradients, float64, in the strided layout of the model, with and without GQA, windows, segments.
TEST(AttentionKernel, RowBlocksMatchCompositeFloat64) {
  at::manual_seed(1);
  const int64_t B = 2, T = 37, D = 8;
  at::Tensor seg = (at::div(at::arange(T, at::kLong), 5, "floor") % 3).repeat({B, 1});  // ids come back: 0 1 2 0 1 2 ...
  at::Tensor runs = at::div(at::arange(T, at::kLong), 9, "floor").repeat({B, 1});
  for (auto [H, Hkv] : {std::pair<int64_t, int64_t>{6, 2}, {3, 3}}) {
    for (int64_t window : {0, 7}) {
      for (const at::Tensor& s : {at::Tensor(), seg, runs}) {
        at::Tensor q = bthd(B, T, H, D, at::kDouble), k = bthd(B, T, Hkv, D, at::kDouble);
        at::Tensor v = bthd(B, T, Hkv, D, at::kDouble), dy = bthd(B, T, H, D, at::kDouble);
        auto ref = reference(q, k, v, dy, 0.35, window, s);
        for (int64_t rows : {1, 5, 16, 0}) {
          auto [o, lse] = lf::kernels::causal_attention_forward_cpu(q, k, v, 0.35, window, s, rows);
          auto [dq, dk, dv] = lf::kernels::causal_attention_backward_cpu(dy, q, k, v, o, lse, 0.35, window, s, rows);
          const std::string what = "H " + std::to_string(H) + " window " + std::to_string(window) + " rows " +
                                   std::to_string(rows) + (s.defined() ? " segments" : "");
          EXPECT_LT(max_abs(o - ref[0]), 1e-12) << what;
          EXPECT_LT(max_abs(dq - ref[1]), 1e-12) << what;
          EXPECT_LT(max_abs(dk - ref[2]), 1e-12) << what;
          EXPECT_LT(max_abs(dv - ref[3]), 1e-12) << what;
          EXPECT_EQ(o.sizes(), q.sizes());
          EXPECT_EQ(dk.sizes(), k.sizes());
        }
      }
    }
  }
}

// float32 against ATen's own causal attention (is_causal: its CPU flash attention, what PyTorch users run), at the
// bench's head shapes with T not a multiple of the block; and inside a parallel region (train.cpu_split's threads).
TEST(AttentionKernel, MatchesAtenCausalFloat32) {
  at::manual_seed(2);
  for (auto [T, H, Hkv, D] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{300, 8, 4, 32}, {130, 4, 4, 64}}) {
    const int64_t B = 2;
    at::Tensor q = (bthd(B, T, H, D, at::kFloat) * 2).requires_grad_(), k = bthd(B, T, Hkv, D, at::kFloat).requires_grad_();
    at::Tensor v = bthd(B, T, Hkv, D, at::kFloat).requires_grad_(), dy = bthd(B, T, H, D, at::kFloat);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    at::Tensor q2 = q.detach().clone().requires_grad_(), k2 = k.detach().clone().requires_grad_();
    at::Tensor v2 = v.detach().clone().requires_grad_();
    at::Tensor ref = at::scaled_dot_product_attention(q2, k2, v2, {}, 0.0, true, scale, H != Hkv);
    auto gr = torch::autograd::grad({ref}, {q2, k2, v2}, {dy});
    at::Tensor o = causal_attention(q, k, v, scale);
    auto g = torch::autograd::grad({o}, {q, k, v}, {dy});
    EXPECT_LT(rel_err(o, ref), 1e-5);
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(g[i], gr[i]), 1e-5) << "input " << i;
    // the same products one batch row per task of an outer parallel region: the kernel then runs inline
    std::vector<at::Tensor> parts(B);
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        parts[b] = std::get<0>(lf::kernels::causal_attention_forward_cpu(q.narrow(0, b, 1), k.narrow(0, b, 1),
                                                                         v.narrow(0, b, 1), scale, 0, {}));
    });
    EXPECT_TRUE(at::equal(at::cat(parts, 0), o.detach()));
  }
}

// nn::causal_attention routes the whole-sequence CPU case to the kernel (same values as the composite with segments
// and windows); generation with a cache, bfloat16 and shapes the kernel does not take still go to ATen.
TEST(AttentionKernel, ModelEntryAndFallbacks) {
  at::manual_seed(3);
  const int64_t B = 2, T = 20, H = 4, D = 8;
  at::Tensor q = bthd(B, T, H, D, at::kFloat), k = bthd(B, T, 2, D, at::kFloat), v = bthd(B, T, 2, D, at::kFloat);
  at::Tensor seg = at::div(at::arange(T, at::kLong), 6, "floor").repeat({B, 1});
  EXPECT_TRUE(lf::kernels::causal_attention_kernel_supported(q, k, v, seg));
  EXPECT_LT(rel_err(lf::nn::causal_attention(q, k, v, 0, 5, 0.3, seg), causal_attention_reference(q, k, v, 0.3, 5, seg)),
            1e-6);
  // a cache step: 3 new queries at positions 17..19 against 20 keys
  at::Tensor qs = q.narrow(2, 17, 3);
  at::Tensor full = causal_attention_reference(q, k, v, 0.3).narrow(2, 17, 3);
  EXPECT_LT(rel_err(lf::nn::causal_attention(qs, k, v, 17, 0, 0.3), full), 1e-6);
  at::Tensor qb = q.to(at::kBFloat16), kb = k.to(at::kBFloat16), vb = v.to(at::kBFloat16);
  EXPECT_FALSE(lf::kernels::causal_attention_kernel_supported(qb, kb, vb));
  EXPECT_TRUE(at::equal(causal_attention(qb, kb, vb, 0.3), causal_attention_reference(qb, kb, vb, 0.3)));
  EXPECT_FALSE(lf::kernels::causal_attention_kernel_supported(q, k.narrow(1, 0, 1).expand({B, 3, T, D}), v));
  EXPECT_THROW(lf::kernels::causal_attention_forward_cpu(q, k.narrow(2, 0, 5), v, 0.3, 0, {}), c10::Error);
}

// ---- bidirectional (kernels::full_attention) ------------------------------------------------------------------

std::vector<at::Tensor> full_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& dy, double scale, const at::Tensor& seg) {
  at::Tensor q2 = q.detach().clone().requires_grad_(), k2 = k.detach().clone().requires_grad_();
  at::Tensor v2 = v.detach().clone().requires_grad_();
  at::Tensor o = lf::kernels::full_attention_reference(q2, k2, v2, scale, seg);
  auto g = torch::autograd::grad({o}, {q2, k2, v2}, {dy});
  return {o.detach(), g[0], g[1], g[2]};
}

// float64: gradients of the bidirectional Function against central differences of its own forward, and against the
// composite (SDPA with a segment mask); no segments, contiguous segments, a segment id that comes back, GQA.
TEST(FullAttentionKernel, GradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(4);
  const int64_t B = 2, H = 4, Hkv = 2, T = 6, D = 3;
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor seg_runs = at::tensor({0, 0, 1, 1, 1, 2, 0, 0, 0, 1, 1, 1}, at::kLong).view({B, T});
  at::Tensor seg_back = at::tensor({0, 0, 1, 1, 0, 0, 3, 4, 3, 4, 3, 4}, at::kLong).view({B, T});
  for (const at::Tensor& seg : {at::Tensor(), seg_runs, seg_back}) {
    at::Tensor q = at::randn({B, H, T, D}, opts).requires_grad_(), k = at::randn({B, Hkv, T, D}, opts).requires_grad_();
    at::Tensor v = at::randn({B, Hkv, T, D}, opts).requires_grad_();
    at::Tensor dy = at::randn({B, H, T, D}, opts);
    const double scale = 0.7;
    at::Tensor o = lf::kernels::full_attention(q, k, v, scale, seg);
    auto ref = full_reference(q, k, v, dy, scale, seg);
    EXPECT_LT(max_abs(o - ref[0]), 1e-12);
    auto g = torch::autograd::grad({o}, {q, k, v}, {dy});
    for (int i = 0; i < 3; ++i) EXPECT_LT(max_abs(g[i] - ref[i + 1]), 1e-12) << "input " << i;
    at::Tensor qd = q.detach().clone(), kd = k.detach().clone(), vd = v.detach().clone();
    auto f = [&] { return lf::kernels::full_attention(qd, kd, vd, scale, seg); };
    EXPECT_LT(max_abs(g[0] - lf::test::numeric_grad(f, qd, dy)), 1e-7);
    EXPECT_LT(max_abs(g[1] - lf::test::numeric_grad(f, kd, dy)), 1e-7);
    EXPECT_LT(max_abs(g[2] - lf::test::numeric_grad(f, vd, dy)), 1e-7);
  }
}

// Row blocks of every size give the composite's values, float64, strided as the model passes q/k/v.
TEST(FullAttentionKernel, RowBlocksMatchCompositeFloat64) {
  at::manual_seed(5);
  const int64_t B = 2, T = 37, D = 8, H = 6, Hkv = 3;
  at::Tensor seg = (at::div(at::arange(T, at::kLong), 5, "floor") % 3).repeat({B, 1});
  at::Tensor runs = at::div(at::arange(T, at::kLong), 9, "floor").repeat({B, 1});
  for (const at::Tensor& s : {at::Tensor(), seg, runs}) {
    at::Tensor q = bthd(B, T, H, D, at::kDouble), k = bthd(B, T, Hkv, D, at::kDouble);
    at::Tensor v = bthd(B, T, Hkv, D, at::kDouble), dy = bthd(B, T, H, D, at::kDouble);
    auto ref = full_reference(q, k, v, dy, 0.35, s);
    for (int64_t rows : {1, 5, 16, 0}) {
      auto [o, lse] = lf::kernels::causal_attention_forward_cpu(q, k, v, 0.35, 0, s, rows, false);
      auto [dq, dk, dv] = lf::kernels::causal_attention_backward_cpu(dy, q, k, v, o, lse, 0.35, 0, s, rows, false);
      const std::string what = "rows " + std::to_string(rows) + (s.defined() ? " segments" : "");
      EXPECT_LT(max_abs(o - ref[0]), 1e-12) << what;
      EXPECT_LT(max_abs(dq - ref[1]), 1e-12) << what;
      EXPECT_LT(max_abs(dk - ref[2]), 1e-12) << what;
      EXPECT_LT(max_abs(dv - ref[3]), 1e-12) << what;
    }
  }
}

// float32 against ATen's own attention (no mask) at DiT's and a ViT's head shapes, through nn::full_attention (the
// model entry: our kernel on the CPU); bfloat16 still goes to ATen.
TEST(FullAttentionKernel, ModelEntryMatchesAtenFloat32) {
  at::manual_seed(6);
  for (auto [B, T, H, D] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{8, 64, 4, 64}, {2, 197, 3, 32}}) {
    at::Tensor q = (bthd(B, T, H, D, at::kFloat) * 2).requires_grad_();
    at::Tensor k = bthd(B, T, H, D, at::kFloat).requires_grad_(), v = bthd(B, T, H, D, at::kFloat).requires_grad_();
    at::Tensor dy = bthd(B, T, H, D, at::kFloat);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    at::Tensor q2 = q.detach().clone().requires_grad_(), k2 = k.detach().clone().requires_grad_();
    at::Tensor v2 = v.detach().clone().requires_grad_();
    at::Tensor ref = at::scaled_dot_product_attention(q2, k2, v2, {}, 0.0, false, scale);
    auto gr = torch::autograd::grad({ref}, {q2, k2, v2}, {dy});
    at::Tensor o = lf::nn::full_attention(q, k, v, scale);
    auto g = torch::autograd::grad({o}, {q, k, v}, {dy});
    EXPECT_LT(rel_err(o, ref), 1e-5);
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(g[i], gr[i]), 1e-5) << "input " << i;
    EXPECT_NE(o.grad_fn()->name().find("AttentionFunction"), std::string::npos) << o.grad_fn()->name();
  }
  at::Tensor qb = bthd(2, 9, 2, 8, at::kBFloat16), kb = bthd(2, 9, 2, 8, at::kBFloat16);
  at::Tensor vb = bthd(2, 9, 2, 8, at::kBFloat16);
  EXPECT_TRUE(
      at::equal(lf::nn::full_attention(qb, kb, vb, 0.3), lf::kernels::full_attention_reference(qb, kb, vb, 0.3)));
}

// ---- masked attention (an explicit [B,T,S] mask; π0's block mask) ------------------------------------------------

// π0's training mask: a prefix of P tokens (the last `pad` of row b padded) seeing the prefix's valid tokens, then
// blocks that see every earlier block (a state token, then the action chunk), [B, P + 1 + C, P + 1 + C].
at::Tensor pi0_mask(int64_t B, int64_t P, int64_t C) {
  const int64_t T = P + 1 + C;
  at::Tensor valid = at::ones({B, T}, at::kBool);
  for (int64_t b = 0; b < B; ++b) valid[b].narrow(0, P - 1 - b, 1 + b).fill_(false);  // b + 1 pads at the prefix's end
  at::Tensor starts = at::zeros({T}, at::kLong);
  starts[P] = 1;
  starts[P + 1] = 1;
  at::Tensor cum = starts.cumsum(0);
  at::Tensor block = cum.unsqueeze(0) <= cum.unsqueeze(1);  // [T, T]
  return block.unsqueeze(0).logical_and(valid.unsqueeze(1)).logical_and(valid.unsqueeze(2));
}

std::vector<at::Tensor> masked_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& dy, double scale, const at::Tensor& allowed) {
  at::Tensor q2 = q.detach().clone().requires_grad_(), k2 = k.detach().clone().requires_grad_();
  at::Tensor v2 = v.detach().clone().requires_grad_();
  at::Tensor o = lf::kernels::masked_attention_reference(q2, k2, v2, scale, allowed);
  auto g = torch::autograd::grad({o}, {q2, k2, v2}, {dy});
  return {o.detach(), g[0], g[1], g[2]};
}

// float64: the Function's gradients against central differences of its own forward and against the composite
// (transformers' eager attention with the mask); masks: π0's block mask (padded prefix rows see no key), a random
// mask with holes and rows that see nothing, and queries fewer than keys (a suffix over a cached prefix); GQA.
TEST(MaskedAttentionKernel, GradientsMatchFiniteDifferencesFloat64) {
  at::manual_seed(7);
  const int64_t B = 2, H = 4, Hkv = 2, D = 3;
  at::Tensor random = at::rand({B, 5, 7}) < 0.5;
  random[0][2].fill_(false);
  at::Tensor suffix = pi0_mask(B, 4, 2).narrow(1, 4, 3);  // the state and action rows over all 7 keys
  for (const at::Tensor& m : {pi0_mask(B, 4, 2), random, suffix}) {
    const int64_t T = m.size(1), S = m.size(2);
    auto opts = at::TensorOptions().dtype(at::kDouble);
    at::Tensor q = at::randn({B, H, T, D}, opts).requires_grad_(), k = at::randn({B, Hkv, S, D}, opts).requires_grad_();
    at::Tensor v = at::randn({B, Hkv, S, D}, opts).requires_grad_();
    at::Tensor dy = at::randn({B, H, T, D}, opts);
    const double scale = 0.7;
    at::Tensor o = lf::kernels::masked_attention(q, k, v, scale, m);
    EXPECT_NE(o.grad_fn()->name().find("MaskedAttentionFunction"), std::string::npos) << o.grad_fn()->name();
    auto ref = masked_reference(q, k, v, dy, scale, m);
    EXPECT_LT(max_abs(o - ref[0]), 1e-12);
    auto g = torch::autograd::grad({o}, {q, k, v}, {dy});
    for (int i = 0; i < 3; ++i) EXPECT_LT(max_abs(g[i] - ref[i + 1]), 1e-12) << "input " << i << " T " << T;
    at::Tensor qd = q.detach().clone(), kd = k.detach().clone(), vd = v.detach().clone();
    auto f = [&] { return lf::kernels::masked_attention(qd, kd, vd, scale, m); };
    EXPECT_LT(max_abs(g[0] - lf::test::numeric_grad(f, qd, dy)), 1e-7);
    EXPECT_LT(max_abs(g[1] - lf::test::numeric_grad(f, kd, dy)), 1e-7);
    EXPECT_LT(max_abs(g[2] - lf::test::numeric_grad(f, vd, dy)), 1e-7);
  }
}

// Row blocks of every size (one row, sizes that straddle the prefix / suffix boundary, one block for all) give the
// composite's values, float64, strided as the model passes q/k/v, with a [B,1,T,S] mask too.
TEST(MaskedAttentionKernel, RowBlocksMatchCompositeFloat64) {
  at::manual_seed(8);
  const int64_t B = 3, P = 21, C = 9, D = 8, H = 6, Hkv = 2, T = P + 1 + C;
  at::Tensor m = pi0_mask(B, P, C);
  at::Tensor q = bthd(B, T, H, D, at::kDouble), k = bthd(B, T, Hkv, D, at::kDouble);
  at::Tensor v = bthd(B, T, Hkv, D, at::kDouble), dy = bthd(B, T, H, D, at::kDouble);
  auto ref = masked_reference(q, k, v, dy, 0.35, m);
  for (int64_t rows : {1, 5, 16, 0}) {
    const at::Tensor mask = rows == 5 ? m.unsqueeze(1) : m;
    auto [o, lse] = lf::kernels::masked_attention_forward_cpu(q, k, v, 0.35, mask, rows);
    auto [dq, dk, dv] = lf::kernels::masked_attention_backward_cpu(dy, q, k, v, o, lse, 0.35, mask, rows);
    const std::string what = "rows " + std::to_string(rows);
    EXPECT_LT(max_abs(o - ref[0]), 1e-12) << what;
    EXPECT_LT(max_abs(dq - ref[1]), 1e-12) << what;
    EXPECT_LT(max_abs(dk - ref[2]), 1e-12) << what;
    EXPECT_LT(max_abs(dv - ref[3]), 1e-12) << what;
    EXPECT_EQ(dk.sizes(), k.sizes());
  }
}

// float32 at π0's bench head shapes (8 heads over 1 key/value head, D 64, an 80-token padded prefix, a 51-token
// suffix) against ATen's SDPA with the same boolean mask on the rows that see keys; bfloat16 goes to the composite.
TEST(MaskedAttentionKernel, MatchesAtenFloat32AndFallsBack) {
  at::manual_seed(9);
  const int64_t B = 4, P = 80, C = 50, H = 8, D = 64, T = P + 1 + C;
  at::Tensor m = pi0_mask(B, P, C);
  at::Tensor q = bthd(B, T, H, D, at::kFloat).requires_grad_(), k = bthd(B, T, 1, D, at::kFloat).requires_grad_();
  at::Tensor v = bthd(B, T, 1, D, at::kFloat).requires_grad_(), dy = bthd(B, T, H, D, at::kFloat);
  const at::Tensor seen = m.any(-1).unsqueeze(1).unsqueeze(-1);  // [B,1,T,1]
  dy = dy * seen;
  const double scale = 0.125;
  at::Tensor q2 = q.detach().clone().requires_grad_(), k2 = k.detach().clone().requires_grad_();
  at::Tensor v2 = v.detach().clone().requires_grad_();
  // SDPA gives NaN rows where a query sees nothing: those rows get a key of their own there (dy is zero on them)
  at::Tensor m2 = m.logical_or(seen.squeeze(1).logical_not().logical_and(at::eye(T, at::kBool)));
  at::Tensor ref = at::scaled_dot_product_attention(q2, k2, v2, m2.unsqueeze(1), 0.0, false, scale, true) * seen;
  auto gr = torch::autograd::grad({ref}, {q2, k2, v2}, {dy});
  at::Tensor o = lf::kernels::masked_attention(q, k, v, scale, m);
  auto g = torch::autograd::grad({o}, {q, k, v}, {dy});
  EXPECT_LT(rel_err(o, ref), 1e-5);
  EXPECT_EQ(max_abs(o * seen.logical_not()), 0.0);
  for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(g[i], gr[i]), 1e-5) << "input " << i;
  at::Tensor qb = bthd(2, 9, 2, 8, at::kBFloat16), kb = bthd(2, 9, 2, 8, at::kBFloat16);
  at::Tensor vb = bthd(2, 9, 2, 8, at::kBFloat16);
  at::Tensor mb = at::rand({2, 9, 9}) < 0.6;
  EXPECT_FALSE(lf::kernels::masked_attention_kernel_supported(qb, kb, vb, mb));
  EXPECT_TRUE(at::equal(lf::kernels::masked_attention(qb, kb, vb, 0.3, mb),
                        lf::kernels::masked_attention_reference(qb, kb, vb, 0.3, mb)));
}

}  // namespace

// nn::document_ranges: the token ranges of the packed documents of a [B,T] batch, against a direct scan; and
// nn::document_attention away from the GPU is causal_attention with the segment ids (same values).
TEST(DocumentAttention, RangesAndCpuFallback) {
  at::manual_seed(11);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t B = 1 + trial % 3, T = 5 + trial;
    // ids that grow along each row (documents), sometimes a whole row is one document
    at::Tensor seg = (at::rand({B, T}) < 0.25).to(at::kLong).cumsum(1);
    auto [cu, longest] = lf::nn::document_ranges(seg);
    std::vector<int64_t> want = {0};
    int64_t want_longest = 0;
    for (int64_t r = 0; r < B; ++r)
      for (int64_t j = 1; j <= T; ++j)
        if (j == T || seg[r][j].item<int64_t>() != seg[r][j - 1].item<int64_t>()) {
          want_longest = std::max(want_longest, r * T + j - want.back());
          want.push_back(r * T + j);
        }
    ASSERT_EQ(cu.scalar_type(), at::kInt);
    ASSERT_EQ(cu.numel(), static_cast<int64_t>(want.size())) << trial;
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(cu[static_cast<int64_t>(i)].item<int64_t>(), want[i]) << trial;
    EXPECT_EQ(longest, want_longest) << trial;
  }
  at::Tensor seg = at::tensor({0, 0, 0, 1, 1, 2, 2, 2, 2, 0, 0, 1, 1, 1, 1, 1, 1, 1}, at::kLong).view({2, 9});
  auto [cu, longest] = lf::nn::document_ranges(seg);
  at::Tensor q = bthd(2, 9, 4, 8, at::kFloat), k = bthd(2, 9, 2, 8, at::kFloat), v = bthd(2, 9, 2, 8, at::kFloat);
  at::Tensor got = lf::nn::document_attention(q, k, v, 0, 0, 0.3, seg, cu, longest);
  EXPECT_TRUE(at::equal(got, lf::nn::causal_attention(q, k, v, 0, 0, 0.3, seg)));
}
