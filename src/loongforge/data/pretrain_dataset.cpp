#include "loongforge/data/pretrain_dataset.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>

#include "loongforge/core/error.h"

namespace lf::data {

namespace {

// splitmix64: our own generator and shuffle, so the order is the same with every standard library.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

struct Rng {
  uint64_t state;
  uint64_t next() { return state = mix(state); }
  uint64_t below(uint64_t n) {  // uniform in [0, n), Lemire's method
    unsigned __int128 m = static_cast<unsigned __int128>(next()) * n;
    if (static_cast<uint64_t>(m) < n) {
      const uint64_t t = (0 - n) % n;
      while (static_cast<uint64_t>(m) < t) m = static_cast<unsigned __int128>(next()) * n;
    }
    return static_cast<uint64_t>(m >> 64);
  }
};

Rng rng_for(uint64_t seed, uint64_t source, uint64_t epoch, uint64_t purpose) {
  return Rng{mix(mix(mix(mix(seed) ^ source) ^ epoch) ^ purpose)};
}

template <class T>
void shuffle(std::vector<T>& v, Rng rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng.below(i)]);
}

const char* split_name(Split s) { return s == Split::Train ? "train" : "valid"; }

constexpr const char* kWhere = "pretrain data";

}  // namespace

// ------------------------------------------------------------------------------------------------------ state

nlohmann::json PretrainState::to_json() const {
  return {{"samples_consumed", samples_consumed}, {"source_samples", source_samples},
          {"seed", seed},                         {"seq_len", seq_len},
          {"split", split_name(split)}};
}

PretrainState PretrainState::from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw file_error(where, "", "expected a JSON object");
  auto field = [&](const char* name) -> const nlohmann::json& {
    if (!j.contains(name)) throw file_error(where, name, "missing");
    return j.at(name);
  };
  auto unsigned_field = [&](const char* name) {
    const auto& v = field(name);
    if (!v.is_number_integer() || (v.is_number_integer() && !v.is_number_unsigned() && v.get<int64_t>() < 0))
      throw file_error(where, name, "expected a non-negative integer, got " + v.dump());
    return v.get<uint64_t>();
  };
  PretrainState s;
  s.samples_consumed = unsigned_field("samples_consumed");
  s.seed = unsigned_field("seed");
  s.seq_len = static_cast<int64_t>(unsigned_field("seq_len"));
  const auto& split = field("split");
  if (split != "train" && split != "valid") throw file_error(where, "split", "expected \"train\" or \"valid\"");
  s.split = split == "train" ? Split::Train : Split::Valid;
  const auto& counts = field("source_samples");
  if (!counts.is_array()) throw file_error(where, "source_samples", "expected an array of non-negative integers");
  for (size_t i = 0; i < counts.size(); ++i) {
    if (!counts[i].is_number_integer() || (!counts[i].is_number_unsigned() && counts[i].get<int64_t>() < 0))
      throw file_error(where, "source_samples[" + std::to_string(i) + "]", "expected a non-negative integer");
    s.source_samples.push_back(counts[i].get<uint64_t>());
  }
  return s;
}

// ------------------------------------------------------------------------------------------------------ dataset

struct PretrainDataset::Source {
  explicit Source(const std::string& prefix) : shard(prefix) {}
  TokenShard shard;
  std::vector<uint64_t> docs;  // the split's non-empty documents, ascending
  uint64_t tokens = 0, samples = 0;
  // The epoch in use: its document order, stream offsets (cum[i] = start of order[i]; cum.back() = tokens), and
  // sample order.
  uint64_t cached_epoch = UINT64_MAX;
  std::vector<uint64_t> order, cum, sample_order;
};

bool PretrainDataset::is_valid_doc(uint64_t split_seed, double valid_fraction, uint64_t doc) {
  if (valid_fraction <= 0) return false;
  const double u = static_cast<double>(mix(mix(split_seed ^ 0x5e11d) ^ doc) >> 11) * 0x1.0p-53;
  return u < valid_fraction;
}

PretrainDataset::PretrainDataset(PretrainOptions options) : opts_(std::move(options)) {
  if (opts_.sources.empty()) throw file_error(kWhere, "sources", "no shards given");
  if (opts_.seq_len < 1) throw file_error(kWhere, "seq_len", "must be >= 1, got " + std::to_string(opts_.seq_len));
  if (!(opts_.valid_fraction >= 0 && opts_.valid_fraction < 1))
    throw file_error(kWhere, "valid_fraction", "must be in [0, 1), got " + std::to_string(opts_.valid_fraction));
  if (opts_.split == Split::Valid && opts_.valid_fraction <= 0)
    throw file_error(kWhere, "valid_fraction", "is 0: the valid split would be empty");
  double total = 0;
  for (size_t i = 0; i < opts_.sources.size(); ++i) {
    const double w = opts_.sources[i].weight;
    if (!std::isfinite(w) || w <= 0)
      throw file_error(kWhere, "sources[" + std::to_string(i) + "].weight",
                       "must be a positive number, got " + std::to_string(w));
    total += w;
  }
  const uint64_t need = static_cast<uint64_t>(opts_.seq_len) + 1;
  for (size_t i = 0; i < opts_.sources.size(); ++i) {
    weights_.push_back(opts_.sources[i].weight / total);
    auto src = std::make_unique<Source>(opts_.sources[i].prefix);
    const TokenShard& sh = src->shard;
    for (uint64_t d = 0; d < sh.num_docs(); ++d) {
      const uint64_t len = sh.doc_length(d);
      if (len == 0 || is_valid_doc(opts_.split_seed, opts_.valid_fraction, d) != (opts_.split == Split::Valid))
        continue;
      src->docs.push_back(d);
      src->tokens += len;
    }
    if (src->tokens < need)
      throw file_error(opts_.sources[i].prefix + ".idx", "num_tokens",
                       std::string("the ") + split_name(opts_.split) + " split has " + std::to_string(src->tokens) +
                           " tokens in " + std::to_string(src->docs.size()) + " documents; a sample needs " +
                           std::to_string(need));
    src->samples = (src->tokens - 1) / static_cast<uint64_t>(opts_.seq_len);
    sources_.push_back(std::move(src));
  }
  taken_.assign(sources_.size(), 0);
}

PretrainDataset::~PretrainDataset() = default;

uint64_t PretrainDataset::samples_per_epoch(size_t s) const { return sources_.at(s)->samples; }
uint64_t PretrainDataset::split_docs(size_t s) const { return sources_.at(s)->docs.size(); }
uint64_t PretrainDataset::split_tokens(size_t s) const { return sources_.at(s)->tokens; }
uint64_t PretrainDataset::epoch(size_t s) const { return taken_.at(s) / sources_.at(s)->samples; }

Sample PretrainDataset::sample(size_t s, uint64_t k) {
  Source& src = *sources_.at(s);
  const uint64_t epoch = k / src.samples, j = k % src.samples;
  if (src.cached_epoch != epoch) {
    src.order = src.docs;
    shuffle(src.order, rng_for(opts_.seed, s, epoch, 1));
    src.cum.resize(src.order.size() + 1);
    src.cum[0] = 0;
    for (size_t i = 0; i < src.order.size(); ++i) src.cum[i + 1] = src.cum[i] + src.shard.doc_length(src.order[i]);
    src.sample_order.resize(src.samples);
    std::iota(src.sample_order.begin(), src.sample_order.end(), uint64_t{0});
    shuffle(src.sample_order, rng_for(opts_.seed, s, epoch, 2));
    src.cached_epoch = epoch;
  }
  const uint64_t n = static_cast<uint64_t>(opts_.seq_len) + 1;
  const uint64_t start = src.sample_order[j] * static_cast<uint64_t>(opts_.seq_len);
  Sample out;
  out.source = static_cast<uint32_t>(s);
  out.tokens.resize(n);
  size_t p = static_cast<size_t>(std::upper_bound(src.cum.begin(), src.cum.end(), start) - src.cum.begin()) - 1;
  for (uint64_t filled = 0; filled < n; ++p) {
    const uint64_t off = start + filled - src.cum[p];  // into document order[p]
    const uint64_t take = std::min(src.cum[p + 1] - src.cum[p] - off, n - filled);
    if (off == 0) out.doc_starts.push_back(static_cast<int32_t>(filled));
    src.shard.read(src.shard.doc_offset(src.order[p]) + off, take, out.tokens.data() + filled);
    filled += take;
  }
  return out;
}

size_t PretrainDataset::pick() const {
  size_t best = 0;
  double best_deficit = -INFINITY;
  for (size_t i = 0; i < sources_.size(); ++i) {
    const double deficit = weights_[i] * static_cast<double>(consumed_ + 1) - static_cast<double>(taken_[i]);
    if (deficit > best_deficit) best = i, best_deficit = deficit;
  }
  return best;
}

Sample PretrainDataset::next() {
  const size_t s = pick();
  Sample out = sample(s, taken_[s]);
  ++taken_[s];
  ++consumed_;
  return out;
}

std::vector<Sample> PretrainDataset::next_batch(size_t batch_size) {
  std::vector<Sample> batch;
  batch.reserve(batch_size);
  for (size_t i = 0; i < batch_size; ++i) batch.push_back(next());
  return batch;
}

void PretrainDataset::skip(uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    ++taken_[pick()];
    ++consumed_;
  }
}

PretrainState PretrainDataset::state() const {
  return {consumed_, taken_, opts_.seed, opts_.seq_len, opts_.split};
}

void PretrainDataset::restore(const PretrainState& st) {
  auto mismatch = [](const char* field, const std::string& got, const std::string& want) {
    return file_error("data state", field, "is " + got + " but the dataset has " + want);
  };
  if (st.seed != opts_.seed) throw mismatch("seed", std::to_string(st.seed), std::to_string(opts_.seed));
  if (st.seq_len != opts_.seq_len)
    throw mismatch("seq_len", std::to_string(st.seq_len), std::to_string(opts_.seq_len));
  if (st.split != opts_.split) throw mismatch("split", split_name(st.split), split_name(opts_.split));
  if (st.source_samples.size() != sources_.size())
    throw mismatch("source_samples", std::to_string(st.source_samples.size()) + " sources",
                   std::to_string(sources_.size()));
  uint64_t sum = 0;
  for (uint64_t c : st.source_samples) sum += c;
  if (sum != st.samples_consumed)
    throw file_error("data state", "source_samples",
                     "sum to " + std::to_string(sum) + ", not samples_consumed = " +
                         std::to_string(st.samples_consumed));
  consumed_ = st.samples_consumed;
  taken_ = st.source_samples;
}

}  // namespace lf::data
