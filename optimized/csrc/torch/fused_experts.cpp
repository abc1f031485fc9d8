// Binding of moelab::fused_experts, fused_experts_rows, prepack_moe_weight and
// pack_moe_experts (CPU): argument checks, allocation, the thread pool, the call.
//
// The algorithm is torch-free: the pipeline, the work items, how threads share them and the
// packing (with its huge-page advice) are in csrc/cpu/fused_experts_schedule.h, the per-ISA
// kernels they call in csrc/cpu/fused_experts_kernel.h. This file re-checks everything a
// kernel relies on, so a direct torch.ops.moelab call with hostile arguments raises
// RuntimeError instead of reading or writing out of bounds (apply_router_weight_on_input is a
// schema bool: a value the dispatcher cannot read as one is refused there, naming the op and
// the argument); it allocates the outputs and the per-thread buffers, and runs the schedule's
// parallel passes through at::parallel_for (AtenPool).
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "../cpu/fused_experts.h"
#include "../cpu/fused_experts_schedule.h"
#include "common.h"

namespace moelab {
namespace {

namespace fe_schedule = cpu::fe_schedule;

constexpr const char* kOp = "fused_experts";
constexpr const char* kDefaultOp = kOp;   // the checks below also serve fused_experts_rows
constexpr const char* kPackOp = "prepack_moe_weight";

int quant_code(c10::string_view q, const char* op) {
  if (q == "bf16") return fe::kBF16;
  if (q == "fp8_block") return fe::kFP8;
  MOELAB_CHECK(q == "mxfp4", op, "quant", "must be one of bf16, fp8_block, mxfp4; got '", std::string(q), "'");
  return fe::kMXFP4;
}

at::ScalarType weight_dtype(int q) {
  return q == fe::kBF16 ? at::kBFloat16 : q == fe::kFP8 ? at::kFloat8_e4m3fn : at::kByte;
}

void check_shape(const at::Tensor& t, const char* op, const char* arg, at::IntArrayRef want) {
  MOELAB_CHECK(t.sizes() == want, op, arg, "must have shape ", want, ", got ", t.sizes());
}

// The scales of one weight matrix [E][N][K] (standard layout, or packed for mxfp4).
void check_scale(const c10::optional<at::Tensor>& s, int q, bool packed, int64_t E, int64_t N,
                 int64_t K, const char* arg, const char* kOp = kDefaultOp) {
  if (q == fe::kBF16) {
    MOELAB_CHECK(!s.has_value(), kOp, arg, "must be None for quant 'bf16'");
    return;
  }
  MOELAB_CHECK(s.has_value(), kOp, arg, "is required for quant ", q == fe::kFP8 ? "'fp8_block'" : "'mxfp4'");
  if (q == fe::kFP8) {
    check_cpu(*s, kOp, arg, 3, {at::kFloat});
    check_shape(*s, kOp, arg, {E, fe::cdiv(N, fe::kFp8Block), fe::cdiv(K, fe::kFp8Block)});
  } else if (packed) {
    check_cpu(*s, kOp, arg, 2, {at::kByte});
    check_shape(*s, kOp, arg, {E, fe::n16(N) * fe::mx_scale_group_bytes(K)});
  } else {
    check_cpu(*s, kOp, arg, 3, {at::kByte});
    check_shape(*s, kOp, arg, {E, N, K / fe::kMxBlock});
  }
}

void check_weight(const at::Tensor& w, int q, bool packed, int64_t E, int64_t N, int64_t K, const char* arg,
                  const char* kOp = kDefaultOp) {
  if (packed) {
    check_cpu(w, kOp, arg, 2, {at::kByte});
    check_shape(w, kOp, arg, {E, fe::expert_bytes(q, N, K)});
  } else {
    check_cpu(w, kOp, arg, 3, {weight_dtype(q)});
    check_shape(w, kOp, arg, {E, N, q == fe::kMXFP4 ? K / 2 : K});
  }
}

void check_slow(const c10::optional<at::Tensor>& s, bool packed, int64_t E, int64_t N, const char* arg,
                const char* kOp = kDefaultOp) {
  if (!packed) {
    MOELAB_CHECK(!s.has_value(), kOp, arg, "must be None for standard-layout weights");
    return;
  }
  MOELAB_CHECK(s.has_value(), kOp, arg, "is required for prepacked weights");
  check_cpu(*s, kOp, arg, 2, {at::kByte});
  check_shape(*s, kOp, arg, {E, fe::n_tiles(N)});
}

void check_bias(const c10::optional<at::Tensor>& b, int64_t E, int64_t N, const char* arg, const char* kOp = kDefaultOp) {
  if (!b.has_value()) return;
  check_cpu(*b, kOp, arg, 2, {at::kFloat, at::kBFloat16});
  check_shape(*b, kOp, arg, {E, N});
}

// A 64-byte-aligned buffer of `bytes` for the calling thread, its contents undefined (every
// user writes before it reads). Up to `cached` bytes it is a per-thread cache kept between
// calls, one per Slot: fresh pages cost one page fault each, and glibc hands large blocks
// back to the system on every free. Above, `owned` holds a buffer for this call only.
template <int Slot>
uint8_t* thread_buffer(int64_t bytes, int64_t cached, at::Tensor& owned) {
  uint8_t* p;
  if (bytes + 64 > cached) {
    owned = at::empty({bytes + 64}, at::TensorOptions().dtype(at::kByte));
    p = owned.data_ptr<uint8_t>();
  } else {
    thread_local std::unique_ptr<uint8_t[]> cache;
    thread_local int64_t cache_bytes = 0;
    if (cache_bytes < bytes + 64) {
      cache.reset();
      cache.reset(new uint8_t[size_t(bytes + 64)]);
      cache_bytes = bytes + 64;
    }
    p = cache.get();
  }
  return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
}

// Slot 0, the calling thread's workspace: the per-call intermediates (gathered x, h, a, y, the
// f32 combine) in one buffer; cached up to the largest call so far below kCachedWorkspace
// (Qwen3-30B-A3B prefill T=512: ~75 MB; decode: kilobytes); a fresh page costs ~10% of a
// large prefill.
constexpr int64_t kCachedWorkspace = int64_t(256) << 20;
// Slot 1, each GEMM thread's scratch (fe::scratch_bytes: 0.5 MB at K = 2048), kept and never
// zeroed: at decode, clearing ~1.5 MB per call would write through the cache the weight
// stream uses (docs/fused_experts.md, "Call overhead").
constexpr int64_t kCachedScratch = int64_t(16) << 20;

// The Pool of fe_schedule (fused_experts_schedule.h): torch's thread pool, and each GEMM
// thread's scratch from its slot-1 cache.
struct AtenPool {
  int64_t threads() const { return at::get_num_threads(); }
  template <class F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) const {
    at::parallel_for(begin, end, grain, f);
  }
  template <class F>
  void parallel_for_scratch(int64_t begin, int64_t end, int64_t bytes, const F& f) const {
    at::parallel_for(begin, end, 1, [&](int64_t b0, int64_t b1) {
      at::Tensor owned;
      f(b0, b1, thread_buffer<1>(bytes, kCachedScratch, owned));
    });
  }
};

// rows = false: fused_experts (the combined [T, H] bf16). rows = true: fused_experts_rows, the
// per-slot expert outputs y [T*K, H] f32 before the combine (row r = t*K + j; 0 for a dropped
// slot), GEMM2's accumulators starting from y_init's row r when given (op kRowsOp's contract).
at::Tensor fused_experts_impl(const char* kOp, bool rows, const c10::optional<at::Tensor>& y_init,
                              const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                              const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                              c10::string_view quant, bool packed, int64_t E, int64_t I,
                              const c10::optional<at::Tensor>& w13_scale,
                              const c10::optional<at::Tensor>& w2_scale,
                              const c10::optional<at::Tensor>& w13_slow,
                              const c10::optional<at::Tensor>& w2_slow,
                              const c10::optional<at::Tensor>& w13_bias,
                              const c10::optional<at::Tensor>& w2_bias, c10::string_view activation,
                              double alpha, double limit, int64_t policy, int64_t m_cross,
                              bool apply_router_weight_on_input) {
  check_cpu(x, kOp, "x", 2, {at::kBFloat16}, /*contiguous=*/false);
  const int64_t T = x.size(0), H = x.size(1);
  MOELAB_CHECK(T == 0 || x.stride(1) == 1, kOp, "x", "must have unit stride along H");
  MOELAB_CHECK(H >= 1, kOp, "x", "must have H >= 1 columns");
  const int q = quant_code(quant, kOp);
  MOELAB_CHECK(E >= 1 && E <= (int64_t(1) << 20), kOp, "E", "must be in [1, 2^20], got ", E);
  MOELAB_CHECK(H <= (int64_t(1) << 24), kOp, "x", "must have H <= 2^24 columns, got H = ", H);
  MOELAB_CHECK(I >= 1 && I <= (int64_t(1) << 24), kOp, "I", "must be in [1, 2^24], got I = ", I);
  if (q == fe::kMXFP4) {
    MOELAB_CHECK(H % fe::kMxBlock == 0, kOp, "x", "must have H a multiple of 32 for mxfp4, got H = ", H);
    MOELAB_CHECK(I % fe::kMxBlock == 0, kOp, "I", "must be a multiple of 32 for mxfp4, got I = ", I);
  }
  const int64_t N1 = 2 * I, K1 = H, N2 = H, K2 = I;
  check_weight(w13, q, packed, E, N1, K1, "w13", kOp);
  check_weight(w2, q, packed, E, N2, K2, "w2", kOp);
  check_scale(w13_scale, q, packed, E, N1, K1, "w13_scale", kOp);
  check_scale(w2_scale, q, packed, E, N2, K2, "w2_scale", kOp);
  check_slow(w13_slow, packed, E, N1, "w13_slow", kOp);
  check_slow(w2_slow, packed, E, N2, "w2_slow", kOp);
  check_bias(w13_bias, E, N1, "w13_bias", kOp);
  check_bias(w2_bias, E, N2, "w2_bias", kOp);
  check_cpu(topk_ids, kOp, "topk_ids", 2, {at::kInt}, /*contiguous=*/false);
  check_cpu(topk_weights, kOp, "topk_weights", 2, {at::kFloat}, /*contiguous=*/false);
  const int64_t K = topk_ids.size(1);
  MOELAB_CHECK(topk_ids.size(0) == T && K >= 1, kOp, "topk_ids", "must have shape (", T, ", K >= 1), got ",
               topk_ids.sizes());
  MOELAB_CHECK(topk_weights.sizes() == topk_ids.sizes(), kOp, "topk_weights", "must have shape ",
               topk_ids.sizes(), ", got ", topk_weights.sizes());
  MOELAB_CHECK(T * K < (int64_t(1) << 31), kOp, "topk_ids", "has T*K = ", T * K, " rows, more than 2^31 - 1");
  int act = 0;
  if (activation == "swiglu_oai") act = 1;
  else MOELAB_CHECK(activation == "silu", kOp, "activation", "must be silu or swiglu_oai, got '",
                    std::string(activation), "'");
  check_finite(alpha, kOp, "alpha");
  check_finite(limit, kOp, "limit");
  MOELAB_CHECK(policy >= cpu::kFeAllTiny && policy <= cpu::kFePerBlock, kOp, "policy",
               "must be 0 (tiny), 1 (blocked) or 2 (per block), got ", policy);

  if (rows && y_init.has_value()) {
    check_cpu(*y_init, kOp, "y_init", 2, {at::kFloat});
    check_shape(*y_init, kOp, "y_init", {T * K, H});
  }
  const auto rows_out = [&] { return at::zeros({T * K, H}, x.options().dtype(at::kFloat)); };
  if (T == 0) return rows ? rows_out() : at::zeros({T, H}, x.options());

  // Group rows by expert (the permute op's counting sort, which validates the ids), then run
  // the pipeline (fe_schedule::run) on the thread pool.
  fe_schedule::Call c{};
  c.x = static_cast<const uint16_t*>(x.data_ptr());
  c.ldx = x.stride(0);
  c.T = T;
  c.H = H;
  c.topk_weights = topk_weights.data_ptr<float>();
  c.ldw_t = topk_weights.stride(0);
  c.ldw_k = topk_weights.stride(1);
  c.topk_ids = topk_ids.data_ptr<int32_t>();
  c.ldi_t = topk_ids.stride(0);
  c.ldi_k = topk_ids.stride(1);
  c.K = K;
  c.E = E;
  c.I = I;
  c.quant = q;
  c.packed = packed;
  c.w13 = static_cast<const uint8_t*>(w13.data_ptr());
  c.w2 = static_cast<const uint8_t*>(w2.data_ptr());
  c.w13_scale = w13_scale.has_value() ? w13_scale->data_ptr() : nullptr;
  c.w2_scale = w2_scale.has_value() ? w2_scale->data_ptr() : nullptr;
  c.w13_slow = packed ? w13_slow->data_ptr<uint8_t>() : nullptr;
  c.w2_slow = packed ? w2_slow->data_ptr<uint8_t>() : nullptr;
  auto bias_of = [](const c10::optional<at::Tensor>& b) -> const void* {
    return b.has_value() ? b->data_ptr() : nullptr;
  };
  auto bias_bf16 = [](const c10::optional<at::Tensor>& b) {
    return int(b.has_value() && b->scalar_type() == at::kBFloat16);
  };
  c.w13_bias = bias_of(w13_bias);
  c.w13_bias_bf16 = bias_bf16(w13_bias);
  c.w2_bias = bias_of(w2_bias);
  c.w2_bias_bf16 = bias_bf16(w2_bias);
  c.act = act;
  c.alpha = float(alpha);
  c.limit = float(limit);
  c.policy = int(policy);
  c.m_cross = m_cross;
  c.weight_on_input = apply_router_weight_on_input;
  c.y_init = rows && y_init.has_value() ? y_init->data_ptr<float>() : nullptr;

  fe_schedule::Plan plan;
  int64_t bad = 0;
  const int rc = fe_schedule::plan_rows(c, plan, &bad);
  MOELAB_CHECK(rc != cpu::kPermuteBadId, kOp, "topk_ids", "holds ", bad, ", outside the valid range [-1, ", E, ")");
  TORCH_CHECK(rc == cpu::kPermuteOk, "moelab::fused_experts: internal error in the row grouping (", rc, ")");
  if (plan.P == 0) return rows ? rows_out() : at::zeros({T, H}, x.options());   // every slot dropped

  at::Tensor owned;
  uint8_t* ws = thread_buffer<0>(fe_schedule::workspace_bytes(c, plan.P), kCachedWorkspace, owned);
  at::Tensor out = rows ? rows_out() : at::empty({T, H}, x.options());
  AtenPool pool;
  fe_schedule::run(c, plan, ws, out.data_ptr(), rows, pool);
  return out;
}

at::Tensor fused_experts_cpu(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                             const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                             c10::string_view quant, bool packed, int64_t E, int64_t I,
                             const c10::optional<at::Tensor>& w13_scale,
                             const c10::optional<at::Tensor>& w2_scale,
                             const c10::optional<at::Tensor>& w13_slow,
                             const c10::optional<at::Tensor>& w2_slow,
                             const c10::optional<at::Tensor>& w13_bias,
                             const c10::optional<at::Tensor>& w2_bias, c10::string_view activation,
                             double alpha, double limit, int64_t policy, int64_t m_cross,
                             bool apply_router_weight_on_input) {
  return fused_experts_impl(kOp, false, c10::nullopt, x, w13, w2, topk_weights, topk_ids, quant, packed, E, I,
                            w13_scale, w2_scale, w13_slow, w2_slow, w13_bias, w2_bias, activation, alpha,
                            limit, policy, m_cross, apply_router_weight_on_input);
}

// fused_experts_rows: the same pipeline without the combine (docs/parallel.md): y [T*K, H] f32,
// row r = t*K + j = slot j's expert output (unweighted; + w2_bias), 0 for a dropped slot. With
// y_init [T*K, H] f32, GEMM2's f32 accumulators of slot r start from y_init[r] instead of +0:
// a pass over a contiguous slice of I (whole k pairs) continues exactly the dp sequence of the
// slices before it, so chaining the slices of a tensor-parallel split reproduces the
// single-process y bit for bit (the bias belongs to the last slice only).
at::Tensor fused_experts_rows_cpu(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                                  const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                                  c10::string_view quant, bool packed, int64_t E, int64_t I,
                                  const c10::optional<at::Tensor>& w13_scale,
                                  const c10::optional<at::Tensor>& w2_scale,
                                  const c10::optional<at::Tensor>& w13_slow,
                                  const c10::optional<at::Tensor>& w2_slow,
                                  const c10::optional<at::Tensor>& w13_bias,
                                  const c10::optional<at::Tensor>& w2_bias, c10::string_view activation,
                                  double alpha, double limit, int64_t policy, int64_t m_cross,
                                  bool apply_router_weight_on_input, const c10::optional<at::Tensor>& y_init) {
  return fused_experts_impl("fused_experts_rows", true, y_init, x, w13, w2, topk_weights, topk_ids, quant, packed,
                            E, I, w13_scale, w2_scale, w13_slow, w2_slow, w13_bias, w2_bias, activation, alpha,
                            limit, policy, m_cross, apply_router_weight_on_input);
}

// Packs the listed experts of one standard-layout weight matrix w into the prepacked buffers
// (fe_schedule::pack_experts: the layout, the scales, the slow flags and the huge-page advice).
void pack_experts_into(int q, const at::Tensor& w, const c10::optional<at::Tensor>& scale, int64_t N,
                       int64_t K, const std::vector<int64_t>& experts, uint8_t* pp, float* fp8_dst,
                       uint8_t* mx_dst, uint8_t* sp) {
  AtenPool pool;
  fe_schedule::pack_experts(q, static_cast<const uint8_t*>(w.data_ptr()),
                            q == fe::kFP8 ? scale->data_ptr<float>() : nullptr,
                            q == fe::kMXFP4 ? scale->data_ptr<uint8_t>() : nullptr, w.size(0), N, K, experts, pp,
                            fp8_dst, mx_dst, sp, pool);
}

// Checks a standard-layout weight w [E][N][K(/2)] and its scale for `op`; returns K.
int64_t check_std_weight(const at::Tensor& w, const c10::optional<at::Tensor>& scale, int q, const char* op,
                         const char* warg, const char* sarg) {
  check_cpu(w, op, warg, 3, {weight_dtype(q)});
  const int64_t E = w.size(0), N = w.size(1), K = q == fe::kMXFP4 ? 2 * w.size(2) : w.size(2);
  MOELAB_CHECK(E >= 1 && N >= 1 && K >= 1, op, warg, "must have nonzero sizes, got ", w.sizes());
  if (q == fe::kMXFP4) MOELAB_CHECK(K % fe::kMxBlock == 0, op, warg, "mxfp4 needs K a multiple of 32, got ", K);
  if (q == fe::kBF16) {
    MOELAB_CHECK(!scale.has_value(), op, sarg, "must be None for quant 'bf16'");
  } else {
    MOELAB_CHECK(scale.has_value(), op, sarg, "is required for quant '", q == fe::kFP8 ? "fp8_block" : "mxfp4", "'");
    if (q == fe::kFP8) {
      check_cpu(*scale, op, sarg, 3, {at::kFloat});
      check_shape(*scale, op, sarg, {E, fe::cdiv(N, fe::kFp8Block), fe::cdiv(K, fe::kFp8Block)});
    } else {
      check_cpu(*scale, op, sarg, 3, {at::kByte});
      check_shape(*scale, op, sarg, {E, N, K / fe::kMxBlock});
    }
  }
  return K;
}

// Packs one weight matrix of fused_experts ([E][N][K] standard layout) into the blocked
// VNNI layout; returns (packed [E][bytes], scales (fp8: a contiguous copy; mxfp4: packed;
// bf16: empty), slow flags [E][n_tiles]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> prepack_cpu(const at::Tensor& w,
                                                           const c10::optional<at::Tensor>& scale,
                                                           c10::string_view quant) {
  const int q = quant_code(quant, kPackOp);
  const int64_t K = check_std_weight(w, scale, q, kPackOp, "w", "scale");
  const int64_t E = w.size(0), N = w.size(1);
  at::Tensor s;
  if (q == fe::kBF16) s = at::empty({0}, w.options().dtype(at::kFloat));
  else if (q == fe::kFP8) s = at::empty(scale->sizes(), scale->options());
  else s = at::empty({E, fe::n16(N) * fe::mx_scale_group_bytes(K)}, w.options().dtype(at::kByte));
  at::Tensor packed = at::empty({E, fe::expert_bytes(q, N, K)}, w.options().dtype(at::kByte));
  at::Tensor slow = at::empty({E, fe::n_tiles(N)}, w.options().dtype(at::kByte));
  std::vector<int64_t> all(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) all[size_t(e)] = e;
  pack_experts_into(q, w, scale, N, K, all, packed.data_ptr<uint8_t>(),
                    q == fe::kFP8 ? s.data_ptr<float>() : nullptr,
                    q == fe::kMXFP4 ? s.data_ptr<uint8_t>() : nullptr, slow.data_ptr<uint8_t>());
  return {packed, s, slow};
}

// The buffers of one matrix in the prepacked layout, as prepack_moe_weight returns them.
void check_packed_buffers(int q, int64_t E, int64_t N, int64_t K, const at::Tensor& p,
                          const c10::optional<at::Tensor>& s, const at::Tensor& f, const char* op,
                          const char* parg, const char* sarg, const char* farg) {
  check_cpu(p, op, parg, 2, {at::kByte});
  check_shape(p, op, parg, {E, fe::expert_bytes(q, N, K)});
  check_cpu(f, op, farg, 2, {at::kByte});
  check_shape(f, op, farg, {E, fe::n_tiles(N)});
  if (q == fe::kBF16) {
    MOELAB_CHECK(!s.has_value(), op, sarg, "must be None for quant 'bf16'");
    return;
  }
  MOELAB_CHECK(s.has_value(), op, sarg, "is required for quant '", q == fe::kFP8 ? "fp8_block" : "mxfp4", "'");
  if (q == fe::kFP8) {
    check_cpu(*s, op, sarg, 3, {at::kFloat});
    check_shape(*s, op, sarg, {E, fe::cdiv(N, fe::kFp8Block), fe::cdiv(K, fe::kFp8Block)});
  } else {
    check_cpu(*s, op, sarg, 2, {at::kByte});
    check_shape(*s, op, sarg, {E, fe::n16(N) * fe::mx_scale_group_bytes(K)});
  }
}

// The pack cache's op (optimized/pack_cache.py): packs, into the preallocated prepacked-layout
// buffers of both matrices, every expert that topk_ids routes to and whose flag in done[E] is
// still 0, then sets those flags; returns how many experts it packed. The ids are scanned here
// (T*K reads, no host copy, no sort); -1 is skipped, anything else outside [0, E) raises before
// a byte is written. The caller serializes calls on one set of buffers (the entry's lock); a
// flag is set only after both matrices of its expert are written, so a reader that sees it set
// (under the same lock) never reads a half-written pack.
int64_t pack_experts_cpu(const at::Tensor& topk_ids, const at::Tensor& done, const at::Tensor& w13,
                         const c10::optional<at::Tensor>& w13_scale, const at::Tensor& w2,
                         const c10::optional<at::Tensor>& w2_scale, c10::string_view quant,
                         const at::Tensor& p13, const c10::optional<at::Tensor>& q13, const at::Tensor& f13,
                         const at::Tensor& p2, const c10::optional<at::Tensor>& q2, const at::Tensor& f2) {
  constexpr const char* op = "pack_moe_experts";
  const int q = quant_code(quant, op);
  const int64_t K1 = check_std_weight(w13, w13_scale, q, op, "w13", "w13_scale");
  const int64_t K2 = check_std_weight(w2, w2_scale, q, op, "w2", "w2_scale");
  const int64_t E = w13.size(0), N1 = w13.size(1), N2 = w2.size(1);
  MOELAB_CHECK(w2.size(0) == E && N2 == K1 && 2 * K2 == N1, op, "w2", "must have shape [E, H, I] matching w13 ",
               w13.sizes(), ", got ", w2.sizes());
  check_packed_buffers(q, E, N1, K1, p13, q13, f13, op, "p13", "q13", "f13");
  check_packed_buffers(q, E, N2, K2, p2, q2, f2, op, "p2", "q2", "f2");
  check_cpu(done, op, "done", 1, {at::kByte});
  check_shape(done, op, "done", {E});
  check_cpu(topk_ids, op, "topk_ids", 2, {at::kInt}, /*contiguous=*/false);
  uint8_t* dp = done.data_ptr<uint8_t>();
  const int32_t* ip = topk_ids.data_ptr<int32_t>();
  const int64_t T = topk_ids.size(0), K = topk_ids.size(1), s0 = topk_ids.stride(0), s1 = topk_ids.stride(1);
  std::vector<uint8_t> want(static_cast<size_t>(E), 0);
  std::vector<int64_t> todo;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = ip[t * s0 + j * s1];
      if (e == -1) continue;
      MOELAB_CHECK(e >= 0 && e < E, op, "topk_ids", "holds ", e, ", outside the valid range [-1, ", E, ")");
      if (!dp[e] && !want[size_t(e)]) {
        want[size_t(e)] = 1;
        todo.push_back(e);
      }
    }
  if (todo.empty()) return 0;
  auto fp8 = [&](const c10::optional<at::Tensor>& s) { return q == fe::kFP8 ? s->data_ptr<float>() : nullptr; };
  auto mx = [&](const c10::optional<at::Tensor>& s) { return q == fe::kMXFP4 ? s->data_ptr<uint8_t>() : nullptr; };
  pack_experts_into(q, w13, w13_scale, N1, K1, todo, p13.data_ptr<uint8_t>(), fp8(q13), mx(q13), f13.data_ptr<uint8_t>());
  pack_experts_into(q, w2, w2_scale, N2, K2, todo, p2.data_ptr<uint8_t>(), fp8(q2), mx(q2), f2.data_ptr<uint8_t>());
  for (int64_t e : todo) dp[e] = 1;
  return int64_t(todo.size());
}

// pack_moe_experts for tensors with the negative bit (torch._neg_view): like permute_out
// (csrc/torch/permute.cpp), torch's generic Negative fallback mishandles mutable arguments
// that are not returned, so a buffer with the bit is refused (the op writes raw bytes) and an
// input with it is materialized before the backend kernel runs.
int64_t pack_experts_negative(const at::Tensor& topk_ids, const at::Tensor& done, const at::Tensor& w13,
                              const c10::optional<at::Tensor>& w13_scale, const at::Tensor& w2,
                              const c10::optional<at::Tensor>& w2_scale, c10::string_view quant,
                              const at::Tensor& p13, const c10::optional<at::Tensor>& q13, const at::Tensor& f13,
                              const at::Tensor& p2, const c10::optional<at::Tensor>& q2, const at::Tensor& f2) {
  const std::pair<const at::Tensor*, const char*> outs[] = {
      {&done, "done"}, {&p13, "p13"}, {&f13, "f13"}, {&p2, "p2"}, {&f2, "f2"},
      {q13.has_value() ? &*q13 : nullptr, "q13"}, {q2.has_value() ? &*q2 : nullptr, "q2"}};
  for (const auto& [t, name] : outs)
    MOELAB_CHECK(t == nullptr || !t->is_neg(), "pack_moe_experts", name,
                 "must not be a negative view (torch._neg_view): the op writes its buffers as they are");
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("moelab::pack_moe_experts", "")
                       .typed<int64_t(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const c10::optional<at::Tensor>&, const at::Tensor&,
                                      const c10::optional<at::Tensor>&, c10::string_view, const at::Tensor&,
                                      const c10::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                                      const c10::optional<at::Tensor>&, const at::Tensor&)>();
  c10::impl::ExcludeDispatchKeyGuard no_neg(c10::DispatchKey::Negative);
  auto res = [](const c10::optional<at::Tensor>& t) -> c10::optional<at::Tensor> {
    return t.has_value() ? c10::optional<at::Tensor>(t->resolve_neg()) : c10::nullopt;
  };
  return op.call(topk_ids.resolve_neg(), done, w13.resolve_neg(), res(w13_scale), w2.resolve_neg(), res(w2_scale),
                 quant, p13, q13, f13, p2, q2, f2);
}

const int kRegistered = register_op_level(kOp, cpu::Isa::kAvx512Bf16);

}  // namespace
}  // namespace moelab

TORCH_LIBRARY_FRAGMENT(moelab, m) {
  m.def("fused_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
        "str quant, bool packed, int E, int I, Tensor? w13_scale, Tensor? w2_scale, Tensor? w13_slow, "
        "Tensor? w2_slow, Tensor? w13_bias, Tensor? w2_bias, str activation, float alpha, float limit, "
        "int policy, int m_cross, bool apply_router_weight_on_input=False) -> Tensor");
  m.def("fused_experts_rows(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
        "str quant, bool packed, int E, int I, Tensor? w13_scale, Tensor? w2_scale, Tensor? w13_slow, "
        "Tensor? w2_slow, Tensor? w13_bias, Tensor? w2_bias, str activation, float alpha, float limit, "
        "int policy, int m_cross, bool apply_router_weight_on_input=False, Tensor? y_init=None) -> Tensor");
  m.def("prepack_moe_weight(Tensor w, Tensor? scale, str quant) -> (Tensor, Tensor, Tensor)");
  m.def("pack_moe_experts(Tensor topk_ids, Tensor(a!) done, Tensor w13, Tensor? w13_scale, Tensor w2, "
        "Tensor? w2_scale, str quant, Tensor(b!) p13, Tensor(c!)? q13, Tensor(d!) f13, Tensor(e!) p2, "
        "Tensor(f!)? q2, Tensor(g!) f2) -> int");
}
TORCH_LIBRARY_IMPL(moelab, CPU, m) {
  m.impl("fused_experts", &moelab::fused_experts_cpu);
  m.impl("fused_experts_rows", &moelab::fused_experts_rows_cpu);
  m.impl("prepack_moe_weight", &moelab::prepack_cpu);
  m.impl("pack_moe_experts", &moelab::pack_experts_cpu);
}
TORCH_LIBRARY_IMPL(moelab, Negative, m) { m.impl("pack_moe_experts", &moelab::pack_experts_negative); }
