#include "loongforge/parallel/context_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/Work.hpp>  // Pending holds an intrusive_ptr<c10d::Work>

#include <array>
#include <cmath>
#include <limits>

#include "loongforge/core/error.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/loss.h"
#include "loongforge/nn/sequence_parts.h"
#include "loongforge/parallel/functional.h"

namespace lf::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

OptionError cp_error(const std::string& why) { return OptionError("cp", why); }

void check_divisible(int64_t T, int cp_size) {
  if (cp_size < 1) throw cp_error("must be at least 1, got " + std::to_string(cp_size));
  if (T % (2 * cp_size) != 0)
    throw cp_error("2*cp = " + std::to_string(2 * cp_size) + " does not divide the sequence length " +
                std::to_string(T) + " (context parallel splits it in 2*cp load-balanced chunks)");
}

// The global chunk held at local chunk j (0 or 1) by rank `owner` of n.
int64_t chunk_of(int owner, int j, int n) { return j == 0 ? owner : 2 * n - 1 - owner; }

// A finite mask value: a row hidden entirely within one block then gets a finite log-sum-exp that the merge
// weighs with exp(-huge) = 0 (every query sees at least itself, so the merged log-sum-exp is finite).
constexpr double kMasked = -1e30;

// Scores of a query chunk qa [B,G,g,c,D] against a key chunk kb [B,G,1,c,D], masked: causal within the chunk when
// `diag`, and same segment when segq/segk [B,c] are given.
at::Tensor block_scores(const at::Tensor& qa, const at::Tensor& kb, double scale, bool diag, const at::Tensor& segq,
                        const at::Tensor& segk) {
  at::Tensor s = at::matmul(qa, kb.transpose(-1, -2)) * scale;
  const int64_t cq = qa.size(3), ck = kb.size(3);
  at::Tensor allowed;
  if (diag) allowed = at::ones({cq, ck}, at::TensorOptions().dtype(at::kBool).device(qa.device())).tril();
  if (segq.defined()) {
    at::Tensor same = (segq.unsqueeze(2) == segk.unsqueeze(1)).view({segq.size(0), 1, 1, cq, ck});
    allowed = allowed.defined() ? allowed.logical_and(same) : same;
  }
  if (allowed.defined()) s = s.masked_fill(allowed.logical_not(), kMasked);
  return s;
}

const Group& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<const Group*>(ctx->saved_data["group"].toInt());
}

// Posts the exchange of `send` with the ring neighbours (to rank+1, from rank-1) as one batch (under NCCL a send
// and a receive between the same two ranks, cp = 2, must not wait for each other); `recv` gets the block.
struct RingHop {
  Pending p;
  void start(const Group& g, const at::Tensor& send, at::Tensor& recv, int tag) {
    const int n = g.size(), me = g.rank();
    recv = at::empty_like(send);
    p = g.batch_p2p({P2POp{true, send, (me + 1) % n, tag}, P2POp{false, recv, (me - 1 + n) % n, tag}});
  }
  void wait() { p.wait(); }
};

struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            int64_t gptr, double scale, const at::Tensor& seg_in, bool causal) {
    const Group& g = *reinterpret_cast<const Group*>(gptr);
    const int n = g.size(), me = g.rank();
    const auto cdt = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const int64_t B = q.size(0), H = q.size(1), Tl = q.size(2), D = q.size(3), Hkv = k.size(1);
    TORCH_CHECK(H % Hkv == 0, "ring_attention: ", Hkv, " key/value heads do not divide ", H, " heads");
    TORCH_CHECK(k.size(2) == Tl && v.size(2) == Tl, "ring_attention: q, k, v must hold the same local tokens");
    // causal: two load-balanced chunks per rank; bidirectional: the local tokens as one chunk
    const int nc = causal ? 2 : 1;
    TORCH_CHECK(Tl % nc == 0, "ring_attention: the local sequence (", Tl, ") must hold two equal chunks");
    const int64_t gg = H / Hkv, c = Tl / nc;
    at::Tensor qf = q.to(cdt).contiguous().view({B, Hkv, gg, Tl, D});
    at::Tensor kv = at::stack({k.to(cdt), v.to(cdt)}).contiguous();  // [2,B,Hkv,Tl,D]
    const bool has_seg = seg_in.numel() > 0;  // an empty tensor stands for "no segment ids"
    at::Tensor seg_local = has_seg ? seg_in.to(at::kLong).contiguous() : at::Tensor();
    at::Tensor seg = seg_local;

    std::array<at::Tensor, 2> out, lse;
    for (int a = 0; a < nc; ++a) {
      out[a] = at::zeros({B, Hkv, gg, c, D}, qf.options());
      lse[a] = at::full({B, Hkv, gg, c}, -std::numeric_limits<double>::infinity(), qf.options());
    }
    for (int s = 0; s < n; ++s) {
      const int src = (me - s + n) % n;
      RingHop hkv, hseg;
      at::Tensor kv_next, seg_next;
      if (s < n - 1) {
        hkv.start(g, kv, kv_next, 0);
        if (has_seg) hseg.start(g, seg, seg_next, 1);
      }
      for (int a = 0; a < nc; ++a) {
        const int64_t A = chunk_of(me, a, n);
        at::Tensor qa = qf.narrow(3, a * c, c);
        for (int b = 0; b < nc; ++b) {
          const int64_t Bc = chunk_of(src, b, n);
          if (causal && A < Bc) continue;  // hidden by the causal mask
          at::Tensor kb = kv[0].narrow(2, b * c, c).unsqueeze(2), vb = kv[1].narrow(2, b * c, c).unsqueeze(2);
          at::Tensor sc = block_scores(qa, kb, scale, causal && A == Bc,
                                       has_seg ? seg_local.narrow(1, a * c, c) : at::Tensor(),
                                       has_seg ? seg.narrow(1, b * c, c) : at::Tensor());
          at::Tensor blse = at::logsumexp(sc, {-1});
          at::Tensor ob = at::matmul(at::exp(sc - blse.unsqueeze(-1)), vb);
          at::Tensor nl = at::logaddexp(lse[a], blse);
          out[a] = out[a] * at::exp(lse[a] - nl).unsqueeze(-1) + ob * at::exp(blse - nl).unsqueeze(-1);
          lse[a] = nl;
        }
      }
      if (s < n - 1) {
        hkv.wait();
        kv = kv_next;
        if (has_seg) {
          hseg.wait();
          seg = seg_next;
        }
      }
    }
    at::Tensor o = causal ? at::cat({out[0], out[1]}, 3) : out[0];  // [B,Hkv,g,Tl,D]
    at::Tensor l = causal ? at::cat({lse[0], lse[1]}, 3) : lse[0];  // [B,Hkv,g,Tl]
    ctx->saved_data["group"] = gptr;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_seg"] = has_seg;
    ctx->save_for_backward({q, k, v, o, l, has_seg ? seg_local : at::zeros({0}, at::kLong)});
    return o.view({B, H, Tl, D}).to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Group& g = group_of(ctx);
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool has_seg = ctx->saved_data["has_seg"].toBool();
    const bool causal = ctx->saved_data["causal"].toBool();
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &l = saved[4];
    at::Tensor seg_local = has_seg ? saved[5] : at::Tensor(), seg = seg_local;
    const int n = g.size(), me = g.rank();
    const int64_t B = q.size(0), H = q.size(1), Tl = q.size(2), D = q.size(3), Hkv = k.size(1);
    const int nc = causal ? 2 : 1;
    const int64_t gg = H / Hkv, c = Tl / nc;
    const auto cdt = o.scalar_type();
    at::Tensor qf = q.to(cdt).contiguous().view({B, Hkv, gg, Tl, D});
    at::Tensor dout = grads[0].to(cdt).contiguous().view({B, Hkv, gg, Tl, D});
    at::Tensor delta = (dout * o).sum(-1);  // [B,Hkv,g,Tl]
    at::Tensor dq = at::zeros_like(qf);
    at::Tensor kv = at::stack({k.to(cdt), v.to(cdt)}).contiguous();
    at::Tensor dkv = at::zeros_like(kv);  // travels with kv: the dK/dV of the block held now
    for (int s = 0; s < n; ++s) {
      const int src = (me - s + n) % n;
      RingHop hkv, hseg, hd;
      at::Tensor kv_next, seg_next, dkv_next;
      if (s < n - 1) {
        hkv.start(g, kv, kv_next, 2);
        if (has_seg) hseg.start(g, seg, seg_next, 3);
      }
      for (int a = 0; a < nc; ++a) {
        const int64_t A = chunk_of(me, a, n);
        at::Tensor qa = qf.narrow(3, a * c, c), doa = dout.narrow(3, a * c, c);
        at::Tensor la = l.narrow(3, a * c, c).unsqueeze(-1), dla = delta.narrow(3, a * c, c).unsqueeze(-1);
        for (int b = 0; b < nc; ++b) {
          const int64_t Bc = chunk_of(src, b, n);
          if (causal && A < Bc) continue;
          at::Tensor kb = kv[0].narrow(2, b * c, c).unsqueeze(2), vb = kv[1].narrow(2, b * c, c).unsqueeze(2);
          at::Tensor sc = block_scores(qa, kb, scale, causal && A == Bc,
                                       has_seg ? seg_local.narrow(1, a * c, c) : at::Tensor(),
                                       has_seg ? seg.narrow(1, b * c, c) : at::Tensor());
          at::Tensor p = at::exp(sc - la);  // [B,G,g,c,c]
          dkv[1].narrow(2, b * c, c).add_(at::matmul(p.transpose(-1, -2), doa).sum(2));
          at::Tensor ds = p * (at::matmul(doa, vb.transpose(-1, -2)) - dla);
          dq.narrow(3, a * c, c).add_(at::matmul(ds, kb) * scale);
          dkv[0].narrow(2, b * c, c).add_((at::matmul(ds.transpose(-1, -2), qa) * scale).sum(2));
        }
      }
      if (n > 1) {  // dK/dV follow their block; after the last hop they are back at the owner
        hd.start(g, dkv, dkv_next, 4);
        hd.wait();
        dkv = dkv_next;
      }
      if (s < n - 1) {
        hkv.wait();
        kv = kv_next;
        if (has_seg) {
          hseg.wait();
          seg = seg_next;
        }
      }
    }
    return {dq.view({B, H, Tl, D}).to(q.scalar_type()), dkv[0].to(k.scalar_type()), dkv[1].to(v.scalar_type()),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor cp_layout_positions(int64_t T, int cp_size) {
  check_divisible(T, cp_size);
  const int64_t c = T / (2 * cp_size);
  std::vector<at::Tensor> parts;
  for (int i = 0; i < cp_size; ++i) {
    parts.push_back(at::arange(i * c, (i + 1) * c, at::kLong));
    parts.push_back(at::arange((2 * cp_size - 1 - i) * c, (2 * cp_size - i) * c, at::kLong));
  }
  return at::cat(parts);
}

at::Tensor cp_shard(const at::Tensor& x, int cp_size, int cp_rank, int64_t dim) {
  const int64_t T = x.size(dim);
  check_divisible(T, cp_size);
  const int64_t c = T / (2 * cp_size);
  return at::cat({x.narrow(dim, cp_rank * c, c), x.narrow(dim, (2 * cp_size - 1 - cp_rank) * c, c)}, dim);
}

at::Tensor cp_shard(const at::Tensor& x, const Group& cp, int64_t dim) { return cp_shard(x, cp.size(), cp.rank(), dim); }

at::Tensor cp_unshard(const at::Tensor& local, const Group& cp, int64_t dim) {
  if (dim < 0) dim += local.dim();
  at::Tensor all = cp.size() == 1 ? local : cp.all_gather(local.contiguous(), dim);
  at::Tensor order = cp_layout_positions(all.size(dim), cp.size()).to(local.device());
  return all.index_select(dim, at::argsort(order));
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                          const at::Tensor& segment_ids, const Group& cp, bool causal) {
  // Function::apply does not take undefined tensors: an empty one stands for "no segment ids".
  at::Tensor seg = segment_ids.defined() ? segment_ids : at::zeros({0}, q.options().dtype(at::kLong));
  return RingAttention::apply(q, k, v, reinterpret_cast<int64_t>(&cp), scale, seg, causal);
}

at::Tensor a2a_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                         const at::Tensor& segment_ids, const Group& cp, bool causal) {
  const int n = cp.size();
  const int64_t H = q.size(1), Hkv = k.size(1), Tl = q.size(2);
  if (H % n != 0)
    throw cp_error(std::to_string(n) + " does not divide num_attention_heads " + std::to_string(H) +
                " (cp_mode a2a)");
  if (Hkv % n != 0)
    throw cp_error(std::to_string(n) + " does not divide num_key_value_heads " + std::to_string(Hkv) +
                " (cp_mode a2a)");
  if (!causal) {  // any token order will do: the gathered order, segment ids gathered alike
    auto to_heads = [&](const at::Tensor& x) { return all_to_all(x, cp, 1, 2); };
    at::Tensor seg;
    if (segment_ids.defined()) seg = n == 1 ? segment_ids : cp.all_gather(segment_ids.contiguous(), 1);
    return all_to_all(nn::full_attention(to_heads(q), to_heads(k), to_heads(v), scale, seg), cp, 2, 1);
  }
  at::Tensor order = cp_layout_positions(Tl * n, n).to(q.device());  // global position of each gathered token
  at::Tensor inv = at::argsort(order);
  auto to_heads = [&](const at::Tensor& x) { return all_to_all(x, cp, 1, 2).index_select(2, inv); };
  at::Tensor seg;
  if (segment_ids.defined())
    seg = (n == 1 ? segment_ids : cp.all_gather(segment_ids.contiguous(), 1)).index_select(1, inv);
  at::Tensor o = nn::causal_attention(to_heads(q), to_heads(k), to_heads(v), 0, 0, scale, seg);
  return all_to_all(o.index_select(2, order), cp, 2, 1);
}

at::Tensor cp_cut(const at::Tensor& x, const Group& cp, int64_t dim) {
  if (dim < 0) dim += x.dim();
  const int64_t S = x.size(dim), n = cp.size();
  if (S % n != 0)
    throw cp_error(std::to_string(n) + " does not divide the model's token sequence of " + std::to_string(S) +
                   " tokens (made inside the model, e.g. latent patches: frames x height x width / patch_size)");
  return x.narrow(dim, cp.rank() * (S / n), S / n);
}

void apply_context_parallel(models::Model& model, const Group& cp, const std::string& mode) {
  if (mode != "ring" && mode != "a2a")
    throw OptionError("cp_mode", "unknown value '" + mode + "' (ring|a2a)");
  const bool ring = mode == "ring";
  const int n = cp.size();
  const bool inside = model.sequence_inside();
  // the chunks are cut from the batch's token rows, before embed() would put each image's features at its tokens
  if (n > 1 && model.merges_embeddings())
    throw cp_error("the model merges image features into its token embeddings (a vision-language model); context "
                   "parallelism is not supported for it (use dp / zero, tp + sp, pp or ep)");
  std::vector<nn::AttentionHook*> attns = model.attention_modules();
  for (size_t i = 0; i < attns.size(); ++i) {
    nn::AttentionHook* attn = attns[i];
    if (inside && attn->causal)
      throw cp_error("the model cuts its token sequence itself (contiguous parts); its causal attention (layer " +
                     std::to_string(i) + ") needs the load-balanced layout");
    // linear attention, DeepSeek sparse attention, DeepSeek-V4 (its windows within): their parts, whatever the mode
    if (auto* p = dynamic_cast<nn::SequencePartsHook*>(attn); p && p->runs_in_parts()) continue;
    if (attn->window > 0)
      throw cp_error("sliding-window attention (layer " + std::to_string(i) + ", window " +
                  std::to_string(attn->window) + ") is not supported with context parallelism");
    if (!ring && attn->heads % n != 0)
      throw cp_error(std::to_string(n) + " does not divide num_attention_heads " +
                  std::to_string(attn->heads) + " (cp_mode a2a)");
    if (!ring && attn->kv_heads % n != 0)
      throw cp_error(std::to_string(n) + " does not divide num_key_value_heads " +
                  std::to_string(attn->kv_heads) + " (cp_mode a2a)");
  }
  const Group* g = &cp;
  if (inside) model.cut_sequence_fn = [g](const at::Tensor& x, int64_t dim) { return cp_cut(x, *g, dim); };
  // Token mixers with a recurrent state get this rank's parts of the load-balanced layout (chunks i and 2n-1-i of 2n)
  // and an all-gather that puts every rank's part values in sequence order (nn/sequence_parts.h).
  const int me = cp.rank();
  std::vector<int64_t> order(static_cast<size_t>(2 * n));  // sequence index -> position in the gathered tensor
  for (int r = 0; r < n; ++r) {
    order[static_cast<size_t>(r)] = 2 * r;
    order[static_cast<size_t>(2 * n - 1 - r)] = 2 * r + 1;
  }
  for (auto* attn : attns) {  // installed only once every layer passed the checks
    if (auto* rec = dynamic_cast<nn::SequencePartsHook*>(attn); rec && rec->runs_in_parts()) {
      rec->parts = nn::SequenceParts{{me, 2 * n - 1 - me}, 2 * n, [g, order](const at::Tensor& x) {
        at::Tensor all = gather_rs(x.contiguous(), *g, 0);
        return all.index_select(0, at::tensor(order, at::TensorOptions().dtype(at::kLong)).to(all.device()));
      }};
      continue;
    }
    const bool causal = attn->causal;
    attn->attention_fn = [g, ring, causal](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           int64_t q_offset, int64_t window, double scale,
                                           const at::Tensor& segment_ids) {
      if (q_offset != 0 || q.size(2) != k.size(2))
        throw Error("context parallel: a key/value cache (generation) is not supported");
      if (window > 0) throw cp_error("sliding-window attention is not supported with context parallelism");
      if (!ring) return a2a_attention(q, k, v, scale, segment_ids, *g, causal);
      // Ring attention moves keys and values as one tensor: values narrower than the keys (MLA's v_head_dim) travel
      // zero-padded to the key width; the padded output columns are zero and cut off.
      const int64_t dv = v.size(3), dk = k.size(3);
      if (dv == dk) return ring_attention(q, k, v, scale, segment_ids, *g, causal);
      if (dv > dk) throw Error("context parallel: values wider than keys are not supported (ring)");
      at::Tensor vp = at::constant_pad_nd(v, {0, dk - dv});
      return ring_attention(q, k, vp, scale, segment_ids, *g, causal).narrow(3, 0, dv);
    };
  }
}

at::Tensor next_token_targets(const at::Tensor& labels) { return nn::next_token_targets(labels); }

std::pair<at::Tensor, int64_t> token_loss_sum(const at::Tensor& logits, const at::Tensor& targets) {
  return {nn::token_loss_sum(logits, targets), (targets != nn::kIgnoreIndex).sum().item<int64_t>()};
}

}  // namespace lf::parallel
