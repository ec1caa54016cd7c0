// LeRobot's statistics (stats.h). Facts about numpy that the arithmetic follows (checked against numpy 2.4):
//   - a sum along axis 0 of a C-contiguous [N, K] array adds the rows one after another when K > 1, and uses
//     numpy's pairwise summation (blocks of 8 partial sums, halves above 128 elements) when K == 1;
//   - float32 arrays are summed, squared, divided and square-rooted in float32; a Python float meets a float32
//     scalar as float32 (NEP 50), so LeRobot's `min - 1e-10` is a float32 subtraction;
//   - np.linspace(a, b, n) = k * ((b - a) / (n - 1)) + a in the dtype of a and b, the last point set to b;
//   - np.histogram with explicit edges counts [e_k, e_k+1) and the last bin closed, by sorted search.
#include "loongforge/data/robot/stats.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "loongforge/core/error.h"

namespace lf::data::robot {

namespace {

constexpr int kBins = 5000;
constexpr double kQuantiles[] = {0.01, 0.10, 0.50, 0.90, 0.99};
const char* const kQuantileKeys[] = {"q01", "q10", "q50", "q90", "q99"};

// numpy's pairwise summation of N values at A with stride S.
template <class T>
T pairwise_sum(const T* a, int64_t n, int64_t s) {
  if (n < 8) {
    T res = -0.0;
    for (int64_t i = 0; i < n; ++i) res += a[i * s];
    return res;
  }
  if (n <= 128) {
    T r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j * s];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int j = 0; j < 8; ++j) r[j] += a[(i + j) * s];
    T res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i * s];
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a, n2, s) + pairwise_sum(a + n2 * s, n - n2, s);
}

// np.sum(x, axis=0) of a row-major [N, K] array, in numpy's order.
// COLUMNWISE: numpy holds the array column-major (LeRobot's reshape of a one-frame camera batch is a view with
// contiguous columns), so each column is reduced on its own, pairwise.
template <class T>
std::vector<T> sum_axis0(const T* x, int64_t n, int64_t k, bool columnwise = false) {
  std::vector<T> out(k, T(0));
  if (columnwise) {
    for (int64_t j = 0; j < k; ++j) out[j] = T(0) + pairwise_sum(x + j, n, k);
    return out;
  }
  if (k == 1) {
    out[0] = T(0) + pairwise_sum(x, n, 1);
    return out;
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) out[j] += x[i * k + j];
  return out;
}

// np.linspace(start, stop, num) in T.
template <class T>
std::vector<T> linspace(T start, T stop, int64_t num) {
  std::vector<T> y(num);
  int64_t div = num - 1;
  T delta = stop - start;
  for (int64_t k = 0; k < num; ++k) y[k] = static_cast<T>(k);
  if (div > 0) {
    T step = delta / static_cast<T>(div);
    if (step == 0) {
      for (auto& v : y) v = (v / static_cast<T>(div)) * delta;
    } else {
      for (auto& v : y) v *= step;
    }
  } else {
    for (auto& v : y) v *= delta;
  }
  for (auto& v : y) v += start;
  if (num > 1) y[num - 1] = stop;
  return y;
}

// One column's values as sorted distinct values with cumulative counts (for numpy's sorted-search histogram).
template <class T>
struct Sorted {
  std::vector<T> values;
  std::vector<int64_t> cum;  // cum[i]: how many values are <= values[i]
  int64_t less(T e) const {  // how many values are < e
    auto i = std::lower_bound(values.begin(), values.end(), e) - values.begin();
    return i == 0 ? 0 : cum[i - 1];
  }
  int64_t less_equal(T e) const {
    auto i = std::upper_bound(values.begin(), values.end(), e) - values.begin();
    return i == 0 ? 0 : cum[i - 1];
  }
};

template <class T>
Sorted<T> sorted_column(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  Sorted<T> s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (s.values.empty() || v[i] != s.values.back()) {
      s.values.push_back(v[i]);
      s.cum.push_back(s.cum.empty() ? 0 : s.cum.back());
    }
    ++s.cum.back();
  }
  return s;
}

// RunningQuantileStats's quantiles of one column (one update): histogram over linspace(min - 1e-10, max + 1e-10)
// in T, interpolated in float64.
// EDGE[i]: quantile i is a bin edge itself (numpy keeps it a T scalar; an interpolated one is float64).
template <class T>
std::vector<double> column_quantiles(const Sorted<T>& col, T mn, T mx, int64_t count, std::vector<bool>& edge) {
  edge.clear();
  auto edges = linspace<T>(mn - static_cast<T>(1e-10), mx + static_cast<T>(1e-10), kBins + 1);
  std::vector<double> cumsum(kBins);
  int64_t prev = col.less(edges[0]), acc = 0;
  for (int b = 0; b < kBins; ++b) {
    int64_t next = b + 1 < kBins ? col.less(edges[b + 1]) : col.less_equal(edges[kBins]);
    acc += next - prev;
    prev = next;
    cumsum[b] = static_cast<double>(acc);
  }
  std::vector<double> out;
  for (double q : kQuantiles) {
    double target = q * static_cast<double>(count);
    int64_t idx = std::lower_bound(cumsum.begin(), cumsum.end(), target) - cumsum.begin();
    edge.push_back(true);
    if (idx == 0) {
      out.push_back(static_cast<double>(edges[0]));
    } else if (idx >= kBins) {
      out.push_back(static_cast<double>(edges[kBins]));
    } else {
      double before = cumsum[idx - 1], in_bin = cumsum[idx] - before;
      if (in_bin == 0) {
        out.push_back(static_cast<double>(edges[idx]));
      } else {
        edge.back() = false;
        double fraction = (target - before) / in_bin;
        T width = edges[idx + 1] - edges[idx];
        out.push_back(static_cast<double>(edges[idx]) + fraction * static_cast<double>(width));
      }
    }
  }
  return out;
}

template <class T>
at::ScalarType scalar_of() {
  return std::is_same_v<T, float> ? at::kFloat : at::kDouble;
}

template <class T>
at::Tensor vec_tensor(const std::vector<T>& v, std::vector<int64_t> shape) {
  return at::from_blob(const_cast<T*>(v.data()), {static_cast<int64_t>(v.size())}, scalar_of<T>())
      .clone()
      .reshape(shape);
}

// RunningQuantileStats(update once).get_statistics() of row-major X [N, K] (N >= 2) with the columns' sorted
// values COLS; every stat shaped SHAPE, count SAMPLES.
template <class T>
FeatureStats running_stats(const std::vector<T>& x, int64_t n, int64_t k, const std::vector<Sorted<T>>& cols,
                           int64_t samples, const std::vector<int64_t>& shape, bool columnwise = false) {
  auto sum = sum_axis0(x.data(), n, k, columnwise);
  std::vector<T> sq(x.size());
  for (size_t i = 0; i < x.size(); ++i) sq[i] = x[i] * x[i];
  auto sumsq = sum_axis0(sq.data(), n, k, columnwise);
  std::vector<T> mean(k), stdv(k), mn(k), mx(k);
  std::vector<std::vector<double>> qs(5, std::vector<double>(k));
  std::vector<bool> all_edges(5, true), edge;
  for (int64_t j = 0; j < k; ++j) {
    mean[j] = sum[j] / static_cast<T>(n);
    T msq = sumsq[j] / static_cast<T>(n);
    T var = msq - mean[j] * mean[j];
    stdv[j] = std::sqrt(std::max(T(0), var));
    mn[j] = cols[j].values.front();
    mx[j] = cols[j].values.back();
    auto q = column_quantiles(cols[j], mn[j], mx[j], n, edge);
    for (int i = 0; i < 5; ++i) {
      qs[i][j] = q[i];
      all_edges[i] = all_edges[i] && edge[i];
    }
  }
  FeatureStats st;
  st["min"] = vec_tensor(mn, shape);
  st["max"] = vec_tensor(mx, shape);
  st["mean"] = vec_tensor(mean, shape);
  st["std"] = vec_tensor(stdv, shape);
  st["count"] = at::full({1}, samples, at::kLong);
  // np.array of the columns' quantiles: T when every one is a bin edge (a T scalar), else float64 (exact either way,
  // but a camera's quantiles are then divided by 255 in that dtype).
  for (int i = 0; i < 5; ++i)
    st[kQuantileKeys[i]] = vec_tensor(qs[i], shape).to(all_edges[i] ? scalar_of<T>() : at::kDouble);
  return st;
}

// numpy's result_type(dtype, float32): the float type LeRobot's running stats compute in.
bool computes_in_float32(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kBool:
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kHalf:
    case at::kBFloat16:
      return true;
    default:
      return false;
  }
}

template <class T>
FeatureStats numeric_stats_as(const at::Tensor& values) {
  int64_t n = values.size(0), k = values.dim() == 1 ? 1 : values.size(1);
  auto v = values.to(scalar_of<T>()).contiguous();
  const T* vp = v.template data_ptr<T>();
  std::vector<T> x(vp, vp + v.numel());
  std::vector<Sorted<T>> cols;
  for (int64_t j = 0; j < k; ++j) {
    std::vector<T> c(n);
    for (int64_t i = 0; i < n; ++i) c[i] = x[i * k + j];
    cols.push_back(sorted_column(std::move(c)));
  }
  return running_stats<T>(x, n, k, cols, n, {k});
}

}  // namespace

FeatureStats numeric_stats(const at::Tensor& values) {
  if (values.dim() != 1 && values.dim() != 2)
    throw Error("statistics of numeric values need [frames] or [frames, dims], got " +
                std::to_string(values.dim()) + " dimensions");
  if (values.size(0) == 0) throw Error("statistics of no frames");
  auto t = values.scalar_type();
  if (values.size(0) < 2) {
    // _compute_basic_stats: min / max in the stored dtype, mean (float32 stays float32, others float64), std 0,
    // the quantiles a copy of the mean.
    int64_t k = values.dim() == 1 ? 1 : values.size(1);
    auto row = values.reshape({1, k});
    auto mean = row.to(t == at::kFloat ? at::kFloat : at::kDouble)[0].clone();
    FeatureStats st;
    st["min"] = row[0].clone();
    st["max"] = row[0].clone();
    st["mean"] = mean;
    st["std"] = at::zeros_like(mean);
    st["count"] = at::full({1}, int64_t{1}, at::kLong);
    for (auto* q : kQuantileKeys) st[q] = mean.clone();
    return st;
  }
  return computes_in_float32(t) ? numeric_stats_as<float>(values) : numeric_stats_as<double>(values);
}

FeatureStats image_stats(const at::Tensor& frames) {
  if (frames.dim() != 4 || frames.scalar_type() != at::kByte)
    throw Error("image statistics need uint8 frames [n, H, W, C]");
  auto f = frames.contiguous();
  int64_t n = f.size(0), c = f.size(3), m = f.numel() / std::max<int64_t>(c, 1);
  if (m < 2) throw Error("image statistics need at least 2 pixels");
  const uint8_t* p = f.data_ptr<uint8_t>();
  std::vector<float> x(f.numel());
  std::vector<std::vector<int64_t>> counts(c, std::vector<int64_t>(256, 0));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < c; ++j) {
      uint8_t v = p[i * c + j];
      x[i * c + j] = static_cast<float>(v);
      ++counts[j][v];
    }
  std::vector<Sorted<float>> cols(c);
  for (int64_t j = 0; j < c; ++j) {
    int64_t acc = 0;
    for (int v = 0; v < 256; ++v)
      if (counts[j][v]) {
        acc += counts[j][v];
        cols[j].values.push_back(static_cast<float>(v));
        cols[j].cum.push_back(acc);
      }
  }
  // One frame: LeRobot's transpose(0, 2, 3, 1).reshape(-1, C) of its [1, C, H, W] batch is a column-major view.
  auto st = running_stats<float>(x, m, c, cols, n, {c, 1, 1}, n == 1);
  // LeRobot divides by 255 in the stats' own dtypes (float32 min / max / mean / std, float64 quantiles).
  for (auto& [key, v] : st)
    if (key != "count") v = v / (v.scalar_type() == at::kFloat ? at::scalar_tensor(255.0f) : at::scalar_tensor(255.0, at::kDouble));
  return st;
}

std::vector<int64_t> sample_indices(int64_t n) {
  if (n <= 0) return {};
  int64_t lo = n < 100 ? n : 100;
  int64_t num = std::max(lo, std::min(static_cast<int64_t>(std::pow(static_cast<double>(n), 0.75)), int64_t{10000}));
  auto y = linspace<double>(0.0, static_cast<double>(n - 1), num);
  std::vector<int64_t> out;
  for (double v : y) out.push_back(static_cast<int64_t>(std::nearbyint(v)));
  return out;
}

at::Tensor auto_downsample(const at::Tensor& frames) {
  int64_t h = frames.size(1), w = frames.size(2);
  if (std::max(w, h) < 300) return frames;
  auto factor = static_cast<int64_t>(w > h ? static_cast<double>(w) / 150.0 : static_cast<double>(h) / 150.0);
  return frames.slice(1, 0, h, factor).slice(2, 0, w, factor);
}

// A depth camera's frames (float32 [n, H, W, 1] in millimetres, as read_camera gives them) as LeRobot's
// compute_episode_stats takes a depth map's sampled images: in the unit the frames were recorded in (millimetres or
// metres; computed in float32 as at recording), one channel, not divided by 255, count = frames.
FeatureStats depth_stats(const at::Tensor& frames, const std::string& unit) {
  if (frames.dim() != 4 || frames.size(3) != 1) throw Error("depth statistics need frames [n, H, W, 1]");
  const at::Tensor mm = frames.to(at::kFloat);
  const at::Tensor values = (unit == "m" ? mm.div(1000.0f) : mm).reshape({-1, 1});
  FeatureStats st = numeric_stats(values);
  for (auto& [key, v] : st) v = key == "count" ? at::full({1}, frames.size(0), at::kLong) : v.reshape({1, 1, 1});
  return st;
}

FeatureStats aggregate_feature_stats(const std::vector<FeatureStats>& eps) {
  if (eps.empty()) throw Error("aggregate_stats of no episodes");
  const int64_t e = static_cast<int64_t>(eps.size());
  auto shape = eps[0].at("mean").sizes().vec();
  const int64_t k = eps[0].at("mean").numel();
  std::vector<double> counts(e);
  int64_t total = 0;
  for (int64_t i = 0; i < e; ++i) {
    int64_t c = eps[i].at("count").item<int64_t>();
    counts[i] = static_cast<double>(c);
    total += c;
  }
  auto as_double = [&](const at::Tensor& t) {
    auto d = t.to(at::kDouble).contiguous();
    if (d.numel() != k) throw Error("aggregate_stats: episodes' statistics differ in shape");
    return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + k);
  };
  // Weighted sums over episodes (np.sum axis 0 of [E, ...]) divided by the total count.
  auto weighted_mean = [&](const std::vector<std::vector<double>>& vals) {
    std::vector<double> w(e * k);
    for (int64_t i = 0; i < e; ++i)
      for (int64_t j = 0; j < k; ++j) w[i * k + j] = vals[i][j] * counts[i];
    auto s = sum_axis0(w.data(), e, k);
    for (auto& v : s) v /= static_cast<double>(total);
    return s;
  };
  std::vector<std::vector<double>> means, vars;
  for (const auto& st : eps) {
    means.push_back(as_double(st.at("mean")));
    vars.push_back(as_double(st.at("std") * st.at("std")));  // std ** 2 in the std's own dtype
  }
  auto total_mean = weighted_mean(means);
  std::vector<std::vector<double>> parts(e, std::vector<double>(k));
  for (int64_t i = 0; i < e; ++i)
    for (int64_t j = 0; j < k; ++j) {
      double d = means[i][j] - total_mean[j];
      parts[i][j] = vars[i][j] + d * d;
    }
  auto total_var = weighted_mean(parts);
  std::vector<double> stdv(k);
  for (int64_t j = 0; j < k; ++j) stdv[j] = std::sqrt(total_var[j]);
  FeatureStats out;
  std::vector<at::Tensor> mins, maxs;
  for (const auto& st : eps) {
    mins.push_back(st.at("min").to(at::kDouble));
    maxs.push_back(st.at("max").to(at::kDouble));
  }
  out["min"] = std::get<0>(at::stack(mins).min(0));
  out["max"] = std::get<0>(at::stack(maxs).max(0));
  out["mean"] = vec_tensor(total_mean, shape);
  out["std"] = vec_tensor(stdv, shape);
  out["count"] = at::full({1}, total, at::kLong);
  for (auto* q : kQuantileKeys) {
    bool all = true;
    for (const auto& st : eps) all = all && st.count(q);
    if (!all) continue;
    std::vector<std::vector<double>> qs;
    for (const auto& st : eps) qs.push_back(as_double(st.at(q)));
    out[q] = vec_tensor(weighted_mean(qs), shape);
  }
  return out;
}

RawStats episode_stats(const RobotDataset& dataset, int64_t episode, const std::vector<std::string>& features) {
  std::vector<std::string> names = features;
  if (names.empty())
    for (const auto& f : dataset.features())
      if (f.kind != FeatureKind::text) names.push_back(f.name);
  const Episode& ep = dataset.episodes().at(episode);
  RawStats out;
  for (const auto& name : names) {
    const Feature& f = dataset.feature(name);
    try {
      if (f.kind == FeatureKind::text) continue;
      if (f.kind == FeatureKind::numeric) {
        out[name] = numeric_stats(dataset.read_numeric({name}, episode, 0, ep.length)[0]);
      } else {
        auto frames = dataset.read_camera(name, episode, sample_indices(ep.length));
        out[name] = f.depth ? depth_stats(auto_downsample(frames), f.depth->unit) : image_stats(auto_downsample(frames));
      }
    } catch (const Error& e) {
      std::string what = e.what();
      if (what.find(dataset.root()) != std::string::npos) throw;
      throw file_error(dataset.root() + ": episode " + std::to_string(ep.index), name, what);
    }
  }
  return out;
}

RawStats compute_stats(const RobotDataset& dataset, const std::vector<int64_t>& episodes,
                       const std::vector<std::string>& features) {
  std::vector<int64_t> positions = episodes;
  if (positions.empty())
    for (size_t i = 0; i < dataset.episodes().size(); ++i) positions.push_back(static_cast<int64_t>(i));
  // In the dataset's order, each once (as LeRobot aggregates a subset).
  std::sort(positions.begin(), positions.end());
  positions.erase(std::unique(positions.begin(), positions.end()), positions.end());
  std::map<std::string, std::vector<FeatureStats>> per;
  for (int64_t p : positions) {
    if (p < 0 || p >= static_cast<int64_t>(dataset.episodes().size()))
      throw Error(dataset.root() + ": no episode at position " + std::to_string(p));
    if (dataset.episodes()[p].length == 0) continue;
    for (auto& [name, st] : episode_stats(dataset, p, features)) per[name].push_back(std::move(st));
  }
  if (per.empty()) throw Error(dataset.root() + ": no frames to compute statistics from");
  RawStats out;
  for (auto& [name, list] : per) out[name] = aggregate_feature_stats(list);
  return out;
}

Stats to_stats(const RawStats& raw) {
  Stats out;
  for (const auto& [name, st] : raw)
    for (const auto& [key, v] : st) out[name][key] = v.to(at::kDouble).contiguous();
  return out;
}

namespace {

nlohmann::json nested(const at::Tensor& t, int64_t dim, const double* data, int64_t& pos, bool integer) {
  nlohmann::json arr = nlohmann::json::array();
  if (dim == t.dim()) return nlohmann::json();
  for (int64_t i = 0; i < t.size(dim); ++i) {
    if (dim + 1 == t.dim()) {
      double v = data[pos++];
      if (integer)
        arr.push_back(static_cast<int64_t>(v));
      else
        arr.push_back(v);
    } else {
      arr.push_back(nested(t, dim + 1, data, pos, integer));
    }
  }
  return arr;
}

void flatten(const nlohmann::json& j, std::vector<double>& vals, std::vector<int64_t>& shape, size_t depth,
             const std::string& where) {
  if (j.is_number()) {
    if (depth != shape.size()) throw Error(where + ": ragged nested lists");
    vals.push_back(j.get<double>());
    return;
  }
  if (!j.is_array()) throw Error(where + ": expected numbers or nested lists of numbers");
  if (depth == shape.size()) {
    if (!vals.empty()) throw Error(where + ": ragged nested lists");
    shape.push_back(static_cast<int64_t>(j.size()));
  } else if (shape[depth] != static_cast<int64_t>(j.size())) {
    throw Error(where + ": ragged nested lists");
  }
  for (const auto& x : j) flatten(x, vals, shape, depth + 1, where);
}

}  // namespace

std::string stats_to_json(const Stats& stats) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, st] : stats) {
    nlohmann::json f = nlohmann::json::object();
    for (const auto& [key, v] : st) {
      auto d = v.to(at::kDouble).contiguous();
      int64_t pos = 0;
      f[key] = d.dim() == 0 ? nlohmann::json(d.item<double>()) : nested(d, 0, d.data_ptr<double>(), pos, key == "count");
    }
    out[name] = f;
  }
  return out.dump(4) + "\n";
}

Stats stats_from_json(const std::string& text, const std::string& name) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw Error(name + ": not JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(name + ": expected an object {feature: {stat: values}}");
  Stats out;
  for (const auto& [feature, st] : j.items()) {
    if (!st.is_object()) throw file_error(name, feature, "expected an object {stat: values}");
    for (const auto& [key, v] : st.items()) {
      std::vector<double> vals;
      std::vector<int64_t> shape;
      flatten(v, vals, shape, 0, name + ": field '" + feature + "." + key + "'");
      out[feature][key] = at::tensor(vals, at::kDouble).reshape(shape);
    }
  }
  return out;
}

}  // namespace lf::data::robot
