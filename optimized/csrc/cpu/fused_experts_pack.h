// The prepacked weight layout of fused_experts (docs/fused_experts.md, "Weight layout"):
// sizes, the packing of standard SPEC weights, and the per-tile "exact decoder" flag.
// Torch-free, ISA-independent plain C++ (pure byte moves and compares): the binding uses
// it for optimized.prepack_moe_weights, the kernels for standard-layout weights (they pack
// one tile at a time into scratch), so both layouts give the same bytes and flags.
//
// A weight W[E][N][K] (N outputs, K inputs) is cut into groups of 16 output columns, and the
// groups into tiles of 4 (64 columns, the unit of work; the last tile of N may hold fewer):
//   bf16:       a tile of ng groups is tile-major, [K2][ng][16][2]: pair kk of its group gi at
//               byte (kk * ng + gi) * 64 of the tile, element (c, p) = W[16g + c][2kk + p]
//               (g = 4 * tile + gi), so one tile is one sequential stream (docs/fused_experts.md)
//   fp8:        group g holds the whole K range as consecutive pairs, pair kk: 16 columns x 2 k,
//               element (c, p) = W[16g + c][2kk + p] (32 bytes)
//   mxfp4:      group g, octet o (k = 8o .. 8o+7): 64 bytes, 16 little-endian dwords; dword c
//               holds column 16g+c: nibble i (bits 4i..4i+3) = code(16g+c, 8o + 2i) and
//               nibble 4+i (bits 16+4i..) = code(16g+c, 8o + 2i + 1), i = 0..3. So the dword
//               shifted right by 4i, per 16-bit half, has pair 4o+i's codes in its low nibbles.
//               scales: group g, 32-block b: 16 bytes, byte c = e8m0 of W[16g + c][32b..]
// Every layout gives a group group_bytes(q, K) bytes and a tile its ng groups' bytes at the
// same offset (tile * 4 * group_bytes); only the bf16 tile orders them differently inside.
// Columns past N and the k past an odd K hold zero codes (mxfp4 padding scales: 127).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../common/formats.h"

namespace moelab::fe {

enum Quant : int { kBF16 = 0, kFP8 = 1, kMXFP4 = 2 };

constexpr int64_t kGroupN = 16;      // output columns per group (one zmm of f32)
constexpr int64_t kTileGroups = 4;   // groups per tile
constexpr int64_t kTileN = kGroupN * kTileGroups;
constexpr int64_t kFp8Block = 128;
constexpr int64_t kMxBlock = 32;
constexpr int kMxFastLo = 127 - 32, kMxFastHi = 127 + 32;   // mxfp4 scale bytes of the fast path

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t n16(int64_t N) { return cdiv(N, kGroupN); }
inline int64_t k2(int64_t K) { return cdiv(K, 2); }
inline int64_t n_tiles(int64_t N) { return cdiv(N, kTileN); }

// Bytes of one packed group (16 columns x all of K).
inline int64_t group_bytes(int q, int64_t K) {
  return q == kBF16 ? k2(K) * 64 : q == kFP8 ? k2(K) * 32 : (K / 8) * 64;
}
inline int64_t expert_bytes(int q, int64_t N, int64_t K) { return n16(N) * group_bytes(q, K); }
// Bytes of one row of a standard-layout weight.
inline int64_t row_bytes(int q, int64_t K) { return q == kBF16 ? 2 * K : q == kFP8 ? K : K / 2; }
// Packed mxfp4 scale bytes of one group.
inline int64_t mx_scale_group_bytes(int64_t K) { return (K / kMxBlock) * kGroupN; }

inline int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }
// Per-thread scratch of one GEMM pass: the dequantized bf16 tile, and for standard-layout
// weights the packed tile and its packed mxfp4 scales.
inline int64_t scratch_dequant_bytes(int64_t K) { return align64(kTileGroups * k2(K) * 64); }
inline int64_t scratch_bytes(int q, int64_t K) {
  return 64 + scratch_dequant_bytes(K) + align64(kTileGroups * group_bytes(q, K)) +
         align64(q == kMXFP4 ? kTileGroups * mx_scale_group_bytes(K) : 0);
}

// Byte offset of bf16 pair kk of group gi in a tile of ng groups (tile-major).
inline int64_t bf16_pair_offset(int64_t kk, int64_t gi, int64_t ng) { return (kk * ng + gi) * 64; }

// Packs one tile of one expert's standard matrix src ([N][row_bytes]), its groups
// [g0, g0 + ng) (g0 = 4 * tile, ng = the tile's groups), into dst (ng * group_bytes(q, K) bytes).
inline void pack_groups(int q, const uint8_t* src, int64_t N, int64_t K, int64_t g0, int64_t ng,
                        uint8_t* dst) {
  const int64_t gb = group_bytes(q, K), rb = row_bytes(q, K), P = k2(K);
  for (int64_t gi = 0; gi < ng; ++gi) {
    uint8_t* d = dst + gi * gb;
    for (int64_t c = 0; c < kGroupN; ++c) {
      const int64_t n = (g0 + gi) * kGroupN + c;
      if (n >= N) {
        if (q == kBF16) {
          for (int64_t kk = 0; kk < P; ++kk) std::memset(dst + bf16_pair_offset(kk, gi, ng) + 4 * c, 0, 4);
        } else if (q == kFP8) {
          for (int64_t kk = 0; kk < P; ++kk) std::memset(d + kk * 32 + 2 * c, 0, 2);
        } else {
          for (int64_t o = 0; o < K / 8; ++o) std::memset(d + o * 64 + 4 * c, 0, 4);
        }
        continue;
      }
      const uint8_t* s = src + n * rb;
      if (q == kBF16) {
        for (int64_t kk = 0; kk < P; ++kk) {
          uint8_t* o = dst + bf16_pair_offset(kk, gi, ng) + 4 * c;
          const int64_t k = 2 * kk;
          o[0] = s[2 * k];
          o[1] = s[2 * k + 1];
          if (k + 1 < K) {
            o[2] = s[2 * k + 2];
            o[3] = s[2 * k + 3];
          } else {
            o[2] = o[3] = 0;
          }
        }
      } else if (q == kFP8) {
        for (int64_t kk = 0; kk < P; ++kk) {
          uint8_t* o = d + kk * 32 + 2 * c;
          o[0] = s[2 * kk];
          o[1] = 2 * kk + 1 < K ? s[2 * kk + 1] : uint8_t(0);
        }
      } else {
        for (int64_t o = 0; o < K / 8; ++o) {
          uint32_t even = 0, odd = 0;   // byte 4o+i of the row: code(8o+2i) | code(8o+2i+1) << 4
          for (int i = 0; i < 4; ++i) {
            even |= uint32_t(s[4 * o + i] & 0x0f) << (4 * i);
            odd |= uint32_t(s[4 * o + i] >> 4) << (4 * i);
          }
          const uint32_t dw = even | odd << 16;
          std::memcpy(d + o * 64 + 4 * c, &dw, 4);   // little-endian, as the decoders read it
        }
      }
    }
  }
}

// Packs the mxfp4 scales of groups [g0, g0 + ng) of one expert (src [N][K/32]).
inline void pack_mx_scales(const uint8_t* src, int64_t N, int64_t K, int64_t g0, int64_t ng,
                           uint8_t* dst) {
  const int64_t nb = K / kMxBlock;
  for (int64_t gi = 0; gi < ng; ++gi)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t c = 0; c < kGroupN; ++c) {
        const int64_t n = (g0 + gi) * kGroupN + c;
        dst[(gi * nb + b) * kGroupN + c] = n < N ? src[n * nb + b] : uint8_t(127);
      }
}

// Whether a tile needs the exact element-by-element decoder instead of the fast one:
//   fp8:   a NaN code (0x7f / 0xff) in the tile, or a scale of the tile's 128-row block
//          whose scale * 256 is not finite (|scale| >= 2^120, inf or NaN: the fast path
//          multiplies by scale * 256, and would turn the zero padding of an odd K into NaN);
//   mxfp4: a scale byte outside [kMxFastLo, kMxFastHi] = [95, 159], i.e. 2^e with |e| > 32.
//          The fast path keeps the f32 accumulator in units of the current block's scale
//          (acc * 2^-e, fused_experts_kernel.h), which is exact only while that product is
//          a normal f32: |e| <= 32 leaves 2^94 of headroom either side of any output a real
//          model makes (their scales lie within a few binades of 2^0), and s = 255 (NaN),
//          0 and 1 (subnormal scales) go to the exact decoder as before.
// w: the tile's ng packed groups; fp8_scale: the expert's [ceil(N/128)][ceil(K/128)] f32
// scales; mx_scales: the tile's packed scales. A pure function of codes and scales.
inline bool tile_needs_slow(int q, const uint8_t* w, int64_t ng, int64_t K, int64_t tile,
                            const float* fp8_scale, const uint8_t* mx_scales) {
  if (q == kBF16) return false;
  if (q == kFP8) {
    const int64_t nbytes = ng * group_bytes(q, K);
    for (int64_t i = 0; i < nbytes; ++i)
      if ((w[i] & 0x7f) == 0x7f) return true;
    const int64_t nbk = cdiv(K, kFp8Block);
    const float* s = fp8_scale + (tile * kTileN / kFp8Block) * nbk;
    for (int64_t b = 0; b < nbk; ++b) {
      if (!std::isfinite(s[b] * 256.0f)) return true;
    }
    return false;
  }
  const int64_t nbytes = ng * mx_scale_group_bytes(K);
  for (int64_t i = 0; i < nbytes; ++i)
    if (mx_scales[i] < kMxFastLo || mx_scales[i] > kMxFastHi) return true;
  return false;
}

}  // namespace moelab::fe
