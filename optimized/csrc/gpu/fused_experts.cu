// fused_experts on the GPU (SPEC section 5; seed 000): the expert MLPs with bf16, FP8-block or
// MXFP4 weights in SPEC's standard layout, dequantized inside the kernels. Same function as
// the CPU kernel (docs/fused_experts.md): per routed row r = t*K + j with e = ids[t, j] >= 0,
//     h = bf16(x[t] @ W13[e].T + b13[e])          f32 accumulation
//     a = bf16(act(h))                            silu / swiglu_oai in f32 from the bf16 h
//     y = a @ W2[e].T + b2[e]                     f32
//     out[t] = bf16(sum_j w[t, j] * y_j)          f32, j ascending, from +0, rounded once
// apply_router_weight_on_input (SPEC 6, Llama 4): the weight scales the input instead, slot j's
// input is bf16(x[t] * bf16(w[t, j])) (the exact product rounded once), out[t] = bf16(sum_j y_j).
//
// Pipeline of one call (all on one stream, 6 to 8 launches, no atomics on any output):
//   1. group rows by expert: permute_launch (permute.cu, its stable counting sort; no row
//      copy) -> offsets[E+1], src_row[p] (p -> r) and dst_pos[r] (r -> p, -1 dropped). Rows
//      of expert e: p in [offsets[e], offsets[e+1]), in increasing r.
//   2. fe_plan (one block): per expert block of m rows, the path (FePolicy: tiled iff
//      m >= m_cross, or forced) and its work units, chunks of `unit_rows` rows (small path:
//      1, 2, 4 or 8 from T; tiled: kFeTileM), in expert order, via a block scan.
//   3. GEMM1 (x -> h bf16): fe_small over the small units x column tiles of small_cols(TB), and
//      fe_tiled over the tiled units x column tiles of kFeTileN. x rows are read in place
//      through src_row (no gathered copy). With apply_router_weight_on_input, fe_gather_weighted
//      first writes the scaled rows xg[p] = bf16(x[t] * bf16(w[t, j])) (the CPU's gather, bit for
//      bit) into y's region, which GEMM1 then reads row by row (y is written only by GEMM2).
//   4. fe_act: a = bf16(act(h)) per row (the CPU's f32 formulas, bit for bit).
//   5. GEMM2 (a -> y f32): as 3.
//   6. fe_combine: out[t] = bf16(sum over j ascending of w[t,j] * y[dst_pos[t*K+j]]), products
//      rounded then added (mul_rn / add_rn), exactly the CPU's combine (w[t,j] := 1 with
//      apply_router_weight_on_input: 1 * y == y, the unweighted sum in the same order).
// Every output element of every pass is computed by exactly one thread in a fixed order:
// the result does not depend on the launch geometry, the schedule or the GPU's size.
//
// Weights (read in SPEC's standard layout; one 16-byte chunk = 8 bf16, 16 fp8 or 32 mxfp4
// codes of one weight row, which lies in one fp8 128-block / one mxfp4 32-block of k):
//   bf16:  used as is.
//   fp8:   bf16(f32(e4m3(q)) * scale[n/128][k/128]): the reference's f32 value rounded to
//          bf16 (RNE), the rounding the CPU kernel applies (vdpbf16ps multiplies bf16), so
//          CPU and GPU multiply the same weights. e4m3 -> f32 is exact: its exponent and
//          mantissa bits shifted into f32's give e4m3 * 2^-120 (subnormals included), times
//          2^120; NaN codes (0x7f, 0xff) give NaN. The product is rounded once (mul_rn); where
//          |scale| < 2^8 and none of 8 codes is NaN, the two multiplies are one, by the exact
//          scale * 2^120 (fp8_fast).
//   mxfp4: e2m1(code) * 2^(s-127) from a 16-entry table in shared memory times the e8m0
//          scale (s = 255: NaN). Exact in f32 and in bf16 (two significant bits), so it needs
//          no rounding: the same value as the CPU's bf16 weight. The table costs one shared
//          load per weight, one issue slot like the nibble extract it replaces; computing the
//          f32 bits instead (two shifts and a mask, as fp8_top does) would put 3 integer
//          instructions per weight on the integer pipe, which at 36 mxfp4 weights per SM cycle
//          would cap the decode near 60% of the bandwidth.
//   Subnormal weights and activations are computed as IEEE says: the kernels rely on f32
//   denormals being kept (no -ftz / fast-math; neither torch's build nor the compile check
//   sets them). (The CPU at avx512_bf16 flushes them; other CPU levels keep them.)
//
// The two paths and the reduction order of one output element (h[p, n] or y[p, n]):
//   small-m (fe_small): a warp owns small_cols(TB) weight rows (output columns) and one unit of
//     <= TB rows. The K range is cut into 16-byte chunks; lane l takes chunks l, l + kWarp,
//     ... (a batch of them loaded before any is decoded), dequantizes each in registers 8
//     elements at a time and applies it to every row of the unit (fmaf, k ascending). Then
//     gemv.cuh's multi-value warp butterfly; no shared memory, no block barrier. The order
//     depends on K, the format's chunk width and the warp width only - never on T, m or the
//     unit: a token's output is the same bits alone or in any batch when every block takes
//     this path (batch invariant).
//   tiled (fe_tiled): a grouped GEMM; a block owns kFeTileM rows x kFeTileN columns and walks
//     K through a ring of shared-memory stages filled by cp.async; the weight tile of a step is
//     dequantized ONCE into shared memory as bf16 and every row reuses it (the section
//     "tiled path" below has the pipeline and its layout).
//       CUDA sm_80+: tensor cores, ldmatrix fragments and mma.sync m16n8k16 bf16 -> f32
//       (portability.h), 8 warps of 64 rows x 16 columns. The hardware's order of additions
//       inside an MMA is not specified, so this path is deterministic but not batch invariant:
//       in batch-invariant mode optimized.dispatch sends every block to the small-m path.
//       HIP, older CUDA and the CPU emulator's default builds: SIMT, each thread a 4 x 8
//       register tile with one fmaf per k in ascending order: the CPU kernel's order at its
//       scalar, avx2 and avx512 levels, so there the two agree bit for bit (tests/
//       test_gpu_emulated.py; the emulator's MMA build runs the tensor-core branch with
//       ldmatrix and the MMA emulated).
//   An exact-zero sum is +0 on every path (accumulators start at +0), so zero padding of a
//   k tail never changes a bit.
//
// Workspace (fused_experts_workspace_bytes; R = T*K): permute's workspace (status first),
// offsets (E+1) int64, src_row and dst_pos R int32, two work lists of R (expert, chunk)
// int32 pairs, h [R, 2I] bf16, a [R, I] bf16, y [R, H] f32 (rows padded to 16 bytes), each
// region 256-byte aligned. Qwen3-30B-A3B: decode T=1 106 KB; prefill T=512 52.5 MB.
//
// Floors on an H200 (~4.8 TB/s HBM3e, ~990 TFLOP/s dense bf16):
//   decode streams the routed experts' quantized weights once:
//     Qwen3-30B-A3B fp8 (E=128, K=8, H=2048, I=768): 4.72 MB per expert; T=1: 8 experts,
//     37.7 MB -> 7.9 us; T=4: ~29 experts (random routing) ~137 MB -> ~29 us; T=16: ~82,
//     ~387 MB -> ~81 us.
//     GPT-OSS-20B mxfp4 (E=32, K=4, H=I=2880, + e8m0 scales): 13.2 MB per expert; T=1:
//     52.9 MB -> 11 us; T=4: ~13 experts ~175 MB -> ~36 us.
//     Plus 6 launches (~2-3 us each outside a CUDA graph, ~1 us inside one). At full
//     bandwidth an SM must retire ~18 fp8 (36 mxfp4) weights per cycle; decoding costs ~6
//     (fp8: two shifts and a mask, one multiply, the bf16 rounding and its widening) and ~3
//     (mxfp4: nibble, table load, multiply) instructions per weight plus one FMA per row, so the small path
//     stays near the memory floor only with full occupancy and several loads in flight per
//     lane (a warp's columns x its batch of chunks, issued before decoding).
//   prefill T=512 reads each routed expert's weights once per 64-row unit and does
//     2 * rows * 3 * H * I flops: Qwen3 (4096 rows, all 128 experts, 604 MB of fp8 weights,
//     38.7 GFLOP) is bound by the weights: ~126 us to read them, ~39 us of MMAs (64 flops per
//     weight byte, below the H200's ~206); GPT-OSS (2048 rows, 423 MB, 102 GFLOP) by both:
//     ~88 us of reads, ~103 us of MMAs. The tiled kernel needs several weight loads in flight
//     per SM (its cp.async stages: 2 blocks x 2 stages x ~9 KB of fp8) and its dequantization
//     beside the MMAs (16 weights per thread per step against 16 MMAs per warp at 64 rows).
#include <type_traits>

#include "block_scan.cuh"
#include "gemv.cuh"
#include "launch.h"

namespace moelab::gpu {
namespace {

constexpr int kSmallWarps = 4;
constexpr int kSmallThreads = kSmallWarps * kWarp;
constexpr int kTileThreads = 256;                     // the tiled path: 8 warps (CUDA), 4 waves (HIP)
constexpr int kPlanThreads = 256;
constexpr int kAuxThreads = 256;
constexpr int64_t kMaxGrid = 4096;                    // GEMM blocks loop over their work items
constexpr int64_t kAlign = 256;

// Elements of one 16-byte weight chunk.
template <int Q> constexpr int kChunk = Q == kFeBF16 ? 8 : Q == kFeFP8 ? 16 : 32;

MOELAB_HD int64_t row_bytes(int q, int64_t K) { return q == kFeBF16 ? 2 * K : q == kFeFP8 ? K : K / 2; }
MOELAB_HD int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One GEMM pass over the expert blocks: out[p, n] = act[row(p)] . W[e][n] (+ bias[e][n]).
struct FeGemm {
  const uint8_t* w;         // [E][N][row_bytes(q, K)]
  const void* scale;        // fp8: f32 [E][nbn][nbk]; mxfp4: u8 [E][N][K/32]; bf16: null
  int64_t nbn, nbk;         // fp8 scale blocks along N and K
  const void* bias;         // [E][N] or null
  bool bias_bf16;
  int64_t N, K;
  const uint16_t* act;      // bf16 rows, lda elements apart
  int64_t lda;
  const int32_t* src_row;   // GEMM1: row p reads act row src_row[p] / topk; GEMM2 (null): row p
  int64_t topk;
  void* out;                // GEMM1: bf16 h; GEMM2: f32 y; row p at out + p * ldo
  int64_t ldo;
  bool out_bf16;
  const int64_t* offsets;   // [E+1]
  const int32_t* units;     // [n][2] = (expert, chunk of unit_rows rows)
  const int32_t* n_units;   // device count
  int64_t unit_rows;
  int64_t n_tiles;          // column tiles
  int64_t work;             // max units * n_tiles
};

MOELAB_DEV const uint16_t* act_row(const FeGemm& g, int64_t p) {
  const int64_t row = g.src_row != nullptr ? int64_t(g.src_row[p]) / g.topk : p;
  return g.act + row * g.lda;
}

MOELAB_DEV void store_out(const FeGemm& g, int64_t e, int64_t p, int64_t n, float v) {
  if (g.bias != nullptr) {
    const int64_t bi = e * g.N + n;
    v = add_rn(v, g.bias_bf16 ? bf16_f32(static_cast<const uint16_t*>(g.bias)[bi])
                              : static_cast<const float*>(g.bias)[bi]);
  }
  if (g.out_bf16) static_cast<uint16_t*>(g.out)[p * g.ldo + n] = f32_bf16(v);
  else static_cast<float*>(g.out)[p * g.ldo + n] = v;
}

// ------------------------------------------------------------------------ dequantization
MOELAB_DEV float e8m0_f32(uint32_t s) {
  return s == 255u ? __uint_as_float(0x7fc00000u) : s == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23);
}
// The e2m1 value of a 4-bit code (bit 3: sign): 0, .5, 1, 1.5, 2, 3, 4, 6.
MOELAB_DEV float e2m1_f32(uint32_t c) {
  const uint32_t m = c & 7u;
  const float v = m < 4u ? 0.5f * float(m) : m == 7u ? 6.0f : float(m - 2u);
  return (c & 8u) ? -v : v;
}
// bf16(f32(e4m3(b)) * scale), widened. The e4m3 bits shifted into an f32's exponent and
// mantissa fields are exactly e4m3 * 2^-120 (a normal e4m3 lands in a normal f32, a subnormal
// in a subnormal one), so * 2^120 restores e4m3(b) exactly.
// fp8_top: those f32 bits from a word whose top byte is the code (the bytes below are
// ignored): an arithmetic shift by 4 keeps the sign in bit 31 and moves the other 7 bits to
// 26..20, one mask clears the rest. From a packed word that is 3 integer instructions per
// weight (shift the byte up, shift down, mask) instead of 4 or 5 (extract, two masks, two
// shifts, or): the integer pipe, half as wide as the f32 one on sm_80 / sm_90, is what the
// small path's decode loads most (docs/gpu.md, "what should limit each path").
MOELAB_DEV float fp8_top(uint32_t top) { return __uint_as_float(uint32_t(int32_t(top) >> 4) & 0x87f00000u); }
MOELAB_DEV float fp8_bits(uint32_t b) { return fp8_top(b << 24); }
MOELAB_DEV float fp8_weight(uint32_t b, float scale) {
  if ((b & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u);          // e4m3fn NaN
  return round_bf16(mul_rn(mul_rn(fp8_bits(b), 0x1p120f), scale));
}
// Whether 8 codes (words lo, hi) may take one multiply by scale * 2^120 instead of the two
// above: the same rounded product (the same exact value e4m3 * scale, rounded once) whenever
// scale * 2^120 is exact, i.e. |scale| < 2^8 (NaN and infinite scales fail the test), and no
// code is NaN, which a zero byte of (codes & 0x7f) ^ 0x7f shows (one test per 4 codes).
MOELAB_DEV bool fp8_fast(uint32_t lo, uint32_t hi, float scale) {
  auto no_nan = [](uint32_t x) {
    const uint32_t y = (x & 0x7f7f7f7fu) ^ 0x7f7f7f7fu;
    return ((y - 0x01010101u) & ~y & 0x80808080u) == 0u;
  };
  return fabsf(scale) < 0x1p8f && no_nan(lo) && no_nan(hi);
}

MOELAB_DEV vec16 v16(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  vec16 v;
  v.x = a; v.y = b; v.z = c; v.w = d;
  return v;
}

// 16 bytes of a weight row: chunk c (bytes 16c ..). VEC: one aligned vector load; else byte
// loads with zeros past the row's end.
template <bool VEC>
MOELAB_DEV vec16 load_chunk(const uint8_t* row, int64_t c, int64_t rb) {
  if constexpr (VEC) {
    return ld16(row + c * 16);
  } else {
    uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int64_t b = c * 16 + i;
      if (b < rb) w[i >> 2] |= uint32_t(row[b]) << (8 * (i & 3));
    }
    return v16(w[0], w[1], w[2], w[3]);
  }
}

// The scale row of weight row n (fp8: its 128-row block; mxfp4: the row's e8m0 bytes).
template <int Q>
MOELAB_DEV const void* scale_row(const FeGemm& g, int64_t e, int64_t n) {
  if constexpr (Q == kFeFP8) return static_cast<const float*>(g.scale) + (e * g.nbn + n / 128) * g.nbk;
  else if constexpr (Q == kFeMXFP4) return static_cast<const uint8_t*>(g.scale) + (e * g.N + n) * (g.K / 32);
  else return nullptr;
}
template <int Q>
MOELAB_DEV float chunk_scale(const void* srow, int64_t k0) {
  if constexpr (Q == kFeFP8) return static_cast<const float*>(srow)[k0 / 128];
  else if constexpr (Q == kFeMXFP4) return e8m0_f32(static_cast<const uint8_t*>(srow)[k0 / 32]);
  else return 1.0f;
}

// Weights k = 8s .. 8s+7 of a chunk, as the f32 values of their bf16 roundings.
template <int Q, int S>
MOELAB_DEV void dequant8(vec16 v, float sc, const float* lut, float (&w)[8]) {
  if constexpr (Q == kFeBF16) {
    unpack8<Fmt::kBF16>(v, w);
  } else if constexpr (Q == kFeFP8) {
    const uint32_t lo = S == 0 ? v.x : v.z, hi = S == 0 ? v.y : v.w;
    if (fp8_fast(lo, hi, sc)) {
      const float f = mul_rn(sc, 0x1p120f);   // exact: |sc| < 2^8
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        w[q] = round_bf16(mul_rn(fp8_top(lo << (24 - 8 * q)), f));
        w[q + 4] = round_bf16(mul_rn(fp8_top(hi << (24 - 8 * q)), f));
      }
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        w[q] = fp8_weight((lo >> (8 * q)) & 0xffu, sc);
        w[q + 4] = fp8_weight((hi >> (8 * q)) & 0xffu, sc);
      }
    }
  } else {
    const uint32_t word = S == 0 ? v.x : S == 1 ? v.y : S == 2 ? v.z : v.w;
#pragma unroll
    for (int q = 0; q < 8; ++q) w[q] = mul_rn(lut[(word >> (4 * q)) & 15u], sc);
  }
}

// 8 activations (bf16 -> f32) at k of a row; zeros past K when not VEC.
template <bool VEC>
MOELAB_DEV void load_act8(const uint16_t* row, int64_t k, int64_t K, float (&x)[8]) {
  if constexpr (VEC) {
    unpack8<Fmt::kBF16>(ld16(row + k), x);
  } else {
#pragma unroll
    for (int q = 0; q < 8; ++q) x[q] = k + q < K ? bf16_f32(row[k + q]) : 0.0f;
  }
}

// ------------------------------------------------------------------------------- plan

// Work units of both paths, in expert order: small[i] / tiled[i] = (expert, chunk index);
// counts[0], counts[1] = how many. Unit counts per path fit 32 bits (<= T*K < 2^31), so the
// two scans run as one over (small | tiled << 32).
__global__ void __launch_bounds__(kPlanThreads, 1)
fe_plan(const int64_t* __restrict__ offsets, int64_t E, int policy, int64_t m_cross, int64_t small_rows,
        int32_t* __restrict__ counts, int32_t* __restrict__ small, int32_t* __restrict__ tiled) {
  __shared__ int64_t warp_sums[kPlanThreads / kWarp];
  int64_t carry = 0;
  for (int64_t e0 = 0; e0 < E; e0 += kPlanThreads) {
    const int64_t e = e0 + threadIdx.x;
    int64_t ns = 0, nt = 0;
    if (e < E) {
      const int64_t m = offsets[e + 1] - offsets[e];
      if (m > 0) {
        const bool tile = policy == kFeAllTiled || (policy == kFePerBlock && m >= m_cross);
        if (tile) nt = cdiv(m, kFeTileM);
        else ns = cdiv(m, small_rows);
      }
    }
    int64_t total;
    const int64_t before = carry + block_exclusive_scan(ns | (nt << 32), warp_sums, &total);
    const int64_t bs = before & 0xffffffffLL, bt = before >> 32;
    for (int64_t u = 0; u < ns; ++u) {
      small[2 * (bs + u)] = int32_t(e);
      small[2 * (bs + u) + 1] = int32_t(u);
    }
    for (int64_t u = 0; u < nt; ++u) {
      tiled[2 * (bt + u)] = int32_t(e);
      tiled[2 * (bt + u) + 1] = int32_t(u);
    }
    carry += total;
  }
  if (threadIdx.x == 0) {
    counts[0] = int32_t(carry & 0xffffffffLL);
    counts[1] = int32_t(carry >> 32);
  }
}

// Expert, first row and rows of unit u.
struct Unit {
  int64_t e, p0;
  int64_t m;
};
MOELAB_DEV Unit unit_of(const FeGemm& g, int64_t u) {
  const int64_t e = g.units[2 * u], c = g.units[2 * u + 1];
  const int64_t p0 = g.offsets[e] + c * g.unit_rows, left = g.offsets[e + 1] - p0;
  return {e, p0, left < g.unit_rows ? left : g.unit_rows};
}

// ------------------------------------------------------------------------- small-m path
// Each warp owns C = small_cols(TB) weight rows (output columns) of one unit of <= TB rows,
// over all of K, with no block barrier: lane l takes the 16-byte chunks l, l + kWarp,
// l + 2 kWarp, ... in batches of kSmallBatch<TB> chunks per column, all of a batch's loads
// issued before the first is decoded (a decode stream needs bytes in flight, not threads:
// docs/gpu.md, Occupancy). The unit's sums then go through gemv.cuh's multi-value butterfly,
// and the lanes that hold the totals store them.
// Launch bounds: the aligned variant (VEC: 16-byte loads, taken whenever the weight rows, x
// and its row stride are 16-byte aligned, as in every model layout) gets the decode budget,
// >= 4 blocks per SM (<= 128 registers). The unaligned variant (byte loads with bounds masks)
// keeps 2 blocks per SM (<= 255 registers): a correctness path for odd strides, not a fast one.
// On CDNA (64-lane waves) the aligned variant with 8 rows needs more than 128 VGPRs, so there
// it asks for 3 waves per SIMD (<= 168 VGPRs).
constexpr int kSmallMinBlocks = kWarp == 64 ? 3 : kDecodeMinBlocks;
// Columns per warp and chunks per column a lane loads before decoding (C x B 16-byte loads in
// flight): as many as the TB x C accumulators leave registers for within the decode budget
// (at 4 columns, 8-row units spill, and on CDNA mxfp4's 2- and 4-row units).
MOELAB_HD constexpr int small_cols(int tb) { return tb >= 8 || (kWarp == 64 && tb >= 2) ? 2 : 4; }
template <int TB> constexpr int kSmallBatch = TB == 1 ? 2 : 1;

template <int Q, int TB, bool VEC>
__global__ void __launch_bounds__(kSmallThreads, VEC ? kSmallMinBlocks : 2)
fe_small(FeGemm g) {
  constexpr int CE = kChunk<Q>, C = small_cols(TB), NV = TB * C, B = kSmallBatch<TB>;
  __shared__ float lut[16];
  if constexpr (Q == kFeMXFP4) {
    if (threadIdx.x < 16) lut[threadIdx.x] = e2m1_f32(threadIdx.x);
    __syncthreads();
  }
  const int lane = lane_id();
  const int64_t n_units = *g.n_units;
  const int64_t nchunks = cdiv(g.K, CE), rb = row_bytes(Q, g.K);
  const int64_t warps = int64_t(gridDim.x) * kSmallWarps;
  for (int64_t w = int64_t(blockIdx.x) * kSmallWarps + warp_id(); w < g.work; w += warps) {
    const int64_t u = w / g.n_tiles;
    if (u >= n_units) break;                       // warp-uniform: u grows with w
    const int64_t n0 = (w - u * g.n_tiles) * C;
    const Unit un = unit_of(g, u);
    const int m = int(un.m);
    const uint16_t* xr[TB];
#pragma unroll
    for (int t = 0; t < TB; ++t) xr[t] = act_row(g, un.p0 + (t < m ? t : 0));
    const uint8_t* wr[C];
    const void* sr[C];
#pragma unroll
    for (int r = 0; r < C; ++r) {
      const int64_t n = n0 + r < g.N ? n0 + r : g.N - 1;    // past N: a valid row, not stored
      wr[r] = g.w + (un.e * g.N + n) * rb;
      sr[r] = scale_row<Q>(g, un.e, n);
    }
    float acc[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) acc[i] = 0.0f;
    for (int64_t c0 = lane; c0 < nchunks; c0 += int64_t(B) * kWarp) {
      vec16 raw[B][C];
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const int64_t c = c0 + int64_t(b) * kWarp;
#pragma unroll
        for (int r = 0; r < C; ++r) raw[b][r] = c < nchunks ? load_chunk<VEC>(wr[r], c, rb) : vec16{};
      }
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const int64_t c = c0 + int64_t(b) * kWarp;
        if (c >= nchunks) break;                   // the lane's chunks ascend: none after this one
        const int64_t k0 = c * CE;
        float sc[C];
#pragma unroll
        for (int r = 0; r < C; ++r) sc[r] = chunk_scale<Q>(sr[r], k0);
        auto sub = [&](auto s_const) {
          constexpr int S = decltype(s_const)::value;
          const int64_t k = k0 + 8 * S;
          float wv[C][8];
#pragma unroll
          for (int r = 0; r < C; ++r) {
            dequant8<Q, S>(raw[b][r], sc[r], lut, wv[r]);
            if constexpr (!VEC) {
#pragma unroll
              for (int q = 0; q < 8; ++q)
                if (k + q >= g.K) wv[r][q] = 0.0f;
            }
          }
#pragma unroll
          for (int t = 0; t < TB; ++t) {
            if (t < m) {
              float xv[8];
              load_act8<VEC>(xr[t], k, g.K, xv);
#pragma unroll
              for (int r = 0; r < C; ++r)
#pragma unroll
                for (int q = 0; q < 8; ++q) acc[t * C + r] = fmaf(xv[q], wv[r][q], acc[t * C + r]);
            }
          }
        };
        sub(std::integral_constant<int, 0>{});
        if constexpr (CE >= 16) sub(std::integral_constant<int, 1>{});
        if constexpr (CE >= 32) {
          sub(std::integral_constant<int, 2>{});
          sub(std::integral_constant<int, 3>{});
        }
      }
    }
    warp_reduce_multi<NV>(acc);
    each_warp_total<NV>(acc, [&](int i, float v) {
      const int t = i / C, r = i - t * C;
      if (t < m && n0 + r < g.N) store_out(g, un.e, un.p0 + t, n0 + r, v);
    });
  }
}

// --------------------------------------------------------------------------- tiled path
// A grouped GEMM over the tiled units: a block owns kFeTileM rows of one expert block x
// kFeTileN output columns and walks K in steps of kTileK through a kStages-deep ring of shared
// memory stages, each holding the activation tile (kFeTileM x kTileK bf16) and the weight tile
// as stored (bf16, or the fp8 / mxfp4 codes: 1 / 0.5 bytes per weight). Step s:
//   1. wait for this thread's copies of stage s (cp.async groups), then a block barrier: stage
//      s has landed for every thread and every warp is done with step s - 1;
//   2. issue the copies of step s + kStages - 1 into the slot step s - 1 used (cp.async on
//      sm_80+: the loads of the next stages are in flight while this one computes);
//   3. fp8 / mxfp4: the codes of stage s dequantized ONCE into one bf16 tile (sB), then a barrier;
//      bf16 weights are read straight from their stage;
//   4. the products: CUDA sm_80+, each of the 8 warps owns 16 output columns x all 64 rows:
//      per 16 k, one ldmatrix.x4 gives the B fragments of its two n8 blocks, one ldmatrix.x4 per
//      16-row slice the A fragments, two mma.sync m16n8k16 per slice (slices past the unit's
//      rows skipped: a 32-row expert block costs half the MMAs); elsewhere SIMT, each thread a
//      4 x 8 register tile with one fmaf per k, k ascending (the CPU's order).
// Shared memory (static, < 48 KB: no opt-in needed), per stage: A 64 x 40 bf16 (rows padded
// by 16 bytes: the 8 row addresses of an ldmatrix fall in 8 different 16-byte bank groups),
// W: bf16 128 x 40 (the same padding), fp8 128 x 32 bytes, mxfp4 128 x 16 bytes; plus the
// dequantized tile 128 x 40 bf16 for fp8 / mxfp4. 3 stages: 46 KB (bf16), 37 KB (fp8),
// 31 KB (mxfp4).
// Cost per k step (CUDA): 4 to 16 MMAs per warp (16 to 64 rows) against, for fp8 / mxfp4, 16
// weights dequantized per thread (about 5 instructions each): the two are of the same order,
// which is why one dequantized tile serves all 64 rows and all 8 warps.
constexpr int kStages = 3;
constexpr int kTileK = 32;
constexpr int kTileLd = kTileK + 8;                   // padded bf16 row of a tile in shared memory

// Shared-memory bytes of the tiled kernel for format Q.
template <int Q> constexpr int kRawRowBytes = Q == kFeBF16 ? 2 * kTileLd : Q == kFeFP8 ? kTileK : kTileK / 2;
constexpr int kStageABytes = kFeTileM * kTileLd * 2;
template <int Q> constexpr int kStageWBytes = kFeTileN * kRawRowBytes<Q>;
template <int Q> constexpr int kTiledSmemBytes =
    kStages * (kStageABytes + kStageWBytes<Q>) + (Q == kFeBF16 ? 0 : kFeTileN * kTileLd * 2);
static_assert(kTiledSmemBytes<kFeBF16> + kFeTileM * 8 + 64 <= 48 * 1024, "the tiled kernel's static shared memory");
static_assert(kTileThreads == 4 * kFeTileM && kTileThreads == 2 * kFeTileN, "the tiled kernel's thread maps");

// Issue the copies of k step ks into a stage: the activation tile (thread t: row t / 4, 8
// elements at 8 (t % 4)) and the weight tile as stored (zeros past m, N and K). VEC: 16-byte
// cp.async (rows 16-byte aligned, K a multiple of the chunk, so a chunk is all in or all out
// of K); else plain loads with zeros past K, stored at once.
template <int Q, bool VEC>
MOELAB_DEV void tiled_issue(const FeGemm& g, int64_t e, int64_t n0, const int64_t* arow, int64_t ks, uint16_t* sA,
                            uint8_t* sW) {
  const int t = int(threadIdx.x);
  const int64_t k0 = ks * kTileK;
  {
    const int r = t >> 2, cc = t & 3;
    const int64_t k = k0 + 8 * cc;
    uint16_t* dst = sA + r * kTileLd + 8 * cc;
    if (arow[r] < 0 || k >= g.K) {
      st16(dst, vec16{});
    } else if constexpr (VEC) {
      cp_async16(dst, g.act + arow[r] + k);
    } else {
      const uint16_t* src = g.act + arow[r];
      uint32_t h[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) h[q] = k + q < g.K ? src[k + q] : 0u;
      st16(dst, v16(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16)));
    }
  }
  constexpr int CE = kChunk<Q>, CPR = kTileK / CE;    // chunks per weight row and step: 4, 2, 1
  const int64_t rb = row_bytes(Q, g.K);
  for (int i = t; i < kFeTileN * CPR; i += kTileThreads) {
    const int r = i / CPR, cc = i - r * CPR;
    const int64_t n = n0 + r, c = k0 / CE + cc;      // c: the chunk's index in its row
    uint8_t* dst = sW + r * kRawRowBytes<Q> + 16 * cc;
    if (n >= g.N || c * CE >= g.K) st16(dst, vec16{});
    else if constexpr (VEC) cp_async16(dst, g.w + (e * g.N + n) * rb + 16 * c);
    else st16(dst, load_chunk<false>(g.w + (e * g.N + n) * rb, c, rb));
  }
}

// fp8 / mxfp4: the codes of one stage -> the bf16 tile sB (zeros past N and K). Thread t takes
// row t % 128 and 16 codes: fp8 chunk t / 128 of the row's two, mxfp4 half t / 128 of its
// one 32-code chunk (t / 128 is the same for a whole warp). sc: the codes' scale.
template <int Q>
MOELAB_DEV void tiled_dequant(const FeGemm& g, int64_t n0, int64_t ks, const uint8_t* sW, float sc, const float* lut,
                              uint16_t* sB) {
  const int t = int(threadIdx.x), r = t % kFeTileN, half = t / kFeTileN;
  const int64_t kc = ks * kTileK + 16 * half;         // the first k of the thread's 16 codes
  vec16 raw = ld16(sW + r * kRawRowBytes<Q> + (Q == kFeFP8 ? 16 * half : 0));
  if constexpr (Q == kFeMXFP4) {
    if (half) raw = v16(raw.z, raw.w, 0u, 0u);
  }
  const bool live = n0 + r < g.N && kc < g.K;
  uint16_t* dst = sB + r * kTileLd + 16 * half;
  auto sub = [&](auto s_const) {
    constexpr int S = decltype(s_const)::value;
    float wv[8];
    if (live) {
      dequant8<Q, S>(raw, sc, lut, wv);
#pragma unroll
      for (int q = 0; q < 8; ++q)
        if (kc + 8 * S + q >= g.K) wv[q] = 0.0f;     // a K tail inside the chunk (unaligned rows)
    } else {
#pragma unroll
      for (int q = 0; q < 8; ++q) wv[q] = 0.0f;
    }
    st16(dst + 8 * S, v16(pack2<Fmt::kBF16>(wv[0], wv[1]), pack2<Fmt::kBF16>(wv[2], wv[3]),
                          pack2<Fmt::kBF16>(wv[4], wv[5]), pack2<Fmt::kBF16>(wv[6], wv[7])));
  };
  sub(std::integral_constant<int, 0>{});
  sub(std::integral_constant<int, 1>{});
}

// The scale of the codes tiled_dequant gives this thread at step ks (0 where it has none).
template <int Q>
MOELAB_DEV float tiled_scale(const FeGemm& g, int64_t e, int64_t n0, int64_t ks) {
  const int t = int(threadIdx.x);
  const int64_t n = n0 + t % kFeTileN, kc = ks * kTileK + 16 * (t / kFeTileN);
  if constexpr (Q == kFeBF16) return 0.0f;
  else return n < g.N && kc < g.K ? chunk_scale<Q>(scale_row<Q>(g, e, n), kc) : 0.0f;
}

template <int Q, bool VEC>
__global__ void __launch_bounds__(kTileThreads, 2)
fe_tiled(FeGemm g) {
  __shared__ vec16 smem[kTiledSmemBytes<Q> / 16];
  __shared__ int64_t arow[kFeTileM];                // element offset of each row's activations, or -1
  __shared__ float lut[16];
  uint8_t* const base = reinterpret_cast<uint8_t*>(smem);
  auto stage_a = [&](int64_t ks) { return reinterpret_cast<uint16_t*>(base + (ks % kStages) * kStageABytes); };
  auto stage_w = [&](int64_t ks) { return base + kStages * kStageABytes + (ks % kStages) * kStageWBytes<Q>; };
  uint16_t* const sB = reinterpret_cast<uint16_t*>(base + kStages * (kStageABytes + kStageWBytes<Q>));
  if constexpr (Q == kFeMXFP4) {
    if (threadIdx.x < 16) lut[threadIdx.x] = e2m1_f32(threadIdx.x);
    __syncthreads();
  }
  const int64_t n_units = *g.n_units;
  const int64_t nk = cdiv(g.K, kTileK);
  for (int64_t w = blockIdx.x; w < g.work; w += gridDim.x) {
    const int64_t u = w / g.n_tiles;
    if (u >= n_units) break;
    const int64_t n0 = (w - u * g.n_tiles) * kFeTileN;
    const Unit un = unit_of(g, u);
    for (int i = threadIdx.x; i < kFeTileM; i += kTileThreads)
      arow[i] = i < un.m ? act_row(g, un.p0 + i) - g.act : -1;
    __syncthreads();
#if MOELAB_HAS_MMA_BF16
    const int lane = lane_id(), warp = warp_id(), gq = lane >> 2, tq = lane & 3;
    const bool cols_live = n0 + 16 * warp < g.N;    // the warp's 16 columns: some inside N
    float acc[4][2][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
#else
    constexpr int TX = 16, TY = kTileThreads / TX, TM = kFeTileM / TY, TN = kFeTileN / TX;
    const int tx = int(threadIdx.x) % TX, ty = int(threadIdx.x) / TX;
    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
#endif
#pragma unroll 1
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < nk) tiled_issue<Q, VEC>(g, un.e, n0, arow, s, stage_a(s), stage_w(s));
      cp_async_commit();
    }
#pragma unroll 1
    for (int64_t ks = 0; ks < nk; ++ks) {
      const float sc = tiled_scale<Q>(g, un.e, n0, ks);   // loaded while the stage lands
      cp_async_wait<kStages - 2>();
      __syncthreads();
      if (ks + kStages - 1 < nk)
        tiled_issue<Q, VEC>(g, un.e, n0, arow, ks + kStages - 1, stage_a(ks + kStages - 1), stage_w(ks + kStages - 1));
      cp_async_commit();
      const uint16_t* a = stage_a(ks);
      const uint16_t* b = reinterpret_cast<const uint16_t*>(stage_w(ks));
      if constexpr (Q != kFeBF16) {
        tiled_dequant<Q>(g, n0, ks, stage_w(ks), sc, lut, sB);
        __syncthreads();
        b = sB;
      }
#if MOELAB_HAS_MMA_BF16
      if (cols_live) {
#pragma unroll
        for (int kk = 0; kk < kTileK; kk += 16) {
          // B: lane l hands in row 16 warp + 8 (l / 16) + l % 8, k kk + 8 ((l / 8) % 2): matrices
          // (n8 block 0, k lo), (0, k hi), (1, lo), (1, hi) = bf[0][0], bf[0][1], bf[1][0], bf[1][1].
          uint32_t bq[4];
          ldmatrix_x4(bq, b + (16 * warp + 8 * (lane >> 4) + (lane & 7)) * kTileLd + kk + 8 * ((lane >> 3) & 1));
          const uint32_t bf0[2] = {bq[0], bq[1]}, bf1[2] = {bq[2], bq[3]};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            if (16 * i >= un.m) break;
            // A: lane l hands in row 16 i + l % 16, k kk + 8 (l / 16): a[0..3] of the slice.
            uint32_t af[4];
            ldmatrix_x4(af, a + (16 * i + (lane & 15)) * kTileLd + kk + 8 * (lane >> 4));
#if defined(MOELAB_EMU) && defined(MOELAB_PLANT_MMA_LAYOUT)   // negative control (tests only)
            const uint32_t sw = af[1];
            af[1] = af[2];
            af[2] = sw;
#endif
            mma_bf16_16816(acc[i][0], af, bf0);
            mma_bf16_16816(acc[i][1], af, bf1);
          }
        }
      }
#else
      // One fmaf per k, k ascending (even then odd of each pair): the CPU's scalar order.
      for (int kk = 0; kk < kTileK; kk += 2) {
        float a0[TM], a1[TM], b0[TN], b1[TN];
#pragma unroll
        for (int i = 0; i < TM; ++i) {
          const uint32_t p = *reinterpret_cast<const uint32_t*>(a + (ty * TM + i) * kTileLd + kk);
          a0[i] = bf16_lo(p);
          a1[i] = bf16_hi(p);
        }
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          const uint32_t p = *reinterpret_cast<const uint32_t*>(b + (tx + TX * j) * kTileLd + kk);
          b0[j] = bf16_lo(p);
          b1[j] = bf16_hi(p);
        }
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) {
            acc[i][j] = fmaf(a0[i], b0[j], acc[i][j]);
            acc[i][j] = fmaf(a1[i], b1[j], acc[i][j]);
          }
      }
#endif
    }
    cp_async_wait<0>();                            // only empty groups remain
    __syncthreads();                               // stages and arow are rewritten by the next unit
#if MOELAB_HAS_MMA_BF16
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int r = 16 * i + gq + (q >= 2 ? 8 : 0);
          const int64_t n = n0 + 16 * warp + 8 * j + 2 * tq + (q & 1);
          if (r < un.m && n < g.N) store_out(g, un.e, un.p0 + r, n, acc[i][j][q]);
        }
#else
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        const int r = ty * TM + i;
        const int64_t n = n0 + tx + TX * j;
        if (r < un.m && n < g.N) store_out(g, un.e, un.p0 + r, n, acc[i][j]);
      }
#endif
  }
}

// -------------------------------------------------------------------------- activation
// The CPU kernel's f32 formulas (csrc/cpu/fused_experts_simd.h, scalar level), operation by
// operation: exp is the Cephes polynomial with the same constants and FMAs; no other
// operation is contracted (mul_rn / add_rn), so the GPU's a equals the CPU's bit for bit.
MOELAB_DEV float fe_exp(float x) {
  float xv = x > -88.0f ? x : -88.0f;              // NaN -> -88, as the CPU's max/min
  xv = xv < 88.7f ? xv : 88.7f;
  const float n = rintf(mul_rn(xv, 1.44269504088896341f));
  float r = fmaf(-n, 0.693359375f, xv);
  r = fmaf(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  const float e = fmaf(p, mul_rn(r, r), add_rn(r, 1.0f));
  return mul_rn(e, __uint_as_float(uint32_t(int32_t(n) + 127) << 23));
}
MOELAB_DEV float fe_sigmoid(float z) { return div_rn(1.0f, add_rn(1.0f, fe_exp(mul_rn(-1.0f, z)))); }

__global__ void __launch_bounds__(kAuxThreads, 1)
fe_act(const uint16_t* __restrict__ h, int64_t ldh, uint16_t* __restrict__ a, int64_t lda,
       const int64_t* __restrict__ offsets, int64_t E, int64_t I, int act, float alpha, float limit, int64_t rows) {
  const int64_t P = offsets[E] < rows ? offsets[E] : rows;
  const int64_t i0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, istep = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = blockIdx.y; p < P; p += gridDim.y) {
    const uint16_t* hr = h + p * ldh;
    for (int64_t i = i0; i < I; i += istep) {
      float v;
      if (act == kFeSilu) {
        const float gt = bf16_f32(hr[i]), up = bf16_f32(hr[I + i]);
        v = mul_rn(mul_rn(gt, fe_sigmoid(gt)), up);
      } else {
        const float gt = bf16_f32(hr[2 * i]), up = bf16_f32(hr[2 * i + 1]);
        const float gc = limit < gt ? limit : gt;                 // min(gate, limit), NaN passes
        const float um = -limit > up ? -limit : up;               // clamp(up, -limit, limit)
        const float uc = limit < um ? limit : um;
        v = mul_rn(mul_rn(gc, fe_sigmoid(mul_rn(alpha, gc))), add_rn(uc, 1.0f));
      }
      a[p * lda + i] = f32_bf16(v);
    }
  }
}

// ------------------------------------------------------------- weighted input (SPEC 6)
// bf16(x * ws) of two bf16 values widened to f32: one f32 multiply and one RNE rounding, which
// is the single rounding of the exact product (at most 16 significant bits: exact in f32 down to
// 2^-134; below that bf16 gives +-0 either way). The CPU's gather, bit for bit.
MOELAB_DEV uint16_t weighted_input(float x, float ws) { return f32_bf16(mul_rn(x, ws)); }

// GEMM1's input rows for apply_router_weight_on_input: xg[p, k] = bf16(x[t, k] * bf16(w[t, j]))
// for the routed rows p < offsets[E], slot r = src_row[p] = t*K + j; columns [H, ldg) zeroed.
__global__ void __launch_bounds__(kAuxThreads, 1)
fe_gather_weighted(const uint16_t* __restrict__ x, int64_t ldx, const float* __restrict__ w, int64_t ldw_t,
                   int64_t ldw_k, const int32_t* __restrict__ src_row, const int64_t* __restrict__ offsets, int64_t E,
                   int64_t K, int64_t H, uint16_t* __restrict__ xg, int64_t ldg, int64_t rows) {
  const int64_t P = offsets[E] < rows ? offsets[E] : rows;
  const int64_t k0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, kstep = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = blockIdx.y; p < P; p += gridDim.y) {
    const int64_t r = src_row[p], t = r / K, j = r - t * K;
    const float ws = bf16_f32(f32_bf16(w[t * ldw_t + j * ldw_k]));   // the weight rounded to bf16 first
    const uint16_t* xr = x + t * ldx;
    uint16_t* gr = xg + p * ldg;
    for (int64_t k = k0; k < ldg; k += kstep) gr[k] = k < H ? weighted_input(bf16_f32(xr[k]), ws) : uint16_t(0);
  }
}

// ----------------------------------------------------------------------------- combine
// out[t, h] = bf16(sum over j ascending with p = dst_pos[t*K+j] >= 0 of w[t,j] * y[p, h]),
// each product rounded to f32 then added, from +0 (the CPU's unpermute of the f32 y).
// unweighted (apply_router_weight_on_input): every w[t,j] reads as 1, and 1 * y == y.
template <bool VEC>
__global__ void __launch_bounds__(kAuxThreads, 1)
fe_combine(const float* __restrict__ y, int64_t ldy, const float* __restrict__ w, int64_t ldw_t, int64_t ldw_k,
           const int32_t* __restrict__ dst_pos, int64_t T, int64_t K, int64_t H, uint16_t* __restrict__ out,
           bool unweighted) {
  constexpr int NE = VEC ? 4 : 1;
  const int64_t chunks = H / NE;
  const int64_t c0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, cstep = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y)
    for (int64_t c = c0; c < chunks; c += cstep) {
      const int64_t h = c * NE;
      float acc[NE];
#pragma unroll
      for (int q = 0; q < NE; ++q) acc[q] = 0.0f;
      for (int64_t j = 0; j < K; ++j) {
        const int32_t p = dst_pos[t * K + j];
        if (p < 0) continue;
        const float wj = unweighted ? 1.0f : w[t * ldw_t + j * ldw_k];
        float v[NE];
        if constexpr (VEC) unpack4_f32(ld16(y + int64_t(p) * ldy + h), v);
        else v[0] = y[int64_t(p) * ldy + h];
#pragma unroll
        for (int q = 0; q < NE; ++q) acc[q] = add_rn(acc[q], mul_rn(wj, v[q]));
      }
      uint16_t* o = out + t * H + h;
      if constexpr (VEC) {
        uint2 pk;
        pk.x = pack2<Fmt::kBF16>(acc[0], acc[1]);
        pk.y = pack2<Fmt::kBF16>(acc[2], acc[3]);
        st_vec(reinterpret_cast<uint2*>(o), pk);
      } else {
        o[0] = f32_bf16(acc[0]);
      }
    }
}

// ------------------------------------------------------------------------------ host side
int64_t up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

struct Layout {
  int64_t perm, offsets, src_row, dst_pos, counts, small, tiled, h, a, y, total;
  int64_t perm_words, ldh, lda, ldy;
};

Layout layout(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I) {
  Layout l{};
  const int64_t R = T * K;
  int64_t cur = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = cur;
    cur += up(bytes > 0 ? bytes : 1, kAlign);
    return at;
  };
  l.perm_words = permute_workspace_words(R, E);
  l.ldh = up(2 * I, 8);
  l.lda = up(I, 8);
  l.ldy = up(H, 4);
  l.perm = take(l.perm_words * 4);
  l.offsets = take((E + 1) * 8);
  l.src_row = take(R * 4);
  l.dst_pos = take(R * 4);
  l.counts = take(2 * 4);
  l.small = take(R * 8);
  l.tiled = take(R * 8);
  l.h = take(R * l.ldh * 2);
  l.a = take(R * l.lda * 2);
  l.y = take(R * l.ldy * 4);
  l.total = cur;
  return l;
}

template <int Q, int TB>
void launch_small_tb(const FeGemm& g, bool vec, unsigned blocks, Stream s) {
  if (vec) MOELAB_LAUNCH((fe_small<Q, TB, true>), dim3(blocks), dim3(kSmallThreads), 0, s, g);
  else MOELAB_LAUNCH((fe_small<Q, TB, false>), dim3(blocks), dim3(kSmallThreads), 0, s, g);
}
template <int Q>
void launch_small(const FeGemm& g, int tb, bool vec, unsigned blocks, Stream s) {
  switch (tb) {
    case 1: launch_small_tb<Q, 1>(g, vec, blocks, s); break;
    case 2: launch_small_tb<Q, 2>(g, vec, blocks, s); break;
    case 4: launch_small_tb<Q, 4>(g, vec, blocks, s); break;
    default: launch_small_tb<Q, 8>(g, vec, blocks, s); break;
  }
}
template <int Q>
void launch_tiled(const FeGemm& g, bool vec, unsigned blocks, Stream s) {
  if (vec) MOELAB_LAUNCH((fe_tiled<Q, true>), dim3(blocks), dim3(kTileThreads), 0, s, g);
  else MOELAB_LAUNCH((fe_tiled<Q, false>), dim3(blocks), dim3(kTileThreads), 0, s, g);
}

// Upper bounds on the work units of each path (the device counts are not known here).
struct Bounds {
  int64_t small, tiled;
};
Bounds unit_bounds(int64_t R, int64_t E, int policy, int64_t m_cross, int64_t tb) {
  const int64_t blocks = E < R ? E : R;                  // non-empty expert blocks
  auto chunks = [&](int64_t nb, int64_t rows) {          // sum of ceil(m/rows), sum m <= R
    const int64_t b = (R + nb * (rows - 1)) / rows;
    return b < R ? b : R;
  };
  Bounds b{0, 0};
  if (policy == kFeAllSmall) {
    b.small = chunks(blocks, tb);
  } else if (policy == kFeAllTiled) {
    b.tiled = chunks(blocks, kFeTileM);
  } else {
    if (m_cross > 1) {                                   // small blocks have m < m_cross
      const int64_t s = chunks(blocks, tb), per = cdiv(m_cross - 1, tb);
      b.small = s < blocks * per ? s : blocks * per;
    }
    const int64_t mc = m_cross > 1 ? m_cross : 1;
    const int64_t big = R / mc < blocks ? R / mc : blocks;  // blocks with m >= m_cross
    b.tiled = big > 0 ? chunks(big, kFeTileM) : 0;
  }
  return b;
}

// One GEMM pass: both paths, each over its own unit list.
int launch_gemm(int q, FeGemm g, bool vec, const int32_t* small, const int32_t* tiled, const int32_t* counts,
                int tb, const Bounds& b, Stream s) {
  if (b.small > 0) {
    g.units = small;
    g.n_units = counts;
    g.unit_rows = tb;
    g.n_tiles = cdiv(g.N, small_cols(tb));
    g.work = b.small * g.n_tiles;                   // one warp per (unit, column tile)
    const int64_t cap = MOELAB_GRID_CAP(kMaxGrid), want = cdiv(g.work, kSmallWarps);
    const unsigned blocks = unsigned(want < cap ? want : cap);
    switch (q) {
      case kFeBF16: launch_small<kFeBF16>(g, tb, vec, blocks, s); break;
      case kFeFP8: launch_small<kFeFP8>(g, tb, vec, blocks, s); break;
      default: launch_small<kFeMXFP4>(g, tb, vec, blocks, s); break;
    }
    MOELAB_GPU_LAUNCHED();
  }
  if (b.tiled > 0) {
    g.units = tiled;
    g.n_units = counts + 1;
    g.unit_rows = kFeTileM;
    g.n_tiles = cdiv(g.N, kFeTileN);
    g.work = b.tiled * g.n_tiles;
    const int64_t cap = MOELAB_GRID_CAP(kMaxGrid);
    const unsigned blocks = unsigned(g.work < cap ? g.work : cap);
    switch (q) {
      case kFeBF16: launch_tiled<kFeBF16>(g, vec, blocks, s); break;
      case kFeFP8: launch_tiled<kFeFP8>(g, vec, blocks, s); break;
      default: launch_tiled<kFeMXFP4>(g, vec, blocks, s); break;
    }
    MOELAB_GPU_LAUNCHED();
  }
  return kOk;
}

}  // namespace

int64_t fused_experts_workspace_bytes(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I) {
  if (T < 0 || K < 1 || E < 1 || H < 1 || I < 1) return -1;
  return layout(T, K, E, H, I).total;
}

int fused_experts_launch(const FusedExpertsArgs& a, Stream s) {
  constexpr int64_t kI32Max = 0x7fffffff;
  if (a.T < 0 || a.K < 1 || a.E < 1 || a.E > kI32Max || a.H < 1 || a.I < 1 || a.H > (int64_t(1) << 24) ||
      a.I > (int64_t(1) << 24))
    return kBadArgument;
  if (a.quant != kFeBF16 && a.quant != kFeFP8 && a.quant != kFeMXFP4) return kBadArgument;
  if (a.quant == kFeMXFP4 && (a.H % 32 != 0 || a.I % 32 != 0)) return kBadArgument;
  if (a.activation != kFeSilu && a.activation != kFeSwigluOai) return kBadArgument;
  if (a.policy != kFeAllSmall && a.policy != kFeAllTiled && a.policy != kFePerBlock) return kBadArgument;
  if (a.T > kI32Max / a.K) return kBadArgument;
  if (a.T == 0) return kOk;
  if (a.x == nullptr || a.ldx < a.H || a.w13 == nullptr || a.w2 == nullptr || a.topk_weights == nullptr ||
      a.topk_ids == nullptr || a.out == nullptr || a.workspace == nullptr)
    return kBadArgument;
  if (a.quant != kFeBF16 && (a.w13_scale == nullptr || a.w2_scale == nullptr)) return kBadArgument;
  const Layout l = layout(a.T, a.K, a.E, a.H, a.I);
  if (a.workspace_bytes < l.total || (reinterpret_cast<uintptr_t>(a.workspace) & (kAlign - 1)) != 0)
    return kBadArgument;
  char* ws = static_cast<char*>(a.workspace);
  int32_t* perm_ws = reinterpret_cast<int32_t*>(ws + l.perm);
  int64_t* offsets = reinterpret_cast<int64_t*>(ws + l.offsets);
  int32_t* src_row = reinterpret_cast<int32_t*>(ws + l.src_row);
  int32_t* dst_pos = reinterpret_cast<int32_t*>(ws + l.dst_pos);
  int32_t* counts = reinterpret_cast<int32_t*>(ws + l.counts);
  int32_t* small = reinterpret_cast<int32_t*>(ws + l.small);
  int32_t* tiled = reinterpret_cast<int32_t*>(ws + l.tiled);
  uint16_t* h = reinterpret_cast<uint16_t*>(ws + l.h);
  uint16_t* act = reinterpret_cast<uint16_t*>(ws + l.a);
  float* y = reinterpret_cast<float*>(ws + l.y);
  const int64_t R = a.T * a.K;

  // 1. Rows grouped by expert: the permute op's counting sort, without its row copy.
  PermuteArgs pa{};
  pa.hidden = nullptr;
  pa.ld_bytes = 0;
  pa.row_bytes = 0;
  pa.ids = a.topk_ids;
  pa.ids_int64 = false;
  pa.ld_t = a.ldi_t;
  pa.ld_k = a.ldi_k;
  pa.expert_map = nullptr;
  pa.map_stride = 0;
  pa.T = a.T;
  pa.K = a.K;
  pa.n_experts = a.E;
  pa.n_local = a.E;
  pa.align = 1;
  pa.offsets = offsets;
  pa.hidden_out = nullptr;
  pa.src_row = src_row;
  pa.dst_pos = dst_pos;
  pa.capacity = R;
  pa.workspace = perm_ws;
  pa.workspace_words = l.perm_words;
  int st = permute_launch(pa, s);
  if (st != kOk) return st;

  // 2. Work units of both paths.
  const int tb = a.T <= 1 ? 1 : a.T <= 2 ? 2 : a.T <= 4 ? 4 : kFeSmallMaxRows;
  MOELAB_LAUNCH(fe_plan, dim3(1), dim3(kPlanThreads), 0, s, offsets, a.E, a.policy, a.m_cross, int64_t(tb), counts,
                small, tiled);
  MOELAB_GPU_LAUNCHED();
  const Bounds b = unit_bounds(R, a.E, a.policy, a.m_cross, tb);

  // 3. GEMM1: x -> h (bf16).
  const int q = a.quant;
  const int64_t nb = 128;
  FeGemm g1{};
  g1.w = static_cast<const uint8_t*>(a.w13);
  g1.scale = a.w13_scale;
  g1.N = 2 * a.I;
  g1.K = a.H;
  g1.nbn = cdiv(g1.N, nb);
  g1.nbk = cdiv(g1.K, nb);
  g1.bias = a.w13_bias;
  g1.bias_bf16 = a.w13_bias_bf16;
  g1.act = static_cast<const uint16_t*>(a.x);
  g1.lda = a.ldx;
  g1.src_row = src_row;
  g1.topk = a.K;
  bool x_vec = aligned16(a.x) && (a.ldx * 2) % 16 == 0;
  if (a.apply_router_weight_on_input) {
    // The weighted rows xg [R, ldg] bf16 in y's region (R * ldg * 2 <= R * ldy * 4 bytes, since
    // up(H, 8) <= 2 * up(H, 4)); GEMM1 reads row p at xg + p * ldg, GEMM2 overwrites it later.
    uint16_t* xg = reinterpret_cast<uint16_t*>(y);
    const int64_t ldg = up(a.H, 8);
    int64_t bx = cdiv(ldg, kAuxThreads);
    const int64_t cx = MOELAB_GRID_CAP(64), cy = MOELAB_GRID_CAP(65535);
    if (bx > cx) bx = cx;
    const int64_t by = R < cy ? R : cy;
    MOELAB_LAUNCH(fe_gather_weighted, dim3(unsigned(bx), unsigned(by)), dim3(kAuxThreads), 0, s,
                  static_cast<const uint16_t*>(a.x), a.ldx, a.topk_weights, a.ldw_t, a.ldw_k, src_row, offsets, a.E,
                  a.K, a.H, xg, ldg, R);
    MOELAB_GPU_LAUNCHED();
    g1.act = xg;
    g1.lda = ldg;
    g1.src_row = nullptr;
    x_vec = true;
  }
  g1.out = h;
  g1.ldo = l.ldh;
  g1.out_bf16 = true;
  g1.offsets = offsets;
  const bool vec1 = aligned16(a.w13) && row_bytes(q, g1.K) % 16 == 0 && x_vec;
  st = launch_gemm(q, g1, vec1, small, tiled, counts, tb, b, s);
  if (st != kOk) return st;

  // 4. Activation: h -> a (bf16).
  {
    int64_t bx = cdiv(a.I, kAuxThreads);
    const int64_t cx = MOELAB_GRID_CAP(64), cy = MOELAB_GRID_CAP(65535);
    if (bx > cx) bx = cx;
    const int64_t by = R < cy ? R : cy;
    MOELAB_LAUNCH(fe_act, dim3(unsigned(bx), unsigned(by)), dim3(kAuxThreads), 0, s, h, l.ldh, act, l.lda, offsets,
                  a.E, a.I, a.activation, a.alpha, a.limit, R);
    MOELAB_GPU_LAUNCHED();
  }

  // 5. GEMM2: a -> y (f32).
  FeGemm g2 = g1;
  g2.w = static_cast<const uint8_t*>(a.w2);
  g2.scale = a.w2_scale;
  g2.N = a.H;
  g2.K = a.I;
  g2.nbn = cdiv(g2.N, nb);
  g2.nbk = cdiv(g2.K, nb);
  g2.bias = a.w2_bias;
  g2.bias_bf16 = a.w2_bias_bf16;
  g2.act = act;
  g2.lda = l.lda;
  g2.src_row = nullptr;
  g2.out = y;
  g2.ldo = l.ldy;
  g2.out_bf16 = false;
  const bool vec2 = aligned16(a.w2) && row_bytes(q, g2.K) % 16 == 0;
  st = launch_gemm(q, g2, vec2, small, tiled, counts, tb, b, s);
  if (st != kOk) return st;

  // 6. Combine over j in f32, one bf16 rounding.
  {
    const bool vec = a.H % 4 == 0 && (reinterpret_cast<uintptr_t>(a.out) & 7u) == 0;
    const int64_t chunks = vec ? a.H / 4 : a.H;
    int64_t bx = cdiv(chunks, kAuxThreads);
    const int64_t cx = MOELAB_GRID_CAP(1024), cy = MOELAB_GRID_CAP(65535);
    if (bx > cx) bx = cx;
    const dim3 grid(unsigned(bx), unsigned(a.T < cy ? a.T : cy));
    if (vec)
      MOELAB_LAUNCH(fe_combine<true>, grid, dim3(kAuxThreads), 0, s, y, l.ldy, a.topk_weights, a.ldw_t, a.ldw_k,
                    dst_pos, a.T, a.K, a.H, a.out, a.apply_router_weight_on_input);
    else
      MOELAB_LAUNCH(fe_combine<false>, grid, dim3(kAuxThreads), 0, s, y, l.ldy, a.topk_weights, a.ldw_t, a.ldw_k,
                    dst_pos, a.T, a.K, a.H, a.out, a.apply_router_weight_on_input);
    MOELAB_GPU_LAUNCHED();
  }
  return kOk;
}

}  // namespace moelab::gpu
