// GPU-extension introspection: which platform the kernels were built for and its warp size.
#include "common.h"

namespace moelab::gpu_binding {
namespace {
std::vector<std::string> gpu_info() {
  return {std::string("platform:") + (MOELAB_HIP ? "rocm" : "cuda"), "warp:" + std::to_string(gpu::warp_size())};
}
}  // namespace
}  // namespace moelab::gpu_binding

TORCH_LIBRARY_FRAGMENT(moelab, m) { m.def("gpu_info() -> str[]", &moelab::gpu_binding::gpu_info); }
