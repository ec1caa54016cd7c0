// LLaVA on the model contract (models/vlm/llava.h).
#include "loongforge/models/vlm/llava.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::models::vlm {

namespace {

bool starts(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// `file` names the config in errors; the sub-configs are read with their field names as paths.
nlohmann::json sub_config(const nlohmann::json& j, const char* key, const char* default_type) {
  nlohmann::json c = j.contains(key) && j[key].is_object() ? j[key] : nlohmann::json::object();
  if (!c.contains("model_type")) c["model_type"] = default_type;  // transformers' defaults
  return c;
}

}  // namespace

LlavaConfig LlavaConfig::from_json(const nlohmann::json& j, const std::string& file) {
  JsonReader r(j, file);
  LlavaConfig c;
  c.raw = j;
  c.vision = vision::VitConfig::from_json(sub_config(j, "vision_config", "clip_vision_model"), file, "vision_config");
  try {
    c.text = llama::DecoderConfig::from_json(sub_config(j, "text_config", "llama"), file);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (in text_config)");
  }
  c.image_token_id = r.has("image_token_id") ? r.integer("image_token_id") : r.integer("image_token_index", 32000);
  const nlohmann::json& fl = r.has("vision_feature_layer") ? j["vision_feature_layer"] : nlohmann::json(-2);
  c.feature_layer_list = fl.is_array();
  c.feature_layers = r.has("vision_feature_layer") ? r.int_list("vision_feature_layer") : std::vector<int64_t>{-2};
  if (c.feature_layers.empty()) r.fail("vision_feature_layer", "no layer given");
  c.select_strategy = r.string("vision_feature_select_strategy", "default");
  if (c.select_strategy != "default" && c.select_strategy != "full")
    r.fail("vision_feature_select_strategy", "'" + c.select_strategy + "' is not default or full");
  c.projector_act = r.string("projector_hidden_act", "gelu");
  c.projector_bias = r.boolean("multimodal_projector_bias", true);
  vision::require_activation(r, "projector_hidden_act", c.projector_act);
  for (int64_t l : c.feature_layers) {
    const int64_t n = c.vision.num_hidden_layers;
    if (l < -(n + 1) || l > n)
      r.fail("vision_feature_layer", std::to_string(l) + " is not a layer of a " + std::to_string(n) + "-layer tower");
  }
  if (c.image_token_id < 0 || c.image_token_id >= c.text.vocab_size)
    r.fail(r.has("image_token_id") ? "image_token_id" : "image_token_index",
           std::to_string(c.image_token_id) + " is outside the vocabulary of " + std::to_string(c.text.vocab_size));
  return c;
}

std::vector<int64_t> LlavaConfig::feature_indices() const {
  std::vector<int64_t> out;
  for (int64_t l : feature_layers) out.push_back(l < 0 ? vision.num_hidden_layers + 1 + l : l);
  return out;
}

ProjectorImpl::ProjectorImpl(int64_t in, int64_t out, bool bias, std::string act) : act_(std::move(act)) {
  linear_1 = register_module("linear_1", nn::Linear(in, out, bias));
  linear_2 = register_module("linear_2", nn::Linear(out, out, bias));
}

at::Tensor ProjectorImpl::forward(const at::Tensor& x) { return linear_2(vision::activation(act_, linear_1(x))); }

LlavaImpl::LlavaImpl(LlavaConfig c) : config_(std::move(c)) {
  vision_tower = register_module("vision_tower", vision::VisionTower(config_.vision));
  const int64_t in = config_.vision.hidden_size * static_cast<int64_t>(config_.feature_layers.size());
  multi_modal_projector = register_module(
      "multi_modal_projector", Projector(in, config_.text.hidden_size, config_.projector_bias, config_.projector_act));
  language_model = register_module("language_model", llama::CausalLM(config_.text));
  // What the features never reach cannot learn: the tower's layers past the last feature layer, its final norm and
  // SigLIP's pooling head. Frozen, so that no optimizer decays them (torch skips parameters without gradients).
  const std::vector<int64_t> idx = config_.feature_indices();
  const int64_t used = *std::max_element(idx.begin(), idx.end());
  for (auto& item : vision_tower->named_parameters()) {
    const std::string& n = item.key();
    bool unused = starts(n, "post_layernorm.") || starts(n, "head.");
    if (starts(n, "encoder.layers.")) unused = std::stoll(n.substr(15)) >= used;
    if (unused) item.value().set_requires_grad(false);
  }
}

void LlavaImpl::init_weights(double std) {
  const double text_std = std < 0 ? config_.text.raw.value("initializer_range", 0.02) : std;
  vision_tower->init_weights(std);
  language_model->init_weights(text_std);
  at::NoGradGuard no_grad;
  // transformers initialises the projector with the text config's initializer_range (normal, zero bias)
  for (auto& p : multi_modal_projector->named_parameters()) {
    if (p.key().ends_with(".bias")) p.value().zero_();
    else p.value().normal_(0.0, text_std);
  }
}

BatchSchema LlavaImpl::batch_schema() const {
  BatchSchema s = language_model->batch_schema();
  s.push_back(optional_field("pixel_values", at::kFloat, 4,
                             "images [N, C, H, W] in the order of their image tokens; item field (pixel_values.row: "
                             "each image's row)"));
  return s;
}

at::Tensor LlavaImpl::image_features(const at::Tensor& pixel_values) {
  const std::vector<int64_t> idx = config_.feature_indices();
  const int64_t upto = *std::max_element(idx.begin(), idx.end());
  std::vector<at::Tensor> hs = vision_tower->hidden_states(pixel_values, upto);
  std::vector<at::Tensor> picked;
  for (int64_t i : idx) {
    at::Tensor h = hs[static_cast<size_t>(i)];
    picked.push_back(config_.select_strategy == "default" ? h.narrow(1, 1, h.size(1) - 1) : h);
  }
  return multi_modal_projector(picked.size() == 1 ? picked[0] : at::cat(picked, -1));
}

at::Tensor LlavaImpl::merged_embeddings(const at::Tensor& ids, const at::Tensor& pixel_values, const std::string& where) {
  at::Tensor h = embed_fn ? embed_fn(ids) : language_model->embed(ids);
  const at::Tensor mask = ids == config_.image_token_id;
  const int64_t tokens = mask.sum().item<int64_t>();
  const int64_t images = pixel_values.defined() ? pixel_values.size(0) : 0;
  if (tokens != images * config_.tokens_per_image())
    throw Error(where + ": " + std::to_string(tokens) + " image tokens (id " + std::to_string(config_.image_token_id) +
                ") for " + std::to_string(images) + " images of " + std::to_string(config_.tokens_per_image()) +
                " tokens each");
  if (images == 0) return h;
  const auto& v = config_.vision;
  if (pixel_values.dim() != 4 || pixel_values.size(1) != v.num_channels || pixel_values.size(2) != v.image_size ||
      pixel_values.size(3) != v.image_size)
    throw Error(where + ": pixel_values must be [images, " + std::to_string(v.num_channels) + ", " +
                std::to_string(v.image_size) + ", " + std::to_string(v.image_size) + "]");
  at::Tensor f = image_features(pixel_values.to(h.scalar_type())).to(h.scalar_type());
  return h.masked_scatter(mask.unsqueeze(-1), f.reshape({-1, f.size(-1)}));
}

at::Tensor LlavaImpl::embed(const Batch& b) {
  at::Tensor h = merged_embeddings(b.at("input_ids"), b.get("pixel_values"), "batch");
  return scatter_sequence_fn ? scatter_sequence_fn(h) : h;
}

Model::ReferenceOutput LlavaImpl::reference_forward(const std::map<std::string, at::Tensor>& batch,
                                                    const std::string& file) {
  auto [ids, labels] = reference_ids(batch, file);
  at::Tensor px;
  if (auto p = batch.find("pixel_values"); p != batch.end()) px = p->second;
  at::Tensor h = merged_embeddings(ids, px, file);
  return reference_output(h, block_inputs(Batch{{"input_ids", ids}}, h.scalar_type()), labels);
}

Model::TrainWork LlavaImpl::train_work() const {
  TrainWork w = language_model->train_work();
  const auto& v = config_.vision;
  const double h = static_cast<double>(v.hidden_size), th = static_cast<double>(config_.text.hidden_size);
  const double proj_in = h * static_cast<double>(std::max<size_t>(1, config_.feature_layers.size()));
  // 6 x the parameters a patch goes through (tower, projector per image token: about one per patch) + attention
  w.per_patch = 6.0 * (static_cast<double>(v.num_parameters()) + proj_in * th + th * th);
  w.per_patch_pair = 12.0 * static_cast<double>(v.num_hidden_layers) * h;
  w.fixed_image_patches = v.num_positions();
  return w;
}

std::vector<CheckpointTensor> LlavaImpl::checkpoint_tensors() const {
  std::vector<CheckpointTensor> out;
  for (const auto& item : vision_tower->named_parameters()) out.push_back({"vision_tower." + item.key(), "vision_tower." + item.key()});
  for (const auto& item : multi_modal_projector->named_parameters())
    out.push_back({"multi_modal_projector." + item.key(), "multi_modal_projector." + item.key()});
  for (CheckpointTensor e : language_model->checkpoint_tensors()) {
    e.name = "language_model." + e.name;
    e.param = "language_model." + e.param;
    out.push_back(e);
  }
  return out;
}

bool LlavaImpl::ignorable_checkpoint_tensor(const std::string& name) const {
  return starts(name, "language_model.") &&
         language_model->ignorable_checkpoint_tensor(name.substr(std::string("language_model.").size()));
}

std::string LlavaImpl::canonical_checkpoint_name(const std::string& n) const {
  // transformers' llava key mapping, as loading applies it: llava-hf's CLIP/SigLIP `vision_model.` level, and the
  // in-memory names (model.vision_tower., model.multi_modal_projector., model.language_model., lm_head.)
  if (starts(n, "vision_tower.vision_model.")) return "vision_tower." + n.substr(26);
  if (starts(n, "model.vision_tower.")) return canonical_checkpoint_name(n.substr(6));
  if (starts(n, "model.multi_modal_projector.")) return n.substr(6);
  if (starts(n, "model.language_model.")) return "language_model.model." + n.substr(21);
  if (starts(n, "lm_head.")) return "language_model." + n;
  return n;
}

std::string LlavaImpl::reference_name(const std::string& n) const {
  if (starts(n, "language_model.")) {  // the language model's own in-memory name, placed as transformers places it
    const std::string lm = language_model->reference_name(n.substr(15));
    return starts(lm, "model.") ? "model.language_model." + lm.substr(6) : lm;
  }
  return "model." + n;
}

namespace {

nlohmann::json describe(const LlavaConfig& c) {
  const auto& v = c.vision;
  const int64_t in = v.hidden_size * static_cast<int64_t>(c.feature_layers.size()), d = c.text.hidden_size;
  const int64_t projector = in * d + d * d + (c.projector_bias ? 2 * d : 0);
  const int64_t text = c.text.num_parameters();
  nlohmann::json tower = {{"model_type", v.model_type},         {"parameters", v.num_parameters()},
                          {"layers", v.num_hidden_layers},      {"hidden_size", v.hidden_size},
                          {"heads", v.num_attention_heads},     {"image_size", v.image_size},
                          {"patch_size", v.patch_size},         {"feature_layers", c.feature_layers},
                          {"feature_select_strategy", c.select_strategy}};
  nlohmann::json lm = {{"model_type", c.text.model_type}, {"parameters", text},
                       {"layers", c.text.num_hidden_layers}, {"hidden_size", c.text.hidden_size},
                       {"vocab_size", c.text.vocab_size}};
  return {{"family", "vlm"},
          {"model_type", "llava"},
          {"parameters", v.num_parameters() + projector + text},
          {"image_token_id", c.image_token_id},
          {"tokens_per_image", c.tokens_per_image()},
          {"components",
           {{"vision_tower", tower},
            {"multi_modal_projector", {{"kind", "mlp2x_" + c.projector_act}, {"parameters", projector}}},
            {"language_model", lm}}}};
}

}  // namespace

std::shared_ptr<Model> build_llava(const nlohmann::json& j, const std::string& file) {
  return Llava(LlavaConfig::from_json(j, file)).ptr();
}

Composition compose_llava(const ComposeParts& p) {
  JsonReader vr(p.vision, p.vision_file), lr(p.language, p.language_file);
  nlohmann::json vision = p.vision;
  const std::string vt = vr.string("model_type", "");
  if (vt == "clip" || vt == "siglip") {  // a whole CLIP / SigLIP model: its vision half
    if (!vr.has("vision_config") || !p.vision.at("vision_config").is_object())
      vr.fail("vision_config", "missing (a " + vt + " model's vision half is its vision_config)");
    vision = p.vision.at("vision_config");
    vision["model_type"] = vt + "_vision_model";
  } else if (!vision::VitConfig::handles(vt)) {
    vr.fail("model_type", "'" + vt + "' is not a vision tower LLaVA composes (known: clip, clip_vision_model, siglip, "
                          "siglip_vision_model)");
  }
  vision.erase("architectures");
  nlohmann::json text = p.language;
  text.erase("architectures");
  nlohmann::json j = {{"architectures", {"LlavaForConditionalGeneration"}},
                      {"model_type", "llava"},
                      {"vision_config", vision},
                      {"text_config", text},
                      {"image_token_id", p.token_id(p.image_token.empty() ? "<image>" : p.image_token)},
                      {"projector_hidden_act", "gelu"},
                      {"multimodal_projector_bias", true},
                      {"vision_feature_layer", p.feature_layer},
                      {"vision_feature_select_strategy", p.select_strategy},
                      {"tie_word_embeddings", lr.boolean("tie_word_embeddings", false)}};
  LlavaConfig::from_json(j, "the LLaVA composed of " + p.vision_file + " and " + p.language_file);  // checks it
  Composition out;
  out.config = j;
  // a vision folder stores vision_model.* (LLaVA's llava-hf layout under vision_tower.); a LM folder model.* and
  // lm_head.weight (LLaVA's language_model.*)
  out.parts = {{p.vision_dir, "vision_tower."}, {p.language_dir, "language_model."}};
  out.components = {{"vision", {"vision_tower."}}, {"projector", {"multi_modal_projector."}},
                    {"language", {"language_model."}}};
  return out;
}

nlohmann::json describe_llava(const nlohmann::json& j, const std::string& file) {
  return describe(LlavaConfig::from_json(j, file));
}

}  // namespace lf::models::vlm
