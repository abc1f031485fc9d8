// torch.ops.moelab.route: binding of the CPU top-k routing kernel (csrc/cpu/route_kernel.h).
//
// Schema: route(Tensor logits, int top_k, str method, Tensor? bias=None, float scaling=1.0,
//               bool? renormalize=None, int n_group=1, int topk_group=1, float? norm_eps=None)
//           -> (Tensor weights, Tensor ids)
// method is the SPEC name ("softmax_topk", ..., "llama4", "grouped_softmax", "softmax_bias").
// The arguments are those of optimized.route in the order that lets common calls leave the
// rest at their defaults (norm_eps, added by SPEC 6, last so older positional calls keep
// their meaning). renormalize and norm_eps left unset (None) mean the method's default,
// resolved in checks::check_route_args exactly as reference.validate.check_route does, so a
// direct call that never passed renormalize keeps its old meaning (the biased methods
// normalize). Every constraint the kernel relies on, and every contract limit, is re-checked
// here with TORCH_CHECK, so a direct call with hostile arguments raises RuntimeError instead
// of reading out of bounds.
#include <cmath>
#include <cstring>

#include "../cpu/route.h"
#include "common.h"

namespace moelab {
namespace {

constexpr const char* kOp = "route";
using cpu::RouteMethod;

static_assert(cpu::kRouteMaxExperts == checks::kRouteMaxExperts && cpu::kRouteMaxTopK == checks::kRouteMaxTopK &&
                  cpu::kRouteMaxGroups == checks::kRouteMaxGroups,
              "the kernel's limits are the contract's (csrc/torch/checks.h)");
static_assert(int(cpu::kSoftmaxTopk) == checks::kSoftmaxTopk && int(cpu::kTopkSoftmax) == checks::kTopkSoftmax &&
                  int(cpu::kSigmoidTopk) == checks::kSigmoidTopk && int(cpu::kSigmoidBias) == checks::kSigmoidBias &&
                  int(cpu::kGroupedSigmoidBias) == checks::kGroupedSigmoidBias && int(cpu::kLlama4) == checks::kLlama4 &&
                  int(cpu::kGroupedSoftmax) == checks::kGroupedSoftmax && int(cpu::kSoftmaxBias) == checks::kSoftmaxBias,
              "method codes");

// Tokens per parallel task: ~16K expert keys (~8 us), so the thread pool's fork/join is
// amortized; fewer tokens run on the calling thread. The policy and its reasons live in
// optimized/dispatch.py (ROUTE_GRAIN_ELEMS, route section), which must say the same number.
int64_t grain_tokens(int64_t E) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(E, 1));
}

std::tuple<at::Tensor, at::Tensor> route_impl(const char* op, int selection, const at::Tensor& logits_in,
                                              int64_t top_k, const std::string& method,
                                              const std::optional<at::Tensor>& bias_in, double scaling,
                                              std::optional<bool> renormalize, int64_t n_group,
                                              int64_t topk_group, std::optional<double> norm_eps) {
  check_is_cpu(logits_in, op, "logits");
  if (bias_in.has_value()) check_is_cpu(*bias_in, op, "bias");
  // Every check comes before the copies below (a stride-0 expanded tensor may have any size).
  const checks::RouteSizes r =
      checks::check_route_args(op, logits_in, top_k, method, bias_in, scaling, renormalize, n_group, topk_group,
                               norm_eps);
  const int64_t T = r.T, E = r.E;
  const int m = r.method;
  const bool biased = r.biased;

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
  p.renormalize = r.renormalize;
  p.norm_eps = float(r.norm_eps);   // the reference's f32 operations round eps to f32 too
  p.weights = weights.data_ptr<float>();
  p.ids = ids.data_ptr<int32_t>();
  p.selection = selection;
  auto* fn = MOELAB_PICK(route_tokens);
  const int64_t grain = grain_tokens(E);
  if (T < grain || at::get_num_threads() == 1 || at::in_parallel_region())
    fn(p, 0, T);                                   // decode: no thread-pool round trip
  else
    at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) { fn(p, t0, t1); });
  return {weights, ids};
}

std::tuple<at::Tensor, at::Tensor> route_cpu(const at::Tensor& logits, int64_t top_k, const std::string& method,
                                             const std::optional<at::Tensor>& bias, double scaling,
                                             std::optional<bool> renormalize, int64_t n_group,
                                             int64_t topk_group, std::optional<double> norm_eps) {
  return route_impl(kOp, cpu::kSelectLanes, logits, top_k, method, bias, scaling, renormalize, n_group, topk_group,
                    norm_eps);
}

// moelab::route_variant: the same op with the selection algorithm named (seed 004's
// before/after pair, for experiments, tests and verify; no dispatcher calls it).
// "lanes": today's kernel (what route runs); "serial": one scalar insertion pass over all E.
std::tuple<at::Tensor, at::Tensor> route_variant_cpu(const at::Tensor& logits, int64_t top_k,
                                                     const std::string& method, const std::string& selection,
                                                     const std::optional<at::Tensor>& bias, double scaling,
                                                     std::optional<bool> renormalize, int64_t n_group,
                                                     int64_t topk_group, std::optional<double> norm_eps) {
  constexpr const char* kVariantOp = "route_variant";
  MOELAB_CHECK(selection == "lanes" || selection == "serial", kVariantOp, "selection",
               "must be 'lanes' or 'serial', got '", selection, "'");
  return route_impl(kVariantOp, selection == "serial" ? cpu::kSelectSerial : cpu::kSelectLanes, logits, top_k,
                    method, bias, scaling, renormalize, n_group, topk_group, norm_eps);
}

const int kRegistered = register_op_level(kOp, cpu::Isa::kAvx512);

}  // namespace
}  // namespace moelab

TORCH_LIBRARY_FRAGMENT(moelab, m) {
  m.def("route(Tensor logits, int top_k, str method, Tensor? bias=None, float scaling=1.0, "
        "bool? renormalize=None, int n_group=1, int topk_group=1, float? norm_eps=None) "
        "-> (Tensor weights, Tensor ids)");
}
TORCH_LIBRARY_FRAGMENT(moelab, m) {
  m.def("route_variant(Tensor logits, int top_k, str method, str selection, Tensor? bias=None, "
        "float scaling=1.0, bool? renormalize=None, int n_group=1, int topk_group=1, float? norm_eps=None) "
        "-> (Tensor weights, Tensor ids)");
}
TORCH_LIBRARY_IMPL(moelab, CPU, m) {
  m.impl("route", &moelab::route_cpu);
  m.impl("route_variant", &moelab::route_variant_cpu);
}
