"""Router GEMM: float32 router logits from low-precision activations.

A MoE layer scores every token against every expert with one small matrix product,
logits[t, e] = sum_h x[t, h] * W[e, h], where x[T, H] is the layer input (bf16 in a
bf16 model) and W[E, H] is the router weight, which models such as MiniMax-M2 and
DeepSeek-V3 keep in float32 because routing decisions are sensitive to small logit
differences. The logits come out in float32 for the top-k selection (`route`).

The natural PyTorch spelling, `x.float() @ W.T`, runs two kernels (a cast that writes
an f32 copy of x, then the GEMM); a fused kernel loads x in its own dtype and upcasts
in registers (vLLM's fp32 router GEMM, seed 001). Upcasting bf16/f16 to f32 is exact,
so the function itself does not depend on where the cast happens.

The reference computes in float64 from the exact upcasts of x and W and rounds once to
float32: every product of an f32 and a bf16/f16/f32 number is exact in f64, and the f64
sum's error (about H * 2^-53 relative to sum |x*w|) is far below one f32 rounding, so
this is the exact function rounded to f32 for every practical input (barring a sum that
lands within ~2^-53 of an f32 rounding boundary). Optimized kernels accumulate in f32;
verify bounds their distance from this ground truth.
"""
from __future__ import annotations

import torch

from . import validate

__all__ = ["router_gemm"]


def router_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits: logits = f32(f64(x) @ f64(weight).T).

    Args:
        x: [T, H] bfloat16, float16 or float32 activations (T >= 0, H >= 1; any strides).
        weight: [E, H] float32 router weight (E >= 1) on x's device.

    Math: logits[t, e] = sum_h x[t, h] * weight[e, h], computed in float64 from the exact
    upcasts and rounded once to float32. No bias here (GPT-OSS's router bias is added by
    moe_forward). Exact mode (reference only): float64 x and weight give float64 logits, unrounded.

    Returns:
        [T, E] float32, a fresh tensor; T = 0 gives a [0, E] tensor.

    Raises:
        ValueError: "router_gemm: argument '<name>' ..." for a bad rank, dtype, shape or
            device (see validate.check_router_gemm).
    """
    validate.check_router_gemm(x, weight, exact=True)
    out = x.to(torch.float64) @ weight.to(torch.float64).T
    return out if x.dtype == torch.float64 else out.to(torch.float32)   # f64: exact mode
