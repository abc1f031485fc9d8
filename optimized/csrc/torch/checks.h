// Argument checks shared by the CPU bindings (csrc/torch) and the GPU bindings (csrc/torch_gpu):
// everything about an op's arguments that does not depend on where its tensors live. One
// place, so a direct torch.ops.moelab call is refused the same way on every backend.
//
// Each binding first checks the devices (CPU: check_is_cpu; GPU: check_is_gpu, same device as
// the first tensor), then calls the op's check_<op>_args here, which checks ranks, dtypes,
// sizes, strides, scalars and contract limits and returns the sizes the kernel needs. Index
// ranges (ids, expert_map, dst_pos values) are data: the kernels check them on their own pass.
//
// Every error is a RuntimeError (TORCH_CHECK) "moelab::<op>: argument '<arg>' ...". The
// checks are O(1) per call (no pass over any tensor's data): they run on every decode step.
// Header-only, torch but no CUDA: the GPU extension includes it through torch_gpu/common.h.
#pragma once
#include <ATen/ATen.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#define MOELAB_CHECK(cond, op, arg, ...) \
  TORCH_CHECK((cond), "moelab::", op, ": argument '", arg, "' ", __VA_ARGS__)

namespace moelab::checks {

// Contract limits of SPEC.md, the same on every backend (the kernels' headers have their own
// constants; each binding static_asserts they agree).
constexpr int64_t kRouteMaxExperts = 2048;
constexpr int64_t kRouteMaxGroupedExperts = 1024;
constexpr int64_t kRouteMaxTopK = 32;
constexpr int64_t kRouteMaxGroups = 32;
constexpr int64_t kSkinnyMaxT = 8;

// Rank (ndim < 0: any), dtype and (optionally) contiguity of a tensor, wherever it lives.
inline void check_tensor(const at::Tensor& t, const char* op, const char* arg, int64_t ndim,
                         std::initializer_list<at::ScalarType> dtypes, bool contiguous = true) {
  MOELAB_CHECK(t.defined(), op, arg, "must be a tensor");
  MOELAB_CHECK(ndim < 0 || t.dim() == ndim, op, arg, "must be ", ndim, "-D, got ", t.dim(), "-D");
  bool ok = false;
  for (auto d : dtypes) ok = ok || t.scalar_type() == d;
  MOELAB_CHECK(ok, op, arg, "has unsupported dtype ", t.scalar_type());
  MOELAB_CHECK(!contiguous || t.is_contiguous(), op, arg, "must be contiguous");
}

// A finite float scalar (alpha, limit, scaling, ...).
inline void check_finite(double v, const char* op, const char* arg) {
  MOELAB_CHECK(std::isfinite(v), op, arg, "must be a finite float, got ", v);
}

// The number of elements of an output whose sizes come from different arguments (T from one
// tensor, E from another: each tensor's own numel is bounded by torch, their product is not,
// and a stride-0 expanded input has any size at no memory cost). Refuses, naming `arg`, a
// product whose byte size (elem_size bytes each) overflows int64, before anything is
// allocated or any index is computed from it. Returns the product.
inline int64_t check_numel(std::initializer_list<int64_t> sizes, int64_t elem_size, const char* op,
                           const char* arg) {
  int64_t n = 1, bytes = 0;
  bool overflow = false;
  for (int64_t s : sizes) {
    MOELAB_CHECK(s >= 0, op, arg, "gives a negative output size ", s);
    overflow = overflow || __builtin_mul_overflow(n, s, &n);
  }
  overflow = overflow || __builtin_mul_overflow(n, elem_size, &bytes);
  if (overflow) {
    std::string shape;
    for (int64_t s : sizes) shape += (shape.empty() ? "" : ", ") + std::to_string(s);
    MOELAB_CHECK(false, op, arg, "makes an output of shape [", shape, "] (", elem_size,
                 "-byte elements) whose byte size overflows int64");
  }
  return n;
}

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

inline Span span_of(const at::Tensor& t, const char* name) {
  if (!t.defined() || t.numel() == 0) return {name, 0, 0};
  int64_t last = 0;  // element offset of the last element (torch strides are >= 0)
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {name, lo, lo + uintptr_t(last + 1) * uintptr_t(t.element_size())};
}

inline void check_disjoint(std::initializer_list<Span> inputs, std::initializer_list<Span> outputs, const char* op) {
  auto meet = [](const Span& a, const Span& b) { return a.lo < a.hi && b.lo < b.hi && a.lo < b.hi && b.lo < a.hi; };
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    for (const Span& i : inputs)
      MOELAB_CHECK(!meet(*o, i), op, o->name, "must not share memory with input '", i.name, "'");
    for (auto o2 = o + 1; o2 != outputs.end(); ++o2)
      MOELAB_CHECK(!meet(*o, *o2), op, o->name, "must not share memory with output '", o2->name, "'");
  }
}

// Rows of a 2-D tensor are read as contiguous runs along dim 1 (a single column: any stride).
inline bool unit_inner_stride(const at::Tensor& t) { return t.numel() == 0 || t.size(1) == 1 || t.stride(1) == 1; }

// ------------------------------------------------------------------------------ route
enum RouteMethodCode : int {   // the order of SPEC's table and reference.validate.ROUTE_METHODS;
                               // the kernels' enums use these values
  kSoftmaxTopk = 0, kTopkSoftmax = 1, kSigmoidTopk = 2, kSigmoidBias = 3, kGroupedSigmoidBias = 4, kLlama4 = 5,
  kGroupedSoftmax = 6, kSoftmaxBias = 7,
};
constexpr int kRouteNumMethods = 8;

struct RouteSizes {
  int64_t T, E;
  int method;
  bool biased;        // takes a bias: sigmoid_bias, grouped_sigmoid_bias, softmax_bias
  bool renormalize;   // resolved: the method's default where the call left it unset
  double norm_eps;    // resolved: the method's default where unset (0.0 for a method without one)
};

// logits [T, E] f32/bf16/f16 (any strides), bias [E] f32/bf16 (any stride; contiguity, if a
// backend needs it, is its own check) for the biased methods only, and the scalars.
// renormalize and norm_eps are resolved exactly as reference.validate.check_route resolves
// them (SPEC 6): renormalize unset = on for the biased methods, off for the rest; set True is
// refused for llama4 only. norm_eps unset = 1e-20 (sigmoid_topk, sigmoid_bias,
// grouped_sigmoid_bias) or 1e-12 (softmax_bias); set: finite, >= 0, only for those methods.
inline RouteSizes check_route_args(const char* op, const at::Tensor& logits, int64_t top_k, const std::string& method,
                                   const std::optional<at::Tensor>& bias, double scaling,
                                   std::optional<bool> renormalize, int64_t n_group, int64_t topk_group,
                                   std::optional<double> norm_eps) {
  check_tensor(logits, op, "logits", 2, {at::kFloat, at::kBFloat16, at::kHalf}, /*contiguous=*/false);
  const int64_t T = logits.size(0), E = logits.size(1);
  MOELAB_CHECK(E >= 1 && E <= kRouteMaxExperts, op, "logits", "must have 1 <= E <= ", kRouteMaxExperts,
               " columns (experts), got E = ", E);
  static const char* names[kRouteNumMethods] = {"softmax_topk", "topk_softmax", "sigmoid_topk",
                                                "sigmoid_bias", "grouped_sigmoid_bias", "llama4",
                                                "grouped_softmax", "softmax_bias"};
  int m = -1;
  for (int i = 0; i < kRouteNumMethods; ++i)
    if (method == names[i]) m = i;
  MOELAB_CHECK(m >= 0, op, "method", "must be one of softmax_topk, topk_softmax, sigmoid_topk, "
               "sigmoid_bias, grouped_sigmoid_bias, llama4, grouped_softmax, softmax_bias; got '", method, "'");
  const int64_t k_max = std::min<int64_t>(E, kRouteMaxTopK);
  MOELAB_CHECK(top_k >= 1 && top_k <= k_max, op, "top_k", "must satisfy 1 <= top_k <= min(E, ", kRouteMaxTopK,
               ") = ", k_max, ", got ", top_k);
  MOELAB_CHECK(m != kLlama4 || top_k == 1, op, "top_k", "must be 1 for method 'llama4', got ", top_k);
  const bool biased = m == kSigmoidBias || m == kGroupedSigmoidBias || m == kSoftmaxBias;
  if (biased) {
    MOELAB_CHECK(bias.has_value(), op, "bias", "is required by method '", method, "'");
    check_tensor(*bias, op, "bias", 1, {at::kFloat, at::kBFloat16}, /*contiguous=*/false);
    MOELAB_CHECK(bias->size(0) == E, op, "bias", "must have shape (", E, "), got ", bias->sizes());
  } else {
    MOELAB_CHECK(!bias.has_value(), op, "bias", "is only used by sigmoid_bias, grouped_sigmoid_bias, softmax_bias");
  }
  if (m == kGroupedSigmoidBias || m == kGroupedSoftmax) {
    MOELAB_CHECK(E <= kRouteMaxGroupedExperts, op, "logits", "must have E <= ", kRouteMaxGroupedExperts,
                 " for grouped routing, got E = ", E);
    MOELAB_CHECK(n_group >= 1 && n_group <= kRouteMaxGroups, op, "n_group", "must satisfy 1 <= n_group <= ",
                 kRouteMaxGroups, ", got ", n_group);
    MOELAB_CHECK(E % n_group == 0 && E / n_group >= 2, op, "n_group", "must divide E = ", E,
                 " into groups of at least 2 experts, got ", n_group);
    MOELAB_CHECK(topk_group >= 1 && topk_group <= n_group, op, "topk_group",
                 "must satisfy 1 <= topk_group <= n_group = ", n_group, ", got ", topk_group);
    MOELAB_CHECK(top_k <= topk_group * (E / n_group), op, "top_k", "must be <= topk_group * E / n_group = ",
                 topk_group * (E / n_group), ", got ", top_k);
  } else {
    MOELAB_CHECK(n_group == 1, op, "n_group", "only applies to grouped_sigmoid_bias, grouped_softmax, got ",
                 n_group);
    MOELAB_CHECK(topk_group == 1, op, "topk_group", "only applies to grouped_sigmoid_bias, grouped_softmax, got ",
                 topk_group);
  }
  check_finite(scaling, op, "scaling");
  const bool renorm = renormalize.has_value() ? *renormalize : biased;
  MOELAB_CHECK(!renorm || m != kLlama4, op, "renormalize",
               "does not apply to method 'llama4' (a single weight to normalize)");
  const bool has_eps = m == kSigmoidTopk || m == kSigmoidBias || m == kGroupedSigmoidBias || m == kSoftmaxBias;
  double eps = !has_eps ? 0.0 : m == kSoftmaxBias ? 1e-12 : 1e-20;
  if (norm_eps.has_value()) {
    MOELAB_CHECK(has_eps, op, "norm_eps", "only applies to sigmoid_topk, sigmoid_bias, grouped_sigmoid_bias, "
                 "softmax_bias; method '", method, "' divides by the plain sum");
    check_finite(*norm_eps, op, "norm_eps");
    MOELAB_CHECK(*norm_eps >= 0.0, op, "norm_eps", "must be >= 0, got ", *norm_eps);
    eps = *norm_eps;
  }
  check_numel({T, top_k}, 4, op, "logits");
  return {T, E, m, biased, renorm, eps};
}

// ----------------------------------------------------------------------- router_gemm
struct GemmSizes {
  int64_t T, K, N;   // x [T, K], weight [N, K], out [T, N]
};

// x [T, H] f32/bf16/f16 with unit stride along H (rows any stride), weight [E, H] f32 contiguous.
inline GemmSizes check_router_gemm_args(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  check_tensor(x, op, "x", 2, {at::kFloat, at::kBFloat16, at::kHalf}, /*contiguous=*/false);
  MOELAB_CHECK(x.size(0) == 0 || unit_inner_stride(x), op, "x", "must have unit stride along H");
  check_tensor(weight, op, "weight", 2, {at::kFloat});
  const int64_t T = x.size(0), H = x.size(1), E = weight.size(0);
  MOELAB_CHECK(H >= 1, op, "x", "must have H >= 1 columns");
  MOELAB_CHECK(weight.size(1) == H, op, "weight", "must have shape (E, ", H, "), got ", weight.sizes());
  MOELAB_CHECK(E >= 1, op, "weight", "must have E >= 1 rows");
  check_numel({T, E}, 4, op, "x");   // T rows of x (stride 0 allowed: any T) times E
  return {T, H, E};
}

// ----------------------------------------------------------------------- skinny_gemm
// x [T, K] (T <= 8), weight [N, K] of x's dtype, both with unit stride along K (rows any
// stride), bias [N] of that dtype, contiguous.
inline GemmSizes check_skinny_gemm_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias) {
  check_tensor(x, op, "x", 2, {at::kFloat, at::kBFloat16, at::kHalf}, /*contiguous=*/false);
  const int64_t T = x.size(0), K = x.size(1);
  MOELAB_CHECK(T <= kSkinnyMaxT, op, "x", "must have T <= ", kSkinnyMaxT, " rows, got T = ", T);
  MOELAB_CHECK(K >= 1, op, "x", "must have K >= 1 columns");
  MOELAB_CHECK(T == 0 || unit_inner_stride(x), op, "x", "must have unit stride along K, got strides ", x.strides());
  check_tensor(weight, op, "weight", 2, {x.scalar_type()}, /*contiguous=*/false);
  const int64_t N = weight.size(0);
  MOELAB_CHECK(weight.size(1) == K, op, "weight", "must have shape (N, ", K, "), got ", weight.sizes());
  MOELAB_CHECK(N >= 1, op, "weight", "must have N >= 1 rows");
  MOELAB_CHECK(unit_inner_stride(weight), op, "weight", "must have unit stride along K, got strides ",
               weight.strides());
  if (bias.has_value()) {
    check_tensor(*bias, op, "bias", 1, {x.scalar_type()});
    MOELAB_CHECK(bias->size(0) == N, op, "bias", "must have shape (", N, "), got ", bias->sizes());
  }
  check_numel({T, N}, x.element_size(), op, "weight");   // N rows of weight (stride 0 allowed: any N)
  return {T, K, N};
}

// --------------------------------------------------------------------------- permute
struct PermuteSizes {
  int64_t T, H, K, E_loc, cap;
};

// hidden [T, H] f32/bf16/f16 with unit stride along H, ids [T, K] int32/int64 (any strides),
// expert_map [n_experts] int32 (any stride); positions and rows are int32 in the outputs, so
// T*K and the capacity must be < 2^31. `op` is permute or permute_out (its messages).
inline PermuteSizes check_permute_args(const char* op, const at::Tensor& hidden, const at::Tensor& ids,
                                       int64_t n_experts, const std::optional<at::Tensor>& expert_map,
                                       int64_t n_local, int64_t align) {
  check_tensor(hidden, op, "hidden", 2, {at::kFloat, at::kBFloat16, at::kHalf}, /*contiguous=*/false);
  MOELAB_CHECK(unit_inner_stride(hidden), op, "hidden", "must have unit stride along H");
  check_tensor(ids, op, "ids", 2, {at::kInt, at::kLong}, /*contiguous=*/false);
  const int64_t T = hidden.size(0), H = hidden.size(1), K = ids.size(1);
  MOELAB_CHECK(ids.size(0) == T, op, "ids", "must have one row per token (", T, "), got ", ids.sizes());
  MOELAB_CHECK(K >= 1, op, "ids", "must have at least one column (top_k >= 1)");
  MOELAB_CHECK(n_experts >= 1 && n_experts <= INT32_MAX, op, "n_experts", "must be in [1, 2^31), got ", n_experts);
  MOELAB_CHECK(n_local >= 1 && n_local <= INT32_MAX, op, "n_local_experts", "must be in [1, 2^31), got ", n_local);
  MOELAB_CHECK(align >= 1 && align <= INT32_MAX, op, "align", "must be in [1, 2^31), got ", align);
  if (expert_map.has_value()) {
    check_tensor(*expert_map, op, "expert_map", 1, {at::kInt}, /*contiguous=*/false);
    MOELAB_CHECK(expert_map->size(0) == n_experts, op, "expert_map", "must have n_experts = ", n_experts,
                 " entries, got ", expert_map->size(0));
  } else {
    MOELAB_CHECK(n_local == n_experts, op, "n_local_experts", "must equal n_experts = ", n_experts,
                 " without an expert_map, got ", n_local);
  }
  MOELAB_CHECK(T <= INT32_MAX / K, op, "ids", "T*K must be < 2^31, got T = ", T, ", K = ", K);
  const int64_t cap = T * K + n_local * (align - 1);  // < 2^31 + 2^62: no int64 overflow
  MOELAB_CHECK(cap <= INT32_MAX, op, "align", "makes the capacity T*K + E_loc*(align-1) = ", cap,
               " exceed 2^31 - 1");
  check_numel({cap, H}, hidden.element_size(), op, "hidden");
  return {T, H, K, n_local, cap};
}

// One of permute_out's buffers: the dtype, exactly the shape, contiguous.
inline void check_out_buffer(const at::Tensor& t, const char* op, const char* arg, at::ScalarType dtype,
                             at::IntArrayRef shape) {
  check_tensor(t, op, arg, int64_t(shape.size()), {dtype});
  MOELAB_CHECK(t.sizes() == shape, op, arg, "must have shape ", shape, ", got ", t.sizes());
}

// expert_out [rows, H] f32/bf16/f16 with unit stride along H, weights [T, K] f32 (any
// strides), dst_pos [T*K] int32 contiguous.
struct UnpermuteSizes {
  int64_t rows, H, T, K;
};

inline UnpermuteSizes check_unpermute_args(const char* op, const at::Tensor& expert_out, const at::Tensor& weights,
                                           const at::Tensor& dst_pos) {
  check_tensor(expert_out, op, "expert_out", 2, {at::kFloat, at::kBFloat16, at::kHalf}, /*contiguous=*/false);
  MOELAB_CHECK(unit_inner_stride(expert_out), op, "expert_out", "must have unit stride along H");
  check_tensor(weights, op, "weights", 2, {at::kFloat}, /*contiguous=*/false);
  check_tensor(dst_pos, op, "dst_pos", 1, {at::kInt});
  const int64_t rows = expert_out.size(0), H = expert_out.size(1), T = weights.size(0), K = weights.size(1);
  MOELAB_CHECK(dst_pos.size(0) == T * K, op, "dst_pos", "must have T*K = ", T * K, " entries, got ",
               dst_pos.size(0));   // (T*K is weights' numel: no overflow)
  check_numel({T, H}, expert_out.element_size(), op, "expert_out");
  return {rows, H, T, K};
}

}  // namespace moelab::checks
