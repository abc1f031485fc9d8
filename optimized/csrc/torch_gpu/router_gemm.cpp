// CUDA/ROCm implementation of moelab::router_gemm (schema in csrc/torch/router_gemm.cpp).
#include "common.h"

namespace moelab::gpu_binding {
namespace {
constexpr const char* kOp = "router_gemm";

at::Tensor router_gemm_cuda(const at::Tensor& x, const at::Tensor& weight) {
  check_is_gpu(x, kOp, "x");
  check_is_gpu(weight, kOp, "weight", &x);
  const checks::GemmSizes g = checks::check_router_gemm_args(kOp, x, weight);
  const int64_t T = g.T, H = g.K, E = g.N;
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({T, E}, x.options().dtype(at::kFloat));
  if (T == 0) return out;
  // Rows closer than H elements (an expanded x) are copied; a single row needs no stride.
  const at::Tensor xr = (T > 1 && x.stride(0) < H) || (H > 1 && x.stride(1) != 1) ? x.contiguous() : x;
  const int64_t ldx = T > 1 ? xr.stride(0) : H;
  check_launch(gpu::router_gemm_launch(xr.data_ptr(), fmt_of(xr), ldx, weight.data_ptr<float>(), H,
                                       out.data_ptr<float>(), T, H, E, current_stream()),
               kOp);
  return out;
}
}  // namespace
}  // namespace moelab::gpu_binding

TORCH_LIBRARY_IMPL(moelab, CUDA, m) { m.impl("router_gemm", &moelab::gpu_binding::router_gemm_cuda); }
