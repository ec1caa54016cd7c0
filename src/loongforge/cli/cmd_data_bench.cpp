// loongforge data bench-loader: the robot loader (data/robot/loader.h) on a dataset, as a policy's training would
// read it: delta_timestamps windows, batches, decode threads; prints frames/s and batches/s, and can write the
// batches (or per-frame items) and the sampler state for tests and resume checks.
#include <ATen/ATen.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/robot/dataset.h"
#include "loongforge/data/robot/loader.h"
#include "loongforge/data/robot/sampler.h"
#include "loongforge/io/safetensors.h"

namespace lf::cli {

namespace {

using namespace lf::data::robot;

struct BenchLoaderOptions {
  std::string data, episodes, val_list, take = "train", resume, state_out, dump;
  std::vector<std::string> deltas, features;
  int64_t batch = 8, steps = 20, val_count = 0;
  int threads = 2, prefetch = 0;
  bool shuffle = false, samples = false;
  uint64_t seed = 0;
  double tolerance_s = 1e-4;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t b = 0;
  while (true) {
    size_t e = s.find(sep, b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return out;
}

int64_t parse_int(const std::string& s, const std::string& option) {
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || errno) throw Error(option + ": expected an integer, got '" + s + "'");
  return v;
}

// "0,3,5-9" -> 0 3 5 6 7 8 9
std::vector<int64_t> parse_episodes(const std::string& s, const std::string& option) {
  std::vector<int64_t> out;
  if (s.empty()) return out;
  for (const auto& part : split(s, ',')) {
    auto dash = part.find('-', 1);
    if (dash == std::string::npos) {
      out.push_back(parse_int(part, option));
      continue;
    }
    const int64_t a = parse_int(part.substr(0, dash), option), b = parse_int(part.substr(dash + 1), option);
    if (b < a) throw Error(option + ": empty range '" + part + "'");
    for (int64_t e = a; e <= b; ++e) out.push_back(e);
  }
  return out;
}

// "observation.state=-0.1,0" -> {"observation.state", {-0.1, 0}}
std::pair<std::string, std::vector<double>> parse_delta(const std::string& s) {
  const auto eq = s.find('=');
  if (eq == std::string::npos || eq == 0)
    throw Error("--delta: expected FEATURE=SECONDS,SECONDS,..., got '" + s + "'");
  std::pair<std::string, std::vector<double>> out{s.substr(0, eq), {}};
  for (const auto& v : split(s.substr(eq + 1), ',')) {
    char* end = nullptr;
    const double d = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0') throw Error("--delta " + out.first + ": expected a number of seconds, got '" + v + "'");
    out.second.push_back(d);
  }
  return out;
}

void bench_loader(const BenchLoaderOptions& a) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();  // timed from opening the dataset
  std::shared_ptr<const RobotDataset> ds = open_robot_dataset(a.data);
  EpisodeSelection sel;
  sel.episodes = parse_episodes(a.episodes, "--episodes");
  sel.val_count = a.val_count;
  sel.val_episodes = parse_episodes(a.val_list, "--val-list");
  const EpisodeSplit parts = split_episodes(*ds, sel);
  if (a.take == "val" && parts.val.empty()) throw Error("--take val: no episodes are held out (--val-episodes / --val-list)");
  FrameSampler sampler(*ds, a.take == "val" ? parts.val : parts.train, a.shuffle, a.seed);
  if (!a.resume.empty()) sampler.restore(SamplerState::from_json(read_json_file(a.resume), a.resume), a.resume);

  LoaderOptions o;
  for (const auto& d : a.deltas) o.delta_timestamps.push_back(parse_delta(d));
  o.features = a.features;
  o.batch_size = a.batch;
  o.threads = a.threads;
  o.prefetch = a.prefetch;
  o.tolerance_s = a.tolerance_s;

  RobotLoader loader(ds, std::move(sampler), o);
  int64_t images_per_batch = 0;
  for (const auto& name : loader.features())
    if (ds->feature(name).kind == FeatureKind::video || ds->feature(name).kind == FeatureKind::image) {
      int64_t w = 1;
      for (const auto& win : loader.windows())
        if (win.feature == name) w = static_cast<int64_t>(win.offsets.size());
      images_per_batch += a.batch * w;
    }
  io::NamedTensors dump;
  clock::time_point t_first = t0;
  int64_t sample = 0;
  for (int64_t step = 0; step < a.steps; ++step) {
    RobotBatch batch = loader.next();
    if (step == 0) t_first = clock::now();
    if (a.dump.empty()) continue;
    if (!a.samples) {
      for (auto& [k, v] : batch) dump.emplace_back("batch" + std::to_string(step) + "." + k, v);
      continue;
    }
    for (int64_t b = 0; b < a.batch; ++b, ++sample)
      for (auto& [k, v] : batch) dump.emplace_back("sample" + std::to_string(sample) + "." + k, v[b].contiguous());
  }
  const auto t_end = clock::now();
  const double total = std::chrono::duration<double>(t_end - t0).count();
  const double steady = std::chrono::duration<double>(t_end - t_first).count();
  const double frames = static_cast<double>(a.steps * a.batch);
  std::printf("bench-loader: %s (%s, %.6g fps): %lld batches x %lld frames, %d threads, %lld camera images per batch\n",
              ds->root().c_str(), ds->format().c_str(), ds->fps(), static_cast<long long>(a.steps),
              static_cast<long long>(a.batch), a.threads, static_cast<long long>(images_per_batch));
  std::printf("bench-loader: %.1f frames/s, %.2f batches/s (%.3f s from opening the dataset, first batch after %.3f s)\n", frames / total,
              static_cast<double>(a.steps) / total, total, std::chrono::duration<double>(t_first - t0).count());
  if (a.steps > 1)
    std::printf("bench-loader: after the first batch: %.1f frames/s, %.2f batches/s\n",
                frames * static_cast<double>(a.steps - 1) / static_cast<double>(a.steps) / steady,
                static_cast<double>(a.steps - 1) / steady);
  if (!a.state_out.empty()) write_file_atomic(a.state_out, loader.state().to_json().dump(2) + "\n");
  if (!a.dump.empty()) io::save_file(a.dump, dump);
}

}  // namespace

void add_data_bench_loader(CLI::App& data) {
  auto a = std::make_shared<BenchLoaderOptions>();
  auto* sub = data.add_subcommand("bench-loader",
                                  "Read a robot dataset (LeRobot / HDF5) as training does: windows, batches, decode "
                                  "threads; prints frames/s");
  sub->add_option("data", a->data, "A LeRobot dataset folder, or HDF5 episodes (a file or a folder)")->required();
  sub->add_option("--delta", a->deltas,
                  "A delta_timestamps window: FEATURE=SECONDS,SECONDS,... (repeatable; e.g. action=0,0.1,0.2)")
      ->allow_extra_args(false);
  sub->add_option("--features", a->features, "Features in a batch (default: every numeric and camera feature)")
      ->delimiter(',');
  sub->add_option("--batch", a->batch, "Frames per batch")->capture_default_str();
  sub->add_option("--threads", a->threads, "Decode threads (0: in the consumer's thread)")->capture_default_str();
  sub->add_option("--prefetch", a->prefetch, "Batches read ahead (default 2 x threads)");
  sub->add_flag("--shuffle", a->shuffle, "Seeded shuffle of the frames, a new order each epoch");
  sub->add_option("--seed", a->seed, "Shuffle seed")->capture_default_str();
  sub->add_option("--episodes", a->episodes, "The episodes to use, by episode_index: 0,3,5-9 (default: all)");
  sub->add_option("--val-episodes", a->val_count, "Hold out this many episodes for validation (spread evenly)");
  sub->add_option("--val-list", a->val_list, "Hold out these episodes for validation: 4,9");
  sub->add_option("--take", a->take, "Read the training episodes or the held-out ones")
      ->check(CLI::IsMember({"train", "val"}))
      ->capture_default_str();
  sub->add_option("--steps", a->steps, "Batches to read")->capture_default_str();
  sub->add_option("--tolerance-s", a->tolerance_s, "delta_timestamps / video timestamp tolerance (seconds)")
      ->capture_default_str();
  sub->add_option("--resume", a->resume, "Continue from a sampler state written by --state-out");
  sub->add_option("--state-out", a->state_out, "Write the sampler state after the last batch (JSON)");
  sub->add_option("--dump", a->dump, "Write the batches to a .safetensors file: batch<K>.<name>");
  sub->add_flag("--samples", a->samples, "With --dump: one item per frame, sample<N>.<name> (N counts frames)");
  sub->footer(
      "A batch holds each feature as [B, window..., shape] (cameras uint8 [B, window..., H, W, C]) and\n"
      "<feature>_is_pad bool [B, window] for windowed features (LeRobot's padding at episode edges).\n"
      "Example:\n"
      "  loongforge data bench-loader DATA --delta observation.state=-0.1,0 --delta action=0,0.1,0.2 \\\n"
      "      --batch 32 --threads 4 --shuffle --steps 50");
  sub->callback([a] {
    if (a->steps < 1) throw Error("--steps: must be at least 1");
    bench_loader(*a);
  });
}

}  // namespace lf::cli
