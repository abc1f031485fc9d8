// router_gemm: logits[T,E] (f32) = upcast(x[T,H]) @ weight[E,H].T, f32 accumulation.
//
// The cast is fused into the load: bf16/f16 rows of x widen to f32 in registers, so no f32
// copy of x is ever written (seed 001's point). A thread owns a contiguous range of
// experts and streams each weight row from memory once for all T tokens: it walks 4 weight
// rows at a time and, for each block of up to 4 tokens, keeps 4x4 vector accumulators.
// Weight rows of the current block stay in L1/L2 across token blocks, x (T*H*2 bytes) stays
// in L2.
//
// Cost: bytes = E*H*4 (weight, once) + T*H*sizeof(x) + T*E*4; flops = 2*T*E*H. For decode
// (T <= 32) the weight read dominates: at H=3072, E=256 that is 3.1 MB, ~0.1 ms at 30 GB/s.
//
// Reduction order of out[t,e]: lanes of vector chunks along H in increasing h, then one
// horizontal sum. It depends on H and the ISA only, never on T or on the other tokens, so
// the kernel is batch invariant.
#include "isa_begin.h"

namespace moelab::cpu::MOELAB_ISA_NS {
namespace {


// NT tokens x up to 4 experts (ne of them valid) of the output.
template <Fmt F, int NT>
inline void tile(const char* x, int64_t ldx_bytes, const float* w, int64_t H, int ne,
                 float* out, int64_t ldo) {
  vf acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = vzero();
  int64_t h = 0;
  for (; h + kVecF <= H; h += kVecF) {
    vf wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = j < ne ? vload(w + j * H + h) : vzero();
    for (int t = 0; t < NT; ++t) {
      vf xv = vload_as<F>(x + t * ldx_bytes, h);
      for (int j = 0; j < 4; ++j) acc[t][j] = vfma(xv, wv[j], acc[t][j]);
    }
  }
  if (h < H) {
    int n = int(H - h);
    vf wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = j < ne ? vload(w + j * H + h, n) : vzero();
    for (int t = 0; t < NT; ++t) {
      vf xv = vload_as<F>(x + t * ldx_bytes, h, n);
      for (int j = 0; j < 4; ++j) acc[t][j] = vfma(xv, wv[j], acc[t][j]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < ne; ++j) out[t * ldo + j] = vsum(acc[t][j]);
}

template <Fmt F>
void run(const void* x, int64_t ldx, const float* w, float* out, int64_t T, int64_t H,
         int64_t E, int64_t e0, int64_t e1) {
  const char* xb = static_cast<const char*>(x);
  const int64_t ldx_bytes = ldx * fmt_size(F);
  for (int64_t e = e0; e < e1; e += 4) {
    int ne = int(imin_(4, e1 - e));
    const float* we = w + e * H;
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) tile<F, 4>(xb + t * ldx_bytes, ldx_bytes, we, H, ne, out + t * E + e, E);
    switch (T - t) {
      case 3: tile<F, 3>(xb + t * ldx_bytes, ldx_bytes, we, H, ne, out + t * E + e, E); break;
      case 2: tile<F, 2>(xb + t * ldx_bytes, ldx_bytes, we, H, ne, out + t * E + e, E); break;
      case 1: tile<F, 1>(xb + t * ldx_bytes, ldx_bytes, we, H, ne, out + t * E + e, E); break;
      default: break;
    }
  }
}

}  // namespace

// Experts [e0, e1) of out[T,E] (row stride E). x rows are ldx elements apart.
void router_gemm_experts(const void* x, Fmt fmt, int64_t ldx, const float* w, float* out,
                         int64_t T, int64_t H, int64_t E, int64_t e0, int64_t e1) {
  switch (fmt) {
    case Fmt::kF32: run<Fmt::kF32>(x, ldx, w, out, T, H, E, e0, e1); break;
    case Fmt::kBF16: run<Fmt::kBF16>(x, ldx, w, out, T, H, E, e0, e1); break;
    case Fmt::kF16: run<Fmt::kF16>(x, ldx, w, out, T, H, E, e0, e1); break;
  }
}

}  // namespace moelab::cpu::MOELAB_ISA_NS
