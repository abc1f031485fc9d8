"""fused_experts (SPEC 5 and 6): the expert MLPs with bf16, FP8-block and MXFP4 weights.
Cases over formats, sizes (tile tails, a few big H), activations, biases, dispatch policies
and the router weight on the input; judged by verify.tolerance's rule against an f64 truth
and the eager bf16 pipeline; every dispatch policy must give the same bits (`variants`)."""
from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from reference.fused_experts import fused_experts as ref_fused_experts
from reference.quant import quantize_fp8_block, quantize_mxfp4
from reference.route import route as ref_route

from .. import distributions as D
from .. import tolerance as tol
from .common import (NO_NAN, CallSpec, Case, OpInfo, Picker, TensorRule, _arith_result, _cap_tokens, _common,
                     _noncontig, _shape_check, _tokens)

QUANTS = ("bf16", "fp8_block", "mxfp4")
ACTIVATIONS = ("silu", "swiglu_oai")
DISPATCHES = ("auto", "tiny", "blocked", "global", "per_block")

_HI_MX = (32, 64, 96, 128, 160, 256, 384, 512)
_HI_ANY = (8, 24, 40, 100, 130, 200) + _HI_MX
_HI_BIG = (1024, 2048)


def _draw_experts_common(p: Picker, dist: str, max_e=64):
    quant = p("quant", st.sampled_from(QUANTS))
    sizes = _HI_MX if quant == "mxfp4" else _HI_ANY
    big = p("big", st.sampled_from((False,) * 24 + (True,)))
    H = p("H", st.sampled_from(_HI_BIG if big else sizes))
    I = p("I", st.sampled_from(sizes))
    E = p("E", st.sampled_from(tuple(e for e in (1, 2, 3, 4, 6, 8, 16, 32, 64) if e <= max_e)))
    return {"quant": quant, "H": H, "I": I, "E": E, "big": big,
            "activation": p("activation", st.sampled_from(ACTIVATIONS)),
            "dispatch": p("dispatch", st.sampled_from(DISPATCHES)),
            # SPEC 6: the router weight scales the expert input (Llama 4), a third of the cases
            "on_input": bool(p("on_input", st.sampled_from((False, False, True))))}


def _draw_fused_experts(draw, dist, fixed):
    p = Picker(draw, fixed)
    s = _draw_experts_common(p, dist)
    E = s["E"]
    s["E_global"] = E + p("E_extra", st.sampled_from((1, 3, 8))) if dist == "ep_shard" else E
    kmax = min(s["E_global"], 8)
    if dist == "empty_experts":
        kmax = min(kmax, s["E_global"] - s["E_global"] // 2)
    s["K"] = p("K", st.integers(1, kmax))
    s["bias"] = p("bias", st.sampled_from(("none", "none", "float32", "bfloat16")))
    s["T"] = _tokens(p)
    if s["E"] * 3 * s["H"] * s["I"] > 3e6:        # keep the weights (and their quantization) small
        s["E"] = max(1, int(3e6 // (3 * s["H"] * s["I"])))
        s["E_global"] = s["E"] + (s["E_global"] - E) if dist == "ep_shard" else s["E"]
        s["K"] = min(s["K"], s["E_global"] - (s["E_global"] // 2 if dist == "empty_experts" else 0))
    s["T"] = _cap_tokens(s["T"], s["K"] * 3 * s["H"] * s["I"], 1.5e8)
    s.update(_common(p, dist))
    return s


def make_expert_weights(s: dict, g: torch.Generator, E: int):
    """w13, w2 (+ scales, biases) of one format, from f32 weights with per-128-row-block
    magnitudes (so fp8 blocks get different scales and an off-by-one scale shows)."""
    H, I, quant = s["H"], s["I"], s["quant"]

    def weight(n, k):
        w = torch.randn(E, n, k, generator=g) / math.sqrt(k)
        nb = -(-n // 128)
        f = torch.exp2(torch.randint(-2, 3, (E, nb, 1), generator=g).float())
        f = f.repeat_interleave(128, dim=1)[:, :n]
        kb = -(-k // 128)
        fk = torch.exp2(torch.randint(-1, 2, (E, 1, kb), generator=g).float()).repeat_interleave(128, dim=2)[:, :, :k]
        return w * f * fk
    w13f, w2f = weight(2 * I, H), weight(H, I)
    kw = {}
    if quant == "bf16":
        w13, w2 = w13f.bfloat16(), w2f.bfloat16()
    elif quant == "fp8_block":
        w13, kw["w13_scale"] = quantize_fp8_block(w13f)
        w2, kw["w2_scale"] = quantize_fp8_block(w2f)
    else:
        w13, kw["w13_scale"] = quantize_mxfp4(w13f)
        w2, kw["w2_scale"] = quantize_mxfp4(w2f)
    if s.get("bias", "none") != "none":
        bdt = D.DTYPES[s["bias"]]
        kw["w13_bias"] = (torch.randn(E, 2 * I, generator=g) * 0.5).to(bdt)
        kw["w2_bias"] = (torch.randn(E, H, generator=g) * 0.5).to(bdt)
    return w13, w2, kw


def _expert_x(s, g, T, H):
    x = torch.randn(T, H, generator=g)
    if s["activation"] == "swiglu_oai" and T:
        big = torch.rand(T, generator=g) < 0.4     # h beyond the clamp limit for some tokens
        x[big] *= 8.0
    return x.bfloat16()


def _make_fused_experts(s):
    T, K = s["T"], s["K"]
    r = D.make_routing(s["dist"], T, s["E_global"], K, s["seed"], D.dist_params(s["dist"], s["dchoice"]) |
                       ({"n_local": s["E"]} if s["dist"] == "ep_shard" else {}))
    if s.get("on_input"):   # Llama 4's routing: sigmoid weights, not renormalized (not all 1.0 at K = 1)
        w_route, ids = ref_route(r.logits, K, "sigmoid_topk", renormalize=False)
    else:
        w_route, ids = ref_route(r.logits, K, "softmax_topk", renormalize=True)
    ids = r.local_ids if s["dist"] == "ep_shard" else ids
    g = D.generator(s["seed"] + 3)
    x = _expert_x(s, g, T, s["H"])
    w13, w2, kw = make_expert_weights(s, g, s["E"])
    kw.update(topk_weights=w_route.contiguous(), topk_ids=ids.to(torch.int32).contiguous(), quant=s["quant"],
              activation=s["activation"], dispatch=s["dispatch"])
    if s.get("on_input"):
        kw["apply_router_weight_on_input"] = True
    return Case("fused_experts", s, (x, w13, w2), kw)


def _fused_args(case: Case):
    x, w13, w2 = case.args
    kw = dict(case.kwargs)
    return x, w13, w2, kw.pop("topk_weights"), kw.pop("topk_ids"), kw


def _fused_check(y, g, x, w13, w2, tw, ti, kw, keep_ratios=False):
    eager, V, A, Fl = tol.fused_experts_baseline(x, w13, w2, tw, ti, **kw)
    res = tol.arith_check(y, g, eager, V, A, torch.bfloat16, n_floor=tol.gemm_floor(w2.shape[2] * (
        2 if kw.get("quant") == "mxfp4" else 1)), extra=Fl, keep_ratios=keep_ratios)
    return res, (eager, V, A, Fl)


def _compare_fused_experts(out, ref, case, ctx):
    bad = _shape_check(out, ref)
    if bad:
        return bad
    x, w13, w2, tw, ti, kw = _fused_args(case)
    res, _ = _fused_check(out, ref, x, w13, w2, tw, ti, kw)
    return _arith_result(res, "output")


def _fused_gather(case: Case, rows) -> Case:
    kw = dict(case.kwargs)
    kw["topk_weights"] = kw["topk_weights"][rows].contiguous()
    kw["topk_ids"] = kw["topk_ids"][rows].contiguous()
    return Case(case.op, case.structure, (case.args[0][rows].contiguous(),) + tuple(case.args[1:]), kw)


def _fused_variants(case: Case):
    """The case under every dispatch policy: SPEC promises the same bits from each."""
    return [(f"dispatch={d}", Case(case.op, case.structure, case.args, dict(case.kwargs, dispatch=d)))
            for d in DISPATCHES]


def _fused_errors(seed):
    g = D.generator(seed)
    s = {"H": 64, "I": 32, "quant": "fp8_block", "bias": "none"}
    w13, w2, kw = make_expert_weights(s, g, 3)
    s_bf = dict(s, quant="bf16")
    w13b, w2b, _ = make_expert_weights(s_bf, g, 3)
    s_mx = dict(s, quant="mxfp4")
    w13m, w2m, kwm = make_expert_weights(s_mx, g, 3)
    x = torch.randn(4, 64, generator=g).bfloat16()
    tw = torch.rand(4, 2, generator=g)
    ti = torch.randint(0, 3, (4, 2), generator=g, dtype=torch.int32)
    bad = ti.clone()
    bad[0, 0] = 3
    params = {"x": x, "w13": w13, "w2": w2, "topk_weights": tw, "topk_ids": ti, "quant": "fp8_block",
              "w13_scale": kw["w13_scale"], "w2_scale": kw["w2_scale"], "w13_bias": None, "w2_bias": None,
              "activation": "silu", "alpha": 1.702, "limit": 7.0, "dispatch": "auto",
              "apply_router_weight_on_input": False}
    explicit = [
        ("apply_router_weight_on_input not a bool", {"apply_router_weight_on_input": 1},
         ("apply_router_weight_on_input",)),
        ("apply_router_weight_on_input a string", {"apply_router_weight_on_input": "True"},
         ("apply_router_weight_on_input",)),
        ("unknown quant", {"quant": "int4"}, ("quant",)),
        ("unknown activation", {"activation": "gelu"}, ("activation",)),
        ("unknown dispatch", {"dispatch": "fastest"}, ("dispatch",)),
        ("fp8 without w13_scale", {"w13_scale": None}, ("w13_scale",)),
        ("bf16 weights with fp8 quant", {"w13": w13b, "w2": w2b}, ("w13",)),
        ("scale given for bf16", {"quant": "bf16", "w13": w13b, "w2": w2b}, ("w13_scale",)),
        ("w13 not contiguous", {"w13": _noncontig(w13)}, ("w13",)),
        ("w2_scale not contiguous", {"w2_scale": _noncontig(kw["w2_scale"])}, ("w2_scale",)),
        ("topk_ids = E", {"topk_ids": bad}, ("topk_ids",)),
        ("topk_ids int64", {"topk_ids": ti.long()}, ("topk_ids",)),
        ("topk_weights rows != T", {"topk_weights": tw[:3]}, ("topk_weights",)),
        ("topk_ids K != topk_weights K", {"topk_ids": ti[:, :1].contiguous()}, ("topk_ids",)),
        ("x f32", {"x": x.float()}, ("x",)),
        ("mxfp4 with H not a multiple of 32", {"quant": "mxfp4", "x": torch.randn(4, 48, generator=g).bfloat16(),
                                               "w13": w13m[:, :, :24].contiguous(), "w2": w2m,
                                               "w13_scale": kwm["w13_scale"], "w2_scale": kwm["w2_scale"]},
         ("x", "w13")),
        ("alpha inf", {"alpha": float("inf")}, ("alpha",)),
        ("w13_bias wrong shape", {"w13_bias": torch.zeros(3, 63)}, ("w13_bias",)),
        ("w2 I mismatch", {"w2": w2[:, :, :16].contiguous()}, ("w2",)),
    ]
    # float64 x is not a bad dtype for the reference: it is its exact mode (SPEC 6, docs/families.md)
    rules = {"x": TensorRule((torch.float32, torch.float16), dims=(1,), dim_names=("x", "w13", "w2"), device_ref=True),
             "w13": TensorRule((torch.bfloat16, torch.float32), dims=(2,), dim_names=("w13",), contiguous=True),
             "w2": TensorRule((torch.bfloat16, torch.float32), dims=(1, 2), dim_names=("w2",), contiguous=True),
             "topk_weights": TensorRule((torch.float64, torch.bfloat16), dims=(1,),
                                        dim_names=("topk_weights", "topk_ids")),
             "topk_ids": TensorRule((torch.int64, torch.float32), dims=(1,), dim_names=("topk_ids",), index=(-1, 3)),
             "w13_scale": TensorRule((torch.float64, torch.bfloat16), dims=(1, 2), dim_names=("w13_scale",),
                                     contiguous=True),
             "w2_scale": TensorRule((torch.float64, torch.bfloat16), dims=(1, 2), dim_names=("w2_scale",),
                                    contiguous=True)}
    return CallSpec(params, ("x", "w13", "w2", "topk_weights", "topk_ids"), rules, explicit)


ENTRIES = (
    OpInfo("fused_experts", ref_fused_experts, _draw_fused_experts, _make_fused_experts, _compare_fused_experts,
           _fused_errors, dists=NO_NAN, token_gather=_fused_gather,
           invariant_always=("cpu",), variants=_fused_variants, weight=2.0),
)
