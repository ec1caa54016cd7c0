// Block-quantized checkpoints: config.json's quantization_config with quant_method "fp8" (DeepSeek-V3 / V3.1 / V4,
// Qwen3-FP8, GLM-FP8, MiniMax-M2, ...). A weight W stored as FP8 (e4m3 / e5m2) or as packed FP4 (e2m1, two values per
// byte, low nibble first: MXFP4 experts) has a sibling `W_scale_inv` of per-block scales (float32 / bf16, or E8M0
// exponents: 2^(byte - 127)); W = q * scale block by block. Loading dequantizes to the model's dtype, as transformers
// does on a machine without FP8 matmuls; training and export then see plain weights (exports drop the
// quantization_config). The scales may also be stored as `M.scale` / `M.qscale_weight` for weight `M.weight` (DeepSeek-V4's
// files). A grid that fits the config's weight_block_size with a partial last block (DeepSeek's ceil grid) uses that
// block; otherwise the block is the weight's shape divided by the grid (MXFP4 experts' [1, 32] beside [128, 128]).
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "loongforge/io/safetensors.h"

namespace lf::io {

struct Quantization {
  bool fp8 = false;                          // quant_method "fp8": weights with a `_scale_inv` sibling dequantize
  int64_t block_rows = 0, block_cols = 0;    // weight_block_size (0: derived from each scale grid)
};

// The quantization_config of DIR/config.json (none: {}); a method other than fp8 is a one-line error naming the
// file and the field.
Quantization read_quantization(const std::string& dir);

// Whether checkpoint tensor KEY is quantization data rather than a parameter: the scales beside a quantized weight,
// or an activation / input scale.
bool is_quantization_tensor(const Quantization& q, const SafetensorsCheckpoint& ckpt, const std::string& key);

// Whether KEY is stored quantized (it has block scales beside it).
bool is_quantized(const Quantization& q, const SafetensorsCheckpoint& ckpt, const std::string& key);

// The shape KEY has once dequantized (packed FP4: the last dimension doubled).
std::vector<int64_t> dequantized_shape(const SafetensorsCheckpoint& ckpt, const std::string& key);

// KEY dequantized in float32. WHERE names the tensor in errors (a bad dtype or a scale grid that fits no block).
at::Tensor dequantize(const Quantization& q, const SafetensorsCheckpoint& ckpt, const std::string& key,
                      const std::string& where);

// The same for raw tensors (tests): values FP8 / packed FP4, scales float / bf16 / E8M0 / uint8 exponents.
at::Tensor dequantize_blocks(const at::Tensor& values, const at::Tensor& scales, int64_t block_rows,
                             int64_t block_cols, const std::string& where);

}  // namespace lf::io
