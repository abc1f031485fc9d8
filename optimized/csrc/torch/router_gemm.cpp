#include "../cpu/router_gemm.h"
#include "common.h"

namespace moelab {
namespace {

constexpr const char* kOp = "router_gemm";


at::Tensor router_gemm_cpu(const at::Tensor& x, const at::Tensor& weight) {
  check_is_cpu(x, kOp, "x");
  check_is_cpu(weight, kOp, "weight");
  const checks::GemmSizes g = checks::check_router_gemm_args(kOp, x, weight);
  const int64_t T = g.T, H = g.K, E = g.N;
  at::Tensor out = at::empty({T, E}, x.options().dtype(at::kFloat));
  if (T == 0) return out;
  auto* fn = MOELAB_PICK(router_gemm_experts);
  const void* xp = x.data_ptr();
  const int64_t ldx = x.stride(0);
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Experts split into blocks of 4 (the kernel's tile); each thread streams its own rows.
  at::parallel_for(0, (E + 3) / 4, 1, [&](int64_t b0, int64_t b1) {
    fn(xp, fmt_of(x), ldx, wp, op, T, H, E, b0 * 4, std::min(E, b1 * 4));
  });
  return out;
}

const int kRegistered = register_op_level(kOp, cpu::Isa::kAvx512);

}  // namespace
}  // namespace moelab

TORCH_LIBRARY_FRAGMENT(moelab, m) { m.def("router_gemm(Tensor x, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(moelab, CPU, m) { m.impl("router_gemm", &moelab::router_gemm_cpu); }
