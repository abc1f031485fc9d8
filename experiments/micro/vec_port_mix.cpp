// Throughput of the zmm instructions in fused_experts' fp8 decode and dot product, alone and
// in pairs, on one core: 24 independent chains, so latency does not limit; "cycles per
// instr" is time per instruction over one cycle of a dependent vpaddd chain (the clock).
//
//   python -m experiments.micro vec_port_mix   (compiles with g++ -march=native, runs, saves)
//   (needs AVX512-BF16 and VBMI; output: experiments/results/<machine>/vec_port_mix.txt)
//
// What it is for: Fp8PairDec decodes 64 weights with vpermb + 2 vpermi2b + vpternlogd + 2
// vpunpck{l,h}bw and feeds them to vdpbf16ps (fused_experts_kernel.h); how many of those a
// cycle holds, and which of them share a pipe, bounds the decode rate per core.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define N 100000000L
volatile int sink;
template <class F> double bench(F f) { auto t0 = std::chrono::steady_clock::now(); f(); return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / N; }
#define R12(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
template <class F, class G> void mix(const char* name, F f, G g, double cyc) {
  double t = bench([&] {
    __m512i x0=_mm512_set1_epi32(1),x1=x0,x2=x0,x3=x0,x4=x0,x5=x0,x6=x0,x7=x0,x8=x0,x9=x0,x10=x0,x11=x0;
    __m512i y0=x0,y1=x0,y2=x0,y3=x0,y4=x0,y5=x0,y6=x0,y7=x0,y8=x0,y9=x0,y10=x0,y11=x0;
    for (long i = 0; i < N / 24; ++i) {
#define S(k) x##k = f(x##k); y##k = g(y##k);
      R12(S)
      asm volatile("" : "+v"(x0),"+v"(x1),"+v"(x2),"+v"(x3),"+v"(x4),"+v"(x5),"+v"(x6),"+v"(x7),"+v"(x8),"+v"(x9),"+v"(x10),"+v"(x11));
      asm volatile("" : "+v"(y0),"+v"(y1),"+v"(y2),"+v"(y3),"+v"(y4),"+v"(y5),"+v"(y6),"+v"(y7),"+v"(y8),"+v"(y9),"+v"(y10),"+v"(y11));
    }
#define X(k) x0 = _mm512_xor_si512(x0, _mm512_xor_si512(x##k, y##k));
    R12(X)
    sink = _mm512_reduce_add_epi32(x0);
  });
  printf("%-22s %.2f cycles per instr (24 chains)\n", name, t / cyc);
}
int main() {
  __m512i t0 = _mm512_set1_epi8(3), t1 = _mm512_set1_epi8(5);
  double dep = bench([&] { __m512i x = t0; for (long i = 0; i < N; ++i) { x = _mm512_add_epi32(x, t1); asm volatile("" : "+v"(x)); } sink = _mm512_reduce_add_epi32(x); });
  printf("clock %.2f GHz\n", 1 / dep / 1e9);
  auto permb = [&](__m512i x) { return _mm512_permutexvar_epi8(x, t0); };
  auto permi2b = [&](__m512i x) { return _mm512_permutex2var_epi8(t0, x, t1); };
  auto unpck = [&](__m512i x) { return _mm512_unpacklo_epi8(x, t0); };
  auto dp = [&](__m512i x) { return (__m512i)_mm512_dpbf16_ps((__m512)x, (__m512bh)t0, (__m512bh)t1); };
  auto tern = [&](__m512i x) { return _mm512_ternarylogic_epi32(x, t0, t1, 0x78); };
  auto add = [&](__m512i x) { return _mm512_add_epi32(x, t0); };
  mix("permb+permb", permb, permb, dep);
  mix("permi2b+permi2b", permi2b, permi2b, dep);
  mix("unpck+unpck", unpck, unpck, dep);
  mix("dp+dp", dp, dp, dep);
  mix("tern+tern", tern, tern, dep);
  mix("add+add", add, add, dep);
  mix("permb+unpck", permb, unpck, dep);
  mix("permi2b+unpck", permi2b, unpck, dep);
  mix("permb+dp", permb, dp, dep);
  mix("unpck+dp", unpck, dp, dep);
  mix("permi2b+dp", permi2b, dp, dep);
  mix("tern+dp", tern, dp, dep);
  mix("tern+permi2b", tern, permi2b, dep);
}
