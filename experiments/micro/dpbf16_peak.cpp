// The compute floor of the bf16 GEMMs on one core: how many vdpbf16ps (16 lanes x 2 products,
// 64 flops) and, for comparison, 512-bit f32 FMAs (32 flops) and 256-bit ones (16 flops: the
// avx2 level's FMA) one core retires per second when nothing else limits it: C independent
// accumulator chains (C = 12 and 16; the blocked micro-kernel keeps 24, which here GCC would not
// keep in registers), operands in registers, no memory traffic.
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

// C independent chains a[i] = step(a[i], w, x), n times; w goes through an empty asm each
// iteration so the loop cannot be folded. The chains are unrolled so they stay in registers
// (rolled, -O2 keeps them in memory).
template <int C, class A, class V, class Init, class Step, class Sum>
__attribute__((noinline)) float chains(long n, V w, V x, Init init, Step step, Sum sum) {
  A a[C];
  for (int i = 0; i < C; ++i) a[i] = init(float(i));
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < C; ++i) a[i] = step(a[i], w, x);
    asm volatile("" : "+v"(w));
  }
  float s = 0;
  for (int i = 0; i < C; ++i) s += sum(a[i]);
  return s;
}

const auto init512 = [](float v) { return _mm512_set1_ps(v); };
const auto sum512 = [](__m512 a) { return _mm512_reduce_add_ps(a); };

template <int C>
float dp(long n, __m512i w, __m512i x) {
  return chains<C, __m512>(n, w, x, init512,
                           [](__m512 a, __m512i b, __m512i c) { return _mm512_dpbf16_ps(a, (__m512bh)b, (__m512bh)c); },
                           sum512);
}

template <int C>
float fma(long n, __m512 w, __m512 x) {
  return chains<C, __m512>(n, w, x, init512, [](__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }, sum512);
}

template <int C>
float fma256(long n, __m256 w, __m256 x) {
  return chains<C, __m256>(
      n, w, x, [](float v) { return _mm256_set1_ps(v); },
      [](__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); },
      [](__m256 a) {
        alignas(32) float t[8];
        _mm256_store_ps(t, a);
        float s = 0;
        for (float v : t) s += v;
        return s;
      });
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
