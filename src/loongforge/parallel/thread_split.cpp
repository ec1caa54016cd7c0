#include "loongforge/parallel/thread_split.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include "loongforge/core/error.h"

namespace lf::parallel {

void on_threads(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || at::get_num_threads() == 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  const at::ThreadLocalState state;  // grad mode, autocast, ... of the calling thread
  // grain 1: ATen gives each thread a contiguous run of the n indices (one each when n <= threads).
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard guard(state);
    for (int64_t i = begin; i < end; ++i) fn(i);
    // Autocast keeps its casts of the weights per thread: a pool thread's would outlive this call and hand out
    // stale copies after the next optimizer step.
    at::autocast::clear_cache();
  });
}

void split_backward(int64_t n, const std::vector<at::Tensor>& params, const std::function<at::Tensor(int64_t)>& loss_fn) {
  if (n <= 0) return;
  for (const at::Tensor& p : params)
    if (!p.requires_grad()) throw Error("split_backward: a parameter does not require grad");
  std::vector<std::vector<at::Tensor>> grads(static_cast<size_t>(n));
  on_threads(n, [&](int64_t i) {
    at::Tensor l = loss_fn(i);
    grads[static_cast<size_t>(i)] =
        torch::autograd::grad({l}, params, {}, /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
  });
  // Sum in part order: parameters split over the threads, each summed by one thread (bitwise independent of how).
  at::parallel_for(0, static_cast<int64_t>(params.size()), 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;
    for (int64_t j = begin; j < end; ++j) {
      at::Tensor sum;
      bool owned = false;  // sum may be written in place (autograd's results may be expanded views or shared)
      for (const auto& g : grads) {
        const at::Tensor& gj = g[static_cast<size_t>(j)];
        if (!gj.defined()) continue;
        if (!sum.defined()) {
          // a dense gradient that nothing else references (autograd made it for this call) takes the sum in place
          owned = gj.use_count() == 1 && gj.storage().use_count() == 1 && gj.is_non_overlapping_and_dense() &&
                  !gj.is_inference();
          sum = gj;
        } else if (owned) {
          sum.add_(gj);
        } else {
          sum = sum.add(gj);
          owned = true;
        }
      }
      if (!sum.defined()) continue;
      at::Tensor p = params[static_cast<size_t>(j)];
      at::Tensor& acc = p.mutable_grad();
      if (acc.defined()) acc.add_(sum);
      else acc = owned || sum.is_non_overlapping_and_dense() ? sum : sum.clone();
    }
  });
}

}  // namespace lf::parallel
