// fused_experts' SIMD vocabulary, compiled once per ISA level after isa_begin.h + vec.h.
//
//   W32  32 bf16 weights in VNNI order: 16 output columns x 2 consecutive k
//        (word 2c + p = column c, k = 2kk + p)
//   Acc  16 f32 accumulators, one per output column (acc_store / acc_load: 16 floats, column order)
//   XP   one row's activation pair x[2kk], x[2kk+1], ready to multiply
//   dp(acc, x, w): acc[c] += x[2kk] * w[c][0] + x[2kk+1] * w[c][1] at the level's precision:
//     avx512_bf16: vdpbf16ps (odd product, then even, each added in f32 with RNE; bf16
//                  subnormal inputs read as 0, subnormal results flushed, MXCSR ignored)
//     avx512 / avx2 / scalar / neon: fma(x0, w0, acc) then fma(x1, w1, acc), bf16 widened exactly
// The same dp sequence over kk = 0, 1, ... is every path's reduction order at one level.
//
// vexp: f32 exp (Cephes expf polynomial, <= 2 ulp on [-87.3, 88.7]; 0 below -88.0, +inf at
// and above ~88.4: both far outside what changes a bf16 activation).
#pragma once

namespace moelab::cpu::MOELAB_ISA_NS {
namespace fe_simd {

#if MOELAB_ISA_LEVEL >= 2
struct W32 { __m512i v; };
struct Acc { __m512 v; };
inline W32 w_load(const uint16_t* p) { return {_mm512_loadu_si512(p)}; }
inline void w_store(uint16_t* p, W32 w) { _mm512_storeu_si512(p, w.v); }
inline Acc acc_zero() { return {_mm512_setzero_ps()}; }
inline void acc_store(float* p, Acc a) { _mm512_storeu_ps(p, a.v); }
inline Acc acc_load(const float* p) { return {_mm512_loadu_ps(p)}; }
#if MOELAB_ISA_LEVEL == 3
struct XP { __m512i v; };
inline XP x_pair(const uint16_t* a) {
  uint32_t u;
  std::memcpy(&u, a, 4);
  return {_mm512_set1_epi32(int(u))};
}
inline Acc dp(Acc c, XP x, W32 w) { return {_mm512_dpbf16_ps(c.v, (__m512bh)w.v, (__m512bh)x.v)}; }
#else
struct XP { __m512 x0, x1; };
inline XP x_pair(const uint16_t* a) { return {_mm512_set1_ps(bf16_to_f32(a[0])), _mm512_set1_ps(bf16_to_f32(a[1]))}; }
inline Acc dp(Acc c, XP x, W32 w) {
  __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w.v, 16));
  __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w.v, _mm512_set1_epi32(int(0xffff0000u))));
  return {_mm512_fmadd_ps(x.x1, odd, _mm512_fmadd_ps(x.x0, even, c.v))};
}
#endif

#elif MOELAB_ISA_LEVEL == 1
struct W32 { __m256i lo, hi; };   // columns 0-7, 8-15
struct Acc { __m256 lo, hi; };
struct XP { __m256 x0, x1; };
inline W32 w_load(const uint16_t* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 16))};
}
inline void w_store(uint16_t* p, W32 w) {
  _mm256_storeu_si256((__m256i*)p, w.lo);
  _mm256_storeu_si256((__m256i*)(p + 16), w.hi);
}
inline Acc acc_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline void acc_store(float* p, Acc a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Acc acc_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline XP x_pair(const uint16_t* a) {   // one dword broadcast, both values widened in place
  uint32_t u;
  std::memcpy(&u, a, 4);
  const __m256i d = _mm256_set1_epi32(int(u));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(d, 16)), _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32(int(0xffff0000u))))};
}
inline __m256 dp_half(__m256 c, const XP& x, __m256i w) {
  __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))));
  return _mm256_fmadd_ps(x.x1, odd, _mm256_fmadd_ps(x.x0, even, c));
}
inline Acc dp(Acc c, XP x, W32 w) { return {dp_half(c.lo, x, w.lo), dp_half(c.hi, x, w.hi)}; }

#elif MOELAB_ISA_NEON
struct W32 { uint16x8_t q[4]; };    // q[j]: columns 4j..4j+3, both k of the pair
struct Acc { float32x4_t q[4]; };   // q[j]: columns 4j..4j+3
struct XP { float32x4_t x0, x1; };
inline W32 w_load(const uint16_t* p) { return {{vld1q_u16(p), vld1q_u16(p + 8), vld1q_u16(p + 16), vld1q_u16(p + 24)}}; }
inline void w_store(uint16_t* p, W32 w) {
  for (int j = 0; j < 4; ++j) vst1q_u16(p + 8 * j, w.q[j]);
}
inline Acc acc_zero() { return {{vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}}; }
inline void acc_store(float* p, Acc a) {
  for (int j = 0; j < 4; ++j) vst1q_f32(p + 4 * j, a.q[j]);
}
inline Acc acc_load(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline XP x_pair(const uint16_t* a) {   // one word pair broadcast, both values widened in place
  uint32_t u;
  std::memcpy(&u, a, 4);
  const uint32x4_t d = vdupq_n_u32(u);
  return {vreinterpretq_f32_u32(vshlq_n_u32(d, 16)), vreinterpretq_f32_u32(vandq_u32(d, vdupq_n_u32(0xffff0000u)))};
}
// The same two fmas per column as the scalar and avx2 / avx512 levels: the same bits.
inline Acc dp(Acc c, XP x, W32 w) {
  for (int j = 0; j < 4; ++j) {
    const uint32x4_t u = vreinterpretq_u32_u16(w.q[j]);
    const float32x4_t even = vreinterpretq_f32_u32(vshlq_n_u32(u, 16));
    const float32x4_t odd = vreinterpretq_f32_u32(vandq_u32(u, vdupq_n_u32(0xffff0000u)));
    c.q[j] = vfmaq_f32(vfmaq_f32(c.q[j], x.x0, even), x.x1, odd);
  }
  return c;
}

#else
struct W32 { uint16_t v[32]; };
struct Acc { float v[16]; };
struct XP { float x0, x1; };
inline W32 w_load(const uint16_t* p) {
  W32 w;
  std::memcpy(w.v, p, sizeof(w.v));
  return w;
}
inline void w_store(uint16_t* p, W32 w) { std::memcpy(p, w.v, sizeof(w.v)); }
inline Acc acc_zero() {
  Acc a;
  for (int c = 0; c < 16; ++c) a.v[c] = 0.0f;
  return a;
}
inline void acc_store(float* p, Acc a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline Acc acc_load(const float* p) {
  Acc a;
  std::memcpy(a.v, p, sizeof(a.v));
  return a;
}
inline XP x_pair(const uint16_t* a) { return {bf16_to_f32(a[0]), bf16_to_f32(a[1])}; }
inline Acc dp(Acc c, XP x, W32 w) {
  for (int i = 0; i < 16; ++i) {
    float t = __builtin_fmaf(x.x0, bf16_to_f32(w.v[2 * i]), c.v[i]);
    c.v[i] = __builtin_fmaf(x.x1, bf16_to_f32(w.v[2 * i + 1]), t);
  }
  return c;
}
#endif

// ------------------------------------------------------------------------ f32 math
// min(a, b) that returns b when either is NaN (x86 minps semantics at every level), so
// vmin_(limit, v) passes a NaN v through, as torch.clamp does.
#if MOELAB_ISA_LEVEL >= 2
inline vf vmin_(vf a, vf b) { return {_mm512_min_ps(a.v, b.v)}; }
inline vf vmax_(vf a, vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline vf vdiv(vf a, vf b) { return {_mm512_div_ps(a.v, b.v)}; }
inline vf vexp(vf x) {
  __m512 xv = _mm512_min_ps(_mm512_max_ps(x.v, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.7f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xv);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 e = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return {_mm512_mul_ps(e, _mm512_castsi512_ps(bits))};
}
#elif MOELAB_ISA_LEVEL == 1
inline vf vmin_(vf a, vf b) { return {_mm256_min_ps(a.v, b.v)}; }
inline vf vmax_(vf a, vf b) { return {_mm256_max_ps(a.v, b.v)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.v, b.v)}; }
inline vf vexp(vf x) {
  __m256 xv = _mm256_min_ps(_mm256_max_ps(x.v, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.7f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(xv, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xv);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 e = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(e, _mm256_castsi256_ps(bits))};
}
#elif MOELAB_ISA_NEON
inline vf vmin_(vf a, vf b) { return {vbslq_f32(vcltq_f32(a.v, b.v), a.v, b.v)}; }   // b when NaN
inline vf vmax_(vf a, vf b) { return {vbslq_f32(vcgtq_f32(a.v, b.v), a.v, b.v)}; }
inline vf vdiv(vf a, vf b) { return {vdivq_f32(a.v, b.v)}; }
inline vf vexp(vf x) {   // the scalar level's operations, lane for lane (the same bits)
  float32x4_t xv = vbslq_f32(vcgtq_f32(x.v, vdupq_n_f32(-88.0f)), x.v, vdupq_n_f32(-88.0f));
  xv = vbslq_f32(vcltq_f32(xv, vdupq_n_f32(88.7f)), xv, vdupq_n_f32(88.7f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(xv, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vfmsq_f32(xv, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
  const float32x4_t e = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
  const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return {vmulq_f32(e, vreinterpretq_f32_s32(bits))};
}
#else
inline vf vmin_(vf a, vf b) { return {(a.v < b.v) ? a.v : b.v}; }   // b when NaN
inline vf vmax_(vf a, vf b) { return {(a.v > b.v) ? a.v : b.v}; }
inline vf vdiv(vf a, vf b) { return {a.v / b.v}; }
inline vf vexp(vf x) {
  float xv = x.v > -88.0f ? x.v : -88.0f;
  xv = xv < 88.7f ? xv : 88.7f;
  float n = __builtin_rintf(xv * 1.44269504088896341f);
  float r = __builtin_fmaf(-n, 0.693359375f, xv);
  r = __builtin_fmaf(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = __builtin_fmaf(p, r, 1.3981999507e-3f);
  p = __builtin_fmaf(p, r, 8.3334519073e-3f);
  p = __builtin_fmaf(p, r, 4.1665795894e-2f);
  p = __builtin_fmaf(p, r, 1.6666665459e-1f);
  p = __builtin_fmaf(p, r, 5.0000001201e-1f);
  float e = __builtin_fmaf(p, r * r, r + 1.0f);
  return {e * bits_to_f32(uint32_t(int32_t(n) + 127) << 23)};
}
#endif

// sigmoid(z) = 1 / (1 + exp(-z)) in f32.
inline vf vsigmoid(vf z) {
  return vdiv(vset1(1.0f), vadd(vset1(1.0f), vexp(vmul(vset1(-1.0f), z))));
}

}  // namespace fe_simd
}  // namespace moelab::cpu::MOELAB_ISA_NS
