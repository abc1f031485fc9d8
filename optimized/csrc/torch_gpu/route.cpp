// CUDA/ROCm implementation of moelab::route (schema in csrc/torch/route.cpp). The checks
// shared with the CPU binding (csrc/torch/checks.h), then one launch of csrc/gpu/route.cu
// (tier chosen there, from (E, K)).
#include <cmath>

#include "common.h"

namespace moelab::gpu_binding {
namespace {
constexpr const char* kOp = "route";

// Argument order of the schema (csrc/torch/route.cpp): bias, scaling, renormalize, n_group, topk_group,
// norm_eps. renormalize and norm_eps unset: the method's defaults (resolved in checks.h).
std::tuple<at::Tensor, at::Tensor> route_impl(const char* op, int selection, const at::Tensor& logits, int64_t top_k,
                                              const std::string& method, const std::optional<at::Tensor>& bias,
                                              double scaling, std::optional<bool> renormalize, int64_t n_group,
                                              int64_t topk_group, std::optional<double> norm_eps) {
  check_is_gpu(logits, op, "logits");
  if (bias.has_value()) check_is_gpu(*bias, op, "bias", &logits);
  const checks::RouteSizes r =
      checks::check_route_args(op, logits, top_k, method, bias, scaling, renormalize, n_group, topk_group,
                               norm_eps);
  const int64_t T = r.T, E = r.E;
  const int m = r.method;
  const bool biased = r.biased;
  if (biased) MOELAB_CHECK(bias->is_contiguous(), op, "bias", "must be contiguous");

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
  a.renormalize = r.renormalize;
  a.norm_eps = float(r.norm_eps);
  a.weights = weights.data_ptr<float>();
  a.ids = ids.data_ptr<int32_t>();
  a.selection = selection;
  check_launch(gpu::route_launch(a, current_stream()), op);
  return {weights, ids};
}

std::tuple<at::Tensor, at::Tensor> route_cuda(const at::Tensor& logits, int64_t top_k, const std::string& method,
                                              const std::optional<at::Tensor>& bias, double scaling,
                                              std::optional<bool> renormalize, int64_t n_group, int64_t topk_group,
                                              std::optional<double> norm_eps) {
  return route_impl(kOp, gpu::kSelectLanes, logits, top_k, method, bias, scaling, renormalize, n_group, topk_group,
                    norm_eps);
}

// moelab::route_variant (schema in csrc/torch/route.cpp): seed 004's before/after pair by name.
// "lanes": the tier table (what route runs); "serial": warp 0 alone selects (route.cu).
std::tuple<at::Tensor, at::Tensor> route_variant_cuda(const at::Tensor& logits, int64_t top_k,
                                                      const std::string& method, const std::string& selection,
                                                      const std::optional<at::Tensor>& bias, double scaling,
                                                      std::optional<bool> renormalize, int64_t n_group,
                                                      int64_t topk_group, std::optional<double> norm_eps) {
  constexpr const char* kVariantOp = "route_variant";
  MOELAB_CHECK(selection == "lanes" || selection == "serial", kVariantOp, "selection",
               "must be 'lanes' or 'serial', got '", selection, "'");
  return route_impl(kVariantOp, selection == "serial" ? gpu::kSelectSerial : gpu::kSelectLanes, logits, top_k,
                    method, bias, scaling, renormalize, n_group, topk_group, norm_eps);
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
TORCH_LIBRARY_IMPL(moelab, CUDA, m) {
  m.impl("route", &moelab::gpu_binding::route_cuda);
  m.impl("route_variant", &moelab::gpu_binding::route_variant_cuda);
}
