// router_gemm's CPU kernel, declared at each ISA level (see isa_dispatch.h). Kernels
// are torch-free: raw pointers, sizes, and a [begin, end) range that the binding hands out
// through at::parallel_for.
#pragma once
#include <cstdint>

#include "../common/formats.h"
#include "isa_dispatch.h"

MOELAB_CPU_KERNEL(void, router_gemm_experts,
                  (const void* x, moelab::Fmt fmt, int64_t ldx, const float* w, float* out,
                   int64_t T, int64_t H, int64_t E, int64_t e0, int64_t e1))
