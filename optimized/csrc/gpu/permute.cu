// permute / unpermute on the GPU (SPEC section 2; seed 003): a deterministic stable counting
// sort of the R = T*K routed rows by local expert, and the weighted gather back.
//
// permute. The rows are cut into U contiguous *units* of rows, one warp each, and every
// unit keeps its own histogram (workspace: U * E_loc int32, passed in by the caller):
//   1. histogram: a warp walks its unit kWarp rows at a time; lanes holding the same expert
//      find each other with log2(E_loc + 1) ballots (a radix "match"), and the lowest of them
//      adds the group's size to the unit's count: no atomics, no contention.
//   2. scan (one block): per expert, the total over units, padded to `align`; an exclusive
//      scan over experts gives offsets[]; then, per expert, the units' counts become start
//      positions in unit order (unit 0's rows first): a block-ordered scan.
//   3. scatter: each warp walks its unit again in increasing r; a row's position is its
//      unit's cursor for the expert plus its rank among the same-expert lanes below it
//      (popc(peers & lanes below)); the lowest peer advances the cursor. Rows land in
//      increasing r within each segment - the stable order of SPEC - and the result is a
//      pure function of the inputs, whatever the timing of the warps.
//   4. rows: src_row[p] -> p's row is hidden[src_row[p] / K] or zeros, copied with the widest
//      aligned vector (16 bytes when rows and pointers allow); grid.y over rows and grid.x
//      over a row's vectors, so that a decode-sized call still spreads over the GPU.
// R <= kFusedMaxRows (decode and small prefill): steps 1-3 run in ONE block (units = its
// warps), so a call is 2 launches; larger R: 4 launches (units of kUnitRows rows).
// Nothing is allocated: the workspace comes from the caller (a PermuteScratch holds it).
// Index errors (ids outside [-1, n_experts), expert_map entries outside [-1, E_loc)) are
// written to the workspace's status words for the caller to read back; such rows are
// treated as dropped, so no write ever leaves the outputs.
//
// unpermute: out[t, h] = sum over j ascending with p = dst_pos[t*K+j] >= 0 of
// w[t,j] * f32(expert_out[p, h]); each product rounded to f32, then added (mul_rn, add_rn:
// never an FMA), from +0: the reference's arithmetic, bit for bit. A thread owns 8 (or 4
// for f32) consecutive elements of a token row and reads them with 16-byte loads.
//
// Floors (H200, ~4.8 TB/s): permute moves T*H*e bytes in (the K re-reads of a token row hit
// L2) and capacity*H*e out; Mixtral decode (T = 8, K = 2, H = 4096, bf16): ~0.2 MB, far
// below a launch, so the floor is the launches (2 here) and the allocation-free scratch is
// what seed 003 measures. unpermute reads T*K*H*e and writes T*H*e.
#include "block_scan.cuh"
#include "launch.h"
#include "portability.h"

namespace moelab::gpu {
namespace {

constexpr int kFusedThreads = 512;
constexpr int kFusedWarps = kFusedThreads / kWarp;
constexpr int64_t kFusedMaxRows = 4096;
constexpr int64_t kUnitRows = 1024;          // rows per unit (warp) on the multi-block path
constexpr int kUnitWarpsPerBlock = 4;
constexpr int kScanThreads = 1024;

enum PermuteCode : int32_t { kBadId = 1, kBadMap = 2, kInconsistent = 3 };

int64_t units_for(int64_t R) {
  if (R <= kFusedMaxRows) {
    const int64_t u = (R + kWarp - 1) / kWarp;
    return u < 1 ? 1 : (u > kFusedWarps ? kFusedWarps : u);
  }
  return (R + kUnitRows - 1) / kUnitRows;
}

// First error wins the status word; its value goes beside it.
MOELAB_DEV void report(int32_t* ws, int32_t code, int64_t value) {
  if (atomicCAS(reinterpret_cast<int*>(ws), 0, int(code)) == 0) {
    ws[2] = int32_t(uint32_t(uint64_t(value)));
    ws[3] = int32_t(uint32_t(uint64_t(value) >> 32));
  }
}

// Local expert of routed row r, or -1 (dropped; also for a bad id or map entry, which are
// reported when `check`).
MOELAB_DEV int64_t local_of(const PermuteArgs& a, int64_t r, bool check, int32_t* ws) {
  const int32_t t = int32_t(r) / int32_t(a.K), j = int32_t(r) - t * int32_t(a.K);   // R < 2^31
  const int64_t off = int64_t(t) * a.ld_t + int64_t(j) * a.ld_k;
  const int64_t g = a.ids_int64 ? static_cast<const int64_t*>(a.ids)[off]
                                : int64_t(static_cast<const int32_t*>(a.ids)[off]);
  if (g < -1 || g >= a.n_experts) {
    if (check) report(ws, kBadId, g);
    return -1;
  }
  if (g < 0) return -1;
  if (a.expert_map == nullptr) return g;
  const int64_t e = a.expert_map[g * a.map_stride];
  return (e >= -1 && e < a.n_local) ? e : -1;            // bad entries: reported by check_map
}

MOELAB_DEV void check_map(const PermuteArgs& a, int32_t* ws, int64_t i0, int64_t step) {
  if (a.expert_map == nullptr) return;
  for (int64_t g = i0; g < a.n_experts; g += step) {
    const int64_t e = a.expert_map[g * a.map_stride];
    if (e < -1 || e >= a.n_local) report(ws, kBadMap, e);
  }
}

// Lanes of this warp whose v equals mine (every lane of the warp calls it).
MOELAB_DEV lanemask_t match(int64_t v, int nbits) {
  lanemask_t peers = ballot(true);
  for (int b = 0; b < nbits; ++b) {
    const bool bit = (v >> b) & 1;
    const lanemask_t m = ballot(bit);
    peers &= bit ? m : ~m;
  }
  return peers;
}
int bits_for(int64_t n_local) {          // bits of (e + 1) for e in [-1, n_local)
  int b = 0;
  while ((int64_t(1) << b) <= n_local) ++b;
  return b;
}

// Step 1 for unit u (one warp): its histogram row += counts of rows [r0, r1).
MOELAB_DEV void unit_histogram(const PermuteArgs& a, int32_t* hist, int64_t r0, int64_t r1, int nbits) {
  const int lane = lane_id();
  for (int64_t e = lane; e < a.n_local; e += kWarp) hist[e] = 0;
  warp_sync();
  for (int64_t base = r0; base < r1; base += kWarp) {
    const int64_t r = base + lane;
    const int64_t e = r < r1 ? local_of(a, r, false, nullptr) : -1;
    const lanemask_t peers = match(e + 1, nbits);
    if (e >= 0 && lane == lowest_lane(peers)) hist[e] += popc(peers);
    warp_sync();
  }
}

// Step 3 for unit u: positions, src_row, dst_pos.
MOELAB_DEV void unit_scatter(const PermuteArgs& a, int32_t* ws, int32_t* hist, int64_t r0, int64_t r1, int nbits) {
  const int lane = lane_id();
  for (int64_t base = r0; base < r1; base += kWarp) {
    const int64_t r = base + lane;
    const bool live = r < r1;
    const int64_t e = live ? local_of(a, r, true, ws) : -1;
    const lanemask_t peers = match(e + 1, nbits);
    int32_t cur = 0;
    if (e >= 0) {
      cur = hist[e];
      const int64_t pos = int64_t(cur) + popc(peers & lanemask_lt());
      if (pos < a.offsets[e + 1]) {
        a.src_row[pos] = int32_t(r);
        a.dst_pos[r] = int32_t(pos);
      } else {                                           // the ids changed since step 1
        report(ws, kInconsistent, r);
        a.dst_pos[r] = -1;
      }
    } else if (live) {
      a.dst_pos[r] = -1;
    }
    warp_sync();                                         // every peer has read the cursor
    if (e >= 0 && lane == lowest_lane(peers)) hist[e] = cur + popc(peers);
    warp_sync();
  }
}


// Step 2 (one block): offsets, per-unit start positions, status reset and map check.
MOELAB_DEV void scan_units(const PermuteArgs& a, int32_t* ws, int64_t U, int64_t* warp_sums) {
  int32_t* hist = ws + kPermuteStatusWords;
  const int64_t E = a.n_local;
  int64_t carry = 0;
  for (int64_t e0 = 0; e0 < E; e0 += blockDim.x) {
    const int64_t e = e0 + threadIdx.x;
    int64_t padded = 0;
    if (e < E) {
      int64_t n = 0;
      for (int64_t u = 0; u < U; ++u) n += hist[u * E + e];
      const uint32_t al = uint32_t(a.align);           // n < 2^31, align < 2^31: no overflow
      padded = int64_t((uint32_t(n) + al - 1) / al) * al;
    }
    int64_t chunk_total;
    const int64_t start = carry + block_exclusive_scan(padded, warp_sums, &chunk_total);
    if (e < E) {
      a.offsets[e] = start;
      int64_t cursor = start;                            // unit order: stable across units
      for (int64_t u = 0; u < U; ++u) {
        const int32_t n = hist[u * E + e];
        hist[u * E + e] = int32_t(cursor);
        cursor += n;
      }
    }
    carry += chunk_total;
  }
  if (threadIdx.x == 0) a.offsets[E] = carry;
}

// ----------------------------------------------------------------- fused: steps 1-3
__global__ void __launch_bounds__(kFusedThreads, 1) permute_plan_fused(PermuteArgs a, int64_t U, int nbits) {
  __shared__ int64_t warp_sums[kFusedThreads / kWarp];
  int32_t* ws = a.workspace;
  int32_t* hist = ws + kPermuteStatusWords;
  const int64_t R = a.T * a.K;
  if (threadIdx.x < kPermuteStatusWords) ws[threadIdx.x] = 0;
  for (int64_t p = threadIdx.x; p < a.capacity; p += blockDim.x) a.src_row[p] = -1;
  __syncthreads();
  check_map(a, ws, threadIdx.x, blockDim.x);
  const int64_t chunk = (R + U - 1) / U;
  const int64_t u = warp_id();
  if (u < U) unit_histogram(a, hist + u * a.n_local, u * chunk, R < (u + 1) * chunk ? R : (u + 1) * chunk, nbits);
  __syncthreads();
  scan_units(a, ws, U, warp_sums);
  __syncthreads();
  if (u < U) unit_scatter(a, ws, hist + u * a.n_local, u * chunk, R < (u + 1) * chunk ? R : (u + 1) * chunk, nbits);
}

// ------------------------------------------------------- multi-block: steps 1, 2, 3
__global__ void __launch_bounds__(kUnitWarpsPerBlock * kWarp, 1) permute_histogram(PermuteArgs a, int64_t U, int nbits) {
  const int64_t R = a.T * a.K;
  const int64_t gtid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, gsize = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = gtid; p < a.capacity; p += gsize) a.src_row[p] = -1;
  const int64_t u = int64_t(blockIdx.x) * kUnitWarpsPerBlock + warp_id();
  if (u >= U) return;                                    // whole warps
  const int64_t r0 = u * kUnitRows, r1 = R < r0 + kUnitRows ? R : r0 + kUnitRows;
  unit_histogram(a, a.workspace + kPermuteStatusWords + u * a.n_local, r0, r1, nbits);
}

__global__ void __launch_bounds__(kScanThreads, 1) permute_scan(PermuteArgs a, int64_t U) {
  __shared__ int64_t warp_sums[kScanThreads / kWarp];
  int32_t* ws = a.workspace;
  if (threadIdx.x < kPermuteStatusWords) ws[threadIdx.x] = 0;
  __syncthreads();
  check_map(a, ws, threadIdx.x, blockDim.x);
  scan_units(a, ws, U, warp_sums);
}

__global__ void __launch_bounds__(kUnitWarpsPerBlock * kWarp, 1) permute_scatter(PermuteArgs a, int64_t U, int nbits) {
  const int64_t R = a.T * a.K;
  const int64_t u = int64_t(blockIdx.x) * kUnitWarpsPerBlock + warp_id();
  if (u >= U) return;
  const int64_t r0 = u * kUnitRows, r1 = R < r0 + kUnitRows ? R : r0 + kUnitRows;
  unit_scatter(a, a.workspace, a.workspace + kPermuteStatusWords + u * a.n_local, r0, r1, nbits);
}

// ---------------------------------------------------------------- step 4: the rows
// V: the copy unit (uint4 = 16 bytes down to 1 byte); vpr units per row. grid.y walks the
// destination rows, grid.x the units of a row (no 64-bit division in the loop).
template <typename V>
__global__ void __launch_bounds__(256, 1) permute_rows(const char* __restrict__ in, int64_t ld_units,
                                                    V* __restrict__ out, const int32_t* __restrict__ src_row,
                                                    int32_t K, int64_t vpr, int64_t capacity) {
  const V* src = reinterpret_cast<const V*>(in);
  const int64_t v0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, vstep = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = blockIdx.y; p < capacity; p += gridDim.y) {
    const int32_t r = src_row[p];
    const V* s = r >= 0 ? src + int64_t(r / K) * ld_units : nullptr;
    V* o = out + p * vpr;
    for (int64_t v = v0; v < vpr; v += vstep) st_vec(o + v, s != nullptr ? ld_vec(s + v) : V{});
  }
}

template <typename V>
int launch_rows(const PermuteArgs& a, Stream s) {
  const int64_t vpr = a.row_bytes / int64_t(sizeof(V));
  int64_t bx = (vpr + 255) / 256;
  const int64_t cx = MOELAB_GRID_CAP(1024), cy = MOELAB_GRID_CAP(65535);
  if (bx > cx) bx = cx;
  const int64_t by = a.capacity < cy ? a.capacity : cy;
  MOELAB_LAUNCH(permute_rows<V>, dim3(unsigned(bx), unsigned(by)), dim3(256), 0, s, static_cast<const char*>(a.hidden),
                a.ld_bytes / int64_t(sizeof(V)), static_cast<V*>(a.hidden_out), a.src_row, int32_t(a.K), vpr,
                a.capacity);
  MOELAB_GPU_LAUNCHED();
  return kOk;
}

// The widest unit that divides the row length, the row stride and both base addresses.
int copy_unit(const PermuteArgs& a) {
  const uint64_t m = uint64_t(a.row_bytes) | uint64_t(a.ld_bytes) | reinterpret_cast<uintptr_t>(a.hidden) |
                     reinterpret_cast<uintptr_t>(a.hidden_out);
  for (int u = 16; u > 1; u >>= 1)
    if ((m & uint64_t(u - 1)) == 0) return u;
  return 1;
}

// ------------------------------------------------------------------------ unpermute
template <Fmt F> constexpr int kVecElems = F == Fmt::kF32 ? 4 : 8;

// One thread: NE consecutive elements [h, h + NE) of token t (VEC: 16-byte loads/stores).
template <Fmt F, bool VEC>
__global__ void __launch_bounds__(256, 1) unpermute_kernel(UnpermuteArgs a, int64_t chunks_per_row) {
  constexpr int NE = VEC ? kVecElems<F> : 1;
  constexpr int64_t es = F == Fmt::kF32 ? 4 : 2;
  const int64_t c0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, cstep = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = blockIdx.y; t < a.T; t += gridDim.y)
  for (int64_t c = c0; c < chunks_per_row; c += cstep) {
    const int64_t h = c * NE;
    float acc[NE];
#pragma unroll
    for (int q = 0; q < NE; ++q) acc[q] = 0.0f;
    for (int64_t j = 0; j < a.K; ++j) {
      const int32_t p = a.dst_pos[t * a.K + j];
      if (p < 0) continue;
      if (p >= a.rows) {                                 // outside expert_out: reported, skipped
        if (a.status != nullptr) *a.status = 1;
        continue;
      }
      const float w = a.weights[t * a.ldw_t + j * a.ldw_k];
      const char* row = static_cast<const char*>(a.expert_out) + (int64_t(p) * a.ld + h) * es;
      float x[NE];
      if constexpr (VEC) {
        const vec16 v = ld16(row);
        if constexpr (F == Fmt::kF32) unpack4_f32(v, x);
        else unpack8<F>(v, x);
      } else {
        x[0] = load_elem<F>(row, 0);
      }
#pragma unroll
      for (int q = 0; q < NE; ++q) acc[q] = add_rn(acc[q], mul_rn(w, x[q]));
    }
    char* o = static_cast<char*>(a.out) + (t * a.H + h) * es;
    if constexpr (VEC) {
      vec16 v;
      if constexpr (F == Fmt::kF32) {
        v.x = __float_as_uint(acc[0]); v.y = __float_as_uint(acc[1]);
        v.z = __float_as_uint(acc[2]); v.w = __float_as_uint(acc[3]);
      } else {
        v.x = pack2<F>(acc[0], acc[1]); v.y = pack2<F>(acc[2], acc[3]);
        v.z = pack2<F>(acc[4], acc[5]); v.w = pack2<F>(acc[6], acc[7]);
      }
      st16(o, v);
    } else {
      store_elem<F>(o, 0, acc[0]);
    }
  }
}

template <Fmt F>
int launch_unpermute(const UnpermuteArgs& a, Stream s) {
  constexpr int64_t es = F == Fmt::kF32 ? 4 : 2;
  constexpr int NE = kVecElems<F>;
  const uint64_t m = uint64_t(a.H * es) | uint64_t(a.ld * es) | reinterpret_cast<uintptr_t>(a.expert_out) |
                     reinterpret_cast<uintptr_t>(a.out);
  const bool vec = (m & 15u) == 0;
  const int64_t chunks = vec ? a.H / NE : a.H;
  int64_t bx = (chunks + 255) / 256;
  const int64_t cx = MOELAB_GRID_CAP(1024), cy = MOELAB_GRID_CAP(65535);
  if (bx > cx) bx = cx;
  const dim3 grid(unsigned(bx), unsigned(a.T < cy ? a.T : cy));
  if (vec) MOELAB_LAUNCH((unpermute_kernel<F, true>), grid, dim3(256), 0, s, a, chunks);
  else MOELAB_LAUNCH((unpermute_kernel<F, false>), grid, dim3(256), 0, s, a, chunks);
  MOELAB_GPU_LAUNCHED();
  return kOk;
}

}  // namespace

int64_t permute_workspace_words(int64_t rows, int64_t n_local) {
  const int64_t fused = units_for(rows < kFusedMaxRows ? rows : kFusedMaxRows);
  const int64_t multi = rows > kFusedMaxRows ? units_for(rows) : 0;
  return kPermuteStatusWords + (fused > multi ? fused : multi) * (n_local > 0 ? n_local : 0);
}

int permute_launch(const PermuteArgs& a, Stream s) {
  constexpr int64_t kI32Max = 0x7fffffff;
  if (a.T < 0 || a.K < 1 || a.n_experts < 1 || a.n_experts > kI32Max || a.n_local < 1 || a.n_local > kI32Max ||
      a.align < 1 || a.align > kI32Max || a.row_bytes < 0 || a.ld_bytes < a.row_bytes)
    return kBadArgument;
  if (a.T > kI32Max / a.K) return kBadArgument;
  const int64_t R = a.T * a.K;
  if (a.capacity != R + a.n_local * (a.align - 1) || a.capacity > kI32Max) return kBadArgument;
  if (a.workspace == nullptr || a.workspace_words < permute_workspace_words(R, a.n_local)) return kBadArgument;
  if (a.offsets == nullptr || (a.capacity > 0 && a.src_row == nullptr) || (R > 0 && (a.dst_pos == nullptr || a.ids == nullptr)))
    return kBadArgument;
  const int nbits = bits_for(a.n_local);
  const int64_t U = units_for(R);
  if (R <= kFusedMaxRows) {
    MOELAB_LAUNCH(permute_plan_fused, dim3(1), dim3(kFusedThreads), 0, s, a, U, nbits);
    MOELAB_GPU_LAUNCHED();
  } else {
    const unsigned blocks = unsigned((U + kUnitWarpsPerBlock - 1) / kUnitWarpsPerBlock);
    MOELAB_LAUNCH(permute_histogram, dim3(blocks), dim3(kUnitWarpsPerBlock * kWarp), 0, s, a, U, nbits);
    MOELAB_GPU_LAUNCHED();
    MOELAB_LAUNCH(permute_scan, dim3(1), dim3(kScanThreads), 0, s, a, U);
    MOELAB_GPU_LAUNCHED();
    MOELAB_LAUNCH(permute_scatter, dim3(blocks), dim3(kUnitWarpsPerBlock * kWarp), 0, s, a, U, nbits);
    MOELAB_GPU_LAUNCHED();
  }
  if (a.row_bytes == 0 || a.capacity == 0) return kOk;
  if ((a.T > 0 && a.hidden == nullptr) || a.hidden_out == nullptr) return kBadArgument;   // T = 0: padding only
  switch (copy_unit(a)) {
    case 16: return launch_rows<vec16>(a, s);
    case 8: return launch_rows<uint2>(a, s);
    case 4: return launch_rows<uint32_t>(a, s);
    case 2: return launch_rows<uint16_t>(a, s);
    default: return launch_rows<uint8_t>(a, s);
  }
}

int unpermute_launch(const UnpermuteArgs& a, Stream s) {
  if (a.T < 0 || a.K < 0 || a.H < 0 || a.rows < 0 || a.ld < a.H) return kBadArgument;
  if (a.T == 0 || a.H == 0) return kOk;
  if (a.expert_out == nullptr && a.rows > 0) return kBadArgument;
  if (a.weights == nullptr || a.out == nullptr || (a.K > 0 && a.dst_pos == nullptr)) return kBadArgument;
  switch (a.fmt) {
    case Fmt::kF32: return launch_unpermute<Fmt::kF32>(a, s);
    case Fmt::kBF16: return launch_unpermute<Fmt::kBF16>(a, s);
    case Fmt::kF16: return launch_unpermute<Fmt::kF16>(a, s);
  }
  return kBadArgument;
}

}  // namespace moelab::gpu
