// Qwen2.5-VL on the model contract (models/vlm/qwen_vl.h).
#include "loongforge/models/vlm/qwen_vl.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::models::vlm {

namespace {

bool starts(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// transformers' Qwen2_5_VLTextConfig defaults for fields a config.json may leave out.
const std::vector<std::pair<const char*, nlohmann::json>>& text_defaults() {
  static const std::vector<std::pair<const char*, nlohmann::json>> d = {
      {"vocab_size", 152064},          {"hidden_size", 8192},        {"intermediate_size", 29568},
      {"num_hidden_layers", 80},       {"num_attention_heads", 64},  {"num_key_value_heads", 8},
      {"max_position_embeddings", 32768}, {"rms_norm_eps", 1e-5},    {"rope_theta", 1000000.0}};
  return d;
}

}  // namespace

llama::DecoderConfig qwen_vl_text_config(const nlohmann::json& j, const std::string& file, const std::string& decoder,
                                         const std::vector<std::pair<const char*, nlohmann::json>>& defaults,
                                         const std::vector<int64_t>& default_sections) {
  JsonReader r(j, file);
  // The decoder: text_config (transformers 5), or the top-level fields (the configs Qwen published).
  const bool nested = r.has("text_config");
  nlohmann::json t = nested ? j.at("text_config") : j;
  if (!t.is_object()) r.expected("text_config", "an object");
  t.erase("vision_config");
  for (const auto& [k, v] : defaults)
    if (!t.contains(k) || t.at(k).is_null()) t[k] = v;
  if (!t.contains("num_key_value_heads") || t.at("num_key_value_heads").is_null())
    t["num_key_value_heads"] = t["num_attention_heads"];  // transformers: as many as the attention heads
  if (decoder == "qwen2") t.erase("head_dim");  // Qwen2.5-VL's attention uses hidden_size / num_attention_heads
  const bool tied = r.boolean("tie_word_embeddings", false) ||
                    (nested && t.contains("tie_word_embeddings") && t.at("tie_word_embeddings") == true);
  t["tie_word_embeddings"] = tied;
  t["model_type"] = decoder;
  llama::DecoderConfig c;
  try {
    c = llama::DecoderConfig::from_json(t, file);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + (nested ? " (in text_config)" : ""));
  }
  const std::string rope_block = std::string(nested ? "text_config." : "") +
                                 (t.contains("rope_scaling") && !t.at("rope_scaling").is_null() ? "rope_scaling"
                                                                                                 : "rope_parameters");
  auto& sections = c.rope.mrope_section;
  // the Gated DeltaNet decoders (Qwen3.5) drop the sections as text models (1D positions): read them back
  const std::string block_key = rope_block.substr(rope_block.rfind('.') + 1);
  if (sections.empty() && t.contains(block_key) && t.at(block_key).is_object() &&
      t.at(block_key).contains("mrope_section"))
    sections = JsonReader(t.at(block_key), file, rope_block).int_list("mrope_section");
  if (sections.empty()) sections = default_sections;  // transformers' default
  int64_t sum = 0;
  for (int64_t n : sections) sum += n;
  // partial rotary (Qwen3.5): the sections cover the rotated features only
  if (sum != c.rotary_dim / 2 || sections.size() != 3)
    throw file_error(file, rope_block + ".mrope_section",
                     "three sections summing to rotary_dim / 2 = " + std::to_string(c.rotary_dim / 2) + " expected");
  if (c.rope.type != "default")
    throw file_error(file, rope_block + ".rope_type", "'" + c.rope.type + "' is not supported with multimodal rope");
  return c;
}

void qwen_vl_tokens(const nlohmann::json& j, const std::string& file, int64_t vocab, int64_t vision_out,
                    int64_t text_hidden, int64_t* image_token_id, int64_t* video_token_id,
                    int64_t* vision_start_token_id, int64_t* vision_end_token_id) {
  JsonReader r(j, file);
  *image_token_id = r.integer("image_token_id", *image_token_id);
  *video_token_id = r.integer("video_token_id", *video_token_id);
  *vision_start_token_id = r.integer("vision_start_token_id", *vision_start_token_id);
  *vision_end_token_id = r.integer("vision_end_token_id", *vision_end_token_id);
  if (*image_token_id < 0 || *image_token_id >= vocab)
    r.fail("image_token_id", std::to_string(*image_token_id) + " is outside the vocabulary of " + std::to_string(vocab));
  // the markers around images matter only where the tokenizer has them (generation, chat data): -1 when outside
  if (*vision_start_token_id >= vocab) *vision_start_token_id = -1;
  if (*vision_end_token_id >= vocab) *vision_end_token_id = -1;
  if (vision_out != text_hidden)
    throw file_error(file, "vision_config.out_hidden_size",
                     std::to_string(vision_out) + " differs from the language model's hidden_size " +
                         std::to_string(text_hidden));
}

QwenVLConfig QwenVLConfig::from_json(const nlohmann::json& j, const std::string& file) {
  JsonReader r(j, file);
  QwenVLConfig c;
  c.raw = j;
  const nlohmann::json vision = r.has("vision_config") ? j.at("vision_config") : nlohmann::json::object();
  if (!vision.is_object()) r.expected("vision_config", "an object");
  c.vision = vision::QwenVitConfig::from_json(vision, file, "vision_config");
  c.text = qwen_vl_text_config(j, file, "qwen2", text_defaults(), {16, 24, 24});
  qwen_vl_tokens(j, file, c.text.vocab_size, c.vision.out_hidden_size, c.text.hidden_size, &c.image_token_id,
                 &c.video_token_id, &c.vision_start_token_id, &c.vision_end_token_id);
  return c;
}

QwenVLImpl::QwenVLImpl(QwenVLConfig c) : config_(std::move(c)) {
  visual = register_module("visual", vision::QwenVisionTower(config_.vision));
  language_model = register_module("language_model", llama::CausalLM(config_.text));
}

void QwenVLImpl::init_weights(double std) {
  visual->init_weights(std);
  language_model->init_weights(std);
}

BatchSchema qwen_vl_batch_schema(const llama::CausalLMImpl& lm, bool video_seconds) {
  BatchSchema s;
  for (const BatchField& f : lm.batch_schema())
    if (f.name == "input_ids" || f.name == "targets") s.push_back(f);
  s.push_back(optional_field("pixel_values", at::kFloat, 2,
                             "patches [patches, C * temporal_patch_size * patch_size^2] of the images in token order; "
                             "item field (pixel_values.row: each patch's row)"));
  s.push_back(optional_field("image_grid_thw", at::kLong, 2,
                             "each image's (t, h, w) in patches [images, 3]; item field (image_grid_thw.row)"));
  s.push_back(optional_field("pixel_values_videos", at::kFloat, 2,
                             "the videos' patches, as pixel_values (item field: pixel_values_videos.row)"));
  s.push_back(optional_field("video_grid_thw", at::kLong, 2,
                             "each video's (t, h, w) in patches [videos, 3] (item field: video_grid_thw.row)"));
  if (video_seconds)
    s.push_back(optional_field("second_per_grid_ts", at::kFloat, 1,
                               "seconds per temporal patch of each video [videos] (item field: "
                               "second_per_grid_ts.row; absent: 1)"));
  return s;
}

BatchSchema QwenVLImpl::batch_schema() const { return qwen_vl_batch_schema(*language_model, true); }

at::Tensor qwen_rope_index(const at::Tensor& ids, const at::Tensor& image_mask, const at::Tensor& grid_thw, int64_t m,
                           const std::string& where, const at::Tensor& segment_ids, const QwenVideos* videos) {
  const int64_t rows = ids.size(0), len = ids.size(1);
  at::Tensor vmask_t, vgrid_t, vsec_t;
  if (videos && videos->mask.defined()) {
    vmask_t = videos->mask.to(at::kCPU, at::kBool).contiguous();
    vgrid_t = videos->grid_thw.defined() ? videos->grid_thw.to(at::kCPU, at::kLong).contiguous() : at::zeros({0, 3}, at::kLong);
    if (videos->second_per_grid.defined()) vsec_t = videos->second_per_grid.to(at::kCPU, at::kFloat).contiguous();
  }
  const bool* is_video = vmask_t.defined() ? vmask_t.data_ptr<bool>() : nullptr;
  const int64_t* vg = vgrid_t.defined() ? vgrid_t.data_ptr<int64_t>() : nullptr;
  int64_t video = 0;
  const at::Tensor mask = image_mask.to(at::kCPU, at::kBool).contiguous();
  const at::Tensor segs = segment_ids.defined() ? segment_ids.to(at::kCPU, at::kLong).contiguous() : at::Tensor();
  if (segs.defined() && segs.sizes() != ids.sizes()) throw Error(where + ": segment_ids must have the shape of input_ids");
  const int64_t* seg = segs.defined() ? segs.data_ptr<int64_t>() : nullptr;
  const at::Tensor grid = grid_thw.defined() ? grid_thw.to(at::kCPU, at::kLong).contiguous() : at::zeros({0, 3}, at::kLong);
  const bool* is_image = mask.data_ptr<bool>();
  const int64_t* g = grid.data_ptr<int64_t>();
  at::Tensor pos = at::empty({3, rows, len}, at::kLong);
  int64_t* p = pos.data_ptr<int64_t>();
  const int64_t plane = rows * len;
  int64_t image = 0;
  for (int64_t b = 0; b < rows; ++b) {
    int64_t next = 0;  // the position the next token starts at
    for (int64_t i = 0; i < len;) {
      const int64_t at_ = b * len + i;
      if (seg && i > 0 && seg[at_] != seg[at_ - 1]) next = 0;  // a packed document starts: positions as its own sample
      if (is_video && is_video[at_]) {
        if (video >= vgrid_t.size(0))
          throw Error(where + ": row " + std::to_string(b) + " has video tokens past the " +
                      std::to_string(vgrid_t.size(0)) + " videos of video_grid_thw");
        const int64_t t = vg[3 * video], gh = vg[3 * video + 1] / m, gw = vg[3 * video + 2] / m, n = t * gh * gw;
        for (int64_t k = 0; k < n; ++k)
          if (i + k >= len || !is_video[at_ + k] || (seg && seg[at_ + k] != seg[at_]))
            throw Error(where + ": row " + std::to_string(b) + ": video " + std::to_string(video) + " needs " +
                        std::to_string(n) + " consecutive video tokens from position " + std::to_string(i));
        // transformers: (arange(t) * tokens_per_second * seconds).long() in float32 (exact integers without seconds)
        const float interval = static_cast<float>(videos->tokens_per_second) *
                               (vsec_t.defined() ? vsec_t.data_ptr<float>()[video] : 1.0f);
        for (int64_t k = 0; k < n; ++k) {
          p[at_ + k] = next + static_cast<int64_t>(static_cast<float>(k / (gh * gw)) * interval);
          p[plane + at_ + k] = next + (k / gw) % gh;
          p[2 * plane + at_ + k] = next + k % gw;
        }
        next += std::max(gh, gw);
        i += n;
        ++video;
        continue;
      }
      if (!is_image[at_]) {
        p[at_] = p[plane + at_] = p[2 * plane + at_] = next++;
        ++i;
        continue;
      }
      if (image >= grid.size(0))
        throw Error(where + ": row " + std::to_string(b) + " has image tokens past the " + std::to_string(grid.size(0)) +
                    " images of image_grid_thw");
      const int64_t t = g[3 * image], gh = g[3 * image + 1] / m, gw = g[3 * image + 2] / m, n = t * gh * gw;
      for (int64_t k = 0; k < n; ++k)
        if (i + k >= len || !is_image[at_ + k] || (seg && seg[at_ + k] != seg[at_]))
          throw Error(where + ": row " + std::to_string(b) + ": image " + std::to_string(image) + " (grid " +
                      std::to_string(t) + "x" + std::to_string(gh * m) + "x" + std::to_string(gw * m) + ") needs " +
                      std::to_string(n) + " consecutive image tokens from position " + std::to_string(i));
      for (int64_t k = 0; k < n; ++k) {
        p[at_ + k] = next + k / (gh * gw);
        p[plane + at_ + k] = next + (k / gw) % gh;
        p[2 * plane + at_ + k] = next + k % gw;
      }
      next += std::max(gh, gw);  // transformers: the text after an image starts at its start + max(rows, columns)
      i += n;
      ++image;
    }
  }
  return pos.to(ids.device());
}

at::Tensor QwenVLImpl::rope_index(const at::Tensor& ids, const at::Tensor& image_mask, const at::Tensor& grid_thw,
                                  const std::string& where, const at::Tensor& segment_ids) const {
  return qwen_rope_index(ids, image_mask, grid_thw, config_.vision.spatial_merge_size, where, segment_ids);
}

int64_t qwen_check_image_tokens(const at::Tensor& image_mask, const at::Tensor& grid_thw, int64_t merge_unit,
                                int64_t image_token_id, const std::string& where) {
  const int64_t tokens = image_mask.sum().item<int64_t>();
  int64_t needed = 0, images = 0;
  if (grid_thw.defined()) {
    if (grid_thw.dim() != 2 || grid_thw.size(1) != 3) throw Error(where + ": image_grid_thw must be [images, 3]");
    const at::Tensor g = grid_thw.to(at::kCPU, at::kLong);
    images = g.size(0);
    needed = images ? (g.select(1, 0) * g.select(1, 1) * g.select(1, 2)).sum().item<int64_t>() / merge_unit : 0;
  }
  if (tokens != needed)
    throw Error(where + ": " + std::to_string(tokens) + " image tokens (id " + std::to_string(image_token_id) +
                ") but the " + std::to_string(images) + " images of image_grid_thw give " + std::to_string(needed) +
                " (t * h * w / spatial_merge_size^2 each)");
  return images;
}

at::Tensor QwenVLImpl::merged_embeddings(const at::Tensor& ids, const at::Tensor& pixel_values,
                                         const at::Tensor& grid_thw, const at::Tensor& image_mask,
                                         const std::string& where, const at::Tensor& video_pixels,
                                         const at::Tensor& video_grid) {
  at::Tensor h = embed_fn ? embed_fn(ids) : language_model->embed(ids);
  const int64_t images =
      qwen_check_image_tokens(image_mask, grid_thw, config_.vision.merge_unit(), config_.image_token_id, where);
  if (images > 0) {
    if (!pixel_values.defined()) throw Error(where + ": image_grid_thw without pixel_values");
    at::Tensor f = visual(pixel_values, grid_thw, where).to(h.scalar_type());
    h = h.masked_scatter(image_mask.unsqueeze(-1).to(h.device()), f);
  }
  const at::Tensor video_mask = ids == config_.video_token_id;
  const int64_t videos = qwen_check_image_tokens(video_mask, video_grid, config_.vision.merge_unit(),
                                                 config_.video_token_id, where + " (videos)");
  if (videos > 0) {  // the same tower over the videos' patches
    if (!video_pixels.defined()) throw Error(where + ": video_grid_thw without pixel_values_videos");
    at::Tensor f = visual(video_pixels, video_grid, where + " (videos)").to(h.scalar_type());
    h = h.masked_scatter(video_mask.unsqueeze(-1).to(h.device()), f);
  }
  return h;
}

at::Tensor QwenVLImpl::embed(const Batch& b) {
  const at::Tensor& ids = b.at("input_ids");
  at::Tensor h = merged_embeddings(ids, b.get("pixel_values"), b.get("image_grid_thw"), ids == config_.image_token_id,
                                   "batch", b.get("pixel_values_videos"), b.get("video_grid_thw"));
  return scatter_sequence_fn ? scatter_sequence_fn(h) : h;
}

at::Tensor QwenVLImpl::position_ids(const Batch& b) const {
  const at::Tensor& ids = b.at("input_ids");
  const QwenVideos v{ids == config_.video_token_id, b.get("video_grid_thw"), b.get("second_per_grid_ts"),
                     config_.vision.tokens_per_second};
  return qwen_rope_index(ids, ids == config_.image_token_id, b.get("image_grid_thw"), config_.vision.spatial_merge_size,
                         "batch", b.get("segment_ids"), &v);
}

Batch QwenVLImpl::block_inputs(const Batch& b, at::ScalarType dtype) const {
  auto [cos, sin] = language_model->rotary(position_ids(b), dtype);
  return Batch{{"cos", cos}, {"sin", sin}, {"segment_ids", b.get("segment_ids")}};
}

QwenImages qwen_reference_images(const std::map<std::string, at::Tensor>& batch, const at::Tensor& ids,
                                 int64_t image_token_id, const std::string& file, int64_t video_token_id) {
  auto get = [&](const char* name) {
    auto it = batch.find(name);
    return it == batch.end() ? at::Tensor() : it->second;
  };
  QwenImages out;
  if (video_token_id < 0) {
    for (const char* name : {"pixel_values_videos", "video_grid_thw"})
      if (get(name).defined()) throw file_error(file, name, "videos are not supported for this model yet");
  } else {
    out.video_pixels = get("pixel_values_videos");
    out.video_grid = get("video_grid_thw");
    out.second_per_grid = get("second_per_grid_ts");
    if (out.video_pixels.defined() != out.video_grid.defined())
      throw file_error(file, out.video_pixels.defined() ? "video_grid_thw" : "pixel_values_videos",
                       "missing (pixel_values_videos comes with video_grid_thw)");
    const at::Tensor& vg = out.video_grid;
    if (vg.defined() && (vg.dim() != 2 || vg.size(1) != 3 || at::isFloatingType(vg.scalar_type())))
      throw file_error(file, "video_grid_thw", "expected integers [videos, 3]");
    if (out.video_pixels.defined() && !at::isFloatingType(out.video_pixels.scalar_type()))
      throw file_error(file, "pixel_values_videos", "expected floats");
    if (out.second_per_grid.defined() &&
        (!vg.defined() || out.second_per_grid.dim() != 1 || out.second_per_grid.size(0) != vg.size(0)))
      throw file_error(file, "second_per_grid_ts", "expected one value per video of video_grid_thw");
    out.video_rope_mask = ids == video_token_id;
  }
  const at::Tensor px = get("pixel_values"), grid = get("image_grid_thw");
  if (px.defined() != grid.defined())
    throw file_error(file, px.defined() ? "image_grid_thw" : "pixel_values", "missing (pixel_values comes with image_grid_thw)");
  if (grid.defined() && (grid.dim() != 2 || grid.size(1) != 3 || at::isFloatingType(grid.scalar_type())))
    throw file_error(file, "image_grid_thw", "expected integers [images, 3]");
  if (px.defined() && !at::isFloatingType(px.scalar_type())) throw file_error(file, "pixel_values", "expected floats");
  if (at::Tensor am = get("attention_mask"); am.defined()) {
    if (am.sizes() != ids.sizes() || !(am == 1).all().item<bool>())
      throw file_error(file, "attention_mask", "padding is not supported (all ones with the shape of input_ids expected)");
  }
  // transformers groups the positions by mm_token_type_ids (1: image); without it, by the image tokens
  at::Tensor rope_mask = ids == image_token_id;
  if (at::Tensor tt = get("mm_token_type_ids"); tt.defined()) {
    if (tt.sizes() != ids.sizes() || at::isFloatingType(tt.scalar_type()))
      throw file_error(file, "mm_token_type_ids", "expected integers with the shape of input_ids");
    const int64_t top = video_token_id < 0 ? 1 : 2;
    if ((tt > top).any().item<bool>() || (tt < 0).any().item<bool>())
      throw file_error(file, "mm_token_type_ids",
                       top == 1 ? "only text (0) and image (1) tokens are supported"
                                : "only text (0), image (1) and video (2) tokens are supported");
    rope_mask = tt == 1;
    if (top == 2) out.video_rope_mask = tt == 2;
  }
  out.pixel_values = px;
  out.grid_thw = grid;
  out.rope_mask = rope_mask;
  return out;
}

Model::ReferenceOutput QwenVLImpl::reference_forward(const std::map<std::string, at::Tensor>& batch,
                                                     const std::string& file) {
  auto [ids, labels] = reference_ids(batch, file);
  const QwenImages in = qwen_reference_images(batch, ids, config_.image_token_id, file, config_.video_token_id);
  at::Tensor h = merged_embeddings(ids, in.pixel_values, in.grid_thw, ids == config_.image_token_id, file,
                                   in.video_pixels, in.video_grid);
  const QwenVideos v{in.video_rope_mask, in.video_grid, in.second_per_grid, config_.vision.tokens_per_second};
  const at::Tensor pos = qwen_rope_index(ids, in.rope_mask, in.grid_thw, config_.vision.spatial_merge_size, file, {}, &v);
  auto [cos, sin] = language_model->rotary(pos, h.scalar_type());
  return reference_output(h, Batch{{"cos", cos}, {"sin", sin}}, labels);
}

Model::TrainWork QwenVLImpl::train_work() const {
  TrainWork w = language_model->train_work();
  const auto& v = config_.vision;
  const double h = static_cast<double>(v.hidden_size), unit = static_cast<double>(v.merge_unit());
  const double full = static_cast<double>(v.fullatt_block_indexes.size());
  const double window = static_cast<double>(v.window_size / v.patch_size) * static_cast<double>(v.window_size / v.patch_size);
  // 6 x the parameters a patch goes through (the merger's per m x m patches) + attention: whole image in the
  // full-attention blocks, a window's patches in the others
  w.per_patch = 6.0 * (static_cast<double>(v.num_tower_parameters()) +
                       static_cast<double>(v.num_merger_parameters()) / unit) +
                12.0 * h * (static_cast<double>(v.depth) - full) * window;
  w.per_patch_pair = 12.0 * h * full;
  w.patches_per_image_token = v.merge_unit();
  return w;
}

std::vector<CheckpointTensor> QwenVLImpl::checkpoint_tensors() const {
  std::vector<CheckpointTensor> out;
  for (const auto& item : visual->named_parameters()) out.push_back({"visual." + item.key(), "visual." + item.key()});
  for (CheckpointTensor e : language_model->checkpoint_tensors()) {  // model.*, lm_head.weight
    e.param = "language_model." + e.param;
    out.push_back(e);
  }
  return out;
}

bool QwenVLImpl::ignorable_checkpoint_tensor(const std::string& name) const {
  if (starts(name, "visual.")) return name.ends_with("rotary_pos_emb.inv_freq");
  return language_model->ignorable_checkpoint_tensor(name);
}

std::string QwenVLImpl::canonical_checkpoint_name(const std::string& n) const {
  // transformers' in-memory names (model.visual.*, model.language_model.*) -> the saved layout
  if (starts(n, "model.visual.")) return n.substr(6);
  if (starts(n, "model.language_model.")) return "model." + n.substr(21);
  return n;
}

std::string QwenVLImpl::reference_name(const std::string& n) const {
  if (starts(n, "visual.")) return "model." + n;
  const std::string lm = language_model->reference_name(n);  // the language model's in-memory name
  if (starts(lm, "model.")) return "model.language_model." + lm.substr(6);
  return lm;  // lm_head.weight
}

std::shared_ptr<Model> build_qwen_vl(const nlohmann::json& j, const std::string& file) {
  return QwenVL(QwenVLConfig::from_json(j, file)).ptr();
}

nlohmann::json describe_qwen_vl(const nlohmann::json& j, const std::string& file) {
  const QwenVLConfig c = QwenVLConfig::from_json(j, file);
  const auto& v = c.vision;
  const int64_t tower = v.num_tower_parameters(), merger = v.num_merger_parameters(), text = c.text.num_parameters();
  nlohmann::json vt = {{"model_type", "qwen2_5_vl_vision"}, {"parameters", tower},
                       {"layers", v.depth},                 {"hidden_size", v.hidden_size},
                       {"heads", v.num_heads},              {"patch_size", v.patch_size},
                       {"temporal_patch_size", v.temporal_patch_size}, {"window_size", v.window_size},
                       {"fullatt_block_indexes", v.fullatt_block_indexes}};
  nlohmann::json mg = {{"kind", "patch_merger"}, {"spatial_merge_size", v.spatial_merge_size}, {"parameters", merger}};
  nlohmann::json lm = {{"model_type", "qwen2"},           {"parameters", text},
                       {"layers", c.text.num_hidden_layers}, {"hidden_size", c.text.hidden_size},
                       {"vocab_size", c.text.vocab_size},   {"mrope_section", c.text.rope.mrope_section},
                       {"tied_embeddings", c.text.tie_word_embeddings}};
  return {{"family", "vlm"},
          {"model_type", "qwen2_5_vl"},
          {"parameters", tower + merger + text},
          {"image_token_id", c.image_token_id},
          {"components", {{"vision_tower", vt}, {"merger", mg}, {"language_model", lm}}}};
}

}  // namespace lf::models::vlm
