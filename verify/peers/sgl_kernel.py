"""sgl-kernel's MoE routing (SGLang's CUDA kernels) as an implementation of route.

Runs where a GPU and sgl_kernel exist (scripts/gpu_check.sh); unit-tested here against a fake
(tests/test_peers.py). Entry points:

  softmax_topk          sgl_kernel.topk_softmax(topk_weights, topk_ids, gating_output, renormalize):
                        writes f32 weights and int32 ids into the given buffers; older releases
                        take a token_expert_indices buffer after topk_ids (the adapter passes one
                        when the function's signature has it)
  grouped_sigmoid_bias  sgl_kernel.moe_fused_gate(input, bias, num_expert_group, topk_group, topk,
                        num_fused_shared_experts=0, routed_scaling_factor): DeepSeek-V3's routing,
                        always renormalized, then scaled; the kernel's documented limits: E a power of
                        two, E / n_group <= 32 (not covered outside)

Not covered: the other methods, scaling with softmax_topk, norm_eps, grouped_sigmoid_bias without
its normalization.
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch

from . import Coverage, Deviation, Impl, NotCovered, need_cuda, not_run, resolve_renormalize


def make_route(P):
    """P.topk_softmax and P.moe_fused_gate (the real sgl_kernel, or a fake)."""
    try:
        with_indices = "token_expert_indices" in inspect.signature(P.topk_softmax).parameters
    except (TypeError, ValueError):
        with_indices = False

    def route(logits, top_k, method, *, bias=None, n_group=1, topk_group=1, scaling=1.0, renormalize=None,
              norm_eps=None):
        renorm = resolve_renormalize(method, renormalize)
        if norm_eps is not None and norm_eps != 1e-20:
            raise NotCovered("sgl-kernel's routing has no norm_eps")
        T, E = logits.shape
        if method == "softmax_topk":
            if scaling != 1.0:
                raise NotCovered("topk_softmax has no routed scaling factor")
            w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
            ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
            x = logits.float().contiguous()
            if with_indices:
                P.topk_softmax(w, ids, torch.empty_like(ids), x, renorm)
            else:
                P.topk_softmax(w, ids, x, renorm)
            return w, ids
        if method == "grouped_sigmoid_bias":
            if not renorm:
                raise NotCovered("moe_fused_gate always renormalizes")
            if E & (E - 1) or E // n_group > 32:
                raise NotCovered(f"moe_fused_gate needs E a power of two and E / n_group <= 32 (E {E}, n_group "
                                 f"{n_group})")
            w, ids = P.moe_fused_gate(logits.float().contiguous(), bias.float().contiguous(), n_group, topk_group,
                                      top_k, num_fused_shared_experts=0, routed_scaling_factor=float(scaling))
            return w.float(), ids.to(torch.int32)
        raise NotCovered(f"method {method!r}")
    return route


DEVIATIONS = [
    Deviation("fused_gate_ids_unsorted", ("route",),
              "moe_fused_gate writes the K experts in the order its warp reduction finds them; SGLang does not "
              "document a slot order: ids compared as a set", unordered_ids=True,
              when=lambda case: case.args[2] == "grouped_sigmoid_bias"),
]

COVERS = {"route": Coverage(
    "softmax_topk (topk_softmax, scaling 1) and grouped_sigmoid_bias (moe_fused_gate: E a power of two, "
    "E / n_group <= 32, renormalized)",
    profiles=({"method": "softmax_topk", "scaling": 1.0, "norm_eps": None, "logits_dtype": "float32"},
              {"method": "grouped_sigmoid_bias", "E": 256, "n_group": 8, "norm_eps": None, "renormalize": None},
              {"method": "grouped_sigmoid_bias", "E": 64, "n_group": 4, "norm_eps": None, "renormalize": None}))}


def make_impl(P, version: str = "", backends=("cuda",)) -> Impl:
    return Impl("sgl-kernel", ops=SimpleNamespace(route=make_route(P)), version=version, covers=dict(COVERS),
                deviations=list(DEVIATIONS), backends=tuple(backends),
                notes="declarations from sgl-kernel's code and documentation; the first GPU run measures them")


def load() -> Impl:
    gone = need_cuda("sgl-kernel")
    if gone is not None:
        return gone
    try:
        import sgl_kernel
        P = SimpleNamespace(topk_softmax=sgl_kernel.topk_softmax, moe_fused_gate=sgl_kernel.moe_fused_gate)
    except Exception as e:
        return not_run("sgl-kernel", ImportError(f"sgl-kernel not installed: {type(e).__name__}: {e}"))
    return make_impl(P, version=f"sgl-kernel {getattr(sgl_kernel, '__version__', '?')}")
