"""zentorch's fused MoE (AMD ZenDNN, `make peers`) as an implementation of our contract.

Entry point (what vLLM calls on a Zen CPU, vllm/model_executor/layers/fused_moe/experts/
cpu_moe.py): torch.ops.zentorch.zentorch_fused_moe(out, x, w13, w2, w13_bias, w2_bias,
topk_weights, topk_ids, skip_weighted, act): bf16 weights in our standard layout (no
prepack), act "silu" or "swigluoai" (gate/up interleaved, as SPEC's swiglu_oai).

Where the CPU refuses the kernel (its ZenDNN GEMMs check the ISA, e.g. "AVX512_BF16 ISA not
supported by processor, cannot perform bf16bf16f32 gemm"; not seen here, where the CPU has
AVX512_BF16), load() sees it on one small valid call (`refusal`) and fused_experts is UNAVAILABLE
with the kernel's message instead of a cell of errors; zentorch having no other op, it is then
not run as a whole, with that reason.

Not covered: route (zentorch has no router), fp8_block / mxfp4 (its w13_scales/w2_scales
are per-channel int formats, not SPEC's), apply_router_weight_on_input (vLLM applies it
outside, to the input), alpha/limit other than GPT-OSS's.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from . import Coverage, Deviation, Impl, NotCovered, bf16_moe_activation, not_in_build, not_run


def make_fused_experts(Z):
    def fused_experts(x, w13, w2, topk_weights, topk_ids, *, quant, w13_scale=None, w2_scale=None, w13_bias=None,
                      w2_bias=None, activation="silu", alpha=1.702, limit=7.0, dispatch="auto",
                      apply_router_weight_on_input=False):
        act = bf16_moe_activation(quant, activation, alpha, limit, apply_router_weight_on_input)
        ids = topk_ids.to(torch.int32)
        active = torch.unique(ids[(ids >= 0) & (ids < w13.shape[0])]).numel()
        if active < 2:   # the kernel's own documented limit (its error: "requires at least 2 active experts")
            raise NotCovered("zentorch_fused_moe needs at least 2 active experts (T = 0 and single-expert batches "
                             "are refused by the kernel)")
        out = torch.empty(x.shape, dtype=x.dtype)
        Z.zentorch_fused_moe(out, x.contiguous(), w13.contiguous(), w2.contiguous(),
                             None if w13_bias is None else w13_bias.to(torch.bfloat16).contiguous(),
                             None if w2_bias is None else w2_bias.to(torch.bfloat16).contiguous(),
                             topk_weights.float().contiguous(), topk_ids.to(torch.int32).contiguous(), False, act)
        return out
    return fused_experts


DEVIATIONS = [
    Deviation("biases_bf16", ("fused_experts",),
              "expert biases are passed to the kernel in bf16 (SPEC takes f32 or bf16 biases); an f32 bias is "
              "rounded to bf16 by the adapter: declared tolerance x 2 when a bias is f32", tol_factor=2.0,
              when=lambda case: case.kwargs.get("w13_bias") is not None
              and case.kwargs["w13_bias"].dtype == torch.float32),
]


def refusal(Z):
    """The kernel's message when it refuses a small valid bf16 call on this CPU (an error that
    says something is not supported, e.g. "AVX512_BF16 ISA not supported by processor"), else
    None. Any other error is left to the cells, where it is a failure with a repro."""
    g = torch.Generator().manual_seed(0)
    E, H, I, T = 4, 64, 32, 3
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 8).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / 6).bfloat16()
    try:
        Z.zentorch_fused_moe(torch.empty_like(x), x, w13, w2, None, None, torch.full((T, 2), 0.5),
                             torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32), False, "silu")
    except Exception as e:
        from .probe import _message      # first line, no absolute path of the machine zentorch was built on
        msg = _message(e)
        if "not supported" in msg.lower():
            return msg
    return None


def make_impl(Z, version: str = "") -> Impl:
    """The Impl over the op namespace Z (torch.ops.zentorch in load(), a fake in the tests)."""
    gone = not_in_build(Z, ("zentorch_fused_moe",), prefix="torch.ops.zentorch")
    if gone is None:
        why = refusal(Z)
        gone = None if why is None else f"refused on this CPU (a valid bf16 call): {why}"
    if gone:   # its only op: not run, with the reason (Impl.__post_init__)
        return Impl("zentorch", ops=SimpleNamespace(), version=version, unavailable={"fused_experts": gone})
    covers = {"fused_experts": Coverage(
        "bf16 weights, silu and swiglu_oai (GPT-OSS alpha/limit); not fp8_block / mxfp4, not "
        "apply_router_weight_on_input",
        profiles=({"quant": "bf16", "on_input": False, "big": False},))}
    return Impl("zentorch", ops=SimpleNamespace(fused_experts=make_fused_experts(Z)), version=version, covers=covers,
                deviations=list(DEVIATIONS), bad_inputs=lambda: bad_inputs(Z))


def load() -> Impl:
    try:
        import zentorch
    except Exception as e:
        return not_run("zentorch", ImportError(f"zentorch not installed (make peers): {type(e).__name__}: {e}"))
    return make_impl(getattr(torch.ops, "zentorch", SimpleNamespace()),
                     version=f"zentorch {getattr(zentorch, '__version__', '?')}")


def bad_inputs(Z):
    g = torch.Generator().manual_seed(0)
    E, H, I, T, K = 4, 64, 32, 3, 2
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 8).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / 6).bfloat16()
    tw = torch.rand(T, K, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)

    def moe(**over):
        a = dict(x=x, w13=w13, w2=w2, tw=tw, ids=ids)
        a.update(over)

        def thunk():
            out = torch.empty(a["x"].shape, dtype=torch.bfloat16)
            Z.zentorch_fused_moe(out, a["x"], a["w13"], a["w2"], None, None, a["tw"], a["ids"], False, "silu")
            return out
        return thunk

    big_ids = ids.clone()
    big_ids[1, 1] = 1 << 20
    neg_ids = ids.clone()
    neg_ids[0, 0] = -1
    return [
        ("fused_experts: an expert id = E", moe(ids=torch.tensor([[0, 4], [2, 3], [1, 2]], dtype=torch.int32))),
        ("fused_experts: an expert id = 2^20", moe(ids=big_ids)),
        ("fused_experts: an expert id = -1 (SPEC: skipped)", moe(ids=neg_ids)),
        ("fused_experts: topk_ids int64", moe(ids=ids.long())),
        ("fused_experts: x f32", moe(x=x.float())),
        ("fused_experts: H mismatch (x has H-32)", moe(x=x[:, :H - 32].contiguous())),
    ]
