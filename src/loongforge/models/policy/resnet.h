// torchvision's ResNet trunk (conv1, bn1, layer1..layer4; no pooling head) as robot policies use it for camera
// features, with torchvision's parameter names (layer2.0.downsample.0, layer3.1.bn2.running_var, ...) or, as
// nn.Sequential(*resnet.children()[:-2]) names them, by index (0 = conv1, 1 = bn1, 4..7 = layer1..layer4). Its norm
// layers: frozen batch norm (torchvision.ops.FrozenBatchNorm2d: weight, bias and running statistics are buffers), as
// ACT has it; GroupNorm(channels / 16, channels), as Diffusion Policy's use_group_norm puts in place of every
// BatchNorm2d; or trainable nn.BatchNorm2d (batch statistics in training, running ones in eval).
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/conv.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace lf::models::policy {

enum class ResNetNorm { kFrozenBatch, kGroup, kBatch };

struct ResNetLayout {
  bool bottleneck = false;                // Bottleneck blocks (expansion 4) rather than BasicBlock
  std::vector<int64_t> blocks{2, 2, 2, 2};  // blocks per stage
  std::vector<int64_t> widths{64, 128, 256, 512};  // planes per stage (the block's inner width)
  int64_t stem = 64;                      // conv1's output channels
  bool dilate_last = false;               // layer4's stride replaced by dilation 2
  ResNetNorm norm = ResNetNorm::kFrozenBatch;
  bool indexed_names = false;  // the trunk as nn.Sequential(*children()[:-2]): 0.weight, 1.weight, 4.0.conv1.weight
  int64_t out_channels() const { return widths.back() * (bottleneck ? 4 : 1); }
  // The module names of the stem convolution, its norm and stage s (0-based) under this layout's naming.
  std::string stem_conv_name() const { return indexed_names ? "0" : "conv1"; }
  std::string stem_norm_name() const { return indexed_names ? "1" : "bn1"; }
  std::string stage_name(size_t s) const { return indexed_names ? std::to_string(4 + s) : "layer" + std::to_string(s + 1); }
  // The feature map's height (or width) for an input of `size` pixels (the stem's stride-2 convolution and max
  // pooling, then stride 2 at every stage after the first, but for a dilated last one).
  int64_t feature_size(int64_t size) const;
  // The trunk's parameter count: its convolutions' weights and its norms' (frozen batch norm holds buffers only), as
  // ResNet(*this) registers them, from the layout alone.
  int64_t parameters() const;
  // torchvision's resnet18 / 34 / 50 / 101 / 152 by name; "" when the name is none of them (why, in `error`).
  static ResNetLayout named(const std::string& name, std::string* error);
  // The layout of the trunk whose tensors are stored under `prefix` (conv1.weight, layerS.B.convK.weight, or their
  // indexed names: stages, blocks, widths and block kind from their shapes), with `fallback`'s dilation, norm and
  // naming; `fallback` when none is stored.
  static ResNetLayout from_shapes(const std::map<std::string, std::vector<int64_t>>& shapes, const std::string& prefix,
                                  const ResNetLayout& fallback);
};

// FrozenBatchNorm2d: x * w / sqrt(var + eps) + (b - mean * w / sqrt(var + eps)), all four buffers.
class FrozenBatchNorm2dImpl : public torch::nn::Module {
 public:
  explicit FrozenBatchNorm2dImpl(int64_t channels);
  at::Tensor forward(const at::Tensor& x);
  // (scale, shift) [channels]: forward(x) = x * scale + shift per channel.
  std::pair<at::Tensor, at::Tensor> scale_shift() const;
  at::Tensor weight, bias, running_mean, running_var;
};
TORCH_MODULE(FrozenBatchNorm2d);

// A norm layer of `kind` over `channels` (GroupNorm: channels / 16 groups, at least one channel group of 16).
torch::nn::AnyModule resnet_norm(ResNetNorm kind, int64_t channels);

// One residual block (BasicBlock: conv1 3x3, conv2 3x3; Bottleneck: conv1 1x1, conv2 3x3, conv3 1x1), with
// downsample.0 / downsample.1 when the shape changes.
class ResBlockImpl : public torch::nn::Module {
 public:
  ResBlockImpl(bool bottleneck, int64_t in, int64_t planes, int64_t stride, int64_t dilation, ResNetNorm norm);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  torch::nn::AnyModule bn1, bn2, bn3;
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(ResBlock);

class ResNetImpl : public torch::nn::Module {
 public:
  explicit ResNetImpl(const ResNetLayout& l);
  // images [B, 3, H, W] -> layer4's feature map [B, out_channels, h, w].
  at::Tensor forward(const at::Tensor& x);
  // torchvision's initialisation: Kaiming-normal (fan_out) convolutions, unit norm scale, zero shift (and fresh
  // running statistics).
  void init_weights();
  const ResNetLayout& layout() const { return layout_; }
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::AnyModule bn1;
  std::vector<torch::nn::Sequential> layers;  // layer1..layer4

 private:
  ResNetLayout layout_;
};
TORCH_MODULE(ResNet);

}  // namespace lf::models::policy
