// processor.h: transformers 5.24's CLIP / SigLIP / Qwen2-VL image processors (image_processing_*.py and
// image_processing_backends.py), both backends, re-expressed on ATen tensors.
#include "loongforge/data/image/processor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "loongforge/data/image/decode.h"

namespace lf::data::image {

namespace {

namespace fs = std::filesystem;

const char* kClip = "CLIPImageProcessor";
const char* kSiglip = "SiglipImageProcessor";
const char* kQwen2VL = "Qwen2VLImageProcessor";
constexpr std::array<double, 3> kOpenAIClipMean{0.48145466, 0.4578275, 0.40821073};
constexpr std::array<double, 3> kOpenAIClipStd{0.26862954, 0.26130258, 0.27577711};
constexpr std::array<double, 3> kImagenetStandard{0.5, 0.5, 0.5};

// config.json's model_type -> image processor class, for folders whose preprocessor_config.json names none
// (transformers' IMAGE_PROCESSOR_MAPPING, the entries of these classes).
const std::map<std::string, std::string>& model_type_classes() {
  static const std::map<std::string, std::string> m{
      {"clip", kClip},         {"siglip", kSiglip},     {"paligemma", kSiglip}, {"qwen2_vl", kQwen2VL},
      {"qwen2_5_vl", kQwen2VL}, {"qwen3_vl", kQwen2VL}, {"qwen3_5", kQwen2VL}, {"qwen3_5_moe", kQwen2VL},
  };
  return m;
}

// transformers' get_size_dict: a dict with one of the valid key sets, an int (square or shortest edge), [h, w].
ImageSize parse_size(const JsonReader& r, const std::string& key, bool default_to_square, bool patches) {
  const nlohmann::json& v = r.required(key);
  ImageSize s;
  if (v.is_number_integer()) {
    if (default_to_square) s.height = s.width = v.get<int64_t>();
    else s.shortest_edge = v.get<int64_t>();
  } else if (v.is_array() && v.size() == 2 && v[0].is_number_integer() && v[1].is_number_integer()) {
    s.height = v[0].get<int64_t>(), s.width = v[1].get<int64_t>();
  } else if (v.is_object()) {
    const JsonReader o = r.object(key);
    std::vector<std::string> keys;
    for (const auto& [k, _] : v.items()) keys.push_back(k);
    std::sort(keys.begin(), keys.end());
    using K = std::vector<std::string>;
    if (keys == K{"height", "width"}) s.height = o.integer("height"), s.width = o.integer("width");
    else if (keys == K{"shortest_edge"}) s.shortest_edge = o.integer("shortest_edge");
    else if (keys == K{"longest_edge", "shortest_edge"})
      s.shortest_edge = o.integer("shortest_edge"), s.longest_edge = o.integer("longest_edge");
    else
      r.fail(key, std::string("unsupported keys (expected ") +
                      (patches ? "shortest_edge and longest_edge; min_pixels / max_pixels go at the top level)"
                               : "height and width, shortest_edge, or shortest_edge and longest_edge)"));
  } else {
    r.fail(key, "expected an object, an integer or [height, width]");
  }
  for (int64_t x : {s.height, s.width, s.shortest_edge, s.longest_edge})
    if (x < 0) r.fail(key, "sizes must be positive");
  return s;
}

std::array<double, 3> parse_triplet(const JsonReader& r, const std::string& key, std::array<double, 3> dflt) {
  if (!r.has(key)) return dflt;
  const nlohmann::json& v = r.required(key);
  if (v.is_number()) return {v.get<double>(), v.get<double>(), v.get<double>()};
  if (!v.is_array() || v.size() != 3 || !v[0].is_number() || !v[1].is_number() || !v[2].is_number())
    r.fail(key, "expected a number or a list of 3 numbers (one per RGB channel)");
  return {v[0].get<double>(), v[1].get<double>(), v[2].get<double>()};
}

// transformers' get_resize_output_image_size (default_to_square=False) and get_size_with_aspect_ratio.
std::pair<int64_t, int64_t> shortest_edge_size(int64_t h, int64_t w, int64_t size, int64_t max_size) {
  if (max_size > 0) {
    const double lo = static_cast<double>(std::min(h, w)), hi = static_cast<double>(std::max(h, w));
    double raw = 0;
    bool capped = false;
    if (hi / lo * static_cast<double>(size) > static_cast<double>(max_size)) {
      raw = static_cast<double>(max_size) * lo / hi;
      size = static_cast<int64_t>(std::nearbyint(raw)), capped = true;
    }
    if ((h <= w && h == size) || (w <= h && w == size)) return {h, w};
    auto other = [&](int64_t num, int64_t den) {
      return static_cast<int64_t>((capped ? raw : static_cast<double>(size)) * static_cast<double>(num) /
                                  static_cast<double>(den));
    };
    if (w < h) return {other(h, w), size};
    return {size, other(w, h)};
  }
  const int64_t lo = std::min(h, w), hi = std::max(h, w);
  const int64_t long_side = static_cast<int64_t>(static_cast<double>(size * hi) / static_cast<double>(lo));
  return w <= h ? std::pair{long_side, size} : std::pair{size, long_side};
}

}  // namespace

Backend backend_from_name(const std::string& name) {
  if (name == "pil") return Backend::pil;
  if (name == "torchvision") return Backend::torchvision;
  throw Error("image processor backend '" + name + "': expected pil or torchvision");
}

ImageProcessorConfig ImageProcessorConfig::defaults(const std::string& class_name) {
  ImageProcessorConfig c;
  c.class_name = class_name;
  if (class_name == kClip) {
    c.size.shortest_edge = 224, c.do_center_crop = true, c.crop_size.height = c.crop_size.width = 224;
    c.image_mean = kOpenAIClipMean, c.image_std = kOpenAIClipStd;
  } else if (class_name == kSiglip) {
    c.size.height = c.size.width = 224;
    c.image_mean = c.image_std = kImagenetStandard;
  } else if (class_name == kQwen2VL) {
    c.size.shortest_edge = 56 * 56, c.size.longest_edge = 28 * 28 * 1280;
    c.image_mean = kOpenAIClipMean, c.image_std = kOpenAIClipStd;
  } else {
    throw Error("image processor class '" + class_name + "' is not supported (supported: " + kClip + ", " + kSiglip +
                ", " + kQwen2VL + ")");
  }
  return c;
}

ImageProcessorConfig ImageProcessorConfig::from_json(const nlohmann::json& j, const std::string& class_name,
                                                     const std::string& file) {
  ImageProcessorConfig c = defaults(class_name);
  const JsonReader r(j, file);
  if (!j.is_object()) r.fail("", "expected a JSON object");
  const bool square = r.boolean("default_to_square", false);  // False in all three classes
  c.do_resize = r.boolean("do_resize", c.do_resize);
  c.do_center_crop = r.boolean("do_center_crop", c.do_center_crop);
  c.do_rescale = r.boolean("do_rescale", c.do_rescale);
  c.do_normalize = r.boolean("do_normalize", c.do_normalize);
  c.do_pad = r.boolean("do_pad", false);
  c.rescale_factor = r.number("rescale_factor", c.rescale_factor);
  c.image_mean = parse_triplet(r, "image_mean", c.image_mean);
  c.image_std = parse_triplet(r, "image_std", c.image_std);
  for (double s : c.image_std)
    if (s == 0.0) r.fail("image_std", "a standard deviation of 0");
  if (r.has("resample")) c.resample = filter_from_pil(r.integer("resample"), file + ": field 'resample'");
  if (c.patches()) {
    c.patch_size = r.integer("patch_size", c.patch_size);
    c.temporal_patch_size = r.integer("temporal_patch_size", c.temporal_patch_size);
    c.merge_size = r.integer("merge_size", c.merge_size);
    for (const char* k : {"patch_size", "temporal_patch_size", "merge_size"})
      if (r.has(k) && r.integer(k) <= 0) r.fail(k, "must be positive");
    // Qwen2VLImageProcessor.__init__: min_pixels / max_pixels override size's shortest_edge / longest_edge.
    nlohmann::json size = r.has("size") ? j.at("size") : nlohmann::json{{"shortest_edge", c.size.shortest_edge},
                                                                        {"longest_edge", c.size.longest_edge}};
    for (const auto& [key, edge] : {std::pair{"min_pixels", "shortest_edge"}, {"max_pixels", "longest_edge"}})
      if (r.has(key) && size.is_object()) size[edge] = r.integer(key), size.erase(key);
    const nlohmann::json wrapped{{"size", size}};
    c.size = parse_size(JsonReader(wrapped, file), "size", square, true);
    if (c.do_resize && (c.size.shortest_edge <= 0 || c.size.longest_edge <= 0))
      r.fail("size", "needs shortest_edge and longest_edge (min and max pixels)");
  } else {
    if (r.has("size")) c.size = parse_size(r, "size", square, false);
    if (r.has("crop_size")) c.crop_size = parse_size(r, "crop_size", true, false);
    if (r.has("pad_size")) c.pad_size = parse_size(r, "pad_size", true, false);
    if (c.do_center_crop && (c.crop_size.height <= 0 || c.crop_size.width <= 0))
      r.fail("crop_size", "do_center_crop needs a crop_size with height and width");
    if (c.do_resize && c.size.height <= 0 && c.size.shortest_edge <= 0)
      r.fail("size", "needs height and width or shortest_edge");
  }
  return c;
}

ImageProcessorConfig load_image_processor_config(const std::string& dir) {
  const fs::path p(dir);
  fs::path folder = p, file;
  std::error_code ec;
  if (fs::is_regular_file(p, ec)) {
    folder = p.parent_path(), file = p;
  } else if (!fs::is_directory(p, ec)) {
    throw Error(dir + ": no such model folder");
  }
  nlohmann::json cfg;
  // transformers reads processor_config.json's "image_processor" first, then preprocessor_config.json.
  if (file.empty() && fs::exists(folder / "processor_config.json", ec)) {
    nlohmann::json proc = read_json_file((folder / "processor_config.json").string());
    if (proc.is_object() && proc.contains("image_processor"))
      cfg = proc["image_processor"], file = folder / "processor_config.json";
  }
  if (file.empty()) {
    file = folder / "preprocessor_config.json";
    if (!fs::exists(file, ec))
      throw Error(dir + ": no preprocessor_config.json (the image processor's settings; a Hugging Face vision model's "
                        "folder has one)");
  }
  if (cfg.is_null()) cfg = read_json_file(file.string());
  const JsonReader r(cfg, file.string());
  if (!cfg.is_object()) r.fail("", "expected a JSON object");
  std::string cls;
  if (r.has("image_processor_type")) {
    cls = r.string("image_processor_type");
    for (const std::string suffix : {"Fast", "Pil"})
      if (cls.size() > suffix.size() && cls.ends_with(suffix)) cls.resize(cls.size() - suffix.size());
  } else if (r.has("feature_extractor_type")) {
    cls = r.string("feature_extractor_type");
    if (auto pos = cls.find("FeatureExtractor"); pos != std::string::npos) cls.replace(pos, 16, "ImageProcessor");
  } else {
    const fs::path config = folder / "config.json";
    if (!fs::exists(config, ec))
      r.fail("image_processor_type", "missing, and " + folder.string() + " has no config.json to take it from");
    const nlohmann::json model = read_json_file(config.string());
    const std::string type = JsonReader(model, config.string()).string("model_type");
    auto it = model_type_classes().find(type);
    if (it == model_type_classes().end())
      r.fail("image_processor_type", "missing, and config.json's model_type '" + type + "' has no image processor "
                                     "here (known: clip, siglip, paligemma, qwen2_vl, qwen2_5_vl, qwen3_vl)");
    cls = it->second;
  }
  if (cls != kClip && cls != kSiglip && cls != kQwen2VL)
    r.fail(r.has("image_processor_type") ? "image_processor_type" : "feature_extractor_type",
           "unsupported class '" + cls + "' (supported: " + kClip + ", " + kSiglip + ", " + kQwen2VL + ")");
  return ImageProcessorConfig::from_json(cfg, cls, file.string());
}

std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels,
                                         int64_t max_pixels) {
  const double h = static_cast<double>(height), w = static_cast<double>(width), f = static_cast<double>(factor);
  if (std::max(h, w) / std::min(h, w) > 200)
    throw Error("smart_resize: absolute aspect ratio must be smaller than 200, got " +
                std::to_string(std::max(h, w) / std::min(h, w)) + " (" + std::to_string(height) + "x" +
                std::to_string(width) + ")");
  // Python's round() rounds half to even, as nearbyint in the default rounding mode.
  int64_t hb = static_cast<int64_t>(std::nearbyint(h / f)) * factor;
  int64_t wb = static_cast<int64_t>(std::nearbyint(w / f)) * factor;
  if (hb * wb > max_pixels) {
    const double beta = std::sqrt(static_cast<double>(height * width) / static_cast<double>(max_pixels));
    hb = std::max(factor, static_cast<int64_t>(std::floor(h / beta / f)) * factor);
    wb = std::max(factor, static_cast<int64_t>(std::floor(w / beta / f)) * factor);
  } else if (hb * wb < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / static_cast<double>(height * width));
    hb = static_cast<int64_t>(std::ceil(h * beta / f)) * factor;
    wb = static_cast<int64_t>(std::ceil(w * beta / f)) * factor;
  }
  return {hb, wb};
}

ImageProcessor::ImageProcessor(ImageProcessorConfig config, Backend backend)
    : cfg_(std::move(config)), backend_(backend) {}

std::pair<int64_t, int64_t> ImageProcessor::resized_size(int64_t height, int64_t width) const {
  if (!cfg_.do_resize) return {height, width};
  const ImageSize& s = cfg_.size;
  if (cfg_.patches()) return smart_resize(height, width, cfg_.patch_size * cfg_.merge_size, s.shortest_edge,
                                          s.longest_edge);
  if (s.shortest_edge > 0) return shortest_edge_size(height, width, s.shortest_edge, s.longest_edge);
  return {s.height, s.width};
}

std::pair<int64_t, int64_t> ImageProcessor::patch_grid(int64_t height, int64_t width) const {
  auto [h, w] = resized_size(height, width);
  return {h / cfg_.patch_size, w / cfg_.patch_size};
}

at::Tensor ImageProcessor::resize(const at::Tensor& image) const {
  auto [h, w] = resized_size(image.size(0), image.size(1));
  return backend_ == Backend::pil ? resize_pil(image, h, w, cfg_.resample)
                                  : resize_torchvision(image, h, w, cfg_.resample);
}

// CHW uint8 -> crop_size; an image smaller than the crop is padded with zeros, each backend placing it its way.
at::Tensor ImageProcessor::center_crop(const at::Tensor& chw) const {
  const int64_t h = chw.size(1), w = chw.size(2), ch = cfg_.crop_size.height, cw = cfg_.crop_size.width;
  auto floordiv2 = [](int64_t v) { return v >= 0 ? v / 2 : -((-v + 1) / 2); };
  int64_t top, left;  // where the crop starts in the image (negative: zero padding above / left)
  if (backend_ == Backend::pil) {
    top = floordiv2(h - ch), left = floordiv2(w - cw);  // numpy center_crop; pads by ceil(missing / 2) before
    if (top < 0) top = -((ch - h + 1) / 2);
    if (left < 0) left = -((cw - w + 1) / 2);
  } else {
    // torchvision: pad (missing / 2) before, then crop at int((size - crop) / 2.0).
    const int64_t pad_top = ch > h ? (ch - h) / 2 : 0, pad_left = cw > w ? (cw - w) / 2 : 0;
    const int64_t ph = std::max(h, ch), pw = std::max(w, cw);
    top = static_cast<int64_t>((ph - ch) / 2.0) - pad_top, left = static_cast<int64_t>((pw - cw) / 2.0) - pad_left;
  }
  if (top >= 0 && left >= 0 && top + ch <= h && left + cw <= w)
    return chw.narrow(1, top, ch).narrow(2, left, cw);
  at::Tensor out = at::zeros({chw.size(0), ch, cw}, chw.options());
  const int64_t y0 = std::max<int64_t>(top, 0), x0 = std::max<int64_t>(left, 0);
  const int64_t y1 = std::min(top + ch, h), x1 = std::min(left + cw, w);
  if (y1 > y0 && x1 > x0)
    out.narrow(1, y0 - top, y1 - y0)
        .narrow(2, x0 - left, x1 - x0)
        .copy_(chw.narrow(1, y0, y1 - y0).narrow(2, x0, x1 - x0));
  return out;
}

// CHW uint8 -> float32 as each backend computes it (numpy: x * scale in float64 then float32, then (x - mean) / std in
// float32; torchvision: mean and std divided by the scale in float32, folded into one (x - mean') / std').
at::Tensor ImageProcessor::rescale_normalize(const at::Tensor& chw) const {
  if (!cfg_.do_rescale && !cfg_.do_normalize) return chw.contiguous();
  auto channel_vec = [](const std::array<double, 3>& v) {
    return at::tensor(std::vector<float>{static_cast<float>(v[0]), static_cast<float>(v[1]),
                                         static_cast<float>(v[2])}).view({3, 1, 1});
  };
  at::Tensor mean = channel_vec(cfg_.image_mean), std = channel_vec(cfg_.image_std);
  if (backend_ == Backend::torchvision) {
    if (cfg_.do_rescale && !cfg_.do_normalize) return at::mul(chw, at::Scalar(cfg_.rescale_factor));
    if (cfg_.do_rescale) {
      mean = at::mul(mean, at::Scalar(1.0 / cfg_.rescale_factor));
      std = at::mul(std, at::Scalar(1.0 / cfg_.rescale_factor));
    }
    return chw.to(at::kFloat).sub_(mean).div_(std);
  }
  at::Tensor x = cfg_.do_rescale ? chw.to(at::kDouble).mul_(cfg_.rescale_factor).to(at::kFloat) : chw.to(at::kFloat);
  return cfg_.do_normalize ? x.sub_(mean).div_(std) : x;
}

// CHW -> [grid_h * grid_w, C * T * P * P]: rows by merge window, then by patch inside the window; columns C, T, P, P.
at::Tensor ImageProcessor::patchify(const at::Tensor& chw) const {
  const int64_t c = chw.size(0), h = chw.size(1), w = chw.size(2);
  const int64_t p = cfg_.patch_size, m = cfg_.merge_size, t = cfg_.temporal_patch_size;
  if (h % (p * m) != 0 || w % (p * m) != 0)
    throw Error(cfg_.class_name + ": a " + std::to_string(h) + "x" + std::to_string(w) + " image does not divide " +
                "into " + std::to_string(p * m) + "-pixel merge windows (patch_size * merge_size; do_resize is off)");
  const int64_t gh = h / p, gw = w / p;
  return chw.to(at::kFloat)
      .reshape({c, gh / m, m, p, gw / m, m, p})
      .permute({1, 4, 2, 5, 0, 3, 6})
      .unsqueeze(5)
      .expand({gh / m, gw / m, m, m, c, t, p, p})
      .reshape({gh * gw, c * t * p * p});
}

ProcessedImages ImageProcessor::preprocess(const std::vector<at::Tensor>& images) const {
  if (images.empty()) throw Error(cfg_.class_name + ": no images to process");
  std::vector<at::Tensor> out;
  std::vector<int64_t> grids;
  for (size_t i = 0; i < images.size(); ++i) {
    const at::Tensor& img = images[i];
    if (img.dim() != 3 || img.size(2) != 3 || img.scalar_type() != at::kByte)
      throw Error(cfg_.class_name + ": image " + std::to_string(i) + ": expected uint8 [H, W, 3] (RGB)");
    at::Tensor chw = (cfg_.do_resize ? resize(img) : img).permute({2, 0, 1});
    if (cfg_.patches()) {
      out.push_back(patchify(rescale_normalize(chw)));
      grids.insert(grids.end(), {1, chw.size(1) / cfg_.patch_size, chw.size(2) / cfg_.patch_size});
      continue;
    }
    if (cfg_.do_center_crop) chw = center_crop(chw);
    out.push_back(rescale_normalize(chw));
  }
  ProcessedImages r;
  if (cfg_.patches()) {
    r.pixel_values = at::cat(out, 0);
    r.image_grid_thw = at::tensor(grids, at::kLong).view({static_cast<int64_t>(images.size()), 3});
    return r;
  }
  if (cfg_.do_pad) {  // zeros below and right of each processed image, up to pad_size or the largest image
    int64_t ph = cfg_.pad_size.height, pw = cfg_.pad_size.width;
    for (const at::Tensor& x : out) {
      if (cfg_.pad_size.height <= 0) ph = std::max(ph, x.size(1)), pw = std::max(pw, x.size(2));
      if (x.size(1) > ph || x.size(2) > pw) throw Error(cfg_.class_name + ": pad_size is smaller than an image");
    }
    for (at::Tensor& x : out) x = at::constant_pad_nd(x, {0, pw - x.size(2), 0, ph - x.size(1)}, 0);
  }
  for (size_t i = 1; i < out.size(); ++i)
    if (out[i].sizes() != out[0].sizes())
      throw Error(cfg_.class_name + ": processed images differ in size (" + std::to_string(out[0].size(1)) + "x" +
                  std::to_string(out[0].size(2)) + " and " + std::to_string(out[i].size(1)) + "x" +
                  std::to_string(out[i].size(2)) + "): they cannot form one pixel_values tensor (set a fixed size, "
                  "a center crop or do_pad)");
  r.pixel_values = at::stack(out, 0);
  return r;
}

ProcessedImages ImageProcessor::preprocess_files(const std::vector<std::string>& paths) const {
  std::vector<at::Tensor> images;
  for (const std::string& p : paths) images.push_back(read_image(p, Alpha::white));
  return preprocess(images);
}

}  // namespace lf::data::image
