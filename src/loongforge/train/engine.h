// How the trainer runs one step on this process: the single-process engine (trainer.cpp) or the distributed one
// (dist_engine.cpp: the layouts of parallel/ applied to the plain model). The trainer's loop, data, logging and
// schedule are the same for both.
#pragma once
#include <nlohmann/json.hpp>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loongforge/models/model.h"
#include "loongforge/optim/adamw.h"
#include "loongforge/parallel/layout.h"
#include "loongforge/train/batch.h"
#include "loongforge/train/checkpoint.h"

namespace lf::train {

// The model as the recipe builds it (full, on every process), with the parameters the optimizer updates.
struct ModelBundle {
  std::shared_ptr<models::Model> model;
  TrainableSet trainable;
  std::vector<double> weight_decay;
  std::vector<double> lr_scale;  // optim.lr_multipliers, one per trainable parameter (empty: all 1)
  std::string tokenizer;
};

// bf16 autocast on `device` while it lives (on = false: nothing); leaving turns it off and drops the cached casts.
class Bf16Autocast {
 public:
  Bf16Autocast(at::DeviceType device, bool on);
  ~Bf16Autocast();
  Bf16Autocast(const Bf16Autocast&) = delete;
  Bf16Autocast& operator=(const Bf16Autocast&) = delete;

 private:
  at::DeviceType device_;
  bool on_;
};

// The batch on `device`: host tensors copied from pinned memory without waiting (queued on the stream).
Batch batch_to_device(const Batch& b, const at::Device& device);

class Engine {
 public:
  virtual ~Engine() = default;
  // Forward and backward over the step's micro-batches. Each Batch holds this process's rows of a global
  // micro-batch (local_rows: data-parallel size x micro_batch_size rows in all); `counted` is the step's global
  // number of counted tokens (global_counted). Returns the global loss sum.
  virtual double forward_backward(const std::vector<Batch>& micro, int64_t counted, bool bf16) = 0;
  // Global gradient norm before clipping; clips when max_norm > 0.
  virtual double clip_grad_norm(double max_norm) = 0;
  virtual void step(double lr) = 0;
  virtual void zero_grad() = 0;
  // Global loss sum and counted tokens of a global batch (given as this process's rows), without gradients.
  virtual std::pair<double, int64_t> eval_loss(const Batch& b) = 0;
  virtual std::string save(const std::string& root, int64_t step, const nlohmann::json& trainer_state,
                           const std::string& tokenizer, int keep) = 0;
  virtual nlohmann::json load(const std::string& dir) = 0;
  // Rank 0 (or the only process) writes logs and metrics.
  virtual bool is_main() const { return true; }
  // The data-parallel size: global micro-batches hold this many times micro_batch_size rows.
  virtual int data_parallel() const { return 1; }
  // This process's data-parallel rank (0 .. data_parallel() - 1).
  virtual int data_parallel_rank() const { return 0; }
  // The rows [first, first + n) of each global micro-batch (data_parallel() x micro_batch_size rows) this process
  // reads (BatchSource::next_rows).
  virtual std::pair<int64_t, int64_t> local_rows(int64_t micro_batch_size) const {
    return {0, micro_batch_size * data_parallel()};
  }
  // The global number of counted tokens from this process's count over its rows (a sum over data-parallel ranks).
  virtual int64_t global_counted(int64_t local) { return local; }
  virtual void barrier() {}
  // Same value on every rank (e.g. the number of checkpoints found), decided by rank 0.
  virtual int64_t agree(int64_t v) { return v; }
  // Extra entries for this step's metrics line (no collectives; called on every rank after step()): the MoE
  // replication plans' mean overload with and without guests, and the tokens replicas computed (parallel.ep).
  virtual nlohmann::json step_metrics() { return nlohmann::json::object(); }
  // The loss parts of the last forward_backward (models::Model::take_loss_parts), summed over the data-parallel ranks.
  virtual std::vector<std::pair<std::string, double>> loss_parts() { return {}; }
  // Runs fn on the main process with the whole model as it stands (with the weight average's values instead when
  // `average` and the run keeps one), then puts the weights back; collective. False (fn not run anywhere) when the
  // layout keeps no whole model on the main process (tp, pp, cp, ep, FSDP).
  virtual bool with_whole_model(bool average, const std::function<void(models::Model&)>& fn) = 0;
};

// What the engines take from a recipe, read and checked once (builders.h: engine_options); the engines never look
// recipe keys up themselves.
struct EngineOptions {
  optim::AdamWOptions adamw;
  std::string precision = "fp32";  // fp32 | bf16 | fp8
  bool cuda_graphs = false;        // train.cuda_graphs
  int64_t cpu_split = 0;           // train.cpu_split (0: one part per CPU thread, 1: off)
  bool random_adapters = false;    // LoRA adapters with dropout (draw random numbers)
  int64_t micro_batch_size = 1, grad_accum = 1, seq_len = 0;
  parallel::Layout layout;         // parallel.*
  std::string backend = "auto";    // parallel.backend
  int64_t vocab_granule = 1;       // parallel.vocab_granule
  int guest_slots = 0, ranks_per_node = 0;  // moe.guest_slots, moe.ranks_per_node
  optim::EmaOptions ema;                     // ema.* (decay 0: none): an average of the trained weights
};

// The distributed engine for the layout (dist_engine.cpp); takes the full model.
// device: where the model, batches and optimizer state live (each rank's local GPU, or the CPU).
std::unique_ptr<Engine> make_distributed_engine(const EngineOptions& options, ModelBundle bundle,
                                                at::Device device = at::Device(at::kCPU));

}  // namespace lf::train
