// Context parallelism for any model whose attention modules expose the hook (models/model.h): the sequence of every batch is split over a cp group,
// load-balanced for causal attention, and attention runs across the group either as ring attention or as
// all-to-all (DeepSpeed-Ulysses).
//
// Layout: the sequence (length T, divisible by 2*cp) is cut into 2*cp chunks of c = T/(2*cp) tokens; group rank i
// holds chunks i and 2*cp-1-i, concatenated (2c local tokens). Every rank then does about the same causal work.
//
// Ring ("ring"): each rank keeps its queries; key/value blocks (with their segment ids) travel around the ring
// with Group::batch_p2p (to rank+1 and from rank-1 in one batch), overlapped with the block computation. Blockwise
// attention with a log-sum-exp merge; (query chunk, key chunk) pairs that the causal mask hides entirely are
// skipped. Backward is fully blockwise as well (flash-attention style, recomputing the probabilities from the
// saved log-sum-exp): key/value blocks travel around the ring a second time together with their dK/dV
// accumulators, which arrive back at their owner after the last hop.
//
// All-to-all ("a2a"): q/k/v go from [B, heads, local tokens] to [B, heads/cp, all tokens] (parallel::all_to_all),
// the sequence is put back in natural order, nn::causal_attention runs on it, and the inverse exchange returns
// [B, heads, local tokens]. Needs num_attention_heads and num_key_value_heads divisible by cp.
//
// Linear attention (modules that are also nn::SequencePartsHook: Gated DeltaNet, KDA) in either mode: the module gets
// this rank's two parts and an all-gather of per-part values in sequence order (nn/sequence_parts.h: the recurrent
// state and the short convolution's past pass from part to part); no heads are exchanged. DeepSeek sparse attention
// (a latent attention with an indexer) the same: it gathers the whole sequence's latents and index keys with it.
//
// Packed documents: the segment ids of the local tokens (cp_shard of the full [B,T] ids) are passed as
// attention_fn's segment_ids; attention stays within a document in both modes. Sliding windows are rejected (but in
// DeepSeek-V4's attention, which runs on its parts: it gathers its shared key head and compressor projections and applies
// its window at the global positions).
//
// Training conventions: feed the model cp_shard of the input ids, of the position ids (the global positions, so
// rotary embeddings are right), of the segment ids and of next_token_targets(labels) (the shift must happen on
// the full sequence); take token_loss_sum of the local logits, divide by the global token count, backward, and
// sum the loss and every gradient over the cp group (and data parallel).
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "loongforge/models/model.h"
#include "loongforge/parallel/comm.h"

namespace lf::parallel {

// Global positions (0..T-1) of the tokens of a sequence of length T in the load-balanced layout, in rank order
// (rank 0's local tokens, then rank 1's, ...): [T] long. Throws lf::Error unless 2*cp divides T.
at::Tensor cp_layout_positions(int64_t T, int cp_size);

// This rank's part of a [B,T,...] tensor along `dim` (ids, targets, position ids, segment ids, hidden states) in
// the load-balanced layout. Not differentiable. Throws lf::Error unless 2*cp divides the length.
at::Tensor cp_shard(const at::Tensor& x, const Group& cp, int64_t dim = 1);
at::Tensor cp_shard(const at::Tensor& x, int cp_size, int cp_rank, int64_t dim = 1);
// The inverse: gathers every rank's part (all-gather over cp) and restores the natural order. Not differentiable.
at::Tensor cp_unshard(const at::Tensor& local, const Group& cp, int64_t dim = 1);

// Ring attention over the cp group. q [B,H,Tl,D], k/v [B,Hkv,Tl,D] (GQA: Hkv divides H) hold this rank's tokens in
// the load-balanced layout; segment_ids [B,Tl] (optional) their documents. Causal; returns [B,H,Tl,D].
// Differentiable (custom blockwise backward). Computes in float64 for double inputs, float32 otherwise.
// causal = false: bidirectional attention (every query sees every key of its segment); the tokens may then be in any
// layout (the contiguous one of cp_cut), and nothing is skipped.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                          const at::Tensor& segment_ids, const Group& cp, bool causal = true);
// Ulysses attention over the cp group; same arguments and result. Throws lf::Error unless cp divides H and Hkv.
at::Tensor a2a_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                         const at::Tensor& segment_ids, const Group& cp, bool causal = true);

// Models whose token sequence is made inside the model (models::Model::sequence_inside: diffusion transformers):
// this rank's contiguous part of x along dim (rank i of n holds tokens [i S/n, (i+1) S/n)); differentiable (the
// backward puts the part's gradient in place, zeros elsewhere). OptionError (parallel.cp) unless n divides S.
at::Tensor cp_cut(const at::Tensor& x, const Group& cp, int64_t dim);

// Installs ring or a2a attention (mode "ring" | "a2a") as every attention module's attention_fn
// (Model::attention_modules), causal or bidirectional as each module is; for a model whose sequence is made inside
// (Model::sequence_inside) also its cut_sequence_fn (cp_cut; its modules must be bidirectional). `cp` must outlive
// the model's use. Throws lf::Error (naming parallel.cp / parallel.cp_mode) for an unknown mode, sliding
// windows, or (a2a) heads not divisible by cp. The installed function rejects a key/value cache (generation).
void apply_context_parallel(models::Model& model, const Group& cp, const std::string& mode);

// labels[:, t+1] at position t and -100 at the last position: the next-token targets of the full sequence (the
// shift of nn::causal_lm_loss), to be sharded with cp_shard like the inputs.
at::Tensor next_token_targets(const at::Tensor& labels);
// Sum (float32) of the token cross-entropies of logits [B,Tl,V] against already shifted targets [B,Tl] (-100
// ignored) and the number of counted tokens.
std::pair<at::Tensor, int64_t> token_loss_sum(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace lf::parallel
