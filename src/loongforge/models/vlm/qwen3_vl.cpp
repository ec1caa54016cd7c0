// Qwen3-VL on the model contract (models/vlm/qwen3_vl.h).
#include "loongforge/models/vlm/qwen3_vl.h"

#include <ATen/ATen.h>

#include <string>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/vlm/qwen_vl.h"

namespace lf::models::vlm {

namespace {

bool starts(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// transformers' Qwen3VLTextConfig defaults for fields a config.json may leave out (num_key_value_heads: as many as
// the attention heads).
const std::vector<std::pair<const char*, nlohmann::json>>& text_defaults() {
  static const std::vector<std::pair<const char*, nlohmann::json>> d = {
      {"vocab_size", 151936},        {"hidden_size", 4096},         {"intermediate_size", 22016},
      {"num_hidden_layers", 32},     {"num_attention_heads", 32},   {"head_dim", 128},
      {"max_position_embeddings", 128000}, {"rms_norm_eps", 1e-6},  {"rope_theta", 500000.0}};
  return d;
}

// transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults (the Gated DeltaNet fields: the decoder's own)
const std::vector<std::pair<const char*, nlohmann::json>>& qwen3_5_text_defaults(bool moe) {
  static const std::vector<std::pair<const char*, nlohmann::json>> dense = {
      {"vocab_size", 248320},       {"hidden_size", 4096},         {"intermediate_size", 12288},
      {"num_hidden_layers", 32},    {"num_attention_heads", 16},   {"num_key_value_heads", 4},
      {"head_dim", 256},            {"max_position_embeddings", 32768}, {"rms_norm_eps", 1e-6}};
  static const std::vector<std::pair<const char*, nlohmann::json>> sparse = {
      {"vocab_size", 248320},       {"hidden_size", 2048},         {"num_hidden_layers", 40},
      {"num_attention_heads", 16},  {"num_key_value_heads", 2},    {"head_dim", 256},
      {"max_position_embeddings", 32768}, {"rms_norm_eps", 1e-6}};
  return moe ? sparse : dense;
}

std::string deepstack_key(size_t k) { return "deepstack." + std::to_string(k); }

}  // namespace

Qwen3VLConfig Qwen3VLConfig::from_json(const nlohmann::json& j, const std::string& file) {
  JsonReader r(j, file);
  Qwen3VLConfig c;
  c.raw = j;
  c.model_type = r.string("model_type", c.model_type);
  const bool qwen3_5 = c.model_type == "qwen3_5" || c.model_type == "qwen3_5_moe";
  const nlohmann::json vision = r.has("vision_config") ? j.at("vision_config") : nlohmann::json::object();
  if (!vision.is_object()) r.expected("vision_config", "an object");
  c.vision = vision::Qwen3VitConfig::from_json(vision, file, "vision_config", !qwen3_5);
  if (qwen3_5) {  // Gated DeltaNet + gated attention decoder, partial rotary; Qwen3.5's own vision token ids
    const bool moe = c.model_type == "qwen3_5_moe";
    c.text = qwen_vl_text_config(j, file, moe ? "qwen3_5_moe_text" : "qwen3_5_text", qwen3_5_text_defaults(moe),
                                 {11, 11, 10});
    c.image_token_id = 248056, c.video_token_id = 248057;
    c.vision_start_token_id = 248053, c.vision_end_token_id = 248054;
  } else {
    c.text = qwen_vl_text_config(j, file, "qwen3", text_defaults(), {24, 20, 20});
  }
  c.text.rope.mrope_interleaved = true;  // transformers' Qwen3VL / Qwen3_5 TextRotaryEmbedding always interleaves
  qwen_vl_tokens(j, file, c.text.vocab_size, c.vision.out_hidden_size, c.text.hidden_size, &c.image_token_id,
                 &c.video_token_id, &c.vision_start_token_id, &c.vision_end_token_id);
  return c;
}

Qwen3VLImpl::Qwen3VLImpl(Qwen3VLConfig c) : config_(std::move(c)) {
  visual = register_module("visual", vision::Qwen3VisionTower(config_.vision));
  language_model = register_module("language_model", llama::CausalLM(config_.text));
}

void Qwen3VLImpl::init_weights(double std) {
  visual->init_weights(std);
  language_model->init_weights(std);
}

BatchSchema Qwen3VLImpl::batch_schema() const { return qwen_vl_batch_schema(*language_model, false); }

namespace {
// transformers' Qwen3-VL positions take each video frame as its own grid of t = 1.
at::Tensor per_frame(const at::Tensor& grid) {
  if (!grid.defined() || grid.size(0) == 0) return grid;
  const at::Tensor g = grid.to(at::kCPU, at::kLong);
  at::Tensor out = g.repeat_interleave(g.select(1, 0), 0).clone();
  out.select(1, 0).fill_(1);
  return out;
}
}  // namespace

at::Tensor Qwen3VLImpl::merged_embeddings(const at::Tensor& ids, const at::Tensor& pixel_values,
                                          const at::Tensor& grid_thw, const std::string& where,
                                          std::vector<at::Tensor>* deepstack, const at::Tensor& video_pixels,
                                          const at::Tensor& video_grid) {
  at::Tensor h = embed_fn ? embed_fn(ids) : language_model->embed(ids);
  const at::Tensor image_mask = ids == config_.image_token_id, video_mask = ids == config_.video_token_id;
  const int64_t images =
      qwen_check_image_tokens(image_mask, grid_thw, config_.vision.merge_unit(), config_.image_token_id, where);
  const int64_t videos = qwen_check_image_tokens(video_mask, video_grid, config_.vision.merge_unit(),
                                                 config_.video_token_id, where + " (videos)");
  deepstack->clear();
  std::vector<at::Tensor> image_deep, video_deep;
  if (images > 0) {
    if (!pixel_values.defined()) throw Error(where + ": image_grid_thw without pixel_values");
    vision::Qwen3VitOutput v = visual(pixel_values, grid_thw, where);
    for (const at::Tensor& d : v.deepstack) image_deep.push_back(d.to(h.scalar_type()));
    h = h.masked_scatter(image_mask.unsqueeze(-1).to(h.device()), v.merged.to(h.scalar_type()));
  }
  if (videos > 0) {
    if (!video_pixels.defined()) throw Error(where + ": video_grid_thw without pixel_values_videos");
    vision::Qwen3VitOutput v = visual(video_pixels, video_grid, where + " (videos)");
    for (const at::Tensor& d : v.deepstack) video_deep.push_back(d.to(h.scalar_type()));
    h = h.masked_scatter(video_mask.unsqueeze(-1).to(h.device()), v.merged.to(h.scalar_type()));
  }
  if (videos == 0) {
    *deepstack = std::move(image_deep);
  } else if (images == 0) {
    *deepstack = std::move(video_deep);
  } else {  // both: each visual token's features in sequence order, as transformers joins them
    const at::Tensor visual_mask = image_mask | video_mask;
    const at::Tensor is_image = image_mask.index({visual_mask}).to(h.device());
    const at::Tensor image_at = is_image.nonzero().squeeze(1), video_at = is_image.logical_not().nonzero().squeeze(1);
    for (size_t k = 0; k < image_deep.size(); ++k) {
      at::Tensor joint = at::zeros({is_image.size(0), image_deep[k].size(1)}, image_deep[k].options());
      joint = joint.index_put({image_at}, image_deep[k]).index_put({video_at}, video_deep[k]);
      deepstack->push_back(joint);
    }
  }
  return h;
}

at::Tensor Qwen3VLImpl::embed(const Batch& b) {
  const at::Tensor& ids = b.at("input_ids");
  std::vector<at::Tensor> deepstack;
  at::Tensor h = merged_embeddings(ids, b.get("pixel_values"), b.get("image_grid_thw"), "batch", &deepstack,
                                   b.get("pixel_values_videos"), b.get("video_grid_thw"));
  if (scatter_sequence_fn) {
    // Sequence parallelism: each deepstack layer's features as a dense [B, T, H] tensor (zero off the visual tokens)
    // cut like the sequence; the cut's backward gathers the gradient, so the tower's stays whole on every rank.
    if (!deepstack.empty()) {
      const at::Tensor mask = ((ids == config_.image_token_id) | (ids == config_.video_token_id)).to(h.device());
      const c10::List<std::optional<at::Tensor>> index({std::optional<at::Tensor>(mask)});
      for (at::Tensor& d : deepstack) d = scatter_sequence_fn(at::zeros_like(h).index_put(index, d));
    }
    h = scatter_sequence_fn(h);
  }
  std::lock_guard<std::mutex> lock(stash_mutex_);
  stash_.push_back({ids, std::move(deepstack)});
  if (stash_.size() > 16) stash_.pop_front();
  return h;
}

Batch Qwen3VLImpl::blocks_batch(const at::Tensor& ids, const at::Tensor& rope_mask, const at::Tensor& grid,
                                const std::vector<at::Tensor>& deepstack, at::ScalarType dtype,
                                const std::string& where, const at::Tensor& segment_ids,
                                const at::Tensor& video_rope_mask, const at::Tensor& video_grid) const {
  const QwenVideos v{video_rope_mask.defined() ? video_rope_mask : ids == config_.video_token_id,
                     per_frame(video_grid), {}, 1};
  const at::Tensor pos =
      qwen_rope_index(ids, rope_mask, grid, config_.vision.spatial_merge_size, where, segment_ids, &v);
  auto [cos, sin] = language_model->rotary(pos, dtype);
  Batch in{{"cos", cos}, {"sin", sin}, {"segment_ids", segment_ids}};
  const bool visual = (grid.defined() && grid.size(0) > 0) || (video_grid.defined() && video_grid.size(0) > 0);
  if (visual && !config_.vision.deepstack_visual_indexes.empty()) {
    if (!deepstack.empty() && deepstack[0].dim() == 3) {  // dense, cut like the sequence (embed under sp)
      for (size_t k = 0; k < deepstack.size(); ++k) in.set("deepstack_dense." + std::to_string(k), deepstack[k]);
      return in;
    }
    const at::Tensor mask = (ids == config_.image_token_id) | (ids == config_.video_token_id);
    in.set("visual_mask", mask);
    // item fields (one item per image token, in order), so that splitting the rows keeps each row's features
    const at::Tensor row = deepstack.empty() ? at::Tensor() : mask.nonzero().select(1, 0).contiguous();
    for (size_t k = 0; k < deepstack.size(); ++k) in.set_items(deepstack_key(k), deepstack[k], row);
  }
  return in;
}

Batch Qwen3VLImpl::block_inputs(const Batch& b, at::ScalarType dtype) const {
  const at::Tensor& ids = b.at("input_ids");
  // the deepstack features embed() made for this batch (none on a pipeline stage that does not run embed())
  std::vector<at::Tensor> deepstack;
  {
    std::lock_guard<std::mutex> lock(stash_mutex_);
    for (auto it = stash_.rbegin(); it != stash_.rend(); ++it)
      if (it->ids.is_same(ids)) {
        deepstack = it->deepstack;
        break;
      }
  }
  const at::Tensor grid = b.get("image_grid_thw");
  return blocks_batch(ids, ids == config_.image_token_id, grid, deepstack, dtype, "batch", b.get("segment_ids"), {},
                      b.get("video_grid_thw"));
}

at::Tensor Qwen3VLImpl::position_ids(const Batch& b) const {
  const at::Tensor& ids = b.at("input_ids");
  const QwenVideos v{ids == config_.video_token_id, per_frame(b.get("video_grid_thw")), {}, 1};
  return qwen_rope_index(ids, ids == config_.image_token_id, b.get("image_grid_thw"), config_.vision.spatial_merge_size,
                         "batch", b.get("segment_ids"), &v);
}

at::Tensor Qwen3VLImpl::block_extra(const Batch& in, at::Tensor y, int64_t i) {
  if (i >= static_cast<int64_t>(config_.vision.deepstack_visual_indexes.size())) return y;
  if (const at::Tensor d = in.get("deepstack_dense." + std::to_string(i)); d.defined()) {
    if (d.requires_grad() && !at::GradMode::is_enabled())
      throw Error("qwen3_vl: block " + std::to_string(i) + "'s deepstack features were added without gradients "
                  "(an engine ran block_forward inside recomputation instead of block_after outside it)");
    return y + d.to(y.scalar_type());
  }
  const at::Tensor mask = in.get("visual_mask");
  if (!mask.defined() || i >= static_cast<int64_t>(config_.vision.deepstack_visual_indexes.size())) return y;
  const at::Tensor f = in.get(deepstack_key(static_cast<size_t>(i)));
  if (!f.defined())
    throw Error("qwen3_vl: block " + std::to_string(i) + " adds deepstack features the vision tower makes in embed(); "
                "the first " + std::to_string(config_.vision.deepstack_visual_indexes.size()) +
                " blocks must run on the first pipeline stage");
  if (f.requires_grad() && !at::GradMode::is_enabled())
    throw Error("qwen3_vl: block " + std::to_string(i) + "'s deepstack features were added without gradients "
                "(an engine ran block_forward inside recomputation instead of block_after outside it)");
  // transformers' _deepstack_process: hidden_states[mask] += features
  const c10::List<std::optional<at::Tensor>> index({std::optional<at::Tensor>(mask.to(y.device()))});
  return at::index_put(y, index, y.index({mask.to(y.device())}) + f.to(y.scalar_type()));
}

Model::ReferenceOutput Qwen3VLImpl::reference_forward(const std::map<std::string, at::Tensor>& batch,
                                                      const std::string& file) {
  auto [ids, labels] = reference_ids(batch, file);
  const QwenImages in = qwen_reference_images(batch, ids, config_.image_token_id, file, config_.video_token_id);
  if (in.second_per_grid.defined())
    throw file_error(file, "second_per_grid_ts", "Qwen3-VL places video frames by timestamp text, not by this tensor");
  std::vector<at::Tensor> deepstack;
  at::Tensor h = merged_embeddings(ids, in.pixel_values, in.grid_thw, file, &deepstack, in.video_pixels, in.video_grid);
  return reference_output(h, blocks_batch(ids, in.rope_mask, in.grid_thw, deepstack, h.scalar_type(), file, {},
                                          in.video_rope_mask, in.video_grid),
                          labels);
}

Model::TrainWork Qwen3VLImpl::train_work() const {
  TrainWork w = language_model->train_work();
  const auto& v = config_.vision;
  const double h = static_cast<double>(v.hidden_size), unit = static_cast<double>(v.merge_unit());
  // 6 x the parameters a patch goes through (mergers per m x m patches) + attention over the image in every block
  w.per_patch = 6.0 * (static_cast<double>(v.num_tower_parameters()) +
                       static_cast<double>(v.num_merger_parameters() + v.num_deepstack_parameters()) / unit);
  w.per_patch_pair = 12.0 * h * static_cast<double>(v.depth);
  w.patches_per_image_token = v.merge_unit();
  return w;
}

std::vector<CheckpointTensor> Qwen3VLImpl::checkpoint_tensors() const {
  std::vector<CheckpointTensor> out;
  for (const auto& item : visual->named_parameters())
    out.push_back({"model.visual." + item.key(), "visual." + item.key()});
  for (CheckpointTensor e : language_model->checkpoint_tensors()) {  // model.*, lm_head.weight
    if (starts(e.name, "model.")) e.name = "model.language_model." + e.name.substr(6);
    e.param = "language_model." + e.param;
    out.push_back(e);
  }
  return out;
}

bool Qwen3VLImpl::ignorable_checkpoint_tensor(const std::string& name) const {
  if (starts(name, "model.visual.")) return name.ends_with("rotary_pos_emb.inv_freq");
  if (starts(name, "model.language_model."))
    return language_model->ignorable_checkpoint_tensor("model." + name.substr(21));
  return language_model->ignorable_checkpoint_tensor(name);
}

std::string Qwen3VLImpl::canonical_checkpoint_name(const std::string& n) const {
  // the Qwen2.5-VL-style layout (visual.*, model.*) -> transformers' names
  if (starts(n, "visual.")) return "model." + n;
  if (starts(n, "model.") && !starts(n, "model.visual.") && !starts(n, "model.language_model."))
    return "model.language_model." + n.substr(6);
  return n;
}

std::string Qwen3VLImpl::reference_name(const std::string& n) const {
  if (starts(n, "language_model.model.")) return "model.language_model." + n.substr(21);
  if (starts(n, "language_model.lm_head.")) return n.substr(15);
  return n;
}

std::shared_ptr<Model> build_qwen3_vl(const nlohmann::json& j, const std::string& file) {
  return Qwen3VL(Qwen3VLConfig::from_json(j, file)).ptr();
}

nlohmann::json describe_qwen3_vl(const nlohmann::json& j, const std::string& file) {
  const Qwen3VLConfig c = Qwen3VLConfig::from_json(j, file);
  const auto& v = c.vision;
  const int64_t tower = v.num_tower_parameters(), merger = v.num_merger_parameters();
  const int64_t deep = v.num_deepstack_parameters(), text = c.text.num_parameters();
  nlohmann::json vt = {{"model_type", "qwen3_vl_vision"},
                       {"parameters", tower},
                       {"layers", v.depth},
                       {"hidden_size", v.hidden_size},
                       {"heads", v.num_heads},
                       {"patch_size", v.patch_size},
                       {"temporal_patch_size", v.temporal_patch_size},
                       {"num_position_embeddings", v.num_position_embeddings}};
  nlohmann::json mg = {{"kind", "patch_merger"}, {"spatial_merge_size", v.spatial_merge_size}, {"parameters", merger}};
  const bool qwen3_5 = c.model_type != "qwen3_vl";
  if (qwen3_5) vt["model_type"] = c.model_type + "_vision";
  nlohmann::json lm = {{"model_type", qwen3_5 ? c.text.model_type : "qwen3"},
                       {"parameters", text},
                       {"layers", c.text.num_hidden_layers},
                       {"hidden_size", c.text.hidden_size},
                       {"vocab_size", c.text.vocab_size},
                       {"mrope_section", c.text.rope.mrope_section},
                       {"mrope_interleaved", true},
                       {"tied_embeddings", c.text.tie_word_embeddings}};
  nlohmann::json components = {{"vision_tower", vt}, {"merger", mg}, {"language_model", lm}};
  if (!qwen3_5)
    components["deepstack_mergers"] = {
        {"kind", "patch_merger"}, {"deepstack_visual_indexes", v.deepstack_visual_indexes}, {"parameters", deep}};
  return {{"family", "vlm"},
          {"model_type", c.model_type},
          {"parameters", tower + merger + deep + text},
          {"image_token_id", c.image_token_id},
          {"components", components}};
}

}  // namespace lf::models::vlm
