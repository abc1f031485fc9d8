// skinny_gemm: out[T,N] = x[T,K] @ w[N,K].T (+ bias[N]), f32 accumulation, T <= 8 (decode).
//
// Algorithm. The weight is the big operand (N*K elements; x is T*K with T <= 8), so the
// kernel streams every weight row from memory exactly once for all T tokens. A thread owns
// a contiguous range of output features and walks it R weight rows at a time (R = 1 while x
// is small enough to stay in L1, else R = 4; see run_rows); for each block of up to TT
// tokens (4 on AVX-512, 2 on AVX2 / scalar, where registers are fewer) it keeps TT x R
// vector accumulators over the whole K. When T > TT the next token block re-reads the same
// R rows from L1/L2 (4 rows of K = 4096 bf16 are 32 KiB), not from memory. x (at most 8*K
// elements) stays in L1/L2; its rows may be `ldx` elements apart (strided x).
//
// Products.
//   level 3 (avx512_bf16), bf16 inputs: vdpbf16ps on 32 bf16 pairs at a time, no widening.
//     What the instruction computes, lane i of 16 (Intel SDM pseudocode, and checked
//     bit for bit against a scalar model on this machine's AMD EPYC over 9.6M lanes):
//         acc = fma(x[2i+1], w[2i+1], acc);  acc = fma(x[2i], w[2i], acc)
//     i.e. two chained f32 FMAs, odd element first, each rounded to nearest even, with
//     denormal inputs (x, w and acc) read as zero and denormal results flushed to zero
//     (DAZ/FTZ; MXCSR is neither read nor written). A bf16*bf16 product is exact in f32
//     (8+8 significant bits), so each FMA is one correctly rounded addition: the error is
//     that of f32 sequential summation of K/16 terms per lane, like the FMA path below. The
//     flush adds an absolute error below 2^-126 per step (tests allow K * 2^-126); it only
//     matters for sums that are themselves near f32's underflow.
//   otherwise (levels 0-2, and f16 / f32 inputs at every level): bf16/f16 widen to f32 in
//     registers (exact) and accumulate with f32 FMA (one rounding per step).
//
// Reduction order of out[t,n] (batch invariance): lane l of the vector accumulator sums the
// chunks k = c*V + l (V = 16 lanes on AVX-512, 8 on AVX2, 4 on NEON, 1 scalar; on the dpbf16 path pairs
// k = 32c + 2l + {1, 0} in that order) in increasing c, a zero-padded tail chunk last; then
// one fixed horizontal sum of the lanes; then + f32(bias[n]) (one rounding); then one
// rounding to the output dtype. Every step depends on K and the ISA level only, never on T,
// on the tile a token lands in, on the other tokens or on the thread split (a thread owns
// whole output features), so a token's output is bit-identical alone or inside any batch.
//
// Memory. Besides the hardware prefetchers (which stop at 4 KiB pages), each chunk step
// prefetches the NEXT R rows at the same offset into L2 (prefetch_next_block), so their
// lines are requested a whole row block ahead while this block's products run.
//
// Cost and floors (this machine, AMD EPYC, 2 cores, AVX-512 BF16):
//   bytes = N*K*e (weight, once) + T*K*e + T*N*e (e = element size); the weight dominates:
//   N = 513, K = 4096, bf16 -> 4.2 MB -> 70..140 us at 60..30 GB/s (the read bandwidth
//   measured here swings between those as other jobs share the machine).
//   flops = 2*T*N*K (34 MFLOP at T = 8 for that shape). Measured here: vdpbf16ps peaks at
//   ~8e9 instructions/s per core (64 flops each: ~510 GFLOP/s), the 4x4 tile with
//   L2-resident weights reaches ~310 GFLOP/s per core -> ~55 us for T = 8 on 2 cores,
//   ~27 us for T = 4: below the memory floor, so decode shapes are memory-bound; what
//   costs time beyond the floor at T = 4..8 is compute that does not fully overlap the
//   stream (timed on one core: cold time ~ L3-hot time + a constant memory stall). Current
//   figures per machine: docs/performance.md.
#include "isa_begin.h"

namespace moelab::cpu::MOELAB_ISA_NS {
namespace {

constexpr int kRows = 4;                               // weight rows per pass (R), x large
constexpr int64_t kOneRowXBytes = 16 << 10;            // x up to this: R = 1 (see run_rows)
#if MOELAB_ISA_LEVEL >= 2
constexpr int kTokTile = 4;                            // tokens per tile (TT)
#else
constexpr int kTokTile = 2;
#endif

template <Fmt F> constexpr int64_t esize() { return F == Fmt::kF32 ? 4 : 2; }

// Software prefetch of the NEXT R rows at the same offset, into L2: while this block's
// products run, the next block's lines are already on their way, a whole block ahead (the
// hardware prefetchers stop at 4 KiB pages and fall behind while the core computes). Timed
// on this machine, cold weights: on one core 10-15% faster at T = 4 than no software
// prefetch; on 2 cores within the noise at T = 1 and ~8% faster at T = 4. A prefetch never
// faults, so running past the thread's rows or the tensor's end is harmless.
template <int R>
inline void prefetch_next_block(const char* w, int64_t ldw_b, int64_t off_b) {
#if MOELAB_ISA_LEVEL >= 1
  for (int j = 0; j < R; ++j) _mm_prefetch(w + (R + j) * ldw_b + off_b, _MM_HINT_T1);
#else
  (void)w, (void)ldw_b, (void)off_b;
#endif
}

template <Fmt F> inline vf load_v(const char* p, int64_t i) {
  if constexpr (F == Fmt::kF32) return vload(reinterpret_cast<const float*>(p) + i);
  else if constexpr (F == Fmt::kBF16) return vload_bf16(reinterpret_cast<const uint16_t*>(p) + i);
  else return vload_f16(reinterpret_cast<const uint16_t*>(p) + i);
}
template <Fmt F> inline vf load_v(const char* p, int64_t i, int n) {
  if constexpr (F == Fmt::kF32) return vload(reinterpret_cast<const float*>(p) + i, n);
  else if constexpr (F == Fmt::kBF16) return vload_bf16(reinterpret_cast<const uint16_t*>(p) + i, n);
  else return vload_f16(reinterpret_cast<const uint16_t*>(p) + i, n);
}
template <Fmt F> inline float load_s(const void* p, int64_t i) {
  if constexpr (F == Fmt::kF32) return static_cast<const float*>(p)[i];
  else if constexpr (F == Fmt::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  else return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
}
template <Fmt F> inline void store_s(void* p, int64_t i, float v) {
  if constexpr (F == Fmt::kF32) static_cast<float*>(p)[i] = v;
  else if constexpr (F == Fmt::kBF16) static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  else static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
}

// f32 FMA tile: NT tokens x nr (<= R) weight rows; sums land in res[t][j].
template <Fmt F, int R, int NT>
inline void tile_fma(const char* x, int64_t ldx_b, const char* w, int64_t ldw_b, int64_t K, int nr,
                     float res[kTokTile][kRows]) {
  vf acc[NT][R];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < R; ++j) acc[t][j] = vzero();
  int64_t k = 0;
  for (; k + kVecF <= K; k += kVecF) {
    vf wv[R];
    for (int j = 0; j < R; ++j) wv[j] = j < nr ? load_v<F>(w + j * ldw_b, k) : vzero();
    if (MOELAB_ISA_LEVEL >= 1 && (k * esize<F>()) % 64 < kVecF * esize<F>()) prefetch_next_block<R>(w, ldw_b, k * esize<F>());
    for (int t = 0; t < NT; ++t) {
      vf xv = load_v<F>(x + t * ldx_b, k);
      for (int j = 0; j < R; ++j) acc[t][j] = vfma(xv, wv[j], acc[t][j]);
    }
  }
  if (k < K) {                                         // zero-padded tail chunk
    const int n = int(K - k);
    vf wv[R];
    for (int j = 0; j < R; ++j) wv[j] = j < nr ? load_v<F>(w + j * ldw_b, k, n) : vzero();
    for (int t = 0; t < NT; ++t) {
      vf xv = load_v<F>(x + t * ldx_b, k, n);
      for (int j = 0; j < R; ++j) acc[t][j] = vfma(xv, wv[j], acc[t][j]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < nr; ++j) res[t][j] = vsum(acc[t][j]);
}

#if MOELAB_ISA_LEVEL == 3
inline __mmask32 tail_mask32(int n) { return n >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << n) - 1u); }

// vdpbf16ps tile (bf16 only): 32 bf16 of each operand per step, 16 f32 lanes.
template <int R, int NT>
inline void tile_dp(const char* x, int64_t ldx_b, const char* w, int64_t ldw_b, int64_t K, int nr,
                    float res[kTokTile][kRows]) {
  __m512 acc[NT][R];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < R; ++j) acc[t][j] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[R];
    for (int j = 0; j < R; ++j)
      wv[j] = j < nr ? _mm512_loadu_si512(reinterpret_cast<const uint16_t*>(w + j * ldw_b) + k) : zero;
    prefetch_next_block<R>(w, ldw_b, k * 2);
    for (int t = 0; t < NT; ++t) {
      __m512i xv = _mm512_loadu_si512(reinterpret_cast<const uint16_t*>(x + t * ldx_b) + k);
      for (int j = 0; j < R; ++j)
        acc[t][j] = _mm512_dpbf16_ps(acc[t][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  if (k < K) {                                         // masked tail: zeros add nothing
    const __mmask32 m = tail_mask32(int(K - k));
    __m512i wv[R];
    for (int j = 0; j < R; ++j)
      wv[j] = j < nr ? _mm512_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(w + j * ldw_b) + k) : zero;
    for (int t = 0; t < NT; ++t) {
      __m512i xv = _mm512_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(x + t * ldx_b) + k);
      for (int j = 0; j < R; ++j)
        acc[t][j] = _mm512_dpbf16_ps(acc[t][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < nr; ++j) res[t][j] = _mm512_reduce_add_ps(acc[t][j]);
}
#endif

template <Fmt F, int R, int NT>
inline void tile(const char* x, int64_t ldx_b, const char* w, int64_t ldw_b, int64_t K, int nr,
                 float res[kTokTile][kRows]) {
#if MOELAB_ISA_LEVEL == 3
  if constexpr (F == Fmt::kBF16) {
    tile_dp<R, NT>(x, ldx_b, w, ldw_b, K, nr, res);
    return;
  }
#endif
  tile_fma<F, R, NT>(x, ldx_b, w, ldw_b, K, nr, res);
}

template <Fmt F, int R>
void run(const void* x, int64_t ldx, const void* w, int64_t ldw, const void* bias, void* out,
         int64_t ldo, int64_t T, int64_t K, int64_t n0, int64_t n1) {
  const char* xb = static_cast<const char*>(x);
  const char* wb = static_cast<const char*>(w);
  const int64_t ldx_b = ldx * esize<F>(), ldw_b = ldw * esize<F>();
  float res[kTokTile][kRows];  // R <= kRows
  for (int64_t n = n0; n < n1; n += R) {
    const int nr = int(imin_(R, n1 - n));
    const char* wn = wb + n * ldw_b;
    float b[kRows];
    for (int j = 0; j < nr; ++j) b[j] = bias ? load_s<F>(bias, n + j) : 0.0f;
    for (int64_t t = 0; t < T; t += kTokTile) {
      const int nt = int(imin_(kTokTile, T - t));
      const char* xt = xb + t * ldx_b;
      switch (nt) {
#if MOELAB_ISA_LEVEL >= 2
        case 4: tile<F, R, 4>(xt, ldx_b, wn, ldw_b, K, nr, res); break;
        case 3: tile<F, R, 3>(xt, ldx_b, wn, ldw_b, K, nr, res); break;
#endif
        case 2: tile<F, R, 2>(xt, ldx_b, wn, ldw_b, K, nr, res); break;
        default: tile<F, R, 1>(xt, ldx_b, wn, ldw_b, K, nr, res); break;
      }
      for (int i = 0; i < nt; ++i)
        for (int j = 0; j < nr; ++j)
          store_s<F>(out, (t + i) * ldo + n + j, bias ? res[i][j] + b[j] : res[i][j]);
    }
  }
}

// The row count R changes how many weight rows share each x load, never a row's arithmetic
// (every row's accumulation is self-contained), so the choice below cannot change results.
// R = 1 walks the thread's rows as ONE sequential stream, which the hardware prefetchers
// follow best: on AVX-512 timed 10-15% faster than R = 4 (2 threads, cold weights) while x
// fits in L1 next to the stream (T*K*e <= 16 KiB: T <= 4 at K = 2048, T <= 2 at K = 4096).
// With a larger x, R = 1 would re-read x from L2 for every row; R = 4 shares each x load by 4
// rows. With 8 or fewer lanes R = 1 is latency-bound instead: each token's one accumulator
// chain takes an FMA latency (4-5 cycles) per 8 weights, ~4 bytes per cycle, half the read
// bandwidth of one core; R = 4 runs 4 chains per token.
template <Fmt F>
void run_rows(const void* x, int64_t ldx, const void* w, int64_t ldw, const void* bias, void* out,
              int64_t ldo, int64_t T, int64_t K, int64_t n0, int64_t n1) {
  if (kVecF >= 16 && T * K * esize<F>() <= kOneRowXBytes) run<F, 1>(x, ldx, w, ldw, bias, out, ldo, T, K, n0, n1);
  else run<F, kRows>(x, ldx, w, ldw, bias, out, ldo, T, K, n0, n1);
}

}  // namespace

// Output features [n0, n1) of out[T, ldo] (all of one dtype `fmt`): x rows ldx elements
// apart, weight rows ldw elements apart, both unit stride along K; bias [N] or null.
void skinny_gemm_rows(const void* x, int64_t ldx, const void* w, int64_t ldw, const void* bias,
                      void* out, int64_t ldo, Fmt fmt, int64_t T, int64_t K, int64_t n0, int64_t n1) {
  switch (fmt) {
    case Fmt::kF32: run_rows<Fmt::kF32>(x, ldx, w, ldw, bias, out, ldo, T, K, n0, n1); break;
    case Fmt::kBF16: run_rows<Fmt::kBF16>(x, ldx, w, ldw, bias, out, ldo, T, K, n0, n1); break;
    case Fmt::kF16: run_rows<Fmt::kF16>(x, ldx, w, ldw, bias, out, ldo, T, K, n0, n1); break;
  }
}

}  // namespace moelab::cpu::MOELAB_ISA_NS
