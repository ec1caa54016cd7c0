// Robot datasets: episodes of frames recorded at a fixed rate, each frame a set of features (joint state, action,
// camera images, timestamps, indices, a task). One interface over the formats robot-policy users train on:
//   - LeRobotDataset v3.0 and v2.1 (data/robot/lerobot.cpp): Parquet frames + mp4 videos + meta/;
//   - HDF5 episode files (data/robot/hdf5_episodes.cpp) in ALOHA's layout (/observations/qpos,
//     /observations/images/<cam>, /action, one file per episode) or robomimic's (/data/demo_N/obs/<key>,
//     /data/demo_N/actions, many episodes per file).
// Names are LeRobot's feature names ("observation.state", "action", "observation.images.top", "timestamp",
// "frame_index", "episode_index", "index", "task_index"), so recipes and exports speak one vocabulary whatever the
// files are. Sampling (delta_timestamps windows, pad masks), statistics, normalisation, image transforms and the
// threaded loader sit on top of this interface (data/robot/*.h), never on a format.
//
// Threads: a RobotDataset is shared by the loader's decode threads; every const method is safe to call concurrently.
// Errors: one-line lf::Error naming the file, the episode and the field.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lf::data::robot {

enum class FeatureKind {
  numeric,  // numbers per frame: a tensor [shape...] per frame (state, action, timestamp, indices)
  video,    // a camera stored as video: uint8 frames [H, W, C] decoded from mp4 at the frame's timestamp
  image,    // a camera stored as one encoded image (PNG / JPEG) per frame, or as raw uint8 arrays (HDF5)
  text,     // a string per frame (LeRobot's "task", resolved from task_index); not read as a tensor
};

// A depth camera (LeRobot: a video / image feature whose info says is_depth_map). Videos hold 12-bit codes of the
// depth (HEVC, gray12le), quantised between depth_min and depth_max (metres), logarithmically after adding shift
// when use_log: LeRobot's DepthEncoderConfig; images hold the depth itself in UNIT.
struct DepthMap {
  double depth_min = 0.01, depth_max = 10.0, shift = 3.5;
  bool use_log = true;
  std::string unit = "mm";  // what the recorded frames were in ("mm" or "m"); images are stored so
};

struct Feature {
  std::string name;
  FeatureKind kind = FeatureKind::numeric;
  std::string dtype;           // info.json's spelling: "float32", "int64", "bool", "video", "image", "string"
  std::vector<int64_t> shape;  // per frame: numeric as stored ({} for a scalar, {6} for a vector); cameras {H, W, C}
  std::vector<std::string> names;  // per-dimension names when the dataset gives them (info.json "names")
  std::optional<DepthMap> depth;   // cameras: a depth map (one channel)
};

struct Episode {
  int64_t index = 0;        // the dataset's episode_index (not necessarily its position in episodes())
  int64_t length = 0;       // frames
  int64_t from = 0;         // global index of its first frame (the "index" column); frames are [from, from + length)
  std::vector<std::string> tasks;  // the task texts it lists (may be empty)
};

// Per feature, per statistic ("mean", "std", "min", "max", "count", "q01", "q10", "q50", "q90", "q99"): float64
// tensors shaped like the feature (cameras: [C, 1, 1], as LeRobot stores them; "count": [1]).
using Stats = std::map<std::string, std::map<std::string, at::Tensor>>;

class RobotDataset {
 public:
  virtual ~RobotDataset() = default;

  // "LeRobot v3.0", "LeRobot v2.1", "HDF5 (ALOHA layout)", "HDF5 (robomimic layout)"
  virtual std::string format() const = 0;
  // The folder (or file) it was opened from.
  virtual const std::string& root() const = 0;
  virtual double fps() const = 0;

  // Every feature, numeric ones first, in the dataset's own order; cameras are the video and image features.
  virtual const std::vector<Feature>& features() const = 0;
  bool has_feature(const std::string& name) const;
  const Feature& feature(const std::string& name) const;  // one-line error naming the dataset and the feature
  std::vector<std::string> camera_names() const;

  // Episodes in episode_index order.
  virtual const std::vector<Episode>& episodes() const = 0;
  int64_t num_frames() const;  // over all episodes
  // The position in episodes() of the episode whose episode_index is INDEX; error when there is none.
  int64_t episode_position(int64_t index) const;
  // task_index -> task text (empty when the dataset has no tasks).
  virtual const std::vector<std::string>& tasks() const = 0;
  // The statistics the dataset ships (LeRobot meta/stats.json), empty when it has none.
  virtual const Stats& stats() const = 0;

  // Numeric features of frames [begin, end) of the episode at position EPISODE (0 <= begin <= end <= length), in
  // NAMES' order: tensors [end - begin, shape...] (CPU, contiguous) in the feature's dtype (float32 stays float32,
  // int64 indices stay int64, bool stays bool).
  virtual std::vector<at::Tensor> read_numeric(const std::vector<std::string>& names, int64_t episode,
                                               int64_t begin, int64_t end) const = 0;

  // Camera CAMERA (a video or image feature) at frames FRAMES (indices into the episode at position EPISODE, any
  // order, repeats allowed): uint8 [n, H, W, C]; a depth camera (Feature::depth): float32 [n, H, W, 1] in
  // millimetres, as LeRobotDataset's items (its default depth unit): a video's codes dequantised frame by frame, an
  // image's stored depth (TIFF) scaled from its unit.
  // Video cameras decode the frame nearest to each frame's timestamp (the timestamp column, plus the episode's
  // offset into a shared video file) as LeRobot does, failing when the nearest decoded frame is TOLERANCE_S or more
  // away.
  virtual at::Tensor read_camera(const std::string& camera, int64_t episode, const std::vector<int64_t>& frames,
                                 double tolerance_s = 1e-4) const = 0;
};

// Opens a LeRobot dataset folder (meta/info.json: v3.0 or v2.1), or HDF5 episodes (one .hdf5 / .h5 file, or a
// folder of them). Errors name the path and what is missing.
std::unique_ptr<RobotDataset> open_robot_dataset(const std::string& path);

// The formats' own entry points (open_robot_dataset picks one).
std::unique_ptr<RobotDataset> open_lerobot_dataset(const std::string& folder);
std::unique_ptr<RobotDataset> open_hdf5_dataset(const std::string& path);
// FPS: the frames' rate; the one-path form takes the layout's (ALOHA: 50; robomimic: env_args' control_freq, else 20).
std::unique_ptr<RobotDataset> open_hdf5_dataset(const std::string& path, double fps);
bool is_lerobot_dataset(const std::string& path);  // PATH/meta/info.json exists
bool is_hdf5_dataset(const std::string& path);      // an .hdf5 / .h5 file, or a folder holding some
bool hdf5_available();  // this build reads HDF5 (libhdf5 found); without it open_hdf5_dataset throws

}  // namespace lf::data::robot
