// The format-independent parts of RobotDataset and the format dispatch (dataset.h).
#include "loongforge/data/robot/dataset.h"

#include <filesystem>

#include "loongforge/core/error.h"

namespace lf::data::robot {

bool RobotDataset::has_feature(const std::string& name) const {
  for (const auto& f : features())
    if (f.name == name) return true;
  return false;
}

const Feature& RobotDataset::feature(const std::string& name) const {
  for (const auto& f : features())
    if (f.name == name) return f;
  std::string known;
  for (const auto& f : features()) known += (known.empty() ? "" : ", ") + f.name;
  throw file_error(root(), name, "no such feature (the dataset has: " + known + ")");
}

std::vector<std::string> RobotDataset::camera_names() const {
  std::vector<std::string> out;
  for (const auto& f : features())
    if (f.kind == FeatureKind::video || f.kind == FeatureKind::image) out.push_back(f.name);
  return out;
}

int64_t RobotDataset::num_frames() const {
  int64_t n = 0;
  for (const auto& e : episodes()) n += e.length;
  return n;
}

int64_t RobotDataset::episode_position(int64_t index) const {
  const auto& eps = episodes();
  for (size_t i = 0; i < eps.size(); ++i)
    if (eps[i].index == index) return static_cast<int64_t>(i);
  throw file_error(root(), "episode_index",
                   "no episode " + std::to_string(index) + " (the dataset has " + std::to_string(eps.size()) +
                       " episodes)");
}

bool is_lerobot_dataset(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(std::filesystem::path(path) / "meta" / "info.json", ec);
}

static bool has_hdf5_suffix(const std::filesystem::path& p) {
  auto ext = p.extension().string();
  return ext == ".hdf5" || ext == ".h5";
}

bool is_hdf5_dataset(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return has_hdf5_suffix(path);
  if (!fs::is_directory(path, ec)) return false;
  for (const auto& entry : fs::directory_iterator(path, ec))
    if (entry.is_regular_file() && has_hdf5_suffix(entry.path())) return true;
  return false;
}

std::unique_ptr<RobotDataset> open_robot_dataset(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw Error(path + ": no such file or folder");
  if (is_lerobot_dataset(path)) return open_lerobot_dataset(path);
  if (is_hdf5_dataset(path)) return open_hdf5_dataset(path);
  throw Error(path +
              ": not a robot dataset (a LeRobot dataset has meta/info.json; HDF5 episodes are .hdf5 / .h5 files)");
}

}  // namespace lf::data::robot
