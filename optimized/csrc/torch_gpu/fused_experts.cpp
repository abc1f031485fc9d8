// CUDA/ROCm implementation of moelab::fused_experts (schema in csrc/torch/fused_experts.cpp):
// the CPU binding's argument checks, then csrc/gpu/fused_experts.cu's launcher on the current
// stream with a workspace from torch's caching allocator (fused_experts_workspace_bytes: the
// row grouping and the intermediates h, a, y; CUDA-graph safe).
//
// The GPU takes SPEC's standard weight layout only: `packed` (the CPU's prepacked VNNI layout,
// optimized.prepack_moe_weights) is refused with an error naming the argument. The per-block
// path choice (policy, m_cross) comes from optimized.dispatch (GPU policy: small-m path or
// tiled path per expert block; batch-invariant mode: small-m only).
//
// An id outside [-1, E) is found on the device (the permute kernels' status word; such a slot
// is skipped, nothing is written outside the output). Unless the stream is being captured
// into a CUDA graph (or MOELAB_GPU_SYNC_CHECKS=0), the binding reads the word back (one small
// synchronous copy) and raises the CPU binding's RuntimeError.
#include <cmath>
#include <string>

#include "common.h"

namespace moelab::gpu_binding {
namespace {

constexpr const char* kOp = "fused_experts";

int quant_code(c10::string_view q) {
  if (q == "bf16") return gpu::kFeBF16;
  if (q == "fp8_block") return gpu::kFeFP8;
  MOELAB_CHECK(q == "mxfp4", kOp, "quant", "must be one of bf16, fp8_block, mxfp4; got '", std::string(q), "'");
  return gpu::kFeMXFP4;
}

at::ScalarType weight_dtype(int q) {
  return q == gpu::kFeBF16 ? at::kBFloat16 : q == gpu::kFeFP8 ? at::kFloat8_e4m3fn : at::kByte;
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_shape(const at::Tensor& t, const char* arg, at::IntArrayRef want) {
  MOELAB_CHECK(t.sizes() == want, kOp, arg, "must have shape ", want, ", got ", t.sizes());
}

// Weight [E][N][K] in the standard layout (mxfp4: K/2 bytes per row), and its scales.
void check_weight(const at::Tensor& w, int q, int64_t E, int64_t N, int64_t K, const char* arg,
                  const at::Tensor& like) {
  check_gpu(w, kOp, arg, 3, {weight_dtype(q)}, /*contiguous=*/true, &like);
  check_shape(w, arg, {E, N, q == gpu::kFeMXFP4 ? K / 2 : K});
}

void check_scale(const std::optional<at::Tensor>& s, int q, int64_t E, int64_t N, int64_t K, const char* arg,
                 const at::Tensor& like) {
  if (q == gpu::kFeBF16) {
    MOELAB_CHECK(!s.has_value(), kOp, arg, "must be None for quant 'bf16'");
    return;
  }
  MOELAB_CHECK(s.has_value(), kOp, arg, "is required for quant ", q == gpu::kFeFP8 ? "'fp8_block'" : "'mxfp4'");
  if (q == gpu::kFeFP8) {
    check_gpu(*s, kOp, arg, 3, {at::kFloat}, /*contiguous=*/true, &like);
    check_shape(*s, arg, {E, cdiv(N, 128), cdiv(K, 128)});
  } else {
    check_gpu(*s, kOp, arg, 3, {at::kByte}, /*contiguous=*/true, &like);
    check_shape(*s, arg, {E, N, K / 32});
  }
}

void check_bias(const std::optional<at::Tensor>& b, int64_t E, int64_t N, const char* arg, const at::Tensor& like) {
  if (!b.has_value()) return;
  check_gpu(*b, kOp, arg, 2, {at::kFloat, at::kBFloat16}, /*contiguous=*/true, &like);
  check_shape(*b, arg, {E, N});
}

at::Tensor fused_experts_cuda(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                              const at::Tensor& topk_weights, const at::Tensor& topk_ids, c10::string_view quant,
                              bool packed, int64_t E, int64_t I, const std::optional<at::Tensor>& w13_scale,
                              const std::optional<at::Tensor>& w2_scale, const std::optional<at::Tensor>& w13_slow,
                              const std::optional<at::Tensor>& w2_slow, const std::optional<at::Tensor>& w13_bias,
                              const std::optional<at::Tensor>& w2_bias, c10::string_view activation, double alpha,
                              double limit, int64_t policy, int64_t m_cross,
                              bool apply_router_weight_on_input) {
  check_gpu(x, kOp, "x", 2, {at::kBFloat16}, /*contiguous=*/false);
  const int64_t T = x.size(0), H = x.size(1);
  MOELAB_CHECK(T == 0 || H <= 1 || x.stride(1) == 1, kOp, "x", "must have unit stride along H");
  MOELAB_CHECK(H >= 1, kOp, "x", "must have H >= 1 columns");
  MOELAB_CHECK(!packed, kOp, "packed",
               "prepacked weights (the CPU kernels' layout, optimized.prepack_moe_weights) are not supported on "
               "CUDA/ROCm; pass w13, w2 and their scales in the standard layout");
  MOELAB_CHECK(!w13_slow.has_value(), kOp, "w13_slow", "must be None for standard-layout weights");
  MOELAB_CHECK(!w2_slow.has_value(), kOp, "w2_slow", "must be None for standard-layout weights");
  const int q = quant_code(quant);
  MOELAB_CHECK(E >= 1 && E <= (int64_t(1) << 20), kOp, "E", "must be in [1, 2^20], got ", E);
  MOELAB_CHECK(I >= 1 && I <= (int64_t(1) << 24) && H <= (int64_t(1) << 24), kOp, "I",
               "must be in [1, 2^24] (and H too), got I = ", I, ", H = ", H);
  if (q == gpu::kFeMXFP4)
    MOELAB_CHECK(H % 32 == 0 && I % 32 == 0, kOp, "I", "mxfp4 needs H and I to be multiples of 32, got H = ", H,
                 ", I = ", I);
  check_weight(w13, q, E, 2 * I, H, "w13", x);
  check_weight(w2, q, E, H, I, "w2", x);
  check_scale(w13_scale, q, E, 2 * I, H, "w13_scale", x);
  check_scale(w2_scale, q, E, H, I, "w2_scale", x);
  check_bias(w13_bias, E, 2 * I, "w13_bias", x);
  check_bias(w2_bias, E, H, "w2_bias", x);
  check_gpu(topk_ids, kOp, "topk_ids", 2, {at::kInt}, /*contiguous=*/false, &x);
  check_gpu(topk_weights, kOp, "topk_weights", 2, {at::kFloat}, /*contiguous=*/false, &x);
  const int64_t K = topk_ids.size(1);
  MOELAB_CHECK(topk_ids.size(0) == T && K >= 1, kOp, "topk_ids", "must have shape (", T, ", K >= 1), got ",
               topk_ids.sizes());
  MOELAB_CHECK(topk_weights.sizes() == topk_ids.sizes(), kOp, "topk_weights", "must have shape ", topk_ids.sizes(),
               ", got ", topk_weights.sizes());
  MOELAB_CHECK(T * K < (int64_t(1) << 31), kOp, "topk_ids", "has T*K = ", T * K, " rows, more than 2^31 - 1");
  int act = gpu::kFeSilu;
  if (activation == "swiglu_oai") act = gpu::kFeSwigluOai;
  else MOELAB_CHECK(activation == "silu", kOp, "activation", "must be silu or swiglu_oai, got '",
                    std::string(activation), "'");
  MOELAB_CHECK(std::isfinite(alpha), kOp, "alpha", "must be finite, got ", alpha);
  MOELAB_CHECK(std::isfinite(limit), kOp, "limit", "must be finite, got ", limit);
  MOELAB_CHECK(policy >= gpu::kFeAllSmall && policy <= gpu::kFePerBlock, kOp, "policy",
               "must be 0 (small-m path), 1 (tiled path) or 2 (per block), got ", policy);

  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({T, H}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0) return out;
  // Rows closer than H elements (an expanded x) are copied; a single row needs no stride.
  const at::Tensor xr = T > 1 && x.stride(0) < H ? x.contiguous() : x;
  const int64_t bytes = gpu::fused_experts_workspace_bytes(T, K, E, H, I);
  MOELAB_CHECK(bytes > 0, kOp, "x", "gives no valid workspace size (T = ", T, ", K = ", K, ")");
  at::Tensor ws = at::empty({bytes + 256}, x.options().dtype(at::kByte));
  char* base = static_cast<char*>(ws.data_ptr());
  base += (256 - reinterpret_cast<uintptr_t>(base) % 256) % 256;

  gpu::FusedExpertsArgs a{};
  a.x = xr.data_ptr();
  a.ldx = T > 1 ? xr.stride(0) : H;
  a.w13 = w13.data_ptr();
  a.w2 = w2.data_ptr();
  a.w13_scale = w13_scale.has_value() ? w13_scale->data_ptr() : nullptr;
  a.w2_scale = w2_scale.has_value() ? w2_scale->data_ptr() : nullptr;
  a.w13_bias = w13_bias.has_value() ? w13_bias->data_ptr() : nullptr;
  a.w2_bias = w2_bias.has_value() ? w2_bias->data_ptr() : nullptr;
  a.w13_bias_bf16 = w13_bias.has_value() && w13_bias->scalar_type() == at::kBFloat16;
  a.w2_bias_bf16 = w2_bias.has_value() && w2_bias->scalar_type() == at::kBFloat16;
  a.topk_weights = topk_weights.data_ptr<float>();
  a.ldw_t = topk_weights.stride(0);
  a.ldw_k = topk_weights.stride(1);
  a.topk_ids = topk_ids.data_ptr<int32_t>();
  a.ldi_t = topk_ids.stride(0);
  a.ldi_k = topk_ids.stride(1);
  a.quant = q;
  a.activation = act;
  a.alpha = float(alpha);   // rounded to f32 first, as on the CPU
  a.limit = float(limit);
  a.T = T;
  a.K = K;
  a.E = E;
  a.H = H;
  a.I = I;
  a.policy = int(policy);
  a.m_cross = m_cross;
  a.apply_router_weight_on_input = apply_router_weight_on_input;   // SPEC 6 (csrc/gpu/fused_experts.cu)
  a.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  a.workspace = base;
  a.workspace_bytes = bytes;
  check_launch(gpu::fused_experts_launch(a, current_stream()), kOp);
  if (sync_checks()) {
    const int64_t off = base - static_cast<char*>(ws.data_ptr());
    const at::Tensor st = ws.narrow(0, off, 4 * gpu::kPermuteStatusWords).to(at::kCPU).view(at::kInt);
    const int32_t* w = st.data_ptr<int32_t>();
    const int64_t bad = int64_t(uint64_t(uint32_t(w[2])) | (uint64_t(uint32_t(w[3])) << 32));
    MOELAB_CHECK(w[0] != 1, kOp, "topk_ids", "holds ", bad, ", outside the valid range [-1, ", E, ")");
    TORCH_CHECK(w[0] == 0, "moelab::fused_experts: inconsistent topk_ids between passes (status ", w[0],
                "); is an input sharing memory with a buffer being written?");
  }
  return out;
}

}  // namespace
}  // namespace moelab::gpu_binding

TORCH_LIBRARY_IMPL(moelab, CUDA, m) { m.impl("fused_experts", &moelab::gpu_binding::fused_experts_cuda); }
