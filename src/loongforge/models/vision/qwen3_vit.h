// The Qwen3-VL vision transformer (transformers' Qwen3VLVisionModel). Like the Qwen2.5-VL tower (qwen_vit.h, whose
// attention, 2D rotary positions and patch layout it reuses) it takes flattened patches with each image's grid
// (t, h, w), but:
//   - the patch embedding (a Conv3d, one kernel per patch: a linear map here) has a bias;
//   - learned absolute positions `pos_embed` (num_position_embeddings = side^2 of them, a square grid) are
//     resampled bilinearly (align_corners) to each image's grid and added to the patch embeddings;
//   - the blocks are LayerNorm (with bias) -> attention -> LayerNorm -> linear_fc1 -> hidden_act -> linear_fc2;
//   - no window attention: every block attends within each frame;
//   - the merger is LayerNorm -> 2x2 patch concatenation -> linear_fc1 -> GELU -> linear_fc2, and "deepstack"
//     mergers (deepstack_merger_list.N, LayerNorm after the concatenation) turn the outputs of the blocks in
//     deepstack_visual_indexes into features the language model adds to its first hidden states (Qwen3.5's tower,
//     transformers' Qwen3_5VisionModel, is this one without them).
// Module names are transformers' (`patch_embed.proj`, `pos_embed`, `blocks.N.{norm1,attn.qkv,mlp.linear_fc1}`,
// `merger.norm`, `deepstack_merger_list.N.linear_fc1`).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>

#include <memory>
#include <string>
#include <vector>

#include "loongforge/models/vision/qwen_vit.h"
#include "loongforge/nn/linear.h"

namespace lf::models::vision {

// The Qwen2.5-VL fields that apply (window_size is set past any grid: one window per frame) and Qwen3-VL's own.
struct Qwen3VitConfig : QwenVitConfig {
  int64_t num_position_embeddings = 2304;
  std::vector<int64_t> deepstack_visual_indexes{8, 16, 24};

  int64_t grid_side() const;  // sqrt(num_position_embeddings), as transformers' int(n ** 0.5)
  // Parameters of the tower (patch embedding, positions, blocks), of the merger, of all deepstack mergers.
  int64_t num_tower_parameters() const;
  int64_t num_merger_parameters() const;
  int64_t num_deepstack_parameters() const;
  // transformers' Qwen3VLVisionConfig defaults for absent fields; `file` and `path` name it in errors. Without
  // `deepstack`: Qwen3.5's tower (Qwen3_5VisionConfig: the same fields, no deepstack_visual_indexes / mergers).
  static Qwen3VitConfig from_json(const nlohmann::json& j, const std::string& file, const std::string& path = "",
                                  bool deepstack = true);
};

class Qwen3VitMLPImpl : public torch::nn::Module {
 public:
  Qwen3VitMLPImpl(int64_t hidden, int64_t inner, std::string act);
  at::Tensor forward(const at::Tensor& x);
  nn::Linear linear_fc1{nullptr}, linear_fc2{nullptr};

 private:
  std::string act_;
};
TORCH_MODULE(Qwen3VitMLP);

class Qwen3VitBlockImpl : public torch::nn::Module {
 public:
  explicit Qwen3VitBlockImpl(const Qwen3VitConfig& c);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& segments);
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  QwenVitAttention attn{nullptr};
  Qwen3VitMLP mlp{nullptr};
};
TORCH_MODULE(Qwen3VitBlock);

// postshuffle: the deepstack mergers' LayerNorm over the concatenated 2x2 patches (else over each patch).
class Qwen3PatchMergerImpl : public torch::nn::Module {
 public:
  Qwen3PatchMergerImpl(const Qwen3VitConfig& c, bool postshuffle);
  at::Tensor forward(const at::Tensor& x);  // [T, hidden] -> [T / merge_unit, out_hidden_size]
  torch::nn::LayerNorm norm{nullptr};
  nn::Linear linear_fc1{nullptr}, linear_fc2{nullptr};

 private:
  bool postshuffle_;
};
TORCH_MODULE(Qwen3PatchMerger);

struct Qwen3VitOutput {
  at::Tensor merged;                  // [tokens, out_hidden_size], image after image (pooler_output)
  std::vector<at::Tensor> deepstack;  // one [tokens, out_hidden_size] per deepstack_visual_indexes entry
};

class Qwen3VisionTowerImpl : public torch::nn::Module {
 public:
  explicit Qwen3VisionTowerImpl(Qwen3VitConfig c);
  // pixel_values [patches, patch_dim] of the images of grid_thw [images, 3] (int64); `where` names them in errors.
  Qwen3VitOutput forward(const at::Tensor& pixel_values, const at::Tensor& grid_thw, const std::string& where = "batch");
  // transformers' _init_weights (normal(std) weights and embeddings, zero biases, unit norms); std < 0: the config's.
  void init_weights(double std);
  const Qwen3VitConfig& config() const { return c_; }
  bool recompute = false;  // each block recomputed in backward (activation recomputation)

  std::shared_ptr<torch::nn::Module> patch_embed;  // holds proj.weight [hidden, C, T, P, P] and proj.bias
  at::Tensor patch_weight, patch_bias;
  torch::nn::Embedding pos_embed{nullptr};
  torch::nn::ModuleList blocks{nullptr}, deepstack_merger_list{nullptr};
  Qwen3PatchMerger merger{nullptr};

 private:
  // The positions of the patches (in the processor's order) resampled from the square pos_embed grid.
  at::Tensor interpolated_positions(const at::Tensor& grid_thw, const at::Tensor& rows, const at::Tensor& cols);
  Qwen3VitConfig c_;
};
TORCH_MODULE(Qwen3VisionTower);

}  // namespace lf::models::vision
