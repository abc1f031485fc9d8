// The torch-free API of the moelab GPU kernels: raw pointers, sizes and a stream in, a
// status code out. Host-only (includes the runtime API, not the device headers), so the
// thin torch bindings (csrc/torch_gpu/) and any other host program can call it.
//
// Every launcher checks the arguments its kernels rely on and returns a negative Status
// without launching when they are unsupported; a positive return is the runtime's own error
// code from the launch (cudaError_t / hipError_t; status_string() words both). Kernels never
// read or write outside the buffers the arguments describe, even for hostile index data:
// index errors found on the device are reported through a status word (permute, unpermute)
// that the caller reads back.
#pragma once

#include <cstdint>

#include "platform.h"
#if defined(MOELAB_EMU)
#include "emu/emu.h"
#elif MOELAB_HIP
#include <hip/hip_runtime_api.h>
#else
#include <cuda_runtime_api.h>
#endif

#include "../common/formats.h"

namespace moelab::gpu {

#if MOELAB_HIP
using Stream = hipStream_t;
#else
using Stream = cudaStream_t;
#endif

enum Status : int {
  kOk = 0,
  kBadArgument = -1,   // a size, pointer or stride a kernel cannot take
  kUnsupported = -2,   // valid for the op, but outside what this GPU kernel implements
};
// Text of a Status, or of a runtime error code (> 0).
const char* status_string(int status);

// Lanes per warp of the compiled kernels (32 CUDA, 64 AMD), for bindings and tests.
int warp_size();

// ------------------------------------------------------------------------------ route
// Method codes: the same numbers as the CPU kernel's (csrc/cpu/route.h).
enum RouteMethod : int {
  kSoftmaxTopk = 0, kTopkSoftmax = 1, kSigmoidTopk = 2, kSigmoidBias = 3,
  kGroupedSigmoidBias = 4, kLlama4 = 5, kGroupedSoftmax = 6, kSoftmaxBias = 7,
};
constexpr int kRouteMaxExperts = 2048, kRouteMaxTopK = 32, kRouteMaxGroups = 32,
              kRouteMaxGroupedExperts = 1024;

struct RouteArgs {
  const void* logits;   // [T, E], rows `ld` elements apart, unit stride along E
  Fmt fmt;              // f32, bf16 or f16
  int64_t ld;
  const void* bias;     // [E] contiguous, f32 or bf16 (biased methods: sigmoid_bias,
                        // grouped_sigmoid_bias, softmax_bias), else nullptr
  Fmt bias_fmt;
  int method;           // RouteMethod
  int64_t T;
  int E, K, n_group, topk_group;
  float scaling;        // every method's final weights times scaling (SPEC 6)
  bool renormalize;     // resolved (the binding applies the method's default)
  float norm_eps;       // resolved epsilon: (sum + eps) biased sigmoid, max(sum, eps) sigmoid_topk
                        // and softmax_bias; unused by the other methods
  float* weights;       // [T, K] f32 out, contiguous
  int32_t* ids;         // [T, K] int32 out, contiguous
  int selection = 0;    // RouteSelection; only moelab::route_variant sets another
};
// Selection algorithm (seed 004's before/after pair). kSelectLanes: the tier table (what
// moelab::route runs). kSelectSerial: seed 004's "before", reachable only by name
// (moelab::route_variant: experiments, tests, verify): one block per token whose warp 0
// alone scans every expert serially (each lane keeps a sorted K-slot list of its strided
// experts) and merges by K warp arg-max rounds, while the other warps wait. Same outputs.
enum RouteSelection : int { kSelectLanes = 0, kSelectSerial = 1 };

// The kernel a call with (E, K) takes: one row of the tier table in route.cu.
struct RoutePlan {
  int row;              // index in the table
  bool block;           // false: one warp per token; true: one block per token
  int per_lane;         // experts held per lane (warp tier) / per thread (block tier)
  int threads;          // threads per block
  const char* reason;   // the table row's reason, for optimized.dispatch.explain
};
int route_plan(int E, int K, RoutePlan* plan);   // kOk, or kUnsupported outside the table
int route_launch(const RouteArgs& args, Stream stream);

// -------------------------------------------------------------------- permute / unpermute
// Workspace of permute, in int32 words, for R = T*K routed rows and E_loc local experts:
// a status block plus one expert histogram per unit of rows. Monotone in R, so a buffer
// sized for the largest R fits every smaller call.
int64_t permute_workspace_words(int64_t rows, int64_t n_local);
// Status block at the start of the workspace (words): [0] = 0, or 1 (an id outside
// [-1, n_experts)), 2 (an expert_map entry outside [-1, E_loc)), 3 (inconsistent passes:
// the ids changed while the kernels ran); [2, 3] = the offending value (int64, little end).
constexpr int kPermuteStatusWords = 4;

struct PermuteArgs {
  const void* hidden;       // [T, H], rows ld_bytes apart, unit stride along H
  int64_t ld_bytes, row_bytes;   // row_bytes = H * element size
  const void* ids;          // [T, K], element (t, j) at ids + t*ld_t + j*ld_k
  bool ids_int64;
  int64_t ld_t, ld_k;
  const int32_t* expert_map;     // nullable: [n_experts] int32, map_stride apart
  int64_t map_stride;
  int64_t T, K, n_experts, n_local, align;
  int64_t* offsets;         // [n_local + 1] out
  void* hidden_out;         // [capacity, H] out (row_bytes apart)
  int32_t* src_row;         // [capacity] out
  int32_t* dst_pos;         // [T*K] out
  int64_t capacity;         // T*K + n_local*(align - 1)
  int32_t* workspace;       // permute_workspace_words(T*K, n_local) words
  int64_t workspace_words;
};
int permute_launch(const PermuteArgs& args, Stream stream);

struct UnpermuteArgs {
  const void* expert_out;   // [rows, H], rows ld elements apart, unit stride along H
  Fmt fmt;
  int64_t ld, rows, H;
  const float* weights;     // [T, K] at weights + t*ldw_t + j*ldw_k
  int64_t ldw_t, ldw_k;
  const int32_t* dst_pos;   // [T*K] contiguous
  int64_t T, K;
  void* out;                // [T, H] contiguous, fmt
  int32_t* status;          // nullable: set to 1 when a dst_pos entry is outside [-1, rows)
};
int unpermute_launch(const UnpermuteArgs& args, Stream stream);

// ------------------------------------------------------------------------- router_gemm
// out[T, E] f32 = f32(x[T, H]) @ w[E, H].T; x rows ldx elements apart; w rows ldw apart.
int router_gemm_launch(const void* x, Fmt fx, int64_t ldx, const float* w, int64_t ldw,
                       float* out, int64_t T, int64_t H, int64_t E, Stream stream);

// ------------------------------------------------------------------------- skinny_gemm
// out[T, N] (fmt) = x[T, K] @ w[N, K].T (+ bias[N]), f32 accumulation, T <= 8.
constexpr int kSkinnyMaxT = 8;
int skinny_gemm_launch(const void* x, int64_t ldx, const void* w, int64_t ldw, const void* bias,
                       void* out, Fmt fmt, int64_t T, int64_t K, int64_t N, Stream stream);

// ----------------------------------------------------------------------- fused_experts
// SPEC 5's expert MLPs (csrc/gpu/fused_experts.cu has the algorithm). Codes shared with the
// CPU binding: FeQuant = fe::Quant, FePolicy = cpu::FePolicy, so optimized.dispatch hands
// both devices the same numbers. Per expert block of m rows: the small-m path (weights
// streamed and dequantized in registers; "tiny") or the tiled path (a weight tile dequantized
// once into shared memory as bf16; "blocked"): tiled iff policy == kFeAllTiled, or
// policy == kFePerBlock and m >= m_cross.
enum FeQuant : int { kFeBF16 = 0, kFeFP8 = 1, kFeMXFP4 = 2 };
enum FePolicy : int { kFeAllSmall = 0, kFeAllTiled = 1, kFePerBlock = 2 };
enum FeActivation : int { kFeSilu = 0, kFeSwigluOai = 1 };
constexpr int kFeTileM = 64;          // rows of an expert block per tiled-path unit
constexpr int kFeTileN = 128;         // output columns per tiled-path block
constexpr int kFeSmallMaxRows = 8;    // rows per small-path unit (1, 2, 4 or 8, from T)

struct FusedExpertsArgs {
  const void* x;              // [T, H] bf16, rows ldx elements apart, unit stride along H
  int64_t ldx;
  const void* w13;            // standard layout, contiguous: bf16/f8 [E, 2I, H], mxfp4 u8 [E, 2I, H/2]
  const void* w2;             // bf16/f8 [E, H, I], mxfp4 u8 [E, H, I/2]
  const void* w13_scale;      // fp8: f32 [E, ceil(2I/128), ceil(H/128)]; mxfp4: u8 [E, 2I, H/32]; bf16: null
  const void* w2_scale;       // fp8: f32 [E, ceil(H/128), ceil(I/128)]; mxfp4: u8 [E, H, I/32]; bf16: null
  const void* w13_bias;       // nullable: [E, 2I] contiguous, f32 or bf16 (w13_bias_bf16)
  const void* w2_bias;        // nullable: [E, H]
  bool w13_bias_bf16, w2_bias_bf16;
  const float* topk_weights;  // [T, K] at topk_weights + t*ldw_t + j*ldw_k
  int64_t ldw_t, ldw_k;
  const int32_t* topk_ids;    // [T, K] at topk_ids + t*ldi_t + j*ldi_k; -1 drops the slot
  int64_t ldi_t, ldi_k;
  int quant;                  // FeQuant
  int activation;             // FeActivation
  float alpha, limit;         // swiglu_oai
  int64_t T, K, E, H, I;
  int policy;                 // FePolicy
  int64_t m_cross;
  bool apply_router_weight_on_input;   // SPEC 6: slot j's input is bf16(x[t] * bf16(w[t, j])),
                                       // out[t] = bf16(sum_j y_j) unweighted (false: SPEC 5)
  uint16_t* out;              // [T, H] bf16, contiguous
  void* workspace;            // fused_experts_workspace_bytes(T, K, E, H, I) bytes, 256-byte aligned
  int64_t workspace_bytes;
};
// Workspace of one call: the row grouping (permute's workspace, whose first
// kPermuteStatusWords int32 are the status block: [0] = 1 when an id is outside
// [-1, E), the value at [2, 3]), offsets, src_row, dst_pos, the work lists, and the
// intermediates h [T*K, 2I] bf16, a [T*K, I] bf16 and y [T*K, H] f32 (rows padded to 16 bytes).
// With apply_router_weight_on_input the weighted rows of GEMM1's input live in y's region until
// GEMM2 overwrites it: the size does not depend on the flag.
int64_t fused_experts_workspace_bytes(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I);
int fused_experts_launch(const FusedExpertsArgs& args, Stream stream);

}  // namespace moelab::gpu
