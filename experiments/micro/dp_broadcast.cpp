// How much a broadcast costs beside vdpbf16ps on this machine: 24 independent accumulators
// per iteration (a 6-row x 4-vector register block), with the activation pairs broadcast
// 6 times per 24 dps (micro_buf's loop), loaded pre-broadcast (6 full-vector loads), or
// broadcast once per dp (24 per 24 dps: what the blocked mxfp4 path's first chunk did until micro_tee).
// Best of 30 rounds of 200000 iterations, ns per vdpbf16ps, one core.
//   python -m experiments.micro dp_broadcast   (compiles with g++ -march=native, runs, saves)
// Results: experiments/results/<machine>/dp_broadcast.txt
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

alignas(64) uint32_t xs[8192];
volatile float sink;

template <int MODE>
__attribute__((noinline)) double run(int N) {
  __m512 a[24];
  for (int j = 0; j < 24; ++j) a[j] = _mm512_setzero_ps();
  const __m512i w[4] = {_mm512_set1_epi32(0x3f803f80), _mm512_set1_epi32(0x3f803f81),
                        _mm512_set1_epi32(0x3f803f82), _mm512_set1_epi32(0x3f803f83)};
  auto t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < N; ++it) {
    const uint32_t* p = xs + 96 * (it & 63);
    if constexpr (MODE == 0) {   // dps only (registers)
#pragma GCC unroll 24
      for (int j = 0; j < 24; ++j) a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)w[j & 3], (__m512bh)w[(j + 1) & 3]);
    } else if constexpr (MODE == 1 || MODE == 2) {   // 6 broadcasts / 6 pre-broadcast loads
#pragma GCC unroll 6
      for (int r = 0; r < 6; ++r) {
        const __m512i x = MODE == 1 ? _mm512_set1_epi32(int(p[r])) : _mm512_load_si512(p + 16 * r);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) a[4 * r + g] = _mm512_dpbf16_ps(a[4 * r + g], (__m512bh)w[g], (__m512bh)x);
      }
    } else {   // one broadcast per dp
#pragma GCC unroll 24
      for (int j = 0; j < 24; ++j) {
        __m512i x = _mm512_set1_epi32(int(p[j]));
        __asm__ volatile("" : "+v"(x));   // not shared between dps
        a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)w[0], (__m512bh)x);
      }
    }
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / (N * 24.0);
  float s = 0;
  for (int j = 0; j < 24; ++j) s += _mm512_reduce_add_ps(a[j]);
  sink = s;
  return ns;
}

int main() {
  for (int i = 0; i < 8192; ++i) xs[i] = 0x3f803f80u;
  const char* names[] = {"24 dp, registers only", "24 dp + 6 vpbroadcastd", "24 dp + 6 pre-broadcast loads",
                         "24 dp + 24 vpbroadcastd"};
  double best[4] = {1e9, 1e9, 1e9, 1e9};
  for (int rep = 0; rep < 30; ++rep) {
    const double t[4] = {run<0>(200000), run<1>(200000), run<2>(200000), run<3>(200000)};
    for (int m = 0; m < 4; ++m) best[m] = t[m] < best[m] ? t[m] : best[m];
  }
  for (int m = 0; m < 4; ++m) std::printf("%-32s %.3f ns per dp (%.2fx the registers-only time)\n", names[m], best[m], best[m] / best[0]);
}
