// torch.ops.moelab.route: binding of the CPU top-k routing kernel (csrc/cpu/route_kernel.h).
//
// Schema: route(Tensor logits, int top_k, str method, Tensor? bias=None, float scaling=1.0,
//               bool renormalize=False, int n_group=1, int topk_group=1)
//           -> (Tensor weights, Tensor ids)
// method is the SPEC name ("softmax_topk", ..., "llama4"). The arguments are those of
// optimized.route in the order that lets common calls leave the rest at their defaults. Every constraint the kernel
// relies on, and every contract limit, is re-checked here with TORCH_CHECK, so a direct
// call with hostile arguments raises RuntimeError instead of reading out of bounds.
#include <cmath>
#include <cstring>

#include "../cpu/route.h"
#include "common.h"

namespace moelab {
namespace {

constexpr const char* kOp = "route";
using cpu::RouteMethod;

int method_code(const std::string& m) {
  static const char* names[] = {"softmax_topk", "topk_softmax", "sigmoid_topk",
                                "sigmoid_bias", "grouped_sigmoid_bias", "llama4"};
  for (int i = 0; i < 6; ++i)
    if (m == names[i]) return i;
  MOELAB_CHECK(false, kOp, "method", "must be one of softmax_topk, topk_softmax, sigmoid_topk, "
               "sigmoid_bias, grouped_sigmoid_bias, llama4; got '", m, "'");
  return -1;
}


// Tokens per parallel task: ~16K expert keys (~8 us), so the thread pool's fork/join is
// amortized; fewer tokens run on the calling thread. The policy and its reasons live in
// optimized/dispatch.py (ROUTE_GRAIN_ELEMS, route section), which must say the same number.
int64_t grain_tokens(int64_t E) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(E, 1));
}

std::tuple<at::Tensor, at::Tensor> route_cpu(const at::Tensor& logits_in, int64_t top_k,
                                             const std::string& method,
                                             const std::optional<at::Tensor>& bias_in, double scaling,
                                             bool renormalize, int64_t n_group, int64_t topk_group) {
  check_cpu(logits_in, kOp, "logits", 2, {at::kFloat, at::kBFloat16, at::kHalf}, /*contiguous=*/false);
  const int64_t T = logits_in.size(0), E = logits_in.size(1);
  MOELAB_CHECK(E >= 1 && E <= cpu::kRouteMaxExperts, kOp, "logits", "must have 1 <= E <= ",
               cpu::kRouteMaxExperts, " columns (experts), got E = ", E);
  const int m = method_code(method);
  MOELAB_CHECK(top_k >= 1 && top_k <= std::min<int64_t>(E, cpu::kRouteMaxTopK), kOp, "top_k",
               "must satisfy 1 <= top_k <= min(E, ", cpu::kRouteMaxTopK, ") = ",
               std::min<int64_t>(E, cpu::kRouteMaxTopK), ", got ", top_k);
  MOELAB_CHECK(m != cpu::kLlama4 || top_k == 1, kOp, "top_k", "must be 1 for method 'llama4', got ", top_k);
  const bool biased = m == cpu::kSigmoidBias || m == cpu::kGroupedSigmoidBias;
  // Every check comes before the copies below (a stride-0 expanded tensor may have any size).
  if (biased) {
    MOELAB_CHECK(bias_in.has_value(), kOp, "bias", "is required by method '", method, "'");
    check_cpu(*bias_in, kOp, "bias", 1, {at::kFloat, at::kBFloat16}, /*contiguous=*/false);
    MOELAB_CHECK(bias_in->size(0) == E, kOp, "bias", "must have shape (", E, "), got ", bias_in->sizes());
  } else {
    MOELAB_CHECK(!bias_in.has_value(), kOp, "bias", "is only used by sigmoid_bias, grouped_sigmoid_bias");
  }
  if (m == cpu::kGroupedSigmoidBias) {
    MOELAB_CHECK(E <= 1024, kOp, "logits", "must have E <= 1024 for grouped routing, got E = ", E);
    MOELAB_CHECK(n_group >= 1 && n_group <= cpu::kRouteMaxGroups, kOp, "n_group",
                 "must satisfy 1 <= n_group <= ", cpu::kRouteMaxGroups, ", got ", n_group);
    MOELAB_CHECK(E % n_group == 0 && E / n_group >= 2, kOp, "n_group",
                 "must divide E = ", E, " into groups of at least 2 experts, got ", n_group);
    MOELAB_CHECK(topk_group >= 1 && topk_group <= n_group, kOp, "topk_group",
                 "must satisfy 1 <= topk_group <= n_group = ", n_group, ", got ", topk_group);
    MOELAB_CHECK(top_k <= topk_group * (E / n_group), kOp, "top_k",
                 "must be <= topk_group * E / n_group = ", topk_group * (E / n_group), ", got ", top_k);
  } else {
    MOELAB_CHECK(n_group == 1, kOp, "n_group", "only applies to method 'grouped_sigmoid_bias', got ", n_group);
    MOELAB_CHECK(topk_group == 1, kOp, "topk_group",
                 "only applies to method 'grouped_sigmoid_bias', got ", topk_group);
  }
  check_finite(scaling, kOp, "scaling");
  MOELAB_CHECK(biased || scaling == 1.0, kOp, "scaling",
               "only applies to sigmoid_bias, grouped_sigmoid_bias; must be 1.0, got ", scaling);
  MOELAB_CHECK(!renormalize || m == cpu::kSoftmaxTopk || m == cpu::kTopkSoftmax || m == cpu::kSigmoidTopk,
               kOp, "renormalize", "only applies to softmax_topk, topk_softmax, sigmoid_topk");
  check_numel({T, top_k}, 4, kOp, "logits");

  // Rows may be apart by any stride (a column slice of a wider matrix is read in place);
  // only a non-unit stride along E costs a contiguous copy.
  const at::Tensor logits =
      T > 0 && E > 1 && logits_in.stride(1) != 1 ? logits_in.contiguous() : logits_in;
  std::optional<at::Tensor> bias;
  if (biased) bias = bias_in->contiguous();
  auto opts = logits.options();
  at::Tensor weights = at::empty({T, top_k}, opts.dtype(at::kFloat));
  at::Tensor ids = at::empty({T, top_k}, opts.dtype(at::kInt));
  if (T == 0) return {weights, ids};

  cpu::RouteParams p;
  p.logits = logits.data_ptr();
  p.fmt = fmt_of(logits);
  p.ld = logits.stride(0);
  p.bias = biased ? bias->data_ptr() : nullptr;
  p.bias_fmt = biased ? fmt_of(*bias) : Fmt::kF32;
  p.method = m;
  p.E = int(E);
  p.K = int(top_k);
  p.n_group = int(n_group);
  p.topk_group = int(topk_group);
  p.scaling = float(scaling);
  p.renormalize = renormalize;
  p.weights = weights.data_ptr<float>();
  p.ids = ids.data_ptr<int32_t>();
  auto* fn = MOELAB_PICK(route_tokens);
  const int64_t grain = grain_tokens(E);
  if (T < grain || at::get_num_threads() == 1 || at::in_parallel_region())
    fn(p, 0, T);                                   // decode: no thread-pool round trip
  else
    at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) { fn(p, t0, t1); });
  return {weights, ids};
}

const int kRegistered = register_op_level(kOp, cpu::Isa::kAvx512);

}  // namespace
}  // namespace moelab

TORCH_LIBRARY_FRAGMENT(moelab, m) {
  m.def("route(Tensor logits, int top_k, str method, Tensor? bias=None, float scaling=1.0, "
        "bool renormalize=False, int n_group=1, int topk_group=1) -> (Tensor weights, Tensor ids)");
}
TORCH_LIBRARY_IMPL(moelab, CPU, m) { m.impl("route", &moelab::route_cpu); }
