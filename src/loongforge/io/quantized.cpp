#include "loongforge/io/quantized.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <limits>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"

namespace lf::io {
namespace fs = std::filesystem;

namespace {
const char kScaleSuffix[] = "_scale_inv";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
bool fp4_packed(at::ScalarType t) { return t == at::kChar || t == at::kByte; }

// Two e2m1 values per byte, low nibble first -> float32, the last dimension doubled.
at::Tensor unpack_fp4(const at::Tensor& packed) {
  static const float kLut[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  at::Tensor bytes = packed.contiguous().view(at::kByte);
  at::Tensor lut = at::from_blob(const_cast<float*>(kLut), {16}, at::kFloat);
  at::Tensor low = at::bitwise_and(bytes, 0xF).to(at::kLong), high = at::bitwise_right_shift(bytes, 4).to(at::kLong);
  at::Tensor out = at::stack({lut.index_select(0, low.flatten()).view(low.sizes()),
                              lut.index_select(0, high.flatten()).view(high.sizes())}, -1);
  std::vector<int64_t> shape(packed.sizes().begin(), packed.sizes().end());
  shape.back() *= 2;
  return out.reshape(shape);
}

at::Tensor scales_to_float(const at::Tensor& s) {
  if (s.scalar_type() == at::kFloat8_e8m0fnu || s.scalar_type() == at::kByte) {  // E8M0: 2^(e - 127), 0xFF NaN
    at::Tensor e = s.contiguous().view(at::kByte).to(at::kFloat);
    return at::where(e == 255.0f, at::full({}, std::numeric_limits<float>::quiet_NaN()), at::exp2(e - 127.0f));
  }
  return s.to(at::kFloat);
}
}  // namespace

Quantization read_quantization(const std::string& dir) {
  const fs::path cfg = fs::path(dir) / "config.json";
  Quantization q;
  if (!fs::exists(cfg)) return q;
  const nlohmann::json c = read_json_file(cfg.string());
  if (!c.is_object() || !c.contains("quantization_config") || c["quantization_config"].is_null()) return q;
  const nlohmann::json& qc = c["quantization_config"];
  const std::string where = cfg.string() + ": quantization_config";
  if (!qc.is_object()) throw Error(where + " must be an object");
  const std::string method = qc.contains("quant_method") && qc["quant_method"].is_string() ? qc["quant_method"].get<std::string>() : "";
  if (method != "fp8")
    throw Error(where + ".quant_method '" + method + "' is not supported (block-scaled fp8 checkpoints are; "
                "dequantize the checkpoint first)");
  if (qc.contains("activation_scheme") && qc["activation_scheme"].is_string() &&
      qc["activation_scheme"].get<std::string>() != "dynamic")
    throw Error(where + ".activation_scheme '" + qc["activation_scheme"].get<std::string>() +
                "' is not supported (dynamic is)");
  q.fp8 = true;
  if (qc.contains("weight_block_size") && !qc["weight_block_size"].is_null()) {
    const auto& b = qc["weight_block_size"];
    if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
        b[0].get<int64_t>() <= 0 || b[1].get<int64_t>() <= 0)
      throw Error(where + ".weight_block_size must be two positive integers");
    q.block_rows = b[0].get<int64_t>();
    q.block_cols = b[1].get<int64_t>();
  }
  return q;
}

namespace {
bool quantized_dtype(const std::string& dt) { return dt.rfind("F8_", 0) == 0 || dt == "I8" || dt == "U8"; }

// The scale tensor of weight KEY: `KEY_scale_inv` (transformers' name), or for `M.weight` stored as FP8 / packed FP4
// `M.scale` (DeepSeek-V4's files) or `M.qscale_weight`; "" when KEY is not quantized.
std::string scale_of(const Quantization& q, const SafetensorsCheckpoint& ckpt, const std::string& key) {
  if (!q.fp8) return "";
  if (ckpt.contains(key + kScaleSuffix)) return key + kScaleSuffix;
  if (!ends_with(key, ".weight") || !quantized_dtype(ckpt.dtype(key))) return "";
  const std::string base = key.substr(0, key.size() - 7);
  for (const char* tail : {".scale", ".qscale_weight"})
    if (ckpt.contains(base + tail)) return base + tail;
  return "";
}
}  // namespace

bool is_quantization_tensor(const Quantization& q, const SafetensorsCheckpoint& ckpt, const std::string& key) {
  if (!q.fp8) return false;
  if (ends_with(key, kScaleSuffix)) return ckpt.contains(key.substr(0, key.size() - sizeof(kScaleSuffix) + 1));
  for (const std::string tail : {".scale", ".qscale_weight"}) {
    if (!ends_with(key, tail)) continue;
    const std::string weight = key.substr(0, key.size() - tail.size()) + ".weight";
    if (ckpt.contains(weight) && scale_of(q, ckpt, weight) == key) return true;
  }
  return ends_with(key, ".input_scale") || ends_with(key, ".activation_scale");
}

bool is_quantized(const Quantization& q, const SafetensorsCheckpoint& ckpt, const std::string& key) {
  return !scale_of(q, ckpt, key).empty();
}

std::vector<int64_t> dequantized_shape(const SafetensorsCheckpoint& ckpt, const std::string& key) {
  std::vector<int64_t> shape = ckpt.shape(key);
  const std::string dt = ckpt.dtype(key);
  if ((dt == "I8" || dt == "U8") && !shape.empty()) shape.back() *= 2;
  return shape;
}

at::Tensor dequantize_blocks(const at::Tensor& values_in, const at::Tensor& scales_in, int64_t block_rows,
                             int64_t block_cols, const std::string& where) {
  at::Tensor values;
  switch (values_in.scalar_type()) {
    case at::kFloat8_e4m3fn:
    case at::kFloat8_e5m2:
    case at::kFloat8_e4m3fnuz:
    case at::kFloat8_e5m2fnuz:
      values = values_in.to(at::kFloat);
      break;
    default:
      if (!fp4_packed(values_in.scalar_type()))
        throw Error(where + ": has block scales but is stored as " + std::string(c10::toString(values_in.scalar_type())) +
                    ", not FP8 or packed FP4");
      values = unpack_fp4(values_in);
  }
  if (values.dim() < 2) throw Error(where + ": a quantized weight must have at least 2 dimensions");
  at::Tensor s = scales_to_float(scales_in);
  if (s.dim() < 2) s = s.reshape({1, 1});
  const int64_t rows = values.size(-2), cols = values.size(-1), sr = s.size(-2), sc = s.size(-1);
  const int64_t lead = values.numel() / std::max<int64_t>(rows * cols, 1);
  if (sr <= 0 || sc <= 0 || s.numel() / (sr * sc) != lead)
    throw Error(where + ": the scale grid does not match the weight's leading dimensions");
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  int64_t bm = 0, bn = 0;
  if (block_rows > 0 && ceil_div(rows, block_rows) == sr && ceil_div(cols, block_cols) == sc) {
    bm = block_rows;
    bn = block_cols;
  } else if (rows % sr == 0 && cols % sc == 0) {  // the block from the grid (MXFP4 experts: [1, 32])
    bm = rows / sr;
    bn = cols / sc;
  } else {
    throw Error(where + ": scale grid [" + std::to_string(sr) + ", " + std::to_string(sc) + "] fits no block of the [" +
                std::to_string(rows) + ", " + std::to_string(cols) + "] weight");
  }
  at::Tensor full = s.reshape({lead, sr, sc}).repeat_interleave(bm, 1).repeat_interleave(bn, 2).narrow(1, 0, rows).narrow(2, 0, cols);
  return (values.reshape({lead, rows, cols}) * full).reshape(values.sizes());
}

at::Tensor dequantize(const Quantization& q, const SafetensorsCheckpoint& ckpt, const std::string& key,
                      const std::string& where) {
  const std::string scale = scale_of(q, ckpt, key);
  if (scale.empty()) throw Error(where + ": has no block scales");
  return dequantize_blocks(ckpt.tensor(key), ckpt.tensor(scale), q.block_rows, q.block_cols, where);
}

}  // namespace lf::io
