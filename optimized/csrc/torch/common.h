// Shared by the thin torch bindings: argument checks that name the op and the argument,
// the per-op ISA registry behind optimized.backend_info(), and at::parallel_for helpers.
//
// The Python layer (reference/validate.py) validates every public call first; these checks
// are the C++ floor that keeps a direct torch.ops.moelab call from reading or writing out
// of bounds: shapes, dtypes, devices, contiguity and index ranges the kernels rely on.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/formats.h"
#include "../cpu/isa.h"
#include "../cpu/isa_dispatch.h"

#define MOELAB_CHECK(cond, op, arg, ...) \
  TORCH_CHECK((cond), "moelab::", op, ": argument '", arg, "' ", __VA_ARGS__)

namespace moelab {

// Rank, dtype and (optionally) contiguity of a CPU tensor.
void check_cpu(const at::Tensor& t, const char* op, const char* arg, int64_t ndim,
               std::initializer_list<at::ScalarType> dtypes, bool contiguous = true);
// Every value of an integer tensor in [lo, hi).
void check_range(const at::Tensor& t, const char* op, const char* arg, int64_t lo, int64_t hi);

// A finite float scalar (the Python layer's check_float; alpha, limit, scaling, ...).
void check_finite(double v, const char* op, const char* arg);

// The number of elements of an output whose sizes come from different arguments (T from one
// tensor, E from another: each tensor's own numel is bounded by torch, their product is not;
// a stride-0 expanded input has any size at no memory cost). Refuses, naming `arg`, a product
// whose byte size (elem_size bytes each) does not fit int64, before anything is allocated or
// any index is computed from it. Returns the product.
int64_t check_numel(std::initializer_list<int64_t> sizes, int64_t elem_size, const char* op, const char* arg);

// The no-overlap rule of out= / scratch arguments: an output may share no byte with an input
// or with another output (a kernel that reads an input while it writes an output, or uses one
// output as its cursors while it fills another, would read its own writes). Checked on the
// byte span [first, last] each tensor can touch, a few integer compares per pair:
// conservative for interleaved strided views (refused although they might not collide), exact
// for the contiguous buffers every out= path takes. An output's own internal overlap (a
// stride-0 expanded buffer) is refused by the contiguity check every out= buffer gets.
struct Span {
  const char* name;
  uintptr_t lo, hi;  // [lo, hi) bytes; lo == hi for an empty or undefined tensor
};
Span span_of(const at::Tensor& t, const char* name);
void check_disjoint(std::initializer_list<Span> inputs, std::initializer_list<Span> outputs, const char* op);

// The storage format a kernel reads for a float tensor (f32, bf16 or f16).
Fmt fmt_of(const at::Tensor& t);

// Each binding records the highest ISA level its kernels specialize for; backend_info()
// reports min(active ISA, that level) per op.
int register_op_level(const char* op, cpu::Isa max_level);
cpu::Isa op_isa(cpu::Isa max_level);

}  // namespace moelab
