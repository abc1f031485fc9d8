// The compute floor of the bf16 GEMMs on one core: how many vdpbf16ps (16 lanes x 2 products,
// 64 flops) and, for comparison, 512-bit f32 FMAs (32 flops) and 256-bit ones (16 flops: the
// avx2 level's FMA) one core retires per second when nothing else limits it: C independent accumulator chains (C = 12 and 16; the blocked micro-
// kernel keeps 24, which here GCC would not keep in registers), operands in registers, no
// memory traffic.
//
//   python -m experiments.micro dpbf16_peak   (compiles with g++ -march=native, runs, saves)
//   (needs AVX512-BF16; output: experiments/results/<machine>/dpbf16_peak.txt)
//
// Each figure is the best of 200 runs of 20000 iterations (about 0.1-0.3 ms each, so a run that
// the scheduler interrupts is simply not the best one), 5 rounds. GFLOP/s = instructions/s x
// flops per instruction; the prefill rows of the bench divide their flops by this.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace {

template <int C>
__attribute__((noinline)) float dp(long n, __m512i w, __m512i x) {
  __m512 a[C];
  for (int i = 0; i < C; ++i) a[i] = _mm512_set1_ps(float(i));
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 16   // the accumulators stay in registers (rolled, -O2 keeps them in memory)
    for (int i = 0; i < C; ++i) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)w, (__m512bh)x);
    asm volatile("" : "+v"(w));   // keep the loop from being folded
  }
  float s = 0;
  for (int i = 0; i < C; ++i) s += _mm512_reduce_add_ps(a[i]);
  return s;
}

template <int C>
__attribute__((noinline)) float fma(long n, __m512 w, __m512 x) {
  __m512 a[C];
  for (int i = 0; i < C; ++i) a[i] = _mm512_set1_ps(float(i));
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 16   // the accumulators stay in registers (rolled, -O2 keeps them in memory)
    for (int i = 0; i < C; ++i) a[i] = _mm512_fmadd_ps(a[i], w, x);
    asm volatile("" : "+v"(w));
  }
  float s = 0;
  for (int i = 0; i < C; ++i) s += _mm512_reduce_add_ps(a[i]);
  return s;
}

template <int C>
__attribute__((noinline)) float fma256(long n, __m256 w, __m256 x) {
  __m256 a[C];
  for (int i = 0; i < C; ++i) a[i] = _mm256_set1_ps(float(i));
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 16   // the accumulators stay in registers (rolled, -O2 keeps them in memory)
    for (int i = 0; i < C; ++i) a[i] = _mm256_fmadd_ps(a[i], w, x);
    asm volatile("" : "+x"(w));
  }
  alignas(32) float t[8];
  float s = 0;
  for (int i = 0; i < C; ++i) {
    _mm256_store_ps(t, a[i]);
    for (float v : t) s += v;
  }
  return s;
}

template <class F>
double best_ns_per_op(F f, long n, int chains, float* sink) {
  double best = 1e30;
  for (int r = 0; r < 200; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    *sink += f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best / double(n) / chains * 1e9;
}

}  // namespace

int main() {
  const long n = 20000;
  const __m512i w = _mm512_set1_epi16(0x3f80), x = _mm512_set1_epi16(0);   // 1.0 x 0: no growth
  const __m512 wf = _mm512_set1_ps(1.0f), xf = _mm512_set1_ps(0.0f);
  float sink = 0;
  std::printf("ns per instruction (best of 200 runs of %ld iterations), one core; GFLOP/s\n", n);
  for (int round = 0; round < 5; ++round) {
    const double d12 = best_ns_per_op([&] { return dp<12>(n, w, x); }, n, 12, &sink);
    const double d16 = best_ns_per_op([&] { return dp<16>(n, w, x); }, n, 16, &sink);
    const double f12 = best_ns_per_op([&] { return fma<12>(n, wf, xf); }, n, 12, &sink);
    const double y12 = best_ns_per_op([&] { return fma256<12>(n, _mm512_castps512_ps256(wf), _mm512_castps512_ps256(xf)); },
                                      n, 12, &sink);
    std::printf("round %d  vdpbf16ps x12 %.3f ns (%.1f GFLOP/s)  x16 %.3f ns (%.1f GFLOP/s)  vfmadd x12 %.3f ns (%.1f GFLOP/s)"
                "  vfmadd ymm x12 %.3f ns (%.1f GFLOP/s)\n",
                round, d12, 64 / d12, d16, 64 / d16, f12, 32 / f12, y12, 16 / y12);
  }
  std::printf("(sink %g)\n", sink);
  return 0;
}
