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

// The runs of equal ids in ids [n] (one row of a part): [start, end) ranges, in order.
std::vector<std::pair<int64_t, int64_t>> runs_of(const at::Tensor& ids) {
  const at::Tensor r = ids.to(at::kLong).cpu().contiguous();
  const int64_t* p = r.data_ptr<int64_t>();
  const int64_t n = r.numel();
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t s = 0, i = 1; i <= n; ++i)
    if (i == n || p[i] != p[i - 1]) {
      out.push_back({s, i});
      s = i;
    }
  return out;
}

// The ids of every part's last `n` tokens, in sequence order: [total, B, n] int64 on the CPU (gathered as float64:
// exact for ids below 2^53).
at::Tensor part_tails(const at::Tensor& seg, const SequenceParts& parts, int64_t len, int64_t n) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> tails;
  for (size_t i = 0; i < parts.local.size(); ++i) tails.push_back(seg.narrow(1, static_cast<int64_t>(i) * len + len - n, n));
  return parts.gather(at::stack(tails, 0).to(at::kDouble)).to(at::kLong).cpu();
}

}  // namespace

at::Tensor parts_causal_conv_silu(const at::Tensor& x, const at::Tensor& weight, const SequenceParts& parts,
                                  const at::Tensor& segment_ids) {
  const int64_t len = part_length(x, parts, "parts_causal_conv_silu"), keep = weight.size(2) - 1;
  if (len < keep)
    throw Error("context parallel: a part of " + std::to_string(len) + " tokens is shorter than the convolution's " +
                std::to_string(keep) + "-token past (use a longer sequence or a smaller cp)");
  const int64_t p = static_cast<int64_t>(parts.local.size());
  std::vector<at::Tensor> tails;
  for (int64_t i = 0; i < p; ++i) tails.push_back(x.narrow(1, i * len + len - keep, keep));
  at::Tensor all = parts.gather(at::stack(tails, 0));  // [total, B, K - 1, C]
  const at::Tensor tail_ids = segment_ids.defined() && keep > 0 ? part_tails(segment_ids, parts, len, keep) : at::Tensor();
  std::vector<at::Tensor> ys;
  for (int64_t i = 0; i < p; ++i) {
    const int64_t at_seq = parts.local[static_cast<size_t>(i)];
    at::Tensor past = at_seq > 0 ? all.select(0, at_seq - 1) : at::Tensor();
    if (!tail_ids.defined()) {
      ys.push_back(causal_depthwise_conv_silu(x.narrow(1, i * len, len), weight, past).first);
      continue;
    }
    // packed documents, row by row: the first document of the part sees the past inputs of its own document (the
    // trailing ones of the part before with its id), every later one starts from zeros
    std::vector<at::Tensor> rows;
    for (int64_t r = 0; r < x.size(0); ++r) {
      const at::Tensor ids = segment_ids[r].narrow(0, i * len, len);
      const int64_t first_id = ids[0].item<int64_t>();
      std::vector<at::Tensor> runs;
      for (auto [lo, hi] : runs_of(ids)) {
        at::Tensor run_past;
        if (lo == 0 && past.defined()) {
          const at::Tensor tid = tail_ids[at_seq - 1][r];  // [K - 1]
          std::vector<double> mask(static_cast<size_t>(keep), 0.0);
          for (int64_t j = keep - 1; j >= 0 && tid[j].item<int64_t>() == first_id; --j) mask[static_cast<size_t>(j)] = 1.0;
          run_past = past.narrow(0, r, 1) * at::tensor(mask, past.options()).view({1, keep, 1});
        }
        runs.push_back(causal_depthwise_conv_silu(x.narrow(0, r, 1).narrow(1, i * len + lo, hi - lo), weight, run_past).first);
      }
      rows.push_back(runs.size() == 1 ? runs[0] : at::cat(runs, 1));
    }
    ys.push_back(at::cat(rows, 0));
  }
  return p == 1 ? ys[0] : at::cat(ys, 1);
}

at::Tensor parts_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                  const at::Tensor& beta, const SequenceParts& parts, int64_t chunk,
                                  const at::Tensor& segment_ids) {
  const int64_t len = part_length(v, parts, "parts_gated_delta_rule"), p = static_cast<int64_t>(parts.local.size());
  const int64_t b = v.size(0), h = v.size(2), dv = v.size(3), dk = k.size(3);
  const at::ScalarType ct = v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // values [v | 0] from the start state [0 | I]: outputs [o0 | M_t^T q], end state [S0 | M]
  at::Tensor vx = at::cat({v.to(ct), at::zeros({b, v.size(1), h, dk}, v.options().dtype(ct))}, -1);
  at::Tensor start = at::cat({at::zeros({b, h, dk, dv}, vx.options()),
                              at::eye(dk, vx.options()).expand({b, h, dk, dk})}, -1);
  std::vector<at::Tensor> outs, ends;
  // packed documents: whether each part's first token continues the document of the part before it, [total, B]
  at::Tensor heads_tails;  // [total, B, 2]: every part's first and last ids
  if (segment_ids.defined()) {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> ft;
    for (int64_t i = 0; i < p; ++i)
      ft.push_back(at::stack({segment_ids.select(1, i * len), segment_ids.select(1, i * len + len - 1)}, -1));
    heads_tails = parts.gather(at::stack(ft, 0).to(at::kDouble)).to(at::kLong).cpu();
  }
  for (int64_t i = 0; i < p; ++i) {
    auto cut = [&](const at::Tensor& x) { return x.narrow(1, i * len, len); };
    if (!heads_tails.defined()) {
      auto [o, s] = chunk_gated_delta_rule(cut(q), cut(k), cut(vx), cut(g), cut(beta), start, chunk, true);
      outs.push_back(o);
      ends.push_back(s);
      continue;
    }
    // Row by row, document by document: the part's first document continues from the start state [0 | I] when it
    // runs on from the part before, every other one starts from zeros, whose [. | M] block then stays zero: its
    // outputs take no correction, and a part with a document start leaves an end state independent of its start.
    const int64_t at_seq = parts.local[static_cast<size_t>(i)];
    std::vector<at::Tensor> row_o, row_s;
    for (int64_t r = 0; r < b; ++r) {
      const bool continues = at_seq > 0 && heads_tails[at_seq][r][0].item<int64_t>() == heads_tails[at_seq - 1][r][1].item<int64_t>();
      std::vector<at::Tensor> runs;
      at::Tensor s;
      for (auto [lo, hi] : runs_of(segment_ids[r].narrow(0, i * len, len))) {
        auto run = [&](const at::Tensor& x) { return cut(x).narrow(0, r, 1).narrow(1, lo, hi - lo); };
        const at::Tensor from = lo == 0 && continues ? start.narrow(0, r, 1) : at::zeros_like(start.narrow(0, r, 1));
        at::Tensor o;
        std::tie(o, s) = chunk_gated_delta_rule(run(q), run(k), run(vx), run(g), run(beta), from, chunk, true);
        runs.push_back(o);
      }
      row_o.push_back(runs.size() == 1 ? runs[0] : at::cat(runs, 1));
      row_s.push_back(s);
    }
    outs.push_back(at::cat(row_o, 0));
    ends.push_back(at::cat(row_s, 0));
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
