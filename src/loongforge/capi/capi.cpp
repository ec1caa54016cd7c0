// The C API (<loongforge/loongforge.h>): a thin layer over train::PolicyRunner (predict) and train::train
// (fine-tune). Only the lf_* functions leave the shared library (cmake/loongforge.map); every C++ exception stops at
// this boundary and becomes a one-line message.
#include <loongforge/loongforge.h>

#include <ATen/ATen.h>
#include <stdlib.h>

#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/core/fs.h"
#include "loongforge/train/policy_runner.h"
#include "loongforge/train/recipe.h"
#include "loongforge/train/trainer.h"

struct lf_policy {
  std::string device;
  std::mutex mu;                                     // guards runner, dir, tmp
  std::shared_ptr<lf::train::PolicyRunner> runner;   // predictions hold their own reference
  std::string dir;                                   // the folder the runner was read from
  std::string tmp;                                   // our temporary folder holding dir (after a fine-tune), or ""
  std::mutex change_mu;                              // one fine-tune or save at a time
};

namespace {
namespace fs = std::filesystem;

thread_local std::string last_error;

// The message as one line: line breaks become "; ", surrounding blanks go.
std::string one_line(std::string msg) {
  std::string out;
  for (char c : msg) {
    if (c == '\n' || c == '\r') {
      if (!out.empty() && out.back() != ' ') out += "; ";
    } else {
      out += c;
    }
  }
  while (!out.empty() && (out.back() == ' ' || out.back() == ';')) out.pop_back();
  return out.empty() ? "unknown error" : out;
}

void fail(const std::string& msg, char* err, size_t err_len) {
  last_error = one_line(msg);
  if (err && err_len > 0) {
    const size_t n = std::min(last_error.size(), err_len - 1);
    std::memcpy(err, last_error.data(), n);
    err[n] = '\0';
  }
}

// F() with every exception turned into RET_ON_ERROR and the message.
template <class F, class R>
R guarded(F&& f, R on_error, char* err, size_t err_len) {
  last_error.clear();
  if (err && err_len > 0) err[0] = '\0';
  try {
    return f();
  } catch (const std::exception& e) {
    fail(e.what(), err, err_len);
  } catch (...) {
    fail("unknown error", err, err_len);
  }
  return on_error;
}

void need(const void* p, const char* what) {
  if (!p) throw lf::Error(std::string(what) + " is NULL");
}

// A fresh folder under $TMPDIR (or /tmp) for a fine-tune's output.
std::string make_temp_dir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern = std::string(base && *base ? base : "/tmp") + "/loongforge-policy-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) throw lf::Error(pattern + ": cannot create a temporary folder");
  return buf.data();
}

// One observation as a tensor (the runner checks it against the policy's features: cameras as [C, H, W] in [0, 1]
// or [H, W, C] 0..255, vectors by their element count).
at::Tensor observation_tensor(const lf_obs& o) {
  const std::string what = std::string("observation '") + o.name + "'";
  if (o.ndim < 0 || o.ndim > 8) throw lf::Error(what + ": ndim " + std::to_string(o.ndim) + " out of 0..8");
  if (o.ndim > 0) need(o.shape, (what + ": shape").c_str());
  std::vector<int64_t> dims(o.shape, o.shape + o.ndim);
  int64_t numel = 1;
  for (int64_t d : dims) {
    if (d < 0) throw lf::Error(what + ": negative dimension " + std::to_string(d));
    numel *= d;
  }
  if (numel == 0) return at::empty(dims, at::kFloat);
  need(o.data, (what + ": data").c_str());
  return at::from_blob(const_cast<float*>(o.data), dims, at::kFloat).clone();
}

std::shared_ptr<lf::train::PolicyRunner> runner_of(lf_policy* p) {
  std::lock_guard<std::mutex> lock(p->mu);
  return p->runner;
}

int predict(lf_policy* p, const lf_obs* obs, size_t n_obs, const char* prompt, float* actions, size_t capacity,
            int64_t shape[2]) {
  return guarded([&]() -> int {
    need(p, "policy");
    need(shape, "shape");
    if (n_obs > 0) need(obs, "obs");
    std::shared_ptr<lf::train::PolicyRunner> r = runner_of(p);
    std::map<std::string, at::Tensor> observation;
    for (size_t i = 0; i < n_obs; ++i) {
      need(obs[i].name, ("obs[" + std::to_string(i) + "].name").c_str());
      if (observation.count(obs[i].name)) throw lf::Error(std::string("observation '") + obs[i].name + "': given twice");
      observation[obs[i].name] = observation_tensor(obs[i]);
    }
    at::NoGradGuard no_grad;
    at::Tensor a = r->predict(observation, prompt ? prompt : "", 0).to(at::kCPU, at::kFloat).contiguous();
    if (a.dim() != 2) throw lf::Error("the policy returned an action chunk of " + std::to_string(a.dim()) + " dimensions");
    shape[0] = a.size(0);
    shape[1] = a.size(1);
    if (static_cast<size_t>(a.numel()) > capacity) {
      fail("actions: capacity " + std::to_string(capacity) + " < " + std::to_string(a.numel()) + " floats (chunk " +
               std::to_string(shape[0]) + " x action_dim " + std::to_string(shape[1]) + ")",
           nullptr, 0);
      return LF_ERROR_CAPACITY;
    }
    if (a.numel() > 0) {
      need(actions, "actions");
      std::memcpy(actions, a.data_ptr<float>(), sizeof(float) * static_cast<size_t>(a.numel()));
    }
    return LF_OK;
  }, LF_ERROR, nullptr, 0);
}

// The default fine-tune recipe (LeRobot's ACT fine-tuning settings; configs/act/finetune-act-aloha.yaml).
void default_finetune(nlohmann::json& r, const std::string& device) {
  r["device"] = device;
  r["train"]["steps"] = 100;
  r["train"]["micro_batch_size"] = 8;
  r["optim"]["lr"] = 1e-5;
  r["optim"]["beta1"] = 0.9;
  r["optim"]["beta2"] = 0.999;
  r["optim"]["weight_decay"] = 1e-4;
  r["optim"]["no_decay"] = nlohmann::json::array();
  r["optim"]["clip"] = 10.0;
  r["schedule"]["kind"] = "constant";
  r["log"]["tensorboard"] = false;
  r["log"]["plot"] = false;
  r["log"]["progress"] = "off";
}

// Files of a checkpoint folder that are training state, not the policy.
bool training_state(const std::string& name) {
  return name.rfind("optimizer", 0) == 0 || name == "trainer_state.json";
}

}  // namespace

extern "C" {

const char* lf_version(void) { return "0.1.0"; }

const char* lf_last_error(void) { return last_error.c_str(); }

lf_policy* lf_policy_open_on(const char* dir, const char* device, char* err, size_t err_len) {
  return guarded([&]() -> lf_policy* {
    need(dir, "dir");
    auto p = std::make_unique<lf_policy>();
    p->device = device && *device ? device : "cpu";
    p->runner = std::make_shared<lf::train::PolicyRunner>(dir, p->device);
    p->dir = dir;
    return p.release();
  }, static_cast<lf_policy*>(nullptr), err, err_len);
}

lf_policy* lf_policy_open(const char* dir, char* err, size_t err_len) {
  return lf_policy_open_on(dir, "cpu", err, err_len);
}

int lf_policy_action_shape(lf_policy* p, int64_t shape[2]) {
  return guarded([&]() -> int {
    need(p, "policy");
    need(shape, "shape");
    const nlohmann::json m = runner_of(p)->metadata();
    const auto& s = m.at("action_shape");
    shape[0] = s.at(0).get<int64_t>();
    shape[1] = s.at(1).get<int64_t>();
    return LF_OK;
  }, LF_ERROR, nullptr, 0);
}

int lf_policy_predict(lf_policy* p, const lf_obs* obs, size_t n_obs, float* actions, size_t capacity,
                      int64_t shape[2]) {
  return predict(p, obs, n_obs, nullptr, actions, capacity, shape);
}

int lf_policy_predict_prompt(lf_policy* p, const lf_obs* obs, size_t n_obs, const char* prompt, float* actions,
                             size_t capacity, int64_t shape[2]) {
  return predict(p, obs, n_obs, prompt, actions, capacity, shape);
}

int lf_policy_finetune(lf_policy* p, const char* dataset_dir, const char* recipe_yaml, char* err, size_t err_len) {
  return guarded([&]() -> int {
    need(p, "policy");
    need(dataset_dir, "dataset_dir");
    std::lock_guard<std::mutex> change(p->change_mu);
    std::string from;
    {
      std::lock_guard<std::mutex> lock(p->mu);
      from = p->dir;
    }
    nlohmann::json r = lf::train::load_recipe(recipe_yaml ? recipe_yaml : "");
    if (!recipe_yaml) default_finetune(r, p->device);
    const std::string out = make_temp_dir();
    try {
      r["output_dir"] = out;
      r["model"]["path"] = from;
      r["data"]["format"] = "robot";
      r["data"]["train"] = nlohmann::json::array({{{"path", dataset_dir}, {"weight", 1.0}}});
      const lf::train::TrainOutcome o = lf::train::train(r, false);
      if (o.last_checkpoint.empty()) throw lf::Error("fine-tune: the run wrote no checkpoint");
      auto fresh = std::make_shared<lf::train::PolicyRunner>(o.last_checkpoint, p->device);
      std::string old;
      {
        std::lock_guard<std::mutex> lock(p->mu);
        p->runner = std::move(fresh);
        p->dir = o.last_checkpoint;
        old = std::exchange(p->tmp, out);
      }
      if (!old.empty()) lf::remove_tree(old);
    } catch (...) {
      lf::remove_tree(out);
      throw;
    }
    return LF_OK;
  }, LF_ERROR, err, err_len);
}

int lf_policy_save(lf_policy* p, const char* dir, char* err, size_t err_len) {
  return guarded([&]() -> int {
    need(p, "policy");
    need(dir, "dir");
    std::lock_guard<std::mutex> change(p->change_mu);  // the folder stays while we copy it
    std::string from;
    {
      std::lock_guard<std::mutex> lock(p->mu);
      from = p->dir;
    }
    // The weights in memory are the folder's (only a fine-tune changes them, and it reads them back from its
    // checkpoint): the policy folder's files are the saved policy.
    fs::create_directories(dir);
    if (fs::equivalent(from, dir)) return LF_OK;
    for (const auto& e : fs::directory_iterator(from)) {
      const std::string name = e.path().filename().string();
      if (!e.is_regular_file() || training_state(name)) continue;
      fs::copy_file(e.path(), fs::path(dir) / name, fs::copy_options::overwrite_existing);
    }
    return LF_OK;
  }, LF_ERROR, err, err_len);
}

void lf_policy_close(lf_policy* p) {
  guarded([&]() -> int {
    if (!p) return LF_OK;
    std::unique_ptr<lf_policy> owned(p);
    owned->runner.reset();
    if (!owned->tmp.empty()) lf::remove_tree(owned->tmp);
    return LF_OK;
  }, LF_ERROR, nullptr, 0);
}

}  // extern "C"
