#include "loongforge/train/robot_source.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/robot/stats.h"
#include "loongforge/io/policy_processor.h"
#include "loongforge/train/diffusion_source.h"

namespace lf::train {

namespace fs = std::filesystem;
namespace robot = data::robot;

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Seconds of frame offsets at the dataset's rate (the loader turns them back into the same frames).
std::vector<double> seconds(const std::vector<int64_t>& offsets, double fps) {
  std::vector<double> s;
  for (int64_t o : offsets) s.push_back(static_cast<double>(o) / fps);
  return s;
}

// A second stream per row for image transforms, apart from the draws' (row_seed of a mixed seed).
constexpr uint64_t kTransformSalt = 0x5851f42d4c957f2dULL;

// K uniform draws in [0, 1) for each of N rows (stream rows BASE..), from each row's transform stream for WHAT:
// [N, K] float64, the same whatever the split of a batch over processes.
at::Tensor row_uniforms(uint64_t seed, const std::string& what, int64_t base, int64_t n, int64_t k) {
  at::Tensor u = at::empty({n, k}, at::kDouble);
  const uint64_t salt = std::hash<std::string>{}(what);
  for (int64_t r = 0; r < n; ++r) {
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(row_seed(seed ^ kTransformSalt ^ salt, base + r));
    u[r].copy_(at::rand({k}, g, at::kDouble));
  }
  return u;
}

}  // namespace

RobotSource::RobotSource(RobotSourceOptions o, const models::Model& model)
    : opts_(std::move(o)), model_(model), policy_([&]() -> const models::Policy& {
        const models::Policy* p = models::as_policy(model);
        if (!p)
          throw Error("recipe: field 'data.format': robot datasets train robot policies; the " + model.model_type() +
                      " model is not one");
        return *p;
      }()) {
  spec_ = policy_.policy_spec();
  if (opts_.dataset.empty()) throw Error("recipe: field 'data.train': no dataset (a list of one {path: DATASET})");
  ds_ = robot::open_robot_dataset(opts_.dataset);
  const std::string& where = ds_->root();
  const robot::EpisodeSplit split = robot::split_episodes(*ds_, opts_.episodes);
  episodes_ = opts_.valid ? split.val : split.train;
  if (episodes_.empty()) throw Error("recipe: field 'data.robot.valid_episodes': no held-out episodes to validate on");

  // What the batch holds: the policy's inputs and outputs, with their windows.
  std::vector<std::pair<const models::PolicyFeature*, bool>> feats;  // (feature, is an output)
  for (const auto& f : spec_.inputs) feats.push_back({&f, false});
  for (const auto& f : spec_.outputs) feats.push_back({&f, true});
  std::vector<std::string> stat_features;
  for (const auto& [f, output] : feats) {
    if (f->type == "LANGUAGE") {
      if (spec_.language) continue;  // made from the task below
      throw file_error(where, f->name, "the " + model.model_type() + " policy reads this text feature without saying how its processor makes it");
    }
    if (!ds_->has_feature(f->name))
      throw file_error(where, f->name, "the policy reads this feature; the dataset has none (features: " + [&] {
        std::string s;
        for (const auto& g : ds_->features()) s += (s.empty() ? "" : ", ") + g.name;
        return s;
      }() + ")");
    const robot::Feature& df = ds_->feature(f->name);
    const bool camera = df.kind == robot::FeatureKind::video || df.kind == robot::FeatureKind::image;
    if (camera != (f->type == "VISUAL"))
      throw file_error(where, f->name, camera ? "a camera, the policy reads a vector" : "not a camera, the policy reads images");
    if (camera) {  // dataset [H, W, C]; policy [C, H, W], after the crop / resize
      const robot::ImageTransformsConfig& t = opts_.transforms;
      int64_t h = df.shape.at(0), w = df.shape.at(1);
      if (t.crop_height > 0) h = t.crop_height, w = t.crop_width;
      if (t.resize_height > 0) h = t.resize_height, w = t.resize_width;
      const std::vector<int64_t> got = {df.shape.at(2), h, w};
      if (got != f->shape)
        throw Error("recipe: field 'data.robot.image_transforms': the policy's " + f->name + " takes " +
                    shape_str(f->shape) + ", the dataset's frames give " + shape_str(got) +
                    " (set image_transforms.crop / resize)");
    } else {
      std::vector<int64_t> s = df.shape.empty() ? std::vector<int64_t>{1} : df.shape;
      if (s != f->shape)
        throw file_error(where, f->name, "shape " + shape_str(df.shape) + ", the policy reads " + shape_str(f->shape));
    }
    const robot::NormMode mode = robot::parse_norm_mode(spec_.mode_of(*f));
    modes_[f->name] = mode;
    if (mode != robot::NormMode::identity) stat_features.push_back(f->name);
    loader_opts_.features.push_back(f->name);
    const std::vector<int64_t>& offsets = output ? spec_.action_offsets : spec_.observation_offsets;
    if (!offsets.empty()) loader_opts_.delta_timestamps.push_back({f->name, seconds(offsets, ds_->fps())});
  }

  // The features the policy's own processor steps normalise with the statistics (GR00T's min / max).
  for (const auto& n : spec_.stats_features)
    if (ds_->has_feature(n) && std::find(stat_features.begin(), stat_features.end(), n) == stat_features.end())
      stat_features.push_back(n);
  // Statistics: a given stats.json, the dataset's, or LeRobot's computation over the training episodes.
  if (!opts_.stats_file.empty()) {
    stats_ = robot::stats_from_json(read_text_file(opts_.stats_file), opts_.stats_file);
  } else {
    stats_ = ds_->stats();
    bool complete = true;
    for (const auto& n : stat_features) complete = complete && stats_.count(n);
    if (!complete) stats_ = robot::to_stats(robot::compute_stats(*ds_, split.train, stat_features));
  }
  for (const auto& n : stat_features)
    if (!stats_.count(n))
      throw file_error(opts_.stats_file.empty() ? where : opts_.stats_file, n,
                       "no statistics for a feature the policy normalises (" + robot::norm_mode_name(modes_[n]) + ")");

  stats_ = policy_.processor_stats(stats_);

  if (PromptEncoder::needed(spec_)) {
    if (!ds_->has_feature("task_index") || ds_->tasks().empty())
      throw file_error(where, "task_index", "the " + model.model_type() +
                                                " policy writes the task into its prompt; the dataset has no tasks");
    loader_opts_.features.push_back("task_index");
    prompt_ = std::make_unique<PromptEncoder>(
        policy_, spec_, prompt_tokenizer_folder(opts_.tokenizer, opts_.policy_dir, model.model_type()),
        model.model_type());
  }
  loader_opts_.threads = opts_.threads;
  loader_opts_.tolerance_s = opts_.tolerance_s;
  sampler_ = sampler().state();
}

RobotSource::~RobotSource() = default;

robot::FrameSampler RobotSource::sampler() const {
  // Training rows leave out the policy's drop_n_last_frames (LeRobot's training sampler); held-out rows read all.
  return robot::FrameSampler(*ds_, episodes_, !opts_.valid, opts_.seed, opts_.stride,
                             opts_.valid ? 0 : spec_.drop_n_last_frames);
}

int64_t RobotSource::rows_per_epoch() const {
  return sampler().frames_per_epoch();
}

robot::FrameRef RobotSource::frame_of(int64_t k) const {
  robot::FrameSampler s = sampler();
  robot::SamplerState st = s.state();
  st.epoch = k / st.frames;
  st.position = k % st.frames;
  s.restore(st, opts_.dataset);
  return s.next();
}

Batch RobotSource::next_rows(int64_t global_rows, int64_t first, int64_t n) {
  if (first < 0 || n < 1 || first + n > global_rows)
    throw Error("robot data: rows [" + std::to_string(first) + ", " + std::to_string(first + n) +
                ") are not within a batch of " + std::to_string(global_rows));
  const bool whole = first == 0 && n == global_rows;
  if (!loader_ || loader_opts_.batch_size != global_rows || loader_opts_.rows_first != (whole ? 0 : first) ||
      loader_opts_.rows_count != (whole ? 0 : n)) {
    loader_.reset();
    loader_opts_.batch_size = global_rows;
    loader_opts_.rows_first = whole ? 0 : first;
    loader_opts_.rows_count = whole ? 0 : n;
    robot::FrameSampler s = sampler();
    s.restore(sampler_, opts_.dataset);
    loader_ = std::make_unique<robot::RobotLoader>(ds_, std::move(s), loader_opts_);
  }
  robot::RobotBatch raw = loader_->next();
  sampler_ = loader_->state();
  const int64_t base = rows_ + first;  // stream index of this share's first row
  rows_ += global_rows;

  Batch out;
  auto add = [&](const models::PolicyFeature& f) {
    at::Tensor x = raw.at(f.name);
    if (f.type == "VISUAL") {
      x = robot::camera_to_float(x);  // [n, (W,) C, H, W]
      const robot::ImageTransformsConfig& t = opts_.transforms;
      const bool geometry = t.crop_height > 0 || t.resize_height > 0;
      if (geometry || (t.enable && !opts_.valid)) {
        robot::ImageTransformsConfig cfg = t;
        cfg.enable = t.enable && !opts_.valid;  // validation rows: the geometry only, centre crops
        if (opts_.valid) cfg.random_crop = false;
        std::vector<at::Tensor> rows;
        const uint64_t salt = std::hash<std::string>{}(f.name);
        for (int64_t r = 0; r < x.size(0); ++r) {
          const uint64_t seed = row_seed(opts_.seed ^ kTransformSalt ^ salt, base + r);
          const robot::TransformPlan plan = robot::plan_transforms(cfg, seed, x.size(-2), x.size(-1));
          rows.push_back(robot::apply_transforms(x[r], cfg, plan));
        }
        x = at::stack(rows);
      }
    } else {
      x = x.to(at::kFloat);
    }
    const robot::NormMode mode = modes_.at(f.name);
    if (mode != robot::NormMode::identity) x = robot::normalize(x, stats_.at(f.name), mode, f.name);
    out.set(f.name, x.contiguous());
  };
  for (const auto& f : spec_.inputs) add(f);
  for (const auto& f : spec_.outputs) {
    add(f);
    if (raw.count(f.name + "_is_pad")) out.set(f.name + "_is_pad", raw.at(f.name + "_is_pad"));
  }
  if (prompt_) {
    // GR00T N1.7's albumentations path crops each training row's frames at a position drawn per row (Isaac-GR00T's
    // train-time random crop, one window for all the row's cameras), from the row's transform stream; kept in the
    // batch as vlm_crop_position [n, 2] (y, x). Held-out rows crop at the centre.
    const at::Tensor crop = !opts_.valid && PromptEncoder::draws_crop(spec_)
                                ? row_uniforms(opts_.seed, "vlm_crop_position", base, n, 2)
                                : at::Tensor();
    prompt_->add(out, task_texts(raw.at("task_index")), crop);
    if (crop.defined()) out.set("vlm_crop_position", crop);
  }
  if (!opts_.valid && spec_.state_dropout_prob > 0)  // the processor's state dropout: a bool per training row
    out.set("state_dropout", row_uniforms(opts_.seed, "state_dropout", base, n, 1).squeeze(1).lt(spec_.state_dropout_prob));
  out = policy_.pack_batch(out, stats_);
  // The training draws, per row from its own stream (validation rows too: their loss is the training loss).
  std::map<std::string, std::vector<at::Tensor>> draws;
  for (int64_t r = 0; r < n; ++r) {
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(row_seed(opts_.seed, base + r));
    for (auto& [k, v] : policy_.training_draws(1, g)) draws[k].push_back(v);
  }
  for (auto& [k, v] : draws) out.set(k, at::cat(v));
  return out;
}

std::vector<std::string> RobotSource::task_texts(const at::Tensor& task_index) const {
  const at::Tensor ti = task_index.to(at::kLong).reshape({-1}).contiguous();
  const auto& tasks = ds_->tasks();
  std::vector<std::string> texts;
  for (int64_t r = 0; r < ti.size(0); ++r) {
    const int64_t t = ti[r].item<int64_t>();
    if (t < 0 || t >= static_cast<int64_t>(tasks.size()))
      throw file_error(ds_->root(), "task_index", std::to_string(t) + " is not one of the dataset's " +
                                                     std::to_string(tasks.size()) + " tasks");
    texts.push_back(tasks[static_cast<size_t>(t)]);
  }
  return texts;
}

nlohmann::json RobotSource::state() const { return {{"sampler", sampler_.to_json()}, {"rows", rows_}}; }

void RobotSource::restore(const nlohmann::json& state) {
  const std::string where = "checkpoint data state";
  if (!state.is_object() || !state.contains("sampler") || !state.contains("rows"))
    throw Error(where + ": not a robot data position (sampler, rows)");
  robot::SamplerState s = robot::SamplerState::from_json(state["sampler"], where);
  robot::FrameSampler probe = sampler();
  probe.restore(s, where);  // fails for other episodes, seed or shuffle
  sampler_ = s;
  rows_ = state["rows"].get<int64_t>();
  loader_.reset();
}

std::string RobotSource::write_model_files(const std::string& dir) const {
  io::PolicyNormalization n;
  n.features = nlohmann::json::object();
  nlohmann::json outputs = nlohmann::json::object();
  for (const auto& f : spec_.inputs) n.features[f.name] = {{"type", f.type}, {"shape", f.shape}};
  for (const auto& f : spec_.outputs) n.features[f.name] = outputs[f.name] = {{"type", f.type}, {"shape", f.shape}};
  n.norm_map = nlohmann::json::object();
  for (const auto& [type, mode] : spec_.norm_map) n.norm_map[type] = mode;
  n.modes = modes_;
  for (const auto& [name, mode] : modes_)
    if (mode != robot::NormMode::identity) {
      auto& dst = n.stats[name];
      for (const auto& [stat, t] : stats_.at(name)) dst[stat] = t.to(at::kFloat);
    }
  for (const auto& name : spec_.stats_features)
    if (stats_.count(name))
      for (const auto& [stat, t] : stats_.at(name)) n.stats[name][stat] = t.to(at::kFloat);
  fs::create_directories(dir);
  // LeRobot loads the tokenizer / processor we read (its folder)
  nlohmann::json pre = spec_.preprocessor_steps, post = spec_.postprocessor_steps;
  for (nlohmann::json* steps : {&pre, &post})
    for (auto& step : *steps) {
      if (step.value("registry_name", "") == "tokenizer_processor") step["config"]["tokenizer_name"] = prompt_dir();
      if (step.contains("config") && step["config"].is_object())
        for (auto& [k, val] : step["config"].items())
          if (val.is_string() && val.get<std::string>() == "{processor_folder}") val = prompt_dir();
    }
  io::write_policy_processors(dir, n, outputs, pre, post);
  if (fs::is_directory(prompt_dir()) && fs::absolute(dir).lexically_normal() != fs::path(prompt_dir()))
    for (const char* f : {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                          "preprocessor_config.json", "chat_template.jinja", "chat_template.json"})
      if (fs::exists(fs::path(prompt_dir()) / f))
        fs::copy_file(fs::path(prompt_dir()) / f, fs::path(dir) / f, fs::copy_options::overwrite_existing);
  return dir;
}

}  // namespace lf::train
