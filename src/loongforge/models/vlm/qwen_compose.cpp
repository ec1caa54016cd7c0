// A Qwen2.5-VL / Qwen3-VL / Qwen3.5 composed from a Qwen vision tower and its patch merger plus a language-model folder
// (models/vlm/qwen_compose.h): the whole model's config.json as transformers writes it, and where the parts'
// tensors go.
#include "loongforge/models/vlm/qwen_compose.h"

#include <cmath>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/vlm/qwen3_vl.h"
#include "loongforge/models/vlm/qwen_vl.h"

namespace lf::models::vlm {

namespace {

// M-RoPE sections (temporal, height, width) for a head of `half` rotary pairs, in the proportions of the family's
// default (Qwen2.5-VL's [16, 24, 24], Qwen3-VL's [24, 20, 20] for 64 pairs, Qwen3.5's [11, 11, 10] for 32); height
// and width split the rest evenly, height taking an odd one.
std::vector<int64_t> scaled_sections(int64_t half, int64_t temporal_of_64) {
  const int64_t t = std::max<int64_t>(1, std::llround(static_cast<double>(half) * temporal_of_64 / 64.0));
  const int64_t w = (half - t) / 2;
  return {t, half - t - w, w};
}

std::vector<int64_t> sections_of(const nlohmann::json& text) {
  for (const char* block : {"rope_scaling", "rope_parameters"})
    if (text.contains(block) && text.at(block).is_object() && text.at(block).contains("mrope_section") &&
        text.at(block).at("mrope_section").is_array())
      return text.at(block).at("mrope_section").get<std::vector<int64_t>>();
  return {};
}

}  // namespace

Composition compose_qwen_vl(const ComposeParts& p) {
  JsonReader vr(p.vision, p.vision_file), lr(p.language, p.language_file);
  // the vision part: a whole Qwen2.5-VL / Qwen3-VL / Qwen3.5 folder (its vision_config; its language model is not
  // taken), or the vision model's own config (model_type qwen2_5_vl_vision, ..., tensors without "visual.")
  const std::string vt = vr.string("model_type", "");
  const bool whole = vr.has("vision_config");
  std::string tower;  // the tower's family
  for (const char* f : {"qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"})
    if (vt == f || vt == std::string(f) + "_vision") tower = f;
  if (tower.empty() || (whole && !p.vision.at("vision_config").is_object()))
    vr.fail("model_type", "'" + vt + "' is not a vision tower the patch_merger projector composes (known: qwen2_5_vl, "
                          "qwen3_vl, qwen3_5, qwen3_5_moe and their _vision configs)");
  // Qwen3.5's tower (no deepstack mergers) is the same in the dense and the MoE model: the language model picks which
  const bool qwen3_5 = tower == "qwen3_5" || tower == "qwen3_5_moe";
  const bool qwen3 = tower == "qwen3_vl" || qwen3_5;  // Qwen3-VL's model (qwen3_vl.h)
  const std::string lt = lr.string("model_type", "");
  std::string family = tower;
  if (qwen3_5) family = lt == "qwen3_5_moe_text" ? "qwen3_5_moe" : "qwen3_5";
  nlohmann::json vision = whole ? p.vision.at("vision_config") : p.vision;
  vision.erase("architectures");
  vision["model_type"] = family + "_vision";
  const std::string name = family == "qwen2_5_vl" ? "Qwen2.5-VL" : family == "qwen3_vl" ? "Qwen3-VL" : "Qwen3.5";

  // the language part: the decoder transformers' class fixes (Qwen2.5-VL's is Qwen2's, Qwen3-VL's Qwen3's, Qwen3.5's
  // the Qwen3.5 text decoder, dense or MoE)
  if (qwen3_5 ? lt != "qwen3_5_text" && lt != "qwen3_5_moe_text"
              : lt != (qwen3 ? "qwen3" : "qwen2") && lt != family + "_text")
    lr.fail("model_type", "'" + lt + "' cannot be the language model of a " + name + " (transformers' class fixes its decoder: " +
                              (qwen3_5 ? "qwen3_5_text or qwen3_5_moe_text" : qwen3 ? "qwen3" : "qwen2") + ")");
  nlohmann::json text = p.language;
  text.erase("architectures");
  text["model_type"] = family + "_text";
  const int64_t hidden = lr.integer("hidden_size"), heads = lr.integer("num_attention_heads");
  if (heads <= 0 || hidden % heads != 0) lr.fail("num_attention_heads", "must divide hidden_size");
  // Qwen2.5-VL's attention uses hidden_size / heads; Qwen3's head_dim defaults to 128 (transformers' Qwen3Config),
  // Qwen3.5's to 256 with a quarter of it rotated (partial_rotary_factor)
  int64_t rotary = qwen3 ? lr.integer("head_dim", qwen3_5 ? 256 : 128) : hidden / heads;
  if (qwen3_5) {
    double factor = lr.number("partial_rotary_factor", 0.25);
    for (const char* block : {"rope_parameters", "rope_scaling"})
      if (text.contains(block) && text.at(block).is_object() && text.at(block).contains("partial_rotary_factor"))
        factor = JsonReader(text.at(block), p.language_file, block).number("partial_rotary_factor");
    rotary = static_cast<int64_t>(static_cast<double>(rotary) * factor);
  }
  // multimodal rope: the vision folder's sections when they fit this head, else the family's scaled to it
  // (Qwen2.5-VL's [16, 24, 24] and Qwen3-VL's [24, 20, 20] of 64 pairs, Qwen3.5's [11, 11, 10] of 32)
  std::vector<int64_t> sections = whole && p.vision.contains("text_config") ? sections_of(p.vision.at("text_config"))
                                                                            : std::vector<int64_t>{};
  if (sections.empty() && whole) sections = sections_of(p.vision);
  int64_t sum = 0;
  for (int64_t s : sections) sum += s;
  if (sections.size() != 3 || sum != rotary / 2) sections = scaled_sections(rotary / 2, qwen3_5 ? 22 : qwen3 ? 24 : 16);
  const bool scaling = text.contains("rope_scaling") && text.at("rope_scaling").is_object();
  nlohmann::json& rope = text[scaling ? "rope_scaling" : "rope_parameters"];
  if (!rope.is_object()) rope = nlohmann::json::object();
  if (!rope.contains("rope_type") && !rope.contains("type")) rope["rope_type"] = "default";
  if (!scaling && !rope.contains("rope_theta") && text.contains("rope_theta")) rope["rope_theta"] = text["rope_theta"];
  rope["mrope_section"] = sections;
  if (qwen3) rope["mrope_interleaved"] = true;

  // the merger's output width is the language model's; a tower made for another width gets new output layers
  const int64_t was = JsonReader(vision, p.vision_file, "vision_config").integer("out_hidden_size", -1);
  vision["out_hidden_size"] = hidden;
  const bool tied = lr.boolean("tie_word_embeddings", false);
  text["tie_word_embeddings"] = tied;
  const char* architecture = family == "qwen2_5_vl" ? "Qwen2_5_VLForConditionalGeneration"
                             : family == "qwen3_vl"   ? "Qwen3VLForConditionalGeneration"
                             : family == "qwen3_5"    ? "Qwen3_5ForConditionalGeneration"
                                                      : "Qwen3_5MoeForConditionalGeneration";
  nlohmann::json j = {{"architectures", {architecture}},
                      {"model_type", family},
                      {"vision_config", vision},
                      {"text_config", text},
                      {"image_token_id", p.token_id(p.image_token.empty() ? "<|image_pad|>" : p.image_token)},
                      {"video_token_id", p.token_id("<|video_pad|>")},
                      {"vision_start_token_id", p.token_id("<|vision_start|>")},
                      {"vision_end_token_id", p.token_id("<|vision_end|>")},
                      {"tie_word_embeddings", tied}};
  const std::string what = "the " + name + " composed of " + p.vision_file + " and " + p.language_file;
  std::vector<std::string> skip;
  if (qwen3) {
    const Qwen3VLConfig c = Qwen3VLConfig::from_json(j, what);  // checks it
    if (static_cast<int64_t>(c.vision.deepstack_visual_indexes.size()) > c.text.num_hidden_layers)
      throw file_error(p.vision_file, "vision_config.deepstack_visual_indexes",
                       std::to_string(c.vision.deepstack_visual_indexes.size()) + " deepstack levels but " +
                           p.language_file + " has " + std::to_string(c.text.num_hidden_layers) + " layers to take them");
    if (was != hidden) {
      skip = {"model.visual.merger.linear_fc2.weight", "model.visual.merger.linear_fc2.bias"};
      for (size_t i = 0; i < c.vision.deepstack_visual_indexes.size(); ++i)
        for (const char* t : {"weight", "bias"})
          skip.push_back("model.visual.deepstack_merger_list." + std::to_string(i) + ".linear_fc2." + t);
    }
  } else {
    QwenVLConfig::from_json(j, what);  // checks it
    if (was != hidden) skip = {"visual.merger.mlp.2.weight", "visual.merger.mlp.2.bias"};
  }
  Composition out;
  out.config = j;
  // a whole VLM folder stores visual.* (or model.visual.*); a vision model's folder its names without "visual.";
  // a language folder model.* and lm_head.weight (the older saved layout of the VLM's language model). The parts
  // take the model's checkpoint names (Qwen2.5-VL: visual.*, model.*; Qwen3-VL and Qwen3.5: model.visual.*,
  // model.language_model.*).
  const std::string vis = qwen3 ? "model.visual." : "visual.", lm = qwen3 ? "model.language_model." : "model.";
  out.parts = {{p.vision_dir, whole ? "" : "visual.", {vis}, skip}, {p.language_dir, "", {lm, "lm_head."}, {}}};
  out.components = {{"vision", {"visual.patch_embed.", "visual.pos_embed.", "visual.blocks."}},
                    {"projector", {"visual.merger.", "visual.deepstack_merger_list."}},
                    {"language", {"language_model."}}};
  return out;
}

}  // namespace lf::models::vlm
