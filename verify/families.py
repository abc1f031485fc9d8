"""verify entries for the MoE layer of every model family (SPEC 6): one op per family preset.

`layer.<family>` (e.g. `layer.deepseek_v3`, `layer.gpt_oss`) draws moe_forward cases with that
family's arguments exactly as reference.families names them: its route method, renormalize,
scaling and norm_eps, its groups (scaled down to the drawn E), its activation, where the
routing weight applies (output, or input for Llama 4), router bias, expert biases, a shared
expert with or without its sigmoid gate. Sizes, weight format, tokens and the routing
distribution are drawn as for moe_forward. Each family is its own op, so every family meets
every distribution and the report has one row per family and distribution: a kernel bug that
only one family's arguments reach is found, and named.

How a case is judged. The optimized layer is `reference.moe.moe_forward(..., ops=optimized)`, a
composition of ops. The call runs it with a recording `ops` (every op call's arguments and
output are kept), and the judgement holds the record to two rules:
- composition: the stages are exactly the family's layer: router_gemm(x, W); route of those
  logits (+ router_bias) with the family's top_k, method and arguments; fused_experts of x and
  the case's weights with that routing and the family's activation and options; for a shared
  expert, router_gemm(x, gate) and a one-expert fused_experts weighted by the exact sigmoid of
  that gate (or 1); and the layer's output is bf16(routed + shared) of the recorded outputs, bit
  for bit. Inputs are compared bitwise, options by value.
- each stage's output against the reference op on the same inputs, by that op's own rule in
  verify.registry (router_gemm's, route's with near-tie flips counted, fused_experts').
So a kernel bug that only the family's arguments reach fails its stage, and a layer that passes
a wrong argument (or drops the shared expert) fails the composition. The reference layer on the
same case is computed by the runner but not compared as a whole: a tolerated logit difference
may legitimately move a token to other experts.

Mutants (verify/mutants.py, for every family): the routed experts' output off by a relative
2^-6 in one column (a stage rule kills it), and the family's scaling doubled in the call (the
composition rule kills it). Bad inputs are moe_forward's (`_moe_errors`): the layer takes the
same arguments.
"""
from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from reference.families import FAMILIES, Family
from reference.moe import SharedExpert, moe_forward as ref_moe_forward
from reference.quant import round_to_bf16

from . import distributions as D
from .registry import (NO_NAN, Case, CaseResult, OpInfo, Picker, _bits_equal, _cap_tokens, _common,
                       _compare_fused_experts, _compare_route, _compare_router_gemm, _moe_errors, _shape_check,
                       _x_gather, make_expert_weights, register, skew_router, to_cpu, to_device)

# The first token count is the one hypothesis tries first (and shrinks towards): a real batch, so
# even a cell that gets one case in a short run tests something; 1 and 0 come next.
_TOKENS = (7, 1, 0, 2, 16, 33, 64, 128)
_SHARED_KEYS = ("shared_w13", "shared_w2", "shared_w13_scale", "shared_w2_scale", "shared_gate")
_ROUTE_KEYS = ("bias", "n_group", "topk_group", "scaling", "renormalize", "norm_eps")
_FUSED_KEYS = ("quant", "w13_scale", "w2_scale", "w13_bias", "w2_bias", "activation", "alpha", "limit", "dispatch",
               "apply_router_weight_on_input")


def _groups(fam: Family, E: int, K: int):
    """(n_group, topk_group, K) of the family scaled to E experts: as many groups as the
    family has where they divide E into groups of >= 2, the same kept fraction."""
    if fam.n_group <= 1:
        return 1, 1, K
    n = max(g for g in range(1, min(fam.n_group, E // 2) + 1) if E % g == 0)
    kept = max(1, min(n, round(fam.topk_group * n / fam.n_group)))
    return n, kept, max(1, min(K, kept * (E // n)))


def _draw(fam: Family):
    def draw(draw_fn, dist, fixed):
        p = Picker(draw_fn, fixed)
        quant = p("quant", st.sampled_from(("bf16", "fp8_block", "mxfp4")))
        H = p("H", st.sampled_from((32, 64, 128, 256)))
        I = p("I", st.sampled_from((32, 64, 96)))
        E = p("E", st.sampled_from((4, 8, 16, 32)))
        K = min(fam.top_k, E, 8)
        if dist == "empty_experts":
            K = min(K, E - E // 2)
        n_group, topk_group, K = _groups(fam, E, K)
        s = {"family": fam.name, "quant": quant, "H": H, "I": I, "E": E, "K": K, "n_group": n_group,
             "topk_group": topk_group, "S": I * p("S_mult", st.sampled_from((1, 2))) if fam.shared_I else 0,
             "dispatch": p("dispatch", st.sampled_from(("auto", "tiny", "blocked"))),
             "T": p("T", st.one_of(st.sampled_from(_TOKENS), st.integers(0, 200)))}
        s["T"] = _cap_tokens(s["T"], (K + 1) * 3 * H * I + E * H, 6e7)
        s.update(_common(p, dist))
        return s
    return draw


def _make(fam: Family):
    def make(s):
        T, E, H, K = s["T"], s["E"], s["H"], s["K"]
        g = D.generator(s["seed"])
        x = torch.randn(T, H, generator=g)
        if fam.activation == "swiglu_oai" and T:
            x[torch.rand(T, generator=g) < 0.4] *= 8.0
        W = torch.randn(E, H, generator=g) / math.sqrt(H) * 2.0
        W = skew_router(x, W, s["dist"], D.dist_params(s["dist"], s["dchoice"]), g, K)
        ws = dict(s, bias="float32" if fam.expert_bias else "none")
        w13, w2, kw = make_expert_weights(ws, g, E)
        kw.update(top_k=K, method=fam.method, n_group=s["n_group"], topk_group=s["topk_group"],
                  scaling=fam.scaling, renormalize=fam.renormalize, quant=s["quant"], activation=fam.activation,
                  alpha=fam.alpha, limit=fam.limit, dispatch=s["dispatch"])
        if fam.apply_router_weight_on_input:
            kw["apply_router_weight_on_input"] = True
        if fam.norm_eps is not None:
            kw["norm_eps"] = fam.norm_eps
        if fam.route_bias:
            kw["bias"] = torch.randn(E, generator=g) * 0.3
        if fam.router_bias:
            kw["router_bias"] = torch.randn(E, generator=g)
        if s["S"]:
            s13, s2, skw = make_expert_weights(dict(s, I=s["S"], bias="none"), g, 1)
            kw.update(shared_w13=s13, shared_w2=s2, shared_w13_scale=skw.get("w13_scale"),
                      shared_w2_scale=skw.get("w2_scale"))
            if fam.shared_gate:
                kw["shared_gate"] = torch.randn(1, H, generator=g) / math.sqrt(H)
        return Case(f"layer.{fam.name}", s, (x.bfloat16(), W, w13, w2), kw)
    return make


def _layer_kwargs(kw: dict) -> dict:
    """moe_forward's keywords: the shared_* tensors become a SharedExpert."""
    kw = dict(kw)
    parts = {k: kw.pop(k, None) for k in _SHARED_KEYS}
    if parts["shared_w13"] is not None:
        kw["shared"] = SharedExpert(parts["shared_w13"], parts["shared_w2"], quant=kw["quant"],
                                    w13_scale=parts["shared_w13_scale"], w2_scale=parts["shared_w2_scale"],
                                    gate=parts["shared_gate"])
    return kw


def _reference(x, W, w13, w2, **kw):
    return ref_moe_forward(x, W, w13, w2, **_layer_kwargs(kw))


class Recorder:
    """An `ops` namespace that runs `inner`'s router_gemm, route and fused_experts and records
    every call as (name, args, kwargs, output), on the CPU."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.dispatch = getattr(inner, "dispatch", None)

    def _run(self, name, *args, **kwargs):
        out = getattr(self.inner, name)(*args, **kwargs)
        self.calls.append((name, to_cpu(args), to_cpu(kwargs), to_cpu(out)))
        return out

    def router_gemm(self, *args, **kwargs):
        return self._run("router_gemm", *args, **kwargs)

    def route(self, *args, **kwargs):
        return self._run("route", *args, **kwargs)

    def fused_experts(self, *args, **kwargs):
        return self._run("fused_experts", *args, **kwargs)


def _resolve(ops):
    """The layer under test: moe_forward on `ops`, which a caller (or a mutant) may replace."""
    if not all(callable(getattr(ops, n, None)) for n in ("router_gemm", "route", "fused_experts")):
        return None

    def layer(*args, ops=ops, **kwargs):
        return ref_moe_forward(*args, ops=ops, **kwargs)
    layer.ops = ops
    layer.__name__ = "moe_forward(ops=optimized)"
    return layer


def _base_ops(fn):
    """The ops namespace of the layer function under a mutant's wrappers."""
    while not hasattr(fn, "ops") and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return getattr(fn, "ops", None)


def _call(fn, case: Case, device):
    """Run the layer with a recording ops namespace; the record goes to case.aux['calls']."""
    args, kwargs = to_device((case.args, case.kwargs), device)
    base = _base_ops(fn)
    if base is None:                       # a plain function (the reference): nothing to record
        case.aux["calls"] = None
        return fn(*args, **_layer_kwargs(kwargs))
    rec = Recorder(base)
    out = fn(*args, ops=rec, **_layer_kwargs(kwargs))
    case.aux["calls"] = rec.calls
    return out


def _same(a, b) -> bool:
    """Bitwise for tensors, == for the rest."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _bits_equal(a, b)
    return a == b


class _Mismatch(Exception):
    pass


def _expect_call(calls, i, name, args, kwargs):
    """calls[i] must be `name` with exactly these arguments (None-valued keywords are the same
    as absent ones); returns its output."""
    if i >= len(calls):
        raise _Mismatch(f"stage {i}: expected a {name} call, the layer made only {len(calls)} calls")
    got_name, got_args, got_kw, out = calls[i]
    if got_name != name:
        raise _Mismatch(f"stage {i}: expected {name}, the layer called {got_name}")
    if len(got_args) != len(args) or not all(_same(a, b) for a, b in zip(got_args, args)):
        raise _Mismatch(f"stage {i} ({name}): its positional arguments are not the family layer's")
    want = {k: v for k, v in kwargs.items() if v is not None}
    got = {k: v for k, v in got_kw.items() if v is not None}
    diff = sorted(k for k in set(want) | set(got) if k not in want or k not in got or not _same(got[k], want[k]))
    if diff:
        raise _Mismatch(f"stage {i} ({name}): keyword arguments {diff} are not the family layer's")
    return out


def _compare(out, ref, case: Case, ctx) -> CaseResult:
    """Composition and stages (module docstring)."""
    bad = _shape_check(out, ref)
    if bad:
        return bad
    from reference import fused_experts as r_fused, route as r_route, router_gemm as r_gemm
    calls = case.aux.get("calls")
    if calls is None:
        return CaseResult(True, "ok")      # the reference against itself
    x, W, w13, w2 = case.args
    kw = case.kwargs
    K, method = kw["top_k"], kw["method"]
    seen = {"worst": 0.0, "bound": "", "flips": 0, "gaps": []}

    def judge(stage, compare, got, want, stage_case) -> CaseResult:
        r = compare(got, want, stage_case, ctx)
        if r.ratio is not None and r.ratio > seen["worst"]:
            seen["worst"], seen["bound"] = r.ratio, r.bound
        seen["flips"] += r.flips
        seen["gaps"] += r.flip_gaps
        if not r.ok:
            r.message = f"{stage}: {r.message}"
        return r

    try:
        logits = _expect_call(calls, 0, "router_gemm", (x, W), {})
        r = judge("router_gemm", _compare_router_gemm, logits, r_gemm(x, W), Case("router_gemm", {}, (x, W), {}))
        if not r.ok:
            return r
        if kw.get("router_bias") is not None:
            logits = logits + kw["router_bias"].to(logits.dtype)
        rkw = {k: kw[k] for k in _ROUTE_KEYS if k in kw}
        routing = _expect_call(calls, 1, "route", (logits, K, method), rkw)
        r = judge("route", _compare_route, routing, r_route(logits, K, method, **rkw),
                  Case("route", {}, (logits, K, method), rkw))
        if not r.ok:
            return r
        w, ids = routing
        fkw = {k: kw[k] for k in _FUSED_KEYS if k in kw}
        routed = _expect_call(calls, 2, "fused_experts", (x, w13, w2, w, ids), fkw)
        r = judge("fused_experts (routed)", _compare_fused_experts, routed, r_fused(x, w13, w2, w, ids, **fkw),
                  Case("fused_experts", {}, (x, w13, w2), dict(fkw, topk_weights=w, topk_ids=ids)))
        if not r.ok:
            return r
        want, n = routed, 3
        if kw.get("shared_w13") is not None:
            T, gate = x.shape[0], kw.get("shared_gate")
            gw = torch.ones(T, 1)
            if gate is not None:
                gl = _expect_call(calls, n, "router_gemm", (x, gate), {})
                n += 1
                r = judge("router_gemm (shared gate)", _compare_router_gemm, gl, r_gemm(x, gate),
                          Case("router_gemm", {}, (x, gate), {}))
                if not r.ok:
                    return r
                gw = torch.sigmoid(gl.double()).float()
            sid = torch.zeros(T, 1, dtype=torch.int32)
            s13, s2 = kw["shared_w13"], kw["shared_w2"]
            skw = dict(quant=kw["quant"], w13_scale=kw.get("shared_w13_scale"), w2_scale=kw.get("shared_w2_scale"),
                       activation="silu", alpha=kw["alpha"], limit=kw["limit"], dispatch=kw["dispatch"])
            shared = _expect_call(calls, n, "fused_experts", (x, s13, s2, gw, sid), skw)
            n += 1
            r = judge("fused_experts (shared)", _compare_fused_experts, shared, r_fused(x, s13, s2, gw, sid, **skw),
                      Case("fused_experts", {}, (x, s13, s2), dict(skw, topk_weights=gw, topk_ids=sid)))
            if not r.ok:
                return r
            want = round_to_bf16(routed.double() + shared.double())
        if len(calls) != n:
            raise _Mismatch(f"the layer made {len(calls)} op calls, the family's layer makes {n}")
    except _Mismatch as e:
        return CaseResult(False, "mismatch", ratio=seen["worst"], message=f"composition: {e}")
    if not _bits_equal(out, want):
        return CaseResult(False, "mismatch", ratio=seen["worst"],
                          message="composition: the layer's output is not bf16(routed + shared) of its own stages")
    return CaseResult(True, "ok", ratio=seen["worst"], bound=seen["bound"], flips=seen["flips"], flip_gaps=seen["gaps"])


class _RoutedColumnOff:
    """ops whose first fused_experts call (the routed experts) returns column 0 off by a
    relative 2^-4 (16 bf16 ulps)."""

    def __init__(self, inner):
        self.inner, self.dispatch, self.n = inner, getattr(inner, "dispatch", None), 0
        self.router_gemm, self.route = inner.router_gemm, inner.route

    def fused_experts(self, *args, **kwargs):
        out = self.inner.fused_experts(*args, **kwargs)
        self.n += 1
        if self.n == 1 and out.numel():
            out = out.clone()
            out[:, 0] = (out[:, 0].float() * (1 + 2.0 ** -4)).to(out.dtype)
        return out


def mutant_routed_column_off(fn):
    """The routed experts' kernel: one output column off by 2^-4 (their stage rule kills it)."""
    def f(*args, **kwargs):
        return fn(*args, **kwargs)
    f.__wrapped__ = fn
    f.ops = _RoutedColumnOff(_base_ops(fn))
    return f


def mutant_scaling_doubled(fn):
    """The layer passes twice the family's scaling to route (the composition rule kills it)."""
    def f(*args, scaling=1.0, **kwargs):
        return fn(*args, scaling=2.0 * scaling, **kwargs)
    f.__wrapped__ = fn
    return f


def family_mutants(Mutant):
    """Two mutants per family op (verify/mutants.py adds them to MUTANTS)."""
    out = []
    for fam in FAMILIES.values():
        op = f"layer.{fam.name}"
        out.append(Mutant(f"{op}.routed_column_off", op, "routed experts' output column 0 off by 2^-4",
                          mutant_routed_column_off, dists=("uniform",), fixed={"T": 7}))
        out.append(Mutant(f"{op}.scaling_doubled", op, "route called with twice the family's scaling",
                          mutant_scaling_doubled, dists=("uniform",), fixed={"T": 7}))
    return out


for _fam in FAMILIES.values():
    register(OpInfo(f"layer.{_fam.name}", _reference, _draw(_fam), _make(_fam), _compare, _moe_errors, dists=NO_NAN,
                    call=_call, resolve=_resolve, token_gather=_x_gather, weight=0.08,
                    error_ops=("moe_forward", "router_gemm", "route", "fused_experts"),
                    notes=f"{_fam.name}: moe_forward(ops=optimized) with the family preset, judged stage by stage"))
