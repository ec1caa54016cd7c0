#include "loongforge/train/builders.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <map>
#include <regex>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/tokenizer/tokenizer.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/kernels/cuda_ops.h"
#include "loongforge/models/registry.h"
#include "loongforge/nn/linear.h"
#include "loongforge/nn/lora.h"
#include "loongforge/parallel/comm.h"
#include "loongforge/train/diffusion_source.h"
#include "loongforge/train/image_source.h"
#include "loongforge/train/latent_source.h"
#include "loongforge/train/robot_source.h"
#include "loongforge/train/pretrain_source.h"
#include "loongforge/train/sft_source.h"

namespace lf::train {
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// model.vision / model.projector / model.language: the model composed from the parts' folders (models::compose),
// and OUTPUT_DIR/composed, the folder of its files besides the weights: the language folder's tokenizer (with
// model.image_token added when it lacks it, at the first embedding row no token uses) and the vision folder's image
// processor. Every rank writes the same files (atomically). Returns the model, that folder, and the components'
// module prefixes.
struct Composed {
  std::shared_ptr<models::Model> model;
  std::string files_dir;
  std::vector<std::pair<std::string, std::vector<std::string>>> components;
};

Composed compose_model(const json& r) {
  const json& m = r["model"];
  const std::string vdir = m["vision"]["path"], ldir = m["language"]["path"];
  if (!m["path"].get<std::string>().empty() || !m["config"].get<std::string>().empty())
    throw Error("recipe: field 'model.path': a model composed from model.vision / model.language takes no model.path "
                "or model.config");
  if (vdir.empty()) throw Error("recipe: field 'model.vision.path': missing (the vision encoder's folder)");
  if (ldir.empty()) throw Error("recipe: field 'model.language.path': missing (the language model's folder)");
  std::string tokdir = m["tokenizer"];
  if (tokdir.empty()) tokdir = ldir;
  const fs::path files = fs::path(r["output_dir"].get<std::string>()) / "composed";
  fs::create_directories(files);

  models::ComposeParts p;
  p.vision_file = (fs::path(vdir) / "config.json").string();
  p.language_file = (fs::path(ldir) / "config.json").string();
  for (const auto& f : {p.vision_file, p.language_file})
    if (!fs::exists(f)) throw Error(f + ": missing (model.vision.path / model.language.path take Hugging Face folders)");
  p.vision = read_json_file(p.vision_file);
  p.language = read_json_file(p.language_file);
  p.vision_dir = vdir;
  p.language_dir = ldir;
  p.projector = m["projector"]["kind"];
  p.image_token = m["image_token"];
  p.feature_layer = m["vision"]["feature_layer"];
  p.select_strategy = m["vision"]["select_strategy"];

  // the tokenizer, with the tokens the composition needs (model.image_token, ...) added where it lacks them
  auto tok = data::Tokenizer::load(tokdir);
  const std::string tok_json = (fs::path(tokdir) / "tokenizer.json").string();
  std::string tokenizer_text = fs::exists(tok_json) ? read_text_file(tok_json) : "";
  json tj = tokenizer_text.empty() ? json() : json::parse(tokenizer_text);
  std::map<std::string, int64_t> added;
  int64_t next_free = tok->vocab_size();
  p.token_id = [&](const std::string& token) -> int64_t {
    if (auto id = tok->token_to_id(token)) return *id;
    if (auto it = added.find(token); it != added.end()) return it->second;
    if (tokenizer_text.empty())
      throw Error("recipe: field 'model.tokenizer': '" + token + "' (a token the " + p.projector +
                  " composition needs) is not a token of " + tokdir + " and only a tokenizer.json can be given one here");
    const int64_t vocab = p.language.value("vocab_size", int64_t(0));
    if (next_free >= vocab)
      throw Error("recipe: field 'model.tokenizer': '" + token + "' (a token the " + p.projector +
                  " composition needs) is not a token of " + tokdir + ", and all " + std::to_string(vocab) +
                  " embedding rows of " + p.language_file + " have tokens: give model.image_token one of its tokens "
                  "(e.g. a reserved special token) or a tokenizer that has it");
    const int64_t id = next_free++;
    tj["added_tokens"].push_back({{"id", id}, {"content", token}, {"single_word", false},
                                  {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}});
    added[token] = id;
    return id;
  };
  models::Composition c = models::compose(p, "recipe: field 'model.projector.kind'");
  if (!added.empty()) tokenizer_text = tj.dump(2);

  for (const char* f : {"tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "chat_template.jinja",
                        "chat_template.json", "generation_config.json", "vocab.json", "merges.txt"})
    if (fs::exists(fs::path(tokdir) / f))
      write_file_atomic((files / f).string(), read_text_file((fs::path(tokdir) / f).string()));
  if (!tokenizer_text.empty()) write_file_atomic((files / "tokenizer.json").string(), tokenizer_text);
  for (const char* f : {"preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"})
    if (fs::exists(fs::path(vdir) / f))
      write_file_atomic((files / f).string(), read_text_file((fs::path(vdir) / f).string()));

  Composed out;
  out.model = io::load_composed(c, m["init_std"].get<double>());
  out.files_dir = files.string();
  out.components = c.components;
  return out;
}

}  // namespace

ModelBundle build_model(const json& r) {
  ModelBundle b;
  const json& m = r["model"];
  std::string path = m["path"], cfg = m["config"];
  const bool composed = !m["vision"]["path"].get<std::string>().empty() ||
                        !m["language"]["path"].get<std::string>().empty();
  std::vector<std::regex> freeze;
  std::vector<std::pair<std::regex, double>> lr_mult;
  if (composed) {
    Composed c = compose_model(r);
    b.model = c.model;
    b.tokenizer = c.files_dir;
    // per-component freeze and learning-rate multipliers
    for (const auto& [component, prefixes] : c.components) {
      std::string re = "^(";
      for (const auto& prefix : prefixes) {
        if (re.size() > 2) re += "|";
        for (char ch : prefix) re += ch == '.' ? std::string("\\.") : std::string(1, ch);
      }
      re += ")";
      const json& part = m[component];
      if (part["freeze"].get<bool>()) freeze.emplace_back(re);
      const double mult = part["lr_multiplier"];
      if (!(mult >= 0)) throw Error("recipe: field 'model." + component + ".lr_multiplier': must be >= 0");
      if (mult != 1.0) lr_mult.emplace_back(std::regex(re), mult);
    }
  } else {
    if (path.empty() == cfg.empty()) throw Error("recipe: field 'model': set exactly one of model.path (a HF folder) and model.config (a config.json for random init), or compose one from model.vision and model.language");
    const std::string family = m["family"];
    if (!path.empty()) {
      b.model = io::load_model(path, at::kFloat, family);
    } else {
      b.model = models::build_model_from_file(cfg, family);
      if (m["mtp_loss_weight"].get<double>() == 0) b.model->drop_absent_parts({});  // untrained MTP layers: none
      b.model->init_weights(m["init_std"].get<double>());
      if (const auto base = b.model->base_weights()) {  // e.g. a GR00T policy config over a GR00T N1.7 checkpoint
        std::fprintf(stderr, "model: weights from %s (the %s config's base model)\n", base->dir.c_str(),
                     b.model->model_type().c_str());
        io::load_part(*b.model, {base->dir, base->prefix, {base->prefix}, {}});
      }
    }
    b.tokenizer = m["tokenizer"].get<std::string>();
    if (b.tokenizer.empty()) b.tokenizer = path;
  }
  const json& mo = r["moe"];
  if (!b.model->moe_blocks().empty()) {
    b.model->set_moe_training(mo["aux_loss_coef"].get<double>(), mo["seq_aux_loss_coef"], mo["z_loss_coef"],
                              mo["bias_update_rate"], mo["capacity_factor"]);
    if (mo["guest_slots"].get<int64_t>() != 0 && r["parallel"]["ep"].get<int64_t>() <= 1)
      throw Error("recipe: field 'moe.guest_slots': " + mo["guest_slots"].dump() +
                  ": hot-expert replication places copies on other expert-parallel ranks; it needs parallel.ep > 1");
  } else {
    if (mo["guest_slots"].get<int64_t>() != 0)
      throw Error("recipe: field 'moe.guest_slots': the model has no mixture-of-experts layers");
    for (const char* k : {"seq_aux_loss_coef", "z_loss_coef", "bias_update_rate", "capacity_factor"})
      if (mo[k].get<double>() != 0.0)
        throw Error(std::string("recipe: field 'moe.") + k + "': the model has no mixture-of-experts layers");
  }
  {  // multi-token prediction (DeepSeek-V3's MTP layers): its loss weight; data parallelism only
    const double w = m["mtp_loss_weight"].get<double>();
    const std::string why = b.model->set_mtp_loss_weight(w);
    if (!why.empty()) throw Error("recipe: field 'model.mtp_loss_weight': " + why);
    const json& par = r["parallel"];
    for (const char* k : {"tp", "pp", "cp", "ep"})
      if (w > 0 && par[k].get<int64_t>() > 1)
        throw Error(std::string("recipe: field 'parallel.") + k + "': the multi-token prediction loss (model.mtp_loss_weight > 0) trains under data parallelism only (dp, zero 0 / 1)");
    if (w > 0 && par["zero"].get<int64_t>() == 3)
      throw Error("recipe: field 'parallel.zero': the multi-token prediction loss (model.mtp_loss_weight > 0) trains under data parallelism only (dp, zero 0 / 1)");
    if (par["zero"].get<int64_t>() == 3) {
      // FSDP units come from the model's split, which the MTP layers are not part of: left out, said on stderr
      const size_t before = b.model->named_parameters().size();
      b.model->drop_absent_parts({});
      if (b.model->named_parameters().size() != before)
        std::fprintf(stderr, "model: the multi-token prediction layers are left out under parallel.zero 3 (FSDP): checkpoints will not hold them\n");
    }
  }
  std::string rc = m["recompute"];
  b.model->set_recompute(rc == "full" ? 1 : rc == "per_layer" ? 2 : 0);
  {  // sparse-attention indexers (DeepSeek-V3.2): their KL loss and warm-up stage; no pipeline, no recomputation
    const double c = m["indexer_loss_coef"].get<double>();
    const bool warm = m["indexer_dense_warmup"].get<bool>();
    const std::string why = b.model->set_indexer_training(c, warm);
    if (!why.empty()) throw Error(std::string("recipe: field 'model.") + (warm && c == 0 ? "indexer_dense_warmup" : "indexer_loss_coef") + "': " + why);
    const json& par = r["parallel"];
    const std::string what = "the sparse-attention indexer loss (model.indexer_loss_coef > 0)";
    if (c > 0 && par["pp"].get<int64_t>() > 1)
      throw Error("recipe: field 'parallel.pp': " + what + " does not train under pipeline parallelism (data / expert / tensor / context parallelism do)");
    if (c > 0 && rc != "none")
      throw Error("recipe: field 'model.recompute': " + what + " is made in the training forward, which recomputation runs without a graph; set model.recompute: none");
    if (c > 0 && r["lora"]["enabled"].get<bool>())
      throw Error("recipe: field 'lora.enabled': " + what + " trains the indexers' own weights, which LoRA freezes");
  }
  if (m["vision"]["recompute"].get<bool>() && !b.model->set_pre_recompute(true))
    throw Error("recipe: field 'model.vision.recompute': the " + b.model->model_type() + " model has no vision tower");

  const json& lo = r["lora"];
  if (lo["enabled"].get<bool>()) {
    nn::LoraConfig lc;
    lc.r = lo["r"];
    lc.alpha = lo["alpha"];
    lc.dropout = lo["dropout"];
    for (const auto& t : lo["target_modules"]) lc.target_modules.push_back(t.get<std::string>());
    for (auto& p : b.model->parameters()) p.set_requires_grad(false);  // only the adapter trains
    nn::apply_lora(*b.model, lc);
    b.trainable.lora = lc;
    b.trainable.base_model = path;
  }
  std::vector<std::regex> no_decay;
  for (const auto& f : m["freeze"]) freeze.emplace_back(f.get<std::string>());
  for (const auto& f : r["optim"]["no_decay"]) no_decay.emplace_back(f.get<std::string>());
  double wd = r["optim"]["weight_decay"];
  for (const auto& e : r["optim"]["lr_multipliers"]) {
    const std::string pat = e["pattern"];
    const double mult = e["multiplier"];
    if (pat.empty() || !(mult >= 0)) throw Error("recipe: field 'optim.lr_multipliers': each entry needs a pattern and a multiplier >= 0");
    try {
      lr_mult.emplace_back(std::regex(pat), mult);
    } catch (const std::regex_error& err) {
      throw Error("recipe: field 'optim.lr_multipliers': pattern '" + pat + "': " + err.what());
    }
  }
  bool scaled = false;
  for (auto& item : b.model->named_parameters()) {
    const std::string& n = item.key();
    // what the recipe freezes, and what the model itself keeps frozen (a vision tower's layers its features skip)
    bool frozen = !item.value().requires_grad() ||
                  std::any_of(freeze.begin(), freeze.end(), [&](const std::regex& re) { return std::regex_search(n, re); });
    if (b.trainable.lora) frozen = frozen || n.find(".lora_") == std::string::npos;
    item.value().set_requires_grad(!frozen);
    if (frozen) continue;
    bool nd = std::any_of(no_decay.begin(), no_decay.end(), [&](const std::regex& re) { return std::regex_search(n, re); });
    b.trainable.names.push_back(n);
    b.trainable.params.push_back(item.value());
    b.weight_decay.push_back(nd ? 0.0 : wd);
    double scale = 1.0;  // every matching pattern multiplies
    for (const auto& [re, mult] : lr_mult)
      if (std::regex_search(n, re)) scale *= mult;
    scaled = scaled || scale != 1.0;
    b.lr_scale.push_back(scale);
  }
  if (!scaled) b.lr_scale.clear();
  if (b.trainable.params.empty()) throw Error("recipe: field 'model.freeze': every parameter is frozen");
  return b;
}

namespace {
// A fixed-length list of numbers under KEY (recipe errors name it).
template <size_t N>
std::array<double, N> numbers(const json& v, const std::string& key) {
  if (v.size() != N) throw Error("recipe: field '" + key + "': expected " + std::to_string(N) + " numbers");
  std::array<double, N> out{};
  for (size_t i = 0; i < N; ++i) out[i] = v[i].get<double>();
  return out;
}

}  // namespace

RobotSourceOptions robot_source_options(const json& r, data::Split split) {
  const json& d = r["data"];
  const json& rb = d["robot"];
  if (d["train"].size() != 1) throw Error("recipe: field 'data.train': robot data takes one dataset ({path: DIR})");
  RobotSourceOptions o;
  o.dataset = d["train"][0]["path"].get<std::string>();
  for (const auto& e : rb["episodes"]) o.episodes.episodes.push_back(e.get<int64_t>());
  o.episodes.val_count = rb["valid_episodes"].get<int64_t>();
  if (o.episodes.val_count < 0) throw Error("recipe: field 'data.robot.valid_episodes': must be >= 0");
  o.valid = split == data::Split::Valid;
  o.seed = static_cast<uint64_t>(r["seed"].get<int64_t>());
  o.threads = static_cast<int>(rb["threads"].get<int64_t>());
  if (o.threads < 0) throw Error("recipe: field 'data.robot.threads': must be >= 0");
  o.tolerance_s = rb["tolerance_s"];
  o.stats_file = rb["stats"];
  o.tokenizer = rb["tokenizer"];
  o.policy_dir = r["model"]["path"];
  const json& t = rb["image_transforms"];
  const std::string tk = "data.robot.image_transforms.";
  auto& c = o.transforms;
  c.enable = t["enable"];
  c.max_num_transforms = static_cast<int>(t["max_num_transforms"].get<int64_t>());
  c.random_order = t["random_order"];
  c.brightness = numbers<2>(t["brightness"], tk + "brightness");
  c.contrast = numbers<2>(t["contrast"], tk + "contrast");
  c.saturation = numbers<2>(t["saturation"], tk + "saturation");
  c.hue = numbers<2>(t["hue"], tk + "hue");
  c.sharpness = numbers<2>(t["sharpness"], tk + "sharpness");
  c.degrees = numbers<2>(t["degrees"], tk + "degrees");
  c.translate = numbers<2>(t["translate"], tk + "translate");
  c.weights = numbers<6>(t["weights"], tk + "weights");
  auto size2 = [&](const char* key, int64_t& h, int64_t& w) {
    const json& v = t[key];
    if (v.empty()) return;
    if (v.size() != 2 || v[0].get<int64_t>() < 1 || v[1].get<int64_t>() < 1)
      throw Error("recipe: field '" + tk + key + "': expected [height, width] (positive)");
    h = v[0];
    w = v[1];
  };
  size2("crop", c.crop_height, c.crop_width);
  size2("resize", c.resize_height, c.resize_width);
  c.random_crop = t["random_crop"];
  c.resize_align = t["resize_align"] == "top_left" ? data::robot::PadAlign::top_left : data::robot::PadAlign::center;
  c.pad_value = t["pad_value"];
  try {  // the knobs' own checks (a plan on a probe size)
    if (c.enable) data::robot::plan_transforms(c, 0, 64, 64);
  } catch (const OptionError& e) {
    throw Error("recipe: field '" + tk + e.option() + "': " + e.why());
  }
  return o;
}

namespace {

// data.format: robot (train/robot_source.h).
// The model's vocabulary (its config.json's vocab_size, or a VLM's text_config's), for the token id checks of the
// text sources; 0 when it has none.
int64_t model_vocab(const models::Model* model) {
  if (!model) return 0;
  const json& cj = model->config_json();
  const json* v = cj.contains("vocab_size") ? &cj["vocab_size"]
                  : cj.contains("text_config") && cj["text_config"].is_object() && cj["text_config"].contains("vocab_size")
                      ? &cj["text_config"]["vocab_size"]
                      : nullptr;
  return v && v->is_number_integer() ? v->get<int64_t>() : 0;
}

std::unique_ptr<BatchSource> robot_data(const json& r, data::Split split, const models::Model* model) {
  if (!model) throw Error("recipe: field 'data.format': robot data needs the policy it trains");
  return std::make_unique<RobotSource>(robot_source_options(r, split), *model);
}

std::unique_ptr<BatchSource> base_data(const json& r, data::Split split, const std::string& tokenizer,
                                       const models::Model* model) {
  const json& d = r["data"];
  if (d["skip_bad_samples"].get<bool>() && d["format"] != "sft")
    throw Error("recipe: field 'data.skip_bad_samples': only SFT data (data.format: sft) has samples to skip");
  if (d["format"] == "batch") {
    if (d["train"].size() != 1) throw Error("recipe: field 'data.train': format 'batch' takes one safetensors file");
    return std::make_unique<BatchFileSource>(d["train"][0]["path"].get<std::string>());
  }
  if (d["format"] == "latents") {
    io::LatentShardOptions o;
    for (const auto& s : d["train"]) o.dirs.push_back(s["path"].get<std::string>());
    if (o.dirs.empty() || o.dirs[0].empty())
      throw Error("recipe: field 'data.train': no folders (a list of {path: DIR} made by `loongforge data encode`)");
    o.random_flip = d["random_flip"];
    if (d["random_crop"].get<bool>()) o.crop_pixels = d["resolution"];  // windows of data.resolution pixels
    o.seed = static_cast<uint64_t>(r["seed"].get<int64_t>());
    o.valid_fraction = d["valid_fraction"];
    o.valid = split == data::Split::Valid;
    auto src = std::make_unique<LatentShardSource>(o);
    return src;
  }
  if (d["format"] == "robot") return robot_data(r, split, model);
  if (d["format"] == "images") {
    if (split == data::Split::Valid) throw Error("recipe: field 'data.valid_fraction': not supported for image folders yet");
    data::ImageFolderOptions o;
    for (const auto& s : d["train"]) o.roots.push_back(s["path"].get<std::string>());
    if (o.roots.empty() || o.roots[0].empty())
      throw Error("recipe: field 'data.train': no folders (a list of {path: DIR} with DIR/<class>/<image>)");
    o.resolution = d["resolution"];
    if (o.resolution <= 0) throw Error("recipe: field 'data.resolution': must be positive");
    o.random_flip = d["random_flip"];
    o.random_crop = d["random_crop"];
    o.seed = static_cast<uint64_t>(r["seed"].get<int64_t>());
    return std::make_unique<ImageFolderSource>(o);
  }
  if (d["format"] == "sft") {
    std::vector<std::string> files;
    for (const auto& s : d["train"]) files.push_back(s["path"].get<std::string>());
    if (files.empty()) throw Error("recipe: field 'data.train': no files (a list of {path: FILE.jsonl})");
    if (split == data::Split::Valid) throw Error("recipe: field 'data.valid_fraction': not supported for SFT data yet");
    SftImages images;
    if (auto it = model ? model->image_tokens() : std::nullopt) {
      images.token_id = it->token_id;
      images.per_image = it->per_image;
      images.start_id = it->start_id;
      images.end_id = it->end_id;
      images.processor_dir = r["model"]["path"].get<std::string>();
      if (images.processor_dir.empty()) images.processor_dir = tokenizer;  // (a composed model's files folder)
      images.backend = d["image_backend"];
      images.image_root = d["image_root"];
    }
    return std::make_unique<SftSource>(files, tokenizer, d["chat_template"].get<std::string>(), d["seq_len"],
                                       d["assistant_only_loss"].get<bool>(), d["packing"].get<bool>(),
                                       static_cast<uint64_t>(r["seed"].get<int64_t>()), images,
                                       d["skip_bad_samples"].get<bool>(), model_vocab(model));
  }
  data::PretrainOptions o;
  for (const auto& s : d["train"]) o.sources.push_back({s["path"].get<std::string>(), s["weight"].get<double>()});
  if (o.sources.empty()) throw Error("recipe: field 'data.train': no datasets (a list of {path: PREFIX, weight: W})");
  o.seq_len = d["seq_len"];
  o.seed = static_cast<uint64_t>(r["seed"].get<int64_t>());
  o.split = split;
  o.valid_fraction = d["valid_fraction"];
  return std::make_unique<PretrainSource>(o, d["per_document_attention"].get<bool>(), model_vocab(model));
}
}  // namespace

std::unique_ptr<BatchSource> build_data(const json& r, data::Split split, const std::string& tokenizer,
                                        const models::Model* model) {
  auto src = base_data(r, split, tokenizer, model);
  const json& f = r["diffusion"];
  if (f["objective"] == "none") return src;
  DiffusionObjective o;
  o.kind = f["objective"];
  o.timestep_sampling = f["timestep_sampling"];
  o.logit_mean = f["logit_mean"];
  o.logit_std = f["logit_std"];
  o.mode_scale = f["mode_scale"];
  o.loss_weighting = f["loss_weighting"];
  o.condition_dropout = f["condition_dropout"];
  o.vlb_weight = f["vlb_weight"];
  if (!(o.condition_dropout >= 0 && o.condition_dropout < 1))
    throw Error("recipe: field 'diffusion.condition_dropout': must be in [0, 1)");
  o.schedule.num_train_timesteps = f["num_train_timesteps"];
  if (o.schedule.num_train_timesteps <= 0) throw Error("recipe: field 'diffusion.num_train_timesteps': must be positive");
  o.schedule.shift = f["shift"];
  if (!(o.schedule.shift > 0)) throw Error("recipe: field 'diffusion.shift': must be positive");
  o.schedule.beta_schedule = f["beta_schedule"];
  o.schedule.beta_start = f["beta_start"];
  o.schedule.beta_end = f["beta_end"];
  // validation batches draw from a stream of their own
  const uint64_t seed = static_cast<uint64_t>(r["seed"].get<int64_t>()) + (split == data::Split::Valid ? 1 : 0);
  return std::make_unique<DiffusionObjectiveSource>(std::move(src), o, seed, model);
}

at::Device choose_device(const json& r, bool distributed) {
  const bool want_cuda = r["device"] == "cuda", fp8 = r["precision"] == "fp8";
  if (r["train"]["cuda_graphs"].get<bool>() && !want_cuda)
    throw Error("recipe: field 'train.cuda_graphs': CUDA graphs need device: cuda");
  if (fp8 && !(want_cuda && kernels::cuda::available()))
    throw Error("recipe: field 'precision': fp8 needs a CUDA GPU (Hopper)" +
                (want_cuda ? " (" + kernels::cuda::unavailable_reason() + ")" : std::string(" and device: cuda")));
  const int index = distributed ? parallel::detect_launch().local_rank % std::max(1, kernels::cuda::device_count()) : 0;
  return kernels::cuda::usable_device(want_cuda, index);
}

void use_fp8_linears(models::Model& model, bool blockwise) {
  const std::string blocks = model.split().blocks + ".";
  for (auto& item : model.named_modules()) {
    auto* lin = dynamic_cast<nn::LinearImpl*>(item.value().get());
    if (!lin || item.key().rfind(blocks, 0) != 0) continue;
    lin->matmul_fn = [blockwise](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
      if (blockwise && kernels::cuda::fp8_linear_blockwise_supported(x, w))
        return kernels::cuda::fp8_linear_blockwise(x, w, b);
      if (kernels::cuda::fp8_linear_supported(x, w)) return kernels::cuda::fp8_linear(x, w, b);
      return at::linear(x, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
    };
  }
}

EngineOptions engine_options(const json& r) {
  EngineOptions o;
  const json& op = r["optim"];
  o.adamw = optim::AdamWOptions{op["lr"], op["beta1"], op["beta2"], op["eps"], op["weight_decay"]};
  o.precision = r["precision"];
  o.cuda_graphs = r["train"]["cuda_graphs"];
  o.cpu_split = r["train"]["cpu_split"];
  if (o.cpu_split < 0) throw Error("recipe: field 'train.cpu_split': must be >= 0 (0: one part per CPU thread, 1: off)");
  o.random_adapters = r["lora"]["enabled"].get<bool>() && r["lora"]["dropout"].get<double>() > 0;
  o.micro_batch_size = r["train"]["micro_batch_size"];
  o.grad_accum = r["train"]["grad_accum"];
  o.seq_len = r["data"]["seq_len"];
  const json& p = r["parallel"];
  parallel::Layout& l = o.layout;
  l.dp = p["dp"];
  l.tp = p["tp"];
  l.pp = p["pp"];
  l.vpp = p["vpp"];
  l.cp = p["cp"];
  l.ep = p["ep"];
  l.cp_mode = p["cp_mode"];
  l.sp = p["sp"];
  l.zero = p["zero"];
  l.hsdp_shard = p["hsdp_shard"];
  for (const auto& n : p["pp_layout"]) l.pp_layout.push_back(n.get<int64_t>());
  l.timeout_s = p["timeout_s"];
  o.backend = p["backend"];
  o.vocab_granule = p["vocab_granule"];
  if (o.vocab_granule < 1)
    throw Error("recipe: field 'parallel.vocab_granule': " + std::to_string(o.vocab_granule) + " must be >= 1");
  o.guest_slots = r["moe"]["guest_slots"].get<int>();
  o.ranks_per_node = r["moe"]["ranks_per_node"].get<int>();
  const json& e = r["ema"];
  o.ema.decay = e["decay"];
  o.ema.min_decay = e["min_decay"];
  o.ema.update_after_step = e["update_after_step"];
  o.ema.warmup = e["warmup"];
  o.ema.inv_gamma = e["inv_gamma"];
  o.ema.power = e["power"];
  if (o.ema.decay < 0 || o.ema.decay >= 1)
    throw Error("recipe: field 'ema.decay': " + std::to_string(o.ema.decay) + " must be in [0, 1) (0: no average)");
  if (o.ema.decay > 0 && r["lora"]["enabled"].get<bool>())
    throw Error("recipe: field 'ema.decay': a weight average of LoRA runs is not supported (set 0)");
  return o;
}

RunOptions run_options(const json& r) {
  RunOptions o;
  o.seed = static_cast<uint64_t>(r["seed"].get<int64_t>());
  o.threads = static_cast<int>(r["train"]["threads"].get<int64_t>());
  o.output_dir = r["output_dir"];
  o.steps = r["train"]["steps"];
  o.stop_at_step = r["train"]["stop_at_step"];
  const std::string on_nonfinite = r["train"]["on_nonfinite"];
  if (on_nonfinite != "stop" && on_nonfinite != "skip")
    throw Error("recipe: field 'train.on_nonfinite': expected stop or skip, got '" + on_nonfinite + "'");
  o.skip_nonfinite = on_nonfinite == "skip";
  const json& sc = r["schedule"];
  o.schedule.kind = sc["kind"];
  o.schedule.lr = r["optim"]["lr"];
  o.schedule.min_lr_ratio = sc["min_lr_ratio"];
  o.schedule.warmup_steps = sc["warmup_steps"];
  o.schedule.decay_steps = sc["decay_steps"];
  o.schedule.total_steps = o.steps;
  o.clip = r["optim"]["clip"];
  for (const char* v : {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"})
    if (const char* n = std::getenv(v)) o.distributed = o.distributed || std::atoi(n) > 1;
  const json& par = r["parallel"];
  for (const char* k : {"dp", "tp", "pp", "cp", "vpp", "ep"}) o.distributed = o.distributed || par[k].get<int64_t>() != 1;
  o.distributed = o.distributed || par["zero"].get<int64_t>() != 0 || par["sp"].get<bool>();
  o.fp8 = r["precision"] == "fp8";
  o.fp8_blockwise = r["fp8_scaling"] == "blockwise";
  o.validate = r["data"]["valid_fraction"].get<double>() > 0 ||
               (r["data"]["format"] == "robot" && r["data"]["robot"]["valid_episodes"].get<int64_t>() > 0);
  o.balance = r["data"]["balance"] == "cost";
  o.eval_every = r["eval"]["every"];
  o.eval_batches = r["eval"]["batches"];
  o.log_every = std::max<int64_t>(1, r["log"]["every"].get<int64_t>());
  o.progress = r["log"]["progress"];
  o.tensorboard = r["log"]["tensorboard"];
  o.plot = r["log"]["plot"];
  o.peak_tflops = r["log"]["peak_tflops"];
  o.checkpoint_every = r["checkpoint"]["every"];
  o.keep = static_cast<int>(r["checkpoint"]["keep"].get<int64_t>());
  o.model_path = r["model"]["path"];
  o.model_family = r["model"]["family"];
  o.tokenizer = r["model"]["tokenizer"];
  if (o.tokenizer.empty()) o.tokenizer = o.model_path;
  return o;
}

}  // namespace lf::train
