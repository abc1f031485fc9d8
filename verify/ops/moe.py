"""moe_forward (SPEC 6): the whole layer, router_gemm -> route -> fused_experts. Routing skew
comes from the router weight (`skew_router`); a token the optimized pipeline routed
differently is judged stage by stage with the three ops' own rules (`_compare_moe`)."""
from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from reference.fused_experts import fused_experts as ref_fused_experts
from reference.moe import moe_forward as ref_moe_forward
from reference.route import route as ref_route
from reference.route import selection_keys
from reference.router_gemm import router_gemm as ref_router_gemm
from reference.validate import BIAS_METHODS, GROUPED_METHODS

from .. import distributions as D
from .. import tolerance as tol
from .common import (NO_NAN, CallSpec, Case, CaseResult, OpInfo, Picker, TensorRule, _arith_result, _cap_tokens,
                     _common, _shape_check, _tokens, _x_gather, to_cpu, to_device)
from .fused_experts import _draw_experts_common, _fused_check, make_expert_weights
from .route import METHODS, RENORM_DRAWS, _compare_route, _draw_groups_and_k
from .router_gemm import _compare_router_gemm

def _draw_moe(draw, dist, fixed):
    p = Picker(draw, fixed)
    s = _draw_experts_common(p, dist, max_e=64)
    method = p("method", st.sampled_from(METHODS))
    E = max(2, s["E"])
    n_group, topk_group, K = _draw_groups_and_k(p, method, E, dist, 8)
    s.update({"E": E, "method": method, "n_group": n_group, "topk_group": topk_group, "K": K,
              "renormalize": p("renormalize", st.sampled_from(RENORM_DRAWS if method != "llama4" else (None, False))),
              "scaling": p("scaling", st.sampled_from((1.0, 2.5))),
              "bias": "none", "T": _tokens(p)})
    if s["E"] * 3 * s["H"] * s["I"] > 3e6:
        s["big"], s["H"] = False, min(s["H"], 512)
        s["E"] = max(2, min(s["E"], int(3e6 // (3 * s["H"] * s["I"]))))
        if method in GROUPED_METHODS and s["E"] % n_group:
            s["n_group"] = s["topk_group"] = 1
        s["K"] = max(1, min(s["K"], s["E"] - (s["E"] // 2 if dist == "empty_experts" else 0),
                            s["topk_group"] * (s["E"] // s["n_group"]) if method in GROUPED_METHODS else 99))
    s["T"] = _cap_tokens(s["T"], s["K"] * 3 * s["H"] * s["I"] + s["E"] * s["H"], 1.5e8)
    s.update(_common(p, dist))
    return s


def skew_router(x: torch.Tensor, W: torch.Tensor, dist: str, params: dict, g: torch.Generator,
                K: int) -> torch.Tensor:
    """Make the routing of tokens x [T, H] through router W [E, H] follow `dist`; modifies x
    in place, returns W (replaced for 'extreme').

    Feature 0 is a constant 1 and feature 1 a per-token flag: the router weight's columns
    0 and 1 then act as per-expert logit offsets, which is how the routing skew is made."""
    T, H = x.shape
    E = W.shape[0]
    if H >= 2 and T:
        x[:, 0] = 1.0
        x[:, 1] = 0.0
    if H >= 2:
        if dist == "zipf":
            ranks = torch.randperm(E, generator=g).float() + 1
            W[:, 0] = -params.get("s", 1.2) * torch.log(ranks) * 2.0
        elif dist == "hot_expert":
            hot = int(torch.randint(E, (1,), generator=g))
            n_hot = int(round(params.get("p", 0.9) * T))
            x[torch.randperm(T, generator=g)[:n_hot], 1] = 1.0
            W[hot, 1] = 30.0
        elif dist == "all_to_one":
            W[torch.randperm(E, generator=g)[:K], 0] = 30.0
        elif dist == "empty_experts":
            W[torch.randperm(E, generator=g)[:min(E // 2, E - K)], 0] = -60.0
        elif dist == "exact_ties":
            W[1::2] = W[0:(E // 2) * 2:2]
        elif dist == "near_ties":
            W[1::2] = W[0:(E // 2) * 2:2]
            W[1::2, 2 % H] = D.ulp_steps(W[1::2, 2 % H], torch.ones_like(W[1::2, 2 % H], dtype=torch.int64))
        elif dist == "extreme":
            W = W * 2.0 ** 12
    return W


def _make_moe(s):
    T, E, H, K = s["T"], s["E"], s["H"], s["K"]
    g = D.generator(s["seed"])
    params = D.dist_params(s["dist"], s["dchoice"])
    x = torch.randn(T, H, generator=g)
    if s["activation"] == "swiglu_oai" and T:
        x[torch.rand(T, generator=g) < 0.4] *= 8.0
    W = torch.randn(E, H, generator=g) / math.sqrt(H) * 2.0
    W = skew_router(x, W, s["dist"], params, g, K)
    dist = s["dist"]
    xb = x.bfloat16()
    if dist == "ep_shard" and T:
        wide = torch.zeros(2 * T, H + 2, dtype=torch.bfloat16)
        wide[0::2, 1:H + 1] = xb
        xb = wide[0::2, 1:H + 1]
    w13, w2, kw = make_expert_weights(s, g, E)
    if s["method"] in BIAS_METHODS:
        kw["bias"] = torch.randn(E, generator=g) * (0.3 if s["method"] != "softmax_bias" else 0.3 / E)
    kw.update(top_k=K, method=s["method"], n_group=s["n_group"], topk_group=s["topk_group"],
              scaling=s["scaling"], renormalize=s["renormalize"], quant=s["quant"],
              activation=s["activation"], dispatch=s["dispatch"])
    if s.get("on_input"):
        kw["apply_router_weight_on_input"] = True
    return Case("moe_forward", s, (xb, W, w13, w2), kw)


def _moe_opt(ops):
    fn = getattr(ops, "moe_forward", None)
    if callable(fn):
        return fn
    if all(callable(getattr(ops, n, None)) for n in ("router_gemm", "route", "fused_experts")):
        def composed(*args, **kwargs):
            return ref_moe_forward(*args, ops=ops, **kwargs)
        composed.__name__ = "moe_forward(ops=optimized)"
        return composed
    return None


_ROUTE_KW = ("bias", "n_group", "topk_group", "scaling", "renormalize", "norm_eps")
_FUSED_KW = ("quant", "w13_scale", "w2_scale", "w13_bias", "w2_bias", "activation", "alpha", "limit", "dispatch",
             "apply_router_weight_on_input")


def _moe_parts(case: Case):
    x, W, w13, w2 = case.args
    kw = case.kwargs
    rkw = {k: kw[k] for k in _ROUTE_KW if k in kw}
    fkw = {k: kw[k] for k in _FUSED_KW if k in kw}
    return x, W, w13, w2, kw["top_k"], kw["method"], rkw, fkw


def _compare_moe(out, ref, case, ctx):
    """The output against the reference layer, token by token, except for tokens the
    optimized pipeline routed differently (other ids, or weights more than 16 ulps off: a
    legitimately different logit can move a sigmoid_bias weight a lot when s is tiny next
    to the 1e-20 in its denominator) or that are over the tolerance: those
    are judged stage by stage (the layer is router_gemm -> route -> fused_experts). Their
    optimized logits must pass router_gemm's rule, the optimized routing of those logits
    must pass route's rule (near-tie flips allowed, exact ties never), and their output must
    pass fused_experts' rule against the reference MLP applied to that routing. Tokens whose
    experts changed are counted as near-tie flips when route itself flipped a near tie (the
    reference routing of the optimized logits agrees with the reference), else as reroutes
    (the logits' tolerated error changed the selection). (The optimized stages are rerun
    on the whole batch, as moe_forward ran them: a dispatcher may choose by T.)"""
    bad = _shape_check(out, ref)
    if bad:
        return bad
    x, W, w13, w2, K, method, rkw, fkw = _moe_parts(case)
    logits = ref_router_gemm(x, W)
    w_r, ids_r = ref_route(logits, K, method, **rkw)
    res, _ = _fused_check(out, ref, x, w13, w2, w_r, ids_r, fkw, keep_ratios=True)
    ops = ctx.ops
    rg = getattr(ops, "router_gemm", None) if ops is not None else None
    rt = getattr(ops, "route", None) if ops is not None else None
    rg = rg if callable(rg) else ref_router_gemm
    rt = rt if callable(rt) else ref_route
    try:
        lo_all = rg(to_device(x, ctx.device), to_device(W, ctx.device))
        w_a, ids_a = to_cpu(rt(lo_all, K, method, **to_device(rkw, ctx.device)))
        lo_all = to_cpu(lo_all)
    except Exception as e:
        if res.ok:
            return CaseResult(True, "ok", ratio=res.ratio, bound=res.bound)
        return _arith_result(res, f"output (and the optimized routing raised {type(e).__name__}: {e})")
    moved_mask = (ids_a != ids_r).any(dim=1) if ids_r.numel() else torch.zeros(0, dtype=torch.bool)
    w_diff = (w_a.double() - w_r.double()).abs() > 16 * tol.ulp(w_r.double().nan_to_num(0.0), torch.float32)
    judge = moved_mask | (res.ratios > 1.0).any(dim=1) | w_diff.any(dim=1)
    if not bool(judge.any()):
        return CaseResult(True, "ok", ratio=res.ratio, bound=res.bound)
    tt = torch.nonzero(judge).reshape(-1)
    xs, lo, w_a, ids_a = x[tt], lo_all[tt], w_a[tt], ids_a[tt]
    stage = _compare_router_gemm(lo, logits[tt], Case("router_gemm", {}, (xs, W), {}), ctx)
    if not stage.ok:
        return _arith_result(res, f"output (the optimized router logits of tokens {tt[:5].tolist()} fail "
                                  f"router_gemm's rule: {stage.message[:300]})")
    stage = _compare_route((w_a, ids_a), ref_route(lo, K, method, **rkw),
                           Case("route", {}, (lo, K, method), dict(rkw)), ctx)
    if not stage.ok:
        return _arith_result(res, f"output (the optimized routing of tokens {tt[:5].tolist()} fails route's rule: "
                                  f"{stage.message[:300]})")
    ws, ids_s = w_a.contiguous(), ids_a.contiguous()
    g_alt = ref_fused_experts(xs, w13, w2, ws, ids_s, **fkw)
    res2, _ = _fused_check(out[tt], g_alt, xs, w13, w2, ws, ids_s, fkw)
    if not res2.ok:
        return _arith_result(res2, f"output of tokens {tt[:5].tolist()} (judged against the reference MLP with "
                                   f"the optimized routing)")
    rest, rest_bounds = res.ratios[~judge], res.bounds[~judge]
    ratio = max(float(rest.max()) if rest.numel() else 0.0, res2.ratio)
    bound = res2.bound if ratio == res2.ratio else tol.BOUNDS[int(rest_bounds.reshape(-1)[int(rest.argmax())])]
    # A moved token is a near-tie flip of route when the reference routing of the optimized
    # logits still picks the reference's experts (the gap is measured on those logits' keys);
    # otherwise the logits themselves (within router_gemm's rule) changed the selection: a
    # reroute, counted apart.
    _, ids_on_opt = ref_route(lo, K, method, **rkw)
    moved, gaps, rerouted = [], [], []
    for i, t in enumerate(tt.tolist()):
        if not bool(moved_mask[t]):
            continue
        if not torch.equal(ids_on_opt[i], ids_r[t]):
            rerouted.append(t)
            continue
        moved.append(t)
        keys = selection_keys(lo[i:i + 1], method, rkw.get("bias"), rkw.get("n_group", 1),
                              rkw.get("topk_group", 1))[0]
        d = ids_a[i] != ids_r[t]
        g = tol.ulp_distance_f32(keys[ids_r[t][d].long()], keys[ids_a[i][d].long()])
        gaps.append(float(g.max()) if g.numel() else 0.0)
    return CaseResult(True, "ok", ratio=ratio, bound=bound if ratio > 0 else "", flips=len(moved), flip_gaps=gaps,
                      reroutes=len(rerouted),
                      message=f"tokens {tt[:10].tolist()} judged stage by stage; near-tie flips {moved[:10]}, "
                              f"rerouted by their logits {rerouted[:10]}")


def _moe_errors(seed):
    g = D.generator(seed)
    s = {"H": 64, "I": 32, "quant": "bf16", "bias": "none"}
    w13, w2, _ = make_expert_weights(s, g, 4)
    x = torch.randn(3, 64, generator=g).bfloat16()
    W = torch.randn(4, 64, generator=g)
    params = {"x": x, "router_weight": W, "w13": w13, "w2": w2, "top_k": 2, "method": "softmax_topk",
              "quant": "bf16"}
    explicit = [
        ("router_weight E != w13 E", {"router_weight": W[:3]}, ("router_weight",)),
        ("top_k > E", {"top_k": 5}, ("top_k",)),
        ("unknown method", {"method": "top1"}, ("method",)),
        ("unknown quant", {"quant": "fp4"}, ("quant",)),
        ("x f32", {"x": x.float()}, ("x",)),
        ("router_weight bf16", {"router_weight": W.bfloat16()}, ("weight", "router_weight")),
    ]
    # float64 x is not a bad dtype for the reference: it is its exact mode (SPEC 6, docs/families.md)
    rules = {"x": TensorRule((torch.float16, torch.int32), device_ref=True),
             "router_weight": TensorRule((torch.float64, torch.int32), dims=(1,),
                                         dim_names=("weight", "router_weight"), aliases=("weight",)),
             "w13": TensorRule((torch.float32, torch.int8), dims=(2,), dim_names=("w13",), contiguous=True),
             "w2": TensorRule((torch.float32, torch.int8), dims=(1,), dim_names=("w2",), contiguous=True)}
    return CallSpec(params, ("x", "router_weight", "w13", "w2"), rules, explicit)


ENTRIES = (
    OpInfo("moe_forward", ref_moe_forward, _draw_moe, _make_moe, _compare_moe, _moe_errors, dists=NO_NAN,
           token_gather=_x_gather, resolve=_moe_opt, weight=1.5,
           error_ops=("moe_forward", "router_gemm", "route", "fused_experts"),
           notes="optimized.moe_forward, else reference.moe_forward(ops=optimized) once the three ops exist"),
)
