// fp8 (e4m3) -> bf16 decoders of fused_experts' fast path, side by side, on one core.
//
//   python -m experiments.micro fp8_decode   (compiles with g++ -march=native, runs, saves)
//   (needs AVX512-BF16 and VBMI; output: experiments/results/<machine>/fp8_decode.txt)
//
// Each decoder turns codes (with one block scale) into the bf16 weights vdpbf16ps consumes,
// 16 columns x 2 k per 32 weights, and feeds them to a T = 1 dot product, as the tiny
// micro-kernel does. 256 KB of codes stay in L2, so this times the arithmetic, not DRAM:
//   widen  bytes -> f16 bits (shift, mask) -> vcvtph2ps -> * scale*256 -> vcvtne2ps2bf16
//          (the decoder before December 2026)
//   words  a 128-entry bf16 table of e4m3(c) * scale, 2 x vpermi2w + blend + sign (Fp8Dec)
//   pairs  the table as two byte tables, 64 codes at once: vpermb, 2 x vpermi2b, sign, and
//          vpunpck{l,h}bw (Fp8PairDec)
//   lanes  pairs without the vpermb, on codes stored already in lane order (what a packing
//          in that order would give: the question is whether it would be worth the layout)
// First every decoder's bf16 words are compared with the widening decoder's (they must be
// the same bits), then each is timed: the minimum of 50 passes, 5 rounds interleaved.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

float e4m3(int c) {   // magnitude of code c in 0..126
  const int e = (c >> 3) & 15, m = c & 7;
  return e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
}

// The three decoders write 32 (or 64) bf16 words per call into out.
struct Widen {
  __m512 sv;
  explicit Widen(float s) : sv(_mm512_set1_ps(s * 256.0f)) {}
  static constexpr int kCodes = 32;
  void get(const uint8_t* p, __m512i* out) const {
    __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
    __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), _mm512_set1_epi16(int16_t(0xbf80)));
    __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), sv);
    __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), sv);
    out[0] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
};

struct Words {
  __m512i tab[4];
  explicit Words(float s) {
    alignas(64) float mag[128];
    for (int c = 0; c < 128; ++c) mag[c] = c == 127 ? 0.0f : e4m3(c);
    for (int i = 0; i < 4; ++i)
      tab[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_load_ps(mag + 32 * i + 16), _mm512_set1_ps(s)),
                                            _mm512_mul_ps(_mm512_load_ps(mag + 32 * i), _mm512_set1_ps(s)));
  }
  static constexpr int kCodes = 32;
  void get(const uint8_t* p, __m512i* out) const {
    const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
    const __m512i lo = _mm512_permutex2var_epi16(tab[0], b, tab[1]);
    const __m512i hi = _mm512_permutex2var_epi16(tab[2], b, tab[3]);
    const __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)), lo, hi);
    out[0] = _mm512_ternarylogic_epi32(v, b, _mm512_set1_epi16(int16_t(0x8000)), 0x78);
  }
};

struct Pairs {
  __m512i lo0, lo1, hi0, hi1, order;
  explicit Pairs(float s) {
    Words w(s);
    auto bytes = [](__m512i a, __m512i c, int shift) {
      return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srli_epi16(a, shift))),
                                _mm512_cvtepi16_epi8(_mm512_srli_epi16(c, shift)), 1);
    };
    lo0 = bytes(w.tab[0], w.tab[1], 0);
    lo1 = bytes(w.tab[2], w.tab[3], 0);
    hi0 = bytes(w.tab[0], w.tab[1], 8);
    hi1 = bytes(w.tab[2], w.tab[3], 8);
    alignas(64) uint8_t ord[64];
    for (int q = 0; q < 8; ++q)
      for (int j = 0; j < 8; ++j) ord[8 * q + j] = uint8_t(8 * (q / 2) + 32 * (q % 2) + j);
    order = _mm512_load_si512(ord);
  }
  static constexpr int kCodes = 64;
  void get(const uint8_t* p, __m512i* out) const {
    lookup(_mm512_permutexvar_epi8(order, _mm512_loadu_si512(p)), out);
  }
  // 64 codes already in lane order -> their bf16 words, in code order
  void lookup(__m512i c, __m512i* out) const {
    const __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);
    __m512i hi = _mm512_permutex2var_epi8(hi0, c, hi1);
    hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8(char(0x80)), 0x78);
    out[0] = _mm512_unpacklo_epi8(lo, hi);
    out[1] = _mm512_unpackhi_epi8(lo, hi);
  }
};

// Pairs on codes that the packing would have put in lane order already (no vpermb).
struct Lanes : Pairs {
  using Pairs::Pairs;
  void get(const uint8_t* p, __m512i* out) const { lookup(_mm512_loadu_si512(p), out); }
  // codes of consecutive 64-byte chunks, each put in the lane order Pairs' vpermb makes
  static std::vector<uint8_t> reorder(const std::vector<uint8_t>& w) {
    std::vector<uint8_t> r(w.size());
    for (size_t i = 0; i < w.size(); i += 64)
      for (int q = 0; q < 8; ++q)
        for (int j = 0; j < 8; ++j) r[i + 8 * q + j] = w[i + 8 * (q / 2) + 32 * (q % 2) + j];
    return r;
  }
};

// T = 1: acc[g] += x pair . decoded words; four groups (independent chains) as in the kernel.
template <class D>
__attribute__((noinline)) float dot(const D& d, const uint8_t* w, size_t n, const uint16_t* x) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  constexpr int per = D::kCodes / 32;
  for (size_t i = 0; i < n; i += 4 * D::kCodes) {
    for (int g = 0; g < 4; ++g) {
      __m512i v[2];
      d.get(w + i + g * D::kCodes, v);
      for (int s = 0; s < per; ++s) {
        uint32_t u;
        std::memcpy(&u, x + 2 * (((i / 128) * per + s) % 1024), 4);
        acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)v[s], (__m512bh)_mm512_set1_epi32(int(u)));
      }
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

template <class D>
void decode_all(const D& d, const uint8_t* w, size_t n, uint16_t* out) {
  for (size_t i = 0; i < n; i += D::kCodes) {
    __m512i v[2];
    d.get(w + i, v);
    for (int s = 0; s < D::kCodes / 32; ++s) _mm512_storeu_si512(out + i + 32 * s, v[s]);
  }
}

template <class D>
double time_min(const D& d, const uint8_t* w, size_t n, const uint16_t* x, float* sink) {
  double best = 1e30;
  for (int r = 0; r < 50; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    *sink += dot(d, w, n, x);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main() {
  const size_t n = 256 * 1024;
  std::vector<uint8_t> w(n);
  uint32_t state = 12345;
  for (auto& b : w) {
    state = state * 1664525u + 1013904223u;
    b = uint8_t(state >> 24);
    if ((b & 0x7f) == 0x7f) b = 0;   // NaN codes go to the exact decoder, never here
  }
  std::vector<uint16_t> x(2048);
  for (size_t i = 0; i < x.size(); ++i) x[i] = uint16_t(0x3f80 + (i % 7));
  int bad = 0;
  for (float s : {0.0123f, -3.5e-4f, 1.0f, 7.0e-39f}) {
    Widen a(s);
    Words b(s);
    Pairs c(s);
    std::vector<uint16_t> ra(n), rb(n), rc(n);
    decode_all(a, w.data(), n, ra.data());
    decode_all(b, w.data(), n, rb.data());
    // pairs decode 64 codes that are two consecutive 32-code chunks: the same order
    decode_all(c, w.data(), n, rc.data());
    Lanes d(s);
    std::vector<uint16_t> rd(n);
    decode_all(d, Lanes::reorder(w).data(), n, rd.data());
    const bool same = ra == rb && ra == rc && ra == rd;
    std::printf("scale %-10g words %s widen, pairs %s widen, lanes %s widen\n", s, ra == rb ? "==" : "!=",
                ra == rc ? "==" : "!=", ra == rd ? "==" : "!=");
    bad += !same;
  }
  float sink = 0;
  const float s = 0.0123f;
  Widen a(s);
  Words b(s);
  Pairs c(s);
  Lanes d(s);
  const std::vector<uint8_t> wl = Lanes::reorder(w);
  std::printf("ns per 32 weights (min of 50 passes over %zu KB in L2), one core:\n", n / 1024);
  for (int round = 0; round < 5; ++round) {
    const double ta = time_min(a, w.data(), n, x.data(), &sink), tb = time_min(b, w.data(), n, x.data(), &sink),
                 tc = time_min(c, w.data(), n, x.data(), &sink), td = time_min(d, wl.data(), n, x.data(), &sink);
    const double per = double(n) / 32;
    std::printf("round %d  widen %.3f  words %.3f  pairs %.3f  lanes %.3f   widen/words %.2fx  widen/pairs %.2fx  "
                "pairs/lanes %.2fx\n", round, ta / per * 1e9, tb / per * 1e9, tc / per * 1e9, td / per * 1e9, ta / tb,
                ta / tc, tc / td);
  }
  std::printf("(sink %g)\n", sink);
  return bad ? 1 : 0;
}
