// A parallel layout (the recipe's `parallel` block) and its validation against a model and the data shape.
// The mesh dimensions, outermost first: pp, dp_rep (replicas), dp_shard (ZeRO/FSDP shards), cp, tp — tensor
// parallel ranks are neighbours, as in Megatron. Data parallelism is dp_rep x dp_shard:
//   zero 0: dp_rep = dp; zero 1 (distributed optimizer) and zero 3 (FSDP): dp_shard = dp;
//   HSDP (zero 3, hsdp_shard = S): dp_shard = S, dp_rep = dp / S.
// Expert parallelism (ep > 1, MoE models, zero 0 only): the ep ranks are data-parallel ranks; ep divides dp and the
// mesh splits dp_rep into dp_rep = dp / ep (outer) x ep (inner, neighbouring data ranks):
//   pp, dp_rep, ep, dp_shard, cp, tp (ep is 1 without expert parallelism). The world stays dp x tp x pp x cp.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/models/model.h"

namespace lf::parallel {

struct Layout {
  int dp = 1, tp = 1, pp = 1, vpp = 1, cp = 1, ep = 1;
  std::string cp_mode = "ring";  // ring | a2a
  bool sp = false;
  int zero = 0;                  // 0 | 1 | 3
  int hsdp_shard = 0;            // 0: no HSDP; else the FSDP shard group size
  std::vector<int64_t> pp_layout;  // layers per (virtual) stage; empty: even
  int64_t timeout_s = 300;

  int world() const { return dp * tp * pp * cp; }
  bool trivial() const { return world() == 1 && zero == 0 && !sp; }
  // ZeRO-1 with expert parallelism: the optimizer state is split over the dp / ep ranks of each ep rank's data
  // replicas (non-expert parameters are then also replicated over ep).
  int dp_shard() const { return zero == 0 ? 1 : (hsdp_shard > 0 ? hsdp_shard : dp / ep); }
  int dp_rep() const { return dp / dp_shard() / ep; }
  std::vector<std::pair<std::string, int>> mesh_dims() const {
    return {{"pp", pp}, {"dp_rep", dp_rep()}, {"ep", ep}, {"dp_shard", dp_shard()}, {"cp", cp}, {"tp", tp}};
  }
  std::string describe() const;  // "dp2 tp2 pp2 ..." (the non-trivial parts)
};

// Checks the layout against the model and the batch: one-line lf::Error naming the recipe field
// ("recipe: field 'parallel.tp': 3 does not divide num_attention_heads 8"). micro_batches: per step (grad_accum).
// lora: a LoRA run (trained with dp/zero 1, tp(+sp), pp; zero 3 and cp are errors).
void validate(const Layout& l, models::Model& m, int64_t seq_len, int64_t micro_batches, bool lora);

}  // namespace lf::parallel
