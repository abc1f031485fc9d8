"""FlashInfer's MoE routing kernels (seed 004: the trtllm-gen routing) as an implementation of route.

Runs where a GPU and flashinfer exist (scripts/gpu_check.sh); unit-tested here against a fake
(tests/test_peers.py). Entry point: flashinfer.fused_moe.trtllm_gen_routing(routing_logits,
routing_bias, routing_method, top_k, *, n_group, topk_group, routed_scaling_factor,
norm_topk_prob) -> TrtllmGenRoutingResult, whose topk_ids / topk_weights are the per-token
selection (the routing kernels that run before the trtllm-gen MoE GEMMs). Methods, by
flashinfer's RoutingMethodType:

  softmax_topk, renormalize False   Default           softmax over E, then top-K
  softmax_topk, renormalize True    RenormalizeNaive  softmax, top-K, renormalized
  topk_softmax                      Renormalize       top-K of the logits, softmax over the K
  sigmoid_bias                      DeepSeekV3        sigmoid + bias selects, weights s / sum(s) * scaling
                                                      (SigmoidBias + ScaledSumNormalize), no groups
  grouped_sigmoid_bias              DeepSeekV3        the same with n_group / topk_group
  llama4                            Llama4            K = 1, sigmoid of the selected logit

Logits f32 or bf16 (f16 is cast to f32: exact); bias f32. A method name missing from the installed
RoutingMethodType is not covered. Not covered: scaling with the softmax methods, norm_eps,
sigmoid_bias with renormalize False (norm_topk_prob applies to the DeepSeekV3 method only as
flashinfer documents it; kept to its default), the other methods.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from . import Coverage, Deviation, Impl, NotCovered, need_cuda, not_run, resolve_renormalize


def routing_method(method: str, renorm: bool):
    """flashinfer's RoutingMethodType name for a SPEC method (None: not covered)."""
    if method == "softmax_topk":
        return "RenormalizeNaive" if renorm else "Default"
    return {"topk_softmax": "Renormalize", "sigmoid_bias": "DeepSeekV3", "grouped_sigmoid_bias": "DeepSeekV3",
            "llama4": "Llama4"}.get(method)


def make_route(P):
    """P.trtllm_gen_routing and P.RoutingMethodType (the real flashinfer.fused_moe, or a fake)."""
    def route(logits, top_k, method, *, bias=None, n_group=1, topk_group=1, scaling=1.0, renormalize=None,
              norm_eps=None):
        renorm = resolve_renormalize(method, renormalize)
        if norm_eps is not None and norm_eps != 1e-20:
            raise NotCovered("flashinfer's routing has no norm_eps")
        name = routing_method(method, renorm)
        kind = getattr(P.RoutingMethodType, name, None) if name else None
        if kind is None:
            raise NotCovered(f"method {method!r} (RoutingMethodType.{name} not in this flashinfer)" if name
                             else f"method {method!r}")
        if method in ("softmax_topk", "topk_softmax", "llama4") and scaling != 1.0:
            raise NotCovered("routed scaling with a softmax / Llama4 method")
        if method in ("sigmoid_bias", "grouped_sigmoid_bias") and not renorm:
            raise NotCovered("the DeepSeekV3 method without its sum normalization")
        x = logits if logits.dtype in (torch.float32, torch.bfloat16) else logits.float()
        grouped = method == "grouped_sigmoid_bias"
        res = P.trtllm_gen_routing(x.contiguous(), None if bias is None else bias.float().contiguous(), kind, top_k,
                                   n_group=n_group if grouped else 0, topk_group=topk_group if grouped else 0,
                                   routed_scaling_factor=float(scaling), norm_topk_prob=renorm)
        return res.topk_weights.float(), res.topk_ids.to(torch.int32)
    return route


DEVIATIONS = [
    Deviation("ids_from_permutation", ("route",),
              "trtllm_gen_routing's topk_ids are rebuilt from the permuted layout (flashinfer documents that the "
              "routing kernels never emit ids directly): the top-K as a set, slot order not documented",
              unordered_ids=True),
]

COVERS = {"route": Coverage(
    "softmax_topk, topk_softmax, sigmoid_bias / grouped_sigmoid_bias (DeepSeekV3: SigmoidBias + ScaledSumNormalize, "
    "seed 004's kernel) and llama4, through trtllm_gen_routing",
    profiles=({"method": "sigmoid_bias", "norm_eps": None, "renormalize": None},
              {"method": "sigmoid_bias", "E": 896, "K": 16, "norm_eps": None, "renormalize": None},
              {"method": "grouped_sigmoid_bias", "norm_eps": None, "renormalize": None},
              {"method": "softmax_topk", "scaling": 1.0, "norm_eps": None},
              {"method": "topk_softmax", "scaling": 1.0, "norm_eps": None},
              {"method": "llama4", "scaling": 1.0, "norm_eps": None}))}


def make_impl(P, version: str = "", backends=("cuda",)) -> Impl:
    return Impl("flashinfer", ops=SimpleNamespace(route=make_route(P)), version=version, covers=dict(COVERS),
                deviations=list(DEVIATIONS), backends=tuple(backends),
                notes="declarations from flashinfer's documentation; the first GPU run measures them")


def load() -> Impl:
    gone = need_cuda("flashinfer")
    if gone is not None:
        return gone
    try:
        import flashinfer
        from flashinfer.fused_moe import RoutingMethodType, trtllm_gen_routing
    except Exception as e:
        return not_run("flashinfer", ImportError(f"flashinfer (with trtllm_gen_routing) not installed: "
                                                 f"{type(e).__name__}: {e}"))
    P = SimpleNamespace(trtllm_gen_routing=trtllm_gen_routing, RoutingMethodType=RoutingMethodType)
    return make_impl(P, version=f"flashinfer {getattr(flashinfer, '__version__', '?')}")
