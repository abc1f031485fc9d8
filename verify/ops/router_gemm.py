"""router_gemm (SPEC 3): f32 router logits from bf16/f16/f32 activations, upcast(x) @ weight.T
with f32 accumulation; judged by the arithmetic rule of verify.tolerance against an f64 truth
and the eager f32 computation."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from reference.router_gemm import router_gemm as ref_router_gemm

from .. import distributions as D
from .. import tolerance as tol
from .common import (DTYPE_NAMES, NO_NAN, CallSpec, Case, OpInfo, Picker, TensorRule, _arith_result, _cap_tokens,
                     _common, _explain, _shape_check, _tokens, _x_gather)

_H_CHOICES = (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 127, 128, 129, 256, 511, 512, 1024, 2048, 3072)
_N_CHOICES = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 32, 33, 64, 127, 128, 129, 256, 257, 512, 513)


def _draw_router_gemm(draw, dist, fixed):
    p = Picker(draw, fixed)
    s = {"E": p("E", st.sampled_from(_N_CHOICES)), "H": p("H", st.sampled_from(_H_CHOICES)),
         "x_dtype": p("x_dtype", st.sampled_from(DTYPE_NAMES)), "T": _tokens(p)}
    s["T"] = _cap_tokens(s["T"], s["E"] * s["H"], 3e7)
    s.update(_common(p, dist))
    return s


def _make_router_gemm(s):
    x, w, _ = D.make_gemm_operands(s["dist"], s["T"], s["E"], s["H"], s["seed"],
                                   D.dist_params(s["dist"], s["dchoice"]), D.DTYPES[s["x_dtype"]], torch.float32)
    return Case("router_gemm", s, (x, w), {})


def _compare_router_gemm(out, ref, case, ctx):
    bad = _shape_check(out, ref)
    if bad:
        return bad
    x, w = case.args
    res = tol.arith_check(out, ref, tol.eager_router_gemm(x, w), tol.exact_linear(x, w), tol.magnitude_linear(x, w),
                          torch.float32, n_floor=tol.gemm_floor(x.shape[1]))
    r = _arith_result(res, "logits")
    r.path = _explain(ctx.ops, "router_gemm", x, w)
    return r


def _router_gemm_errors(seed):
    g = D.generator(seed)
    x = torch.randn(4, 16, generator=g).bfloat16()
    w = torch.randn(6, 16, generator=g)
    explicit = [
        ("weight bf16", {"weight": w.bfloat16()}, ("weight",)),
        ("H mismatch", {"weight": torch.randn(6, 15, generator=g)}, ("weight",)),
        ("no experts", {"weight": torch.randn(0, 16, generator=g)}, ("weight",)),
        ("H = 0", {"x": torch.randn(4, 0).bfloat16(), "weight": torch.randn(6, 0)}, ("x", "weight")),
        ("x int", {"x": torch.ones(4, 16, dtype=torch.int32)}, ("x",)),
        ("x 3-D", {"x": x.unsqueeze(0)}, ("x",)),
    ]
    rules = {"x": TensorRule((torch.float64, torch.int32), dims=(1,), dim_names=("x", "weight"), device_ref=True),
             "weight": TensorRule((torch.float64, torch.bfloat16, torch.int32), dims=(1,), dim_names=("weight",))}
    return CallSpec({"x": x, "weight": w}, ("x", "weight"), rules, explicit)


ENTRIES = (
    OpInfo("router_gemm", ref_router_gemm, _draw_router_gemm, _make_router_gemm, _compare_router_gemm,
           _router_gemm_errors, dists=NO_NAN, token_gather=_x_gather, weight=1.0),
)
