"""skinny_gemm, unquantized_gemm, fused_gate_gemm (SPEC 4): the shared-expert gate GEMMs.
One drawing and one arithmetic rule for the two linears (skinny_gemm: T <= 8); fused_gate_gemm
is judged on its concatenated output, also through optimized.FusedGate with an in-place
weight reload (a stale cached weight shows as a mismatch)."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from reference.gate_gemm import fused_gate_gemm as ref_fused_gate_gemm
from reference.gate_gemm import skinny_gemm as ref_skinny_gemm
from reference.gate_gemm import unquantized_gemm as ref_unquantized_gemm

from .. import distributions as D
from .. import tolerance as tol
from .common import (DTYPE_NAMES, NO_NAN, CallSpec, Case, OpInfo, Picker, TensorRule, _arith_result, _cap_tokens,
                     _common, _explain, _shape_check, _tokens, _x_gather, import_optimized, to_device)
from .router_gemm import _N_CHOICES

_K_CHOICES = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 128, 129, 256, 512, 513, 1024, 2048)


def _draw_linear(skinny: bool):
    def draw_fn(draw, dist, fixed):
        p = Picker(draw, fixed)
        s = {"N": p("N", st.sampled_from(_N_CHOICES)), "Kd": p("Kd", st.sampled_from(_K_CHOICES)),
             "dtype": p("dtype", st.sampled_from(DTYPE_NAMES)), "bias": bool(p("bias", st.booleans())),
             "T": p("T", st.integers(0, 8)) if skinny else _tokens(p)}
        s["T"] = _cap_tokens(s["T"], s["N"] * s["Kd"], 2e7)
        s.update(_common(p, dist))
        return s
    return draw_fn


def _make_linear(op):
    def make(s):
        dt = D.DTYPES[s["dtype"]]
        x, w, b = D.make_gemm_operands(s["dist"], s["T"], s["N"], s["Kd"], s["seed"],
                                       D.dist_params(s["dist"], s["dchoice"]), dt, dt, bias=s["bias"])
        return Case(op, s, (x, w), {"bias": b})
    return make


def _compare_linear(op):
    def compare(out, ref, case, ctx):
        bad = _shape_check(out, ref)
        if bad:
            return bad
        x, w = case.args
        b = case.kwargs.get("bias")
        res = tol.arith_check(out, ref, tol.eager_linear(x, w, b), tol.exact_linear(x, w, b),
                              tol.magnitude_linear(x, w, b), x.dtype, n_floor=tol.gemm_floor(x.shape[1]))
        r = _arith_result(res, "output")
        r.path = _explain(ctx.ops, op, x, w, b)
        return r
    return compare


def _linear_errors(op: str, skinny: bool):
    def spec(seed):
        g = D.generator(seed)
        x = torch.randn(3, 16, generator=g).bfloat16()
        w = torch.randn(5, 16, generator=g).bfloat16()
        b = torch.randn(5, generator=g).bfloat16()
        explicit = [
            ("weight dtype differs from x", {"weight": w.float()}, ("weight",)),
            ("K mismatch", {"weight": w[:, :15].contiguous()}, ("weight",)),
            ("bias wrong length", {"bias": b[:4].contiguous()}, ("bias",)),
            ("bias dtype differs", {"bias": b.float()}, ("bias",)),
            ("no output features", {"weight": w[:0]}, ("weight",)),
            ("K = 0", {"x": x[:, :0], "weight": w[:, :0]}, ("x", "weight")),
            ("x f64", {"x": x.double(), "weight": w.double(), "bias": b.double()}, ("x",)),
        ]
        if skinny:
            explicit.append(("T = 9 > 8", {"x": torch.randn(9, 16, generator=g).bfloat16()}, ("x",)))
        rules = {"x": TensorRule((torch.float64, torch.int32), dims=(1,), dim_names=("x", "weight"), device_ref=True),
                 "weight": TensorRule((torch.float64, torch.float32, torch.int16), dims=(1,), dim_names=("weight",)),
                 "bias": TensorRule((torch.float64, torch.float32), dims=(0,), dim_names=("bias",))}
        return CallSpec({"x": x, "weight": w, "bias": b}, ("x", "weight"), rules, explicit)
    return spec


def _draw_fused_gate(draw, dist, fixed):
    p = Picker(draw, fixed)
    s = {"E": p("E", st.sampled_from((1, 2, 3, 8, 16, 60, 64, 128, 256, 512))), "S": p("S", st.sampled_from((1, 1, 2, 3))),
         "H": p("H", st.sampled_from(_K_CHOICES)), "dtype": p("dtype", st.sampled_from(DTYPE_NAMES)), "T": _tokens(p),
         "module": bool(p("module", st.sampled_from((False, False, False, True))))}
    s["T"] = _cap_tokens(s["T"], (s["E"] + s["S"]) * s["H"], 2e7)
    s.update(_common(p, dist))
    return s


def _make_fused_gate(s):
    dt = D.DTYPES[s["dtype"]]
    x, w, _ = D.make_gemm_operands(s["dist"], s["T"], s["E"] + s["S"], s["H"], s["seed"],
                                   D.dist_params(s["dist"], s["dchoice"]), dt, dt)
    return Case("fused_gate_gemm", s, (x, w[:s["E"]].contiguous(), w[s["E"]:].contiguous()), {})


def _call_fused_gate(fn, case: Case, device):
    """fn(x, router_weight, shared_gate_weight); with structure["module"] (and when fn is
    optimized.fused_gate_gemm itself) through optimized.FusedGate instead: the module is
    built on other weights, run once (caching the stacked weight), then both weights are
    reloaded in place with the case's values, as a checkpoint load does, and run again.
    A stale cached weight shows as a mismatch."""
    x, rw, sw = to_device(case.args, device)
    ops = import_optimized()
    cls = getattr(ops, "FusedGate", None) if ops is not None else None
    if case.structure.get("module") and cls is not None and fn is getattr(ops, "fused_gate_gemm", None):
        g = D.generator(case.structure.get("seed", 0) + 9)
        old_rw = torch.randn(tuple(rw.shape), generator=g).to(rw.dtype).to(device)
        old_sw = torch.randn(tuple(sw.shape), generator=g).to(sw.dtype).to(device)
        gate = cls(old_rw, old_sw)
        gate(x)
        with torch.no_grad():
            old_rw.copy_(rw)
            old_sw.copy_(sw)
        return gate(x)
    return fn(x, rw, sw)


def _compare_fused_gate(out, ref, case, ctx):
    bad = _shape_check(out, ref, ("router_logits", "shared_gate_logits"))
    if bad:
        return bad
    x, rw, sw = case.args
    w = torch.cat([rw, sw])
    y = torch.cat([out[0], out[1]], dim=1)
    g = torch.cat([ref[0], ref[1]], dim=1)
    res = tol.arith_check(y, g, tol.eager_linear(x, w), tol.exact_linear(x, w), tol.magnitude_linear(x, w), x.dtype,
                          n_floor=tol.gemm_floor(x.shape[1]))
    r = _arith_result(res, "[router_logits | shared_gate_logits]")
    r.path = _explain(ctx.ops, "unquantized_gemm", x, w, None)
    return r


def _fused_gate_errors(seed):
    g = D.generator(seed)
    x = torch.randn(3, 16, generator=g)
    rw = torch.randn(8, 16, generator=g)
    sw = torch.randn(1, 16, generator=g)
    explicit = [
        ("router_weight dtype differs", {"router_weight": rw.bfloat16()}, ("router_weight",)),
        ("shared_gate_weight H mismatch", {"shared_gate_weight": torch.randn(1, 15, generator=g)},
         ("shared_gate_weight",)),
        ("no shared gate rows", {"shared_gate_weight": sw[:0]}, ("shared_gate_weight",)),
        ("H = 0", {"x": x[:, :0], "router_weight": rw[:, :0], "shared_gate_weight": sw[:, :0]}, ("x",)),
    ]
    rules = {"x": TensorRule((torch.float64, torch.int32), dims=(1,), dim_names=("x", "router_weight",
                                                                              "shared_gate_weight"), device_ref=True),
             "router_weight": TensorRule((torch.float64, torch.int32), dims=(1,), dim_names=("router_weight",)),
             "shared_gate_weight": TensorRule((torch.float64, torch.int32), dims=(1,),
                                              dim_names=("shared_gate_weight",))}
    return CallSpec({"x": x, "router_weight": rw, "shared_gate_weight": sw},
                    ("x", "router_weight", "shared_gate_weight"), rules, explicit)


ENTRIES = (
    OpInfo("skinny_gemm", ref_skinny_gemm, _draw_linear(True), _make_linear("skinny_gemm"),
           _compare_linear("skinny_gemm"), _linear_errors("skinny_gemm", True), dists=NO_NAN,
           token_gather=_x_gather, invariant_always=("cpu", "cuda"), max_tokens=8, weight=0.7),
    OpInfo("unquantized_gemm", ref_unquantized_gemm, _draw_linear(False), _make_linear("unquantized_gemm"),
           _compare_linear("unquantized_gemm"), _linear_errors("unquantized_gemm", False), dists=NO_NAN,
           token_gather=_x_gather, weight=0.8),
    OpInfo("fused_gate_gemm", ref_fused_gate_gemm, _draw_fused_gate, _make_fused_gate, _compare_fused_gate,
           _fused_gate_errors, dists=NO_NAN, token_gather=_x_gather, weight=0.7, call=_call_fused_gate,
           notes="also through optimized.FusedGate with an in-place weight reload (structure 'module')",
           error_ops=("fused_gate_gemm", "unquantized_gemm")),
)
