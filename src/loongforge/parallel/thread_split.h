// Data parallelism over the CPU threads of one process. Small GEMMs and element-wise ops parallelised inside each op
// spend a good part of a CPU step waiting at the ops' barriers; splitting a micro-batch's rows into one part per
// intra-op thread and running each part's forward and backward single-threaded on its own thread (nested ATen and
// MKL parallelism runs inline inside a parallel region) keeps every core busy instead. The parts' parameter
// gradients are summed in part order, so a given split gives bitwise the same gradients on every run.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace lf::parallel {

// Runs fn(i) for every i in [0, n) on ATen's intra-op threads (with one thread, or inside a parallel region: in turn
// on this thread). Each call sees the caller's thread-local state (grad mode, autocast); ops inside it run on its
// thread. The first exception thrown by a call is rethrown here.
void on_threads(int64_t n, const std::function<void(int64_t)>& fn);

// Differentiates loss_fn(i) for the n parts, each on its own thread (on_threads), and adds the sum of the parts'
// gradients, in part order, into params' .grad (parameters a part does not reach get nothing from it). loss_fn
// builds part i's scalar to differentiate, with gradients on; params need requires_grad.
void split_backward(int64_t n, const std::vector<at::Tensor>& params, const std::function<at::Tensor(int64_t)>& loss_fn);

}  // namespace lf::parallel
