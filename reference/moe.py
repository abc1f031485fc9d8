"""`moe_forward`: one routed Mixture-of-Experts layer, end to end.

A MoE layer replaces a transformer's MLP with E expert MLPs of which each token uses
only K. Three ops compose it:

    logits        = router_gemm(x, router_weight)              [T, E] f32  (SPEC 3)
    weights, ids  = route(logits, top_k, method, ...)          [T, K] f32, int32  (SPEC 1)
    out           = fused_experts(x, w13, w2, weights, ids, ...)  [T, H] bf16  (SPEC 5)

`moe_forward` is that composition and nothing more: every number comes from the three
ops, so it is exactly as precise as they are, and the ops come from a namespace you
choose (`ops`): the reference modules by default, or any object/module with functions
`router_gemm`, `route` and `fused_experts` of SPEC's signatures, e.g. the `optimized`
package. Experiments time it as the layer; tests use it as an integration check
(`moe_forward(..., ops=optimized)` against `moe_forward(...)`).

What it leaves out: the shared expert (models such as Qwen2-MoE add one, gated by
`fused_gate_gemm`) and expert parallelism (all E experts are local here; ids are never
-1). The alternative composition SPEC mentions, permute -> per-expert GEMMs ->
unpermute, computes the same function with other rounding points and is not this
function.
"""
from __future__ import annotations

import types
from typing import Optional

import torch

from .validate import check_tensor, fail

__all__ = ["moe_forward", "reference_ops"]

_OP_NAMES = ("router_gemm", "route", "fused_experts")


def reference_ops() -> types.SimpleNamespace:
    """The reference implementations of the three ops, as a namespace (the default `ops`)."""
    from .fused_experts import fused_experts
    from .route import route
    from .router_gemm import router_gemm
    return types.SimpleNamespace(router_gemm=router_gemm, route=route, fused_experts=fused_experts)


def moe_forward(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                top_k: int, method: str = "softmax_topk", bias: Optional[torch.Tensor] = None,
                n_group: int = 1, topk_group: int = 1, scaling: float = 1.0, renormalize: bool = False,
                quant: str = "bf16", w13_scale: Optional[torch.Tensor] = None,
                w2_scale: Optional[torch.Tensor] = None, w13_bias: Optional[torch.Tensor] = None,
                w2_bias: Optional[torch.Tensor] = None, activation: str = "silu", alpha: float = 1.702,
                limit: float = 7.0, dispatch: str = "auto", ops=None) -> torch.Tensor:
    """One MoE layer: fused_experts(x, route(router_gemm(x, router_weight), ...), ...).

    Math:
        logits = ops.router_gemm(x, router_weight)
        weights, ids = ops.route(logits, top_k, method, bias=bias, n_group=n_group,
                                 topk_group=topk_group, scaling=scaling, renormalize=renormalize)
        out = ops.fused_experts(x, w13, w2, weights, ids, quant=quant, w13_scale=...,
                                w2_scale=..., w13_bias=..., w2_bias=..., activation=...,
                                alpha=..., limit=..., dispatch=...)

    Args:
        x: [T, H] bf16 (fused_experts takes bf16 only). router_weight: [E, H] f32.
        w13, w2 and their scales/biases: one of fused_experts' weight formats (`quant`),
            with the same E as router_weight.
        top_k, method, bias, n_group, topk_group, scaling, renormalize: `route`'s arguments.
        quant, activation, alpha, limit, dispatch: `fused_experts`' arguments.
        ops: namespace with router_gemm, route, fused_experts; None = the reference ones.
    Returns: [T, H] bf16 (T = 0 gives [0, H]).
    Raises: ValueError "moe_forward: argument 'ops' ..." if ops lacks one of the three
        functions, "moe_forward: argument 'router_weight' ..." if its expert count differs
        from w13's; otherwise the ValueError of the op that rejects an argument (its
        message names that op, e.g. "route: argument 'top_k' ...").
    """
    op = "moe_forward"
    if ops is None:
        ops = reference_ops()
    for name in _OP_NAMES:
        if not callable(getattr(ops, name, None)):
            fail(op, "ops", f"must provide callables {', '.join(_OP_NAMES)}; '{name}' is missing")
    check_tensor(op, "router_weight", router_weight, ndim=2)
    check_tensor(op, "w13", w13, ndim=3)
    if router_weight.shape[0] != w13.shape[0]:
        fail(op, "router_weight", f"must have one row per expert of w13 (E = {w13.shape[0]}), "
                                  f"got {router_weight.shape[0]} rows")

    logits = ops.router_gemm(x, router_weight)
    weights, ids = ops.route(logits, top_k, method, bias=bias, n_group=n_group, topk_group=topk_group,
                             scaling=scaling, renormalize=renormalize)
    return ops.fused_experts(x, w13, w2, weights, ids, quant=quant, w13_scale=w13_scale,
                             w2_scale=w2_scale, w13_bias=w13_bias, w2_bias=w2_bias,
                             activation=activation, alpha=alpha, limit=limit, dispatch=dispatch)
