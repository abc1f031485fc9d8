// CUDA/ROCm implementation of moelab::route (schema in csrc/torch/route.cpp). Same checks
// as the CPU binding, then one launch of csrc/gpu/route.cu (tier chosen there, from (E, K)).
#include <cmath>

#include "common.h"

namespace moelab::gpu_binding {
namespace {
constexpr const char* kOp = "route";

int method_code(const std::string& m) {
  static const char* names[] = {"softmax_topk", "topk_softmax", "sigmoid_topk",
                                "sigmoid_bias", "grouped_sigmoid_bias", "llama4"};
  for (int i = 0; i < 6; ++i)
    if (m == names[i]) return i;
  MOELAB_CHECK(false, kOp, "method", "must be one of softmax_topk, topk_softmax, sigmoid_topk, "
               "sigmoid_bias, grouped_sigmoid_bias, llama4; got '", m, "'");
  return -1;
}

// Argument order of the schema (csrc/torch/route.cpp): bias, scaling, renormalize, n_group, topk_group.
std::tuple<at::Tensor, at::Tensor> route_cuda(const at::Tensor& logits, int64_t top_k, const std::string& method,
                                              const std::optional<at::Tensor>& bias, double scaling, bool renormalize,
                                              int64_t n_group, int64_t topk_group) {
  check_gpu(logits, kOp, "logits", 2, {at::kFloat, at::kBFloat16, at::kHalf}, /*contiguous=*/false);
  const int64_t T = logits.size(0), E = logits.size(1);
  MOELAB_CHECK(E >= 1 && E <= gpu::kRouteMaxExperts, kOp, "logits", "must have 1 <= E <= ", gpu::kRouteMaxExperts,
               " columns (experts), got E = ", E);
  const int m = method_code(method);
  MOELAB_CHECK(top_k >= 1 && top_k <= std::min<int64_t>(E, gpu::kRouteMaxTopK), kOp, "top_k",
               "must satisfy 1 <= top_k <= min(E, ", gpu::kRouteMaxTopK, ") = ",
               std::min<int64_t>(E, gpu::kRouteMaxTopK), ", got ", top_k);
  MOELAB_CHECK(m != gpu::kLlama4 || top_k == 1, kOp, "top_k", "must be 1 for method 'llama4', got ", top_k);
  const bool biased = m == gpu::kSigmoidBias || m == gpu::kGroupedSigmoidBias;
  if (biased) {
    MOELAB_CHECK(bias.has_value(), kOp, "bias", "is required by method '", method, "'");
    check_gpu(*bias, kOp, "bias", 1, {at::kFloat, at::kBFloat16}, /*contiguous=*/true, &logits);
    MOELAB_CHECK(bias->size(0) == E, kOp, "bias", "must have shape (", E, "), got ", bias->sizes());
  } else {
    MOELAB_CHECK(!bias.has_value(), kOp, "bias", "is only used by sigmoid_bias, grouped_sigmoid_bias");
  }
  if (m == gpu::kGroupedSigmoidBias) {
    MOELAB_CHECK(E <= gpu::kRouteMaxGroupedExperts, kOp, "logits", "must have E <= ", gpu::kRouteMaxGroupedExperts,
                 " for grouped routing, got E = ", E);
    MOELAB_CHECK(n_group >= 1 && n_group <= gpu::kRouteMaxGroups, kOp, "n_group", "must satisfy 1 <= n_group <= ",
                 gpu::kRouteMaxGroups, ", got ", n_group);
    MOELAB_CHECK(E % n_group == 0 && E / n_group >= 2, kOp, "n_group", "must divide E = ", E,
                 " into groups of at least 2 experts, got ", n_group);
    MOELAB_CHECK(topk_group >= 1 && topk_group <= n_group, kOp, "topk_group",
                 "must satisfy 1 <= topk_group <= n_group = ", n_group, ", got ", topk_group);
    MOELAB_CHECK(top_k <= topk_group * (E / n_group), kOp, "top_k", "must be <= topk_group * E / n_group = ",
                 topk_group * (E / n_group), ", got ", top_k);
  } else {
    MOELAB_CHECK(n_group == 1, kOp, "n_group", "only applies to method 'grouped_sigmoid_bias', got ", n_group);
    MOELAB_CHECK(topk_group == 1, kOp, "topk_group", "only applies to method 'grouped_sigmoid_bias', got ",
                 topk_group);
  }
  MOELAB_CHECK(std::isfinite(scaling), kOp, "scaling", "must be finite, got ", scaling);
  MOELAB_CHECK(biased || scaling == 1.0, kOp, "scaling",
               "only applies to sigmoid_bias, grouped_sigmoid_bias; must be 1.0, got ", scaling);
  MOELAB_CHECK(!renormalize || m == gpu::kSoftmaxTopk || m == gpu::kTopkSoftmax || m == gpu::kSigmoidTopk, kOp,
               "renormalize", "only applies to softmax_topk, topk_softmax, sigmoid_topk");

  const c10::cuda::CUDAGuard guard(logits.device());
  auto opts = logits.options();
  at::Tensor weights = at::empty({T, top_k}, opts.dtype(at::kFloat));
  at::Tensor ids = at::empty({T, top_k}, opts.dtype(at::kInt));
  if (T == 0) return {weights, ids};
  const at::Tensor x = (E > 1 && logits.stride(1) != 1) || (T > 1 && logits.stride(0) < E) ? logits.contiguous()
                                                                                             : logits;
  gpu::RouteArgs a;
  a.logits = x.data_ptr();
  a.fmt = fmt_of(x);
  a.ld = T > 1 ? x.stride(0) : E;
  a.bias = biased ? bias->data_ptr() : nullptr;
  a.bias_fmt = biased ? fmt_of(*bias) : Fmt::kF32;
  a.method = m;
  a.T = T;
  a.E = int(E);
  a.K = int(top_k);
  a.n_group = int(n_group);
  a.topk_group = int(topk_group);
  a.scaling = float(scaling);
  a.renormalize = renormalize;
  a.weights = weights.data_ptr<float>();
  a.ids = ids.data_ptr<int32_t>();
  check_launch(gpu::route_launch(a, current_stream()), kOp);
  return {weights, ids};
}

// The tier table's row for (E, K): "row <i>: warp|block, <p> experts per lane: <reason>".
std::string gpu_route_plan(int64_t E, int64_t K) {
  gpu::RoutePlan p;
  if (E < 1 || K < 1 || E > gpu::kRouteMaxExperts || K > gpu::kRouteMaxTopK ||
      gpu::route_plan(int(E), int(K), &p) != gpu::kOk)
    return "unsupported";
  return "row " + std::to_string(p.row) + ": " + (p.block ? "block" : "warp") + " tier, " +
         std::to_string(p.per_lane) + " experts per " + (p.block ? "thread" : "lane") + ", " +
         std::to_string(p.threads) + " threads per block: " + p.reason;
}
}  // namespace
}  // namespace moelab::gpu_binding

TORCH_LIBRARY_FRAGMENT(moelab, m) { m.def("gpu_route_plan(int E, int K) -> str", &moelab::gpu_binding::gpu_route_plan); }
TORCH_LIBRARY_IMPL(moelab, CUDA, m) { m.impl("route", &moelab::gpu_binding::route_cuda); }
