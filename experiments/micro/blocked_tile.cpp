// micro_buf's loop (6 rows x 4 groups, 24 vdpbf16ps per k pair) over a bf16 weight tile of
// KP pairs, group-major (4 streams KP*64 bytes apart, the packed bf16 layout), for `chunks`
// chunks of 6 rows, each chunk its own rows (as an expert's 64 rows are ~11 chunks).
// Compares a tile in L2 (KP = 1024: 256 KB) with K-blocking (the same tile, KC pairs at a
// time over all chunks, accumulators stored to / loaded from an f32 buffer between blocks),
// the question being whether keeping the weights of a block in L1 (as a GEMM library's K
// blocking does) would speed the blocked kernel up. 64 distinct tiles (16 MB, in L3 after the
// first round), best of 7 rounds, ns per vdpbf16ps, one core.
//   python -m experiments.micro blocked_tile   (compiles with g++ -march=native, runs, saves)
// Results: experiments/results/<machine>/blocked_tile.txt
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

volatile float sink;

static inline __m512 dp(__m512 a, __m512i w, __m512i x) { return _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)x); }

// one chunk, pairs [k0, k1), acc in registers loaded/stored from accb
__attribute__((noinline)) void chunk(const uint16_t* w, int64_t gstride, const uint16_t* a, int64_t lda,
                                     int64_t k0, int64_t k1, float* accb) {
  __m512 acc[6][4];
#pragma GCC unroll 6
  for (int r = 0; r < 6; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_load_ps(accb + (r * 4 + g) * 16);
  const uint16_t* bk = w + k0 * 32;
  for (int64_t kk = k0; kk < k1; ++kk, bk += 32) {
    __m512i wv[4];
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) wv[g] = _mm512_load_si512(bk + g * gstride);
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
      uint32_t xv;
      std::memcpy(&xv, a + r * lda + 2 * kk, 4);
      const __m512i x = _mm512_set1_epi32(int(xv));
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) acc[r][g] = dp(acc[r][g], wv[g], x);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < 6; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) _mm512_store_ps(accb + (r * 4 + g) * 16, acc[r][g]);
}

int main(int argc, char** argv) {
  const int64_t KP = 1024, chunks = 11, K = 2 * KP;
  const int ntiles = 64;   // distinct tiles (cold-ish: 16 MB > L2)
  uint16_t* W = (uint16_t*)aligned_alloc(64, size_t(ntiles) * 4 * KP * 32 * 2);
  uint16_t* A = (uint16_t*)aligned_alloc(64, size_t(chunks) * 6 * K * 2);
  float* accb = (float*)aligned_alloc(64, size_t(chunks) * 24 * 16 * 4);
  for (int64_t i = 0; i < int64_t(ntiles) * 4 * KP * 32; ++i) W[i] = 0x3f80;
  for (int64_t i = 0; i < chunks * 6 * K; ++i) A[i] = 0x3f80;
  std::memset(accb, 0, size_t(chunks) * 24 * 16 * 4);
  const int64_t kcs[] = {1024, 512, 256, 128, 64};
  double best[5];
  for (double& b : best) b = 1e9;
  for (int rep = 0; rep < 7; ++rep) {
    for (int v = 0; v < 5; ++v) {
      const int64_t KC = kcs[v];
      auto t0 = std::chrono::steady_clock::now();
      for (int t = 0; t < ntiles; ++t) {
        const uint16_t* w = W + int64_t(t) * 4 * KP * 32;
        for (int64_t k0 = 0; k0 < KP; k0 += KC)
          for (int c = 0; c < chunks; ++c) chunk(w, KP * 32, A + c * 6 * K, K, k0, k0 + KC, accb + c * 24 * 16);
      }
      const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
                        (double(ntiles) * chunks * KP * 24);
      best[v] = ns < best[v] ? ns : best[v];
    }
  }
  for (int v = 0; v < 5; ++v)
    std::printf("KC = %4ld pairs (weights %4ld KB per block): %.4f ns per vdpbf16ps\n", long(kcs[v]), long(kcs[v] * 256 / 1024), best[v]);
  sink = accb[5];
}
