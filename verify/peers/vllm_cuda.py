"""vLLM's CUDA MoE routing and experts (a CUDA build of vllm) as an implementation of our contract.

Runs where a GPU and a CUDA vllm exist (scripts/gpu_check.sh); here it is unit-tested against a
fake peer (tests/test_peers.py). Entry points (vllm/model_executor/layers/fused_moe/router/
fused_topk_router.py, grouped_topk_router.py, fused_moe.py):

  route  softmax_topk, sigmoid_topk  fused_topk(hidden_states, gating_output, topk, renormalize,
                                     scoring_func="softmax" | "sigmoid"): the _moe_C.topk_softmax /
                                     topk_sigmoid kernels; hidden_states only gives the token count
                                     (the logits are passed for it); weights f32, ids int32
         sigmoid_bias,               fused_grouped_topk(..., e_score_correction_bias=bias (f32),
         grouped_sigmoid_bias        num_expert_group, topk_group, scoring_func="sigmoid",
                                     routed_scaling_factor): the _moe_C.grouped_topk kernel that
                                     vLLM's grouped_topk takes for n_group <= 32, K <= 32 with a bias
                                     (sigmoid_bias: one group)
         grouped_softmax             grouped_topk(..., scoring_func="softmax", no bias): vLLM's
                                     PyTorch code (torch.topk(sorted=False) unless
                                     VLLM_BATCH_INVARIANT), called without its torch.compile wrapper
  fused_experts  bf16                fused_experts(x, w13, w2, topk_weights, topk_ids, activation,
                                     apply_router_weight_on_input): the Triton fused MoE, weights in
                                     our layout ([E, 2I, H], [E, H, I]), "silu" or "swigluoai" (gate/up
                                     interleaved, as SPEC's swiglu_oai; alpha 1.702, limit 7.0 fixed)

Not covered (NotCovered): the other methods, scaling with the ungrouped routers, norm_eps, fp8_block
and mxfp4 (vLLM's CUDA fp8 block path quantizes the activations to fp8 too: another contract),
expert biases (passed through a quant config, not adapted), ids of -1, the weight on the input with
K > 1 (vLLM allows it only for K = 1).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from . import Coverage, Deviation, Impl, NotCovered, need_cuda, not_run, resolve_renormalize


def make_route(P):
    """P: the peer's entry points (fused_topk, fused_grouped_topk, grouped_topk)."""
    def route(logits, top_k, method, *, bias=None, n_group=1, topk_group=1, scaling=1.0, renormalize=None,
              norm_eps=None):
        renorm = resolve_renormalize(method, renormalize)
        if norm_eps is not None and norm_eps != 1e-20:
            raise NotCovered("vLLM's routers have no norm_eps")
        if method in ("softmax_topk", "sigmoid_topk"):
            if scaling != 1.0:
                raise NotCovered("fused_topk has no routed scaling factor")
            w, ids, _ = P.fused_topk(logits, logits, top_k, renorm,
                                     scoring_func="softmax" if method == "softmax_topk" else "sigmoid")
            return w.float(), ids.to(torch.int32)
        if method in ("sigmoid_bias", "grouped_sigmoid_bias"):
            ng, tg = (n_group, topk_group) if method == "grouped_sigmoid_bias" else (1, 1)
            if ng > 32 or top_k > 32:
                raise NotCovered("the fused grouped_topk kernel takes n_group <= 32 and K <= 32")
            w, ids = P.fused_grouped_topk(logits, logits, top_k, renorm, bias.float().contiguous(),
                                          num_expert_group=ng, topk_group=tg, scoring_func="sigmoid",
                                          routed_scaling_factor=float(scaling))
            return w.float(), ids.to(torch.int32)
        if method == "grouped_softmax":
            w, ids = P.grouped_topk(logits, logits, top_k, renorm, num_expert_group=n_group, topk_group=topk_group,
                                    scoring_func="softmax", routed_scaling_factor=float(scaling),
                                    e_score_correction_bias=None)
            return w.float(), ids.to(torch.int32)
        raise NotCovered(f"method {method!r}")
    return route


def make_fused_experts(P):
    """P.fused_experts and P.activation(name) -> vLLM's MoEActivation."""
    def fused_experts(x, w13, w2, topk_weights, topk_ids, *, quant, w13_scale=None, w2_scale=None, w13_bias=None,
                      w2_bias=None, activation="silu", alpha=1.702, limit=7.0, dispatch="auto",
                      apply_router_weight_on_input=False):
        if quant != "bf16":
            raise NotCovered(f"quant {quant!r} (vLLM's CUDA fp8 block path quantizes the activations too)")
        if w13_bias is not None or w2_bias is not None:
            raise NotCovered("expert biases (vLLM passes them through a quant config; not adapted)")
        act = {"silu": "silu", "swiglu_oai": "swigluoai"}.get(activation)
        if act is None or (act == "swigluoai" and (alpha != 1.702 or limit != 7.0)):
            raise NotCovered(f"activation {activation!r} with alpha {alpha}, limit {limit}")
        if apply_router_weight_on_input and topk_ids.shape[1] != 1:
            raise NotCovered("apply_router_weight_on_input with K > 1 (vLLM takes it for K = 1 only)")
        if topk_ids.numel() and bool((topk_ids < 0).any()):
            raise NotCovered("ids of -1 (vLLM maps non-local experts through an expert_map, not adapted)")
        return P.fused_experts(x.contiguous(), w13.contiguous(), w2.contiguous(), topk_weights.float().contiguous(),
                               topk_ids.to(torch.int32).contiguous(), activation=P.activation(act),
                               apply_router_weight_on_input=bool(apply_router_weight_on_input))
    return fused_experts


DEVIATIONS = [
    Deviation("grouped_softmax_ids_unsorted", ("route",),
              "grouped_softmax runs vLLM's PyTorch grouped_topk, whose torch.topk(sorted=False) returns the top-K "
              "as a set (read in the code; the CUDA kernels' slot order is measured, not declared)",
              unordered_ids=True, when=lambda case: case.args[2] == "grouped_softmax"),
]

COVERS = {
    "route": Coverage(
        "softmax_topk and sigmoid_topk (fused_topk, scaling 1), sigmoid_bias and grouped_sigmoid_bias (the fused "
        "grouped_topk kernel, n_group <= 32), grouped_softmax (vLLM's PyTorch grouped_topk)",
        profiles=({"method": "softmax_topk", "scaling": 1.0, "norm_eps": None},
                  {"method": "sigmoid_topk", "scaling": 1.0, "norm_eps": None},
                  {"method": "sigmoid_bias", "norm_eps": None},
                  {"method": "grouped_sigmoid_bias", "norm_eps": None},
                  {"method": "grouped_softmax", "norm_eps": None})),
    "fused_experts": Coverage(
        "bf16 weights, silu and swiglu_oai (GPT-OSS alpha/limit), no expert biases, the weight on the input at K = 1",
        profiles=({"quant": "bf16", "bias": "none", "on_input": False},)),
}


def make_impl(P, version: str = "", backends=("cuda",)) -> Impl:
    """The Impl over the peer's entry points P (the real vllm in load(), a fake in the tests)."""
    return Impl("vllm-cuda", ops=SimpleNamespace(route=make_route(P), fused_experts=make_fused_experts(P)),
                version=version, covers=dict(COVERS), deviations=list(DEVIATIONS), backends=tuple(backends),
                notes="the GPU peers' declarations come from their code and documentation; the first GPU run "
                      "measures them")


def load() -> Impl:
    gone = need_cuda("vllm-cuda")
    if gone is not None:
        return gone
    try:
        import vllm
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
        from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
        from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import fused_grouped_topk, grouped_topk
    except Exception as e:
        return not_run("vllm-cuda", ImportError(f"a CUDA build of vllm is not installed: {type(e).__name__}: {e}"))
    if not hasattr(torch.ops, "_moe_C") or not hasattr(torch.ops._moe_C, "topk_softmax"):
        return not_run("vllm-cuda", RuntimeError("torch.ops._moe_C.topk_softmax not registered (not a CUDA build)"))
    P = SimpleNamespace(fused_topk=fused_topk, fused_grouped_topk=fused_grouped_topk,
                        grouped_topk=getattr(grouped_topk, "_torchdynamo_orig_callable", grouped_topk),
                        fused_experts=fused_experts, activation=MoEActivation)
    return make_impl(P, version=f"vllm {vllm.__version__}")
