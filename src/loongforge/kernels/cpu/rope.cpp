// RoPE: the device dispatch and the composite reference (the CPU path is the composite version).
#include "loongforge/kernels/rope.h"

#include <ATen/ATen.h>

#include "loongforge/kernels/cuda_ops.h"

namespace lf::kernels {

at::Tensor apply_rope_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor c = cos.unsqueeze(1).to(x.scalar_type()), s = sin.unsqueeze(1).to(x.scalar_type());
  at::Tensor rot = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rot * s;
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const bool cs_dtype = cos.scalar_type() == sin.scalar_type() &&
                        (cos.scalar_type() == at::kFloat || cos.scalar_type() == x.scalar_type());
  if (cuda::supported(x) && cuda::supported(cos) && cuda::supported(sin) && cs_dtype && x.dim() == 4 &&
      cos.dim() == 3)
    return cuda::rope(x, cos, sin);
  return apply_rope_reference(x, cos, sin);
}

}  // namespace lf::kernels
