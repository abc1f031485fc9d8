// router_gemm: logits[T,E] (f32) = upcast(x[T,H]) @ weight[E,H].T, f32 accumulation.
//
// Data layout. x [T,H] bf16/f16/f32, unit stride along H, rows ldx elements apart (read in
// place); weight [E,H] f32 row-major, contiguous; out [T,E] f32.
//
// Algorithm. The cast is fused into the load: bf16/f16 rows of x widen to f32 in registers,
// so no f32 copy of x is ever written (seed 001's point). A thread owns a contiguous range of
// experts (the binding hands them out in multiples of 4) and walks it kNE weight rows at a
// time (6 on AVX-512, 4 on AVX2 / NEON / scalar). For each block of up to kNT tokens (2 on
// AVX2, else 4) it keeps kNT x kNE vector accumulators over the whole of H (AVX-512: 24
// accumulators + 6 weight vectors + 1 x vector = 31 of the 32 registers; AVX2: 8 + 4 + 1 of
// 16, the weights read as FMA memory operands), so the weight rows are read once from
// memory for the first token block and from L2 for the next ones (a block of 6 rows of
// H = 3072 is 72 KiB); x stays in L2. Every weight-row step of 64 bytes also prefetches (into
// L2) the NEXT block's rows at the same offset, a whole block ahead; when there are several
// token blocks the next block's rows are shared out among them (token block k prefetches rows
// k, k + nt, ...), so the memory stream keeps running while each token block computes.
// On AVX-512 each 64-byte step also prefetches into L1 the block's own rows kAheadL1 = 4
// lines ahead (they come from L2 for every token block but the first), and a bf16 x chunk
// widens with one vpermw (vec.h widen_bf16: lane l = x[h + l] << 16) instead of vpmovzxwd +
// vpslld; same bits, same lanes, so the reduction order below is unchanged.
//
// Reduction order of out[t,e] (batch invariance): lane l of the accumulator sums the chunks
// h = c*V + l (V = 16 lanes on AVX-512, 8 on AVX2, 4 on NEON, 1 scalar) in increasing c, one
// f32 FMA per lane per chunk, the zero-padded tail chunk last; then one horizontal sum (vsum;
// NEON: (l0 + l2) + (l1 + l3)). It
// depends on H and the ISA only, never on T, on the tile a token or expert lands in, on the
// other tokens or on the thread split, so the kernel is batch invariant.
//
// Cost: bytes = E*H*4 (weight, once) + T*H*sizeof(x) + T*E*4; flops = 2*T*E*H. No scratch.
// Floors at H = 3072, E = 256, bf16 x, weights cold, on the 2-core AVX-512 development
// machine: read bandwidth ~19 GB/s on 1 thread and ~35 GB/s on 2 (the read probe
// `python -m experiments.bench` prints), a 512-bit f32 FMA peak of ~112 GFLOP/s per core
// (one FMA per ~0.28 ns: experiments/micro/dpbf16_peak.cpp):
//     T     bytes     memory floor 1 / 2 thr    flops     compute floor 1 / 2 thr
//     1    3.15 MB      ~164 / 91 us           1.6 M        ~14 / 7 us
//     4    3.17 MB      ~165 / 91 us           6.3 M        ~56 / 28 us
//     8    3.20 MB      ~167 / 92 us          12.6 M       ~111 / 56 us
//    32    3.38 MB      ~176 / 97 us          50.3 M       ~445 / 223 us
// So T <= 8 is memory-bound, and what matters is that the weight stream never stops while
// the products run; T = 32 is compute-bound on one thread (a 4 x 6 tile is 24 FMAs per 6
// weight and 4 x loads, well inside the load ports). Hence the software prefetch a block
// ahead: the hardware prefetchers stop at every 4 KiB page, and with more work per byte
// fewer demand misses are in flight, so without it the stream slows as T grows and memory
// idles while the token blocks after the first re-read the block from L2. Peer ratios:
// docs/performance.md. The tile shapes, H slicings and x conversions that lost to this one,
// and how to measure them: docs/router_gemm.md, "Design alternatives".
#include "isa_begin.h"

namespace moelab::cpu::MOELAB_ISA_NS {
namespace {

#if MOELAB_ISA_LEVEL >= 2
constexpr int kNT = 4;          // tokens per tile
constexpr int kNE = 6;          // experts per tile: 4 x 6 = 24 accumulators + 6 weight vectors + x
#elif MOELAB_ISA_LEVEL == 1
constexpr int kNT = 2;          // 2 x 4 = 8 accumulators + 4 weight vectors + x: 4 x 4 spills 16 ymm
constexpr int kNE = 4;
#else
constexpr int kNT = 4;
constexpr int kNE = 4;
#endif
constexpr int64_t kLineF = 16;  // f32 per 64-byte cache line
#if MOELAB_ISA_LEVEL >= 2
constexpr int64_t kAheadL1 = 4 * kLineF;   // L1 prefetch distance on the tile's own rows (f32)
#else
constexpr int64_t kAheadL1 = 0;            // (not measured on AVX2 / scalar: off)
#endif

// NT tokens x up to kNE experts of the output (ne valid; Full: ne == kNE), over all of H.
// Each 64-byte step of the weight rows also prefetches, into L2, pf_n rows of the NEXT
// expert block at the same offset: pf, pf + pf_stride, ...; and, into L1, the tile's own
// rows kAheadL1 elements ahead (they come from L2, or memory for the first token tile).
template <Fmt F, int NT, bool Full>
inline void tile(const char* x, int64_t ldx_b, const float* w, int64_t H, int ne,
                 const float* pf, int pf_n, int64_t pf_stride, float* out, int64_t ldo) {
  vf acc[NT][kNE];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < kNE; ++j) acc[t][j] = vzero();
  int64_t h = 0;
  for (; h + kVecF <= H; h += kVecF) {
    if (kVecF >= kLineF || h % kLineF == 0) {
      for (int r = 0; r < pf_n; ++r) __builtin_prefetch(pf + r * pf_stride + h, 0, 2);
      if constexpr (kAheadL1 > 0)
        for (int j = 0; j < kNE; ++j)
          if (Full || j < ne) __builtin_prefetch(w + j * H + h + kAheadL1, 0, 3);
    }
    vf wv[kNE];
    for (int j = 0; j < kNE; ++j) wv[j] = (Full || j < ne) ? vload(w + j * H + h) : vzero();
    for (int t = 0; t < NT; ++t) {
      vf xv = vload_as<F>(x + t * ldx_b, h);
      for (int j = 0; j < kNE; ++j) acc[t][j] = vfma(xv, wv[j], acc[t][j]);
    }
  }
  if (h < H) {                  // zero-padded tail chunk
    const int n = int(H - h);
    vf wv[kNE];
    for (int j = 0; j < kNE; ++j) wv[j] = (Full || j < ne) ? vload(w + j * H + h, n) : vzero();
    for (int t = 0; t < NT; ++t) {
      vf xv = vload_as<F>(x + t * ldx_b, h, n);
      for (int j = 0; j < kNE; ++j) acc[t][j] = vfma(xv, wv[j], acc[t][j]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < ne; ++j) out[t * ldo + j] = vsum(acc[t][j]);
}

template <Fmt F, int NT>
inline void tile_any(const char* x, int64_t ldx_b, const float* w, int64_t H, int ne,
                     const float* pf, int pf_n, int64_t pf_stride, float* out, int64_t ldo) {
  if (ne == kNE) tile<F, NT, true>(x, ldx_b, w, H, ne, pf, pf_n, pf_stride, out, ldo);
  else tile<F, NT, false>(x, ldx_b, w, H, ne, pf, pf_n, pf_stride, out, ldo);
}

template <Fmt F>
void run(const void* x, int64_t ldx, const float* w, float* out, int64_t T, int64_t H,
         int64_t E, int64_t e0, int64_t e1) {
  const char* xb = static_cast<const char*>(x);
  const int64_t ldx_b = ldx * fmt_size(F);
  const int64_t nt = (T + kNT - 1) / kNT;              // token tiles
  for (int64_t e = e0; e < e1; e += kNE) {
    const int ne = int(imin_(kNE, e1 - e));
    const float* we = w + e * H;
    const int ne_next = int(imax_(0, imin_(kNE, e1 - e - kNE)));   // rows of the next block
    for (int64_t k = 0; k < nt; ++k) {
      // Tile k prefetches the next block's rows k, k + nt, ... (spread over the token tiles,
      // so the memory stream runs while every tile computes).
      const int pf_n = k < ne_next ? int((ne_next - k + nt - 1) / nt) : 0;
      const float* pf = pf_n > 0 ? we + (kNE + k) * H : we;
      const int64_t t = k * kNT;
      const char* xt = xb + t * ldx_b;
      float* ot = out + t * E + e;
      switch (imin_(kNT, T - t)) {
        case 4: tile_any<F, 4>(xt, ldx_b, we, H, ne, pf, pf_n, nt * H, ot, E); break;
        case 3: tile_any<F, 3>(xt, ldx_b, we, H, ne, pf, pf_n, nt * H, ot, E); break;
        case 2: tile_any<F, 2>(xt, ldx_b, we, H, ne, pf, pf_n, nt * H, ot, E); break;
        default: tile_any<F, 1>(xt, ldx_b, we, H, ne, pf, pf_n, nt * H, ot, E); break;
      }
    }
  }
}

}  // namespace

// Experts [e0, e1) of out[T,E] (row stride E). x rows are ldx elements apart.
void router_gemm_experts(const void* x, Fmt fmt, int64_t ldx, const float* w, float* out,
                         int64_t T, int64_t H, int64_t E, int64_t e0, int64_t e1) {
  switch (fmt) {
    case Fmt::kF32: run<Fmt::kF32>(x, ldx, w, out, T, H, E, e0, e1); break;
    case Fmt::kBF16: run<Fmt::kBF16>(x, ldx, w, out, T, H, E, e0, e1); break;
    case Fmt::kF16: run<Fmt::kF16>(x, ldx, w, out, T, H, E, e0, e1); break;
  }
}

}  // namespace moelab::cpu::MOELAB_ISA_NS
