#include "loongforge/models/policy/groot.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/dropout.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/models/llama/model.h"
#include "loongforge/models/policy/spec.h"

namespace lf::models::policy {

namespace {

bool starts(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

const std::string kBackbone = "_groot_model.backbone.model.";

// LeRobot's hard-coded nvidia/Cosmos-Reason2-2B config (a Qwen3-VL-2B layout).
nlohmann::json cosmos_reason2_config() {
  return {{"model_type", "qwen3_vl"},
          {"image_token_id", 151655},
          {"video_token_id", 151656},
          {"vision_start_token_id", 151652},
          {"vision_end_token_id", 151653},
          {"tie_word_embeddings", true},
          {"text_config",
           {{"attention_bias", false}, {"head_dim", 128}, {"hidden_act", "silu"}, {"hidden_size", 2048},
            {"intermediate_size", 6144}, {"max_position_embeddings", 262144}, {"model_type", "qwen3_vl_text"},
            {"num_attention_heads", 16}, {"num_hidden_layers", 28}, {"num_key_value_heads", 8}, {"rms_norm_eps", 1e-6},
            {"rope_scaling", {{"mrope_interleaved", true}, {"mrope_section", {24, 20, 20}}, {"rope_type", "default"}}},
            {"rope_theta", 5000000}, {"tie_word_embeddings", true}, {"vocab_size", 151936}}},
          {"vision_config",
           {{"deepstack_visual_indexes", {5, 11, 17}}, {"depth", 24}, {"hidden_act", "gelu_pytorch_tanh"},
            {"hidden_size", 1024}, {"in_channels", 3}, {"intermediate_size", 4096}, {"model_type", "qwen3_vl"},
            {"num_heads", 16}, {"num_position_embeddings", 2304}, {"out_hidden_size", 2048}, {"patch_size", 16},
            {"spatial_merge_size", 2}, {"temporal_patch_size", 2}}}};
}

// A diffusers block stack's settings from `key` of the GR00T config (the constructor's defaults for absent fields).
GrootBlocksConfig read_blocks(const JsonReader& g, const std::string& key, bool dit) {
  GrootBlocksConfig b;
  if (!g.has(key)) {
    if (dit) return {32, 32, 48, 1024, 0.2, 1e-5, true, true, true, false};  // GR00T_N1_7_DEFAULTS
    return {4, 32, 64, 0, 0.2, 1e-5, true, true, false, true};
  }
  const JsonReader r = g.object(key);
  b.num_layers = r.integer("num_layers", dit ? 12 : 0);  // vl_self_attention_cfg without num_layers: none
  b.num_attention_heads = r.integer("num_attention_heads", 8);
  b.attention_head_dim = r.integer("attention_head_dim", 64);
  b.output_dim = r.integer("output_dim", 26);
  b.dropout = r.number("dropout", 0.1);
  b.final_dropout = r.boolean("final_dropout", true);
  b.attention_bias = r.boolean("attention_bias", true);
  b.norm_eps = r.number("norm_eps", 1e-5);
  // absent: diffusers' default "sinusoidal"
  if (b.num_layers > 0 && (!r.json().contains("positional_embeddings") || r.has("positional_embeddings")))
    r.fail("positional_embeddings", "only null is supported (GR00T N1.7's)");
  if (r.string("activation_fn", "gelu-approximate") != "gelu-approximate")
    r.fail("activation_fn", "only gelu-approximate is supported");
  if (dit) {
    b.interleave_self_attention = r.boolean("interleave_self_attention", false);
    b.norm_elementwise_affine = r.boolean("norm_elementwise_affine", false);
    if (r.string("norm_type", "ada_norm") != "ada_norm") r.fail("norm_type", "only ada_norm is supported");
  } else {
    b.norm_elementwise_affine = true;
  }
  for (const char* k : {"num_attention_heads", "attention_head_dim"})
    if (r.integer(k, 1) <= 0) r.fail(k, "must be positive");
  return b;
}

// A raw N1.7 checkpoint's statistics for the embodiment TAG (statistics.json) in its modality config's order
// (processor_kwargs.modality_configs[TAG]), as LeRobot's flatten_n1_7_modality_stats: per modality (state, action)
// each stat the concatenation over modality_keys, q01 / q99 for min / max with use_percentiles. Also the config's
// action delta_indices (the valid action horizon) and video modality keys (the camera order).
void read_checkpoint_modalities(GrootConfig& c, const nlohmann::json& kw, const std::string& base, const std::string& tag,
                                const std::string& file, std::vector<std::string>& ignored) {
  namespace fs = std::filesystem;
  const nlohmann::json& mcs = kw.contains("modality_configs") ? kw["modality_configs"] : nlohmann::json();
  if (!mcs.is_object() || !mcs.contains(tag) || !mcs[tag].is_object()) return;
  const nlohmann::json& mc = mcs[tag];
  auto keys_of = [&](const char* modality) {
    std::vector<std::string> keys;
    if (mc.contains(modality) && mc[modality].is_object() && mc[modality].contains("modality_keys") &&
        mc[modality]["modality_keys"].is_array())
      for (const auto& k : mc[modality]["modality_keys"])
        if (k.is_string()) keys.push_back(k.get<std::string>());
    return keys;
  };
  c.video_keys = keys_of("video");
  if (mc.contains("action") && mc["action"].is_object() && mc["action"].contains("delta_indices") &&
      mc["action"]["delta_indices"].is_array())
    c.valid_action_horizon = static_cast<int64_t>(mc["action"]["delta_indices"].size());
  if (kw.contains("max_action_horizon") && kw["max_action_horizon"].is_number_integer())
    ignored.push_back("max_action_horizon");
  if (mc.contains("video") && mc["video"].is_object() && mc["video"].contains("delta_indices") &&
      mc["video"]["delta_indices"].is_array() && mc["video"]["delta_indices"].size() > 1)
    ignored.push_back("a video horizon of " + std::to_string(mc["video"]["delta_indices"].size()));
  const fs::path sfile = fs::path(base) / "statistics.json";
  if (!fs::exists(sfile)) return;
  const nlohmann::json all = read_json_file(sfile.string());
  if (!all.is_object() || !all.contains(tag) || !all[tag].is_object()) return;
  const nlohmann::json& raw = all[tag];
  const bool percentiles = kw.value("use_percentiles", nlohmann::json(false)) == nlohmann::json(true);
  for (const auto& [modality, feature] : {std::pair<std::string, std::string>{"state", "observation.state"}, {"action", "action"}}) {
    const std::vector<std::string> keys = keys_of(modality.c_str());
    if (!raw.contains(modality) || !raw[modality].is_object() || keys.empty()) continue;
    std::map<std::string, at::Tensor> flat;
    for (const char* stat : {"min", "max", "mean", "std"}) {
      const std::string source = percentiles && std::string(stat) == "min" ? "q01" : percentiles && std::string(stat) == "max" ? "q99" : stat;
      std::vector<double> values;
      for (const std::string& k : keys) {
        const std::string where = tag + "." + modality + "." + k + "." + source;
        const nlohmann::json& ks = raw[modality].contains(k) ? raw[modality][k] : nlohmann::json();
        if (!ks.is_object() || !ks.contains(source) || !ks[source].is_array())
          throw file_error(sfile.string(), where, "missing (the modality config of " + file + " lists '" + k + "')");
        for (const auto& v : ks[source]) {
          if (!v.is_number()) throw file_error(sfile.string(), where, "expected a list of numbers");
          values.push_back(v.get<double>());
        }
      }
      flat[stat] = at::tensor(values, at::kDouble).to(at::kFloat);
    }
    c.checkpoint_stats[feature] = flat;
  }
}

}  // namespace

GrootConfig GrootConfig::from_json(const nlohmann::json& j, const std::string& file) {
  namespace fs = std::filesystem;
  JsonReader r(j, file);
  GrootConfig c;
  c.raw = j;
  c.chunk_size = r.integer("chunk_size", 40);
  c.n_action_steps = r.integer("n_action_steps", 40);
  c.tune_llm = r.boolean("tune_llm", false);
  c.tune_visual = r.boolean("tune_visual", false);
  c.tune_projector = r.boolean("tune_projector", true);
  c.tune_diffusion_model = r.boolean("tune_diffusion_model", true);
  c.tune_vlln = r.boolean("tune_vlln", true);
  c.tune_top_llm_layers = r.integer("tune_top_llm_layers", 0);
  const PolicyFeatures f = PolicyFeatures::read(r, "groot");
  c.action_dim = f.action_dim;
  c.state_dim = f.state_dim;
  if (f.cameras.empty()) r.fail("input_features", "GR00T needs at least one VISUAL feature");

  // GR00T N1.7's model config, from the base model's folder
  const std::string base = r.string("base_model_path", "nvidia/GR00T-N1.7-3B");
  if (!fs::is_directory(base))
    r.fail("base_model_path", "'" + base + "' is not a local folder (LoongForge reads GR00T's model config from its config.json)");
  const std::string gfile = (fs::path(base) / "config.json").string();
  const nlohmann::json gj = read_json_file(gfile);
  // A raw GR00T N1.7 checkpoint (config.json without a policy "type") with processor sidecars, read as LeRobot's GR00T
  // processor reads them: processor_config.json's image geometry (when it gives image_target_size) and switches, the
  // embodiment's statistics and modality config, embodiment_id.json. What is not followed (relative actions,
  // max_action_horizon, video horizons) is said once on stderr when the sidecars ask for it.
  c.image_geometry = {{"image_crop_size", {230, 230}}, {"image_target_size", {256, 256}},
                      {"shortest_image_edge", nullptr}, {"crop_fraction", nullptr}};
  const fs::path sidecar = fs::path(base) / "processor_config.json";
  if (!gj.contains("type") && fs::exists(sidecar)) {
    const nlohmann::json pj = read_json_file(sidecar.string());
    const nlohmann::json kw = pj.is_object() ? pj.value("processor_kwargs", nlohmann::json::object()) : nlohmann::json();
    const std::string file = sidecar.string();
    auto pair = [&](const char* k) -> std::optional<std::pair<int64_t, int64_t>> {
      if (!kw.contains(k) || kw[k].is_null()) return std::nullopt;
      const nlohmann::json& v = kw[k];
      if (!v.is_array() || v.size() != 2 || !v[0].is_number_integer() || !v[1].is_number_integer() ||
          v[0].get<int64_t>() <= 0 || v[1].get<int64_t>() <= 0)
        throw file_error(file, std::string("processor_kwargs.") + k, "must be two positive integers or null");
      return std::make_pair(v[0].get<int64_t>(), v[1].get<int64_t>());
    };
    std::vector<std::string> ignored;
    const std::string tag = r.string("embodiment_tag", "new_embodiment");
    if (kw.is_object()) {
      if (const auto target = pair("image_target_size")) {
        const auto crop = pair("image_crop_size");
        c.image_target_h = target->first;
        c.image_target_w = target->second;
        c.image_resize_edge = c.image_target_h;
        if (kw.contains("shortest_image_edge") && !kw["shortest_image_edge"].is_null()) {
          if (!kw["shortest_image_edge"].is_number_integer() || kw["shortest_image_edge"].get<int64_t>() <= 0)
            throw file_error(file, "processor_kwargs.shortest_image_edge", "must be a positive integer or null");
          c.image_resize_edge = kw["shortest_image_edge"].get<int64_t>();
        }
        c.image_crop_fraction = 0;
        if (kw.contains("crop_fraction") && !kw["crop_fraction"].is_null()) {
          if (!kw["crop_fraction"].is_number())
            throw file_error(file, "processor_kwargs.crop_fraction", "must be a number or null");
          c.image_crop_fraction = kw["crop_fraction"].get<double>();
        } else if (crop) {
          c.image_crop_fraction = static_cast<double>(crop->first) / static_cast<double>(c.image_target_h);
        }
        // LeRobot reads a switch that is not a JSON boolean as false
        c.image_opencv_area = kw.value("use_albumentations", nlohmann::json(false)) == nlohmann::json(true);
        c.image_letterbox = kw.value("letter_box_transform", nlohmann::json(false)) == nlohmann::json(true);
        c.image_geometry = {{"image_crop_size", crop ? nlohmann::json{crop->first, crop->second} : nlohmann::json()},
                            {"image_target_size", {target->first, target->second}},
                            {"shortest_image_edge", kw.value("shortest_image_edge", nlohmann::json())},
                            {"crop_fraction", kw.value("crop_fraction", nlohmann::json())}};
      }
      if (kw.value("use_relative_action", nlohmann::json(false)) == nlohmann::json(true)) ignored.push_back("use_relative_action true");
      // as LeRobot reads them: a switch that is not a JSON boolean stays true, a dropout that is not a number is 0
      c.formalize_language = kw.value("formalize_language", nlohmann::json(true)) != nlohmann::json(false);
      c.clip_outliers = kw.value("clip_outliers", nlohmann::json(true)) != nlohmann::json(false);
      if (kw.contains("state_dropout_prob") && kw["state_dropout_prob"].is_number()) {
        c.processor_state_dropout = kw["state_dropout_prob"].get<double>();
        if (!(c.processor_state_dropout >= 0 && c.processor_state_dropout <= 1))
          throw file_error(file, "processor_kwargs.state_dropout_prob", "must be in [0, 1]");
      }
      read_checkpoint_modalities(c, kw, base, tag, file, ignored);
    }
    const fs::path ids = fs::path(base) / "embodiment_id.json";
    if (fs::exists(ids)) {  // _load_n1_7_embodiment_mapping: integer values (or strings of them); others skipped
      const nlohmann::json ij = read_json_file(ids.string());
      if (ij.is_object())
        for (const auto& [k, v] : ij.items()) {
          if (v.is_number_integer()) c.embodiment_ids[k] = v.get<int64_t>();
          else if (v.is_string()) try {
              size_t used = 0;
              const int64_t id = std::stoll(v.get<std::string>(), &used);
              if (used == v.get<std::string>().size()) c.embodiment_ids[k] = id;
            } catch (const std::exception&) {}
        }
    }
    static bool said = false;
    if (!ignored.empty() && !said) {
      said = true;
      std::string what;
      for (const auto& w : ignored) what += (what.empty() ? "" : ", ") + w;
      std::fprintf(stderr, "model: %s: GR00T N1.7's processor sidecars ask for what LoongForge's GR00T processor does "
                   "not follow (%s): batches are made without them\n", base.c_str(), what.c_str());
    }
  }
  const JsonReader g(gj, gfile);
  c.backbone_embedding_dim = g.integer("backbone_embedding_dim", 2048);
  c.select_layer = g.integer("select_layer", 16);
  c.hidden_size = g.integer("hidden_size", 1024);
  c.input_embedding_dim = g.integer("input_embedding_dim", 1536);
  c.max_state_dim = g.integer("max_state_dim", 132);
  c.max_action_dim = g.integer("max_action_dim", 132);
  c.action_horizon = g.integer("action_horizon", 40);
  c.state_history_length = g.integer("state_history_length", 1);
  c.max_seq_len = g.integer("max_seq_len", 1024);
  c.max_num_embodiments = g.integer("max_num_embodiments", 32);
  c.num_inference_timesteps = g.integer("num_inference_timesteps", 4);
  if (r.has("num_inference_timesteps")) c.num_inference_timesteps = r.integer("num_inference_timesteps");
  c.num_timestep_buckets = g.integer("num_timestep_buckets", 1000);
  c.attend_text_every_n_blocks = g.integer("attend_text_every_n_blocks", 2);
  c.add_pos_embed = g.boolean("add_pos_embed", true);
  c.use_vlln = g.boolean("use_vlln", true);
  c.use_alternate_vl_dit = g.boolean("use_alternate_vl_dit", true);
  c.noise_beta_alpha = g.number("noise_beta_alpha", 1.5);
  c.noise_beta_beta = g.number("noise_beta_beta", 1.0);
  c.noise_s = g.number("noise_s", 0.999);
  c.state_dropout_prob = g.number("state_dropout_prob", 0.2);
  c.dit = read_blocks(g, "diffusion_model_cfg", true);
  c.vl = read_blocks(g, "vl_self_attention_cfg", false);
  for (const char* k : {"backbone_embedding_dim", "select_layer", "hidden_size", "input_embedding_dim", "max_state_dim",
                        "max_action_dim", "action_horizon", "state_history_length", "max_seq_len",
                        "max_num_embodiments", "num_inference_timesteps", "num_timestep_buckets",
                        "attend_text_every_n_blocks"})
    if (g.integer(k, 1) <= 0) g.fail(k, "must be positive");
  if (c.dit.inner() != c.input_embedding_dim)
    g.fail("diffusion_model_cfg", "num_attention_heads x attention_head_dim = " + std::to_string(c.dit.inner()) +
                                      " must equal input_embedding_dim " + std::to_string(c.input_embedding_dim));
  if (c.dit.output_dim != c.hidden_size)
    g.fail("diffusion_model_cfg.output_dim", "must equal hidden_size " + std::to_string(c.hidden_size));
  if (c.vl.num_layers > 0 && c.vl.inner() != c.backbone_embedding_dim)
    g.fail("vl_self_attention_cfg", "num_attention_heads x attention_head_dim = " + std::to_string(c.vl.inner()) +
                                        " must equal backbone_embedding_dim " + std::to_string(c.backbone_embedding_dim));
  if (c.use_alternate_vl_dit && !c.dit.interleave_self_attention)
    g.fail("diffusion_model_cfg.interleave_self_attention", "AlternateVLDiT requires true");
  if (c.add_pos_embed && c.action_horizon > c.max_seq_len)
    g.fail("max_seq_len", "must be at least action_horizon " + std::to_string(c.action_horizon));
  if (c.action_dim > c.max_action_dim) r.fail("output_features", "action dimension exceeds GR00T's max_action_dim");
  if (c.state_dim > c.max_state_dim)
    r.fail("input_features", "state dimension exceeds GR00T's max_state_dim");

  // the backbone: Qwen3-VL cut to its first select_layer decoder layers
  const std::string name = g.string("model_name", "nvidia/Cosmos-Reason2-2B");
  nlohmann::json bj;
  std::string bfile = gfile;
  if (fs::is_directory(name)) {
    bfile = (fs::path(name) / "config.json").string();
    bj = read_json_file(bfile);
  } else if (name == "nvidia/Cosmos-Reason2-2B") {
    bj = cosmos_reason2_config();
  } else {
    g.fail("model_name", "'" + name + "' is neither a local folder nor a backbone LoongForge knows (nvidia/Cosmos-Reason2-2B)");
  }
  if (bj.value("model_type", std::string("qwen3_vl")) != "qwen3_vl")
    throw file_error(bfile, "model_type", "GR00T N1.7's backbone must be qwen3_vl");
  nlohmann::json& text = bj.contains("text_config") ? bj["text_config"] : bj;
  const int64_t layers = text.value("num_hidden_layers", int64_t{32});
  text["num_hidden_layers"] = std::min(layers, c.select_layer);
  if (text.contains("layer_types") && text["layer_types"].is_array() &&
      static_cast<int64_t>(text["layer_types"].size()) > c.select_layer)
    text["layer_types"].erase(text["layer_types"].begin() + c.select_layer, text["layer_types"].end());
  c.backbone = vlm::Qwen3VLConfig::from_json(bj, bfile);
  if (c.backbone.text.hidden_size != c.backbone_embedding_dim)
    g.fail("backbone_embedding_dim", "must equal the backbone's hidden_size " + std::to_string(c.backbone.text.hidden_size));
  return c;
}

// ---- modules ----

CategoryLinearImpl::CategoryLinearImpl(int64_t categories, int64_t in, int64_t out) {
  W = register_parameter("W", at::randn({categories, in, out}) * 0.02);
  b = register_parameter("b", at::zeros({categories, out}));
}

at::Tensor CategoryLinearImpl::forward(const at::Tensor& x, const at::Tensor& cat) {
  return at::bmm(x, W.index_select(0, cat)) + b.index_select(0, cat).unsqueeze(1);
}

CategoryMLPImpl::CategoryMLPImpl(int64_t categories, int64_t in, int64_t hidden, int64_t out) {
  layer1 = register_module("layer1", CategoryLinear(categories, in, hidden));
  layer2 = register_module("layer2", CategoryLinear(categories, hidden, out));
}

at::Tensor CategoryMLPImpl::forward(const at::Tensor& x, const at::Tensor& cat) {
  return layer2(at::relu(layer1(x, cat)), cat);
}

GrootAttentionImpl::GrootAttentionImpl(int64_t dim, int64_t context_dim, const GrootBlocksConfig& c)
    : heads_(c.num_attention_heads), head_dim_(c.attention_head_dim), dropout_(c.dropout) {
  const int64_t inner = c.inner(), kv = context_dim > 0 ? context_dim : dim;
  to_q = register_module("to_q", nn::Linear(dim, inner, c.attention_bias));
  to_k = register_module("to_k", nn::Linear(kv, inner, c.attention_bias));
  to_v = register_module("to_v", nn::Linear(kv, inner, c.attention_bias));
  to_out = register_module("to_out", torch::nn::ModuleList());
  to_out->push_back(nn::Linear(inner, dim, true));
}

at::Tensor GrootAttentionImpl::forward(const at::Tensor& x, const at::Tensor& context, const at::Tensor& key_mask) {
  const at::Tensor& kv = context.defined() ? context : x;
  const int64_t B = x.size(0), T = x.size(1), S = kv.size(1);
  const at::Tensor q = to_q(x).view({B, T, heads_, head_dim_}).transpose(1, 2);
  const at::Tensor k = to_k(kv).view({B, S, heads_, head_dim_}).transpose(1, 2);
  const at::Tensor v = to_v(kv).view({B, S, heads_, head_dim_}).transpose(1, 2);
  std::optional<at::Tensor> mask;
  // diffusers repeats the mask per head: [B, heads, 1, S]
  if (key_mask.defined()) mask = key_mask.view({B, 1, 1, S}).expand({B, heads_, 1, S});
  at::Tensor o = at::scaled_dot_product_attention(q, k, v, mask, 0.0, false);
  o = o.transpose(1, 2).reshape({B, T, heads_ * head_dim_});
  return at::dropout((*to_out)[0]->as<nn::LinearImpl>()->forward(o), dropout_, is_training());
}

GrootBlockImpl::GrootBlockImpl(int64_t dim, int64_t context_dim, bool ada_norm, const GrootBlocksConfig& c)
    : cross(context_dim > 0), ada_(ada_norm), dropout_(c.dropout), final_dropout_(c.final_dropout) {
  if (ada_) {  // AdaLayerNorm: linear (dim -> 2 dim) of SiLU(temb), LayerNorm(eps 1e-5) without affine
    norm1 = register_module("norm1", std::make_shared<torch::nn::Module>());
    norm1_linear = norm1->register_module("linear", nn::Linear(dim, 2 * dim, true));
  } else {
    norm1_ln = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(c.norm_eps)));
  }
  attn1 = register_module("attn1", GrootAttention(dim, context_dim, c));
  norm3 = register_module("norm3", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(c.norm_eps).elementwise_affine(c.norm_elementwise_affine)));
  auto ff = register_module("ff", std::make_shared<torch::nn::Module>());
  ff_net = ff->register_module("net", torch::nn::ModuleList());
  auto gelu = std::make_shared<torch::nn::Module>();
  gelu->register_module("proj", nn::Linear(dim, 4 * dim, true));
  ff_net->push_back(gelu);
  ff_net->push_back(torch::nn::Dropout(c.dropout));
  ff_net->push_back(nn::Linear(4 * dim, dim, true));
}

at::Tensor GrootBlockImpl::forward(const at::Tensor& h, const at::Tensor& context, const at::Tensor& key_mask,
                                   const at::Tensor& temb) {
  at::Tensor x;
  if (ada_) {
    const auto ss = norm1_linear(at::silu(temb)).chunk(2, 1);  // scale, shift
    x = at::layer_norm(h, {h.size(-1)}, {}, {}, 1e-5) * (1 + ss[0].unsqueeze(1)) + ss[1].unsqueeze(1);
  } else {
    x = norm1_ln(h);
  }
  at::Tensor a = attn1(x, cross ? context : at::Tensor(), cross ? key_mask : at::Tensor());
  if (final_dropout_) a = at::dropout(a, dropout_, is_training());
  at::Tensor out = a + h;
  auto* proj = (*ff_net)[0]->named_children()[0].value()->as<nn::LinearImpl>();
  at::Tensor f = at::gelu(proj->forward(norm3(out)), "tanh");
  f = (*ff_net)[2]->as<nn::LinearImpl>()->forward(at::dropout(f, dropout_, is_training()));
  if (final_dropout_) f = at::dropout(f, dropout_, is_training());
  return f + out;
}

GrootDiTImpl::GrootDiTImpl(const GrootConfig& c) : c_(c) {
  const int64_t inner = c.dit.inner();
  timestep_encoder = register_module("timestep_encoder", std::make_shared<torch::nn::Module>());
  timestep_embedder = timestep_encoder->register_module("timestep_embedder", std::make_shared<torch::nn::Module>());
  linear_1 = timestep_embedder->register_module("linear_1", nn::Linear(256, inner, true));
  linear_2 = timestep_embedder->register_module("linear_2", nn::Linear(inner, inner, true));
  transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.dit.num_layers; ++i) {
    const bool self_attn = i % 2 == 1 && c.dit.interleave_self_attention;
    transformer_blocks->push_back(GrootBlock(inner, self_attn ? 0 : c.backbone_embedding_dim, true, c.dit));
  }
  proj_out_1 = register_module("proj_out_1", nn::Linear(inner, 2 * inner, true));
  proj_out_2 = register_module("proj_out_2", nn::Linear(inner, c.dit.output_dim, true));
}

at::Tensor GrootDiTImpl::forward(const at::Tensor& hidden, const at::Tensor& vl, const at::Tensor& timestep,
                                 const at::Tensor& image_mask, const at::Tensor& attention_mask) {
  // diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1): [cos, sin] of t * exp(-ln(1e4) k / 127)
  const int64_t half = 128;
  const auto f32 = hidden.options().dtype(at::kFloat);
  const at::Tensor exponent = at::arange(0, half, f32) * (-std::log(10000.0)) / static_cast<double>(half - 1);
  const at::Tensor arg = timestep.unsqueeze(1).to(at::kFloat) * at::exp(exponent).unsqueeze(0);
  const at::Tensor proj = at::cat({at::cos(arg), at::sin(arg)}, -1).to(hidden.scalar_type());
  const at::Tensor temb = linear_2(at::silu(linear_1(proj)));
  at::Tensor image, text;
  if (c_.use_alternate_vl_dit) {
    image = image_mask.logical_and(attention_mask);
    text = image_mask.logical_not().logical_and(attention_mask);
  }
  at::Tensor h = hidden;
  for (size_t i = 0; i < transformer_blocks->size(); ++i) {
    auto* block = (*transformer_blocks)[i]->as<GrootBlockImpl>();
    at::Tensor mask;  // DiT: no mask on the cross attention
    if (c_.use_alternate_vl_dit && block->cross)
      mask = static_cast<int64_t>(i) % (2 * c_.attend_text_every_n_blocks) == 0 ? text : image;
    h = block->forward(h, vl, mask, temb);
  }
  const auto ss = proj_out_1(at::silu(temb)).chunk(2, 1);  // shift, scale
  h = at::layer_norm(h, {h.size(-1)}, {}, {}, 1e-6) * (1 + ss[1].unsqueeze(1)) + ss[0].unsqueeze(1);
  return proj_out_2(h);
}

GrootActionHeadImpl::GrootActionHeadImpl(const GrootConfig& c) : c_(c) {
  model = register_module("model", GrootDiT(c));
  state_encoder = register_module("state_encoder", CategoryMLP(c.max_num_embodiments, c.max_state_dim * c.state_history_length,
                                                               c.hidden_size, c.input_embedding_dim));
  action_encoder = register_module("action_encoder", std::make_shared<torch::nn::Module>());
  W1 = action_encoder->register_module("W1", CategoryLinear(c.max_num_embodiments, c.max_action_dim, c.input_embedding_dim));
  W2 = action_encoder->register_module("W2", CategoryLinear(c.max_num_embodiments, 2 * c.input_embedding_dim, c.input_embedding_dim));
  W3 = action_encoder->register_module("W3", CategoryLinear(c.max_num_embodiments, c.input_embedding_dim, c.input_embedding_dim));
  action_decoder = register_module("action_decoder", CategoryMLP(c.max_num_embodiments, c.hidden_size, c.hidden_size, c.max_action_dim));
  if (c.use_vlln) vlln = register_module("vlln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.backbone_embedding_dim})));
  if (c.vl.num_layers > 0) {
    vl_self_attention = register_module("vl_self_attention", std::make_shared<torch::nn::Module>());
    vl_blocks = vl_self_attention->register_module("transformer_blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.vl.num_layers; ++i) vl_blocks->push_back(GrootBlock(c.vl.inner(), 0, false, c.vl));
  }
  if (c.add_pos_embed) {
    position_embedding = register_module("position_embedding", torch::nn::Embedding(c.max_seq_len, c.input_embedding_dim));
    torch::NoGradGuard g;
    position_embedding->weight.normal_(0.0, 0.02);
  }
}

at::Tensor GrootActionHeadImpl::vl_features(const at::Tensor& features) {
  at::Tensor h = vlln ? vlln(features) : features;
  if (vl_blocks)
    for (size_t i = 0; i < vl_blocks->size(); ++i) h = (*vl_blocks)[i]->as<GrootBlockImpl>()->forward(h, {}, {}, {});
  return h;
}

at::Tensor GrootActionHeadImpl::velocity(const at::Tensor& vl, const at::Tensor& state_features, const at::Tensor& x_t,
                                         const at::Tensor& t_discrete, const at::Tensor& embodiment,
                                         const at::Tensor& image_mask, const at::Tensor& attention_mask) {
  const int64_t B = x_t.size(0), H = x_t.size(1), E = c_.input_embedding_dim;
  // MultiEmbodimentActionEncoder: W1 x, joined with the time's [sin, cos] (exp(-k ln(1e4) / (E / 2))), swish, W3
  const int64_t half = E / 2;
  const auto f32 = x_t.options().dtype(at::kFloat);
  const at::Tensor rate = at::log(at::scalar_tensor(10000.0, f32)) / static_cast<double>(half);
  const at::Tensor exponent = -at::arange(half, f32) * rate;
  const at::Tensor freqs = t_discrete.to(at::kFloat).view({B, 1, 1}).expand({B, H, 1}) * at::exp(exponent);
  const at::Tensor time_emb = at::cat({at::sin(freqs), at::cos(freqs)}, -1).to(x_t.scalar_type());
  const at::Tensor a = W1(x_t, embodiment);
  const at::Tensor w2 = W2(at::cat({a, time_emb}, -1), embodiment);
  at::Tensor features = W3(w2 * at::sigmoid(w2), embodiment);
  if (position_embedding) features = features + position_embedding->weight.narrow(0, 0, H).unsqueeze(0);
  const at::Tensor sa = at::cat({state_features, features}, 1);
  const at::Tensor out = model(sa, vl, t_discrete, image_mask, attention_mask);
  const at::Tensor pred = action_decoder(out, embodiment);
  return pred.narrow(1, pred.size(1) - H, H);
}

// ---- the policy ----

GrootPolicyImpl::GrootPolicyImpl(GrootConfig config) : PolicyModel(config.raw), config_(std::move(config)) {
  groot_model = register_module("_groot_model", std::make_shared<torch::nn::Module>());
  backbone = groot_model->register_module("backbone", std::make_shared<torch::nn::Module>());
  qwen = backbone->register_module("model", vlm::Qwen3VL(config_.backbone));
  action_head = groot_model->register_module("action_head", GrootActionHead(config_));
  // LeRobot's set_trainable_parameters: the frozen parts take no gradient
  const auto& c = config_;
  auto freeze = [](torch::nn::Module& m, bool train) {
    for (auto& p : m.parameters()) p.set_requires_grad(train);
  };
  freeze(*qwen->visual, c.tune_visual);
  freeze(*qwen->language_model, c.tune_llm);
  const int64_t layers = c.backbone.text.num_hidden_layers;
  for (int64_t i = std::max<int64_t>(0, layers - c.tune_top_llm_layers); i < layers && c.tune_top_llm_layers > 0; ++i)
    freeze(qwen->language_model->block(i), true);
  auto& h = *action_head;
  for (torch::nn::Module* m : {static_cast<torch::nn::Module*>(h.state_encoder.get()), h.action_encoder.get(),
                               static_cast<torch::nn::Module*>(h.action_decoder.get())})
    freeze(*m, c.tune_projector);
  if (h.position_embedding) freeze(*h.position_embedding, c.tune_projector);
  freeze(*h.model, c.tune_diffusion_model);
  if (h.vlln) freeze(*h.vlln, c.tune_vlln);
  if (h.vl_self_attention) freeze(*h.vl_self_attention, c.tune_vlln);
}

void GrootPolicyImpl::init_weights(double std) {
  torch::NoGradGuard g;
  qwen->init_weights(std);
  // PyTorch's defaults for the action head's linear layers and LayerNorms; CategorySpecificLinear W ~ 0.02 N(0, 1),
  // b = 0; the position embedding N(0, 0.02)
  for (auto& m : action_head->modules(false)) {
    if (auto* l = m->as<nn::LinearImpl>()) {
      torch::nn::init::kaiming_uniform_(l->weight, std::sqrt(5.0));
      if (l->bias.defined()) {
        const double bound = 1.0 / std::sqrt(static_cast<double>(l->in_features));
        l->bias.uniform_(-bound, bound);
      }
    } else if (auto* cl = m->as<CategoryLinearImpl>()) {
      cl->W.normal_(0.0, 0.02);
      cl->b.zero_();
    } else if (auto* ln = m->as<torch::nn::LayerNormImpl>()) {
      if (ln->weight.defined()) ln->weight.fill_(1.0);
      if (ln->bias.defined()) ln->bias.zero_();
    }
  }
  if (action_head->position_embedding) action_head->position_embedding->weight.normal_(0.0, 0.02);
}

BatchSchema GrootPolicyImpl::batch_schema() const {
  const auto& c = config_;
  const std::string H = std::to_string(c.action_horizon), A = std::to_string(c.max_action_dim);
  BatchSchema s;
  s.push_back(required_field("state", at::kFloat, 3, "GR00T's normalised state [B, " + std::to_string(c.state_history_length) + ", " + std::to_string(c.max_state_dim) + "]"));
  s.push_back(required_field("action", at::kFloat, 3, "normalised action chunk [B, " + H + ", " + A + "]"));
  s.push_back(required_field("action_mask", at::kFloat, 3, "the chunk's valid elements [B, " + H + ", " + A + "]"));
  s.push_back(required_field("embodiment_id", at::kLong, 1, "embodiment index [B]"));
  s.push_back(required_field("input_ids", at::kLong, 2, "the backbone's tokens (text and image tokens) [B, L]"));
  s.push_back(required_field("attention_mask", at::kLong, 2, "the backbone's valid tokens [B, L]"));
  s.push_back(required_field("pixel_values", at::kFloat, 2, "Qwen3-VL patches [patches, C x T x P x P]"));
  s.push_back(required_field("image_grid_thw", at::kLong, 2, "per image (t, h, w) [images, 3]"));
  s.push_back(optional_field("noise", at::kFloat, 3, "flow matching's noise [B, " + H + ", " + A + "] (drawn when absent)"));
  s.push_back(optional_field("time", at::kFloat, 1, "flow matching's time [B] (GR00T's: 1 is the data; drawn when absent)"));
  return s;
}

int64_t GrootPolicyImpl::loss_terms(const Batch& b) const {
  if (const at::Tensor m = b.get("action_mask"); m.defined()) return static_cast<int64_t>(m.to(at::kDouble).sum().item<double>());
  return b.num_rows() * config_.action_horizon * config_.max_action_dim;
}

double GrootPolicyImpl::train_flops_per_sample(int64_t seq) const {
  // the action head over the state and action tokens (forward and backward); the backbone's forward over the prompt
  int64_t head = 0, backbone = 0;
  for (const auto& p : action_head->parameters()) head += p.numel();
  for (const auto& p : qwen->parameters()) backbone += p.numel();
  return 6.0 * static_cast<double>(config_.action_horizon + 1) * static_cast<double>(head) +
         2.0 * static_cast<double>(std::max<int64_t>(seq, 1)) * static_cast<double>(backbone);
}

at::Tensor GrootPolicyImpl::head_loss_sum(const at::Tensor& h, const Batch&) { return h.to(at::kFloat).sum(); }

GrootPolicyImpl::Backbone GrootPolicyImpl::run_backbone(const Batch& b) {
  const bool frozen = !config_.tune_llm && !config_.tune_visual && config_.tune_top_llm_layers == 0;
  std::optional<torch::NoGradGuard> no_grad;
  if (frozen) no_grad.emplace();
  const at::Tensor ids = b.at("input_ids");
  const at::Tensor valid = b.at("attention_mask") == 1;
  const bool padded = !valid.all().item<bool>();
  // Left-padded prompts (LeRobot's processor pads on the left): transformers gives the valid tokens the positions
  // and attention of the unpadded prompt, and the pad tokens, whose query rows are fully masked, no attention output
  // (SDPA's 0). Here each row's valid tokens are moved first (in order), so that causal attention and the positions
  // block_inputs computes are the unpadded prompt's; the pads' features are their embedding through each kept layer's
  // residual MLP alone; then the rows are put back in their order.
  at::Tensor order;
  Batch in;
  if (padded) {
    order = at::argsort(valid.logical_not().to(at::kInt), /*stable=*/true, 1, false);
    in.set("input_ids", ids.gather(1, order));
  } else {
    in.set("input_ids", ids);
  }
  in.set("pixel_values", b.at("pixel_values"));
  in.set("image_grid_thw", b.at("image_grid_thw"));
  // (a bias: FSDP's bf16 compute copies replace only the 2-D weights)
  const at::Tensor dtype_probe = action_head->model->proj_out_2->bias;
  at::Tensor h = qwen->embed(in);
  const at::Tensor embedded = h;
  const Batch blocks = qwen->block_inputs(in, h.scalar_type());
  // the last kept layer's output as GR00T's forward hook takes it: before that layer's deepstack features
  const int64_t n = qwen->num_blocks();
  for (int64_t i = 0; i < n; ++i) h = i + 1 < n ? qwen->block_forward(blocks, h, i) : qwen->block_body(blocks, h, i);
  if (padded) {
    const at::Tensor moved_valid = valid.gather(1, order);
    at::Tensor pads = embedded;  // only the pad positions' values are kept
    for (int64_t i = 0; i < n; ++i) {
      auto* layer = dynamic_cast<llama::DecoderLayerImpl*>(&qwen->block(i));
      if (!layer || !layer->mlp) throw Error("groot: padded prompts need the backbone's dense decoder layers");
      pads = pads + layer->mlp(layer->post_attention_layernorm(pads));
    }
    h = at::where(moved_valid.unsqueeze(-1), h, pads);
    h = at::empty_like(h).scatter(1, order.unsqueeze(-1).expand_as(h), h);
  }
  Backbone out;
  out.features = h.to(dtype_probe.scalar_type());
  out.image_mask = ids == config_.backbone.image_token_id;
  out.attention_mask = valid;
  return out;
}

at::Tensor GrootPolicyImpl::forward_whole(const Batch& b) {
  const auto& c = config_;
  const at::Tensor actions = b.at("action");
  const int64_t B = actions.size(0);
  at::Tensor noise = b.get("noise"), time = b.get("time");
  if (!noise.defined()) noise = at::randn(actions.sizes(), actions.options());
  if (!time.defined()) {  // (1 - Beta(alpha, beta)) * noise_s, a Beta draw as X / (X + Y) of two Gamma draws
    const at::Tensor x = at::_standard_gamma(at::full({B}, c.noise_beta_alpha, at::kFloat));
    const at::Tensor y = at::_standard_gamma(at::full({B}, c.noise_beta_beta, at::kFloat));
    time = ((1 - x / (x + y)) * c.noise_s).to(actions.options());
  }
  const Backbone bb = run_backbone(b);
  const at::Tensor vl = action_head->vl_features(bb.features);
  const at::Tensor emb = b.at("embodiment_id");
  at::Tensor state_features = action_head->state_encoder(b.at("state").reshape({B, 1, -1}), emb);
  if (is_training() && c.state_dropout_prob > 0) {
    const at::Tensor drop = (at::rand({B}, state_features.options()) < c.state_dropout_prob).to(state_features.scalar_type());
    state_features = state_features * (1 - drop.view({B, 1, 1}));
  }
  const at::Tensor t = time.view({B, 1, 1});
  const at::Tensor x_t = (1 - t) * noise + t * actions;
  const at::Tensor target = actions - noise;
  const at::Tensor t_discrete = (t.view({B}) * static_cast<double>(c.num_timestep_buckets)).to(at::kLong);
  const at::Tensor v = action_head->velocity(vl, state_features, x_t, t_discrete, emb, bb.image_mask, bb.attention_mask);
  const at::Tensor mask = b.at("action_mask").to(v.scalar_type());
  return ((v - target).square() * mask).reshape({B, -1});
}

at::Tensor GrootPolicyImpl::predict_action_chunk(const Batch& b, const at::Tensor& start) {
  torch::NoGradGuard g;
  const bool was = is_training();
  eval();
  const auto& c = config_;
  const at::Tensor state = b.at("state");
  const int64_t B = state.size(0);
  const Backbone bb = run_backbone(b);
  const at::Tensor vl = action_head->vl_features(bb.features);
  const at::Tensor emb = b.at("embodiment_id");
  const at::Tensor state_features = action_head->state_encoder(state.reshape({B, 1, -1}), emb);
  at::Tensor x = start.defined() ? start : at::randn({B, c.action_horizon, c.max_action_dim}, state.options());
  const double dt = 1.0 / static_cast<double>(c.num_inference_timesteps);
  for (int64_t step = 0; step < c.num_inference_timesteps; ++step) {
    // int(step / N * buckets), as Python computes it in double
    const double t_cont = static_cast<double>(step) / static_cast<double>(c.num_inference_timesteps);
    const auto t_discrete = static_cast<int64_t>(t_cont * static_cast<double>(c.num_timestep_buckets));
    const at::Tensor ts = at::full({B}, t_discrete, state.options().dtype(at::kLong));
    x = x + dt * action_head->velocity(vl, state_features, x, ts, emb, bb.image_mask, bb.attention_mask);
  }
  train(was);
  const int64_t horizon = std::max<int64_t>(1, std::min({c.action_horizon, c.chunk_size, c.n_action_steps}));
  return x.narrow(1, 0, horizon).narrow(2, 0, c.action_dim);
}

Batch GrootPolicyImpl::check_batch(const std::map<std::string, at::Tensor>& batch, const std::string& file) const {
  const auto& c = config_;
  BatchChecker k(batch, file, action_head->model->proj_out_2->bias.scalar_type());  // (a bias, as above)
  const int64_t B = BatchChecker::kB, H = c.action_horizon, A = c.max_action_dim;
  k.take("state", {B, c.state_history_length, c.max_state_dim}, true);
  k.take("action", {B, H, A}, true);
  if (const at::Tensor m = k.raw("action_mask"); m.defined() && m.scalar_type() == at::kBool)
    k.take("action_mask", {B, H, A}, true, BatchChecker::kBool);
  else
    k.take("action_mask", {B, H, A}, true);
  k.take("embodiment_id", {B}, true, BatchChecker::kInteger);
  k.take("input_ids", {B, -1}, true, BatchChecker::kInteger);
  const int64_t L = k.out.at("input_ids").size(1);
  if (const at::Tensor m = k.raw("attention_mask"); m.defined() && m.scalar_type() == at::kBool)
    k.take("attention_mask", {B, L}, true, BatchChecker::kBool);
  else
    k.take("attention_mask", {B, L}, true, BatchChecker::kInteger);
  k.take("pixel_values", {-1, -1}, true);
  k.take("image_grid_thw", {-1, 3}, true, BatchChecker::kInteger);
  k.take("noise", {B, H, A}, false);
  k.take("time", {B}, false);
  k.take("sample_noise", {B, H, A}, false);
  Batch out = k.out;
  out.set("attention_mask", out.at("attention_mask").to(at::kLong));
  const at::Tensor emb = out.at("embodiment_id");
  if (emb.min().item<int64_t>() < 0 || emb.max().item<int64_t>() >= c.max_num_embodiments)
    throw file_error(file, "embodiment_id", "must be in [0, " + std::to_string(c.max_num_embodiments) + ")");
  const at::Tensor ids = out.at("input_ids");
  if (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= c.backbone.text.vocab_size)
    throw file_error(file, "input_ids", "ids must be in [0, " + std::to_string(c.backbone.text.vocab_size) + ")");
  // padded prompts: on the left only (LeRobot's processor's side; right pads' queries see the prompt)
  const at::Tensor m = out.at("attention_mask") == 1;
  if (!(m.to(at::kInt).diff(1, 1) >= 0).all().item<bool>() || !m.select(1, L - 1).all().item<bool>())
    throw file_error(file, "attention_mask", "prompts must be padded on the left (zeros, then ones; the last token valid)");
  return out;
}

Model::ReferenceOutput GrootPolicyImpl::reference_forward(const std::map<std::string, at::Tensor>& batch, const std::string& file) {
  const Batch b = check_batch(batch, file);
  for (const char* k : {"noise", "time"})
    if (!b.has(k)) throw file_error(file, k, "missing (flow matching's draw: dump is deterministic)");
  if (!b.has("sample_noise"))
    throw file_error(file, "sample_noise", "missing (the sampler's start [B, action_horizon, max_action_dim]: dump is deterministic)");
  ReferenceOutput r;
  const at::Tensor h = forward_whole(b);
  r.loss = h.sum() / (b.at("action_mask").to(h.scalar_type()).sum() + 1e-6);
  r.outputs.emplace_back("action_chunk", predict_action_chunk(b, b.at("sample_noise")));
  return r;
}

std::vector<CheckpointTensor> GrootPolicyImpl::checkpoint_tensors() const {
  std::vector<CheckpointTensor> out;
  for (CheckpointTensor e : qwen->checkpoint_tensors()) {
    e.name = kBackbone + e.name;
    e.param = kBackbone + e.param;
    out.push_back(e);
  }
  for (const auto& item : action_head->named_parameters())
    out.push_back({"_groot_model.action_head." + item.key(), "_groot_model.action_head." + item.key()});
  return out;
}

bool GrootPolicyImpl::ignorable_checkpoint_tensor(const std::string& name) const {
  return starts(name, kBackbone) && qwen->ignorable_checkpoint_tensor(name.substr(kBackbone.size()));
}

std::string GrootPolicyImpl::canonical_checkpoint_name(const std::string& stored) const {
  // safetensors' save_model keeps one name of tied tensors: the first in sorted order, the unused lm_head's
  if (config_.backbone.text.tie_word_embeddings && stored == kBackbone + "lm_head.weight")
    return kBackbone + "model.language_model.embed_tokens.weight";
  return stored;
}

std::optional<Model::BaseWeights> GrootPolicyImpl::base_weights() const {
  namespace fs = std::filesystem;
  const std::string base = config_.raw.value("base_model_path", std::string());
  for (const char* f : {"model.safetensors", "model.safetensors.index.json"})
    if (!base.empty() && fs::exists(fs::path(base) / f)) return BaseWeights{base, "_groot_model."};
  return std::nullopt;
}

namespace {

// LeRobot's N1_7_EMBODIMENT_MAPPING (processor_groot.py): embodiment tag -> id.
const std::map<std::string, int64_t>& default_embodiment_ids() {
  static const std::map<std::string, int64_t> ids = {
      {"oxe_droid_relative_eef_relative_joint", 24}, {"xdof_relative_eef_relative_joint", 27},
      {"xdof_relative_eef_relative_joint_subtask", 27}, {"real_g1_relative_eef_relative_joints", 25},
      {"real_r1_pro_sharpa_relative_eef", 26}, {"real_r1_pro_sharpa_relative_eef_human", 26},
      {"real_r1_pro_sharpa_relative_eef_maxinsights", 26}, {"real_r1_pro_sharpa_relative_eef_mecka", 26},
      {"unitree_g1_full_body_with_waist_height_nav_cmd", 25}, {"simpler_env_google", 0}, {"simpler_env_widowx", 1},
      {"libero_sim", 2}, {"new_embodiment", 10}};
  return ids;
}

// The mapping in use: the checkpoint's embodiment_id.json when it has one, else LeRobot's.
const std::map<std::string, int64_t>& embodiment_ids(const GrootConfig& c) {
  return c.embodiment_ids.empty() ? default_embodiment_ids() : c.embodiment_ids;
}

// The tag's id (0 for a tag the mapping lacks).
int64_t embodiment_id_of(const GrootConfig& c, const std::string& tag) {
  const auto& ids = embodiment_ids(c);
  auto it = ids.find(tag);
  return it == ids.end() ? 0 : it->second;
}

nlohmann::json embodiment_mapping_json(const GrootConfig& c) {
  nlohmann::json m = nlohmann::json::object();
  for (const auto& [t, id] : embodiment_ids(c)) m[t] = id;
  return m;
}

constexpr int64_t kNativeHorizon = 40;               // N1_7_NATIVE_ACTION_HORIZON

// min / max of a feature's statistics as GR00T aligns them to D values (min padded with 0, max with 1, cut).
std::pair<at::Tensor, at::Tensor> min_max(const Policy::Stats& stats, const std::string& name, int64_t D) {
  auto vec = [&](const char* stat, double fill) {
    const at::Tensor t = stats.at(name).at(stat).to(at::kFloat).flatten();
    if (t.numel() >= D) return t.narrow(0, 0, D);
    return at::cat({t, at::full({D - t.numel()}, fill, at::kFloat)});
  };
  return {vec("min", 0.0), vec("max", 1.0)};
}

bool has_min_max(const Policy::Stats& stats, const std::string& name) {
  auto it = stats.find(name);
  return it != stats.end() && it->second.count("min") && it->second.count("max");
}

// GR00T's _min_max_norm: [-1, 1] (clipped with clip_outliers), 0 where max = min.
at::Tensor groot_normalize(const at::Tensor& x, const Policy::Stats& stats, const std::string& name, bool clip) {
  if (!has_min_max(stats, name)) return x;
  auto [lo, hi] = min_max(stats, name, x.size(-1));
  lo = lo.to(x.device()), hi = hi.to(x.device());
  const at::Tensor denom = hi - lo, ok = denom != 0;
  const at::Tensor safe = at::where(ok, denom, at::ones_like(denom));
  const at::Tensor mapped = 2 * (x - lo) / safe - 1;
  const at::Tensor out = at::where(ok, mapped, at::zeros_like(mapped));
  return clip ? out.clamp(-1.0, 1.0) : out;
}

}  // namespace

PolicySpec GrootPolicyImpl::policy_spec() const {
  const auto& c = config_;
  PolicySpec s = lerobot_policy_spec(c.raw, "config.json");
  const int64_t H = std::min(c.chunk_size, kNativeHorizon);
  if (H != c.action_horizon)
    throw file_error("config.json", "chunk_size", "GR00T's processor packs min(chunk_size, 40) = " + std::to_string(H) +
                                                      " action steps; the model's action_horizon is " + std::to_string(c.action_horizon));
  for (const char* k : {"max_state_dim", "max_action_dim"})
    if (c.raw.contains(k) && c.raw[k].is_number_integer() &&
        c.raw[k].get<int64_t>() != (std::string(k) == "max_state_dim" ? c.max_state_dim : c.max_action_dim))
      throw file_error("config.json", k, "differs from the GR00T model config's (base_model_path)");
  for (int64_t i = 0; i < H; ++i) s.action_offsets.push_back(i);
  s.n_action_steps = c.n_action_steps;
  s.drop_n_last_frames = H - 1;
  if (c.state_dim > 0) s.stats_features.push_back("observation.state");
  s.stats_features.push_back("action");
  s.vlm_prompt.enabled = true;
  s.vlm_prompt.image_token_id = c.backbone.image_token_id;
  s.vlm_prompt.resize_edge = c.image_resize_edge;
  s.vlm_prompt.target_height = c.image_target_h;
  s.vlm_prompt.target_width = c.image_target_w;
  s.vlm_prompt.crop_fraction = c.image_crop_fraction;
  s.vlm_prompt.opencv_area = c.image_opencv_area;
  s.vlm_prompt.letterbox = c.image_letterbox;
  if (!c.video_keys.empty()) {  // _ordered_image_keys: the checkpoint's camera order (wrist_image also as image2)
    std::vector<std::string> ordered;
    auto has = [&](const std::string& n) {
      return std::any_of(s.inputs.begin(), s.inputs.end(), [&](const PolicyFeature& f) { return f.type == "VISUAL" && f.name == n; });
    };
    for (const std::string& k : c.video_keys)
      for (const std::string& n : {"observation.images." + k, k == "wrist_image" ? std::string("observation.images.image2") : std::string()})
        if (!n.empty() && has(n)) {
          ordered.push_back(n);
          break;
        }
    s.vlm_prompt.cameras = ordered;  // none matched: every camera, sorted (as LeRobot falls back)
  }
  if (c.state_dim > 0) s.state_dropout_prob = c.processor_state_dropout;
  s.vlm_prompt.padding_side = "left";
  const std::string tag = c.raw.value("embodiment_tag", std::string("new_embodiment"));
  // make_groot_pre_post_processors' pipelines as save_pretrained writes them
  const nlohmann::json rename = {{"registry_name", "rename_observations_processor"}, {"config", {{"rename_map", nlohmann::json::object()}}}};
  const nlohmann::json batch = {{"registry_name", "to_batch_processor"}, {"config", nlohmann::json::object()}};
  const nlohmann::json device = {{"registry_name", "device_processor"}, {"config", {{"device", "cpu"}, {"float_dtype", nullptr}}}};
  nlohmann::json pack = {{"registry_name", "groot_n1_7_pack_inputs_v1"},
                         {"config",
                          {{"state_horizon", 1}, {"action_horizon", H}, {"valid_action_horizon", H}, {"video_horizon", nullptr},
                           {"max_state_dim", c.max_state_dim}, {"max_action_dim", c.max_action_dim}, {"language_key", "task"},
                           {"formalize_language", c.formalize_language}, {"embodiment_tag", tag}, {"embodiment_mapping", embodiment_mapping_json(c)},
                           {"normalize_min_max", true}, {"state_dropout_prob", c.processor_state_dropout}, {"clip_outliers", c.clip_outliers},
                           {"use_percentiles", false}, {"video_modality_keys", nullptr}, {"raw_stats", nullptr},
                           {"modality_config", nullptr}}},
                         {"stats_features", s.stats_features}};
  const nlohmann::json encode = {{"registry_name", "groot_n1_7_vlm_encode_v1"},
                                 {"config",
                                  {{"model_name", "{processor_folder}"}, {"image_crop_size", c.image_geometry["image_crop_size"]},
                                   {"image_target_size", c.image_geometry["image_target_size"]},
                                   {"shortest_image_edge", c.image_geometry["shortest_image_edge"]},
                                   {"crop_fraction", c.image_geometry["crop_fraction"]}, {"use_albumentations", c.image_opencv_area},
                                   {"letter_box_transform", c.image_letterbox}, {"device", "cpu"}}}};
  s.preprocessor_steps = {rename, batch, pack, encode, device};
  const nlohmann::json unpack = {{"registry_name", "groot_action_unpack_unnormalize_v2"},
                                 {"config",
                                  {{"env_action_dim", c.action_dim}, {"normalize_min_max", true},
                                   {"clip_normalized_action", true}, {"libero_gripper_action", tag == "libero_sim"},
                                   {"libero_gripper_binarize", true}}},
                                 {"stats_features", {"action"}}};
  s.postprocessor_steps = {unpack, device};
  return s;
}

std::vector<std::string> GrootPolicyImpl::prompts(const std::vector<std::string>& tasks, const Batch&) const {
  std::vector<std::string> out;
  for (const std::string& t : tasks) {
    const std::string text = t.empty() ? "Perform the task." : t;
    std::string f;
    if (!config_.formalize_language) f = text;
    else
      for (unsigned char ch : text)
        if (std::isalnum(ch) || ch == '_' || ch == ' ' || (ch >= '\t' && ch <= '\r')) f += static_cast<char>(std::tolower(ch));
    out.push_back(f);
  }
  return out;
}

Batch GrootPolicyImpl::pack_batch(const Batch& in, const Stats& stats) const {
  const auto& c = config_;
  Batch out;
  for (const auto& [k, t] : in.tensors())
    if (!starts(k, "observation.") && k != "action") out.set(k, t);
  // the batch's rows: from the action (training) or, at deployment (no action), the state or the prompt's ids
  const bool train = in.has("action");
  const at::Tensor rows_of = train ? in.at("action") : in.has("observation.state") ? in.at("observation.state")
                                                                                   : in.at("input_ids");
  const int64_t B = rows_of.size(0);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(rows_of.device());
  if (in.has("observation.state")) {
    const at::Tensor st = groot_normalize(in.at("observation.state").to(at::kFloat).reshape({B, -1}), stats,
                                          "observation.state", c.clip_outliers);
    at::Tensor padded = at::constant_pad_nd(st, {0, c.max_state_dim - st.size(1)}).unsqueeze(1);
    if (in.has("state_dropout"))  // the processor's state dropout (training rows' draws)
      padded = padded.masked_fill(in.at("state_dropout").to(at::kBool).to(padded.device()).view({B, 1, 1}), 0);
    out.set("state", padded.contiguous());
  } else {
    out.set("state", at::zeros({B, 1, c.max_state_dim}, f32));
  }
  out.set("embodiment_id", at::full({B}, embodiment_id_of(c, c.raw.value("embodiment_tag", std::string("new_embodiment"))), at::kLong));
  if (!train) return out;
  const at::Tensor action = in.at("action").to(at::kFloat);  // [B, H, A]
  const int64_t H = action.size(1), A = action.size(2);
  at::Tensor valid = at::ones({B, H}, action.options().dtype(at::kBool));
  if (in.has("action_is_pad")) valid = in.at("action_is_pad").to(at::kBool).logical_not();
  if (c.valid_action_horizon > 0 && c.valid_action_horizon < H)  // the modality config's action horizon
    valid = valid.logical_and(at::arange(H, valid.options().dtype(at::kLong)).lt(c.valid_action_horizon).unsqueeze(0));
  at::Tensor a = groot_normalize(action.reshape({B * H, A}), stats, "action", c.clip_outliers).view({B, H, A});
  a = a * valid.unsqueeze(-1).to(a.scalar_type());
  out.set("action", at::constant_pad_nd(a, {0, c.max_action_dim - A}).contiguous());
  at::Tensor mask = at::zeros({B, H, c.max_action_dim}, action.options());
  mask.narrow(2, 0, A).copy_(valid.unsqueeze(-1).to(at::kFloat).expand({B, H, A}));
  out.set("action_mask", mask);
  return out;
}

Policy::Stats GrootPolicyImpl::processor_stats(const Stats& dataset) const {
  if (config_.checkpoint_stats.empty()) return dataset;
  Stats s = dataset;  // LeRobot's processor takes the checkpoint's in place of the dataset's state / action statistics
  s.erase("observation.state");
  s.erase("action");
  for (const auto& [k, v] : config_.checkpoint_stats) s[k] = v;
  return s;
}

at::Tensor GrootPolicyImpl::unpack_action(const at::Tensor& chunk, const Stats& stats) const {
  at::Tensor x = chunk.narrow(-1, 0, config_.action_dim).to(at::kFloat);
  if (!has_min_max(stats, "action")) return x;
  x = x.clamp(-1.0, 1.0);
  auto [lo, hi] = min_max(stats, "action", x.size(-1));
  lo = lo.to(x.device()), hi = hi.to(x.device());
  const at::Tensor denom = hi - lo, ok = denom != 0;
  const at::Tensor safe = at::where(ok, denom, at::ones_like(denom));
  return at::where(ok, (x + 1.0) * 0.5 * safe + lo, lo);
}

std::map<std::string, at::Tensor> GrootPolicyImpl::training_draws(int64_t rows, at::Generator& gen) const {
  const auto& c = config_;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor noise = at::randn({rows, c.action_horizon, c.max_action_dim}, gen, f32);
  const at::Tensor x = at::_standard_gamma(at::full({rows}, c.noise_beta_alpha, f32), gen);
  const at::Tensor y = at::_standard_gamma(at::full({rows}, c.noise_beta_beta, f32), gen);
  return {{"noise", noise}, {"time", (1 - x / (x + y)) * c.noise_s}};
}

std::shared_ptr<Model> build_groot(const nlohmann::json& j, const std::string& file) {
  return GrootPolicy(GrootConfig::from_json(j, file)).ptr();
}

nlohmann::json describe_groot(const nlohmann::json& j, const std::string& file) {
  const GrootConfig c = GrootConfig::from_json(j, file);
  // the action head's numbers from its shapes; the backbone's from Qwen3-VL's own count
  auto linear = [](int64_t in, int64_t out) { return in * out + out; };
  auto blocks = [&](const GrootBlocksConfig& b, int64_t dim, int64_t context, bool ada, bool interleave) {
    int64_t n = 0;
    for (int64_t i = 0; i < b.num_layers; ++i) {
      const int64_t kv = (interleave && i % 2 == 1) || context == 0 ? dim : context;
      const int64_t bias = b.attention_bias ? b.inner() : 0;
      n += ada ? linear(dim, 2 * dim) : 2 * dim;
      n += dim * b.inner() + bias + 2 * (kv * b.inner() + bias) + linear(b.inner(), dim);
      n += linear(dim, 4 * dim) + linear(4 * dim, dim);
      if (b.norm_elementwise_affine) n += 2 * dim;
    }
    return n;
  };
  const int64_t E = c.max_num_embodiments, emb = c.input_embedding_dim, hid = c.hidden_size;
  const int64_t inner = c.dit.inner();
  const int64_t dit = linear(256, inner) + linear(inner, inner) +
                      blocks(c.dit, inner, c.backbone_embedding_dim, true, c.dit.interleave_self_attention) +
                      linear(inner, 2 * inner) + linear(inner, c.dit.output_dim);
  const int64_t vl = (c.vl.num_layers > 0 ? blocks(c.vl, c.vl.inner(), 0, false, false) : 0) +
                     (c.use_vlln ? 2 * c.backbone_embedding_dim : 0);
  const int64_t projectors = E * linear(c.max_state_dim * c.state_history_length, hid) + E * linear(hid, emb) +
                             E * (linear(c.max_action_dim, emb) + linear(2 * emb, emb) + linear(emb, emb)) +
                             E * (linear(hid, hid) + linear(hid, c.max_action_dim)) +
                             (c.add_pos_embed ? c.max_seq_len * emb : 0);
  nlohmann::json bj = c.backbone.raw;
  const int64_t backbone = vlm::describe_qwen3_vl(bj, file)["parameters"].get<int64_t>();
  return {{"family", "policy"},
          {"model_type", "groot"},
          {"parameters", backbone + dit + vl + projectors},
          {"state_dim", c.state_dim},
          {"action_dim", c.action_dim},
          {"chunk_size", c.chunk_size},
          {"n_action_steps", c.n_action_steps},
          {"select_layer", c.select_layer},
          {"components", {{"backbone", {{"parameters", backbone}}}, {"diffusion_model", {{"parameters", dit}}},
                          {"vl_self_attention", {{"parameters", vl}}}, {"projectors", {{"parameters", projectors}}}}}};
}

}  // namespace lf::models::policy
