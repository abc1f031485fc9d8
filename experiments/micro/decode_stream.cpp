// bf16 decode on one core (or on `threads` cores, each its contiguous share of the tiles, as the
// kernel's bands): micro_buf's loop for a chunk of R = 1..3 rows (4 weight loads, R
// broadcasts, 4R vdpbf16ps per k pair) over cold packed bf16 tiles (64 columns x K: 4 groups of
// 16 columns, 768 MB in transparent huge pages, as prepack_moe_weights advises them), against
// pure reads of the same bytes, side by side. Variants (GB/s = tile bytes / time of one pass):
//   read1       one sequential stream, 64-byte loads XORed (the read probe's access)
//   read4       group-major order, loads only: per k pair one line of each of the 4 groups
//   read4+8dp   read4 plus 8 vdpbf16ps per k pair that do not depend on the loads
//   kern        group-major tile (4 streams K*32 bytes apart), the next tile prefetched
//               (prefetcht1) one line per k pair, as the kernel did for a single chunk of rows
//   kern-nopf   the same without the next-tile prefetch
//   kern+L2:48  kern-nopf plus prefetcht1 of each group stream 48 lines ahead
//   tmaj        tile-major tile ([K/2][4 groups][16 x 2]: one stream, 256 bytes per k pair)
//   tmaj+next   tmaj with the next-tile prefetch of kern
//   tmaj+L2:D   tmaj with a prefetcht1 of its own stream D lines ahead (4 lines per k pair)
// Interleaved rounds, the order rotating, median (min..max) over rounds.
//   python -m experiments.micro decode_stream   (compiles with g++ -march=native, runs, saves)
//   arguments: R rounds K [threads]   (R rows, K = 2048: OLMoE's GEMM1, 1024: its GEMM2;
//                                              threads: 1 by default)
// Results: experiments/results/<machine>/decode_stream.txt
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

static int64_t KP = 1024;                    // k pairs (K = 2048; argv[3] sets K)
static int64_t kGroupBytes = KP * 64;        // one group of 16 columns
static int64_t kTileBytes = 4 * kGroupBytes; // 256 KB
static volatile float sink;
static volatile int64_t isink;

static inline __m512 dp(__m512 a, __m512i w, __m512i x) { return _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)x); }

enum Pf { kNone, kNext, kL2 };

// One tile, R rows; group g of the tile at t + g * gs, pair kk at + kk * ks (bytes).
template <int R>
__attribute__((noinline)) void tile(const char* t, int64_t gs, int64_t ks, const uint16_t* a, int64_t lda,
                                    const char* next, Pf pf, int dist, float* out) {
  __m512 acc[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
  const char* np = next;
  for (int64_t kk = 0; kk < KP; ++kk) {
    const char* bk = t + kk * ks;
    if (pf == kNext) { _mm_prefetch(np, _MM_HINT_T1); np += 64; }
    else if (pf == kL2) { for (int g = 0; g < 4; ++g) _mm_prefetch(bk + g * gs + dist * 64, _MM_HINT_T1); }
    __m512i w[4];
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) w[g] = _mm512_load_si512(bk + g * gs);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      uint32_t xv;
      std::memcpy(&xv, a + r * lda + 2 * kk, 4);
      const __m512i x = _mm512_set1_epi32(int(xv));
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) acc[r][g] = dp(acc[r][g], w[g], x);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) _mm512_store_ps(out + (r * 4 + g) * 16, acc[r][g]);
}

__attribute__((noinline)) int64_t read4(const char* t) {
  __m512i s = _mm512_setzero_si512();
  for (int64_t kk = 0; kk < KP; ++kk)
    for (int g = 0; g < 4; ++g) s = _mm512_xor_si512(s, _mm512_load_si512(t + g * kGroupBytes + kk * 64));
  return _mm512_reduce_or_epi64(s);
}

__attribute__((noinline)) int64_t read1(const char* p, int64_t n) {
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t i = 0; i < n; i += 256) {
    s0 = _mm512_xor_si512(s0, _mm512_load_si512(p + i));
    s1 = _mm512_xor_si512(s1, _mm512_load_si512(p + i + 64));
    s2 = _mm512_xor_si512(s2, _mm512_load_si512(p + i + 128));
    s3 = _mm512_xor_si512(s3, _mm512_load_si512(p + i + 192));
  }
  return _mm512_reduce_or_epi64(_mm512_or_si512(_mm512_or_si512(s0, s1), _mm512_or_si512(s2, s3)));
}

// read4 plus n independent vdpbf16ps chains per k pair that do not depend on the loads.
template <int N>
__attribute__((noinline)) int64_t read4_dp(const char* t, float* out) {
  __m512i s = _mm512_setzero_si512();
  __m512 acc[N];
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i c = _mm512_set1_epi32(0x3c003c00);
  for (int64_t kk = 0; kk < KP; ++kk) {
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) s = _mm512_xor_si512(s, _mm512_load_si512(t + g * kGroupBytes + kk * 64));
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) acc[i] = dp(acc[i], c, c);
  }
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) _mm512_store_ps(out + i * 16, acc[i]);
  return _mm512_reduce_or_epi64(s);
}

int main(int argc, char** argv) {
  const int R = argc > 1 ? std::atoi(argv[1]) : 2;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  if (argc > 3) { KP = std::atoi(argv[3]) / 2; kGroupBytes = KP * 64; kTileBytes = 4 * kGroupBytes; }
  const int nt = argc > 4 ? std::atoi(argv[4]) : 1;
  const int64_t ntiles = (int64_t(768) << 20) / kTileBytes;   // 768 MB
  const int64_t bytes = ntiles * kTileBytes;
  char* W = (char*)aligned_alloc(1 << 21, bytes);
  madvise(W, bytes, MADV_HUGEPAGE);
  for (int64_t i = 0; i < bytes; i += 2) *(uint16_t*)(W + i) = 0x3f80 ^ (i & 0x7);
  const int64_t K = 2 * KP, lda = K;
  uint16_t* A = (uint16_t*)aligned_alloc(64, 3 * K * 2);
  for (int64_t i = 0; i < 3 * K; ++i) A[i] = 0x3c00;
  alignas(64) static float outs[8][3 * 4 * 16];
  float* out = outs[0];

  // Thread t of nt takes tiles [t * ntiles / nt, (t + 1) * ntiles / nt): one contiguous band each.
  auto kern = [&](Pf pf, int dist, bool tmaj) {
#pragma omp parallel num_threads(nt)
    {
      const int t = omp_get_thread_num();
      float* o = outs[t % 8];
      for (int64_t i = t * ntiles / nt; i < (t + 1) * ntiles / nt; ++i) {
        const char* tp = W + i * kTileBytes;
        const char* nx = i + 1 < ntiles ? tp + kTileBytes : tp;
        const int64_t gs = tmaj ? 64 : kGroupBytes, ks = tmaj ? 256 : 64;
        if (R == 1) tile<1>(tp, gs, ks, A, lda, nx, pf, dist, o);
        else if (R == 2) tile<2>(tp, gs, ks, A, lda, nx, pf, dist, o);
        else tile<3>(tp, gs, ks, A, lda, nx, pf, dist, o);
      }
    }
    sink = out[0];
  };
  auto read1_all = [&] {
    int64_t s = 0;
#pragma omp parallel num_threads(nt) reduction(| : s)
    {
      const int t = omp_get_thread_num();
      const int64_t a = t * ntiles / nt * kTileBytes, b = (t + 1) * ntiles / nt * kTileBytes;
      s |= read1(W + a, b - a);
    }
    isink = s;
  };
  std::vector<std::pair<std::string, std::function<void()>>> v = {
      {"read1", read1_all},
      {"read4", [&] { int64_t s = 0; for (int64_t i = 0; i < ntiles; ++i) s |= read4(W + i * kTileBytes); isink = s; }},
      {"read4+8dp", [&] { int64_t s = 0; for (int64_t i = 0; i < ntiles; ++i) s |= read4_dp<8>(W + i * kTileBytes, out); isink = s; }},
      {"kern", [&] { kern(kNext, 0, false); }},
      {"kern-nopf", [&] { kern(kNone, 0, false); }},
      {"kern+L2:48", [&] { kern(kL2, 48, false); }},
      {"tmaj", [&] { kern(kNone, 0, true); }},
      {"tmaj+next", [&] { kern(kNext, 0, true); }},
      {"tmaj+L2:16", [&] { kern(kL2, 16, true); }},
      {"tmaj+L2:64", [&] { kern(kL2, 64, true); }},
  };
  if (nt > 1)   // the one-core variants (read4, read4+8dp) stay one thread: leave them out
    v.erase(std::remove_if(v.begin(), v.end(), [](auto& e) { return e.first.rfind("read4", 0) == 0; }), v.end());
  std::vector<std::vector<double>> gbs(v.size());
  for (int rd = 0; rd < rounds; ++rd)
    for (size_t j = 0; j < v.size(); ++j) {
      const size_t i = (j + rd) % v.size();
      auto t0 = std::chrono::steady_clock::now();
      v[i].second();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      gbs[i].push_back(bytes / s / 1e9);
    }
  std::printf("R=%d rows, %lld tiles of %lld KB (%lld MB), %d thread(s), %d rounds: GB/s median (min..max)\n", R,
              (long long)ntiles, (long long)(kTileBytes >> 10), (long long)(bytes >> 20), nt, rounds);
  for (size_t i = 0; i < v.size(); ++i) {
    auto g = gbs[i];
    std::sort(g.begin(), g.end());
    std::printf("  %-12s %6.1f GB/s (%.1f..%.1f)\n", v[i].first.c_str(), g[g.size() / 2], g.front(), g.back());
  }
  return 0;
}
