// Shared by the thin CPU torch bindings: argument checks that name the op and the argument
// (the device-independent ones are in checks.h, shared with the GPU bindings), the per-op ISA
// registry behind optimized.backend_info(), and at::parallel_for helpers.
//
// The Python layer (reference/validate.py) validates every public call first; these checks
// are the C++ floor that keeps a direct torch.ops.moelab call from reading or writing out
// of bounds: shapes, dtypes, devices, contiguity and index ranges the kernels rely on.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/formats.h"
#include "checks.h"
#include "../cpu/isa.h"
#include "../cpu/isa_dispatch.h"

namespace moelab {

using checks::check_disjoint;
using checks::check_finite;
using checks::check_numel;
using checks::check_tensor;
using checks::span_of;
using checks::Span;

// A CPU tensor: the device, then check_tensor's rank, dtype and (optionally) contiguity.
void check_cpu(const at::Tensor& t, const char* op, const char* arg, int64_t ndim,
               std::initializer_list<at::ScalarType> dtypes, bool contiguous = true);
// Just the device (the rest is a checks::check_<op>_args call).
void check_is_cpu(const at::Tensor& t, const char* op, const char* arg);
// Every value of an integer tensor in [lo, hi).
void check_range(const at::Tensor& t, const char* op, const char* arg, int64_t lo, int64_t hi);

// The storage format a kernel reads for a float tensor (f32, bf16 or f16).
Fmt fmt_of(const at::Tensor& t);

// Each binding records the highest ISA level its kernels specialize for; backend_info()
// reports min(active ISA, that level) per op.
int register_op_level(const char* op, cpu::Isa max_level);
cpu::Isa op_isa(cpu::Isa max_level);

}  // namespace moelab
