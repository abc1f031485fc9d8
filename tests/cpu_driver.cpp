// Torch-free driver of the CPU kernels (optimized/csrc/cpu): runs one kernel on raw binary
// inputs and writes its raw outputs, so a build for another architecture (aarch64, under
// qemu-aarch64-static) can be checked against the x86 build of the same kernels. Built and
// run by tests/cross_cpu.py; the checks are in tests/test_aarch64.py.
//
//   cpu_driver <case dir>
//
// The case directory holds case.txt ("key value" lines; `op` names the kernel) and the
// inputs as <name>.bin; the driver writes <name>.out beside them and prints the ISA level it
// ran at. The level is the run-time choice (cpuid / hwcaps), capped by MOELAB_ISA as in the
// extension. A build may contain only the portable level (the x86 reference build:
// MOELAB_DRIVER_PORTABLE), which the driver then calls directly.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "../optimized/csrc/cpu/fused_experts.h"
#include "../optimized/csrc/cpu/permute.h"
#include "../optimized/csrc/cpu/read_stream.h"
#include "../optimized/csrc/cpu/route.h"
#include "../optimized/csrc/cpu/router_gemm.h"
#include "../optimized/csrc/cpu/skinny_gemm.h"

#ifdef MOELAB_DRIVER_PORTABLE
#define PICK(name) (&::moelab::cpu::scalar::name)
#define LEVEL_NAME() "scalar"
#else
#define PICK(name) MOELAB_PICK(name)
#define LEVEL_NAME() ::moelab::cpu::isa_name(::moelab::cpu::active_isa())
#endif

namespace {

using namespace moelab;
using namespace moelab::cpu;

struct Case {
  std::string dir;
  std::map<std::string, std::string> kv;
  std::string s(const char* k) const {
    auto it = kv.find(k);
    if (it == kv.end()) throw std::runtime_error(std::string("case.txt lacks ") + k);
    return it->second;
  }
  int64_t i(const char* k) const { return std::strtoll(s(k).c_str(), nullptr, 10); }
  float f(const char* k) const { return std::strtof(s(k).c_str(), nullptr); }
  bool has(const char* k) const { return kv.count(k) != 0; }
  std::vector<uint8_t> in(const char* name) const {
    std::vector<uint8_t> b;
    FILE* fp = std::fopen((dir + "/" + name + ".bin").c_str(), "rb");
    if (!fp) throw std::runtime_error(std::string("missing input ") + name);
    uint8_t buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), fp)) > 0) b.insert(b.end(), buf, buf + n);
    std::fclose(fp);
    return b;
  }
  void out(const char* name, const void* p, size_t n) const {
    FILE* fp = std::fopen((dir + "/" + name + ".out").c_str(), "wb");
    if (!fp || std::fwrite(p, 1, n, fp) != n) throw std::runtime_error(std::string("cannot write ") + name);
    std::fclose(fp);
  }
};

template <class T> const T* as(const std::vector<uint8_t>& b) { return reinterpret_cast<const T*>(b.data()); }

Fmt fmt_of(int64_t v) { return v == 0 ? Fmt::kF32 : v == 1 ? Fmt::kBF16 : Fmt::kF16; }

void run_route(const Case& c) {
  const int64_t T = c.i("T");
  RouteParams p{};
  const auto logits = c.in("logits");
  std::vector<uint8_t> bias;
  p.logits = logits.data();
  p.fmt = fmt_of(c.i("fmt"));
  p.ld = c.i("E");
  if (c.i("has_bias")) {
    bias = c.in("bias");
    p.bias = bias.data();
    p.bias_fmt = fmt_of(c.i("bias_fmt"));
  } else {
    p.bias = nullptr;
    p.bias_fmt = Fmt::kF32;
  }
  p.method = int(c.i("method"));
  p.E = int(c.i("E"));
  p.K = int(c.i("K"));
  p.n_group = int(c.i("n_group"));
  p.topk_group = int(c.i("topk_group"));
  p.scaling = c.f("scaling");
  p.renormalize = c.i("renormalize") != 0;
  p.norm_eps = c.f("norm_eps");
  std::vector<float> w(size_t(T * p.K), -1.0f);
  std::vector<int32_t> ids(size_t(T * p.K), -7);
  p.weights = w.data();
  p.ids = ids.data();
  // Two ranges, as two threads would take them: the result must not depend on the split.
  PICK(route_tokens)(p, 0, T / 2);
  PICK(route_tokens)(p, T / 2, T);
  c.out("weights", w.data(), w.size() * 4);
  c.out("ids", ids.data(), ids.size() * 4);
}

void run_permute(const Case& c) {
  const int64_t T = c.i("T"), K = c.i("K"), ne = c.i("n_experts"), nl = c.i("n_local"), align = c.i("align");
  const int64_t rb = c.i("row_bytes"), cap = T * K + nl * (align - 1);
  const auto ids = c.in("ids"), hidden = c.in("hidden");
  std::vector<uint8_t> map;
  if (c.i("has_map")) map = c.in("map");
  std::vector<int64_t> counts(static_cast<size_t>(nl)), offsets(size_t(nl + 1), -5);
  std::vector<int32_t> src(size_t(cap), -5), dst(size_t(T * K), -5);
  int64_t bad = 0;
  const int rc = PICK(permute_plan)(ids.data(), false, T, K, K, 1, map.empty() ? nullptr : as<int32_t>(map), 1, ne, nl,
                                    align, counts.data(), offsets.data(), src.data(), cap, dst.data(), &bad);
  std::vector<uint8_t> rows(size_t(cap * rb), 0xAB);
  if (rc == kPermuteOk) {
    PICK(permute_rows)(hidden.data(), rb, rows.data(), rb, src.data(), K, 0, cap / 2);
    PICK(permute_rows)(hidden.data(), rb, rows.data(), rb, src.data(), K, cap / 2, cap);
  }
  const int64_t st[2] = {rc, bad};
  c.out("status", st, sizeof(st));
  c.out("offsets", offsets.data(), offsets.size() * 8);
  c.out("src_row", src.data(), src.size() * 4);
  c.out("dst_pos", dst.data(), dst.size() * 4);
  c.out("rows", rows.data(), rows.size());
}

void run_unpermute(const Case& c) {
  const int64_t T = c.i("T"), K = c.i("K"), H = c.i("H");
  const Fmt fmt = fmt_of(c.i("fmt"));
  const auto eo = c.in("expert_out"), w = c.in("w"), pos = c.in("dst_pos");
  std::vector<uint8_t> out(size_t(T * H * fmt_size(fmt)), 0xCD);
  PICK(unpermute_tokens)(eo.data(), fmt, H, as<float>(w), K, 1, as<int32_t>(pos), K, H, out.data(), 0, T);
  c.out("out", out.data(), out.size());
}

void run_router_gemm(const Case& c) {
  const int64_t T = c.i("T"), H = c.i("H"), E = c.i("E");
  const auto x = c.in("x"), w = c.in("w");
  std::vector<float> out(size_t(T * E), -1.0f);
  PICK(router_gemm_experts)(x.data(), fmt_of(c.i("fmt")), H, as<float>(w), out.data(), T, H, E, 0, E);
  c.out("out", out.data(), out.size() * 4);
}

void run_skinny_gemm(const Case& c) {
  const int64_t T = c.i("T"), K = c.i("K"), N = c.i("N");
  const Fmt fmt = fmt_of(c.i("fmt"));
  const auto x = c.in("x"), w = c.in("w");
  std::vector<uint8_t> bias;
  if (c.i("has_bias")) bias = c.in("bias");
  std::vector<uint8_t> out(size_t(T * N * fmt_size(fmt)), 0xCD);
  PICK(skinny_gemm_rows)(x.data(), K, w.data(), K, bias.empty() ? nullptr : bias.data(), out.data(), N, fmt, T, K, 0,
                         N / 3);
  PICK(skinny_gemm_rows)(x.data(), K, w.data(), K, bias.empty() ? nullptr : bias.data(), out.data(), N, fmt, T, K,
                         N / 3, N);
  c.out("out", out.data(), out.size());
}

// One GEMM pass of fused_experts over every (expert, 64-column tile) of E experts whose rows
// (a, grouped by expert: offsets) are given; standard layout, or packed here as the pack
// cache packs it (fused_experts_pack.h).
void run_fe_gemm(const Case& c) {
  const int q = int(c.i("quant"));
  const int64_t E = c.i("E"), N = c.i("N"), K = c.i("K"), lda = c.i("lda");
  const bool packed = c.i("packed") != 0, out_bf16 = c.i("out_bf16") != 0;
  const auto a = c.in("a"), w = c.in("w"), off = c.in("offsets");
  std::vector<uint8_t> scale;
  if (q != fe::kBF16) scale = c.in("scale");
  const int64_t* offsets = as<int64_t>(off);
  const int64_t rows = offsets[E];
  const int64_t ntiles = fe::cdiv(N, fe::kTileN), N16 = fe::n16(N), gb = fe::group_bytes(q, K);
  const int64_t sgb = fe::mx_scale_group_bytes(K), rb = fe::row_bytes(q, K);
  const int64_t nbn = fe::cdiv(N, fe::kFp8Block), nbk = fe::cdiv(K, fe::kFp8Block);
  std::vector<uint8_t> pw, ps, slow;
  FeGemm g{};
  g.quant = q;
  g.packed = packed;
  g.w = w.data();
  g.scale = q == fe::kBF16 ? nullptr : scale.data();
  g.slow = nullptr;
  if (packed) {
    pw.assign(size_t(E * N16 * gb), 0);
    if (q == fe::kMXFP4) ps.assign(size_t(E * N16 * sgb), 0);
    slow.assign(size_t(E * ntiles), 0);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t g0 = t * fe::kTileGroups, ng = std::min<int64_t>(fe::kTileGroups, N16 - g0);
        uint8_t* dt = pw.data() + e * N16 * gb + g0 * gb;
        fe::pack_groups(q, w.data() + e * N * rb, N, K, g0, ng, dt);
        uint8_t* dsc = nullptr;
        if (q == fe::kMXFP4) {
          dsc = ps.data() + e * N16 * sgb + g0 * sgb;
          fe::pack_mx_scales(scale.data() + e * N * (K / fe::kMxBlock), N, K, g0, ng, dsc);
        }
        const float* es = q == fe::kFP8 ? as<float>(scale) + e * nbn * nbk : nullptr;
        slow[size_t(e * ntiles + t)] = fe::tile_needs_slow(q, dt, ng, K, t, es, dsc) ? 1 : 0;
      }
    g.w = pw.data();
    if (q == fe::kMXFP4) g.scale = ps.data();
    g.slow = slow.data();
  }
  g.N = N;
  g.K = K;
  g.a = as<uint16_t>(a);
  g.lda = lda;
  g.bias = nullptr;
  g.bias_bf16 = 0;
  g.out_bf16 = out_bf16;
  g.init = nullptr;
  std::vector<uint8_t> out(size_t(rows * N * (out_bf16 ? 2 : 4)), 0xCD);
  g.out = out.data();
  g.ldo = N;
  g.offsets = offsets;
  std::vector<int32_t> items;
  for (int64_t e = 0; e < E; ++e)
    if (offsets[e + 1] > offsets[e])
      for (int64_t t = 0; t < ntiles; ++t) items.insert(items.end(), {int32_t(e), int32_t(t)});
  g.items = items.data();
  g.policy = int(c.i("policy"));
  g.m_cross = c.i("m_cross");
  g.mx_scaled = false;
  g.stream_ahead = false;
  const int64_t n_items = int64_t(items.size() / 2);
  std::vector<uint8_t> scratch(size_t(fe::scratch_bytes(q, K)) + 64);
  uint8_t* sp = scratch.data() + (64 - reinterpret_cast<uintptr_t>(scratch.data()) % 64) % 64;
  // Two calls over halves of the items, as two threads would run them.
  PICK(fused_experts_gemm)(g, 0, n_items / 2, n_items / 2, sp);
  PICK(fused_experts_gemm)(g, n_items / 2, n_items, n_items, sp);
  c.out("out", out.data(), out.size());
}

void run_fe_act(const Case& c) {
  const int64_t P = c.i("P"), I = c.i("I"), lda = c.i("lda");
  const auto h = c.in("h");
  std::vector<uint16_t> a(size_t(P * lda), 0xCDCD);
  PICK(fused_experts_act)(as<uint16_t>(h), 2 * I, a.data(), lda, I, int(c.i("act")), c.f("alpha"), c.f("limit"), 0, P);
  c.out("a", a.data(), a.size() * 2);
}

void run_fe_to_bf16(const Case& c) {
  const auto src = c.in("src");
  const int64_t n = int64_t(src.size() / 4);
  std::vector<uint16_t> dst(size_t(n + 1), 0xCDCD);
  PICK(fused_experts_to_bf16)(as<float>(src), dst.data(), n);
  c.out("dst", dst.data(), dst.size() * 2);
}

void run_fe_gather(const Case& c) {
  const int64_t T = c.i("T"), K = c.i("K"), H = c.i("H"), ldg = c.i("ldg"), P = T * K;
  const auto x = c.in("x"), w = c.in("w");
  std::vector<int32_t> src(static_cast<size_t>(P));
  for (int64_t p = 0; p < P; ++p) src[size_t(p)] = int32_t((p * 7) % P);   // a permutation (7 coprime with P)
  std::vector<uint16_t> xg(size_t(P * ldg), 0xCDCD);
  PICK(fused_experts_gather_weighted)(as<uint16_t>(x), H, as<float>(w), K, 1, src.data(), K, H, xg.data(), ldg, 0, P);
  c.out("xg", xg.data(), xg.size() * 2);
}

void run_read_stream(const Case& c) {
  const auto b = c.in("bytes");
  const uint64_t s = PICK(read_stream_bytes)(b.data(), int64_t(b.size()), int(c.i("streams")), c.i("prefetch"));
  c.out("sum", &s, 8);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <case dir>\n", argv[0]);
    return 2;
  }
  try {
    Case c;
    c.dir = argv[1];
    FILE* fp = std::fopen((c.dir + "/case.txt").c_str(), "r");
    if (!fp) throw std::runtime_error("no case.txt");
    char k[64], v[64];
    while (std::fscanf(fp, "%63s %63s", k, v) == 2) c.kv[k] = v;
    std::fclose(fp);
    const std::string op = c.s("op");
    if (op == "route") run_route(c);
    else if (op == "permute") run_permute(c);
    else if (op == "unpermute") run_unpermute(c);
    else if (op == "router_gemm") run_router_gemm(c);
    else if (op == "skinny_gemm") run_skinny_gemm(c);
    else if (op == "fe_gemm") run_fe_gemm(c);
    else if (op == "fe_act") run_fe_act(c);
    else if (op == "fe_to_bf16") run_fe_to_bf16(c);
    else if (op == "fe_gather") run_fe_gather(c);
    else if (op == "read_stream") run_read_stream(c);
    else throw std::runtime_error("unknown op " + op);
    std::printf("level %s\n", LEVEL_NAME());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpu_driver: %s\n", e.what());
    return 1;
  }
  return 0;
}
