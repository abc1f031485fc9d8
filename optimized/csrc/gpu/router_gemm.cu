// router_gemm on the GPU (SPEC section 3; seed 001): logits[T, E] f32 = f32(x[T, H]) @ w[E, H].T
// with the cast fused into the load: 16-byte loads of 8 bf16 (or f16) of x, widened in
// registers; no f32 copy of x is ever written. One kernel per call.
//
// Shape of the work (gemv.cuh): a block owns kRows experts; its threads split H in chunks of
// 8; each thread loads its slice of the kRows weight rows once and applies it to all the
// tokens of its chunk (TB = 1, 2, 4, 8 or 16, a template parameter, so the accumulators stay
// in registers); warp-shuffle then shared-memory reduction in a fixed order, independent of T
// (batch invariant). T > 16 runs as chunks of 16 tokens on grid.y, in the same launch: a
// 32-token chunk needed 242 registers per thread (2 blocks per SM on sm_90a) or, capped at
// the decode budget of 128, spilled; two 16-token chunks keep 4 weight rows per block (so
// x is re-read from L2 by E/4 blocks, not E/2 or E) at <= 128 registers (docs/gpu.md).
//
// Floors (H200: ~4.8 TB/s HBM, ~60 TFLOP/s f32 FMA): MiniMax-M2 (H = 3072, E = 256):
// bytes = E*H*4 (weight, 3.1 MB) + T*H*2 + T*E*4 -> ~0.7 us; flops = 2*T*E*H = 50 MFLOP at
// T = 32 -> ~1 us at the f32 FMA peak: at decode sizes the weight stream and one launch set
// the floor, which is why the fused kernel beats cast + cuBLAS (3 launches, a round trip of
// the f32 copy of x).
#include "gemv.cuh"
#include "launch.h"

namespace moelab::gpu {
namespace {

// Weight rows per block: TB x ROWS accumulators must stay in registers (64-lane AMD waves get
// fewer VGPRs per lane at this block size, so fewer rows there).
template <int TB> constexpr int kRowsFor = TB >= 16 ? (kWarp == 64 ? 2 : 4) : 4;
constexpr int kMaxTB = 16;

template <int TB, Fmt XF, bool VEC>
__global__ void __launch_bounds__(kGemvThreads, kDecodeMinBlocks)
router_gemm_kernel(const void* __restrict__ x, int64_t ldx, const float* __restrict__ w, int64_t ldw,
                   float* __restrict__ out, int64_t T, int64_t H, int64_t E) {
  constexpr int ROWS = kRowsFor<TB>;
  __shared__ float red[kGemvWarps * TB * ROWS];
  __shared__ float sums[TB * ROWS];
  const int64_t n0 = int64_t(blockIdx.x) * ROWS, t0 = int64_t(blockIdx.y) * TB;
  const int64_t left = T - t0;
  const int nt = int(left < TB ? left : TB);
  constexpr int64_t xes = XF == Fmt::kF32 ? 4 : 2;
  const void* xt = static_cast<const char*>(x) + t0 * ldx * xes;
  gemv_block<TB, ROWS, XF, Fmt::kF32, VEC>(xt, ldx, w, ldw, n0, E, nt, H, red, sums);
  for (int i = threadIdx.x; i < TB * ROWS; i += kGemvThreads) {
    const int t = i / ROWS, r = i - t * ROWS;
    if (t < nt && n0 + r < E) out[(t0 + t) * E + n0 + r] = sums[i];
  }
}

template <int TB, Fmt XF>
int launch_tb(const void* x, int64_t ldx, const float* w, int64_t ldw, float* out, int64_t T, int64_t H,
              int64_t E, bool vec, Stream s) {
  constexpr int ROWS = kRowsFor<TB>;
  const int64_t gy = (T + TB - 1) / TB;
  if (gy > 65535) return kUnsupported;
  const dim3 grid(unsigned((E + ROWS - 1) / ROWS), unsigned(gy)), block(kGemvThreads);
  if (vec) MOELAB_LAUNCH((router_gemm_kernel<TB, XF, true>), grid, block, 0, s, x, ldx, w, ldw, out, T, H, E);
  else if constexpr (TB == 1) MOELAB_LAUNCH((router_gemm_kernel<1, XF, false>), grid, block, 0, s, x, ldx, w, ldw, out, T, H, E);
  else return kBadArgument;
  MOELAB_GPU_LAUNCHED();
  return kOk;
}

template <Fmt XF>
int launch_fmt(const void* x, int64_t ldx, const float* w, int64_t ldw, float* out, int64_t T, int64_t H,
               int64_t E, Stream s) {
  constexpr int64_t xes = XF == Fmt::kF32 ? 4 : 2;
  const uint64_t m = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w) | uint64_t(ldx * xes) |
                     uint64_t(ldw * 4);
  // Unaligned rows (a sliced x, H % 4 != 0): the scalar-load variant, one token per block
  // row (TB = 1). Same chunking and order as the vector path, so the same bits.
  const bool vec = (m & 15u) == 0;
  if (!vec || T <= 1) return launch_tb<1, XF>(x, ldx, w, ldw, out, T, H, E, vec, s);
  if (T <= 2) return launch_tb<2, XF>(x, ldx, w, ldw, out, T, H, E, vec, s);
  if (T <= 4) return launch_tb<4, XF>(x, ldx, w, ldw, out, T, H, E, vec, s);
  if (T <= 8) return launch_tb<8, XF>(x, ldx, w, ldw, out, T, H, E, vec, s);
  static_assert(kMaxTB == 16, "the largest token chunk");
  return launch_tb<16, XF>(x, ldx, w, ldw, out, T, H, E, vec, s);
}

}  // namespace

int router_gemm_launch(const void* x, Fmt fx, int64_t ldx, const float* w, int64_t ldw, float* out, int64_t T,
                       int64_t H, int64_t E, Stream s) {
  if (T < 0 || H < 1 || E < 1 || ldx < H || ldw < H) return kBadArgument;
  if (T == 0) return kOk;
  if (x == nullptr || w == nullptr || out == nullptr) return kBadArgument;
  if (E > int64_t(0x7fffffff) * 2) return kUnsupported;
  switch (fx) {
    case Fmt::kF32: return launch_fmt<Fmt::kF32>(x, ldx, w, ldw, out, T, H, E, s);
    case Fmt::kBF16: return launch_fmt<Fmt::kBF16>(x, ldx, w, ldw, out, T, H, E, s);
    case Fmt::kF16: return launch_fmt<Fmt::kF16>(x, ldx, w, ldw, out, T, H, E, s);
  }
  return kBadArgument;
}

}  // namespace moelab::gpu
