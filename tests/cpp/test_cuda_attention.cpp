// Flash attention over packed documents on the GPU (kernels/cuda_ops.h: flash_varlen_attention, and
// nn::document_attention, which the trainer uses for bf16 runs with per-document attention) against
// nn::causal_attention with segment ids in float64 on the CPU: values and gradients, GQA, a sliding window, documents
// of uneven lengths crossing no rows. Skipped without a CUDA device (CI); run by bench/gpu_check.sh.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/nn/attention.h"

namespace cu = lf::kernels::cuda;

#define SKIP_WITHOUT_CUDA() \
  if (!cu::available()) GTEST_SKIP() << "no CUDA device (LoongForge CUDA kernels compiled: " << cu::compiled() << ")"

namespace {
double rel_err(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.detach().cpu().to(at::kDouble), y = b.detach().cpu().to(at::kDouble);
  return (x - y).abs().max().item<double>() / std::max(1e-30, y.abs().max().item<double>());
}
}  // namespace

TEST(CudaKernels, DocumentAttentionMatchesMaskedReference) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(4);
  const int64_t B = 2, T = 200, H = 8, Hkv = 2, D = 64;
  // row 0: documents of 37, 100, 63 tokens; row 1: one document
  at::Tensor seg = at::zeros({B, T}, at::kLong);
  seg[0].narrow(0, 37, 100).fill_(1);
  seg[0].narrow(0, 137, 63).fill_(2);
  auto [ranges, longest] = lf::nn::document_ranges(seg);
  ASSERT_EQ(longest, 200);
  at::Tensor q = at::randn({B, H, T, D}), k = at::randn({B, Hkv, T, D}), v = at::randn({B, Hkv, T, D});
  at::Tensor dy = at::randn({B, H, T, D});
  const double scale = 0.125;
  for (int64_t window : {0, 48}) {
    // reference: float64 on the CPU, the mask path
    at::Tensor q1 = q.to(at::kDouble).requires_grad_(), k1 = k.to(at::kDouble).requires_grad_();
    at::Tensor v1 = v.to(at::kDouble).requires_grad_();
    at::Tensor y1 = lf::nn::causal_attention(q1, k1, v1, 0, window, scale, seg);
    auto g1 = torch::autograd::grad({(y1 * dy.to(at::kDouble)).sum()}, {q1, k1, v1});
    // bf16 on the GPU through the varlen kernels
    auto gpu = [](const at::Tensor& t) { return t.to(at::kCUDA, at::kBFloat16).requires_grad_(); };
    at::Tensor q2 = gpu(q), k2 = gpu(k), v2 = gpu(v);
    at::Tensor y2 = lf::nn::document_attention(q2, k2, v2, 0, window, scale, seg.to(at::kCUDA),
                                               ranges.to(at::kCUDA), longest);
    auto g2 = torch::autograd::grad({(y2.to(at::kFloat) * dy.to(at::kCUDA)).sum()}, {q2, k2, v2});
    EXPECT_LT(rel_err(y2, y1), 2e-2) << "window " << window;
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(g2[i], g1[i]), 3e-2) << "window " << window << " grad " << i;
    // the raw kernel on [N, H, D] rows, too: document boundaries matter (a whole-row causal result differs)
    at::Tensor whole = at::scaled_dot_product_attention(q2.detach(), k2.detach(), v2.detach(), {}, 0.0, true, scale,
                                                        /*enable_gqa=*/true);
    if (window == 0) {
      EXPECT_GT(rel_err(whole, y1), 0.1);
    }
  }
}
