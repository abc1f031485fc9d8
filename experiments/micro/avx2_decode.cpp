// fused_experts' fp8 and mxfp4 decode loops at the avx2 level (16 ymm registers), one core.
//
//   python -m experiments.micro avx2_decode [rows]   (g++ -O2 -march=x86-64-v3: AVX2 + FMA and
//   16 ymm registers on any CPU; run it under MOELAB_ISA=avx2 so the output lands in the avx2
//   folder: experiments/results/<machine>-avx2[-capped]/avx2_decode.txt)
//
// A fused_experts decode item (fused_experts_kernel.h, the tiny path) is one tile of 4 groups of
// 16 columns over K = 2048 and R = 1..4 rows of bf16 activations. Each loop computes the same
// 64 x R f32 dot products with the same fma sequence per output (fma(x0, w_even, acc), then
// fma(x1, w_odd, acc), k pairs ascending) on the exact decoder's weights, so the bits must
// agree (checked first); what differs is the instruction count and the loop's shape:
//   fp8 min    per k pair all 4 groups decoded, then R x 4 dps (the kernel's loop); the
//              16-entry index as min(c & 0x7f, (c & 7) | 8) and the exponent step (E - 1) << 3
//              by a saturating byte subtract: 19 vector instructions per 32 codes, plus 8 per
//              row to widen and multiply
//   fp8 cmpgt  the same loop with the index from the exponent field by a compare (21 per 32)
//   fp8 group  cmpgt one group at a time over all of K (2 accumulators per row): fewer live
//              registers, but each accumulator's fma chain waits on the previous pair
//   fp8 parity the kernel's decoder (Fp8Dec at avx2), in fp8 min's loop: a 16-entry table of
//              (mantissa, exponent parity) and the rest of the exponent step added to the high
//              byte before the zip, so no word-wide add (17 per 32)
//   mxfp4 words  the kernel's (Mx4Dec at avx2): per pair and 16 words, the nibble masked and 2
//              byte lookups; accumulators in block-scale units, rescaled at each 32-k block
//   mxfp4 bytes  all 32 low (then high) nibbles looked up at once, pairs 0 / 2 (1 / 3) split
//              from the even and odd bytes (19 instructions per 64 words against 23)
// Two settings: L2 (1 MB of tiles, every pass from L2: the loop's arithmetic rate, also in core
// cycles per 32 weights) and DRAM (tiles over 512 MB in huge pages, each pass reads them once:
// what the loop gets of memory), beside `read`, a pure 32-byte-load stream over the same bytes.
// GB/s = code bytes / time; median (min..max) of interleaved rounds.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t K = 2048, K2 = K / 2, NG = 4, kScaleBlockPairs = 64;
constexpr int64_t kGroupBytes = K2 * 32, kTileBytes = NG * kGroupBytes;   // 128 KB
volatile float sink;

float e4m3(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
  return (c & 0x80) ? -v : v;
}
uint16_t bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
float bf16_f(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Acc { __m256 lo, hi; };
struct W32 { __m256i lo, hi; };
struct XP { __m256 x0, x1; };

inline XP x_pair(const uint16_t* a) {
  uint32_t u;
  std::memcpy(&u, a, 4);
  const __m256i d = _mm256_set1_epi32(int(u));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(d, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32(int(0xffff0000u))))};
}
inline __m256 dp_half(__m256 c, const XP& x, __m256i w) {
  const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))));
  return _mm256_fmadd_ps(x.x1, odd, _mm256_fmadd_ps(x.x0, even, c));
}
inline Acc dp(Acc c, const XP& x, const W32& w) { return {dp_half(c.lo, x, w.lo), dp_half(c.hi, x, w.hi)}; }

// The 16-entry tables of one 128-k block: bytes of bf16(e4m3(i) * s), i = 0..15 (lo, hi), and
// for "fp8 parity" bytes of bf16((1 + m / 8) * 2^(p - 7) * s), entry 8p + m (plo, phi).
struct Tab { __m256i lo, hi, plo, phi; };
Tab make_tab(float s) {
  alignas(16) uint8_t lo[16], hi[16], plo[16], phi[16];
  for (int i = 0; i < 16; ++i) {
    const uint16_t v = bf16_rne(e4m3(uint8_t(i)) * s);
    lo[i] = uint8_t(v & 0xff);
    hi[i] = uint8_t(v >> 8);
    const uint16_t pv = bf16_rne(std::ldexp(1.0f + (i & 7) / 8.0f, (i >> 3) - 7) * s);
    plo[i] = uint8_t(pv & 0xff);
    phi[i] = uint8_t(pv >> 8);
  }
  auto b = [](const uint8_t* t) { return _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)t)); };
  return {b(lo), b(hi), b(plo), b(phi)};
}

// The index from the exponent field by a compare ("cmpgt").
inline W32 dec_cmpgt(const Tab& t, const uint8_t* p) {
  const __m256i c = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i*)p), _MM_SHUFFLE(3, 1, 2, 0));
  const __m256i e = _mm256_and_si256(_mm256_srli_epi16(c, 3), _mm256_set1_epi8(0x0f));
  const __m256i m = _mm256_and_si256(c, _mm256_set1_epi8(0x07));
  const __m256i idx = _mm256_or_si256(m, _mm256_and_si256(_mm256_cmpgt_epi8(e, _mm256_setzero_si256()), _mm256_set1_epi8(0x08)));
  const __m256i lo = _mm256_shuffle_epi8(t.lo, idx);
  const __m256i hi = _mm256_xor_si256(_mm256_shuffle_epi8(t.hi, idx), _mm256_and_si256(c, _mm256_set1_epi8(char(0x80))));
  const __m256i ea = _mm256_subs_epu8(e, _mm256_set1_epi8(1));
  const __m256i z = _mm256_setzero_si256();
  return {_mm256_add_epi16(_mm256_unpacklo_epi8(lo, hi), _mm256_slli_epi16(_mm256_unpacklo_epi8(ea, z), 7)),
          _mm256_add_epi16(_mm256_unpackhi_epi8(lo, hi), _mm256_slli_epi16(_mm256_unpackhi_epi8(ea, z), 7))};
}

// "min": m7 = c & 0x7f serves the index (min with
// (c & 7) | 8: E = 0 gives m, E >= 1 gives 8 + m) and the exponent step ((c & 0x78) - 8,
// saturated: (E - 1) << 3, 0 for E = 0), which the byte unpack with zero puts at bit 3 of a
// word and a shift by 4 moves to bit 7.
inline W32 dec_min(const Tab& t, const uint8_t* p) {
  const __m256i c = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i*)p), _MM_SHUFFLE(3, 1, 2, 0));
  const __m256i k8 = _mm256_set1_epi8(0x08);
  const __m256i m7 = _mm256_and_si256(c, _mm256_set1_epi8(0x7f));
  const __m256i idx = _mm256_min_epu8(m7, _mm256_or_si256(_mm256_and_si256(c, _mm256_set1_epi8(0x07)), k8));
  const __m256i ea = _mm256_subs_epu8(_mm256_and_si256(c, _mm256_set1_epi8(0x78)), k8);
  const __m256i lo = _mm256_shuffle_epi8(t.lo, idx);
  const __m256i hi = _mm256_xor_si256(_mm256_shuffle_epi8(t.hi, idx), _mm256_xor_si256(c, m7));   // + the sign bit
  const __m256i z = _mm256_setzero_si256();
  return {_mm256_add_epi16(_mm256_unpacklo_epi8(lo, hi), _mm256_slli_epi16(_mm256_unpacklo_epi8(ea, z), 4)),
          _mm256_add_epi16(_mm256_unpackhi_epi8(lo, hi), _mm256_slli_epi16(_mm256_unpackhi_epi8(ea, z), 4))};
}

// "fp8 parity": the exponent step added to the high byte before the bytes are zipped, so no
// word-wide add. e4m3(c) = (1 + m/8) * 2^(E-7) for E >= 1 = the entry 8 (E & 1) + m = c & 15
// times 2^(2 (E >> 1)); the subnormal codes 1..7 are (1, 1, 1.5, 1, 1.25, 1.5, 1.75) x 2^-7 x
// (1/4, 1/2, 1/2, 1, 1, 1, 1): entries (0, 8, 12, 0, 2, 4, 6) with the high byte - 1 for codes
// 1..3; code 0 indexes with bit 7 set (pshufb gives +0). j = c7 +sat 0x78 has bit 7 clear only
// for c7 < 8 and then indexes the corrections at 8 + c7. For s > 0 in [2^-117, 2^119): every
// product then stays normal, so a power of two commutes with both roundings (same bits).
inline W32 dec_par(const Tab& t, const uint8_t* p) {
  const __m256i lx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, char(0x80), 0 ^ 1, 8 ^ 2, 12 ^ 3, 0 ^ 4, 2 ^ 5, 4 ^ 6, 6 ^ 7,
                                      0, 0, 0, 0, 0, 0, 0, 0, char(0x80), 0 ^ 1, 8 ^ 2, 12 ^ 3, 0 ^ 4, 2 ^ 5, 4 ^ 6, 6 ^ 7);
  const __m256i hd = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, 0, 0, 0, 0,
                                      0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, 0, 0, 0, 0);
  const __m256i c = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i*)p), _MM_SHUFFLE(3, 1, 2, 0));
  const __m256i c7 = _mm256_and_si256(c, _mm256_set1_epi8(0x7f));
  const __m256i j = _mm256_adds_epu8(c7, _mm256_set1_epi8(0x78));
  const __m256i idx = _mm256_xor_si256(_mm256_and_si256(c, _mm256_set1_epi8(0x0f)), _mm256_shuffle_epi8(lx, j));
  const __m256i ha = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(c, 4), _mm256_set1_epi8(0x07)), _mm256_shuffle_epi8(hd, j));
  const __m256i lo = _mm256_shuffle_epi8(t.plo, idx);
  const __m256i hi = _mm256_xor_si256(_mm256_add_epi8(_mm256_shuffle_epi8(t.phi, idx), ha), _mm256_xor_si256(c, c7));
  return {_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi)};
}

// acc: [R][NG][16] f32 out. w: one tile ([NG][K2][32] codes), s: 16 block scales, a: R rows of K bf16.
using Kern = void (*)(const uint8_t* w, const float* s, const uint16_t* a, int R, float* out);

template <int R, W32 (*Dec)(const Tab&, const uint8_t*)>
void kern_all(const uint8_t* w, const float* s, const uint16_t* a, float* out) {
  Acc acc[R][NG];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g) acc[r][g] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < K2 / kScaleBlockPairs; ++b) {
    const Tab t = make_tab(s[b]);
    for (int64_t kk = b * kScaleBlockPairs; kk < (b + 1) * kScaleBlockPairs; ++kk) {
      W32 wv[NG];
      for (int g = 0; g < NG; ++g) wv[g] = Dec(t, w + g * kGroupBytes + kk * 32);
      for (int r = 0; r < R; ++r) {
        const XP x = x_pair(a + r * K + 2 * kk);
        for (int g = 0; g < NG; ++g) acc[r][g] = dp(acc[r][g], x, wv[g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g) {
      _mm256_storeu_ps(out + (r * NG + g) * 16, acc[r][g].lo);
      _mm256_storeu_ps(out + (r * NG + g) * 16 + 8, acc[r][g].hi);
    }
}

template <int R, W32 (*Dec)(const Tab&, const uint8_t*)>
void kern_group(const uint8_t* w, const float* s, const uint16_t* a, float* out) {
  for (int g = 0; g < NG; ++g) {
    Acc acc[R];
    for (int r = 0; r < R; ++r) acc[r] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const uint8_t* wg = w + g * kGroupBytes;
    for (int64_t b = 0; b < K2 / kScaleBlockPairs; ++b) {
      const Tab t = make_tab(s[b]);
      for (int64_t kk = b * kScaleBlockPairs; kk < (b + 1) * kScaleBlockPairs; ++kk) {
        const W32 wv = Dec(t, wg + kk * 32);
        for (int r = 0; r < R; ++r) acc[r] = dp(acc[r], x_pair(a + r * K + 2 * kk), wv);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + (r * NG + g) * 16, acc[r].lo);
      _mm256_storeu_ps(out + (r * NG + g) * 16 + 8, acc[r].hi);
    }
  }
}

// One loop shape (all groups per k pair, or group by group) and decoder, for R = 1..4 rows.
template <W32 (*Dec)(const Tab&, const uint8_t*), bool kAllGroups>
void fp8_rows(const uint8_t* w, const float* s, const uint16_t* a, int R, float* out) {
  auto run = [&](auto r) {
    if constexpr (kAllGroups) kern_all<decltype(r)::value, Dec>(w, s, a, out);
    else kern_group<decltype(r)::value, Dec>(w, s, a, out);
  };
  switch (R) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    default: run(std::integral_constant<int, 4>{}); break;
  }
}

// The exact decoder and the same fma sequence, in scalar code.
void reference(const uint8_t* w, const float* s, const uint16_t* a, int R, float* out) {
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < 16; ++c) {
        float acc = 0.0f;
        for (int64_t kk = 0; kk < K2; ++kk) {
          const uint8_t* p = w + g * kGroupBytes + kk * 32 + 2 * c;
          const float sc = s[kk / kScaleBlockPairs];
          const float w0 = bf16_f(bf16_rne(e4m3(p[0]) * sc)), w1 = bf16_f(bf16_rne(e4m3(p[1]) * sc));
          acc = std::fma(bf16_f(a[r * K + 2 * kk]), w0, acc);
          acc = std::fma(bf16_f(a[r * K + 2 * kk + 1]), w1, acc);
        }
        out[(r * NG + g) * 16 + c] = acc;
      }
}


// ---------------------------------------------------------------------------- mxfp4
// The kernel's mxfp4 layout (fused_experts_pack.h): per group, one 64-byte octet per 4 k pairs,
// dword c = column c's 8 codes (pair j, parity p at bits 16p + 4j); one e8m0 scale byte per
// column and 32-k block (16 pairs = 4 octets). Weights decode to the plain e2m1 values and the
// accumulators are kept in units of the block's scale (rescaled at each block), as Mx4Dec.
constexpr int64_t kMxGroupBytes = K2 / 4 * 64, kMxTileBytes = NG * kMxGroupBytes;   // 64 KB
constexpr int64_t kMxBlocks = K / 32;

struct MxTab { __m256i lo, hi; };
MxTab mx_tab() {
  alignas(16) uint8_t lo[16], hi[16];
  for (int c = 0; c < 16; ++c) {
    const float m[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const uint16_t v = bf16_rne((c & 8) ? -m[c & 7] : m[c & 7]);
    lo[c] = uint8_t(v & 0xff);
    hi[c] = uint8_t(v >> 8);
  }
  return {_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)lo)),
          _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)hi))};
}

// The kernel's: per pair and 16 words, the code's nibble masked, 2 lookups (the high-byte one
// on the code moved up a byte), or.
inline __m256i mx_codes(const MxTab& t, __m256i d) {
  const __m256i n = _mm256_and_si256(d, _mm256_set1_epi16(0x000f));
  return _mm256_or_si256(_mm256_shuffle_epi8(t.lo, n), _mm256_shuffle_epi8(t.hi, _mm256_slli_epi16(n, 8)));
}
inline void mx_words(const MxTab& t, const uint8_t* p, W32* w) {
  const __m256i d0 = _mm256_loadu_si256((const __m256i*)p), d1 = _mm256_loadu_si256((const __m256i*)(p + 32));
  w[0] = {mx_codes(t, d0), mx_codes(t, d1)};
  w[1] = {mx_codes(t, _mm256_srli_epi16(d0, 4)), mx_codes(t, _mm256_srli_epi16(d1, 4))};
  w[2] = {mx_codes(t, _mm256_srli_epi16(d0, 8)), mx_codes(t, _mm256_srli_epi16(d1, 8))};
  w[3] = {mx_codes(t, _mm256_srli_epi16(d0, 12)), mx_codes(t, _mm256_srli_epi16(d1, 12))};
}
// Bytes: the low nibbles of all 32 bytes (pairs 0 and 2) and the high ones (pairs 1 and 3)
// looked up at once, then the words of pair 0 from the even bytes of both lookups and pair 2
// from the odd bytes: 19 instructions per 64 words against 23.
inline void mx_bytes_half(const MxTab& t, __m256i d, __m256i* w) {
  const __m256i m = _mm256_set1_epi8(0x0f), low = _mm256_set1_epi16(0x00ff);
  const __m256i n02 = _mm256_and_si256(d, m), n13 = _mm256_and_si256(_mm256_srli_epi16(d, 4), m);
  const __m256i l02 = _mm256_shuffle_epi8(t.lo, n02), h02 = _mm256_shuffle_epi8(t.hi, n02);
  const __m256i l13 = _mm256_shuffle_epi8(t.lo, n13), h13 = _mm256_shuffle_epi8(t.hi, n13);
  w[0] = _mm256_or_si256(_mm256_and_si256(l02, low), _mm256_slli_epi16(h02, 8));
  w[2] = _mm256_or_si256(_mm256_srli_epi16(l02, 8), _mm256_andnot_si256(low, h02));
  w[1] = _mm256_or_si256(_mm256_and_si256(l13, low), _mm256_slli_epi16(h13, 8));
  w[3] = _mm256_or_si256(_mm256_srli_epi16(l13, 8), _mm256_andnot_si256(low, h13));
}
inline void mx_bytes(const MxTab& t, const uint8_t* p, W32* w) {
  __m256i a[4], b[4];
  mx_bytes_half(t, _mm256_loadu_si256((const __m256i*)p), a);
  mx_bytes_half(t, _mm256_loadu_si256((const __m256i*)(p + 32)), b);
  for (int j = 0; j < 4; ++j) w[j] = {a[j], b[j]};
}

inline __m256 mx_factor(const uint8_t* s, int64_t b, int c0) {   // 2^(e(b-1) - e(b)), 8 columns
  const __m256i prev = b > 0 ? _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(s + (b - 1) * 16 + c0))) : _mm256_set1_epi32(127);
  const __m256i cur = b < kMxBlocks ? _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(s + b * 16 + c0))) : _mm256_set1_epi32(127);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(prev, cur), _mm256_set1_epi32(127)), 23));
}

// w: tile [NG][K2/4][64], s: [NG][kMxBlocks][16] scale bytes; the kernel's loop (block_rows
// with kStep 4: group by group within an octet).
using MxKern = void (*)(const uint8_t* w, const uint8_t* s, const uint16_t* a, int R, float* out);
template <int R, void (*Dec)(const MxTab&, const uint8_t*, W32*)>
void mx_loop(const uint8_t* w, const uint8_t* s, const uint16_t* a, float* out) {
  const MxTab t = mx_tab();
  Acc acc[R][NG];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g) acc[r][g] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b <= kMxBlocks; ++b) {
    for (int g = 0; g < NG; ++g) {
      const __m256 flo = mx_factor(s + g * kMxBlocks * 16, b, 0), fhi = mx_factor(s + g * kMxBlocks * 16, b, 8);
      for (int r = 0; r < R; ++r) acc[r][g] = {_mm256_mul_ps(acc[r][g].lo, flo), _mm256_mul_ps(acc[r][g].hi, fhi)};
    }
    if (b == kMxBlocks) break;
    for (int64_t kk = b * 16; kk < (b + 1) * 16; kk += 4) {
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        W32 wv[4];
        Dec(t, w + g * kMxGroupBytes + kk / 4 * 64, wv);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[r][g] = dp(acc[r][g], x_pair(a + r * K + 2 * (kk + j)), wv[j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g) {
      _mm256_storeu_ps(out + (r * NG + g) * 16, acc[r][g].lo);
      _mm256_storeu_ps(out + (r * NG + g) * 16 + 8, acc[r][g].hi);
    }
}
template <void (*Dec)(const MxTab&, const uint8_t*, W32*)>
MxKern mx_by_rows() {
  return [](const uint8_t* w, const uint8_t* s, const uint16_t* a, int R, float* out) {
    switch (R) {
      case 1: mx_loop<1, Dec>(w, s, a, out); break;
      case 2: mx_loop<2, Dec>(w, s, a, out); break;
      case 3: mx_loop<3, Dec>(w, s, a, out); break;
      default: mx_loop<4, Dec>(w, s, a, out); break;
    }
  };
}

// The exact decoder's weights bf16(e2m1(c) * 2^(s - 127)) and the same fma sequence.
void mx_reference(const uint8_t* w, const uint8_t* s, const uint16_t* a, int R, float* out) {
  const float m[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < 16; ++c) {
        float acc = 0.0f;
        for (int64_t kk = 0; kk < K2; ++kk) {
          uint32_t dw;
          std::memcpy(&dw, w + g * kMxGroupBytes + kk / 4 * 64 + 4 * c, 4);
          const float sc = std::ldexp(1.0f, int(s[(g * kMxBlocks + kk / 16) * 16 + c]) - 127);
          for (int p = 0; p < 2; ++p) {
            const uint32_t code = (dw >> (16 * p + 4 * (kk & 3))) & 15;
            const float wv = bf16_f(bf16_rne(((code & 8) ? -m[code & 7] : m[code & 7]) * sc));
            acc = std::fma(bf16_f(a[r * K + 2 * kk + p]), wv, acc);
          }
        }
        out[(r * NG + g) * 16 + c] = acc;
      }
}

// Core clock: a chain of dependent register-register adds (1 cycle each; an add of an
// immediate can be folded at rename on recent cores, so the increment is a register).
double core_ghz() {
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    uint64_t x = 0, one = 1;
    const int64_t n = 200000000;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; i += 8)
      __asm__ volatile("add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0"
                       : "+r"(x) : "r"(one));
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, n / dt / 1e9);
  }
  return best;
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::string stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  char b[64];
  std::snprintf(b, sizeof b, "%6.2f (%5.2f..%5.2f)", v[v.size() / 2], v.front(), v.back());
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = 7;
  std::vector<int> rows_list = {1, 2, 4};
  if (argc > 1) rows_list = {std::atoi(argv[1])};
  const int64_t big = int64_t(512) << 20;
  auto* mem = static_cast<uint8_t*>(std::aligned_alloc(2 << 20, big));
  madvise(mem, big, MADV_HUGEPAGE);
  uint64_t st = 88172645463325252ull;
  auto rnd = [&] { st ^= st << 13, st ^= st >> 7, st ^= st << 17; return st; };
  for (int64_t i = 0; i < big; ++i) {
    uint8_t c = uint8_t(rnd());
    if ((c & 0x7f) == 0x7f) c = 0;   // no fp8 NaN codes (the kernel sends their tiles to the exact decoder)
    mem[i] = c;
  }
  std::vector<float> scales(16);
  for (int b = 0; b < 16; ++b) scales[b] = std::ldexp(1.0f + b / 16.0f, -9 + (b % 5));
  std::vector<uint8_t> mx_scales(NG * kMxBlocks * 16);
  for (auto& v : mx_scales) v = uint8_t(120 + rnd() % 15);
  std::vector<uint16_t> a(4 * K);
  for (auto& v : a) v = bf16_rne(float(int(rnd() % 2001) - 1000) / 997.0f);

  // One variant: a name, the bytes of one tile, and a call over the tile at w.
  struct V { std::string name; int64_t tile; std::function<void(const uint8_t*, int, float*)> run; };
  const Kern fp8[] = {fp8_rows<dec_cmpgt, true>, fp8_rows<dec_min, true>, fp8_rows<dec_cmpgt, false>,
                      fp8_rows<dec_par, true>};
  const char* fp8_names[] = {"fp8 cmpgt", "fp8 min", "fp8 group", "fp8 parity"};
  const MxKern mx[] = {mx_by_rows<mx_words>(), mx_by_rows<mx_bytes>()};
  const char* mx_names[] = {"mxfp4 words", "mxfp4 bytes"};
  std::vector<V> vars;
  for (int i = 0; i < 4; ++i)
    vars.push_back({fp8_names[i], kTileBytes, [&, i](const uint8_t* w, int R, float* o) { fp8[i](w, scales.data(), a.data(), R, o); }});
  for (int i = 0; i < 2; ++i)
    vars.push_back({mx_names[i], kMxTileBytes, [&, i](const uint8_t* w, int R, float* o) { mx[i](w, mx_scales.data(), a.data(), R, o); }});
  vars.push_back({"read", kTileBytes, [](const uint8_t* w, int, float* o) {
                    __m256i x = _mm256_setzero_si256();
                    for (int64_t i = 0; i < kTileBytes; i += 32) x = _mm256_xor_si256(x, _mm256_load_si256((const __m256i*)(w + i)));
                    o[0] += float(_mm256_extract_epi32(x, 0) & 1);
                  }});

  const double ghz = core_ghz();
  std::printf("# K = %ld, 4 groups x 16 columns per tile (fp8 %ld KB, mxfp4 %ld KB of codes), one core, "
              "-march=x86-64-v3; core clock %.2f GHz (dependent register adds)\n",
              long(K), long(kTileBytes >> 10), long(kMxTileBytes >> 10), ghz);
  for (int R : rows_list) {
    std::vector<float> ref(R * NG * 16), got(R * NG * 16);
    reference(mem, scales.data(), a.data(), R, ref.data());
    for (int i = 0; i < 4; ++i) {
      fp8[i](mem, scales.data(), a.data(), R, got.data());
      if (std::memcmp(ref.data(), got.data(), ref.size() * 4)) return std::printf("R=%d %s: bits differ\n", R, fp8_names[i]), 1;
    }
    mx_reference(mem, mx_scales.data(), a.data(), R, ref.data());
    for (int i = 0; i < 2; ++i) {
      mx[i](mem, mx_scales.data(), a.data(), R, got.data());
      if (std::memcmp(ref.data(), got.data(), ref.size() * 4)) return std::printf("R=%d %s: bits differ\n", R, mx_names[i]), 1;
    }
    std::printf("R=%d: every variant == the exact decoder and fma sequence (bit for bit)\n", R);
  }
  std::printf("GB/s of codes, median (min..max) of %d interleaved rounds; L2: 1 MB of tiles, 40 passes (best of 3);"
              " DRAM: 512 MB, one pass; cyc/32w: core cycles per 32 weights in L2\n", rounds);
  std::vector<float> out(4 * NG * 16);
  for (int R : rows_list) {
    for (int where = 0; where < 2; ++where) {   // 0: L2, 1: DRAM
      std::vector<std::vector<double>> gbs(vars.size());
      for (int round = 0; round < rounds; ++round) {
        for (size_t vi = 0; vi < vars.size(); ++vi) {
          const V& v = vars[vi];
          const int64_t nt = where ? big / v.tile : (int64_t(1) << 20) / v.tile;
          const int passes = where ? 1 : 40;
          double best = 1e30;
          for (int rep = 0; rep < (where ? 1 : 3); ++rep) {
            const double t0 = now();
            for (int pass = 0; pass < passes; ++pass)
              for (int64_t t = 0; t < nt; ++t) v.run(mem + t * v.tile, R, out.data());
            best = std::min(best, now() - t0);
          }
          gbs[vi].push_back(double(nt) * v.tile * passes / best / 1e9);
        }
      }
      for (size_t vi = 0; vi < vars.size(); ++vi) {
        if (vars[vi].name == "read" && R != rows_list[0]) continue;
        std::vector<double> g = gbs[vi];
        std::sort(g.begin(), g.end());
        const double wpb = vars[vi].name.rfind("mxfp4", 0) == 0 ? 2.0 : 1.0;   // weights per byte
        std::printf("R=%d %-4s %-12s %s GB/s", R, where ? "DRAM" : "L2", vars[vi].name.c_str(), stats(gbs[vi]).c_str());
        if (!where && vars[vi].name != "read") std::printf("  %5.2f cyc/32w", 32.0 / wpb / g[g.size() / 2] * ghz);
        std::printf("\n");
      }
    }
  }
  sink = out[0];
  return 0;
}
