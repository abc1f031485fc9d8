// fused_experts' schedule: the pipeline of one call, the work items of a GEMM pass and how
// threads share them, and where the packed weights go in memory. Read it after
// fused_experts.h (what one GEMM pass is) and before fused_experts_kernel.h (how an item runs).
//
// Why a header of its own, and why not *_kernel.h: everything here is the same at every ISA
// level (it moves almost no data; it calls the per-level kernels of fused_experts.h and
// permute.h through MOELAB_PICK), so it is compiled once, into the binding, instead of once
// per level as _build.py compiles every *_kernel.h. It is torch-free like the kernels: the
// binding (csrc/torch/fused_experts.cpp) checks the tensors, allocates the outputs and the
// workspace, and hands in a Pool, its threading primitive (at::parallel_for). A Pool has:
//   int64_t threads();                                  // threads a parallel run may use
//   parallel_for(begin, end, grain, f);                  // f(b0, b1) over disjoint [b0, b1)
//                                                        // covering [begin, end), >= grain each
//   parallel_for_scratch(begin, end, bytes, f);          // the same with grain 1, and
//                                                        // f(b0, b1, scratch): the calling
//                                                        // thread's 64-byte aligned buffer of
//                                                        // `bytes`, contents undefined
// Nothing here depends on how many threads the Pool runs or which one runs a range: every
// pass writes each output element from exactly one item, so results are bit-identical for
// any thread count (docs/fused_experts.md, "Micro-kernels and the reduction order").
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "fused_experts.h"
#include "permute.h"

namespace moelab::cpu::fe_schedule {

// One call of fused_experts (or fused_experts_rows), as raw pointers the binding has checked.
struct Call {
  const uint16_t* x;            // [T][H] bf16, rows ldx elements apart, unit stride along H
  int64_t ldx, T, H;
  const float* topk_weights;    // w[t, j] at topk_weights + t*ldw_t + j*ldw_k
  int64_t ldw_t, ldw_k;
  const int32_t* topk_ids;      // id[t, j] at topk_ids + t*ldi_t + j*ldi_k; -1 drops the slot
  int64_t ldi_t, ldi_k;
  int64_t K;                    // slots per token (top-k)
  int64_t E, I;                 // experts, intermediate size
  int quant;                    // fe::Quant
  bool packed;                  // weights in the prepacked layout (fused_experts_pack.h)
  const uint8_t* w13;           // [E][2I][H] (or packed), GEMM1
  const uint8_t* w2;            // [E][H][I] (or packed), GEMM2
  const void* w13_scale;        // as FeGemm::scale; null for bf16
  const void* w2_scale;
  const uint8_t* w13_slow;      // packed only: FeGemm::slow
  const uint8_t* w2_slow;
  const void* w13_bias;         // [E][2I] or null
  int w13_bias_bf16;            // 0 f32, 1 bf16
  const void* w2_bias;          // [E][H] or null
  int w2_bias_bf16;
  int act;                      // 0 silu, 1 swiglu_oai
  float alpha, limit;           // swiglu_oai's parameters
  int policy;                   // FePolicy
  int64_t m_cross;
  bool weight_on_input;         // apply_router_weight_on_input (SPEC 6)
  const float* y_init;          // rows mode only, or null: [T*K][H] f32, GEMM2's starting sums
};

// Rows grouped by expert: the permute op's stable counting sort over the ids.
struct Plan {
  std::vector<int64_t> counts, offsets;   // offsets[E+1]: expert e's rows [offsets[e], offsets[e+1])
  std::vector<int32_t> src_row;           // [T*K]: grouped row p comes from slot src_row[p]
  std::vector<int32_t> dst_pos;           // [T*K]: slot r went to grouped row dst_pos[r], or -1
  int64_t P = 0;                          // rows routed (slots not dropped)
};

// Fills `plan`; returns permute_plan's status (kPermuteBadId with *bad = the id when an id
// is outside [-1, E)). Serial: it is a pass over T*K ints.
inline int plan_rows(const Call& c, Plan& plan, int64_t* bad) {
  const int64_t R = c.T * c.K;
  plan.counts.assign(size_t(c.E), 0);
  plan.offsets.assign(size_t(c.E + 1), 0);
  plan.src_row.assign(size_t(R), 0);
  plan.dst_pos.assign(size_t(R), 0);
  const int rc = MOELAB_PICK(permute_plan)(c.topk_ids, false, c.T, c.K, c.ldi_t, c.ldi_k, nullptr, 0, c.E, c.E, 1,
                                           plan.counts.data(), plan.offsets.data(), plan.src_row.data(), R,
                                           plan.dst_pos.data(), bad);
  plan.P = plan.offsets[size_t(c.E)];
  return rc;
}

inline int64_t up64(int64_t n) { return (n + 63) / 64 * 64; }

// The call's intermediates, carved out of one workspace of workspace_bytes(c, P):
// xg [P][Hp] bf16 (gathered x, padded to whole k pairs), h [P][2I] bf16, a [P][Ip] bf16,
// y [P][H] f32, and the combine's f32 sums [T][H]; each starts on a 64-byte boundary.
struct Workspace {
  int64_t Hp, Ip;
  uint16_t* xg;
  uint16_t* h;
  uint16_t* a;
  float* y;
  float* sum;
};

inline Workspace carve(const Call& c, int64_t P, uint8_t* ws, int64_t* bytes) {
  Workspace w{};
  w.Hp = fe::k2(c.H) * 2;
  w.Ip = fe::k2(c.I) * 2;
  const int64_t b_xg = up64(P * w.Hp * 2), b_h = up64(P * 2 * c.I * 2), b_a = up64(P * w.Ip * 2);
  const int64_t b_y = up64(P * c.H * 4);
  *bytes = b_xg + b_h + b_a + b_y + c.T * c.H * 4;
  if (ws != nullptr) {
    w.xg = reinterpret_cast<uint16_t*>(ws);
    w.h = reinterpret_cast<uint16_t*>(ws + b_xg);
    w.a = reinterpret_cast<uint16_t*>(ws + b_xg + b_h);
    w.y = reinterpret_cast<float*>(ws + b_xg + b_h + b_a);
    w.sum = reinterpret_cast<float*>(ws + b_xg + b_h + b_a + b_y);
  }
  return w;
}

inline int64_t workspace_bytes(const Call& c, int64_t P) {
  int64_t bytes = 0;
  carve(c, P, nullptr, &bytes);
  return bytes;
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

inline Work make_items(const std::vector<int64_t>& offsets, int64_t E, int64_t N, int64_t threads) {
  Work w;
  const int64_t nt = fe::n_tiles(N), B = std::max<int64_t>(1, threads);
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
// own), so this keeps batch invariance and bit-for-bit determinism. The owner's chunk of 4
// lets an item prefetch the next one's weights (the kernel's i_next); a thief takes 2 so
// that the ends meet within an item or two.
constexpr int64_t kOwnChunk = 4, kStealChunk = 2;

template <class Pool>
void run_gemm(const FeGemm& g, const Work& w, Pool& pool) {
  auto* fn = MOELAB_PICK(fused_experts_gemm);
  const int64_t bytes = fe::scratch_bytes(g.quant, g.K);
  const int64_t B = int64_t(w.band.size()) - 1;
  std::unique_ptr<BandLeft[]> left(new BandLeft[size_t(B)]);
  for (int64_t b = 0; b < B; ++b) left[b].v.store(BandLeft::pack(w.band[b], w.band[b + 1]));
  pool.parallel_for_scratch(0, B, bytes, [&](int64_t b0, int64_t b1, uint8_t* s) {
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
template <class Pool>
bool mx_scaled_ok(const FeGemm& g, int64_t P, int64_t E, Pool& pool) {
  if (g.quant != fe::kMXFP4 || g.init || g.K > (int64_t(1) << 20)) return false;
  bool blocked = g.policy == kFeAllBlocked;
  for (int64_t e = 0; e < E && !blocked; ++e)
    blocked = g.policy == kFePerBlock && g.offsets[e + 1] - g.offsets[e] >= g.m_cross;
  if (!blocked) return false;
  auto* fn = MOELAB_PICK(fused_experts_mx_range);
  std::atomic<bool> ok{true};
  pool.parallel_for(0, P, 64, [&](int64_t p0, int64_t p1) {
    if (ok.load(std::memory_order_relaxed) && !fn(g.a, g.lda, g.K, p0, p1)) ok.store(false, std::memory_order_relaxed);
  });
  return ok.load();
}

// The pipeline of docs/fused_experts.md after the row grouping: gather x rows, GEMM1 items,
// activation rows, GEMM2 items, combine. plan.P > 0; ws: workspace_bytes(c, plan.P) bytes,
// 64-byte aligned, contents undefined. rows = false: out is the combined [T][H] bf16 (every
// element written). rows = true (fused_experts_rows): out is y [T*K][H] f32, zeroed by the
// caller: row r = t*K + j gets slot r's expert output, a dropped slot's row stays 0.
template <class Pool>
void run(const Call& c, const Plan& plan, uint8_t* ws, void* out, bool rows, Pool& pool) {
  const int64_t T = c.T, H = c.H, K = c.K, E = c.E, I = c.I, P = plan.P;
  const int64_t N1 = 2 * I, K1 = H, N2 = H, K2 = I;
  const int32_t* src_row = plan.src_row.data();
  int64_t unused;
  const Workspace w = carve(c, P, ws, &unused);
  const int64_t Hp = w.Hp, Ip = w.Ip;

  // 1. Gather x rows, padded to an even width (the k pairs). With weight_on_input the gather
  // applies the router weight: row p (slot t*K + j) = bf16(x[t] * bf16(w[t, j])).
  if (c.weight_on_input) {
    auto* fn = MOELAB_PICK(fused_experts_gather_weighted);
    pool.parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
      fn(c.x, c.ldx, c.topk_weights, c.ldw_t, c.ldw_k, src_row, K, H, w.xg, Hp, p0, p1);
    });
  } else {
    const char* xp = reinterpret_cast<const char*>(c.x);
    char* gp = reinterpret_cast<char*>(w.xg);
    const int64_t ldx = c.ldx * 2;
    if (Hp == H) {
      auto* fn = MOELAB_PICK(permute_rows);
      pool.parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) { fn(xp, ldx, gp, H * 2, src_row, K, p0, p1); });
    } else {
      for (int64_t p = 0; p < P; ++p) {
        std::memcpy(gp + p * Hp * 2, xp + (src_row[p] / K) * ldx, size_t(H) * 2);
        std::memset(gp + p * Hp * 2 + H * 2, 0, 2);
      }
    }
  }

  // 2. GEMM1: h = bf16(x @ W13.T + b13).
  FeGemm g1{};
  g1.quant = c.quant;
  g1.packed = c.packed;
  g1.w = c.w13;
  g1.scale = c.w13_scale;
  g1.slow = c.packed ? c.w13_slow : nullptr;
  g1.N = N1;
  g1.K = K1;
  g1.a = w.xg;
  g1.lda = Hp;
  g1.bias = c.w13_bias;
  g1.bias_bf16 = c.w13_bias_bf16;
  g1.out_bf16 = true;
  g1.out = w.h;
  g1.ldo = N1;
  g1.offsets = plan.offsets.data();
  g1.policy = c.policy;
  g1.m_cross = c.m_cross;
  g1.stream_ahead = pool.threads() > 1;
  const Work work1 = make_items(plan.offsets, E, N1, pool.threads());
  g1.items = work1.items.data();
  g1.mx_scaled = mx_scaled_ok(g1, P, E, pool);
  run_gemm(g1, work1, pool);

  // 3. Activation: a = bf16(act(h)), rows in chunks of ~16K elements.
  {
    auto* fn = MOELAB_PICK(fused_experts_act);
    pool.parallel_for(0, P, std::max<int64_t>(1, 16384 / I), [&](int64_t p0, int64_t p1) {
      fn(w.h, N1, w.a, Ip, I, c.act, c.alpha, c.limit, p0, p1);
    });
  }

  // 4. GEMM2: y = a @ W2.T + b2 (f32).
  FeGemm g2 = g1;
  g2.w = c.w2;
  g2.scale = c.w2_scale;
  g2.slow = c.packed ? c.w2_slow : nullptr;
  g2.N = N2;
  g2.K = K2;
  g2.a = w.a;
  g2.lda = Ip;
  g2.bias = c.w2_bias;
  g2.bias_bf16 = c.w2_bias_bf16;
  g2.out_bf16 = false;
  g2.out = w.y;
  g2.ldo = N2;
  if (rows && c.y_init != nullptr) {
    // The accumulators start from y_init (grouped like y; the kernel reads each element of
    // its rows before it writes it, so y is its own init buffer).
    pool.parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) std::memcpy(w.y + p * N2, c.y_init + int64_t(src_row[p]) * H, size_t(H) * 4);
    });
    g2.init = w.y;
  }
  const Work work2 = make_items(plan.offsets, E, N2, pool.threads());
  g2.items = work2.items.data();
  g2.mx_scaled = mx_scaled_ok(g2, P, E, pool);
  run_gemm(g2, work2, pool);
  if (rows) {   // y back to slot order; dropped slots stay 0
    float* op = static_cast<float*>(out);
    pool.parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) std::memcpy(op + int64_t(src_row[p]) * H, w.y + p * N2, size_t(H) * 4);
    });
    return;
  }

  // 5. Combine in f32, j ascending (the permute op's unpermute), then one bf16 rounding in
  // the same pass (one pass over the output, and no cold library code at decode). With
  // weight_on_input the sum is unweighted: every slot's weight reads the one 1.0f (strides
  // 0), and 1.0f * y == y exactly, so this is sum_j y_j in the same order.
  auto* fn = MOELAB_PICK(unpermute_tokens);
  auto* cvt = MOELAB_PICK(fused_experts_to_bf16);
  static const float kOne = 1.0f;
  const float* wp = c.weight_on_input ? &kOne : c.topk_weights;
  const int64_t ldw_t = c.weight_on_input ? 0 : c.ldw_t, ldw_k = c.weight_on_input ? 0 : c.ldw_k;
  const int32_t* dst_pos = plan.dst_pos.data();
  uint16_t* o16 = static_cast<uint16_t*>(out);
  pool.parallel_for(0, T, std::max<int64_t>(1, 8192 / (H * K)), [&](int64_t t0, int64_t t1) {
    fn(w.y, Fmt::kF32, H, wp, ldw_t, ldw_k, dst_pos, K, H, w.sum, t0, t1);
    cvt(w.sum + t0 * H, o16 + t0 * H, (t1 - t0) * H);
  });
}

// ------------------------------------------------------------------ packing and huge pages
// Before the first write, each packed expert's bytes are advised as transparent huge pages
// (madvise MADV_HUGEPAGE over the 2 MiB pages that overlap the expert, within the E experts'
// buffer [base, base + total)). A decode call streams ~5-13 MB per expert: with 4 KiB pages
// that is a TLB miss every 64 lines, and the hardware prefetcher stops at every page
// boundary; with 2 MiB pages the stream runs on (experiments/micro/huge_pages.py measures the
// difference). Where THP is "always" this changes nothing, where it is "never" the advice is
// ignored, and a failure changes nothing either. A 2 MiB page shared with an expert not
// packed yet becomes resident with it (at most 2 MiB per side of a packed expert).
inline void advise_huge_pages(uint8_t* base, int64_t total, int64_t begin, int64_t end) {
#ifdef __linux__
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t lo = (uintptr_t(base) + kHuge - 1) & ~(kHuge - 1), hi = (uintptr_t(base) + total) & ~(kHuge - 1);
  uintptr_t a = (uintptr_t(base) + begin) & ~(kHuge - 1), b = (uintptr_t(base) + end + kHuge - 1) & ~(kHuge - 1);
  a = a < lo ? lo : a;
  b = b > hi ? hi : b;
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);
#else
  (void)base, (void)total, (void)begin, (void)end;
#endif
}

// Packs the listed experts of one weight matrix w ([E][N][K] standard layout, contiguous,
// row_bytes(q, K) per row) into preallocated buffers: pp [E][expert_bytes], slow flags sp
// [E][n_tiles], and the scales (fp8: the expert's [ceil(N/128)][ceil(K/128)] f32 copied from
// fp8_src into fp8_dst; mxfp4: mx_src [E][N][K/32] packed into mx_dst). Parallel over (listed
// expert, tile); every byte written belongs to one listed expert, so the other experts' bytes
// are never touched (the pack cache relies on it: a thread may be reading them), and
// prepack_moe_weight (every expert) and pack_moe_experts (the routed ones) give the same
// bytes and flags.
template <class Pool>
void pack_experts(int q, const uint8_t* wp, const float* fp8_src, const uint8_t* mx_src, int64_t E, int64_t N,
                  int64_t K, const std::vector<int64_t>& experts, uint8_t* pp, float* fp8_dst, uint8_t* mx_dst,
                  uint8_t* sp, Pool& pool) {
  const int64_t n = int64_t(experts.size());
  if (n == 0) return;
  const int64_t N16 = fe::n16(N), gb = fe::group_bytes(q, K), sgb = fe::mx_scale_group_bytes(K);
  const int64_t eb = N16 * gb;
  for (int64_t e : experts) advise_huge_pages(pp, E * eb, e * eb, (e + 1) * eb);
  const int64_t nt = fe::n_tiles(N), rb = fe::row_bytes(q, K);
  const int64_t nbn = fe::cdiv(N, fe::kFp8Block), nbk = fe::cdiv(K, fe::kFp8Block);
  if (q == fe::kFP8)
    for (int64_t e : experts) std::memcpy(fp8_dst + e * nbn * nbk, fp8_src + e * nbn * nbk, size_t(nbn * nbk) * 4);
  pool.parallel_for(0, n * nt, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = experts[size_t(i / nt)], t = i % nt;
      const int64_t g0 = t * fe::kTileGroups, ng = std::min(fe::kTileGroups, N16 - g0);
      uint8_t* tw = pp + e * N16 * gb + g0 * gb;
      fe::pack_groups(q, wp + e * N * rb, N, K, g0, ng, tw);
      const float* fs = q == fe::kFP8 ? fp8_dst + e * nbn * nbk : nullptr;
      uint8_t* ms = nullptr;
      if (q == fe::kMXFP4) {
        ms = mx_dst + e * N16 * sgb + g0 * sgb;
        fe::pack_mx_scales(mx_src + e * N * (K / fe::kMxBlock), N, K, g0, ng, ms);
      }
      sp[e * nt + t] = fe::tile_needs_slow(q, tw, ng, K, t, fs, ms) ? 1 : 0;
    }
  });
}

}  // namespace moelab::cpu::fe_schedule
