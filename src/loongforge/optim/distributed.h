// The optimizer side of data parallelism: gradient synchronisation + AdamW (optim::AdamW's exact arithmetic) on
// this rank's shard of the parameters, for DDP, ZeRO-1 (distributed optimizer), ZeRO-3 (FSDP) and HSDP.
//
// Per step: set_sync(false) before each micro-batch's backward but the last (set_sync(true)); backward();
// finish_backward() after each backward; clip_grad_norm(max); step(lr); zero_grad(). clip_grad_norm and step call
// finish_backward themselves if needed. Gradients are summed over the data-parallel ranks (the trainer divides
// each micro-batch loss by the global number of counted tokens). Always zero gradients with this class's
// zero_grad() (DDP/ZeRO-1 parameter gradients are views of the reduction buckets).
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loongforge/optim/adamw.h"
#include "loongforge/parallel/comm.h"
#include "loongforge/parallel/data_parallel.h"

namespace lf::optim {

struct DataParallelOptions {
  int zero = 0;                      // 0: DDP, 1: ZeRO-1 (3: FSDP, built with parallel::fully_shard)
  int64_t bucket_bytes = 25 << 20;  // gradient bucket size (DDP / ZeRO-1)
};

class DataParallelOptimizer {
 public:
  // DDP (zero 0; pass the dp group as dp_replicate and a group of one as dp_shard) or ZeRO-1 (zero 1; dp_shard:
  // the ranks splitting the optimizer state, dp_replicate: a group of one, or the replicas for a hybrid). The
  // parameters become views of flat buckets. weight_decay: one per parameter (empty: the options' value);
  // count_in_norm: one per parameter (empty: all true); model_parallel: the group over which the squared norm is
  // summed as well (tensor/pipeline parallel ranks), null for none. Throws lf::Error for zero not in {0, 1}.
  DataParallelOptimizer(std::vector<std::string> names, std::vector<at::Tensor> params,
                        std::vector<double> weight_decay, AdamWOptions opts, const parallel::Group& dp_replicate,
                        const parallel::Group& dp_shard, DataParallelOptions dp = {},
                        const parallel::Group* model_parallel = nullptr, std::vector<bool> count_in_norm = {});
  // Over an engine (ZeRO-3/HSDP: parallel::fully_shard's result). weight_decay / count_in_norm follow
  // engine->names().
  DataParallelOptimizer(std::shared_ptr<parallel::GradSync> engine, std::vector<double> weight_decay,
                        AdamWOptions opts, const parallel::Group* model_parallel = nullptr,
                        std::vector<bool> count_in_norm = {});

  void set_sync(bool last_micro_batch) { engine_->set_sync(last_micro_batch); }
  void finish_backward() { engine_->finish_backward(); }
  // The global 2-norm of the gradients before clipping (norm^2 summed over the shard ranks and model_parallel,
  // counting only count_in_norm parameters); scales them like torch.nn.utils.clip_grad_norm_ when max_norm > 0.
  double clip_grad_norm(double max_norm);
  // The two halves of clip_grad_norm, for callers combining several optimizers (expert parallelism): the squared
  // norm (summed over the shard ranks and model_parallel, count_in_norm parameters only), and the clipping of the
  // gradients given the global norm `total` (a no-op unless max_norm > 0).
  double grad_sq_norm();
  void scale_grads(double total, double max_norm);
  void step(double lr);
  // Learning-rate multipliers by parameter name (absent: 1), as AdamW::set_lr_scale.
  void set_lr_scale(const std::map<std::string, double>& by_name);
  void zero_grad() { engine_->zero_grad(); }
  int64_t steps() const { return adam_->steps(); }
  void set_steps(int64_t s) { adam_->set_steps(s); }
  // An average of this rank's shard of the parameters (AdamW::enable_ema); full_state("ema") gathers it.
  void enable_ema(const EmaOptions& o) { adam_->enable_ema(o); }
  bool has_ema() const { return adam_->has_ema(); }
  const std::vector<std::string>& names() const { return engine_->names(); }
  parallel::GradSync& engine() { return *engine_; }

  // Collective over the shard group: the whole "exp_avg", "exp_avg_sq", "ema" or "param" (master values) of every
  // parameter, by name, in host memory (for checkpoints; steps() is the step count).
  std::map<std::string, at::Tensor> full_state(const std::string& which) const;
  // Sets this rank's shard of `which` from whole tensors by name (same values on every rank); "param" also
  // refreshes the model's parameters (collective).
  void load_full_state(const std::string& which, const std::map<std::string, at::Tensor>& state);

 private:
  void init(std::vector<double> weight_decay, AdamWOptions opts, std::vector<bool> count_in_norm);
  at::Tensor& state_of(const std::string& which, size_t piece) const;
  std::shared_ptr<parallel::GradSync> engine_;
  const parallel::Group* model_parallel_ = nullptr;
  struct PieceRef {
    size_t shard;
    parallel::FlatShard::Piece piece;
  };
  std::vector<PieceRef> pieces_;
  std::vector<bool> counted_;  // per piece
  mutable std::vector<at::Tensor> param_views_, grad_views_;
  std::unique_ptr<AdamW> adam_;
};

}  // namespace lf::optim
