// fused_experts: the two GEMM passes and the activation of the expert MLPs (SPEC 5).
// Design, layout and costs: docs/fused_experts.md. In short:
//
// A work item is (expert e, tile of 64 output columns) of one GEMM pass; its rows are the
// expert's block p in [offsets[e], offsets[e+1]) (m rows, grouped by permute_plan). Two
// micro-kernels, chosen per block by the policy the binding passes (FePolicy):
//   tiny:    per chunk of <= 4 rows, decode the tile's 4 weight vectors (16 columns x 2 k
//            each) in registers for every k pair and feed them to the rows (16 f32
//            accumulators); a larger block decodes the tile again per chunk.
//   blocked: decode the tile once into a per-thread bf16 buffer [K/2][4][32] (tagged with
//            (weights, expert, first group, groups, decoder) and checked before reuse), then
//            a register block of up to 6 rows x 4 vectors (24 accumulators) streams it for
//            every chunk of rows. mxfp4 fills the buffer during its first chunk instead
//            (micro_tee: that chunk runs the same register block over the codes and stores
//            what it decodes), so the decode issues beside that chunk's dps. bf16 weights
//            need no decoding: both kernels read the packed tile directly.
// Both decode through the same functions (so the same bf16 weight bits) and run the same dp
// sequence over k pairs 0, 1, ... for every output element (fused_experts_simd.h), so tiny,
// blocked and every policy give bit-identical results at one ISA level, for any batch and
// any thread count: the kernel is batch invariant.
// apply_router_weight_on_input (SPEC 6) only changes what GEMM1 reads: the schedule gathers
// the rows with fused_experts_gather_weighted (bf16(x * bf16(w)), below) and sums the combine
// unweighted; the passes here are the same for both.
//
// Decoders (fast paths at the avx2 and avx512 levels; the exact scalar decoder at the scalar
// level and for tiles flagged by fe::tile_needs_slow):
//   fp8:   a per-(tile, 128-k block) table of the 128 magnitudes' bf16(e4m3(c) * scale)
//          (f32 product, rounded once, then bf16 RNE: vcvtne2ps2bf16 at avx512_bf16, integer
//          RNE at avx512), looked up with two vpermi2w per 32 codes, sign XORed in (Fp8Dec);
//          at avx2 a 16-entry vpshufb table of mantissa and exponent parity, the rest of
//          the exponent added to the high byte (its Fp8Dec).
//   mxfp4: one 64-byte octet (4 k pairs) -> 3 shifts -> 4 vpermw of the plain e2m1 bf16
//          patterns; the f32 accumulators are kept in units of the current 32-k block's scale
//          (multiplied by 2^(e(b-1) - e(b)) at each block, by 2^e(last) at the end): the same
//          bits as scaling the weights, for scale bytes in [95, 159] (Mx4Dec). The blocked
//          path scales the weights instead where the inputs guarantee those same bits
//          (FeGemm::mx_scaled, micro_tee), and then never rescales.
//   exact: bf16_rne(f32(e4m3(q)) * scale) / bf16_rne(e2m1(c) * 2^(s-127)) per element
//          (formats.h); an odd K's padding k is exactly 0.
//
// Floors (per call, 2 threads; ~30-55 GB/s, ~420 GFLOP/s bf16 through torch):
//   bytes >= the routed experts' quantized weights (+ scales): Qwen3-30B-A3B fp8 T=1:
//   8 experts x 4.72 MB = 37.7 MB -> 1.26 ms at 30 GB/s; GPT-OSS-20B mxfp4 T=1: 4 x 13.2 MB
//   = 52.9 MB -> 1.76 ms. flops = 2 * rows * 3 * H * I: Qwen3 T=512 (4096 rows) 38.7 GFLOP
//   -> 92 ms at 420 GFLOP/s; GPT-OSS T=512 (2048 rows) 102 GFLOP -> 243 ms.
#include "fused_experts.h"  // declarations, FeGemm and the packed layout, before the ISA pragma

#include "isa_begin.h"
#include "fused_experts_simd.h"

namespace moelab::cpu::MOELAB_ISA_NS {
namespace {

using namespace fe_simd;
using fe::group_bytes;
using fe::k2;

// The avx2 and NEON fast decoders are forced inline: left to itself GCC kept Mx4Dec<4>::get at
// avx2 out of line, a call per octet with its 8 results passed through memory.
#define MOELAB_FE_INLINE inline __attribute__((always_inline))

constexpr int kTinyRows = 4;
constexpr int kBlockedRows = 6;
constexpr int64_t kStreamAhead = 16;   // bf16 decode: cache lines prefetched ahead in the own tile
constexpr int64_t kWholeK = int64_t(1) << 60;

// ----------------------------------------------------------------------------- decoders
// A decoder yields, for group g (of the NG it covers) and pair kk, kStep weight vectors
// (pairs kk .. kk+kStep-1). begin_scale_block(b) is called before the pairs of scale block b
// (kScaleBlockPairs pairs each). A decoder with kRescales (mxfp4's fast one) yields unscaled
// weights and a factor per group that the accumulators are multiplied by at each block start
// and, with b = the number of blocks, once more at the end (Mx4Dec).

// bf16 in VNNI order already (the packed bf16 tile, tile-major: groups 32 elements apart).
struct LoadDec {
  static constexpr int kStep = 1;
  static constexpr int64_t kScaleBlockPairs = kWholeK;
  static constexpr bool kRescales = false;
  const uint16_t* base;
  int64_t kstride;   // elements between pairs (32 x the tile's groups)
  void begin_scale_block(int64_t) {}
  void get(int g, int64_t kk, W32* w) const { w[0] = w_load(base + g * 32 + kk * kstride); }
};

// The exact element-by-element decoder (formats.h). q: fe::kFP8 or fe::kMXFP4.
struct ExactDec {
  static constexpr int kStep = 1;
  static constexpr int64_t kScaleBlockPairs = kWholeK;
  static constexpr bool kRescales = false;
  int q;
  const uint8_t* w;          // tile's first group
  int64_t gb;                // bytes per group
  int64_t K;
  const float* srow;         // fp8: the tile's row of 128-blocks of scales
  const uint8_t* ms;         // mxfp4: the tile's packed scales (first group)
  int64_t sgb;               // mxfp4: scale bytes per group
  void begin_scale_block(int64_t) {}
  // fp8: the decoder of 128-k block b alone, whose first pair is k0 (pairs renumbered from 0).
  ExactDec fp8_block_view(int64_t b, int64_t k0) const {
    ExactDec v = *this;
    v.w += k0 * 32;
    v.K -= 2 * k0;
    v.srow += b;
    return v;
  }
  void get(int g, int64_t kk, W32* out) const {
    alignas(64) uint16_t v[32];
    if (q == fe::kFP8) {
      const uint8_t* p = w + g * gb + kk * 32;
      for (int i = 0; i < 32; ++i) {
        const int64_t k = 2 * kk + (i & 1);
        v[i] = k < K ? f32_to_bf16(e4m3_to_f32(p[i]) * srow[k / fe::kFp8Block]) : uint16_t(0);
      }
    } else {
      const uint8_t* p = w + g * gb + (kk / 4) * 64;   // the octet of pair kk
      const int shift = 4 * int(kk & 3);
      const uint8_t* s = ms + g * sgb;
      for (int i = 0; i < 32; ++i) {
        uint32_t dw;
        std::memcpy(&dw, p + 4 * (i >> 1), 4);
        const uint8_t code = uint8_t((dw >> (16 * (i & 1) + shift)) & 0x0f);
        const int64_t k = 2 * kk + (i & 1);
        const uint8_t sc = s[(k / fe::kMxBlock) * fe::kGroupN + (i >> 1)];
        v[i] = f32_to_bf16(e2m1_to_f32(code) * e8m0_to_f32(sc));
      }
    }
    out[0] = w_load(v);
  }
};

#if MOELAB_ISA_LEVEL >= 2
inline __m512i narrow_pair(__m512 lo, __m512 hi) {
#if MOELAB_ISA_LEVEL == 3
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
#else
  return _mm512_inserti64x4(_mm512_castsi256_si512(narrow_bf16(vf{lo})), narrow_bf16(vf{hi}), 1);
#endif
}

// fp8 fast path. The tile's 64 columns lie in one 128-row scale block, so one scale per
// 128-k block serves all groups. begin_scale_block builds the block's decode table: for each of
// the 128 magnitudes c, bf16(e4m3(c) * scale) (the f32 product, narrowed as every fast path
// narrows), in four registers of 32 words. get() then decodes 32 codes with two 64-entry
// word permutes (vpermi2w on the low 6 bits), a blend on bit 6 and the sign flipped in from
// bit 7: 6 instructions, against 9 (and two 2-uop vcvtph2ps) for widening each code to f32
// and multiplying, which is also what it saves in time (experiments/micro/fp8_decode.cpp times
// both in L2). The table is 8 multiplies per 8192 weights. Same bits as the widening: the
// table holds the very products the multiply would make, and bf16(-v) = -bf16(v) (XOR, so a negative scale
// is right too). NaN codes (0x7f) never get here: their tiles are flagged slow.
struct Fp8Dec {
  static constexpr int kStep = 1;
  static constexpr int64_t kScaleBlockPairs = fe::kFp8Block / 2;
  static constexpr bool kRescales = false;
  const uint8_t* w;
  int64_t gb;
  const float* srow;
  __m512i tab[4];   // bf16(e4m3(c) * scale), c = 32 i .. 32 i + 31
  void begin_scale_block(int64_t b) {
    const __m512 sv = _mm512_set1_ps(srow[b]);
    const float* mag = e4m3_magnitudes();
    for (int i = 0; i < 4; ++i)
      tab[i] = narrow_pair(_mm512_mul_ps(_mm512_load_ps(mag + 32 * i), sv),
                           _mm512_mul_ps(_mm512_load_ps(mag + 32 * i + 16), sv));
  }
  void get(int g, int64_t kk, W32* out) const {
    // sign-extended: bits 0-6 the magnitude, bit 15 the sign
    const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + g * gb + kk * 32)));
    const __m512i lo = _mm512_permutex2var_epi16(tab[0], b, tab[1]);
    const __m512i hi = _mm512_permutex2var_epi16(tab[2], b, tab[3]);
    const __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)), lo, hi);
    out[0].v = _mm512_ternarylogic_epi32(v, b, _mm512_set1_epi16(int16_t(0x8000)), 0x78);   // v ^ (b & sign)
  }
  // |e4m3(c)| for c = 0..127 in f32, 64-byte aligned (c = 127 is NaN, never decoded here)
  static const float* e4m3_magnitudes() {
    struct Table {
      alignas(64) float v[128];
      Table() {
        for (int c = 0; c < 128; ++c) v[c] = e4m3_to_f32(uint8_t(c));
      }
    };
    static const Table t;
    return t.v;
  }
};

#if MOELAB_ISA_LEVEL == 3
// fp8 fast path at avx512_bf16 (which implies VBMI, isa.cpp), two k pairs per step, for
// K2 even: the same table, split into its low and high bytes (two 128-byte tables), looked up
// with vpermi2b on all 64 codes of pairs kk, kk+1 at once, the sign XORed into the high
// bytes, and the bytes zipped into words (vpunpck{l,h}bw). The zip works per 128-bit lane,
// so the codes are first put in lane order with one vpermb. 6 instructions per 64 weights,
// against 6 per 32 for Fp8Dec (experiments/micro/fp8_decode.cpp times both); the same bytes
// out, so the same bits.
alignas(64) constexpr uint8_t kFp8LaneOrder[64] = {   // lane q takes codes 8 (q/2) + 32 (q%2) + 0..7
    0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39, 8,  9,  10, 11, 12, 13,
    14, 15, 40, 41, 42, 43, 44, 45, 46, 47, 16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51,
    52, 53, 54, 55, 24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};

struct Fp8PairDec {
  static constexpr int kStep = 2;
  static constexpr int64_t kScaleBlockPairs = fe::kFp8Block / 2;
  static constexpr bool kRescales = false;
  const uint8_t* w;
  int64_t gb;
  const float* srow;
  __m512i lo0, lo1, hi0, hi1, order;   // bytes of bf16(e4m3(c) * scale), c = 0..63 / 64..127
  void begin_scale_block(int64_t b) {
    Fp8Dec words{w, gb, srow, {}};
    words.begin_scale_block(b);
    auto bytes = [](__m512i a, __m512i c, int shift) {
      return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srli_epi16(a, shift))),
                                _mm512_cvtepi16_epi8(_mm512_srli_epi16(c, shift)), 1);
    };
    lo0 = bytes(words.tab[0], words.tab[1], 0);
    lo1 = bytes(words.tab[2], words.tab[3], 0);
    hi0 = bytes(words.tab[0], words.tab[1], 8);
    hi1 = bytes(words.tab[2], words.tab[3], 8);
    order = _mm512_load_si512(kFp8LaneOrder);
  }
  void get(int g, int64_t kk, W32* out) const {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(w + g * gb + kk * 32));
    const __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);
    __m512i hi = _mm512_permutex2var_epi8(hi0, c, hi1);
    hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8(char(0x80)), 0x78);   // hi ^ (c & sign)
    out[0].v = _mm512_unpacklo_epi8(lo, hi);
    out[1].v = _mm512_unpackhi_epi8(lo, hi);
  }
};
#endif

// mxfp4 fast path, in units of the block's scale. The codes of a 32-k block decode to their
// plain e2m1 values (exact in bf16), and the accumulator is kept multiplied by 2^-e of the
// current block (e per column: the e8m0 byte s minus 127): before block b's pairs the kernel
// multiplies it by 2^(e(b-1) - e(b)) (e(-1) = 0) and after the last block by 2^e(last)
// (mx_rescale). A power-of-two factor is exact and commutes with every rounding of the
// accumulation as long as nothing leaves the normal f32 range, so this is the same sum as
// accumulating x * (e2m1 * 2^e) (checked bit for bit: experiments/micro/mxfp4_decode.cpp);
// the fast path's scale range [kMxFastLo, kMxFastHi] (fe::tile_needs_slow) keeps it there.
// It saves the per-code exponent add, which had to skip the zero codes (a vptestmw and a
// masked vpaddw per 32 codes). One 64-byte octet holds pairs kk .. kk+3 (fused_experts_pack.h):
// pair kk+i's codes are the low nibbles of each 16-bit half after a right shift by 4i, and
// vpermw reads only the low 5 bits of an index, so with the 16 patterns repeated in both
// halves of the table no mask is needed: 3 shifts and 4 vpermw per 128 codes.
inline __m512 mx_rescale(const uint8_t* gs, int64_t b, int64_t nb) {   // gs: one group's scales
  const __m512i prev = b > 0 ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(gs + (b - 1) * fe::kGroupN)))
                             : _mm512_set1_epi32(127);
  const __m512i cur = b < nb ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(gs + b * fe::kGroupN)))
                             : _mm512_set1_epi32(127);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(prev, cur), _mm512_set1_epi32(127)), 23));
}

template <int NG>
struct Mx4Dec {
  static constexpr int kStep = 4;
  static constexpr int64_t kScaleBlockPairs = fe::kMxBlock / 2;
  static constexpr bool kRescales = true;
  const uint8_t* w;
  int64_t gb;
  const uint8_t* ms;
  int64_t sgb;
  __m512i lut;
  __m512 factor[NG];   // what begin_scale_block(b) multiplies the accumulators of group g by
  void init() {
    lut = _mm512_broadcast_i32x8(_mm256_set_epi16(int16_t(0xC0C0), int16_t(0xC080), int16_t(0xC040), int16_t(0xC000),
                                                  int16_t(0xBFC0), int16_t(0xBF80), int16_t(0xBF00), int16_t(0x8000),
                                                  0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0x0000));
  }
  void begin_scale_block(int64_t b) {   // b = sgb / 16 (past the last block): the final factor
    for (int g = 0; g < NG; ++g) factor[g] = mx_rescale(ms + g * sgb, b, sgb / fe::kGroupN);
  }
  void get(int g, int64_t kk, W32* out) const {
    const __m512i d = _mm512_loadu_si512(w + g * gb + (kk / 4) * 64);
    out[0].v = _mm512_permutexvar_epi16(d, lut);
    out[1].v = _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 4), lut);
    out[2].v = _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 8), lut);
    out[3].v = _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 12), lut);
  }
};

template <int R, int NG>
inline void acc_rescale(Acc (&acc)[R][NG], const __m512 (&f)[NG]) {
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g) acc[r][g].v = _mm512_mul_ps(acc[r][g].v, f[g]);
}

inline Fp8Dec fp8_dec(const ExactDec& ex) { return Fp8Dec{ex.w, ex.gb, ex.srow, {}}; }

#elif MOELAB_ISA_LEVEL == 1
// fp8 fast path at avx2, which has no word permute: a 16-entry table per 128-k block, indexed by
// the code's mantissa and exponent parity, and the rest of the exponent added to the high byte.
// For a code of exponent field E >= 1 and mantissa m, e4m3 = (1 + m/8) * 2^(E-7)
//   = e4m3 of entry p = 8 (E & 1) + m   times   2^(2 (E >> 1)),
// where entry i holds v(i) = (1 + (i & 7)/8) * 2^((i >> 3) - 7). A power of two commutes with
// both roundings of the exact decoder (the f32 product, then bf16 RNE) while the results stay
// normal, and the bf16 high byte is the sign and the exponent's top 7 bits, so
//   bf16(e4m3(c) * s) = bf16(v(c & 15) * s), its high byte + (E >> 1)
// for every s in [2^-117, 2^119) (e4m3(1) * s = 2^-9 s >= 2^-126; 448 s < 2^128). The
// subnormal codes 1..7 are (1, 1, 1.5, 1, 1.25, 1.5, 1.75) x 2^-7 x (1/4, 1/2, 1/2, 1, 1, 1, 1):
// entries 0, 8, 12, 0, 2, 4, 6, the high byte - 1 for codes 1..3; code 0 indexes with bit 7 set,
// which vpshufb turns into +0. The sign is XORed in from the code. A block whose scale lies
// outside that range (0 and negative scales among them: a negative one would need -0 for code
// 0) decodes through the exact decoder: the same bits. No multiply.
struct Fp8Dec {
  static constexpr int kStep = 1;
  static constexpr int64_t kScaleBlockPairs = fe::kFp8Block / 2;
  static constexpr bool kRescales = false;
  ExactDec exact;
  __m256i tlo, thi;   // bytes of bf16(v(i) * s), i = 0..15, in both 128-bit lanes
  bool slow_scale_block;
  void begin_scale_block(int64_t b) {
    const float s = exact.srow[b];
    slow_scale_block = !(s >= 0x1p-117f && s < 0x1p119f);
    if (slow_scale_block) return;
    alignas(16) uint8_t lo[16], hi[16];
    for (int i = 0; i < 16; ++i) {
      const uint16_t v = f32_to_bf16((1.0f + float(i & 7) / 8.0f) * (i < 8 ? 0x1p-7f : 0x1p-6f) * s);
      lo[i] = uint8_t(v & 0xff);
      hi[i] = uint8_t(v >> 8);
    }
    tlo = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)lo));
    thi = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)hi));
  }
  // Only for blocks with !slow_scale_block: run_rows and dequant send the others to `exact`, so the
  // loop over a block's pairs has no branch and no call beside the vector code. 17 vector
  // instructions per 32 codes: with c7 = c & 0x7f, j = c7 +sat 0x78 has bit 7 clear only for the
  // subnormal codes (c7 < 8), and then indexes their corrections at 8 + c7 in two small tables
  // (the index XOR and the high-byte step); every other code looks up zeros there
  // (experiments/micro/avx2_decode.cpp: "fp8 parity", beside the decoders it replaced).
  MOELAB_FE_INLINE void get(int g, int64_t kk, W32* out) const {
    const __m256i lx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, char(0x80), 0 ^ 1, 8 ^ 2, 12 ^ 3, 0 ^ 4, 2 ^ 5, 4 ^ 6, 6 ^ 7,
                                        0, 0, 0, 0, 0, 0, 0, 0, char(0x80), 0 ^ 1, 8 ^ 2, 12 ^ 3, 0 ^ 4, 2 ^ 5, 4 ^ 6, 6 ^ 7);
    const __m256i hd = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, 0, 0, 0, 0,
                                        0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, 0, 0, 0, 0);
    // qwords 0, 2, 1, 3: the per-lane byte unpacks at the end then give codes 0-15 (columns
    // 0-7) in .lo and codes 16-31 (columns 8-15) in .hi, in order
    const __m256i c = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i*)(exact.w + g * exact.gb + kk * 32)),
                                               _MM_SHUFFLE(3, 1, 2, 0));
    const __m256i c7 = _mm256_and_si256(c, _mm256_set1_epi8(0x7f));
    const __m256i j = _mm256_adds_epu8(c7, _mm256_set1_epi8(0x78));
    const __m256i idx = _mm256_xor_si256(_mm256_and_si256(c, _mm256_set1_epi8(0x0f)), _mm256_shuffle_epi8(lx, j));
    const __m256i step = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(c, 4), _mm256_set1_epi8(0x07)),   // E >> 1
                                         _mm256_shuffle_epi8(hd, j));
    const __m256i lo = _mm256_shuffle_epi8(tlo, idx);
    const __m256i hi = _mm256_xor_si256(_mm256_add_epi8(_mm256_shuffle_epi8(thi, idx), step), _mm256_xor_si256(c, c7));
    out[0].lo = _mm256_unpacklo_epi8(lo, hi);
    out[0].hi = _mm256_unpackhi_epi8(lo, hi);
  }
};

inline Fp8Dec fp8_dec(const ExactDec& ex) { return Fp8Dec{ex, {}, {}, true}; }

// 16 f32 factors, one per column of a group (Acc's two halves).
struct Factor { __m256 lo, hi; };
inline Factor mx_rescale(const uint8_t* gs, int64_t b, int64_t nb) {   // as at avx512, 8 columns at a time
  auto half = [&](int c0) {
    const __m256i prev = b > 0 ? _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(gs + (b - 1) * fe::kGroupN + c0)))
                               : _mm256_set1_epi32(127);
    const __m256i cur = b < nb ? _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(gs + b * fe::kGroupN + c0)))
                               : _mm256_set1_epi32(127);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(prev, cur), _mm256_set1_epi32(127)), 23));
  };
  return {half(0), half(8)};
}

// mxfp4 fast path at avx2: Mx4Dec's units and octet layout; the 16 e2m1 bf16 patterns are
// looked up with two vpshufb (low and high bytes) per 16 codes: the code in a word's low byte
// indexes the low-byte table, the code moved to the high byte the high-byte table, and entry
// 0 (+0) has both bytes zero, so the other byte of each lookup is 0.
template <int NG>
struct Mx4Dec {
  static constexpr int kStep = 4;
  static constexpr int64_t kScaleBlockPairs = fe::kMxBlock / 2;
  static constexpr bool kRescales = true;
  const uint8_t* w;
  int64_t gb;
  const uint8_t* ms;
  int64_t sgb;
  __m256i tlo, thi;
  Factor factor[NG];
  void init() {
    alignas(16) uint8_t lo[16], hi[16];
    for (int c = 0; c < 16; ++c) {
      const uint16_t v = f32_to_bf16(e2m1_to_f32(uint8_t(c)));
      lo[c] = uint8_t(v & 0xff);
      hi[c] = uint8_t(v >> 8);
    }
    tlo = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)lo));
    thi = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)hi));
  }
  void begin_scale_block(int64_t b) {
    for (int g = 0; g < NG; ++g) factor[g] = mx_rescale(ms + g * sgb, b, sgb / fe::kGroupN);
  }
  MOELAB_FE_INLINE __m256i codes(__m256i d) const {   // the low nibble of each word -> its bf16 pattern
    const __m256i n = _mm256_and_si256(d, _mm256_set1_epi16(0x000f));
    return _mm256_or_si256(_mm256_shuffle_epi8(tlo, n), _mm256_shuffle_epi8(thi, _mm256_slli_epi16(n, 8)));
  }
  MOELAB_FE_INLINE void get(int g, int64_t kk, W32* out) const {
    const uint8_t* p = w + g * gb + (kk / 4) * 64;
    const __m256i d0 = _mm256_loadu_si256((const __m256i*)p), d1 = _mm256_loadu_si256((const __m256i*)(p + 32));
    out[0] = {codes(d0), codes(d1)};
    out[1] = {codes(_mm256_srli_epi16(d0, 4)), codes(_mm256_srli_epi16(d1, 4))};
    out[2] = {codes(_mm256_srli_epi16(d0, 8)), codes(_mm256_srli_epi16(d1, 8))};
    out[3] = {codes(_mm256_srli_epi16(d0, 12)), codes(_mm256_srli_epi16(d1, 12))};
  }
};

template <int R, int NG>
inline void acc_rescale(Acc (&acc)[R][NG], const Factor (&f)[NG]) {
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g) {
      acc[r][g].lo = _mm256_mul_ps(acc[r][g].lo, f[g].lo);
      acc[r][g].hi = _mm256_mul_ps(acc[r][g].hi, f[g].hi);
    }
}

#elif MOELAB_ISA_NEON
// fp8 fast path at NEON: a 16-entry table per 128-k block (entry m for E = 0, 8 + m otherwise)
// and an exponent add (E - 1) << 7 to the word, for |s| in [2^-120, 2^119) (e4m3(8) s >= 2^-126;
// 480 * 2^14 s < 2^128): the same bits as the exact decoder. The two byte tables are looked up
// with one `tbl` (vqtbl1q_u8) each per 16 codes. Word i of a W32 is code byte i (i = 2c + p),
// so 16 codes give q[0], q[1] (columns 0-7) and the next 16 q[2], q[3] after a byte zip.
struct Fp8Dec {
  static constexpr int kStep = 1;
  static constexpr int64_t kScaleBlockPairs = fe::kFp8Block / 2;
  static constexpr bool kRescales = false;
  ExactDec exact;
  uint8x16_t tlo, thi;   // bytes of bf16(e4m3(i) * s), i = 0..15
  bool slow_scale_block;
  void begin_scale_block(int64_t b) {
    const float s = exact.srow[b], a = s < 0.0f ? -s : s;
    slow_scale_block = !(a >= 0x1p-120f && a < 0x1p119f);
    if (slow_scale_block) return;
    alignas(16) uint8_t lo[16], hi[16];
    for (int i = 0; i < 16; ++i) {
      const uint16_t v = f32_to_bf16(e4m3_to_f32(uint8_t(i)) * s);
      lo[i] = uint8_t(v & 0xff);
      hi[i] = uint8_t(v >> 8);
    }
    tlo = vld1q_u8(lo);
    thi = vld1q_u8(hi);
  }
  // 16 codes -> 16 words (two uint16x8_t, codes 0-7 and 8-15).
  inline void words(uint8x16_t c, uint16x8_t* w0, uint16x8_t* w1) const {
    const uint8x16_t e = vandq_u8(vshrq_n_u8(c, 3), vdupq_n_u8(0x0f));   // exponent field
#ifdef MOELAB_PLANT_NEON_FP8_TABLE
    // Negative control (tests/test_aarch64.py): subnormal codes take the normal entries.
    const uint8x16_t idx = vorrq_u8(vandq_u8(c, vdupq_n_u8(0x07)), vdupq_n_u8(0x08));
#else
    const uint8x16_t idx = vorrq_u8(vandq_u8(c, vdupq_n_u8(0x07)), vandq_u8(vtstq_u8(c, vdupq_n_u8(0x78)), vdupq_n_u8(0x08)));
#endif
    const uint8x16_t lo = vqtbl1q_u8(tlo, idx);
    const uint8x16_t hi = veorq_u8(vqtbl1q_u8(thi, idx), vandq_u8(c, vdupq_n_u8(0x80)));
    const uint8x16_t ea = vqsubq_u8(e, vdupq_n_u8(1));   // E - 1, or 0 for E = 0
    *w0 = vaddq_u16(vreinterpretq_u16_u8(vzip1q_u8(lo, hi)), vshlq_n_u16(vmovl_u8(vget_low_u8(ea)), 7));
    *w1 = vaddq_u16(vreinterpretq_u16_u8(vzip2q_u8(lo, hi)), vshlq_n_u16(vmovl_high_u8(ea), 7));
  }
  MOELAB_FE_INLINE void get(int g, int64_t kk, W32* out) const {   // blocks with !slow_scale_block only (run_rows)
    const uint8_t* p = exact.w + g * exact.gb + kk * 32;
    words(vld1q_u8(p), &out[0].q[0], &out[0].q[1]);
    words(vld1q_u8(p + 16), &out[0].q[2], &out[0].q[3]);
  }
};

inline Fp8Dec fp8_dec(const ExactDec& ex) { return Fp8Dec{ex, {}, {}, true}; }

// mxfp4 fast path at NEON: the exact decoder's weights, bf16(e2m1(c) * 2^(s-127)), without
// rescaled accumulators. An octet (64 bytes, 4 k pairs) read as 32 words is already in W32's
// word order (word 2c + p = the codes of column c, k parity p, pair j in bits 4j..4j+3); per
// pair: a shift and mask, one `tbl` for the low and one for the high bytes of the 16 e2m1
// bf16 patterns, and the scale's exponent added to every nonzero weight (+-0 stays +-0).
// Adding (s - 127) << 7 to the bits multiplies by 2^(s-127) exactly while the product stays
// normal: s in [2, 252] for |e2m1| in [0.5, 6]; tiles with a scale byte outside
// [kMxFastLo, kMxFastHi] take the exact decoder (tile_needs_slow), so the bits are the exact
// decoder's, and the dp sequence is the scalar level's: the same output bits.
template <int NG>
struct Mx4Dec {
  static constexpr int kStep = 4;
  static constexpr int64_t kScaleBlockPairs = fe::kMxBlock / 2;
  static constexpr bool kRescales = false;
  const uint8_t* w;
  int64_t gb;
  const uint8_t* ms;
  int64_t sgb;
  uint8x16_t tlo, thi;
  uint16x8_t ex[NG][4];   // (s[c] - 127) << 7 for word 2c + p, c = 4j..4j+3 in ex[g][j]
  void init() {
    alignas(16) uint8_t lo[16], hi[16];
    for (int c = 0; c < 16; ++c) {
      const uint16_t v = f32_to_bf16(e2m1_to_f32(uint8_t(c)));
      lo[c] = uint8_t(v & 0xff);
      hi[c] = uint8_t(v >> 8);
    }
    tlo = vld1q_u8(lo);
    thi = vld1q_u8(hi);
  }
  void begin_scale_block(int64_t b) {
    for (int g = 0; g < NG; ++g) {
      const uint8x16_t sc = vld1q_u8(ms + g * sgb + b * fe::kGroupN);   // columns 0..15
      const int16x8_t lo = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(sc)));
      const int16x8_t hi = vreinterpretq_s16_u16(vmovl_high_u8(sc));
      const uint16x8_t dlo = vreinterpretq_u16_s16(vshlq_n_s16(vsubq_s16(lo, vdupq_n_s16(127)), 7));
      const uint16x8_t dhi = vreinterpretq_u16_s16(vshlq_n_s16(vsubq_s16(hi, vdupq_n_s16(127)), 7));
      ex[g][0] = vzip1q_u16(dlo, dlo);   // columns 0-3, each twice
      ex[g][1] = vzip2q_u16(dlo, dlo);
      ex[g][2] = vzip1q_u16(dhi, dhi);
      ex[g][3] = vzip2q_u16(dhi, dhi);
    }
  }
  inline uint16x8_t decode(uint16x8_t n, uint16x8_t e) const {   // n: codes in the low nibble
    const uint8x16_t idx = vreinterpretq_u8_u16(n);                // high bytes index entry 0 (+0)
    const uint16x8_t v = vorrq_u16(vreinterpretq_u16_u8(vqtbl1q_u8(tlo, idx)),
                                   vshlq_n_u16(vreinterpretq_u16_u8(vqtbl1q_u8(thi, idx)), 8));
#ifdef MOELAB_PLANT_NEON_MX_ZERO
    return vaddq_u16(v, e);   // negative control (tests/test_aarch64.py): zeros get the exponent too
#else
    return vaddq_u16(v, vandq_u16(e, vtstq_u16(v, vdupq_n_u16(0x7fff))));
#endif
  }
  MOELAB_FE_INLINE void get(int g, int64_t kk, W32* out) const {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(w + g * gb + (kk / 4) * 64);
    const uint16x8_t m = vdupq_n_u16(0x000f);
    for (int q = 0; q < 4; ++q) {
      const uint16x8_t d = vld1q_u16(p + 8 * q);
      out[0].q[q] = decode(vandq_u16(d, m), ex[g][q]);
      out[1].q[q] = decode(vandq_u16(vshrq_n_u16(d, 4), m), ex[g][q]);
      out[2].q[q] = decode(vandq_u16(vshrq_n_u16(d, 8), m), ex[g][q]);
      out[3].q[q] = decode(vshrq_n_u16(d, 12), ex[g][q]);
    }
  }
};
#endif

// --------------------------------------------------------------------- prefetching
// While one item computes, the next item's packed tile is prefetched into L2, a few cache
// lines per k step, so its first pass (decode or dequantization) finds it there: the DRAM
// stream of item i+1 overlaps the arithmetic of item i. Loads only; no effect on results.
struct Prefetch {
  const char* p = nullptr;
  const char* end = nullptr;
  int lines = 0;          // cache lines per k step (run_rows, dequant)
  int64_t rate = 256;     // micro_buf: cache lines per k pair, in 1/256ths
  int64_t credit = 0;     // micro_buf: the fraction of a line not yet issued, in 1/256ths
  inline void step() {
    for (int i = 0; i < lines && p < end; ++i, p += 64) __builtin_prefetch(p, 0, 2);
  }
};

// ------------------------------------------------------------------------ the K loop
// A decoder with a member `slow_scale_block` (fp8 at avx2 and NEON) has a fast path only for the
// scale blocks its begin_scale_block accepts; run_rows and dequant send the others through its
// exact decoder in a loop of their own, so the fast loop holds no branch.
template <class D, class = void>
struct has_exact_scale_blocks : std::false_type {};
template <class D>
struct has_exact_scale_blocks<D, std::void_t<decltype(&D::slow_scale_block)>> : std::true_type {};

// acc[r][g] += sum over all pairs of a[r] . W[group g], pairs in increasing order.
template <int R, int NG, class Dec>
inline void run_rows(Dec& dec, const uint16_t* a, int64_t lda, int64_t K2, Acc (&acc)[R][NG], Prefetch* pfp) {
  Prefetch pf = *pfp;   // a local copy, so its pointer lives in a register
  int64_t b = 0;
  for (int64_t k0 = 0; k0 < K2; k0 += Dec::kScaleBlockPairs, ++b) {
    dec.begin_scale_block(b);
#if MOELAB_ISA_LEVEL >= 1
    if constexpr (Dec::kRescales) acc_rescale(acc, dec.factor);
#endif
    const int64_t k1 = K2 - k0 < Dec::kScaleBlockPairs ? K2 : k0 + Dec::kScaleBlockPairs;
    if constexpr (has_exact_scale_blocks<Dec>::value) {
      if (dec.slow_scale_block) {
        ExactDec ex = dec.exact.fp8_block_view(b, k0);
        *pfp = pf;
        run_rows<R, NG>(ex, a + 2 * k0, lda, k1 - k0, acc, pfp);
        pf = *pfp;
        continue;
      }
    }
    for (int64_t kk = k0; kk < k1; kk += Dec::kStep) {
      pf.step();
      if constexpr (Dec::kStep > 2) {   // group by group: 4 weight vectors live, not 4 x NG
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) {
          W32 w[Dec::kStep];
          dec.get(g, kk, w);
#pragma GCC unroll 4
          for (int s = 0; s < Dec::kStep; ++s)
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) acc[r][g] = dp(acc[r][g], x_pair(a + r * lda + 2 * (kk + s)), w[s]);
        }
        continue;
      }
      W32 w[NG][Dec::kStep];
      for (int g = 0; g < NG; ++g) dec.get(g, kk, w[g]);
      for (int s = 0; s < Dec::kStep; ++s) {
        for (int r = 0; r < R; ++r) {
          const XP x = x_pair(a + r * lda + 2 * (kk + s));
          for (int g = 0; g < NG; ++g) acc[r][g] = dp(acc[r][g], x, w[g][s]);
        }
      }
    }
  }
#if MOELAB_ISA_LEVEL >= 1
  if constexpr (Dec::kRescales) {
    dec.begin_scale_block(b);
    acc_rescale(acc, dec.factor);
  }
#endif
  pfp->p = pf.p;
}

// Decode the NG groups into buf, [K2][NG][32] bf16 (the groups of one k pair adjacent, so
// the blocked micro-kernel walks one pointer).
template <int NG, class Dec>
inline void dequant(Dec& dec, int64_t K2, uint16_t* buf, Prefetch* pf) {
  for (int64_t k0 = 0, b = 0; k0 < K2; k0 += Dec::kScaleBlockPairs, ++b) {
    dec.begin_scale_block(b);
    const int64_t k1 = K2 - k0 < Dec::kScaleBlockPairs ? K2 : k0 + Dec::kScaleBlockPairs;
    if constexpr (has_exact_scale_blocks<Dec>::value) {
      if (dec.slow_scale_block) {
        ExactDec ex = dec.exact.fp8_block_view(b, k0);
        dequant<NG>(ex, k1 - k0, buf + k0 * NG * 32, pf);
        continue;
      }
    }
    for (int64_t kk = k0; kk < k1; kk += Dec::kStep) {
      pf->step();
      for (int g = 0; g < NG; ++g) {
        W32 w[Dec::kStep];
        dec.get(g, kk, w);
        for (int s = 0; s < Dec::kStep; ++s) w_store(buf + ((kk + s) * NG + g) * 32, w[s]);
      }
    }
  }
}

// ------------------------------------------------------------------------- epilogue
struct Out {
  const FeGemm* g;
  int64_t e;
  int64_t n_first;   // first column of group 0
  bool claim;        // prefetch each chunk's output lines (acc_begin)
};

// Rows [p, p + R) of the output, groups 0..NG-1: + bias (f32), then bf16 RNE or f32.
template <int R, int NG>
inline void store_rows(const Out& o, int64_t p, Acc (&acc)[R][NG]) {
  const FeGemm& g = *o.g;
  for (int r = 0; r < R; ++r) {
    for (int gi = 0; gi < NG; ++gi) {
      const int64_t n0 = o.n_first + gi * fe::kGroupN;
      const int nc = int(imin_(fe::kGroupN, g.N - n0));
      if (nc <= 0) continue;
      alignas(64) float t[16];
      acc_store(t, acc[r][gi]);
      for (int c = 0; c < nc; c += kVecF) {
        const int n = int(imin_(kVecF, nc - c));
        vf v = vload(t + c, n);
        if (g.bias) {
          const int64_t bi = o.e * g.N + n0 + c;
          v = vadd(v, g.bias_bf16 ? vload_bf16(static_cast<const uint16_t*>(g.bias) + bi, n)
                                  : vload(static_cast<const float*>(g.bias) + bi, n));
        }
        if (g.out_bf16) vstore_bf16(static_cast<uint16_t*>(g.out) + (p + r) * g.ldo + n0 + c, v, n);
        else vstore(static_cast<float*>(g.out) + (p + r) * g.ldo + n0 + c, v, n);
      }
    }
  }
}

// The accumulators of rows [p, p + R), groups 0..NG-1 before the first k pair: +0, or the
// f32 values g.init holds there (columns past N read as 0; they are never stored).
// With o.claim it first prefetches the chunk's output lines, so that their misses resolve
// during the k loop: at prefill h and y are tens of MB, in no cache, and the stores at the
// chunk's end otherwise wait for those lines and hold up the next chunk's loads
// (docs/fused_experts.md, "Output lines"). The hint asks for writing; without the PRFCHW
// target feature (the ISA levels do not enable it) GCC emits prefetcht0, and that is what was
// measured.
template <int R, int NG>
inline void acc_begin(const Out& o, int64_t p, Acc (&acc)[R][NG]) {
  const FeGemm& g = *o.g;
  if (o.claim) {
    const int64_t eb = g.out_bf16 ? 2 : 4, bytes = imin_(NG * fe::kGroupN, g.N - o.n_first) * eb;
    for (int r = 0; r < R; ++r) {
      const uintptr_t row = reinterpret_cast<uintptr_t>(g.out) + uintptr_t(((p + r) * g.ldo + o.n_first) * eb);
      for (uintptr_t l = row & ~uintptr_t(63); l < row + uintptr_t(bytes); l += 64)
        __builtin_prefetch(reinterpret_cast<const void*>(l), 1, 3);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int gi = 0; gi < NG; ++gi) {
      if (!g.init) {
        acc[r][gi] = acc_zero();
        continue;
      }
      const int64_t n0 = o.n_first + gi * fe::kGroupN;
      const int nc = int(imin_(fe::kGroupN, g.N - n0));
      alignas(64) float t[16] = {};
      for (int c = 0; c < nc; ++c) t[c] = g.init[(p + r) * g.ldo + n0 + c];
      acc[r][gi] = acc_load(t);
    }
  }
}

template <int R, int NG, class Dec>
inline void rows_chunk(Dec dec, const uint16_t* a, int64_t lda, int64_t K2, const Out& o, int64_t p,
                       Prefetch* pf) {
  Acc acc[R][NG];
  acc_begin<R, NG>(o, p, acc);
  run_rows<R, NG>(dec, a, lda, K2, acc, pf);
  store_rows<R, NG>(o, p, acc);
}

// All m rows of a block, in chunks of up to 4 (tiny) or 6 (blocked) rows. The decoder is
// copied per chunk (its block state restarts at k = 0).
template <int NG, int MaxR, class Dec>
inline void all_rows(const Dec& dec, const uint16_t* a, int64_t lda, int64_t K2, const Out& o,
                     int64_t p0, int64_t m, Prefetch* pf) {
  int64_t r0 = 0;
  for (; r0 + MaxR <= m; r0 += MaxR) rows_chunk<MaxR, NG>(dec, a + r0 * lda, lda, K2, o, p0 + r0, pf);
  const int64_t rest = m - r0;
  const uint16_t* ar = a + r0 * lda;
  switch (rest) {
    case 1: rows_chunk<1, NG>(dec, ar, lda, K2, o, p0 + r0, pf); break;
    case 2: rows_chunk<2, NG>(dec, ar, lda, K2, o, p0 + r0, pf); break;
    case 3: rows_chunk<3, NG>(dec, ar, lda, K2, o, p0 + r0, pf); break;
    case 4: if constexpr (MaxR > 4) rows_chunk<4, NG>(dec, ar, lda, K2, o, p0 + r0, pf); break;
    case 5: if constexpr (MaxR > 5) rows_chunk<5, NG>(dec, ar, lda, K2, o, p0 + r0, pf); break;
    default: break;
  }
}

// The blocked micro-kernel: R rows x NG vectors over bf16 weight vectors at
// b + kk * kstride + g * 32, [K2][NG][32]: the dequantized buffer, or a full packed bf16 tile,
// which is laid out the same (kstride = NG * 32); with kPacked, one group (NG = 1) of a packed
// bf16 tile of fewer than 4 groups (the last of N; kstride = 32 x its groups, at run time).
// The same dp sequence per output element as run_rows (kk ascending), written so the pointers
// stay in registers (4 loads, R broadcasts, R * NG vdpbf16ps per k pair). The strides the
// layout fixes are compile-time constants, and the function is never inlined: with both
// strides in registers GCC spilled one to the stack inside the k loop (reloaded every pair),
// and inlined into blocked_rows it kept the accumulators in memory; with the strides constant
// the k loop holds every pointer and accumulator in registers. ms (mxfp4's fast path: the
// buffer holds unscaled e2m1 weights): the packed scales of the NG groups (sgb bytes apart); the
// accumulators are rescaled at every 32-k block as run_rows does with Mx4Dec, so the same bits.
template <int R, int NG, bool kPacked>
__attribute__((noinline)) void micro_buf(const uint16_t* b, int64_t packed_kstride, const uint16_t* a, int64_t lda,
                                         int64_t K2, const Out& o, int64_t p, Prefetch* pf, const uint8_t* ms,
                                         int64_t sgb) {
  static_assert(!kPacked || NG == 1, "a packed partial tile is read one group at a time");
  const int64_t kstride = kPacked ? packed_kstride : NG * 32;
  constexpr int64_t gstride = 32;
  Acc acc[R][NG];
  acc_begin<R, NG>(o, p, acc);
#if MOELAB_ISA_LEVEL >= 1
  const int64_t nb = sgb / fe::kGroupN, kb = ms ? fe::kMxBlock / 2 : K2;
  auto rescale = [&](int64_t blk) {
    decltype(mx_rescale(ms, 0, 0)) f[NG];
    for (int g = 0; g < NG; ++g) f[g] = mx_rescale(ms + g * sgb, blk, nb);
    acc_rescale(acc, f);
  };
#else
  const int64_t kb = K2;   // (mxfp4 takes the exact decoder at the scalar level: ms is null)
  (void)ms, (void)sgb;
#endif
  // Rows r = 0..5 addressed as a0 + {0, 1, 2} * ld and a3 + {0, 1, 2} * ld (x86 scaled
  // index addressing), so two row pointers and the stride stay in registers.
  const char* a0 = reinterpret_cast<const char*>(a);
  const char* a3 = a0 + 3 * lda * 2;
  const int64_t ld = lda * 2;
  const char* pp = pf->p;
  const char* const pe = pf->end;
  const int64_t rate = pf->rate;
  int64_t credit = pf->credit;
  const uint16_t* bk = b;
  int64_t blk = 0;
  for (int64_t k0 = 0; k0 < K2; k0 += kb, ++blk) {
#if MOELAB_ISA_LEVEL >= 1
    if (ms) rescale(blk);
#endif
    const int64_t k1 = K2 - k0 < kb ? K2 : k0 + kb;
    for (int64_t kk = k0; kk < k1; ++kk, a0 += 4, a3 += 4, bk += kstride) {
      for (credit += rate; credit >= 256 && pp < pe; credit -= 256, pp += 64) __builtin_prefetch(pp, 0, 2);
      W32 w[NG];
      for (int g = 0; g < NG; ++g) w[g] = w_load(bk + g * gstride);
      for (int r = 0; r < R; ++r) {
        const char* ar = r < 3 ? a0 + r * ld : a3 + (r - 3) * ld;
        const XP x = x_pair(reinterpret_cast<const uint16_t*>(ar));
        for (int g = 0; g < NG; ++g) acc[r][g] = dp(acc[r][g], x, w[g]);
      }
    }
  }
#if MOELAB_ISA_LEVEL >= 1
  if (ms) rescale(blk);
#endif
  pf->p = pp;
  pf->credit = credit;
  store_rows<R, NG>(o, p, acc);
}

#if MOELAB_ISA_LEVEL >= 2
// The words (s[c] - 127) << 7, c = 0..15, each twice (word 2c + p, column c): what adding 2^e
// to a bf16 adds to its bits, for the 16 columns' scale bytes s of one 32-k block.
inline __m512i mx_exp_words(const uint8_t* s) {
  const __m512i d = _mm512_slli_epi32(
      _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)s)), _mm512_set1_epi32(127)), 7);
  const __m512i lo = _mm512_and_si512(d, _mm512_set1_epi32(0xffff));
  return _mm512_or_si512(lo, _mm512_slli_epi32(lo, 16));
}

// mxfp4's blocked path, first chunk of rows (R <= 6): micro_buf's loop over the packed codes
// instead of the buffer. Each k pair decodes its NG weight vectors as Mx4Dec does (the octet
// of pair kk shifted right by 4 (kk % 4), one vpermw) and stores them into buf at dequant's
// layout ([K2][NG][32]), so the tile's decode issues beside the chunk's dps and the later
// chunks stream the buffer (micro_buf). Per k pair: NG octet loads (from L1: an octet serves
// 4 pairs, reloaded rather than held, which would need NG more registers beside the 24
// accumulators), NG shifts, NG vpermw, NG stores, R broadcasts, R * NG vdpbf16ps. The next
// item's tile is prefetched `lines` per octet, as run_rows does with Mx4Dec's 4-pair steps.
// This register block shares each broadcast among NG weight vectors, where run_rows with a
// decoder that also stores would issue one broadcast per dp.
//
// Units. !kScaled: Mx4Dec's, the weights unscaled and the accumulators rescaled at each block
// (the same bits as run_rows with Mx4Dec); the later chunks rescale too (micro_buf with ms).
// kScaled (FeGemm::mx_scaled): each nonzero weight gets e added to its exponent field (a
// vptestmw and a masked vpaddw), which makes it bf16(e2m1 * 2^e), the exact decoder's weight;
// the dps run in plain units and nothing is rescaled, here or in the later chunks (micro_buf
// without ms: the rescaling multiplies are a visible share of a large prefill's work). The
// two units give the same bits whenever no product, partial sum or rescaled accumulator
// leaves the normal f32 range in either: every operation then commutes with the power-of-two scaling. The schedule sets
// mx_scaled only where that holds for every output: no init, K <= 2^20, and every input
// element 0 or of magnitude in [2^-47, 2^40) (fused_experts_mx_range). With |e| <= 32 (the
// fast path's scale range) and e2m1 magnitudes in [2^-1, 6], a nonzero product is a multiple
// of 2^(-47 - 1 - 32 - 14) = 2^-94 in plain units, so every nonzero partial sum is too, and at
// least 2^-126 in the rescaled units (x 2^-e >= 2^-32); no sum of up to 2^20 products
// reaches 2^(40 + 3 + 32 + 32 + 20) = 2^127 in either. So tiny (always rescaled) and blocked
// stay bit-identical for every input, and each output's bits depend only on its own row.
template <int R, int NG, bool kScaled>
__attribute__((noinline)) void micro_tee(const uint8_t* w, int64_t gb, const uint8_t* ms, int64_t sgb,
                                         uint16_t* buf, const uint16_t* a, int64_t lda, const Out& o,
                                         int64_t p, Prefetch* pf) {
  Acc acc[R][NG];
  acc_begin<R, NG>(o, p, acc);
  Mx4Dec<NG> dec{w, gb, ms, sgb, {}, {}};
  dec.init();
  const __m512i lut = dec.lut;
  const int64_t nb = sgb / fe::kGroupN;
  alignas(64) uint16_t ev[NG][32];   // kScaled: the block's mx_exp_words per group
  const char* a0 = reinterpret_cast<const char*>(a);
  const char* a3 = a0 + 3 * lda * 2;
  const int64_t ld = lda * 2;
  Prefetch pfl = *pf;
  const uint8_t* oc = w;   // the current octet of group 0
  uint16_t* bk = buf;
  for (int64_t blk = 0; blk < nb; ++blk) {
    if constexpr (kScaled) {
      for (int g = 0; g < NG; ++g) _mm512_store_si512(ev[g], mx_exp_words(ms + g * sgb + blk * fe::kGroupN));
    } else {
      dec.begin_scale_block(blk);
      acc_rescale(acc, dec.factor);
    }
    for (int j = 0; j < int(fe::kMxBlock / 8); ++j, oc += 64) {   // the block's 4 octets
      pfl.step();
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s, a0 += 4, a3 += 4, bk += NG * 32) {
        const uint8_t* os = oc;
        const uint16_t* es = &ev[0][0];
        __asm__("" : "+r"(os), "+r"(es));   // reload the octets and exponents for every pair
        W32 wv[NG];
        for (int g = 0; g < NG; ++g) {
          const __m512i d = _mm512_loadu_si512(os + g * gb);
          wv[g].v = _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 4 * s), lut);
          if constexpr (kScaled)
            wv[g].v = _mm512_mask_add_epi16(wv[g].v, _mm512_test_epi16_mask(wv[g].v, _mm512_set1_epi16(0x7fff)),
                                            wv[g].v, _mm512_load_si512(es + g * 32));
          w_store(bk + g * 32, wv[g]);
        }
        for (int r = 0; r < R; ++r) {
          const char* ar = r < 3 ? a0 + r * ld : a3 + (r - 3) * ld;
          const XP x = x_pair(reinterpret_cast<const uint16_t*>(ar));
          for (int g = 0; g < NG; ++g) acc[r][g] = dp(acc[r][g], x, wv[g]);
        }
      }
    }
  }
  if constexpr (!kScaled) {
    dec.begin_scale_block(nb);
    acc_rescale(acc, dec.factor);
  }
  pf->p = pfl.p;
  store_rows<R, NG>(o, p, acc);
}

template <int NG, bool kScaled>
inline void tee_chunk(int64_t R, const uint8_t* w, int64_t gb, const uint8_t* ms, int64_t sgb, uint16_t* buf,
                      const uint16_t* a, int64_t lda, const Out& o, int64_t p, Prefetch* pf) {
  switch (R) {
    case 1: micro_tee<1, NG, kScaled>(w, gb, ms, sgb, buf, a, lda, o, p, pf); break;
    case 2: micro_tee<2, NG, kScaled>(w, gb, ms, sgb, buf, a, lda, o, p, pf); break;
    case 3: micro_tee<3, NG, kScaled>(w, gb, ms, sgb, buf, a, lda, o, p, pf); break;
    case 4: micro_tee<4, NG, kScaled>(w, gb, ms, sgb, buf, a, lda, o, p, pf); break;
    case 5: micro_tee<5, NG, kScaled>(w, gb, ms, sgb, buf, a, lda, o, p, pf); break;
    default: micro_tee<6, NG, kScaled>(w, gb, ms, sgb, buf, a, lda, o, p, pf); break;
  }
}
#endif

// The size of chunk c of blocked_rows' cdiv(m, kBlockedRows) balanced chunks of m rows.
inline int64_t chunk_rows(int64_t m, int64_t c) {
  const int64_t n = fe::cdiv(m, kBlockedRows);
  return m / n + (c < m % n ? 1 : 0);
}

// All m rows of a block over the buffer, in chunks of 1..6 rows of balanced sizes
// (m = 32: 6, 6, 5, 5, 5, 5). buf: the dequantized buffer or a full packed bf16 tile, or with
// kPacked one group of a partial packed bf16 tile (its pairs packed_kstride elements apart;
// micro_buf).
template <int NG, bool kPacked>
inline void blocked_rows(const uint16_t* buf, int64_t packed_kstride, const uint16_t* a, int64_t lda,
                         int64_t K2, const Out& o, int64_t p0, int64_t m, Prefetch* pf,
                         const uint8_t* ms = nullptr, int64_t sgb = 0) {
  int64_t r0 = 0;
  for (int64_t c = 0; r0 < m; ++c) {
    const int64_t R = chunk_rows(m, c);
    const uint16_t* ar = a + r0 * lda;
    switch (R) {
      case 1: micro_buf<1, NG, kPacked>(buf, packed_kstride, ar, lda, K2, o, p0 + r0, pf, ms, sgb); break;
      case 2: micro_buf<2, NG, kPacked>(buf, packed_kstride, ar, lda, K2, o, p0 + r0, pf, ms, sgb); break;
      case 3: micro_buf<3, NG, kPacked>(buf, packed_kstride, ar, lda, K2, o, p0 + r0, pf, ms, sgb); break;
      case 4: micro_buf<4, NG, kPacked>(buf, packed_kstride, ar, lda, K2, o, p0 + r0, pf, ms, sgb); break;
      case 5: micro_buf<5, NG, kPacked>(buf, packed_kstride, ar, lda, K2, o, p0 + r0, pf, ms, sgb); break;
      default: micro_buf<6, NG, kPacked>(buf, packed_kstride, ar, lda, K2, o, p0 + r0, pf, ms, sgb); break;
    }
    r0 += R;
  }
}

// ------------------------------------------------------------------------ work items
// What the blocked path's buffer holds: (weights, expert, first group, groups, decoder).
struct TileTag {
  const void* w = nullptr;
  int64_t e = -1, g_first = -1, ng = 0;
  bool slow = false;
  bool valid = false;
  bool holds(const void* w_, int64_t e_, int64_t g_, int64_t ng_, bool s_) const {
    return valid && w == w_ && e == e_ && g_first == g_ && ng == ng_ && slow == s_;
  }
};

struct Item {
  const FeGemm* g;
  int64_t e, tile, p0, m;
  const uint8_t* tw;    // the tile's packed groups
  const float* srow;    // fp8: the tile's scale row
  const uint8_t* tms;   // mxfp4: the tile's packed scales
  bool slow, blocked;
  uint16_t* buf;        // the dequantized tile buffer
  TileTag* tag;
  Prefetch* pf;         // the next item's tile
};

// Groups [gbase, gbase + NG) of an item.
template <int NG>
void item_groups(const Item& it, int gbase) {
  const FeGemm& g = *it.g;
  const int64_t K = g.K, K2 = k2(K), gb = group_bytes(g.quant, K);
  const int64_t sgb = fe::mx_scale_group_bytes(K);
  const uint16_t* a = g.a + it.p0 * g.lda;
  // Only an item of several chunks of rows (prefill) claims its output lines ahead: a single
  // chunk's stores hold nothing up but the next item, so claiming its lines gains nothing.
  const Out o{&g, it.e, (it.tile * fe::kTileGroups + gbase) * fe::kGroupN, it.blocked && it.m > kBlockedRows};
  const uint8_t* w = it.tw + gbase * gb;

  if (g.quant == fe::kBF16) {   // the packed tile is already bf16: both kernels read it directly
    // Tile-major ([K2][ng][32], fused_experts_pack.h): a full tile has the buffer's layout.
    const int64_t ng = imin_(fe::kTileGroups, fe::n16(g.N) - it.tile * fe::kTileGroups);
    const uint16_t* wb = reinterpret_cast<const uint16_t*>(it.tw) + gbase * 32;
    if (!it.blocked) {
      all_rows<NG, kTinyRows>(LoadDec{wb, ng * 32}, a, g.lda, K2, o, it.p0, it.m, it.pf);
    } else if constexpr (NG == fe::kTileGroups) {
      blocked_rows<NG, false>(wb, 0, a, g.lda, K2, o, it.p0, it.m, it.pf);
    } else {
      blocked_rows<NG, true>(wb, ng * 32, a, g.lda, K2, o, it.p0, it.m, it.pf);
    }
    return;
  }
  const ExactDec exact{g.quant, w, gb, K, it.srow, it.tms ? it.tms + gbase * sgb : nullptr, sgb};
  const bool use_exact = it.slow || (MOELAB_ISA_LEVEL < 1 && !MOELAB_ISA_NEON);

  if (it.blocked) {
    const int64_t g_first = it.tile * fe::kTileGroups + gbase;
    if (!it.tag->holds(g.w, it.e, g_first, NG, it.slow)) {
      it.tag->valid = false;
      if (use_exact) {
        ExactDec d = exact;
        dequant<NG>(d, K2, it.buf, it.pf);
      }
#if MOELAB_ISA_LEVEL >= 1
      else if (g.quant == fe::kFP8) {
#if MOELAB_ISA_LEVEL == 3
        if (K2 % 2 == 0) {
          Fp8PairDec d{w, gb, it.srow, {}, {}, {}, {}, {}};
          dequant<NG>(d, K2, it.buf, it.pf);
        } else
#endif
        {
          Fp8Dec d = fp8_dec(exact);
          dequant<NG>(d, K2, it.buf, it.pf);
        }
      }
#if MOELAB_ISA_LEVEL == 1
      else {   // mxfp4: the buffer holds the unscaled e2m1 weights; the rows rescale (below)
        Mx4Dec<NG> d{w, gb, it.tms + gbase * sgb, sgb, {}, {}, {}};
        d.init();
        dequant<NG>(d, K2, it.buf, it.pf);
      }
#else
      else {   // mxfp4: the first chunk of rows fills the buffer as it runs (micro_tee)
        const uint8_t* tms = it.tms + gbase * sgb;
        const int64_t R0 = chunk_rows(it.m, 0);
        if (g.mx_scaled) tee_chunk<NG, true>(R0, w, gb, tms, sgb, it.buf, a, g.lda, o, it.p0, it.pf);
        else tee_chunk<NG, false>(R0, w, gb, tms, sgb, it.buf, a, g.lda, o, it.p0, it.pf);
        *it.tag = TileTag{g.w, it.e, g_first, NG, it.slow, true};
        if (it.m > R0)
          blocked_rows<NG, false>(it.buf, 0, a + R0 * g.lda, g.lda, K2, o, it.p0 + R0, it.m - R0, it.pf,
                                  g.mx_scaled ? nullptr : tms, sgb);
        return;
      }
#endif
#elif MOELAB_ISA_NEON
      else if (g.quant == fe::kFP8) {
        Fp8Dec d = fp8_dec(exact);
        dequant<NG>(d, K2, it.buf, it.pf);
      } else {   // mxfp4: the buffer holds the scaled weights (the exact decoder's)
        Mx4Dec<NG> d{w, gb, it.tms + gbase * sgb, sgb, {}, {}, {}};
        d.init();
        dequant<NG>(d, K2, it.buf, it.pf);
      }
#endif
      *it.tag = TileTag{g.w, it.e, g_first, NG, it.slow, true};
    }
    // mxfp4's fast decoder leaves the scales to the accumulators (Mx4Dec), unless mx_scaled
    const bool rescaled = !MOELAB_ISA_NEON && g.quant == fe::kMXFP4 && !use_exact && !g.mx_scaled;
    blocked_rows<NG, false>(it.buf, 0, a, g.lda, K2, o, it.p0, it.m, it.pf,
                     rescaled ? it.tms + gbase * sgb : nullptr, sgb);
    return;
  }
  if (use_exact) {
    all_rows<NG, kTinyRows>(exact, a, g.lda, K2, o, it.p0, it.m, it.pf);
    return;
  }
#if MOELAB_ISA_LEVEL >= 1
  if (g.quant == fe::kFP8) {
#if MOELAB_ISA_LEVEL == 3
    if (K2 % 2 == 0) {
      all_rows<NG, kTinyRows>(Fp8PairDec{w, gb, it.srow, {}, {}, {}, {}, {}}, a, g.lda, K2, o, it.p0, it.m, it.pf);
    } else
#endif
    all_rows<NG, kTinyRows>(fp8_dec(exact), a, g.lda, K2, o, it.p0, it.m, it.pf);
  } else {
    Mx4Dec<NG> d{w, gb, it.tms + gbase * sgb, sgb, {}, {}};
    d.init();
    all_rows<NG, kTinyRows>(d, a, g.lda, K2, o, it.p0, it.m, it.pf);
  }
#elif MOELAB_ISA_NEON
  if (g.quant == fe::kFP8) {
    all_rows<NG, kTinyRows>(fp8_dec(exact), a, g.lda, K2, o, it.p0, it.m, it.pf);
  } else {
    Mx4Dec<NG> d{w, gb, it.tms + gbase * sgb, sgb, {}, {}, {}};
    d.init();
    all_rows<NG, kTinyRows>(d, a, g.lda, K2, o, it.p0, it.m, it.pf);
  }
#endif
}

// ----------------------------------------------------------- standard-layout packing
// The same bytes as fe::pack_groups (and the same flag as fe::tile_needs_slow), faster: at
// avx512 levels one 16-lane dword gather reads 4 bytes of each of the group's 16 rows, which
// is 2 fp8 pairs, 1 bf16 pair or 2 mxfp4 quads of all 16 columns; the tails (an odd K, the
// last pair of a K that is not a multiple of 4) go through the scalar packer.
inline void pack_tile(int q, const uint8_t* src, int64_t N, int64_t K, int64_t g0, int64_t ng, uint8_t* dst) {
#if MOELAB_ISA_LEVEL >= 2
  const int64_t gb = group_bytes(q, K), rb = fe::row_bytes(q, K);
  const __m512i vindex = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(int(rb)));
  const int64_t jmax = rb / 4;   // whole dwords per row
  for (int64_t gi = 0; gi < ng; ++gi) {
    const int64_t n0 = (g0 + gi) * fe::kGroupN;
    const int64_t rows = imin_(fe::kGroupN, N - n0);
    const __mmask16 mask = __mmask16((1u << rows) - 1u);
    const uint8_t* base = src + n0 * rb;
    uint8_t* d = dst + gi * gb;
    for (int64_t j = 0; j < jmax; ++j) {
      __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, vindex, base + 4 * j, 1);
      if (q == fe::kBF16) {
        _mm512_storeu_si512(dst + fe::bf16_pair_offset(j, gi, ng), v);   // pair j of the 16 columns
        continue;
      }
      if (q == fe::kMXFP4) {   // bytes b0..b3 (octet j) -> lo(b0..b3) | hi(b0..b3) << 16, 4 bits each
        const __m512i n4 = _mm512_set1_epi32(0x0f0f0f0f), n8 = _mm512_set1_epi32(0x00ff00ff);
        auto squeeze = [&](__m512i x) {   // nibbles in the low halves of bytes 0..3 -> bits 0..15
          x = _mm512_and_si512(_mm512_or_si512(x, _mm512_srli_epi32(x, 4)), n8);
          return _mm512_and_si512(_mm512_or_si512(x, _mm512_srli_epi32(x, 8)), _mm512_set1_epi32(0xffff));
        };
        const __m512i even = squeeze(_mm512_and_si512(v, n4)), odd = squeeze(_mm512_and_si512(_mm512_srli_epi32(v, 4), n4));
        _mm512_storeu_si512(d + j * 64, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
        continue;
      }
      // fp8: pairs 2j, 2j+1 (32 bytes each)
      _mm256_storeu_si256((__m256i*)(d + 2 * j * 32), _mm512_cvtepi32_epi16(v));
      _mm256_storeu_si256((__m256i*)(d + (2 * j + 1) * 32), _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
    }
    if (jmax * 4 < rb) {   // tail pairs: bf16 with an odd K (the last pair), fp8 with
                           // K % 4 in {1, 2, 3} (the last one or two pairs)
      const int64_t P = k2(K);
      const int64_t kk0 = q == fe::kBF16 ? jmax : 2 * jmax;
      for (int64_t c = 0; c < fe::kGroupN; ++c) {
        const int64_t n = n0 + c;
        for (int64_t kk = kk0; kk < P; ++kk) {
          const int64_t es = q == fe::kBF16 ? 2 : 1;   // element bytes
          uint8_t* o = (q == fe::kBF16 ? dst + fe::bf16_pair_offset(kk, gi, ng) : d + kk * 32) + c * 2 * es;
          for (int p = 0; p < 2; ++p) {
            const int64_t k = 2 * kk + p;
            for (int64_t b = 0; b < es; ++b) o[p * es + b] = (n < N && k < K) ? base[c * rb + k * es + b] : uint8_t(0);
          }
        }
      }
    }
  }
#else
  fe::pack_groups(q, src, N, K, g0, ng, dst);
#endif
}

inline bool tile_needs_slow_fast(int q, const uint8_t* w, int64_t ng, int64_t K, int64_t tile,
                                 const float* fp8_scale, const uint8_t* mx_scales) {
#if MOELAB_ISA_LEVEL >= 2
  if (q == fe::kFP8) {   // the NaN-code scan, 64 bytes at a time; the scales as fe:: does
    const int64_t nbytes = ng * group_bytes(q, K);   // a multiple of 32
    int64_t i = 0;
    const __m512i m7f = _mm512_set1_epi8(0x7f);
    for (; i + 64 <= nbytes; i += 64)
      if (_mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512(w + i), m7f), m7f)) return true;
    for (; i < nbytes; ++i)
      if ((w[i] & 0x7f) == 0x7f) return true;
    return fe::tile_needs_slow(q, w, 0, K, tile, fp8_scale, mx_scales);
  }
#endif
  return fe::tile_needs_slow(q, w, ng, K, tile, fp8_scale, mx_scales);
}

}  // namespace

void fused_experts_gemm(const FeGemm& g, int64_t i0, int64_t i1, int64_t i_next, uint8_t* scratch) {
  const int q = g.quant;
  const int64_t N = g.N, K = g.K, N16 = fe::n16(N), ntiles = fe::n_tiles(N);
  const int64_t gb = group_bytes(q, K), sgb = fe::mx_scale_group_bytes(K);
  const int64_t nbn = fe::cdiv(N, fe::kFp8Block), nbk = fe::cdiv(K, fe::kFp8Block);
  uint16_t* buf = reinterpret_cast<uint16_t*>(scratch + 64);
  uint8_t* ptile = scratch + 64 + fe::scratch_dequant_bytes(K);
  uint8_t* pscale = ptile + fe::align64(fe::kTileGroups * gb);
  TileTag tag;   // invalid: this call's buffer holds nothing yet
  const int64_t K2 = k2(K);

  for (int64_t i = i0; i < i1; ++i) {
    const int64_t e = g.items[2 * i], tile = g.items[2 * i + 1];
    const int64_t p0 = g.offsets[e], m = g.offsets[e + 1] - p0;
    if (m <= 0) continue;
    const int64_t ng = imin_(fe::kTileGroups, N16 - tile * fe::kTileGroups);
    Prefetch pf;
    Item it{&g, e, tile, p0, m, nullptr, nullptr, nullptr, false, false, buf, &tag, &pf};
    it.blocked = g.policy == kFeAllBlocked || (g.policy == kFePerBlock && m >= g.m_cross);
    // A bf16 item of a single chunk of rows (decode) streams its tile once, memory-bound: it
    // does not prefetch the next item's tile: a second stream beside its own takes from a
    // core's read rate instead of adding to it (experiments/micro/decode_stream.cpp measures
    // the streams). It prefetches ...
    const bool bf16_single = q == fe::kBF16 && it.blocked && m <= kBlockedRows;
    if (g.packed && i + 1 < i_next && !bf16_single) {   // prefetch the next item's tile over this item's k steps
      const int64_t e1 = g.items[2 * i + 2], t1 = g.items[2 * i + 3];
      const int64_t ng1 = imin_(fe::kTileGroups, N16 - t1 * fe::kTileGroups);
      pf.p = reinterpret_cast<const char*>(g.w + e1 * N16 * gb + t1 * fe::kTileGroups * gb);
      pf.end = pf.p + ng1 * gb;
      const int64_t passes = it.blocked ? 1 + fe::cdiv(m, kBlockedRows) : fe::cdiv(m, kTinyRows);
      const int64_t steps = imax_(1, passes * K2 / (q == fe::kMXFP4 ? 4 : 2));   // done by mid-item (mxfp4 steps 4 pairs)
      pf.lines = int(fe::cdiv(fe::cdiv(ng1 * gb, 64), steps));
      // micro_buf: with two or more chunks of rows, the tile's lines spread evenly over all
      // their k pairs (one line per pair finishes it early and leaves the item's last chunks
      // without the next tile's stream); a single chunk (fp8, mxfp4) keeps one line per pair (a decode
      // item is memory-bound, and a faster next-tile stream only competes with its own).
      const int64_t chunks = fe::cdiv(m, kBlockedRows);
      if (it.blocked && chunks >= 2) pf.rate = fe::cdiv(fe::cdiv(ng1 * gb, 64) * 256, chunks * K2);
    }
    if (bf16_single && m == 1 && g.stream_ahead && g.packed && ng == fe::kTileGroups) {
      // ... a single row's item prefetches its own tile on two threads instead, kStreamAhead
      // lines ahead of its loads, at their pace (ng lines per k pair). It helps where two cores
      // share the memory and costs a little on one core, whose hardware prefetch keeps up
      // alone, so only on two or more threads, and only for one row (two rows an expert gain
      // nothing); farther ahead is slower. experiments/micro/decode_stream.cpp (with a threads
      // argument) measures the same stream; docs/fused_experts.md, "Design alternatives".
      const char* t0 = reinterpret_cast<const char*>(g.w + e * N16 * gb + tile * fe::kTileGroups * gb);
      pf.p = t0 + kStreamAhead * 64;
      pf.end = t0 + ng * gb;
      pf.rate = ng * 256;
    }
    const float* escale = q == fe::kFP8 ? static_cast<const float*>(g.scale) + e * nbn * nbk : nullptr;
    if (escale) it.srow = escale + (tile * fe::kTileN / fe::kFp8Block) * nbk;
    if (g.packed) {
      it.tw = g.w + e * N16 * gb + tile * fe::kTileGroups * gb;
      if (q == fe::kMXFP4)
        it.tms = static_cast<const uint8_t*>(g.scale) + e * N16 * sgb + tile * fe::kTileGroups * sgb;
      it.slow = g.slow[e * ntiles + tile] != 0;
    } else {
      // Standard layout: pack this tile first (same bytes and flag as prepacking). The
      // buffer tag keys on (weights, expert, groups), so re-packing never confuses it.
      pack_tile(q, g.w + e * N * fe::row_bytes(q, K), N, K, tile * fe::kTileGroups, ng, ptile);
      it.tw = ptile;
      if (q == fe::kMXFP4) {
        fe::pack_mx_scales(static_cast<const uint8_t*>(g.scale) + e * N * (K / fe::kMxBlock), N, K,
                           tile * fe::kTileGroups, ng, pscale);
        it.tms = pscale;
      }
      it.slow = tile_needs_slow_fast(q, it.tw, ng, K, tile, escale, it.tms);
    }
    if (ng == fe::kTileGroups) {
      item_groups<fe::kTileGroups>(it, 0);
    } else {
      for (int gi = 0; gi < ng; ++gi) item_groups<1>(it, gi);
    }
  }
}

void fused_experts_act(const uint16_t* h, int64_t ldh, uint16_t* a, int64_t lda, int64_t I, int act,
                       float alpha, float limit, int64_t p0, int64_t p1) {
  const vf one = vset1(1.0f), lim = vset1(limit), nlim = vset1(-limit), al = vset1(alpha);
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* hr = h + p * ldh;
    uint16_t* ar = a + p * lda;
    for (int64_t i = 0; i < I; i += kVecF) {
      const int n = int(imin_(kVecF, I - i));
      vf gate, up;
      if (act == 0) {
        gate = vload_bf16(hr + i, n);
        up = vload_bf16(hr + I + i, n);
        vf s = vsigmoid(gate);
        vstore_bf16(ar + i, vmul(vmul(gate, s), up), n);
        continue;
      }
      // swiglu_oai: gate = h[2i], up = h[2i+1] (interleaved): one dword = (gate, up).
#if MOELAB_ISA_LEVEL >= 2
      __m512i d = _mm512_maskz_loadu_epi32(tail_mask(n), hr + 2 * i);
      gate = vf{_mm512_castsi512_ps(_mm512_slli_epi32(d, 16))};
      up = vf{_mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32(int(0xffff0000u))))};
#elif MOELAB_ISA_LEVEL == 1
      alignas(32) uint32_t tmp[8] = {0};
      std::memcpy(tmp, hr + 2 * i, size_t(n) * 4);
      __m256i d = _mm256_load_si256((const __m256i*)tmp);
      gate = vf{_mm256_castsi256_ps(_mm256_slli_epi32(d, 16))};
      up = vf{_mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32(int(0xffff0000u))))};
#elif MOELAB_ISA_NEON
      uint32x4_t d;
      if (n == 4) {
        d = vreinterpretq_u32_u16(vld1q_u16(hr + 2 * i));
      } else {
        alignas(16) uint32_t tmp[4] = {0, 0, 0, 0};
        std::memcpy(tmp, hr + 2 * i, size_t(n) * 4);
        d = vld1q_u32(tmp);
      }
      gate = vf{vreinterpretq_f32_u32(vshlq_n_u32(d, 16))};
      up = vf{vreinterpretq_f32_u32(vandq_u32(d, vdupq_n_u32(0xffff0000u)))};
#else
      gate = vf{bf16_to_f32(hr[2 * i])};
      up = vf{bf16_to_f32(hr[2 * i + 1])};
#endif
      vf gc = vmin_(lim, gate);                 // min(gate, limit), NaN passes
      vf uc = vmin_(lim, vmax_(nlim, up));      // clamp(up, -limit, limit), NaN passes
      vf s = vsigmoid(vmul(al, gc));
      vstore_bf16(ar + i, vmul(vmul(gc, s), vadd(uc, one)), n);
    }
    for (int64_t i = I; i < lda; ++i) ar[i] = 0;
  }
}

void fused_experts_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kVecF <= n; i += kVecF) vstore_bf16(dst + i, vload(src + i));
  if (i < n) vstore_bf16(dst + i, vload(src + i, int(n - i)), int(n - i));
}

// apply_router_weight_on_input: GEMM1's rows are gathered scaled, one f32 multiply and one
// RNE rounding per element. That is the single rounding of the exact product: two bf16
// significands (8 bits each) multiply to at most 16 bits, so an f32 product of at least
// 2^-134 in magnitude is exact (its last bit is >= 2^-149, even for bf16 subnormal factors);
// a smaller one rounds to +-0 in bf16 whether or not f32 rounded it first (exact ties at
// 2^-134 stay ties). Checked against the f64 rounding over millions of pairs in that range.
void fused_experts_gather_weighted(const uint16_t* x, int64_t ldx, const float* w, int64_t ldw_t, int64_t ldw_k,
                                   const int32_t* src_row, int64_t K, int64_t H, uint16_t* xg, int64_t ldg,
                                   int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t r = src_row[p], t = r / K, j = r - t * K;
    const float ws = bf16_to_f32(f32_to_bf16(w[t * ldw_t + j * ldw_k]));   // the weight rounded to bf16 first
    const vf wv = vset1(ws);
    const uint16_t* xr = x + t * ldx;
    uint16_t* gr = xg + p * ldg;
    for (int64_t i = 0; i < H; i += kVecF) {
      const int n = int(imin_(kVecF, H - i));
      vstore_bf16(gr + i, vmul(vload_bf16(xr + i, n), wv), n);
    }
    for (int64_t i = H; i < ldg; ++i) gr[i] = 0;
  }
}

bool fused_experts_mx_range(const uint16_t* a, int64_t lda, int64_t n, int64_t p0, int64_t p1) {
#if MOELAB_ISA_LEVEL >= 2
  // m = bits & 0x7fff: ok where m == 0 or m - 0x2800 <= 0x2b7f (unsigned 16-bit)
  const __m512i mag = _mm512_set1_epi16(0x7fff), lo = _mm512_set1_epi16(0x2800), span = _mm512_set1_epi16(0x537f - 0x2800);
  __mmask32 bad = 0;
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* r = a + p * lda;
    for (int64_t i = 0; i < n; i += 32) {
      const __mmask32 live = i + 32 <= n ? ~__mmask32(0) : __mmask32((1u << (n - i)) - 1u);
      const __m512i m = _mm512_and_si512(_mm512_maskz_loadu_epi16(live, r + i), mag);
      bad |= _mm512_mask_cmpgt_epu16_mask(_mm512_test_epi16_mask(m, m), _mm512_sub_epi16(m, lo), span);
    }
    if (bad) return false;
  }
  return true;
#else
  (void)a, (void)lda, (void)n, (void)p0, (void)p1;
  return false;
#endif
}

}  // namespace moelab::cpu::MOELAB_ISA_NS
