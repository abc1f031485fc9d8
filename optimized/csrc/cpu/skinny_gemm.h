// skinny_gemm's CPU kernel, declared at each ISA level (see isa_dispatch.h). Torch-free:
// raw pointers, element strides, sizes, and the [n0, n1) range of output features that
// the binding hands out through at::parallel_for. See skinny_gemm_kernel.h.
#pragma once
#include <cstdint>

#include "../common/formats.h"
#include "isa_dispatch.h"

MOELAB_CPU_KERNEL(void, skinny_gemm_rows,
                  (const void* x, int64_t ldx, const void* w, int64_t ldw, const void* bias,
                   void* out, int64_t ldo, moelab::Fmt fmt, int64_t T, int64_t K, int64_t n0,
                   int64_t n1))
