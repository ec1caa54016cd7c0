// The model contract: what every family (decoder LMs, and next vision-language models, diffusion transformers, robot
// policies) gives the layers above models/. train/, parallel/, io/ and cli/ see only this interface and the family
// registry (models/registry.h); nothing above models/ names a family.
//
// A model is a plain torch::nn::Module tree whose parameter names are the names of the checkpoint format its users
// exchange (Hugging Face, diffusers, LeRobot), up to the declarative mapping checkpoint_tensors() gives. It runs as
//   embed(batch) -> blocks [0, num_blocks()) -> post_blocks -> head_loss_sum(batch)
// and says how it may be split: the modules before the repeated blocks, the blocks, the modules after them
// (pipeline stages and FSDP units come from these), a tensor-parallel plan given as data (module-name patterns ->
// styles, as torchtitan's parallelize plans), its attention modules behind one hook (context parallelism and
// per-document attention install themselves there) and its mixture-of-experts blocks (expert parallelism, router
// losses). Parallel layouts are applied to the plain model from outside, through these.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/models/batch.h"
#include "loongforge/nn/attention.h"
#include "loongforge/nn/moe.h"

namespace lf::models {

// One checkpoint tensor and the model tensor (or slice) it fills. Hub checkpoints may store per-expert tensors
// where the model stacks them: entry `name` fills param[index, begin:end] (along dim 1 of the parameter); with
// index < 0, the rows param[begin:end] when end > begin (Kimi Linear's q/k/v convolutions of one fused weight), else
// the whole tensor `param` (a buffer when `buffer`). Loading and export apply this list.
struct CheckpointTensor {
  std::string name, param;
  int64_t index = -1, begin = 0, end = 0;
  bool buffer = false;
};
// The view of `t` (the tensor named entry.param) that entry fills.
at::Tensor checkpoint_slice(const at::Tensor& t, const CheckpointTensor& entry);

// How the model splits into pipeline stages / FSDP units: module names (as named_modules() gives them).
struct Split {
  std::vector<std::string> pre;   // before the blocks (first stage): e.g. the embedding
  std::string blocks;             // the ModuleList of repeated blocks: block i is "<blocks>.<i>"
  std::vector<std::string> post;  // after the blocks (last stage): final norm, output head
  // Parameters the pre and post pieces share (tied embeddings): the last stage keeps a copy, gradients are summed.
  std::vector<std::string> tied;
  // Modules inside a block that pieces outside it use too (DiT's output layer is conditioned through block 0's
  // embedder): FSDP keeps them in its root unit (gathered throughout) rather than in their block's.
  std::vector<std::string> shared;
};

// Tensor parallelism as data: each module whose name matches a rule's pattern (std::regex_match, first rule wins)
// is parallelised in that style; unmatched modules are replicated. A "region" is a stretch of the block computed on
// whole (replicated, full-sequence) activations split by heads or ffn columns: it starts at an entry (copy to the tp
// group, or an all-gather of the sequence under sequence parallelism) and ends at an exit (a sum over tp, or a
// reduce-scatter of the sequence).
enum class TpStyle {
  Colwise,           // Linear, output rows (and bias) split over tp; region entry on its input
  ColwiseInside,     // Linear, output rows split; inside a region (no entry of its own)
  Rowwise,           // Linear, input columns split; region exit on its output (whole bias added once, after the sum)
  RowwiseInside,     // Linear, input columns split; inside a region whose exit sums (e.g. MoE shared experts)
  ReplicatedEntry,   // Linear, whole; region entry on its input (its gradient is partial: summed over tp)
  ReplicatedInside,  // whole parameters inside a region (per-head norms, latent norms): gradients summed over tp
  VocabEmbedding,    // Embedding, vocabulary rows split; ids outside the slice give zeros, summed over tp
  VocabHead,         // output projection, vocabulary rows split; the loss never gathers whole logits
  ReplicatedWhole,   // a module tree kept whole that runs on whole inputs on every rank before the sequence is cut
                     // (a VLM's vision tower), or one computing the same thing on every rank from whole inputs
                     // (DeepSeek sparse attention's indexer): its gradients are complete on each rank, under sp too
  WholeEntry,        // Linear of such a ReplicatedWhole module reading the block's activation: whole, region entry
                     // on its input (whole sequence under sp), its gradient complete on each rank (never summed)
  ShardedInside,     // a module's own parameters (not a linear layer) split along their first dimension longer
                     // than 1 inside a region: per-head vectors (also [1, 1, H, 1]), a depthwise convolution's
                     // channels (linear attention)
};
struct TpRule {
  std::string pattern;
  TpStyle style;
  // The split dimension holds stacked blocks of these sizes (a fused [q | k | v] projection or convolution): each
  // rank keeps its chunk of every block, stacked the same way. Empty: one block.
  std::vector<int64_t> blocks = {};
};
struct TensorParallelSpec {
  std::vector<TpRule> rules;
  // Sizes tp must divide, by the config field that sets them ("num_attention_heads", 8).
  std::vector<std::pair<std::string, int64_t>> divisible;
};

// What a diffusion model's autoencoder (a VAE) gives the tools above models/ (`data encode`, `sample --images`, the
// trainer's sample grids): pixels in [-1, 1], [B, C, H, W] for image VAEs, [B, C, frames, H, W] for video VAEs.
class LatentCodec {
 public:
  virtual ~LatentCodec() = default;
  // The posterior's (mean, logvar), unscaled latents.
  virtual std::pair<at::Tensor, at::Tensor> encode_latents(const at::Tensor& pixels) = 0;
  // Unscaled latents -> pixels.
  virtual at::Tensor decode_latents(const at::Tensor& z) = 0;
  // The denoiser's latent space as the reference pipelines feed it: normalize (e.g. (z - shift) * scaling_factor, or
  // Wan's per-channel (z - mean) / std) and its inverse.
  virtual at::Tensor normalize_latents(const at::Tensor& z) const = 0;
  virtual at::Tensor denormalize_latents(const at::Tensor& z) const = 0;
  virtual int64_t latent_channels() const = 0;
  virtual int64_t pixel_channels() const = 0;
  // Pixels per latent along height/width, and frames per latent frame (1: an image VAE; video VAEs map
  // 1 + temporal * k frames to 1 + k latent frames).
  virtual int64_t spatial_factor() const = 0;
  virtual int64_t temporal_factor() const { return 1; }
  virtual bool video() const { return false; }
};

class Model : public torch::nn::Module {
 public:
  ~Model() override = default;

  // ---- identity and config ----
  virtual std::string family() const = 0;      // the registry's family name
  virtual std::string model_type() const = 0;  // as the checkpoint's ecosystem names it (config.json)
  // The config as written to a checkpoint's config.json (the file read, fields preserved).
  virtual const nlohmann::json& config_json() const = 0;
  // transformers' / diffusers' initialisation for training from scratch (std < 0: the config's).
  virtual void init_weights(double std) = 0;

  // ---- batches and losses ----
  virtual BatchSchema batch_schema() const = 0;
  // The number of loss terms of a batch (counted tokens, samples): the step's loss is the sum over every term of
  // its micro-batches divided by their number.
  virtual int64_t loss_terms(const Batch& b) const = 0;
  // Training FLOPs (forward + backward) per sample of a batch with sequence length `seq` (MFU).
  virtual double train_flops_per_sample(int64_t seq) const = 0;
  // Training FLOPs (forward + backward) of a sample's parts, for data-parallel load balancing (data/balance.h):
  // per language-model token through the linear layers and per (query, key) pair of one document's attention; per
  // patch through the vision modules and per pair of patches of one image (0 without vision modules). An image of t
  // image tokens has t * patches_per_image_token patches, or fixed_image_patches when that is > 0.
  struct TrainWork {
    double per_token = 0, per_token_pair = 0, per_patch = 0, per_patch_pair = 0;
    int64_t patches_per_image_token = 1, fixed_image_patches = 0;
  };
  // The default reads the language-model terms off train_flops_per_sample (a * seq + b * seq^2), no vision.
  virtual TrainWork train_work() const;

  // The pieces of a forward, for engines that run part of the model (pipeline stages, FSDP units):
  // the input of block 0 (pre modules);
  virtual at::Tensor embed(const Batch& b) = 0;
  // what the blocks read besides the activations (positions, rotary tables, document ids), once per batch;
  virtual Batch block_inputs(const Batch& b, at::ScalarType dtype) const = 0;
  // block i on h, as is (no recomputation);
  virtual at::Tensor block_forward(const Batch& inputs, const at::Tensor& h, int64_t i) = 0;
  // block_forward = block_after(block_body): the body is what recomputation reruns and FSDP units shard (the
  // block's own parameters); block_after adds what comes from outside the block with gradients of its own (Qwen3-VL's
  // deepstack features), run by the engines with the graph kept. Default: all body.
  virtual at::Tensor block_body(const Batch& inputs, const at::Tensor& h, int64_t i) { return block_forward(inputs, h, i); }
  virtual at::Tensor block_after(const Batch& inputs, const at::Tensor& y, int64_t i) { return y; }
  // the post modules up to the loss head (final norm);
  virtual at::Tensor post_blocks(const at::Tensor& h) = 0;
  // the loss head: the summed loss over the batch's terms from post_blocks' output (float32 scalar).
  virtual at::Tensor head_loss_sum(const at::Tensor& h, const Batch& b) = 0;
  // The width of the activations between blocks ([rows, sequence, width]).
  virtual int64_t hidden_size() const = 0;
  // The shape of the activations between blocks of a batch of `rows` sequences of `seq` tokens (pipeline stages
  // exchange them): [rows, seq, hidden_size()] unless the model says otherwise (DeepSeek-V4's hc_mult streams).
  virtual std::vector<int64_t> activation_shape(int64_t rows, int64_t seq) const { return {rows, seq, hidden_size()}; }
  virtual int64_t num_blocks() const = 0;

  // Blocks [begin, end) with recomputation as set_recompute says (recomputed MoE blocks backpropagate their router
  // losses in the recomputation through layer_loss_fn).
  at::Tensor run_blocks(const Batch& inputs, at::Tensor h, int64_t begin, int64_t end);
  // The whole forward to post_blocks' output.
  at::Tensor forward_hidden(const Batch& b);
  // The loss of a micro-batch: head_loss_sum plus the MoE router losses of this forward weighted by its terms (see
  // aux_loss), and its terms. backward_scale: the factor the caller multiplies the loss by before backward (1 / the
  // step's terms), for recomputed layers' router losses (0: not set up). terms < 0: loss_terms(b).
  std::pair<at::Tensor, int64_t> loss(const Batch& b, double backward_scale = 0, int64_t terms = -1);

  // `loongforge dump`: a forward on a batch given under the names of the family's reference library (transformers:
  // input_ids, optional labels): its outputs (logits) and the loss that library computes. The batch is checked here
  // (dtypes, shapes, ranges; errors name `file` and the tensor).
  struct ReferenceOutput {
    std::vector<std::pair<std::string, at::Tensor>> outputs;
    at::Tensor loss;
  };
  virtual ReferenceOutput reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) = 0;

  // Denoising models: the conditions of an unconditional prediction for classifier-free guidance, given the
  // conditional ones under the reference library's names (DiT: the class labels replaced by the "no label" class).
  // The default: lf::Error (the model has no unconditional input).
  virtual std::map<std::string, at::Tensor> unconditional(const std::map<std::string, at::Tensor>& conditions,
                                                          const std::string& file) const;

  // Autoencoders give their latent space (nullptr: not an autoencoder).
  virtual LatentCodec* latent_codec() { return nullptr; }

  // ---- how it splits ----
  virtual Split split() const = 0;
  virtual TensorParallelSpec tensor_parallel_spec() const = 0;
  // Every attention module, in block order (empty: none).
  virtual std::vector<nn::AttentionHook*> attention_modules() = 0;
  // The MoE blocks with the index of the block holding them, in block order (empty for dense models).
  virtual std::vector<std::pair<int64_t, nn::MoEImpl*>> moe_layers() const { return {}; }
  std::vector<nn::MoEImpl*> moe_blocks() const;
  // The block module i (its parameters: FSDP units, recomputation); the default looks "<split().blocks>.<i>" up.
  virtual torch::nn::Module& block(int64_t i);
  // Vision-language models: the token that stands for image features in input_ids and how many of them one image
  // takes (0: as many as the image processor's patch grid gives, grid_h * grid_w / merge_size^2), and the tokens
  // the model's chat template writes around each image's run (Qwen's <|vision_start|>, <|vision_end|>; -1: none).
  // nullopt: the model takes no images.
  struct ImageTokens {
    int64_t token_id = -1;
    int64_t per_image = 0;
    int64_t start_id = -1, end_id = -1;
  };
  virtual std::optional<ImageTokens> image_tokens() const { return std::nullopt; }
  // False when the model's backward must not run on several CPU threads at once (the row-split engine,
  // parallel/thread_split.h): ATen's CPU convolutions give wrong weight gradients there, so models with
  // convolutions (VAEs) say false; patch embeddings are written as GEMMs instead.
  virtual bool thread_split_safe() const { return true; }
  // An empty string when a CUDA graph may capture a training step; else why not (one line).
  virtual std::string cuda_graph_blocker() const { return ""; }

  // ---- checkpoints ----
  // The weights' file name in a saved folder, without ".safetensors" (transformers: "model"; diffusers:
  // "diffusion_pytorch_model"), and whether config.json records the weights' dtype (transformers' "dtype"; diffusers'
  // configs do not).
  virtual std::string weights_file_stem() const { return "model"; }
  virtual bool config_records_dtype() const { return true; }
  // Checkpoint names <-> model tensors; every parameter not listed maps to itself.
  virtual std::vector<CheckpointTensor> checkpoint_tensors() const;
  // Checkpoint tensors loading may skip (tied copies, buffers older versions saved).
  virtual bool ignorable_checkpoint_tensor(const std::string& name) const { return false; }
  // The name checkpoint_tensors() uses for a tensor stored under another key layout the family's library also
  // loads (older exports, in-memory names): loading renames every stored name through this first.
  virtual std::string canonical_checkpoint_name(const std::string& stored) const { return stored; }
  // The name the reference library gives the parameter behind checkpoint tensor `name` in memory (transformers'
  // named_parameters()): `dump` writes grad.<this>. Usually the checkpoint name itself.
  virtual std::string reference_name(const std::string& checkpoint_name) const { return checkpoint_name; }
  // Pretrained weights a model built from its config alone starts from, as its ecosystem builds it (LeRobot's
  // GrootPolicy loads base_model_path's GR00T checkpoint): DIR's tensors, each under prefix + its stored name, fill
  // the checkpoint tensors named with that prefix (io::load_part). None by default: a config alone is random init.
  struct BaseWeights {
    std::string dir, prefix;
  };
  virtual std::optional<BaseWeights> base_weights() const { return std::nullopt; }

  // ---- hooks layouts install (see the layouts in parallel/) ----
  // Replaces the vocabulary head's summed cross-entropy (vocabulary-parallel layouts): hidden [.., H], the output
  // weight [V_local, H], targets (-100 ignored) -> float32 sum.
  std::function<at::Tensor(const at::Tensor& h, const at::Tensor& weight, const at::Tensor& targets)> vocab_loss_fn;
  // Replaces the embedding lookup (vocabulary-parallel layouts).
  std::function<at::Tensor(const at::Tensor& ids)> embed_fn;
  // Models whose embed() adds more than token embeddings (image features at image tokens) say so here: layouts
  // that cut the sequence of the blocks' input (sequence parallelism) then give them whole sequences from embed_fn
  // and install scatter_sequence_fn, which embed() applies to its result last.
  virtual bool merges_embeddings() const { return false; }
  std::function<at::Tensor(const at::Tensor& h)> scatter_sequence_fn;
  // Models whose token sequence exists only inside the model (diffusion transformers patchify latents in embed(); the
  // batch has no sequence field) say so here: context parallelism then installs cut_sequence_fn, and the model
  // applies it to every per-token tensor along its sequence dim `dim`: embed()'s result, per-token block inputs
  // (rotary tables) and the head's targets as tokens, so head_loss_sum sums over this rank's tokens only while
  // loss_terms still counts the whole batch (the engine sums losses and gradients over the cp ranks). The cut is
  // differentiable (backward: the part's gradient in place, zeros elsewhere; per-row conditions stay whole on every
  // rank, their gradients partial). Every attention module of such a model is bidirectional.
  virtual bool sequence_inside() const { return false; }
  std::function<at::Tensor(const at::Tensor& x, int64_t dim)> cut_sequence_fn;
  // Applies cut_sequence_fn when set (x unchanged otherwise).
  at::Tensor cut_sequence(const at::Tensor& x, int64_t dim) const {
    return cut_sequence_fn ? cut_sequence_fn(x, dim) : x;
  }
  // An empty string when pipeline parallelism can split the model into stages; else why not (one line).
  virtual std::string pipeline_blocker() const { return ""; }

  // ---- activation recomputation ----
  // Every n-th block (0: none; 1: all). Recomputed MoE blocks make their router statistics in the graph-free forward
  // too (MoEImpl::force_stats).
  void set_recompute(int64_t every_n_blocks);
  bool recomputed(int64_t block) const { return recompute_every_ > 0 && block % recompute_every_ == 0; }
  // The layers of the modules before the blocks (a VLM's vision tower) recomputed in backward too; false when the
  // model has no such layers.
  virtual bool set_pre_recompute(bool on) { return false; }
  // Router losses of a recomputed block (index), called in its backward recomputation (unset: none).
  std::function<at::Tensor(int64_t block)> layer_loss_fn;

  // ---- mixture of experts (no-ops for dense models) ----
  // Router losses of the last forward with gradients, to add to the mean loss (undefined when none):
  // aux_loss_coef * transformers' load_balancing_loss_func over all MoE blocks (statistics pooled across blocks) +
  // every block's sequence-level and z-loss terms.
  at::Tensor aux_loss() const;
  // This rank's share of the router losses when every micro-batch is split over data-parallel ranks (rows), in two
  // halves. aux_stats: the statistics of the blocks [begin, end) (end < 0: all) with `reduce` summing a tensor over
  // those ranks in place (collective; called once whenever any block of the range has router losses). aux_share:
  // the share of the blocks [lo, hi) from those statistics; the shares sum over the ranks to aux_loss() of the whole
  // micro-batch in one process. with_lb = false leaves the pooled load-balancing loss out (pipeline stages pool it
  // later: lb_prob_sum and lb_share).
  struct AuxStats {
    at::Tensor counts;  // [E] float64: expert assignments pooled over blocks and ranks
    double rows = 0, tokens = 0, sequences = 0;
    bool any = false;
  };
  AuxStats aux_stats(const std::function<void(at::Tensor&)>& reduce, int64_t begin = 0, int64_t end = -1) const;
  at::Tensor aux_share(const AuxStats& st, int64_t lo = 0, int64_t hi = -1, bool with_lb = true) const;
  at::Tensor lb_prob_sum(int64_t begin, int64_t end) const;
  at::Tensor lb_share(const at::Tensor& prob_sum, const at::Tensor& counts, double rows) const;
  // Aux-loss-free bias updates of every block; call after the optimizer step.
  void update_moe_bias();
  // Training options of every MoE block: load-balancing coefficient (aux_loss_coef < 0: the config's), sequence-level
  // and z-loss coefficients, aux-loss-free bias update rate, capacity factor. lf::Error naming the option
  // ("bias_update_rate") when a block cannot take it.
  void set_moe_training(double aux_loss_coef, double seq_aux_loss_coef, double z_loss_coef, double bias_update_rate,
                        double capacity_factor);

  // ---- optional parts and extra losses (DeepSeek-V3's multi-token prediction layers) ----
  // Loading calls this with every tensor name the checkpoint stores (after canonical_checkpoint_name) before it checks
  // them: the model drops the optional parts the checkpoint lacks (an empty set drops every optional part: a run from
  // scratch that does not train them). Default: none.
  virtual void drop_absent_parts(const std::set<std::string>& stored) {}
  // The weight of the multi-token prediction loss in training (0: not trained): "" when taken, else why not (one line).
  virtual std::string set_mtp_loss_weight(double weight) {
    return weight == 0 ? "" : "the " + model_type() + " model has no multi-token prediction layers";
  }
  // Training the sparse-attention indexers (DeepSeek-V3.2's lightning indexers; frozen when loss_coef is 0): their
  // KL loss weighted by loss_coef, and dense_warmup for the warm-up stage (dense attention, every other parameter
  // frozen). "" when taken, else why not (one line).
  virtual std::string set_indexer_training(double loss_coef, bool dense_warmup) {
    return loss_coef == 0 && !dense_warmup ? "" : "the " + model_type() + " model has no sparse-attention indexer";
  }
  // The loss parts the training forwards added since the last call (name, summed over their terms, detached), for the
  // metrics line (divided by the step's counted tokens there); the same names on every rank.
  virtual std::vector<std::pair<std::string, double>> take_loss_parts() { return {}; }

 protected:
  Model() = default;
  double router_aux_loss_coef_ = 0;  // set by families with MoE blocks (the config's router_aux_loss_coef)

 private:
  int64_t recompute_every_ = 0;
};

// Every checkpoint tensor of a model with the model tensor (or slice) it fills: copy_ into it loads, reading it
// exports.
std::vector<std::pair<std::string, at::Tensor>> checkpoint_targets(Model& model);

}  // namespace lf::models
