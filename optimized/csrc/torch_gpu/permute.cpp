// CUDA/ROCm implementations of moelab::permute, permute_out and unpermute (schemas in
// csrc/torch/permute.cpp): the argument checks shared with the CPU bindings (csrc/torch/checks.h),
// then the launchers of csrc/gpu/permute.cu.
//
// Workspace. The GPU counting sort keeps one expert histogram per unit of rows:
// gpu::permute_workspace_words(T*K, E_loc) int32 words. permute allocates it from torch's
// caching allocator with its outputs; permute_out takes it as `counts` (int64, at least half
// that many elements, see optimized.gpu.permute_counts_numel), so with a PermuteScratch sized
// for CUDA a call allocates nothing.
//
// Index errors (ids, expert_map, dst_pos out of range) are detected by the kernels, which
// never write outside the outputs, and written to a status word. Unless the stream is being
// captured into a CUDA graph, the binding reads the word back (one small synchronous copy)
// and raises the same RuntimeError as the CPU binding; during capture (or with
// MOELAB_GPU_SYNC_CHECKS=0, for timing the eager host path) the check is left to the caller
// (verify runs eagerly with checks on, so it sees every error).
#include <climits>

#include "common.h"

namespace moelab::gpu_binding {
namespace {

constexpr const char* kPermute = "permute";
constexpr const char* kPermuteOut = "permute_out";   // same checks, its own name in messages
constexpr const char* kUnpermute = "unpermute";

using Sizes = checks::PermuteSizes;

// The device of every tensor argument (all on hidden's GPU), then the shared checks.
Sizes check_inputs(const char* op, const at::Tensor& hidden, const at::Tensor& ids, int64_t n_experts,
                   const std::optional<at::Tensor>& expert_map, int64_t n_local, int64_t align) {
  check_is_gpu(hidden, op, "hidden");
  check_is_gpu(ids, op, "ids", &hidden);
  if (expert_map.has_value()) check_is_gpu(*expert_map, op, "expert_map", &hidden);
  return checks::check_permute_args(op, hidden, ids, n_experts, expert_map, n_local, align);
}

void check_out(const at::Tensor& t, const char* arg, at::ScalarType dtype, at::IntArrayRef shape,
               const at::Tensor& like) {
  check_is_gpu(t, kPermuteOut, arg, &like);
  checks::check_out_buffer(t, kPermuteOut, arg, dtype, shape);
}

void run(const char* op, const at::Tensor& hidden_in, const at::Tensor& ids, int64_t n_experts,
         const std::optional<at::Tensor>& expert_map, const Sizes& s, int64_t align, const at::Tensor& offsets,
         const at::Tensor& hidden_out, const at::Tensor& src_row, const at::Tensor& dst_pos, const at::Tensor& ws) {
  // Rows closer than H elements (a stride-0 expanded hidden, accepted as on the CPU) are
  // copied: the launcher wants rows at least row_bytes apart.
  const at::Tensor hidden = s.T > 1 && s.H > 0 && hidden_in.stride(0) < s.H ? hidden_in.contiguous() : hidden_in;
  const int64_t es = hidden.element_size();
  gpu::PermuteArgs a;
  a.hidden = hidden.data_ptr();
  a.row_bytes = s.H * es;
  a.ld_bytes = s.T > 1 ? hidden.stride(0) * es : a.row_bytes;
  a.ids = ids.data_ptr();
  a.ids_int64 = ids.scalar_type() == at::kLong;
  a.ld_t = ids.stride(0);
  a.ld_k = ids.stride(1);
  a.expert_map = expert_map.has_value() ? expert_map->data_ptr<int32_t>() : nullptr;
  a.map_stride = expert_map.has_value() ? expert_map->stride(0) : 0;
  a.T = s.T;
  a.K = s.K;
  a.n_experts = n_experts;
  a.n_local = s.E_loc;
  a.align = align;
  a.offsets = offsets.data_ptr<int64_t>();
  a.hidden_out = hidden_out.data_ptr();
  a.src_row = src_row.data_ptr<int32_t>();
  a.dst_pos = dst_pos.data_ptr<int32_t>();
  a.capacity = s.cap;
  a.workspace = static_cast<int32_t*>(ws.data_ptr());
  a.workspace_words = ws.nbytes() / 4;
  check_launch(gpu::permute_launch(a, current_stream()), op);
  if (!sync_checks()) return;
  const at::Tensor st = ws.view({-1}).view(at::kInt).narrow(0, 0, gpu::kPermuteStatusWords).to(at::kCPU);
  const int32_t* w = st.data_ptr<int32_t>();
  const int64_t bad = int64_t(uint64_t(uint32_t(w[2])) | (uint64_t(uint32_t(w[3])) << 32));
  MOELAB_CHECK(w[0] != 1, op, "ids", "holds ", bad, ", outside the valid range [-1, ", n_experts, ")");
  MOELAB_CHECK(w[0] != 2, op, "expert_map", "holds ", bad, ", outside the valid range [-1, ", s.E_loc, ")");
  MOELAB_CHECK(w[0] == 0, op, "ids", "differed between the kernel's passes over them (written during the "
               "call?); status ", w[0]);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> permute_cuda(
    const at::Tensor& hidden, const at::Tensor& ids, int64_t n_experts, const std::optional<at::Tensor>& expert_map,
    int64_t n_local_experts, int64_t align) {
  const Sizes s = check_inputs(kPermute, hidden, ids, n_experts, expert_map, n_local_experts, align);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const auto i64 = hidden.options().dtype(at::kLong), i32 = hidden.options().dtype(at::kInt);
  at::Tensor offsets = at::empty({s.E_loc + 1}, i64);
  at::Tensor hidden_out = at::empty({s.cap, s.H}, hidden.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor src_row = at::empty({s.cap}, i32);
  at::Tensor dst_pos = at::empty({s.T * s.K}, i32);
  at::Tensor ws = at::empty({gpu::permute_workspace_words(s.T * s.K, s.E_loc)}, i32);
  run(kPermute, hidden, ids, n_experts, expert_map, s, align, offsets, hidden_out, src_row, dst_pos, ws);
  return {offsets, hidden_out, src_row, dst_pos};
}

void permute_out_cuda(const at::Tensor& hidden, const at::Tensor& ids, int64_t n_experts,
                      const std::optional<at::Tensor>& expert_map, int64_t n_local_experts, int64_t align,
                      const at::Tensor& offsets, const at::Tensor& hidden_out, const at::Tensor& src_row,
                      const at::Tensor& dst_pos, const at::Tensor& counts) {
  const Sizes s = check_inputs(kPermuteOut, hidden, ids, n_experts, expert_map, n_local_experts, align);
  check_out(offsets, "offsets", at::kLong, {s.E_loc + 1}, hidden);
  check_out(hidden_out, "hidden_out", hidden.scalar_type(), {s.cap, s.H}, hidden);
  check_out(src_row, "src_row", at::kInt, {s.cap}, hidden);
  check_out(dst_pos, "dst_pos", at::kInt, {s.T * s.K}, hidden);
  check_gpu(counts, kPermuteOut, "counts", 1, {at::kLong}, /*contiguous=*/true, &hidden);
  const int64_t words = gpu::permute_workspace_words(s.T * s.K, s.E_loc);
  MOELAB_CHECK(counts.numel() * 2 >= words, kPermuteOut, "counts",
               "is the GPU workspace and must hold at least ", (words + 1) / 2, " int64 for T*K = ", s.T * s.K,
               " rows and ", s.E_loc, " local experts (optimized.gpu.permute_counts_numel), got ", counts.numel());
  check_disjoint({span_of(hidden, "hidden"), span_of(ids, "ids"),
                  span_of(expert_map.has_value() ? *expert_map : at::Tensor(), "expert_map")},
                 {span_of(offsets, "offsets"), span_of(hidden_out, "hidden_out"), span_of(src_row, "src_row"),
                  span_of(dst_pos, "dst_pos"), span_of(counts, "counts")},
                 kPermuteOut);
  const c10::cuda::CUDAGuard guard(hidden.device());
  run(kPermuteOut, hidden, ids, n_experts, expert_map, s, align, offsets, hidden_out, src_row, dst_pos, counts);
}

at::Tensor unpermute_cuda(const at::Tensor& expert_out, const at::Tensor& weights, const at::Tensor& dst_pos) {
  check_is_gpu(expert_out, kUnpermute, "expert_out");
  check_is_gpu(weights, kUnpermute, "weights", &expert_out);
  check_is_gpu(dst_pos, kUnpermute, "dst_pos", &expert_out);
  const checks::UnpermuteSizes u = checks::check_unpermute_args(kUnpermute, expert_out, weights, dst_pos);
  const int64_t rows = u.rows, H = u.H, T = u.T, K = u.K;
  const c10::cuda::CUDAGuard guard(expert_out.device());
  at::Tensor out = at::empty({T, H}, expert_out.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0 || H == 0) return out;
  const bool check = sync_checks();
  at::Tensor status = check ? at::zeros({1}, expert_out.options().dtype(at::kInt)) : at::Tensor();
  gpu::UnpermuteArgs a;
  a.expert_out = expert_out.data_ptr();
  a.fmt = fmt_of(expert_out);
  a.rows = rows;
  a.H = H;
  a.ld = rows > 1 ? expert_out.stride(0) : H;
  a.weights = weights.data_ptr<float>();
  a.ldw_t = weights.stride(0);
  a.ldw_k = weights.stride(1);
  a.dst_pos = dst_pos.data_ptr<int32_t>();
  a.T = T;
  a.K = K;
  a.out = out.data_ptr();
  a.status = check ? status.data_ptr<int32_t>() : nullptr;
  MOELAB_CHECK(a.ld >= H, kUnpermute, "expert_out", "rows must not overlap (row stride ", a.ld, " < H = ", H, ")");
  check_launch(gpu::unpermute_launch(a, current_stream()), kUnpermute);
  if (check)
    MOELAB_CHECK(status.item<int32_t>() == 0, kUnpermute, "dst_pos", "holds a value outside the valid range [-1, ",
                 rows, ")");
  return out;
}

}  // namespace
}  // namespace moelab::gpu_binding

TORCH_LIBRARY_FRAGMENT(moelab, m) {
  m.def("gpu_permute_workspace_words(int rows, int n_local) -> int", [](int64_t rows, int64_t n_local) {
    return moelab::gpu::permute_workspace_words(rows, n_local);
  });
}
TORCH_LIBRARY_IMPL(moelab, CUDA, m) {
  m.impl("permute", &moelab::gpu_binding::permute_cuda);
  m.impl("permute_out", &moelab::gpu_binding::permute_out_cuda);
  m.impl("unpermute", &moelab::gpu_binding::unpermute_cuda);
}
