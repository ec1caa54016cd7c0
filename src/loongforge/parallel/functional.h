// Collectives as differentiable functions (the building blocks of tensor, sequence and context parallelism).
// Each forward has the adjoint collective as its backward; all run over a Group of parallel/comm.h.
#pragma once
#include <ATen/core/Tensor.h>

#include "loongforge/parallel/comm.h"

namespace lf::parallel {

// forward: identity; backward: all-reduce (sum) of the gradient. Megatron's "copy to tensor-parallel region".
at::Tensor copy_to(const at::Tensor& x, const Group& g);
// forward: all-reduce (sum); backward: identity. "Reduce from tensor-parallel region".
at::Tensor reduce_from(const at::Tensor& x, const Group& g);
// forward: this rank's part of x split in g.size() equal parts along dim; backward: all-gather.
at::Tensor split(const at::Tensor& x, const Group& g, int64_t dim);
// forward: all-gather along dim; backward: this rank's part of the gradient (no reduction).
at::Tensor gather(const at::Tensor& x, const Group& g, int64_t dim);
// forward: all-gather along dim; backward: reduce-scatter (sum) along dim. Sequence parallel entry.
at::Tensor gather_rs(const at::Tensor& x, const Group& g, int64_t dim);
// forward: reduce-scatter (sum) along dim; backward: all-gather along dim. Sequence parallel exit.
at::Tensor reduce_scatter(const at::Tensor& x, const Group& g, int64_t dim);
// Ulysses all-to-all: x is split in g.size() parts along scatter_dim, part j goes to rank j, and the parts
// received are concatenated along gather_dim (in rank order). Backward is the inverse exchange.
at::Tensor all_to_all(const at::Tensor& x, const Group& g, int64_t scatter_dim, int64_t gather_dim);

}  // namespace lf::parallel
