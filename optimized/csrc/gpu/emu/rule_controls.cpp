// Negative controls of the emulator's hardware rules (emu.h; tests/test_gpu_emulated.py): tiny
// kernels, built and run like the real ones (with the access hooks), that break one rule when
// `plant` is set and keep it otherwise. Each rule must fail the launch with the plant and pass
// without it, so a test that passes on the real kernels means something. Torch-free (raw
// pointers); bindings.cpp wraps them. Test-only, as the whole emulator.
#include <cstdint>

#include "../portability.h"

namespace moelab::emu::controls {
namespace {
using namespace ::moelab::gpu;

constexpr int kThreads = 128;

// Write after read across a collective: every thread reads the warps' sums, a shuffle, then
// lane 0 of each warp overwrites its sum. Without the barrier between the reads and the
// writes (plant) a slow warp can still be reading: a race the shuffle does not prevent.
__global__ void war_kernel(int plant, int* out) {
  __shared__ int sums[kThreads / kWarp];
  const int nw = int(blockDim.x) / kWarp;
  if (lane_id() == 0) sums[warp_id()] = warp_id() + 1;
  __syncthreads();
  int tot = 0;
  for (int w = 0; w < nw; ++w) tot += sums[w];
  tot = shfl_xor(tot, 1);
  if (!plant) __syncthreads();
  if (lane_id() == 0) sums[warp_id()] = tot;
  __syncthreads();
  out[threadIdx.x] = sums[(warp_id() + 1) % nw];
}

// Within one warp: lane 0 writes, a shuffle, lane 1 reads. A shuffle does not order memory;
// warp_sync (__syncwarp / fences around HIP's wave barrier) does. plant 1: no warp_sync.
// plant 2 (HIP only): the wave barrier without its release and acquire fences.
__global__ void warp_order_kernel(int plant, int* out) {
  __shared__ int cell[kWarp];
  cell[lane_id()] = lane_id() == 0 ? 42 : 0;
  const int x = shfl_idx(int(lane_id()), 0);
  if (plant == 0) warp_sync();
#if MOELAB_HIP
  if (plant == 2) __builtin_amdgcn_wave_barrier();
#endif
  out[threadIdx.x] = (lane_id() == 1 ? cell[0] : 0) + x;
}

// Static shared memory, two blocks: every thread writes its element, then reads its neighbour's.
// plant: block 1 leaves element 5 unwritten (the previous block's value would still be there).
__global__ void uninit_static_kernel(int plant, float* out) {
  __shared__ float buf[kThreads];
  if (!(plant && blockIdx.x == 1 && threadIdx.x == 5)) buf[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  out[blockIdx.x * kThreads + threadIdx.x] = buf[(threadIdx.x + kThreads - 1) % kThreads];
}

// The same with dynamic shared memory.
__global__ void uninit_dynamic_kernel(int plant, float* out) {
  MOELAB_EXTERN_SHARED(float, buf);
  if (!(plant && blockIdx.x == 1 && threadIdx.x == 5)) buf[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  out[blockIdx.x * kThreads + threadIdx.x] = buf[(threadIdx.x + kThreads - 1) % kThreads];
}

// cp.async: each thread copies two 16-byte vectors of `in` (two groups) into shared memory,
// then reads its neighbour's copy. plant 0: every wait and barrier in place. plant 1: a thread
// reads its own first copy before any wait. plant 2:
// after the waits, no barrier before reading the neighbour's (a race, or a read of a copy the
// neighbour has not waited for yet, whichever the schedule gives). plant 3: no wait at all
// (the thread exits with its copies pending). plant 4: cp_async_wait<1> lands only the first
// group, and the thread reads the second.
__global__ void cp_async_kernel(int plant, const float* in, float* out) {
  __shared__ vec16 buf[2][kThreads];
  const int t = int(threadIdx.x);
  cp_async16(&buf[0][t], in + 4 * t);
  cp_async_commit();
  cp_async16(&buf[1][t], in + 4 * (kThreads + t));
  cp_async_commit();
  if (plant == 3) return;
  __syncthreads();   // every copy issued; the waits, not this barrier, land them
  float first = 0.0f;
  if (plant == 1) first = __uint_as_float(buf[0][t].x);
  cp_async_wait<1>();
  first += __uint_as_float(buf[0][t].x);
  if (plant == 4) first += __uint_as_float(buf[1][t].x);
  cp_async_wait<0>();
  if (plant != 2) __syncthreads();
  const int nb = (t + 1) % kThreads;
  out[t] = first + __uint_as_float(buf[1][nb].y);
}

// A vector load of `size` bytes (16: uint4, 8: uint2) from global memory at byte offset `off`
// of an aligned buffer (where == 0) or from shared memory (where == 1).
__global__ void vector_kernel(const char* in, int off, int size, int where, unsigned* out) {
  __shared__ vec16 stage[4];
  const char* src = in;
  if (where == 1) {
    if (threadIdx.x < 4) stage[threadIdx.x] = ld16(in + 16 * threadIdx.x);
    __syncthreads();
    src = reinterpret_cast<const char*>(stage);
  }
  if (threadIdx.x == 0) {
    if (size == 16) out[0] = ld16(src + off).y;
    else out[0] = ld_vec(reinterpret_cast<const uint2*>(src + off)).y;
  }
}

// Lanes of a warp at two different shuffles (plant 1), or threads of a block at two different
// __syncthreads (plant 2).
__global__ void divergent_kernel(int plant, int* out) {
  int v = int(threadIdx.x);
  if (plant == 1 && (lane_id() & 1)) v = shfl_xor(v, 1);
  else v = shfl_xor(v, 1);
  if (plant == 2 && warp_id() == 0) __syncthreads();
  else __syncthreads();
  out[threadIdx.x] = v;
}

// Block b reads block b-1's result from global memory in the same launch (no grid-wide
// ordering exists): correct only when the blocks happen to run in index order.
__global__ void chain_kernel(int* out) {
  if (threadIdx.x == 0) out[blockIdx.x] = blockIdx.x == 0 ? 1 : out[blockIdx.x - 1] + 1;
}

#if MOELAB_HAS_MMA_BF16
// One m16n8k16 MMA: d[16][8] = a[16][16] . w[8][16]^T (bf16 bits in, f32 out), the fragments
// loaded from global memory in the PTX ISA's layout (plant 1: A's registers 1 and 2 swapped,
// i.e. the row and k halves exchanged; plant 2: B's row and column ownership swapped).
__global__ void mma_kernel(const uint16_t* a, const uint16_t* w, int plant, float* d) {
  const int lane = lane_id(), g = lane >> 2, c = lane & 3;
  auto pair = [](const uint16_t* p) { return uint32_t(p[0]) | (uint32_t(p[1]) << 16); };
  uint32_t af[4] = {pair(a + g * 16 + 2 * c), pair(a + (g + 8) * 16 + 2 * c), pair(a + g * 16 + 2 * c + 8),
                    pair(a + (g + 8) * 16 + 2 * c + 8)};
  if (plant == 1) {
    const uint32_t t = af[1];
    af[1] = af[2];
    af[2] = t;
  }
  uint32_t bf[2] = {pair(w + g * 16 + 2 * c), pair(w + g * 16 + 2 * c + 8)};
  if (plant == 2) {   // B[k][n] read as B[n][k]: column 2c, k pair from g
    bf[0] = pair(w + 2 * c * 16 + g);
    bf[1] = pair(w + 2 * c * 16 + g + 8);
  }
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_bf16_16816(acc, af, bf);
  d[g * 8 + 2 * c] = acc[0];
  d[g * 8 + 2 * c + 1] = acc[1];
  d[(g + 8) * 8 + 2 * c] = acc[2];
  d[(g + 8) * 8 + 2 * c + 1] = acc[3];
}

// ldmatrix_x4: warp 0 stores 32 rows of 8 bf16 (row i = in[8 i .. 8 i + 7]) in shared memory,
// a barrier, then warp 1 loads them as four 8x8 matrices (lane l hands in row l) and writes
// each lane's four registers. plant 1: no barrier (warp 1 may read rows before warp 0 wrote
// them: an uninitialised read or a race, whichever the schedule gives); plant 2: odd lanes hand
// in a row address 8 bytes off (misaligned); plant 3: the rows' global copy instead of shared
// memory.
__global__ void ldmatrix_kernel(const uint16_t* in, int plant, uint32_t* out) {
  __shared__ vec16 rows[32];
  const int lane = lane_id();
  if (warp_id() == 0) rows[lane] = ld16(in + 8 * lane);
  if (plant != 1) __syncthreads();
  if (warp_id() == 1) {
    const void* p = &rows[lane];
    if (plant == 2 && (lane & 1)) p = reinterpret_cast<const char*>(p) + 8;
    if (plant == 3) p = in + 8 * lane;
    uint32_t r[4];
    ldmatrix_x4(r, p);
    for (int i = 0; i < 4; ++i) out[4 * lane + i] = r[i];
  }
}
#endif

// round_bf16 of n values (the cvt.rn.bf16.f32 of the MMA build, the integer rounding otherwise).
__global__ void round_kernel(const float* x, int n, float* y) {
  for (int i = int(threadIdx.x); i < n; i += int(blockDim.x)) y[i] = round_bf16(x[i]);
}

}  // namespace

void war(int plant, int* out) { MOELAB_LAUNCH(war_kernel, 1, kThreads, 0, nullptr, plant, out); }
void cp_async(int plant, const float* in, float* out) {
  MOELAB_LAUNCH(cp_async_kernel, 1, kThreads, 0, nullptr, plant, in, out);
}
void warp_order(int plant, int* out) { MOELAB_LAUNCH(warp_order_kernel, 1, kWarp, 0, nullptr, plant, out); }
void uninit_static(int plant, float* out) { MOELAB_LAUNCH(uninit_static_kernel, 2, kThreads, 0, nullptr, plant, out); }
void uninit_dynamic(int plant, float* out) {
  MOELAB_LAUNCH(uninit_dynamic_kernel, 2, kThreads, kThreads * sizeof(float), nullptr, plant, out);
}
void vector_load(const char* in, int off, int size, int where, unsigned* out) {
  MOELAB_LAUNCH(vector_kernel, 1, kWarp, 0, nullptr, in, off, size, where, out);
}
void divergent(int plant, int* out) { MOELAB_LAUNCH(divergent_kernel, 1, 2 * kWarp, 0, nullptr, plant, out); }
void chain(int blocks, int* out) { MOELAB_LAUNCH(chain_kernel, blocks, kWarp, 0, nullptr, out); }
bool mma(const uint16_t* a, const uint16_t* w, int plant, float* d) {
#if MOELAB_HAS_MMA_BF16
  MOELAB_LAUNCH(mma_kernel, 1, kWarp, 0, nullptr, a, w, plant, d);
  return true;
#else
  (void)a, (void)w, (void)plant, (void)d;
  return false;
#endif
}
bool ldmatrix(const uint16_t* in, int plant, uint32_t* out) {
#if MOELAB_HAS_MMA_BF16
  MOELAB_LAUNCH(ldmatrix_kernel, 1, 2 * kWarp, 0, nullptr, in, plant, out);
  return true;
#else
  (void)in, (void)plant, (void)out;
  return false;
#endif
}
void round_bf16_values(const float* x, int n, float* y) { MOELAB_LAUNCH(round_kernel, 1, kWarp, 0, nullptr, x, n, y); }

}  // namespace moelab::emu::controls
