// route's CPU kernel (SPEC section 1), declared at each ISA level (see isa_dispatch.h).
// Torch-free: the binding fills RouteParams with raw pointers and sizes, checks everything
// the kernel relies on, and hands out token ranges [t0, t1) through at::parallel_for.
#pragma once
#include <cstdint>

#include "../common/formats.h"
#include "isa_dispatch.h"

namespace moelab::cpu {

// Method codes; the op schema takes the method by name and the binding maps it here.
enum RouteMethod : int {
  kSoftmaxTopk = 0,         // key p = softmax(x); weight p (renormalize: / sum)
  kTopkSoftmax = 1,         // key x; weight softmax over the K selected x
  kSigmoidTopk = 2,         // key s = sigmoid(x); weight s (renormalize: / max(sum, norm_eps))
  kSigmoidBias = 3,         // key s + bias; weight s * scaling (renormalize: / (sum s + norm_eps))
  kGroupedSigmoidBias = 4,  // as kSigmoidBias, keys of dropped groups (top-2 sum) set to -inf first
  kLlama4 = 5,              // key x; weight sigmoid(x), K = 1
  kGroupedSoftmax = 6,      // as kSoftmaxTopk, keys of dropped groups (largest p) set to -inf first
  kSoftmaxBias = 7,         // key p + bias; weight p (renormalize: / max(sum, norm_eps))
};
// Every method's weights end multiplied by scaling (the biased sigmoid methods inside their
// formula: s * scaling / (sum + eps)); scaling = 1 is exact.

// Selection algorithm (seed 004's before/after pair on the CPU). kSelectLanes is the kernel
// every dispatch takes (the file comment of route_kernel.h, step 3). kSelectSerial is the
// seed's "before" as a CPU analogue, reachable only through moelab::route_variant (experiments,
// tests, verify): one scalar pass over all E order keys, offering each to a sorted top-K list
// (insertion above the running K-th best), with no vector work in the selection and no lane
// sink in the key pass. Both return the K largest composites, so ids and weights are the same
// bits.
enum RouteSelection : int { kSelectLanes = 0, kSelectSerial = 1 };

constexpr int kRouteMaxExperts = 2048;
constexpr int kRouteMaxTopK = 32;
constexpr int kRouteMaxGroups = 32;

struct RouteParams {
  const void* logits;   // [T, E], rows `ld` elements apart, unit stride along E
  Fmt fmt;              // f32, bf16 or f16
  int64_t ld;
  const void* bias;     // [E] contiguous (biased methods only: sigmoid_bias, grouped_sigmoid_bias,
                        // softmax_bias), f32 or bf16
  Fmt bias_fmt;
  int method;           // RouteMethod
  int E, K;             // 1 <= K <= min(E, 32), E <= 2048
  int n_group, topk_group;
  float scaling;
  bool renormalize;     // resolved by the binding (the method's default where unset)
  float norm_eps;       // resolved f32 epsilon of the normalization (unused where none)
  float* weights;       // [T, K] f32 out
  int32_t* ids;         // [T, K] int32 out
  int selection = kSelectLanes;   // RouteSelection; only moelab::route_variant sets another
};

}  // namespace moelab::cpu

// Tokens [t0, t1) of one call; every element of their output rows is written.
MOELAB_CPU_KERNEL(void, route_tokens, (const moelab::cpu::RouteParams& p, int64_t t0, int64_t t1))
