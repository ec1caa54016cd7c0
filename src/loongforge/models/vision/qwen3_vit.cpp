// The Qwen3-VL vision transformer (models/vision/qwen3_vit.h).
#include "loongforge/nn/recompute.h"
#include "loongforge/models/vision/qwen3_vit.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/vision/vit.h"

namespace lf::models::vision {

Qwen3VitConfig Qwen3VitConfig::from_json(const nlohmann::json& j, const std::string& file, const std::string& path,
                                         bool deepstack) {
  JsonReader r(j, file, path);
  Qwen3VitConfig c;
  c.raw = j;
  // transformers' Qwen3VLVisionConfig defaults
  c.depth = 27;
  c.hidden_size = 1152;
  c.intermediate_size = 4304;
  c.num_heads = 16;
  c.patch_size = 16;
  c.out_hidden_size = 3584;
  c.hidden_act = "gelu_pytorch_tanh";
  c.fullatt_block_indexes.clear();
  c.window_size = int64_t(1) << 40;  // no windows: one per frame (qwen_vit_layout then keeps the processor's order)
  if (deepstack) {
    c.read_common(r, {"qwen3_vl_vision", "qwen3_vl"});
  } else {  // Qwen3.5's tower (older checkpoints name it by the whole model's type)
    c.read_common(r, {"qwen3_5_vision", "qwen3_5_moe_vision", "qwen3_5", "qwen3_5_moe"});
    c.deepstack_visual_indexes.clear();
  }
  c.num_position_embeddings = r.integer("num_position_embeddings", c.num_position_embeddings);
  if (r.has("deepstack_visual_indexes")) c.deepstack_visual_indexes = r.int_list("deepstack_visual_indexes");
  if (!deepstack && !c.deepstack_visual_indexes.empty())
    r.fail("deepstack_visual_indexes", "Qwen3.5's vision tower has no deepstack mergers (an empty list or none expected)");
  if (c.num_position_embeddings <= 0) r.fail("num_position_embeddings", "must be positive");
  std::set<int64_t> seen;
  for (int64_t i : c.deepstack_visual_indexes)
    if (i < 0 || i >= c.depth || !seen.insert(i).second)
      r.fail("deepstack_visual_indexes", "entries must be distinct block indexes in [0, depth = " +
                                             std::to_string(c.depth) + ")");
  return c;
}

int64_t Qwen3VitConfig::grid_side() const {
  return static_cast<int64_t>(std::sqrt(static_cast<double>(num_position_embeddings)));
}

int64_t Qwen3VitConfig::num_tower_parameters() const {
  const int64_t d = hidden_size, f = intermediate_size;
  const int64_t block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d);
  return d * patch_dim() + d + num_position_embeddings * d + depth * block;
}

int64_t Qwen3VitConfig::num_merger_parameters() const {
  const int64_t in = hidden_size * merge_unit();
  return 2 * hidden_size + (in * in + in) + (in * out_hidden_size + out_hidden_size);
}

int64_t Qwen3VitConfig::num_deepstack_parameters() const {
  const int64_t in = hidden_size * merge_unit();
  const int64_t one = 2 * in + (in * in + in) + (in * out_hidden_size + out_hidden_size);
  return static_cast<int64_t>(deepstack_visual_indexes.size()) * one;
}

Qwen3VitMLPImpl::Qwen3VitMLPImpl(int64_t hidden, int64_t inner, std::string act) : act_(std::move(act)) {
  linear_fc1 = register_module("linear_fc1", nn::Linear(hidden, inner, true));
  linear_fc2 = register_module("linear_fc2", nn::Linear(inner, hidden, true));
}

at::Tensor Qwen3VitMLPImpl::forward(const at::Tensor& x) { return linear_fc2(activation(act_, linear_fc1(x))); }

namespace {
torch::nn::LayerNorm layer_norm(int64_t width) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}).eps(1e-6));
}
}  // namespace

Qwen3VitBlockImpl::Qwen3VitBlockImpl(const Qwen3VitConfig& c) {
  norm1 = register_module("norm1", layer_norm(c.hidden_size));
  norm2 = register_module("norm2", layer_norm(c.hidden_size));
  attn = register_module("attn", QwenVitAttention(c.hidden_size, c.num_heads));
  mlp = register_module("mlp", Qwen3VitMLP(c.hidden_size, c.intermediate_size, c.hidden_act));
}

at::Tensor Qwen3VitBlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                      const at::Tensor& segments) {
  at::Tensor h = x + attn(norm1(x), cos, sin, segments);
  return h + mlp(norm2(h));
}

Qwen3PatchMergerImpl::Qwen3PatchMergerImpl(const Qwen3VitConfig& c, bool postshuffle) : postshuffle_(postshuffle) {
  const int64_t in = c.hidden_size * c.merge_unit();
  norm = register_module("norm", layer_norm(postshuffle ? in : c.hidden_size));
  linear_fc1 = register_module("linear_fc1", nn::Linear(in, in, true));
  linear_fc2 = register_module("linear_fc2", nn::Linear(in, c.out_hidden_size, true));
}

at::Tensor Qwen3PatchMergerImpl::forward(const at::Tensor& x) {
  const int64_t in = linear_fc1->weight.size(1);
  at::Tensor h = postshuffle_ ? norm(x.reshape({-1, in})) : norm(x).reshape({-1, in});
  return linear_fc2(at::gelu(linear_fc1(h)));
}

Qwen3VisionTowerImpl::Qwen3VisionTowerImpl(Qwen3VitConfig c) : c_(std::move(c)) {
  patch_embed = register_module("patch_embed", std::make_shared<torch::nn::Module>());
  auto proj = patch_embed->register_module("proj", std::make_shared<torch::nn::Module>());
  patch_weight = proj->register_parameter(
      "weight", at::empty({c_.hidden_size, c_.in_channels, c_.temporal_patch_size, c_.patch_size, c_.patch_size}));
  patch_bias = proj->register_parameter("bias", at::zeros({c_.hidden_size}));
  pos_embed = register_module("pos_embed", torch::nn::Embedding(c_.num_position_embeddings, c_.hidden_size));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c_.depth; ++i) blocks->push_back(Qwen3VitBlock(c_));
  merger = register_module("merger", Qwen3PatchMerger(c_, false));
  deepstack_merger_list = register_module("deepstack_merger_list", torch::nn::ModuleList());
  for (size_t i = 0; i < c_.deepstack_visual_indexes.size(); ++i)
    deepstack_merger_list->push_back(Qwen3PatchMerger(c_, true));
}

at::Tensor Qwen3VisionTowerImpl::interpolated_positions(const at::Tensor& grid_thw, const at::Tensor& rows,
                                                        const at::Tensor& cols) {
  // transformers' get_vision_interpolation_indices_and_weights (bilinear, align_corners): each axis maps index i of
  // a side of n patches to i * (side - 1) / max(n - 1, 1) on the table, between two taps clamped to the table.
  const at::Tensor g = grid_thw.to(at::kCPU, at::kLong);
  const at::Tensor counts = g.select(1, 0) * g.select(1, 1) * g.select(1, 2);
  const at::Tensor heights = at::repeat_interleave(g.select(1, 1), counts);
  const at::Tensor widths = at::repeat_interleave(g.select(1, 2), counts);
  const int64_t side = c_.grid_side();
  auto taps = [&](const at::Tensor& index, const at::Tensor& size) {
    const at::Tensor src = index.to(at::kFloat) * (side - 1) / at::clamp(size - 1, 1);
    const at::Tensor floor = at::floor(src);
    const at::Tensor offsets = at::arange(0, 2, at::TensorOptions().dtype(at::kLong));
    const at::Tensor t = (floor.to(at::kLong).unsqueeze(1) + offsets).clamp(0, side - 1);
    const at::Tensor w = (1 - (src.unsqueeze(1) - floor.unsqueeze(1) - offsets).abs()).clamp_min(0);
    return std::make_pair(t, w);
  };
  const auto [ht, hw] = taps(rows, heights);
  const auto [wt, ww] = taps(cols, widths);
  const at::Tensor idx = (ht.unsqueeze(2) * side + wt.unsqueeze(1)).reshape({-1, 4});
  const at::Tensor weights = (hw.unsqueeze(2) * ww.unsqueeze(1)).reshape({-1, 4});
  const at::Device dev = pos_embed->weight.device();
  return (pos_embed(idx.to(dev)) * weights.to(dev).unsqueeze(-1)).sum(1);
}

Qwen3VitOutput Qwen3VisionTowerImpl::forward(const at::Tensor& pixel_values, const at::Tensor& grid_thw,
                                             const std::string& where) {
  // one window per frame: the layout keeps the processor's patch order (2x2 merge groups, row-major)
  const QwenVitLayout lay = qwen_vit_layout(c_, grid_thw, where);
  check_qwen_vit_pixels(c_, lay, pixel_values, where);
  const at::Device dev = patch_weight.device();
  at::Tensor x = at::linear(pixel_values.to(dev, patch_weight.scalar_type()), patch_weight.reshape({c_.hidden_size, -1}),
                            patch_bias);
  x = x + interpolated_positions(grid_thw, lay.rows, lay.cols).to(x.scalar_type());
  const auto [cos, sin] = qwen_vit_rotary(c_, lay.rows, lay.cols, dev);
  const at::Tensor frames = lay.frame_segments.to(dev);
  Qwen3VitOutput out;
  for (int64_t i = 0; i < c_.depth; ++i) {
    auto* block = (*blocks)[static_cast<size_t>(i)]->as<Qwen3VitBlockImpl>();
    // (by value: a recomputation runs in backward, after this frame is gone)
    x = nn::maybe_recompute(
        recompute, *block, [block, cos = cos, sin = sin, frames](const at::Tensor& y) { return block->forward(y, cos, sin, frames); },
        x);
    const auto& ds = c_.deepstack_visual_indexes;
    if (auto it = std::find(ds.begin(), ds.end(), i); it != ds.end()) {
      auto* m = (*deepstack_merger_list)[static_cast<size_t>(it - ds.begin())]->as<Qwen3PatchMergerImpl>();
      out.deepstack.push_back(m->forward(x));
    }
  }
  out.merged = merger(x);  // one window per frame: the layout's order is the identity, nothing to order back
  return out;
}

void Qwen3VisionTowerImpl::init_weights(double std) {
  init_qwen_vit_weights(*this, std < 0 ? c_.initializer_range : std);
}

}  // namespace lf::models::vision
