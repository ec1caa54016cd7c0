// The threaded robot loader (loader.h).
#include "loongforge/data/robot/loader.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <set>
#include <thread>

#include "loongforge/core/error.h"

namespace lf::data::robot {

namespace {

struct FeatureInfo {
  std::string name;
  bool camera = false;
  bool windowed = false;
  std::vector<int64_t> offsets = {0};  // {0} without a window
  at::ScalarType dtype = at::kByte;
  std::vector<int64_t> shape;          // per frame
};

struct Task {
  bool camera = false;
  size_t feature = 0;          // the camera's index into features (camera tasks)
  int64_t episode = 0;         // position in episodes()
  std::vector<int64_t> items;  // positions in the batch, all of this episode
};

struct Plan {
  std::vector<FrameRef> frames;
  SamplerState after;
  RobotBatch out;
  std::vector<Task> tasks;
  size_t next_task = 0, remaining = 0;
  std::exception_ptr error;
  bool ready = false;
};

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

struct RobotLoader::Impl {
  std::shared_ptr<const RobotDataset> ds;
  LoaderOptions opts;
  FrameSampler sampler;
  std::vector<Window> windows;
  std::vector<FeatureInfo> feats;
  std::vector<std::string> names;          // feats' names
  std::vector<size_t> numeric;             // indices into feats
  std::vector<std::string> numeric_names;  // their names (read_numeric's argument)
  size_t prefetch = 2;

  std::mutex m;
  std::condition_variable cv_work, cv_ready;
  std::deque<std::shared_ptr<Plan>> plans;
  bool stop = false;
  SamplerState consumed;
  std::vector<std::thread> threads;

  Impl(std::shared_ptr<const RobotDataset> d, FrameSampler s, LoaderOptions o)
      : ds(std::move(d)), opts(std::move(o)), sampler(std::move(s)) {}

  std::string episode_label(int64_t episode) const {
    return "episode " + std::to_string(ds->episodes()[static_cast<size_t>(episode)].index);
  }

  void setup() {
    const std::string& where = ds->root();
    if (opts.batch_size < 1) throw file_error(where, "batch_size", "must be at least 1");
    if (opts.threads < 0) throw file_error(where, "threads", "must be 0 or more");
    if (opts.rows_count < 0 || opts.rows_first < 0 || (opts.rows_count > 0 && opts.rows_first + opts.rows_count > opts.batch_size))
      throw file_error(where, "rows_first", "rows [" + std::to_string(opts.rows_first) + ", " +
                                                std::to_string(opts.rows_first + opts.rows_count) +
                                                ") are not within a batch of " + std::to_string(opts.batch_size));
    windows = delta_windows(opts.delta_timestamps, ds->fps(), opts.tolerance_s, where);
    std::vector<std::string> want = opts.features;
    if (want.empty())
      for (const auto& f : ds->features())
        if (f.kind != FeatureKind::text) want.push_back(f.name);
    std::set<std::string> seen;
    for (const auto& n : want) {
      const Feature& f = ds->feature(n);  // error naming the dataset and the feature
      if (!seen.insert(n).second) throw file_error(where, "features", "feature '" + n + "' given twice");
      if (f.kind == FeatureKind::text)
        throw file_error(where, n, "a text feature cannot be read into a batch");
      FeatureInfo fi;
      fi.name = n;
      fi.camera = f.kind == FeatureKind::video || f.kind == FeatureKind::image;
      fi.shape = f.shape;
      if (f.depth) fi.dtype = at::kFloat;  // depth cameras: millimetres
      feats.push_back(std::move(fi));
      names.push_back(n);
    }
    for (const auto& w : windows) {
      auto it = std::find(names.begin(), names.end(), w.feature);
      if (it == names.end()) {
        ds->feature(w.feature);  // an unknown feature: the dataset's error
        throw file_error(where, "delta_timestamps." + w.feature, "not among the features read");
      }
      auto& fi = feats[static_cast<size_t>(it - names.begin())];
      fi.windowed = true;
      fi.offsets = w.offsets;
    }
    for (size_t i = 0; i < feats.size(); ++i)
      if (!feats[i].camera) {
        numeric.push_back(i);
        numeric_names.push_back(feats[i].name);
      }
    if (!numeric.empty()) {  // dtypes and per-frame shapes as the reader gives them
      const auto& eps = ds->episodes();
      for (int64_t p : sampler.episode_positions())
        if (eps[static_cast<size_t>(p)].length > 0) {
          auto probe = ds->read_numeric(numeric_names, p, 0, 1);
          for (size_t j = 0; j < numeric.size(); ++j) {
            auto& fi = feats[numeric[j]];
            fi.dtype = probe[j].scalar_type();
            fi.shape = probe[j].sizes().slice(1).vec();
          }
          break;
        }
    }
    consumed = sampler.state();
    prefetch = static_cast<size_t>(opts.prefetch > 0 ? opts.prefetch : 2 * std::max(opts.threads, 1));
    for (int i = 0; i < opts.threads; ++i) threads.emplace_back([this] { work(); });
  }

  // Draws the next batch's frames and cuts it into tasks (under the lock: the sampler is not thread-safe).
  std::shared_ptr<Plan> make_plan() {
    auto p = std::make_shared<Plan>();
    try {
      const int64_t B = opts.rows_count > 0 ? opts.rows_count : opts.batch_size;
      p->frames = sampler.next_batch(opts.batch_size);
      if (opts.rows_count > 0)
        p->frames = std::vector<FrameRef>(p->frames.begin() + opts.rows_first,
                                          p->frames.begin() + opts.rows_first + opts.rows_count);
      p->after = sampler.state();
      std::map<int64_t, std::vector<int64_t>> by_episode;
      for (int64_t b = 0; b < B; ++b) by_episode[p->frames[static_cast<size_t>(b)].episode].push_back(b);
      const auto& eps = ds->episodes();
      for (const auto& fi : feats) {
        std::vector<int64_t> shape = {B};
        if (fi.windowed) shape.push_back(static_cast<int64_t>(fi.offsets.size()));
        shape.insert(shape.end(), fi.shape.begin(), fi.shape.end());
        p->out[fi.name] = at::empty(shape, at::TensorOptions().dtype(fi.dtype));
        if (!fi.windowed) continue;
        const auto W = static_cast<int64_t>(fi.offsets.size());
        auto pad = at::empty({B, W}, at::kBool);
        std::vector<int64_t> frames(static_cast<size_t>(W));
        for (int64_t b = 0; b < B; ++b) {
          const auto& fr = p->frames[static_cast<size_t>(b)];
          window_query(fi.offsets, eps[static_cast<size_t>(fr.episode)].length, fr.frame, frames.data(),
                       pad.data_ptr<bool>() + b * W);
        }
        p->out[fi.name + "_is_pad"] = pad;
      }
      for (auto& [episode, items] : by_episode) {
        if (!numeric.empty()) p->tasks.push_back({false, 0, episode, items});
        for (size_t i = 0; i < feats.size(); ++i)
          if (feats[i].camera) p->tasks.push_back({true, i, episode, items});
      }
    } catch (...) {
      p->error = std::current_exception();
      p->tasks.clear();
    }
    p->remaining = p->tasks.size();
    p->ready = p->remaining == 0;
    return p;
  }

  void run_numeric(Plan& p, const Task& t) {
    const int64_t length = ds->episodes()[static_cast<size_t>(t.episode)].length;
    std::vector<int64_t> need;
    std::vector<int64_t> q;
    for (int64_t b : t.items) {
      const auto& fr = p.frames[static_cast<size_t>(b)];
      for (size_t j : numeric) {
        const auto& off = feats[j].offsets;
        q.resize(off.size());
        std::unique_ptr<bool[]> pad(new bool[off.size()]);
        window_query(off, length, fr.frame, q.data(), pad.get());
        need.insert(need.end(), q.begin(), q.end());
      }
    }
    std::sort(need.begin(), need.end());
    need.erase(std::unique(need.begin(), need.end()), need.end());
    // Runs of nearby frames, one read each; row_start[r] is run r's first row in the concatenation.
    constexpr int64_t kGap = 16;
    std::vector<int64_t> run_first, run_row;
    std::vector<std::vector<at::Tensor>> parts(numeric.size());
    int64_t rows = 0;
    for (size_t i = 0; i < need.size();) {
      size_t j = i;
      while (j + 1 < need.size() && need[j + 1] - need[j] <= kGap) ++j;
      auto got = ds->read_numeric(numeric_names, t.episode, need[i], need[j] + 1);
      for (size_t k = 0; k < numeric.size(); ++k) parts[k].push_back(got[k]);
      run_first.push_back(need[i]);
      run_row.push_back(rows);
      rows += need[j] + 1 - need[i];
      i = j + 1;
    }
    auto row_of = [&](int64_t frame) {
      auto r = static_cast<size_t>(std::upper_bound(run_first.begin(), run_first.end(), frame) - run_first.begin() - 1);
      return run_row[r] + frame - run_first[r];
    };
    for (size_t k = 0; k < numeric.size(); ++k) {
      const auto& fi = feats[numeric[k]];
      at::Tensor all = parts[k].size() == 1 ? parts[k][0] : at::cat(parts[k]);
      if (all.size(0) != rows || all.sizes().slice(1) != at::IntArrayRef(fi.shape) || all.scalar_type() != fi.dtype)
        throw file_error(ds->root(), fi.name,
                         episode_label(t.episode) + ": the reader gave " + shape_str(all.sizes()) + " " +
                             std::string(c10::toString(all.scalar_type())) + ", expected " +
                             std::to_string(rows) + " rows of " + shape_str(fi.shape) + " " +
                             std::string(c10::toString(fi.dtype)));
      const auto W = fi.offsets.size();
      q.resize(W);
      std::vector<int64_t> idx(t.items.size() * W);
      std::unique_ptr<bool[]> pad(new bool[W]);
      for (size_t i = 0; i < t.items.size(); ++i) {
        window_query(fi.offsets, length, p.frames[static_cast<size_t>(t.items[i])].frame, q.data(), pad.get());
        for (size_t w = 0; w < W; ++w) idx[i * W + w] = row_of(q[w]);
      }
      at::Tensor g = all.index_select(0, at::tensor(idx, at::kLong));
      at::Tensor& out = p.out.at(fi.name);
      for (size_t i = 0; i < t.items.size(); ++i) {
        at::Tensor rows_i = g.narrow(0, static_cast<int64_t>(i * W), static_cast<int64_t>(W));
        out.select(0, t.items[i]).copy_(fi.windowed ? rows_i : rows_i.squeeze(0));
      }
    }
  }

  void run_camera(Plan& p, const Task& t) {
    const auto& fi = feats[t.feature];
    const int64_t length = ds->episodes()[static_cast<size_t>(t.episode)].length;
    const auto W = fi.offsets.size();
    std::vector<int64_t> q(W), all;
    std::unique_ptr<bool[]> pad(new bool[W]);
    for (int64_t b : t.items) {
      window_query(fi.offsets, length, p.frames[static_cast<size_t>(b)].frame, q.data(), pad.get());
      all.insert(all.end(), q.begin(), q.end());
    }
    std::vector<int64_t> need = all;
    std::sort(need.begin(), need.end());
    need.erase(std::unique(need.begin(), need.end()), need.end());
    at::Tensor img = ds->read_camera(fi.name, t.episode, need, opts.tolerance_s);
    std::vector<int64_t> want = {static_cast<int64_t>(need.size())};
    want.insert(want.end(), fi.shape.begin(), fi.shape.end());
    if (img.sizes() != at::IntArrayRef(want) || img.scalar_type() != fi.dtype)
      throw file_error(ds->root(), fi.name,
                       episode_label(t.episode) + ": the reader gave frames " + shape_str(img.sizes()) + " " +
                           std::string(c10::toString(img.scalar_type())) + ", expected " +
                           std::string(c10::toString(fi.dtype)) + " " + shape_str(want));
    at::Tensor& out = p.out.at(fi.name);
    for (size_t i = 0; i < t.items.size(); ++i) {
      at::Tensor dst = out.select(0, t.items[i]);
      for (size_t w = 0; w < W; ++w) {
        const auto r = std::lower_bound(need.begin(), need.end(), all[i * W + w]) - need.begin();
        (fi.windowed ? dst.select(0, static_cast<int64_t>(w)) : dst).copy_(img.select(0, r));
      }
    }
  }

  void run(Plan& p, const Task& t) {
    if (t.camera)
      run_camera(p, t);
    else
      run_numeric(p, t);
  }

  void work() {
    std::unique_lock<std::mutex> lk(m);
    while (true) {
      if (stop) return;
      std::shared_ptr<Plan> p;
      const Task* t = nullptr;
      for (auto& pl : plans)
        if (pl->next_task < pl->tasks.size()) {
          p = pl;
          t = &pl->tasks[pl->next_task++];
          break;
        }
      if (!t) {
        if (plans.size() < prefetch) {
          plans.push_back(make_plan());
          if (plans.back()->ready) cv_ready.notify_all();
          cv_work.notify_all();
        } else {
          cv_work.wait(lk);
        }
        continue;
      }
      lk.unlock();
      std::exception_ptr err;
      try {
        run(*p, *t);
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      if (err && !p->error) p->error = err;
      if (--p->remaining == 0) {
        p->ready = true;
        cv_ready.notify_all();
      }
    }
  }

  RobotBatch next() {
    std::shared_ptr<Plan> p;
    if (threads.empty()) {
      p = make_plan();
      for (const auto& t : p->tasks) {
        try {
          run(*p, t);
        } catch (...) {
          if (!p->error) p->error = std::current_exception();
          break;
        }
      }
      consumed = p->after;
    } else {
      std::unique_lock<std::mutex> lk(m);
      cv_work.notify_all();
      cv_ready.wait(lk, [&] { return !plans.empty() && plans.front()->ready; });
      p = plans.front();
      plans.pop_front();
      consumed = p->after;
      lk.unlock();
      cv_work.notify_all();
    }
    if (p->error) std::rethrow_exception(p->error);
    return std::move(p->out);
  }

  void shutdown() {
    {
      std::lock_guard<std::mutex> lk(m);
      stop = true;
    }
    cv_work.notify_all();
    for (auto& th : threads) th.join();
    threads.clear();
  }
};

RobotLoader::RobotLoader(std::shared_ptr<const RobotDataset> dataset, FrameSampler sampler, LoaderOptions options)
    : impl_(std::make_unique<Impl>(std::move(dataset), std::move(sampler), std::move(options))) {
  impl_->setup();
}

RobotLoader::~RobotLoader() { impl_->shutdown(); }

RobotBatch RobotLoader::next() { return impl_->next(); }

SamplerState RobotLoader::state() const {
  std::lock_guard<std::mutex> lk(impl_->m);
  return impl_->consumed;
}

const std::vector<std::string>& RobotLoader::features() const { return impl_->names; }
const std::vector<Window>& RobotLoader::windows() const { return impl_->windows; }

at::Tensor camera_to_float(const at::Tensor& frames) {
  return at::movedim(frames, -1, -3).to(at::kFloat).div_(255.0).contiguous();
}

}  // namespace lf::data::robot
