// The distributed engine: the recipe's `parallel` block becomes a mesh (pp, dp_rep, dp_shard, cp, tp) over the
// processes of the job, and the layouts of parallel/ are applied to the plain model in turn: tensor (+sequence)
// parallel, context parallel, pipeline stages, then data parallel (DDP / ZeRO-1 through
// optim::DataParallelOptimizer, or FSDP/HSDP through parallel::fully_shard).
//
// Every rank reads only its rows of each global micro-batch (data-parallel size x micro_batch_size rows; rows
// [dp index x micro_batch_size, +micro_batch_size): BatchSource::next_rows, which advances the data position as the
// whole draw would) and takes its part of the sequence (context parallel); the step's counted tokens are summed over
// the data-parallel ranks. Losses are summed over all counted tokens and divided by the global count, so gradients
// are sums over data/context-parallel ranks. A model that makes its token sequence inside (Model::sequence_inside:
// diffusion transformers patchify latents in embed()) gets whole rows and cuts the sequence itself through the
// cut_sequence_fn context parallelism installs; its loss_terms count the whole rows on every cp rank.
//
// LoRA runs (trainable.lora): the adapters train under data parallel (DDP, ZeRO-1), tensor (+sequence) parallel
// (parallel/tensor_parallel.h splits lora_B of column-parallel layers and lora_A of row-parallel ones; the other
// matrix stays whole with its gradient summed over tp) and pipeline parallel; checkpoints then hold the PEFT adapter
// folder a single-process LoRA run writes (rank 0 merges the ranks' shares). FSDP, context parallel and adapters
// outside the decoder layers are one-line errors.
//
// Expert parallelism (parallel.ep = E > 1, MoE models, DDP or ZeRO-1): the ep ranks are E data-parallel ranks (mesh
// pp, dp_rep, ep, dp_shard, cp, tp; ep divides dp), each with its own rows and 1/E of every MoE block's experts
// (parallel/expert_parallel.h; optional guest slots for hot-expert replicas, moe.guest_slots); with tp each expert is
// further split along its ffn (tensor_parallel.h), with pp each stage's blocks are expert-parallel over the stage's
// ep group, with cp the ep ranks of each cp coordinate exchange the tokens of their sequence chunks. Two optimizers:
// the non-expert parameters' gradients are summed over all dp ranks, the expert slices' over the dp / E ranks
// holding the same experts (never over ep; over cp too); ZeRO-1 splits both optimizers' state over those dp / E
// ranks. The grad norm sums the expert squares over ep (and tp, pp) once. Checkpoints hold every expert
// (all-gathered over ep) under the per-expert names a single-process run writes, and whole optimizer moments, so
// they load in any layout.
//
// MoE router losses (every data-parallel layout): each rank adds its share of the losses of the whole global
// micro-batch (CausalLM::aux_stats / aux_share: expert counts, rows, tokens and sequences summed over the data and
// context ranks), so they equal one process's on the whole micro-batch. Under pp they are added per chunk (Pipeline's
// chunk_loss_fn); the pooled load-balancing loss, which needs every layer's counts, sums them over the stages as the
// chunks' carry and adds each chunk's share in its backward. Under cp each sequence's expert counts are summed over
// the cp ranks (nn::MoEImpl::sequence_reduce) for the sequence-level loss. Under FSDP the layers run without a graph:
// the statistics are made anyway and each layer's share is backpropagated in its recomputation
// (FullyShardedModel::layer_loss_fn).
//
// Validation (eval_loss) with pp > 1 runs Pipeline::forward_only. With FSDP and precision bf16 the gathered matmul
// weights are bf16 copies (parallel/fsdp.h); evaluation switches them back to fp32, as evaluation runs without
// autocast.
//
// Checkpoints are Hugging Face folders written by every rank: each writes a share of the whole tensors
// (model-rank-R.safetensors, optimizer-rank-R.safetensors) and rank 0 the index (model.safetensors.index.json,
// the format transformers reads), config and tokenizer. Since they hold whole tensors, any checkpoint loads into
// any layout (and into transformers).
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/nn/lora.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/peft.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/optim/distributed.h"
#include "loongforge/parallel/comm.h"
#include "loongforge/parallel/mpi_backend.h"
#include "loongforge/parallel/context_parallel.h"
#include "loongforge/parallel/expert_parallel.h"
#include "loongforge/parallel/fsdp.h"
#include "loongforge/parallel/layout.h"
#include "loongforge/parallel/pipeline.h"
#include "loongforge/parallel/tensor_parallel.h"
#include "loongforge/train/engine.h"
#include "loongforge/train/router_losses.h"

namespace lf::train {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

class DistEngine : public Engine {
 public:
  DistEngine(const EngineOptions& o, ModelBundle b, at::Device device)
      : b_(std::move(b)), layout_(o.layout), device_(device) {
    auto& model = *b_.model;
    schema_ = model.batch_schema();
    parallel::validate(layout_, model, o.seq_len, o.grad_accum, b_.trainable.lora.has_value());
    if (b_.trainable.lora) {
      const std::string blocks = model.split().blocks + ".";
      for (const auto& m : nn::lora_modules(model))
        if (m.rfind(blocks, 0) != 0)
          throw Error("recipe: field 'lora.target_modules': distributed runs support LoRA on the blocks' "
                      "projections only, not on '" + m + "'");
      if (layout_.tp > 1 && b_.trainable.lora->dropout > 0)
        throw Error("recipe: field 'lora.dropout': must be 0 with parallel.tp > 1 (tensor-parallel ranks would draw "
                    "different dropout masks for the same activations)");
    }
    // Replication options, before the processes meet (a bad recipe fails the same way everywhere).
    parallel::moe::GuestOptions guests;
    guests.guest_slots = o.guest_slots;
    guests.ranks_per_node = o.ranks_per_node;
    guests.hidden_size = model.hidden_size();
    guests.bytes_per_element = o.precision == "fp32" ? 4 : 2;
    if (!model.moe_blocks().empty()) guests.expert_params = 3 * model.hidden_size() * model.moe_blocks().front()->options.expert_ffn;
    parallel::check_guest_options(guests, layout_.ep);
    for (auto* blk : model.moe_blocks())  // the router losses' collectives run only when some are on
      for (double v : {blk->options.aux_loss_coef, blk->options.seq_aux_loss_coef, blk->options.z_loss_coef})
        router_losses_ = router_losses_ || v > 0;
    if (layout_.zero == 3)  // FSDP runs each layer without a graph: router statistics made there too (nn/moe.h)
      for (auto* blk : model.moe_blocks()) blk->force_stats = true;
    parallel::Comm::Options co;
    co.timeout = std::chrono::milliseconds(layout_.timeout_s * 1000);
    // auto: NCCL for GPUs; on the CPU Open MPI when mpirun started the job (shared-memory transport, bench/
    // comm_bench.cpp), else Gloo. Gloo and MPI stage GPU tensors through the host (several ranks on one GPU, for
    // tests); NCCL needs the GPUs.
    const std::string& backend = o.backend;
    if (backend == "nccl" && !device_.is_cuda())
      throw Error("recipe: field 'parallel.backend': nccl needs GPUs (device: cuda); this run is on the CPU");
    const parallel::LaunchEnv launch = parallel::detect_launch();
    const bool mpirun = launch.launcher == "mpirun" && parallel::mpi_compiled();
    co.backend = backend == "auto" ? (device_.is_cuda() ? "nccl" : mpirun ? "mpi" : "gloo") : backend;
    if (device_.is_cuda()) kernels::cuda::set_device(device_.index());
    comm_ = parallel::Comm::init(launch, co);
    if (comm_->world() != layout_.world())
      throw Error(std::string("recipe: field 'parallel.") +
                  (layout_.dp > 1 ? "dp" : layout_.tp > 1 ? "tp" : layout_.pp > 1 ? "pp" : "cp") + "': layout " +
                  layout_.describe() + " needs " + std::to_string(layout_.world()) +
                  " processes; the job has " + std::to_string(comm_->world()) +
                  " (launch with torchrun, mpirun -np N or srun)");
    mesh_ = std::make_unique<parallel::Mesh>(comm_, layout_.mesh_dims());
    tp_ = &mesh_->group("tp");
    cp_ = &mesh_->group("cp");
    pp_ = &mesh_->group("pp");
    const parallel::Group& shard = mesh_->group("dp_shard");
    const parallel::Group& replicate = mesh_->group_over({"dp_rep", "ep", "cp"});
    dp_cp_ = &mesh_->group_over({"dp_rep", "ep", "dp_shard", "cp"});
    dp_ = &mesh_->group_over({"dp_rep", "ep", "dp_shard"});
    mp_ = &mesh_->group_over({"pp", "tp"});
    ep_ = &mesh_->group("ep");
    dp_index_ = (mesh_->coord("dp_rep") * layout_.ep + mesh_->coord("ep")) * layout_.dp_shard() + mesh_->coord("dp_shard");
    mb_ = o.micro_batch_size;

    // Which parameters train (by name) and their weight decay, from the bundle.
    std::map<std::string, double> wd, lr_scale;
    for (size_t i = 0; i < b_.trainable.names.size(); ++i) wd[b_.trainable.names[i]] = b_.weight_decay[i];
    for (size_t i = 0; i < b_.lr_scale.size(); ++i) lr_scale[b_.trainable.names[i]] = b_.lr_scale[i];
    const optim::AdamWOptions& ao = o.adamw;

    if (layout_.zero == 3) {  // FSDP / HSDP (data parallel only; validated)
      parallel::FsdpOptions fo;
      if (o.precision == "bf16") fo.compute_dtype = at::kBFloat16;  // bf16 copies of the gathered matmul weights
      if (device_.is_cuda()) fo.device = device_;  // only this rank's shards go to the GPU
      fsdp_ = parallel::fully_shard(model, shard, mesh_->group("dp_rep"), fo);
      if (device_.is_cuda()) model.to(device_);  // the buffers (and the released parameters' empty placeholders)
      std::vector<double> decay;
      for (const auto& n : fsdp_->names()) decay.push_back(wd.count(n) ? wd[n] : 0.0);
      opt_ = std::make_unique<optim::DataParallelOptimizer>(fsdp_, decay, ao);
      if (!lr_scale.empty()) opt_->set_lr_scale(lr_scale);
      if (o.ema.decay > 0) opt_->enable_ema(o.ema);
      for (const auto& n : fsdp_->names()) saved_names_.push_back(n);
      return;
    }
    if (layout_.tp > 1 || layout_.sp) {
      plan_ = parallel::apply_tensor_parallel(model, *tp_, layout_.sp, o.vocab_granule);
      // Replicated parameters with partial gradients (norms under sp, q/k norms): sum over tp as each gradient is
      // produced, before data-parallel reduction sees it.
      std::set<std::string> partial(plan_.partial_grad.begin(), plan_.partial_grad.end());
      for (auto& item : model.named_parameters()) {
        if (!partial.count(item.key()) || !item.value().requires_grad()) continue;
        const parallel::Group* tp = tp_;
        item.value().register_hook([tp](const at::Tensor& g) {
          at::Tensor s = g.contiguous().clone();
          tp->all_reduce(s);
          return s;
        });
      }
    }
    if (layout_.cp > 1) {
      parallel::apply_context_parallel(model, *cp_, layout_.cp_mode);
      // the sequence-level router loss: each sequence's expert counts summed over the cp ranks holding its parts
      for (auto* blk : model.moe_blocks())
        blk->sequence_reduce = [this](at::Tensor& counts) {
          cp_->all_reduce(counts);
          return static_cast<int64_t>(layout_.cp);
        };
    }
    std::vector<std::string> owned, counted;
    if (layout_.pp > 1) {
      auto counts = parallel::pipeline_layer_counts(model.num_blocks(), layout_.pp, layout_.vpp, layout_.pp_layout);
      pipe_ = std::make_unique<parallel::Pipeline>(model, *pp_, layout_.vpp, counts);
      owned = pipe_->owned_parameter_names();
      counted = pipe_->norm_parameter_names();
    } else {
      for (auto& item : model.named_parameters()) owned.push_back(item.key());
      counted = owned;
    }
    if (layout_.ep > 1) ep_plan_ = parallel::apply_expert_parallel(model, *ep_, guests);  // before the buckets
    // On a GPU: the model moves once the layouts have split it (each rank carries only its slices and stage), before
    // the optimizers lay out their buckets and state there.
    if (device_.is_cuda()) model.to(device_);
    std::set<std::string> counted_set(counted.begin(), counted.end());
    std::vector<std::string> names, enames;
    std::vector<at::Tensor> params, eparams;
    std::vector<double> decay, edecay;
    std::vector<bool> count_in_norm;
    auto named = model.named_parameters();
    for (const auto& n : owned) {
      if (!wd.count(n)) continue;  // frozen
      if (ep_plan_.is_expert_param(n)) {
        enames.push_back(n);
        eparams.push_back(named[n]);
        edecay.push_back(wd[n]);
        continue;
      }
      names.push_back(n);
      params.push_back(named[n]);
      decay.push_back(wd[n]);
      bool c = counted_set.count(n) > 0;
      if (layout_.tp > 1 || layout_.sp) c = c && plan_.counted_in_norm(n);
      count_in_norm.push_back(c);
    }
    for (const auto& n : counted)
      if (!b_.trainable.lora || wd.count(n)) saved_names_.push_back(n);  // LoRA runs save the adapter only
    optim::DataParallelOptions dpo;
    dpo.zero = layout_.zero;
    opt_ = std::make_unique<optim::DataParallelOptimizer>(names, params, decay, ao, replicate, shard, dpo, mp_, count_in_norm);
    if (!enames.empty())  // expert slices: summed over the data ranks holding the same experts only
      eopt_ = std::make_unique<optim::DataParallelOptimizer>(enames, eparams, edecay, ao,
                                                             mesh_->group_over({"dp_rep", "cp"}), shard, dpo);
    if (!lr_scale.empty()) {
      opt_->set_lr_scale(lr_scale);
      if (eopt_) eopt_->set_lr_scale(lr_scale);
    }
    if (o.ema.decay > 0) {
      opt_->enable_ema(o.ema);
      if (eopt_) eopt_->enable_ema(o.ema);
    }
  }

  void set_sync(bool last) {
    opt_->set_sync(last);
    if (eopt_) eopt_->set_sync(last);
  }
  void finish_backward() {
    opt_->finish_backward();
    if (eopt_) eopt_->finish_backward();
  }

  bool is_main() const override { return comm_->rank() == 0; }
  int data_parallel() const override { return layout_.dp; }
  int data_parallel_rank() const override { return static_cast<int>(dp_index_); }
  void barrier() override { comm_->world_group().barrier(); }
  bool with_whole_model(bool average, const std::function<void(models::Model&)>& fn) override {
    if (layout_.tp > 1 || layout_.sp || layout_.pp > 1 || layout_.cp > 1 || layout_.ep > 1 || layout_.zero == 3)
      return false;
    at::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> avg;
    if (average && opt_->has_ema()) avg = opt_->full_state("ema");  // collective
    if (is_main()) {
      auto named = b_.model->named_parameters();
      std::map<std::string, at::Tensor> kept;
      for (const auto& [n, t] : avg) {
        kept[n] = named[n].detach().clone();
        named[n].detach().copy_(t);
      }
      auto restore = [&] {
        for (const auto& [n, t] : kept) named[n].detach().copy_(t);
      };
      try {
        fn(*b_.model);
      } catch (...) {
        restore();
        throw;
      }
      restore();
    }
    barrier();
    return true;
  }
  std::pair<int64_t, int64_t> local_rows(int64_t micro_batch_size) const override {
    return {dp_index_ * micro_batch_size, micro_batch_size};
  }
  int64_t global_counted(int64_t local) override {
    at::Tensor t = at::full({1}, static_cast<double>(local), at::kDouble);
    dp_->all_reduce(t);
    return static_cast<int64_t>(t.item<double>());
  }

  // This rank's sequence part of its rows (local_rows) of a global micro-batch.
  // The sequence length of a batch: dim 1 of its first sequence field (the schema's).
  int64_t seq_of(const Batch& b) const {
    for (const auto& f : schema_)
      if (f.sequence && b.has(f.name)) return b.at(f.name).size(1);
    throw Error("distributed engine: the batch has no sequence field of the model's schema");
  }
  // This rank's sequence part of its rows (local_rows) of a global micro-batch: the schema's sequence fields cut
  // for context parallelism (positions filled in first, so each part keeps its global positions).
  Batch local(const Batch& g) const {
    Batch b = g;
    if (b.num_rows() != mb_)
      throw Error("distributed engine: a micro-batch of " + std::to_string(b.num_rows()) + " rows; this rank reads " +
                  std::to_string(mb_) + " (local_rows)");
    if (layout_.cp > 1 && !b_.model->sequence_inside()) {  // else the model cuts its own sequence (cut_sequence_fn)
      const int64_t T = seq_of(b);
      for (const auto& f : schema_)
        if (f.positions && !b.has(f.name))
          b.set(f.name, at::arange(T, at::kLong).unsqueeze(0).expand({b.num_rows(), T}).contiguous());
      for (const auto& f : schema_)
        if (f.sequence && b.has(f.name)) b.set(f.name, parallel::cp_shard(b.at(f.name), *cp_));
    }
    return device_.is_cuda() ? batch_to_device(b, device_) : b;
  }

  // The summed loss of the model's head on its hidden states (a tensor-parallel vocabulary: the layout's
  // vocab_loss_fn; otherwise the single-process head, e.g. the fused linear + cross-entropy for large batches).
  at::Tensor loss_of(const at::Tensor& hidden, const Batch& b) { return b_.model->head_loss_sum(hidden, b); }

  at::Tensor hidden(const Batch& b) { return fsdp_ ? fsdp_->forward_hidden(b) : b_.model->forward_hidden(b); }

  double forward_backward(const std::vector<Batch>& micro, int64_t counted, bool bf16) override {
    const double scale = static_cast<double>(std::max<int64_t>(1, counted));
    double local_sum = 0;
    {
      Bf16Autocast autocast(device_.type(), bf16);
      std::vector<Batch> mine;
      for (const auto& g : micro) mine.push_back(local(g));
      // Router losses: each micro-batch's global share (as one process computes them on the whole micro-batch),
      // weighted by the micro-batch's global count of counted tokens (micro_loss's weighting).
      std::vector<double> weight;
      const bool router = router_losses_;
      if (router) {
        at::Tensor c = at::zeros({static_cast<int64_t>(mine.size())}, at::kDouble);
        for (size_t i = 0; i < mine.size(); ++i) c[static_cast<int64_t>(i)] = static_cast<double>(b_.model->loss_terms(mine[i]));
        dp_cp_->all_reduce(c);
        for (size_t i = 0; i < mine.size(); ++i) weight.push_back(c[static_cast<int64_t>(i)].item<double>());
      }
      auto reduce = [this](at::Tensor& t) { dp_cp_->all_reduce(t); };
      if (pipe_) {
        const std::vector<parallel::MicroBatch>& mbs = mine;
        const int64_t seq = seq_of(mine[0]) / (layout_.sp ? layout_.tp : 1);
        set_sync(false);
        const int64_t lb = lb_experts(*b_.model);
        parallel::Pipeline::ChunkLossFn router_losses =
            router ? pipeline_router_losses(b_.model.get(), reduce, weight, layout_.tp, scale, lb) : nullptr;
        local_sum = pipe_->forward_backward(
            mbs, [&](const at::Tensor& h, size_t i) { return loss_of(h, mine[i]); }, scale,
            [&](size_t i) { return b_.model->activation_shape(mine[i].num_rows(), seq); },
            router_losses, lb > 0 ? lb + 1 : 0);
        b_.model->layer_loss_fn = nullptr;
        pipe_->sync_tied_grads();
        set_sync(true);
        finish_backward();
      } else {
        for (size_t i = 0; i < mine.size(); ++i) {
          set_sync(i + 1 == mine.size());
          at::Tensor l = loss_of(hidden(mine[i]), mine[i]);
          double value = l.item<double>();
          // MoE router losses: this rank's share (router_losses.h).
          if (router)
            value += add_router_losses(*b_.model, reduce, weight[i], layout_.tp, scale, l,
                                       fsdp_ ? &fsdp_->layer_loss_fn : nullptr);
          (l / scale).backward();
          if (fsdp_) fsdp_->layer_loss_fn = nullptr;
          finish_backward();
          local_sum += value;
        }
      }
    }
    // tp ranks hold the same value, pp ranks too (the pipeline broadcasts it); sum over data and context ranks,
    // with the model's loss parts (the multi-token prediction loss) in the same reduction.
    parts_ = b_.model->take_loss_parts();
    at::Tensor t = at::zeros({1 + static_cast<int64_t>(parts_.size())}, at::kDouble);
    t[0] = local_sum;
    for (size_t i = 0; i < parts_.size(); ++i) t[static_cast<int64_t>(i) + 1] = parts_[i].second;
    dp_cp_->all_reduce(t);
    for (size_t i = 0; i < parts_.size(); ++i) parts_[i].second = t[static_cast<int64_t>(i) + 1].item<double>();
    return t[0].item<double>();
  }
  std::vector<std::pair<std::string, double>> loss_parts() override { return parts_; }

  double clip_grad_norm(double max_norm) override {
    if (!eopt_) return opt_->clip_grad_norm(max_norm);
    // Non-expert squares once (the same on every data rank after DDP), expert squares summed over ep.
    at::Tensor esq = at::full({1}, eopt_->grad_sq_norm(), at::kDouble);
    mesh_->group_over({"pp", "ep", "tp"}).all_reduce(esq);  // expert slices: split over ep (and tp, pp stages)
    const double total = std::sqrt(opt_->grad_sq_norm() + esq.item<double>());
    opt_->scale_grads(total, max_norm);
    eopt_->scale_grads(total, max_norm);
    return total;
  }
  void step(double lr) override {
    opt_->step(lr);
    if (eopt_) eopt_->step(lr);
    // Aux-loss-free MoE bias updates from the global expert loads (every data-parallel rank counted its own tokens).
    for (auto* blk : b_.model->moe_blocks())
      if (blk->options.bias_update_rate > 0 && blk->load_since_update.defined()) dp_cp_->all_reduce(blk->load_since_update);
    b_.model->update_moe_bias();
  }
  json step_metrics() override {
    json m = json::object();
    auto& st = *ep_plan_.stats;
    if (layout_.ep > 1 && st.plans > 0) {  // the forwards since the last step, of rank 0's expert-parallel group
      m["moe_overload"] = st.overload / static_cast<double>(st.plans);
      m["moe_home_overload"] = st.home_overload / static_cast<double>(st.plans);
      m["moe_replica_tokens"] = st.replica_tokens;
    }
    st = parallel::ExpertParallelPlan::Stats{};
    return m;
  }
  void zero_grad() override {
    opt_->zero_grad();
    if (eopt_) eopt_->zero_grad();
  }

  // The optimizers' whole state `which` by name; expert slices all-gathered over ep (collective).
  std::map<std::string, at::Tensor> full_state(const std::string& which) const {
    std::map<std::string, at::Tensor> out = opt_->full_state(which);
    if (eopt_)
      for (const auto& [n, t] : eopt_->full_state(which)) out[n] = ep_->all_gather(t.contiguous(), 0);
    return out;
  }

  std::pair<double, int64_t> eval_loss(const Batch& g) override {
    at::NoGradGuard no_grad;
    auto& model = *b_.model;
    bool was_training = model.is_training();
    model.eval();
    // Evaluation runs in fp32 without autocast (as the single-process engine's): no bf16 copies meanwhile.
    const at::ScalarType compute = fsdp_ ? fsdp_->compute_dtype() : at::kFloat;
    if (fsdp_) fsdp_->set_compute_dtype(at::kFloat);
    Batch b = local(g);
    double l;
    if (pipe_) {  // forward-only through the stages; the last stage computes the loss, every pp rank gets it
      const int64_t seq = seq_of(b) / (layout_.sp ? layout_.tp : 1);
      std::vector<parallel::MicroBatch> one{b};
      l = pipe_->forward_only(
          one, [&](const at::Tensor& h, size_t) { return loss_of(h, b); },
          [&](size_t) { return model.activation_shape(b.num_rows(), seq); });
    } else {
      l = loss_of(hidden(b), b).item<double>();
    }
    if (fsdp_) fsdp_->set_compute_dtype(compute);
    if (was_training) model.train();
    // A model that cuts its sequence itself counts the whole batch's terms on every cp rank: summed over dp only.
    at::Tensor loss = at::full({1}, l, at::kDouble);
    at::Tensor terms = at::full({1}, static_cast<double>(model.loss_terms(b)), at::kDouble);
    dp_cp_->all_reduce(loss);
    (model.sequence_inside() ? dp_ : dp_cp_)->all_reduce(terms);
    return {loss.item<double>(), static_cast<int64_t>(terms.item<double>())};
  }

  // Whole tensors of this pipeline stage: model weights (saved_names_) and the optimizer moments.
  std::map<std::string, at::Tensor> whole(const std::map<std::string, at::Tensor>& local_by_name) const {
    std::map<std::string, at::Tensor> out;
    for (const auto& [n, t] : local_by_name) {
      // gathered tensors go to the host at once (a whole model need not fit next to its shards on a GPU)
      out[n] = (layout_.tp > 1 || layout_.sp) ? parallel::unshard(n, t, plan_, *tp_).cpu() : t;
    }
    return out;
  }

  std::string save(const std::string& root, int64_t step, const json& st, const std::string& tokenizer, int keep) override {
    std::map<std::string, at::Tensor> weights;
    if (fsdp_) {
      weights = fsdp_->full_parameters();
      // frozen parameters stay outside the FSDP units, whole on every rank (a model's parts its loss never reaches,
      // e.g. sparse-attention indexers, or model.freeze): written as loaded
      for (const auto& item : b_.model->named_parameters())
        if (!b_.trainable.lora && !item.value().requires_grad() && !weights.count(item.key()))
          weights[item.key()] = item.value().detach();
    } else {
      auto named = b_.model->named_parameters();
      std::map<std::string, at::Tensor> local_w;
      for (const auto& n : saved_names_) local_w[n] = named[n].detach();
      weights = whole(local_w);  // whole over tp; expert slices then all-gathered over ep
      if (layout_.ep > 1)
        for (auto& [n, t] : weights)
          if (ep_plan_.is_expert_param(n)) t = ep_->all_gather(t.contiguous(), 0).cpu();
    }
    if (!b_.trainable.lora) weights = to_checkpoint_names(*b_.model, weights);
    // Persistent buffers that are checkpoint tensors (the MoE routers' correction biases), the same on every rank.
    if (!b_.trainable.lora) {
      const auto saved = checkpoint_buffers(*b_.model);
      for (const auto& item : b_.model->named_buffers())
        if (saved.count(item.key())) weights[saved.at(item.key())] = item.value().detach();
    }
    std::map<std::string, at::Tensor> m = whole(full_state("exp_avg")), v = whole(full_state("exp_avg_sq")), e;
    if (opt_->has_ema()) e = whole(full_state("ema"));
    // Each tensor of this stage is written by one of the stage's ranks (round robin over dp x cp x tp).
    const parallel::Group& stage = mesh_->group_over({"dp_rep", "ep", "dp_shard", "cp", "tp"});
    CheckpointRanks ranks;
    ranks.rank = comm_->rank();
    ranks.world = comm_->world();
    ranks.writer = stage.rank();
    ranks.writers = stage.size();
    ranks.barrier = [this] { barrier(); };
    ranks.layout = layout_.describe();
    return write_checkpoint(root, step, ranks, weights, m, v, opt_->steps(), *b_.model, b_.trainable, st, tokenizer,
                            keep, e);
  }

  json load(const std::string& dir) override {
    at::NoGradGuard no_grad;
    const bool lora = b_.trainable.lora.has_value();
    std::optional<io::SafetensorsCheckpoint> ckpt;
    std::shared_ptr<io::SafetensorsFile> adapter;  // LoRA runs: the PEFT adapter (the base comes from model.path)
    if (lora) adapter = io::SafetensorsFile::open((fs::path(dir) / "adapter_model.safetensors").string());
    else ckpt = io::SafetensorsCheckpoint::open(dir);
    OptimizerStateReader st(dir);
    std::optional<io::SafetensorsCheckpoint> ema_ckpt;
    if (opt_->has_ema()) ema_ckpt = io::SafetensorsCheckpoint::open(ema_dir(dir));
    auto local_of = [&](const std::string& n, const at::Tensor& full) {
      at::Tensor t = (layout_.tp > 1 || layout_.sp) ? parallel::shard_of(n, full, plan_, *tp_) : full;
      return layout_.ep > 1 && ep_plan_.is_expert_param(n) ? parallel::expert_shard_of(t, *ep_) : t;
    };
    std::map<std::string, at::Tensor> p, m, v, e;
    std::vector<std::string> all_names = opt_->names();
    if (eopt_) all_names.insert(all_names.end(), eopt_->names().begin(), eopt_->names().end());
    for (const auto& n : all_names) {
      at::Tensor w;
      if (lora) {
        if (!adapter->contains(io::peft_name(n))) throw file_error(adapter->path(), io::peft_name(n), "missing");
        w = adapter->tensor(io::peft_name(n));
      } else {
        w = read_whole(*ckpt, *b_.model, n, dir);
      }
      p[n] = local_of(n, w.to(at::kFloat));
      m[n] = local_of(n, st.tensor("exp_avg." + n));
      v[n] = local_of(n, st.tensor("exp_avg_sq." + n));
      if (ema_ckpt) e[n] = local_of(n, read_whole(*ema_ckpt, *b_.model, n, ema_dir(dir)).to(at::kFloat));
    }
    for (auto* o : {opt_.get(), eopt_.get()}) {
      if (!o) continue;
      o->load_full_state("param", p);
      o->load_full_state("exp_avg", m);
      o->load_full_state("exp_avg_sq", v);
      if (ema_ckpt) o->load_full_state("ema", e);
      o->set_steps(st.steps());
    }
    // Frozen parameters of this rank come from the checkpoint too.
    std::set<std::string> trained(all_names.begin(), all_names.end());
    const auto map = b_.model->checkpoint_tensors();
    for (auto& item : b_.model->named_parameters()) {
      const std::string& n = item.key();
      if (lora || trained.count(n) || item.value().numel() == 0) continue;
      bool stored = ckpt->contains(n);
      for (const auto& e : map)
        stored = stored || (e.param == n && ckpt->contains(e.name));  // per-expert or renamed (MTP layers)
      if (!stored) continue;
      item.value().copy_(local_of(n, read_whole(*ckpt, *b_.model, n, dir).to(at::kFloat)));
    }
    if (!lora) {
      const auto saved = checkpoint_buffers(*b_.model);
      for (auto& item : b_.model->named_buffers())
        if (saved.count(item.key()) && ckpt->contains(saved.at(item.key())))
          item.value().copy_(ckpt->tensor(saved.at(item.key())));
    }
    // The RNG continues where this rank left it when the layout's world size is the same.
    if (st.saved_world() == comm_->world()) {
      std::string file = shard_file("optimizer", comm_->rank(), st.saved_world());
      if (fs::exists(fs::path(dir) / file)) {
        auto f = io::SafetensorsFile::open((fs::path(dir) / file).string());
        if (f->contains("rng.cpu")) set_cpu_rng_state(f->tensor("rng.cpu"));
      }
    }
    return read_json_file((fs::path(dir) / "trainer_state.json").string());
  }

 private:
  ModelBundle b_;
  parallel::Layout layout_;
  at::Device device_;
  std::shared_ptr<parallel::Comm> comm_;
  std::unique_ptr<parallel::Mesh> mesh_;
  const parallel::Group *tp_ = nullptr, *cp_ = nullptr, *pp_ = nullptr, *dp_cp_ = nullptr, *mp_ = nullptr, *dp_ = nullptr;
  int64_t dp_index_ = 0, mb_ = 1;
  parallel::TensorParallelPlan plan_;
  std::unique_ptr<parallel::Pipeline> pipe_;
  std::vector<std::pair<std::string, double>> parts_;  // the last forward_backward's loss parts, summed over dp / cp
  std::shared_ptr<parallel::FullyShardedModel> fsdp_;
  std::unique_ptr<optim::DataParallelOptimizer> opt_, eopt_;  // eopt_: expert slices under parallel.ep (else null)
  parallel::ExpertParallelPlan ep_plan_;
  const parallel::Group* ep_ = nullptr;
  std::vector<std::string> saved_names_;
  bool router_losses_ = false;  // some MoE block has a router loss coefficient > 0
  models::BatchSchema schema_;
};

}  // namespace

std::unique_ptr<Engine> make_distributed_engine(const EngineOptions& o, ModelBundle bundle, at::Device device) {
  return std::make_unique<DistEngine>(o, std::move(bundle), device);
}

}  // namespace lf::train
