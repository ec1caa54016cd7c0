// Rotary position embeddings (RoPE) with the scaling types of transformers' modeling_rope_utils: default, linear,
// dynamic (NTK), llama3 and yarn. Frequencies are computed in float32 with the same ATen ops as transformers.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace lf::nn {

struct RopeSpec {
  std::string type = "default";
  double theta = 10000.0, factor = 1.0;
  int64_t head_dim = 0, max_position_embeddings = 0, original_max_position_embeddings = 0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;                      // llama3
  double beta_fast = 32.0, beta_slow = 1.0;                                  // yarn
  double attention_factor = -1, mscale = 0, mscale_all_dim = 0;             // yarn (<= 0: unset)
  bool truncate = true;                                                      // yarn
  // Multimodal RoPE (Qwen2-VL / 2.5-VL): the rotary frequencies split into temporal / height / width sections
  // (sizes summing to head_dim / 2), each rotated by its own row of [3, B, T] positions.
  std::vector<int64_t> mrope_section;
  // Qwen3-VL: the sections interleave instead (frequency j from the height row when j % 3 == 1 and
  // j < 3 * mrope_section[1], from the width row when j % 3 == 2 and j < 3 * mrope_section[2], else temporal).
  bool mrope_interleaved = false;
};

class Rotary {
 public:
  explicit Rotary(RopeSpec spec);
  // cos, sin of shape [B, T, head_dim] (position_ids [B, T] int64), float32, times the attention scaling. With
  // mrope_section, position_ids may be [3, B, T] (temporal, height, width): frequency section i takes its angles
  // from row i % 3 (transformers' Qwen2-VL recomposition); [B, T] positions then act as three equal rows.
  std::pair<at::Tensor, at::Tensor> cos_sin(const at::Tensor& position_ids) const;
  const at::Tensor& inv_freq() const { return inv_freq_; }
  // Keeps the frequencies on `device` (the model's), so a forward there copies nothing from the host (a copy from
  // pageable memory would wait for the device, and a CUDA graph cannot capture it).
  void to(const at::Device& device);
  double attention_scaling() const { return scaling_; }

 private:
  at::Tensor compute_inv_freq(int64_t seq_len, double* scaling) const;
  RopeSpec spec_;
  at::Tensor inv_freq_;
  double scaling_ = 1.0;
};

// q*cos + rotate_half(q)*sin, with cos/sin [B,T,D] broadcast over heads of x [B,H,T,D]. Partial rotary (cos/sin
// narrower than x, as transformers' partial_rotary_factor): the first D features rotate, the others pass unchanged.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace lf::nn
