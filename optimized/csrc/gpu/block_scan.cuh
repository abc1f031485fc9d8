// A block-wide exclusive scan of one int64 per thread, shared by the permute sort's offsets and
// fused_experts' work plan. Deterministic: a warp-shuffle scan, then the warps' totals added in
// warp order by every thread. Works for any warp width (kWarp) and any blockDim.x multiple of it.
#pragma once
#include <cstdint>

#include "portability.h"

namespace moelab::gpu {

// Exclusive scan of one int64 per thread over the block (blockDim.x a multiple of kWarp);
// returns the thread's exclusive prefix, *total gets the block's sum.
MOELAB_DEV int64_t block_exclusive_scan(int64_t v, int64_t* warp_sums, int64_t* total) {
  const int lane = lane_id(), warp = warp_id(), nw = int(blockDim.x) / kWarp;
  int64_t incl = v;
#pragma unroll
  for (int off = 1; off < kWarp; off <<= 1) {
    const int64_t o = int64_t(shfl_idx(uint64_t(incl), lane >= off ? lane - off : lane));
    if (lane >= off) incl += o;
  }
  if (lane == kWarp - 1) warp_sums[warp] = incl;
  __syncthreads();
  int64_t before = 0, all = 0;
  for (int w = 0; w < nw; ++w) {
    before += w < warp ? warp_sums[w] : 0;
    all += warp_sums[w];
  }
  __syncthreads();                                       // warp_sums reusable afterwards
  *total = all;
  return before + incl - v;
}

}  // namespace moelab::gpu
