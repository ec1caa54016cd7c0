#include "loongforge/models/policy/resnet.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/normalization.h>

namespace lf::models::policy {

namespace {
// torchvision: 3x3 convolutions pad by their dilation, 1x1 by nothing, the 7x7 stem by 3
int64_t conv_padding(int64_t k, int64_t dilation) { return k == 3 ? dilation : (k == 7 ? 3 : 0); }

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t dilation) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k)
                               .stride(stride)
                               .padding(conv_padding(k, dilation))
                               .dilation(dilation)
                               .bias(false));
}

// bn(conv(x)) (the trunk's convolutions have no bias): x * scale + shift in one pass (addcmul) instead of
// torchvision's two; its backward is torchvision's (grad * scale). Folding the batch norm into the convolution
// (conv(x, w * scale) + shift as its bias) was tried: it changes the rounding of the trunk's weight gradients enough
// (1 % on elements near zero) to move AdamW's first step on them past test_act_parity.py's float tolerance.
at::Tensor conv_bn(const torch::nn::Conv2dImpl& c, const FrozenBatchNorm2dImpl& bn, const at::Tensor& x) {
  const auto& o = c.options;
  const int64_t k = o.kernel_size()->at(0), stride = o.stride()->at(0), dilation = o.dilation()->at(0);
  const auto [scale, shift] = bn.scale_shift();
  const at::Tensor y = at::conv2d(x, c.weight, {}, stride, conv_padding(k, dilation), dilation);
  return at::addcmul(shift.view({1, -1, 1, 1}), y, scale.view({1, -1, 1, 1}));
}
// A convolution then its norm: frozen batch norm in one pass (conv_bn), the other norms as their modules.
at::Tensor conv_norm(torch::nn::Conv2dImpl& c, torch::nn::AnyModule& norm, const at::Tensor& x) {
  if (const auto* f = dynamic_cast<const FrozenBatchNorm2dImpl*>(norm.ptr().get())) return conv_bn(c, *f, x);
  return norm.forward(c.forward(x));
}
}  // namespace

ResNetLayout ResNetLayout::named(const std::string& name, std::string* error) {
  ResNetLayout l;
  if (name == "resnet18") l.blocks = {2, 2, 2, 2};
  else if (name == "resnet34") l.blocks = {3, 4, 6, 3};
  else if (name == "resnet50") l.blocks = {3, 4, 6, 3}, l.bottleneck = true;
  else if (name == "resnet101") l.blocks = {3, 4, 23, 3}, l.bottleneck = true;
  else if (name == "resnet152") l.blocks = {3, 8, 36, 3}, l.bottleneck = true;
  else if (error) *error = "'" + name + "' is not one of resnet18, resnet34, resnet50, resnet101, resnet152";
  return l;
}

int64_t ResNetLayout::feature_size(int64_t size) const {
  // every stride-2 step here (7x7 pad 3, 3x3 pad 1 max pool and convolutions) maps n to (n - 1) / 2 + 1
  int64_t steps = 2 + static_cast<int64_t>(blocks.size()) - 1 - (dilate_last && blocks.size() > 1 ? 1 : 0);
  for (int64_t i = 0; i < steps; ++i) size = (size - 1) / 2 + 1;
  return size;
}

ResNetLayout ResNetLayout::from_shapes(const std::map<std::string, std::vector<int64_t>>& shapes, const std::string& prefix,
                                       const ResNetLayout& fallback) {
  auto it = shapes.find(prefix + fallback.stem_conv_name() + ".weight");
  if (it == shapes.end() || it->second.empty()) return fallback;
  ResNetLayout l;
  l.dilate_last = fallback.dilate_last;
  l.norm = fallback.norm;
  l.indexed_names = fallback.indexed_names;
  l.stem = it->second[0];
  l.bottleneck = shapes.count(prefix + l.stage_name(0) + ".0.conv3.weight") > 0;
  l.blocks.clear();
  l.widths.clear();
  for (size_t s = 0;; ++s) {
    const std::string stage = prefix + l.stage_name(s) + ".";
    auto first = shapes.find(stage + "0.conv1.weight");
    if (first == shapes.end() || first->second.empty()) break;
    int64_t n = 0;
    while (shapes.count(stage + std::to_string(n) + ".conv1.weight")) ++n;
    l.blocks.push_back(n);
    l.widths.push_back(first->second[0]);  // conv1's output: the block's inner width (planes)
  }
  return l.blocks.empty() ? fallback : l;
}

int64_t ResNetLayout::parameters() const {
  const int64_t expansion = bottleneck ? 4 : 1;
  const int64_t affine = norm == ResNetNorm::kFrozenBatch ? 0 : 2;  // a norm's weight and bias per channel
  int64_t n = 3 * stem * 7 * 7 + affine * stem, in = stem;
  for (size_t s = 0; s < blocks.size(); ++s) {
    const int64_t planes = widths[s], out = planes * expansion;
    const bool strided = s > 0 && !(s + 1 == blocks.size() && dilate_last);  // as ResNetImpl places the strides
    for (int64_t b = 0; b < blocks[s]; ++b) {
      n += bottleneck ? in * planes + planes * planes * 9 + planes * out : in * planes * 9 + planes * planes * 9;
      n += affine * (bottleneck ? 2 * planes + out : 2 * planes);
      if ((b == 0 && strided) || in != out) n += in * out + affine * out;  // ResBlock's downsample (1x1 + norm)
      in = out;
    }
  }
  return n;
}

FrozenBatchNorm2dImpl::FrozenBatchNorm2dImpl(int64_t channels) {
  weight = register_buffer("weight", at::ones({channels}));
  bias = register_buffer("bias", at::zeros({channels}));
  running_mean = register_buffer("running_mean", at::zeros({channels}));
  running_var = register_buffer("running_var", at::ones({channels}));
}

torch::nn::AnyModule resnet_norm(ResNetNorm kind, int64_t channels) {
  switch (kind) {
    case ResNetNorm::kGroup:
      return torch::nn::AnyModule(torch::nn::GroupNorm(torch::nn::GroupNormOptions(std::max<int64_t>(channels / 16, 1), channels)));
    case ResNetNorm::kBatch:
      return torch::nn::AnyModule(torch::nn::BatchNorm2d(channels));
    default:
      return torch::nn::AnyModule(FrozenBatchNorm2d(channels));
  }
}

std::pair<at::Tensor, at::Tensor> FrozenBatchNorm2dImpl::scale_shift() const {
  // torchvision's order of operations: scale = w * rsqrt(var + eps), shift = b - mean * scale
  const at::Tensor scale = weight * (running_var + 1e-5).rsqrt();
  return {scale, bias - running_mean * scale};
}

at::Tensor FrozenBatchNorm2dImpl::forward(const at::Tensor& x) {
  const auto [scale, shift] = scale_shift();
  return x * scale.view({1, -1, 1, 1}) + shift.view({1, -1, 1, 1});
}

ResBlockImpl::ResBlockImpl(bool bottleneck, int64_t in, int64_t planes, int64_t stride, int64_t dilation, ResNetNorm norm) {
  const int64_t out = planes * (bottleneck ? 4 : 1);
  if (bottleneck) {
    conv1 = register_module("conv1", conv(in, planes, 1, 1, 1));
    conv2 = register_module("conv2", conv(planes, planes, 3, stride, dilation));
    conv3 = register_module("conv3", conv(planes, out, 1, 1, 1));
    bn3 = resnet_norm(norm, out);
    register_module("bn3", bn3.ptr());
  } else {
    conv1 = register_module("conv1", conv(in, planes, 3, stride, 1));
    conv2 = register_module("conv2", conv(planes, planes, 3, 1, 1));
  }
  bn1 = resnet_norm(norm, planes);
  bn2 = resnet_norm(norm, planes);
  register_module("bn1", bn1.ptr());
  register_module("bn2", bn2.ptr());
  if (stride != 1 || in != out) {
    downsample = torch::nn::Sequential(conv(in, out, 1, stride, 1));
    downsample->push_back(resnet_norm(norm, out));
    register_module("downsample", downsample);
  }
}

at::Tensor ResBlockImpl::forward(const at::Tensor& x) {
  at::Tensor y = at::relu(conv_norm(*conv1, bn1, x));
  if (conv3) {
    y = at::relu(conv_norm(*conv2, bn2, y));
    y = conv_norm(*conv3, bn3, y);
  } else {
    y = conv_norm(*conv2, bn2, y);
  }
  at::Tensor skip = x;
  if (downsample) {
    const auto* frozen = dynamic_cast<const FrozenBatchNorm2dImpl*>(downsample->ptr(1).get());
    skip = frozen ? conv_bn(*downsample->ptr<torch::nn::Conv2dImpl>(0), *frozen, x) : downsample->forward(x);
  }
  return at::relu(y + skip);
}

ResNetImpl::ResNetImpl(const ResNetLayout& l) : layout_(l) {
  conv1 = register_module(l.stem_conv_name(), conv(3, l.stem, 7, 2, 1));
  bn1 = resnet_norm(l.norm, l.stem);
  register_module(l.stem_norm_name(), bn1.ptr());
  int64_t in = l.stem, dilation = 1;
  for (size_t s = 0; s < l.blocks.size(); ++s) {
    int64_t stride = s == 0 ? 1 : 2;
    const int64_t previous = dilation;
    if (s + 1 == l.blocks.size() && l.dilate_last) {  // torchvision's replace_stride_with_dilation
      dilation *= stride;
      stride = 1;
    }
    torch::nn::Sequential layer;
    for (int64_t b = 0; b < l.blocks[s]; ++b) {
      layer->push_back(ResBlock(l.bottleneck, in, l.widths[s], b == 0 ? stride : 1, b == 0 ? previous : dilation, l.norm));
      in = l.widths[s] * (l.bottleneck ? 4 : 1);
    }
    layers.push_back(register_module(l.stage_name(s), layer));
  }
}

at::Tensor ResNetImpl::forward(const at::Tensor& x) {
  // (channels-last activations were tried: with the torch 2.11 wheel's oneDNN the process then crashed at exit, in
  // the primitive cache's destructor of a 1x1 backward-weights kernel, with 2 threads; so NCHW as torchvision)
  at::Tensor h = at::relu(conv_norm(*conv1, bn1, x));
  h = at::max_pool2d(h, {3, 3}, {2, 2}, {1, 1});
  for (auto& layer : layers) h = layer->forward(h);
  return h;
}

void ResNetImpl::init_weights() {
  torch::NoGradGuard g;
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* c = m->as<torch::nn::Conv2dImpl>())
      torch::nn::init::kaiming_normal_(c->weight, 0, torch::kFanOut, torch::kReLU);
    if (auto* bn = m->as<FrozenBatchNorm2dImpl>()) {
      bn->weight.fill_(1);
      bn->bias.zero_();
      bn->running_mean.zero_();
      bn->running_var.fill_(1);
    }
    if (auto* gn = m->as<torch::nn::GroupNormImpl>()) gn->reset_parameters();
    if (auto* bn = m->as<torch::nn::BatchNorm2dImpl>()) bn->reset_parameters();
  }
}

}  // namespace lf::models::policy
