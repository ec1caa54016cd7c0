// CUDA graphs for a step whose shapes do not change (train.cuda_graphs): the GPU work of a function is captured once
// and replayed with one launch, so the host's per-kernel launch cost and the gaps between kernels go away.
// Built on ATen's at::cuda::CUDAGraph (the caching allocator keeps a private pool for the graph's tensors, so every
// replay reuses the addresses the capture saw). Without CUDA in the build both classes throw on construction.
#pragma once
#include <functional>
#include <memory>

namespace lf::kernels::cuda {

// Makes a stream of its own (not the legacy default stream, which cannot be captured) the calling thread's current
// CUDA stream from construction to destruction; the device is synchronised at both ends, so work queued before and
// after stays ordered with it. Everything a graph reads and writes should be queued inside one StreamScope: then the
// copies into a graph's inputs, its replays and the work that reads its outputs run in stream order.
class StreamScope {
 public:
  StreamScope();
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One captured piece of GPU work. capture(fn) runs fn with the current stream in capture mode: the kernels fn
// queues (the autograd backward's included) are recorded, not run, and the tensors fn allocates come from the
// graph's pool and keep their addresses (keep references to the outputs you read after replay()). fn must not wait
// for the device or copy device data to the host (.item(), .cpu()); a capture that fails throws std::runtime_error
// with CUDA's reason and leaves the stream usable. replay() queues the recorded work on the current stream.
class Graph {
 public:
  Graph();
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void capture(const std::function<void()>& fn);
  void replay();
  bool captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lf::kernels::cuda
