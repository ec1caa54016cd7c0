#include "loongforge/parallel/tensor_parallel.h"

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <set>

#include "loongforge/core/error.h"
#include "loongforge/parallel/functional.h"

namespace lf::parallel {

namespace llama = models::llama;

namespace {

Error tp_error(const std::string& what) { return Error("recipe: field 'parallel.tp': " + what); }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The split dimension of a parameter of the dense decoder, by HF name.
int64_t layout_dim(const std::string& name) {
  for (const char* col : {"q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj."})
    if (ends_with(name, std::string(col) + "weight") || ends_with(name, std::string(col) + "bias")) return 0;
  for (const char* row : {"o_proj.weight", "down_proj.weight"})
    if (ends_with(name, row)) return 1;
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return 0;
  // LoRA adapters (y += s * B A x): a column-parallel layer's B splits its rows like the base weight (A whole); a
  // row-parallel layer's A splits its columns like the base weight (B whole; B applied to the partial A x is summed by
  // the layer's output reduction since B is linear).
  for (const char* col : {"q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj."})
    if (ends_with(name, std::string(col) + "lora_B.weight")) return 0;
  for (const char* row : {"o_proj.", "down_proj."})
    if (ends_with(name, std::string(row) + "lora_A.weight")) return 1;
  return -1;
}

// The whole adapter matrix of a LoRA pair whose gradient is partial on each tp rank (column-parallel lora_A sees only
// this rank's output rows; row-parallel lora_B only this rank's input columns).
bool lora_partial(const std::string& name) {
  if (ends_with(name, "lora_A.weight") || ends_with(name, "lora_B.weight")) return layout_dim(name) < 0;
  return false;
}

void check_divides(int tp, int64_t n, const char* what) {
  if (n % tp != 0) throw tp_error(std::to_string(tp) + " does not divide " + what + " " + std::to_string(n));
}

void check_sequence(int64_t t, int tp) {
  if (t % tp != 0)
    throw Error("recipe: field 'parallel.sp': sequence length " + std::to_string(t) + " is not divisible by tp " +
                std::to_string(tp));
}

// The entry of a group of column-parallel layers that read the same input (q/k/v, gate/up): one copy_to (or one
// sequence all-gather under sp) per input instead of one per layer. The result is kept for the other `uses - 1`
// layers only (then released, so recomputation still frees it).
class ColumnEntry {
 public:
  ColumnEntry(const Group* g, bool sp, int uses) : g_(g), sp_(sp), uses_(uses) {}
  at::Tensor operator()(const at::Tensor& x) {
    const bool grad = at::GradMode::is_enabled();
    if (left_ > 0 && key_.defined() && key_.is_same(x) && grad == grad_) {
      at::Tensor v = value_;
      if (--left_ == 0) key_ = value_ = at::Tensor();
      return v;
    }
    if (sp_) check_sequence(x.size(1) * g_->size(), g_->size());
    at::Tensor v = sp_ ? gather_rs(x, *g_, 1) : copy_to(x, *g_);
    left_ = uses_ - 1;
    if (left_ > 0) {
      key_ = x;
      value_ = v;
      grad_ = grad;
    } else {
      key_ = value_ = at::Tensor();
    }
    return v;
  }

 private:
  const Group* g_;
  bool sp_;
  int uses_, left_ = 0;
  bool grad_ = false;
  at::Tensor key_, value_;
};

void set_shard(at::Tensor& p, const std::string& name, const TensorParallelPlan& plan, const Group& tp) {
  at::NoGradGuard ng;
  at::Tensor s = shard_of(name, p.detach(), plan, tp);
  if (plan.dim_of(name) >= 0) p.set_data(s);
  if (p.grad().defined()) p.mutable_grad() = at::Tensor();
}

void column_parallel(nn::LinearImpl& lin, const std::shared_ptr<ColumnEntry>& entry) {
  lin.input_fn = [entry](const at::Tensor& x) { return (*entry)(x); };
  lin.out_features = lin.weight.size(0);
}

// Row parallel: the layer computes x_local W_local^T (its bias removed from the product), the output is summed
// over tp (reduce-scattered along the sequence under sp), then the whole bias is added once.
void row_parallel(nn::LinearImpl& lin, const Group* g, bool sp) {
  at::Tensor bias = lin.bias;  // the registered parameter (same tensor): still trained, now added after the sum
  lin.bias = at::Tensor();
  lin.output_fn = [g, sp, bias](const at::Tensor& y) {
    at::Tensor r = sp ? reduce_scatter(y, *g, 1) : reduce_from(y, *g);
    return bias.defined() ? r + bias : r;
  };
}

}  // namespace

int64_t TensorParallelPlan::dim_of(const std::string& name) const {
  auto it = shard_dim.find(name);
  if (it == shard_dim.end()) throw Error("tensor parallel: no parameter named '" + name + "' in the plan");
  return it->second;
}

bool TensorParallelPlan::counted_in_norm(const std::string& name) const { return dim_of(name) >= 0 || tp_rank == 0; }

void check_tensor_parallel(const llama::DecoderConfig& c, int tp) {
  if (tp < 1) throw tp_error("must be at least 1, got " + std::to_string(tp));
  check_divides(tp, c.num_attention_heads, "num_attention_heads");
  check_divides(tp, c.num_key_value_heads, "num_key_value_heads");
  check_divides(tp, c.intermediate_size, "intermediate_size");
  check_divides(tp, c.vocab_size, "vocab_size");
}

TensorParallelPlan apply_tensor_parallel(llama::CausalLMImpl& m, const Group& tp_group, bool sp) {
  const llama::DecoderConfig& c = m.config();
  const int n = tp_group.size();
  check_tensor_parallel(c, n);
  if (m.embed_fn) throw Error("tensor parallel: the model already has a vocabulary-parallel (or other) embed_fn");
  const Group* g = &tp_group;

  TensorParallelPlan plan;
  plan.tp_size = n;
  plan.tp_rank = tp_group.rank();
  plan.sp = sp;
  // MoE blocks: experts split along their ffn dimension (gate_up_proj [E,2f,d]: rows of each half; down_proj
  // [E,d,f]: columns), the router replicated with a partial gradient (its routing weights multiply partial expert
  // outputs); shared experts as a dense MLP (by name below).
  std::map<const void*, int64_t> moe_dim;
  std::set<const void*> moe_gate;
  for (auto* b : m.moe_blocks()) {
    if (b->options.expert_ffn % n)
      throw tp_error(std::to_string(n) + " does not divide moe_intermediate_size " + std::to_string(b->options.expert_ffn));
    if (b->options.shared_ffn % n)
      throw tp_error(std::to_string(n) + " does not divide the shared experts' intermediate size " +
                     std::to_string(b->options.shared_ffn));
    moe_dim[b->experts->gate_up_proj.unsafeGetTensorImpl()] = 1;
    moe_dim[b->experts->down_proj.unsafeGetTensorImpl()] = 2;
    moe_gate.insert(b->gate->weight.unsafeGetTensorImpl());
  }
  auto params = m.named_parameters(true);
  for (const auto& item : params) {
    const std::string& name = item.key();
    const void* impl = item.value().unsafeGetTensorImpl();
    if (auto it = moe_dim.find(impl); it != moe_dim.end()) {
      plan.shard_dim[name] = it->second;
      if (it->second == 1) plan.halves.insert(name);
      continue;
    }
    if (moe_gate.count(impl)) {
      plan.shard_dim[name] = -1;
      plan.partial_grad.push_back(name);
      continue;
    }
    if (name.find("lora_") != std::string::npos && name.rfind("model.layers.", 0) != 0)
      throw Error("recipe: field 'lora.target_modules': tensor parallel supports LoRA on the decoder layers' "
                  "projections only (parameter '" + name + "')");
    const int64_t dim = layout_dim(name);
    plan.shard_dim[name] = dim;
    const bool qk_norm = ends_with(name, "q_norm.weight") || ends_with(name, "k_norm.weight");
    if (dim < 0 && (qk_norm || sp || lora_partial(name))) plan.partial_grad.push_back(name);
  }
  for (auto& item : params) set_shard(item.value(), item.key(), plan, tp_group);

  for (size_t i = 0; i < m.model->layers->size(); ++i) {
    auto* layer = m.model->layers[i]->as<llama::DecoderLayerImpl>();
    auto& a = *layer->self_attn;
    a.heads /= n;
    a.kv_heads /= n;
    auto attn_in = std::make_shared<ColumnEntry>(g, sp, 3);
    for (nn::LinearImpl* lin : {a.q_proj.get(), a.k_proj.get(), a.v_proj.get()}) {
      column_parallel(*lin, attn_in);
    }
    row_parallel(*a.o_proj, g, sp);
    a.o_proj->in_features = a.o_proj->weight.size(1);
    if (layer->moe) {
      auto& b = *layer->moe;
      b.input_fn = [g, sp](const at::Tensor& x) {
        if (sp) check_sequence(x.size(1) * g->size(), g->size());
        return sp ? gather_rs(x, *g, 1) : copy_to(x, *g);
      };
      b.output_fn = [g, sp](const at::Tensor& y) { return sp ? reduce_scatter(y, *g, 1) : reduce_from(y, *g); };
      if (b.shared_experts) {  // column/row shards inside the block's region: no hooks of their own
        for (nn::LinearImpl* lin : {b.shared_experts->gate_proj.get(), b.shared_experts->up_proj.get()})
          lin->out_features = lin->weight.size(0);
        b.shared_experts->down_proj->in_features = b.shared_experts->down_proj->weight.size(1);
      }
      continue;
    }
    auto& mlp = *layer->mlp;
    auto mlp_in = std::make_shared<ColumnEntry>(g, sp, 2);
    for (nn::LinearImpl* lin : {mlp.gate_proj.get(), mlp.up_proj.get()}) {
      column_parallel(*lin, mlp_in);
    }
    row_parallel(*mlp.down_proj, g, sp);
    mlp.down_proj->in_features = mlp.down_proj->weight.size(1);
  }

  // Vocabulary-parallel embedding.
  const int64_t vl = c.vocab_size / n, lo = vl * tp_group.rank(), hi = lo + vl;
  int64_t pad = -1;
  if (c.pad_token_id && *c.pad_token_id >= lo && *c.pad_token_id < hi) pad = *c.pad_token_id - lo;
  auto* emb = m.model->embed_tokens.get();  // owned by m, which owns embed_fn: a raw pointer, no cycle
  m.embed_fn = [emb, g, sp, lo, hi, pad](const at::Tensor& ids) {
    if (sp) check_sequence(ids.size(1), g->size());
    at::Tensor in = (ids >= lo).logical_and(ids < hi);
    at::Tensor local = (ids - lo).masked_fill(in.logical_not(), 0);
    at::Tensor e = at::embedding(emb->weight, local, pad);
    e = e * in.unsqueeze(-1).to(e.scalar_type());
    return sp ? reduce_scatter(e, *g, 1) : reduce_from(e, *g);
  };
  return plan;
}

at::Tensor lm_loss_sum(llama::CausalLMImpl& m, const at::Tensor& hidden, const at::Tensor& targets, const Group& tp,
                       bool sp, int64_t ignore_index) {
  if (sp) check_sequence(hidden.size(1) * tp.size(), tp.size());
  at::Tensor h = sp ? gather_rs(hidden, tp, 1) : copy_to(hidden, tp);
  if (h.size(0) != targets.size(0) || h.size(1) != targets.size(1))
    throw Error("tensor parallel: lm_loss_sum: targets [" + std::to_string(targets.size(0)) + "," +
                std::to_string(targets.size(1)) + "] do not match the hidden states' batch and sequence");
  at::Tensor w = m.output_weight();
  const int64_t vl = w.size(0), lo = vl * tp.rank();
  at::Tensor logits = at::linear(h, w).to(at::kFloat);  // [B,T,V/tp]: this rank's vocabulary slice
  at::Tensor mx = std::get<0>(logits.detach().max(-1, true)).contiguous();
  tp.all_reduce(mx, Reduce::Max);
  at::Tensor z = logits - mx;
  at::Tensor sumexp = reduce_from(z.exp().sum(-1), tp);  // [B,T]
  at::Tensor valid = targets.ne(ignore_index);
  at::Tensor mine = (targets >= lo).logical_and(targets < lo + vl).logical_and(valid);
  at::Tensor local = (targets - lo).masked_fill(mine.logical_not(), 0);
  at::Tensor picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(mine.logical_not(), 0);
  at::Tensor target_logit = reduce_from(picked, tp);
  return (sumexp.log() - target_logit).masked_fill(valid.logical_not(), 0).sum();
}

at::Tensor gather_full_logits(llama::CausalLMImpl& m, const at::Tensor& hidden, const Group& tp, bool sp) {
  at::Tensor h = sp ? gather(hidden, tp, 1) : hidden;
  return gather(at::linear(h, m.output_weight()), tp, -1 + h.dim());
}

void sync_sequence_parallel_grads(llama::CausalLMImpl& m, const TensorParallelPlan& plan, const Group& tp) {
  if (plan.partial_grad.empty() || tp.size() == 1) return;
  auto params = m.named_parameters(true);
  std::vector<at::Tensor> ps, flat;
  for (const auto& name : plan.partial_grad) {
    at::Tensor* p = params.find(name);
    if (!p) throw Error("tensor parallel: no parameter named '" + name + "' in the model");
    ps.push_back(*p);
    flat.push_back(p->grad().defined() ? p->grad().reshape(-1) : at::zeros({p->numel()}, p->options()));
  }
  at::Tensor buf = at::cat(flat);
  tp.all_reduce(buf);
  int64_t off = 0;
  at::NoGradGuard ng;
  for (auto& p : ps) {
    at::Tensor part = buf.narrow(0, off, p.numel()).view(p.sizes());
    off += p.numel();
    if (p.grad().defined()) p.mutable_grad().copy_(part);
    else p.mutable_grad() = part.clone();
  }
}

std::map<std::string, at::Tensor> gather_full(llama::CausalLMImpl& m, const TensorParallelPlan& plan, const Group& tp) {
  std::map<std::string, at::Tensor> out;
  at::NoGradGuard ng;
  for (const auto& item : m.named_parameters(true)) {
    const int64_t dim = plan.dim_of(item.key());
    at::Tensor p = item.value().detach();
    out[item.key()] = dim >= 0 ? unshard(item.key(), p, plan, tp) : p.clone();
  }
  return out;
}

at::Tensor shard_of(const std::string& name, const at::Tensor& full, const TensorParallelPlan& plan, const Group& tp) {
  const int64_t dim = plan.dim_of(name);
  if (dim < 0) return full;
  if (full.size(dim) % tp.size() != 0)
    throw tp_error(std::to_string(tp.size()) + " does not divide dimension " + std::to_string(dim) + " (" +
                   std::to_string(full.size(dim)) + ") of '" + name + "'");
  if (plan.halves.count(name)) {  // [.., 2f, ..]: this rank's chunk of each half, stacked
    if (full.size(dim) % (2 * tp.size()) != 0)
      throw tp_error(std::to_string(tp.size()) + " does not divide the halves of dimension " + std::to_string(dim) +
                     " (" + std::to_string(full.size(dim)) + ") of '" + name + "'");
    auto h = full.chunk(2, dim);
    return at::cat({h[0].chunk(tp.size(), dim)[static_cast<size_t>(tp.rank())],
                    h[1].chunk(tp.size(), dim)[static_cast<size_t>(tp.rank())]}, dim);
  }
  at::Tensor s = full.chunk(tp.size(), dim)[static_cast<size_t>(tp.rank())];
  return s.is_contiguous() ? s.clone() : s.contiguous();
}

at::Tensor unshard(const std::string& name, const at::Tensor& local, const TensorParallelPlan& plan, const Group& tp) {
  const int64_t dim = plan.dim_of(name);
  if (dim < 0 || tp.size() == 1) return local;
  if (plan.halves.count(name)) {
    auto h = local.chunk(2, dim);
    return at::cat({tp.all_gather(h[0].contiguous(), dim), tp.all_gather(h[1].contiguous(), dim)}, dim);
  }
  return tp.all_gather(local.contiguous(), dim);
}

}  // namespace lf::parallel
