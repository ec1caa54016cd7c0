// LeRobotDataset folders (dataset.h), codebase v3.0 and v2.1.
//
// v3.0: meta/info.json (fps, features, data_path / video_path templates), meta/stats.json, meta/tasks.parquet
// (task_index, task), meta/episodes/chunk-*/file-*.parquet (one row per episode: length, dataset_from_index,
// data/chunk_index + data/file_index, videos/<camera>/chunk_index, file_index, from_timestamp, tasks); frames in
// data/chunk-*/file-*.parquet, many episodes per file (rows in "index" order); each camera's video in
// videos/<camera>/chunk-*/file-*.mp4, episodes end to end (an episode's frame at timestamp t is the video's frame at
// from_timestamp + t).
// v2.1: meta/info.json, episodes.jsonl (episode_index, tasks, length), tasks.jsonl (task_index, task),
// episodes_stats.jsonl (per-episode stats, aggregated into dataset stats as LeRobot's aggregate_stats does when there
// is no stats.json); one data/chunk-XXX/episode_XXXXXX.parquet and one videos/chunk-XXX/<camera>/episode_XXXXXX.mp4
// per episode.
#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <list>
#include <set>
#include <tuple>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/image/decode.h"
#include "loongforge/data/parquet.h"
#include "loongforge/data/robot/dataset.h"
#include "loongforge/data/robot/video_frames.h"

namespace lf::data::robot {

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

std::string join(const std::string& root, const std::string& rel) { return (fs::path(root) / rel).string(); }

// Python's str.format for the placeholders LeRobot's path templates use: {name} and {name:0Nd}.
std::string format_template(const std::string& tmpl, const std::map<std::string, std::string>& strings,
                            const std::map<std::string, int64_t>& ints, const std::string& file,
                            const std::string& field) {
  std::string out;
  size_t i = 0;
  while (i < tmpl.size()) {
    const char c = tmpl[i];
    if (c != '{') {
      out += c;
      ++i;
      continue;
    }
    const size_t close = tmpl.find('}', i);
    if (close == std::string::npos) throw file_error(file, field, "unclosed '{' in '" + tmpl + "'");
    const std::string spec = tmpl.substr(i + 1, close - i - 1);
    const size_t colon = spec.find(':');
    const std::string name = spec.substr(0, colon);
    const std::string fmt = colon == std::string::npos ? "" : spec.substr(colon + 1);
    if (auto s = strings.find(name); s != strings.end()) {
      out += s->second;
    } else if (auto n = ints.find(name); n != ints.end()) {
      std::string digits = std::to_string(n->second);
      if (!fmt.empty()) {
        if (fmt.back() != 'd') throw file_error(file, field, "unsupported format '{" + spec + "}' in '" + tmpl + "'");
        const bool zero = fmt[0] == '0';
        const size_t width = std::stoul("0" + fmt.substr(0, fmt.size() - 1));
        if (digits.size() < width) digits.insert(0, width - digits.size(), zero ? '0' : ' ');
      }
      out += digits;
    } else {
      throw file_error(file, field, "unknown placeholder '{" + name + "}' in '" + tmpl + "'");
    }
    i = close + 1;
  }
  return out;
}

// A data or video file of the dataset at ROOT: TMPL formatted (format_template), which must stay inside the folder
// (neither absolute nor through "..": info.json's templates and feature names are the dataset's, not trusted).
std::string dataset_file(const std::string& root, const std::string& tmpl,
                         const std::map<std::string, std::string>& strings, const std::map<std::string, int64_t>& ints,
                         const std::string& file, const std::string& field) {
  const std::string rel = format_template(tmpl, strings, ints, file, field);
  const fs::path p(rel);
  bool outside = p.has_root_path();
  for (const auto& part : p) outside = outside || part == "..";
  if (outside) throw file_error(file, field, "'" + rel + "' leads outside the dataset folder");
  return join(root, rel);
}

// A JSON number / nested list of numbers as a float64 tensor of the nesting's shape.
at::Tensor json_tensor(const ojson& j, const std::string& file, const std::string& field) {
  std::vector<int64_t> shape;
  const ojson* p = &j;
  while (p->is_array()) {
    shape.push_back(static_cast<int64_t>(p->size()));
    if (p->empty()) break;
    p = &(*p)[0];
  }
  std::vector<double> values;
  std::function<void(const ojson&, size_t)> walk = [&](const ojson& x, size_t depth) {
    if (depth == shape.size()) {
      if (!x.is_number()) throw file_error(file, field, "expected numbers, got " + x.dump());
      values.push_back(x.get<double>());
      return;
    }
    if (!x.is_array() || static_cast<int64_t>(x.size()) != shape[depth])
      throw file_error(file, field, "a ragged list (expected " + std::to_string(shape[depth]) + " values at depth " +
                                        std::to_string(depth) + ")");
    for (const auto& y : x) walk(y, depth + 1);
  };
  walk(j, 0);
  return at::tensor(values, at::kDouble).reshape(shape).clone();
}

Stats stats_from_json(const ojson& j, const std::string& file, const std::string& where) {
  Stats out;
  if (!j.is_object()) throw file_error(file, where, "expected an object of features");
  for (const auto& [feature, per] : j.items()) {
    if (!per.is_object()) throw file_error(file, where + feature, "expected an object of statistics");
    for (const auto& [stat, value] : per.items())
      out[feature][stat] = json_tensor(value, file, where + feature + "." + stat);
  }
  return out;
}

// LeRobot's aggregate_stats: count-weighted means (and quantiles), the parallel variance, min of mins, max of maxes.
Stats aggregate_stats(const std::vector<Stats>& per_episode, const std::string& file) {
  std::set<std::string> keys;
  for (const auto& s : per_episode)
    for (const auto& [k, v] : s) keys.insert(k);
  Stats out;
  for (const auto& key : keys) {
    std::vector<const std::map<std::string, at::Tensor>*> list;
    for (const auto& s : per_episode)
      if (auto it = s.find(key); it != s.end()) list.push_back(&it->second);
    auto stack = [&](const std::string& stat) {
      std::vector<at::Tensor> ts;
      for (const auto* m : list) {
        auto it = m->find(stat);
        if (it == m->end()) throw file_error(file, key + "." + stat, "missing in an episode's stats");
        ts.push_back(it->second);
      }
      try {
        return at::stack(ts);
      } catch (const std::exception&) {
        throw file_error(file, key + "." + stat, "the episodes' shapes differ");
      }
    };
    at::Tensor means = stack("mean"), variances = stack("std").pow(2), counts = stack("count");
    at::Tensor total = counts.sum(0);
    while (counts.dim() < means.dim()) counts = counts.unsqueeze(-1);
    at::Tensor mean = (means * counts).sum(0) / total;
    at::Tensor var = ((variances + (means - mean).pow(2)) * counts).sum(0) / total;
    auto& o = out[key];
    o["min"] = std::get<0>(stack("min").min(0));
    o["max"] = std::get<0>(stack("max").max(0));
    o["mean"] = mean;
    o["std"] = var.sqrt();
    o["count"] = total;
    for (const auto& [stat, v] : *list.front()) {
      if (stat.size() < 2 || stat[0] != 'q' ||
          !std::all_of(stat.begin() + 1, stat.end(), [](char c) { return c >= '0' && c <= '9'; }))
        continue;
      bool all = true;
      for (const auto* m : list) all = all && m->count(stat);
      if (all) o[stat] = (stack(stat) * counts).sum(0) / total;
    }
  }
  return out;
}

ojson read_ordered_json(const std::string& path) {
  const std::string text = read_text_file(path);
  try {
    return ojson::parse(text);
  } catch (const std::exception& e) {
    throw Error(path + ": not valid JSON: " + e.what());
  }
}

// JSON Lines: one object per non-empty line.
std::vector<ojson> read_jsonl(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) throw Error(path + ": no such file");
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot read");
  std::vector<ojson> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      out.push_back(ojson::parse(line));
    } catch (const std::exception& e) {
      throw Error(path + ": line " + std::to_string(n) + ": not valid JSON: " + e.what());
    }
    if (!out.back().is_object()) throw Error(path + ": line " + std::to_string(n) + ": expected a JSON object");
  }
  return out;
}

int64_t json_int(const ojson& j, const std::string& key, const std::string& file, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) throw file_error(file, where + key, "missing");
  if (!it->is_number_integer()) throw file_error(file, where + key, "expected an integer, got " + it->dump());
  return it->get<int64_t>();
}

// LeRobot's depth marker and quantiser settings in a camera's info (is_depth_map, or the legacy video.is_depth_map;
// video.depth_min / depth_max / shift / use_log, LeRobot's defaults when absent; depth_unit).
std::optional<DepthMap> depth_map(const ojson& info, const std::string& file, const std::string& field) {
  auto flag = [&](const char* key) {
    auto it = info.find(key);
    return it != info.end() && it->is_boolean() && it->get<bool>();
  };
  if (!flag("is_depth_map") && !flag("video.is_depth_map")) return std::nullopt;
  DepthMap d;
  auto number = [&](const char* key, double& out) {
    auto it = info.find(key);
    if (it == info.end() || it->is_null()) return;
    if (!it->is_number()) throw file_error(file, field + "." + key, "expected a number");
    out = it->get<double>();
  };
  number("video.depth_min", d.depth_min);
  number("video.depth_max", d.depth_max);
  number("video.shift", d.shift);
  if (auto it = info.find("video.use_log"); it != info.end() && !it->is_null()) {
    if (!it->is_boolean()) throw file_error(file, field + ".video.use_log", "expected true or false");
    d.use_log = it->get<bool>();
  }
  if (auto it = info.find("depth_unit"); it != info.end() && !it->is_null()) {
    if (!it->is_string() || (*it != "mm" && *it != "m"))
      throw file_error(file, field + ".depth_unit", "expected \"mm\" or \"m\"");
    d.unit = it->get<std::string>();
  }
  if (!(d.depth_max > d.depth_min)) throw file_error(file, field + ".video.depth_max", "must exceed video.depth_min");
  if (d.use_log && !(d.depth_min + d.shift > 0))
    throw file_error(file, field + ".video.shift", "depth_min + shift must be positive for logarithmic quantisation");
  return d;
}

// A depth video's 12-bit codes (int16 [n, H, W, 1]) -> millimetres (float32), as LeRobot's dequantize_depth (its
// torch path, output unit mm) computes each item: frame by frame, the same float32 operations in the same order.
at::Tensor dequantize_depth(const at::Tensor& codes, const DepthMap& d) {
  constexpr double qmax = 4095.0;  // LeRobot's DEPTH_QMAX (12 bits)
  double scale, offset;
  if (d.use_log) {
    const double log_min = std::log(d.depth_min + d.shift), log_max = std::log(d.depth_max + d.shift);
    scale = (log_max - log_min) / qmax;
    offset = log_min;
  } else {
    scale = (d.depth_max - d.depth_min) / qmax;
    offset = d.depth_min;
  }
  at::Tensor out = at::empty(codes.sizes(), at::kFloat);
  for (int64_t i = 0; i < codes.size(0); ++i) {
    at::Tensor buf = codes[i].to(at::kFloat, false, true);
    buf.mul_(scale).add_(offset);
    if (d.use_log) buf.exp_().sub_(d.shift);
    buf.clamp_(d.depth_min, d.depth_max);
    buf.mul_(1000.0).round_().clamp_(0.0, 65535.0);
    out[i].copy_(buf);
  }
  return out;
}

std::vector<std::string> string_list(const ojson& j) {
  std::vector<std::string> out;
  if (j.is_array()) {
    for (const auto& x : j)
      if (x.is_string()) out.push_back(x.get<std::string>());
  } else if (j.is_object()) {  // older datasets: {"motors": [...]}
    for (const auto& [k, v] : j.items())
      if (v.is_array()) return string_list(v);
  }
  return out;
}

struct EpisodeFiles {
  std::string data;                           // the episode's Parquet file
  int64_t row = 0;                            // its first row there
  std::map<std::string, std::string> videos;  // camera -> mp4
  std::map<std::string, double> video_from;   // camera -> from_timestamp in that mp4
};

// Decoded row groups of the data files, shared by all reads. Parquet decodes a column chunk whole, and a LeRobot
// v3.0 data file holds many episodes in one row group (often the file is one group), so a read of a few frames
// would decode the whole group each time: here it is decoded once (all numeric columns together; an image column
// on its own) and kept, least recently used first out, within a byte budget.
class RowGroupCache {
 public:
  explicit RowGroupCache(int64_t max_bytes) : max_bytes_(max_bytes) {}

  std::shared_ptr<const std::vector<at::Tensor>> numeric(const ParquetFile& f, const std::vector<std::string>& names,
                                                         int g) {
    return get<std::vector<at::Tensor>>(f, g, "", [&](int64_t b, int64_t e, int64_t& bytes) {
      auto t = std::make_shared<std::vector<at::Tensor>>(f.read_tensors(names, b, e));
      for (const auto& x : *t) bytes += static_cast<int64_t>(x.nbytes());
      return t;
    });
  }
  std::shared_ptr<const std::vector<std::string>> bytes(const ParquetFile& f, const std::string& column, int g) {
    return get<std::vector<std::string>>(f, g, column, [&](int64_t b, int64_t e, int64_t& bytes) {
      auto t = std::make_shared<std::vector<std::string>>(f.read_bytes(column, b, e));
      for (const auto& x : *t) bytes += static_cast<int64_t>(x.size()) + 32;
      return t;
    });
  }

 private:
  using Key = std::tuple<std::string, int, std::string>;
  struct Entry {
    std::shared_ptr<const void> data;
    int64_t bytes = 0;
    std::list<Key>::iterator lru;
  };

  template <class T, class Read>
  std::shared_ptr<const T> get(const ParquetFile& f, int g, const std::string& column, Read read) {
    const Key key{f.path(), g, column};
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = entries_.find(key); it != entries_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second.lru);
        return std::static_pointer_cast<const T>(it->second.data);
      }
    }
    // decoded outside the lock (two readers of a new group may both decode it; the first one kept wins)
    int64_t nbytes = 0;
    const auto& starts = f.row_group_starts();
    std::shared_ptr<const T> data = read(starts[g], starts[g + 1], nbytes);
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = entries_.find(key); it != entries_.end()) return std::static_pointer_cast<const T>(it->second.data);
    lru_.push_front(key);
    entries_[key] = Entry{data, nbytes, lru_.begin()};
    bytes_ += nbytes;
    while (bytes_ > max_bytes_ && lru_.size() > 1) {
      auto last = std::prev(lru_.end());
      auto it = entries_.find(*last);
      bytes_ -= it->second.bytes;
      entries_.erase(it);
      lru_.erase(last);
    }
    return data;
  }

  const int64_t max_bytes_;
  std::mutex mu_;
  std::list<Key> lru_;
  std::map<Key, Entry> entries_;
  int64_t bytes_ = 0;
};

// The row groups overlapping rows [begin, end) of F: (group, first row in it, end row in it) relative to the group.
std::vector<std::array<int64_t, 3>> groups_of(const ParquetFile& f, int64_t begin, int64_t end) {
  std::vector<std::array<int64_t, 3>> out;
  const auto& starts = f.row_group_starts();
  int64_t g = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  for (; g < f.num_row_groups() && starts[g] < end; ++g)
    out.push_back({g, std::max(begin, starts[g]) - starts[g], std::min(end, starts[g + 1]) - starts[g]});
  return out;
}

class LeRobotDataset final : public RobotDataset {
 public:
  explicit LeRobotDataset(const std::string& root) : root_(root) { open(); }

  std::string format() const override { return "LeRobot " + version_; }
  const std::string& root() const override { return root_; }
  double fps() const override { return fps_; }
  const std::vector<Feature>& features() const override { return features_; }
  const std::vector<Episode>& episodes() const override { return episodes_; }
  const std::vector<std::string>& tasks() const override { return tasks_; }
  const Stats& stats() const override { return stats_; }

  std::vector<at::Tensor> read_numeric(const std::vector<std::string>& names, int64_t episode, int64_t begin,
                                       int64_t end) const override {
    check_range(episode, begin, end);
    for (const auto& n : names) {
      const Feature& f = feature(n);
      if (f.kind != FeatureKind::numeric)
        throw file_error(root_, n, "not a numeric feature (its dtype is " + f.dtype + ")");
    }
    const EpisodeFiles& ef = files_[episode];
    auto file = parquet(episode);
    try {
      if (begin == end) return file->read_tensors(names, ef.row + begin, ef.row + end);
      std::vector<size_t> which;  // NAMES' positions among the dataset's numeric features
      for (const auto& n : names)
        which.push_back(std::find(numeric_names_.begin(), numeric_names_.end(), n) - numeric_names_.begin());
      std::vector<std::vector<at::Tensor>> parts(names.size());
      for (const auto& [g, b, e] : groups_of(*file, ef.row + begin, ef.row + end)) {
        const auto cols = groups_.numeric(*file, numeric_names_, static_cast<int>(g));
        for (size_t i = 0; i < names.size(); ++i) parts[i].push_back((*cols)[which[i]].slice(0, b, e));
      }
      std::vector<at::Tensor> out;
      for (auto& p : parts) out.push_back(p.size() == 1 ? p[0].clone() : at::cat(p));
      return out;
    } catch (const Error& e) {
      throw Error(std::string(e.what()) + " (episode " + std::to_string(episodes_[episode].index) + ")");
    }
  }

  at::Tensor read_camera(const std::string& camera, int64_t episode, const std::vector<int64_t>& frames,
                         double tolerance_s) const override {
    const Feature& f = feature(camera);
    if (f.kind != FeatureKind::video && f.kind != FeatureKind::image)
      throw file_error(root_, camera, "not a camera (its dtype is " + f.dtype + ")");
    if (episode < 0 || episode >= static_cast<int64_t>(episodes_.size()))
      throw file_error(root_, "episode", "position " + std::to_string(episode) + " out of range (the dataset has " +
                                             std::to_string(episodes_.size()) + " episodes)");
    const Episode& ep = episodes_[episode];
    for (int64_t i : frames)
      if (i < 0 || i >= ep.length)
        throw file_error(root_, camera, "episode " + std::to_string(ep.index) + ": frame " + std::to_string(i) +
                                            " out of range (the episode has " + std::to_string(ep.length) +
                                            " frames)");
    const int64_t n = static_cast<int64_t>(frames.size());
    const int64_t h = f.shape.size() == 3 ? f.shape[0] : 0, w = f.shape.size() == 3 ? f.shape[1] : 0;
    if (n == 0) return f.depth ? at::empty({0, h, w, 1}, at::kFloat) : at::empty({0, h, w, 3}, at::kByte);
    const int64_t lo = *std::min_element(frames.begin(), frames.end());
    const int64_t hi = *std::max_element(frames.begin(), frames.end()) + 1;
    const EpisodeFiles& ef = files_[episode];
    auto file = parquet(episode);
    const std::string where = "episode " + std::to_string(ep.index) + ", camera " + camera;
    if (f.kind == FeatureKind::image) {
      std::vector<std::pair<int64_t, std::shared_ptr<const std::vector<std::string>>>> groups;  // (first row, rows)
      try {
        for (const auto& [g, b, e] : groups_of(*file, ef.row + lo, ef.row + hi))
          groups.emplace_back(file->row_group_starts()[g], groups_.bytes(*file, camera, static_cast<int>(g)));
      } catch (const Error& e) {
        throw Error(std::string(e.what()) + " (episode " + std::to_string(ep.index) + ")");
      }
      std::vector<at::Tensor> out;
      out.reserve(n);
      for (int64_t i : frames) {
        const int64_t row = ef.row + i;
        size_t k = 0;
        while (k + 1 < groups.size() && groups[k + 1].first <= row) ++k;
        const std::string& bytes = (*groups[k].second)[row - groups[k].first];
        const std::string name = ef.data + ": " + where + ", frame " + std::to_string(i);
        if (!f.depth) {
          out.push_back(image::decode_image(bytes, name));
          continue;
        }
        // depth: the stored values (TIFF), in millimetres as LeRobotDataset's items (metres times 1000)
        at::Tensor d = image::decode_depth_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), name);
        out.push_back(f.depth->unit == "m" ? d * 1000.0 : d);
      }
      try {
        return at::stack(out);
      } catch (const std::exception&) {
        throw Error(ef.data + ": " + where + ": the frames' image sizes differ");
      }
    }
    if (!has_feature("timestamp")) throw file_error(root_, "timestamp", "missing (video cameras need it)");
    const at::Tensor ts = read_numeric({"timestamp"}, episode, lo, hi)[0].to(at::kDouble).reshape({-1}).contiguous();
    const double from = ef.video_from.at(camera);
    std::vector<double> times;
    times.reserve(n);
    const double* t = ts.data_ptr<double>();
    for (int64_t i : frames) times.push_back(from + t[i - lo]);
    if (f.depth)
      return dequantize_depth(videos_.frames_at(ef.videos.at(camera), times, tolerance_s, where, FramePixels::gray12),
                              *f.depth);
    return videos_.frames_at(ef.videos.at(camera), times, tolerance_s, where);
  }

 private:
  void check_range(int64_t episode, int64_t begin, int64_t end) const {
    if (episode < 0 || episode >= static_cast<int64_t>(episodes_.size()))
      throw file_error(root_, "episode", "position " + std::to_string(episode) + " out of range (the dataset has " +
                                             std::to_string(episodes_.size()) + " episodes)");
    const Episode& ep = episodes_[episode];
    if (begin < 0 || begin > end || end > ep.length)
      throw file_error(root_, "episode", "episode " + std::to_string(ep.index) + ": frames [" + std::to_string(begin) +
                                             ", " + std::to_string(end) + ") out of range (it has " +
                                             std::to_string(ep.length) + " frames)");
  }

  // The episode's data file, opened once and checked against info.json (every numeric and image feature is a
  // column; enough rows for the episodes it holds).
  std::shared_ptr<const ParquetFile> parquet(int64_t episode) const {
    const std::string& path = files_[episode].data;
    const std::string ep = "episode " + std::to_string(episodes_[episode].index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = parquets_.find(path); it != parquets_.end()) return it->second;
    }
    std::shared_ptr<ParquetFile> file;
    try {
      file = std::make_shared<ParquetFile>(path);
    } catch (const Error& e) {
      throw Error(std::string(e.what()) + " (" + ep + ")");
    }
    for (const auto& f : features_) {
      if (f.kind != FeatureKind::numeric && f.kind != FeatureKind::image) continue;
      if (!file->has_column(f.name))
        throw file_error(path, f.name, ep + ": no such column (meta/info.json lists the feature)");
      const auto kind = file->column(f.name).kind;
      if (f.kind == FeatureKind::numeric && kind != ParquetColumnKind::numeric)
        throw file_error(path, f.name, ep + ": not a numeric column (" + file->column(f.name).type + ")");
      if (f.kind == FeatureKind::image && kind != ParquetColumnKind::image && kind != ParquetColumnKind::bytes)
        throw file_error(path, f.name, ep + ": not an image column (" + file->column(f.name).type + ")");
    }
    const int64_t need = rows_needed_.at(path);
    if (file->num_rows() < need)
      throw Error(path + ": " + ep + ": the file has " + std::to_string(file->num_rows()) +
                  " rows, its episodes need " + std::to_string(need));
    std::lock_guard<std::mutex> lock(mu_);
    return parquets_.emplace(path, std::move(file)).first->second;
  }

  void open() {
    const std::string info_path = join(root_, "meta/info.json");
    const ojson info = read_ordered_json(info_path);
    if (!info.is_object()) throw Error(info_path + ": expected a JSON object");
    auto str = [&](const std::string& key) {
      auto it = info.find(key);
      if (it == info.end() || !it->is_string()) throw file_error(info_path, key, "missing (expected a string)");
      return it->get<std::string>();
    };
    version_ = str("codebase_version");
    if (version_ != "v3.0" && version_ != "v2.1" && version_ != "v2.0")
      throw file_error(info_path, "codebase_version",
                       "unsupported '" + version_ + "' (this reader knows LeRobot v3.0, v2.1 and v2.0)");
    const bool v3 = version_ == "v3.0";
    {
      auto it = info.find("fps");
      if (it == info.end() || !it->is_number() || !(it->get<double>() > 0))
        throw file_error(info_path, "fps", "missing or not a positive number");
      fps_ = it->get<double>();
    }
    const std::string data_tmpl = str("data_path");
    auto vt = info.find("video_path");
    const std::string video_tmpl = vt != info.end() && vt->is_string() ? vt->get<std::string>() : "";

    // features: numeric ones first, then cameras, then the task text
    auto fit = info.find("features");
    if (fit == info.end() || !fit->is_object()) throw file_error(info_path, "features", "missing (expected an object)");
    std::vector<Feature> numeric, cameras;
    for (const auto& [name, spec] : fit->items()) {
      const std::string field = "features." + name;
      if (!spec.is_object()) throw file_error(info_path, field, "expected an object");
      Feature f;
      f.name = name;
      auto d = spec.find("dtype");
      if (d == spec.end() || !d->is_string()) throw file_error(info_path, field + ".dtype", "missing");
      f.dtype = d->get<std::string>();
      if (auto s = spec.find("shape"); s != spec.end() && s->is_array())
        for (const auto& x : *s) {
          if (!x.is_number_integer()) throw file_error(info_path, field + ".shape", "expected integers");
          f.shape.push_back(x.get<int64_t>());
        }
      if (auto nm = spec.find("names"); nm != spec.end()) f.names = string_list(*nm);
      if (f.dtype == "video" || f.dtype == "image") {
        f.kind = f.dtype == "video" ? FeatureKind::video : FeatureKind::image;
        // {H, W, C}: from the video info when given, else the shape in its names' order
        if (f.shape.size() != 3) throw file_error(info_path, field + ".shape", "expected [height, width, channels]");
        if (f.names.size() == 3 && f.names[0] == "channels") f.shape = {f.shape[1], f.shape[2], f.shape[0]};
        if (auto vi = spec.find("info"); vi != spec.end() && vi->is_object()) {
          auto h = vi->find("video.height"), w = vi->find("video.width"), c = vi->find("video.channels");
          if (h != vi->end() && w != vi->end() && h->is_number_integer() && w->is_number_integer())
            f.shape = {h->get<int64_t>(), w->get<int64_t>(),
                       c != vi->end() && c->is_number_integer() ? c->get<int64_t>() : 3};
          f.depth = depth_map(*vi, info_path, field + ".info");
        }
        if (f.depth && f.shape[2] != 1)
          throw file_error(info_path, field + ".shape",
                           "a depth map has one channel, not " + std::to_string(f.shape[2]));
        cameras.push_back(std::move(f));
      } else if (f.dtype == "string") {
        continue;  // text columns are not frames' tensors
      } else {
        numeric.push_back(std::move(f));
      }
    }
    for (const auto& f : cameras)
      if (f.kind == FeatureKind::video && video_tmpl.empty())
        throw file_error(info_path, "video_path", "missing (the dataset has the video feature " + f.name + ")");

    if (v3) open_v3(info_path, data_tmpl, video_tmpl, cameras);
    else open_v2(info_path, info, data_tmpl, video_tmpl, cameras);

    for (size_t i = 0; i < files_.size(); ++i) {
      auto& need = rows_needed_[files_[i].data];
      need = std::max(need, files_[i].row + episodes_[i].length);
    }
    // numeric shapes as stored: the first data file's columns ({} for a scalar column info.json lists as [1])
    if (!episodes_.empty()) {
      features_ = numeric;  // parquet() checks the columns of every numeric / image feature
      for (const auto& c : cameras) features_.push_back(c);
      auto file = parquet(0);
      for (auto& f : numeric) {
        const auto& col = file->column(f.name);
        std::vector<int64_t> shape = col.shape;
        if (std::find(shape.begin(), shape.end(), -1) != shape.end()) shape = file->row_shape(f.name);
        f.shape = shape;
      }
    }
    features_ = numeric;
    for (const auto& f : numeric) numeric_names_.push_back(f.name);
    for (auto& c : cameras) features_.push_back(std::move(c));
    if (!tasks_.empty()) {
      Feature t;
      t.name = "task";
      t.kind = FeatureKind::text;
      t.dtype = "string";
      features_.push_back(t);
    }
  }

  void open_v3(const std::string& info_path, const std::string& data_tmpl, const std::string& video_tmpl,
               const std::vector<Feature>& cameras) {
    // tasks
    const std::string tasks_path = join(root_, "meta/tasks.parquet");
    std::error_code ec;
    if (fs::exists(tasks_path, ec)) {
      ParquetFile tf(tasks_path);
      const at::Tensor idx = tf.read_tensor("task_index").to(at::kLong).reshape({-1});
      const auto text = tf.read_bytes("task");
      for (int64_t i = 0; i < idx.size(0); ++i) {
        const int64_t k = idx[i].item<int64_t>();
        if (k < 0 || k > 1000000000) throw file_error(tasks_path, "task_index", "bad value " + std::to_string(k));
        if (static_cast<int64_t>(tasks_.size()) <= k) tasks_.resize(k + 1);
        tasks_[k] = text[i];
      }
    }
    // episodes
    const fs::path meta_eps = fs::path(root_) / "meta" / "episodes";
    std::vector<std::string> ep_files;
    if (fs::is_directory(meta_eps, ec))
      for (const auto& e : fs::recursive_directory_iterator(meta_eps, ec))
        if (e.is_regular_file() && e.path().extension() == ".parquet") ep_files.push_back(e.path().string());
    if (ep_files.empty()) throw Error(meta_eps.string() + ": no episode files (meta/episodes/chunk-*/file-*.parquet)");
    std::sort(ep_files.begin(), ep_files.end());
    struct Row {
      Episode ep;
      EpisodeFiles files;
      int64_t data_chunk, data_file;
    };
    std::vector<Row> rows;
    for (const auto& path : ep_files) {
      ParquetFile pf(path);
      auto ints = [&](const std::string& col) {
        return pf.read_tensor(col).to(at::kLong).reshape({-1}).contiguous();
      };
      const at::Tensor index = ints("episode_index"), length = ints("length"), from = ints("dataset_from_index"),
                       dchunk = ints("data/chunk_index"), dfile = ints("data/file_index");
      std::vector<std::vector<std::string>> task_lists;
      if (pf.has_column("tasks") && pf.column("tasks").kind == ParquetColumnKind::byte_lists)
        task_lists = pf.read_byte_lists("tasks");
      std::map<std::string, std::array<at::Tensor, 3>> vids;  // camera -> chunk, file, from_timestamp
      for (const auto& c : cameras) {
        if (c.kind != FeatureKind::video) continue;
        const std::string p = "videos/" + c.name + "/";
        vids[c.name] = {ints(p + "chunk_index"), ints(p + "file_index"),
                        pf.read_tensor(p + "from_timestamp").to(at::kDouble).reshape({-1}).contiguous()};
      }
      for (int64_t i = 0; i < pf.num_rows(); ++i) {
        Row r;
        r.ep.index = index[i].item<int64_t>();
        r.ep.length = length[i].item<int64_t>();
        r.ep.from = from[i].item<int64_t>();
        if (r.ep.length < 0)
          throw file_error(path, "length", "episode " + std::to_string(r.ep.index) + ": negative length");
        if (i < static_cast<int64_t>(task_lists.size())) r.ep.tasks = task_lists[i];
        r.data_chunk = dchunk[i].item<int64_t>();
        r.data_file = dfile[i].item<int64_t>();
        r.files.data = dataset_file(root_, data_tmpl, {}, {{"chunk_index", r.data_chunk}, {"file_index", r.data_file}},
                                    info_path, "data_path");
        for (const auto& [cam, t] : vids) {
          r.files.videos[cam] = dataset_file(
              root_, video_tmpl, {{"video_key", cam}},
              {{"chunk_index", t[0][i].item<int64_t>()}, {"file_index", t[1][i].item<int64_t>()}}, info_path,
              "video_path");
          r.files.video_from[cam] = t[2][i].item<double>();
        }
        rows.push_back(std::move(r));
      }
    }
    std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.ep.index < b.ep.index; });
    // an episode's first row in its data file: its "index" minus the file's first index (the file holds its
    // episodes' frames in index order)
    std::map<std::string, int64_t> first_index;
    for (const auto& r : rows) {
      auto [it, fresh] = first_index.emplace(r.files.data, r.ep.from);
      if (!fresh) it->second = std::min(it->second, r.ep.from);
    }
    for (size_t i = 0; i < rows.size(); ++i) {
      if (i > 0 && rows[i].ep.index == rows[i - 1].ep.index)
        throw file_error(meta_eps.string(), "episode_index", "episode " + std::to_string(rows[i].ep.index) +
                                                                  " is listed twice");
      rows[i].files.row = rows[i].ep.from - first_index[rows[i].files.data];
      episodes_.push_back(rows[i].ep);
      files_.push_back(rows[i].files);
    }
    // stats
    const std::string stats_path = join(root_, "meta/stats.json");
    if (fs::exists(stats_path, ec)) stats_ = stats_from_json(read_ordered_json(stats_path), stats_path, "");
  }

  void open_v2(const std::string& info_path, const ojson& info, const std::string& data_tmpl,
               const std::string& video_tmpl, const std::vector<Feature>& cameras) {
    int64_t chunks_size = 1000;
    if (auto it = info.find("chunks_size"); it != info.end() && it->is_number_integer()) chunks_size = it->get<int64_t>();
    if (chunks_size <= 0) throw file_error(info_path, "chunks_size", "must be positive");
    const std::string tasks_path = join(root_, "meta/tasks.jsonl");
    std::error_code ec;
    if (fs::exists(tasks_path, ec)) {
      for (const auto& j : read_jsonl(tasks_path)) {
        const int64_t k = json_int(j, "task_index", tasks_path, "");
        auto t = j.find("task");
        if (t == j.end() || !t->is_string()) throw file_error(tasks_path, "task", "missing (task_index " +
                                                                                     std::to_string(k) + ")");
        if (k < 0 || k > 1000000000) throw file_error(tasks_path, "task_index", "bad value " + std::to_string(k));
        if (static_cast<int64_t>(tasks_.size()) <= k) tasks_.resize(k + 1);
        tasks_[k] = t->get<std::string>();
      }
    }
    const std::string eps_path = join(root_, "meta/episodes.jsonl");
    std::vector<Episode> eps;
    for (const auto& j : read_jsonl(eps_path)) {
      Episode e;
      e.index = json_int(j, "episode_index", eps_path, "");
      e.length = json_int(j, "length", eps_path, "");
      if (e.length < 0) throw file_error(eps_path, "length", "episode " + std::to_string(e.index) + ": negative");
      if (auto t = j.find("tasks"); t != j.end()) e.tasks = string_list(*t);
      eps.push_back(std::move(e));
    }
    std::sort(eps.begin(), eps.end(), [](const Episode& a, const Episode& b) { return a.index < b.index; });
    int64_t from = 0;
    for (size_t i = 0; i < eps.size(); ++i) {
      if (i > 0 && eps[i].index == eps[i - 1].index)
        throw file_error(eps_path, "episode_index", "episode " + std::to_string(eps[i].index) + " is listed twice");
      eps[i].from = from;
      from += eps[i].length;
      EpisodeFiles ef;
      const int64_t chunk = eps[i].index / chunks_size;
      ef.data = dataset_file(root_, data_tmpl, {}, {{"episode_chunk", chunk}, {"episode_index", eps[i].index}},
                             info_path, "data_path");
      for (const auto& c : cameras) {
        if (c.kind != FeatureKind::video) continue;
        ef.videos[c.name] = dataset_file(root_, video_tmpl, {{"video_key", c.name}},
                                         {{"episode_chunk", chunk}, {"episode_index", eps[i].index}}, info_path,
                                         "video_path");
        ef.video_from[c.name] = 0.0;
      }
      files_.push_back(std::move(ef));
    }
    episodes_ = std::move(eps);
    // stats: stats.json when present, else the episodes' stats aggregated
    const std::string stats_path = join(root_, "meta/stats.json");
    const std::string ep_stats_path = join(root_, "meta/episodes_stats.jsonl");
    if (fs::exists(stats_path, ec)) {
      stats_ = stats_from_json(read_ordered_json(stats_path), stats_path, "");
    } else if (fs::exists(ep_stats_path, ec)) {
      std::vector<Stats> per;
      for (const auto& j : read_jsonl(ep_stats_path)) {
        const int64_t e = json_int(j, "episode_index", ep_stats_path, "");
        auto s = j.find("stats");
        if (s == j.end()) throw file_error(ep_stats_path, "stats", "missing (episode " + std::to_string(e) + ")");
        per.push_back(stats_from_json(*s, ep_stats_path, "stats."));
      }
      if (!per.empty()) stats_ = aggregate_stats(per, ep_stats_path);
    }
  }

  std::string root_, version_;
  double fps_ = 0;
  std::vector<Feature> features_;
  std::vector<Episode> episodes_;
  std::vector<EpisodeFiles> files_;  // per episode position
  std::map<std::string, int64_t> rows_needed_;
  std::vector<std::string> tasks_;
  Stats stats_;
  mutable std::mutex mu_;
  mutable std::map<std::string, std::shared_ptr<const ParquetFile>> parquets_;
  std::vector<std::string> numeric_names_;
  mutable RowGroupCache groups_{int64_t{512} << 20};
  mutable VideoFrameCache videos_;
};

}  // namespace

std::unique_ptr<RobotDataset> open_lerobot_dataset(const std::string& folder) {
  return std::make_unique<LeRobotDataset>(folder);
}

}  // namespace lf::data::robot
