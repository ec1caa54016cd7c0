#include "loongforge/nn/sequence_parts.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/nn/gated_delta.h"

namespace lf::nn {

namespace {

int64_t part_length(const at::Tensor& x, const SequenceParts& parts, const char* op) {
  const int64_t p = static_cast<int64_t>(parts.local.size()), t = x.size(1);
  if (p == 0 || t % p || !parts.gather) throw Error(std::string(op) + ": " + std::to_string(t) + " local tokens do not make " + std::to_string(p) + " equal parts");
  for (int64_t i : parts.local)
    if (i < 0 || i >= parts.total) throw Error(std::string(op) + ": part index " + std::to_string(i) + " out of range");
  return t / p;
}

}  // namespace

at::Tensor parts_causal_conv_silu(const at::Tensor& x, const at::Tensor& weight, const SequenceParts& parts) {
  const int64_t len = part_length(x, parts, "parts_causal_conv_silu"), keep = weight.size(2) - 1;
  if (len < keep)
    throw Error("context parallel: a part of " + std::to_string(len) + " tokens is shorter than the convolution's " +
                std::to_string(keep) + "-token past (use a longer sequence or a smaller cp)");
  const int64_t p = static_cast<int64_t>(parts.local.size());
  std::vector<at::Tensor> tails;
  for (int64_t i = 0; i < p; ++i) tails.push_back(x.narrow(1, i * len + len - keep, keep));
  at::Tensor all = parts.gather(at::stack(tails, 0));  // [total, B, K - 1, C]
  std::vector<at::Tensor> ys;
  for (int64_t i = 0; i < p; ++i) {
    const int64_t at_seq = parts.local[static_cast<size_t>(i)];
    at::Tensor past = at_seq > 0 ? all.select(0, at_seq - 1) : at::Tensor();
    ys.push_back(causal_depthwise_conv_silu(x.narrow(1, i * len, len), weight, past).first);
  }
  return p == 1 ? ys[0] : at::cat(ys, 1);
}

at::Tensor parts_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                  const at::Tensor& beta, const SequenceParts& parts, int64_t chunk) {
  const int64_t len = part_length(v, parts, "parts_gated_delta_rule"), p = static_cast<int64_t>(parts.local.size());
  const int64_t b = v.size(0), h = v.size(2), dv = v.size(3), dk = k.size(3);
  const at::ScalarType ct = v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // values [v | 0] from the start state [0 | I]: outputs [o0 | M_t^T q], end state [S0 | M]
  at::Tensor vx = at::cat({v.to(ct), at::zeros({b, v.size(1), h, dk}, v.options().dtype(ct))}, -1);
  at::Tensor start = at::cat({at::zeros({b, h, dk, dv}, vx.options()),
                              at::eye(dk, vx.options()).expand({b, h, dk, dk})}, -1);
  std::vector<at::Tensor> outs, ends;
  for (int64_t i = 0; i < p; ++i) {
    auto cut = [&](const at::Tensor& x) { return x.narrow(1, i * len, len); };
    auto [o, s] = chunk_gated_delta_rule(cut(q), cut(k), cut(vx), cut(g), cut(beta), start, chunk, true);
    outs.push_back(o);
    ends.push_back(s);
  }
  at::Tensor all = parts.gather(at::stack(ends, 0));  // [total, B, H, Dk, Dv + Dk]
  // the start state of every part up to this rank's last, in sequence order
  const int64_t last = *std::max_element(parts.local.begin(), parts.local.end());
  std::vector<at::Tensor> starts{at::zeros({b, h, dk, dv}, vx.options())};
  for (int64_t j = 0; j < last; ++j) {
    at::Tensor e = all.select(0, j);
    starts.push_back(at::matmul(e.narrow(-1, dv, dk), starts.back()) + e.narrow(-1, 0, dv));
  }
  std::vector<at::Tensor> ys;
  for (int64_t i = 0; i < p; ++i) {
    const at::Tensor& o = outs[static_cast<size_t>(i)];  // [B, len, H, Dv + Dk]
    const at::Tensor& s = starts[static_cast<size_t>(parts.local[static_cast<size_t>(i)])];  // [B, H, Dk, Dv]
    // o_t += S_start^T (M_t^T q_t): [B, H, len, Dk] x [B, H, Dk, Dv]
    at::Tensor fix = at::matmul(o.narrow(-1, dv, dk).to(ct).transpose(1, 2), s).transpose(1, 2);
    ys.push_back(o.narrow(-1, 0, dv).to(ct) + fix);
  }
  return (p == 1 ? ys[0] : at::cat(ys, 1)).to(v.scalar_type());
}

}  // namespace lf::nn
