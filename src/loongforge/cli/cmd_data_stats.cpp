// loongforge data stats: a robot dataset's per-feature statistics (data/robot/stats.h), computed as LeRobot computes
// them, written in LeRobot's meta/stats.json layout.
#include <ATen/ATen.h>

#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/robot/dataset.h"
#include "loongforge/data/robot/stats.h"

namespace lf::cli {

namespace {

struct DataStatsOptions {
  std::string dataset, episodes, features, out;
  double fps = 0;
};

template <class F>
void split_list(const std::string& text, F&& each) {
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) each(item);
}

void run_stats(const DataStatsOptions& o) {
  namespace robot = lf::data::robot;
  std::unique_ptr<robot::RobotDataset> ds;
  if (o.fps > 0) {
    if (!robot::is_hdf5_dataset(o.dataset))
      throw Error(o.dataset + ": --fps is for HDF5 episodes (a LeRobot dataset's info.json gives its fps)");
    ds = robot::open_hdf5_dataset(o.dataset, o.fps);
  } else {
    ds = robot::open_robot_dataset(o.dataset);
  }
  std::vector<int64_t> positions;
  split_list(o.episodes, [&](const std::string& s) {
    int64_t index = 0;
    try {
      size_t used = 0;
      index = std::stoll(s, &used);
      if (used != s.size()) throw std::invalid_argument(s);
    } catch (const std::exception&) {
      throw Error("--episodes: '" + s + "' is not an episode index");
    }
    positions.push_back(ds->episode_position(index));
  });
  std::vector<std::string> features;
  split_list(o.features, [&](const std::string& s) {
    ds->feature(s);  // one line naming the dataset and the feature when it has none
    features.push_back(s);
  });
  auto stats = robot::to_stats(robot::compute_stats(*ds, positions, features));
  auto text = robot::stats_to_json(stats);
  if (o.out.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
  } else {
    write_file_atomic(o.out, text);
    std::fprintf(stderr, "%s: statistics of %zu features over %zu episodes\n", o.out.c_str(), stats.size(),
                 positions.empty() ? ds->episodes().size() : positions.size());
  }
}

}  // namespace

void add_data_stats(CLI::App& data) {
  auto o = std::make_shared<DataStatsOptions>();
  auto* sub = data.add_subcommand("stats", "A robot dataset's per-feature statistics (mean, std, min, max, count, "
                                           "q01..q99) as LeRobot computes them, as stats.json");
  sub->add_option("--dataset", o->dataset, "a LeRobot dataset folder, or HDF5 episodes (a .hdf5 file or a folder)")
      ->required();
  sub->add_option("--episodes", o->episodes, "episode indices, comma-separated (default: all)");
  sub->add_option("--features", o->features, "feature names, comma-separated (default: every numeric and camera one)");
  sub->add_option("--fps", o->fps,
                  "HDF5 episodes' frame rate (default: ALOHA's 50; robomimic's env_args control_freq, else 20)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--out", o->out, "the stats.json to write (default: standard output)");
  sub->footer("Example:\n  loongforge data stats --dataset aloha_episodes/ --episodes 0,2,5 --out stats.json");
  sub->callback([o] { run_stats(*o); });
}

}  // namespace lf::cli
