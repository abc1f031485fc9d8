// A small SIMD vocabulary for f32 lanes, compiled once per ISA level (see isa_begin.h).
//
//   level 3 avx512_bf16 : 16 lanes (__m512) + vdpbf16ps for bf16 dot products
//   level 2 avx512      : 16 lanes (__m512)
//   level 1 avx2        :  8 lanes (__m256), tails through a small stack buffer
//   level 0 scalar      :  1 lane  (float)
//   aarch64 neon        :  4 lanes (float32x4_t), tails through a small stack buffer
//
// Loads widen bf16/f16 to f32 in registers; stores to bf16 round to nearest even (NaN
// stays NaN), the same rounding as formats.h, so every level rounds bit-identically.
// The `n` overloads touch only the first n elements (tails): nothing past the end is
// read or written.
#pragma once

namespace moelab::cpu::MOELAB_ISA_NS {

inline float fmin_(float a, float b) { return b < a ? b : a; }
inline float fmax_(float a, float b) { return a < b ? b : a; }
inline int64_t imin_(int64_t a, int64_t b) { return b < a ? b : a; }
inline int64_t imax_(int64_t a, int64_t b) { return a < b ? b : a; }

#if MOELAB_ISA_LEVEL >= 2
constexpr int kVecF = 16;
struct vf { __m512 v; };
inline __mmask16 tail_mask(int n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }
inline vf vzero() { return {_mm512_setzero_ps()}; }
inline vf vset1(float a) { return {_mm512_set1_ps(a)}; }
inline vf vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline vf vload(const float* p, int n) { return {_mm512_maskz_loadu_ps(tail_mask(n), p)}; }
// 16 bf16 -> f32: one zero-masked vpermw puts word l into the high half of lane l and zeroes
// the low half (lane l = h[l] << 16), one shuffle where vpmovzxwd + vpslld take two ops
// (router_gemm widens each x chunk again for every expert block, so the op it saves counts).
inline vf widen_bf16(__m256i h) {
  const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
                                       7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
  return {_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(__mmask32(0xAAAAAAAAu), idx, _mm512_castsi256_si512(h)))};
}
inline vf vload_bf16(const uint16_t* p) { return widen_bf16(_mm256_loadu_si256((const __m256i*)p)); }
inline vf vload_bf16(const uint16_t* p, int n) { return widen_bf16(_mm256_maskz_loadu_epi16(tail_mask(n), p)); }
inline vf vload_f16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
inline vf vload_f16(const uint16_t* p, int n) { return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask(n), p))}; }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a.v); }
inline void vstore(float* p, vf a, int n) { _mm512_mask_storeu_ps(p, tail_mask(n), a.v); }
inline __m256i narrow_bf16(vf a) {
  __m512i u = _mm512_castps_si512(a.v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q));
}
inline void vstore_bf16(uint16_t* p, vf a) { _mm256_storeu_si256((__m256i*)p, narrow_bf16(a)); }
inline void vstore_bf16(uint16_t* p, vf a, int n) { _mm256_mask_storeu_epi16(p, tail_mask(n), narrow_bf16(a)); }
inline vf vadd(vf a, vf b) { return {_mm512_add_ps(a.v, b.v)}; }
inline vf vmul(vf a, vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vf vfma(vf a, vf b, vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline vf vmax(vf a, vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a.v); }

#elif MOELAB_ISA_LEVEL == 1
constexpr int kVecF = 8;
struct vf { __m256 v; };
inline vf vzero() { return {_mm256_setzero_ps()}; }
inline vf vset1(float a) { return {_mm256_set1_ps(a)}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline vf vload(const float* p, int n) {
  alignas(32) float t[8] = {0};
  for (int i = 0; i < n && i < 8; ++i) t[i] = p[i];
  return {_mm256_load_ps(t)};
}
inline vf widen_bf16(__m128i h) { return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))}; }
inline vf vload_bf16(const uint16_t* p) { return widen_bf16(_mm_loadu_si128((const __m128i*)p)); }
inline vf vload_bf16(const uint16_t* p, int n) {
  alignas(16) uint16_t t[8] = {0};
  for (int i = 0; i < n && i < 8; ++i) t[i] = p[i];
  return widen_bf16(_mm_load_si128((const __m128i*)t));
}
inline vf vload_f16(const uint16_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))}; }
inline vf vload_f16(const uint16_t* p, int n) {
  alignas(16) uint16_t t[8] = {0};
  for (int i = 0; i < n && i < 8; ++i) t[i] = p[i];
  return {_mm256_cvtph_ps(_mm_load_si128((const __m128i*)t))};
}
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a.v); }
inline void vstore(float* p, vf a, int n) {
  alignas(32) float t[8];
  _mm256_store_ps(t, a.v);
  for (int i = 0; i < n && i < 8; ++i) p[i] = t[i];
}
inline __m128i narrow_bf16(vf a) {
  __m256i u = _mm256_castps_si256(a.v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  __m256i w = _mm256_blendv_epi8(r, q, nan);  // 32-bit lanes holding 16-bit values
  __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
  return _mm_packus_epi32(lo, hi);            // values < 65536: no saturation
}
inline void vstore_bf16(uint16_t* p, vf a) { _mm_storeu_si128((__m128i*)p, narrow_bf16(a)); }
inline void vstore_bf16(uint16_t* p, vf a, int n) {
  alignas(16) uint16_t t[8];
  _mm_store_si128((__m128i*)t, narrow_bf16(a));
  for (int i = 0; i < n && i < 8; ++i) p[i] = t[i];
}
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.v, b.v)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline vf vfma(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.v, b.v)}; }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#elif MOELAB_ISA_NEON
// aarch64 NEON: 4 lanes (float32x4_t). bf16 widens by a shift into the high half (exact);
// narrowing is the integer RNE + quiet-NaN rule of the x86 levels, lane for lane. Tails go
// through a small stack buffer, as at avx2, so nothing past n is read or written.
constexpr int kVecF = 4;
struct vf { float32x4_t v; };
inline vf vzero() { return {vdupq_n_f32(0.0f)}; }
inline vf vset1(float a) { return {vdupq_n_f32(a)}; }
inline vf vload(const float* p) { return {vld1q_f32(p)}; }
inline vf vload(const float* p, int n) {
  alignas(16) float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int i = 0; i < n && i < 4; ++i) t[i] = p[i];
  return {vld1q_f32(t)};
}
inline vf widen_bf16(uint16x4_t h) { return {vreinterpretq_f32_u32(vshll_n_u16(h, 16))}; }
inline vf vload_bf16(const uint16_t* p) { return widen_bf16(vld1_u16(p)); }
inline vf vload_bf16(const uint16_t* p, int n) {
  alignas(8) uint16_t t[4] = {0, 0, 0, 0};
  for (int i = 0; i < n && i < 4; ++i) t[i] = p[i];
  return widen_bf16(vld1_u16(t));
}
// f16 -> f32 (fcvtl) is exact, subnormals included (FPCR.FZ16 is clear on Linux).
inline vf vload_f16(const uint16_t* p) { return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))}; }
inline vf vload_f16(const uint16_t* p, int n) {
  alignas(8) uint16_t t[4] = {0, 0, 0, 0};
  for (int i = 0; i < n && i < 4; ++i) t[i] = p[i];
  return vload_f16(t);
}
inline void vstore(float* p, vf a) { vst1q_f32(p, a.v); }
inline void vstore(float* p, vf a, int n) {
  alignas(16) float t[4];
  vst1q_f32(t, a.v);
  for (int i = 0; i < n && i < 4; ++i) p[i] = t[i];
}
inline uint16x4_t narrow_bf16(vf a) {
  const uint32x4_t u = vreinterpretq_u32_f32(a.v);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
#ifdef MOELAB_PLANT_NEON_NARROW
  // Negative control (tests/test_aarch64.py): rounds ties away instead of to even.
  const uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vdupq_n_u32(0x8000)), 16);
  (void)lsb;
#else
  const uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb), 16);
#endif
  const uint32x4_t q = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40));
  const uint32x4_t num = vceqq_f32(a.v, a.v);   // all ones unless NaN
  return vmovn_u32(vbslq_u32(num, r, q));
}
inline void vstore_bf16(uint16_t* p, vf a) { vst1_u16(p, narrow_bf16(a)); }
inline void vstore_bf16(uint16_t* p, vf a, int n) {
  alignas(8) uint16_t t[4];
  vst1_u16(t, narrow_bf16(a));
  for (int i = 0; i < n && i < 4; ++i) p[i] = t[i];
}
inline vf vadd(vf a, vf b) { return {vaddq_f32(a.v, b.v)}; }
inline vf vmul(vf a, vf b) { return {vmulq_f32(a.v, b.v)}; }
inline vf vfma(vf a, vf b, vf c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
// a > b ? a : b, so b when either is NaN (x86 maxps; NEON's fmax would return the NaN).
inline vf vmax(vf a, vf b) { return {vbslq_f32(vcgtq_f32(a.v, b.v), a.v, b.v)}; }
// (l0 + l2) + (l1 + l3): avx2's last two steps of its lane tree.
inline float vsum(vf a) {
  const float32x2_t s = vadd_f32(vget_low_f32(a.v), vget_high_f32(a.v));
  return vget_lane_f32(s, 0) + vget_lane_f32(s, 1);
}

#else
constexpr int kVecF = 1;
struct vf { float v; };
inline vf vzero() { return {0.0f}; }
inline vf vset1(float a) { return {a}; }
inline vf vload(const float* p) { return {*p}; }
inline vf vload(const float* p, int n) { return {n > 0 ? *p : 0.0f}; }
inline vf vload_bf16(const uint16_t* p) { return {bf16_to_f32(*p)}; }
inline vf vload_bf16(const uint16_t* p, int n) { return {n > 0 ? bf16_to_f32(*p) : 0.0f}; }
inline vf vload_f16(const uint16_t* p) { return {f16_to_f32(*p)}; }
inline vf vload_f16(const uint16_t* p, int n) { return {n > 0 ? f16_to_f32(*p) : 0.0f}; }
inline void vstore(float* p, vf a) { *p = a.v; }
inline void vstore(float* p, vf a, int n) { if (n > 0) *p = a.v; }
inline void vstore_bf16(uint16_t* p, vf a) { *p = f32_to_bf16(a.v); }
inline void vstore_bf16(uint16_t* p, vf a, int n) { if (n > 0) *p = f32_to_bf16(a.v); }
inline vf vadd(vf a, vf b) { return {a.v + b.v}; }
inline vf vmul(vf a, vf b) { return {a.v * b.v}; }
inline vf vfma(vf a, vf b, vf c) { return {__builtin_fmaf(a.v, b.v, c.v)}; }
inline vf vmax(vf a, vf b) { return {fmax_(a.v, b.v)}; }
inline float vsum(vf a) { return a.v; }
#endif

// Load kVecF (or the first n) elements of a row stored as F, widened to f32.
template <Fmt F> inline vf vload_as(const void* p, int64_t i) {
  if constexpr (F == Fmt::kF32) return vload(static_cast<const float*>(p) + i);
  else if constexpr (F == Fmt::kBF16) return vload_bf16(static_cast<const uint16_t*>(p) + i);
  else return vload_f16(static_cast<const uint16_t*>(p) + i);
}
template <Fmt F> inline vf vload_as(const void* p, int64_t i, int n) {
  if constexpr (F == Fmt::kF32) return vload(static_cast<const float*>(p) + i, n);
  else if constexpr (F == Fmt::kBF16) return vload_bf16(static_cast<const uint16_t*>(p) + i, n);
  else return vload_f16(static_cast<const uint16_t*>(p) + i, n);
}

}  // namespace moelab::cpu::MOELAB_ISA_NS
