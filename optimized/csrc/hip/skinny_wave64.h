// The ROCm-only wave64 skinny GEMM (skinny_wave64.hip): declared for the HIP binding.
#pragma once
#include "../gpu/launch.h"

namespace moelab::gpu {
// bf16/f16 with T * K * 2 bytes of x fitting in LDS (64 KB); other calls: kUnsupported.
bool skinny_wave64_fits(Fmt fmt, int64_t T, int64_t K);
// out[T, N] = x[T, K] @ w[N, K].T (+ bias[N]); n_cu: compute units of the device (grid size).
int skinny_wave64_launch(const void* x, int64_t ldx, const void* w, int64_t ldw, const void* bias, void* out, Fmt fmt,
                         int64_t T, int64_t K, int64_t N, int n_cu, Stream stream);
}  // namespace moelab::gpu
