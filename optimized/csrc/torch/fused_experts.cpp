// Binding of moelab::fused_experts and moelab::prepack_moe_weight (CPU).
//
// fused_experts runs the pipeline of docs/fused_experts.md: group rows (permute_plan), gather
// x rows (permute_rows; with apply_router_weight_on_input, fused_experts_gather_weighted:
// bf16(x[t] * bf16(w[t, j])) per row), GEMM1 items, activation rows, GEMM2 items, combine
// (unpermute_tokens in f32, weighted, or unweighted with the flag; then one bf16 rounding).
// Every pass is an at::parallel_for over independent outputs, so the result does not depend
// on the thread count. Everything a kernel relies on is re-checked here, so a direct
// torch.ops.moelab call with hostile arguments raises RuntimeError instead of reading or
// writing out of bounds. (apply_router_weight_on_input is a schema bool: a value the dispatcher
// cannot read as one is refused there, naming the op and the argument.)
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "../cpu/fused_experts.h"
#include "../cpu/permute.h"
#include "common.h"

namespace moelab {
namespace {

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

// Work items (expert, tile) of one pass, in one band of tiles per thread: band b holds, for
// every routed expert in turn, the tiles [b*nt/B, (b+1)*nt/B). Thread b runs its band (every
// thread gets its share of every expert's tiles, so a hot expert is split across threads and
// the cost stays balanced under any routing skew) expert by expert, so an expert's rows stay
// in L2 across its tiles and the next item's weights (prefetched) are the next tile of the
// same expert. A thread that finishes its band early takes the rest of another band's items
// from its far end (run_gemm): the bands are equal in work, not in time on a shared machine.
// The order never changes a result: every output element belongs to exactly one item.
struct Work {
  std::vector<int32_t> items;   // [n][2] = (expert, tile)
  std::vector<int64_t> band;    // band b: items [band[b], band[b+1])
};

Work make_items(const std::vector<int64_t>& offsets, int64_t E, int64_t N) {
  Work w;
  const int64_t nt = fe::n_tiles(N), B = std::max<int64_t>(1, at::get_num_threads());
  w.band.push_back(0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t e = 0; e < E; ++e)
      if (offsets[e + 1] > offsets[e])
        for (int64_t t = b * nt / B; t < (b + 1) * nt / B; ++t) {
          w.items.push_back(int32_t(e));
          w.items.push_back(int32_t(t));
        }
    w.band.push_back(int64_t(w.items.size() / 2));
  }
  return w;
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
// Slot 1, each GEMM thread's scratch (fe::scratch_bytes: 0.5 MB at K = 2048). It was a zeroed
// vector per thread and pass: at decode, that memset of ~1.5 MB per call wrote through the
// cache the weight stream was using (docs/fused_experts.md, "Call overhead").
constexpr int64_t kCachedScratch = int64_t(16) << 20;

int64_t up64(int64_t n) { return (n + 63) / 64 * 64; }

// The items left in a band, [front, back), in one word, so that the owner taking from the
// front and a thief taking from the back agree with one compare-exchange.
struct alignas(64) BandLeft {
  std::atomic<uint64_t> v;
  static uint64_t pack(int64_t front, int64_t back) { return uint64_t(front) | uint64_t(back) << 32; }
  // Takes up to n items from the front (own) or the back (thief); false when none are left.
  bool take(int64_t n, bool own, int64_t& i0, int64_t& i1) {
    uint64_t cur = v.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = int64_t(cur & 0xffffffffu), b = int64_t(cur >> 32);
      if (f >= b) return false;
      i0 = own ? f : std::max(f, b - n);
      i1 = own ? std::min(b, f + n) : b;
      const uint64_t next = own ? pack(i1, b) : pack(f, i0);
      if (v.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return true;
    }
  }
};

// One GEMM pass over w's items. Thread t runs band t from its front, a few items at a time;
// then it takes items from the back of the bands still running, one or two at a time, so the
// two ends meet and no thread waits for a slower one by more than ~an item. Which thread runs
// an item never changes its result (the kernel is the same and every item's outputs are its
// own), so this keeps batch invariance and bit-for-bit determinism.
constexpr int64_t kOwnChunk = 4, kStealChunk = 2;

void run_gemm(const cpu::FeGemm& g, const Work& w) {
  auto* fn = MOELAB_PICK(fused_experts_gemm);
  const int64_t bytes = fe::scratch_bytes(g.quant, g.K);
  const int64_t B = int64_t(w.band.size()) - 1;
  std::unique_ptr<BandLeft[]> left(new BandLeft[size_t(B)]);
  for (int64_t b = 0; b < B; ++b) left[b].v.store(BandLeft::pack(w.band[b], w.band[b + 1]));
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    at::Tensor owned;
    uint8_t* s = thread_buffer<1>(bytes, kCachedScratch, owned);
    int64_t i0, i1;
    for (int64_t b = b0; b < b1; ++b)
      while (left[b].take(kOwnChunk, true, i0, i1)) fn(g, i0, i1, w.band[b + 1], s);
    for (int64_t k = 0; k < B; ++k) {
      const int64_t b = (b1 + k) % B;
      while (left[b].take(kStealChunk, false, i0, i1)) fn(g, i0, i1, i1, s);
    }
  });
}

// FeGemm::mx_scaled for g over rows [0, P) of g.a: mxfp4, some item blocked, no init, K <=
// 2^20, and every input element in fused_experts_mx_range's range (the proof is at
// fused_experts_kernel.h's micro_tee). A pure function of the inputs; it never changes a
// result's bits, only whether the blocked path rescales its accumulators.
bool mx_scaled_ok(const cpu::FeGemm& g, int64_t P, int64_t E) {
  if (g.quant != fe::kMXFP4 || g.init || g.K > (int64_t(1) << 20)) return false;
  bool blocked = g.policy == cpu::kFeAllBlocked;
  for (int64_t e = 0; e < E && !blocked; ++e)
    blocked = g.policy == cpu::kFePerBlock && g.offsets[e + 1] - g.offsets[e] >= g.m_cross;
  if (!blocked) return false;
  auto* fn = MOELAB_PICK(fused_experts_mx_range);
  std::atomic<bool> ok{true};
  at::parallel_for(0, P, 64, [&](int64_t p0, int64_t p1) {
    if (ok.load(std::memory_order_relaxed) && !fn(g.a, g.lda, g.K, p0, p1)) ok.store(false, std::memory_order_relaxed);
  });
  return ok.load();
}

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

  // 1. Group rows by expert: the permute op's stable counting sort (validates the ids).
  const int64_t R = T * K;
  std::vector<int64_t> counts(static_cast<size_t>(E)), offsets(static_cast<size_t>(E + 1));
  std::vector<int32_t> src_row(static_cast<size_t>(R)), dst_pos(static_cast<size_t>(R));
  int64_t bad = 0;
  const int rc = MOELAB_PICK(permute_plan)(topk_ids.data_ptr(), false, T, K, topk_ids.stride(0),
                                           topk_ids.stride(1), nullptr, 0, E, E, 1, counts.data(),
                                           offsets.data(), src_row.data(), R, dst_pos.data(), &bad);
  MOELAB_CHECK(rc != cpu::kPermuteBadId, kOp, "topk_ids", "holds ", bad, ", outside the valid range [-1, ", E, ")");
  TORCH_CHECK(rc == cpu::kPermuteOk, "moelab::fused_experts: internal error in the row grouping (", rc, ")");
  const int64_t P = offsets[size_t(E)];
  if (P == 0) return rows ? rows_out() : at::zeros({T, H}, x.options());   // every slot dropped

  // Intermediates: xg [P, Hp] bf16, h [P, 2I] bf16, a [P, Ip] bf16, y [P, H] f32, out32 [T, H] f32.
  const int64_t Hp = fe::k2(H) * 2, Ip = fe::k2(I) * 2;
  const int64_t b_xg = up64(P * Hp * 2), b_h = up64(P * N1 * 2), b_a = up64(P * Ip * 2), b_y = up64(P * N2 * 4);
  at::Tensor owned;
  uint8_t* ws = thread_buffer<0>(b_xg + b_h + b_a + b_y + T * H * 4, kCachedWorkspace, owned);
  uint16_t* xg = reinterpret_cast<uint16_t*>(ws);
  uint16_t* hb = reinterpret_cast<uint16_t*>(ws + b_xg);
  uint16_t* ab = reinterpret_cast<uint16_t*>(ws + b_xg + b_h);
  float* yb = reinterpret_cast<float*>(ws + b_xg + b_h + b_a);
  float* ob = reinterpret_cast<float*>(ws + b_xg + b_h + b_a + b_y);

  // 2. Gather x rows, padded to an even width (the k pairs). With apply_router_weight_on_input
  // the gather applies the router weight: row p (slot t*K + j) = bf16(x[t] * bf16(w[t, j])).
  if (apply_router_weight_on_input) {
    auto* fn = MOELAB_PICK(fused_experts_gather_weighted);
    const uint16_t* xp = static_cast<const uint16_t*>(x.data_ptr());
    const float* wp = topk_weights.data_ptr<float>();
    const int64_t ldx = x.stride(0), ldw_t = topk_weights.stride(0), ldw_k = topk_weights.stride(1);
    at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
      fn(xp, ldx, wp, ldw_t, ldw_k, src_row.data(), K, H, xg, Hp, p0, p1);
    });
  } else {
    const char* xp = static_cast<const char*>(x.data_ptr());
    char* gp = reinterpret_cast<char*>(xg);
    const int64_t ldx = x.stride(0) * 2;
    if (Hp == H) {
      auto* rows = MOELAB_PICK(permute_rows);
      at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
        rows(xp, ldx, gp, H * 2, src_row.data(), K, p0, p1);
      });
    } else {
      for (int64_t p = 0; p < P; ++p) {
        std::memcpy(gp + p * Hp * 2, xp + (src_row[p] / K) * ldx, size_t(H) * 2);
        std::memset(gp + p * Hp * 2 + H * 2, 0, 2);
      }
    }
  }

  auto bias_of = [](const c10::optional<at::Tensor>& b) -> const void* {
    return b.has_value() ? b->data_ptr() : nullptr;
  };
  auto bias_bf16 = [](const c10::optional<at::Tensor>& b) {
    return int(b.has_value() && b->scalar_type() == at::kBFloat16);
  };

  // 3. GEMM1: h = bf16(x @ W13.T + b13).
  cpu::FeGemm g1{};
  g1.quant = q;
  g1.packed = packed;
  g1.w = static_cast<const uint8_t*>(w13.data_ptr());
  g1.scale = w13_scale.has_value() ? w13_scale->data_ptr() : nullptr;
  g1.slow = packed ? w13_slow->data_ptr<uint8_t>() : nullptr;
  g1.N = N1;
  g1.K = K1;
  g1.a = xg;
  g1.lda = Hp;
  g1.bias = bias_of(w13_bias);
  g1.bias_bf16 = bias_bf16(w13_bias);
  g1.out_bf16 = true;
  g1.out = hb;
  g1.ldo = N1;
  g1.offsets = offsets.data();
  g1.policy = int(policy);
  g1.m_cross = m_cross;
  g1.stream_ahead = at::get_num_threads() > 1;
  const Work work1 = make_items(offsets, E, N1);
  g1.items = work1.items.data();
  g1.mx_scaled = mx_scaled_ok(g1, P, E);
  run_gemm(g1, work1);

  // 4. Activation: a = bf16(act(h)).
  {
    auto* fn = MOELAB_PICK(fused_experts_act);
    const uint16_t* hp = hb;
    uint16_t* ap = ab;
    const float al = float(alpha), li = float(limit);
    at::parallel_for(0, P, std::max<int64_t>(1, 16384 / I), [&](int64_t p0, int64_t p1) {
      fn(hp, N1, ap, Ip, I, act, al, li, p0, p1);
    });
  }

  // 5. GEMM2: y = a @ W2.T + b2 (f32).
  cpu::FeGemm g2 = g1;
  g2.w = static_cast<const uint8_t*>(w2.data_ptr());
  g2.scale = w2_scale.has_value() ? w2_scale->data_ptr() : nullptr;
  g2.slow = packed ? w2_slow->data_ptr<uint8_t>() : nullptr;
  g2.N = N2;
  g2.K = K2;
  g2.a = ab;
  g2.lda = Ip;
  g2.bias = bias_of(w2_bias);
  g2.bias_bf16 = bias_bf16(w2_bias);
  g2.out_bf16 = false;
  g2.out = yb;
  g2.ldo = N2;
  if (rows && y_init.has_value()) {
    // The accumulators start from y_init (grouped like y; the kernel reads each element of
    // its rows before it writes it, so y is its own init buffer).
    const float* ip = y_init->data_ptr<float>();
    at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) std::memcpy(yb + p * N2, ip + int64_t(src_row[p]) * H, size_t(H) * 4);
    });
    g2.init = yb;
  }
  const Work work2 = make_items(offsets, E, N2);
  g2.items = work2.items.data();
  g2.mx_scaled = mx_scaled_ok(g2, P, E);
  run_gemm(g2, work2);
  if (rows) {   // y back to slot order; dropped slots stay 0
    at::Tensor out = rows_out();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) std::memcpy(op + int64_t(src_row[p]) * H, yb + p * N2, size_t(H) * 4);
    });
    return out;
  }

  // 6. Combine in f32, j ascending (the permute op's unpermute), then one bf16 rounding. With
  // apply_router_weight_on_input the sum is unweighted: every slot's weight reads the one 1.0f
  // (strides 0), and 1.0f * y == y exactly, so this is sum_j y_j in the same order.
  {
    auto* fn = MOELAB_PICK(unpermute_tokens);
    const float* yp = yb;
    static const float kOne = 1.0f;
    const float* wp = apply_router_weight_on_input ? &kOne : topk_weights.data_ptr<float>();
    const int64_t ldw_t = apply_router_weight_on_input ? 0 : topk_weights.stride(0);
    const int64_t ldw_k = apply_router_weight_on_input ? 0 : topk_weights.stride(1);
    float* op = ob;
    // The one bf16 rounding in the same pass, by our own conversion (torch's .to() was a
    // TensorIterator copy: cold code at decode, and a second pass over the output).
    at::Tensor out = at::empty({T, H}, x.options());
    uint16_t* o16 = reinterpret_cast<uint16_t*>(out.data_ptr());
    auto* cvt = MOELAB_PICK(fused_experts_to_bf16);
    at::parallel_for(0, T, std::max<int64_t>(1, 8192 / (H * K)), [&](int64_t t0, int64_t t1) {
      fn(yp, Fmt::kF32, H, wp, ldw_t, ldw_k, dst_pos.data(), K, H, op, t0, t1);
      cvt(op + t0 * H, o16 + t0 * H, (t1 - t0) * H);
    });
    return out;
  }
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

// Packs the listed experts of one weight matrix w ([E][N][K] standard layout, contiguous) into
// preallocated buffers: pp [E][expert_bytes], slow flags [E][n_tiles], and the scales (fp8: the
// expert's [ceil(N/128)][ceil(K/128)] f32 copied into fp8_dst; mxfp4: packed into mx_dst).
// Parallel over (listed expert, tile); every byte written belongs to one listed expert, so the
// other experts' bytes are never touched (the pack cache relies on it: a thread may be reading
// them). Both prepack_moe_weight (every expert) and pack_moe_experts (the routed ones) use it,
// so the two give the same bytes and flags.
//
// Before the first write, each listed expert's packed bytes are advised as transparent huge
// pages (madvise MADV_HUGEPAGE over the 2 MiB pages that overlap the expert, within the E
// experts' buffer; where THP is "always" this changes nothing, where it is "never" it is
// ignored). A decode call streams ~5-13 MB per expert: with 4 KiB pages that is a TLB miss
// (and a page the hardware prefetcher stops at) every 64 lines. Measured on the Zen 5 EPYC
// against the same bytes in 4 KiB pages, rotating cold copies, T = 1, 4, 16, 1 and 2 threads:
// 1.22-1.43x for Qwen3 fp8 and 1.15-1.30x for GPT-OSS mxfp4 decode
// (experiments/micro/huge_pages.py, experiments/results/amd-epyc-2c-avx512_bf16/huge_pages.txt). A 2 MiB page shared with an expert
// not packed yet becomes resident with it (at most 2 MiB per side of a packed expert).
void advise_huge_pages(uint8_t* base, int64_t total, int64_t begin, int64_t end) {
#ifdef __linux__
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t lo = (uintptr_t(base) + kHuge - 1) & ~(kHuge - 1), hi = (uintptr_t(base) + total) & ~(kHuge - 1);
  uintptr_t a = (uintptr_t(base) + begin) & ~(kHuge - 1), b = (uintptr_t(base) + end + kHuge - 1) & ~(kHuge - 1);
  a = a < lo ? lo : a;
  b = b > hi ? hi : b;
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);   // advice: a failure changes nothing
#else
  (void)base, (void)total, (void)begin, (void)end;
#endif
}

void pack_experts_into(int q, const at::Tensor& w, const c10::optional<at::Tensor>& scale, int64_t N,
                       int64_t K, const std::vector<int64_t>& experts, uint8_t* pp, float* fp8_dst,
                       uint8_t* mx_dst, uint8_t* sp) {
  const int64_t n = int64_t(experts.size());
  if (n == 0) return;
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const int64_t N16 = fe::n16(N), gb = fe::group_bytes(q, K), sgb = fe::mx_scale_group_bytes(K);
  const int64_t eb = N16 * gb;
  for (int64_t e : experts) advise_huge_pages(pp, w.size(0) * eb, e * eb, (e + 1) * eb);
  const int64_t nt = fe::n_tiles(N), rb = fe::row_bytes(q, K);
  const int64_t nbn = fe::cdiv(N, fe::kFp8Block), nbk = fe::cdiv(K, fe::kFp8Block);
  if (q == fe::kFP8) {
    const float* src = scale->data_ptr<float>();
    for (int64_t e : experts) std::memcpy(fp8_dst + e * nbn * nbk, src + e * nbn * nbk, size_t(nbn * nbk) * 4);
  }
  at::parallel_for(0, n * nt, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = experts[size_t(i / nt)], t = i % nt;
      const int64_t g0 = t * fe::kTileGroups, ng = std::min(fe::kTileGroups, N16 - g0);
      uint8_t* tw = pp + e * N16 * gb + g0 * gb;
      fe::pack_groups(q, wp + e * N * rb, N, K, g0, ng, tw);
      const float* fs = q == fe::kFP8 ? fp8_dst + e * nbn * nbk : nullptr;
      uint8_t* ms = nullptr;
      if (q == fe::kMXFP4) {
        ms = mx_dst + e * N16 * sgb + g0 * sgb;
        fe::pack_mx_scales(scale->data_ptr<uint8_t>() + e * N * (K / fe::kMxBlock), N, K, g0, ng, ms);
      }
      sp[e * nt + t] = fe::tile_needs_slow(q, tw, ng, K, t, fs, ms) ? 1 : 0;
    }
  });
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
