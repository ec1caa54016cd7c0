// kernels/cuda_graph.h: at::cuda::CUDAGraph and a stream of our own; stand-ins that throw without LOONGFORGE_CUDA.
#include "loongforge/kernels/cuda_graph.h"

#include <stdexcept>
#include <string>

#if defined(LOONGFORGE_CUDA) && LOONGFORGE_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <optional>

namespace lf::kernels::cuda {

struct StreamScope::Impl {
  c10::cuda::CUDAStreamGuard guard;
  Impl() : guard(c10::cuda::getStreamFromPool(/*isHighPriority=*/false)) {}
};

StreamScope::StreamScope() {
  c10::cuda::device_synchronize();  // work queued on the previous stream is done before ours starts
  impl_ = std::make_unique<Impl>();
}

StreamScope::~StreamScope() {
  try {
    c10::cuda::device_synchronize();
  } catch (...) {  // a destructor must not throw; a device error surfaces on the next call anyway
  }
}

struct Graph::Impl {
  std::optional<at::cuda::CUDAGraph> graph;
};

Graph::Graph() : impl_(std::make_unique<Impl>()) {}
Graph::~Graph() = default;

void Graph::capture(const std::function<void()>& fn) {
  if (c10::cuda::getCurrentCUDAStream() == c10::cuda::getDefaultCUDAStream())
    throw std::runtime_error("CUDA graph capture needs a stream other than the default one (a StreamScope)");
  // As torch.cuda.graph: a quiet device and the cached blocks of eager steps returned, so the graph's private pool
  // does not sit next to a second copy of the activations.
  c10::cuda::device_synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
  impl_->graph.emplace();
  impl_->graph->capture_begin();
  // The capture is ended whatever fn did (a failed fn leaves it invalidated, and capture_end then throws too); the
  // first error is the one reported.
  std::string why;
  auto first_line = [](const char* what) {
    std::string w = what;
    return w.substr(0, w.find('\n'));
  };
  try {
    fn();
  } catch (const std::exception& e) {
    why = first_line(e.what());
  }
  try {
    impl_->graph->capture_end();
  } catch (const std::exception& e) {
    if (why.empty()) why = first_line(e.what());
  }
  if (!why.empty()) {
    impl_->graph.reset();
    (void)cudaGetLastError();
    throw std::runtime_error("capturing the step in a CUDA graph failed: " + why);
  }
}

void Graph::replay() {
  if (!impl_->graph) throw std::runtime_error("CUDA graph: replay() before a successful capture()");
  impl_->graph->replay();
}

bool Graph::captured() const { return impl_->graph.has_value(); }

}  // namespace lf::kernels::cuda

#else

namespace lf::kernels::cuda {
namespace {
[[noreturn]] void missing() {
  throw std::runtime_error("LoongForge was built without CUDA (-DLOONGFORGE_CUDA=OFF): CUDA graphs are unavailable");
}
}  // namespace
struct StreamScope::Impl {};
struct Graph::Impl {};
StreamScope::StreamScope() { missing(); }
StreamScope::~StreamScope() = default;
Graph::Graph() { missing(); }
Graph::~Graph() = default;
void Graph::capture(const std::function<void()>&) { missing(); }
void Graph::replay() { missing(); }
bool Graph::captured() const { return false; }
}  // namespace lf::kernels::cuda

#endif
