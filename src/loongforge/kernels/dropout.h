// Training-mode (inverted) dropout on the CPU without ATen's bernoulli_: y = x * keep / (1 - p), keep ~ Bernoulli(1 - p)
// per element. ATen draws a float mask with bernoulli_ (MKL's generator, then a float per element) and multiplies;
// in a CPU training step of ACT (dropout 0.1 after attention, inside and after every feed-forward and on the attention
// probabilities) that was ~6 % of LeRobot's step. Here keep is a counter-based hash (SplitMix64's finaliser) of a
// 64-bit seed and the element's index, compared with (1 - p) 2^32 (two elements per hash): one pass forward, one pass
// backward that recomputes the mask from the seed (nothing is saved), the same mask whatever the thread count. The
// seed comes from the default CPU generator, so at::manual_seed and saving / restoring its state (nn/recompute.h's
// recomputation) repeat the masks as they do ATen's.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace lf::kernels {

// Autograd-aware. p <= 0: x itself; p >= 1: zeros. CPU float32 / float64 tensors take the kernel, anything else
// at::dropout(x, p, true).
at::Tensor dropout(const at::Tensor& x, double p);

// The raw kernel (no autograd), for tests: x * keep(seed, index) / (1 - p) over x's elements in contiguous order.
at::Tensor dropout_cpu(const at::Tensor& x, double p, uint64_t seed);

}  // namespace lf::kernels
