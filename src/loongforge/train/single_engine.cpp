#include "loongforge/train/single_engine.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>

#include <cstdio>
#include <optional>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/kernels/cuda_graph.h"
#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/nn/attention.h"
#include "loongforge/optim/adamw.h"
#include "loongforge/parallel/thread_split.h"
#include "loongforge/train/checkpoint.h"

namespace lf::train {
using nlohmann::json;

namespace {

using Built = ModelBundle;

// train.cuda_graphs on a model whose step cannot be captured: one line naming the field.
void check_graphable(const models::Model& model) {
  const std::string why = model.cuda_graph_blocker();
  if (!why.empty()) throw Error("recipe: field 'train.cuda_graphs': " + why + "; set it to false");
}

// Packed documents on the GPU in bf16 (eager steps): while this lives every attention layer runs
// nn::document_attention with the micro-batch's document ranges, i.e. flash attention's varlen kernels instead of
// SDPA with a [B,1,T,T] mask (which takes the memory-efficient backend). Forward and backward (recomputation too)
// run inside its scope.
class DocumentAttention {
 public:
  DocumentAttention(models::Model& model, const at::Tensor& segment_ids, const at::Device& device) {
    auto [cu, longest] = nn::document_ranges(segment_ids);
    const at::Tensor cu_dev = cu.pin_memory().to(device, /*non_blocking=*/true);
    for (nn::AttentionHook* a : model.attention_modules()) {
      if (a->attention_fn) continue;
      a->attention_fn = [cu_dev, longest = longest](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     int64_t q_offset, int64_t window, double scale,
                                                     const at::Tensor& seg) {
        return nn::document_attention(q, k, v, q_offset, window, scale, seg, cu_dev, longest);
      };
      hooked_.push_back(a);
    }
  }
  ~DocumentAttention() {
    for (auto* a : hooked_) a->attention_fn = nullptr;
  }
  DocumentAttention(const DocumentAttention&) = delete;
  DocumentAttention& operator=(const DocumentAttention&) = delete;

 private:
  std::vector<nn::AttentionHook*> hooked_;
};


// One process, no layout: the model, AdamW and checkpoints as HF folders. On CUDA the model (fp32 masters) and the
// optimizer state live on the GPU, batches are copied from pinned memory without blocking, bf16/fp8 run under CUDA
// autocast, AdamW and the grad norm are the multi-tensor kernels (optim/adamw.cpp picks them for CUDA params).
class SingleEngine : public Engine {
 public:
  // cuda_graphs (train.cuda_graphs, on a CUDA device): the forward + backward of a micro-batch is captured in a CUDA
  // graph after kGraphWarmup eager steps and replayed for every later micro-batch of the captured shape.
  SingleEngine(const EngineOptions& o, Built b, at::Device device)
      : stream_(o.cuda_graphs && device.is_cuda() ? std::make_unique<kernels::cuda::StreamScope>() : nullptr),
        b_(std::move(b)),
        device_(device),
        opt_(on_device(b_, device), o.adamw, b_.weight_decay),
        split_(o.cpu_split) {
    if (!b_.lr_scale.empty()) opt_.set_lr_scale(b_.lr_scale);
    if (o.ema.decay > 0) opt_.enable_ema(o.ema);
    splittable_ = b_.model->moe_blocks().empty() && !b_.model->recomputed(0) && !o.random_adapters &&
                  b_.model->thread_split_safe();
    if (stream_) check_graphable(*b_.model);
  }
  double forward_backward(const std::vector<Batch>& micro, int64_t counted, bool bf16) override {
    auto& model = *b_.model;
    if (device_.is_cuda()) return forward_backward_cuda(micro, counted, bf16);
    const double denom = static_cast<double>(std::max<int64_t>(1, counted)), scale = 1.0 / denom;
    double loss_sum = 0;
    for (const Batch& mbatch : micro) {
      Bf16Autocast autocast(at::kCPU, bf16);
      const int64_t parts = cpu_parts(mbatch.num_rows());
      if (parts > 1) {  // rows split over the CPU threads (parallel/thread_split.h)
        std::vector<double> losses(static_cast<size_t>(parts));
        parallel::split_backward(parts, b_.trainable.params, [&](int64_t i) {
          const int64_t rows = mbatch.num_rows(), lo = rows * i / parts, hi = rows * (i + 1) / parts;
          at::Tensor l = model.loss(mbatch.rows(lo, hi - lo), scale).first;
          losses[static_cast<size_t>(i)] = l.item<double>();
          return l / denom;
        });
        for (double l : losses) loss_sum += l;
      } else {
        at::Tensor l = model.loss(mbatch, scale).first;
        (l / denom).backward();
        loss_sum += l.item<double>();
      }
    }
    return loss_sum;
  }
  std::vector<std::pair<std::string, double>> loss_parts() override { return b_.model->take_loss_parts(); }
  double clip_grad_norm(double max_norm) override {
    // The clipping coefficient is applied inside AdamW's pass over the gradients (optim/adamw.h).
    auto [norm, coef] = optim::grad_norm_and_clip_coef(b_.trainable.params, max_norm);
    clip_coef_ = coef;
    return norm;
  }
  void step(double lr) override {
    opt_.step(lr, clip_coef_);
    clip_coef_ = 1.0;
    b_.model->update_moe_bias();  // aux-loss-free MoE routing (a no-op unless moe.bias_update_rate > 0)
  }
  // With CUDA graphs the gradients keep their storage: the graph accumulates into the addresses it captured.
  void zero_grad() override { opt_.zero_grad(/*set_to_none=*/!stream_); }
  std::pair<double, int64_t> eval_loss(const Batch& b_in) override {
    at::NoGradGuard no_grad;
    auto& model = *b_.model;
    bool was_training = model.is_training();
    model.eval();
    const Batch b = device_.is_cuda() ? to_device(b_in) : b_in;
    auto [l, c] = model.loss(b);
    if (was_training) model.train();
    return {l.item<double>(), c};
  }
  std::string save(const std::string& root, int64_t step, const json& st, const std::string& tokenizer, int keep) override {
    return save_checkpoint(root, step, *b_.model, b_.trainable, opt_, st, tokenizer, keep);
  }
  json load(const std::string& dir) override { return load_checkpoint(dir, *b_.model, b_.trainable, opt_); }
  bool with_whole_model(bool average, const std::function<void(models::Model&)>& fn) override {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> kept;
    if (average && opt_.has_ema())
      for (size_t i = 0; i < opt_.params().size(); ++i) {
        kept.push_back(opt_.params()[i].detach().clone());
        opt_.params()[i].detach().copy_(opt_.ema()[i]);
      }
    try {
      fn(*b_.model);
    } catch (...) {
      for (size_t i = 0; i < kept.size(); ++i) opt_.params()[i].detach().copy_(kept[i]);
      throw;
    }
    for (size_t i = 0; i < kept.size(); ++i) opt_.params()[i].detach().copy_(kept[i]);
    return true;
  }

 private:
  // Moves the model to the device before the optimizer allocates its state there (Module::to keeps the parameter
  // tensors, so b.trainable.params stay valid). Returns the optimizer's parameters.
  static std::vector<at::Tensor> on_device(Built& b, at::Device device) {
    if (device.is_cuda()) b.model->to(device);
    return b.trainable.params;
  }
  // Host -> device from pinned memory, non_blocking: the copy is queued on the stream and the host goes on.
  Batch to_device(const Batch& b) const { return batch_to_device(b, device_); }
  // The forward and backward of one micro-batch on the GPU: the token-loss sum l (float32 scalar) of the batch, with
  // the gradients of l / divisor accumulated (divisor: the step's counted tokens, a float32 scalar on the device, so
  // a CUDA graph reads it from its address). Queues work only: nothing waits for the device.
  // counted: the micro-batch's counted tokens (MoE router losses are weighted by it), backward_scale: 1 / the step's.
  at::Tensor micro_step_cuda(const Batch& mbatch, int64_t counted, double backward_scale, const at::Tensor& divisor,
                             bool bf16) {
    auto& model = *b_.model;
    at::Tensor l;
    {  // bf16 (fp8: the Linear layers' matmul_fn) with fp32 master weights; the backward runs outside autocast
      Bf16Autocast autocast(at::kCUDA, bf16);
      l = model.loss(mbatch, backward_scale, counted).first;
    }
    (l / divisor).backward();
    return l.detach();
  }
  double forward_backward_cuda(const std::vector<Batch>& micro, int64_t counted, bool bf16) {
    const at::TensorOptions f32 = at::TensorOptions().device(device_).dtype(at::kFloat);
    const double denom = static_cast<double>(std::max<int64_t>(1, counted));
    at::Tensor loss_sum = at::zeros({}, at::TensorOptions().device(device_).dtype(at::kDouble));
    const bool graphed = stream_ && (graph_ || eager_steps_ >= kGraphWarmup);
    if (!graphed) ++eager_steps_;
    // Every micro-batch's copy is queued up front: micro-batch i+1 travels while i computes.
    std::vector<Batch> dev;
    if (!graphed)
      for (const Batch& m : micro) dev.push_back(to_device(m));
    at::Tensor divisor = graphed ? at::Tensor() : at::full({}, denom, f32);
    for (size_t i = 0; i < micro.size(); ++i) {
      if (!graphed) {
        std::optional<DocumentAttention> docs;  // (a captured step keeps the mask: the ranges change every batch)
        if (bf16 && !stream_ && micro[i].has("segment_ids")) docs.emplace(*b_.model, micro[i].at("segment_ids"), device_);
        loss_sum += micro_step_cuda(dev[i], b_.model->loss_terms(micro[i]), 1.0 / denom, divisor, bf16).to(at::kDouble);
        continue;
      }
      if (!graph_) capture_step(micro[i], bf16);
      if (!graph_->fits(micro[i])) {  // another shape (e.g. a shorter last batch): this micro-batch runs eagerly
        if (!shape_noted_) {
          std::fprintf(stderr, "loongforge: train.cuda_graphs: a micro-batch of shape [%lld, %lld] differs from the "
                       "captured one; such micro-batches run without the graph\n",
                       (long long)micro[i].num_rows(), (long long)micro[i].tensors().begin()->second.size(1));
          shape_noted_ = true;
        }
        loss_sum += micro_step_cuda(to_device(micro[i]), b_.model->loss_terms(micro[i]), 1.0 / denom, at::full({}, denom, f32), bf16)
                        .to(at::kDouble);
        continue;
      }
      graph_->load(micro[i], denom);
      graph_->graph.replay();
      loss_sum += graph_->loss.to(at::kDouble);
    }
    return loss_sum.item<double>();  // the one host sync of the forward/backward
  }

  // train.cuda_graphs: the captured micro-step with its static inputs (copied into before every replay) and output.
  struct GraphedStep {
    kernels::cuda::Graph graph;
    Batch in;            // device tensors the graph reads
    at::Tensor divisor;  // float32 scalar: the step's counted tokens
    at::Tensor loss;     // float32 scalar the graph writes: the micro-batch's token-loss sum
    bool fits(const Batch& b) const {
      if (b.tensors().size() != in.tensors().size()) return false;
      for (const auto& [n, t] : b.tensors()) {
        const at::Tensor s = in.get(n);
        if (!s.defined() || t.sizes() != s.sizes() || t.dtype() != s.dtype()) return false;
      }
      return true;
    }
    // Host -> static inputs from pinned memory, queued on the stream before the replay that reads them.
    void load(const Batch& b, double denom) {
      for (const auto& [n, src] : b.tensors())
        in.at(n).copy_(src.is_cuda() ? src : src.pin_memory(), /*non_blocking=*/true);
      divisor.fill_(denom);
    }
  };
  static constexpr int64_t kGraphWarmup = 2;  // eager steps before the capture (cuBLAS, autograd, allocator warm)
  void capture_step(const Batch& first, bool bf16) {
    auto g = std::make_unique<GraphedStep>();
    g->in = first.map([&](const std::string&, const at::Tensor& t) { return at::empty(t.sizes(), t.options().device(device_)); });
    g->divisor = at::ones({}, at::TensorOptions().device(device_).dtype(at::kFloat));
    // The capture records the kernels without running them; the inputs are loaded before each replay.
    GraphedStep* gp = g.get();
    try {
      // Dense models only (check_graphable): the counts and scale for MoE router losses are unused.
      g->graph.capture([&] { gp->loss = micro_step_cuda(gp->in, 0, 0.0, gp->divisor, bf16); });
    } catch (const std::runtime_error& e) {
      throw Error(std::string("recipe: field 'train.cuda_graphs': ") + e.what() + " (set it to false)");
    }
    graph_ = std::move(g);
  }
  // How many parts a micro-batch of `rows` rows splits into over the CPU threads: train.cpu_split (0: one per
  // thread), at most one row each; 1 (no split) on a GPU and for models that keep state across a forward (MoE
  // statistics, activation recomputation's reentrant backward) or draw random numbers (LoRA dropout).
  int64_t cpu_parts(int64_t rows) const {
    if (device_.is_cuda() || !splittable_) return 1;
    const int64_t want = split_ > 0 ? split_ : at::get_num_threads();
    return std::max<int64_t>(1, std::min(want, rows));
  }

  std::unique_ptr<kernels::cuda::StreamScope> stream_;  // set with CUDA graphs: all of the engine's GPU work runs here
  Built b_;
  at::Device device_;
  optim::AdamW opt_;
  int64_t split_ = 0;
  bool splittable_ = true;
  double clip_coef_ = 1.0;  // from clip_grad_norm, applied by the next step
  std::unique_ptr<GraphedStep> graph_;
  int64_t eager_steps_ = 0;
  bool shape_noted_ = false;
};

}  // namespace

std::unique_ptr<Engine> make_single_engine(const EngineOptions& o, ModelBundle bundle, at::Device device) {
  return std::make_unique<SingleEngine>(o, std::move(bundle), device);
}

Bf16Autocast::Bf16Autocast(at::DeviceType device, bool on) : device_(device), on_(on) {
  if (!on_) return;
  at::autocast::set_autocast_enabled(device_, true);
  at::autocast::set_autocast_dtype(device_, at::kBFloat16);
}

Bf16Autocast::~Bf16Autocast() {
  if (!on_) return;
  at::autocast::set_autocast_enabled(device_, false);
  at::autocast::clear_cache();
}

Batch batch_to_device(const Batch& b, const at::Device& device) {
  return b.map([&](const std::string&, const at::Tensor& t) {
    return t.device() == device ? t : t.pin_memory().to(device, /*non_blocking=*/true);
  });
}

}  // namespace lf::train
