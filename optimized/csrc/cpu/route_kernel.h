// route: top-k expert selection (SPEC section 1), one token row at a time.
//
// Per token t (x = the logits row, read in its own dtype and widened in registers; no f32
// copy of the logits is ever written):
//   1. key pass: the method's f32 key of every expert (softmax p, x, sigmoid s, s + bias,
//      p + bias), turned at once into a 32-bit *order key* ok (see okey()): unsigned order of
//      ok == the contract's total order of keys (NaN above +inf, all NaNs equal, -0 == +0).
//      Stored to a small per-thread buffer (E <= 2048 -> 8 KB, stays in L1).
//   2. grouped methods only: group scores (grouped_sigmoid_bias: sum of the two largest keys
//      of each group; grouped_softmax: the largest), the topk_group best groups kept, the
//      order keys of the others set to ok(-inf).
//   3. selection: the K largest composites c = (ok << 32) | (0xFFFFFFFF - index), compared
//      as unsigned 64-bit integers, so equal keys rank lower index first; c is unique per
//      expert, so the top K is exactly determined and any correct algorithm gives the same
//      ids. AVX-512 and AVX2: a branch-free pass keeps the R largest order keys of each of
//      the W lanes (W = 16: R = 1, 2, 3 for K <= 8, 16, 32; W = 8: R = 2, 3, 6); the K-th
//      largest of those W * R values is a lower bound of the row's K-th largest key (they
//      belong to W * R distinct experts), and on random rows only a few more than K experts
//      reach it (K + 2.4 for K = 8, W = 16, R = 1). A second pass compresses those
//      candidates (vpcompressd; at AVX2 a table of the 256 masks' lane lists), which are then
//      placed by counting, for each, the candidates that beat it (8 or 4 compares per
//      instruction). Ties or adversarial rows with more than 64 candidates, and the scalar
//      and NEON levels, use a running-threshold insertion instead: a sorted list of the best
//      K so far; a vector compare against the current K-th best skips every chunk without a
//      better key.
//      Seed 004's "before" (RouteParams::selection = kSelectSerial, reachable only through
//      moelab::route_variant for experiments, tests and verify): select_serial, one scalar
//      pass offering every key to that list, no lane sink, no vector skip. Same composites.
//   4. weights from the selected composites (the order key gives back the key's value) and
//      from the stored sigmoid s or softmax p (biased methods, whose weights leave the bias
//      out); then the normalization (renormalize, resolved by the binding; its norm_eps) and
//      scaling, in the reference's order of f32 operations (reference/route.py).
//
// Arithmetic. exp is our own f32 routine: Cody-Waite reduction with FMA, a degree-6
// polynomial fitted for relative error (3.8e-9), and an exact scaling by 2^n that also rounds
// subnormal results once (vscalefps; two exact-then-rounding multiplies on AVX2/scalar give
// the same bits). sigmoid is 1/(1+e) or e/(1+e), e = exp(-|x|), with 1 + e kept as an exact
// two-float sum and the quotient corrected by one FMA residual step: measured against the
// exactly rounded sigmoid (the reference), 96.5% of values are identical and the rest one
// ulp off. softmax: x - max is kept exact (TwoSum) before the exp, exp's own rounding error
// is carried (hi + lo), the sum accumulates in f64 (16 fixed lanes, fixed tree), and
// p = e / sum is rounded once to f32: 95% identical to the reference, the rest one ulp.
// The key math runs on 4 chunks of 16 experts in lockstep so the long exp/divide chains
// overlap. Every ISA level performs the same IEEE operations per element (FMA where
// written), so keys, ids and weights are bit-identical across levels, thread counts and
// batch positions (batch invariant).
//
// Floors and measurements (this machine: Zen 5, 2 cores, full-width AVX-512; one thread).
// Memory: T*E*sizeof(logits) + T*K*8 bytes; T = 2048, E = 896, bf16: 3.7 MB, ~0.1 ms at
// 35 GB/s, so route is compute bound. Compute: the sigmoid_bias key path issues ~31 vector
// ops per 16 experts, 17 of them on the 2 FMA pipes: floor ~9 cycles per 16 experts; we
// measure ~16 (the exp/divide dependency chains). Selection adds ~200 cycles per token at
// E = 256 (K = 8), ~450 at E = 896 (K = 16). Measured per token, sigmoid_bias, bf16:
// E = 256, K = 8: 0.14 us; E = 896, K = 16: 0.38 us; E = 2048, K = 32: ~1 us. A call adds
// ~2 us of fixed costs (argument conversion, the two output tensors, the binding's checks),
// which is what bounds decode-size batches (docs/performance.md, "route").
#include "route.h"
#include "isa_begin.h"

namespace moelab::cpu::MOELAB_ISA_NS {
namespace {

#define MOELAB_AI inline __attribute__((always_inline))

// ----------------------------------------------------------------- lane vocabulary
// vf (vec.h) holds kVecF f32 lanes; vu the matching 32-bit integer lanes; vm a lane mask;
// vd the same lanes widened to f64. Every operation is the same IEEE operation per lane on
// every level (the scalar level included), which is what makes the levels bit-identical.
#if MOELAB_ISA_LEVEL >= 2
struct vu { __m512i v; };
using vm = __mmask16;
struct vd { __m512d lo, hi; };
inline vf vsub(vf a, vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline vf vdiv(vf a, vf b) { return {_mm512_div_ps(a.v, b.v)}; }
inline vf vfnma(vf a, vf b, vf c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a*b, one rounding
inline vf vnabs(vf a) { return {_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(int(0x80000000u))))}; }
inline vf vmaxc(vf a, vf b) { return {_mm512_max_ps(a.v, b.v)}; }            // a > b ? a : b
inline vm vlt(vf a, vf b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ); }
inline vm visnan(vf a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
inline vm vmor(vm a, vm b) { return vm(a | b); }
inline bool vany(vm a) { return a != 0; }
inline vf vsel(vm m, vf a, vf b) { return {_mm512_mask_blend_ps(m, b.v, a.v)}; }  // m ? a : b
inline vm lanes_below(int n) { return tail_mask(n < 0 ? 0 : n); }
inline float hmax(vf a) { return _mm512_reduce_max_ps(a.v); }
// y * 2^n for integral n in [-160, 0]: one rounding (also into the subnormals).
inline vf vscale2(vf y, vf n) { return {_mm512_scalef_ps(y.v, n.v)}; }
// Order key of f; NEGZ: f may be -0.0 (mapped like +0.0).
template <bool NEGZ> MOELAB_AI vu okey(vf f) {
  __m512i u = _mm512_castps_si512(f.v);
  if constexpr (NEGZ)
    u = _mm512_mask_mov_epi32(u, _mm512_cmpeq_epi32_mask(u, _mm512_set1_epi32(int(0x80000000u))), _mm512_setzero_si512());
  __m512i k = _mm512_ternarylogic_epi32(u, _mm512_srai_epi32(u, 31), _mm512_set1_epi32(int(0x80000000u)), 0x1e);
  return {_mm512_mask_mov_epi32(k, _mm512_cmp_ps_mask(f.v, f.v, _CMP_UNORD_Q), _mm512_set1_epi32(-1))};
}
inline void ustore(uint32_t* p, vu a) { _mm512_storeu_si512(p, a.v); }
inline vu uload(const uint32_t* p) { return {_mm512_loadu_si512(p)}; }
inline vf ld_f32(const float* p, int n) { return vload(p, n); }
inline vf ld_bf16(const uint16_t* p, int n) { return vload_bf16(p, n); }
inline vf ld_f16(const uint16_t* p, int n) { return vload_f16(p, n); }
inline void st_f32(float* p, vf a) { _mm512_storeu_ps(p, a.v); }          // buffers have slack
inline vd widen_sum(vf a, vf b) {                                           // f64(a) + f64(b)
  return {_mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(a.v)), _mm512_cvtps_pd(_mm512_castps512_ps256(b.v))),
          _mm512_add_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(a.v, 1)), _mm512_cvtps_pd(_mm512_extractf32x8_ps(b.v, 1)))};
}
inline void dstore(double* p, vd a) { _mm512_storeu_pd(p, a.lo); _mm512_storeu_pd(p + 8, a.hi); }
inline vd dload(const double* p) { return {_mm512_loadu_pd(p), _mm512_loadu_pd(p + 8)}; }
inline vf mul_round(vd a, double inv) {                                     // f32(a * inv)
  __m512d s = _mm512_set1_pd(inv);
  __m256 lo = _mm512_cvtpd_ps(_mm512_mul_pd(a.lo, s)), hi = _mm512_cvtpd_ps(_mm512_mul_pd(a.hi, s));
  return {_mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1)};
}
// f64 partial sums: lane l accumulates the elements i with i % 16 == l (same on every level).
struct Acc16 {
  __m512d a0, a1;
  Acc16() { a0 = _mm512_setzero_pd(); a1 = _mm512_setzero_pd(); }
  MOELAB_AI void add(vd e, int64_t /*i*/) { a0 = _mm512_add_pd(a0, e.lo); a1 = _mm512_add_pd(a1, e.hi); }
  // Pairwise tree: lane l += lane l + 8, then + 4, + 2, + 1 (the same on every level).
  double total() const {
    __m512d t = _mm512_add_pd(a0, a1);
    __m256d u = _mm256_add_pd(_mm512_castpd512_pd256(t), _mm512_extractf64x4_pd(t, 1));
    __m128d v = _mm_add_pd(_mm256_castpd256_pd128(u), _mm256_extractf128_pd(u, 1));
    return _mm_cvtsd_f64(_mm_add_sd(v, _mm_unpackhi_pd(v, v)));
  }
};

#elif MOELAB_ISA_LEVEL == 1
struct vu { __m256i v; };
struct vm { __m256 v; };
struct vd { __m256d lo, hi; };
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.v, b.v)}; }
inline vf vfnma(vf a, vf b, vf c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }
inline vf vnabs(vf a) { return {_mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(a.v), _mm256_set1_epi32(int(0x80000000u))))}; }
inline vf vmaxc(vf a, vf b) { return {_mm256_max_ps(a.v, b.v)}; }
inline vm vlt(vf a, vf b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ)}; }
inline vm visnan(vf a) { return {_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)}; }
inline vm vmor(vm a, vm b) { return {_mm256_or_ps(a.v, b.v)}; }
inline bool vany(vm a) { return _mm256_movemask_ps(a.v) != 0; }
inline vf vsel(vm m, vf a, vf b) { return {_mm256_blendv_ps(b.v, a.v, m.v)}; }
inline vm lanes_below(int n) {
  return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))};
}
inline float hmax(vf a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
// 2^n1 * 2^n2 with n = n1 + n2, both factors normal: the first product is exact, the second
// rounds once, as vscalefps does.
inline vf vscale2(vf y, vf n) {
  __m256i ni = _mm256_cvtps_epi32(n.v);
  __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
  __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
  return {_mm256_mul_ps(_mm256_mul_ps(y.v, s1), s2)};
}
template <bool NEGZ> MOELAB_AI vu okey(vf f) {
  __m256i u = _mm256_castps_si256(f.v);
  if constexpr (NEGZ) u = _mm256_andnot_si256(_mm256_cmpeq_epi32(u, _mm256_set1_epi32(int(0x80000000u))), u);
  __m256i flip = _mm256_or_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32(int(0x80000000u)));
  __m256i k = _mm256_xor_si256(u, flip);
  return {_mm256_or_si256(k, _mm256_castps_si256(_mm256_cmp_ps(f.v, f.v, _CMP_UNORD_Q)))};
}
inline void ustore(uint32_t* p, vu a) { _mm256_storeu_si256((__m256i*)p, a.v); }
inline vu uload(const uint32_t* p) { return {_mm256_loadu_si256((const __m256i*)p)}; }
inline vf ld_f32(const float* p, int n) { return n >= 8 ? vload(p) : vload(p, n); }
inline vf ld_bf16(const uint16_t* p, int n) { return n >= 8 ? vload_bf16(p) : vload_bf16(p, n); }
inline vf ld_f16(const uint16_t* p, int n) { return n >= 8 ? vload_f16(p) : vload_f16(p, n); }
inline void st_f32(float* p, vf a) { _mm256_storeu_ps(p, a.v); }
inline vd widen_sum(vf a, vf b) {
  return {_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a.v)), _mm256_cvtps_pd(_mm256_castps256_ps128(b.v))),
          _mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(a.v, 1)), _mm256_cvtps_pd(_mm256_extractf128_ps(b.v, 1)))};
}
inline void dstore(double* p, vd a) { _mm256_storeu_pd(p, a.lo); _mm256_storeu_pd(p + 4, a.hi); }
inline vd dload(const double* p) { return {_mm256_loadu_pd(p), _mm256_loadu_pd(p + 4)}; }
inline vf mul_round(vd a, double inv) {
  __m256d s = _mm256_set1_pd(inv);
  __m128 lo = _mm256_cvtpd_ps(_mm256_mul_pd(a.lo, s)), hi = _mm256_cvtpd_ps(_mm256_mul_pd(a.hi, s));
  return {_mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1)};
}
struct Acc16 {
  __m256d a[4];
  Acc16() { for (int k = 0; k < 4; ++k) a[k] = _mm256_setzero_pd(); }
  MOELAB_AI void add(vd e, int64_t i) {   // the 8 lanes are elements i..i+7: sum lanes (i % 16)..+7
    int b = (i & 8) ? 2 : 0;
    a[b] = _mm256_add_pd(a[b], e.lo);
    a[b + 1] = _mm256_add_pd(a[b + 1], e.hi);
  }
  double total() const {   // a[0..3] hold lanes 0-3, 4-7, 8-11, 12-15
    __m256d u = _mm256_add_pd(_mm256_add_pd(a[0], a[2]), _mm256_add_pd(a[1], a[3]));
    __m128d v = _mm_add_pd(_mm256_castpd256_pd128(u), _mm256_extractf128_pd(u, 1));
    return _mm_cvtsd_f64(_mm_add_sd(v, _mm_unpackhi_pd(v, v)));
  }
};

#elif MOELAB_ISA_NEON
// aarch64 NEON, 4 lanes: avx2's operations lane for lane (x86 maxps / blend semantics spelled
// with compares and bsl, since NEON's fmax / fmin would return the NaN).
struct vu { uint32x4_t v; };
struct vm { uint32x4_t v; };
struct vd { float64x2_t lo, hi; };
inline vf vsub(vf a, vf b) { return {vsubq_f32(a.v, b.v)}; }
inline vf vdiv(vf a, vf b) { return {vdivq_f32(a.v, b.v)}; }
inline vf vfnma(vf a, vf b, vf c) { return {vfmsq_f32(c.v, a.v, b.v)}; }   // c - a*b, one rounding
inline vf vnabs(vf a) { return {vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(a.v), vdupq_n_u32(0x80000000u)))}; }
inline vf vmaxc(vf a, vf b) { return {vbslq_f32(vcgtq_f32(a.v, b.v), a.v, b.v)}; }   // a > b ? a : b
inline vm vlt(vf a, vf b) { return {vcltq_f32(a.v, b.v)}; }
inline vm visnan(vf a) { return {vmvnq_u32(vceqq_f32(a.v, a.v))}; }
inline vm vmor(vm a, vm b) { return {vorrq_u32(a.v, b.v)}; }
inline bool vany(vm a) { return vmaxvq_u32(a.v) != 0; }
inline vf vsel(vm m, vf a, vf b) { return {vbslq_f32(m.v, a.v, b.v)}; }   // m ? a : b
inline vm lanes_below(int n) {
  const int32_t iota[4] = {0, 1, 2, 3};
  return {vcgtq_s32(vdupq_n_s32(n), vld1q_s32(iota))};
}
inline float hmax(vf a) {   // avx2's last two steps: (l0 vs l2, l1 vs l3), then lane 0 vs lane 1
  const float32x2_t lo = vget_low_f32(a.v), hi = vget_high_f32(a.v);
  const float32x2_t m = vbsl_f32(vcgt_f32(lo, hi), lo, hi);
  const float m0 = vget_lane_f32(m, 0), m1 = vget_lane_f32(m, 1);
  return m0 > m1 ? m0 : m1;
}
// 2^n1 * 2^n2 with n = n1 + n2, both factors normal: as at avx2 (one rounding).
inline vf vscale2(vf y, vf n) {
  const int32x4_t ni = vcvtnq_s32_f32(n.v);
  const int32x4_t n1 = vshrq_n_s32(ni, 1), n2 = vsubq_s32(ni, n1);
  const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, vdupq_n_s32(127)), 23));
  const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, vdupq_n_s32(127)), 23));
  return {vmulq_f32(vmulq_f32(y.v, s1), s2)};
}
template <bool NEGZ> MOELAB_AI vu okey(vf f) {
  uint32x4_t u = vreinterpretq_u32_f32(f.v);
  if constexpr (NEGZ) u = vbicq_u32(u, vceqq_u32(u, vdupq_n_u32(0x80000000u)));
  const uint32x4_t flip = vorrq_u32(vreinterpretq_u32_s32(vshrq_n_s32(vreinterpretq_s32_u32(u), 31)), vdupq_n_u32(0x80000000u));
  return {vorrq_u32(veorq_u32(u, flip), vmvnq_u32(vceqq_f32(f.v, f.v)))};
}
inline void ustore(uint32_t* p, vu a) { vst1q_u32(p, a.v); }
inline vu uload(const uint32_t* p) { return {vld1q_u32(p)}; }
inline vf ld_f32(const float* p, int n) { return n >= 4 ? vload(p) : vload(p, n); }
inline vf ld_bf16(const uint16_t* p, int n) { return n >= 4 ? vload_bf16(p) : vload_bf16(p, n); }
inline vf ld_f16(const uint16_t* p, int n) { return n >= 4 ? vload_f16(p) : vload_f16(p, n); }
inline void st_f32(float* p, vf a) { vst1q_f32(p, a.v); }
inline vd widen_sum(vf a, vf b) {
  return {vaddq_f64(vcvt_f64_f32(vget_low_f32(a.v)), vcvt_f64_f32(vget_low_f32(b.v))),
          vaddq_f64(vcvt_high_f64_f32(a.v), vcvt_high_f64_f32(b.v))};
}
inline void dstore(double* p, vd a) { vst1q_f64(p, a.lo); vst1q_f64(p + 2, a.hi); }
inline vd dload(const double* p) { return {vld1q_f64(p), vld1q_f64(p + 2)}; }
inline vf mul_round(vd a, double inv) {
  const float64x2_t s = vdupq_n_f64(inv);
  return {vcvt_high_f32_f64(vcvt_f32_f64(vmulq_f64(a.lo, s)), vmulq_f64(a.hi, s))};
}
struct Acc16 {
  float64x2_t a[4][2];   // a[j]: lanes 4j..4j+3
  Acc16() { for (int k = 0; k < 4; ++k) a[k][0] = a[k][1] = vdupq_n_f64(0.0); }
  MOELAB_AI void add(vd e, int64_t i) {   // the 4 lanes are elements i..i+3: lanes (i % 16)..+3
    const int b = int(i >> 2) & 3;
    a[b][0] = vaddq_f64(a[b][0], e.lo);
    a[b][1] = vaddq_f64(a[b][1], e.hi);
  }
  double total() const {   // lane l += l + 8, then + 4, + 2, + 1
    const float64x2_t u0 = vaddq_f64(vaddq_f64(a[0][0], a[2][0]), vaddq_f64(a[1][0], a[3][0]));
    const float64x2_t u1 = vaddq_f64(vaddq_f64(a[0][1], a[2][1]), vaddq_f64(a[1][1], a[3][1]));
    const float64x2_t v = vaddq_f64(u0, u1);
    return vgetq_lane_f64(v, 0) + vgetq_lane_f64(v, 1);
  }
};

#else
struct vu { uint32_t v; };
struct vm { bool v; };
struct vd { double v; };
inline vf vsub(vf a, vf b) { return {a.v - b.v}; }
inline vf vdiv(vf a, vf b) { return {a.v / b.v}; }
inline vf vfnma(vf a, vf b, vf c) { return {__builtin_fmaf(-a.v, b.v, c.v)}; }
inline vf vnabs(vf a) { return {bits_to_f32(f32_to_bits(a.v) | 0x80000000u)}; }
inline vf vmaxc(vf a, vf b) { return {a.v > b.v ? a.v : b.v}; }
inline vm vlt(vf a, vf b) { return {a.v < b.v}; }
inline vm visnan(vf a) { return {a.v != a.v}; }
inline vm vmor(vm a, vm b) { return {a.v || b.v}; }
inline bool vany(vm a) { return a.v; }
inline vf vsel(vm m, vf a, vf b) { return m.v ? a : b; }
inline vm lanes_below(int n) { return {n > 0}; }
inline float hmax(vf a) { return a.v; }
inline vf vscale2(vf y, vf n) {
  if (n.v != n.v) return {n.v};
  int32_t ni = int32_t(n.v), n1 = ni >> 1, n2 = ni - n1;   // arithmetic shift (floor)
  return {(y.v * bits_to_f32(uint32_t(n1 + 127) << 23)) * bits_to_f32(uint32_t(n2 + 127) << 23)};
}
template <bool NEGZ> MOELAB_AI vu okey(vf f) {
  uint32_t u = f32_to_bits(f.v);
  if (NEGZ && u == 0x80000000u) u = 0;
  uint32_t k = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return {f.v != f.v ? 0xffffffffu : k};
}
inline void ustore(uint32_t* p, vu a) { *p = a.v; }
inline vu uload(const uint32_t* p) { return {*p}; }
inline vf ld_f32(const float* p, int) { return {*p}; }
inline vf ld_bf16(const uint16_t* p, int) { return {bf16_to_f32(*p)}; }
inline vf ld_f16(const uint16_t* p, int) { return {f16_to_f32(*p)}; }
inline void st_f32(float* p, vf a) { *p = a.v; }
inline vd widen_sum(vf a, vf b) { return {double(a.v) + double(b.v)}; }
inline void dstore(double* p, vd a) { *p = a.v; }
inline vd dload(const double* p) { return {*p}; }
inline vf mul_round(vd a, double inv) { return {float(a.v * inv)}; }
struct Acc16 {
  double a[16];
  Acc16() { for (int k = 0; k < 16; ++k) a[k] = 0.0; }
  void add(vd e, int64_t i) { a[i & 15] += e.v; }
  double total() const {
    double l[16];
    for (int k = 0; k < 16; ++k) l[k] = a[k];
    for (int w = 8; w >= 1; w /= 2)
      for (int k = 0; k < w; ++k) l[k] += l[k + w];
    return l[0];
  }
};
#endif

constexpr int W = kVecF;
// Chunks of experts whose sigmoid keys are computed in lockstep (see sigmoid()).
constexpr int kSigmoidLockstep = W == 1 ? 1 : 4;

// ------------------------------------------------------------------ order keys
// ok(f): unsigned order of ok == total order of f (NaN > +inf, NaNs equal, -0 == +0).
inline uint32_t okey1(float f) {
  uint32_t u = f32_to_bits(f);
  if (u == 0x80000000u) u = 0;
  uint32_t k = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return f != f ? 0xffffffffu : k;
}
// The key value back from its order key (-0 comes back as +0, every NaN as one NaN).
inline float okey_value(uint32_t k) {
  return bits_to_f32((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
constexpr uint32_t kOkNegInf = 0x007fffffu;   // okey1(-inf)
inline uint64_t composite(uint32_t ok, uint32_t idx) { return (uint64_t(ok) << 32) | (0xffffffffu - idx); }
inline uint32_t comp_index(uint64_t c) { return 0xffffffffu - uint32_t(c); }
inline uint32_t comp_okey(uint64_t c) { return uint32_t(c >> 32); }

// --------------------------------------------------------------------- exp, sigmoid
// The math below works on N vectors in lockstep (N independent chunks of experts): each
// step is issued for all N before the next, so the long dependency chains of exp and the
// division overlap in the out-of-order window. Lanes never mix: N only changes speed.
#define MOELAB_FOR_N(k) _Pragma("GCC unroll 8") for (int k = 0; k < N; ++k)

// exp(a + alo) for a <= 0 (-inf allowed; NaN in, NaN out), with alo a correction term,
// |alo| <= ulp(a) / 2 (LO = false: alo unused). y gets the f32 result; with LO, lo gets the
// rounding error of its final addition (scaled alike), so y + lo carries ~8 more bits.
// Results below 2^-150 are 0 and subnormal results round once. ZERO: also return exactly
// 0 for a < -104 whatever alo holds (alo may be NaN there: x = -inf in the softmax).
template <int N, bool LO, bool ZERO>
MOELAB_AI void exp_neg(const vf* a, const vf* alo, vf* y, vf* lo) {
  const vf magic = vset1(12582912.0f);                  // 1.5 * 2^23: round to integer
  vf n[N], r[N], p[N], q[N];
  MOELAB_FOR_N(k) {
    vf ac = vmaxc(vset1(-110.0f), a[k]);                // -110 > a ? -110 : a (NaN stays)
    n[k] = vsub(vfma(ac, vset1(1.44269504088896341f), magic), magic);   // round(a / ln 2)
    r[k] = vfnma(n[k], vset1(0.693145751953125f), ac);  // exact (Cody-Waite high part)
  }
  MOELAB_FOR_N(k) r[k] = vfnma(n[k], vset1(1.42860676533018704e-6f), r[k]);
  if constexpr (LO) MOELAB_FOR_N(k) r[k] = vadd(r[k], alo[k]);
  // exp(r) = 1 + q, q = r + r^2 P(r) on |r| <= 0.3466: P of degree 4 fitted for minimal
  // relative error of exp (max 3.8e-9 = 0.06 * 2^-24 with these f32 coefficients).
  MOELAB_FOR_N(k) p[k] = vfma(vset1(1.375272986e-3f), r[k], vset1(8.368914016e-3f));
  MOELAB_FOR_N(k) p[k] = vfma(p[k], r[k], vset1(4.166951030e-2f));
  MOELAB_FOR_N(k) p[k] = vfma(p[k], r[k], vset1(1.666651815e-1f));
  MOELAB_FOR_N(k) p[k] = vfma(p[k], r[k], vset1(4.999998808e-1f));
  MOELAB_FOR_N(k) q[k] = vfma(p[k], vmul(r[k], r[k]), r[k]);
  MOELAB_FOR_N(k) y[k] = vadd(q[k], vset1(1.0f));
  if constexpr (LO) MOELAB_FOR_N(k) lo[k] = vscale2(vsub(q[k], vsub(y[k], vset1(1.0f))), n[k]);  // Fast2Sum(1, q)
  MOELAB_FOR_N(k) y[k] = vscale2(y[k], n[k]);
  if constexpr (ZERO) {
    MOELAB_FOR_N(k) {
      vm z = vlt(a[k], vset1(-104.0f));
      if constexpr (LO) lo[k] = vsel(z, vzero(), lo[k]);
      y[k] = vsel(z, vzero(), y[k]);
    }
  }
}

// sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) for x < 0, with e = exp(-|x|) in [0, 1].
// 1 + e = hi + lo exactly; the quotient q gets one residual correction, so the result is
// within about one ulp of the exactly rounded sigmoid. NaN in, NaN out.
template <int N> MOELAB_AI void sigmoid(const vf* x, vf* s) {
  const vf one = vset1(1.0f);
  vf a[N], e[N], hi[N], inv[N], q[N], r[N];
  MOELAB_FOR_N(k) a[k] = vnabs(x[k]);
  exp_neg<N, false, false>(a, nullptr, e, nullptr);
  MOELAB_FOR_N(k) {
    hi[k] = vadd(one, e[k]);
    inv[k] = vdiv(one, hi[k]);
  }
  MOELAB_FOR_N(k) {
    vf num = vsel(vlt(x[k], vzero()), e[k], one);
    q[k] = vmul(num, inv[k]);
    r[k] = vfnma(q[k], hi[k], num);
  }
  MOELAB_FOR_N(k) r[k] = vfnma(q[k], vsub(e[k], vsub(hi[k], one)), r[k]);   // lo of 1 + e
  MOELAB_FOR_N(k) s[k] = vfma(r[k], inv[k], q[k]);
}
MOELAB_AI vf sigmoid1(vf x) {
  vf s;
  sigmoid<1>(&x, &s);
  return s;
}

// ------------------------------------------------------------------------- loads
template <Fmt F> MOELAB_AI vf load_row(const void* row, int64_t i, int n) {
  if constexpr (F == Fmt::kF32) return ld_f32(static_cast<const float*>(row) + i, n);
  else if constexpr (F == Fmt::kBF16) return ld_bf16(static_cast<const uint16_t*>(row) + i, n);
  else return ld_f16(static_cast<const uint16_t*>(row) + i, n);
}

// --------------------------------------------------------------- lane top-R sink
// Lane selection, first pass: the R largest order keys of each of the W lanes, kept
// lane-wise sorted M[0] >= M[1] >= ... The key passes feed it as they go (no second read).
template <int R> struct Lanes {
#if MOELAB_ISA_LEVEL >= 2
  __m512i M[R > 0 ? R : 1];
  Lanes() { for (int r = 0; r < R; ++r) M[r] = _mm512_setzero_si512(); }
  MOELAB_AI void add(vu k, int n) {
    __m512i v = n < 16 ? _mm512_maskz_mov_epi32(tail_mask(n), k.v) : k.v;
    for (int r = 0; r < R; ++r) {
      __m512i hi = _mm512_max_epu32(M[r], v);
      v = _mm512_min_epu32(M[r], v);
      M[r] = hi;
    }
  }
#elif MOELAB_ISA_LEVEL == 1
  __m256i M[R > 0 ? R : 1];
  Lanes() { for (int r = 0; r < R; ++r) M[r] = _mm256_setzero_si256(); }
  MOELAB_AI void add(vu k, int n) {
    __m256i v = n < 8 ? _mm256_and_si256(k.v, _mm256_castps_si256(lanes_below(n).v)) : k.v;
    for (int r = 0; r < R; ++r) {
      __m256i hi = _mm256_max_epu32(M[r], v);
      v = _mm256_min_epu32(M[r], v);
      M[r] = hi;
    }
  }
#else
  void add(vu, int) {}
#endif
};

// ---------------------------------------------------------------------- softmax
// ed[i] = exp(x[i] - max) in f64 (hi + lo of exp_neg) for i < n (ed has slack up to a
// multiple of 16), and returns 1 / sum(ed) (f64, fixed lane order). Returns a NaN if the row
// has a NaN or its max is not finite: every p is then NaN, as in the exact softmax.
// N chunks from element i on: ed = exp(x - m) as f64 (hi + lo), 0 in lanes past n.
template <int N, Fmt F>
MOELAB_AI void softmax_chunks(const void* row, int i, int n, vf vmx, vf negm, double* ed, Acc16& acc) {
  vf d[N], dlo[N], hi[N], lo[N];
  MOELAB_FOR_N(c) {
    vf x = load_row<F>(row, i + c * W, n - i - c * W);
    d[c] = vsub(x, vmx);                                // TwoSum(x, -m): d + dlo == x - m
    vf bb = vsub(d[c], x);
    dlo[c] = vadd(vsub(x, vsub(d[c], bb)), vsub(negm, bb));
  }
  exp_neg<N, true, true>(d, dlo, hi, lo);
  MOELAB_FOR_N(c) {
    vm valid = lanes_below(n - i - c * W);
    vd e = widen_sum(vsel(valid, hi[c], vzero()), vsel(valid, lo[c], vzero()));
    dstore(ed + i + c * W, e);
    acc.add(e, i + c * W);
  }
}

// ed[i] = exp(x[i] - m) in f64 (hi + lo of exp_neg) for i < n, with m = max(x) finite (ed
// has slack up to a multiple of 16); returns 1 / sum(ed) (f64, fixed lane order and tree).
template <Fmt F> double softmax_exp(const void* row, int n, float m, double* ed) {
  const vf vmx = vset1(m), negm = vset1(-m);
  Acc16 acc;
  constexpr int N = kSigmoidLockstep;
  int i = 0;
  for (; i + N * W <= n; i += N * W) softmax_chunks<N, F>(row, i, n, vmx, negm, ed, acc);
  for (; i < n; i += W) softmax_chunks<1, F>(row, i, n, vmx, negm, ed, acc);
  return 1.0 / acc.total();
}

// The row max, or NaN when the row holds a NaN or its max is not finite: the exact softmax
// is then NaN everywhere.
template <Fmt F> float softmax_max(const void* row, int n) {
  const vf ninf = vset1(-__builtin_inff());
  vf mx = ninf;
  vm bad = visnan(vzero());
  for (int i = 0; i < n; i += W) {
    vf x = load_row<F>(row, i, n - i);
    bad = vmor(bad, visnan(x));
    mx = vmaxc(vsel(lanes_below(n - i), x, ninf), mx);
  }
  const float m = hmax(mx);                             // exact, whatever the order
  return vany(bad) || !(m > -__builtin_inff() && m < __builtin_inff()) ? __builtin_nanf("") : m;
}

// ------------------------------------------------------------------ key passes
// Each writes ok[0..E) (and slack up to a multiple of W) and feeds the lane sink.
template <Fmt F, int R> void keys_logit(const void* row, int E, uint32_t* ok, Lanes<R>& sink) {
  Lanes<R> L = sink;                     // a local copy stays in registers
  for (int i = 0; i < E; i += W) {
    vu k = okey<true>(load_row<F>(row, i, E - i));
    ustore(ok + i, k);
    L.add(k, E - i);
  }
  sink = L;
}

// p = softmax(x); key = p, or p + bias (BIAS: softmax_bias, which also stores p in p_out for
// its weights; p + bias is never -0.0 since p >= +0).
template <Fmt F, Fmt B, bool BIAS, int R>
void keys_softmax(const void* row, const void* bias, int E, uint32_t* ok, double* ed, float* p_out, Lanes<R>& sink) {
  Lanes<R> L = sink;
  const float m = softmax_max<F>(row, E);
  if (m != m) {
    const vf nan = vset1(__builtin_nanf(""));
    for (int i = 0; i < E; i += W) {
      if constexpr (BIAS) st_f32(p_out + i, nan);
      vu k = okey<false>(nan);                             // NaN + bias is NaN too
      ustore(ok + i, k);
      L.add(k, E - i);
    }
  } else {
    const double inv = softmax_exp<F>(row, E, m, ed);
    for (int i = 0; i < E; i += W) {
      vf pv = mul_round(dload(ed + i), inv);               // p >= +0
      if constexpr (BIAS) {
        st_f32(p_out + i, pv);
        pv = vadd(pv, load_row<B>(bias, i, E - i));
      }
      vu k = okey<false>(pv);
      ustore(ok + i, k);
      L.add(k, E - i);
    }
  }
  sink = L;
}

// s = sigmoid(x) (stored when the weights need it), key = s or s + bias (never -0.0).
// N chunks of keys starting at expert i (n valid experts from i on; n >= N * W except for
// N = 1): s = sigmoid(x) (stored when the weights need it), key = s or s + bias (never -0.0).
template <int N, Fmt F, Fmt B, bool BIAS>
MOELAB_AI void sigmoid_keys(const void* row, const void* bias, int i, int n, float* s_out, vu* k) {
  vf x[N], s[N];
  MOELAB_FOR_N(c) x[c] = load_row<F>(row, i + c * W, n - c * W);
  sigmoid<N>(x, s);
  MOELAB_FOR_N(c) {
    if constexpr (BIAS) {
      st_f32(s_out + i + c * W, s[c]);
      s[c] = vadd(s[c], load_row<B>(bias, i + c * W, n - c * W));
    }
    k[c] = okey<false>(s[c]);
  }
}
template <Fmt F, Fmt B, bool BIAS, int R>
void keys_sigmoid(const void* row, const void* bias, int E, uint32_t* ok, float* s_out, Lanes<R>& sink) {
  constexpr int N = kSigmoidLockstep;
  Lanes<R> L = sink;
  int i = 0;
  for (; i + N * W <= E; i += N * W) {
    vu k[N];
    sigmoid_keys<N, F, B, BIAS>(row, bias, i, N * W, s_out, k);
    MOELAB_FOR_N(c) {
      ustore(ok + i + c * W, k[c]);
      L.add(k[c], W);
    }
  }
  for (; i < E; i += W) {
    vu k;
    sigmoid_keys<1, F, B, BIAS>(row, bias, i, E - i, s_out, &k);
    ustore(ok + i, k);
    L.add(k, E - i);
  }
  sink = L;
}

// ----------------------------------------------------------------- top-k lists
// The best K composites seen so far, sorted descending; thr = order key of the K-th once
// the list is full (0 before: every real order key is > 0).
struct TopList {
  uint64_t v[kRouteMaxTopK];
  int n = 0;
  uint32_t thr = 0;
};
// Insert c (known to beat the K-th when the list is full).
inline void push(TopList& L, int K, uint64_t c) {
  int pos = L.n < K ? L.n++ : K - 1;
  while (pos > 0 && L.v[pos - 1] < c) {
    L.v[pos] = L.v[pos - 1];
    --pos;
  }
  L.v[pos] = c;
  if (L.n == K) L.thr = comp_okey(L.v[K - 1]);
}
// Elements are offered in increasing index order, so an order key equal to thr loses to
// the K-th (lower index); only ok > thr can enter.
inline void offer(TopList& L, int K, uint32_t ok, uint32_t idx) {
  if (ok > L.thr) push(L, K, composite(ok, idx));
}

// Running-threshold insertion over ok[0..E), a vector compare skipping chunks with nothing
// above the current K-th best: the selection of the scalar and NEON levels (the x86 levels
// run the lane selection).
inline void select_scan(const uint32_t* ok, int E, int K, uint64_t* out) {
  TopList L;
  int i = 0;
#if MOELAB_ISA_NEON
  for (; i + 4 <= E; i += 4) {
    const uint32x4_t gt = vcgtq_u32(vld1q_u32(ok + i), vdupq_n_u32(L.thr));
    if (vmaxvq_u32(gt) == 0) continue;
    for (int l = 0; l < 4; ++l) offer(L, K, ok[i + l], uint32_t(i + l));   // offer re-checks thr
  }
#endif
  for (; i < E; ++i) offer(L, K, ok[i], uint32_t(i));
  for (int j = 0; j < K; ++j) out[j] = L.v[j];
}

// The running-threshold insertion over the C candidates cidx[0..C) (increasing index): the lane
// selections' fallback when ties at the bound leave more than 64 of them.
inline void select_among(const uint32_t* ok, const uint32_t* cidx, int C, int K, uint64_t* out) {
  TopList T;
  for (int c = 0; c < C; ++c) offer(T, K, ok[cidx[c]], cidx[c]);
  for (int j = 0; j < K; ++j) out[j] = T.v[j];
}

#if MOELAB_ISA_LEVEL >= 2
// The K-th largest of the 16R values in M[0..R) (as a multiset): the largest value v with
// at least K values >= v. Counts by comparing against the 16 rotations of each register.
template <int R> inline uint32_t kth_largest(const __m512i* M, int K) {
  __m512i cnt[R];
  for (int r = 0; r < R; ++r) cnt[r] = _mm512_setzero_si512();
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i one = _mm512_set1_epi32(1), fifteen = _mm512_set1_epi32(15);
  for (int s = 0; s < 16; ++s) {
    __m512i idx = _mm512_and_si512(_mm512_add_epi32(iota, _mm512_set1_epi32(s)), fifteen);
    for (int j = 0; j < R; ++j) {
      __m512i rot = _mm512_permutexvar_epi32(idx, M[j]);
      for (int r = 0; r < R; ++r)
        cnt[r] = _mm512_mask_add_epi32(cnt[r], _mm512_cmpge_epu32_mask(rot, M[r]), cnt[r], one);
    }
  }
  uint32_t thr = 0;
  for (int r = 0; r < R; ++r) {
    __mmask16 enough = _mm512_cmpge_epi32_mask(cnt[r], _mm512_set1_epi32(K));
    uint32_t v = _mm512_mask_reduce_max_epu32(enough, M[r]);
    thr = v > thr ? v : thr;
  }
  return thr;
}

// Lane top-R bound, compress, then rank by counting (see the file comment).
template <int R> void select_lanes(const uint32_t* ok, int E, int K, const Lanes<R>& L,
                                   uint64_t* out, uint32_t* cidx) {
  const uint32_t thr = kth_largest<R>(L.M, K);
  int C = 0;
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i sixteen = _mm512_set1_epi32(16), vthr = _mm512_set1_epi32(int(thr));
  for (int i = 0; i < E; i += 16) {     // branch-free: most chunks have no candidate
    __m512i k = _mm512_loadu_si512(ok + i);
    __mmask16 m = _mm512_mask_cmpge_epu32_mask(tail_mask(E - i), k, vthr);
    _mm512_storeu_si512(cidx + C, _mm512_maskz_compress_epi32(m, idx));
    C += __builtin_popcount(unsigned(m));
    idx = _mm512_add_epi32(idx, sixteen);
  }
  if (C > 64) {                        // many ties at the bound
    select_among(ok, cidx, C, K, out);
    return;
  }
  // Composites of the candidates, 8 per register, zero-padded (0 beats nothing).
  alignas(64) uint64_t comp[64];
  const int nv = (C + 7) / 8;
  for (int v = 0; v < nv; ++v) {
    __m256i id = _mm256_loadu_si256((const __m256i*)(cidx + 8 * v));
    __mmask8 live = __mmask8(tail_mask(C - 8 * v));
    __m256i o = _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), live, id, ok, 4);
    __m512i c = _mm512_or_si512(_mm512_slli_epi64(_mm512_cvtepu32_epi64(o), 32),
                                _mm512_cvtepu32_epi64(_mm256_sub_epi32(_mm256_set1_epi32(-1), id)));
    _mm512_store_si512(comp + 8 * v, _mm512_maskz_mov_epi64(live, c));
  }
  // rank of each candidate = number of candidates that beat it; ranks are a permutation.
  alignas(64) uint64_t placed[64];
  for (int c = 0; c < C; ++c) {
    __m512i me = _mm512_set1_epi64((long long)comp[c]);
    int rank = 0;
    for (int v = 0; v < nv; ++v)
      rank += __builtin_popcount(unsigned(_mm512_cmpgt_epu64_mask(_mm512_load_si512(comp + 8 * v), me)));
    placed[rank] = comp[c];
  }
  for (int j = 0; j < K; ++j) out[j] = placed[j];
}
#endif

#if MOELAB_ISA_LEVEL == 1
// AVX2's lane selection: select_lanes with 8 lanes and without vpcompressd / unsigned 64-bit
// compares. The bound is the K-th largest of the 8R lane values (counted against the 8
// rotations of each register); candidates are compressed through a table of the 256 lane
// masks' index lists (vpermd-free: the list is the lane numbers, added to the chunk base), and
// ranked by signed 64-bit compares of the composites with their top bit flipped.
struct Compress8 {   // for each 8-bit mask, its set lanes in increasing order
  uint8_t lane[256][8];
  constexpr Compress8() : lane() {
    for (int m = 0; m < 256; ++m) {
      int n = 0;
      for (int l = 0; l < 8; ++l)
        if (m & (1 << l)) lane[m][n++] = uint8_t(l);
    }
  }
};
inline constexpr Compress8 kCompress8{};

MOELAB_AI __m256i ge_epu32(__m256i a, __m256i b) { return _mm256_cmpeq_epi32(_mm256_max_epu32(a, b), a); }

template <int R> inline uint32_t kth_largest(const __m256i* M, int K) {
  __m256i cnt[R];
  for (int r = 0; r < R; ++r) cnt[r] = _mm256_setzero_si256();
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), seven = _mm256_set1_epi32(7);
  for (int s = 0; s < 8; ++s) {
    const __m256i idx = _mm256_and_si256(_mm256_add_epi32(iota, _mm256_set1_epi32(s)), seven);
    for (int j = 0; j < R; ++j) {
      const __m256i rot = _mm256_permutevar8x32_epi32(M[j], idx);
      for (int r = 0; r < R; ++r) cnt[r] = _mm256_sub_epi32(cnt[r], ge_epu32(rot, M[r]));   // += 1 where rot >= M[r]
    }
  }
  __m256i best = _mm256_setzero_si256();
  for (int r = 0; r < R; ++r)
    best = _mm256_max_epu32(best, _mm256_and_si256(M[r], _mm256_cmpgt_epi32(cnt[r], _mm256_set1_epi32(K - 1))));
  alignas(32) uint32_t v[8];
  _mm256_store_si256((__m256i*)v, best);
  uint32_t thr = 0;
  for (int l = 0; l < 8; ++l) thr = v[l] > thr ? v[l] : thr;
  return thr;
}

template <int R> void select_lanes(const uint32_t* ok, int E, int K, const Lanes<R>& L,
                                   uint64_t* out, uint32_t* cidx) {
  const __m256i vthr = _mm256_set1_epi32(int(kth_largest<R>(L.M, K)));
  int C = 0;
  for (int i = 0; i < E; i += 8) {     // branch-free: most chunks have no candidate
    const __m256i k = _mm256_loadu_si256((const __m256i*)(ok + i));
    unsigned m = unsigned(_mm256_movemask_ps(_mm256_castsi256_ps(ge_epu32(k, vthr))));
    if (E - i < 8) m &= (1u << (E - i)) - 1u;
    const __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)kCompress8.lane[m]));
    _mm256_storeu_si256((__m256i*)(cidx + C), _mm256_add_epi32(lanes, _mm256_set1_epi32(i)));
    C += __builtin_popcount(m);
  }
  if (C > 64) {                        // many ties at the bound
    select_among(ok, cidx, C, K, out);
    return;
  }
  // Composites with the top bit flipped (unsigned order as signed), 4 per register, padded
  // with the smallest value (beats nothing).
  alignas(32) int64_t flip[64];
  const int nv = (C + 3) / 4;
  for (int c = 0; c < 4 * nv; ++c)
    flip[c] = c < C ? int64_t(composite(ok[cidx[c]], cidx[c]) ^ (uint64_t(1) << 63)) : INT64_MIN;
  alignas(32) uint64_t placed[64];
  for (int c = 0; c < C; ++c) {
    const __m256i me = _mm256_set1_epi64x(flip[c]);
    int rank = 0;
    for (int v = 0; v < nv; ++v)
      rank += __builtin_popcount(unsigned(_mm256_movemask_pd(
          _mm256_castsi256_pd(_mm256_cmpgt_epi64(_mm256_load_si256((const __m256i*)(flip + 4 * v)), me)))));
    placed[rank] = uint64_t(flip[c]) ^ (uint64_t(1) << 63);
  }
  for (int j = 0; j < K; ++j) out[j] = placed[j];
}
#endif

// Seed 004's "before" on the CPU (kSelectSerial, experiments only): one scalar pass over
// every expert in index order, each offered to the sorted top-K list; no chunk is skipped.
inline void select_serial(const uint32_t* ok, int E, int K, uint64_t* out) {
  TopList L;
  for (int i = 0; i < E; ++i) offer(L, K, ok[i], uint32_t(i));
  for (int j = 0; j < K; ++j) out[j] = L.v[j];
}

// The K best composites of ok[0..E), sorted descending (L: the lane sink fed with ok).
template <int R> inline void select_topk(const uint32_t* ok, int E, int K, const Lanes<R>& L,
                                         uint64_t* out, uint32_t* cidx) {
#if MOELAB_ISA_LEVEL >= 1
  if constexpr (R > 0) {
    select_lanes<R>(ok, E, K, L, out, cidx);
    return;
  }
#endif
  (void)L;
  (void)cidx;
  select_scan(ok, E, K, out);
}

// Group restriction on the order keys: score each group, keep the topk_group best groups
// (ties: lower group), set the keys of the rest to -inf. TOP2 (DeepSeek-V3,
// grouped_sigmoid_bias): the score is the f32 sum of the group's two largest keys; otherwise
// (DeepSeek-V2 group_limited_greedy, grouped_softmax) the group's largest key, whose order key
// is already the score's (order keys are canonical: one NaN, -0 as +0).
template <bool TOP2> void mask_groups(uint32_t* ok, int E, int n_group, int topk_group) {
  const int gs = E / n_group;
  TopList G;
  for (int g = 0; g < n_group; ++g) {
    uint32_t b1 = 0, b2 = 0;
    for (int i = g * gs; i < (g + 1) * gs; ++i) {
      uint32_t o = ok[i];
      if (o > b1) { b2 = b1; b1 = o; }
      else if (o > b2) b2 = o;
    }
    offer(G, topk_group, TOP2 ? okey1(okey_value(b1) + okey_value(b2)) : b1, uint32_t(g));
  }
  bool keep[kRouteMaxGroups] = {false};
  for (int j = 0; j < topk_group; ++j) keep[comp_index(G.v[j])] = true;
  for (int g = 0; g < n_group; ++g)
    if (!keep[g])
      for (int i = g * gs; i < (g + 1) * gs; ++i) ok[i] = kOkNegInf;
}

// -------------------------------------------------------------------- weights
// f32 sum in increasing j (the reference's order).
inline float sum_f32(const float* w, int K) {
  float s = w[0];
  for (int j = 1; j < K; ++j) s = s + w[j];
  return s;
}

// SERIAL: seed 004's before (select_serial, with R = 0: no lane sink in the key pass).
template <Fmt F, Fmt B, int R, bool SERIAL = false>
void route_rows_r(const RouteParams& p, int64_t t0, int64_t t1) {
  const int E = p.E, K = p.K;
  alignas(64) uint32_t ok[kRouteMaxExperts + 16];
  alignas(64) float sbuf[kRouteMaxExperts + 16];     // sigmoid s (biased methods)
  alignas(64) double ed[kRouteMaxExperts + 16];      // exp(x - max) (softmax)
  alignas(64) uint32_t cidx[kRouteMaxExperts + 16];   // candidates: index, order key
  alignas(64) float small[kRouteMaxTopK + 16];
  uint64_t sel[kRouteMaxTopK];
  const int64_t row_bytes = p.ld * (F == Fmt::kF32 ? 4 : 2);
  for (int64_t t = t0; t < t1; ++t) {
    const void* row = static_cast<const char*>(p.logits) + t * row_bytes;
    Lanes<R> L;
    switch (p.method) {
      case kSoftmaxTopk: keys_softmax<F, B, false, R>(row, nullptr, E, ok, ed, nullptr, L); break;
      case kSoftmaxBias: keys_softmax<F, B, true, R>(row, p.bias, E, ok, ed, sbuf, L); break;
      case kTopkSoftmax:
      case kLlama4: keys_logit<F, R>(row, E, ok, L); break;
      case kSigmoidTopk: keys_sigmoid<F, B, false, R>(row, nullptr, E, ok, nullptr, L); break;
      case kSigmoidBias: keys_sigmoid<F, B, true, R>(row, p.bias, E, ok, sbuf, L); break;
      default: {   // grouped: mask the dropped groups, then feed the sink
        Lanes<0> none;
        if (p.method == kGroupedSoftmax) {
          keys_softmax<F, B, false, 0>(row, nullptr, E, ok, ed, nullptr, none);
          mask_groups<false>(ok, E, p.n_group, p.topk_group);
        } else {
          keys_sigmoid<F, B, true, 0>(row, p.bias, E, ok, sbuf, none);
          mask_groups<true>(ok, E, p.n_group, p.topk_group);
        }
        if constexpr (R > 0)
          for (int i = 0; i < E; i += W) L.add(uload(ok + i), E - i);
        break;
      }
    }
    if constexpr (SERIAL)
      select_serial(ok, E, K, sel);
    else
      select_topk<R>(ok, E, K, L, sel, cidx);

    float* w = p.weights + t * K;
    int32_t* id = p.ids + t * K;
    for (int j = 0; j < K; ++j) id[j] = int32_t(comp_index(sel[j]));
    switch (p.method) {
      case kSoftmaxTopk:
      case kGroupedSoftmax:
      case kSigmoidTopk: {   // the keys are the weights (grouped: the kept p)
        for (int j = 0; j < K; ++j) w[j] = okey_value(comp_okey(sel[j]));
        if (p.renormalize) {
          float s = sum_f32(w, K);
          if (p.method == kSigmoidTopk) s = s < p.norm_eps ? p.norm_eps : s;   // clamp_min, NaN stays
          for (int j = 0; j < K; ++j) w[j] = w[j] / s;
        }
        break;
      }
      case kSoftmaxBias: {   // p, the bias left out
        for (int j = 0; j < K; ++j) w[j] = sbuf[comp_index(sel[j])];
        if (p.renormalize) {
          float s = sum_f32(w, K);
          s = s < p.norm_eps ? p.norm_eps : s;                                  // clamp_min, NaN stays
          for (int j = 0; j < K; ++j) w[j] = w[j] / s;
        }
        break;
      }
      case kTopkSoftmax: {
        for (int j = 0; j < K; ++j) small[j] = okey_value(comp_okey(sel[j]));
        // Slot 0 holds the max (a NaN or +inf would rank first): the softmax is NaN
        // everywhere unless it is finite.
        const float m = small[0];
        if (!(m > -__builtin_inff() && m < __builtin_inff()))
          for (int j = 0; j < K; ++j) w[j] = __builtin_nanf("");
        else {
          const double inv = softmax_exp<Fmt::kF32>(small, K, m, ed);
          for (int j = 0; j < K; j += W) st_f32(small + j, mul_round(dload(ed + j), inv));
          for (int j = 0; j < K; ++j) w[j] = small[j];
        }
        break;
      }
      case kLlama4: {
        small[0] = okey_value(comp_okey(sel[0]));
        st_f32(small, sigmoid1(ld_f32(small, 1)));
        w[0] = small[0];
        break;
      }
      default: {   // sigmoid_bias, grouped_sigmoid_bias: scaling inside the formula
        for (int j = 0; j < K; ++j) small[j] = sbuf[comp_index(sel[j])];
        const vf scale = vset1(p.scaling);
        if (p.renormalize) {
          const vf den = vset1(sum_f32(small, K) + p.norm_eps);
          for (int j = 0; j < K; j += W) st_f32(small + j, vdiv(vmul(ld_f32(small + j, K - j), scale), den));
        } else {
          for (int j = 0; j < K; j += W) st_f32(small + j, vmul(ld_f32(small + j, K - j), scale));
        }
        for (int j = 0; j < K; ++j) w[j] = small[j];
        continue;
      }
    }
    // Every other method: the final weights times scaling (SPEC 6); 1.0 (most calls) is exact.
    if (p.scaling != 1.0f)
      for (int j = 0; j < K; ++j) w[j] = w[j] * p.scaling;
  }
}

// R: rows of the lane sink for this K (0: running-threshold selection).
template <Fmt F, Fmt B> void route_rows(const RouteParams& p, int64_t t0, int64_t t1) {
  if (p.selection == kSelectSerial) {   // experiments only (moelab::route_variant)
    route_rows_r<F, B, 0, true>(p, t0, t1);
    return;
  }
#if MOELAB_ISA_LEVEL >= 2
  if (p.K <= 8) route_rows_r<F, B, 1>(p, t0, t1);
  else if (p.K <= 16) route_rows_r<F, B, 2>(p, t0, t1);
  else route_rows_r<F, B, 3>(p, t0, t1);
#elif MOELAB_ISA_LEVEL == 1   // 8 lanes: about as many lane values per K as at 16 lanes
  if (p.K <= 8) route_rows_r<F, B, 2>(p, t0, t1);
  else if (p.K <= 16) route_rows_r<F, B, 3>(p, t0, t1);
  else route_rows_r<F, B, 6>(p, t0, t1);
#else
  route_rows_r<F, B, 0>(p, t0, t1);
#endif
}

}  // namespace

void route_tokens(const RouteParams& p, int64_t t0, int64_t t1) {
  const bool bf16_bias = p.bias_fmt == Fmt::kBF16;
  switch (p.fmt) {
    case Fmt::kF32:
      bf16_bias ? route_rows<Fmt::kF32, Fmt::kBF16>(p, t0, t1) : route_rows<Fmt::kF32, Fmt::kF32>(p, t0, t1);
      break;
    case Fmt::kBF16:
      bf16_bias ? route_rows<Fmt::kBF16, Fmt::kBF16>(p, t0, t1) : route_rows<Fmt::kBF16, Fmt::kF32>(p, t0, t1);
      break;
    case Fmt::kF16:
      bf16_bias ? route_rows<Fmt::kF16, Fmt::kBF16>(p, t0, t1) : route_rows<Fmt::kF16, Fmt::kF32>(p, t0, t1);
      break;
  }
}

}  // namespace moelab::cpu::MOELAB_ISA_NS

#undef MOELAB_FOR_N
#undef MOELAB_AI
