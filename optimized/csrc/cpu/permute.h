// permute / unpermute CPU kernels, declared at each ISA level (see isa_dispatch.h).
// Torch-free: raw pointers, sizes and strides; the binding (csrc/torch/permute.cpp) checks
// the tensors, hands out [begin, end) ranges through at::parallel_for and turns a nonzero
// status of permute_plan into a TORCH_CHECK error.
#pragma once
#include <cstdint>

#include "../common/formats.h"
#include "isa_dispatch.h"

namespace moelab::cpu {
// permute_plan's result. On an error *bad holds the offending value (id or map entry).
enum PermuteStatus : int {
  kPermuteOk = 0,
  kPermuteBadId = 1,      // an id outside [-1, n_experts)
  kPermuteBadMap = 2,     // an expert_map entry outside [-1, n_local)
  kPermuteInternal = 3,   // the two passes over ids disagreed (aliased buffers); nothing out of bounds
};
}  // namespace moelab::cpu

// The index part of permute, serial: validates ids/expert_map, builds offsets[n_local+1],
// src_row[capacity] (every entry written) and dst_pos[T*K] (every entry written).
// ids[t, j] is at ids + t*ld_t + j*ld_k elements (int64 when ids_int64, else int32);
// expert_map (nullable) holds n_experts int32 entries, map_stride apart. counts[n_local] is
// workspace. capacity must equal T*K + n_local*(align-1).
MOELAB_CPU_KERNEL(int, permute_plan,
                  (const void* ids, bool ids_int64, int64_t T, int64_t K, int64_t ld_t, int64_t ld_k,
                   const int32_t* expert_map, int64_t map_stride, int64_t n_experts, int64_t n_local,
                   int64_t align, int64_t* counts, int64_t* offsets, int32_t* src_row,
                   int64_t capacity, int32_t* dst_pos, int64_t* bad))

// Destination rows [p0, p1) of permute's hidden output (row_bytes each, contiguous): row p is
// a copy of the input row src_row[p] / K (input rows ld_bytes apart), or zeros when
// src_row[p] < 0. src_row must come from permute_plan (entries < T*K).
MOELAB_CPU_KERNEL(void, permute_rows,
                  (const void* hidden, int64_t ld_bytes, void* out, int64_t row_bytes,
                   const int32_t* src_row, int64_t K, int64_t p0, int64_t p1))

// Tokens [t0, t1) of unpermute: out[t] = round(sum over j ascending with dst_pos[t*K+j] >= 0
// of weights[t, j] * f32(expert_out[dst_pos[t*K+j]])), f32, no FMA. expert_out rows are ld
// elements apart (unit stride along H), weights[t, j] at w + t*ldw_t + j*ldw_k, dst_pos
// contiguous with every entry in [-1, rows of expert_out). out is [T, H] contiguous, fmt.
MOELAB_CPU_KERNEL(void, unpermute_tokens,
                  (const void* expert_out, moelab::Fmt fmt, int64_t ld, const float* w,
                   int64_t ldw_t, int64_t ldw_k, const int32_t* dst_pos, int64_t K, int64_t H,
                   void* out, int64_t t0, int64_t t1))
