// Number formats shared by every backend: bf16, f16, f8 e4m3fn, e2m1 (MXFP4 elements) and
// e8m0 (MX scales). Torch-free and header-only; MOELAB_HD marks functions that also run on a
// GPU. Every conversion here is exact or round-to-nearest-even, as SPEC.md requires.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MOELAB_HD __host__ __device__ __forceinline__
#else
#define MOELAB_HD inline
#endif

namespace moelab {

MOELAB_HD float bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
MOELAB_HD uint32_t f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

// bf16 is the top half of an f32: widening is a shift.
MOELAB_HD float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

// f32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
MOELAB_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// IEEE half -> f32 (exact), subnormals included.
MOELAB_HD float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_f32(sign);
    float v = float(man) * (1.0f / 16777216.0f);  // man * 2^-24
    return (sign ? -v : v);
  }
  return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

// f32 -> IEEE half, round to nearest even (for outputs in f16).
MOELAB_HD uint16_t f32_to_f16(float f) {
  uint32_t u = f32_to_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);        // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);       // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                       // below 2^-14: subnormal half
    // value * 2^24 rounded to an integer, RNE (float addition of 0.5-ulp magic does it).
    float v = bits_to_f32(a) * 16777216.0f;                    // exact scaling
    uint32_t m = uint32_t(v);
    float rem = v - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);                  // RNE on the 13 dropped bits
  return uint16_t(sign | ((r - 0x38000000u) >> 13));
}

// f8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no inf; 0x7f / 0xff are NaN.
MOELAB_HD float e4m3_to_f32(uint8_t b) {
  uint32_t sign = uint32_t(b & 0x80u) << 24, exp = (b >> 3) & 0xfu, man = b & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_to_f32(sign | 0x7fc00000u);
  if (exp == 0) {                                              // subnormal: man * 2^-9
    float v = float(man) * (1.0f / 512.0f);
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((exp + 120u) << 23) | (man << 20));
}

// e2m1 code (4 bits: sign = bit 3) -> value; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
MOELAB_HD float e2m1_to_f32(uint8_t code) {
  const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float v = mag[code & 7u];
  return (code & 8u) ? -v : v;
}

// e8m0 scale byte -> 2^(s-127); s = 255 is NaN. 2^-127 is an f32 subnormal (exact).
MOELAB_HD float e8m0_to_f32(uint8_t s) {
  if (s == 255) return bits_to_f32(0x7fc00000u);
  if (s == 0) return bits_to_f32(0x00400000u);
  return bits_to_f32(uint32_t(s) << 23);
}

}  // namespace moelab

namespace moelab {
// Activation storage formats a kernel may read (the binding maps torch dtypes to these).
enum class Fmt : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
constexpr int64_t fmt_size(Fmt f) { return f == Fmt::kF32 ? 4 : 2; }
}  // namespace moelab
