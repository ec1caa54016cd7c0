// Image transforms (transforms.h). The colour, sharpness and affine operations follow
// torchvision.transforms.v2.functional's tensor kernels step for step (the same ATen operations in the same order,
// so the results are the same bits).
#include "loongforge/data/robot/transforms.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "loongforge/core/error.h"

namespace lf::data::robot {

namespace {

void check_channels(const at::Tensor& images, const char* op) {
  if (images.dim() < 3) throw Error(std::string(op) + ": images must be [..., C, H, W]");
  int64_t c = images.size(-3);
  if (c != 1 && c != 3)
    throw Error(std::string(op) + ": images must have 1 or 3 channels ([..., C, H, W]), got " + std::to_string(c));
  if (!images.is_floating_point() && images.scalar_type() != at::kByte)
    throw Error(std::string(op) + ": images must be uint8 or floating point");
}

double max_value(const at::Tensor& t) { return t.is_floating_point() ? 1.0 : 255.0; }

// Luma of RGB [..., 3, H, W] as float: r * 0.2989 + g * 0.587 + b * 0.114 -> [..., 1, H, W].
at::Tensor grayscale(const at::Tensor& image) {
  auto rgb = image.unbind(-3);
  auto l = rgb[0].mul(0.2989).add_(rgb[1], 0.587).add_(rgb[2], 0.114);
  return l.unsqueeze(-3);
}

at::Tensor blend(const at::Tensor& image1, const at::Tensor& image2, double ratio) {
  bool fp = image1.is_floating_point();
  auto out = image1.mul(ratio).add_(image2, 1.0 - ratio).clamp_(0, max_value(image1));
  return fp ? out : out.to(image1.scalar_type());
}

at::Tensor rgb_to_hsv(const at::Tensor& image) {
  auto ch = image.unbind(-3);
  auto r = ch[0], g = ch[1];
  auto [minc, maxc] = at::aminmax(image, -3);
  auto eqc = maxc == minc;
  auto range = maxc - minc;
  auto ones = at::ones_like(maxc);
  auto s = range / at::where(eqc, ones, maxc);
  auto divisor = at::where(eqc, ones, range).unsqueeze_(-3);
  auto parts = ((maxc.unsqueeze(-3) - image) / divisor).unbind(-3);
  auto rc = parts[0], gc = parts[1], bc = parts[2];
  auto maxc_neq_r = maxc != r;
  auto maxc_eq_g = maxc == g;
  auto hg = rc.add(2.0).sub_(bc).mul_(maxc_eq_g & maxc_neq_r);
  auto hr = bc.sub_(gc).mul_(maxc_neq_r.logical_not());
  auto hb = gc.add_(4.0).sub_(rc).mul_(maxc_neq_r.logical_and_(maxc_eq_g.logical_not_()));
  auto h = hr.add_(hg).add_(hb);
  h = h.mul_(1.0 / 6.0).add_(1.0).fmod_(1.0);
  return at::stack({h, s, maxc}, -3);
}

at::Tensor hsv_to_rgb(const at::Tensor& img) {
  auto ch = img.unbind(-3);
  auto h = ch[0], s = ch[1], v = ch[2];
  auto h6 = h.mul(6);
  auto i = at::floor(h6);
  auto f = h6.sub_(i);
  i = i.to(at::kInt);
  auto sxf = s * f;
  auto one_minus_s = 1.0 - s;
  auto q = (1.0 - sxf).mul_(v).clamp_(0.0, 1.0);
  auto t = sxf.add_(one_minus_s).mul_(v).clamp_(0.0, 1.0);
  auto p = one_minus_s.mul_(v).clamp_(0.0, 1.0);
  i.remainder_(6);
  auto vpqt = at::stack({v, p, q, t}, -3);
  auto select = at::tensor({0, 2, 1, 1, 3, 0, 3, 0, 0, 2, 1, 1, 1, 1, 3, 0, 0, 2}, at::kLong).reshape({3, 6});
  select = select.index({at::indexing::Slice(), i});
  if (select.dim() > 3) select = select.movedim(0, -3);
  return vpqt.gather(-3, select);
}

}  // namespace

at::Tensor adjust_brightness(const at::Tensor& images, double factor) {
  check_channels(images, "adjust_brightness");
  if (factor < 0) throw OptionError("brightness", "factor " + std::to_string(factor) + " is negative");
  auto out = images.mul(factor).clamp_(0, max_value(images));
  return images.is_floating_point() ? out : out.to(images.scalar_type());
}

at::Tensor adjust_contrast(const at::Tensor& images, double factor) {
  check_channels(images, "adjust_contrast");
  if (factor < 0) throw OptionError("contrast", "factor " + std::to_string(factor) + " is negative");
  bool fp = images.is_floating_point();
  at::Tensor gray;
  if (images.size(-3) == 3) {
    gray = grayscale(images);
    if (!fp) gray = gray.floor_();
  } else {
    gray = fp ? images : images.to(at::kFloat);
  }
  auto mean = at::mean(gray, {-3, -2, -1}, true);
  return blend(images, mean, factor);
}

at::Tensor adjust_saturation(const at::Tensor& images, double factor) {
  check_channels(images, "adjust_saturation");
  if (factor < 0) throw OptionError("saturation", "factor " + std::to_string(factor) + " is negative");
  if (images.size(-3) == 1) return images;
  auto gray = grayscale(images);
  if (!images.is_floating_point()) gray = gray.floor_();
  return blend(images, gray, factor);
}

at::Tensor adjust_hue(const at::Tensor& images, double factor) {
  check_channels(images, "adjust_hue");
  if (!(factor >= -0.5 && factor <= 0.5)) throw OptionError("hue", "factor " + std::to_string(factor) + " is not in [-0.5, 0.5]");
  if (images.size(-3) == 1 || images.numel() == 0) return images;
  auto orig = images.scalar_type();
  at::Tensor x = images;
  if (orig == at::kByte)
    x = images.to(at::kFloat).mul_(1.0 / 255);
  else if (orig != at::kFloat)
    x = images.to(at::kFloat);
  auto hsv = rgb_to_hsv(x).unbind(-3);
  auto h = hsv[0], s = hsv[1], v = hsv[2];
  h.add_(factor).remainder_(1.0);
  auto out = hsv_to_rgb(at::stack({h, s, v}, -3));
  if (orig == at::kByte) return out.mul(255.0 + 1.0 - 1e-3).to(at::kByte);
  return out.to(orig);
}

at::Tensor adjust_sharpness(const at::Tensor& images, double factor) {
  check_channels(images, "adjust_sharpness");
  if (factor < 0) throw OptionError("sharpness", "factor " + std::to_string(factor) + " is negative");
  const int64_t c = images.size(-3), h = images.size(-2), w = images.size(-1);
  if (images.numel() == 0 || h <= 2 || w <= 2) return images;
  const bool fp = images.is_floating_point();
  at::Tensor x = images.dim() > 4 ? images.reshape({-1, c, h, w}) : images;
  // A normalised 3x3 kernel: 1s around a 5, over 13; blurred pixels replace the inner ones, borders stay.
  const auto kdtype = fp ? images.scalar_type() : at::kFloat;
  const double a = 1.0 / 13.0, b = 5.0 / 13.0;
  auto kernel = at::tensor({a, a, a, a, b, a, a, a, a}, at::TensorOptions().dtype(kdtype)).reshape({3, 3});
  kernel = kernel.expand({c, 1, 3, 3});
  auto out = x.to(kdtype, false, true);
  const std::vector<int64_t> one{1, 1}, zero{0, 0};
  auto blurred = at::conv2d(out, kernel, at::Tensor(), one, zero, one, c);
  if (!fp) blurred.round_();
  using at::indexing::Slice;
  auto inner = out.index({at::indexing::Ellipsis, Slice(1, -1), Slice(1, -1)});
  inner.add_(blurred.sub_(inner), 1.0 - factor);
  out.clamp_(0, max_value(images));
  if (!fp) out = out.to(images.scalar_type());
  return images.dim() > 4 ? out.reshape(images.sizes()) : out;
}

at::Tensor affine(const at::Tensor& images, double angle, std::array<double, 2> translate, double scale,
                  std::array<double, 2> shear, Interpolation interpolation, std::optional<double> fill) {
  check_channels(images, "affine");
  if (!(scale > 0)) throw OptionError("affine.scale", "must be positive");
  const int64_t c = images.size(-3), h = images.size(-2), w = images.size(-1);
  // The inverse map (output pixel -> input pixel) about the centre, as torchvision's _get_inverse_affine_matrix.
  const double deg = M_PI / 180.0;
  const double rot = angle * deg, sx = shear[0] * deg, sy = shear[1] * deg;
  const double cx = 0.0, cy = 0.0, tx = translate[0], ty = translate[1];
  const double cos_sy = std::cos(sy), tan_sx = std::tan(sx), rot_minus_sy = rot - sy;
  const double cx_plus_tx = cx + tx, cy_plus_ty = cy + ty;
  const double ma = std::cos(rot_minus_sy) / cos_sy;
  const double mb = -(ma * tan_sx + std::sin(rot));
  const double mc = std::sin(rot_minus_sy) / cos_sy;
  const double md = std::cos(rot) - mc * tan_sx;
  std::vector<double> m{md / scale, -mb / scale, 0.0, -mc / scale, ma / scale, 0.0};
  m[2] += cx - m[0] * cx_plus_tx - m[1] * cy_plus_ty;
  m[5] += cy - m[3] * cx_plus_tx - m[4] * cy_plus_ty;
  const bool fp = images.is_floating_point();
  const auto dtype = fp ? images.scalar_type() : at::kFloat;
  const auto opts = at::TensorOptions().dtype(dtype);
  auto theta = at::tensor(m, opts).reshape({1, 2, 3});
  // The sampling grid (torchvision's _affine_grid): pixel centres relative to the image centre, mapped by theta
  // and normalised to [-1, 1].
  auto base = at::empty({1, h, w, 3}, opts);
  using at::indexing::Ellipsis;
  base.index({Ellipsis, 0}).copy_(at::linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, w));
  base.index({Ellipsis, 1}).copy_(at::linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, h).unsqueeze_(-1));
  base.index({Ellipsis, 2}).fill_(1);
  auto rescaled = theta.transpose(1, 2).div_(at::tensor({0.5 * w, 0.5 * h}, opts));
  auto grid = base.view({1, h * w, 3}).bmm(rescaled).view({1, h, w, 2});
  // torchvision's _apply_grid_transform: grid_sample with zero padding, a ones channel marking what came from
  // inside when there is a fill.
  if (images.numel() == 0) return images;
  auto x = images.reshape({-1, c, h, w});
  const int64_t n = x.size(0);
  auto fx = fp ? x : x.to(dtype);
  if (n > 1) grid = grid.expand({n, -1, -1, -1});
  if (fill) fx = at::cat({fx, at::ones({n, 1, h, w}, fx.options())}, 1);
  const int64_t mode = interpolation == Interpolation::nearest ? 1 : 0;
  fx = at::grid_sampler(fx, grid, mode, 0, false);
  if (fill) {
    auto mask = fx.narrow(1, c, 1);
    fx = fx.narrow(1, 0, c);
    mask = mask.expand_as(fx);
    auto fill_img = at::tensor({*fill}, fx.options()).view({1, -1, 1, 1});
    if (interpolation == Interpolation::nearest)
      fx = at::where(mask < 0.5, fill_img.expand_as(fx), fx);
    else
      fx = fx.sub_(fill_img).mul_(mask).add_(fill_img);
  }
  auto out = fp ? fx : fx.round_().to(images.scalar_type());
  return out.reshape(images.sizes());
}

at::Tensor crop(const at::Tensor& images, int64_t top, int64_t left, int64_t height, int64_t width) {
  int64_t h = images.size(-2), w = images.size(-1);
  int64_t right = left + width, bottom = top + height;
  using at::indexing::Slice;
  using at::indexing::Ellipsis;
  if (left < 0 || top < 0 || right > w || bottom > h) {
    auto cut = images.index({Ellipsis, Slice(std::max<int64_t>(top, 0), bottom), Slice(std::max<int64_t>(left, 0), right)});
    std::vector<int64_t> pad{std::max<int64_t>(std::min<int64_t>(right, 0) - left, 0),
                             std::max<int64_t>(right - std::max(w, left), 0),
                             std::max<int64_t>(std::min<int64_t>(bottom, 0) - top, 0),
                             std::max<int64_t>(bottom - std::max(h, top), 0)};
    return at::constant_pad_nd(cut, pad, 0);
  }
  return images.index({Ellipsis, Slice(top, bottom), Slice(left, right)});
}

at::Tensor center_crop(const at::Tensor& images, int64_t height, int64_t width) {
  if (height <= 0 || width <= 0) throw OptionError("crop", "size must be positive");
  at::Tensor image = images;
  int64_t ih = image.size(-2), iw = image.size(-1);
  if (height > ih || width > iw) {
    int64_t l = width > iw ? (width - iw) / 2 : 0, t = height > ih ? (height - ih) / 2 : 0;
    int64_t r = width > iw ? (width - iw + 1) / 2 : 0, b = height > ih ? (height - ih + 1) / 2 : 0;
    image = at::constant_pad_nd(image, {l, r, t, b}, 0);
    ih = image.size(-2);
    iw = image.size(-1);
    if (ih == height && iw == width) return image;
  }
  auto top = static_cast<int64_t>(std::nearbyint((ih - height) / 2.0));
  auto left = static_cast<int64_t>(std::nearbyint((iw - width) / 2.0));
  using at::indexing::Slice;
  return image.index({at::indexing::Ellipsis, Slice(top, top + height), Slice(left, left + width)});
}

at::Tensor resize_with_pad(const at::Tensor& images, int64_t height, int64_t width, PadAlign align,
                           double pad_value) {
  if (images.dim() != 4 && images.dim() != 3) throw Error("resize_with_pad: images must be [B, C, H, W] or [C, H, W]");
  if (height <= 0 || width <= 0) throw OptionError("resize", "size must be positive");
  auto x = images.dim() == 3 ? images.unsqueeze(0) : images;
  int64_t ch = x.size(2), cw = x.size(3);
  if (align == PadAlign::top_left && ch == height && cw == width) return images;
  double ratio = std::max(static_cast<double>(cw) / width, static_cast<double>(ch) / height);
  auto rh = static_cast<int64_t>(ch / ratio), rw = static_cast<int64_t>(cw / ratio);
  auto resized = at::upsample_bilinear2d(x, {rh, rw}, false, std::nullopt, std::nullopt);
  at::Tensor out;
  if (align == PadAlign::center) {
    if (x.scalar_type() == at::kByte)
      resized = at::round(resized).clamp(0, 255).to(at::kByte);
    else if (x.scalar_type() == at::kFloat)
      resized = resized.clamp(0.0, 1.0);
    else
      throw Error("resize_with_pad: images must be uint8 or float32");
    auto dh = height - rh, dw = width - rw;
    // Python's divmod (floor) on a non-negative difference.
    int64_t h0 = dh / 2, w0 = dw / 2;
    out = at::constant_pad_nd(resized, {w0, w0 + dw % 2, h0, h0 + dh % 2}, 0);
  } else {
    int64_t ph = std::max<int64_t>(0, height - rh), pw = std::max<int64_t>(0, width - rw);
    out = at::constant_pad_nd(resized, {pw, 0, ph, 0}, pad_value);
  }
  return images.dim() == 3 ? out.squeeze(0) : out;
}

TransformPlan plan_transforms(const ImageTransformsConfig& c, uint64_t seed, int64_t height, int64_t width) {
  TransformPlan plan;
  std::mt19937_64 rng(seed);
  auto uniform = [&](double lo, double hi) {
    double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    return lo + (hi - lo) * u;
  };
  if (c.crop_height > 0 || c.crop_width > 0) {
    if (c.crop_height <= 0 || c.crop_width <= 0) throw OptionError("crop", "needs both a height and a width");
    if (c.random_crop) {
      if (c.crop_height > height || c.crop_width > width)
        throw OptionError("crop", std::to_string(c.crop_height) + "x" + std::to_string(c.crop_width) +
                                      " is larger than the " + std::to_string(height) + "x" + std::to_string(width) +
                                      " frames");
      plan.crop_top = static_cast<int64_t>(rng() % static_cast<uint64_t>(height - c.crop_height + 1));
      plan.crop_left = static_cast<int64_t>(rng() % static_cast<uint64_t>(width - c.crop_width + 1));
    }
  }
  if (!c.enable) return plan;
  constexpr int kinds = 6;
  const char* names[kinds] = {"brightness", "contrast", "saturation", "hue", "sharpness", "affine"};
  const std::array<double, 2>* ranges[kinds] = {&c.brightness, &c.contrast, &c.saturation,
                                                &c.hue,        &c.sharpness, &c.degrees};
  for (int k = 0; k < kinds; ++k) {
    if (c.weights[k] < 0) throw OptionError(std::string(names[k]) + ".weight", "must not be negative");
    if ((*ranges[k])[0] > (*ranges[k])[1])
      throw OptionError(names[k], "range [" + std::to_string((*ranges[k])[0]) + ", " +
                                      std::to_string((*ranges[k])[1]) + "] is reversed");
  }
  if (c.hue[0] < -0.5 || c.hue[1] > 0.5) throw OptionError("hue", "range must lie in [-0.5, 0.5]");
  for (int k : {0, 1, 2, 4})
    if ((*ranges[k])[0] < 0) throw OptionError(names[k], "range must not be negative");
  for (double t : c.translate)
    if (!(t >= 0 && t <= 1)) throw OptionError("affine.translate", "must lie in [0, 1]");
  int available = 0;
  for (double w : c.weights) available += w > 0;
  if (available == 0) return plan;
  if (c.max_num_transforms < 1) throw OptionError("max_num_transforms", "must be at least 1");
  int n = std::min(c.max_num_transforms, available);
  // Weighted sampling without replacement (as torch.multinomial(weights, n)).
  std::array<double, kinds> w = c.weights;
  std::vector<int> picked;
  for (int i = 0; i < n; ++i) {
    double total = 0;
    for (double x : w) total += x;
    double r = uniform(0.0, total);
    int k = 0;
    for (; k < kinds - 1; ++k) {
      if (r < w[k]) break;
      r -= w[k];
    }
    while (w[k] <= 0) k = (k + 1) % kinds;
    picked.push_back(k);
    w[k] = 0;
  }
  if (!c.random_order) std::sort(picked.begin(), picked.end());
  // The jitters see the frames after the crop and the resize: affine's shift scales with that size.
  int64_t jh = height, jw = width;
  if (c.crop_height > 0 && c.crop_width > 0) jh = c.crop_height, jw = c.crop_width;
  if (c.resize_height > 0 && c.resize_width > 0) jh = c.resize_height, jw = c.resize_width;
  for (int k : picked) {
    plan.jitters.emplace_back(names[k], uniform((*ranges[k])[0], (*ranges[k])[1]));
    if (k == 5) {  // RandomAffine: round(uniform(-max, max)) pixels, Python's round (half to even)
      double dx = c.translate[0] * static_cast<double>(jw), dy = c.translate[1] * static_cast<double>(jh);
      plan.affine_tx = static_cast<int64_t>(std::nearbyint(uniform(-dx, dx)));
      plan.affine_ty = static_cast<int64_t>(std::nearbyint(uniform(-dy, dy)));
    }
  }
  return plan;
}

at::Tensor apply_transforms(const at::Tensor& images, const ImageTransformsConfig& c, const TransformPlan& plan) {
  at::Tensor x = images;
  if (c.crop_height > 0 && c.crop_width > 0)
    x = plan.crop_top >= 0 ? crop(x, plan.crop_top, plan.crop_left, c.crop_height, c.crop_width)
                           : center_crop(x, c.crop_height, c.crop_width);
  if (c.resize_height > 0 && c.resize_width > 0)
    x = resize_with_pad(x, c.resize_height, c.resize_width, c.resize_align, c.pad_value);
  for (const auto& [name, factor] : plan.jitters) {
    if (name == "brightness")
      x = adjust_brightness(x, factor);
    else if (name == "contrast")
      x = adjust_contrast(x, factor);
    else if (name == "saturation")
      x = adjust_saturation(x, factor);
    else if (name == "hue")
      x = adjust_hue(x, factor);
    else if (name == "sharpness")
      x = adjust_sharpness(x, factor);
    else if (name == "affine")
      x = affine(x, factor, {static_cast<double>(plan.affine_tx), static_cast<double>(plan.affine_ty)}, 1.0,
                 {0.0, 0.0}, Interpolation::nearest, 0.0);
    else
      throw OptionError("image_transforms", "unknown transform '" + name + "'");
  }
  return x;
}

at::Tensor transform_images(const at::Tensor& images, const ImageTransformsConfig& config, uint64_t seed) {
  auto plan = plan_transforms(config, seed, images.size(-2), images.size(-1));
  return apply_transforms(images, config, plan);
}

}  // namespace lf::data::robot
