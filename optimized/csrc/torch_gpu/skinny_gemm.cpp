// CUDA/ROCm implementation of moelab::skinny_gemm (schema in csrc/torch/skinny_gemm.cpp).
// CUDA: the portable split-K kernel (csrc/gpu/skinny_gemm.cu). ROCm: the wave64 kernel
// (csrc/hip/skinny_wave64.hip, the wvSplitK idea) when x fits its LDS staging (bf16/f16,
// T*K*2 <= 64 KB), else the portable kernel. optimized.dispatch.explain says which.
#include "common.h"
#if MOELAB_HIP
#include "../hip/skinny_wave64.h"
#endif

namespace moelab::gpu_binding {
namespace {
constexpr const char* kOp = "skinny_gemm";

#if MOELAB_HIP
int compute_units(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  if (hipDeviceGetAttribute(&n, hipDeviceAttributeMultiprocessorCount, device) != hipSuccess || n < 1) n = 1;
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}
#endif

at::Tensor skinny_gemm_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_is_gpu(x, kOp, "x");
  check_is_gpu(weight, kOp, "weight", &x);
  if (bias.has_value()) check_is_gpu(*bias, kOp, "bias", &x);
  const checks::GemmSizes g = checks::check_skinny_gemm_args(kOp, x, weight, bias);
  const int64_t T = g.T, K = g.K, N = g.N;
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({T, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0) return out;
  // Overlapping rows (stride < K, an expanded tensor) are copied; a single row needs no stride.
  const at::Tensor xr = T > 1 && x.stride(0) < K ? x.contiguous() : x;
  const at::Tensor wr = N > 1 && weight.stride(0) < K ? weight.contiguous() : weight;
  const int64_t ldx = T > 1 ? xr.stride(0) : K, ldw = N > 1 ? wr.stride(0) : K;
  const void* bp = b.defined() ? b.data_ptr() : nullptr;
  const Fmt f = fmt_of(x);
#if MOELAB_HIP
  if (gpu::skinny_wave64_fits(f, T, K)) {
    check_launch(gpu::skinny_wave64_launch(xr.data_ptr(), ldx, wr.data_ptr(), ldw, bp, out.data_ptr(), f, T, K, N,
                                           compute_units(x.get_device()), current_stream()),
                 kOp);
    return out;
  }
#endif
  check_launch(gpu::skinny_gemm_launch(xr.data_ptr(), ldx, wr.data_ptr(), ldw, bp, out.data_ptr(), f, T, K, N,
                                       current_stream()),
               kOp);
  return out;
}

// Which kernel skinny_gemm takes on this build for (dtype, T, K): for dispatch.explain.
std::string gpu_skinny_kernel(const std::string& dtype, int64_t T, int64_t K) {
#if MOELAB_HIP
  const Fmt f = dtype == "bfloat16" ? Fmt::kBF16 : dtype == "float16" ? Fmt::kF16 : Fmt::kF32;
  if (gpu::skinny_wave64_fits(f, T, K))
    return "skinny_wave64 (ROCm wvSplitK-style: persistent workgroups, x staged in LDS, K split across 64 lanes)";
  return "skinny_gemm portable kernel (x does not fit the wave64 kernel's LDS staging, or f32)";
#else
  (void)dtype; (void)T; (void)K;
  return "skinny_gemm portable kernel (split-K across lanes and warps, 4 output rows per block)";
#endif
}
}  // namespace
}  // namespace moelab::gpu_binding

TORCH_LIBRARY_FRAGMENT(moelab, m) {
  m.def("gpu_skinny_kernel(str dtype, int T, int K) -> str", &moelab::gpu_binding::gpu_skinny_kernel);
}
TORCH_LIBRARY_IMPL(moelab, CUDA, m) { m.impl("skinny_gemm", &moelab::gpu_binding::skinny_gemm_cuda); }
