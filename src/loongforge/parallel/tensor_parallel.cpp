#include "loongforge/parallel/tensor_parallel.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <torch/nn/modules/embedding.h>

#include "loongforge/core/error.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/loss.h"
#include "loongforge/parallel/functional.h"

namespace lf::parallel {

namespace {

OptionError tp_error(const std::string& what) { return OptionError("tp", what); }

// Parameter `local` ("weight", "bias", "lora_A.weight", "lora_B.weight") of a module in `style`: its split dimension
// (-1: replicated) and whether its gradient is partial on each tp rank (summed over tp after backward).
// LoRA adapters (y += s * B A x): a column-parallel layer's B splits its rows like the base weight (A whole, its
// gradient partial: it sees only this rank's output rows); a row-parallel layer's A splits its columns like the base
// weight (B whole, applied to the partial A x and summed by the layer's output reduction; its gradient partial).
std::pair<int64_t, bool> param_dim(models::TpStyle style, const std::string& local, bool sp) {
  using S = models::TpStyle;
  switch (style) {
    case S::Colwise:
    case S::ColwiseInside:
      if (local == "weight" || local == "bias" || local == "lora_B.weight") return {0, false};
      if (local == "lora_A.weight") return {-1, true};
      break;
    case S::Rowwise:
    case S::RowwiseInside:
      if (local == "weight" || local == "lora_A.weight") return {1, false};
      if (local == "lora_B.weight") return {-1, true};
      if (local == "bias") return {-1, sp};  // added once after the sum (under sp: on this rank's tokens)
      break;
    case S::VocabEmbedding:
    case S::VocabHead:
      if (local == "weight") return {0, false};
      break;
    case S::ReplicatedEntry:
    case S::ReplicatedInside:
      return {-1, true};
    case S::ReplicatedWhole:
    case S::WholeEntry:
      return {-1, false};
    case S::ShardedInside:
      return {0, false};
  }
  return {-2, false};  // not a parameter this style knows
}

void check_divides(int tp, int64_t n, const std::string& what) {
  if (n % tp != 0) throw tp_error(std::to_string(tp) + " does not divide " + what + " " + std::to_string(n));
}

void check_sequence(int64_t t, int tp) {
  if (t % tp != 0)
    throw OptionError("sp", "sequence length " + std::to_string(t) + " is not divisible by tp " +
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

void check_tensor_parallel(const models::TensorParallelSpec& spec, int tp) {
  if (tp < 1) throw tp_error("must be at least 1, got " + std::to_string(tp));
  for (const auto& [field, n] : spec.divisible) check_divides(tp, n, field);
}

TensorParallelPlan apply_tensor_parallel(models::Model& m, const Group& tp_group, bool sp, int64_t vocab_granule) {
  if (vocab_granule < 1) throw Error("tensor parallel: the vocabulary granule must be >= 1, got " + std::to_string(vocab_granule));
  using S = models::TpStyle;
  const models::TensorParallelSpec spec = m.tensor_parallel_spec();
  const int n = tp_group.size();
  check_tensor_parallel(spec, n);
  if (m.embed_fn) throw Error("tensor parallel: the model already has a vocabulary-parallel (or other) embed_fn");
  const Group* g = &tp_group;

  TensorParallelPlan plan;
  plan.tp_size = n;
  plan.tp_rank = tp_group.rank();
  plan.sp = sp;
  // MoE blocks: experts split along their ffn dimension (gate_up_proj [E,2f,d]: rows of each half; down_proj
  // [E,d,f]: columns), the router replicated with a partial gradient (its routing weights multiply partial expert
  // outputs); shared experts by the plan's rules (inside the block's region).
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
  // The style of every module the plan names (first matching rule), and the rule that matched.
  std::vector<std::regex> res;
  for (const auto& r : spec.rules) res.emplace_back(r.pattern);
  struct Styled {
    std::shared_ptr<torch::nn::Module> module;
    S style;
    size_t rule;
  };
  std::map<std::string, Styled> styled;
  for (const auto& item : m.named_modules("", /*include_self=*/false))
    for (size_t k = 0; k < res.size(); ++k)
      if (std::regex_match(item.key(), res[k])) {
        styled[item.key()] = {item.value(), spec.rules[k].style, k};
        break;
      }
  auto params = m.named_parameters(true);
  for (const auto& item : params) {
    const std::string& name = item.key();
    const void* impl = item.value().unsafeGetTensorImpl();
    if (auto it = moe_dim.find(impl); it != moe_dim.end()) {
      plan.shard_dim[name] = it->second;
      if (it->second == 1) {
        const int64_t f = item.value().size(1) / 2;
        plan.blocks[name] = {f, f};
      }
      continue;
    }
    if (moe_gate.count(impl)) {
      plan.shard_dim[name] = -1;
      plan.partial_grad.push_back(name);
      continue;
    }
    // the styled module owning the parameter: the longest module name that prefixes it
    const Styled* owner = nullptr;
    std::string local;
    for (size_t dot = name.rfind('.'); dot != std::string::npos && dot > 0; dot = name.rfind('.', dot - 1)) {
      auto it = styled.find(name.substr(0, dot));
      if (it != styled.end()) {
        owner = &it->second;
        local = name.substr(dot + 1);
        break;
      }
    }
    const bool lora = name.find("lora_") != std::string::npos;
    int64_t dim = -1;
    bool partial = sp;  // replicated parameters outside any region see this rank's tokens under sp
    if (owner) {
      std::tie(dim, partial) = param_dim(owner->style, local, sp);
      if (dim == -2 && lora)
        throw OptionError("target_modules", "tensor parallel supports LoRA on the blocks' projections only "
                                            "(parameter '" + name + "')");
      if (dim == -2) throw Error("tensor parallel: parameter '" + name + "' does not fit its module's plan style");
      if (owner->style == S::ShardedInside)  // its first dimension longer than 1 (the heads of a [1, 1, H, 1] vector)
        while (dim + 1 < item.value().dim() && item.value().size(dim) == 1) ++dim;
    } else if (lora) {
      throw OptionError("target_modules", "tensor parallel supports LoRA on the blocks' projections only "
                                          "(parameter '" + name + "')");
    }
    plan.shard_dim[name] = dim;
    if (dim >= 0 && owner && !spec.rules[owner->rule].blocks.empty()) {
      const std::vector<int64_t>& sizes = spec.rules[owner->rule].blocks;
      int64_t total = 0;
      for (int64_t b : sizes) {
        if (b % n) throw tp_error(std::to_string(n) + " does not divide a block of " + std::to_string(b) + " rows of '" + name + "'");
        total += b;
      }
      if (total != item.value().size(dim))
        throw Error("tensor parallel: the blocks of '" + name + "' sum to " + std::to_string(total) + ", not its " +
                    std::to_string(item.value().size(dim)) + " rows");
      plan.blocks[name] = sizes;
    }
    if (dim < 0 && partial) plan.partial_grad.push_back(name);
    if (owner && (owner->style == S::VocabEmbedding || owner->style == S::VocabHead) && dim == 0) {
      const int64_t v = item.value().size(0), unit = int64_t{n} * vocab_granule, vp = (v + unit - 1) / unit * unit;
      if (plan.vocab && plan.vocab != v)
        throw Error("tensor parallel: vocabulary-parallel parameters of " + std::to_string(plan.vocab) + " and " +
                    std::to_string(v) + " rows");
      plan.vocab = v;
      plan.padded_vocab = vp;
      if (vp != v) plan.padded_rows[name] = v;
    }
  }
  for (auto& item : params) set_shard(item.value(), item.key(), plan, tp_group);

  for (nn::AttentionHook* a : m.attention_modules()) {
    a->heads /= n;
    a->kv_heads /= n;
    a->head_sum_fn = [g](const at::Tensor& t) {
      at::Tensor sum = t.detach().contiguous().clone();
      g->all_reduce(sum);
      return sum;
    };
  }
  // Region entries shared by the modules one rule matches under one parent (q/k/v, gate/up: one copy or gather of
  // their common input).
  std::map<std::pair<std::string, size_t>, int> uses;
  auto parent = [](const std::string& name) { return name.substr(0, name.rfind('.') == std::string::npos ? 0 : name.rfind('.')); };
  for (const auto& [name, st] : styled)
    if (st.style == S::Colwise || st.style == S::ReplicatedEntry || st.style == S::WholeEntry) ++uses[{parent(name), st.rule}];
  std::map<std::pair<std::string, size_t>, std::shared_ptr<ColumnEntry>> entries;
  bool vocab = false;
  for (const auto& [name, st] : styled) {
    if (st.style == S::VocabEmbedding || st.style == S::VocabHead) {
      vocab = true;
      continue;
    }
    if (st.style == S::ReplicatedInside || st.style == S::ReplicatedWhole || st.style == S::ShardedInside) continue;
    auto* lin = st.module->as<nn::LinearImpl>();
    if (!lin) throw Error("tensor parallel: module '" + name + "' is not a linear layer (its plan style needs one)");
    if (st.style == S::Colwise || st.style == S::ReplicatedEntry || st.style == S::WholeEntry) {
      auto key = std::make_pair(parent(name), st.rule);
      auto& e = entries[key];
      if (!e) e = std::make_shared<ColumnEntry>(g, sp, uses[key]);
      lin->input_fn = [e](const at::Tensor& x) { return (*e)(x); };
    }
    if (st.style == S::Colwise || st.style == S::ColwiseInside) lin->out_features = lin->weight.size(0);
    if (st.style == S::Rowwise) row_parallel(*lin, g, sp);
    if (st.style == S::Rowwise || st.style == S::RowwiseInside) lin->in_features = lin->weight.size(1);
  }
  for (auto* b : m.moe_blocks()) {  // a region of its own: routing on whole tokens, one sum of the partial outputs
    b->input_fn = [g, sp](const at::Tensor& x) {
      if (sp) check_sequence(x.size(1) * g->size(), g->size());
      return sp ? gather_rs(x, *g, 1) : copy_to(x, *g);
    };
    b->output_fn = [g, sp](const at::Tensor& y) { return sp ? reduce_scatter(y, *g, 1) : reduce_from(y, *g); };
  }

  // Vocabulary-parallel embedding and loss.
  for (const auto& [name, st] : styled) {
    if (st.style != S::VocabEmbedding) continue;
    auto* emb = st.module->as<torch::nn::EmbeddingImpl>();  // owned by m, which owns embed_fn: no cycle
    if (!emb) throw Error("tensor parallel: module '" + name + "' is not an embedding (VocabEmbedding)");
    const int64_t vl = emb->weight.size(0), lo = vl * tp_group.rank(), hi = lo + vl;
    int64_t pad = -1;
    if (auto p = emb->options.padding_idx(); p && *p >= lo && *p < hi) pad = *p - lo;
    // A model that merges more into the embeddings (models::Model::merges_embeddings) gets whole sequences and
    // cuts them itself, through scatter_sequence_fn, once they are complete.
    const bool scatter_here = sp && !m.merges_embeddings();
    m.embed_fn = [emb, g, sp, scatter_here, lo, hi, pad](const at::Tensor& ids) {
      if (sp) check_sequence(ids.size(1), g->size());
      at::Tensor in = (ids >= lo).logical_and(ids < hi);
      at::Tensor local = (ids - lo).masked_fill(in.logical_not(), 0);
      at::Tensor e = at::embedding(emb->weight, local, pad);
      e = e * in.unsqueeze(-1).to(e.scalar_type());
      return scatter_here ? reduce_scatter(e, *g, 1) : reduce_from(e, *g);
    };
    if (sp && !scatter_here)
      m.scatter_sequence_fn = [g](const at::Tensor& h) {
        check_sequence(h.size(1), g->size());
        return split(h, *g, 1);  // backward: the gradients of every part, gathered
      };
  }
  if (vocab)
    m.vocab_loss_fn = [g, sp, v = plan.vocab](const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets) {
      return vocab_parallel_loss_sum(h, w, targets, *g, sp, nn::kIgnoreIndex, v);
    };
  return plan;
}

at::Tensor vocab_parallel_loss_sum(const at::Tensor& hidden, const at::Tensor& w, const at::Tensor& targets,
                                   const Group& tp, bool sp, int64_t ignore_index, int64_t vocab) {
  if (sp) check_sequence(hidden.size(1) * tp.size(), tp.size());
  at::Tensor h = sp ? gather_rs(hidden, tp, 1) : copy_to(hidden, tp);
  if (h.size(0) != targets.size(0) || h.size(1) != targets.size(1))
    throw Error("tensor parallel: vocab_parallel_loss_sum: targets [" + std::to_string(targets.size(0)) + "," +
                std::to_string(targets.size(1)) + "] do not match the hidden states' batch and sequence");
  const int64_t vl = w.size(0), lo = vl * tp.rank();
  at::Tensor logits = at::linear(h, w).to(at::kFloat);  // [B,T,V/tp]: this rank's vocabulary slice
  if (vocab >= 0 && lo + vl > vocab)  // padding rows: no probability (their weights stay zero: no gradient)
    logits = logits.index_fill(-1, at::arange(std::max<int64_t>(0, vocab - lo), vl, targets.options()),
                               -std::numeric_limits<float>::infinity());
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

at::Tensor gather_full_logits(const at::Tensor& weight, const at::Tensor& hidden, const Group& tp, bool sp,
                              int64_t vocab) {
  at::Tensor h = sp ? gather(hidden, tp, 1) : hidden;
  at::Tensor full = gather(at::linear(h, weight), tp, -1 + h.dim());
  return vocab >= 0 && vocab < full.size(-1) ? full.narrow(-1, 0, vocab) : full;
}

void sync_sequence_parallel_grads(models::Model& m, const TensorParallelPlan& plan, const Group& tp) {
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

std::map<std::string, at::Tensor> gather_full(models::Model& m, const TensorParallelPlan& plan, const Group& tp) {
  std::map<std::string, at::Tensor> out;
  at::NoGradGuard ng;
  for (const auto& item : m.named_parameters(true)) {
    const int64_t dim = plan.dim_of(item.key());
    at::Tensor p = item.value().detach();
    out[item.key()] = dim >= 0 ? unshard(item.key(), p, plan, tp) : p.clone();
  }
  return out;
}

at::Tensor shard_of(const std::string& name, const at::Tensor& full_in, const TensorParallelPlan& plan, const Group& tp) {
  const int64_t dim = plan.dim_of(name);
  if (dim < 0) return full_in;
  at::Tensor full = full_in;
  if (auto it = plan.padded_rows.find(name); it != plan.padded_rows.end()) {
    if (full.size(0) != it->second)
      throw Error("tensor parallel: '" + name + "' has " + std::to_string(full.size(0)) + " rows, the vocabulary " +
                  std::to_string(it->second));
    full = at::constant_pad_nd(full, {0, 0, 0, plan.padded_vocab - it->second});  // zero rows at the end
  }
  if (full.size(dim) % tp.size() != 0)
    throw tp_error(std::to_string(tp.size()) + " does not divide dimension " + std::to_string(dim) + " (" +
                   std::to_string(full.size(dim)) + ") of '" + name + "'");
  if (auto it = plan.blocks.find(name); it != plan.blocks.end()) {  // this rank's chunk of every block, stacked
    std::vector<at::Tensor> mine;
    for (const at::Tensor& b : full.split_with_sizes(it->second, dim)) {
      if (b.size(dim) % tp.size() != 0)
        throw tp_error(std::to_string(tp.size()) + " does not divide a block of " + std::to_string(b.size(dim)) +
                       " along dimension " + std::to_string(dim) + " of '" + name + "'");
      mine.push_back(b.chunk(tp.size(), dim)[static_cast<size_t>(tp.rank())]);
    }
    return at::cat(mine, dim);
  }
  at::Tensor s = full.chunk(tp.size(), dim)[static_cast<size_t>(tp.rank())];
  return s.is_contiguous() ? s.clone() : s.contiguous();
}

at::Tensor unshard(const std::string& name, const at::Tensor& local, const TensorParallelPlan& plan, const Group& tp) {
  const int64_t dim = plan.dim_of(name);
  if (dim < 0 || tp.size() == 1) return local;
  if (auto it = plan.padded_rows.find(name); it != plan.padded_rows.end())
    return tp.all_gather(local.contiguous(), dim).narrow(0, 0, it->second).contiguous();
  if (auto it = plan.blocks.find(name); it != plan.blocks.end()) {
    std::vector<int64_t> local_sizes;
    for (int64_t b : it->second) local_sizes.push_back(b / tp.size());
    std::vector<at::Tensor> whole;
    for (const at::Tensor& b : local.split_with_sizes(local_sizes, dim)) whole.push_back(tp.all_gather(b.contiguous(), dim));
    return at::cat(whole, dim);
  }
  return tp.all_gather(local.contiguous(), dim);
}

}  // namespace lf::parallel
