// route on the GPU: top-k expert selection (SPEC section 1), CUDA and HIP from one source.
//
// Keys. Each expert's f32 key (softmax p, logit x, sigmoid s, s + bias, p + bias) becomes a 32-bit
// *order key* ok (okey()): unsigned order of ok == the contract's total order (NaN above
// +inf, NaNs equal, -0 == +0). The composite c = (ok << 32) | (0xFFFFFFFF - index) is unique
// per expert and its unsigned order ranks equal keys lower index first, so "the K largest
// composites" is exactly the contract's top K and any correct selection gives the same ids.
// sigmoid and softmax are evaluated in f64 and rounded once to f32, as reference/route.py
// does, so the keys (hence the ids) are those of the reference and of the CPU kernel wherever
// the CPU's f32 sigmoid/exp round the same way (verify counts the rest as near-tie flips).
//
// Tiers, chosen from (E, K) by ONE table (kTiers below; route_plan() reads it, and
// optimized.dispatch.explain reports the row):
//   warp   one warp per token; lane l holds experts l + kWarp*i, i < P (P = 1..16 per lane,
//          registers). Selection: K rounds of a warp arg-max of the lanes' best composites;
//          the winner's owner clears it. Cost per round: P compares + log2(kWarp) 64-bit
//          shuffles.
//   block  one block of 256 threads per token (seed 004's lane-owned top-k, for E 512..2048
//          and K 9..32): each thread sorts the P <= 8 composites it owns (its own top-k
//          candidate list, in registers), each worker warp reduces its lanes' lists to the
//          warp's top K (K rounds of arg-max over the list heads), and the warps' lists are
//          merged pairwise in shared memory, log2(warps) levels, by rank (an element's rank
//          in the union = its index in its list + the elements of the other list above it).
//   serial seed 004's "before", never chosen by the table: only route_variant(selection =
//          "serial") launches it (kSelectSerial; experiments, tests, verify). The block tier's
//          launch and keys, then warp 0 alone selects: each lane inserts its strided experts
//          (E / kWarp of them, one after another) into a sorted K-slot list, then K warp
//          arg-max rounds over the list heads; the other warps wait. Same ids and weights.
// Grouped methods (both tiers): per group, the top two order keys (a warp reduction of
// (max, second max) pairs); score = f32 sum of their values (grouped_sigmoid_bias, DeepSeek-V3)
// or the largest alone (grouped_softmax, DeepSeek-V2 group_limited_greedy); the topk_group
// best groups kept (rank by counting, ties to the lower group), the keys of the other groups
// set to -inf.
//
// Weights (lane j holds slot j): sums over the K selected run in increasing j, f32 (f64 for
// the softmax over the K selected, rounded once), then the normalization (renormalize and
// norm_eps arrive resolved) and scaling: exactly the reference's formulas and f32 operations.
//
// Floors (H200: ~4.8 TB/s HBM, a few us per launch): bytes = T*E*sizeof(logits) + T*K*8;
// seed 004's shape T = 512, E = 896, K = 16, f32 logits: 1.8 MB -> ~0.4 us of memory, so a
// launch (~2-3 us, less in a CUDA graph) is the floor; the block tier's merge work per token
// (~1-2 thousand instructions per warp) hides under it at 4 tokens per SM.
#include "launch.h"
#include "portability.h"

namespace moelab::gpu {
namespace {

// ------------------------------------------------------------------ order keys
MOELAB_DEV uint32_t okey(float f) {
  uint32_t u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;                           // -0 == +0
  const uint32_t k = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return f != f ? 0xffffffffu : k;                       // every NaN above +inf
}
MOELAB_DEV float okey_value(uint32_t k) {                // -0 comes back as +0
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
constexpr uint32_t kOkNegInf = 0x007fffffu;              // okey(-inf)
MOELAB_DEV uint64_t composite(uint32_t ok, uint32_t idx) { return (uint64_t(ok) << 32) | (0xffffffffu - idx); }
MOELAB_DEV uint32_t comp_index(uint64_t c) { return 0xffffffffu - uint32_t(c); }
MOELAB_DEV uint32_t comp_okey(uint64_t c) { return uint32_t(c >> 32); }
// 0 is below every real composite (ok >= okey(-inf) > 0): "no candidate".

MOELAB_DEV uint64_t umax64(uint64_t a, uint64_t b) { return a > b ? a : b; }
MOELAB_DEV uint64_t warp_max64(uint64_t v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v = umax64(v, shfl_xor(v, off));
  return v;
}
MOELAB_DEV float warp_maxf(float v) {                    // NaN-free inputs
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v = fmaxf(v, shfl_xor(v, off));
  return v;
}
// Butterfly sums: every lane ends with the same bits (each step adds a pair both ways).
MOELAB_DEV double warp_sum_d(double v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v = v + shfl_xor(v, off);
  return v;
}
// (largest, second largest) of a multiset of order keys, merged across the warp.
MOELAB_DEV void top2_merge(uint32_t& b1, uint32_t& b2, uint32_t c1, uint32_t c2) {
  const uint32_t hi = b1 > c1 ? b1 : c1, lo = b1 > c1 ? c1 : b1;
  const uint32_t second = b2 > c2 ? b2 : c2;
  b1 = hi;
  b2 = lo > second ? lo : second;
}
MOELAB_DEV void warp_top2(uint32_t& b1, uint32_t& b2) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const uint32_t c1 = shfl_xor(b1, off), c2 = shfl_xor(b2, off);
    top2_merge(b1, b2, c1, c2);
  }
}
MOELAB_DEV void top2_push(uint32_t& b1, uint32_t& b2, uint32_t o) {
  if (o > b1) { b2 = b1; b1 = o; }
  else if (o > b2) b2 = o;
}

// ---------------------------------------------------------------------- arithmetic
// The exact function evaluated in f64 and rounded once to f32, as the reference does.
MOELAB_DEV float sigmoid_rn(float x) { return float(1.0 / (1.0 + exp(-double(x)))); }

__host__ __device__ inline bool is_softmax_key(int m) {
  return m == kSoftmaxTopk || m == kGroupedSoftmax || m == kSoftmaxBias;
}
__host__ __device__ inline bool is_grouped(int m) { return m == kGroupedSigmoidBias || m == kGroupedSoftmax; }

MOELAB_DEV float load_bias(const RouteArgs& a, int e) {
  return a.bias_fmt == Fmt::kBF16 ? bf16_f32(static_cast<const uint16_t*>(a.bias)[e])
                                  : static_cast<const float*>(a.bias)[e];
}

// --------------------------------------------------------------- the tier table
enum Tier : int { kTierWarp = 0, kTierBlock = 1 };
constexpr int kBlockThreads = 256;
struct TierRow {
  int min_e, max_e, min_k, max_k;
  Tier tier;
  int per_lane;          // warp tier: experts per lane (E <= per_lane * kWarp); block: 0 = from E
  const char* reason;
};
// First matching row wins. In units of kWarp, so AMD (64 lanes) gets its own boundaries.
constexpr TierRow kTiers[] = {
    {1, kWarp, 1, 32, kTierWarp, 1, "E <= warp size: one warp per token, 1 expert per lane"},
    {kWarp + 1, 2 * kWarp, 1, 32, kTierWarp, 2, "one warp per token, 2 experts per lane"},
    {2 * kWarp + 1, 4 * kWarp, 1, 32, kTierWarp, 4, "one warp per token, 4 experts per lane"},
    {512, 2048, 9, 32, kTierBlock, 0,
     "E 512..2048 with K 9..32 (seed 004): a block per token, lane-owned top-k candidates, "
     "warps merged pairwise"},
    {4 * kWarp + 1, 8 * kWarp, 1, 32, kTierWarp, 8, "one warp per token, 8 experts per lane"},
    {8 * kWarp + 1, 16 * kWarp, 1, 32, kTierWarp, 16, "one warp per token, 16 experts per lane"},
    {16 * kWarp + 1, 2048, 1, 32, kTierBlock, 0,
     "E above 16 experts per lane: a block per token, lane-owned top-k candidates"},
};
constexpr int kNumTiers = int(sizeof(kTiers) / sizeof(kTiers[0]));

int block_per_thread(int E) {           // 256 threads: E <= 512 -> 2, <= 1024 -> 4, else 8
  const int need = (E + kBlockThreads - 1) / kBlockThreads;
  return need <= 2 ? 2 : need <= 4 ? 4 : 8;
}

// ------------------------------------------------------------ keys of one expert
// Order key of expert e (< E) from its logit x; the softmax key needs the row's max m and
// 1 / sum: p = f32(exp(x - m) / sum) evaluated in f64.
struct SoftmaxRow {
  double m, sum;
  bool bad;              // a NaN in the row or a non-finite max: every p is NaN
};
MOELAB_DEV float softmax_p(float x, const SoftmaxRow& sm) {
  return sm.bad ? __int_as_float(0x7fc00000) : float(exp(double(x) - sm.m) / sm.sum);
}
MOELAB_DEV uint32_t key_of(const RouteArgs& a, int e, float x, const SoftmaxRow& sm) {
  switch (a.method) {
    case kSoftmaxTopk:
    case kGroupedSoftmax: return okey(softmax_p(x, sm));     // a bad row: every p is NaN
    case kSoftmaxBias: return okey(softmax_p(x, sm) + load_bias(a, e));   // f32 add
    case kTopkSoftmax:
    case kLlama4: return okey(x);
    case kSigmoidTopk: return okey(sigmoid_rn(x));
    default: return okey(sigmoid_rn(x) + load_bias(a, e));    // f32 add, as the reference
  }
}

// ----------------------------------------------------------- weights of the K slots
// Lane j < K holds slot j's composite c (all lanes of the warp call this; K <= 32 <= kWarp).
// row: the token's logits. Writes weights and ids of token t.
MOELAB_DEV float load_logit(const RouteArgs& a, const void* row, int e) {
  switch (a.fmt) {
    case Fmt::kBF16: return load_elem<Fmt::kBF16>(row, e);
    case Fmt::kF16: return load_elem<Fmt::kF16>(row, e);
    default: return load_elem<Fmt::kF32>(row, e);
  }
}
MOELAB_DEV const void* logits_row(const RouteArgs& a, int64_t t) {
  return static_cast<const char*>(a.logits) + t * a.ld * (a.fmt == Fmt::kF32 ? 4 : 2);
}

MOELAB_DEV void write_slots(const RouteArgs& a, const void* row, int64_t t, uint64_t c, const SoftmaxRow& sm) {
  const int lane = lane_id();
  const int K = a.K;
  const bool mine = lane < K;
  const uint32_t id = mine ? comp_index(c) : 0u;
  const float key = mine ? okey_value(comp_okey(c)) : 0.0f;
  float w = 0.0f;
  switch (a.method) {
    case kSoftmaxTopk:
    case kGroupedSoftmax:
    case kSigmoidTopk:
    case kSoftmaxBias: {
      // the key is the weight, except softmax_bias: p of the expert, the bias left out
      w = a.method != kSoftmaxBias ? key : mine ? softmax_p(load_logit(a, row, int(id)), sm) : 0.0f;
      if (a.renormalize) {
        float s = shfl_idx(w, 0);
        for (int j = 1; j < K; ++j) s = add_rn(s, shfl_idx(w, j));   // increasing j
        if (a.method == kSigmoidTopk || a.method == kSoftmaxBias)
          s = s < a.norm_eps ? a.norm_eps : s;                       // clamp_min; NaN stays
        w = w / s;
      }
      break;
    }
    case kTopkSoftmax: {             // softmax over the K selected logits, f64, rounded once
      const float m = shfl_idx(key, 0);   // slot 0: the largest (NaN if any)
      const bool finite = m == m && m != __int_as_float(0x7f800000) && m != __int_as_float(int(0xff800000u));
      const double e = mine ? exp(double(key) - double(m)) : 0.0;
      double s = 0.0;
      for (int j = 0; j < K; ++j) s = s + shfl_idx(e, j);
      w = finite ? float(e / s) : __int_as_float(0x7fc00000);
      break;
    }
    case kLlama4: w = sigmoid_rn(key); break;
    default: {                       // (grouped_)sigmoid_bias: the bias never enters a weight
      const float s = mine ? sigmoid_rn(load_logit(a, row, int(id))) : 0.0f;
      float sum = shfl_idx(s, 0);
      if (a.renormalize)
        for (int j = 1; j < K; ++j) sum = add_rn(sum, shfl_idx(s, j));
      w = a.renormalize ? mul_rn(s, a.scaling) / add_rn(sum, a.norm_eps) : mul_rn(s, a.scaling);
      break;
    }
  }
  // Every other method: the final weights times scaling (SPEC 6; 1.0 is exact).
  if (a.method != kSigmoidBias && a.method != kGroupedSigmoidBias) w = mul_rn(w, a.scaling);
  if (mine) {
    a.weights[t * K + lane] = w;
    a.ids[t * K + lane] = int32_t(id);
  }
}

// ===================================================================== warp tier
constexpr int kWarpsPerBlock = 4;

template <int P>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp)
route_warp_kernel(RouteArgs a) {
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp_id();
  if (t >= a.T) return;                                   // whole warps leave together
  const int lane = lane_id(), E = a.E;
  const void* row = logits_row(a, t);

  float x[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int e = lane + i * kWarp;
    x[i] = e < E ? load_logit(a, row, e) : 0.0f;
  }
  SoftmaxRow sm{0.0, 1.0, false};
  if (is_softmax_key(a.method)) {
    bool nan = false;
    float m = __int_as_float(int(0xff800000u));
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (lane + i * kWarp < E) {
        nan = nan || x[i] != x[i];
        m = x[i] == x[i] ? fmaxf(m, x[i]) : m;
      }
    m = warp_maxf(m);
    sm.bad = ballot(nan) != 0 || !(m > __int_as_float(int(0xff800000u)) && m < __int_as_float(0x7f800000));
    sm.m = double(m);
    if (!sm.bad) {
      double s = 0.0;
#pragma unroll
      for (int i = 0; i < P; ++i)
        if (lane + i * kWarp < E) s = s + exp(double(x[i]) - sm.m);
      sm.sum = warp_sum_d(s);
    }
  }
  uint64_t c[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int e = lane + i * kWarp;
    c[i] = e < E ? composite(key_of(a, e, x[i], sm), uint32_t(e)) : 0ull;
  }

  if (is_grouped(a.method) && a.topk_group < a.n_group) {
    const bool top2 = a.method == kGroupedSigmoidBias;   // else the largest key alone
    const int gs = E / a.n_group;
    int grp[P];                                          // group of each held expert (-1: none)
#pragma unroll
    for (int i = 0; i < P; ++i) grp[i] = lane + i * kWarp < E ? (lane + i * kWarp) / gs : -1;
    uint64_t gcomp = 0;                                  // lane g: group g's score composite
    for (int g = 0; g < a.n_group; ++g) {
      uint32_t b1 = 0, b2 = 0;
#pragma unroll
      for (int i = 0; i < P; ++i)
        if (grp[i] == g) top2_push(b1, b2, comp_okey(c[i]));
      warp_top2(b1, b2);
      const float score = top2 ? okey_value(b1) + okey_value(b2) : okey_value(b1);
      if (lane == g) gcomp = composite(okey(score), uint32_t(g));
    }
    int rank = 0;
    for (int h = 0; h < a.n_group; ++h) rank += shfl_idx(gcomp, h) > gcomp ? 1 : 0;
    const lanemask_t keep = ballot(lane < a.n_group && rank < a.topk_group);
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (grp[i] >= 0 && !((keep >> grp[i]) & 1)) c[i] = composite(kOkNegInf, uint32_t(lane + i * kWarp));
  }

  uint64_t slot = 0;                                     // lane j: the j-th largest
  for (int j = 0; j < a.K; ++j) {
    uint64_t best = 0;
#pragma unroll
    for (int i = 0; i < P; ++i) best = umax64(best, c[i]);
    best = warp_max64(best);
#pragma unroll
    for (int i = 0; i < P; ++i) c[i] = c[i] == best ? 0ull : c[i];
    if (lane == j) slot = best;
  }
  write_slots(a, row, t, slot, sm);
}

// ==================================================================== block tier
constexpr int kBlockWarps = kBlockThreads / kWarp;
static_assert(kBlockWarps >= 2 && (kBlockWarps & (kBlockWarps - 1)) == 0, "warps per block: a power of two");

// SERIAL = false: the lane-owned path below (step 1-3). SERIAL = true: seed 004's "before"
// (kSelectSerial, reachable only through route_variant): the same keys, then warp 0 alone
// selects while the other warps wait at the barrier.
template <int P, bool SERIAL>
__global__ void __launch_bounds__(kBlockThreads)
route_block_kernel(RouteArgs a) {
  __shared__ uint64_t lists[2][kBlockWarps][kRouteMaxTopK];
  __shared__ double red_d[kBlockWarps];
  __shared__ float red_f[kBlockWarps];
  __shared__ uint32_t g_top[kBlockWarps][kRouteMaxGroups][2];
  __shared__ uint64_t g_comp[kRouteMaxGroups];
  __shared__ int nan_w[kBlockWarps];

  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x, lane = lane_id(), warp = warp_id(), E = a.E, K = a.K;
  const void* row = logits_row(a, t);

  float x[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int e = tid + i * kBlockThreads;
    x[i] = e < E ? load_logit(a, row, e) : 0.0f;
  }
  SoftmaxRow sm{0.0, 1.0, false};
  if (is_softmax_key(a.method)) {                        // block max, then f64 block sum
    bool nan = false;
    float m = __int_as_float(int(0xff800000u));
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (tid + i * kBlockThreads < E) {
        nan = nan || x[i] != x[i];
        m = x[i] == x[i] ? fmaxf(m, x[i]) : m;
      }
    // A NaN anywhere in the row: one flag per warp (a shared flag stored by every thread that
    // saw a NaN would be a write/write race, benign or not).
    const bool warp_nan = ballot(nan) != 0;
    m = warp_maxf(m);
    if (lane == 0) {
      red_f[warp] = m;
      nan_w[warp] = warp_nan ? 1 : 0;
    }
    __syncthreads();
    m = red_f[0];
    bool any_nan = nan_w[0] != 0;
    for (int w = 1; w < kBlockWarps; ++w) {
      m = fmaxf(m, red_f[w]);
      any_nan = any_nan || nan_w[w] != 0;
    }
    sm.bad = any_nan || !(m > __int_as_float(int(0xff800000u)) && m < __int_as_float(0x7f800000));
    sm.m = double(m);
    if (!sm.bad) {
      double s = 0.0;
#pragma unroll
      for (int i = 0; i < P; ++i)
        if (tid + i * kBlockThreads < E) s = s + exp(double(x[i]) - sm.m);
      s = warp_sum_d(s);
      if (lane == 0) red_d[warp] = s;
      __syncthreads();
      s = red_d[0];
      for (int w = 1; w < kBlockWarps; ++w) s = s + red_d[w];   // fixed order
      sm.sum = s;
    }
  }
  uint64_t c[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int e = tid + i * kBlockThreads;
    c[i] = e < E ? composite(key_of(a, e, x[i], sm), uint32_t(e)) : 0ull;
  }

  if (is_grouped(a.method) && a.topk_group < a.n_group) {
    const bool top2 = a.method == kGroupedSigmoidBias;   // else the largest key alone
    const int gs = E / a.n_group;
    int grp[P];
#pragma unroll
    for (int i = 0; i < P; ++i) grp[i] = tid + i * kBlockThreads < E ? (tid + i * kBlockThreads) / gs : -1;
    for (int g = 0; g < a.n_group; ++g) {
      uint32_t b1 = 0, b2 = 0;
#pragma unroll
      for (int i = 0; i < P; ++i)
        if (grp[i] == g) top2_push(b1, b2, comp_okey(c[i]));
      warp_top2(b1, b2);
      if (lane == 0) { g_top[warp][g][0] = b1; g_top[warp][g][1] = b2; }
    }
    __syncthreads();
    if (tid < a.n_group) {
      uint32_t b1 = g_top[0][tid][0], b2 = g_top[0][tid][1];
      for (int w = 1; w < kBlockWarps; ++w) top2_merge(b1, b2, g_top[w][tid][0], g_top[w][tid][1]);
      g_comp[tid] = composite(okey(top2 ? okey_value(b1) + okey_value(b2) : okey_value(b1)), uint32_t(tid));
    }
    __syncthreads();
    uint32_t keep = 0;                                   // bit g: group g kept
    for (int g = 0; g < a.n_group; ++g) {
      int rank = 0;
      for (int h = 0; h < a.n_group; ++h) rank += g_comp[h] > g_comp[g] ? 1 : 0;
      keep |= rank < a.topk_group ? (1u << g) : 0u;
    }
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (grp[i] >= 0 && !((keep >> grp[i]) & 1u)) c[i] = composite(kOkNegInf, uint32_t(tid + i * kBlockThreads));
  }

  if constexpr (SERIAL) {
    // Seed 004's before: the composites go to shared memory; warp 0's lane l scans experts
    // l, l + kWarp, ... one after another, inserting each into its own sorted K-slot list
    // (K values per lane: the register state the seed's change removed), then K rounds of a
    // warp arg-max over the list heads, the owner popping its head. The other warps idle.
    __shared__ uint64_t all[kRouteMaxExperts];
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (tid + i * kBlockThreads < E) all[tid + i * kBlockThreads] = c[i];
    __syncthreads();
    if (warp != 0) return;
    uint64_t top[kRouteMaxTopK];
    for (int j = 0; j < K; ++j) top[j] = 0;
    for (int e = lane; e < E; e += kWarp) {
      const uint64_t v = all[e];
      if (v <= top[K - 1]) continue;                     // 0: an empty slot, below every expert
      int pos = K - 1;
      for (; pos > 0 && top[pos - 1] < v; --pos) top[pos] = top[pos - 1];
      top[pos] = v;
    }
    int head = 0;
    uint64_t slot = 0;                                   // lane j: the j-th largest
    for (int j = 0; j < K; ++j) {
      const uint64_t mine = head < K ? top[head] : 0ull;
      const uint64_t best = warp_max64(mine);            // > 0: E >= K real composites
      if (mine == best) ++head;                          // composites are unique: one owner
      if (lane == j) slot = best;
    }
    write_slots(a, row, t, slot, sm);
    return;
  } else {
  // 1. Each thread's own candidate list: its P composites sorted descending (compare-swap
  //    network on registers; static indices only).
#pragma unroll
  for (int i = 1; i < P; ++i)
#pragma unroll
    for (int j = i; j > 0; --j) {
      const uint64_t hi = umax64(c[j - 1], c[j]), lo = c[j - 1] ^ c[j] ^ hi;
      c[j - 1] = hi;
      c[j] = lo;
    }
  // 2. Each warp's top K: K rounds of arg-max over the list heads; the owner pops its head.
  for (int j = 0; j < K; ++j) {
    const uint64_t best = warp_max64(c[0]);
    if (c[0] == best) {
#pragma unroll
      for (int i = 0; i + 1 < P; ++i) c[i] = c[i + 1];
      c[P - 1] = 0;
    }
    if (lane == j) lists[0][warp][j] = best;
  }
  __syncthreads();
  // 3. Pairwise merges by rank, log2(warps) levels: warp w merges lists 2w and 2w+1.
  int src = 0;
  for (int n = kBlockWarps; n > 1; n >>= 1) {
    if (warp < n / 2) {
      const uint64_t* A = lists[src][2 * warp];
      const uint64_t* B = lists[src][2 * warp + 1];
      uint64_t* out = lists[src ^ 1][warp];
      for (int idx = lane; idx < 2 * K; idx += kWarp) {
        const bool in_a = idx < K;
        const int pos = in_a ? idx : idx - K;
        const uint64_t v = in_a ? A[pos] : B[pos];
        const uint64_t* other = in_a ? B : A;
        int rank = pos;
        for (int q = 0; q < K; ++q) rank += other[q] > v ? 1 : 0;
        if (rank < K) out[rank] = v;
      }
    }
    src ^= 1;
    __syncthreads();
  }
  if (warp == 0) write_slots(a, row, t, lane < K ? lists[src][0][lane] : 0ull, sm);
  }
}

// ------------------------------------------------------------------ dispatch helpers
int launch_warp(const RouteArgs& a, int P, Stream s) {
  const dim3 grid(unsigned((a.T + kWarpsPerBlock - 1) / kWarpsPerBlock)), block(kWarpsPerBlock * kWarp);
  switch (P) {
    case 1: MOELAB_LAUNCH((route_warp_kernel<1>), grid, block, 0, s, a); break;
    case 2: MOELAB_LAUNCH((route_warp_kernel<2>), grid, block, 0, s, a); break;
    case 4: MOELAB_LAUNCH((route_warp_kernel<4>), grid, block, 0, s, a); break;
    case 8: MOELAB_LAUNCH((route_warp_kernel<8>), grid, block, 0, s, a); break;
    case 16: MOELAB_LAUNCH((route_warp_kernel<16>), grid, block, 0, s, a); break;
    default: return kUnsupported;
  }
  MOELAB_GPU_LAUNCHED();
  return kOk;
}
template <bool SERIAL>
int launch_block(const RouteArgs& a, int P, Stream s) {
  const dim3 grid(unsigned(a.T)), block(kBlockThreads);
  switch (P) {
    case 2: MOELAB_LAUNCH((route_block_kernel<2, SERIAL>), grid, block, 0, s, a); break;
    case 4: MOELAB_LAUNCH((route_block_kernel<4, SERIAL>), grid, block, 0, s, a); break;
    case 8: MOELAB_LAUNCH((route_block_kernel<8, SERIAL>), grid, block, 0, s, a); break;
    default: return kUnsupported;
  }
  MOELAB_GPU_LAUNCHED();
  return kOk;
}

}  // namespace

int route_plan(int E, int K, RoutePlan* plan) {
  for (int r = 0; r < kNumTiers; ++r) {
    const TierRow& row = kTiers[r];
    if (E < row.min_e || E > row.max_e || K < row.min_k || K > row.max_k) continue;
    plan->row = r;
    plan->block = row.tier == kTierBlock;
    plan->per_lane = plan->block ? block_per_thread(E) : row.per_lane;
    plan->threads = plan->block ? kBlockThreads : kWarpsPerBlock * kWarp;
    plan->reason = row.reason;
    return kOk;
  }
  return kUnsupported;
}

int route_launch(const RouteArgs& a, Stream stream) {
  if (a.T < 0 || a.E < 1 || a.E > kRouteMaxExperts || a.K < 1 || a.K > kRouteMaxTopK || a.K > a.E)
    return kBadArgument;
  if (a.method < kSoftmaxTopk || a.method > kSoftmaxBias || (a.method == kLlama4 && (a.K != 1 || a.renormalize)))
    return kBadArgument;
  if (!(a.norm_eps >= 0.0f)) return kBadArgument;        // NaN too
  const bool biased = a.method == kSigmoidBias || a.method == kGroupedSigmoidBias || a.method == kSoftmaxBias;
  if (biased && (a.bias == nullptr || (a.bias_fmt != Fmt::kF32 && a.bias_fmt != Fmt::kBF16))) return kBadArgument;
  if (is_grouped(a.method) &&
      (a.E > kRouteMaxGroupedExperts || a.n_group < 1 || a.n_group > kRouteMaxGroups || a.E % a.n_group != 0 ||
       a.E / a.n_group < 2 || a.topk_group < 1 || a.topk_group > a.n_group ||
       a.K > a.topk_group * (a.E / a.n_group)))
    return kBadArgument;
  if (a.selection != kSelectLanes && a.selection != kSelectSerial) return kBadArgument;
  if (a.T == 0) return kOk;
  if (a.logits == nullptr || a.weights == nullptr || a.ids == nullptr || a.ld < a.E) return kBadArgument;
  if (a.T > 0x7fffffffLL) return kUnsupported;
  RoutePlan p;
  if (route_plan(a.E, a.K, &p) != kOk) return kUnsupported;
  if (a.fmt != Fmt::kF32 && a.fmt != Fmt::kBF16 && a.fmt != Fmt::kF16) return kBadArgument;
  if (a.selection == kSelectSerial) return launch_block<true>(a, block_per_thread(a.E), stream);
  return p.block ? launch_block<false>(a, p.per_lane, stream) : launch_warp(a, p.per_lane, stream);
  return kBadArgument;
}

}  // namespace moelab::gpu
