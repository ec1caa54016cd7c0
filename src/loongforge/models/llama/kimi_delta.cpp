#include "loongforge/models/llama/kimi_delta.h"

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "loongforge/nn/gated_delta.h"

namespace lf::models::llama {

KdaForgetGateImpl::KdaForgetGateImpl(int64_t hidden, int64_t h, int64_t dh) : heads(h), head_dim(dh) {
  f_a_proj = register_module("f_a_proj", nn::Linear(hidden, head_dim, false));
  f_b_proj = register_module("f_b_proj", nn::Linear(head_dim, heads * head_dim, false));
  dt_bias = register_parameter("dt_bias", at::zeros({heads * head_dim}));
  A_log = register_parameter("A_log", at::empty({1, 1, heads, 1}).uniform_(1.0, 16.0).log_());
}

at::Tensor KdaForgetGateImpl::forward(const at::Tensor& x) {
  const at::ScalarType ct = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor a = f_b_proj->forward(f_a_proj->forward(x)).to(ct) + dt_bias.to(ct);
  a = a.view({a.size(0), a.size(1), -1, head_dim});
  return -A_log.to(ct).exp() * at::softplus(a);  // softplus(a) = a above 20, as transformers
}

KimiDeltaAttentionImpl::KimiDeltaAttentionImpl(const DecoderConfig& c, int64_t idx)
    : nn::AttentionHook(c.linear_num_value_heads, c.linear_num_value_heads, 0), layer_idx(idx),
      head_dim(c.linear_value_head_dim), kernel(c.linear_conv_kernel_dim) {
  const int64_t d = c.hidden_size, hd = heads * head_dim;
  q_proj = register_module("q_proj", nn::Linear(d, hd, false));
  k_proj = register_module("k_proj", nn::Linear(d, hd, false));
  v_proj = register_module("v_proj", nn::Linear(d, hd, false));
  conv1d = register_module("conv1d", DepthwiseConvWeight(3 * hd, kernel));
  forget_gate = register_module("forget_gate", KdaForgetGate(d, heads, head_dim));
  b_proj = register_module("b_proj", nn::Linear(d, heads, false));
  g_a_proj = register_module("g_a_proj", nn::Linear(d, head_dim, false));
  g_b_proj = register_module("g_b_proj", nn::Linear(head_dim, hd, false));
  o_norm = register_module("o_norm", nn::RMSNorm(head_dim, c.rms_norm_eps));
  o_proj = register_module("o_proj", nn::Linear(hd, d, false));
}

at::Tensor KimiDeltaAttentionImpl::forward(const at::Tensor& x, nn::KVCache* cache, const at::Tensor& segment_ids) {
  LinearLayout layout(*this, segment_ids, parts, cache, layer_idx);
  // this rank's heads (divided by tensor parallelism); b, t from the projections (a sequence-parallel entry gathers
  // the sequence: t can exceed x's)
  const int64_t hd = heads * head_dim;
  at::Tensor mixed = at::cat({q_proj->forward(x), k_proj->forward(x), v_proj->forward(x)}, -1);
  const int64_t b = mixed.size(0), t = mixed.size(1);
  auto qkv = layout.conv(mixed, conv1d->weight).split(hd, -1);
  const std::vector<int64_t> shape{b, t, heads, head_dim};
  // q and k L2-normalised in the compute dtype (float32 unless float64), q scaled by D^-1/2, as transformers
  const at::ScalarType ct = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor q = nn::l2_normalize(qkv[0].reshape(shape).to(ct)) * (1.0 / std::sqrt(static_cast<double>(head_dim)));
  at::Tensor k = nn::l2_normalize(qkv[1].reshape(shape).to(ct));
  at::Tensor v = qkv[2].reshape(shape);
  at::Tensor g = forget_gate->forward(x);
  at::Tensor beta = at::sigmoid(b_proj->forward(x));
  at::Tensor core = layout.delta_rule(q, k, v, g, beta, chunk);
  at::Tensor gate = g_b_proj->forward(g_a_proj->forward(x)).view(shape);
  at::Tensor o = nn::gated_rms_norm(core, gate, o_norm->weight, o_norm->eps, /*sigmoid_gate=*/true);
  return o_proj->forward(o.reshape({b, t, hd}));
}

}  // namespace lf::models::llama
