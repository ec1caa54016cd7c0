// Autoregressive generation with a key/value cache: greedy (temperature 0) or temperature + top-p sampling.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "loongforge/models/model.h"

namespace lf::models {

// Speculative decoding's counts: drafted tokens, drafts the main model accepted, main-model forwards.
struct DraftStats {
  int64_t drafted = 0, accepted = 0, main_forwards = 0;
};

struct GenerateOptions {
  int64_t max_new_tokens = 32;
  double temperature = 0.0;  // 0: greedy
  double top_p = 1.0;
  uint64_t seed = 0;
  std::vector<int64_t> stop_ids;  // generation ends after one of these
  // Vision-language models: the prompt's images as the model's batch schema takes them (pixel_values, and
  // image_grid_thw for patch models), in the order of its image runs (empty: none).
  Batch images;
  // Speculative decoding: the model's multi-token prediction layers draft, the main model verifies (greedy only; the
  // output equals plain greedy decoding). Counts go to draft_stats when set.
  bool mtp = false;
  DraftStats* draft_stats = nullptr;
};

// Returns the new token ids (prompt excluded). on_token, when set, is called with each new id as it is produced.
// Families that generate text (the decoder LMs, the vision-language models); others: lf::Error.
std::vector<int64_t> generate(Model& model, const std::vector<int64_t>& prompt, const GenerateOptions& opts,
                              const std::function<void(int64_t)>& on_token = {});

// A vision-language model's prompt for images of `run[i]` image tokens each: each image token of `prompt` (one per
// image, as users write "<image>" or Qwen's template writes <|image_pad|>) becomes the image's run of image tokens; a
// prompt already holding the full runs is kept; a prompt with no image token gets the runs first (each between the
// model's start / end tokens when it has them). lf::Error when the model takes no images or the counts do not fit.
std::vector<int64_t> expand_image_tokens(const Model& model, const std::vector<int64_t>& prompt,
                                         const std::vector<int64_t>& run);

// The vocabulary size and end-of-sequence ids of a model that generates text (lf::Error otherwise).
int64_t vocab_size(const Model& model);
std::vector<int64_t> eos_token_ids(const Model& model);

// Samples one id from logits [V] (float32): argmax at temperature 0, else softmax(logits/T) restricted to the
// smallest set of tokens whose probability reaches top_p (as transformers' TopPLogitsWarper).
int64_t sample_token(const at::Tensor& logits, double temperature, double top_p, at::Generator& gen);

}  // namespace lf::models
