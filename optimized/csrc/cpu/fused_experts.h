// fused_experts' CPU kernels, declared at each ISA level (see isa_dispatch.h), and the
// ISA-independent description of one GEMM pass that the binding hands them.
// Torch-free: raw pointers and sizes. fused_experts_schedule.h runs the pipeline and the
// passes over these kernels; the binding (csrc/torch/fused_experts.cpp) checks the tensors,
// allocates, and lends it torch's thread pool. The algorithm, layout and costs are in
// docs/fused_experts.md and fused_experts_kernel.h.
#pragma once
#include <cstdint>

#include "../common/formats.h"
#include "fused_experts_pack.h"
#include "isa_dispatch.h"

namespace moelab::cpu {

// Which micro-kernel an expert block takes (decided in optimized/dispatch.py).
enum FePolicy : int {
  kFeAllTiny = 0,      // every block: tiny
  kFeAllBlocked = 1,   // every block: blocked
  kFePerBlock = 2,     // block of m rows: blocked iff m >= m_cross
};

// One GEMM pass (GEMM1: x -> h, or GEMM2: a -> y) over work items (expert, 64-column tile).
// Rows of expert e are p in [offsets[e], offsets[e+1]) of `a` and `out`.
struct FeGemm {
  int quant;                 // fe::Quant
  bool packed;               // w / scale in the prepacked layout (fused_experts_pack.h)
  const uint8_t* w;          // packed: [E][N16 * group_bytes]; standard: [E][N][row bytes]
  const void* scale;         // fp8: f32 [E][ceil(N/128)][ceil(K/128)]; mxfp4: packed
                             // [E][N16][K/32][16] or standard [E][N][K/32] bytes; bf16: null
  const uint8_t* slow;       // packed only: [E][n_tiles] "needs the exact decoder" flags
  int64_t N, K;              // output features, input features (logical)
  const uint16_t* a;         // bf16 rows, lda elements apart, lda >= 2*ceil(K/2), zero padded
  int64_t lda;
  const void* bias;          // [E][N] or null
  int bias_bf16;             // bias dtype: 0 f32, 1 bf16
  bool out_bf16;             // GEMM1: round to bf16; GEMM2: f32
  const float* init;         // f32 outputs only: the accumulators start from init's rows (ldo
                             // apart, like out; may be out itself) instead of +0, so a pass over
                             // a slice of K continues the dp sequence of the slices before it
                             // (the parallel layer's exact tensor-parallel chain); null: +0
  void* out;                 // rows ldo elements apart
  int64_t ldo;
  const int64_t* offsets;    // [E+1]
  const int32_t* items;      // [n_items][2] = (expert, tile)
  int policy;                // FePolicy
  int64_t m_cross;
  bool mx_scaled;            // mxfp4's blocked fast path decodes the tile scaled (the exact
                             // weights: no rescaling; fused_experts_kernel.h, micro_tee). Set
                             // only where that gives the same bits as the rescaled units: no
                             // init, K <= 2^20, and every element of a's rows 0 or of magnitude
                             // in [2^-47, 2^40) (fused_experts_mx_range)
  bool stream_ahead;         // single-row bf16 items (decode) prefetch their own tile ahead of
                             // their loads; the binding sets it on two or more threads
};

}  // namespace moelab::cpu

// Work items [i0, i1) of one GEMM pass. Each item prefetches the next one's weights while it
// computes; with i_next > i1 the last one prefetches item i1 too (the caller will most likely
// run it next: a hint, never a dependence). scratch: fe::scratch_bytes(quant, K) bytes, owned
// by the calling thread for the duration of the call.
MOELAB_CPU_KERNEL(void, fused_experts_gemm,
                  (const moelab::cpu::FeGemm& g, int64_t i0, int64_t i1, int64_t i_next, uint8_t* scratch))

// Whether every element of rows [p0, p1) of a (n bf16 values each, lda apart) is +-0 or of
// magnitude in [2^-47, 2^40) (bf16 bits & 0x7fff in [0x2800, 0x537f]): FeGemm::mx_scaled's
// condition on the GEMM's input. false below the avx512 levels (their blocked path always
// rescales: it has no plain-units first chunk).
MOELAB_CPU_KERNEL(bool, fused_experts_mx_range,
                  (const uint16_t* a, int64_t lda, int64_t n, int64_t p0, int64_t p1))

// Rows [p0, p1) of the activation: h[p] (2I bf16, ldh apart) -> a[p] (I bf16, lda apart;
// a[p][I] is zeroed when lda > I, the pad of an odd I). act: 0 silu, 1 swiglu_oai.
MOELAB_CPU_KERNEL(void, fused_experts_act,
                  (const uint16_t* h, int64_t ldh, uint16_t* a, int64_t lda, int64_t I, int act,
                   float alpha, float limit, int64_t p0, int64_t p1))

// dst[i] = bf16(src[i]) for i in [0, n): round to nearest even, as torch's .to(bfloat16) (the
// combine's one rounding of the layer output).
MOELAB_CPU_KERNEL(void, fused_experts_to_bf16, (const float* src, uint16_t* dst, int64_t n))

// Rows [p0, p1) of GEMM1's input with the router weight applied to it
// (apply_router_weight_on_input, SPEC 6): row p = slot r = src_row[p] = t*K + j gets
// xg[p][k] = bf16(x[t][k] * bf16(w[t, j])), the exact product rounded once (RNE), for k < H;
// xg[p][k] = 0 for H <= k < ldg (the pad of an odd H). x rows ldx elements apart (unit stride
// along H); w[t, j] at w + t*ldw_t + j*ldw_k.
MOELAB_CPU_KERNEL(void, fused_experts_gather_weighted,
                  (const uint16_t* x, int64_t ldx, const float* w, int64_t ldw_t, int64_t ldw_k,
                   const int32_t* src_row, int64_t K, int64_t H, uint16_t* xg, int64_t ldg, int64_t p0,
                   int64_t p1))
