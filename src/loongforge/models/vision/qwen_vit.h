// The Qwen2.5-VL vision transformer (transformers' Qwen2_5_VisionTransformerPretrainedModel): images arrive as
// flattened patches ([patches, C * temporal_patch_size * patch_size^2], the Qwen2-VL image processor's
// pixel_values, images one after the other) with each image's grid (t, h, w) in patches. A patch embedding (a
// Conv3d without bias, one kernel per patch: a linear map here), 2D rotary positions (row and column of each patch,
// half the rotary frequencies each), pre-norm blocks (RMSNorm, attention with a fused qkv, RMSNorm, SwiGLU MLP with
// biases) and the patch merger (RMSNorm, each 2x2 group of patches concatenated, mlp.0 -> GELU -> mlp.2) to the
// language model's width.
//
// Attention never crosses an image frame; most blocks attend within windows of window_size pixels (the tokens are
// reordered so that each window is contiguous, as transformers does, and ordered back after the merger), the blocks
// in fullatt_block_indexes over the whole frame. Windows and frames are segments of one packed sequence
// (nn::full_attention with segment ids, through each block's nn::AttentionHook).
//
// Module names are transformers' (`patch_embed.proj`, `blocks.N.attn.qkv`, `blocks.N.mlp.gate_proj`,
// `merger.ln_q`, `merger.mlp.0`). A component of the vision-language family (models/vlm), not a family itself.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/nn/attention.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/rms_norm.h"

namespace lf {
class JsonReader;
}

namespace lf::models::vision {

struct QwenVitConfig {
  int64_t depth = 32, hidden_size = 3584, intermediate_size = 3420, num_heads = 16, in_channels = 3;
  int64_t patch_size = 14, temporal_patch_size = 2, spatial_merge_size = 2, window_size = 112;
  int64_t out_hidden_size = 3584, tokens_per_second = 4;
  std::vector<int64_t> fullatt_block_indexes{7, 15, 23, 31};
  std::string hidden_act = "silu";
  double rope_theta = 10000.0, initializer_range = 0.02;
  nlohmann::json raw;

  int64_t head_dim() const { return hidden_size / num_heads; }
  int64_t patch_dim() const { return in_channels * temporal_patch_size * patch_size * patch_size; }
  int64_t merge_unit() const { return spatial_merge_size * spatial_merge_size; }
  // Parameters of the tower without / of the merger.
  int64_t num_tower_parameters() const;
  int64_t num_merger_parameters() const;
  // The fields both Qwen ViTs read (sizes, heads, activation, axial rope; absent: as set), checked; a model_type
  // other than `model_types` is an error naming the first.
  void read_common(const JsonReader& r, const std::vector<std::string>& model_types);
  // transformers' Qwen2_5_VLVisionConfig defaults for absent fields; `file` and `path` name it in errors.
  static QwenVitConfig from_json(const nlohmann::json& j, const std::string& file, const std::string& path = "");
};

// Where the patches of a batch of images go (computed on the host from grid_thw [images, 3]).
struct QwenVitLayout {
  at::Tensor order;        // [patches] int64: the window-major order of the patches (transformers' window_index)
  at::Tensor unit_back;    // [patches / merge_unit] int64: merged tokens back to image order
  at::Tensor rows, cols;   // [patches] int64, in window order: each patch's row / column in its image
  at::Tensor window_segments, frame_segments;  // [1, patches] int64, in window order
  std::vector<int64_t> tokens;  // merged tokens per image
};
// `where` names the batch in errors (grids not divisible by the merge size).
QwenVitLayout qwen_vit_layout(const QwenVitConfig& c, const at::Tensor& grid_thw, const std::string& where);

// The 2D rotary tables (cos, sin [1, T, head_dim]) of patches at rows / cols [T] (int64) on `device`: the first half
// of the frequencies turn with the row, the second with the column.
std::pair<at::Tensor, at::Tensor> qwen_vit_rotary(const QwenVitConfig& c, const at::Tensor& rows, const at::Tensor& cols,
                                                  const at::Device& device);

// An error naming `where` unless pixel_values is [the layout's patches, patch_dim].
void check_qwen_vit_pixels(const QwenVitConfig& c, const QwenVitLayout& lay, const at::Tensor& pixel_values,
                           const std::string& where);
// transformers' _init_weights of the Qwen ViTs: zero biases, unit norms (names with norm / ln_q), normal(std) else.
void init_qwen_vit_weights(torch::nn::Module& tower, double std);

class QwenVitAttentionImpl : public torch::nn::Module, public nn::AttentionHook {
 public:
  QwenVitAttentionImpl(int64_t hidden, int64_t heads);
  // x [T, hidden] (one packed sequence), cos/sin [1, T, head_dim], segments [1, T] -> [T, hidden].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& segments);
  nn::Linear qkv{nullptr}, proj{nullptr};
  int64_t head_dim;
};
TORCH_MODULE(QwenVitAttention);

class QwenVitMLPImpl : public torch::nn::Module {
 public:
  QwenVitMLPImpl(int64_t hidden, int64_t inner, std::string act);
  at::Tensor forward(const at::Tensor& x);
  nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  std::string act_;
};
TORCH_MODULE(QwenVitMLP);

class QwenVitBlockImpl : public torch::nn::Module {
 public:
  explicit QwenVitBlockImpl(const QwenVitConfig& c);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& segments);
  nn::RMSNorm norm1{nullptr}, norm2{nullptr};
  QwenVitAttention attn{nullptr};
  QwenVitMLP mlp{nullptr};
};
TORCH_MODULE(QwenVitBlock);

class QwenPatchMergerImpl : public torch::nn::Module {
 public:
  explicit QwenPatchMergerImpl(const QwenVitConfig& c);
  at::Tensor forward(const at::Tensor& x);  // [T, hidden] -> [T / merge_unit, out_hidden_size]
  nn::RMSNorm ln_q{nullptr};
  nn::Linear fc1{nullptr}, fc2{nullptr};  // mlp.0, mlp.2
};
TORCH_MODULE(QwenPatchMerger);

class QwenVisionTowerImpl : public torch::nn::Module {
 public:
  explicit QwenVisionTowerImpl(QwenVitConfig c);
  // pixel_values [patches, patch_dim] of the images of grid_thw [images, 3] (int64) -> the merged features
  // [patches / merge_unit, out_hidden_size], image after image (transformers' pooler_output).
  at::Tensor forward(const at::Tensor& pixel_values, const at::Tensor& grid_thw, const std::string& where = "batch");
  // transformers' _init_weights (normal(std) weights, zero biases, unit norms); std < 0: the config's.
  void init_weights(double std);
  const QwenVitConfig& config() const { return c_; }
  bool recompute = false;  // each block recomputed in backward (activation recomputation)

  std::shared_ptr<torch::nn::Module> patch_embed;  // holds proj.weight [hidden, C, T, P, P]
  at::Tensor patch_weight;
  torch::nn::ModuleList blocks{nullptr};
  QwenPatchMerger merger{nullptr};

 private:
  QwenVitConfig c_;
};
TORCH_MODULE(QwenVisionTower);

}  // namespace lf::models::vision
