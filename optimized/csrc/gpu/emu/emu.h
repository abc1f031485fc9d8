// A small SIMT emulator: the moelab GPU kernels, unchanged, compiled by the host C++ compiler
// and run on the CPU, so their logic is tested on machines without a GPU (tests/
// test_gpu_emulated.py). Not a simulator of performance or of memory ordering: a test tool.
//
// Build with -DMOELAB_EMU -DMOELAB_EMU_WARP=32 (CUDA flavour: the CUDA branch of
// portability.h runs against emulated __shfl_*_sync / __ballot_sync / ...) or =64 (HIP
// flavour: the HIP branch runs, 64-lane wavefronts). Every thread of a block is a fiber
// (ucontext); a fiber runs until it reaches a warp collective (shuffle, ballot, warp_sync)
// or __syncthreads, and the collective completes when every live lane of its warp (every
// live thread of its block) has arrived. Blocks run one after another. The emulator fails
// loudly (RuntimeError from the launch) on a collective that a warp reaches with some lanes
// exited or absent, on a deadlock (lanes of a warp waiting at different barriers), and on a
// launch configuration CUDA would reject. The order in which fibers run between barriers is
// shuffled (seeded: MOELAB_EMU_SEED), which exposes some missing barriers.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

#include "../../common/formats.h"

#ifndef MOELAB_EMU_WARP
#define MOELAB_EMU_WARP 32
#endif

// ------------------------------------------------------------- language keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };

namespace moelab::emu {

constexpr int kEmuWarp = MOELAB_EMU_WARP;

struct Ids {
  dim3 threadIdx, blockIdx, blockDim, gridDim;
};
const Ids& ids();
int lane();
// Deposit v for this lane's warp collective, wait for the warp, return its kEmuWarp slots.
const uint64_t* exchange(uint64_t v);
void sync_block();
void* dynamic_smem();
void launch(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body);
int last_error();   // 0, or 9 (invalid configuration) after a rejected launch; then cleared

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
template <typename T> inline T shfl(T v, int src) {
  const uint64_t* s = exchange(bits(v));
  return unbits<T>(s[src]);
}
inline uint64_t ballot_bits(bool p) {
  const uint64_t* s = exchange(p ? 1u : 0u);
  uint64_t m = 0;
  for (int l = 0; l < kEmuWarp; ++l) m |= (s[l] & 1u) << l;
  return m;
}

}  // namespace moelab::emu

#define threadIdx (::moelab::emu::ids().threadIdx)
#define blockIdx (::moelab::emu::ids().blockIdx)
#define blockDim (::moelab::emu::ids().blockDim)
#define gridDim (::moelab::emu::ids().gridDim)

#define MOELAB_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::moelab::emu::launch(dim3(grid), dim3(block), size_t(smem), [&]() { kernel(__VA_ARGS__); })
#define MOELAB_EXTERN_SHARED(T, name) T* name = static_cast<T*>(::moelab::emu::dynamic_smem())

inline void __syncthreads() { ::moelab::emu::sync_block(); }

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
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int m) {
  return ::moelab::emu::shfl(v, (::moelab::emu::lane() ^ m) & 31);
}
inline unsigned __shfl_down_sync(unsigned, unsigned v, unsigned d) {
  const int src = ::moelab::emu::lane() + int(d);
  const unsigned got = ::moelab::emu::shfl(v, src < 32 ? src : ::moelab::emu::lane());
  return got;
}
inline unsigned __shfl_sync(unsigned, unsigned v, int src) { return ::moelab::emu::shfl(v, src & 31); }
inline unsigned __ballot_sync(unsigned, bool p) { return unsigned(::moelab::emu::ballot_bits(p)); }
inline void __syncwarp() { (void)::moelab::emu::exchange(0); }
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
inline int __shfl_xor(int v, int m) { return ::moelab::emu::shfl(v, (::moelab::emu::lane() ^ m) & 63); }
inline int __shfl_down(int v, unsigned d) {
  const int src = ::moelab::emu::lane() + int(d);
  return ::moelab::emu::shfl(v, src < 64 ? src : ::moelab::emu::lane());
}
inline int __shfl(int v, int src) { return ::moelab::emu::shfl(v, src & 63); }
inline unsigned long long __ballot(bool p) { return ::moelab::emu::ballot_bits(p); }
inline int __popcll(unsigned long long m) { return __builtin_popcountll(m); }
inline int __ffsll(unsigned long long m) { return __builtin_ffsll(static_cast<long long>(m)); }
#define __builtin_amdgcn_fence(order, scope) ((void)0)
#define __builtin_amdgcn_wave_barrier() ((void)::moelab::emu::exchange(0))
using hipError_t = int;
using hipStream_t = void*;
constexpr int hipSuccess = 0;
inline hipError_t hipGetLastError() { return ::moelab::emu::last_error(); }
inline const char* hipGetErrorString(hipError_t e) { return e == 0 ? "no error" : "invalid configuration (emulator)"; }
#endif
