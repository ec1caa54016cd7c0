#include "loongforge/models/policy/resnet.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/normalization.h>

namespace lf::models::policy {

namespace {
torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t dilation) {
  // torchvision: 3x3 convolutions pad by their dilation, 1x1 by nothing, the 7x7 stem by 3
  const int64_t pad = k == 3 ? dilation : (k == 7 ? 3 : 0);
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(pad).dilation(dilation).bias(false));
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

at::Tensor FrozenBatchNorm2dImpl::forward(const at::Tensor& x) {
  // torchvision's order of operations: scale = w * rsqrt(var + eps), shift = b - mean * scale
  const at::Tensor scale = weight * (running_var + 1e-5).rsqrt();
  const at::Tensor shift = bias - running_mean * scale;
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
  at::Tensor y = at::relu(bn1.forward(conv1(x)));
  if (conv3) {
    y = at::relu(bn2.forward(conv2(y)));
    y = bn3.forward(conv3(y));
  } else {
    y = bn2.forward(conv2(y));
  }
  return at::relu(y + (downsample ? downsample->forward(x) : x));
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
  at::Tensor h = at::relu(bn1.forward(conv1(x)));
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
