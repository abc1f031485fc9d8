"""`fused_experts`: the expert MLPs of an MoE layer, with bf16, block-FP8 or MXFP4 weights.

After routing, token t goes to the K experts topk_ids[t, :] with weights
topk_weights[t, :]. Each expert e is a gated MLP with an up/gate projection
W13[e] (H -> 2I) and a down projection W2[e] (I -> H). For every slot j of every token
(a "row"; an id of -1 means the slot is dropped, e.g. an expert on another rank):

    h   = bf16( x[t] @ W13[e].T + b13[e] )                       [2I]
    a   = bf16( act(h) )                                          [I]
          silu:        a = silu(h[:I]) * h[I:]                    (Mixtral, Qwen, DeepSeek)
          swiglu_oai:  g = min(h[0::2], limit), u = clamp(h[1::2], -limit, limit),
                       a = g * sigmoid(alpha * g) * (u + 1)       (GPT-OSS; gate/up interleaved)
    y   = a @ W2[e].T + b2[e]                                     [H]
    out[t] = bf16( sum_j topk_weights[t, j] * y_j )               [H]

With apply_router_weight_on_input (Llama 4, vLLM's parameter of this name) the weight scales
the expert's input instead of its output: slot j's input is bf16(x[t] * bf16(w_tj)) (the
weight rounded to bf16 first, as a bf16 model does; the product of two bf16 values is exact
in f32, so the product is rounded once), and out[t] = bf16( sum_j y_j ), unweighted.

`bf16(.)` marks the only three roundings: everything else is computed in float64 from the
exact inputs (bf16 x, the f32 dequantized weights, f32/bf16 biases, f32 routing weights),
so the result is the exact function rounded at SPEC's rounding points (up to float64
error, far below a bf16 ulp). A kernel that accumulates in f32 differs from it by its own
f32 error; verify's tolerance is built around that.

Weights come in three formats (see reference/quant.py); each expert's matrices are first
dequantized to f32 exactly as SPEC.md says (bf16 -> f32 is exact; fp8_block multiplies
in f32; mxfp4 values are exact in f32). The reference dequantizes one expert at a time,
so it never holds more than one expert's f32 weights.

Exact mode (this reference only, docs/families.md): float64 x, weights in the unquantized
layout as float64, float64 biases and topk_weights; then none of the roundings happen and the
result is float64: the model's function itself, compared with transformers' float64 run.

The reference loops over experts, not tokens: it gathers the rows routed to each expert
and does two matrix products for them, then scatters the weighted outputs back. The
`dispatch` argument selects the optimized kernels' micro-kernel choice (tiny / blocked /
global / per_block / auto); it is validated here and otherwise ignored: every dispatch
value computes the same function, and the reference computes it the same way for all.
"""
from __future__ import annotations

from typing import Optional

import torch

from .quant import dequantize_expert_weights, round_to_bf16
from .validate import check_fused_experts

__all__ = ["fused_experts", "activate"]


def activate(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """The gated activation of rows h[m, 2I] (float64) -> [m, I] float64, unrounded.

    silu:       silu(h[:, :I]) * h[:, I:], silu(z) = z * sigmoid(z).
    swiglu_oai: g = min(h[:, 0::2], limit), u = clamp(h[:, 1::2], -limit, limit),
                g * sigmoid(alpha * g) * (u + 1). The gate is clamped from above only.
    """
    if activation == "silu":
        I = h.shape[1] // 2
        gate, up = h[:, :I], h[:, I:]
        return gate * torch.sigmoid(gate) * up
    gate, up = h[:, 0::2], h[:, 1::2]
    g = torch.clamp(gate, max=limit)
    u = torch.clamp(up, min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + 1.0)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, quant: str,
                  w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                  w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
                  activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                  dispatch: str = "auto", apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """The routed expert MLPs: out[t] = bf16(sum_j topk_weights[t,j] * MLP_{topk_ids[t,j]}(x[t])).

    Math (module docstring): h = bf16(x @ W13[e].T + b13[e]); a = bf16(act(h));
    y = a @ W2[e].T + b2[e]; out[t] = bf16(sum_j topk_weights[t, j] * y_j), all in float64
    between the three bf16 roundings. Slots with id -1 contribute nothing (a token whose
    slots are all -1 gets zeros). apply_router_weight_on_input: the input of slot j is
    bf16(x[t] * bf16(topk_weights[t, j])) and out[t] = bf16(sum_j y_j).

    Args (E experts, I intermediate size):
        x: [T, H] bf16 (float64: exact mode). topk_weights: [T, K] f32. topk_ids: [T, K] int32, in [-1, E).
        quant: "bf16" | "fp8_block" | "mxfp4", with
            bf16:      w13 [E, 2I, H] bf16, w2 [E, H, I] bf16, no scales;
            fp8_block: w13 [E, 2I, H] f8e4m3fn, w2 [E, H, I] f8e4m3fn,
                       w13_scale [E, ceil(2I/128), ceil(H/128)] f32, w2_scale [E, ceil(H/128), ceil(I/128)] f32;
            mxfp4:     w13 [E, 2I, H/2] uint8, w2 [E, H, I/2] uint8,
                       w13_scale [E, 2I, H/32] uint8, w2_scale [E, H, I/32] uint8 (H, I multiples of 32).
        w13_bias: [E, 2I], w2_bias: [E, H], f32 or bf16, optional.
        activation: "silu" | "swiglu_oai"; alpha, limit: finite floats (swiglu_oai only).
        dispatch: "auto" | "tiny" | "blocked" | "global" | "per_block": validated; the
            reference computes the same result for every value.
        apply_router_weight_on_input: bool (SPEC 6), any K.
    Returns: [T, H] bf16 (a fresh tensor; T = 0 gives [0, H]; float64 in exact mode).
    Raises: ValueError from validate.check_fused_experts, message 'fused_experts: argument
    '<name>' ...', for any bad argument (dtype, shape, device, contiguity, scale
    presence, id range, unknown option, non-finite alpha/limit).
    """
    E, I = check_fused_experts(x, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale,
                               w13_bias, w2_bias, activation, alpha, limit, dispatch,
                               apply_router_weight_on_input, exact=True)
    exact = x.dtype == torch.float64
    # The bf16 rounding points; in exact mode nothing is rounded.
    rnd = (lambda v: v) if exact else (lambda v: round_to_bf16(v).to(torch.float64))
    T, H = x.shape
    x64 = x.to(torch.float64)
    weights64 = topk_weights.to(torch.float64)
    out = torch.zeros(T, H, dtype=torch.float64, device=x.device)

    for e in range(E):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)   # rows routed to expert e
        if tok.numel() == 0:
            continue                                              # never dequantized
        if exact:
            W13, W2 = w13[e], w2[e]
        else:
            W13 = dequantize_expert_weights(quant, w13[e], None if w13_scale is None else w13_scale[e])
            W2 = dequantize_expert_weights(quant, w2[e], None if w2_scale is None else w2_scale[e])

        if apply_router_weight_on_input:
            xin = rnd(x64[tok] * rnd(weights64[tok, slot]).unsqueeze(1))   # bf16(x * bf16(w))
        else:
            xin = x64[tok]
        h = xin @ W13.to(torch.float64).T                        # [m, 2I]
        if w13_bias is not None:
            h = h + w13_bias[e].to(torch.float64)
        h = rnd(h)

        a = rnd(activate(h, activation, alpha, limit))           # [m, I]

        y = a @ W2.to(torch.float64).T                            # [m, H]
        if w2_bias is not None:
            y = y + w2_bias[e].to(torch.float64)

        scale = 1.0 if apply_router_weight_on_input else weights64[tok, slot].unsqueeze(1)
        out.index_put_((tok,), scale * y, accumulate=True)       # out[tok] += w * y

    return out if exact else round_to_bf16(out)
