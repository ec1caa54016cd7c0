// HDF5 episode files in ALOHA's layout (dataset.h), through libhdf5's C API. One file per episode (episode_N.hdf5:
// N is the episode_index when every file is so numbered, else the files' sorted position), or a single file:
//   /observations/qpos   [T, D]          -> observation.state
//   /observations/qvel   [T, D] (opt.)   -> observation.velocity
//   /observations/effort [T, D] (opt.)   -> observation.effort
//   /action              [T, A]          -> action
//   /observations/images/<cam> uint8 [T, H, W, C] -> observation.images.<cam> (an image feature), or, in ALOHA's
//       compressed files (root attribute compress = true), uint8 [T, N]: each row one JPEG padded with zeros.
// The files carry no rate: timestamp = frame / fps (float32), frame_index, episode_index and index are synthesised.
// Numeric features keep the file's dtype (float32 / float64; integers read as int64).
// libhdf5 (Debian's serial build) is not thread-safe: every call into it holds one process-wide mutex. Nor is it
// hardened against hostile files: what can be checked from outside is (check_storage, read sizes), but a corrupt group
// B-tree can still crash libhdf5 1.10.8 inside H5Gget_info (a NULL memcpy in H5F__accum_read; found by fuzzing).
#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <initializer_list>
#include <utility>
#include <mutex>

#include "loongforge/core/error.h"
#include "loongforge/data/robot/dataset.h"

#ifdef LF_HAVE_HDF5
#include <hdf5.h>

#include "loongforge/data/image/decode.h"
#endif

namespace lf::data::robot {

#ifndef LF_HAVE_HDF5

std::unique_ptr<RobotDataset> open_hdf5_dataset(const std::string& path, double fps) {
  throw Error(path + ": this build has no HDF5 support (install libhdf5-dev and rebuild)");
}

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

// One source dataset of a feature: its path in the file and how it maps.
struct Source {
  std::string feature, path;
  bool compressed = false;  // a camera stored as JPEG bytes per frame
};

struct EpisodeFile {
  std::string file;
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
  Hdf5Dataset(std::string root, double fps) : root_(std::move(root)), fps_(fps) {
    if (!(fps_ > 0)) throw Error(root_ + ": fps must be positive (got " + std::to_string(fps_) + ")");
    std::lock_guard<std::mutex> lock(hdf5_mutex());
    list_files();
    for (size_t i = 0; i < files_.size(); ++i) scan(i);
  }

  std::string format() const override { return "HDF5 (ALOHA layout)"; }
  const std::string& root() const override { return root_; }
  double fps() const override { return fps_; }
  const std::vector<Feature>& features() const override { return features_; }
  const std::vector<Episode>& episodes() const override { return episodes_; }
  const std::vector<std::string>& tasks() const override { return tasks_; }
  const Stats& stats() const override { return stats_; }

  std::vector<at::Tensor> read_numeric(const std::vector<std::string>& names, int64_t episode, int64_t begin,
                                       int64_t end) const override {
    const Episode& ep = check_episode(episode);
    if (begin < 0 || end < begin || end > ep.length)
      throw ep_error(files_[episode], ep.index, "",
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
        if (!file) file = std::make_unique<Handle>(open_file(files_[episode], ep.index));
        out.push_back(read_rows(file->id, files_[episode], ep.index, source(name).path, begin, end, dtype_of(f)));
      }
    }
    return out;
  }

  at::Tensor read_camera(const std::string& camera, int64_t episode, const std::vector<int64_t>& frames,
                         double tolerance_s) const override {
    const Episode& ep = check_episode(episode);
    const Feature& f = feature(camera);
    if (f.kind != FeatureKind::image) throw file_error(root_, camera, "not a camera");
    const Source& src = source(camera);
    const std::string& fname = files_[episode];
    for (int64_t t : frames)
      if (t < 0 || t >= ep.length)
        throw ep_error(fname, ep.index, src.path,
                       "frame " + std::to_string(t) + " outside the episode's " + std::to_string(ep.length) + " frames");
    auto out = at::empty({static_cast<int64_t>(frames.size()), f.shape[0], f.shape[1], f.shape[2]}, at::kByte);
    std::lock_guard<std::mutex> lock(hdf5_mutex());
    Handle file = open_file(fname, ep.index);
    for (size_t i = 0; i < frames.size(); ++i) {
      auto row = read_rows(file.id, fname, ep.index, src.path, frames[i], frames[i] + 1, at::kByte)[0];
      if (src.compressed) {
        auto img = image::decode_image(row.data_ptr<uint8_t>(), static_cast<size_t>(row.numel()),
                                       fname + ": episode " + std::to_string(ep.index) + ": field '" + src.path +
                                           "' frame " + std::to_string(frames[i]));
        if (img.sizes() != out[i].sizes())
          throw ep_error(fname, ep.index, src.path,
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

  void list_files() {
    std::error_code ec;
    if (fs::is_regular_file(root_, ec)) {
      files_.push_back(root_);
      episodes_.push_back(Episode{0, 0, 0, {}});
      return;
    }
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(root_, ec)) {
      auto ext = e.path().extension().string();
      if (e.is_regular_file() && (ext == ".hdf5" || ext == ".h5")) names.push_back(e.path().filename().string());
    }
    if (ec) throw Error(root_ + ": cannot list the folder: " + ec.message());
    if (names.empty()) throw Error(root_ + ": no .hdf5 / .h5 files");
    // episode_N: the trailing number of the stem; every file numbered (and distinct) -> those are the indices.
    auto number = [](const std::string& name) -> int64_t {
      std::string stem = fs::path(name).stem().string();
      size_t k = stem.size();
      while (k > 0 && std::isdigit(static_cast<unsigned char>(stem[k - 1]))) --k;
      if (k == stem.size() || stem.size() - k > 15) return -1;
      return std::stoll(stem.substr(k));
    };
    bool numbered = true;
    for (const auto& n : names) numbered = numbered && number(n) >= 0;
    if (numbered) {
      std::sort(names.begin(), names.end(),
                [&](const std::string& a, const std::string& b) { return std::make_pair(number(a), a) < std::make_pair(number(b), b); });
      for (size_t i = 1; i < names.size(); ++i)
        if (number(names[i]) == number(names[i - 1])) numbered = false;
    }
    if (!numbered) std::sort(names.begin(), names.end());
    for (size_t i = 0; i < names.size(); ++i) {
      files_.push_back((fs::path(root_) / names[i]).string());
      episodes_.push_back(Episode{numbered ? number(names[i]) : static_cast<int64_t>(i), 0, 0, {}});
    }
  }

  // Reads file I's layout: the first file defines the features, the others must match.
  void scan(size_t i) {
    const std::string& fname = files_[i];
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
    auto numeric = [&](const std::string& path, const std::string& name, bool required) {
      if (!link_exists(file.id, path)) {
        if (required) throw ep_error(fname, ep.index, path, "missing (the ALOHA layout needs it)");
        return;
      }
      auto info = dataset_info(file.id, fname, ep.index, path);
      if (info.dims.size() != 1 && info.dims.size() != 2)
        throw ep_error(fname, ep.index, path, "rank " + std::to_string(info.dims.size()) + " " + shape_str(info.dims) +
                                                  ", expected [frames, dims] or [frames]");
      Feature f;
      f.name = name;
      if (info.cls == H5T_FLOAT && (info.size == 4 || info.size == 8))
        f.dtype = info.size == 4 ? "float32" : "float64";
      else if (info.cls == H5T_INTEGER)
        f.dtype = "int64";
      else
        throw ep_error(fname, ep.index, path, "not a float or integer array");
      if (info.dims.size() == 2) f.shape = {info.dims[1]};
      check_length(path, info.dims[0]);
      feats.push_back(f);
      srcs.push_back(Source{name, path, false});
    };
    numeric("/observations/qpos", "observation.state", true);
    numeric("/observations/qvel", "observation.velocity", false);
    numeric("/observations/effort", "observation.effort", false);
    numeric("/action", "action", true);
    using Synth = std::pair<const char*, const char*>;
    for (auto [name, dtype] : std::initializer_list<Synth>{
             {"timestamp", "float32"}, {"frame_index", "int64"}, {"episode_index", "int64"}, {"index", "int64"}}) {
      Feature f;
      f.name = name;
      f.dtype = dtype;
      feats.push_back(f);
    }
    bool compress = root_attr_true(file.id, "compress");
    if (link_exists(file.id, "/observations/images")) {
      Handle g(H5Gopen2(file.id, "/observations/images", H5P_DEFAULT), H5Gclose);
      if (!g.ok()) throw ep_error(fname, ep.index, "/observations/images", "not a group");
      H5G_info_t ginfo;
      if (H5Gget_info(g.id, &ginfo) < 0) throw ep_error(fname, ep.index, "/observations/images", "unreadable group");
      std::vector<std::string> cams;
      for (hsize_t k = 0; k < ginfo.nlinks; ++k) {
        ssize_t n = H5Lget_name_by_idx(g.id, ".", H5_INDEX_NAME, H5_ITER_INC, k, nullptr, 0, H5P_DEFAULT);
        if (n < 0) throw ep_error(fname, ep.index, "/observations/images", "unreadable group");
        std::string s(static_cast<size_t>(n), '\0');
        H5Lget_name_by_idx(g.id, ".", H5_INDEX_NAME, H5_ITER_INC, k, s.data(), s.size() + 1, H5P_DEFAULT);
        cams.push_back(s);
      }
      for (const auto& cam : cams) {
        std::string path = "/observations/images/" + cam;
        auto info = dataset_info(file.id, fname, ep.index, path);
        if (info.cls != H5T_INTEGER || info.size != 1)
          throw ep_error(fname, ep.index, path, "camera frames must be uint8");
        Feature f;
        f.name = "observation.images." + cam;
        f.kind = FeatureKind::image;
        f.dtype = "image";
        f.names = {"height", "width", "channels"};
        Source src{f.name, path, false};
        if (info.dims.size() == 4) {
          if (info.dims[3] != 3 && info.dims[3] != 1)
            throw ep_error(fname, ep.index, path, "shape " + shape_str(info.dims) + ": expected [frames, H, W, 3]");
          f.shape = {info.dims[1], info.dims[2], info.dims[3]};
        } else if (info.dims.size() == 2 && (compress || info.dims[1] > 0)) {
          // JPEG bytes per frame (ALOHA's compress = true): the first frame gives the size.
          src.compressed = true;
          if (info.dims[0] == 0) throw ep_error(fname, ep.index, path, "no frames");
          auto row = read_rows(file.id, fname, ep.index, path, 0, 1, at::kByte)[0];
          auto img = image::decode_image(row.data_ptr<uint8_t>(), static_cast<size_t>(row.numel()),
                                         fname + ": episode " + std::to_string(ep.index) + ": field '" + path +
                                             "' frame 0");
          f.shape = img.sizes().vec();
        } else {
          throw ep_error(fname, ep.index, path,
                         "rank " + std::to_string(info.dims.size()) + " " + shape_str(info.dims) +
                             ", expected uint8 [frames, H, W, 3] (or [frames, bytes] of JPEG with compress = true)");
        }
        check_length(path, info.dims[0]);
        feats.push_back(f);
        srcs.push_back(src);
      }
    }
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
      throw ep_error(fname, ep.index, "", "features (" + describe(feats) + ") differ from " + files_[0] + "'s (" +
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
  std::vector<std::string> files_;
  std::vector<Episode> episodes_;
  std::vector<Feature> features_;
  std::vector<Source> sources_;
  std::vector<std::string> tasks_;
  Stats stats_;
};

}  // namespace

std::unique_ptr<RobotDataset> open_hdf5_dataset(const std::string& path, double fps) {
  return std::make_unique<Hdf5Dataset>(path, fps);
}

bool hdf5_available() { return true; }

#endif

std::unique_ptr<RobotDataset> open_hdf5_dataset(const std::string& path) { return open_hdf5_dataset(path, 50.0); }

}  // namespace lf::data::robot
