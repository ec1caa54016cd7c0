// Pretraining samples from token shards (token_shards.h), Megatron-style, torch-free.
//
// Per source (one shard) and epoch e: the documents of the split are shuffled by (seed, source, e) and
// concatenated into one token stream of L tokens; sample j of the epoch covers the tokens
// [j*seq_len, j*seq_len + seq_len + 1) of that stream (consecutive samples share one token: the inputs are
// tokens[0, seq_len), the labels tokens[1, seq_len]); there are floor((L - 1) / seq_len) samples per epoch (the
// tail is dropped; the next epoch's order differs, so different tokens are dropped); the samples of an epoch are
// drawn in a shuffled order (seed, source, e). A blend draws from its sources by weight with Megatron's rule: draw
// t takes the source with the largest weight_i * (t + 1) - taken_i (the first on a tie), so the counts never lag
// the weights by a sample. Everything is a pure function of (options, samples consumed): exact resume.
//
// Split: a document is held out for validation when hash(split_seed, doc index) < valid_fraction, independent of
// `seed`, so changing the shuffle seed never moves documents between train and valid.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "loongforge/data/token_shards.h"

namespace lf::data {

struct BlendSource {
  std::string prefix;  // PREFIX.bin / PREFIX.idx
  double weight = 1.0;
};

enum class Split { Train, Valid };

struct PretrainOptions {
  std::vector<BlendSource> sources;
  int64_t seq_len = 2048;
  uint64_t seed = 1234;
  Split split = Split::Train;
  double valid_fraction = 0.0;  // in [0, 1)
  uint64_t split_seed = 0;
};

struct Sample {
  std::vector<int64_t> tokens;      // seq_len + 1 ids
  std::vector<int32_t> doc_starts;  // ascending positions in [0, seq_len] where a document begins (0 only if one
                                    // begins exactly there)
  uint32_t source = 0;              // index into PretrainOptions::sources
  bool operator==(const Sample&) const = default;
};

// Where the dataset is; enough to continue exactly. Serialised with the options' seed/seq_len/split so a restore
// into a differently configured dataset is refused.
struct PretrainState {
  uint64_t samples_consumed = 0;
  std::vector<uint64_t> source_samples;  // samples drawn from each source (they sum to samples_consumed)
  uint64_t seed = 0;
  int64_t seq_len = 0;
  Split split = Split::Train;

  nlohmann::json to_json() const;
  // WHERE names the origin in errors (e.g. "ckpt/step_100/data.json").
  static PretrainState from_json(const nlohmann::json& j, const std::string& where = "data state");
};

class PretrainDataset {
 public:
  // Opens and validates every shard; lf::Error (naming the shard / option) on a bad shard, a non-positive or
  // non-finite weight, seq_len < 1, valid_fraction outside [0, 1), or a source whose split has fewer than
  // seq_len + 1 tokens.
  explicit PretrainDataset(PretrainOptions options);
  ~PretrainDataset();

  Sample next();
  std::vector<Sample> next_batch(size_t batch_size);
  // Moves past the next n samples exactly as n calls of next() would, without reading their tokens.
  void skip(uint64_t n);
  // Sample K (0-based, counted over all epochs) of source S, without moving the dataset.
  Sample sample(size_t source, uint64_t k);

  PretrainState state() const;
  void restore(const PretrainState& state);  // lf::Error if the state does not belong to these options

  const PretrainOptions& options() const { return opts_; }
  size_t num_sources() const { return sources_.size(); }
  uint64_t samples_per_epoch(size_t source) const;
  uint64_t split_docs(size_t source) const;    // documents of the split (non-empty ones)
  uint64_t split_tokens(size_t source) const;  // tokens of one epoch's stream
  uint64_t epoch(size_t source) const;         // epoch of the next sample drawn from SOURCE
  // Whether document D of a shard is in the validation split for these options (pure function).
  static bool is_valid_doc(uint64_t split_seed, double valid_fraction, uint64_t doc);

 private:
  struct Source;
  size_t pick() const;
  PretrainOptions opts_;
  std::vector<std::unique_ptr<Source>> sources_;
  std::vector<double> weights_;  // normalised
  uint64_t consumed_ = 0;
  std::vector<uint64_t> taken_;
};

}  // namespace lf::data
