// Context parallelism of linear attention (nn/sequence_parts.h), in one process: a sequence cut into parts held in
// a shuffled local order, with a gather that puts them back in sequence order (what the all-gather does over ranks),
// gives the outputs and every input's gradient of the whole-sequence chunk-wise rule / convolution (float64), for
// parts shorter and longer than a chunk, with one decay per head and per key channel (KDA); short parts or bad indices
// are errors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/nn/gated_delta.h"
#include "loongforge/nn/sequence_parts.h"

namespace {

using at::Tensor;

// The parts of x [B, T, ...] (T = total parts of equal length) in the order `local` names them, concatenated.
Tensor in_local_order(const Tensor& x, const std::vector<int64_t>& local, int64_t total) {
  const int64_t len = x.size(1) / total;
  std::vector<Tensor> parts;
  for (int64_t i : local) parts.push_back(x.narrow(1, i * len, len));
  return at::cat(parts, 1);
}

lf::nn::SequenceParts shuffled(const std::vector<int64_t>& local) {
  const int64_t total = static_cast<int64_t>(local.size());
  std::vector<int64_t> where(local.size());
  for (size_t p = 0; p < local.size(); ++p) where[static_cast<size_t>(local[p])] = static_cast<int64_t>(p);
  Tensor inverse = at::tensor(where, at::kLong);
  return {local, total, [inverse](const Tensor& x) { return x.index_select(0, inverse); }};
}

// g [B, T, H] (Gated DeltaNet) or per key channel [B, T, H, Dk] (KDA: the decay acts on the state's key rows, the
// part's map stays affine).
void delta_rule_equals_the_whole_sequence(bool per_channel) {
  for (int64_t len : {5, 70}) {  // parts inside one chunk, and over two chunks of 64
    at::manual_seed(len);
    const std::vector<int64_t> local{2, 0, 3, 1};
    const int64_t b = 2, t = 4 * len, hk = per_channel ? 4 : 2, h = 4, dk = 6, dv = 5;
    auto opts = at::TensorOptions().dtype(at::kDouble);
    Tensor q = at::randn({b, t, hk, dk}, opts).requires_grad_(), k = (at::randn({b, t, hk, dk}, opts) * 0.4).requires_grad_();
    Tensor v = at::randn({b, t, h, dv}, opts).requires_grad_();
    const std::vector<int64_t> g_shape = per_channel ? std::vector<int64_t>{b, t, h, dk} : std::vector<int64_t>{b, t, h};
    Tensor g = (-at::rand(g_shape, opts) * 0.3).requires_grad_();
    Tensor beta = at::rand({b, t, h}, opts).requires_grad_();
    Tensor whole = lf::nn::chunk_gated_delta_rule(q, k, v, g, beta).first;
    auto mine = [&](const Tensor& x) { return in_local_order(x, local, 4); };
    Tensor split = lf::nn::parts_gated_delta_rule(mine(q), mine(k), mine(v), mine(g), mine(beta), shuffled(local));
    EXPECT_LT((split - mine(whole)).abs().max().item<double>(), 1e-10) << len;
    Tensor w = at::randn_like(whole);
    auto ref = torch::autograd::grad({(whole * w).sum()}, {q, k, v, g, beta});
    auto got = torch::autograd::grad({(split * mine(w)).sum()}, {q, k, v, g, beta});
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_LT((got[i] - ref[i]).abs().max().item<double>(), 1e-9 * (1 + ref[i].abs().max().item<double>())) << len << " input " << i;
  }
}

TEST(SequenceParts, DeltaRuleEqualsTheWholeSequence) { delta_rule_equals_the_whole_sequence(false); }

TEST(SequenceParts, PerChannelDecayEqualsTheWholeSequence) { delta_rule_equals_the_whole_sequence(true); }

TEST(SequenceParts, ConvolutionEqualsTheWholeSequence) {
  at::manual_seed(3);
  const std::vector<int64_t> local{1, 3, 0, 2};
  auto opts = at::TensorOptions().dtype(at::kDouble);
  Tensor x = at::randn({2, 4 * 6, 7}, opts).requires_grad_(), w = at::randn({7, 1, 4}, opts).requires_grad_();
  Tensor whole = lf::nn::causal_depthwise_conv_silu(x, w).first;
  Tensor split = lf::nn::parts_causal_conv_silu(in_local_order(x, local, 4), w, shuffled(local));
  EXPECT_LT((split - in_local_order(whole, local, 4)).abs().max().item<double>(), 1e-12);
  Tensor r = at::randn_like(whole);
  auto ref = torch::autograd::grad({(whole * r).sum()}, {x, w});
  auto got = torch::autograd::grad({(split * in_local_order(r, local, 4)).sum()}, {x, w});
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_LT((got[i] - ref[i]).abs().max().item<double>(), 1e-10) << i;
}

TEST(SequenceParts, BadPartsAreErrors) {
  auto opts = at::TensorOptions().dtype(at::kDouble);
  Tensor w = at::randn({3, 1, 4}, opts);
  // parts of 2 tokens cannot hold the convolution's 3-token past
  EXPECT_THROW(lf::nn::parts_causal_conv_silu(at::randn({1, 4, 3}, opts), w, shuffled({1, 0})), lf::Error);
  // 5 tokens do not make 2 equal parts; an index past the total
  EXPECT_THROW(lf::nn::parts_causal_conv_silu(at::randn({1, 5, 3}, opts), w, shuffled({1, 0})), lf::Error);
  lf::nn::SequenceParts bad = shuffled({1, 0});
  bad.local = {1, 2};
  EXPECT_THROW(lf::nn::parts_causal_conv_silu(at::randn({1, 8, 3}, opts), w, bad), lf::Error);
}

}  // namespace
