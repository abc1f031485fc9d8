// Opens one ISA level of a CPU kernel source. A kernel `foo` lives in foo_kernel.h and is
// compiled four times by one-line files (foo_scalar.cpp, foo_avx2.cpp, foo_avx512.cpp,
// foo_avx512bf16.cpp) that define MOELAB_ISA_LEVEL (0..3) and include it; on aarch64 twice
// (foo_scalar.cpp, foo_neon.cpp), on other architectures once (foo_scalar.cpp). This header:
//   1. includes the standard headers kernels may use, BEFORE the target pragma, so no
//      standard-library code is compiled for a higher ISA than the caller's;
//   2. switches code generation to the level with `#pragma GCC target`;
//   3. names the namespace MOELAB_ISA_NS (scalar / avx2 / avx512 / avx512bf16 / neon), so each
//      level's functions are distinct symbols (no ODR clash between levels);
//   4. brings in vec.h, the small SIMD vocabulary, compiled for that level.
// Kernel code after this header must not instantiate standard-library templates
// (std::sort, std::vector, ...): use the helpers of vec.h and plain loops.
//
// Architectures. MOELAB_ISA_LEVEL is the x86 level and is 0 on every other architecture, so
// x86 code gated by `MOELAB_ISA_LEVEL >= 1` is never compiled for Arm. MOELAB_ISA_X86 (1 on
// x86-64 / i386, else 0) and MOELAB_ISA_NEON (1 only in the aarch64 NEON wrappers, which
// define it with MOELAB_ISA_LEVEL 0) name the architecture: Arm code sits in `#elif
// MOELAB_ISA_NEON` branches beside the x86 ones, and a level-0 translation unit without
// MOELAB_ISA_NEON is the portable (scalar) level on every architecture. A non-x86 compiler
// sees no x86 header, pragma or intrinsic; NEON (ASIMD) is baseline on aarch64, so its level
// needs no target pragma, only <arm_neon.h>.
#ifndef MOELAB_ISA_LEVEL
#error "define MOELAB_ISA_LEVEL (0 scalar, 1 avx2, 2 avx512, 3 avx512_bf16) before including"
#endif
#if defined(__x86_64__) || defined(__i386__)
#define MOELAB_ISA_X86 1
#else
#define MOELAB_ISA_X86 0
#endif
#ifndef MOELAB_ISA_NEON
#define MOELAB_ISA_NEON 0
#endif
#if MOELAB_ISA_NEON && !defined(__aarch64__)
#error "MOELAB_ISA_NEON is an aarch64 level"
#endif
#if MOELAB_ISA_LEVEL != 0 && !MOELAB_ISA_X86
#error "MOELAB_ISA_LEVEL >= 1 is an x86 level"
#endif
#if MOELAB_ISA_NEON && MOELAB_ISA_LEVEL != 0
#error "the NEON level has MOELAB_ISA_LEVEL 0"
#endif
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if MOELAB_ISA_X86
#include <immintrin.h>
#elif MOELAB_ISA_NEON
#include <arm_neon.h>
#endif

#include "../common/formats.h"
#include "isa.h"

#if MOELAB_ISA_LEVEL == 3
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c,bmi,bmi2,popcnt")
#define MOELAB_ISA_NS avx512bf16
#elif MOELAB_ISA_LEVEL == 2
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,popcnt")
#define MOELAB_ISA_NS avx512
#elif MOELAB_ISA_LEVEL == 1
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,popcnt")
#define MOELAB_ISA_NS avx2
#elif MOELAB_ISA_NEON
#define MOELAB_ISA_NS neon
#else
#define MOELAB_ISA_NS scalar
#endif

#include "vec.h"
