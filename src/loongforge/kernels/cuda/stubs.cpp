// Stand-ins for kernels/cuda_ops.h when the library is built without LOONGFORGE_CUDA: available() is false and every
// kernel throws (callers check available()/supported() first).
#if !(defined(LOONGFORGE_CUDA) && LOONGFORGE_CUDA)
#include <c10/util/Exception.h>

#include "loongforge/kernels/cuda_ops.h"

namespace lf::kernels::cuda {
namespace {
[[noreturn]] void missing(const char* op) {
  TORCH_CHECK(false, "LoongForge was built without CUDA kernels (-DLOONGFORGE_CUDA=OFF): ", op, " is unavailable");
}
}  // namespace

bool compiled() { return false; }
bool available() { return false; }
std::string unavailable_reason() { return "this build has no CUDA support (LOONGFORGE_CUDA=OFF)"; }
bool supported(const at::Tensor&) { return false; }
int64_t max_memory_allocated() { return 0; }
void synchronize() {}
int device_count() { return 0; }
void set_device(int) { missing("set_device"); }
std::string device_description(int) { missing("device_description"); }
std::string runtime_version() { return ""; }

at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double) { missing("rms_norm"); }
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  missing("add_rms_norm");
}
at::Tensor rope(const at::Tensor&, const at::Tensor&, const at::Tensor&) { missing("rope"); }
at::Tensor swiglu(const at::Tensor&, const at::Tensor&) { missing("swiglu"); }
at::Tensor linear_cross_entropy(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t) {
  missing("linear_cross_entropy");
}
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor&, const at::Tensor&, double) {
  missing("rms_norm_forward");
}
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&) {
  missing("rms_norm_backward");
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, double) {
  missing("add_rms_norm_forward");
}
at::Tensor rope_apply(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) { missing("rope_apply"); }
at::Tensor swiglu_forward(const at::Tensor&, const at::Tensor&) { missing("swiglu_forward"); }
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  missing("swiglu_backward");
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_ce_forward(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, int64_t, int64_t) {
  missing("linear_ce_forward");
}
std::tuple<at::Tensor, at::Tensor> linear_ce_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                      int64_t) {
  missing("linear_ce_backward");
}
int64_t linear_ce_auto_chunk(int64_t, int64_t vocab) { return vocab; }
at::Tensor fp8_e4m3_cast(const at::Tensor&, const at::Tensor&) { missing("fp8_e4m3_cast"); }
void multi_tensor_adamw(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                        const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const AdamWHyper&,
                        const std::vector<double>&, const std::optional<at::Tensor>&,
                        const std::vector<at::Tensor>&) {
  missing("multi_tensor_adamw");
}
at::Tensor multi_tensor_l2norm(const std::vector<at::Tensor>&) { missing("multi_tensor_l2norm"); }
at::Tensor clip_coef(const at::Tensor&, double) { missing("clip_coef"); }

}  // namespace lf::kernels::cuda
#endif
