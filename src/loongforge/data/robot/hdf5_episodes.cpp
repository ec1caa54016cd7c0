// HDF5 episodes (dataset.h), through libhdf5's C API, in two layouts, told apart per file (a /data group holding
// demo_N groups: robomimic; else ALOHA), one layout per dataset.
// ALOHA: one file per episode (episode_N.hdf5: N is the episode_index when every file is so numbered, else the
// files' sorted position), or a single file:
//   /observations/qpos   [T, D]          -> observation.state
//   /observations/qvel   [T, D] (opt.)   -> observation.velocity
//   /observations/effort [T, D] (opt.)   -> observation.effort
//   /action              [T, A]          -> action
//   /observations/images/<cam> uint8 [T, H, W, C] -> observation.images.<cam> (an image feature), or, in ALOHA's
//       compressed files (root attribute compress = true), uint8 [T, N]: each row one JPEG padded with zeros.
// robomimic: one file (or several) holding many episodes, /data/demo_N (N is the episode_index when the numbers are
// distinct over the dataset, else the position; demos in N's order, as robomimic sorts them):
//   /data/demo_N/obs/<key>   [T, ...] -> observation.<key>, or observation.images.<key> for uint8 [T, H, W, C]
//                                       (C = 1 or 3; robomimic's image observations); other ranks (depth as float
//                                       [T, H, W, 1]) stay numeric with their per-frame shape
//   /data/demo_N/states      [T, S] (opt.) -> observation.environment_state (the simulator state)
//   /data/demo_N/actions     [T, A]        -> action
//   /data/demo_N/rewards, dones [T] (opt.) -> next.reward, next.done
//   attribute num_samples of demo_N must equal T; next_obs and /mask are not read. The rate is /data's env_args
//   (JSON) env_kwargs.control_freq when given, else 20 (robosuite's default).
// The files carry no timestamps: timestamp = frame / fps (float32), frame_index, episode_index and index are
// synthesised.
// Numeric features keep the file's dtype (float32 / float64; integers read as int64).
// libhdf5 (Debian's serial build) is not thread-safe: every call into it holds one process-wide mutex. Nor is it
// hardened against hostile files: what can be checked from outside is (check_storage, read sizes), but a corrupt group
// B-tree can still crash libhdf5 1.10.8 inside H5Gget_info (a NULL memcpy in H5F__accum_read; found by fuzzing).
#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <utility>

#include "loongforge/core/error.h"
#include "loongforge/data/robot/dataset.h"

#ifdef LF_HAVE_HDF5
#include <hdf5.h>

#include <nlohmann/json.hpp>

#include "loongforge/data/image/decode.h"
#endif

namespace lf::data::robot {

#ifndef LF_HAVE_HDF5

std::unique_ptr<RobotDataset> open_hdf5_dataset(const std::string& path, double) {
  throw Error(path + ": this build has no HDF5 support (install libhdf5-dev and rebuild)");
}

std::unique_ptr<RobotDataset> open_hdf5_dataset(const std::string& path) { return open_hdf5_dataset(path, 0.0); }

bool hdf5_available() { return false; }

#else

namespace {

namespace fs = std::filesystem;

std::mutex& hdf5_mutex() {
  static std::mutex m;
  return m;
}

// An hid_t closed by its close function when it goes out of scope.
struct Handle {
  hid_t id = H5I_INVALID_HID;
  herr_t (*close)(hid_t) = nullptr;
  Handle() = default;
  Handle(hid_t i, herr_t (*c)(hid_t)) : id(i), close(c) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& o) noexcept : id(o.id), close(o.close) { o.id = H5I_INVALID_HID; }
  ~Handle() {
    if (id >= 0 && close) close(id);
  }
  bool ok() const { return id >= 0; }
};

// One source dataset of a feature: its path under the episode's group and how it maps.
struct Source {
  std::string feature, path;
  bool compressed = false;  // a camera stored as JPEG bytes per frame
};

enum class Layout { aloha, robomimic };

// Where an episode lives: a file, and the group of its datasets ("" for ALOHA's one episode per file).
struct EpisodeRef {
  std::string file, group;
};

// Per-file errors: "FILE: episode E: field 'PATH': WHAT".
Error ep_error(const std::string& file, int64_t episode, const std::string& path, const std::string& what) {
  return file_error(file + ": episode " + std::to_string(episode), path, what);
}

Handle open_file(const std::string& file, int64_t episode) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  Handle f(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!f.ok()) throw ep_error(file, episode, "", "cannot open as HDF5 (not an HDF5 file, or truncated)");
  return f;
}

bool link_exists(hid_t file, const std::string& path) {
  // Every prefix must exist for H5Lexists to be safe.
  size_t pos = 0;
  while ((pos = path.find('/', pos + 1)) != std::string::npos)
    if (H5Lexists(file, path.substr(0, pos).c_str(), H5P_DEFAULT) <= 0) return false;
  return H5Lexists(file, path.c_str(), H5P_DEFAULT) > 0;
}

// The names of the links in group PATH (in name order).
std::vector<std::string> group_links(hid_t file, const std::string& fname, int64_t episode, const std::string& path) {
  Handle g(H5Gopen2(file, path.c_str(), H5P_DEFAULT), H5Gclose);
  if (!g.ok()) throw ep_error(fname, episode, path, "not a group");
  H5G_info_t ginfo;
  if (H5Gget_info(g.id, &ginfo) < 0) throw ep_error(fname, episode, path, "unreadable group");
  std::vector<std::string> names;
  for (hsize_t k = 0; k < ginfo.nlinks; ++k) {
    ssize_t n = H5Lget_name_by_idx(g.id, ".", H5_INDEX_NAME, H5_ITER_INC, k, nullptr, 0, H5P_DEFAULT);
    if (n < 0 || n > 4096) throw ep_error(fname, episode, path, "unreadable group");
    std::string s(static_cast<size_t>(n), '\0');
    H5Lget_name_by_idx(g.id, ".", H5_INDEX_NAME, H5_ITER_INC, k, s.data(), s.size() + 1, H5P_DEFAULT);
    names.push_back(s);
  }
  return names;
}

// Scalar attribute NAME of object PATH, opened and checked to hold one value of class CLS (nullopt when absent); a
// malformed one is an error naming path@name. h5py writes str as a variable-length UTF-8 string.
struct ScalarAttr {
  std::string field;
  Handle a, type;
};

std::optional<ScalarAttr> scalar_attr(hid_t file, const std::string& fname, int64_t episode, const std::string& path,
                                      const char* name, H5T_class_t cls) {
  if (H5Aexists_by_name(file, path.c_str(), name, H5P_DEFAULT) <= 0) return std::nullopt;
  const std::string field = path + "@" + name;
  Handle a(H5Aopen_by_name(file, path.c_str(), name, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  Handle s(a.ok() ? H5Aget_space(a.id) : H5I_INVALID_HID, H5Sclose);
  Handle t(a.ok() ? H5Aget_type(a.id) : H5I_INVALID_HID, H5Tclose);
  if (!s.ok() || !t.ok() || H5Sget_simple_extent_npoints(s.id) != 1 || H5Tget_class(t.id) != cls ||
      (H5Tis_variable_str(t.id) <= 0 && H5Aget_storage_size(a.id) < H5Tget_size(t.id)))
    throw ep_error(fname, episode, field, cls == H5T_INTEGER ? "not one integer" : "not one string");
  return ScalarAttr{field, std::move(a), std::move(t)};
}

std::optional<int64_t> int_attr(hid_t file, const std::string& fname, int64_t episode, const std::string& path,
                                const char* name) {
  auto attr = scalar_attr(file, fname, episode, path, name, H5T_INTEGER);
  if (!attr) return std::nullopt;
  int64_t v = 0;
  if (H5Aread(attr->a.id, H5T_NATIVE_INT64, &v) < 0) throw ep_error(fname, episode, attr->field, "unreadable");
  return v;
}

std::optional<std::string> string_attr(hid_t file, const std::string& fname, int64_t episode, const std::string& path,
                                       const char* name) {
  auto attr = scalar_attr(file, fname, episode, path, name, H5T_STRING);
  if (!attr) return std::nullopt;
  const hid_t t = attr->type.id;
  if (H5Tis_variable_str(t) > 0) {
    Handle mt(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mt.id, H5T_VARIABLE);
    H5Tset_cset(mt.id, H5Tget_cset(t));
    char* str = nullptr;
    if (H5Aread(attr->a.id, mt.id, &str) < 0 || !str) throw ep_error(fname, episode, attr->field, "unreadable");
    std::string out(str);
    H5free_memory(str);
    return out;
  }
  const size_t size = H5Tget_size(t);
  if (size == 0 || size > (size_t{1} << 24)) throw ep_error(fname, episode, attr->field, "unreadable string");
  std::string out(size, '\0');
  if (H5Aread(attr->a.id, t, out.data()) < 0) throw ep_error(fname, episode, attr->field, "unreadable");
  out.resize(std::strlen(out.c_str()));
  return out;
}

// Bounds on what a file may declare: a dimension (files are hostile: HDF5 keeps sizes as 64-bit unsigned), and the
// bytes one read takes (a whole episode of a numeric feature, or one camera frame).
constexpr hsize_t kMaxDim = hsize_t{1} << 40;
constexpr int64_t kMaxReadBytes = int64_t{1} << 30;

struct DatasetInfo {
  std::vector<int64_t> dims;
  H5T_class_t cls = H5T_NO_CLASS;
  size_t size = 0;
  bool is_signed = true;
};

// libhdf5 (1.10) trusts a dataset's storage records: compact data shorter than its dataspace, or an unfiltered chunk
// stored shorter than a chunk (a corrupt chunk index), make H5Dread copy past libhdf5's own buffer (found by the
// hdf5_episode fuzz target). Such datasets are refused when the file is opened, before any read.
void check_storage(hid_t d, hid_t space, hid_t type, const std::string& fname, int64_t episode,
                   const std::string& path) {
  Handle plist(H5Dget_create_plist(d), H5Pclose);
  if (!plist.ok()) throw ep_error(fname, episode, path, "unreadable storage layout (corrupt file)");
  const hsize_t size = H5Tget_size(type);
  const H5D_layout_t layout = H5Pget_layout(plist.id);
  if (layout == H5D_COMPACT) {
    const hssize_t points = H5Sget_simple_extent_npoints(space);
    const hsize_t stored = H5Dget_storage_size(d);
    if (points < 0 || size == 0 || stored / size < static_cast<hsize_t>(points))
      throw ep_error(fname, episode, path, "compact data of " + std::to_string(stored) + " bytes, less than its " +
                                               std::to_string(points) + " elements (corrupt file)");
  } else if (layout == H5D_CHUNKED && H5Pget_nfilters(plist.id) == 0) {
    const int rank = H5Pget_chunk(plist.id, 0, nullptr);
    std::vector<hsize_t> chunk(rank > 0 ? rank : 0);
    if (rank <= 0 || H5Pget_chunk(plist.id, rank, chunk.data()) < 0)
      throw ep_error(fname, episode, path, "unreadable chunk shape (corrupt file)");
    hsize_t want = size;
    for (hsize_t c : chunk) want = c == 0 || want <= (hsize_t{1} << 40) / c ? want * c : 0;
    hsize_t n = 0;
    if (H5Dget_num_chunks(d, space, &n) < 0) throw ep_error(fname, episode, path, "unreadable chunk index (corrupt file)");
    for (hsize_t i = 0; i < n; ++i) {
      unsigned mask = 0;
      haddr_t addr = 0;
      hsize_t stored = 0;
      if (H5Dget_chunk_info(d, space, i, nullptr, &mask, &addr, &stored) < 0 || stored != want)
        throw ep_error(fname, episode, path, "chunk " + std::to_string(i) + " stored in " + std::to_string(stored) +
                                                 " bytes, a chunk is " + std::to_string(want) + " (corrupt file)");
    }
  }
}

DatasetInfo dataset_info(hid_t file, const std::string& fname, int64_t episode, const std::string& path) {
  Handle d(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose);
  if (!d.ok()) throw ep_error(fname, episode, path, "not a dataset");
  Handle s(H5Dget_space(d.id), H5Sclose);
  Handle t(H5Dget_type(d.id), H5Tclose);
  if (!s.ok() || !t.ok()) throw ep_error(fname, episode, path, "unreadable dataset header (truncated file?)");
  DatasetInfo info;
  int rank = H5Sget_simple_extent_ndims(s.id);
  if (rank < 0) throw ep_error(fname, episode, path, "unreadable dataspace");
  std::vector<hsize_t> dims(rank);
  H5Sget_simple_extent_dims(s.id, dims.data(), nullptr);
  for (auto v : dims) {
    if (v > kMaxDim) throw ep_error(fname, episode, path, "dimension " + std::to_string(v) + " out of range");
    info.dims.push_back(static_cast<int64_t>(v));
  }
  check_storage(d.id, s.id, t.id, fname, episode, path);
  info.cls = H5Tget_class(t.id);
  info.size = H5Tget_size(t.id);
  if (info.cls == H5T_INTEGER) info.is_signed = H5Tget_sign(t.id) == H5T_SGN_2;
  return info;
}

std::string shape_str(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Reads rows [begin, end) of dataset PATH (rank >= 1) as DTYPE into a contiguous tensor [end - begin, rest...].
at::Tensor read_rows(hid_t file, const std::string& fname, int64_t episode, const std::string& path, int64_t begin,
                     int64_t end, at::ScalarType dtype) {
  Handle d(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose);
  if (!d.ok()) throw ep_error(fname, episode, path, "missing dataset");
  Handle s(H5Dget_space(d.id), H5Sclose);
  int rank = H5Sget_simple_extent_ndims(s.id);
  if (rank < 1) throw ep_error(fname, episode, path, "not an array");
  std::vector<hsize_t> dims(rank), start(rank, 0), count(rank);
  H5Sget_simple_extent_dims(s.id, dims.data(), nullptr);
  if (end > static_cast<int64_t>(dims[0]))
    throw ep_error(fname, episode, path, "has " + std::to_string(dims[0]) + " rows, row " + std::to_string(end - 1) +
                                             " was asked for");
  std::vector<int64_t> shape{end - begin};
  count[0] = end - begin;
  start[0] = begin;
  int64_t bytes = (end - begin) * static_cast<int64_t>(at::elementSize(dtype));
  for (int i = 1; i < rank; ++i) {
    if (dims[i] > kMaxDim) throw ep_error(fname, episode, path, "dimension " + std::to_string(dims[i]) + " out of range");
    count[i] = dims[i];
    shape.push_back(static_cast<int64_t>(dims[i]));
    bytes = dims[i] == 0 || bytes <= kMaxReadBytes / static_cast<int64_t>(dims[i]) ? bytes * static_cast<int64_t>(dims[i])
                                                                                   : kMaxReadBytes + 1;
  }
  if (bytes > kMaxReadBytes)
    throw ep_error(fname, episode, path, "reading rows [" + std::to_string(begin) + ", " + std::to_string(end) +
                                             ") as " + shape_str(shape) + " takes more than " +
                                             std::to_string(kMaxReadBytes) + " bytes (the most one read takes)");
  auto out = at::empty(shape, at::TensorOptions().dtype(dtype));
  if (end == begin) return out;
  H5Sselect_hyperslab(s.id, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
  Handle m(H5Screate_simple(rank, count.data(), nullptr), H5Sclose);
  hid_t mtype = dtype == at::kFloat    ? H5T_NATIVE_FLOAT
                : dtype == at::kDouble ? H5T_NATIVE_DOUBLE
                : dtype == at::kByte   ? H5T_NATIVE_UINT8
                                       : H5T_NATIVE_INT64;
  if (H5Dread(d.id, mtype, m.id, s.id, H5P_DEFAULT, out.data_ptr()) < 0)
    throw ep_error(fname, episode, path, "read failed (truncated or corrupt file)");
  return out;
}

class Hdf5Dataset final : public RobotDataset {
 public:
  // FPS <= 0: the layout's own rate (robomimic: env_args' control_freq, else 20; ALOHA: 50).
  Hdf5Dataset(std::string root, double fps) : root_(std::move(root)), fps_(fps) {
    if (std::isnan(fps_)) throw Error(root_ + ": fps must be positive (got nan)");
    std::lock_guard<std::mutex> lock(hdf5_mutex());
    list_episodes();
    for (size_t i = 0; i < refs_.size(); ++i) scan(i);
    if (fps_ <= 0) fps_ = layout_ == Layout::robomimic ? file_rate_ : 50.0;
  }

  std::string format() const override {
    return layout_ == Layout::robomimic ? "HDF5 (robomimic layout)" : "HDF5 (ALOHA layout)";
  }
  const std::string& root() const override { return root_; }
  double fps() const override { return fps_; }
  const std::vector<Feature>& features() const override { return features_; }
  const std::vector<Episode>& episodes() const override { return episodes_; }
  const std::vector<std::string>& tasks() const override { return tasks_; }
  const Stats& stats() const override { return stats_; }

  std::vector<at::Tensor> read_numeric(const std::vector<std::string>& names, int64_t episode, int64_t begin,
                                       int64_t end) const override {
    const Episode& ep = check_episode(episode);
    const EpisodeRef& ref = refs_[episode];
    if (begin < 0 || end < begin || end > ep.length)
      throw ep_error(ref.file, ep.index, ref.group,
                     "frames [" + std::to_string(begin) + ", " + std::to_string(end) + ") outside the episode's " +
                         std::to_string(ep.length) + " frames");
    std::vector<at::Tensor> out;
    std::unique_ptr<Handle> file;
    for (const auto& name : names) {
      const Feature& f = feature(name);
      if (f.kind != FeatureKind::numeric) throw file_error(root_, name, "not a numeric feature");
      auto frames = at::arange(begin, end, at::kLong);
      if (name == "timestamp") {
        out.push_back((frames.to(at::kDouble) / fps_).to(at::kFloat));
      } else if (name == "frame_index") {
        out.push_back(frames);
      } else if (name == "episode_index") {
        out.push_back(at::full({end - begin}, ep.index, at::kLong));
      } else if (name == "index") {
        out.push_back(frames + ep.from);
      } else {
        std::lock_guard<std::mutex> lock(hdf5_mutex());
        if (!file) file = std::make_unique<Handle>(open_file(ref.file, ep.index));
        out.push_back(read_rows(file->id, ref.file, ep.index, ref.group + source(name).path, begin, end, dtype_of(f)));
      }
    }
    return out;
  }

  at::Tensor read_camera(const std::string& camera, int64_t episode, const std::vector<int64_t>& frames,
                         double tolerance_s) const override {
    const Episode& ep = check_episode(episode);
    const Feature& f = feature(camera);
    if (f.kind != FeatureKind::image) throw file_error(root_, camera, "not a camera");
    const std::string path = refs_[episode].group + source(camera).path;
    const bool compressed = source(camera).compressed;
    const std::string& fname = refs_[episode].file;
    for (int64_t t : frames)
      if (t < 0 || t >= ep.length)
        throw ep_error(fname, ep.index, path,
                       "frame " + std::to_string(t) + " outside the episode's " + std::to_string(ep.length) + " frames");
    auto out = at::empty({static_cast<int64_t>(frames.size()), f.shape[0], f.shape[1], f.shape[2]}, at::kByte);
    std::lock_guard<std::mutex> lock(hdf5_mutex());
    Handle file = open_file(fname, ep.index);
    for (size_t i = 0; i < frames.size(); ++i) {
      auto row = read_rows(file.id, fname, ep.index, path, frames[i], frames[i] + 1, at::kByte)[0];
      if (compressed) {
        auto img = image::decode_image(row.data_ptr<uint8_t>(), static_cast<size_t>(row.numel()),
                                       fname + ": episode " + std::to_string(ep.index) + ": field '" + path +
                                           "' frame " + std::to_string(frames[i]));
        if (img.sizes() != out[i].sizes())
          throw ep_error(fname, ep.index, path,
                         "frame " + std::to_string(frames[i]) + " decodes to " + shape_str(img.sizes().vec()) +
                             ", the camera's frames are " + shape_str(f.shape));
        out[i].copy_(img);
      } else {
        out[i].copy_(row);
      }
    }
    return out;
  }

 private:
  static at::ScalarType dtype_of(const Feature& f) {
    if (f.dtype == "float32") return at::kFloat;
    if (f.dtype == "float64") return at::kDouble;
    return at::kLong;
  }

  const Episode& check_episode(int64_t episode) const {
    if (episode < 0 || episode >= static_cast<int64_t>(episodes_.size()))
      throw Error(root_ + ": no episode at position " + std::to_string(episode) + " (the dataset has " +
                  std::to_string(episodes_.size()) + ")");
    return episodes_[episode];
  }

  const Source& source(const std::string& name) const {
    for (const auto& s : sources_)
      if (s.feature == name) return s;
    throw file_error(root_, name, "no such feature");
  }

  // The trailing number of S (-1 when it has none, or one too long).
  static int64_t trailing_number(const std::string& s) {
    size_t k = s.size();
    while (k > 0 && std::isdigit(static_cast<unsigned char>(s[k - 1]))) --k;
    if (k == s.size() || s.size() - k > 15) return -1;
    return std::stoll(s.substr(k));
  }

  // The files (sorted by their episode_N number when every one has a distinct number, else by name), then each
  // file's episodes: the file itself (ALOHA) or its /data/demo_N groups (robomimic, in N's order).
  void list_episodes() {
    std::error_code ec;
    std::vector<std::string> files;
    std::vector<int64_t> file_numbers;  // ALOHA's episode_index of each file: its number, else its position
    if (fs::is_regular_file(root_, ec)) {
      files.push_back(root_);
      file_numbers.push_back(0);
    } else {
      std::vector<std::string> names;
      for (const auto& e : fs::directory_iterator(root_, ec)) {
        auto ext = e.path().extension().string();
        if (e.is_regular_file() && (ext == ".hdf5" || ext == ".h5")) names.push_back(e.path().filename().string());
      }
      if (ec) throw Error(root_ + ": cannot list the folder: " + ec.message());
      if (names.empty()) throw Error(root_ + ": no .hdf5 / .h5 files");
      auto number = [](const std::string& name) { return trailing_number(fs::path(name).stem().string()); };
      bool numbered = true;
      for (const auto& n : names) numbered = numbered && number(n) >= 0;
      if (numbered) {
        std::sort(names.begin(), names.end(), [&](const std::string& a, const std::string& b) {
          return std::make_pair(number(a), a) < std::make_pair(number(b), b);
        });
        for (size_t i = 1; i < names.size(); ++i)
          if (number(names[i]) == number(names[i - 1])) numbered = false;
      }
      if (!numbered) std::sort(names.begin(), names.end());
      for (size_t i = 0; i < names.size(); ++i) {
        files.push_back((fs::path(root_) / names[i]).string());
        file_numbers.push_back(numbered ? number(names[i]) : static_cast<int64_t>(i));
      }
    }
    // Episode numbers: the files' (ALOHA) or the demo_N groups' (robomimic), used when distinct.
    std::vector<int64_t> numbers;
    for (size_t i = 0; i < files.size(); ++i) {
      const std::string& fname = files[i];
      Handle file = open_file(fname, file_numbers[i]);
      std::vector<std::string> demos;
      if (link_exists(file.id, "/data") && Handle(H5Gopen2(file.id, "/data", H5P_DEFAULT), H5Gclose).ok())
        for (const auto& n : group_links(file.id, fname, 0, "/data"))
          if (n.size() > 5 && n.size() <= 20 && n.rfind("demo_", 0) == 0 &&
              n.find_first_not_of("0123456789", 5) == std::string::npos)
            demos.push_back(n);
      const Layout layout = demos.empty() ? Layout::aloha : Layout::robomimic;
      if (i > 0 && layout != layout_)
        throw file_error(fname, "/data", std::string("a ") + (layout == Layout::robomimic ? "robomimic" : "ALOHA") +
                                             " file among " + (layout_ == Layout::robomimic ? "robomimic" : "ALOHA") +
                                             " files (" + files[0] + ")");
      layout_ = layout;
      if (layout == Layout::aloha) {
        refs_.push_back(EpisodeRef{fname, ""});
        numbers.push_back(file_numbers[i]);
        continue;
      }
      std::sort(demos.begin(), demos.end(), [](const std::string& a, const std::string& b) {
        return trailing_number(a) < trailing_number(b);
      });
      for (const auto& d : demos) {
        refs_.push_back(EpisodeRef{fname, "/data/" + d});
        numbers.push_back(trailing_number(d));
      }
      if (i == 0) file_rate_ = control_freq(file.id, fname);
    }
    std::vector<int64_t> sorted = numbers;
    std::sort(sorted.begin(), sorted.end());
    bool distinct = std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end() &&
                    std::all_of(sorted.begin(), sorted.end(), [](int64_t n) { return n >= 0; });
    for (size_t i = 0; i < refs_.size(); ++i)
      episodes_.push_back(Episode{distinct ? numbers[i] : static_cast<int64_t>(i), 0, 0, {}});
  }

  // robomimic's rate: /data@env_args (JSON) env_kwargs.control_freq, else robosuite's default 20.
  static double control_freq(hid_t file, const std::string& fname) {
    auto args = string_attr(file, fname, 0, "/data", "env_args");
    if (!args) return 20.0;
    nlohmann::json j = nlohmann::json::parse(*args, nullptr, false);
    if (j.is_discarded() || !j.is_object()) throw file_error(fname, "/data@env_args", "not a JSON object");
    auto kw = j.find("env_kwargs");
    if (kw == j.end() || !kw->is_object() || !kw->contains("control_freq")) return 20.0;
    const auto& f = (*kw)["control_freq"];
    if (!f.is_number() || !(f.get<double>() > 0))
      throw file_error(fname, "/data@env_args", "env_kwargs.control_freq is not a positive number");
    return f.get<double>();
  }

  // Reads episode I's layout: the first episode defines the features, the others must match.
  void scan(size_t i) {
    const std::string& fname = refs_[i].file;
    const std::string& group = refs_[i].group;
    Episode& ep = episodes_[i];
    Handle file = open_file(fname, ep.index);
    std::vector<Feature> feats;
    std::vector<Source> srcs;
    int64_t length = -1;
    std::string length_from;
    auto check_length = [&](const std::string& path, int64_t t) {
      if (length < 0) {
        length = t;
        length_from = path;
      } else if (t != length) {
        throw ep_error(fname, ep.index, path,
                       std::to_string(t) + " frames, but " + length_from + " has " + std::to_string(length));
      }
    };
    const bool robomimic = layout_ == Layout::robomimic;
    // REL: the dataset's path under the episode's group; MAX_RANK: 2 ([frames, dims]), or more for robomimic's
    // per-frame arrays.
    auto numeric = [&](const std::string& rel, const std::string& name, bool required, size_t max_rank = 2) {
      const std::string path = group + rel;
      if (!link_exists(file.id, path)) {
        if (required)
          throw ep_error(fname, ep.index, path,
                         std::string("missing (the ") + (robomimic ? "robomimic" : "ALOHA") + " layout needs it)");
        return;
      }
      auto info = dataset_info(file.id, fname, ep.index, path);
      if (info.dims.empty() || info.dims.size() > max_rank)
        throw ep_error(fname, ep.index, path, "rank " + std::to_string(info.dims.size()) + " " + shape_str(info.dims) +
                                                  ", expected [frames, dims] or [frames]");
      Feature f;
      f.name = name;
      if (info.cls == H5T_FLOAT && (info.size == 4 || info.size == 8))
        f.dtype = info.size == 4 ? "float32" : "float64";
      else if (info.cls == H5T_INTEGER || info.cls == H5T_ENUM)  // h5py stores bool as an enum over int8
        f.dtype = "int64";
      else
        throw ep_error(fname, ep.index, path, "not a float or integer array");
      f.shape.assign(info.dims.begin() + 1, info.dims.end());
      check_length(path, info.dims[0]);
      feats.push_back(f);
      srcs.push_back(Source{name, rel, false});
    };
    // A camera: uint8 [T, H, W, C] (or ALOHA's JPEG rows [T, bytes] when COMPRESS).
    auto camera = [&](const std::string& rel, const std::string& name) {
      const std::string path = group + rel;
      auto info = dataset_info(file.id, fname, ep.index, path);
      Feature f;
      f.name = name;
      f.kind = FeatureKind::image;
      f.dtype = "image";
      f.names = {"height", "width", "channels"};
      Source src{f.name, rel, false};
      if (info.dims.size() == 4) {
        f.shape = {info.dims[1], info.dims[2], info.dims[3]};
      } else {
        // JPEG bytes per frame (ALOHA's compress = true): the first frame gives the size.
        src.compressed = true;
        if (info.dims[0] == 0) throw ep_error(fname, ep.index, path, "no frames");
        auto row = read_rows(file.id, fname, ep.index, path, 0, 1, at::kByte)[0];
        auto img = image::decode_image(row.data_ptr<uint8_t>(), static_cast<size_t>(row.numel()),
                                       fname + ": episode " + std::to_string(ep.index) + ": field '" + path +
                                           "' frame 0");
        f.shape = img.sizes().vec();
      }
      check_length(path, info.dims[0]);
      feats.push_back(f);
      srcs.push_back(src);
    };
    using Synth = std::pair<const char*, const char*>;
    auto synthesised = [&] {
      for (auto [name, dtype] : std::initializer_list<Synth>{
               {"timestamp", "float32"}, {"frame_index", "int64"}, {"episode_index", "int64"}, {"index", "int64"}}) {
        Feature f;
        f.name = name;
        f.dtype = dtype;
        feats.push_back(f);
      }
    };
    if (robomimic) {
      // obs keys in name order: uint8 [T, H, W, 1 | 3] are cameras (after the numeric features), the rest numeric.
      std::vector<std::string> cams;
      if (link_exists(file.id, group + "/obs"))
        for (const auto& key : group_links(file.id, fname, ep.index, group + "/obs")) {
          auto info = dataset_info(file.id, fname, ep.index, group + "/obs/" + key);
          if (info.cls == H5T_INTEGER && info.size == 1 && !info.is_signed && info.dims.size() == 4 &&
              (info.dims[3] == 1 || info.dims[3] == 3))
            cams.push_back(key);
          else
            numeric("/obs/" + key, "observation." + key, true, 4);
        }
      numeric("/states", "observation.environment_state", false);
      numeric("/actions", "action", true);
      numeric("/rewards", "next.reward", false, 1);
      numeric("/dones", "next.done", false, 1);
      synthesised();
      for (const auto& key : cams) camera("/obs/" + key, "observation.images." + key);
      if (auto n = int_attr(file.id, fname, ep.index, group, "num_samples"); n && *n != length)
        throw ep_error(fname, ep.index, group + "@num_samples",
                       std::to_string(*n) + ", but " + length_from + " has " + std::to_string(length) + " frames");
    } else {
      numeric("/observations/qpos", "observation.state", true);
      numeric("/observations/qvel", "observation.velocity", false);
      numeric("/observations/effort", "observation.effort", false);
      numeric("/action", "action", true);
      synthesised();
      bool compress = root_attr_true(file.id, "compress");
      if (link_exists(file.id, "/observations/images")) {
        for (const auto& cam : group_links(file.id, fname, ep.index, "/observations/images")) {
          std::string path = "/observations/images/" + cam;
          auto info = dataset_info(file.id, fname, ep.index, path);
          if (info.cls != H5T_INTEGER || info.size != 1)
            throw ep_error(fname, ep.index, path, "camera frames must be uint8");
          if (info.dims.size() == 4) {
            if (info.dims[3] != 3 && info.dims[3] != 1)
              throw ep_error(fname, ep.index, path, "shape " + shape_str(info.dims) + ": expected [frames, H, W, 3]");
          } else if (!(info.dims.size() == 2 && (compress || info.dims[1] > 0))) {
            throw ep_error(fname, ep.index, path,
                           "rank " + std::to_string(info.dims.size()) + " " + shape_str(info.dims) +
                               ", expected uint8 [frames, H, W, 3] (or [frames, bytes] of JPEG with compress = true)");
          }
          camera(path, "observation.images." + cam);
        }
      }
    }
    if (length < 0) throw ep_error(fname, ep.index, group, "no arrays");
    ep.length = length;
    ep.from = i == 0 ? 0 : episodes_[i - 1].from + episodes_[i - 1].length;
    if (i == 0) {
      features_ = std::move(feats);
      sources_ = std::move(srcs);
      return;
    }
    // Later episodes: the same features with the same shapes and dtypes.
    auto describe = [](const std::vector<Feature>& fs) {
      std::string s;
      for (const auto& f : fs) s += (s.empty() ? "" : ", ") + f.name + " " + f.dtype + shape_str(f.shape);
      return s;
    };
    bool same = feats.size() == features_.size();
    for (size_t k = 0; same && k < feats.size(); ++k)
      same = feats[k].name == features_[k].name && feats[k].dtype == features_[k].dtype &&
             feats[k].shape == features_[k].shape;
    for (size_t k = 0; same && k < srcs.size(); ++k) same = srcs[k].compressed == sources_[k].compressed;
    if (!same)
      throw ep_error(fname, ep.index, group, "features (" + describe(feats) + ") differ from " + refs_[0].file +
                                                 (refs_[0].group.empty() ? "" : " " + refs_[0].group) + "'s (" +
                                                 describe(features_) + ")");
  }

  static bool root_attr_true(hid_t file, const char* name) {
    if (H5Aexists(file, name) <= 0) return false;
    Handle a(H5Aopen(file, name, H5P_DEFAULT), H5Aclose);
    if (!a.ok()) return false;
    Handle s(H5Aget_space(a.id), H5Sclose);
    if (H5Sget_simple_extent_npoints(s.id) != 1) return false;
    // h5py writes a bool as an enum over int8: read the value in its own (native) type, true when not all zero.
    Handle t(H5Aget_type(a.id), H5Tclose);
    if (!t.ok() || H5Aget_storage_size(a.id) < H5Tget_size(t.id)) return false;  // stored short: corrupt
    Handle nt(H5Tget_native_type(t.id, H5T_DIR_ASCEND), H5Tclose);
    if (!nt.ok()) return false;
    std::vector<unsigned char> v(H5Tget_size(nt.id) + 8, 0);
    if (H5Aread(a.id, nt.id, v.data()) < 0) return false;
    return std::any_of(v.begin(), v.end(), [](unsigned char c) { return c != 0; });
  }

  std::string root_;
  double fps_;
  Layout layout_ = Layout::aloha;
  double file_rate_ = 20.0;  // robomimic's control_freq
  std::vector<EpisodeRef> refs_;  // per episode
  std::vector<Episode> episodes_;
  std::vector<Feature> features_;
  std::vector<Source> sources_;
  std::vector<std::string> tasks_;
  Stats stats_;
};

}  // namespace

std::unique_ptr<RobotDataset> open_hdf5_dataset(const std::string& path, double fps) {
  if (!(fps > 0)) throw Error(path + ": fps must be positive (got " + std::to_string(fps) + ")");
  return std::make_unique<Hdf5Dataset>(path, fps);
}

std::unique_ptr<RobotDataset> open_hdf5_dataset(const std::string& path) {
  return std::make_unique<Hdf5Dataset>(path, 0.0);
}

bool hdf5_available() { return true; }

#endif

}  // namespace lf::data::robot
