// skinny_gemm on the GPU (SPEC section 4; seed 002): out[T, N] = x[T, K] @ w[N, K].T (+ bias),
// x, w, bias and out of one dtype (bf16, f16, f32), f32 accumulation, T <= 8 (decode).
//
// Split-K across the lanes and warps of a block that owns kRows output rows (gemv.cuh): each
// thread reads its 8-element slices of the kRows weight rows once (16-byte loads) and
// applies them to every token; odd N (the fused gate's E + 1) is a guard on the last block's
// rows, K % 8 a scalar tail, strided rows of x a row stride. Epilogue per output: the fixed-
// order f32 sum, + f32(bias[n]) (one rounding), one rounding to the dtype, as on the CPU.
// Batch invariant (the reduction order does not depend on T).
//
// Floors (H200 ~4.8 TB/s): bytes = N*K*e (the weight, once) + T*K*e + T*N*e. Seed 002's
// fused gate (N = 513, K = 7168, bf16): 7.4 MB -> ~1.5 us, plus one launch; flops = 2*T*N*K
// = 59 MFLOP at T = 8, ~1 us on the f32 FMA pipes: memory- and launch-bound.
// ROCm runs the wave64 variant in csrc/hip/skinny_wave64.hip instead (the binding decides).
#include "gemv.cuh"
#include "launch.h"

namespace moelab::gpu {
namespace {

constexpr int kRows = 4;

template <int TB, Fmt F, bool VEC>
__global__ void __launch_bounds__(kGemvThreads, kDecodeMinBlocks)
skinny_gemm_kernel(const void* __restrict__ x, int64_t ldx, const void* __restrict__ w, int64_t ldw,
                   const void* __restrict__ bias, void* __restrict__ out, int64_t T, int64_t K, int64_t N) {
  __shared__ float red[kGemvWarps * TB * kRows];
  __shared__ float sums[TB * kRows];
  const int64_t n0 = int64_t(blockIdx.x) * kRows;
  gemv_block<TB, kRows, F, F, VEC>(x, ldx, w, ldw, n0, N, int(T), K, red, sums);
  for (int i = threadIdx.x; i < TB * kRows; i += kGemvThreads) {
    const int t = i / kRows, r = i - t * kRows;
    if (t < T && n0 + r < N) {
      float v = sums[i];
      if (bias != nullptr) v = v + load_elem<F>(bias, n0 + r);
      store_elem<F>(out, int64_t(t) * N + n0 + r, v);
    }
  }
}

template <int TB, Fmt F>
int launch_tb(const void* x, int64_t ldx, const void* w, int64_t ldw, const void* bias, void* out, int64_t T,
              int64_t K, int64_t N, bool vec, Stream s) {
  const dim3 grid(unsigned((N + kRows - 1) / kRows)), block(kGemvThreads);
  (void)vec;
  MOELAB_LAUNCH((skinny_gemm_kernel<TB, F, true>), grid, block, 0, s, x, ldx, w, ldw, bias, out, T, K, N);
  MOELAB_GPU_LAUNCHED();
  return kOk;
}

// Unaligned rows (a sliced x, K % 8 != 0): scalar loads, one launch per token (TB = 1). Same
// chunking and order as the vector path, so the same bits; only slower.
template <Fmt F>
int launch_scalar(const void* x, int64_t ldx, const void* w, int64_t ldw, const void* bias, void* out, int64_t T,
                  int64_t K, int64_t N, Stream s) {
  constexpr int64_t es = F == Fmt::kF32 ? 4 : 2;
  const dim3 grid(unsigned((N + kRows - 1) / kRows)), block(kGemvThreads);
  for (int64_t t = 0; t < T; ++t) {
    MOELAB_LAUNCH((skinny_gemm_kernel<1, F, false>), grid, block, 0, s, static_cast<const char*>(x) + t * ldx * es,
                  ldx, w, ldw, bias, static_cast<char*>(out) + t * N * es, int64_t(1), K, N);
    MOELAB_GPU_LAUNCHED();
  }
  return kOk;
}

template <Fmt F>
int launch_fmt(const void* x, int64_t ldx, const void* w, int64_t ldw, const void* bias, void* out, int64_t T,
               int64_t K, int64_t N, Stream s) {
  constexpr int64_t es = F == Fmt::kF32 ? 4 : 2;
  const uint64_t m = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w) | uint64_t(ldx * es) |
                     uint64_t(ldw * es);
  const bool vec = (m & 15u) == 0;
  if (!vec) return launch_scalar<F>(x, ldx, w, ldw, bias, out, T, K, N, s);
  if (T <= 1) return launch_tb<1, F>(x, ldx, w, ldw, bias, out, T, K, N, vec, s);
  if (T <= 2) return launch_tb<2, F>(x, ldx, w, ldw, bias, out, T, K, N, vec, s);
  if (T <= 4) return launch_tb<4, F>(x, ldx, w, ldw, bias, out, T, K, N, vec, s);
  return launch_tb<8, F>(x, ldx, w, ldw, bias, out, T, K, N, vec, s);
}

}  // namespace

int skinny_gemm_launch(const void* x, int64_t ldx, const void* w, int64_t ldw, const void* bias, void* out, Fmt fmt,
                       int64_t T, int64_t K, int64_t N, Stream s) {
  if (T < 0 || T > kSkinnyMaxT || K < 1 || N < 1 || (T > 0 && ldx < K) || ldw < K) return kBadArgument;
  if (T == 0) return kOk;
  if (x == nullptr || w == nullptr || out == nullptr) return kBadArgument;
  if ((N + kRows - 1) / kRows > 0x7fffffffLL) return kUnsupported;
  switch (fmt) {
    case Fmt::kF32: return launch_fmt<Fmt::kF32>(x, ldx, w, ldw, bias, out, T, K, N, s);
    case Fmt::kBF16: return launch_fmt<Fmt::kBF16>(x, ldx, w, ldw, bias, out, T, K, N, s);
    case Fmt::kF16: return launch_fmt<Fmt::kF16>(x, ldx, w, ldw, bias, out, T, K, N, s);
  }
  return kBadArgument;
}

}  // namespace moelab::gpu
