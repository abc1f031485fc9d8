"""reference.moe.moe_forward as the whole layer (SPEC 6): router bias, shared experts, the
float64 exact mode, prepacked weights through ops=optimized, and its errors.

Each expected value is built from the ops one at a time (or by hand in float64), never by
calling moe_forward itself.
"""
from __future__ import annotations

import types

import pytest
import torch

import reference as R
from reference.moe import SharedExpert, moe_forward
from reference.quant import round_to_bf16

H, I, E, S = 64, 32, 6, 48


def _weights(seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(dtype)
    router = torch.randn(E, H, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    s13 = (torch.randn(1, 2 * S, H, generator=g) * H ** -0.5).to(dtype)
    s2 = (torch.randn(1, H, S, generator=g) * S ** -0.5).to(dtype)
    gate = torch.randn(1, H, generator=g, dtype=router.dtype)
    rbias = torch.randn(E, generator=g, dtype=router.dtype)
    x = torch.randn(7, H, generator=g).to(dtype)
    return x, router, w13, w2, s13, s2, gate, rbias


@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert_is_a_one_expert_fused_experts_added_once(gated):
    x, router, w13, w2, s13, s2, gate, _ = _weights(1)
    shared = SharedExpert(s13, s2, gate=gate if gated else None)
    got = moe_forward(x, router, w13, w2, top_k=2, shared=shared)

    w, ids = R.route(R.router_gemm(x, router), 2, "softmax_topk")
    routed = R.fused_experts(x, w13, w2, w, ids, quant="bf16")
    if gated:
        g = torch.sigmoid(x.double() @ gate.double().T).float()       # exact sigmoid, rounded once
    else:
        g = torch.ones(7, 1)
    sh = R.fused_experts(x, s13, s2, g, torch.zeros(7, 1, dtype=torch.int32), quant="bf16")
    want = round_to_bf16(routed.double() + sh.double())
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(got, routed)                                # the shared part is there


def test_router_bias_is_added_to_the_logits_before_route():
    x, router, w13, w2, _, _, _, rbias = _weights(2)
    got = moe_forward(x, router, w13, w2, top_k=2, method="topk_softmax", router_bias=rbias)
    logits = R.router_gemm(x, router) + rbias
    w, ids = R.route(logits, 2, "topk_softmax")
    want = R.fused_experts(x, w13, w2, w, ids, quant="bf16")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # and it matters: without it the experts differ for some token
    _, ids0 = R.route(R.router_gemm(x, router), 2, "topk_softmax")
    assert not torch.equal(ids, ids0)


def test_exact_mode_is_the_unrounded_layer_in_float64():
    """float64 everything: the layer equals a by-hand float64 evaluation to ~1e-14."""
    x, router, w13, w2, s13, s2, gate, rbias = _weights(3, torch.float64)
    got = moe_forward(x, router, w13, w2, top_k=2, method="softmax_topk", renormalize=True, scaling=2.5,
                      router_bias=rbias, shared=SharedExpert(s13, s2, gate=gate))
    assert got.dtype == torch.float64
    logits = x @ router.T + rbias
    p = torch.softmax(logits, -1)
    top, ids = p.topk(2, dim=-1)
    top = top / top.sum(-1, keepdim=True) * 2.5
    want = torch.zeros_like(x)
    silu = torch.nn.functional.silu
    for t in range(x.shape[0]):
        for j in range(2):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            want[t] += top[t, j] * (w2[e] @ (silu(h[:I]) * h[I:]))
        h = s13[0] @ x[t]
        want[t] += torch.sigmoid(gate[0] @ x[t]) * (s2[0] @ (silu(h[:S]) * h[S:]))
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_exact_mode_apply_router_weight_on_input():
    x, router, w13, w2, *_ = _weights(4, torch.float64)
    got = moe_forward(x, router, w13, w2, top_k=1, method="llama4", apply_router_weight_on_input=True)
    logits = x @ router.T
    ids = logits.argmax(-1)
    want = torch.stack([w2[e] @ (lambda h: torch.nn.functional.silu(h[:I]) * h[I:])(
        w13[e] @ (x[t] * torch.sigmoid(logits[t, e]))) for t, e in enumerate(ids.tolist())])
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_optimized_ops_take_prepacked_weights_for_routed_and_shared():
    import optimized
    x, router, w13, w2, s13, s2, gate, _ = _weights(5)
    plain = moe_forward(x, router, w13, w2, top_k=2, shared=SharedExpert(s13, s2, gate=gate), ops=optimized)
    packed = optimized.prepack_moe_weights(w13, w2, "bf16")
    spacked = optimized.prepack_moe_weights(s13, s2, "bf16")
    got = moe_forward(x, router, packed, None, top_k=2, shared=SharedExpert(spacked, None, gate=gate),
                      ops=optimized)
    assert torch.equal(got.view(torch.int16), plain.view(torch.int16))


def test_the_new_keywords_reach_only_ops_that_need_them():
    """An ops namespace written against the old signatures still composes the old layers."""
    seen = {}

    def route(logits, top_k, method, **kw):
        seen["route"] = kw
        return R.route(logits, top_k, method, **kw)

    def fused(*a, **kw):
        seen["fused"] = kw
        return R.fused_experts(*a, **kw)

    ops = types.SimpleNamespace(router_gemm=R.router_gemm, route=route, fused_experts=fused)
    x, router, w13, w2, *_ = _weights(6)
    moe_forward(x, router, w13, w2, top_k=2, ops=ops)
    assert "norm_eps" not in seen["route"] and "apply_router_weight_on_input" not in seen["fused"]
    moe_forward(x, router, w13, w2, top_k=2, method="sigmoid_topk", norm_eps=1e-6, ops=ops)
    assert seen["route"]["norm_eps"] == 1e-6


@pytest.mark.parametrize("bad,arg", [
    (dict(router_bias=torch.zeros(E + 1)), "router_bias"),
    (dict(router_bias=torch.zeros(E, dtype=torch.float16)), "router_bias"),
    (dict(shared="mlp"), "shared"),
    (dict(shared="two experts"), "shared"),
    (dict(shared="gate of other H"), "shared"),
    (dict(shared="bad quant"), "shared"),
    (dict(w13="not a tensor"), "w13"),
])
def test_bad_layer_arguments_name_the_argument(bad, arg):
    x, router, w13, w2, s13, s2, gate, _ = _weights(7)
    kw = dict(top_k=2)
    kw.update(bad)
    if kw.get("shared") == "two experts":
        kw["shared"] = SharedExpert(torch.cat([s13, s13]), torch.cat([s2, s2]))
    elif kw.get("shared") == "gate of other H":
        kw["shared"] = SharedExpert(s13, s2, gate=torch.zeros(1, H + 1))
    elif kw.get("shared") == "bad quant":
        kw["shared"] = SharedExpert(s13, s2, quant="int4")
    if kw.get("w13") == "not a tensor":
        w13 = kw.pop("w13")
    with pytest.raises(ValueError, match=rf"^moe_forward: argument '{arg}'"):
        moe_forward(x, router, w13, w2, **kw)
