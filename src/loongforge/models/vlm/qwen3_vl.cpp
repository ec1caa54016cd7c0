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

std::string deepstack_key(size_t k) { return "deepstack." + std::to_string(k); }

}  // namespace

Qwen3VLConfig Qwen3VLConfig::from_json(const nlohmann::json& j, const std::string& file) {
  JsonReader r(j, file);
  Qwen3VLConfig c;
  c.raw = j;
  const nlohmann::json vision = r.has("vision_config") ? j.at("vision_config") : nlohmann::json::object();
  if (!vision.is_object()) r.expected("vision_config", "an object");
  c.vision = vision::Qwen3VitConfig::from_json(vision, file, "vision_config");
  c.text = qwen_vl_text_config(j, file, "qwen3", text_defaults(), {24, 20, 20});
  c.text.rope.mrope_interleaved = true;  // transformers' Qwen3VLTextRotaryEmbedding always interleaves
  qwen_vl_tokens(j, file, c.text.vocab_size, c.vision.out_hidden_size, c.text.hidden_size, &c.image_token_id,
                 &c.video_token_id);
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

BatchSchema Qwen3VLImpl::batch_schema() const { return qwen_vl_batch_schema(*language_model); }

at::Tensor Qwen3VLImpl::merged_embeddings(const at::Tensor& ids, const at::Tensor& pixel_values,
                                          const at::Tensor& grid_thw, const std::string& where,
                                          std::vector<at::Tensor>* deepstack) {
  at::Tensor h = embed_fn ? embed_fn(ids) : language_model->embed(ids);
  const at::Tensor mask = ids == config_.image_token_id;
  const int64_t images =
      qwen_check_image_tokens(mask, grid_thw, config_.vision.merge_unit(), config_.image_token_id, where);
  deepstack->clear();
  if (images == 0) return h;
  if (!pixel_values.defined()) throw Error(where + ": image_grid_thw without pixel_values");
  vision::Qwen3VitOutput v = visual(pixel_values, grid_thw, where);
  for (const at::Tensor& d : v.deepstack) deepstack->push_back(d.to(h.scalar_type()));
  return h.masked_scatter(mask.unsqueeze(-1).to(h.device()), v.merged.to(h.scalar_type()));
}

at::Tensor Qwen3VLImpl::embed(const Batch& b) {
  if (scatter_sequence_fn)  // the deepstack features would have to follow the sequence cut
    throw OptionError("sp", "Qwen3-VL's deepstack blocks under sequence parallelism are not supported yet");
  const at::Tensor& ids = b.at("input_ids");
  at::Tensor h = merged_embeddings(ids, b.get("pixel_values"), b.get("image_grid_thw"), "batch", &stash_);
  stash_ids_ = ids;
  return h;
}

Batch Qwen3VLImpl::blocks_batch(const at::Tensor& ids, const at::Tensor& rope_mask, const at::Tensor& grid,
                                const std::vector<at::Tensor>& deepstack, at::ScalarType dtype,
                                const std::string& where) const {
  const at::Tensor pos = qwen_rope_index(ids, rope_mask, grid, config_.vision.spatial_merge_size, where);
  auto [cos, sin] = language_model->rotary(pos, dtype);
  Batch in{{"cos", cos}, {"sin", sin}};
  if (grid.defined() && grid.size(0) > 0 && !config_.vision.deepstack_visual_indexes.empty()) {
    const at::Tensor mask = ids == config_.image_token_id;
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
  const bool ours = stash_ids_.defined() && stash_ids_.is_same(ids);
  const at::Tensor grid = b.get("image_grid_thw");
  return blocks_batch(ids, ids == config_.image_token_id, grid, ours ? stash_ : std::vector<at::Tensor>{}, dtype,
                      "batch");
}

at::Tensor Qwen3VLImpl::block_forward(const Batch& in, const at::Tensor& h, int64_t i) {
  at::Tensor y = language_model->block_forward(in, h, i);
  const at::Tensor mask = in.get("visual_mask");
  if (!mask.defined() || i >= static_cast<int64_t>(config_.vision.deepstack_visual_indexes.size())) return y;
  const at::Tensor f = in.get(deepstack_key(static_cast<size_t>(i)));
  if (!f.defined())
    throw Error("qwen3_vl: block " + std::to_string(i) + " adds deepstack features the vision tower makes in embed(); "
                "the first " + std::to_string(config_.vision.deepstack_visual_indexes.size()) +
                " blocks must run on the first pipeline stage");
  if (f.requires_grad() && !at::GradMode::is_enabled())
    throw Error("qwen3_vl: block " + std::to_string(i) + " adds deepstack features and cannot be recomputed or "
                "sharded as an FSDP unit yet (their gradients would not reach the vision tower)");
  // transformers' _deepstack_process: hidden_states[mask] += features
  const c10::List<std::optional<at::Tensor>> index({std::optional<at::Tensor>(mask.to(y.device()))});
  return at::index_put(y, index, y.index({mask.to(y.device())}) + f.to(y.scalar_type()));
}

Model::ReferenceOutput Qwen3VLImpl::reference_forward(const std::map<std::string, at::Tensor>& batch,
                                                      const std::string& file) {
  auto [ids, labels] = reference_ids(batch, file);
  const auto [px, grid, rope_mask] = qwen_reference_images(batch, ids, config_.image_token_id, file);
  std::vector<at::Tensor> deepstack;
  at::Tensor h = merged_embeddings(ids, px, grid, file, &deepstack);
  return reference_output(h, blocks_batch(ids, rope_mask, grid, deepstack, h.scalar_type(), file), labels);
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
  nlohmann::json ds = {{"kind", "patch_merger"},
                       {"deepstack_visual_indexes", v.deepstack_visual_indexes},
                       {"parameters", deep}};
  nlohmann::json lm = {{"model_type", "qwen3"},
                       {"parameters", text},
                       {"layers", c.text.num_hidden_layers},
                       {"hidden_size", c.text.hidden_size},
                       {"vocab_size", c.text.vocab_size},
                       {"mrope_section", c.text.rope.mrope_section},
                       {"mrope_interleaved", true},
                       {"tied_embeddings", c.text.tie_word_embeddings}};
  return {{"family", "vlm"},
          {"model_type", "qwen3_vl"},
          {"parameters", tower + merger + deep + text},
          {"image_token_id", c.image_token_id},
          {"components", {{"vision_tower", vt}, {"merger", mg}, {"deepstack_mergers", ds}, {"language_model", lm}}}};
}

}  // namespace lf::models::vlm
