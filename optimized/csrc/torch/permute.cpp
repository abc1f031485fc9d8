// Bindings of permute / unpermute (SPEC 2). Three ops:
//   permute(hidden, ids, n_experts, expert_map, n_local_experts, align)
//       -> (offsets, hidden_out, src_row, dst_pos)                    fresh outputs
//   permute_out(..., offsets!, hidden_out!, src_row!, dst_pos!, counts!) -> ()
//       the same kernel writing into caller buffers (a PermuteScratch): no allocation.
//       The buffers are positional (not keyword-only): parsing keywords costs ~0.7 us a call.
//   unpermute(expert_out, weights, dst_pos) -> out
// Everything the kernels rely on is re-checked here (a direct torch.ops.moelab call with
// hostile arguments raises RuntimeError). The id / expert_map ranges are checked inside
// permute_plan's histogram pass (no extra pass, no temporary tensors), dst_pos's range by
// one serial pass before the parallel kernel.
#include <climits>
#include <sys/mman.h>
#include <vector>

#include "../cpu/permute.h"
#include "common.h"

namespace moelab {
namespace {

constexpr const char* kPermute = "permute";
constexpr const char* kPermuteOut = "permute_out";   // same checks, its own name in messages
constexpr const char* kUnpermute = "unpermute";
// Work per at::parallel_for task. Waking the second thread costs a few us, about what
// copying 256 KB from L2 costs, so decode-sized calls stay on one thread (at T=8, E=64, K=8,
// H=4096 bf16, 512 KB out, two threads are no faster; at T=64, 4 MB, they are;
// `python -m experiments.bench --ops permute --threads 1,2` times both).
constexpr int64_t kCopyGrainBytes = int64_t(512) << 10;       // permute: bytes written
constexpr int64_t kGatherGrainBytes = int64_t(256) << 10;     // unpermute: bytes read

// A fresh permute output is written in full right away, so its first-touch page faults are
// a large part of the allocating path's cost at prefill sizes (a 32 MB output is 8192 4 KB
// faults, ~10 ms here; glibc mmaps blocks above 32 MB afresh on every call). Asking for
// transparent huge pages on its 2 MB-aligned interior turns that into 16 faults. Only for
// outputs of 8 MB and more (the syscall is noise there); a no-op where THP is off, and
// harmless on memory glibc serves from its heap. The scratch path never needs it.
void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (t.nbytes() < (size_t(8) << 20)) return;
  const uintptr_t b = reinterpret_cast<uintptr_t>(t.data_ptr()), e = b + t.nbytes();
  const uintptr_t hb = (b + kHuge - 1) & ~(kHuge - 1), he = e & ~(kHuge - 1);
  if (he > hb) (void)madvise(reinterpret_cast<void*>(hb), he - hb, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

using PermuteArgs = checks::PermuteSizes;

// The device of every tensor argument, then the shared checks (csrc/torch/checks.h).
PermuteArgs check_permute_inputs(const char* op, const at::Tensor& hidden, const at::Tensor& ids, int64_t n_experts,
                                 const std::optional<at::Tensor>& expert_map, int64_t n_local, int64_t align) {
  check_is_cpu(hidden, op, "hidden");
  check_is_cpu(ids, op, "ids");
  if (expert_map.has_value()) check_is_cpu(*expert_map, op, "expert_map");
  return checks::check_permute_args(op, hidden, ids, n_experts, expert_map, n_local, align);
}

// Every scratch/out buffer: CPU, the dtype, exactly the shape, contiguous.
void check_out(const at::Tensor& t, const char* arg, at::ScalarType dtype, at::IntArrayRef shape) {
  check_is_cpu(t, kPermuteOut, arg);
  checks::check_out_buffer(t, kPermuteOut, arg, dtype, shape);
}

void run_permute(const char* op, const at::Tensor& hidden, const at::Tensor& ids, int64_t n_experts,
                 const std::optional<at::Tensor>& expert_map, const PermuteArgs& a, int64_t align,
                 const at::Tensor& offsets, const at::Tensor& hidden_out, const at::Tensor& src_row,
                 const at::Tensor& dst_pos, int64_t* counts) {
  const int32_t* map = expert_map.has_value() ? expert_map->data_ptr<int32_t>() : nullptr;
  const int64_t map_stride = expert_map.has_value() ? expert_map->stride(0) : 0;
  int64_t bad = 0;
  const int status = MOELAB_PICK(permute_plan)(
      ids.data_ptr(), ids.scalar_type() == at::kLong, a.T, a.K, ids.stride(0), ids.stride(1), map, map_stride,
      n_experts, a.E_loc, align, counts, offsets.data_ptr<int64_t>(),
      src_row.data_ptr<int32_t>(), a.cap, dst_pos.data_ptr<int32_t>(), &bad);
  MOELAB_CHECK(status != cpu::kPermuteBadId, op, "ids", "holds ", bad, ", outside the valid range [-1, ",
               n_experts, ")");
  MOELAB_CHECK(status != cpu::kPermuteBadMap, op, "expert_map", "holds ", bad,
               ", outside the valid range [-1, ", a.E_loc, ")");
  // Only reachable if ids change between the plan's two passes (another thread writing them):
  // the plan then stops before writing out of bounds.
  MOELAB_CHECK(status == cpu::kPermuteOk, op, "ids", "differed between the two passes over them (written by "
               "another thread during the call?); status ", status);
  if (a.cap == 0 || a.H == 0) return;
  const int64_t es = hidden.element_size(), row_bytes = a.H * es;
  const void* in = hidden.data_ptr();
  const int64_t ld_bytes = hidden.stride(0) * es;
  void* out = hidden_out.data_ptr();
  const int32_t* src = src_row.data_ptr<int32_t>();
  auto* rows = MOELAB_PICK(permute_rows);
  const int64_t grain = std::max<int64_t>(1, kCopyGrainBytes / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, a.cap, grain, [&](int64_t p0, int64_t p1) {
    rows(in, ld_bytes, out, row_bytes, src, a.K, p0, p1);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> permute_cpu(
    const at::Tensor& hidden, const at::Tensor& ids, int64_t n_experts, const std::optional<at::Tensor>& expert_map,
    int64_t n_local_experts, int64_t align) {
  const PermuteArgs a = check_permute_inputs(kPermute, hidden, ids, n_experts, expert_map, n_local_experts, align);
  const auto i64 = hidden.options().dtype(at::kLong), i32 = hidden.options().dtype(at::kInt);
  at::Tensor offsets = at::empty({a.E_loc + 1}, i64);
  at::Tensor hidden_out = at::empty({a.cap, a.H}, hidden.options());
  advise_huge_pages(hidden_out);
  at::Tensor src_row = at::empty({a.cap}, i32);
  at::Tensor dst_pos = at::empty({a.T * a.K}, i32);
  std::vector<int64_t> counts(size_t(a.E_loc));  // workspace (the scratch path brings its own)
  run_permute(kPermute, hidden, ids, n_experts, expert_map, a, align, offsets, hidden_out, src_row, dst_pos,
              counts.data());
  return {offsets, hidden_out, src_row, dst_pos};
}

void permute_out_cpu(const at::Tensor& hidden, const at::Tensor& ids, int64_t n_experts,
                     const std::optional<at::Tensor>& expert_map, int64_t n_local_experts, int64_t align,
                     const at::Tensor& offsets, const at::Tensor& hidden_out, const at::Tensor& src_row,
                     const at::Tensor& dst_pos, const at::Tensor& counts) {
  const PermuteArgs a = check_permute_inputs(kPermuteOut, hidden, ids, n_experts, expert_map, n_local_experts, align);
  check_out(offsets, "offsets", at::kLong, {a.E_loc + 1});
  check_out(hidden_out, "hidden_out", hidden.scalar_type(), {a.cap, a.H});
  check_out(src_row, "src_row", at::kInt, {a.cap});
  check_out(dst_pos, "dst_pos", at::kInt, {a.T * a.K});
  check_out(counts, "counts", at::kLong, {a.E_loc});
  check_disjoint({span_of(hidden, "hidden"), span_of(ids, "ids"),
                  span_of(expert_map.has_value() ? *expert_map : at::Tensor(), "expert_map")},
                 {span_of(offsets, "offsets"), span_of(hidden_out, "hidden_out"), span_of(src_row, "src_row"),
                  span_of(dst_pos, "dst_pos"), span_of(counts, "counts")},
                 kPermuteOut);
  run_permute(kPermuteOut, hidden, ids, n_experts, expert_map, a, align, offsets, hidden_out, src_row, dst_pos,
              counts.data_ptr<int64_t>());
}

at::Tensor unpermute_cpu(const at::Tensor& expert_out, const at::Tensor& weights, const at::Tensor& dst_pos) {
  check_is_cpu(expert_out, kUnpermute, "expert_out");
  check_is_cpu(weights, kUnpermute, "weights");
  check_is_cpu(dst_pos, kUnpermute, "dst_pos");
  const checks::UnpermuteSizes u = checks::check_unpermute_args(kUnpermute, expert_out, weights, dst_pos);
  const int64_t rows = u.rows, H = u.H, T = u.T, K = u.K;
  const int32_t* pos = dst_pos.data_ptr<int32_t>();
  for (int64_t i = 0; i < T * K; ++i)
    MOELAB_CHECK(pos[i] >= -1 && pos[i] < rows, kUnpermute, "dst_pos", "holds ", pos[i],
                 ", outside the valid range [-1, ", rows, ")");
  at::Tensor out = at::empty({T, H}, expert_out.options());
  if (T == 0 || H == 0) return out;
  auto* fn = MOELAB_PICK(unpermute_tokens);
  const void* eo = expert_out.data_ptr();
  const int64_t ld = expert_out.stride(0), ldw_t = weights.stride(0), ldw_k = weights.stride(1);
  const float* w = weights.data_ptr<float>();
  void* o = out.data_ptr();
  const Fmt fmt = fmt_of(expert_out);
  const int64_t grain = std::max<int64_t>(1, kGatherGrainBytes / std::max<int64_t>(K * H * expert_out.element_size(), 1));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    fn(eo, fmt, ld, w, ldw_t, ldw_k, pos, K, H, o, t0, t1);
  });
  return out;
}

// permute_out for tensors with the negative bit (torch._neg_view, and views of such tensors).
// torch's generic Negative fallback (ATen's MathBitsFallback) mishandles an op whose mutable
// arguments are not returned: an internal assert, after which the process crashed on the
// next call. So permute_out has its own Negative kernel: an output with the negative bit is
// refused (the kernel writes raw bits; negating afterwards is not what the caller asked
// for), an input with it is materialized, then the call goes on to the backend kernel.
// Registered for the Negative key, so any backend (CPU, CUDA, meta) passes through it.
void permute_out_negative(const at::Tensor& hidden, const at::Tensor& ids, int64_t n_experts,
                          const std::optional<at::Tensor>& expert_map, int64_t n_local_experts, int64_t align,
                          const at::Tensor& offsets, const at::Tensor& hidden_out, const at::Tensor& src_row,
                          const at::Tensor& dst_pos, const at::Tensor& counts) {
  const std::pair<const at::Tensor*, const char*> outs[] = {
      {&offsets, "offsets"}, {&hidden_out, "hidden_out"}, {&src_row, "src_row"}, {&dst_pos, "dst_pos"},
      {&counts, "counts"}};
  for (const auto& [t, name] : outs)
    MOELAB_CHECK(!t->is_neg(), kPermuteOut, name, "must not be a negative view (torch._neg_view): the op "
                 "writes its buffers as they are");
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("moelab::permute_out", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&,
                                   int64_t, int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&)>();
  c10::impl::ExcludeDispatchKeyGuard no_neg(c10::DispatchKey::Negative);
  std::optional<at::Tensor> map;
  if (expert_map.has_value()) map = expert_map->resolve_neg();
  op.call(hidden.resolve_neg(), ids.resolve_neg(), n_experts, map, n_local_experts, align, offsets, hidden_out,
          src_row, dst_pos, counts);
}

const int kRegistered = register_op_level(kPermute, cpu::Isa::kAvx512) + register_op_level(kUnpermute, cpu::Isa::kAvx512);

}  // namespace
}  // namespace moelab

TORCH_LIBRARY_FRAGMENT(moelab, m) {
  m.def("permute(Tensor hidden, Tensor ids, int n_experts, Tensor? expert_map, int n_local_experts, int align)"
        " -> (Tensor offsets, Tensor hidden_out, Tensor src_row, Tensor dst_pos)");
  m.def("permute_out(Tensor hidden, Tensor ids, int n_experts, Tensor? expert_map, int n_local_experts, "
        "int align, Tensor(a!) offsets, Tensor(b!) hidden_out, Tensor(c!) src_row, Tensor(d!) dst_pos, "
        "Tensor(e!) counts) -> ()");
  m.def("unpermute(Tensor expert_out, Tensor weights, Tensor dst_pos) -> Tensor");
}
TORCH_LIBRARY_IMPL(moelab, Negative, m) { m.impl("permute_out", &moelab::permute_out_negative); }
TORCH_LIBRARY_IMPL(moelab, CPU, m) {
  m.impl("permute", &moelab::permute_cpu);
  m.impl("permute_out", &moelab::permute_out_cpu);
  m.impl("unpermute", &moelab::unpermute_cpu);
}
