// The Qwen2.5-VL vision transformer (models/vision/qwen_vit.h).
#include "loongforge/nn/recompute.h"
#include "loongforge/models/vision/qwen_vit.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/vision/vit.h"
#include "loongforge/nn/rotary.h"

namespace lf::models::vision {

void QwenVitConfig::read_common(const JsonReader& r, const std::vector<std::string>& model_types) {
  if (r.has("model_type")) {
    const std::string t = r.string("model_type");
    if (std::find(model_types.begin(), model_types.end(), t) == model_types.end())
      r.fail("model_type", "'" + t + "' is not a vision tower this model handles (known: " + model_types[0] + ")");
  }
  depth = r.has("depth") ? r.integer("depth") : r.integer("num_hidden_layers", depth);
  hidden_size = r.integer("hidden_size", hidden_size);
  intermediate_size = r.integer("intermediate_size", intermediate_size);
  num_heads = r.has("num_heads") ? r.integer("num_heads") : r.integer("num_attention_heads", num_heads);
  in_channels = r.integer("in_channels", in_channels);
  patch_size = r.integer("patch_size", patch_size);
  temporal_patch_size = r.integer("temporal_patch_size", temporal_patch_size);
  spatial_merge_size = r.integer("spatial_merge_size", spatial_merge_size);
  out_hidden_size = r.integer("out_hidden_size", out_hidden_size);
  hidden_act = r.string("hidden_act", hidden_act);
  initializer_range = r.number("initializer_range", initializer_range);
  if (r.has("rope_parameters")) {
    JsonReader rope = r.object("rope_parameters");
    rope_theta = rope.number("rope_theta", rope_theta);
    const std::string type = rope.string("rope_type", std::string("axial"));
    if (type != "axial") rope.fail("rope_type", "'" + type + "' is not supported (the vision tower's rope is axial)");
  }
  for (const char* k : {"hidden_size", "intermediate_size", "in_channels", "patch_size", "temporal_patch_size",
                        "spatial_merge_size", "out_hidden_size"})
    if (r.has(k) && r.integer(k) <= 0) r.fail(k, "must be positive");
  if (depth <= 0) r.fail(r.has("depth") ? "depth" : "num_hidden_layers", "must be positive");
  const char* heads = r.has("num_heads") || !r.has("num_attention_heads") ? "num_heads" : "num_attention_heads";
  if (num_heads <= 0 || hidden_size % num_heads != 0)
    r.fail(heads, std::to_string(num_heads) + " does not divide hidden_size " + std::to_string(hidden_size));
  if (head_dim() % 4 != 0)
    r.fail(heads, "the head width " + std::to_string(head_dim()) + " must be a multiple of 4 (2D rotary positions)");
  require_activation(r, "hidden_act", hidden_act);
}

QwenVitConfig QwenVitConfig::from_json(const nlohmann::json& j, const std::string& file, const std::string& path) {
  JsonReader r(j, file, path);
  QwenVitConfig c;
  c.raw = j;
  c.read_common(r, {"qwen2_5_vl_vision", "qwen2_5_vl"});
  c.window_size = r.integer("window_size", c.window_size);
  c.tokens_per_second = r.integer("tokens_per_second", c.tokens_per_second);
  if (r.has("fullatt_block_indexes")) c.fullatt_block_indexes = r.int_list("fullatt_block_indexes");
  if (r.has("window_size") && c.window_size <= 0) r.fail("window_size", "must be positive");
  if (c.window_size / c.spatial_merge_size / c.patch_size < 1)
    r.fail("window_size", std::to_string(c.window_size) + " is smaller than spatial_merge_size x patch_size");
  return c;
}

int64_t QwenVitConfig::num_tower_parameters() const {
  const int64_t d = hidden_size, f = intermediate_size;
  const int64_t block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * (d * f + f) + (f * d + d);
  return d * patch_dim() + depth * block;
}

int64_t QwenVitConfig::num_merger_parameters() const {
  const int64_t in = hidden_size * merge_unit();
  return hidden_size + (in * in + in) + (in * out_hidden_size + out_hidden_size);
}

QwenVitLayout qwen_vit_layout(const QwenVitConfig& c, const at::Tensor& grid_thw, const std::string& where) {
  if (grid_thw.dim() != 2 || grid_thw.size(1) != 3)
    throw Error(where + ": image_grid_thw must be [images, 3] (t, h, w)");
  const at::Tensor grid = grid_thw.to(at::kCPU, at::kLong).contiguous();
  const int64_t* g = grid.data_ptr<int64_t>();
  const int64_t m = c.spatial_merge_size, mu = c.merge_unit(), span = c.window_size / m / c.patch_size;
  std::vector<int64_t> units, order, rows, cols, wseg, fseg;
  QwenVitLayout out;
  int64_t unit_base = 0, window = 0, frame = 0;
  for (int64_t i = 0; i < grid.size(0); ++i) {
    const int64_t t = g[3 * i], h = g[3 * i + 1], w = g[3 * i + 2];
    if (t <= 0 || h <= 0 || w <= 0 || h % m || w % m)
      throw Error(where + ": image_grid_thw[" + std::to_string(i) + "] = (" + std::to_string(t) + ", " +
                  std::to_string(h) + ", " + std::to_string(w) + ") must be positive with h and w multiples of "
                  "spatial_merge_size " + std::to_string(m));
    const int64_t lh = h / m, lw = w / m;
    // transformers' window_index: each frame's merged tokens in windows of span x span (the last row and column of
    // windows partial), window after window, row-major inside a window
    for (int64_t f = 0; f < t; ++f, ++frame) {
      for (int64_t wr = 0; wr * span < lh; ++wr)
        for (int64_t wc = 0; wc * span < lw; ++wc, ++window)
          for (int64_t r = wr * span; r < std::min(lh, (wr + 1) * span); ++r)
            for (int64_t q = wc * span; q < std::min(lw, (wc + 1) * span); ++q) {
              const int64_t u = unit_base + (f * lh + r) * lw + q;
              units.push_back(u);
              for (int64_t a = 0; a < m; ++a)
                for (int64_t b = 0; b < m; ++b) {
                  order.push_back(u * mu + a * m + b);
                  rows.push_back(r * m + a);
                  cols.push_back(q * m + b);
                  wseg.push_back(window);
                  fseg.push_back(frame);
                }
            }
    }
    unit_base += t * lh * lw;
    out.tokens.push_back(t * lh * lw);
  }
  std::vector<int64_t> back(units.size());
  for (size_t k = 0; k < units.size(); ++k) back[static_cast<size_t>(units[k])] = static_cast<int64_t>(k);
  auto tensor = [](const std::vector<int64_t>& v) { return at::tensor(v, at::TensorOptions().dtype(at::kLong)); };
  out.order = tensor(order);
  out.unit_back = tensor(back);
  out.rows = tensor(rows);
  out.cols = tensor(cols);
  out.window_segments = tensor(wseg).unsqueeze(0);
  out.frame_segments = tensor(fseg).unsqueeze(0);
  return out;
}

std::pair<at::Tensor, at::Tensor> qwen_vit_rotary(const QwenVitConfig& c, const at::Tensor& rows, const at::Tensor& cols,
                                                  const at::Device& device) {
  const int64_t half = c.head_dim() / 2;
  const at::Tensor exponents = at::arange(0, half, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) /
                               static_cast<double>(half);
  const at::Tensor inv = at::reciprocal(at::pow(c.rope_theta, exponents)).to(device);
  at::Tensor f = at::cat({rows.to(device).to(at::kFloat).unsqueeze(-1) * inv,
                          cols.to(device).to(at::kFloat).unsqueeze(-1) * inv}, -1);
  f = at::cat({f, f}, -1).unsqueeze(0);  // [1, T, head_dim]
  return {f.cos(), f.sin()};
}

void check_qwen_vit_pixels(const QwenVitConfig& c, const QwenVitLayout& lay, const at::Tensor& pixel_values,
                           const std::string& where) {
  int64_t patches = 0;
  for (int64_t n : lay.tokens) patches += n * c.merge_unit();
  if (pixel_values.dim() != 2 || pixel_values.size(0) != patches || pixel_values.size(1) != c.patch_dim())
    throw Error(where + ": pixel_values must be [" + std::to_string(patches) + ", " + std::to_string(c.patch_dim()) +
                "] for image_grid_thw (patches of all images x channels * temporal_patch_size * patch_size^2)");
}

QwenVitAttentionImpl::QwenVitAttentionImpl(int64_t hidden, int64_t heads)
    : nn::AttentionHook(heads, heads, 0), head_dim(hidden / heads) {
  causal = false;
  qkv = register_module("qkv", nn::Linear(hidden, 3 * hidden, true));
  proj = register_module("proj", nn::Linear(hidden, hidden, true));
}

at::Tensor QwenVitAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                         const at::Tensor& segments) {
  const int64_t t = x.size(0);
  at::Tensor y = qkv(x).view({t, 3, -1, head_dim}).permute({1, 2, 0, 3});  // [3, H, T, D]
  at::Tensor q = nn::apply_rotary(y.select(0, 0).unsqueeze(0), cos, sin);
  at::Tensor k = nn::apply_rotary(y.select(0, 1).unsqueeze(0), cos, sin);
  at::Tensor o = attend(q, k, y.select(0, 2).unsqueeze(0), 0, 1.0 / std::sqrt(static_cast<double>(head_dim)), segments);
  return proj(o.squeeze(0).transpose(0, 1).reshape({t, -1}));
}

QwenVitMLPImpl::QwenVitMLPImpl(int64_t hidden, int64_t inner, std::string act) : act_(std::move(act)) {
  gate_proj = register_module("gate_proj", nn::Linear(hidden, inner, true));
  up_proj = register_module("up_proj", nn::Linear(hidden, inner, true));
  down_proj = register_module("down_proj", nn::Linear(inner, hidden, true));
}

at::Tensor QwenVitMLPImpl::forward(const at::Tensor& x) {
  return down_proj(activation(act_, gate_proj(x)) * up_proj(x));
}

QwenVitBlockImpl::QwenVitBlockImpl(const QwenVitConfig& c) {
  norm1 = register_module("norm1", nn::RMSNorm(c.hidden_size, 1e-6));
  norm2 = register_module("norm2", nn::RMSNorm(c.hidden_size, 1e-6));
  attn = register_module("attn", QwenVitAttention(c.hidden_size, c.num_heads));
  mlp = register_module("mlp", QwenVitMLP(c.hidden_size, c.intermediate_size, c.hidden_act));
}

at::Tensor QwenVitBlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                     const at::Tensor& segments) {
  at::Tensor h = x + attn(norm1(x), cos, sin, segments);
  return h + mlp(norm2(h));
}

QwenPatchMergerImpl::QwenPatchMergerImpl(const QwenVitConfig& c) {
  const int64_t in = c.hidden_size * c.merge_unit();
  ln_q = register_module("ln_q", nn::RMSNorm(c.hidden_size, 1e-6));
  auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>());  // nn.Sequential: 0 linear, 1 GELU, 2 linear
  fc1 = mlp->register_module("0", nn::Linear(in, in, true));
  fc2 = mlp->register_module("2", nn::Linear(in, c.out_hidden_size, true));
}

at::Tensor QwenPatchMergerImpl::forward(const at::Tensor& x) {
  at::Tensor h = ln_q(x);
  return fc2(at::gelu(fc1(h.reshape({-1, fc1->weight.size(1)}))));
}

QwenVisionTowerImpl::QwenVisionTowerImpl(QwenVitConfig c) : c_(std::move(c)) {
  patch_embed = register_module("patch_embed", std::make_shared<torch::nn::Module>());
  auto proj = patch_embed->register_module("proj", std::make_shared<torch::nn::Module>());
  patch_weight = proj->register_parameter(
      "weight", at::empty({c_.hidden_size, c_.in_channels, c_.temporal_patch_size, c_.patch_size, c_.patch_size}));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c_.depth; ++i) blocks->push_back(QwenVitBlock(c_));
  merger = register_module("merger", QwenPatchMerger(c_));
}

at::Tensor QwenVisionTowerImpl::forward(const at::Tensor& pixel_values, const at::Tensor& grid_thw,
                                        const std::string& where) {
  const QwenVitLayout lay = qwen_vit_layout(c_, grid_thw, where);
  check_qwen_vit_pixels(c_, lay, pixel_values, where);
  const at::Device dev = patch_weight.device();
  auto on = [&](const at::Tensor& t) { return t.to(dev); };
  // The patch embedding (a Conv3d whose kernel is the patch) on the patches in window order.
  at::Tensor x = pixel_values.to(dev, patch_weight.scalar_type()).index_select(0, on(lay.order));
  x = at::linear(x, patch_weight.reshape({c_.hidden_size, -1}));
  const auto [cos, sin] = qwen_vit_rotary(c_, lay.rows, lay.cols, dev);
  const at::Tensor windows = on(lay.window_segments), frames = on(lay.frame_segments);
  for (int64_t i = 0; i < c_.depth; ++i) {
    const bool full = std::find(c_.fullatt_block_indexes.begin(), c_.fullatt_block_indexes.end(), i) !=
                      c_.fullatt_block_indexes.end();
    auto* block = (*blocks)[static_cast<size_t>(i)]->as<QwenVitBlockImpl>();
    // (by value: a recomputation runs in backward, after this frame is gone)
    x = nn::maybe_recompute(
        recompute, *block,
        [block, cos = cos, sin = sin, segments = full ? frames : windows](const at::Tensor& y) {
          return block->forward(y, cos, sin, segments);
        },
        x);
  }
  return merger(x).index_select(0, on(lay.unit_back));
}

void init_qwen_vit_weights(torch::nn::Module& tower, double std) {
  at::NoGradGuard no_grad;
  for (auto& item : tower.named_parameters()) {
    const std::string& n = item.key();
    at::Tensor& p = item.value();
    if (n.ends_with(".bias")) p.zero_();
    else if (n.find("norm") != std::string::npos || n.find("ln_q") != std::string::npos) p.fill_(1.0);
    else p.normal_(0.0, std);
  }
}

void QwenVisionTowerImpl::init_weights(double std) { init_qwen_vit_weights(*this, std < 0 ? c_.initializer_range : std); }

}  // namespace lf::models::vision
