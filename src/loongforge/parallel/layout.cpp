#include "loongforge/parallel/layout.h"

#include "loongforge/core/error.h"
#include "loongforge/nn/sequence_parts.h"

namespace lf::parallel {

namespace {
[[noreturn]] void bad(const std::string& field, const std::string& what) {
  throw OptionError(field, what);
}
std::string s(int64_t v) { return std::to_string(v); }
}  // namespace

std::string Layout::describe() const {
  std::string d;
  auto add = [&](const std::string& x) { d += (d.empty() ? "" : " ") + x; };
  if (dp > 1) add("dp" + s(dp));
  if (tp > 1) add("tp" + s(tp));
  if (sp) add("sp");
  if (pp > 1) add("pp" + s(pp));
  if (vpp > 1) add("vpp" + s(vpp));
  if (cp > 1) add("cp" + s(cp) + "(" + cp_mode + ")");
  if (ep > 1) add("ep" + s(ep));
  if (zero > 0) add("zero" + s(zero));
  if (hsdp_shard > 0) add("hsdp_shard" + s(hsdp_shard));
  return d.empty() ? "single process" : d;
}

void validate(const Layout& l, models::Model& m, int64_t seq_len, int64_t micro_batches, bool lora) {
  for (auto [name, v] : {std::pair{"dp", l.dp}, {"tp", l.tp}, {"pp", l.pp}, {"vpp", l.vpp}, {"cp", l.cp}, {"ep", l.ep}})
    if (v < 1) bad(name, s(v) + " is not a positive size");
  const bool moe = !m.moe_layers().empty();
  const int64_t blocks = m.num_blocks();
  const auto attn = m.attention_modules();
  if (l.ep != 1 && !moe) bad("ep", s(l.ep) + ": expert parallelism needs a mixture-of-experts model; this one is dense");
  // MoE models: data parallelism (DDP, ZeRO-1, FSDP), tensor (+sequence) parallelism (experts split along their
  // ffn) expert parallelism over data-parallel ranks (DDP, ZeRO-1), pipeline and context parallelism in the trainer.
  if (l.ep > 1) {
    if (l.dp % l.ep)
      bad("ep", s(l.ep) + " does not divide parallel.dp " + s(l.dp) + " (the expert-parallel ranks are data-parallel ranks)");
    if (l.zero > 1) bad("ep", s(l.ep) + ": expert parallelism runs with parallel.zero 0 (DDP) or 1 (ZeRO-1), got zero " + s(l.zero));
  }
  if (l.timeout_s < 1) bad("timeout_s", s(l.timeout_s) + " is not a positive number of seconds");
  if (l.tp > 1 && m.tensor_parallel_spec().rules.empty())
    bad("tp", s(l.tp) + ": " + m.model_type() + " has no tensor-parallel plan (use data or context parallelism)");
  if (l.pp > 1)
    if (const std::string why = m.pipeline_blocker(); !why.empty()) bad("pp", s(l.pp) + ": " + why);
  if (l.tp > 1)
    for (const auto& [field, n] : m.tensor_parallel_spec().divisible)
      if (n % l.tp) bad("tp", s(l.tp) + " does not divide " + field + " " + s(n));
  if (l.sp && l.tp == 1) bad("sp", "sequence parallel splits over tensor-parallel ranks; it needs tp > 1");
  // A model that makes its token sequence inside (Model::sequence_inside) checks the length when it cuts it.
  const int64_t seq_div = (l.cp > 1 && !m.sequence_inside() ? 2 * l.cp : 1) * (l.sp ? l.tp : 1);
  if (seq_len % seq_div)
    bad(l.cp > 1 ? "cp" : "sp", "data.seq_len " + s(seq_len) + " is not a multiple of " + s(seq_div) +
                                    (l.cp > 1 ? " (2 x cp chunks" + std::string(l.sp ? " x tp" : "") + ")" : " (tp)"));
  if (l.cp > 1 && l.cp_mode == "a2a")
    for (const nn::AttentionHook* a : attn) {
      // linear attention passes states, DeepSeek sparse attention gathers its keys: no heads exchanged
      if (auto* p = dynamic_cast<const nn::SequencePartsHook*>(a); p && p->runs_in_parts()) continue;
      if ((a->heads / l.tp) % l.cp) bad("cp", s(l.cp) + " does not divide the " + s(a->heads / l.tp) + " attention heads per tensor-parallel rank (cp_mode a2a)");
      if ((a->kv_heads / l.tp) % l.cp) bad("cp", s(l.cp) + " does not divide the " + s(a->kv_heads / l.tp) + " key/value heads per tensor-parallel rank (cp_mode a2a)");
    }
  if (l.cp > 1)
    for (const nn::AttentionHook* a : attn) {
      // a module that runs on its parts (DeepSeek-V4: gathers its keys) applies its window itself
      if (auto* p = dynamic_cast<const nn::SequencePartsHook*>(a); p && p->runs_in_parts()) continue;
      if (a->window > 0) bad("cp", "context parallel does not support sliding-window attention (layer window " + s(a->window) + ")");
    }
  if (l.vpp > 1 && l.pp == 1) bad("vpp", "virtual pipeline stages need pp > 1");
  const int64_t stages = int64_t(l.pp) * l.vpp;
  if (!l.pp_layout.empty()) {
    if (static_cast<int64_t>(l.pp_layout.size()) != stages)
      bad("pp_layout", "has " + s(static_cast<int64_t>(l.pp_layout.size())) + " entries; pp x vpp = " + s(stages));
    int64_t sum = 0;
    for (int64_t n : l.pp_layout) {
      if (n < 1) bad("pp_layout", "every stage needs at least one layer");
      sum += n;
    }
    if (sum != blocks) bad("pp_layout", "sums to " + s(sum) + " layers; the model has " + s(blocks));
  } else if (stages > 1 && blocks % stages) {
    bad("pp", "pp x vpp = " + s(stages) + " does not divide num_hidden_layers " + s(blocks) +
                  " (give parallel.pp_layout for an uneven split)");
  }
  if (stages > 1 && stages > blocks) bad("pp", "pp x vpp = " + s(stages) + " stages for " + s(blocks) + " layers");
  if (l.vpp > 1 && micro_batches % l.pp)
    bad("vpp", "the interleaved schedule needs train.grad_accum (" + s(micro_batches) + ") to be a multiple of pp " + s(l.pp));
  if (l.hsdp_shard > 0) {
    if (l.zero != 3) bad("hsdp_shard", "HSDP shards parameters: it needs parallel.zero 3");
    if (l.dp % l.hsdp_shard) bad("hsdp_shard", s(l.hsdp_shard) + " does not divide dp " + s(l.dp));
  }
  if (l.zero == 3 && (l.tp > 1 || l.pp > 1 || l.cp > 1))
    bad("zero", "3 (FSDP) combines with data parallelism only; with tp/pp/cp use zero 1 (distributed optimizer)");
  // LoRA: data parallel (DDP, ZeRO-1), tensor (+sequence) and pipeline parallel; not FSDP or context parallel yet.
  if (lora && l.zero == 3) bad("zero", "3 (FSDP) does not train LoRA adapters yet; use zero 0 or 1");
  if (lora && l.cp > 1) bad("cp", "context parallel does not train LoRA adapters yet");
}

}  // namespace lf::parallel
