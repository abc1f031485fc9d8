// The decode GEMM core shared by router_gemm.cu and skinny_gemm.cu:
//   out[t, n] = sum_k f32(x[t, k]) * f32(w[n, k]),  t < nt <= TB tokens, n in a block's ROWS.
//
// A block of kGemvWarps warps owns ROWS consecutive output rows (weight rows). The reduction
// dimension is cut into chunks of 8 elements (16-byte loads of 8 bf16/f16, or two of 4 f32);
// thread i of the block takes chunks i, i + threads, i + 2*threads, ... For each chunk it
// loads the ROWS weight slices ONCE, widens them in registers, and applies them to every
// token (x stays in L1/L2; TB is a template parameter so the TB x ROWS accumulators live in
// registers). Then:
//   warp: a multi-value butterfly. At each of log2(kWarp) levels a lane sends half of its
//         values to its partner and keeps the other half, so TB*ROWS values cost about
//         TB*ROWS + log2(kWarp) shuffles instead of TB*ROWS*log2(kWarp); every value's
//         sum follows the same tree (lanes paired by bit 4, 3, ... 0) whatever TB is.
//   block: the warps' partial sums added in warp order through shared memory.
// So the rounding of out[t, n] depends on K, the weight layout and the platform only -
// never on T, on nt or on the other tokens: the kernels are batch invariant.
#pragma once
#include "portability.h"

namespace moelab::gpu {

constexpr int kGemvWarps = 4;
constexpr int kGemvThreads = kGemvWarps * kWarp;

// 8 elements of a row starting at element k (VEC: one or two 16-byte loads; else scalar).
template <Fmt F, bool VEC>
MOELAB_DEV void load8(const void* row, int64_t k, float* d) {
  if constexpr (VEC) {
    if constexpr (F == Fmt::kF32) {
      const float* p = static_cast<const float*>(row) + k;
      unpack4_f32(ld16(p), d);
      unpack4_f32(ld16(p + 4), d + 4);
    } else {
      unpack8<F>(ld16(static_cast<const uint16_t*>(row) + k), d);
    }
  } else {
#pragma unroll
    for (int q = 0; q < 8; ++q) d[q] = load_elem<F>(row, k + q);
  }
}

// Multi-value warp reduction of v[0..N) (N a power of two). Afterwards, with W = kWarp:
// N >= W: lane l holds the totals of indices l*(N/W) + j in v[j], j < N/W;
// N <  W: every lane holds the total of index l >> (log2 W - log2 N) in v[0].
// One level per template instance (n values left, partner at lane ^ OFF): all indices are
// compile-time, so v stays in registers on both compilers.
template <int N, int n, int OFF>
MOELAB_DEV void warp_reduce_level(float (&v)[N], int lane) {
  if constexpr (OFF > 0) {
    if constexpr (n > 1) {
      constexpr int half = n / 2;
      // Bit-mask selects (not `upper ? v[i] : v[i + half]`, which a compiler may turn into
      // a load from a selected address and so move v out of registers).
      const uint32_t up = (lane & OFF) != 0 ? 0xffffffffu : 0u;
#pragma unroll
      for (int i = 0; i < half; ++i) {
        const uint32_t lo = __float_as_uint(v[i]), hi = __float_as_uint(v[i + half]);
        const float send = __uint_as_float((lo & up) | (hi & ~up));
        const float keep = __uint_as_float((hi & up) | (lo & ~up));
        v[i] = keep + shfl_xor(send, OFF);
      }
      warp_reduce_level<N, half, OFF / 2>(v, lane);
    } else {
      v[0] = v[0] + shfl_xor(v[0], OFF);
      warp_reduce_level<N, 1, OFF / 2>(v, lane);
    }
  }
}
template <int N>
MOELAB_DEV void warp_reduce_multi(float (&v)[N]) {
  warp_reduce_level<N, N, kWarp / 2>(v, lane_id());
}

// After warp_reduce_multi<NV>: f(i, total) once for each index i < NV, called by one lane
// that holds that total (with NV < kWarp, the lowest lane of the group that shares it).
template <int NV, typename F>
MOELAB_DEV void each_warp_total(const float (&acc)[NV], F&& f) {
  const int lane = lane_id();
  if constexpr (NV >= kWarp) {
#pragma unroll
    for (int j = 0; j < NV / kWarp; ++j) f(lane * (NV / kWarp) + j, acc[j]);
  } else {
    constexpr int shift = kLogWarp - (NV == 1 ? 0 : NV == 2 ? 1 : NV == 4 ? 2 : NV == 8 ? 3 : NV == 16 ? 4 : 5);
    if ((lane & ((1 << shift) - 1)) == 0) f(lane >> shift, acc[0]);
  }
}

// After warp_reduce_multi<NV>: this warp's NV sums go to red[warp * NV .. + NV), for a
// fixed-order sum over the warps after a barrier.
template <int NV>
MOELAB_DEV void stash_warp_sums(const float (&acc)[NV], float* red) {
  const int warp = warp_id();
  each_warp_total<NV>(acc, [&](int i, float v) { red[warp * NV + i] = v; });
}

// The block's TB x ROWS sums, reduced to shared memory red_out[t * ROWS + r] (valid after
// the function returns; it ends with a barrier). Rows n0 + r >= N read as zero.
template <int TB, int ROWS, Fmt XF, Fmt WF, bool VEC>
MOELAB_DEV void gemv_block(const void* __restrict__ x, int64_t ldx, const void* __restrict__ w, int64_t ldw,
                           int64_t n0, int64_t N, int nt, int64_t K, float* red /* [kGemvWarps][TB*ROWS] */,
                           float* red_out /* [TB*ROWS] */) {
  constexpr int64_t xes = XF == Fmt::kF32 ? 4 : 2, wes = WF == Fmt::kF32 ? 4 : 2;
  constexpr int NV = TB * ROWS;
  float acc[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) acc[i] = 0.0f;
  const char* wrow[ROWS];
  bool rvalid[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    rvalid[r] = n0 + r < N;
    wrow[r] = static_cast<const char*>(w) + (rvalid[r] ? (n0 + r) : 0) * ldw * wes;
  }
  const int64_t kvec = K / 8 * 8;
  for (int64_t k = int64_t(threadIdx.x) * 8; k < kvec; k += int64_t(kGemvThreads) * 8) {
    float wv[ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (rvalid[r]) load8<WF, VEC>(wrow[r], k, wv[r]);
      else
#pragma unroll
        for (int q = 0; q < 8; ++q) wv[r][q] = 0.0f;
    }
#pragma unroll
    for (int t = 0; t < TB; ++t) {
      if (t < nt) {
        float xv[8];
        load8<XF, VEC>(static_cast<const char*>(x) + t * ldx * xes, k, xv);
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[t * ROWS + r] = fmaf(xv[q], wv[r][q], acc[t * ROWS + r]);
      }
    }
  }
  // Tail (K % 8 elements): one element per thread, after its chunks.
  for (int64_t k = kvec + threadIdx.x; k < K; k += kGemvThreads) {
    float wk[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wk[r] = rvalid[r] ? load_elem<WF>(wrow[r], k) : 0.0f;
#pragma unroll
    for (int t = 0; t < TB; ++t)
      if (t < nt) {
        const float xk = load_elem<XF>(static_cast<const char*>(x) + t * ldx * xes, k);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[t * ROWS + r] = fmaf(xk, wk[r], acc[t * ROWS + r]);
      }
  }

  warp_reduce_multi<NV>(acc);
  stash_warp_sums<NV>(acc, red);
  __syncthreads();
  for (int i = threadIdx.x; i < NV; i += kGemvThreads) {
    float s = red[i];
    for (int q = 1; q < kGemvWarps; ++q) s = s + red[q * NV + i];
    red_out[i] = s;
  }
  __syncthreads();
}

}  // namespace moelab::gpu
