// permute / unpermute: regroup routed token rows by expert, and combine them back (SPEC 2).
//
// permute is a stable counting sort of the R = T*K routed rows by local expert:
//   1. permute_plan (serial, O(R + E)): validate the ids and the expert_map, histogram of
//      the local expert of every row, prefix sum over experts with each segment rounded up
//      to `align`, then a scatter in increasing r (so each segment lists its rows in
//      increasing r: the layout is a pure function of the inputs, identical to the
//      reference and independent of the thread count), and -1 for padding / unused slots.
//   2. permute_rows (parallel over destination rows): row p copies input row src_row[p]/K
//      with 64-byte (AVX-512) / 32-byte (AVX2) moves, or the libc fast-string copy for rows
//      of 4 KB and more (see copy_bytes), or is zero-filled when src_row[p] < 0.
// The index work is a few ns per row; the row copies are the cost.
//
// unpermute, per token (parallel over tokens), per chunk of H held in registers:
//   acc = +0; for j ascending with p = dst_pos[t*K+j] >= 0: acc = acc + w[t,j] * f32(row p)
//   out[t] = round_to_dtype(acc)   (bf16/f16: round to nearest even)
// The product is rounded to f32 and then added (two roundings, NO fused multiply-add),
// exactly what the reference's `acc + weights[:, j] * expert_out[p].float()` does in
// separate torch ops, so the result is bit-identical to the reference. An empty asm
// barrier on the product (no_contract) keeps the compiler from contracting mul+add into an
// FMA whatever -ffp-contract says (without it GCC does fuse them at the AVX2/AVX-512 levels,
// and the bitwise tests fail). Starting from +0 (not from the first term) matches the
// reference too: +0 + (-0) = +0.
//
// Floors (2 cores here, ~30-55 GB/s DRAM read; no flops in permute):
//   permute:   bytes >= T*H*es (read, each token row once; the K re-reads hit cache) +
//              capacity*H*es (write) + ~12*T*K (indices). E=64, K=8, H=4096 bf16: T=8 writes
//              512 KB (L2-resident: ~4 us at the ~130 GB/s one core's memcpy reaches), T=64
//              4 MB (L3: ~46 us on one core, 90 GB/s), T=512 32 MB (~0.7 ms on one core at
//              47 GB/s; two cores share the DRAM bandwidth). The kernel runs at memcpy speed;
//              what is left above the floor at small T is the fixed cost of a call.
//   unpermute: bytes >= T*K*H*es (read) + T*H*es (write); flops = 2*T*K*H (negligible:
//              bandwidth-bound by ~2 orders of magnitude).
#include "permute.h"  // declarations (and the status codes), before the ISA pragma

#include "isa_begin.h"

namespace moelab::cpu::MOELAB_ISA_NS {
namespace {

// ------------------------------------------------------------------ wide row moves
// Rows of 4 KB and more go to memcpy / memset: glibc picks the CPU's fast-string path
// (rep movsb / stosb with ERMS/FSRM), which writes whole cache lines without reading them
// first, where the 64-byte vector loop reads each destination line before writing it; at 2 KB
// rows and below the loop is as fast or faster (no call or startup cost). docs/permute.md,
// "Design alternatives".
constexpr int64_t kLibcMinBytes = 4096;

inline void copy_bytes(char* dst, const char* src, int64_t n) {
  if (n >= kLibcMinBytes) {
    std::memcpy(dst, src, size_t(n));
    return;
  }
#if MOELAB_ISA_LEVEL >= 2
  int64_t i = 0;
  for (; i + 256 <= n; i += 256) {
    __m512i a = _mm512_loadu_si512(src + i), b = _mm512_loadu_si512(src + i + 64);
    __m512i c = _mm512_loadu_si512(src + i + 128), d = _mm512_loadu_si512(src + i + 192);
    _mm512_storeu_si512(dst + i, a);
    _mm512_storeu_si512(dst + i + 64, b);
    _mm512_storeu_si512(dst + i + 128, c);
    _mm512_storeu_si512(dst + i + 192, d);
  }
  for (; i + 64 <= n; i += 64) _mm512_storeu_si512(dst + i, _mm512_loadu_si512(src + i));
  if (i < n) {
    __mmask64 m = _bzhi_u64(~0ull, unsigned(n - i));
    _mm512_mask_storeu_epi8(dst + i, m, _mm512_maskz_loadu_epi8(m, src + i));
  }
#elif MOELAB_ISA_LEVEL == 1
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256((const __m256i*)(src + i));
    __m256i b = _mm256_loadu_si256((const __m256i*)(src + i + 32));
    __m256i c = _mm256_loadu_si256((const __m256i*)(src + i + 64));
    __m256i d = _mm256_loadu_si256((const __m256i*)(src + i + 96));
    _mm256_storeu_si256((__m256i*)(dst + i), a);
    _mm256_storeu_si256((__m256i*)(dst + i + 32), b);
    _mm256_storeu_si256((__m256i*)(dst + i + 64), c);
    _mm256_storeu_si256((__m256i*)(dst + i + 96), d);
  }
  for (; i + 32 <= n; i += 32)
    _mm256_storeu_si256((__m256i*)(dst + i), _mm256_loadu_si256((const __m256i*)(src + i)));
  if (i < n) std::memcpy(dst + i, src + i, size_t(n - i));
#else
  if (n > 0) std::memcpy(dst, src, size_t(n));
#endif
}

inline void zero_bytes(char* dst, int64_t n) {
  if (n >= kLibcMinBytes) {
    std::memset(dst, 0, size_t(n));
    return;
  }
#if MOELAB_ISA_LEVEL >= 2
  const __m512i z = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 256 <= n; i += 256) {
    _mm512_storeu_si512(dst + i, z);
    _mm512_storeu_si512(dst + i + 64, z);
    _mm512_storeu_si512(dst + i + 128, z);
    _mm512_storeu_si512(dst + i + 192, z);
  }
  for (; i + 64 <= n; i += 64) _mm512_storeu_si512(dst + i, z);
  if (i < n) _mm512_mask_storeu_epi8(dst + i, _bzhi_u64(~0ull, unsigned(n - i)), z);
#elif MOELAB_ISA_LEVEL == 1
  const __m256i z = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) _mm256_storeu_si256((__m256i*)(dst + i), z);
  if (i < n) std::memset(dst + i, 0, size_t(n - i));
#else
  if (n > 0) std::memset(dst, 0, size_t(n));
#endif
}

// ---------------------------------------------------------------- unpermute helpers
// Hides the product from the optimizer so `acc + prod` is never contracted into an FMA.
inline vf no_contract(vf a) {
#if MOELAB_ISA_LEVEL >= 2
  __asm__("" : "+v"(a.v));
#elif MOELAB_ISA_NEON
  __asm__("" : "+w"(a.v));
#else
  __asm__("" : "+x"(a.v));
#endif
  return a;
}


// f32 -> f16 stores, round to nearest even (vec.h has bf16 only).
inline void vstore_f16(uint16_t* p, vf a, int n) {
#if MOELAB_ISA_LEVEL >= 2
  __m256i h = _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_mask_storeu_epi16(p, tail_mask(n), h);
#elif MOELAB_ISA_LEVEL == 1
  __m128i h = _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (n >= 8) {
    _mm_storeu_si128((__m128i*)p, h);
  } else {
    alignas(16) uint16_t t[8];
    _mm_store_si128((__m128i*)t, h);
    for (int i = 0; i < n; ++i) p[i] = t[i];
  }
#elif MOELAB_ISA_NEON
  const uint16x4_t h = vreinterpret_u16_f16(vcvt_f16_f32(a.v));   // RNE: FPCR's default mode
  if (n >= 4) {
    vst1_u16(p, h);
  } else {
    alignas(8) uint16_t t[4];
    vst1_u16(t, h);
    for (int i = 0; i < n; ++i) p[i] = t[i];
  }
#else
  if (n > 0) *p = f32_to_f16(a.v);
#endif
}

template <Fmt F> inline void store_out(void* p, int64_t i, vf a, int n) {
  if constexpr (F == Fmt::kF32) vstore(static_cast<float*>(p) + i, a, n);
  else if constexpr (F == Fmt::kBF16) vstore_bf16(static_cast<uint16_t*>(p) + i, a, n);
  else vstore_f16(static_cast<uint16_t*>(p) + i, a, n);
}

// NV vectors of one token's output starting at column h (n valid elements in the last one
// when TAIL). Each element's sum runs over j ascending: the chunking never changes the order.
template <Fmt F, int NV, bool TAIL>
inline void token_chunk(const char* base, int64_t ld_bytes, const float* w, int64_t ldw_k,
                        const int32_t* pos, int64_t K, void* out, int64_t h, int n) {
  vf acc[NV];
  for (int u = 0; u < NV; ++u) acc[u] = vzero();
  for (int64_t j = 0; j < K; ++j) {
    const int64_t p = pos[j];
    if (p < 0) continue;
    const vf wv = vset1(w[j * ldw_k]);
    const char* row = base + p * ld_bytes;
    for (int u = 0; u < NV; ++u) {
      vf x = TAIL ? vload_as<F>(row, h + u * kVecF, n) : vload_as<F>(row, h + u * kVecF);
      acc[u] = vadd(acc[u], no_contract(vmul(wv, x)));
    }
  }
  for (int u = 0; u < NV; ++u) store_out<F>(out, h + u * kVecF, acc[u], TAIL ? n : kVecF);
}

template <Fmt F>
void unpermute_run(const void* expert_out, int64_t ld, const float* w, int64_t ldw_t,
                   int64_t ldw_k, const int32_t* dst_pos, int64_t K, int64_t H, void* out,
                   int64_t t0, int64_t t1) {
  constexpr int64_t es = F == Fmt::kF32 ? 4 : 2;
  const char* base = static_cast<const char*>(expert_out);
  for (int64_t t = t0; t < t1; ++t) {
    const int32_t* pos = dst_pos + t * K;
    const float* wt = w + t * ldw_t;
    char* o = static_cast<char*>(out) + t * H * es;
    int64_t h = 0;
    for (; h + 4 * kVecF <= H; h += 4 * kVecF)
      token_chunk<F, 4, false>(base, ld * es, wt, ldw_k, pos, K, o, h, kVecF);
    for (; h + kVecF <= H; h += kVecF)
      token_chunk<F, 1, false>(base, ld * es, wt, ldw_k, pos, K, o, h, kVecF);
    if (h < H) token_chunk<F, 1, true>(base, ld * es, wt, ldw_k, pos, K, o, h, int(H - h));
  }
}

template <bool I64>
inline int64_t id_at(const void* ids, int64_t i) {
  if constexpr (I64) return static_cast<const int64_t*>(ids)[i];
  else return static_cast<const int32_t*>(ids)[i];
}

template <bool I64>
int plan(const void* ids, int64_t T, int64_t K, int64_t ld_t, int64_t ld_k, const int32_t* map,
         int64_t ms, int64_t n_experts, int64_t n_local, int64_t align, int64_t* counts,
         int64_t* offsets, int32_t* src_row, int64_t capacity, int32_t* dst_pos, int64_t* bad) {
  if (map) {
    for (int64_t g = 0; g < n_experts; ++g) {
      const int64_t v = map[g * ms];
      if (v < -1 || v >= n_local) { *bad = v; return kPermuteBadMap; }
    }
  }
  // 1. Histogram of local experts (validating every id on the way).
  for (int64_t e = 0; e < n_local; ++e) counts[e] = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t g = id_at<I64>(ids, t * ld_t + j * ld_k);
      if (g < -1 || g >= n_experts) { *bad = g; return kPermuteBadId; }
      const int64_t e = g < 0 ? -1 : map ? map[g * ms] : g;
      if (e >= 0) ++counts[e];
    }
  }
  // 2. Segment starts, each segment padded to a multiple of align; counts become cursors.
  int64_t off = 0;
  for (int64_t e = 0; e < n_local; ++e) {
    const int64_t n = counts[e];
    offsets[e] = off;
    counts[e] = off;
    off += (n + align - 1) / align * align;
  }
  offsets[n_local] = off;
  if (off > capacity) return kPermuteInternal;
  // 3. Stable scatter in increasing r. The ids were validated above; the checks here only
  //    guard against them changing in between (memory shared with an output).
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t r = t * K + j;
      const int64_t g = id_at<I64>(ids, t * ld_t + j * ld_k);
      const int64_t e = (g < 0 || g >= n_experts) ? -1 : map ? map[g * ms] : g;
      if (e < 0 || e >= n_local) {
        dst_pos[r] = -1;
        continue;
      }
      const int64_t p = counts[e]++;
      if (p >= offsets[e + 1]) return kPermuteInternal;
      src_row[p] = int32_t(r);
      dst_pos[r] = int32_t(p);
    }
  }
  // 4. Padding at each segment's end and the unused tail: -1.
  for (int64_t e = 0; e < n_local; ++e)
    for (int64_t p = counts[e]; p < offsets[e + 1]; ++p) src_row[p] = -1;
  for (int64_t p = off; p < capacity; ++p) src_row[p] = -1;
  return kPermuteOk;
}

}  // namespace

int permute_plan(const void* ids, bool ids_int64, int64_t T, int64_t K, int64_t ld_t, int64_t ld_k,
                 const int32_t* expert_map, int64_t map_stride, int64_t n_experts, int64_t n_local,
                 int64_t align, int64_t* counts, int64_t* offsets, int32_t* src_row,
                 int64_t capacity, int32_t* dst_pos, int64_t* bad) {
  return ids_int64 ? plan<true>(ids, T, K, ld_t, ld_k, expert_map, map_stride, n_experts, n_local,
                                align, counts, offsets, src_row, capacity, dst_pos, bad)
                   : plan<false>(ids, T, K, ld_t, ld_k, expert_map, map_stride, n_experts, n_local,
                                 align, counts, offsets, src_row, capacity, dst_pos, bad);
}

void permute_rows(const void* hidden, int64_t ld_bytes, void* out, int64_t row_bytes,
                  const int32_t* src_row, int64_t K, int64_t p0, int64_t p1) {
  const char* in = static_cast<const char*>(hidden);
  char* o = static_cast<char*>(out);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t r = src_row[p];
    if (r >= 0) copy_bytes(o + p * row_bytes, in + (r / K) * ld_bytes, row_bytes);
    else zero_bytes(o + p * row_bytes, row_bytes);
  }
}

void unpermute_tokens(const void* expert_out, Fmt fmt, int64_t ld, const float* w, int64_t ldw_t,
                      int64_t ldw_k, const int32_t* dst_pos, int64_t K, int64_t H, void* out,
                      int64_t t0, int64_t t1) {
  switch (fmt) {
    case Fmt::kF32: unpermute_run<Fmt::kF32>(expert_out, ld, w, ldw_t, ldw_k, dst_pos, K, H, out, t0, t1); break;
    case Fmt::kBF16: unpermute_run<Fmt::kBF16>(expert_out, ld, w, ldw_t, ldw_k, dst_pos, K, H, out, t0, t1); break;
    case Fmt::kF16: unpermute_run<Fmt::kF16>(expert_out, ld, w, ldw_t, ldw_k, dst_pos, K, H, out, t0, t1); break;
  }
}

}  // namespace moelab::cpu::MOELAB_ISA_NS
