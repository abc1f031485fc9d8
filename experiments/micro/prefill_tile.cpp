// bf16 prefill on one core: micro_buf's 6 x 4 register block (24 vdpbf16ps per k pair) over one
// packed tile (64 columns x K = 2048, 256 KB) for 11 chunks of rows (an expert block of 64
// rows, OLMoE at T = 512), the tile streamed from L2 by every chunk after the first, in the two
// layouts: group-major (gm: 4 streams K*32 bytes apart) and tile-major (tm: [K/2][4][32], one
// stream, the layout bf16 uses since 2026-12-04), and tm with a software prefetch into L1
// (prefetcht0) of the line D k pairs ahead: 1 line per pair (every 4th line of the stream:
// "tm+L1x1:D") or all 4 ("tm+L1x4:D"). 16 distinct tiles (4 MB) round robin, so each item's
// first chunk reads its tile from L3. Interleaved rounds, median (min..max) ns per vdpbf16ps.
//   python -m experiments.micro prefill_tile   (compiles with g++ -march=native, runs, saves)
// Results: experiments/results/<machine>/prefill_tile.txt
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
static constexpr int kChunks = 11, kTiles = 16, kReps = 32;
static volatile float sink;

static inline __m512 dp(__m512 a, __m512i w, __m512i x) { return _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)x); }

// kTm: tile-major; PF lines prefetched per pair (0, 1 or 4), D pairs ahead.
template <bool kTm, int PF>
__attribute__((noinline)) void chunk(const uint16_t* w, const uint16_t* a, int64_t lda, int D, float* out) {
  constexpr int64_t ks = kTm ? 128 : 32, gs = kTm ? 32 : KP * 32;
  __m512 acc[6][4];
#pragma GCC unroll 6
  for (int r = 0; r < 6; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
  const char* a0 = reinterpret_cast<const char*>(a);
  const char* a3 = a0 + 3 * lda * 2;
  const int64_t ld = lda * 2;
  const uint16_t* bk = w;
  for (int64_t kk = 0; kk < KP; ++kk, a0 += 4, a3 += 4, bk += ks) {
    if constexpr (PF == 1) _mm_prefetch(reinterpret_cast<const char*>(bk + D * ks), _MM_HINT_T0);
    if constexpr (PF == 4) {
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) _mm_prefetch(reinterpret_cast<const char*>(bk + D * ks + g * 32), _MM_HINT_T0);
    }
    __m512i wv[4];
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) wv[g] = _mm512_loadu_si512(bk + g * gs);
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
      const char* ar = r < 3 ? a0 + r * ld : a3 + (r - 3) * ld;
      uint32_t xv;
      std::memcpy(&xv, ar, 4);
      const __m512i x = _mm512_set1_epi32(int(xv));
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) acc[r][g] = dp(acc[r][g], wv[g], x);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < 6; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(out + (r * 4 + g) * 16, acc[r][g]);
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 9;
  const int64_t tile = 4 * KP * 32;   // elements
  uint16_t* W = (uint16_t*)aligned_alloc(64, size_t(kTiles) * tile * 2);
  uint16_t* A = (uint16_t*)aligned_alloc(64, size_t(kChunks) * 6 * K * 2);
  for (int64_t i = 0; i < kTiles * tile; ++i) W[i] = 0x3f80 ^ (i & 7);
  for (int64_t i = 0; i < kChunks * 6 * K; ++i) A[i] = 0x3c00;
  alignas(64) static float out[24 * 16];
  auto run = [&](auto fn) {
    for (int t = 0; t < kTiles * kReps; ++t)
      for (int c = 0; c < kChunks; ++c) fn(W + (t % kTiles) * tile, A + c * 6 * K);
    sink = out[3];
  };
  std::vector<std::pair<std::string, std::function<void()>>> v = {
      {"gm", [&] { run([&](const uint16_t* w, const uint16_t* a) { chunk<false, 0>(w, a, K, 0, out); }); }},
      {"tm", [&] { run([&](const uint16_t* w, const uint16_t* a) { chunk<true, 0>(w, a, K, 0, out); }); }},
      {"tm+L1x1:8", [&] { run([&](const uint16_t* w, const uint16_t* a) { chunk<true, 1>(w, a, K, 8, out); }); }},
      {"tm+L1x1:16", [&] { run([&](const uint16_t* w, const uint16_t* a) { chunk<true, 1>(w, a, K, 16, out); }); }},
      {"tm+L1x4:4", [&] { run([&](const uint16_t* w, const uint16_t* a) { chunk<true, 4>(w, a, K, 4, out); }); }},
      {"tm+L1x4:8", [&] { run([&](const uint16_t* w, const uint16_t* a) { chunk<true, 4>(w, a, K, 8, out); }); }},
  };
  std::vector<std::vector<double>> ns(v.size());
  const double dps = double(kTiles) * kReps * kChunks * KP * 24;
  for (int rd = 0; rd < rounds; ++rd)
    for (size_t j = 0; j < v.size(); ++j) {
      const size_t i = (j + rd) % v.size();
      auto t0 = std::chrono::steady_clock::now();
      v[i].second();
      ns[i].push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / dps);
    }
  std::printf("%d rounds: ns per vdpbf16ps, median (min..max)\n", rounds);
  for (size_t i = 0; i < v.size(); ++i) {
    auto s = ns[i];
    std::sort(s.begin(), s.end());
    std::printf("  %-12s %.4f (%.4f..%.4f)\n", v[i].first.c_str(), s[s.size() / 2], s.front(), s.back());
  }
  return 0;
}
