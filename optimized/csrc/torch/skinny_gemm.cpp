// moelab::skinny_gemm(x[T,K], weight[N,K], bias[N]?) -> [T,N], T <= 8 (SPEC section 4).
//
// The checks below are the C++ floor (the Python wrapper validates first with
// reference.validate.check_skinny_gemm): everything the kernel relies on to stay inside the
// tensors. Rows of x and weight may be strided (any row stride torch allows); along K both
// need unit stride (or K == 1). T > 8 is refused here too, so a direct call cannot exceed
// the contract.
#include <torch/csrc/autograd/custom_function.h>

#include "../cpu/skinny_gemm.h"
#include "common.h"

namespace moelab {
namespace {

constexpr const char* kOp = "skinny_gemm";
constexpr int64_t kRowTile = 4;         // the kernel's row tile
constexpr int64_t kMinBytesPerTask = 128 << 10;  // less weight per thread: fewer threads


at::Tensor skinny_gemm_cpu(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  check_is_cpu(x, kOp, "x");
  check_is_cpu(weight, kOp, "weight");
  if (bias.has_value()) check_is_cpu(*bias, kOp, "bias");
  const checks::GemmSizes g = checks::check_skinny_gemm_args(kOp, x, weight, bias);
  const int64_t T = g.T, K = g.K, N = g.N;
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  at::Tensor out = at::empty({T, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0) return out;
  auto* fn = MOELAB_PICK(skinny_gemm_rows);
  const void* xp = x.data_ptr();
  const void* wp = weight.data_ptr();
  const void* bp = b.defined() ? b.data_ptr() : nullptr;
  void* op = out.data_ptr();
  const int64_t ldx = x.stride(0), ldw = weight.stride(0);
  const Fmt fmt = fmt_of(x);
  // Work unit: a row tile of 4 output features; a thread streams its own weight rows. Small
  // weights run on one thread (a fork costs more than it saves).
  const int64_t tiles = (N + kRowTile - 1) / kRowTile;
  const int64_t tile_bytes = kRowTile * K * static_cast<int64_t>(x.element_size());
  const int64_t grain = std::max<int64_t>(1, (kMinBytesPerTask + tile_bytes - 1) / tile_bytes);
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    fn(xp, ldx, wp, ldw, bp, op, N, fmt, T, K, t0 * kRowTile, std::min(N, t1 * kRowTile));
  });
  return out;
}

// Autograd: y = x @ w.T + b, so dx = dy @ w, dw = dy.T @ x, db = sum over rows of dy (plain
// ATen ops; training is not this kernel's purpose, but a gradient must never be silently
// missing). In C++ so that calls without gradients pay no Python autograd dispatch.
at::Tensor skinny_gemm_call(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("moelab::skinny_gemm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(x, w, b);
}

class SkinnyGemmFunction : public torch::autograd::Function<SkinnyGemmFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& b) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x, w});
    ctx->saved_data["has_bias"] = b.has_value();
    return skinny_gemm_call(x, w, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &dy = grads[0];
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = dy.matmul(w);
    if (ctx->needs_input_grad(1)) dw = dy.t().matmul(x);
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) db = dy.sum(0);
    return {dx, dw, db};
  }
};

at::Tensor skinny_gemm_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || weight.requires_grad() || (bias.has_value() && bias->requires_grad()));
  if (!grad) {  // inference: skip building an autograd node (saves ~1 us per call)
    at::AutoDispatchBelowADInplaceOrView guard;
    return skinny_gemm_call(x, weight, bias);
  }
  return SkinnyGemmFunction::apply(x, weight, bias);
}

const int kRegistered = register_op_level(kOp, cpu::Isa::kAvx512Bf16);

}  // namespace
}  // namespace moelab

TORCH_LIBRARY_FRAGMENT(moelab, m) {
  m.def("skinny_gemm(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(moelab, CPU, m) { m.impl("skinny_gemm", &moelab::skinny_gemm_cpu); }
TORCH_LIBRARY_IMPL(moelab, Autograd, m) { m.impl("skinny_gemm", &moelab::skinny_gemm_autograd); }
