// Two threads streaming the same 96 MB (4 copies in huge pages, rotating): each thread its own
// contiguous half ("halves": the split of our fused_experts' item bands, thread 0 the first
// tiles of every expert, thread 1 the last) against the two threads taking alternate chunks of
// 256 KB, 1 MB or 4 MB (neighbouring addresses at any moment, as an atomic task counter gives).
// The question: does how the two threads divide a decode's weight stream change its read rate?
// Interleaved rounds, median (min..max) GB/s.
//   python -m experiments.micro stream_split 15   (compiles with g++ -march=native, runs, saves)
// Results: experiments/results/<machine>/stream_split.txt
#include <immintrin.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <thread>
#include <vector>
#include <string>
static constexpr size_t kBytes = size_t(96) << 20;
static volatile float sink;
static float sum_range(const char* p, size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 256) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps((const float*)(p + i)));
    a1 = _mm512_add_ps(a1, _mm512_load_ps((const float*)(p + i + 64)));
    a2 = _mm512_add_ps(a2, _mm512_load_ps((const float*)(p + i + 128)));
    a3 = _mm512_add_ps(a3, _mm512_load_ps((const float*)(p + i + 192)));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 9;
  const int ncopies = 4;
  std::vector<char*> bufs;
  for (int c = 0; c < ncopies; ++c) {
    char* b = (char*)aligned_alloc(2 << 20, kBytes);
    madvise(b, kBytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < kBytes; i += 4) *(float*)(b + i) = 1.0f;
    bufs.push_back(b);
  }
  struct M { std::string n; size_t chunk; };  // chunk 0: halves
  std::vector<M> modes = {{"halves", 0}, {"inter256K", 256 << 10}, {"inter1M", 1 << 20}, {"inter4M", 4 << 20}};
  std::vector<std::vector<double>> gbs(modes.size());
  int cc = 0;
  for (int r = 0; r < rounds; ++r)
    for (size_t j = 0; j < modes.size(); ++j) {
      size_t mi = (j + r) % modes.size();
      const char* b = bufs[cc++ % ncopies];
      const size_t ch = modes[mi].chunk;
      float s[2];
      auto work = [&](int t) {
        float acc = 0;
        if (ch == 0) acc = sum_range(b + t * kBytes / 2, kBytes / 2);
        else for (size_t o = t * ch; o < kBytes; o += 2 * ch) acc += sum_range(b + o, ch);
        s[t] = acc;
      };
      auto t0 = std::chrono::steady_clock::now();
      std::thread th(work, 1);
      work(0);
      th.join();
      double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      sink = s[0] + s[1];
      gbs[mi].push_back(kBytes / sec / 1e9);
    }
  for (size_t i = 0; i < modes.size(); ++i) {
    auto v = gbs[i]; std::sort(v.begin(), v.end());
    printf("%-10s %.1f GB/s (%.1f..%.1f)\n", modes[i].n.c_str(), v[v.size() / 2], v[0], v.back());
  }
}
