// skinny_gemm for AMD wave64 GPUs (MI200 gfx90a, MI300 gfx940/942): the idea of ROCm's
// wvSplitK kernels (vLLM's rocm_unquantized_gemm; seed 002), written for moelab.
//
//   out[T, N] = x[T, K] @ w[N, K].T (+ bias), bf16 or f16, f32 accumulation, T <= 8.
//
// * Persistent workgroups: the grid is sized to the machine (kWavesPerCU waves per compute
//   unit, never more than the work), and each wave walks output-row tiles n0, n0 + stride,
//   ... until N is done: no tail wave quantization at odd N (513 = 512 experts + 1 shared
//   gate), one launch whatever N.
// * Activations staged in LDS: the workgroup copies x (T*K*2 bytes <= kLdsBytes) to LDS once
//   with 16-byte loads; every wave then reads the tokens' slices from LDS, so the only global
//   stream is the weight, read exactly once.
// * K split across the 64 lanes: lane l takes the 8-element chunks k = 8*(l + 64 i) of each
//   of its tile's kRows weight rows (16-byte loads), applies them to every token, and the
//   wave reduces the kRows x T partial sums with the multi-value butterfly of gemv.cuh.
// The reduction order of an output depends on K only, never on T: batch invariant, like the
// portable kernel (its bits differ from the portable kernel's: a different split of K).
// Outside its domain (f32, or x too large for LDS) the launcher returns kUnsupported and the
// binding uses the portable skinny kernel (csrc/gpu/skinny_gemm.cu).
//
// Floors (MI300X: ~5.3 TB/s HBM): bytes = N*K*2 (the weight) + T*K*2 + T*N*2; seed 002's
// N = 513, K = 7168: 7.4 MB -> ~1.4 us plus one launch.
#include "../gpu/gemv.cuh"
#include "../gpu/launch.h"
#include "skinny_wave64.h"

namespace moelab::gpu {
namespace {

static_assert(kWarp == 64, "skinny_wave64 is the wave64 kernel");
constexpr int kWaves = 4;                     // waves per workgroup
constexpr int kThreads = kWaves * kWarp;      // 256
constexpr int kRows = 4;                      // output rows per wave tile
constexpr int kWavesPerCU = 8;                // persistent grid: CUs * 8 waves / 4 per group
constexpr int64_t kLdsBytes = 64 * 1024;

template <int TB, Fmt F>
__global__ void __launch_bounds__(kThreads)
skinny_wave64_kernel(const uint16_t* __restrict__ x, int64_t ldx, const uint16_t* __restrict__ w, int64_t ldw,
                     const uint16_t* __restrict__ bias, uint16_t* __restrict__ out, int T, int64_t K, int64_t N,
                     bool vec_x, bool vec) {
  MOELAB_EXTERN_SHARED(uint16_t, xs);         // [T][K] bf16/f16, rows K elements apart
  // 1. Stage x in LDS (16-byte copies when rows and K allow, else 2-byte).
  if (vec_x) {
    const int64_t per_row = K / 8;
    for (int64_t i = threadIdx.x; i < int64_t(T) * per_row; i += kThreads) {
      const int64_t t = i / per_row, c = i - t * per_row;
      st16(xs + t * K + c * 8, ld16(x + t * ldx + c * 8));
    }
  } else {
    for (int64_t i = threadIdx.x; i < int64_t(T) * K; i += kThreads) {
      const int64_t t = i / K, k = i - t * K;
      xs[t * K + k] = x[t * ldx + k];
    }
  }
  __syncthreads();

  // 2. Persistent loop over row tiles; one wave per tile.
  const int lane = lane_id();
  const int64_t wave = int64_t(blockIdx.x) * kWaves + warp_id(), nwaves = int64_t(gridDim.x) * kWaves;
  const int64_t kvec = K / 8 * 8;
  constexpr int NV = TB * kRows;
  for (int64_t n0 = wave * kRows; n0 < N; n0 += nwaves * kRows) {
    float acc[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) acc[i] = 0.0f;
    const uint16_t* wr[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) wr[r] = w + (n0 + r < N ? n0 + r : n0) * ldw;
    if (vec) {
      for (int64_t k = int64_t(lane) * 8; k < kvec; k += kWarp * 8) {
        float wv[kRows][8];
#pragma unroll
        for (int r = 0; r < kRows; ++r) unpack8<F>(ld16(wr[r] + k), wv[r]);
#pragma unroll
        for (int t = 0; t < TB; ++t) {
          if (t < T) {
            float xv[8];
            unpack8<F>(ld16(xs + t * K + k), xv);
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
              for (int q = 0; q < 8; ++q) acc[t * kRows + r] = fmaf(xv[q], wv[r][q], acc[t * kRows + r]);
          }
        }
      }
    }
    for (int64_t k = (vec ? kvec : 0) + lane; k < K; k += kWarp) {   // tail, or unaligned rows
      float wk[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) wk[r] = load_elem<F>(wr[r], k);
#pragma unroll
      for (int t = 0; t < TB; ++t)
        if (t < T) {
          const float xk = load_elem<F>(xs + t * K, k);
#pragma unroll
          for (int r = 0; r < kRows; ++r) acc[t * kRows + r] = fmaf(xk, wk[r], acc[t * kRows + r]);
        }
    }
    warp_reduce_multi<NV>(acc);
    // NV <= 32 < 64: lane l holds index l >> (6 - log2 NV); its group's first lane writes.
    constexpr int shift = kLogWarp - (NV == 4 ? 2 : NV == 8 ? 3 : NV == 16 ? 4 : 5);
    if ((lane & ((1 << shift) - 1)) == 0) {
      const int i = lane >> shift, t = i / kRows, r = i - t * kRows;
      if (t < T && n0 + r < N) {
        float v = acc[0];
        if (bias != nullptr) v = v + load_elem<F>(bias, n0 + r);
        store_elem<F>(out, int64_t(t) * N + n0 + r, v);
      }
    }
  }
}

template <int TB, Fmt F>
int launch_tb(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, const uint16_t* bias, uint16_t* out,
              int T, int64_t K, int64_t N, int n_cu, Stream s) {
  // 16-byte paths: x rows (staging) and weight rows + LDS rows (K % 8 == 0) 16-byte aligned.
  const bool vec_x = aligned16(x) && (ldx & 7) == 0 && (K & 7) == 0;
  const bool vec = aligned16(w) && (ldw & 7) == 0 && (K & 7) == 0;
  const int64_t tiles = (N + kRows - 1) / kRows;
  int64_t groups = (int64_t(n_cu > 0 ? n_cu : 1) * kWavesPerCU + kWaves - 1) / kWaves;
  const int64_t need = (tiles + kWaves - 1) / kWaves;
  if (groups > need) groups = need;
  const size_t lds = size_t(T) * size_t(K) * 2;
  MOELAB_LAUNCH((skinny_wave64_kernel<TB, F>), dim3(unsigned(groups)), dim3(kThreads), lds, s, x, ldx, w, ldw, bias,
                out, T, K, N, vec_x, vec);
  MOELAB_GPU_LAUNCHED();
  return kOk;
}

template <Fmt F>
int launch_fmt(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, const uint16_t* bias, uint16_t* out,
               int T, int64_t K, int64_t N, int n_cu, Stream s) {
  if (T <= 1) return launch_tb<1, F>(x, ldx, w, ldw, bias, out, T, K, N, n_cu, s);
  if (T <= 2) return launch_tb<2, F>(x, ldx, w, ldw, bias, out, T, K, N, n_cu, s);
  if (T <= 4) return launch_tb<4, F>(x, ldx, w, ldw, bias, out, T, K, N, n_cu, s);
  return launch_tb<8, F>(x, ldx, w, ldw, bias, out, T, K, N, n_cu, s);
}

}  // namespace

// Decided from K alone (LDS sized for the largest T), never from T: a token's row then takes
// the same kernel, hence the same reduction order, in a batch of any size (batch invariance).
bool skinny_wave64_fits(Fmt fmt, int64_t T, int64_t K) {
  return (fmt == Fmt::kBF16 || fmt == Fmt::kF16) && T >= 1 && T <= kSkinnyMaxT && K >= 1 &&
         kSkinnyMaxT * K * 2 <= kLdsBytes;
}

int skinny_wave64_launch(const void* x, int64_t ldx, const void* w, int64_t ldw, const void* bias, void* out, Fmt fmt,
                         int64_t T, int64_t K, int64_t N, int n_cu, Stream s) {
  if (T < 0 || T > kSkinnyMaxT || K < 1 || N < 1 || (T > 0 && ldx < K) || ldw < K) return kBadArgument;
  if (T == 0) return kOk;
  if (!skinny_wave64_fits(fmt, T, K)) return kUnsupported;
  if (x == nullptr || w == nullptr || out == nullptr) return kBadArgument;
  const auto* xp = static_cast<const uint16_t*>(x);
  const auto* wp = static_cast<const uint16_t*>(w);
  const auto* bp = static_cast<const uint16_t*>(bias);
  auto* op = static_cast<uint16_t*>(out);
  if (fmt == Fmt::kBF16) return launch_fmt<Fmt::kBF16>(xp, ldx, wp, ldw, bp, op, int(T), K, N, n_cu, s);
  return launch_fmt<Fmt::kF16>(xp, ldx, wp, ldw, bp, op, int(T), K, N, n_cu, s);
}

}  // namespace moelab::gpu
