#include "loongforge/train/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/kernels/cuda_graph.h"
#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/kernels/linear_ce.h"
#include "loongforge/io/peft.h"
#include "loongforge/io/plot.h"
#include "loongforge/io/tensorboard.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/lora.h"
#include "loongforge/nn/loss.h"
#include "loongforge/optim/schedule.h"
#include "loongforge/parallel/comm.h"
#include "loongforge/parallel/thread_split.h"
#include "loongforge/train/checkpoint.h"
#include "loongforge/train/engine.h"
#include "loongforge/train/pretrain_source.h"
#include "loongforge/train/recipe.h"
#include "loongforge/train/sft_source.h"

namespace lf::train {
namespace fs = std::filesystem;
using nlohmann::json;
using models::llama::CausalLM;

namespace {

// transformers' _init_weights for these models: normal(0, std) for Linear and Embedding (padding row zero),
// zeros for biases, ones for norms.
void init_weights(models::llama::CausalLMImpl& m, double std) {
  at::NoGradGuard no_grad;
  for (auto& item : m.named_parameters()) {
    const std::string& n = item.key();
    at::Tensor& p = item.value();
    if (n.find("norm.weight") != std::string::npos) p.fill_(1.0);
    else if (n.size() > 5 && n.compare(n.size() - 5, 5, ".bias") == 0) p.zero_();
    else p.normal_(0.0, std);
  }
  if (m.config().pad_token_id) m.model->embed_tokens->weight[*m.config().pad_token_id].zero_();
}

using Built = ModelBundle;

Built build_model(const json& r) {
  Built b;
  const json& m = r["model"];
  std::string path = m["path"], cfg = m["config"];
  if (path.empty() == cfg.empty()) throw Error("recipe: field 'model': set exactly one of model.path (a HF folder) and model.config (a config.json for random init)");
  if (!path.empty()) {
    b.model = io::load_causal_lm(path, at::kFloat);
  } else {
    auto c = models::llama::DecoderConfig::from_file(cfg);
    b.model = CausalLM(c);
    double std = m["init_std"].get<double>();
    if (std < 0) std = c.raw.value("initializer_range", 0.02);
    init_weights(*b.model, std);
  }
  b.tokenizer = m["tokenizer"].get<std::string>();
  if (b.tokenizer.empty()) b.tokenizer = path;
  const json& mo = r["moe"];
  if (!b.model->moe_blocks().empty()) {
    const double aux = mo["aux_loss_coef"].get<double>();
    b.model->set_moe_training(aux >= 0 ? aux : b.model->config().router_aux_loss_coef, mo["seq_aux_loss_coef"],
                              mo["z_loss_coef"], mo["bias_update_rate"], mo["capacity_factor"]);
    if (mo["guest_slots"].get<int64_t>() != 0 && r["parallel"]["ep"].get<int64_t>() <= 1)
      throw Error("recipe: field 'moe.guest_slots': " + mo["guest_slots"].dump() +
                  ": hot-expert replication places copies on other expert-parallel ranks; it needs parallel.ep > 1");
  } else {
    if (mo["guest_slots"].get<int64_t>() != 0)
      throw Error("recipe: field 'moe.guest_slots': the model has no mixture-of-experts layers");
    for (const char* k : {"seq_aux_loss_coef", "z_loss_coef", "bias_update_rate", "capacity_factor"})
      if (mo[k].get<double>() != 0.0)
        throw Error(std::string("recipe: field 'moe.") + k + "': the model has no mixture-of-experts layers");
  }
  std::string rc = m["recompute"];
  b.model->set_recompute(rc == "full" ? 1 : rc == "per_layer" ? 2 : 0);

  const json& lo = r["lora"];
  if (lo["enabled"].get<bool>()) {
    nn::LoraConfig lc;
    lc.r = lo["r"];
    lc.alpha = lo["alpha"];
    lc.dropout = lo["dropout"];
    for (const auto& t : lo["target_modules"]) lc.target_modules.push_back(t.get<std::string>());
    for (auto& p : b.model->parameters()) p.set_requires_grad(false);  // only the adapter trains
    nn::apply_lora(*b.model, lc);
    b.trainable.lora = lc;
    b.trainable.base_model = path;
  }
  std::vector<std::regex> freeze, no_decay;
  for (const auto& f : m["freeze"]) freeze.emplace_back(f.get<std::string>());
  for (const auto& f : r["optim"]["no_decay"]) no_decay.emplace_back(f.get<std::string>());
  double wd = r["optim"]["weight_decay"];
  for (auto& item : b.model->named_parameters()) {
    const std::string& n = item.key();
    bool frozen = std::any_of(freeze.begin(), freeze.end(), [&](const std::regex& re) { return std::regex_search(n, re); });
    if (b.trainable.lora) frozen = frozen || n.find(".lora_") == std::string::npos;
    item.value().set_requires_grad(!frozen);
    if (frozen) continue;
    bool nd = std::any_of(no_decay.begin(), no_decay.end(), [&](const std::regex& re) { return std::regex_search(n, re); });
    b.trainable.names.push_back(n);
    b.trainable.params.push_back(item.value());
    b.weight_decay.push_back(nd ? 0.0 : wd);
  }
  if (b.trainable.params.empty()) throw Error("recipe: field 'model.freeze': every parameter is frozen");
  return b;
}

std::unique_ptr<BatchSource> build_data(const json& r, data::Split split, const std::string& tokenizer) {
  const json& d = r["data"];
  if (d["format"] == "batch") {
    if (d["train"].size() != 1) throw Error("recipe: field 'data.train': format 'batch' takes one safetensors file");
    return std::make_unique<BatchFileSource>(d["train"][0]["path"].get<std::string>());
  }
  if (d["format"] == "sft") {
    std::vector<std::string> files;
    for (const auto& s : d["train"]) files.push_back(s["path"].get<std::string>());
    if (files.empty()) throw Error("recipe: field 'data.train': no files (a list of {path: FILE.jsonl})");
    if (split == data::Split::Valid) throw Error("recipe: field 'data.valid_fraction': not supported for SFT data yet");
    return std::make_unique<SftSource>(files, tokenizer, d["chat_template"].get<std::string>(), d["seq_len"],
                                       d["assistant_only_loss"].get<bool>(), d["packing"].get<bool>(),
                                       static_cast<uint64_t>(r["seed"].get<int64_t>()));
  }
  data::PretrainOptions o;
  for (const auto& s : d["train"]) o.sources.push_back({s["path"].get<std::string>(), s["weight"].get<double>()});
  if (o.sources.empty()) throw Error("recipe: field 'data.train': no datasets (a list of {path: PREFIX, weight: W})");
  o.seq_len = d["seq_len"];
  o.seed = static_cast<uint64_t>(r["seed"].get<int64_t>());
  o.split = split;
  o.valid_fraction = d["valid_fraction"];
  return std::make_unique<PretrainSource>(o, d["per_document_attention"].get<bool>());
}

double validation_loss(Engine& engine, BatchSource& src, int64_t batches, int64_t mb) {
  double sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < batches; ++i) {
    auto [first, n] = engine.local_rows(mb);
    Batch b = src.next_rows(mb * engine.data_parallel(), first, n);
    auto [l, c] = engine.eval_loss(b);
    sum += l;
    count += c;
  }
  return count ? sum / static_cast<double>(count) : std::nan("");
}

// The recipe's device after checking what this machine has. device: cuda without a usable GPU prints one line and
// gives the CPU (train.cuda_graphs then has nothing to capture and is ignored); precision: fp8 needs the GPU. A
// distributed run (any layout) gives each rank its local rank's GPU (modulo the GPUs it sees).
at::Device choose_device(const json& r, bool distributed) {
  const bool want_cuda = r["device"] == "cuda", fp8 = r["precision"] == "fp8";
  if (r["train"]["cuda_graphs"].get<bool>() && !want_cuda)
    throw Error("recipe: field 'train.cuda_graphs': CUDA graphs need device: cuda");
  if (fp8 && !(want_cuda && kernels::cuda::available()))
    throw Error("recipe: field 'precision': fp8 needs a CUDA GPU (Hopper)" +
                (want_cuda ? " (" + kernels::cuda::unavailable_reason() + ")" : std::string(" and device: cuda")));
  const int index = distributed ? parallel::detect_launch().local_rank % std::max(1, kernels::cuda::device_count()) : 0;
  return kernels::cuda::usable_device(want_cuda, index);
}

// train.cuda_graphs on a model whose step cannot be captured: one line naming the field.
void check_graphable(const models::llama::CausalLMImpl& model) {
  const std::string f = "recipe: field 'train.cuda_graphs': ";
  if (!model.moe_blocks().empty())
    throw Error(f + "a mixture-of-experts step cannot be captured (the tokens per expert reach the host each step); "
                    "set it to false");
  if (model.config().rope.type == "dynamic")
    throw Error(f + "rope_scaling 'dynamic' reads the longest position on the host each step; set it to false");
}

// Packed documents on the GPU in bf16 (eager steps): while this lives every attention layer runs
// nn::document_attention with the micro-batch's document ranges, i.e. flash attention's varlen kernels instead of
// SDPA with a [B,1,T,T] mask (which takes the memory-efficient backend). Forward and backward (recomputation too)
// run inside its scope.
class DocumentAttention {
 public:
  DocumentAttention(models::llama::CausalLMImpl& model, const at::Tensor& segment_ids, const at::Device& device) {
    auto [cu, longest] = nn::document_ranges(segment_ids);
    const at::Tensor cu_dev = cu.pin_memory().to(device, /*non_blocking=*/true);
    for (auto& m : *model.model->layers) {
      auto* l = m->as<models::llama::DecoderLayerImpl>();
      if (!l || !l->self_attn || l->self_attn->attention_fn) continue;
      l->self_attn->attention_fn = [cu_dev, longest](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     int64_t q_offset, int64_t window, double scale,
                                                     const at::Tensor& seg) {
        return nn::document_attention(q, k, v, q_offset, window, scale, seg, cu_dev, longest);
      };
      hooked_.push_back(l->self_attn.get());
    }
  }
  ~DocumentAttention() {
    for (auto* a : hooked_) a->attention_fn = nullptr;
  }
  DocumentAttention(const DocumentAttention&) = delete;
  DocumentAttention& operator=(const DocumentAttention&) = delete;

 private:
  std::vector<models::llama::AttentionImpl*> hooked_;
};

// precision: fp8: every Linear of the decoder layers (not lm_head, not the embedding) runs its GEMMs in e4m3 with
// tensorwise scales (kernels::cuda::fp8_linear) or, with fp8_scaling: blockwise, 1 x 128 / 128 x 128 block scales
// (kernels::cuda::fp8_linear_blockwise, where the shapes are multiples of 128; tensorwise otherwise); shapes
// _scaled_mm cannot take stay in bf16.
void use_fp8_linears(models::llama::CausalLMImpl& model, bool blockwise) {
  for (auto& item : model.named_modules()) {
    auto* lin = dynamic_cast<nn::LinearImpl*>(item.value().get());
    if (!lin || item.key().find("lm_head") != std::string::npos) continue;
    lin->matmul_fn = [blockwise](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
      if (blockwise && kernels::cuda::fp8_linear_blockwise_supported(x, w))
        return kernels::cuda::fp8_linear_blockwise(x, w, b);
      if (kernels::cuda::fp8_linear_supported(x, w)) return kernels::cuda::fp8_linear(x, w, b);
      return at::linear(x, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
    };
  }
}

// One process, no layout: the model, AdamW and checkpoints as HF folders. On CUDA the model (fp32 masters) and the
// optimizer state live on the GPU, batches are copied from pinned memory without blocking, bf16/fp8 run under CUDA
// autocast, AdamW and the grad norm are the multi-tensor kernels (optim/adamw.cpp picks them for CUDA params).
class SingleEngine : public Engine {
 public:
  // cuda_graphs (train.cuda_graphs, on a CUDA device): the forward + backward of a micro-batch is captured in a CUDA
  // graph after kGraphWarmup eager steps and replayed for every later micro-batch of the captured shape.
  explicit SingleEngine(const json& r, Built b, at::Device device = at::Device(at::kCPU), bool cuda_graphs = false)
      : stream_(cuda_graphs && device.is_cuda() ? std::make_unique<kernels::cuda::StreamScope>() : nullptr),
        b_(std::move(b)),
        device_(device),
        opt_(on_device(b_, device),
             optim::AdamWOptions{r["optim"]["lr"], r["optim"]["beta1"], r["optim"]["beta2"], r["optim"]["eps"],
                                 r["optim"]["weight_decay"]},
             b_.weight_decay),
        split_(r["train"]["cpu_split"].get<int64_t>()) {
    if (split_ < 0) throw Error("recipe: field 'train.cpu_split': must be >= 0 (0: one part per CPU thread, 1: off)");
    splittable_ = b_.model->moe_blocks().empty() && !b_.model->recomputed(0) &&
                  !(r["lora"]["enabled"].get<bool>() && r["lora"]["dropout"].get<double>() > 0);
    if (stream_) check_graphable(*b_.model);
  }
  double forward_backward(const std::vector<Batch>& micro, int64_t counted, bool bf16) override {
    auto& model = *b_.model;
    if (device_.is_cuda()) return forward_backward_cuda(micro, counted, bf16);
    const double denom = static_cast<double>(std::max<int64_t>(1, counted)), scale = 1.0 / denom;
    double loss_sum = 0;
    for (const Batch& mbatch : micro) {
      Bf16Autocast autocast(at::kCPU, bf16);
      const int64_t parts = cpu_parts(mbatch.input_ids.size(0));
      if (parts > 1) {  // rows split over the CPU threads (parallel/thread_split.h)
        std::vector<double> losses(static_cast<size_t>(parts));
        parallel::split_backward(parts, b_.trainable.params, [&](int64_t i) {
          const int64_t rows = mbatch.input_ids.size(0), lo = rows * i / parts, hi = rows * (i + 1) / parts;
          at::Tensor l = micro_loss(model, mbatch.rows(lo, hi - lo), scale).first;
          losses[static_cast<size_t>(i)] = l.item<double>();
          return l / denom;
        });
        for (double l : losses) loss_sum += l;
      } else {
        at::Tensor l = micro_loss(model, mbatch, scale).first;
        (l / denom).backward();
        loss_sum += l.item<double>();
      }
    }
    return loss_sum;
  }
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
    auto [l, c] = micro_loss(model, b);
    if (was_training) model.train();
    return {l.item<double>(), c};
  }
  std::string save(const std::string& root, int64_t step, const json& st, const std::string& tokenizer, int keep) override {
    return save_checkpoint(root, step, *b_.model, b_.trainable, opt_, st, tokenizer, keep);
  }
  json load(const std::string& dir) override { return load_checkpoint(dir, *b_.model, b_.trainable, opt_); }

 private:
  // Moves the model to the device before the optimizer allocates its state there (Module::to keeps the parameter
  // tensors, so b.trainable.params stay valid). Returns the optimizer's parameters.
  static std::vector<at::Tensor> on_device(Built& b, at::Device device) {
    if (device.is_cuda()) b.model->to(device);
    return b.trainable.params;
  }
  // Host -> device from pinned memory, non_blocking: the copy is queued on the stream and the host goes on.
  Batch to_device(const Batch& b) const {
    auto mv = [&](const at::Tensor& t) {
      if (!t.defined() || t.device() == device_) return t;
      return t.pin_memory().to(device_, /*non_blocking=*/true);
    };
    return Batch{mv(b.input_ids), mv(b.targets), mv(b.position_ids), mv(b.segment_ids)};
  }
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
      l = micro_loss(model, mbatch, backward_scale, counted).first;
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
        if (bf16 && !stream_ && micro[i].segment_ids.defined()) docs.emplace(*b_.model, micro[i].segment_ids, device_);
        loss_sum += micro_step_cuda(dev[i], micro[i].counted(), 1.0 / denom, divisor, bf16).to(at::kDouble);
        continue;
      }
      if (!graph_) capture_step(micro[i], bf16);
      if (!graph_->fits(micro[i])) {  // another shape (e.g. a shorter last batch): this micro-batch runs eagerly
        if (!shape_noted_) {
          std::fprintf(stderr, "loongforge: train.cuda_graphs: a micro-batch of shape [%lld, %lld] differs from the "
                       "captured one; such micro-batches run without the graph\n",
                       (long long)micro[i].input_ids.size(0), (long long)micro[i].input_ids.size(1));
          shape_noted_ = true;
        }
        loss_sum += micro_step_cuda(to_device(micro[i]), micro[i].counted(), 1.0 / denom, at::full({}, denom, f32), bf16)
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
      auto same = [](const at::Tensor& a, const at::Tensor& s) {
        return a.defined() == s.defined() && (!a.defined() || (a.sizes() == s.sizes() && a.dtype() == s.dtype()));
      };
      return same(b.input_ids, in.input_ids) && same(b.targets, in.targets) && same(b.position_ids, in.position_ids) &&
             same(b.segment_ids, in.segment_ids);
    }
    // Host -> static inputs from pinned memory, queued on the stream before the replay that reads them.
    void load(const Batch& b, double denom) {
      for (auto [dst, src] : {std::pair{&in.input_ids, &b.input_ids}, std::pair{&in.targets, &b.targets},
                              std::pair{&in.position_ids, &b.position_ids}, std::pair{&in.segment_ids, &b.segment_ids}})
        if (src->defined()) dst->copy_(src->is_cuda() ? *src : src->pin_memory(), /*non_blocking=*/true);
      divisor.fill_(denom);
    }
  };
  static constexpr int64_t kGraphWarmup = 2;  // eager steps before the capture (cuBLAS, autograd, allocator warm)
  void capture_step(const Batch& first, bool bf16) {
    auto g = std::make_unique<GraphedStep>();
    auto alloc = [&](const at::Tensor& t) { return t.defined() ? at::empty(t.sizes(), t.options().device(device_)) : t; };
    g->in = Batch{alloc(first.input_ids), alloc(first.targets), alloc(first.position_ids), alloc(first.segment_ids)};
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

double peak_flops(const json& r, const at::Device& device) {
  double p = r["log"]["peak_tflops"];
  if (p > 0) return p * 1e12;
  if (device.is_cuda()) return 989e12;  // H100/H200 dense bf16 (the MFU convention; fp32 runs count against it too)
  // CPU: AVX2 FMA, 2 x 8 fp32 lanes x 2 flops per cycle at ~3 GHz per thread (the brief measures ~98 GFLOP/s a core).
  return 98e9 * at::get_num_threads();
}

class Progress {
 public:
  Progress(const std::string& mode, int64_t total) : total_(total) {
    bar_ = mode == "bar" || (mode == "auto" && ::isatty(STDOUT_FILENO));
    off_ = mode == "off";
  }
  void update(int64_t step, double loss, double lr, double tps, double eta_s, bool line) {
    if (off_) return;
    if (bar_) {
      int width = 30, filled = static_cast<int>(width * step / std::max<int64_t>(1, total_));
      std::string bar(filled, '#');
      bar.resize(width, '.');
      std::printf("\r[%s] %lld/%lld loss %.4f lr %.2e %.0f tok/s ETA %s   ", bar.c_str(), (long long)step,
                  (long long)total_, loss, lr, tps, fmt_eta(eta_s).c_str());
      std::fflush(stdout);
    } else if (line) {
      std::printf("step %lld/%lld loss %.4f lr %.3e tok/s %.0f eta %s\n", (long long)step, (long long)total_, loss, lr, tps,
                  fmt_eta(eta_s).c_str());
      std::fflush(stdout);
    }
  }
  void note(const std::string& s) {
    if (off_) return;
    std::printf("%s%s\n", bar_ ? "\n" : "", s.c_str());
    std::fflush(stdout);
  }
  void done() {
    if (bar_ && !off_) std::printf("\n");
  }

 private:
  static std::string fmt_eta(double s) {
    char buf[32];
    int t = static_cast<int>(s);
    std::snprintf(buf, sizeof buf, "%d:%02d", t / 60, t % 60);
    return buf;
  }
  int64_t total_;
  bool bar_ = false, off_ = false;
};

}  // namespace

std::pair<at::Tensor, int64_t> micro_loss(models::llama::CausalLMImpl& model, const Batch& b, double backward_scale,
                                          int64_t counted) {
  if (counted < 0) counted = b.counted();
  at::Tensor h = model.hidden_states(b.input_ids, b.position_ids, nullptr, b.segment_ids);
  // MoE router losses of this forward (CausalLM::aux_loss; undefined for dense models and without gradients, so
  // eval losses are pure token losses). Transformers adds coef * aux to each micro-batch's mean token loss; here the
  // sum is returned and the engine divides by the step's counted tokens, so aux is added times this micro-batch's
  // counted tokens: one micro-batch gives exactly mean token loss + coef * aux, several weight each micro-batch's
  // aux by its share of the step's tokens.
  auto with_aux = [&model, counted, backward_scale](at::Tensor l) {
    at::Tensor a = model.aux_loss();
    if (a.defined() && backward_scale > 0 && model.recomputed(0)) {
      // Recomputed layers ran without a graph: each one's share goes back in its recomputation (nn/recompute.h).
      auto st = model.aux_stats([](at::Tensor&) {});
      const double w = static_cast<double>(counted) * backward_scale;
      model.layer_loss_fn = [&model, st, w](int64_t i) {
        at::Tensor s = model.aux_share(st, i, i + 1);
        return s.defined() ? s * w : s;
      };
    }
    return a.defined() ? l + a.to(l.scalar_type()) * static_cast<double>(counted) : l;
  };
  return {with_aux(token_loss_sum(model, h, b.targets)), counted};
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

at::Tensor token_loss_sum(models::llama::CausalLMImpl& model, at::Tensor h, const at::Tensor& targets) {
  // The fused linear + cross-entropy (no [N, V] logits kept) computes what model.logits + cross_entropy compute, as
  // long as nothing hooks lm_head (LoRA adapter, layout input/output functions) and it has no bias. Below 1M logits
  // the composite version costs next to nothing, and staying on it keeps tiny runs bitwise equal to `dump` (the
  // fused one rounds differently: the gradient is scaled after the GEMMs).
  const auto& head = model.lm_head;
  const bool large = targets.numel() * model.output_weight().size(0) >= (int64_t(1) << 20);
  if (large && (!head || (!head->adapter && !head->input_fn && !head->output_fn && !head->bias.defined()))) {
    at::Tensor w = model.output_weight();
    const auto dev_type = h.device().type();
    if (at::autocast::is_autocast_enabled(dev_type)) {  // bf16 GEMMs as autocast would run them, softmax in float32
      const auto dt = at::autocast::get_autocast_dtype(dev_type);
      h = h.to(dt);
      w = w.to(dt);
    }
    return std::get<0>(kernels::linear_cross_entropy(h, w, targets, nn::kIgnoreIndex));
  }
  at::Tensor logits = model.logits(h);
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, logits.size(-1)}), targets.reshape({-1}), {},
                                at::Reduction::Sum, nn::kIgnoreIndex);
}


TrainOutcome train(const json& r, bool resume) {
  // Training allocates and frees the same large activation buffers every step. glibc would hand buffers above
  // its mmap threshold back to the kernel on free and fault them in again (zeroed) on the next step; keep them.
  ::mallopt(M_MMAP_THRESHOLD, 1 << 30);
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  if (r["train"]["threads"].get<int64_t>() > 0) at::set_num_threads(static_cast<int>(r["train"]["threads"].get<int64_t>()));
  at::manual_seed(static_cast<uint64_t>(r["seed"].get<int64_t>()));
  const std::string out = r["output_dir"];
  fs::create_directories(out);
  const std::string ckpt_root = (fs::path(out) / "checkpoints").string();

  Built b = build_model(r);
  const std::string tokenizer = b.tokenizer;
  const models::llama::DecoderConfig cfg = b.model->config();
  const json& o = r["optim"];
  const json& par = r["parallel"];
  bool distributed = false;  // launched as several processes, or a layout that needs them
  for (const char* v : {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"})
    if (const char* n = std::getenv(v)) distributed = distributed || std::atoi(n) > 1;
  for (const char* k : {"dp", "tp", "pp", "cp", "vpp", "ep"}) distributed = distributed || par[k].get<int64_t>() != 1;
  distributed = distributed || par["zero"].get<int64_t>() != 0 || par["sp"].get<bool>();
  const at::Device device = choose_device(r, distributed);
  if (r["precision"] == "fp8") use_fp8_linears(*b.model, r["fp8_scaling"] == "blockwise");
  std::unique_ptr<Engine> engine = distributed ? make_distributed_engine(r, std::move(b), device)
                                               : std::make_unique<SingleEngine>(r, std::move(b), device,
                                                                                r["train"]["cuda_graphs"].get<bool>());
  const bool main_rank = engine->is_main();
  const int64_t dp = engine->data_parallel();
  optim::Schedule sched;
  sched.kind = r["schedule"]["kind"];
  sched.lr = o["lr"];
  sched.min_lr_ratio = r["schedule"]["min_lr_ratio"];
  sched.warmup_steps = r["schedule"]["warmup_steps"];
  sched.decay_steps = r["schedule"]["decay_steps"];
  const int64_t steps = r["train"]["steps"];
  sched.total_steps = steps;

  auto data = build_data(r, data::Split::Train, tokenizer);
  std::unique_ptr<BatchSource> valid;
  const int64_t eval_every = r["eval"]["every"];
  if (r["data"]["valid_fraction"].get<double>() > 0) valid = build_data(r, data::Split::Valid, tokenizer);
  // Every evaluation uses the same first eval.batches validation batches, so values compare across steps and
  // with `loongforge eval`.
  const json valid_start = valid ? valid->state() : json();

  int64_t step = 0, tokens_seen = 0;
  json history = json::array();
  if (resume) {
    auto dir = latest_checkpoint(ckpt_root);
    if (!dir) throw Error(ckpt_root + ": --resume given but there is no checkpoint (no 'latest')");
    json st = engine->load(*dir);
    step = st.at("step");
    tokens_seen = st.at("tokens");
    data->restore(st.at("data"));
    if (main_rank) std::printf("resumed from %s at step %lld\n", dir->c_str(), static_cast<long long>(step));
  }

  const int64_t mb = r["train"]["micro_batch_size"], accum = r["train"]["grad_accum"];
  const double clip = o["clip"];
  const bool bf16 = r["precision"] == "bf16" || r["precision"] == "fp8";  // fp8: bf16 autocast around the FP8 GEMMs
  const int64_t log_every = std::max<int64_t>(1, r["log"]["every"].get<int64_t>());
  const int64_t ckpt_every = r["checkpoint"]["every"];
  const int keep = static_cast<int>(r["checkpoint"]["keep"].get<int64_t>());
  const double n_params = static_cast<double>(cfg.num_active_parameters());  // MoE: the experts a token uses
  const double seq = static_cast<double>(r["data"]["seq_len"].get<int64_t>());
  const double flops_per_token = 6.0 * n_params + 12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq;
  const double peak = peak_flops(r, device);

  const std::string metrics_path = (fs::path(out) / "metrics.jsonl").string();
  if (main_rank && resume && fs::exists(metrics_path)) {  // drop lines of steps after the checkpoint (they will be redone)
    std::ifstream in(metrics_path);
    std::string l, kept;
    while (std::getline(in, l)) {
      json j = json::parse(l, nullptr, false);
      if (!j.is_discarded() && j.value("step", int64_t(0)) <= step) kept += l + "\n";
    }
    write_file_atomic(metrics_path, kept);
  }
  std::ofstream metrics;
  std::unique_ptr<io::TensorBoardWriter> tb;
  if (main_rank) {  // rank 0 writes the logs
    write_file_atomic((fs::path(out) / "recipe.yaml").string(), recipe_to_yaml(r));
    metrics.open(metrics_path, resume ? std::ios::app : std::ios::trunc);
    if (!metrics) throw Error((fs::path(out) / "metrics.jsonl").string() + ": cannot write");
    if (r["log"]["tensorboard"].get<bool>()) tb = std::make_unique<io::TensorBoardWriter>((fs::path(out) / "tensorboard").string());
  }
  Progress progress(main_rank ? r["log"]["progress"].get<std::string>() : "off", steps);

  auto state_json = [&]() {
    json st = {{"step", step}, {"tokens", tokens_seen}, {"data", data->state()}, {"recipe", r}};
    return st;
  };
  TrainOutcome outcome;
  auto t_start = std::chrono::steady_clock::now();
  int64_t start_step = step;
  const int64_t stop_at = r["train"]["stop_at_step"];  // leave early (with a checkpoint), e.g. before a preemption
  while (step < steps && !(stop_at > 0 && step >= stop_at)) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<Batch> micro;
    int64_t counted = 0;
    const auto [first_row, rows] = engine->local_rows(mb);  // this rank reads only its rows
    for (int64_t i = 0; i < accum; ++i) {
      micro.push_back(data->next_rows(mb * dp, first_row, rows));
      counted += micro.back().counted();
    }
    counted = engine->global_counted(counted);
    // The loss of the step averages over every counted token of all its micro-batches (and ranks).
    double loss = engine->forward_backward(micro, counted, bf16) / static_cast<double>(std::max<int64_t>(1, counted));
    double gnorm = engine->clip_grad_norm(clip);
    double lr = sched.at(step);
    engine->step(lr);
    engine->zero_grad();
    ++step;
    int64_t step_tokens = accum * mb * dp * static_cast<int64_t>(seq);
    tokens_seen += step_tokens;
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double tps = step_tokens / std::max(dt, 1e-9);
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    double eta = elapsed / static_cast<double>(step - start_step) * static_cast<double>(steps - step);
    json line = {{"step", step}, {"loss", loss}, {"grad_norm", gnorm}, {"lr", lr}, {"tokens", tokens_seen},
                 {"tokens_per_s", tps}, {"mfu", flops_per_token * tps / peak}, {"step_time_s", dt}};
    if (device.is_cuda()) line["max_memory_allocated"] = kernels::cuda::max_memory_allocated();
    const json extra = engine->step_metrics();
    for (auto it = extra.begin(); it != extra.end(); ++it) line[it.key()] = it.value();
    if (valid && eval_every > 0 && (step % eval_every == 0 || step == steps)) {
      valid->restore(valid_start);
      double vl = validation_loss(*engine, *valid, r["eval"]["batches"], mb);
      line["valid_loss"] = vl;
      if (tb) tb->add_scalar("valid/loss", vl, step);
      progress.note("step " + std::to_string(step) + " valid loss " + std::to_string(vl));
    }
    if (main_rank) {
      metrics << line.dump() << "\n";
      metrics.flush();
    }
    history.push_back(line);
    if (tb) {
      tb->add_scalar("train/loss", loss, step);
      tb->add_scalar("train/grad_norm", gnorm, step);
      tb->add_scalar("train/lr", lr, step);
      tb->add_scalar("train/tokens_per_s", tps, step);
    }
    progress.update(step, loss, lr, tps, eta, step % log_every == 0 || step == steps);
    outcome.last_loss = loss;
    if ((ckpt_every > 0 && step % ckpt_every == 0) || step == steps || step == stop_at) {
      outcome.last_checkpoint = engine->save(ckpt_root, step, state_json(), tokenizer, keep);
      if (ckpt_every > 0 && step != steps) progress.note("saved " + outcome.last_checkpoint);
    }
  }
  progress.done();
  if (tb) tb->flush();
  if (main_rank && r["log"]["plot"].get<bool>()) {
    // The whole run's curve, resumed runs included: read metrics.jsonl back.
    io::Series train_s{"train loss", {}, {}, 0x1f77b4}, valid_s{"valid loss", {}, {}, 0xd62728};
    std::ifstream in((fs::path(out) / "metrics.jsonl").string());
    std::string l;
    while (std::getline(in, l)) {
      json j = json::parse(l, nullptr, false);
      if (j.is_discarded()) continue;
      train_s.x.push_back(j["step"].get<double>());
      train_s.y.push_back(j["loss"].get<double>());
      if (j.contains("valid_loss")) {
        valid_s.x.push_back(j["step"].get<double>());
        valid_s.y.push_back(j["valid_loss"].get<double>());
      }
    }
    std::vector<io::Series> series{train_s};
    if (!valid_s.x.empty()) series.push_back(valid_s);
    io::write_line_plot((fs::path(out) / "loss.png").string(), "loss", series);
  }
  outcome.steps = step;
  engine->barrier();  // nobody leaves (and takes the rendezvous store down) before everyone is done
  return outcome;
}

double evaluate(const json& r, const std::string& model_dir, int64_t batches) {
  models::llama::CausalLM model{nullptr};
  if (fs::exists(fs::path(model_dir) / "adapter_config.json")) {  // a LoRA checkpoint: base from the recipe
    model = io::load_causal_lm(r["model"]["path"].get<std::string>(), at::kFloat);
    io::load_peft_adapter(model_dir, *model);
  } else {
    model = io::load_causal_lm(model_dir, at::kFloat);
  }
  std::string tok = r["model"]["tokenizer"].get<std::string>();
  if (tok.empty()) tok = r["model"]["path"].get<std::string>();
  auto src = build_data(r, r["data"]["valid_fraction"].get<double>() > 0 ? data::Split::Valid : data::Split::Train, tok);
  Built b;
  b.model = model;
  b.tokenizer = tok;
  b.trainable.params = {model->parameters().front()};
  b.trainable.names = {"unused"};
  SingleEngine engine(r, std::move(b), choose_device(r, /*distributed=*/false));
  return validation_loss(engine, *src, batches, r["train"]["micro_batch_size"]);
}

}  // namespace lf::train
