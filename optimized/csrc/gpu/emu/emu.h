// A small SIMT emulator: the moelab GPU kernels, unchanged, compiled by the host C++ compiler
// and run on the CPU, so their logic is tested on machines without a GPU (tests/
// test_gpu_emulated.py). Not a simulator of performance: a test tool that models the rules
// real GPUs punish (docs/gpu.md, "The emulator's hardware rules").
//
// Build with -DMOELAB_EMU -DMOELAB_EMU_WARP=32 (CUDA flavour: the CUDA branch of
// portability.h runs against emulated __shfl_*_sync / __ballot_sync / ...) or =64 (HIP
// flavour: the HIP branch runs, 64-lane wavefronts); -DMOELAB_EMU_MMA=1 (32 only) also turns on
// the sm_80+ branch (MOELAB_HAS_MMA_BF16): mma.sync m16n8k16 and cvt.rn.bf16.f32, emulated
// with the PTX ISA's fragment layouts. Every thread of a block is a fiber (ucontext); a fiber
// runs until it reaches a warp collective (shuffle, ballot, warp sync, mma, ldmatrix) or __syncthreads,
// and the collective completes when every live lane of its warp (every live thread of its
// block) has arrived, at the same call site. Blocks run one after another in a shuffled order.
// The order in which fibers run between barriers is shuffled too (seeded: MOELAB_EMU_SEED).
//
// The rules (emu.cpp; checked when the kernels are built with the access hooks, tests/
// gpu_emu.py: every load and store of kernel code reports its address and size):
//   - every access naturally aligned (2, 4, 8, 16 bytes), global and shared;
//   - shared memory (static __shared__ and dynamic) is uninitialised at every block start: a
//     read of a byte no thread of this block wrote fails;
//   - shared-memory races: per byte, the last writer and the readers since, with the block
//     barrier epoch (__syncthreads) and the warp sync count (__syncwarp; on HIP a wave barrier
//     between a release and an acquire fence) they saw; a write/read or write/write pair of two
//     threads that no barrier orders fails. Shuffles and ballots do not order memory;
//   - collectives matched by call site: the lanes of a warp (threads of a block) must reach the
//     same shuffle / ballot / sync / mma (__syncthreads) from the same call path;
//   - cp.async (32-lane builds): the copy lands at the issuing thread's wait, and any access to
//     its destination before that fails; so does exiting with copies not waited for;
//   - ldmatrix (MMA build): each lane's row must be 16-byte aligned shared memory, read under the
//     rules above by that lane.
// A violation, a collective with absent lanes, a deadlock or a launch configuration CUDA
// rejects fails the launch loudly (RuntimeError).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../../common/formats.h"

#ifndef MOELAB_EMU_WARP
#define MOELAB_EMU_WARP 32
#endif
#ifndef MOELAB_EMU_MMA
#define MOELAB_EMU_MMA 0
#endif
#ifndef MOELAB_EMU_RULES       // 1: the kernels are built with the access hooks (tests/gpu_emu.py)
#define MOELAB_EMU_RULES 0
#endif

// ------------------------------------------------------------- language keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Static shared memory: thread-local storage of the emulator's module (fibers share the OS
// thread, so the threads of a block share it), one contiguous range the access hooks know.
#define __shared__ static thread_local

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
// Aligned as CUDA's vector types: a 16-byte (8-byte) vector access must be 16 (8)-byte aligned.
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };

namespace moelab::emu {

constexpr int kEmuWarp = MOELAB_EMU_WARP;

struct Ids {
  dim3 threadIdx, blockIdx, blockDim, gridDim;
};
constexpr int kSlotWords = 8;   // words a lane deposits at one collective (mma: 5)

// What a warp collective is: shuffles and ballots exchange values but do not order memory;
// kSync (__syncwarp, HIP's wave barrier) orders it; kMma is the tensor-core instruction and
// kLdmatrix its fragment load (neither orders memory).
enum Collective : int { kShfl = 1, kBallot = 2, kSync = 3, kMma = 4, kLdmatrix = 5 };

const Ids& ids();
int lane();
// Deposit n words for this lane's warp collective, wait for the warp, return its slots
// (lane l's words at l * kSlotWords).
// file/line: the call site (collectives are matched by it).
const uint64_t* exchange_n(const uint64_t* v, int n, int kind, const char* file, int line);
inline const uint64_t* exchange(uint64_t v, int kind, const char* file, int line) {
  return exchange_n(&v, 1, kind, file, line);
}
void sync_block(const char* file, int line);
inline void wave_barrier(const char* file, int line) { (void)exchange(0, kSync, file, line); }
void fence(int order);
// A vector load/store of n bytes at p (portability.h's ld_vec/st_vec): fails unless n-aligned.
void vector_access(const void* p, size_t n, bool write);   // HIP's __builtin_amdgcn_fence (release / acquire halves of warp_sync)
// cp.async (portability.h's cp_async16 / cp_async_commit / cp_async_wait, 32-lane builds): n
// bytes from global src to shared dst, both n-aligned, landing at a later cp_async_wait of the
// issuing thread once at most `keep` newer committed groups are pending. Until then any access
// to dst fails; a thread that exits with copies not waited for fails.
void async_copy(void* dst, const void* src, int n);
void async_commit();
void async_wait(int keep);
void* dynamic_smem();
void launch(const char* name, dim3 grid, dim3 block, size_t smem, const std::function<void()>& body);
int last_error();   // 0, or 9 (invalid configuration) after a rejected launch; then cleared
// A launcher's cap on a grid dimension (grid-stride loops): c, or less when a test lowered it
// (set_grid_cap) so that every grid-stride loop iterates; hits counts the lowered caps.
int64_t grid_cap(int64_t c);
void set_grid_cap(int64_t cap);
int64_t grid_cap_hits();
// Launches since the last clear, as "name gx gy gz bx by bz" lines (coverage tests).
const std::vector<std::string>& launch_log();
void clear_launch_log();

template <typename T> inline uint64_t bits(T v) {
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T> inline T unbits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
template <typename T> inline T shfl(T v, int src, const char* file, int line) {
  const uint64_t* s = exchange(bits(v), kShfl, file, line);
  return unbits<T>(s[src * kSlotWords]);
}
inline uint64_t ballot_bits(bool p, const char* file, int line) {
  const uint64_t* s = exchange(p ? 1u : 0u, kBallot, file, line);
  uint64_t m = 0;
  for (int l = 0; l < kEmuWarp; ++l) m |= (s[l * kSlotWords] & 1u) << l;
  return m;
}

// cvt.rn.bf16.f32 as the hardware does it: round to nearest even; any NaN gives the canonical
// bf16 NaN 0x7fff (not the quieted payload of formats.h's software rounding).
inline uint16_t cvt_rn_bf16_f32(float f) {
  const uint32_t u = unbits<uint32_t>(bits(f));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, warp-wide: D = A (16x16) . B (16x8) + C,
// every lane holding only its fragments, in the PTX ISA's layout (g = lane >> 2, c = lane & 3;
// the lower column / k of a pair in the low 16 bits of a register):
//   A: a[0] = A[g][2c, 2c+1], a[1] = A[g+8][2c, 2c+1], a[2] = A[g][2c+8, 2c+9], a[3] = A[g+8][2c+8, 2c+9]
//   B: b[0] = B[2c, 2c+1][g], b[1] = B[2c+8, 2c+9][g]
//   C, D: d[0], d[1] = D[g][2c, 2c+1]; d[2], d[3] = D[g+8][2c, 2c+1].
// The hardware's order of additions is not specified; the emulator adds the 16 products into
// C one fmaf at a time, k ascending (the SIMT path's order, so both branches give the same bits
// in the emulator). Products of two bf16 are exact in f32 either way.
void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const char* file, int line);

// ldmatrix.sync.aligned.m8n8.x4.shared.b16, warp-wide: lane l has read row l % 8 of matrix l / 8
// (the 16 bytes lo, hi: portability.h's ldmatrix_x4 loads them as a shared read of that lane);
// lane t receives r[i] = the 32-bit word t % 4 of the row lane 8 i + t / 4 read.
void ldmatrix_exchange(uint32_t (&r)[4], uint64_t lo, uint64_t hi, const char* file, int line);
// Fails unless p lies in this block's shared memory (static or dynamic): `what` names the
// instruction that requires it.
void require_shared(const void* p, const char* what);

}  // namespace moelab::emu

#define threadIdx (::moelab::emu::ids().threadIdx)
#define blockIdx (::moelab::emu::ids().blockIdx)
#define blockDim (::moelab::emu::ids().blockDim)
#define gridDim (::moelab::emu::ids().gridDim)

#define MOELAB_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::moelab::emu::launch(#kernel, dim3(grid), dim3(block), size_t(smem), [&]() { kernel(__VA_ARGS__); })
#define MOELAB_GRID_CAP(c) ::moelab::emu::grid_cap(c)
#define MOELAB_EXTERN_SHARED(T, name) T* name = static_cast<T*>(::moelab::emu::dynamic_smem())

#define MOELAB_EMU_SITE const char* file = __builtin_FILE(), int line = __builtin_LINE()
inline void __syncthreads(MOELAB_EMU_SITE) { ::moelab::emu::sync_block(file, line); }

// ------------------------------------------------------------------- bit casts, math
inline unsigned __float_as_uint(float f) { return ::moelab::emu::unbits<unsigned>(::moelab::emu::bits(f)); }
inline float __uint_as_float(unsigned u) { return ::moelab::emu::unbits<float>(u); }
inline int __float_as_int(float f) { return int(__float_as_uint(f)); }
inline float __int_as_float(int i) { return __uint_as_float(unsigned(i)); }
inline long long __double_as_longlong(double d) { return ::moelab::emu::unbits<long long>(::moelab::emu::bits(d)); }
inline double __longlong_as_double(long long v) { return ::moelab::emu::unbits<double>(uint64_t(v)); }
using std::exp;
using std::fmaf;
using std::fmaxf;
inline int atomicCAS(int* p, int cmp, int val) {   // fibers never preempt each other
  const int old = *p;
  if (old == cmp) *p = val;
  return old;
}

#if MOELAB_EMU_WARP == 32
// ------------------------------------------------------------ CUDA-flavoured API
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int m, MOELAB_EMU_SITE) {
  return ::moelab::emu::shfl(v, (::moelab::emu::lane() ^ m) & 31, file, line);
}
inline unsigned __shfl_down_sync(unsigned, unsigned v, unsigned d, MOELAB_EMU_SITE) {
  const int src = ::moelab::emu::lane() + int(d);
  return ::moelab::emu::shfl(v, src < 32 ? src : ::moelab::emu::lane(), file, line);
}
inline unsigned __shfl_sync(unsigned, unsigned v, int src, MOELAB_EMU_SITE) {
  return ::moelab::emu::shfl(v, src & 31, file, line);
}
inline unsigned __ballot_sync(unsigned, bool p, MOELAB_EMU_SITE) {
  return unsigned(::moelab::emu::ballot_bits(p, file, line));
}
inline void __syncwarp(MOELAB_EMU_SITE) { (void)::moelab::emu::exchange(0, ::moelab::emu::kSync, file, line); }
inline int __popc(unsigned m) { return __builtin_popcount(m); }
inline int __ffs(int m) { return __builtin_ffs(m); }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
struct __half { uint16_t x; };
inline __half __ushort_as_half(uint16_t h) { return {h}; }
inline uint16_t __half_as_ushort(__half h) { return h.x; }
inline float __half2float(__half h) { return ::moelab::f16_to_f32(h.x); }
inline __half __float2half_rn(float f) { return {::moelab::f32_to_f16(f)}; }
using cudaError_t = int;
using cudaStream_t = void*;
constexpr int cudaSuccess = 0;
inline cudaError_t cudaGetLastError() { return ::moelab::emu::last_error(); }
inline const char* cudaGetErrorString(cudaError_t e) { return e == 0 ? "no error" : "invalid configuration (emulator)"; }
#else
// ------------------------------------------------------------- HIP-flavoured API
inline int __shfl_xor(int v, int m, MOELAB_EMU_SITE) {
  return ::moelab::emu::shfl(v, (::moelab::emu::lane() ^ m) & 63, file, line);
}
inline int __shfl_down(int v, unsigned d, MOELAB_EMU_SITE) {
  const int src = ::moelab::emu::lane() + int(d);
  return ::moelab::emu::shfl(v, src < 64 ? src : ::moelab::emu::lane(), file, line);
}
inline int __shfl(int v, int src, MOELAB_EMU_SITE) { return ::moelab::emu::shfl(v, src & 63, file, line); }
inline unsigned long long __ballot(bool p, MOELAB_EMU_SITE) { return ::moelab::emu::ballot_bits(p, file, line); }
inline int __popcll(unsigned long long m) { return __builtin_popcountll(m); }
inline int __ffsll(unsigned long long m) { return __builtin_ffsll(static_cast<long long>(m)); }
#define __builtin_amdgcn_fence(order, scope) ::moelab::emu::fence(order)
#define __builtin_amdgcn_wave_barrier() ::moelab::emu::wave_barrier(__FILE__, __LINE__)
using hipError_t = int;
using hipStream_t = void*;
constexpr int hipSuccess = 0;
inline hipError_t hipGetLastError() { return ::moelab::emu::last_error(); }
inline const char* hipGetErrorString(hipError_t e) { return e == 0 ? "no error" : "invalid configuration (emulator)"; }
#endif
