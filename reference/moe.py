"""`moe_forward`: the whole Mixture-of-Experts layer of a real model family (SPEC 5 and 6).

A MoE layer replaces a transformer's MLP with E expert MLPs of which each token uses
only K, plus, in many families, shared experts that every token uses. The ops compose it:

    logits        = router_gemm(x, router_weight) (+ router_bias)      [T, E] f32  (SPEC 3)
    weights, ids  = route(logits, top_k, method, ...)                  [T, K] f32, int32  (SPEC 1)
    routed        = fused_experts(x, w13, w2, weights, ids, ...)       [T, H] bf16  (SPEC 5)
    shared        = fused_experts(x, s.w13, s.w2, g, 0, ...)           [T, H] bf16  (one expert, E = 1)
                    g = sigmoid(router_gemm(x, s.gate)) (Qwen2-MoE, Qwen3-Next), else 1
    out           = bf16(routed + shared)                              [T, H] bf16

Every number comes from the ops, so the layer is exactly as precise as they are, and the
ops come from a namespace you choose (`ops`): the reference modules by default, or any
object/module with functions `router_gemm`, `route` and `fused_experts` of SPEC's
signatures, e.g. the `optimized` package. Family presets (reference/families.py) fill in
the arguments for each model family; docs/families.md is the table of families.

Decisions (SPEC 6 leaves the composition and roundings to the project):
- The router bias (GPT-OSS) is added to the f32 logits in f32, before route.
- A family that scales the routed output (rather than the weights) by a routed scaling
  factor is expressed through route's `scaling`: sum_j (w_j * c) * y_j = c * sum_j w_j * y_j,
  the same function with one rounding fewer.
- The shared expert is a gated MLP of its own width, in any weight format, computed by
  fused_experts with a single expert (E = 1, every token's id 0), so it is rounded exactly as a
  routed expert is: h and a to bf16, y in f32. Its routing weight is the shared gate
  sigmoid(x @ gate.T), evaluated exactly and rounded once to f32 (as route's sigmoid is), or 1.
  Several shared experts (DeepSeek's n_shared_experts) are one MLP of the summed width, which
  is how the models store them.
- routed and shared are each rounded to bf16 (as a bf16 model's two branches are), then added
  exactly and rounded once: out = bf16(routed + shared).
- Exact mode (reference ops only): float64 x and float64 weights make every op float64 with
  no rounding at all; this is the function the conformance tests compare with transformers'
  module run in float64 (docs/families.md).

Expert parallelism (ids of -1, expert_map) is a layer above this one. The alternative
composition SPEC mentions, permute -> per-expert GEMMs -> unpermute, computes the same
function with other rounding points and is not this function.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Optional

import torch

from .quant import round_to_bf16
from .validate import check_choice, check_tensor, fail, QUANT_FORMATS, ACTIVATIONS

__all__ = ["moe_forward", "reference_ops", "SharedExpert"]

_OP_NAMES = ("router_gemm", "route", "fused_experts")


@dataclasses.dataclass
class SharedExpert:
    """The shared expert(s) of a layer: one gated MLP that every token passes through.

    w13 [1, 2S, H] and w2 [1, H, S] in fused_experts' layout and format `quant` (scales and
    biases likewise, with a leading expert dimension of 1; or weights prepacked by the ops,
    with w2 None, as `optimized.prepack_moe_weights` makes them); `gate` [1, H] float32 is the
    optional sigmoid gate of Qwen2-MoE / Qwen3-Next (float64 in exact mode).
    """
    w13: torch.Tensor
    w2: torch.Tensor
    quant: str = "bf16"
    w13_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    w13_bias: Optional[torch.Tensor] = None
    w2_bias: Optional[torch.Tensor] = None
    gate: Optional[torch.Tensor] = None
    activation: str = "silu"


def reference_ops() -> types.SimpleNamespace:
    """The reference implementations of the three ops, as a namespace (the default `ops`)."""
    from .fused_experts import fused_experts
    from .route import route
    from .router_gemm import router_gemm
    return types.SimpleNamespace(router_gemm=router_gemm, route=route, fused_experts=fused_experts)


def _n_experts(op: str, name: str, w13) -> int:
    """E of w13: a weight tensor [E, 2I, ...] or an ops-specific prepacked object with an `E`
    (optimized.PackedMoEWeights), which the ops' fused_experts then validates."""
    if isinstance(w13, torch.Tensor):
        check_tensor(op, name, w13, ndim=3)
        return w13.shape[0]
    E = getattr(w13, "E", None)
    if not isinstance(E, int):
        fail(op, name, f"must be a 3-D weight tensor or prepacked weights, got {type(w13).__name__}")
    return E


def _shared_weights(x: torch.Tensor, shared: SharedExpert, ops) -> torch.Tensor:
    """[T, 1] routing weight of the shared expert: sigmoid(x @ gate.T) or 1."""
    T = x.shape[0]
    wdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    if shared.gate is None:
        return torch.ones(T, 1, dtype=wdt, device=x.device)
    g = ops.router_gemm(x, shared.gate)                           # [T, 1] f32 (f64 exact)
    return torch.sigmoid(g.to(torch.float64)).to(wdt)             # exact sigmoid, rounded once


def moe_forward(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                top_k: int, method: str = "softmax_topk", bias: Optional[torch.Tensor] = None,
                n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
                renormalize: Optional[bool] = None, norm_eps: Optional[float] = None,
                router_bias: Optional[torch.Tensor] = None,
                quant: str = "bf16", w13_scale: Optional[torch.Tensor] = None,
                w2_scale: Optional[torch.Tensor] = None, w13_bias: Optional[torch.Tensor] = None,
                w2_bias: Optional[torch.Tensor] = None, activation: str = "silu", alpha: float = 1.702,
                limit: float = 7.0, dispatch: str = "auto", apply_router_weight_on_input: bool = False,
                shared: Optional[SharedExpert] = None, ops=None) -> torch.Tensor:
    """One MoE layer (module docstring): routed experts, plus shared experts where given.

    Math:
        logits = ops.router_gemm(x, router_weight) (+ f32(router_bias))
        weights, ids = ops.route(logits, top_k, method, bias=bias, n_group=n_group,
                                 topk_group=topk_group, scaling=scaling, renormalize=renormalize,
                                 norm_eps=norm_eps)
        routed = ops.fused_experts(x, w13, w2, weights, ids, quant=quant, ..., dispatch=dispatch,
                                   apply_router_weight_on_input=apply_router_weight_on_input)
        without shared: out = routed
        with shared:    out = bf16(routed + ops.fused_experts(x, shared.w13, shared.w2, g, 0, ...))

    Args:
        x: [T, H] bf16 (float64: the reference's exact mode). router_weight: [E, H] f32.
        w13, w2 and their scales/biases: one of fused_experts' weight formats (`quant`),
            with the same E as router_weight (or weights prepacked for `ops`, w2 None).
        top_k, method, bias, n_group, topk_group, scaling, renormalize, norm_eps: `route`'s.
        router_bias: [E] f32 (GPT-OSS), added to the logits.
        quant, activation, alpha, limit, dispatch, apply_router_weight_on_input: `fused_experts`'.
        shared: a SharedExpert or None.
        ops: namespace with router_gemm, route, fused_experts; None = the reference ones.
    Returns: [T, H] bf16 (T = 0 gives [0, H]; float64 in exact mode).
    Raises: ValueError "moe_forward: argument 'ops' ..." if ops lacks one of the three
        functions, "moe_forward: argument 'router_weight' ..." if its expert count differs
        from w13's, "moe_forward: argument 'router_bias' / 'shared' ..." for a malformed one;
        otherwise the ValueError of the op that rejects an argument (its message names that
        op, e.g. "route: argument 'top_k' ...").
    """
    op = "moe_forward"
    if ops is None:
        ops = reference_ops()
    for name in _OP_NAMES:
        if not callable(getattr(ops, name, None)):
            fail(op, "ops", f"must provide callables {', '.join(_OP_NAMES)}; '{name}' is missing")
    check_tensor(op, "router_weight", router_weight, ndim=2)
    E = _n_experts(op, "w13", w13)
    if router_weight.shape[0] != E:
        fail(op, "router_weight", f"must have one row per expert of w13 (E = {E}), "
                                  f"got {router_weight.shape[0]} rows")
    if router_bias is not None:
        check_tensor(op, "router_bias", router_bias, shape=(E,), device=x.device,
                     dtypes=(torch.float64,) if x.dtype == torch.float64 else (torch.float32, torch.bfloat16))
    if shared is not None:
        if not isinstance(shared, SharedExpert):
            fail(op, "shared", f"must be a SharedExpert or None, got {type(shared).__name__}")
        check_choice(op, "shared", shared.quant, QUANT_FORMATS)
        check_choice(op, "shared", shared.activation, ACTIVATIONS)
        n_shared = _n_experts(op, "shared", shared.w13)
        if n_shared != 1:
            fail(op, "shared", f"must hold one expert (w13 of shape (1, 2S, H)), got {n_shared}")
        if shared.gate is not None:
            check_tensor(op, "shared", shared.gate, shape=(1, x.shape[-1] if x.dim() == 2 else None))

    logits = ops.router_gemm(x, router_weight)
    if router_bias is not None:
        logits = logits + router_bias.to(logits.dtype)
    # The SPEC 6 keywords are passed only when set, so an `ops` written against the older
    # signatures (a peer's adapter, a test double) still composes the layers it can express.
    route_kw = dict(bias=bias, n_group=n_group, topk_group=topk_group, scaling=scaling, renormalize=renormalize)
    if norm_eps is not None:
        route_kw["norm_eps"] = norm_eps
    weights, ids = ops.route(logits, top_k, method, **route_kw)
    expert_kw = dict(activation=activation, alpha=alpha, limit=limit, dispatch=dispatch)
    if apply_router_weight_on_input:
        expert_kw["apply_router_weight_on_input"] = True
    routed = ops.fused_experts(x, w13, w2, weights, ids, quant=quant, w13_scale=w13_scale,
                               w2_scale=w2_scale, w13_bias=w13_bias, w2_bias=w2_bias, **expert_kw)
    if shared is None:
        return routed

    g = _shared_weights(x, shared, ops)
    zeros = torch.zeros(x.shape[0], 1, dtype=torch.int32, device=x.device)
    shared_out = ops.fused_experts(x, shared.w13, shared.w2, g, zeros, quant=shared.quant,
                                   w13_scale=shared.w13_scale, w2_scale=shared.w2_scale,
                                   w13_bias=shared.w13_bias, w2_bias=shared.w2_bias,
                                   activation=shared.activation, alpha=alpha, limit=limit, dispatch=dispatch)
    total = routed.to(torch.float64) + shared_out.to(torch.float64)   # two bf16 values: exact
    return total if x.dtype == torch.float64 else round_to_bf16(total)
