// Opens one ISA level of a CPU kernel source. A kernel `foo` lives in foo_kernel.h and is
// compiled four times by one-line files (foo_scalar.cpp, foo_avx2.cpp, foo_avx512.cpp,
// foo_avx512bf16.cpp) that define MOELAB_ISA_LEVEL (0..3) and include it. This header:
//   1. includes the standard headers kernels may use, BEFORE the target pragma, so no
//      standard-library code is compiled for a higher ISA than the caller's;
//   2. switches code generation to the level with `#pragma GCC target`;
//   3. names the namespace MOELAB_ISA_NS (scalar / avx2 / avx512 / avx512bf16), so each
//      level's functions are distinct symbols (no ODR clash between levels);
//   4. brings in vec.h, the small SIMD vocabulary, compiled for that level.
// Kernel code after this header must not instantiate standard-library templates
// (std::sort, std::vector, ...): use the helpers of vec.h and plain loops.
#ifndef MOELAB_ISA_LEVEL
#error "define MOELAB_ISA_LEVEL (0 scalar, 1 avx2, 2 avx512, 3 avx512_bf16) before including"
#endif
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

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
#else
#define MOELAB_ISA_NS scalar
#endif

#include "vec.h"
