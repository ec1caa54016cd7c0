#include "loongforge/models/llama/mtp.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "loongforge/core/error.h"
#include "loongforge/models/llama/deepseek_v4.h"
#include "loongforge/nn/loss.h"

namespace lf::models::llama {

namespace {
const std::string kMtpPrefix = "mtp.layers.";

// The first `n` positions of every layer of a key/value cache (the rest dropped: rejected drafts).
void crop_cache(nn::KVCache& cache, int64_t n) {
  for (size_t l = 0; l < cache.keys.size(); ++l) {
    if (!cache.keys[l].defined()) continue;
    if (n <= 0) {
      cache.keys[l] = at::Tensor();
      cache.values[l] = at::Tensor();
    } else if (cache.keys[l].size(2) > n) {
      cache.keys[l] = cache.keys[l].narrow(2, 0, n).contiguous();
      cache.values[l] = cache.values[l].narrow(2, 0, n).contiguous();
    }
  }
}

// One slot of a cache (MTP depth k's block is layer k of the MTP config).
void crop_slot(nn::KVCache& cache, size_t slot, int64_t n) {
  nn::KVCache one(1);
  one.keys[0] = cache.keys[slot];
  one.values[0] = cache.values[slot];
  crop_cache(one, n);
  cache.keys[slot] = one.keys[0];
  cache.values[slot] = one.values[0];
}
}  // namespace

int64_t mtp_layers_declared(const DecoderConfig& c) {
  const bool qwen = DecoderConfig::gated_deltanet_family(c.model_type);
  if (c.model_type != "deepseek_v3" && c.model_type != "glm4_moe" && !qwen) return 0;
  // Qwen3-Next / Qwen3.5: mtp_num_hidden_layers (transformers has no such field: absent = none)
  const char* field = qwen ? "mtp_num_hidden_layers" : "num_nextn_predict_layers";
  if (!c.raw.contains(field) || c.raw.at(field).is_null()) return qwen ? 0 : 1;  // DeepseekV3Config / Glm4MoeConfig: 1
  const auto& v = c.raw.at(field);
  if (!v.is_number_integer() || v.get<int64_t>() < 0)
    throw file_error("config.json", field, "expected an integer >= 0, got " + v.dump());
  if (qwen && v.get<int64_t>() > 1)  // one fc / norm pair shared by every depth (vLLM's Qwen3NextMultiTokenPredictor)
    throw file_error("config.json", field, "only 1 multi-token prediction layer is supported, got " + v.dump());
  return v.get<int64_t>();
}

DecoderConfig mtp_block_config(const DecoderConfig& c) {
  nlohmann::json j = c.raw;
  const int64_t k = mtp_layers_declared(c);
  j["num_hidden_layers"] = k;
  if (DecoderConfig::gated_deltanet_family(c.model_type)) {  // gated full attention, the main model's MLP kind
    j["layer_types"] = std::vector<std::string>(static_cast<size_t>(k), "full_attention");
    j["mlp_only_layers"] = nlohmann::json::array();
  } else {
    j["first_k_dense_replace"] = 0;  // MTP blocks are MoE blocks whatever the main model's dense layers
  }
  return DecoderConfig::from_json(j, "config.json (its multi-token prediction layers)");
}

MtpLayerImpl::MtpLayerImpl(const DecoderConfig& bc, int64_t depth) {
  const int64_t h = bc.hidden_size;
  enorm = register_module("enorm", nn::RMSNorm(h, bc.rms_norm_eps));
  hnorm = register_module("hnorm", nn::RMSNorm(h, bc.rms_norm_eps));
  eh_proj = register_module("eh_proj", nn::Linear(2 * h, h, false));
  mtp_block = register_module("mtp_block", DecoderLayer(bc, depth));
  post_norm = register_module("post_norm", nn::RMSNorm(h, bc.rms_norm_eps));
}

MtpImpl::MtpImpl(const DecoderConfig& main) : block_config(mtp_block_config(main)) {
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t k = 0; k < block_config.num_hidden_layers; ++k) layers->push_back(MtpLayer(block_config, k));
}

std::string mtp_checkpoint_name(const std::string& name, const DecoderConfig& c) {
  if (!name.starts_with(kMtpPrefix)) return name;
  const size_t dot = name.find('.', kMtpPrefix.size());
  const std::string depth = name.substr(kMtpPrefix.size(), dot - kMtpPrefix.size());
  std::string rest = name.substr(dot + 1);
  if (DecoderConfig::gated_deltanet_family(c.model_type)) {  // Qwen3-Next: mtp.{fc, pre_fc_norm_*, norm, layers.k.*}
    for (auto [from, to] : {std::pair{"enorm.", "pre_fc_norm_embedding."}, {"hnorm.", "pre_fc_norm_hidden."},
                            {"eh_proj.", "fc."}, {"post_norm.", "norm."}})
      if (rest.starts_with(from)) return "mtp." + (to + rest.substr(std::string(from).size()));
    return kMtpPrefix + depth + "." + rest.substr(std::string("mtp_block.").size());
  }
  if (rest.starts_with("mtp_block.")) rest = rest.substr(10);
  else if (rest.starts_with("post_norm.")) rest = "shared_head.norm." + rest.substr(10);
  return "model.layers." + std::to_string(c.num_hidden_layers + std::stoll(depth)) + "." + rest;
}

bool mtp_shared_copy(const std::string& name, const DecoderConfig& c) {
  const int64_t depths = mtp_layers_declared(c);
  for (int64_t k = 0; k < depths; ++k) {
    const std::string p = "model.layers." + std::to_string(c.num_hidden_layers + k) + ".";
    if (name == p + "embed_tokens.weight" || name == p + "shared_head.head.weight") return true;
  }
  return false;
}

at::Tensor CausalLMImpl::mtp_forward(int64_t k, const at::Tensor& prev, const at::Tensor& ids,
                                     const at::Tensor& position_ids, nn::KVCache* cache, const at::Tensor& segment_ids) {
  MtpLayerImpl& l = mtp_->layer(k);
  const at::Tensor e = embed(ids);
  const bool zc = config_.zero_centered_norm;  // Qwen3-Next's (1 + weight) norms
  at::Tensor x = l.eh_proj->forward(
      at::cat({apply_norm(l.enorm, e, zc), apply_norm(l.hnorm, prev.to(e.scalar_type()), zc)}, -1));
  auto [cos, sin] = rotary(position_ids, x.scalar_type());
  x = l.mtp_block->forward(x, cos, sin, cache, segment_ids);
  return apply_norm(l.post_norm, x, zc);
}

std::string CausalLMImpl::canonical_checkpoint_name(const std::string& stored) const {
  if (config_.deepseek_v4) return v4_canonical_name(stored);  // DeepSeek's own names (deepseek_v4.h)
  if (!mtp_ || !stored.starts_with("model.layers.")) return stored;
  for (const char* stem : {".experts.gate_up_proj", ".experts.down_proj"}) {
    if (!stored.ends_with(stem)) continue;
    for (int64_t k = 0; k < mtp_->depths(); ++k) {
      const std::string p = "model.layers." + std::to_string(config_.num_hidden_layers + k) + ".";
      if (stored.starts_with(p)) return kMtpPrefix + std::to_string(k) + ".mtp_block." + stored.substr(p.size());
    }
  }
  return stored;
}

void CausalLMImpl::drop_absent_parts(const std::set<std::string>& stored) {
  if (!mtp_) return;
  for (const auto& n : stored) {
    if (mtp_shared_copy(n, config_)) continue;
    if (n.starts_with(kMtpPrefix)) return;  // kept (stacked experts, canonical_checkpoint_name)
    for (int64_t k = 0; k < mtp_->depths(); ++k)
      if (n.starts_with("model.layers." + std::to_string(config_.num_hidden_layers + k) + ".")) return;  // kept
  }
  unregister_module("mtp");
  mtp_.reset();
}

std::string CausalLMImpl::set_mtp_loss_weight(double weight) {
  if (!(weight >= 0) || !std::isfinite(weight)) return "must be a number >= 0";
  if (weight > 0 && !mtp_) {
    const int64_t k = mtp_layers_declared(config_);
    const bool qwen = DecoderConfig::gated_deltanet_family(config_.model_type);
    const char* field = qwen ? "mtp_num_hidden_layers" : "num_nextn_predict_layers";
    if (k == 0)
      return "the " + config_.model_type + " config declares no multi-token prediction layers" +
             (config_.raw.contains(field) ? std::string(" (") + field + " = 0)" : qwen ? " (no mtp_num_hidden_layers)" : "");
    return "the checkpoint lacks the model's " + std::to_string(k) + " multi-token prediction layer(s) (" +
           (qwen ? std::string("mtp.*") : "model.layers." + std::to_string(config_.num_hidden_layers) + ".*") + " absent)";
  }
  mtp_loss_weight_ = weight;
  if (mtp_)  // untrained MTP layers stay as loaded (frozen: the optimizer leaves them out)
    for (auto& p : mtp_->parameters()) p.set_requires_grad(weight > 0);
  return "";
}

std::vector<std::pair<std::string, double>> CausalLMImpl::take_loss_parts() {
  std::vector<std::pair<std::string, double>> parts;
  if (mtp_loss_weight_ > 0) parts.emplace_back("mtp_loss", mtp_loss_sum_);
  if (indexer_loss_coef_ > 0) parts.emplace_back("indexer_kl", indexer_loss_sum_);  // the layers' mean, unweighted
  mtp_loss_sum_ = indexer_loss_sum_ = 0;
  return parts;
}

at::Tensor CausalLMImpl::head_loss_sum(const at::Tensor& hidden, const Batch& b) {
  at::Tensor loss = main_head_loss_sum(hidden, b);
  // Training forwards only: validation and `dump` report the main model's loss.
  if (!at::GradMode::is_enabled()) return loss;
  // DeepSeek sparse attention's indexer KL terms of this forward (dsa.h)
  if (at::Tensor kl = take_indexer_kl(); kl.defined()) loss = loss + kl.to(loss.scalar_type());
  if (mtp_loss_weight_ == 0 || !mtp_) return loss;
  return loss + mtp_loss_part(hidden, b);
}

at::Tensor CausalLMImpl::take_indexer_kl() {
  at::Tensor sum;
  const std::vector<IndexerImpl*> idx = indexers();
  for (IndexerImpl* i : idx)
    if (at::Tensor kl = i->take_kl(); kl.defined()) sum = sum.defined() ? sum + kl : kl;
  if (sum.defined() && indexer_loss_coef_ > 0)
    indexer_loss_sum_ += sum.detach().item<double>() / (indexer_loss_coef_ * static_cast<double>(idx.size()));
  return sum;
}

at::Tensor CausalLMImpl::mtp_loss_part(const at::Tensor& hidden, const Batch& b) {
  const at::Tensor& ids = b.at("input_ids");
  const at::Tensor& targets = b.at("targets");
  const at::Tensor seg = b.get("segment_ids");
  at::Tensor pos = b.get("position_ids");
  const int64_t t = ids.size(1), depths = mtp_->depths();
  if (!pos.defined()) pos = at::arange(t, ids.options().dtype(at::kLong)).unsqueeze(0).expand({ids.size(0), t});
  at::Tensor sum = at::zeros({}, hidden.options().dtype(at::promote_types(hidden.scalar_type(), at::kFloat)));
  at::Tensor prev = hidden;
  for (int64_t k = 0; k < depths && t - k - 1 > 0; ++k) {
    const int64_t n = t - k - 1;  // depth k at position i reads token i+k+1 and predicts token i+k+2 (targets[i+k+1])
    const at::Tensor own_seg = seg.defined() ? seg.narrow(1, 0, n) : at::Tensor();
    prev = mtp_forward(k, prev.narrow(1, 0, n), ids.narrow(1, k + 1, n), pos.narrow(1, k + 1, n), nullptr, own_seg);
    at::Tensor tk = targets.narrow(1, k + 1, n).contiguous();
    if (seg.defined()) tk = tk.masked_fill(own_seg != seg.narrow(1, k + 1, n), nn::kIgnoreIndex);  // no cross-document
    sum = sum + main_head_loss_sum(prev, Batch{{"targets", tk}});
  }
  mtp_loss_sum_ += sum.detach().item<double>() / static_cast<double>(depths);
  return sum * (mtp_loss_weight_ / static_cast<double>(depths));
}

void add_mtp_outputs(CausalLMImpl& model, const at::Tensor& ids, std::vector<std::pair<std::string, at::Tensor>>& out) {
  if (!model.mtp()) return;
  const int64_t t = ids.size(1);
  at::Tensor prev = model.hidden_states(ids);
  const at::Tensor pos = at::arange(t, ids.options().dtype(at::kLong)).unsqueeze(0).expand({ids.size(0), t});
  for (int64_t k = 0; k < model.mtp()->depths() && t - k - 1 > 0; ++k) {
    const int64_t n = t - k - 1;
    prev = model.mtp_forward(k, prev.narrow(1, 0, n), ids.narrow(1, k + 1, n), pos.narrow(1, k + 1, n));
    out.emplace_back("mtp_logits." + std::to_string(k), model.logits(prev));
  }
}

std::vector<int64_t> generate_with_mtp(CausalLMImpl& model, const std::vector<int64_t>& prompt,
                                       const GenerateOptions& opts, const std::function<void(int64_t)>& on_token) {
  MtpImpl* mtp = model.mtp();
  if (!mtp)
    throw Error("generate --mtp: the model has no multi-token prediction layers (config num_nextn_predict_layers or "
                "mtp_num_hidden_layers, and their weights in the folder)");
  if (opts.temperature > 0) throw Error("generate --mtp: speculative decoding is greedy only (--temperature 0)");
  // Linear-attention layers (Qwen3-Next) keep a recurrent state that cannot be cut back to the accepted drafts: the
  // cache before verification is kept (its tensors are replaced, never written in place) and, when a draft is
  // rejected, the main model runs the accepted tokens again from it.
  const auto& lin = model.config().layer_linear;
  const bool recurrent = std::find(lin.begin(), lin.end(), 1) != lin.end();
  at::NoGradGuard no_grad;
  DraftStats local;
  DraftStats& stats = opts.draft_stats ? *opts.draft_stats : local;
  const auto device = model.output_weight().device();
  const auto lopt = at::TensorOptions().dtype(at::kLong).device(device);
  const int64_t depths = mtp->depths();
  nn::KVCache main = model.new_cache(), draft(static_cast<size_t>(depths));
  std::vector<at::Tensor> hid(static_cast<size_t>(depths));  // depth k's outputs at positions [0, done[k])
  std::vector<int64_t> done(static_cast<size_t>(depths), 0);
  std::vector<int64_t> seq = prompt, out;
  auto ids_tensor = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).unsqueeze(0).to(device); };
  auto positions = [&](int64_t lo, int64_t n) { return at::arange(lo, lo + n, lopt).unsqueeze(0); };
  auto argmax = [&](const at::Tensor& h) { return model.logits(h).argmax(-1).to(at::kCPU); };
  // Emits a token; true when generation ends with it.
  auto emit = [&](int64_t id) {
    out.push_back(id);
    seq.push_back(id);
    if (on_token) on_token(id);
    return static_cast<int64_t>(out.size()) >= opts.max_new_tokens ||
           std::find(opts.stop_ids.begin(), opts.stop_ids.end(), id) != opts.stop_ids.end();
  };
  if (opts.max_new_tokens <= 0 || prompt.empty()) return out;
  at::Tensor main_h = model.hidden_states(ids_tensor(prompt), {}, &main);  // positions [0, n) of the main model
  ++stats.main_forwards;
  if (emit(argmax(main_h.select(1, main_h.size(1) - 1)).item<int64_t>())) return out;
  for (;;) {
    const int64_t n = static_cast<int64_t>(seq.size()) - 1;  // seq[n]: the main model's latest token, not yet run
    std::vector<int64_t> drafts;
    for (int64_t k = 0; k < depths; ++k) {
      const size_t ks = static_cast<size_t>(k);
      const int64_t lo = done[ks], cnt = n - lo;
      // position i reads token i+k+1: a verified one up to seq[n], drafts after
      std::vector<int64_t> ids;
      for (int64_t i = lo; i < n; ++i) {
        const int64_t idx = i + k + 1;
        ids.push_back(idx <= n ? seq[static_cast<size_t>(idx)] : drafts[static_cast<size_t>(idx - n - 1)]);
      }
      const at::Tensor prev = (k == 0 ? main_h : hid[ks - 1]).narrow(1, lo, cnt);
      at::Tensor y = model.mtp_forward(k, prev, ids_tensor(ids), positions(lo + k + 1, cnt), &draft);
      hid[ks] = lo > 0 ? at::cat({hid[ks].narrow(1, 0, lo), y}, 1) : y;
      drafts.push_back(argmax(y.select(1, cnt - 1)).item<int64_t>());
    }
    // Keep what only verified tokens went into: depth k at positions < n - k.
    for (int64_t k = 0; k < depths; ++k) {
      const size_t ks = static_cast<size_t>(k);
      done[ks] = std::max<int64_t>(0, n - k);
      crop_slot(draft, ks, done[ks]);
      hid[ks] = done[ks] > 0 ? hid[ks].narrow(1, 0, done[ks]) : at::Tensor();
    }
    std::vector<int64_t> cand = {seq[static_cast<size_t>(n)]};
    cand.insert(cand.end(), drafts.begin(), drafts.end());
    const nn::KVCache before = main;
    const at::Tensor vh = model.hidden_states(ids_tensor(cand), positions(n, depths + 1), &main);
    ++stats.main_forwards;
    const at::Tensor greedy = argmax(vh).squeeze(0);
    int64_t a = 0;
    while (a < depths && drafts[static_cast<size_t>(a)] == greedy[a].item<int64_t>()) ++a;
    stats.drafted += depths;
    stats.accepted += a;
    for (int64_t j = 0; j < a; ++j)
      if (emit(drafts[static_cast<size_t>(j)])) return out;
    if (emit(greedy[a].item<int64_t>())) return out;
    if (!recurrent) {
      crop_cache(main, n + a + 1);  // the main model has run seq[0 .. n+a]
    } else if (a < depths) {        // the state after seq[0 .. n+a]: the accepted tokens again from the kept cache
      main = before;
      model.hidden_states(ids_tensor(std::vector<int64_t>(cand.begin(), cand.begin() + a + 1)), positions(n, a + 1), &main);
      ++stats.main_forwards;
    }
    main_h = at::cat({main_h, vh.narrow(1, 0, a + 1)}, 1);
  }
}

}  // namespace lf::models::llama
