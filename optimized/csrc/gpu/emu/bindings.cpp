// Python bindings of the emulated GPU launchers (tests only; see emu.h). CPU tensors in,
// the launchers' status and freshly poisoned outputs out (NaN / -7), so a test sees every
// element a kernel failed to write.
#include <torch/extension.h>

#include "../launch.h"
#include "../portability.h"
#if MOELAB_HIP
#include "../../hip/skinny_wave64.h"
#endif

namespace {
using moelab::Fmt;
namespace gpu = moelab::gpu;

Fmt fmt_of(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? Fmt::kBF16 : t.scalar_type() == at::kHalf ? Fmt::kF16 : Fmt::kF32;
}
at::Tensor poison(at::IntArrayRef shape, at::ScalarType dt) {
  if (at::isFloatingType(dt)) return at::full(shape, std::numeric_limits<double>::quiet_NaN(), at::dtype(dt));
  return at::full(shape, -7, at::dtype(dt));
}

py::tuple route(const at::Tensor& logits, int64_t K, int64_t method, const std::optional<at::Tensor>& bias,
                int64_t n_group, int64_t topk_group, double scaling, bool renormalize, double norm_eps,
                int64_t selection) {
  const int64_t T = logits.size(0), E = logits.size(1);
  at::Tensor w = poison({T, K}, at::kFloat), ids = poison({T, K}, at::kInt);
  gpu::RouteArgs a;
  a.logits = logits.data_ptr();
  a.fmt = fmt_of(logits);
  a.ld = logits.stride(0);
  a.bias = bias ? bias->data_ptr() : nullptr;
  a.bias_fmt = bias ? fmt_of(*bias) : Fmt::kF32;
  a.method = int(method);
  a.T = T;
  a.E = int(E);
  a.K = int(K);
  a.n_group = int(n_group);
  a.topk_group = int(topk_group);
  a.scaling = float(scaling);
  a.renormalize = renormalize;   // resolved by the caller, as the torch binding resolves it
  a.norm_eps = float(norm_eps);
  a.weights = w.data_ptr<float>();
  a.ids = ids.data_ptr<int32_t>();
  a.selection = int(selection);   // gpu::RouteSelection (0: the tier table, 1: seed 004's warp-0 kernel)
  const int st = gpu::route_launch(a, nullptr);
  return py::make_tuple(st, w, ids);
}

py::tuple route_plan(int64_t E, int64_t K) {
  gpu::RoutePlan p{};
  const int st = gpu::route_plan(int(E), int(K), &p);
  return py::make_tuple(st, p.row, p.block, p.per_lane, p.threads);
}

py::tuple permute(const at::Tensor& hidden, const at::Tensor& ids, int64_t n_experts,
                  const std::optional<at::Tensor>& expert_map, int64_t n_local, int64_t align, int64_t ws_words) {
  const int64_t T = hidden.size(0), H = hidden.size(1), K = ids.size(1), R = T * K;
  const int64_t cap = R + n_local * (align - 1);
  at::Tensor offsets = poison({n_local + 1}, at::kLong), out = poison({cap, H}, hidden.scalar_type());
  at::Tensor src_row = poison({cap}, at::kInt), dst_pos = poison({R}, at::kInt);
  if (ws_words < 0) ws_words = gpu::permute_workspace_words(R, n_local);
  at::Tensor ws = at::full({std::max<int64_t>(ws_words, 4)}, 12345, at::kInt);   // garbage, as reused memory
  gpu::PermuteArgs a;
  a.hidden = hidden.data_ptr();
  a.row_bytes = H * hidden.element_size();
  a.ld_bytes = hidden.stride(0) * hidden.element_size();
  a.ids = ids.data_ptr();
  a.ids_int64 = ids.scalar_type() == at::kLong;
  a.ld_t = ids.stride(0);
  a.ld_k = ids.stride(1);
  a.expert_map = expert_map ? expert_map->data_ptr<int32_t>() : nullptr;
  a.map_stride = expert_map ? expert_map->stride(0) : 0;
  a.T = T;
  a.K = K;
  a.n_experts = n_experts;
  a.n_local = n_local;
  a.align = align;
  a.offsets = offsets.data_ptr<int64_t>();
  a.hidden_out = out.data_ptr();
  a.src_row = src_row.data_ptr<int32_t>();
  a.dst_pos = dst_pos.data_ptr<int32_t>();
  a.capacity = cap;
  a.workspace = ws.data_ptr<int32_t>();
  a.workspace_words = ws_words;
  const int st = gpu::permute_launch(a, nullptr);
  return py::make_tuple(st, offsets, out, src_row, dst_pos, ws.narrow(0, 0, 4).clone());
}

py::tuple unpermute(const at::Tensor& eo, const at::Tensor& w, const at::Tensor& dst_pos) {
  const int64_t T = w.size(0), K = w.size(1), H = eo.size(1);
  at::Tensor out = poison({T, H}, eo.scalar_type());
  at::Tensor flag = at::zeros({1}, at::kInt);
  gpu::UnpermuteArgs a;
  a.expert_out = eo.data_ptr();
  a.fmt = fmt_of(eo);
  a.ld = eo.stride(0);
  a.rows = eo.size(0);
  a.H = H;
  a.weights = w.data_ptr<float>();
  a.ldw_t = w.stride(0);
  a.ldw_k = w.stride(1);
  a.dst_pos = dst_pos.data_ptr<int32_t>();
  a.T = T;
  a.K = K;
  a.out = out.data_ptr();
  a.status = flag.data_ptr<int32_t>();
  const int st = gpu::unpermute_launch(a, nullptr);
  return py::make_tuple(st, out, flag.item<int>());
}

py::tuple router_gemm(const at::Tensor& x, const at::Tensor& w) {
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0);
  at::Tensor out = poison({T, E}, at::kFloat);
  const int st = gpu::router_gemm_launch(x.data_ptr(), fmt_of(x), T > 1 ? x.stride(0) : H, w.data_ptr<float>(),
                                         w.stride(0), out.data_ptr<float>(), T, H, E, nullptr);
  return py::make_tuple(st, out);
}

py::tuple skinny_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool wave64,
                      int64_t n_cu) {
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = poison({T, N}, x.scalar_type());
  const void* bp = bias ? bias->data_ptr() : nullptr;
  const int64_t ldx = T > 1 ? x.stride(0) : K;
  int st;
#if MOELAB_HIP
  if (wave64)
    st = gpu::skinny_wave64_launch(x.data_ptr(), ldx, w.data_ptr(), w.stride(0), bp, out.data_ptr(), fmt_of(x), T, K,
                                   N, int(n_cu), nullptr);
  else
#endif
    st = gpu::skinny_gemm_launch(x.data_ptr(), ldx, w.data_ptr(), w.stride(0), bp, out.data_ptr(), fmt_of(x), T, K, N,
                                 nullptr);
  (void)wave64;
  (void)n_cu;
  return py::make_tuple(st, out);
}
// fused_experts: the launcher on CPU tensors. ws_bytes < 0: exactly the size the launcher asks
// for (filled with garbage, as reused memory); quant: 0 bf16, 1 fp8_block, 2 mxfp4 (FeQuant);
// weighted_input: apply_router_weight_on_input (SPEC 6; keyword, default False).
// Returns (status, out [T, H] bf16 poisoned with NaN before the call, the 4 status words).
py::tuple fused_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& tw,
                        const at::Tensor& ids, int64_t quant, const std::optional<at::Tensor>& s13,
                        const std::optional<at::Tensor>& s2, const std::optional<at::Tensor>& b13,
                        const std::optional<at::Tensor>& b2, int64_t act, double alpha, double limit, int64_t policy,
                        int64_t m_cross, int64_t E, int64_t I, int64_t ws_bytes, bool weighted_input) {
  const int64_t T = x.size(0), H = x.size(1), K = ids.size(1);
  at::Tensor out = poison({T, H}, at::kBFloat16);
  const int64_t need = gpu::fused_experts_workspace_bytes(T, K, E, H, I);
  if (ws_bytes < 0) ws_bytes = need;
  at::Tensor ws = at::full({std::max<int64_t>(ws_bytes, 16) + 256}, 0x5a, at::kByte);
  char* base = static_cast<char*>(ws.data_ptr());
  base += (256 - reinterpret_cast<uintptr_t>(base) % 256) % 256;   // the launcher wants 256-byte alignment
  gpu::FusedExpertsArgs a{};
  a.x = x.data_ptr();
  a.ldx = T > 1 ? x.stride(0) : H;
  a.w13 = w13.data_ptr();
  a.w2 = w2.data_ptr();
  a.w13_scale = s13 ? s13->data_ptr() : nullptr;
  a.w2_scale = s2 ? s2->data_ptr() : nullptr;
  a.w13_bias = b13 ? b13->data_ptr() : nullptr;
  a.w2_bias = b2 ? b2->data_ptr() : nullptr;
  a.w13_bias_bf16 = b13 && b13->scalar_type() == at::kBFloat16;
  a.w2_bias_bf16 = b2 && b2->scalar_type() == at::kBFloat16;
  a.topk_weights = tw.data_ptr<float>();
  a.ldw_t = tw.stride(0);
  a.ldw_k = tw.stride(1);
  a.topk_ids = ids.data_ptr<int32_t>();
  a.ldi_t = ids.stride(0);
  a.ldi_k = ids.stride(1);
  a.quant = int(quant);
  a.activation = int(act);
  a.alpha = float(alpha);
  a.limit = float(limit);
  a.T = T;
  a.K = K;
  a.E = E;
  a.H = H;
  a.I = I;
  a.policy = int(policy);
  a.m_cross = m_cross;
  a.apply_router_weight_on_input = weighted_input;
  a.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  a.workspace = base;
  a.workspace_bytes = ws_bytes;
  const int st = gpu::fused_experts_launch(a, nullptr);
  at::Tensor status = at::from_blob(base, {4}, at::kInt).clone();
  return py::make_tuple(st, out, status);
}
}  // namespace

#if MOELAB_SANITIZE
void moelab_emu_sanitizer_controls(pybind11::module& m);   // sanitizer_controls.cpp
#endif

// The rules' negative controls (rule_controls.cpp), each run with plant = 0 (must pass) or a
// planted bug (must raise).
namespace moelab::emu::controls {
void war(int plant, int* out);
void cp_async(int plant, const float* in, float* out);
void warp_order(int plant, int* out);
void uninit_static(int plant, float* out);
void uninit_dynamic(int plant, float* out);
void vector_load(const char* in, int off, int size, int where, unsigned* out);
void divergent(int plant, int* out);
void chain(int blocks, int* out);
bool mma(const uint16_t* a, const uint16_t* w, int plant, float* d);
bool ldmatrix(const uint16_t* in, int plant, uint32_t* out);
void round_bf16_values(const float* x, int n, float* y);
}  // namespace moelab::emu::controls

namespace {
namespace ctl = moelab::emu::controls;

void rule_controls(pybind11::module& m) {
  m.def("control_war", [](int64_t plant) {
    at::Tensor out = at::zeros({128}, at::kInt);
    ctl::war(int(plant), out.data_ptr<int32_t>());
    return out;
  });
  m.def("control_cp_async", [](int64_t plant) {
    at::Tensor in = at::arange(8 * 128, at::kFloat), out = at::zeros({128}, at::kFloat);
    ctl::cp_async(int(plant), in.data_ptr<float>(), out.data_ptr<float>());
    return out;
  });
  m.def("control_warp_order", [](int64_t plant) {
    at::Tensor out = at::zeros({gpu::warp_size()}, at::kInt);
    ctl::warp_order(int(plant), out.data_ptr<int32_t>());
    return out;
  });
  m.def("control_uninit", [](bool dynamic, int64_t plant) {
    at::Tensor out = at::zeros({2, 128}, at::kFloat);
    if (dynamic) ctl::uninit_dynamic(int(plant), out.data_ptr<float>());
    else ctl::uninit_static(int(plant), out.data_ptr<float>());
    return out;
  });
  m.def("control_vector_load", [](int64_t off, int64_t size, bool shared) {
    at::Tensor in = at::arange(32, at::kInt);   // 128 bytes, 64-byte aligned by torch's allocator
    at::Tensor out = at::zeros({1}, at::kInt);
    ctl::vector_load(static_cast<const char*>(in.data_ptr()), int(off), int(size), shared ? 1 : 0,
                     reinterpret_cast<unsigned*>(out.data_ptr<int32_t>()));
    return out.item<int>();
  });
  m.def("control_divergent", [](int64_t plant) {
    at::Tensor out = at::zeros({2 * gpu::warp_size()}, at::kInt);
    ctl::divergent(int(plant), out.data_ptr<int32_t>());
    return out;
  });
  m.def("control_chain", [](int64_t blocks) {
    at::Tensor out = at::zeros({blocks}, at::kInt);
    ctl::chain(int(blocks), out.data_ptr<int32_t>());
    return out;
  });
  m.def("control_mma", [](const at::Tensor& a, const at::Tensor& w, int64_t plant) -> py::object {
    const at::Tensor ac = a.contiguous(), wc = w.contiguous();
    at::Tensor d = at::full({16, 8}, std::numeric_limits<double>::quiet_NaN(), at::kFloat);
    if (!ctl::mma(reinterpret_cast<const uint16_t*>(ac.data_ptr()), reinterpret_cast<const uint16_t*>(wc.data_ptr()),
                  int(plant), d.data_ptr<float>()))
      return py::none();
    return py::cast(d);
  });
  m.def("control_ldmatrix", [](const at::Tensor& rows, int64_t plant) -> py::object {
    const at::Tensor rc = rows.contiguous();   // 32 x 8 16-bit elements
    TORCH_CHECK(rc.numel() == 256 && rc.element_size() == 2, "control_ldmatrix: 32 x 8 16-bit elements");
    at::Tensor out = at::zeros({32, 4}, at::kInt);
    if (!ctl::ldmatrix(reinterpret_cast<const uint16_t*>(rc.data_ptr()), int(plant),
                       reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>())))
      return py::none();
    return py::cast(out);
  });
  m.def("round_bf16", [](const at::Tensor& x) {
    const at::Tensor xc = x.contiguous().to(at::kFloat);
    at::Tensor y = at::empty_like(xc);
    ctl::round_bf16_values(xc.data_ptr<float>(), int(xc.numel()), y.data_ptr<float>());
    return y;
  });
  m.def("set_grid_cap", &moelab::emu::set_grid_cap);
  m.def("grid_cap_hits", &moelab::emu::grid_cap_hits);
  m.def("launch_log", []() { return moelab::emu::launch_log(); });
  m.def("clear_launch_log", &moelab::emu::clear_launch_log);
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("warp_size", &gpu::warp_size);
  m.def("route", &route, py::arg("logits"), py::arg("K"), py::arg("method"), py::arg("bias"), py::arg("n_group"),
        py::arg("topk_group"), py::arg("scaling"), py::arg("renormalize"), py::arg("norm_eps"),
        py::arg("selection") = 0);
  m.def("route_plan", &route_plan);
  m.def("permute", &permute);
  m.def("workspace_words", &gpu::permute_workspace_words);
  m.def("unpermute", &unpermute);
  m.def("router_gemm", &router_gemm);
  m.def("skinny_gemm", &skinny_gemm);
  m.def("fused_experts", &fused_experts, py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("tw"), py::arg("ids"),
        py::arg("quant"), py::arg("s13"), py::arg("s2"), py::arg("b13"), py::arg("b2"), py::arg("act"),
        py::arg("alpha"), py::arg("limit"), py::arg("policy"), py::arg("m_cross"), py::arg("E"), py::arg("I"),
        py::arg("ws_bytes"), py::arg("weighted_input") = false);
  m.def("fused_experts_workspace_bytes", &gpu::fused_experts_workspace_bytes);
  m.attr("has_wave64") = bool(MOELAB_HIP);
  m.attr("has_mma") = bool(MOELAB_HAS_MMA_BF16);
  m.attr("rules") = bool(MOELAB_EMU_RULES);
  rule_controls(m);
#if MOELAB_SANITIZE
  moelab_emu_sanitizer_controls(m);   // the negative controls, sanitized build only
#endif
}
