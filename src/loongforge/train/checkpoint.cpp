#include "loongforge/train/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <set>
#include <thread>

#include "loongforge/core/error.h"
#include "loongforge/core/fs.h"
#include "loongforge/core/json.h"
#include "loongforge/io/hf_model.h"
#include "loongforge/io/peft.h"
#include "loongforge/io/safetensors.h"
#include "loongforge/models/policy_io.h"

namespace lf::train {
namespace fs = std::filesystem;

namespace {
void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Tests set LOONGFORGE_TEST_SAVE_DELAY_MS to widen the window in which a save can be interrupted.
void test_delay() {
  if (const char* d = std::getenv("LOONGFORGE_TEST_SAVE_DELAY_MS"))
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(d)));
}
}  // namespace

std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::string begin_checkpoint(const std::string& root, int64_t step, bool unique) {
  fs::create_directories(root);
  const std::string name = checkpoint_name(step);
  fs::path tmp = fs::path(root) / (".tmp-" + name + (unique ? "-" + std::to_string(::getpid()) : std::string()));
  remove_tree(tmp.string());
  fs::create_directories(tmp);
  return tmp.string();
}

std::string commit_checkpoint(const std::string& root, int64_t step, const std::string& tmp_dir, int keep) {
  const std::string name = checkpoint_name(step);
  fs::path tmp(tmp_dir);
  for (const auto& e : fs::directory_iterator(tmp)) fsync_path(e.path());
  fsync_path(tmp);
  fs::path final_dir = fs::path(root) / name;
  if (fs::exists(final_dir)) {  // an older run's checkpoint of the same step: move it aside, then drop it
    fs::path old = fs::path(root) / (".old-" + name + "-" + std::to_string(::getpid()));
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    remove_tree(old.string());
  } else {
    fs::rename(tmp, final_dir);
  }
  fsync_path(root);
  test_delay();
  write_file_atomic((fs::path(root) / "latest").string(), name + "\n");
  fsync_path(root);
  if (keep > 0) {
    std::vector<std::string> steps;
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_directory() && e.path().filename().string().rfind("step_", 0) == 0) steps.push_back(e.path().filename().string());
    std::sort(steps.begin(), steps.end());
    for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i)
      if (steps[i] != name) remove_tree((fs::path(root) / steps[i]).string());
  }
  return final_dir.string();
}

at::Tensor cpu_rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

void checkpoint_test_delay() { test_delay(); }

std::string save_checkpoint(const std::string& root, int64_t step, models::Model& model,
                            const TrainableSet& trainable, optim::AdamW& opt, const nlohmann::json& trainer_state,
                            const std::string& tokenizer_src, int keep) {
  // A world of one through the one writer: the whole tensors by checkpoint name (LoRA runs: the adapter).
  std::map<std::string, at::Tensor> weights, m, v, ema;
  if (trainable.lora) {
    for (size_t i = 0; i < trainable.names.size(); ++i) weights[trainable.names[i]] = trainable.params[i].detach();
  } else {
    for (auto& [name, t] : models::checkpoint_targets(model)) weights[name] = t.detach();
  }
  for (size_t i = 0; i < trainable.names.size(); ++i) {
    m[trainable.names[i]] = opt.exp_avg()[i];
    v[trainable.names[i]] = opt.exp_avg_sq()[i];
    if (opt.has_ema()) ema[trainable.names[i]] = opt.ema()[i];
  }
  return write_checkpoint(root, step, CheckpointRanks{}, weights, m, v, opt.steps(), model, trainable, trainer_state,
                          tokenizer_src, keep, ema);
}

OptimizerStateReader::OptimizerStateReader(const std::string& dir) : dir_(dir) {
  fs::path idx = fs::path(dir) / "optimizer.index.json";
  if (fs::exists(idx)) {
    nlohmann::json j = read_json_file(idx.string());
    try {
      for (auto it = j.at("weight_map").begin(); it != j.at("weight_map").end(); ++it) {
        const std::string file = it.value();
        if (!is_plain_name(file))
          throw file_error(idx.string(), "weight_map." + it.key(), "'" + file + "' is not a file of this folder");
        file_of_[it.key()] = file;
      }
      steps_ = j.at("optimizer_steps");
      world_ = j.at("world");
    } catch (const nlohmann::json::exception& e) {
      throw file_error(idx.string(), "weight_map/optimizer_steps/world", "missing or malformed");
    }
    return;
  }
  auto f = io::SafetensorsFile::open((fs::path(dir) / "optimizer.safetensors").string());
  open_["optimizer.safetensors"] = f;
  auto meta = f->metadata();
  auto it = meta.find("optimizer_steps");
  if (it == meta.end()) throw file_error(f->path(), "__metadata__.optimizer_steps", "missing");
  try {
    steps_ = std::stoll(it->second);
  } catch (const std::exception&) {
    throw file_error(f->path(), "__metadata__.optimizer_steps", "not an integer: '" + it->second + "'");
  }
}

at::Tensor OptimizerStateReader::tensor(const std::string& key) {
  std::string name = key.substr(key.find('.') + 1);
  std::string file = file_of_.empty() ? "optimizer.safetensors" : file_of_.count(name) ? file_of_[name] : "";
  if (file.empty()) throw file_error((fs::path(dir_) / "optimizer.index.json").string(), "weight_map." + name, "missing");
  auto& f = open_[file];
  if (!f) f = io::SafetensorsFile::open((fs::path(dir_) / file).string());
  if (!f->contains(key)) throw file_error(f->path(), key, "missing");
  return f->tensor(key);
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  fs::path latest = fs::path(root) / "latest";
  if (!fs::exists(latest)) return std::nullopt;
  std::string name = read_text_file(latest.string());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (!name.empty() && !is_plain_name(name))
    throw Error(latest.string() + ": refers to '" + name + "', which is not a folder of " + root +
                " (latest names one checkpoint folder beside it)");
  fs::path dir = fs::path(root) / name;
  if (name.empty() || !fs::is_directory(dir)) throw Error(latest.string() + ": points at a missing checkpoint '" + name + "'");
  return dir.string();
}

nlohmann::json load_checkpoint(const std::string& dir, models::Model& model,
                               const TrainableSet& trainable, optim::AdamW& opt) {
  at::NoGradGuard no_grad;
  if (trainable.lora) {
    auto adapter = io::SafetensorsFile::open((fs::path(dir) / "adapter_model.safetensors").string());
    for (size_t i = 0; i < trainable.names.size(); ++i) {
      std::string key = io::peft_name(trainable.names[i]);
      if (!adapter->contains(key)) throw file_error(adapter->path(), key, "missing");
      trainable.params[i].copy_(adapter->tensor(key));
    }
  } else {
    io::load_state(model, dir);
  }
  OptimizerStateReader st(dir);
  for (size_t i = 0; i < trainable.names.size(); ++i) {
    for (auto [prefix, vec] : {std::pair{"exp_avg.", &opt.exp_avg()}, std::pair{"exp_avg_sq.", &opt.exp_avg_sq()}}) {
      std::string key = prefix + trainable.names[i];
      at::Tensor t = st.tensor(key);
      if (t.sizes() != (*vec)[i].sizes()) throw Error(dir + ": optimizer tensor '" + key + "': shape does not match the model");
      (*vec)[i].copy_(t);
    }
  }
  if (opt.has_ema()) {
    const std::string ed = ema_dir(dir);
    if (!fs::exists(ed)) throw Error(ed + ": missing (the run keeps a weight average: ema.decay > 0)");
    auto ckpt = io::SafetensorsCheckpoint::open(ed);
    for (size_t i = 0; i < trainable.names.size(); ++i) {
      at::Tensor t = read_whole(ckpt, model, trainable.names[i], ed);
      if (t.sizes() != opt.ema()[i].sizes())
        throw Error(ed + ": tensor '" + trainable.names[i] + "': shape does not match the model");
      opt.ema()[i].copy_(t);
    }
  }
  opt.set_steps(st.steps());
  if (st.saved_world() == 1 && fs::exists(fs::path(dir) / "optimizer.safetensors")) {  // the RNG of a world of one
    auto f = io::SafetensorsFile::open((fs::path(dir) / "optimizer.safetensors").string());
    if (f->contains("rng.cpu")) set_cpu_rng_state(f->tensor("rng.cpu"));
  }
  return read_json_file((fs::path(dir) / "trainer_state.json").string());
}

// The buffers that are checkpoint tensors (the MoE routers' correction biases), as the model lists them.
std::map<std::string, std::string> checkpoint_buffers(const models::Model& model) {
  std::map<std::string, std::string> out;
  for (const auto& e : model.checkpoint_tensors())
    if (e.buffer) out[e.param] = e.name;
  return out;
}

// Whole tensors by parameter name -> by checkpoint name: stacked expert parameters become the per-expert tensors
// a single-process run and transformers' Hub checkpoints use (Model::checkpoint_tensors).
std::map<std::string, at::Tensor> to_checkpoint_names(const models::Model& model,
                                                      const std::map<std::string, at::Tensor>& by_param) {
  std::map<std::string, at::Tensor> out;
  std::set<std::string> mapped;
  for (const auto& e : model.checkpoint_tensors()) {
    auto it = by_param.find(e.param);
    if (it == by_param.end() || (e.index < 0 && e.name == e.param)) continue;  // renamed whole tensors too (MTP layers)
    out[e.name] = models::checkpoint_slice(it->second, e);
    mapped.insert(e.param);
  }
  for (const auto& [n, t] : by_param)
    if (!mapped.count(n)) out[n] = t;
  return out;
}

// The whole parameter `name` from a checkpoint: stored under its own name, or assembled from its per-expert
// checkpoint tensors.
at::Tensor read_whole(const io::SafetensorsCheckpoint& ckpt, const models::Model& model, const std::string& name,
                      const std::string& dir) {
  if (ckpt.contains(name)) return ckpt.tensor(name);
  for (const auto& e : model.checkpoint_tensors())  // a whole tensor stored under another name (MTP layers)
    if (e.param == name && (e.index < 0 && e.end <= e.begin) && ckpt.contains(e.name)) return ckpt.tensor(e.name);
  std::vector<models::CheckpointTensor> parts;  // per-expert tensors, or row blocks of one tensor
  for (const auto& e : model.checkpoint_tensors())
    if (e.param == name && !(e.index < 0 && e.end <= e.begin)) parts.push_back(e);
  if (parts.empty()) throw Error(dir + ": tensor '" + name + "' missing from the checkpoint");
  int64_t n = 0, rows = 0;
  for (const auto& e : parts) {
    if (!ckpt.contains(e.name)) throw Error(dir + ": tensor '" + e.name + "' missing from the checkpoint");
    n = std::max(n, e.index + 1);
    rows = std::max(rows, e.end);
  }
  std::vector<int64_t> shape = ckpt.shape(parts.front().name);
  if (parts.front().index >= 0) shape.insert(shape.begin(), n);
  shape[parts.front().index >= 0 ? 1 : 0] = rows;
  at::Tensor whole = at::zeros(shape, at::kFloat);
  for (const auto& e : parts) {
    at::Tensor t = ckpt.tensor(e.name);
    if (t.size(0) != e.end - e.begin)
      throw Error(dir + ": tensor '" + e.name + "': " + std::to_string(t.size(0)) + " rows, the config needs " +
                  std::to_string(e.end - e.begin));
    models::checkpoint_slice(whole, e).copy_(t);
  }
  return whole;
}

std::string rank_file(const std::string& stem, int rank) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-rank-%05d.safetensors", stem.c_str(), rank);
  return buf;
}

std::string shard_file(const std::string& stem, int rank, int world) {
  return world == 1 ? stem + ".safetensors" : rank_file(stem, rank);
}

std::string ema_dir(const std::string& checkpoint_dir) { return (fs::path(checkpoint_dir) / "ema").string(); }

std::string write_checkpoint(const std::string& root, int64_t step, const CheckpointRanks& ranks,
                             const std::map<std::string, at::Tensor>& weights,
                             const std::map<std::string, at::Tensor>& m, const std::map<std::string, at::Tensor>& v,
                             int64_t optimizer_steps, const models::Model& model, const TrainableSet& trainable,
                             const nlohmann::json& st, const std::string& tokenizer, int keep,
                             const std::map<std::string, at::Tensor>& ema) {
  using nlohmann::json;
  const bool main = ranks.rank == 0, one = ranks.world == 1;
  // Nothing non-finite is ever checkpointed (the trainer stops or skips NaN / inf steps; this catches an update
  // that overflowed): refused before anything is written, the previous checkpoint stays the newest.
  for (const auto* group : {&weights, &m, &v, &ema})
    for (const auto& [n, t] : *group)
      if (t.is_floating_point() && !at::isfinite(t).all().item<bool>())
        throw Error(root + ": checkpoint of step " + std::to_string(step) + " refused: '" + n +
                    "' holds NaN or inf values (the previous checkpoint stays the newest)");
  // one process: a temporary folder of its own (a killed run's leftovers never clash); else one name for every rank
  std::string tmp;
  if (main) tmp = begin_checkpoint(root, step, one);
  ranks.barrier();
  if (!one) tmp = (fs::path(root) / (".tmp-" + checkpoint_name(step))).string();
  io::NamedTensors wt, ot;
  json mine = json::object(), mine_opt = json::object();  // checkpoint name -> weight file; parameter -> moments file
  size_t i = 0;
  const std::string weight_stem = trainable.lora ? "adapter" : model.weights_file_stem();
  for (const auto& [n, t] : weights) {
    if (static_cast<int>(i++ % static_cast<size_t>(ranks.writers)) != ranks.writer) continue;
    wt.emplace_back(n, t.to(at::kCPU, at::kFloat).contiguous());
    mine[n] = shard_file(weight_stem, ranks.rank, ranks.world);
  }
  i = 0;
  for (const auto& [n, t] : m) {
    if (static_cast<int>(i++ % static_cast<size_t>(ranks.writers)) != ranks.writer) continue;
    ot.emplace_back("exp_avg." + n, t.to(at::kCPU).contiguous());
    ot.emplace_back("exp_avg_sq." + n, v.at(n).to(at::kCPU).contiguous());
    mine_opt[n] = shard_file("optimizer", ranks.rank, ranks.world);
  }
  ot.emplace_back("rng.cpu", cpu_rng_state());
  if (!wt.empty())
    io::save_file((fs::path(tmp) / shard_file(weight_stem, ranks.rank, ranks.world)).string(), wt, {{"format", "pt"}});
  const bool with_ema = !ema.empty() && !trainable.lora;
  if (with_ema) {  // the average's folder: the same names in the same files, averaged values where trained
    const std::map<std::string, at::Tensor> averaged = to_checkpoint_names(model, ema);
    io::NamedTensors et;
    for (const auto& [n, t] : wt) {
      auto it = averaged.find(n);
      et.emplace_back(n, it == averaged.end() ? t : it->second.to(at::kCPU, at::kFloat).contiguous());
    }
    if (main) fs::create_directories(ema_dir(tmp));
    ranks.barrier();
    if (!et.empty())
      io::save_file((fs::path(ema_dir(tmp)) / shard_file(weight_stem, ranks.rank, ranks.world)).string(), et,
                    {{"format", "pt"}});
  }
  io::save_file((fs::path(tmp) / shard_file("optimizer", ranks.rank, ranks.world)).string(), ot,
                {{"optimizer_steps", std::to_string(optimizer_steps)}});
  write_file_atomic((fs::path(tmp) / ("index-rank-" + std::to_string(ranks.rank) + ".json")).string(),
                    json{{"weights", mine}, {"optimizer", mine_opt}}.dump());
  checkpoint_test_delay();
  ranks.barrier();
  std::string final_dir = (fs::path(root) / checkpoint_name(step)).string();
  if (main) {
    json weight_map = json::object(), opt_map = json::object();
    int64_t total = 0;
    for (int rk = 0; rk < ranks.world; ++rk) {
      fs::path f = fs::path(tmp) / ("index-rank-" + std::to_string(rk) + ".json");
      json part = read_json_file(f.string());
      for (auto it = part["weights"].begin(); it != part["weights"].end(); ++it) weight_map[it.key()] = it.value();
      for (auto it = part["optimizer"].begin(); it != part["optimizer"].end(); ++it) opt_map[it.key()] = it.value();
      fs::remove(f);
    }
    if (trainable.lora) {
      // The adapter in PEFT's layout (as a single-process LoRA run writes it): the ranks' shares of whole
      // tensors merged into adapter_model.safetensors, in model order; the base stays where it is.
      std::map<std::string, at::Tensor> all;
      for (int rk = 0; rk < ranks.world; ++rk) {
        fs::path f = fs::path(tmp) / shard_file("adapter", rk, ranks.world);
        if (!fs::exists(f)) continue;
        {
          auto file = io::SafetensorsFile::open(f.string());
          for (const auto& e : file->entries()) all[e.name] = file->tensor(e.name).clone();
        }
        fs::remove(f);
      }
      io::NamedTensors ordered;
      for (const auto& n : trainable.names) {
        if (!all.count(n)) throw Error(tmp + ": adapter tensor '" + n + "' was written by no rank");
        ordered.emplace_back(n, all[n]);
      }
      // a robot policy's adapter is LeRobot's (wrap_with_peft: no task type), a language model's a causal LM's
      io::save_peft_tensors(tmp, ordered, *trainable.lora, trainable.base_model,
                            models::as_policy(model) ? "" : "CAUSAL_LM");
      write_file_atomic((fs::path(tmp) / "base_config.json").string(), model.config_json().dump(2) + "\n");
    } else {
      for (int rk = 0; rk < ranks.world; ++rk) {  // total_size: bytes of every weight, as transformers writes it
        fs::path f = fs::path(tmp) / shard_file(model.weights_file_stem(), rk, ranks.world);
        if (fs::exists(f)) total += static_cast<int64_t>(fs::file_size(f));
      }
      json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
      if (!one)  // a world of one: model.safetensors alone, as save_pretrained writes a model that fits one file
        write_file_atomic((fs::path(tmp) / (model.weights_file_stem() + ".safetensors.index.json")).string(),
                          index.dump(2) + "\n");
      if (with_ema) {
        if (!one)
          write_file_atomic((fs::path(ema_dir(tmp)) / (model.weights_file_stem() + ".safetensors.index.json")).string(),
                            index.dump(2) + "\n");
        io::write_model_metadata(model, ema_dir(tmp), at::kFloat, tokenizer);
      }
    }
    json oindex = {{"world", ranks.world}, {"layout", ranks.layout}, {"optimizer_steps", optimizer_steps},
                   {"weight_map", opt_map}};
    if (!one) write_file_atomic((fs::path(tmp) / "optimizer.index.json").string(), oindex.dump(2) + "\n");
    if (!trainable.lora) io::write_model_metadata(model, tmp, at::kFloat, tokenizer);
    write_file_atomic((fs::path(tmp) / "trainer_state.json").string(), st.dump(2) + "\n");
    final_dir = commit_checkpoint(root, step, tmp, keep);
  }
ranks.barrier();
return final_dir;
}

}  // namespace lf::train
