// read_stream_bytes (read_stream.h): the byte sum of a buffer, read as S interleaved streams.
//
// Per 64-byte block: AVX-512 one 64-byte load and a vpsadbw against zero (8 partial sums of 8
// bytes each) added into that stream's 8 x u64 accumulator; AVX2 the same with two 32-byte
// loads; scalar a plain byte loop (the portable fallback, not meant to reach the memory
// bandwidth). Two instructions per 64 bytes leave the loads as the only limit: at tens of
// GB/s a core spends ~10 cycles per block waiting for memory. S is a template parameter, so
// the S accumulators stay in registers and the S loads of a step are independent.
#include "read_stream.h"
#include "isa_begin.h"

namespace moelab::cpu::MOELAB_ISA_NS {
namespace {

constexpr int64_t kBlock = 64;
static_assert(kReadStreamMaxStreams == 16, "read_stream_bytes' switch lists 1..16");

#if MOELAB_ISA_LEVEL >= 2
using Acc = __m512i;
inline Acc acc_zero() { return _mm512_setzero_si512(); }
inline Acc acc_block(Acc a, const uint8_t* p) {
  return _mm512_add_epi64(a, _mm512_sad_epu8(_mm512_loadu_si512(reinterpret_cast<const void*>(p)),
                                             _mm512_setzero_si512()));
}
inline uint64_t acc_total(Acc a) { return static_cast<uint64_t>(_mm512_reduce_add_epi64(a)); }
#elif MOELAB_ISA_LEVEL == 1
struct Acc { __m256i lo, hi; };
inline Acc acc_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Acc acc_block(Acc a, const uint8_t* p) {
  const __m256i z = _mm256_setzero_si256();
  a.lo = _mm256_add_epi64(a.lo, _mm256_sad_epu8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), z));
  a.hi = _mm256_add_epi64(a.hi, _mm256_sad_epu8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), z));
  return a;
}
inline uint64_t acc_total(Acc a) {
  alignas(32) uint64_t v[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(v), _mm256_add_epi64(a.lo, a.hi));
  return v[0] + v[1] + v[2] + v[3];
}
#elif MOELAB_ISA_NEON
using Acc = uint64x2_t;   // 64 bytes -> 4 x 16 bytes, pairwise widened 8 -> 16 -> 32 -> 64 bits
inline Acc acc_zero() { return vdupq_n_u64(0); }
inline Acc acc_block(Acc a, const uint8_t* p) {
  uint16x8_t s = vpaddlq_u8(vld1q_u8(p));
  s = vpadalq_u8(s, vld1q_u8(p + 16));
  s = vpadalq_u8(s, vld1q_u8(p + 32));
  s = vpadalq_u8(s, vld1q_u8(p + 48));
  return vpadalq_u32(a, vpaddlq_u16(s));
}
inline uint64_t acc_total(Acc a) { return vgetq_lane_u64(a, 0) + vgetq_lane_u64(a, 1); }
#else
using Acc = uint64_t;
inline Acc acc_zero() { return 0; }
inline Acc acc_block(Acc a, const uint8_t* p) {
  uint64_t s = 0;
  for (int i = 0; i < kBlock; ++i) s += p[i];
  return a + s;
}
inline uint64_t acc_total(Acc a) { return a; }
#endif

// S streams over nblk whole blocks at p: stream s reads blocks [s*L, (s+1)*L), L = nblk / S,
// one block of each stream per step; then the nblk - S*L leftover blocks.
// prefetch > 0: each step also prefetches (into L2) the block `prefetch` blocks ahead in each
// stream, as long as that block is still in the stream.
template <int S>
uint64_t streams_sum(const uint8_t* p, int64_t nblk, int64_t prefetch) {
  const int64_t L = nblk / S;
  Acc acc[S];
  for (int s = 0; s < S; ++s) acc[s] = acc_zero();
  int64_t i = 0;
  if (prefetch > 0) {
    for (; i + prefetch < L; ++i)
      for (int s = 0; s < S; ++s) {
        __builtin_prefetch(p + (s * L + i + prefetch) * kBlock, 0, 2);
        acc[s] = acc_block(acc[s], p + (s * L + i) * kBlock);
      }
  }
  for (; i < L; ++i)
    for (int s = 0; s < S; ++s) acc[s] = acc_block(acc[s], p + (s * L + i) * kBlock);
  for (int64_t b = S * L; b < nblk; ++b) acc[0] = acc_block(acc[0], p + b * kBlock);
  uint64_t total = 0;
  for (int s = 0; s < S; ++s) total += acc_total(acc[s]);
  return total;
}

}  // namespace

uint64_t read_stream_bytes(const uint8_t* p, int64_t nbytes, int streams, int64_t prefetch) {
  if (nbytes <= 0) return 0;
  const int64_t nblk = nbytes / kBlock;
  uint64_t total = 0;
  switch (streams) {
#define MOELAB_RS_CASE(n) \
    case n: total = streams_sum<n>(p, nblk, prefetch); break;
    MOELAB_RS_CASE(1) MOELAB_RS_CASE(2) MOELAB_RS_CASE(3) MOELAB_RS_CASE(4) MOELAB_RS_CASE(5) MOELAB_RS_CASE(6)
    MOELAB_RS_CASE(7) MOELAB_RS_CASE(8) MOELAB_RS_CASE(9) MOELAB_RS_CASE(10) MOELAB_RS_CASE(11) MOELAB_RS_CASE(12)
    MOELAB_RS_CASE(13) MOELAB_RS_CASE(14) MOELAB_RS_CASE(15) MOELAB_RS_CASE(16)
#undef MOELAB_RS_CASE
    default: total = streams_sum<1>(p, nblk, prefetch); break;   // the binding admits 1..16 only
  }
  for (int64_t i = nblk * kBlock; i < nbytes; ++i) total += p[i];   // the tail, < 64 bytes
  return total;
}

}  // namespace moelab::cpu::MOELAB_ISA_NS
