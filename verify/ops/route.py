"""route (SPEC 1 and 6): top-k expert selection. Cases over every method, group layout,
renormalize / scaling / norm_eps draw and logits dtype; ids judged exactly except for near-tie
flips (two keys a few f32 ulps apart, where sigmoid/exp implementations may legitimately
differ: `key_allowance`, `admissible_topk`), weights by verify.tolerance's rule."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from hypothesis import strategies as st

from reference.route import route as ref_route
from reference.route import selection_keys
from reference.validate import BIAS_METHODS, GROUPED_METHODS, NORM_EPS_DEFAULT, ROUTE_METHODS, check_route

from .. import distributions as D
from .. import tolerance as tol
from .common import (ALL_DISTS, DTYPE_NAMES, CallSpec, Case, CaseResult, Ctx, OpInfo, Picker, TensorRule,
                     _arith_result, _cap_tokens, _common, _shape_check, _tokens, import_optimized, to_device)

METHODS = ROUTE_METHODS          # SPEC 1's six and SPEC 6's grouped_softmax, softmax_bias
# renormalize is drawn unset (the method's default), False or True; llama4 refuses True
RENORM_DRAWS = (None, False, True)
# route's scaling applies to every method (SPEC 6); 0.375 and 2.5 are exact in f32, 0.1 is not
SCALINGS = (1.0, 2.5, 0.5, 0.375, 0.1)
# norm_eps for the methods that take one: unset (the default), LFM2's 1e-6, 0 (allowed: the
# plain sum) and 0.75, large enough that the floor max(sum, eps) binds and (sum + eps) moves
NORM_EPS_DRAWS = (None, 1e-6, 0.0, 0.75)


def _draw_groups_and_k(p: Picker, method: str, E: int, dist: str, k_cap: int):
    """(n_group, topk_group, K) valid for the method and E: groups that divide E into groups
    of >= 2 (grouped methods only), K <= k_cap, <= the experts the groups leave, <= the
    experts empty_experts leaves, and 1 for llama4."""
    n_group = topk_group = 1
    if method in GROUPED_METHODS:
        divisors = [d for d in range(1, 33) if E % d == 0 and E // d >= 2]
        n_group = p("n_group", st.sampled_from(divisors))
        topk_group = p("topk_group", st.integers(1, n_group))
    kmax = min(E, k_cap)
    if method in GROUPED_METHODS:
        kmax = min(kmax, topk_group * (E // n_group))
    if dist == "empty_experts":
        kmax = min(kmax, E - E // 2)
    return n_group, topk_group, (1 if method == "llama4" else p("K", st.integers(1, kmax)))


def _draw_route(draw, dist, fixed):
    p = Picker(draw, fixed)
    method = p("method", st.sampled_from(METHODS))
    E = p("E", st.sampled_from((1, 2, 3, 4, 6, 8, 16, 32, 60, 64, 128, 256, 384, 512, 896, 1024, 2048)))
    if method in GROUPED_METHODS:
        E = max(2, min(E, 1024))
    n_group, topk_group, K = _draw_groups_and_k(p, method, E, dist, 32)
    s = {"method": method, "E": E, "K": K, "n_group": n_group, "topk_group": topk_group,
         "renormalize": p("renormalize", st.sampled_from(RENORM_DRAWS if method != "llama4" else (None, False))),
         "scaling": p("scaling", st.sampled_from(SCALINGS)),
         "norm_eps": p("norm_eps", st.sampled_from(NORM_EPS_DRAWS)) if method in NORM_EPS_DEFAULT else None,
         "logits_dtype": p("logits_dtype", st.sampled_from(DTYPE_NAMES)),
         "bias_dtype": p("bias_dtype", st.sampled_from(("float32", "bfloat16"))),
         "T": _tokens(p)}
    s["T"] = _cap_tokens(s["T"], E, 300_000)
    s.update(_common(p, dist))
    return s


def _make_route(s: dict) -> Case:
    T, E, K = s["T"], s["E"], s["K"]
    dt = D.DTYPES[s["logits_dtype"]]
    params = D.dist_params(s["dist"], s["dchoice"])
    g = D.generator(s["seed"])
    logits = D.routing_logits(s["dist"], T, E, K, g, params, dt).to(dt)
    if s["dist"] == "ep_shard":   # the local experts' logits: a strided view with holes
        wide = torch.zeros(T, E + 5, dtype=dt)
        wide[:, 2:E + 2] = logits
        logits = wide[:, 2:E + 2]
    kwargs = {"n_group": s["n_group"], "topk_group": s["topk_group"], "scaling": s["scaling"],
              "renormalize": s["renormalize"], "bias": None}
    if s.get("norm_eps") is not None:            # (older saved cases have no norm_eps)
        kwargs["norm_eps"] = s["norm_eps"]
    if s["method"] in BIAS_METHODS:
        bdt = D.DTYPES[s["bias_dtype"]]
        # softmax_bias adds the bias to p ~ 1/E: a bias of that size competes with p
        size = 0.5 if s["method"] != "softmax_bias" else 0.5 / E
        if s["dist"] == "exact_ties":
            bias = torch.tensor((0.0, 0.25 if s["method"] != "softmax_bias" else 0.25 / 1024))[
                torch.randint(2, (E,), generator=g)]
        elif s["dist"] == "near_ties":
            bias = torch.zeros(E)
        else:
            bias = torch.randn(E, generator=g) * size
        kwargs["bias"] = bias.to(bdt)
    return Case("route", s, (logits, K, s["method"]), kwargs)


def _tie_classes(x: torch.Tensor, bias: Optional[torch.Tensor], method: str) -> torch.Tensor:
    """Per (t, e) an id of the inputs that determine the key: equal id <=> identical inputs
    (so the keys must be identical and the lower index must win). f32 bits, -0.0 as +0.0,
    every NaN one class; with a bias, the (x, bias) pair."""
    v = x.to(torch.float32) + 0.0
    v = torch.where(torch.isnan(v), torch.full_like(v, float("nan")), v)
    cls = v.view(torch.int32).to(torch.int64)
    if method in BIAS_METHODS and bias is not None:
        b = (bias.to(torch.float32) + 0.0).view(torch.int32).to(torch.int64)
        cls = cls * (2 ** 32) + (b & 0xFFFFFFFF).unsqueeze(0)
    return cls


F32_TINY = 2.0 ** -126


def key_allowance(x32: torch.Tensor, bias: Optional[torch.Tensor], method: str, keys: torch.Tensor) -> torch.Tensor:
    """How far (absolute, f64 [T, E]) an f32 implementation's key may be from the exact key.

    Raw-logit keys (topk_softmax, llama4) are not computed: 0, so any reordering of
    different logits is an error. Computed keys get at least 2 ulps each (a near tie is a
    gap of at most 4 ulps between two keys, SPEC's "a few ulps"), and more where an f32
    computation is necessarily less exact:
      softmax p = exp(x - max) / sum: the f32 difference x - max carries ~|x - max| / 2 ulps
        of relative error into exp, so (2 + |x - max|) ulps of p; p + bias: that plus 1 ulp
        of the sum;
      sigmoid s: 2 ulps of s; s + bias: 2 ulps of s plus 1 ulp of the sum (with a negative
        bias the sum can be much smaller than s);
      a subnormal exact key may be flushed to zero (FTZ): + 2^-126.
    """
    if method in ("topk_softmax", "llama4"):
        return torch.zeros(keys.shape, dtype=torch.float64)
    k64 = keys.to(torch.float64)
    if method in ("softmax_topk", "grouped_softmax", "softmax_bias"):
        xf = x32.to(torch.float64)
        m = torch.where(torch.isfinite(xf), xf, torch.full_like(xf, -math.inf)).amax(dim=-1, keepdim=True)
        spread = (xf - m).abs().nan_to_num(0.0, 0.0, 0.0)
        p = torch.softmax(xf, dim=-1).to(torch.float32).to(torch.float64)
        d = tol.ulp(p.nan_to_num(0.0), torch.float32) * (2.0 + spread)
        if method in BIAS_METHODS:   # p + bias: one more rounding, of the sum
            d = d + tol.ulp(k64.nan_to_num(0.0, 0.0, 0.0), torch.float32)
        base = p
    else:
        s = torch.sigmoid(x32.to(torch.float64)).to(torch.float32).to(torch.float64)
        d = 2.0 * tol.ulp(s.nan_to_num(0.0), torch.float32)
        if method in BIAS_METHODS:
            d = d + tol.ulp(k64.nan_to_num(0.0, 0.0, 0.0), torch.float32)
        base = s
    d = d + torch.where(base.abs() < F32_TINY, F32_TINY, 0.0)
    d = torch.maximum(d, 2.0 * tol.ulp(k64.nan_to_num(0.0, 0.0, 0.0), torch.float32))
    return torch.where(torch.isfinite(k64), d, torch.zeros_like(d))


def _dominates(ka, kb, ca, cb, ia, ib, da, db):
    """Vectorized 'a must rank above b' (broadcasting tensors): NaN above everything, exact
    input ties by index, otherwise a key larger by more than both keys' allowances."""
    a_nan, b_nan = torch.isnan(ka), torch.isnan(kb)
    tie = (ca == cb) | (a_nan & b_nan)
    by_nan = a_nan & ~b_nan
    ka64, kb64 = ka.to(torch.float64), kb.to(torch.float64)
    gap = torch.where(ka64 == kb64, torch.zeros_like(ka64), ka64 - kb64)      # inf - inf: equal
    larger = (~a_nan) & (~b_nan) & (ka64 > kb64) & (gap > da + db)
    return by_nan | (tie & (ia < ib)) | (~tie & larger)


def admissible_topk(keys: torch.Tensor, classes: torch.Tensor, delta: torch.Tensor,
                    sel: torch.Tensor) -> Tuple[bool, str]:
    """Is `sel` ([K] int64) an acceptable top-K of one row of keys, given each key's
    allowance `delta`? Acceptable: K distinct valid experts; no slot is dominated by a later
    slot, and no unselected expert dominates a selected one (`_dominates`)."""
    E = keys.shape[0]
    K = sel.shape[0]
    if bool(((sel < 0) | (sel >= E)).any()) or len(set(sel.tolist())) != K:
        return False, f"ids {sel.tolist()} are not {K} distinct experts in [0, {E})"
    ks, cs, ds = keys[sel], classes[sel], delta[sel]
    if K > 1:
        dom = _dominates(ks.unsqueeze(0), ks.unsqueeze(1), cs.unsqueeze(0), cs.unsqueeze(1),
                         sel.unsqueeze(0), sel.unsqueeze(1), ds.unsqueeze(0), ds.unsqueeze(1))   # [i, j]: j above i
        bad = dom & torch.triu(torch.ones(K, K, dtype=torch.bool), diagonal=1)
        if bool(bad.any()):
            i, j = (int(v) for v in torch.nonzero(bad)[0])
            return False, (f"slot {j} (expert {int(sel[j])}, key {float(ks[j]):.9g}) must rank above slot {i} "
                           f"(expert {int(sel[i])}, key {float(ks[i]):.9g})")
    mask = torch.ones(E, dtype=torch.bool)
    mask[sel] = False
    others = torch.nonzero(mask).reshape(-1)
    if others.numel():
        dom = _dominates(keys[others].unsqueeze(1), ks.unsqueeze(0), classes[others].unsqueeze(1),
                         cs.unsqueeze(0), others.unsqueeze(1), sel.unsqueeze(0),
                         delta[others].unsqueeze(1), ds.unsqueeze(0))
        if bool(dom.any()):
            o, j = (int(v) for v in torch.nonzero(dom)[0])
            e = int(others[o])
            return False, (f"unselected expert {e} (key {float(keys[e]):.9g}) must rank above selected "
                           f"expert {int(sel[j])} (key {float(ks[j]):.9g})")
    return True, ""


def _grouped_admissible(keys0, d0, classes, sel, n_group, topk_group, top2=True):
    """Grouped routing with near ties among group scores (top2: a group's score is the sum of
    its two largest keys, DeepSeek-V3; else its largest key, DeepSeek-V2's
    group_limited_greedy). A group is *surely kept* when it
    dominates at least n_group - topk_group others, *possibly kept* when fewer than
    topk_group groups dominate it. The groups sel uses must be possibly kept and, with the
    surely kept ones, at most topk_group; sel must then be an acceptable top-K of the keys
    masked to (used + surely kept) groups (experts of the other possibly kept groups may
    legitimately have been dropped with their group)."""
    from reference.route import _topk_total_order
    E = keys0.shape[0]
    gsz = E // n_group
    grouped = keys0.reshape(n_group, gsz)
    best = _topk_total_order(grouped, 2) + (torch.arange(n_group) * gsz).unsqueeze(1)     # expert ids
    c2 = classes[best]
    if top2:
        gscore = keys0[best[:, 0]] + keys0[best[:, 1]]                                     # f32 add
        gd = d0[best[:, 0]] + d0[best[:, 1]] + tol.ulp(gscore.to(torch.float64).nan_to_num(0.0, 0.0, 0.0),
                                                        torch.float32)
        gcls = c2[:, 0] * 1_000_003 + c2[:, 1]
    else:
        gscore, gd, gcls = keys0[best[:, 0]], d0[best[:, 0]].clone(), c2[:, 0]
    gd = torch.where(torch.isfinite(gscore), gd, torch.zeros_like(gd))
    gi = torch.arange(n_group)
    dom = _dominates(gscore.unsqueeze(1), gscore.unsqueeze(0), gcls.unsqueeze(1), gcls.unsqueeze(0),
                     gi.unsqueeze(1), gi.unsqueeze(0), gd.unsqueeze(1), gd.unsqueeze(0))   # [a, b]: a above b
    surely = dom.sum(dim=1) >= n_group - topk_group
    possibly = dom.sum(dim=0) < topk_group
    used = torch.zeros(n_group, dtype=torch.bool)
    used[torch.unique(sel // gsz)] = True
    if bool((used & ~possibly).any()):
        g = int(torch.nonzero(used & ~possibly)[0])
        return False, f"ids use group {g}, which at least topk_group = {topk_group} groups rank above"
    if int((used | surely).sum()) > topk_group:
        return False, (f"ids use groups {torch.nonzero(used).reshape(-1).tolist()} besides the surely kept "
                       f"{torch.nonzero(surely).reshape(-1).tolist()}: more than topk_group = {topk_group}")
    keep = (used | surely).repeat_interleave(gsz)
    masked = torch.where(keep, keys0, torch.full_like(keys0, float("-inf")))
    mcls = torch.where(keep, classes, torch.full_like(classes, -(2 ** 62)))
    return admissible_topk(masked, mcls, torch.where(keep, d0, torch.zeros_like(d0)), sel)


def route_flip_check(logits32, bias, method, n_group, topk_group, ids_ref, ids_opt):
    """Rows where ids differ: (flip rows, gaps in ulps, first failure message or None)."""
    keys = selection_keys(logits32, method, bias, n_group, topk_group)
    classes = _tie_classes(logits32, bias, method)
    diff = torch.nonzero((ids_ref != ids_opt).any(dim=1)).reshape(-1).tolist()
    flips, gaps = [], []
    if not diff:
        return flips, gaps, None
    if method in GROUPED_METHODS:
        # the unmasked keys: s + bias (grouped_sigmoid_bias) or p (grouped_softmax)
        keys0 = selection_keys(logits32, "sigmoid_bias" if method == "grouped_sigmoid_bias" else "softmax_topk", bias)
        delta = key_allowance(logits32, bias, method, keys0)
    else:
        delta = key_allowance(logits32, bias, method, keys)
    for t in diff:
        sel = ids_opt[t].to(torch.int64)
        if method in GROUPED_METHODS:
            ok, why = _grouped_admissible(keys0[t], delta[t], classes[t], sel, n_group, topk_group,
                                          top2=method == "grouped_sigmoid_bias")
        else:
            ok, why = admissible_topk(keys[t], classes[t], delta[t], sel)
        if not ok:
            return flips, gaps, (f"token {t}: ids {ids_opt[t].tolist()} vs reference {ids_ref[t].tolist()}: "
                                 f"not a near tie: {why}")
        r = ids_ref[t].to(torch.int64)
        d = ids_ref[t] != ids_opt[t]
        kk = keys0 if method in GROUPED_METHODS else keys
        gap = tol.ulp_distance_f32(kk[t][r[d]], kk[t][sel[d].clamp(0, kk.shape[1] - 1)])
        gaps.append(float(gap.max()) if gap.numel() else 0.0)
        flips.append(t)
    return flips, gaps, None


def _compare_route(out, ref, case: Case, ctx: Ctx) -> CaseResult:
    bad = _shape_check(out, ref, ("weights", "ids"))
    if bad:
        return bad
    (w_o, ids_o), (w_r, ids_r) = out, ref
    logits, K, method = case.args
    kw = case.kwargs
    bias, scaling = kw.get("bias"), kw.get("scaling", 1.0)
    # renormalize and norm_eps as the call resolves them (None: the method's defaults)
    renorm, eps = check_route(logits, K, method, bias, kw.get("n_group", 1), kw.get("topk_group", 1), scaling,
                              kw.get("renormalize"), kw.get("norm_eps"))
    x32 = logits.to(torch.float32)
    flips, gaps, why = route_flip_check(x32, bias, method, kw.get("n_group", 1), kw.get("topk_group", 1), ids_r, ids_o)
    if why:
        return CaseResult(False, "mismatch", flips=len(flips), flip_gaps=gaps, message="ids: " + why)
    w_exp = w_r.clone()
    ids_for = ids_r.clone()
    if flips:
        ft = torch.tensor(flips)
        w_exp[ft] = tol.route_weights_for_ids(x32[ft], ids_o[ft], method, bias=bias, scaling=scaling,
                                              renormalize=renorm, norm_eps=eps, exact=True)
        ids_for[ft] = ids_o[ft]
    w_eager = tol.route_weights_for_ids(x32, ids_for, method, bias=bias, scaling=scaling, renormalize=renorm,
                                        norm_eps=eps, exact=False)
    scale, key = tol.route_weight_scale(x32, ids_for, method, scaling=scaling, renormalize=renorm, norm_eps=eps)
    res = tol.route_weight_check(w_o, w_exp, w_eager, key=key, scale=scale)
    r = _arith_result(res, "weights")
    r.flips, r.flip_gaps = len(flips), gaps
    return r


def _route_gather(case: Case, rows) -> Case:
    logits, K, method = case.args
    return Case(case.op, case.structure, (logits[rows].contiguous(), K, method), dict(case.kwargs))


def _route_variants(case: Case):
    """route's kernel and seed 004's "before" selection (optimized.route.route_variant with
    selection="serial": one scalar pass on the CPU, warp 0 alone on CUDA), which must give
    the same bits; checked with batch invariance (route's kernel is held to the reference)."""
    return [("", case), ("selection=serial", Case(case.op, case.structure, case.args,
                                                  dict(case.kwargs, selection="serial")))]


def _call_route(fn, case: Case, device):
    """fn(logits, top_k, method, **kw); a `selection` variant runs route_variant when fn is
    optimized.route itself (a mutant or a peer has no before kernel: it runs as it is)."""
    args, kwargs = to_device((case.args, case.kwargs), device)
    selection = kwargs.pop("selection", None)
    ops = import_optimized()
    if selection is not None and ops is not None and fn is getattr(ops, "route", None):
        from optimized.route import route_variant
        return route_variant(*args, selection=selection, **kwargs)
    return fn(*args, **kwargs)


def _route_errors(seed: int) -> CallSpec:
    g = D.generator(seed)
    logits = torch.randn(5, 8, generator=g)
    # (float64 logits are the reference's exact mode, refused by optimized: an explicit case)
    f = (torch.int32, torch.int64)
    params = {"logits": logits, "top_k": 2, "method": "softmax_topk", "bias": None, "n_group": 1,
              "topk_group": 1, "scaling": 1.0, "renormalize": False, "norm_eps": None}
    bias8 = torch.randn(8, generator=g)
    explicit = [
        ("top_k = 0", {"top_k": 0}, ("top_k",)),
        ("K > E", {"top_k": 9}, ("top_k",)),
        ("K > 32", {"logits": torch.randn(2, 64, generator=g), "top_k": 33}, ("top_k",)),
        ("unknown method", {"method": "softmax"}, ("method",)),
        ("llama4 with K = 2", {"method": "llama4"}, ("top_k",)),
        ("sigmoid_bias without bias", {"method": "sigmoid_bias"}, ("bias",)),
        ("bias with softmax_topk", {"bias": bias8}, ("bias",)),
        ("bias of the wrong length", {"method": "sigmoid_bias", "bias": torch.randn(7, generator=g)}, ("bias",)),
        ("bias f16", {"method": "sigmoid_bias", "bias": bias8.half()}, ("bias",)),
        ("bias on meta", {"method": "sigmoid_bias", "bias": bias8.to("meta")}, ("bias",)),
        ("n_group not dividing E", {"method": "grouped_sigmoid_bias", "bias": bias8, "n_group": 3}, ("n_group",)),
        ("topk_group > n_group", {"method": "grouped_sigmoid_bias", "bias": bias8, "n_group": 2, "topk_group": 3},
         ("topk_group",)),
        ("grouped K > topk_group * E / n_group", {"method": "grouped_sigmoid_bias", "bias": bias8, "n_group": 4,
                                                   "topk_group": 1, "top_k": 3}, ("top_k",)),
        ("n_group with softmax_topk", {"n_group": 2}, ("n_group",)),
        ("scaling NaN", {"method": "sigmoid_bias", "bias": bias8, "scaling": float("nan")}, ("scaling",)),
        ("renormalize with llama4", {"method": "llama4", "top_k": 1, "renormalize": True}, ("renormalize",)),
        ("renormalize an int", {"renormalize": 1}, ("renormalize",)),
        ("norm_eps with softmax_topk", {"norm_eps": 1e-6}, ("norm_eps",)),
        ("norm_eps with grouped_softmax", {"method": "grouped_softmax", "n_group": 2, "norm_eps": 1e-6},
         ("norm_eps",)),
        ("norm_eps negative", {"method": "sigmoid_bias", "bias": bias8, "norm_eps": -1e-6}, ("norm_eps",)),
        ("norm_eps NaN", {"method": "softmax_bias", "bias": bias8, "norm_eps": float("nan")}, ("norm_eps",)),
        ("softmax_bias without bias", {"method": "softmax_bias"}, ("bias",)),
        ("grouped_softmax with bias", {"method": "grouped_softmax", "bias": bias8, "n_group": 2}, ("bias",)),
        ("grouped_softmax K > topk_group * E / n_group", {"method": "grouped_softmax", "n_group": 4,
                                                          "topk_group": 1, "top_k": 3}, ("top_k",)),
        ("scaling inf with softmax_topk", {"scaling": float("inf")}, ("scaling",)),
        # the reference (exact mode) and optimized both name the float64 logits
        ("logits float64 with an f32 bias", {"logits": logits.double(), "method": "sigmoid_bias", "bias": bias8},
         ("logits",)),
        ("E > 2048", {"logits": torch.randn(1, 2049, generator=g)}, ("logits",)),
        ("logits 1-D", {"logits": torch.randn(8, generator=g)}, ("logits",)),
        ("logits int", {"logits": torch.zeros(5, 8, dtype=torch.int32)}, ("logits",)),
        ("top_k not an int", {"top_k": 2.0}, ("top_k",)),
    ]
    rules = {"logits": TensorRule(f, device_ref=True)}
    return CallSpec(params, ("logits", "top_k", "method"), rules, explicit)


ENTRIES = (
    OpInfo("route", ref_route, _draw_route, _make_route, _compare_route, _route_errors,
           dists=ALL_DISTS, token_gather=_route_gather, invariant_always=("cpu", "cuda"), weight=1.0,
           variants=_route_variants, call=_call_route,
           notes="ids exact (near-tie flips counted), weights within 8 f32 ulps + 4x eager; "
                 "seed 004's serial selection bit for bit with route (batch-invariance cases)"),
)
