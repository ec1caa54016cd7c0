#include "loongforge/models/llama/dsa.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "loongforge/core/error.h"
#include "loongforge/kernels/sparse_attention.h"
#include "loongforge/models/llama/mla.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/nn/rotary.h"

namespace lf::models::llama {

bool is_dsa_family(const std::string& model_type) {
  return model_type == "deepseek_v32" || model_type == "glm_moe_dsa";
}

namespace {

// GLM-5's per-layer indexer kinds when the file has no indexer_types: index_topk_pattern ("FSS..." or a list of
// "full" / "shared"), else "full" where max(i - offset + 1, 0) is a multiple of index_topk_freq (transformers'
// GlmMoeDsaConfig.__post_init__).
std::vector<int64_t> glm_indexer_layers(const JsonReader& rd, int64_t layers) {
  const std::string& file = rd.file();
  std::vector<int64_t> full(layers, 1);
  const auto kinds = [&](const nlohmann::json& list, const std::string& field) {
    if (!list.is_array() || static_cast<int64_t>(list.size()) != layers)
      throw file_error(file, field, "expected a list of num_hidden_layers strings");
    for (int64_t i = 0; i < layers; ++i) {
      const std::string t = list[i].is_string() ? list[i].get<std::string>() : "";
      if (t != "full" && t != "shared")
        throw file_error(file, field, "unsupported indexer type " + list[i].dump() + " (full, shared)");
      full[i] = t == "full";
    }
  };
  if (rd.has("indexer_types")) {
    kinds(rd.json().at("indexer_types"), "indexer_types");
  } else if (rd.has("index_topk_pattern")) {
    const nlohmann::json& p = rd.json().at("index_topk_pattern");
    if (p.is_string()) {
      const std::string s = p.get<std::string>();
      if (static_cast<int64_t>(s.size()) != layers || s.find_first_not_of("FS") != std::string::npos)
        throw file_error(file, "index_topk_pattern", "expected num_hidden_layers letters F (full) / S (shared), got \"" + s + "\"");
      for (int64_t i = 0; i < layers; ++i) full[i] = s[i] == 'F';
    } else {
      kinds(p, "index_topk_pattern");
    }
  } else {
    const int64_t freq = std::max<int64_t>(rd.integer("index_topk_freq", 1), 1);
    const int64_t offset = rd.integer("index_skip_topk_offset", 2);
    for (int64_t i = 0; i < layers; ++i) full[i] = std::max<int64_t>(i - offset + 1, 0) % freq == 0;
  }
  return full;
}

}  // namespace

void parse_dsa(const JsonReader& rd, DecoderConfig& c) {
  const std::string& file = rd.file();
  const bool glm = c.model_type == "glm_moe_dsa";
  const int64_t layers = c.num_hidden_layers;
  const auto str = [](int64_t v) { return std::to_string(v); };
  c.dsa = true;
  c.index_rope_interleave = glm;  // DeepSeek-V3.2's indexer rotates halves, GLM-5's interleaved pairs
  c.rope_interleave = true;       // the latent attention always rotates interleaved pairs (no rope_interleave field)
  if (c.q_lora_rank <= 0)
    throw file_error(file, "q_lora_rank", "must be a positive integer for " + c.model_type +
                                              " (its attention always has q_a_proj; the indexer reads its output), got null");
  if (!rd.has("max_position_embeddings")) c.max_position_embeddings = glm ? 202752 : 163840;
  if (!rd.has("rms_norm_eps")) c.rms_norm_eps = glm ? 1e-5 : 1e-6;
  c.index_topk = rd.integer("index_topk", 2048);
  c.index_head_dim = rd.integer("index_head_dim", 128);
  c.index_n_heads = rd.integer("index_n_heads", glm ? 32 : 64);
  for (auto [k, v] : {std::pair{"index_topk", c.index_topk}, {"index_head_dim", c.index_head_dim}, {"index_n_heads", c.index_n_heads}})
    if (v <= 0) throw file_error(file, k, "must be positive, got " + str(v));
  if (c.index_head_dim < c.qk_rope_head_dim)
    throw file_error(file, "index_head_dim", "must be at least qk_rope_head_dim = " + str(c.qk_rope_head_dim) +
                                                 " (the indexer rotates its first qk_rope_head_dim features), got " + str(c.index_head_dim));
  // mlp_layer_types (save_pretrained writes it) wins over first_k_dense_replace
  if (rd.has("mlp_layer_types")) {
    const nlohmann::json& lt = rd.json().at("mlp_layer_types");
    if (!lt.is_array() || static_cast<int64_t>(lt.size()) != layers)
      throw file_error(file, "mlp_layer_types", "expected a list of num_hidden_layers strings");
    for (int64_t i = 0; i < layers; ++i) {
      const std::string t = lt[i].is_string() ? lt[i].get<std::string>() : "";
      if (t != "dense" && t != "sparse")
        throw file_error(file, "mlp_layer_types", "unsupported MLP type " + lt[i].dump() + " (dense, sparse)");
      c.layer_moe[i] = t == "sparse";
    }
    if (std::find(c.layer_moe.begin(), c.layer_moe.end(), 1) != c.layer_moe.end() &&
        (c.num_experts <= 0 || c.moe_intermediate_size <= 0 || c.moe_n_group < 1 || c.num_experts % c.moe_n_group))
      throw file_error(file, "mlp_layer_types", "sparse layers need n_routed_experts, moe_intermediate_size and n_group "
                                                "valid as for first_k_dense_replace < num_hidden_layers");
  }
  c.layer_indexer.assign(layers, 1);
  if (glm) c.layer_indexer = glm_indexer_layers(rd, layers);
  if (layers > 0 && !c.layer_indexer[0])
    throw file_error(file, glm && rd.has("indexer_types") ? "indexer_types" : glm && rd.has("index_topk_pattern") ? "index_topk_pattern" : "index_skip_topk_offset",
                     "layer 0 is 'shared' but no layer before it runs an indexer");
}

bool dsa_shares_selection(const DecoderConfig& c) {
  return c.dsa && std::find(c.layer_indexer.begin(), c.layer_indexer.end(), 0) != c.layer_indexer.end();
}

int64_t dsa_num_parameters(const DecoderConfig& c) {
  if (!c.dsa) return 0;
  const int64_t d = c.hidden_size, hd = c.index_head_dim, h = c.index_n_heads;
  const int64_t one = c.q_lora_rank * h * hd + d * hd + 2 * hd + d * h;  // wq_b, wk, k_norm (weight, bias), weights_proj
  int64_t n = 0;
  for (int64_t full : c.layer_indexer) n += full ? one : 0;
  return n;
}

IndexerImpl::IndexerImpl(const DecoderConfig& c)
    : n_heads(c.index_n_heads), head_dim(c.index_head_dim), rope_dim(c.qk_rope_head_dim), topk(c.index_topk),
      interleave(c.index_rope_interleave) {
  wq_b = register_module("wq_b", nn::Linear(c.q_lora_rank, n_heads * head_dim, false));
  wk = register_module("wk", nn::Linear(c.hidden_size, head_dim, false));
  // transformers: nn.LayerNorm(index_head_dim, eps=1e-6), whatever rms_norm_eps
  k_norm = register_module("k_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({head_dim}).eps(1e-6)));
  weights_proj = register_module("weights_proj", nn::Linear(c.hidden_size, n_heads, false));
  // The language-model loss never reaches the indexer (the selection is not differentiable, and it runs without
  // autograd): kept frozen as a model keeps the parts its loss skips, so every engine leaves it out of the optimizer
  // and the gradient reductions, as torch.optim.AdamW leaves a parameter whose .grad is None (no weight decay).
  for (auto& p : parameters()) p.set_requires_grad(false);
}

at::Tensor IndexerImpl::rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
  at::Tensor rot = x.narrow(-1, 0, rope_dim), pass = x.narrow(-1, rope_dim, head_dim - rope_dim);
  rot = interleave ? apply_rotary_interleaved(rot, cos, sin) : nn::apply_rotary(rot, cos, sin);
  return at::cat({rot, pass}, -1);
}

at::Tensor IndexerImpl::raw_keys(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor k = k_norm->forward(wk->forward(x)).unsqueeze(1);  // [B,1,T,D]
  return rotate(k, cos, sin);
}

at::Tensor IndexerImpl::keys(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::NoGradGuard no_grad;
  return raw_keys(x, cos, sin);
}

at::Tensor IndexerImpl::scores(const at::Tensor& x, const at::Tensor& q_resid, const at::Tensor& cos,
                               const at::Tensor& sin, const at::Tensor& keys) {
  const int64_t b = q_resid.size(0), t = q_resid.size(1);
  const at::ScalarType wide = at::promote_types(x.scalar_type(), at::kFloat);
  at::Tensor q = wq_b->forward(q_resid).view({b, t, n_heads, head_dim}).transpose(1, 2);  // [B,H,T,D]
  q = rotate(q, cos, sin).transpose(1, 2).to(wide);                                      // [B,T,H,D]
  at::Tensor kt = keys.to(wide).transpose(-1, -2);                                       // [B,1,D,Tk]
  // [B,T,H,Tk] relu'd dot products, then summed over heads with the per-query head weights: [B,T,Tk]
  at::Tensor s = at::relu(at::matmul(q, kt) * (1.0 / std::sqrt(static_cast<double>(head_dim))));
  at::Tensor w = weights_proj->forward(x).to(wide) * (1.0 / std::sqrt(static_cast<double>(n_heads)));
  return at::matmul(w.unsqueeze(-2), s).squeeze(-2);
}

namespace {

// Keys a query may see: at or before its position (qpos [T]: the queries' positions; keys at 0 .. Tk-1), within its
// document (q_seg [B,T], k_seg [B,Tk]).
at::Tensor visible_keys(int64_t b, const at::Tensor& qpos, int64_t tk, const at::Tensor& q_seg, const at::Tensor& k_seg) {
  const int64_t t = qpos.size(0);
  at::Tensor visible = (at::arange(tk, qpos.options()).unsqueeze(0) <= qpos.unsqueeze(1)).unsqueeze(0);  // [1,T,Tk]
  if (q_seg.defined()) visible = visible & (q_seg.unsqueeze(2) == k_seg.unsqueeze(1));
  return visible.expand({b, t, tk});
}

// The queries' positions and the keys' documents: queries at offset .. offset+T-1 seeing the same documents, or
// (context parallelism) this rank's parts against the whole sequence.
std::pair<at::Tensor, at::Tensor> query_layout(int64_t t, int64_t offset, const at::Tensor& segment_ids,
                                               const nn::SequenceParts* parts, const at::TensorOptions& opts) {
  if (!parts) return {at::arange(offset, offset + t, opts.dtype(at::kLong)), segment_ids};
  at::Tensor k_seg;
  if (segment_ids.defined()) {  // gathered as float64 (exact for ids below 2^53)
    at::Tensor s = segment_ids.to(at::kDouble).unsqueeze(1).unsqueeze(-1);  // [B,1,Tl,1]
    k_seg = gather_parts(s, *parts).squeeze(-1).squeeze(1).to(at::kLong);
  }
  return {part_positions(*parts, t, opts), k_seg};
}

// The visible keys among the top-k index scores (all visible ones while a query sees no more than k).
at::Tensor top_keys(const at::Tensor& index, const at::Tensor& visible, int64_t topk) {
  const int64_t tk = index.size(-1), k = std::min(topk, tk);
  if (k >= tk) return visible.clone();
  at::Tensor masked = index.masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
  at::Tensor chosen = at::zeros(visible.sizes(), visible.options()).scatter_(-1, std::get<1>(masked.topk(k, -1)), true);
  return chosen & visible;
}

}  // namespace

at::Tensor IndexerImpl::select(const at::Tensor& x, const at::Tensor& q_resid, const at::Tensor& cos,
                               const at::Tensor& sin, const at::Tensor& keys, int64_t offset,
                               const at::Tensor& segment_ids, const nn::SequenceParts* parts) {
  at::NoGradGuard no_grad;
  const auto [qpos, k_seg] = query_layout(q_resid.size(1), offset, segment_ids, parts, x.options());
  at::Tensor visible = visible_keys(q_resid.size(0), qpos, keys.size(2), segment_ids, k_seg);
  if (dense_warmup) return visible.clone();  // the warm-up stage attends densely
  return top_keys(scores(x, q_resid, cos, sin, keys), visible, topk);
}

at::Tensor IndexerImpl::train_keep(const at::Tensor& x, const at::Tensor& q_resid, const at::Tensor& cos,
                                   const at::Tensor& sin, const at::Tensor& segment_ids,
                                   const nn::SequenceParts* parts) {
  // the indexer's own graph: its inputs detached, so the language-model loss and this one share no parameter
  const at::Tensor xd = x.detach(), qd = q_resid.detach();
  at::Tensor k = raw_keys(xd, cos, sin);
  if (parts) k = gather_parts(k, *parts);  // every rank's keys, their gradients summed back to their rank
  train_scores_ = scores(xd, qd, cos, sin, k);
  const auto [qpos, k_seg] = query_layout(q_resid.size(1), 0, segment_ids, parts, x.options());
  const at::Tensor visible = visible_keys(q_resid.size(0), qpos, k.size(2), segment_ids, k_seg);
  train_keep_ = dense_warmup ? visible.clone() : top_keys(train_scores_.detach(), visible, topk);
  return train_keep_;
}

void IndexerImpl::add_kl(const at::Tensor& target) {
  TORCH_CHECK(train_scores_.defined(), "indexer: add_kl without train_keep");
  const at::Tensor off = train_keep_.logical_not();
  // the target: the heads' mean attention distribution over the kept keys (sums to 1 per query)
  const at::Tensor p = target.detach().to(train_scores_.scalar_type());  // [B,T,Tk]
  const at::Tensor logq = at::log_softmax(train_scores_.masked_fill(off, -std::numeric_limits<double>::infinity()), -1);
  // sum p (log p - log q) over kept keys; p = 0 elsewhere (xlogy: 0 log 0 = 0)
  const at::Tensor kl = (at::xlogy(p, p) - p * logq.masked_fill(off, 0)).sum() * loss_coef;
  kl_ = kl_.defined() ? kl_ + kl : kl;
  train_scores_ = train_keep_ = at::Tensor();
}

at::Tensor IndexerImpl::take_kl() {
  at::Tensor k = kl_;
  kl_ = at::Tensor();
  return k;
}

at::Tensor gather_parts(const at::Tensor& x, const nn::SequenceParts& parts) {
  const int64_t b = x.size(0), h = x.size(1), p = static_cast<int64_t>(parts.local.size()), d = x.size(3);
  const int64_t c = x.size(2) / p;
  at::Tensor per = x.reshape({b, h, p, c, d}).permute({2, 0, 1, 3, 4}).contiguous();  // [P,B,H,c,D]
  return parts.gather(per).permute({1, 2, 0, 3, 4}).reshape({b, h, parts.total * c, d});
}

at::Tensor part_positions(const nn::SequenceParts& parts, int64_t local_len, const at::TensorOptions& opts) {
  const int64_t c = local_len / static_cast<int64_t>(parts.local.size());
  std::vector<at::Tensor> pos;
  for (int64_t i : parts.local) pos.push_back(at::arange(i * c, (i + 1) * c, opts.dtype(at::kLong)));
  return at::cat(pos);
}

at::Tensor sparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keep,
                            double scale, at::Tensor* probs) {
  // the fused kernel on the CPU: only the kept keys of each query (kernels/sparse_attention.h)
  if (!probs && kernels::sparse_attention_kernel_takes(q, k, v))
    return kernels::sparse_attention(q, k, v, kernels::keep_to_index(keep), scale);
  at::Tensor s = at::matmul(q, k.transpose(-1, -2)) * scale;  // [B,H,Tq,Tk]
  s = s.masked_fill(keep.logical_not().unsqueeze(1), -std::numeric_limits<double>::infinity());
  at::Tensor p = at::softmax(s, -1, at::promote_types(q.scalar_type(), at::kFloat));
  if (probs) *probs = p;
  return at::matmul(p.to(q.scalar_type()), v);
}

std::vector<IndexerImpl*> CausalLMImpl::indexers() const {
  std::vector<IndexerImpl*> out;
  if (!config_.dsa) return out;
  for (size_t i = 0; i < model->layers->size(); ++i) {
    MLAImpl* a = model->layers->ptr(i)->as<DecoderLayerImpl>()->mla.get();
    if (a && a->indexer) out.push_back(a->indexer.get());
  }
  return out;
}

std::string CausalLMImpl::set_indexer_training(double loss_coef, bool dense_warmup) {
  if (!(loss_coef >= 0) || !std::isfinite(loss_coef)) return "must be a number >= 0";
  if (loss_coef == 0 && !dense_warmup) return "";
  if (!config_.dsa) return "the " + config_.model_type + " model has no sparse-attention indexer";
  if (loss_coef == 0) return "the warm-up stage trains the indexers alone: it needs an indexer loss coefficient > 0";
  indexer_loss_coef_ = loss_coef;
  // the warm-up stage trains the indexers alone (every other parameter frozen: no optimizer touches it)
  if (dense_warmup)
    for (auto& p : parameters()) p.set_requires_grad(false);
  for (IndexerImpl* i : indexers()) {
    i->loss_coef = loss_coef;
    i->dense_warmup = dense_warmup;
    for (auto& p : i->parameters()) p.set_requires_grad(true);
  }
  return "";
}

void link_dsa_layers(torch::nn::ModuleList& layers, const DecoderConfig& c) {
  if (!c.dsa) return;
  std::shared_ptr<DsaSelection> last;
  for (size_t i = 0; i < layers->size(); ++i) {
    MLAImpl* a = layers->ptr(i)->as<DecoderLayerImpl>()->mla.get();
    if (!a) continue;
    if (a->indexer) last = a->selection;
    else a->selection = last;
  }
}

}  // namespace lf::models::llama
