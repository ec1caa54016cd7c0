// loongforge data export: a robot dataset's frames (LeRobot v3.0 / v2.1, HDF5 episodes) into one .safetensors file,
// under LeRobot's feature names; and the dataset summary `loongforge info DATASET` prints.
#include <ATen/ATen.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/data/robot/dataset.h"
#include "loongforge/io/safetensors.h"

namespace lf::cli {

namespace {

namespace robot = lf::data::robot;

struct ExportOptions {
  std::string dataset, out;
  std::vector<int64_t> episodes;
  bool cameras = false;
  bool stats = false;
  double tolerance_s = 1e-4;
};

const char* kind_name(robot::FeatureKind k) {
  switch (k) {
    case robot::FeatureKind::numeric: return "numeric";
    case robot::FeatureKind::video: return "video";
    case robot::FeatureKind::image: return "image";
    case robot::FeatureKind::text: return "text";
  }
  return "?";
}

void export_dataset(const ExportOptions& o) {
  const auto ds = robot::open_robot_dataset(o.dataset);
  std::vector<int64_t> positions;
  if (!o.episodes.empty()) {
    for (int64_t e : o.episodes) positions.push_back(ds->episode_position(e));
  } else {
    for (int64_t i = 0; i < static_cast<int64_t>(ds->episodes().size()); ++i) positions.push_back(i);
  }
  std::vector<std::string> numeric;
  for (const auto& f : ds->features())
    if (f.kind == robot::FeatureKind::numeric) numeric.push_back(f.name);
  std::vector<std::vector<at::Tensor>> parts(numeric.size());
  for (int64_t p : positions) {
    auto cols = ds->read_numeric(numeric, p, 0, ds->episodes()[p].length);
    for (size_t i = 0; i < cols.size(); ++i) parts[i].push_back(cols[i]);
  }
  io::NamedTensors out;
  for (size_t i = 0; i < numeric.size(); ++i) {
    if (parts[i].empty()) continue;
    out.emplace_back(numeric[i], at::cat(parts[i]).contiguous());
  }
  if (o.cameras || !o.episodes.empty()) {
    for (const auto& cam : ds->camera_names()) {
      std::vector<at::Tensor> per;
      for (int64_t p : positions) {
        std::vector<int64_t> frames(ds->episodes()[p].length);
        for (size_t i = 0; i < frames.size(); ++i) frames[i] = static_cast<int64_t>(i);
        per.push_back(ds->read_camera(cam, p, frames, o.tolerance_s));
      }
      if (!per.empty()) out.emplace_back(cam, at::cat(per).contiguous());
    }
  }
  if (o.stats)
    for (const auto& [feature, per] : ds->stats())
      for (const auto& [stat, t] : per) out.emplace_back("stats/" + feature + "/" + stat, t.contiguous());
  std::map<std::string, std::string> meta{{"format", ds->format()}, {"fps", std::to_string(ds->fps())}};
  io::save_file(o.out, out, meta);
  std::printf("%s: %zu tensors (%zu episodes of %s) -> %s\n", o.dataset.c_str(), out.size(), positions.size(),
              ds->format().c_str(), o.out.c_str());
}

}  // namespace

bool print_robot_dataset_info(const std::string& path) {
  if (!robot::is_lerobot_dataset(path) && !robot::is_hdf5_dataset(path)) return false;
  const auto ds = robot::open_robot_dataset(path);
  nlohmann::ordered_json j;
  j["format"] = ds->format();
  j["root"] = ds->root();
  j["episodes"] = ds->episodes().size();
  j["frames"] = ds->num_frames();
  j["fps"] = ds->fps();
  j["tasks"] = ds->tasks().size();
  j["features"] = nlohmann::ordered_json::array();
  for (const auto& f : ds->features()) {
    nlohmann::ordered_json x;
    x["name"] = f.name;
    x["kind"] = kind_name(f.kind);
    x["dtype"] = f.dtype;
    x["shape"] = f.shape;
    if (!f.names.empty()) x["names"] = f.names;
    if (f.depth) x["depth"] = true;  // frames are float32 millimetres
    j["features"].push_back(x);
  }
  j["cameras"] = ds->camera_names();
  j["stats"] = nlohmann::ordered_json::array();
  for (const auto& [feature, per] : ds->stats()) j["stats"].push_back(feature);
  std::printf("%s\n", j.dump(2).c_str());
  return true;
}

void add_data_export(CLI::App& data) {
  auto o = std::make_shared<ExportOptions>();
  auto* sub = data.add_subcommand(
      "export", "Read a robot dataset (LeRobot v3.0 / v2.1, HDF5 episodes) into a .safetensors file");
  sub->add_option("--dataset", o->dataset, "Dataset folder (meta/info.json), or HDF5 episode file(s)")->required();
  sub->add_option("--out", o->out, "Output .safetensors")->required();
  sub->add_option("--episode", o->episodes, "Only this episode (its episode_index), with its camera frames; "
                                            "repeatable");
  sub->add_flag("--cameras", o->cameras, "Also the cameras' frames when exporting every episode");
  sub->add_flag("--stats", o->stats, "Also write the dataset's statistics as stats/FEATURE/STAT (float64)");
  sub->add_option("--tolerance-s", o->tolerance_s, "Video frames: the largest timestamp mismatch allowed")
      ->capture_default_str();
  sub->footer(
      "Writes every numeric feature under its name (observation.state, action, timestamp, frame_index,\n"
      "episode_index, index, task_index, ...) for all frames in episode order (or the --episode ones); with\n"
      "--episode or --cameras also each camera's decoded frames, uint8 [frames, H, W, C], under its name.\n"
      "Example:\n"
      "  loongforge data export --dataset path/to/lerobot_dataset --episode 0 --out ep0.safetensors");
  sub->callback([o] { export_dataset(*o); });
}

}  // namespace lf::cli
