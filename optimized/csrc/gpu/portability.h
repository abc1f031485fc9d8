// One header for CUDA (nvcc) and HIP (hipcc, AMD): everything the moelab GPU kernels use
// that differs between the two. Kernels include this and nothing vendor-specific.
//
//   kWarp            lanes of a warp / wavefront, a compile-time constant: 32 on CUDA,
//                    64 on AMD gfx9 (CDNA: gfx90a, gfx940/942). Never write 32 in shared code.
//   lanemask_t       a ballot's type (32 or 64 bits); ballot(), popc(), lanemask_lt()
//   shfl_xor/down/idx  warp shuffles (full-warp masks on CUDA); 64-bit values go as two halves
//   warp_sync()      orders memory between the lanes of a warp (__syncwarp on CUDA; a
//                    wave barrier on AMD, whose lanes run in lockstep)
//   ld16/st16        16-byte vector loads/stores (uint4), the unit of every row copy
//   bf16/f16         storage as uint16_t; conversions exact (widening) or round-to-nearest-
//                    even (narrowing), identical to csrc/common/formats.h (the CPU's), so a
//                    kernel rounds an output bit-for-bit like the CPU kernel does
//   mul_rn/add_rn    f32 multiply / add that the compiler may NOT fuse into an FMA
//   div_rn           f32 division rounded once (never an approximation)
//   round_bf16       an f32 rounded to bf16 (RNE) and widened back (one cvt on sm_80+)
//   mma_bf16_16816   CUDA sm_80+ only (MOELAB_HAS_MMA_BF16): one m16n8k16 bf16 tensor-core MMA
//   ldmatrix_x4      CUDA sm_80+ only (with MMA): four 8x8 b16 matrices from shared memory into
//                    the registers of the MMA's fragment layout (ldmatrix.sync.aligned.m8n8.x4)
//   cp_async16       16 bytes global -> shared, landing by cp_async_wait<N>() (cp.async on
//                    sm_80+, MOELAB_HAS_CP_ASYNC; a plain copy elsewhere)
//   Stream, Status   the stream handle and the launchers' return code (launch.h)
//
// The AMD wave size is fixed at 64: the host side of a launch cannot see the device
// compiler's __AMDGCN_WAVEFRONT_SIZE, so a wave32 target (RDNA) fails to build here
// instead of running with block shapes computed for the wrong width.
#pragma once

#include <cstdint>

#include "platform.h"
#if defined(MOELAB_EMU)
#include "emu/emu.h"
#elif MOELAB_HIP
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#endif

#include "../common/formats.h"

#define MOELAB_DEV __device__ __forceinline__

namespace moelab::gpu {

#if MOELAB_HIP
#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != 64
#error "moelab GPU kernels target wave64 AMD GPUs (gfx9 / CDNA: gfx90a, gfx940, gfx942)"
#endif
constexpr int kWarp = 64;
using lanemask_t = unsigned long long;
#else
constexpr int kWarp = 32;
using lanemask_t = unsigned int;
#endif
constexpr int kLogWarp = kWarp == 64 ? 6 : 5;
// Decode kernels (the weight-streaming GEMVs: router_gemm, skinny_gemm and fused_experts'
// small-m path) are bandwidth bound: they want many loads in flight, hence resident warps. They
// ask for kDecodeMinBlocks resident blocks in their __launch_bounds__ (CUDA: blocks per SM;
// HIP: waves per SIMD, which for these 4-wave blocks is the same count). With 4 warps per
// block that caps them at 128 registers per thread (CUDA: 64K registers / (4 * 128 threads);
// CDNA: 512 VGPRs / 4 waves). scripts/compile_check.py enforces it (docs/gpu.md, Occupancy).
constexpr int kDecodeMinBlocks = 4;
static_assert((1 << kLogWarp) == kWarp, "warp size must be a power of two");

// The emulator matches the lanes of a warp collective by their source location (emu/emu.h):
// in its builds every collective wrapper below takes the caller's file and line as defaulted
// trailing arguments and hands them on; elsewhere these macros are empty.
#if defined(MOELAB_EMU)
#define MOELAB_SITE_DECL , const char* site_file_ = __builtin_FILE(), int site_line_ = __builtin_LINE()
#define MOELAB_SITE_DECL1 const char* site_file_ = __builtin_FILE(), int site_line_ = __builtin_LINE()
#define MOELAB_SITE_ARG , site_file_, site_line_
#define MOELAB_SITE_ARG1 site_file_, site_line_
#define MOELAB_WAVE_BARRIER() ::moelab::emu::wave_barrier(site_file_, site_line_)
#else
#define MOELAB_SITE_DECL
#define MOELAB_SITE_DECL1
#define MOELAB_SITE_ARG
#define MOELAB_SITE_ARG1
#define MOELAB_WAVE_BARRIER() __builtin_amdgcn_wave_barrier()
#endif

// ------------------------------------------------------------------ lanes and warps
MOELAB_DEV int lane_id() { return int(threadIdx.x) & (kWarp - 1); }   // 1-D blocks only
MOELAB_DEV int warp_id() { return int(threadIdx.x) >> kLogWarp; }

MOELAB_DEV lanemask_t ballot(bool p MOELAB_SITE_DECL) {
#if MOELAB_HIP
  return __ballot(p MOELAB_SITE_ARG);
#else
  return __ballot_sync(0xffffffffu, p MOELAB_SITE_ARG);
#endif
}

MOELAB_DEV int popc(lanemask_t m) {
#if MOELAB_HIP
  return __popcll(m);
#else
  return __popc(m);
#endif
}

// Lanes below this one.
MOELAB_DEV lanemask_t lanemask_lt() { return (lanemask_t(1) << lane_id()) - 1; }

// Index of the lowest set bit (m != 0).
MOELAB_DEV int lowest_lane(lanemask_t m) {
#if MOELAB_HIP
  return __ffsll(static_cast<unsigned long long>(m)) - 1;
#else
  return __ffs(static_cast<int>(m)) - 1;
#endif
}

MOELAB_DEV void warp_sync(MOELAB_SITE_DECL1) {
#if MOELAB_HIP
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  MOELAB_WAVE_BARRIER();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp(MOELAB_SITE_ARG1);
#endif
}

// ------------------------------------------------------------------------- shuffles
// 32-bit types directly; 64-bit as two 32-bit halves (portable on every HIP version).
MOELAB_DEV uint32_t shfl_xor(uint32_t v, int m MOELAB_SITE_DECL) {
#if MOELAB_HIP
  return uint32_t(__shfl_xor(int(v), m MOELAB_SITE_ARG));
#else
  return __shfl_xor_sync(0xffffffffu, v, m MOELAB_SITE_ARG);
#endif
}
MOELAB_DEV uint32_t shfl_down(uint32_t v, int d MOELAB_SITE_DECL) {
#if MOELAB_HIP
  return uint32_t(__shfl_down(int(v), unsigned(d) MOELAB_SITE_ARG));
#else
  return __shfl_down_sync(0xffffffffu, v, unsigned(d) MOELAB_SITE_ARG);
#endif
}
MOELAB_DEV uint32_t shfl_idx(uint32_t v, int src MOELAB_SITE_DECL) {
#if MOELAB_HIP
  return uint32_t(__shfl(int(v), src MOELAB_SITE_ARG));
#else
  return __shfl_sync(0xffffffffu, v, src MOELAB_SITE_ARG);
#endif
}
MOELAB_DEV int32_t shfl_xor(int32_t v, int m MOELAB_SITE_DECL) { return int32_t(shfl_xor(uint32_t(v), m MOELAB_SITE_ARG)); }
MOELAB_DEV int32_t shfl_down(int32_t v, int d MOELAB_SITE_DECL) { return int32_t(shfl_down(uint32_t(v), d MOELAB_SITE_ARG)); }
MOELAB_DEV int32_t shfl_idx(int32_t v, int s MOELAB_SITE_DECL) { return int32_t(shfl_idx(uint32_t(v), s MOELAB_SITE_ARG)); }
MOELAB_DEV float shfl_xor(float v, int m MOELAB_SITE_DECL) { return __uint_as_float(shfl_xor(__float_as_uint(v), m MOELAB_SITE_ARG)); }
MOELAB_DEV float shfl_down(float v, int d MOELAB_SITE_DECL) { return __uint_as_float(shfl_down(__float_as_uint(v), d MOELAB_SITE_ARG)); }
MOELAB_DEV float shfl_idx(float v, int s MOELAB_SITE_DECL) { return __uint_as_float(shfl_idx(__float_as_uint(v), s MOELAB_SITE_ARG)); }
MOELAB_DEV uint64_t shfl_xor(uint64_t v, int m MOELAB_SITE_DECL) {
  uint32_t lo = shfl_xor(uint32_t(v), m MOELAB_SITE_ARG), hi = shfl_xor(uint32_t(v >> 32), m MOELAB_SITE_ARG);
  return (uint64_t(hi) << 32) | lo;
}
MOELAB_DEV uint64_t shfl_idx(uint64_t v, int s MOELAB_SITE_DECL) {
  uint32_t lo = shfl_idx(uint32_t(v), s MOELAB_SITE_ARG), hi = shfl_idx(uint32_t(v >> 32), s MOELAB_SITE_ARG);
  return (uint64_t(hi) << 32) | lo;
}
MOELAB_DEV double shfl_xor(double v, int m MOELAB_SITE_DECL) {
  return __longlong_as_double(static_cast<long long>(shfl_xor(static_cast<uint64_t>(__double_as_longlong(v)), m MOELAB_SITE_ARG)));
}
MOELAB_DEV double shfl_idx(double v, int s MOELAB_SITE_DECL) {
  return __longlong_as_double(static_cast<long long>(shfl_idx(static_cast<uint64_t>(__double_as_longlong(v)), s MOELAB_SITE_ARG)));
}

// ---------------------------------------------------------------- 16-byte vectors
// ld_vec / st_vec: one naturally aligned vector access of V (uint4, uint2, or a scalar); the
// emulator checks the alignment (a misaligned vector access faults on a GPU).
template <typename V> MOELAB_DEV V ld_vec(const V* p) {
#if defined(MOELAB_EMU)
  ::moelab::emu::vector_access(p, sizeof(V), false);
#endif
  return *p;
}
template <typename V> MOELAB_DEV void st_vec(V* p, V v) {
#if defined(MOELAB_EMU)
  ::moelab::emu::vector_access(p, sizeof(V), true);
#endif
  *p = v;
}
using vec16 = uint4;   // 16 bytes: 8 bf16/f16, 4 f32
MOELAB_DEV vec16 ld16(const void* p) { return ld_vec(static_cast<const vec16*>(p)); }
MOELAB_DEV void st16(void* p, vec16 v) { st_vec(static_cast<vec16*>(p), v); }
MOELAB_HD bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ----------------------------------------------------------- number formats
// bf16: the upper half of an f32 (widening is a shift); narrowing is formats.h's RNE.
MOELAB_DEV float bf16_lo(uint32_t pair) { return __uint_as_float(pair << 16); }
MOELAB_DEV float bf16_hi(uint32_t pair) { return __uint_as_float(pair & 0xffff0000u); }
MOELAB_DEV float bf16_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }
// The rounding of formats.h's f32_to_bf16, with register bit casts (no memcpy).
MOELAB_DEV uint16_t f32_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);   // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// f16 through the hardware conversions (exact widening, RNE narrowing, as formats.h).
MOELAB_DEV float f16_f32(uint16_t h) {
#if MOELAB_HIP
  return float(__builtin_bit_cast(_Float16, h));
#else
  return __half2float(__ushort_as_half(h));
#endif
}
MOELAB_DEV uint16_t f32_f16(float f) {
#if MOELAB_HIP
  return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f));
#else
  return __half_as_ushort(__float2half_rn(f));
#endif
}

// Storage format -> f32 for one element at p (element index i).
template <Fmt F> MOELAB_DEV float load_elem(const void* p, int64_t i) {
  if constexpr (F == Fmt::kF32) return static_cast<const float*>(p)[i];
  else if constexpr (F == Fmt::kBF16) return bf16_f32(static_cast<const uint16_t*>(p)[i]);
  else return f16_f32(static_cast<const uint16_t*>(p)[i]);
}
template <Fmt F> MOELAB_DEV void store_elem(void* p, int64_t i, float v) {
  if constexpr (F == Fmt::kF32) static_cast<float*>(p)[i] = v;
  else if constexpr (F == Fmt::kBF16) static_cast<uint16_t*>(p)[i] = f32_bf16(v);
  else static_cast<uint16_t*>(p)[i] = f32_f16(v);
}

// 8 consecutive elements from 16 bytes (bf16/f16) -> f32.
template <Fmt F> MOELAB_DEV void unpack8(vec16 v, float* d) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (F == Fmt::kBF16) {
      d[2 * i] = bf16_lo(w[i]);
      d[2 * i + 1] = bf16_hi(w[i]);
    } else {
      d[2 * i] = f16_f32(uint16_t(w[i] & 0xffffu));
      d[2 * i + 1] = f16_f32(uint16_t(w[i] >> 16));
    }
  }
}
// 4 f32 from 16 bytes.
MOELAB_DEV void unpack4_f32(vec16 v, float* d) {
  d[0] = __uint_as_float(v.x); d[1] = __uint_as_float(v.y);
  d[2] = __uint_as_float(v.z); d[3] = __uint_as_float(v.w);
}
// Two f32 -> one 32-bit word of two narrow elements (element 0 in the low half).
template <Fmt F> MOELAB_DEV uint32_t pack2(float a, float b) {
  if constexpr (F == Fmt::kBF16) return uint32_t(f32_bf16(a)) | (uint32_t(f32_bf16(b)) << 16);
  else return uint32_t(f32_f16(a)) | (uint32_t(f32_f16(b)) << 16);
}

// ------------------------------------------------- f32 arithmetic with no contraction
// Each rounds once; the compiler may not fuse a mul_rn into a following add_rn (nvcc: the
// __f*_rn intrinsics are never contracted; clang/HIP: contraction switched off here).
MOELAB_DEV float mul_rn(float a, float b) {
#if MOELAB_HIP
#pragma clang fp contract(off)
  return a * b;
#else
  return __fmul_rn(a, b);
#endif
}
MOELAB_DEV float add_rn(float a, float b) {
#if MOELAB_HIP
#pragma clang fp contract(off)
  return a + b;
#else
  return __fadd_rn(a, b);
#endif
}

// f32 division rounded once (nvcc: __fdiv_rn, never the approximate division of fast-math;
// clang/HIP: its default f32 division is the correctly rounded one).
MOELAB_DEV float div_rn(float a, float b) {
#if MOELAB_HIP
  return a / b;
#else
  return __fdiv_rn(a, b);
#endif
}

// f rounded to bf16 (round to nearest even), returned as the f32 of that bf16. CUDA sm_80+:
// one cvt.rn.bf16.f32; elsewhere the integer rounding of f32_bf16. The same value for every
// input; only a NaN's payload may differ (the hardware returns the canonical NaN).
MOELAB_DEV float round_bf16(float f) {
#if defined(MOELAB_EMU) && MOELAB_EMU_MMA
  return __uint_as_float(uint32_t(::moelab::emu::cvt_rn_bf16_f32(f)) << 16);   // the emulated cvt
#elif !MOELAB_HIP && !defined(MOELAB_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return __uint_as_float(uint32_t(h) << 16);
#else
  return bf16_f32(f32_bf16(f));
#endif
}

// ------------------------------------------------------------------------ tensor cores
// MOELAB_HAS_MMA_BF16: 1 while compiling device code for CUDA sm_80 or newer, where
// mma_bf16_16816 is one warp-wide mma.sync.m16n8k16 (bf16 inputs, f32 accumulators):
//   d[0..3] += A(16x16, row-major) . B(16x8, "col": B[k][n] = W[n][k]), fragments as in the
//   PTX ISA: a[0] = A[g][2c..2c+1], a[1] = A[g+8][2c..], a[2] = A[g][2c+8..], a[3] = A[g+8][2c+8..];
//   b[0] = B[2c..2c+1][g], b[1] = B[2c+8..][g]; d[0..1] = D[g][2c..2c+1], d[2..3] = D[g+8][2c..]
//   (g = lane / 4, c = lane % 4; the lower k of a pair in the low 16 bits).
// The order in which the hardware adds the 16 products into d is not specified: results are
// deterministic on one GPU model but not the order of a scalar loop. 0 on HIP, in the
// emulator's default builds and in host passes, where kernels take their SIMT branch. The
// emulator's MMA build (MOELAB_EMU_MMA, 32-lane warps) runs this branch with the instruction
// emulated (emu/emu.h: the same fragment layout).
#if defined(MOELAB_EMU) && MOELAB_EMU_MMA
#if MOELAB_EMU_WARP != 32
#error "MOELAB_EMU_MMA emulates a CUDA instruction: 32-lane warps only"
#endif
#define MOELAB_HAS_MMA_BF16 1
MOELAB_DEV void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2] MOELAB_SITE_DECL) {
  ::moelab::emu::mma_m16n8k16_bf16(d, a, b, site_file_, site_line_);
}
#elif !MOELAB_HIP && !defined(MOELAB_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MOELAB_HAS_MMA_BF16 1
MOELAB_DEV void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
#define MOELAB_HAS_MMA_BF16 0
#endif

// ldmatrix_x4(r, row): warp-wide, four 8x8 matrices of 16-bit elements from shared memory. Lane
// l hands in the address of row l % 8 of matrix l / 8 (16 contiguous bytes, 16-byte aligned);
// lane t receives in r[i] the pair of elements (row t / 4, columns 2 (t % 4), +1) of matrix i,
// the lower column in the low half. That is the mma_bf16_16816 fragment layout: for a
// row-major A tile the lanes' rows (l % 16, k offset 8 (l / 16)) give a[0..3]; for a weight tile
// stored n-major (W[n][k], i.e. B column-major) the rows (n offset 8 (l / 16) + l % 8, k offset
// 8 ((l / 8) % 2)) give b[0..1] of two n8 blocks. Only where MOELAB_HAS_MMA_BF16 (sm_75+ has the
// instruction; the kernels use it with the MMA). The emulator's MMA build loads each lane's row
// as a 16-byte shared read of that lane (so the race, uninitialised-read and alignment rules
// apply to it) and exchanges the rows across the warp.
#if MOELAB_HAS_MMA_BF16 && defined(MOELAB_EMU)
MOELAB_DEV void ldmatrix_x4(uint32_t (&r)[4], const void* row MOELAB_SITE_DECL) {
  ::moelab::emu::require_shared(row, "ldmatrix");
  const vec16 v = ld16(row);
  ::moelab::emu::ldmatrix_exchange(r, v.x | (uint64_t(v.y) << 32), v.z | (uint64_t(v.w) << 32), site_file_, site_line_);
}
#elif MOELAB_HAS_MMA_BF16
MOELAB_DEV void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}
#endif

// ----------------------------------------------------------------------- async copies
// cp_async16(dst, src): 16 bytes from global src to shared dst (both 16-byte aligned) that land
// by this thread's cp_async_wait<N>(), which returns once at most N committed groups newer than
// the copy's are pending (cp_async_commit() closes a group). Until the wait nothing may touch
// dst; other threads see it after the wait and a barrier. CUDA sm_80+: cp.async.cg (L2 only),
// commit_group, wait_group. HIP, older CUDA and host passes: a plain 16-byte copy at issue and
// no-ops, which keeps the same contract. The emulator's 32-lane builds defer the copy to the
// wait and fail an access to a pending destination (emu/emu.h).
#if defined(MOELAB_EMU) && MOELAB_EMU_WARP == 32
#define MOELAB_HAS_CP_ASYNC 1
MOELAB_DEV void cp_async16(void* dst, const void* src) { ::moelab::emu::async_copy(dst, src, 16); }
MOELAB_DEV void cp_async_commit() { ::moelab::emu::async_commit(); }
template <int N> MOELAB_DEV void cp_async_wait() { ::moelab::emu::async_wait(N); }
#elif !MOELAB_HIP && !defined(MOELAB_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MOELAB_HAS_CP_ASYNC 1
MOELAB_DEV void cp_async16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
}
MOELAB_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> MOELAB_DEV void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
#else
#define MOELAB_HAS_CP_ASYNC 0
MOELAB_DEV void cp_async16(void* dst, const void* src) { st16(dst, ld16(src)); }
MOELAB_DEV void cp_async_commit() {}
template <int N> MOELAB_DEV void cp_async_wait() {}
#endif

}  // namespace moelab::gpu

// Kernel launch, written once for both compilers (and for the CPU emulator that tests run:
// csrc/gpu/emu/, where a launch runs the threads as fibers).
#ifndef MOELAB_LAUNCH
#define MOELAB_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#endif
// A launcher's cap on a grid dimension, for kernels with grid-stride loops (the emulator can
// lower it, so that tests reach those loops with small inputs).
#ifndef MOELAB_GRID_CAP
#define MOELAB_GRID_CAP(c) (c)
#endif
// Dynamically sized shared memory (the launch's smem bytes).
#ifndef MOELAB_EXTERN_SHARED
#define MOELAB_EXTERN_SHARED(T, name) extern __shared__ T name[]
#endif

// Launch check inside a launcher: returns the runtime's error code (> 0) from the function.
#if MOELAB_HIP
#define MOELAB_GPU_LAUNCHED()                                   \
  do {                                                          \
    hipError_t moelab_e_ = hipGetLastError();                   \
    if (moelab_e_ != hipSuccess) return static_cast<int>(moelab_e_); \
  } while (0)
#else
#define MOELAB_GPU_LAUNCHED()                                    \
  do {                                                           \
    cudaError_t moelab_e_ = cudaGetLastError();                  \
    if (moelab_e_ != cudaSuccess) return static_cast<int>(moelab_e_); \
  } while (0)
#endif
