// The blocked (prefill) micro-kernel at the avx2 level: which register block suits 16 ymm.
//
//   python -m experiments.micro avx2_prefill_block   (g++ -O3 -march=x86-64-v3, the kernel's
//   flags at its avx2 level: AVX2 + FMA and 16 ymm registers on any CPU; run it under
//   MOELAB_ISA=avx2 on an AVX-512 CPU so the output lands in the capped folder)
//
// One expert block of prefill: 11 chunks of 6 rows (66 rows) of bf16 activations times one
// dequantized tile of 64 columns (4 groups of 16) x K = 2048 bf16 weights in the kernel's
// buffer layout ([K/2][4][32], VNNI pairs), 16 such tiles round robin (4 MB, so each tile's
// first chunk reads it from L3 and the other 10 from L2). Every variant computes the same
// 66 x 64 dot products with the level's fma sequence per output (fma(x0, w_even, acc), then
// fma(x1, w_odd, acc), k pairs ascending), so the bits must agree (checked first); what differs
// is the register block:
//   6x4 mixed   micro_buf at avx2 (the kernel's block): per k pair 4 groups x 6 rows, 48 ymm
//               accumulators in a 16-register file, so most live on the stack (each fma
//               reads and writes one there)
//   6x1 mixed   one group (16 columns, 2 ymm per row) at a time over all of K: 12 accumulators,
//               each row's activation pair widened in registers (x_pair); 19 values live
//               against 16 registers, so a few accumulators spill
//   4x1 phased  4 rows x 1 group, all even-k fmas of a pair before its odd-k fmas: nothing
//               spills, but each widened weight vector serves only 4 rows
//   6x1 panel   6 rows x 1 group, the chunk's activations widened to f32 once ([K/2][2][6]),
//               so each is one vbroadcastss from memory: 12 accumulators + 2 weight vectors +
//               1 broadcast, no accumulator spilled
//   6x4 panel   the kernel's block with the panel's broadcasts (no x_pair widening)
// The question: on a CPU whose stack spills cost more than they do on Zen 4 (where 6x4 mixed
// wins), does a non-spilling block run the prefill GEMM faster? The winner decides the
// blocked kernel's block at avx2.
// GFLOP/s (2 per multiply-add) and ns per ymm fma, median (min..max) of interleaved rounds.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

static constexpr int64_t KP = 1024, K = 2 * KP;
static constexpr int kChunks = 11, kRows = 6, kTiles = 16, kReps = 8, kGroups = 4;
static constexpr int64_t kTile = KP * kGroups * 32;   // elements
static volatile float sink;

struct XP { __m256 x0, x1; };
static inline XP x_pair(const char* a) {
  uint32_t u;
  std::memcpy(&u, a, 4);
  const __m256i d = _mm256_set1_epi32(int(u));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(d, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32(int(0xffff0000u))))};
}
static inline __m256 even(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline __m256 odd(__m256i w) { return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u)))); }
static inline __m256 dp_half(__m256 c, const XP& x, __m256i w) {
  return _mm256_fmadd_ps(x.x1, odd(w), _mm256_fmadd_ps(x.x0, even(w), c));
}

// Where a row's activation pair comes from: the bf16 rows, widened in registers (x_pair, the
// kernel's way), or the chunk's f32 panel (widen_rows below), one vbroadcastss per value.
struct Bf16Rows {
  const char *a0, *a3;   // rows 0-2 and 3-5, as the kernel addresses them
  int64_t ld;
  Bf16Rows(const uint16_t* a, int64_t lda)
      : a0(reinterpret_cast<const char*>(a)), a3(a0 + 3 * lda * 2), ld(lda * 2) {}
  XP at(int r) const { return x_pair(r < 3 ? a0 + r * ld : a3 + (r - 3) * ld); }
  void next() { a0 += 4, a3 += 4; }
};
template <int R>
struct F32Panel {
  const float* p;
  XP at(int r) const { return {_mm256_broadcast_ss(p + r), _mm256_broadcast_ss(p + R + r)}; }
  void next() { p += 2 * R; }
};

// R rows x NG groups, per k pair every group loaded, then per row both halves' even and odd fma.
template <int R, int NG, class X>
__attribute__((noinline)) void mixed(const uint16_t* b, int64_t kstride, X x, float* out) {
  __m256 acc[R][NG][2];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g) acc[r][g][0] = acc[r][g][1] = _mm256_setzero_ps();
  const uint16_t* bk = b;
  for (int64_t kk = 0; kk < KP; ++kk, x.next(), bk += kstride) {
    __m256i w[NG][2];
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) w[g][h] = _mm256_loadu_si256((const __m256i*)(bk + g * 32 + h * 16));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const XP xr = x.at(r);
#pragma GCC unroll 8
      for (int g = 0; g < NG; ++g)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) acc[r][g][h] = dp_half(acc[r][g][h], xr, w[g][h]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * 64 + g * 16 + h * 8, acc[r][g][h]);
}

// R rows x 1 group, per k pair all even-k fmas, then all odd-k fmas.
template <int R>
__attribute__((noinline)) void phased(const uint16_t* b, int64_t kstride, const uint16_t* a, int64_t lda, float* out) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const char* a0 = reinterpret_cast<const char*>(a);
  const char* a3 = a0 + 3 * lda * 2;
  const int64_t ld = lda * 2;
  const uint16_t* bk = b;
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  for (int64_t kk = 0; kk < KP; ++kk, a0 += 4, a3 += 4, bk += kstride) {
    const __m256i wl = _mm256_loadu_si256((const __m256i*)bk), wh = _mm256_loadu_si256((const __m256i*)(bk + 16));
    const __m256 el = even(wl), eh = even(wh);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      uint32_t u;
      std::memcpy(&u, r < 3 ? a0 + r * ld : a3 + (r - 3) * ld, 4);
      const __m256 x0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi32(int(u)), 16));
      acc[r][0] = _mm256_fmadd_ps(x0, el, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x0, eh, acc[r][1]);
    }
    const __m256 ol = _mm256_castsi256_ps(_mm256_and_si256(wl, hi)), oh = _mm256_castsi256_ps(_mm256_and_si256(wh, hi));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      uint32_t u;
      std::memcpy(&u, r < 3 ? a0 + r * ld : a3 + (r - 3) * ld, 4);
      const __m256 x1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_set1_epi32(int(u)), hi));
      acc[r][0] = _mm256_fmadd_ps(x1, ol, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x1, oh, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * 64, acc[r][0]);
    _mm256_storeu_ps(out + r * 64 + 8, acc[r][1]);
  }
}

// The chunk's activations widened to f32 once, k-major ([K/2][2][R]: pair kk's even-k values of
// the R rows, then its odd-k values), so each row's value is one vbroadcastss from memory.
template <int R>
static void widen_rows(const uint16_t* a, int64_t lda, float* ap) {
  for (int64_t kk = 0; kk < KP; ++kk)
    for (int p = 0; p < 2; ++p)
      for (int r = 0; r < R; ++r) {
        const uint32_t u = uint32_t(a[r * lda + 2 * kk + p]) << 16;
        std::memcpy(ap + (kk * 2 + p) * R + r, &u, 4);
      }
}

// R rows x 1 group over the f32 panel: per k pair the even-k fmas of all rows, then the odd-k.
template <int R>
__attribute__((noinline)) void panel(const uint16_t* b, int64_t kstride, const float* ap, float* out) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint16_t* bk = b;
  for (int64_t kk = 0; kk < KP; ++kk, ap += 2 * R, bk += kstride) {
    const __m256i wl = _mm256_loadu_si256((const __m256i*)bk), wh = _mm256_loadu_si256((const __m256i*)(bk + 16));
    const __m256 el = even(wl), eh = even(wh);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_broadcast_ss(ap + r);
      acc[r][0] = _mm256_fmadd_ps(x0, el, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x0, eh, acc[r][1]);
    }
    const __m256 ol = odd(wl), oh = odd(wh);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x1 = _mm256_broadcast_ss(ap + R + r);
      acc[r][0] = _mm256_fmadd_ps(x1, ol, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x1, oh, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * 64, acc[r][0]);
    _mm256_storeu_ps(out + r * 64 + 8, acc[r][1]);
  }
}

// One chunk of rows over a tile (the weights, the chunk's first row, 6 x 64 outputs).
using Fn = std::function<void(const uint16_t*, const uint16_t*, float*)>;

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 9;
  uint16_t* W = (uint16_t*)aligned_alloc(64, size_t(kTiles) * kTile * 2);
  uint16_t* A = (uint16_t*)aligned_alloc(64, size_t(kChunks) * kRows * K * 2);
  uint32_t s = 12345;
  auto bf16 = [&] {   // small random bf16 values (sign, exponent 120..127, 7-bit mantissa)
    s = s * 1664525u + 1013904223u;
    return uint16_t(((s >> 31) << 15) | ((120 + ((s >> 20) & 7)) << 7) | ((s >> 8) & 0x7f));
  };
  for (int64_t i = 0; i < kTiles * kTile; ++i) W[i] = bf16();
  for (int64_t i = 0; i < kChunks * kRows * K; ++i) A[i] = bf16();
  std::vector<std::pair<std::string, Fn>> v = {
      {"6x4 mixed", [](const uint16_t* w, const uint16_t* a, float* out) {
         mixed<6, 4>(w, kGroups * 32, Bf16Rows(a, K), out);
       }},
      {"6x1 mixed", [](const uint16_t* w, const uint16_t* a, float* out) {
         for (int g = 0; g < kGroups; ++g) mixed<6, 1>(w + g * 32, kGroups * 32, Bf16Rows(a, K), out + g * 16);
       }},
      {"4x1 phased", [](const uint16_t* w, const uint16_t* a, float* out) {
         for (int g = 0; g < kGroups; ++g) {
           phased<4>(w + g * 32, kGroups * 32, a, K, out + g * 16);
           phased<2>(w + g * 32, kGroups * 32, a + 4 * K, K, out + 4 * 64 + g * 16);
         }
       }},
      {"6x1 panel", [](const uint16_t* w, const uint16_t* a, float* out) {
         alignas(64) static float ap[KP * 2 * kRows];
         widen_rows<kRows>(a, K, ap);
         for (int g = 0; g < kGroups; ++g) panel<kRows>(w + g * 32, kGroups * 32, ap, out + g * 16);
       }},
      {"6x4 panel", [](const uint16_t* w, const uint16_t* a, float* out) {
         alignas(64) static float ap[KP * 2 * kRows];
         widen_rows<kRows>(a, K, ap);
         mixed<kRows, kGroups>(w, kGroups * 32, F32Panel<kRows>{ap}, out);
       }},
  };
  // The same bits from every variant (one chunk, one tile).
  alignas(64) static float ref[kRows * 64], got[kRows * 64];
  v[0].second(W, A, ref);
  for (size_t i = 1; i < v.size(); ++i) {
    std::memset(got, 0xff, sizeof(got));
    v[i].second(W, A, got);
    if (std::memcmp(ref, got, sizeof(ref))) {
      std::printf("MISMATCH: %s differs from %s\n", v[i].first.c_str(), v[0].first.c_str());
      return 1;
    }
  }
  alignas(64) static float out[kRows * 64];
  std::vector<std::vector<double>> ns(v.size());
  const double fmas = double(kTiles) * kReps * kChunks * kRows * 64 / 8 * K;   // ymm fmas
  for (int rd = 0; rd < rounds; ++rd)
    for (size_t j = 0; j < v.size(); ++j) {
      const size_t i = (j + rd) % v.size();
      auto t0 = std::chrono::steady_clock::now();
      for (int t = 0; t < kTiles * kReps; ++t)
        for (int c = 0; c < kChunks; ++c) v[i].second(W + (t % kTiles) * kTile, A + c * kRows * K, out);
      ns[i].push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / fmas);
      sink = out[3];
    }
  std::printf("bits: every variant equal to %s\n", v[0].first.c_str());
  std::printf("%d rounds, one core: GFLOP/s and ns per ymm fma, median (min..max)\n", rounds);
  for (size_t i = 0; i < v.size(); ++i) {
    auto t = ns[i];
    std::sort(t.begin(), t.end());
    const double med = t[t.size() / 2];
    std::printf("  %-11s %6.1f GFLOP/s  %.4f ns (%.4f..%.4f)\n", v[i].first.c_str(), 16.0 / med, med, t.front(),
                t.back());
  }
  return 0;
}
