// Context parallelism for token mixers with a recurrent state (linear attention): the state and the short
// convolution's past pass from one part of the sequence to the next, across ranks (layer nn; no parallel include:
// the layout installs the gather). A module that can run this way also derives from SequencePartsHook; the context
// parallel layout finds it among Model::attention_modules() and sets `parts` instead of an attention_fn.
//
// The gated delta rule is affine in its start state: over a part, S_end = M S_start + S0 (M [Dk, Dk] the product of
// the part's (I - beta k k^T) D_t factors, D_t = exp(g_t) one decay per head or, for KDA's per-channel decay,
// diag(exp(g_t)) acting on the state's key rows: affine all the same; S0 the end state from zero) and every output
// o_t = o0_t + S_start^T (M_t^T q_t). One chunk-wise pass with values [v | 0] from the start state [0 | I] gives all of it: the outputs' two
// column blocks are o0 and M_t^T q, the end state is [S0 | M]. The parts' (S0, M) are all-gathered (small: [Dk,
// Dv + Dk] per head), each rank scans them in sequence order to its parts' start states, and adds the correction —
// the local work is one pass of width Dv + Dk, and nothing of size T leaves the rank but the convolution's K - 1
// last inputs per part.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <vector>

namespace lf::nn {

struct SequenceParts {
  std::vector<int64_t> local;  // the sequence indices of this rank's parts, in local order (equal lengths)
  int64_t total = 0;           // the number of parts the whole sequence is cut into
  // [P, ...] values of this rank's parts -> [total, ...] of every rank's, in sequence order. Differentiable: the
  // backward sums what every rank's copy received (all-gather forward, reduce-scatter backward).
  std::function<at::Tensor(const at::Tensor&)> gather;
};

struct SequencePartsHook {
  virtual ~SequencePartsHook() = default;
  std::optional<SequenceParts> parts;  // set by the context parallel layout; unset: the local tokens are the sequence
  // Whether this module runs on its parts (false: it takes the layout's attention_fn as other attention modules;
  // DeepSeek's latent attention without a sparse-attention indexer).
  virtual bool runs_in_parts() const { return true; }
};

// Packed documents (segment_ids [B, Tl]: this rank's tokens' document ids, the global ones, a document ending where
// the id changes as nn::document_ranges has it): in both functions below the convolution's past and the recurrent
// state restart at every document start, within a part or at its first token; a document running on from the part
// before continues as without documents. Undefined: one document per row.

// causal_depthwise_conv_silu over this rank's parts of x [B, Tl, C] (Tl = P equal parts), each continuing from the
// last K - 1 inputs of the part before it in the sequence (zeros before the first). Returns y [B, Tl, C].
at::Tensor parts_causal_conv_silu(const at::Tensor& x, const at::Tensor& weight, const SequenceParts& parts,
                                  const at::Tensor& segment_ids = {});

// chunk_gated_delta_rule over this rank's parts (q, k [B, Tl, Hk, Dk]; v [B, Tl, Hv, Dv]; beta [B, Tl, Hv]; g
// [B, Tl, Hv] or per channel [B, Tl, Hv, Dk]),
// each part starting from the state the parts before it leave (zeros before the first). Returns the outputs
// [B, Tl, Hv, Dv] in v's dtype.
at::Tensor parts_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                  const at::Tensor& beta, const SequenceParts& parts, int64_t chunk = 64,
                                  const at::Tensor& segment_ids = {});

}  // namespace lf::nn
