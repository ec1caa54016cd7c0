// torchvision's ResNet trunk (conv1, bn1, layer1..layer4; no pooling head) as robot policies use it for camera
// features, with torchvision's parameter names (layer2.0.downsample.0, layer3.1.bn2.running_var, ...). Batch norm is
// frozen (torchvision.ops.FrozenBatchNorm2d: weight, bias and running statistics are buffers), as ACT has it.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace lf::models::policy {

struct ResNetLayout {
  bool bottleneck = false;                // Bottleneck blocks (expansion 4) rather than BasicBlock
  std::vector<int64_t> blocks{2, 2, 2, 2};  // blocks per stage
  std::vector<int64_t> widths{64, 128, 256, 512};  // planes per stage (the block's inner width)
  int64_t stem = 64;                      // conv1's output channels
  bool dilate_last = false;               // layer4's stride replaced by dilation 2
  int64_t out_channels() const { return widths.back() * (bottleneck ? 4 : 1); }
  // The trunk's parameter count: its convolutions' weights (frozen batch norm holds buffers only), as ResNet(*this)
  // registers them, from the layout alone.
  int64_t parameters() const;
  // torchvision's resnet18 / 34 / 50 / 101 / 152 by name; "" when the name is none of them (why, in `error`).
  static ResNetLayout named(const std::string& name, std::string* error);
  // The layout of the trunk whose tensors are stored under `prefix` (conv1.weight, layerS.B.convK.weight: stages,
  // blocks, widths and block kind from their shapes), with `fallback`'s dilation; `fallback` when none is stored.
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

// One residual block (BasicBlock: conv1 3x3, conv2 3x3; Bottleneck: conv1 1x1, conv2 3x3, conv3 1x1), with
// downsample.0 / downsample.1 when the shape changes.
class ResBlockImpl : public torch::nn::Module {
 public:
  ResBlockImpl(bool bottleneck, int64_t in, int64_t planes, int64_t stride, int64_t dilation);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  FrozenBatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(ResBlock);

class ResNetImpl : public torch::nn::Module {
 public:
  explicit ResNetImpl(const ResNetLayout& l);
  // images [B, 3, H, W] -> layer4's feature map [B, out_channels, h, w].
  at::Tensor forward(const at::Tensor& x);
  // torchvision's initialisation: Kaiming-normal (fan_out) convolutions, unit batch-norm scale, zero shift.
  void init_weights();
  const ResNetLayout& layout() const { return layout_; }
  torch::nn::Conv2d conv1{nullptr};
  FrozenBatchNorm2d bn1{nullptr};
  std::vector<torch::nn::Sequential> layers;  // layer1..layer4

 private:
  ResNetLayout layout_;
};
TORCH_MODULE(ResNet);

}  // namespace lf::models::policy
