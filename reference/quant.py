"""Weight quantization formats of `fused_experts`: block FP8 (e4m3) and OCP MXFP4 (e2m1 + e8m0).

Both formats store a weight matrix W[..., N, K] (N output features, K input features) as
small codes plus a scale per block of elements; the value of an element is
`decode(code) * scale(block)`.

FP8 block (`fp8_block`, DeepSeek-V3 / Qwen3 FP8 checkpoints)
    The codes are float8_e4m3fn numbers (1 sign bit, 4 exponent bits with bias 7, 3
    mantissa bits; no infinities; 0x7F and 0xFF are NaN; largest finite value 448). One
    f32 scale covers a 128 x 128 block, so scale has shape [..., ceil(N/128), ceil(K/128)]
    (edge blocks may be partial). Dequantization, exactly as SPEC.md states it:

        W[n, k] = f32(q[n, k]) * scale[n // 128, k // 128]      (the product rounded in f32)

    `quantize_fp8_block` picks scale = amax(|block|) / 448 (an f32 division) and codes
    q = e4m3 round-to-nearest-even of w / scale, after clamping to [-448, 448].

MXFP4 (`mxfp4`, OCP Microscaling, GPT-OSS checkpoints)
    The codes are 4-bit e2m1 numbers: bit 3 is the sign, the low three bits select the
    magnitude 0, 0.5, 1, 1.5, 2, 3, 4 or 6 (`E2M1_VALUES`). Two codes share a byte, the
    even k in the low nibble: packed[n, k // 2] = code[n, 2i] | code[n, 2i + 1] << 4. One
    e8m0 scale byte s covers 32 consecutive k of a row and means 2^(s - 127); s = 255 is
    NaN. So packed has shape [..., N, K/2] and scales [..., N, K/32]:

        W[n, k] = E2M1_VALUES[code[n, k]] * 2^(scales[n, k // 32] - 127)

    Every such value is an exact f32 number (s = 0 gives 2^-127, an f32 subnormal) except
    6 * 2^127 and 4 * 2^127, which lie beyond the f32 range and decode to +-inf.

    `quantize_mxfp4` chooses the block exponent e by one of two rules and then rounds
    each w / 2^e to the nearest e2m1 value, ties to the even code:
      * "ceil" (default; SPEC's rule): the smallest e with 6 * 2^e >= amax, i.e.
        e = ceil(log2(amax / 6)). No element ever exceeds the grid, nothing clips.
      * "floor" (the OCP MX v1.0 rule): e = floor(log2(amax)) - 2. Elements above 6 * 2^e
        (amax can reach nearly 8 * 2^e) saturate to +-6 * 2^e: this rule can clip.

Exactness: every function here is exact or rounds once, at the point its docstring names.
The rounding to e4m3 and to bf16 is done by hand in float64 (`round_to_float_format`),
because torch's float64 -> bfloat16 / float8 conversions go through float32 and so round
twice (1 + 2^-8 + 2^-30 becomes 1.0 instead of 1 + 2^-7).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .validate import (FP8_BLOCK, MX_BLOCK, QUANT_FORMATS, check_choice, check_quant_input,
                       check_tensor, fail)

__all__ = [
    "E2M1_VALUES", "E4M3_MAX", "MX_SCALE_RULES",
    "quantize_fp8_block", "dequantize_fp8_block", "quantize_mxfp4", "dequantize_mxfp4",
    "dequantize_expert_weights", "round_to_float_format", "round_to_bf16", "round_to_e4m3",
]

# Code c -> value: sign = bit 3, magnitude by the low 3 bits. Code 8 is -0.0.
E2M1_VALUES: Tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
MX_SCALE_RULES = ("ceil", "floor")
E8M0_BIAS = 127
E8M0_NAN = 255

# Midpoints between consecutive e2m1 magnitudes (codes i and i+1), and where a value
# exactly on a midpoint goes: to the even code of the two.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ----------------------------------------------------------------------------- rounding
def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact 2.0**e in float64 for integer e in [-1022, 1023], built from the bit pattern."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def round_to_float_format(v: torch.Tensor, mantissa_bits: int, min_exponent: int,
                          max_finite: float) -> torch.Tensor:
    """Round float64 `v` to the nearest number of a binary float format, ties to even.

    The format has `mantissa_bits` stored fraction bits, smallest normal exponent
    `min_exponent` (below it the spacing stays 2^(min_exponent - mantissa_bits):
    subnormals) and largest finite value `max_finite`. A finite v whose rounding exceeds
    max_finite becomes +-inf (IEEE overflow; callers that saturate clamp first). NaN and
    +-inf pass through. The result is float64 holding a value of the format, so a
    conversion to the format's torch dtype afterwards is exact.

    Done in float64 by hand: with q the spacing of v's binade, v / q is exact and
    torch.round rounds half to even.
    """
    v = v.to(torch.float64)
    _, ex = torch.frexp(v)                     # |v| in [2^(ex-1), 2^ex)
    quantum = _pow2(torch.clamp(ex.to(torch.int64) - 1, min=min_exponent) - mantissa_bits)
    r = torch.round(v / quantum) * quantum
    r = torch.where(r.abs() > max_finite, r * float("inf"), r)      # overflow -> +-inf
    return torch.where(torch.isfinite(v), r, v)


def round_to_bf16(v: torch.Tensor) -> torch.Tensor:
    """float64 -> bfloat16, rounded once to nearest even (no float32 detour)."""
    return round_to_float_format(v, 7, -126, float(torch.finfo(torch.bfloat16).max)).to(torch.bfloat16)


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 -> float8_e4m3fn, rounded once to nearest even. |v| must be <= 448 (no inf in e4m3)."""
    return round_to_float_format(v, 3, -6, E4M3_MAX).to(torch.float8_e4m3fn)


# ---------------------------------------------------------------------------- FP8 block
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _expand_blocks(scale: torch.Tensor, N: int, K: int, bn: int, bk: int) -> torch.Tensor:
    """[..., nb, kb] -> [..., N, K]: every element gets its block's scale."""
    return scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :N, :K]


def quantize_fp8_block(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize w[..., N, K] to float8_e4m3fn with one f32 scale per 128 x 128 block.

    Math, per block B (edge blocks may be partial):
        amax = max |w| over B
        scale = f32(amax / 448)                  (one f32 division, rounded to nearest)
        q = RNE_e4m3(clamp(w / scale, -448, 448))  (w / scale exact, then one rounding)
    Scale is rounded, so w / scale can exceed 448 by about an f32 ulp; that still rounds to
    448, and the clamp makes the saturation explicit.
    Decisions: an all-zero block gets scale 1.0 (its codes are 0); a nonzero block whose
    amax / 448 underflows f32 to 0 gets the smallest f32 subnormal 2^-149 instead. -0.0
    stays -0.0 (e4m3 has a negative zero, code 0x80).

    Args: w: f32, bf16 or f16, at least 2-D, finite.
    Returns: (q float8_e4m3fn [..., N, K], scale f32 [..., ceil(N/128), ceil(K/128)]).
    Raises: ValueError (message starts with 'quantize_fp8_block') for a non-tensor, other
    dtype, fewer than 2 dims, or a NaN/inf element.
    """
    check_quant_input("quantize_fp8_block", w, 0)
    N, K = w.shape[-2], w.shape[-1]
    lead = w.shape[:-2]
    nb, kb = _cdiv(N, FP8_BLOCK), _cdiv(K, FP8_BLOCK)
    w32 = w.to(torch.float32)                  # exact for all three input dtypes
    padded = torch.zeros(*lead, nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    padded[..., :N, :K] = w32.abs()
    amax = padded.reshape(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK).amax(dim=(-3, -1))
    scale = amax / E4M3_MAX                    # f32 division
    tiny = torch.finfo(torch.float32).smallest_normal * 2.0 ** -23   # 2^-149
    scale = torch.where((scale == 0) & (amax > 0), torch.full_like(scale, tiny), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    v = w32.to(torch.float64) / _expand_blocks(scale, N, K, FP8_BLOCK, FP8_BLOCK).to(torch.float64)
    # An f64 quotient of two f32 numbers is never a false e4m3 tie, so rounding it is exact RNE.
    q = round_to_e4m3(v.clamp(-E4M3_MAX, E4M3_MAX))
    return q, scale


def _check_fp8_pair(op: str, q, scale) -> None:
    check_tensor(op, "q", q, dtypes=(torch.float8_e4m3fn,))
    if q.dim() < 2:
        fail(op, "q", f"must be at least 2-D (..., N, K), got {q.dim()}-D")
    N, K = q.shape[-2], q.shape[-1]
    check_tensor(op, "scale", scale, dtypes=(torch.float32,),
                 shape=(*q.shape[:-2], _cdiv(N, FP8_BLOCK), _cdiv(K, FP8_BLOCK)), device=q.device)


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[..., n, k] = f32(q[..., n, k]) * scale[..., n // 128, k // 128], the product rounded in f32.

    Exactly SPEC.md's dequantization (an f32 multiply, not f64): a kernel that dequantizes
    into f32 gets these bits. The e4m3 decode itself is exact; NaN codes (0x7F, 0xFF)
    decode to NaN.

    Args: q float8_e4m3fn [..., N, K]; scale f32 [..., ceil(N/128), ceil(K/128)].
    Returns: f32 [..., N, K].
    Raises: ValueError ('dequantize_fp8_block', naming q or scale) on dtype/shape mismatch.
    """
    _check_fp8_pair("dequantize_fp8_block", q, scale)
    N, K = q.shape[-2], q.shape[-1]
    return q.to(torch.float32) * _expand_blocks(scale, N, K, FP8_BLOCK, FP8_BLOCK)


# -------------------------------------------------------------------------------- MXFP4
def _e2m1_magnitude_code(a: torch.Tensor) -> torch.Tensor:
    """|value| (f64, >= 0) -> magnitude code 0..7: nearest e2m1 magnitude, ties to the even code.

    Counts the midpoints that `a` lies above; a value exactly on the midpoint between codes
    i and i+1 counts as above it only when i+1 is even. Values above 6 give code 7
    (saturation), which only the floor rule can produce.
    """
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        above = (a >= mid) if (i + 1) % 2 == 0 else (a > mid)
        code += above.to(torch.uint8)
    return code


def _mx_block_exponent(amax: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """Per-block exponent e (int64) from amax (f64 >= 0), computed exactly with frexp.

    amax = m * 2^ex with m in [0.5, 1), so amax in [2^e0, 2^(e0+1)) with e0 = ex - 1.
      ceil:  smallest e with 6 * 2^e >= amax. 6 * 2^(e0-2) = 1.5 * 2^e0, so e = e0 - 2 when
             amax <= 1.5 * 2^e0 (m <= 0.75), otherwise e = e0 - 1 (6 * 2^(e0-1) = 3 * 2^e0 > amax).
      floor: e = e0 - 2 (OCP: floor(log2 amax) - emax(e2m1) with emax = 2).
    An all-zero block gets e = -127 (scale byte 0).
    """
    m, ex = torch.frexp(amax)
    e0 = ex.to(torch.int64) - 1
    if scale_rule == "ceil":
        e = torch.where(m <= 0.75, e0 - 2, e0 - 1)
    else:
        e = e0 - 2
    return torch.where(amax == 0, torch.full_like(e, -E8M0_BIAS), e)


def quantize_mxfp4(w: torch.Tensor, *, scale_rule: str = "ceil") -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize w[..., N, K] to OCP MXFP4: e2m1 codes, one e8m0 scale per 32 values along K.

    Math, per block of 32 consecutive k in a row:
        e = block exponent by `scale_rule` (see the module docstring): "ceil" (default,
            e = ceil(log2(amax / 6)), never clips) or "floor" (OCP, e = floor(log2 amax) - 2,
            values above 6 * 2^e saturate to +-6 * 2^e). All-zero block: e = -127.
        s = clamp(e + 127, 0, 254) (uint8); the block is coded with e' = s - 127
            (e' >= e, so the clamp can only make the ceil rule safer; for finite f32
            input the upper clamp never binds).
        code = nearest e2m1 value to w / 2^e' (exact in f64), ties to the even code
            (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
    Decision: a value whose magnitude rounds to 0 (-0.0 included) is coded 0 (+0), never
    8 (-0), so the packed bytes do not depend on the sign of zero.
    Packing: packed[..., n, i] = code[..., n, 2i] | code[..., n, 2i+1] << 4.

    Args: w: f32, bf16 or f16, at least 2-D, K a multiple of 32, finite.
          scale_rule: "ceil" or "floor".
    Returns: (packed uint8 [..., N, K/2], scales uint8 [..., N, K/32]).
    Raises: ValueError ('quantize_mxfp4', naming w or scale_rule) for a bad dtype, fewer
    than 2 dims, K not a multiple of 32, a NaN/inf element, or an unknown rule.
    """
    op = "quantize_mxfp4"
    check_quant_input(op, w, MX_BLOCK)
    check_choice(op, "scale_rule", scale_rule, MX_SCALE_RULES)
    N, K = w.shape[-2], w.shape[-1]
    lead = w.shape[:-2]
    blocks = w.to(torch.float64).reshape(*lead, N, K // MX_BLOCK, MX_BLOCK)
    e = _mx_block_exponent(blocks.abs().amax(dim=-1), scale_rule)
    s = torch.clamp(e + E8M0_BIAS, 0, 2 * E8M0_BIAS)
    v = blocks / _pow2(s - E8M0_BIAS).unsqueeze(-1)
    mag = _e2m1_magnitude_code(v.abs())
    sign = ((v < 0) & (mag > 0)).to(torch.uint8)
    codes = (mag | (sign << 3)).reshape(*lead, N, K)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, s.to(torch.uint8)


def _check_mx_pair(op: str, packed, scales) -> None:
    check_tensor(op, "packed", packed, dtypes=(torch.uint8,))
    if packed.dim() < 2:
        fail(op, "packed", f"must be at least 2-D (..., N, K/2), got {packed.dim()}-D")
    half_k = packed.shape[-1]
    if half_k % (MX_BLOCK // 2):
        fail(op, "packed", f"must have a last dim K/2 with K a multiple of {MX_BLOCK}, got K/2 = {half_k}")
    check_tensor(op, "scales", scales, dtypes=(torch.uint8,),
                 shape=(*packed.shape[:-1], 2 * half_k // MX_BLOCK), device=packed.device)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W[..., n, k] = E2M1_VALUES[code[..., n, k]] * 2^(scales[..., n, k // 32] - 127), in f32.

    code[n, 2i] is the low nibble of packed[n, i], code[n, 2i+1] the high nibble. A scale
    byte of 255 makes its 32 values NaN. The product is formed exactly in f64 and is an
    f32 number (s = 0 gives the subnormal 2^-127 scale; code 1 then gives 2^-128), so the
    conversion to f32 is exact, except that +-4 * 2^127 and +-6 * 2^127 (s = 254) lie
    beyond the f32 range and become +-inf.

    Args: packed uint8 [..., N, K/2] (K a multiple of 32); scales uint8 [..., N, K/32].
    Returns: f32 [..., N, K].
    Raises: ValueError ('dequantize_mxfp4', naming packed or scales) on dtype/shape mismatch.
    """
    _check_mx_pair("dequantize_mxfp4", packed, scales)
    K = 2 * packed.shape[-1]
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], K)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)
    scale = _pow2(scales.to(torch.int64) - E8M0_BIAS)
    scale = torch.where(scales == E8M0_NAN, torch.full_like(scale, float("nan")), scale)
    w = table[codes.to(torch.int64)] * scale.repeat_interleave(MX_BLOCK, dim=-1)
    return w.to(torch.float32)


# ------------------------------------------------------------------------------ experts
def dequantize_expert_weights(quant: str, w: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One weight matrix (or a stack of them) of any `fused_experts` format -> f32 [..., N, K].

    quant "bf16": w.float() (exact; scale must be None); "fp8_block":
    dequantize_fp8_block(w, scale); "mxfp4": dequantize_mxfp4(w, scale). fused_experts
    calls this for one expert at a time.

    Raises: ValueError ('dequantize_expert_weights' naming quant, w or scale; or the
    called dequantizer's message) on a bad combination.
    """
    op = "dequantize_expert_weights"
    check_choice(op, "quant", quant, QUANT_FORMATS)
    if quant == "bf16":
        check_tensor(op, "w", w, dtypes=(torch.bfloat16,))
        if scale is not None:
            fail(op, "scale", "must be None for quant 'bf16'")
        return w.to(torch.float32)
    if scale is None:
        fail(op, "scale", f"is required for quant '{quant}'")
    if quant == "fp8_block":
        return dequantize_fp8_block(w, scale)
    return dequantize_mxfp4(w, scale)
