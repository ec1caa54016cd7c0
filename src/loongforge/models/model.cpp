#include "loongforge/models/model.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "loongforge/core/error.h"
#include "loongforge/models/policy_io.h"
#include "loongforge/nn/recompute.h"

namespace lf::models {

// ---- Batch ----

Batch::Batch(std::initializer_list<std::pair<const std::string, at::Tensor>> fields) {
  for (const auto& [n, t] : fields)
    if (t.defined()) t_[n] = t;
}

const at::Tensor& Batch::at(const std::string& name) const {
  auto it = t_.find(name);
  if (it == t_.end()) throw Error("batch: no tensor '" + name + "'");
  return it->second;
}

at::Tensor Batch::get(const std::string& name) const {
  auto it = t_.find(name);
  return it == t_.end() ? at::Tensor() : it->second;
}

void Batch::set(const std::string& name, at::Tensor t) {
  if (t.defined()) t_[name] = std::move(t);
  else t_.erase(name);
}

int64_t Batch::num_rows() const {
  for (const auto& [k, t] : t_)
    if (!is_item_index(k) && !is_item_field(k)) return t.size(0);
  return 0;
}

void Batch::set_items(const std::string& name, at::Tensor items, at::Tensor row_of_item) {
  TORCH_CHECK(items.defined() && row_of_item.defined() && row_of_item.dim() == 1 &&
                  row_of_item.size(0) == items.size(0) && row_of_item.scalar_type() == at::kLong,
              "Batch::set_items(", name, "): ", name, ".row must be int64 [items]");
  t_[name] = std::move(items);
  t_[name + ".row"] = std::move(row_of_item);
}

Batch Batch::rows(int64_t first, int64_t n) const {
  Batch out;
  for (const auto& [k, t] : t_) {
    if (is_item_index(k)) continue;
    auto idx = t_.find(k + ".row");
    if (idx == t_.end()) {
      out.t_[k] = t.narrow(0, first, n);
      continue;
    }
    // items of rows [first, first + n): a contiguous range, the rows being non-decreasing
    const at::Tensor r = idx->second.cpu();
    const int64_t lo = at::searchsorted(r, at::scalar_tensor(first, at::kLong)).item<int64_t>();
    const int64_t hi = at::searchsorted(r, at::scalar_tensor(first + n, at::kLong)).item<int64_t>();
    out.t_[k] = t.narrow(0, lo, hi - lo);
    out.t_[k + ".row"] = idx->second.narrow(0, lo, hi - lo) - first;
  }
  return out;
}

Batch Batch::concat(const std::vector<Batch>& parts) {
  if (parts.size() == 1) return parts[0];
  Batch out;
  if (parts.empty()) return out;
  for (const auto& [k, t0] : parts[0].t_) {
    if (is_item_index(k)) continue;
    std::vector<at::Tensor> pieces, rows;
    int64_t offset = 0;
    for (const Batch& p : parts) {
      auto it = p.t_.find(k);
      if (it == p.t_.end()) throw Error("batch: field '" + k + "' missing from a batch to concatenate");
      pieces.push_back(it->second);
      if (parts[0].is_item_field(k)) rows.push_back(p.t_.at(k + ".row") + offset);
      offset += p.num_rows();
    }
    out.t_[k] = at::cat(pieces, 0);
    if (!rows.empty()) out.t_[k + ".row"] = at::cat(rows, 0);
  }
  return out;
}

Batch Batch::map(const std::function<at::Tensor(const std::string&, const at::Tensor&)>& f) const {
  Batch out;
  for (const auto& [k, t] : t_) out.set(k, f(k, t));
  return out;
}

// ---- Model ----

at::Tensor checkpoint_slice(const at::Tensor& t, const CheckpointTensor& e) {
  if (e.index < 0) return e.end > e.begin ? t.slice(0, e.begin, e.end) : t;  // rows of one tensor, or all of it
  return t.select(0, e.index).slice(0, e.begin, e.end);
}

Model::TrainWork Model::train_work() const {
  // train_flops_per_sample(s) = a s + b s^2: a per token, b per pair of positions
  const double s = 1024, f1 = train_flops_per_sample(1024), f2 = train_flops_per_sample(2048);
  TrainWork w;
  w.per_token_pair = std::max(0.0, (f2 - 2 * f1) / (2 * s * s));
  w.per_token = f1 / s - w.per_token_pair * s;
  return w;
}

std::vector<CheckpointTensor> Model::checkpoint_tensors() const {
  std::vector<CheckpointTensor> out;
  for (const auto& item : named_parameters()) out.push_back({item.key(), item.key()});
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> checkpoint_targets(Model& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  auto params = model.named_parameters(true);
  auto buffers = model.named_buffers(true);
  for (const auto& e : model.checkpoint_tensors()) {
    const at::Tensor& t = e.buffer ? buffers[e.param] : params[e.param];
    out.emplace_back(e.name, checkpoint_slice(t, e));
  }
  return out;
}

torch::nn::Module& Model::block(int64_t i) {
  const std::string name = split().blocks + "." + std::to_string(i);
  auto mods = named_modules("", /*include_self=*/false);
  auto* m = mods.find(name);
  if (!m) throw Error("model: no block '" + name + "'");
  return **m;
}

at::Tensor Model::run_blocks(const Batch& inputs, at::Tensor h, int64_t begin, int64_t end) {
  const bool grad = at::GradMode::is_enabled();
  std::vector<std::pair<int64_t, nn::MoEImpl*>> moe;  // looked up once, if any block is recomputed
  bool moe_known = false;
  for (int64_t i = begin; i < end; ++i) {
    if (!(recomputed(i) && grad)) {
      h = block_forward(inputs, h, i);
      continue;
    }
    if (!moe_known) {
      moe = moe_layers();
      moe_known = true;
    }
    std::function<at::Tensor()> extra;
    for (const auto& [idx, blk] : moe)
      if (idx == i) extra = [this, i]() { return layer_loss_fn ? layer_loss_fn(i) : at::Tensor(); };
    // block inputs with gradients of their own (conditions made by modules before the blocks) go through the
    // recomputation as side inputs, so their gradients reach those modules
    std::vector<std::string> names;
    std::vector<at::Tensor> side;
    for (const auto& [name, t] : inputs.tensors())
      if (t.defined() && t.requires_grad()) {
        names.push_back(name);
        side.push_back(t);
      }
    auto body = [this, inputs, names, i](const at::Tensor& x, const std::vector<at::Tensor>& s) {
      Batch in = inputs;
      for (size_t k = 0; k < names.size(); ++k) in.set(names[k], s[k]);
      return block_body(in, x, i);
    };
    h = block_after(inputs, nn::recompute(body, h, side, block(i).parameters(), std::move(extra)), i);
  }
  return h;
}

at::Tensor Model::forward_hidden(const Batch& b) {
  at::Tensor h = embed(b);
  const Batch inputs = block_inputs(b, h.scalar_type());
  return post_blocks(run_blocks(inputs, h, 0, num_blocks()));
}

std::pair<at::Tensor, int64_t> Model::loss(const Batch& b, double backward_scale, int64_t terms) {
  if (terms < 0) terms = loss_terms(b);
  at::Tensor l = head_loss_sum(forward_hidden(b), b);
  // MoE router losses of this forward (undefined for dense models and without gradients, so evaluation losses are
  // pure head losses). transformers adds coef * aux to each micro-batch's mean loss; here the sum is returned and the
  // engine divides by the step's terms, so aux is added times this micro-batch's terms: one micro-batch gives
  // exactly the mean loss + coef * aux, several weight each micro-batch's aux by its share of the step's terms.
  at::Tensor a = aux_loss();
  if (!a.defined()) return {l, terms};
  if (backward_scale > 0 && recomputed(0)) {
    // Recomputed blocks ran without a graph: each one's share goes back in its recomputation (nn/recompute.h).
    auto st = aux_stats([](at::Tensor&) {});
    const double w = static_cast<double>(terms) * backward_scale;
    layer_loss_fn = [this, st, w](int64_t i) {
      at::Tensor s = aux_share(st, i, i + 1);
      return s.defined() ? s * w : s;
    };
  }
  return {l + a.to(l.scalar_type()) * static_cast<double>(terms), terms};
}

std::vector<nn::MoEImpl*> Model::moe_blocks() const {
  std::vector<nn::MoEImpl*> out;
  for (const auto& [i, b] : moe_layers()) out.push_back(b);
  return out;
}

void Model::set_recompute(int64_t every_n_blocks) {
  recompute_every_ = every_n_blocks;
  for (const auto& [i, b] : moe_layers())
    if (recomputed(i)) b->force_stats = true;
}

at::Tensor Model::aux_loss() const {
  at::Tensor total;
  auto add = [&total](const at::Tensor& t) {
    if (t.defined()) total = total.defined() ? total + t : t;
  };
  std::vector<const nn::MoEImpl*> blocks;
  for (auto* b : moe_blocks()) {
    blocks.push_back(b);
    add(b->extra_loss);
  }
  at::Tensor lb = nn::load_balancing_loss(blocks);
  if (lb.defined()) add(router_aux_loss_coef_ * lb);
  return total;
}

namespace {
// The MoE blocks of blocks [begin, end) that hold router losses of the last forward.
std::vector<const nn::MoEImpl*> loss_blocks(const std::vector<std::pair<int64_t, nn::MoEImpl*>>& layers,
                                            int64_t begin, int64_t end) {
  std::vector<const nn::MoEImpl*> out;
  for (const auto& [i, b] : layers)
    if (i >= begin && i < end && (b->lb_prob_sum.defined() || b->extra_loss.defined())) out.push_back(b);
  return out;
}
}  // namespace

Model::AuxStats Model::aux_stats(const std::function<void(at::Tensor&)>& reduce, int64_t begin, int64_t end) const {
  if (end < 0) end = num_blocks();
  AuxStats st;
  auto blocks = loss_blocks(moe_layers(), begin, end);
  if (blocks.empty()) return st;
  const int64_t e = blocks.front()->options.num_experts;
  at::Tensor stats = at::zeros({e + 3}, at::kDouble);
  double rows = 0;
  for (const auto* b : blocks) {
    if (!b->lb_prob_sum.defined()) continue;
    stats.slice(0, 0, e).add_(b->lb_counts.to(at::kCPU, at::kDouble));  // (on a GPU: brought to the host)
    rows += static_cast<double>(b->lb_rows);
  }
  stats[e] = rows;
  stats[e + 1] = static_cast<double>(blocks.front()->tokens_seen);
  // context parallel: the cp ranks sharing the sequences count them once between them
  stats[e + 2] = static_cast<double>(blocks.front()->sequences_seen) / static_cast<double>(blocks.front()->sequence_parts);
  reduce(stats);
  st.any = true;
  st.counts = stats.slice(0, 0, e).clone();
  st.rows = stats[e].item<double>();
  st.tokens = stats[e + 1].item<double>();
  st.sequences = stats[e + 2].item<double>();
  return st;
}

at::Tensor Model::aux_share(const AuxStats& st, int64_t lo, int64_t hi, bool with_lb) const {
  if (hi < 0) hi = num_blocks();
  if (!st.any) return {};
  at::Tensor total;
  auto add = [&total](const at::Tensor& t) { total = total.defined() ? total + t : t; };
  for (const auto* b : loss_blocks(moe_layers(), lo, hi)) {
    if (with_lb && b->lb_prob_sum.defined()) add(lb_share(b->lb_prob_sum, st.counts, st.rows));
    // (under context parallelism seq_loss is already this rank's part of its sequences' loss)
    if (b->seq_loss.defined()) add(b->seq_loss * (static_cast<double>(b->sequences_seen) / st.sequences));
    if (b->z_loss.defined()) add(b->z_loss * (static_cast<double>(b->tokens_seen) / st.tokens));
  }
  return total;
}

at::Tensor Model::lb_prob_sum(int64_t begin, int64_t end) const {
  at::Tensor sum;
  for (const auto* b : loss_blocks(moe_layers(), begin, end))
    if (b->lb_prob_sum.defined()) sum = sum.defined() ? sum + b->lb_prob_sum : b->lb_prob_sum;
  return sum;
}

at::Tensor Model::lb_share(const at::Tensor& prob_sum, const at::Tensor& counts, double rows) const {
  at::Tensor c = counts.to(prob_sum.device(), prob_sum.scalar_type());
  return router_aux_loss_coef_ * static_cast<double>(prob_sum.size(0)) * (c / rows * (prob_sum / rows)).sum();
}

void Model::update_moe_bias() {
  for (auto* b : moe_blocks()) b->update_bias();
}

void Model::set_moe_training(double aux_loss_coef, double seq_aux_loss_coef, double z_loss_coef,
                             double bias_update_rate, double capacity_factor) {
  if (aux_loss_coef >= 0) router_aux_loss_coef_ = aux_loss_coef;
  for (auto* b : moe_blocks()) {
    const bool hash = b->options.hash_vocab > 0;  // a fixed token -> experts table (DeepSeek-V4): no bias to update
    if (bias_update_rate > 0 && !b->options.score_correction_bias && !hash)
      throw OptionError("bias_update_rate", "needs a router with a score correction bias (deepseek_v3)");
    b->options.aux_loss_coef = router_aux_loss_coef_;
    b->options.seq_aux_loss_coef = seq_aux_loss_coef;
    b->options.z_loss_coef = z_loss_coef;
    b->options.bias_update_rate = hash ? 0.0 : bias_update_rate;
    b->options.capacity_factor = capacity_factor;
  }
}

std::map<std::string, at::Tensor> Model::unconditional(const std::map<std::string, at::Tensor>&,
                                                     const std::string&) const {
  throw Error("the " + model_type() + " model has no unconditional input (classifier-free guidance)");
}

Policy* as_policy(Model& model) { return dynamic_cast<Policy*>(&model); }
const Policy* as_policy(const Model& model) { return dynamic_cast<const Policy*>(&model); }

}  // namespace lf::models
