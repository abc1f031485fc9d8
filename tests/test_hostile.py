"""Hostile direct calls of every torch.ops.moelab op (SPEC: "never a crash, never a silent
wrong answer, never a write outside the outputs").

The Python wrappers validate every public call (reference/validate.py) before they reach a
kernel; these tests bypass them and call torch.ops.moelab.<op> directly, starting from one
small valid call per op and changing one argument at a time:

- wrong dtypes, ranks, sizes, zero-size dims, strides (transposed, stepped, stride-0
  expanded) where a kernel needs contiguity, index values out of range, non-finite scalars,
  and permute_out buffers that are too small, of another dtype, or share memory with an input
  or another output. Each must raise RuntimeError whose message names the op
  ('moelab::<op>') and the argument ('<arg>').
- sizes whose products overflow the index math, built from stride-0 expanded tensors (a few
  bytes of storage): rejected before anything is allocated or any kernel runs.
- the meta device: a call with only meta tensors runs the fake kernel and returns correctly
  shaped meta outputs; a call that MIXES meta and CPU tensors also lands on the fake kernel
  (the dispatcher picks the Meta key whenever any argument is meta), which must raise rather
  than hand back uninitialized CPU tensors (it did, before these tests).
- the strided inputs a kernel does accept give the same bits as their contiguous copies.

Out-of-bounds accesses: permute_out writes into views of larger canary-filled buffers, which
must be intact after every call (valid or hostile); the sanitizer build runs this file too.
Nothing here allocates more than a few MB.
"""
from __future__ import annotations

import math

import pytest
import torch

import optimized  # noqa: F401  (builds and loads the extension: registers torch.ops.moelab)
from reference.quant import quantize_fp8_block, quantize_mxfp4
from reference.validate import capacity

ops = torch.ops.moelab
BIG = 2 ** 62          # a size whose product with almost anything overflows int64
NAN, INF = float("nan"), float("inf")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def huge(n: int, *tail: int, dtype=torch.float32, fill=0) -> torch.Tensor:
    """An [n, *tail] tensor of one repeated row: stride 0 along dim 0, a few bytes of storage."""
    return torch.full((1, *tail), fill, dtype=dtype).expand(n, *tail)


def stepped(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The same values as t, every other element along `dim` of a twice-as-large buffer."""
    shape = list(t.shape)
    shape[dim] *= 2
    buf = torch.zeros(shape, dtype=t.dtype)
    idx = [slice(None)] * t.dim()
    idx[dim] = slice(0, None, 2)
    buf[tuple(idx)] = t
    return buf[tuple(idx)]


def transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values as a 2-D t, stored column-major (stride (1, rows))."""
    return t.t().contiguous().t()


# ------------------------------------------------------------------ valid base calls
# Each returns fresh keyword arguments (schema names) of one small valid call.

E_R = 16


def route_base():
    g = _gen(1)
    return dict(logits=torch.randn(5, E_R, generator=g), top_k=4, method="sigmoid_bias",
                bias=torch.randn(E_R, generator=g), scaling=2.5, renormalize=False, n_group=1, topk_group=1)


def route_grouped():
    return {**route_base(), "method": "grouped_sigmoid_bias", "n_group": 4, "topk_group": 2}


def route_softmax():
    return {**route_base(), "method": "softmax_topk", "bias": None, "scaling": 1.0, "renormalize": True}


# SPEC 6: the methods added in December, with renormalize and norm_eps set
def route_grouped_softmax():
    return {**route_softmax(), "method": "grouped_softmax", "scaling": 2.5, "n_group": 4, "topk_group": 2}


def route_softmax_bias():
    return {**route_base(), "method": "softmax_bias", "renormalize": None, "norm_eps": 1e-6}


def router_gemm_base():
    g = _gen(2)
    return dict(x=torch.randn(5, 24, generator=g).to(torch.bfloat16), weight=torch.randn(8, 24, generator=g))


def skinny_base():
    g = _gen(3)
    return dict(x=torch.randn(3, 20, generator=g).to(torch.bfloat16),
                weight=torch.randn(7, 20, generator=g).to(torch.bfloat16),
                bias=torch.randn(7, generator=g).to(torch.bfloat16))


T_P, K_P, E_P, H_P = 5, 2, 4, 6


def _ids(T=T_P, K=K_P, E=E_P, seed=4, dtype=torch.int32):
    ids = torch.randint(0, E, (T, K), generator=_gen(seed), dtype=torch.int64)
    ids[1, 0] = -1
    return ids.to(dtype)


def permute_base():
    return dict(hidden=torch.randn(T_P, H_P, generator=_gen(5)), ids=_ids(), n_experts=E_P, expert_map=None,
                n_local_experts=E_P, align=1)


def permute_map():
    # global experts 0..5, local 0..2 (3 and 5 dropped, 4 -> 2)
    return dict(hidden=torch.randn(T_P, H_P, generator=_gen(5)), ids=_ids(E=6), n_experts=6,
                expert_map=torch.tensor([0, 1, -1, -1, 2, -1], dtype=torch.int32), n_local_experts=3, align=4)


def permute_out_buffers(kw, counts_numel=None):
    """Fresh, correctly shaped out buffers for a permute call's kwargs."""
    T, H = kw["hidden"].shape
    K, e_loc = kw["ids"].shape[1], kw["n_local_experts"]
    cap = capacity(T, K, e_loc, kw["align"])
    return dict(offsets=torch.empty(e_loc + 1, dtype=torch.int64), hidden_out=torch.empty(cap, H, dtype=kw["hidden"].dtype),
                src_row=torch.empty(cap, dtype=torch.int32), dst_pos=torch.empty(T * K, dtype=torch.int32),
                counts=torch.empty(e_loc if counts_numel is None else counts_numel, dtype=torch.int64))


def permute_out_base():
    kw = permute_base()
    return {**kw, **permute_out_buffers(kw)}


def permute_out_map():
    kw = permute_map()
    return {**kw, **permute_out_buffers(kw)}


ROWS_U, T_U, K_U, H_U = 9, 4, 2, 5


def unpermute_base():
    g = _gen(6)
    pos = torch.randperm(ROWS_U, generator=g)[: T_U * K_U].to(torch.int32)
    pos[3] = -1
    return dict(expert_out=torch.randn(ROWS_U, H_U, generator=g).to(torch.bfloat16),
                weights=torch.rand(T_U, K_U, generator=g), dst_pos=pos)


T_F, H_F, I_F, E_F, K_F = 3, 32, 32, 4, 2


def _fe_common(seed=7):
    g = _gen(seed)
    x = torch.randn(T_F, H_F, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E_F, generator=g)[:K_F] for _ in range(T_F)]).to(torch.int32)
    w = torch.rand(T_F, K_F, generator=g)
    return g, dict(x=x, topk_weights=w, topk_ids=ids, E=E_F, I=I_F, w13_scale=None, w2_scale=None,
                   w13_slow=None, w2_slow=None, w13_bias=None, w2_bias=None, activation="silu",
                   alpha=1.702, limit=7.0, policy=2, m_cross=4)


def _fe_weights(g):
    w13 = torch.randn(E_F, 2 * I_F, H_F, generator=g) * 0.1
    w2 = torch.randn(E_F, H_F, I_F, generator=g) * 0.1
    return w13, w2


def fe_base():
    g, kw = _fe_common()
    w13, w2 = _fe_weights(g)
    return {**kw, "w13": w13.to(torch.bfloat16), "w2": w2.to(torch.bfloat16), "quant": "bf16", "packed": False}


def fe_oai():
    g = _gen(8)
    return {**fe_base(), "activation": "swiglu_oai", "w13_bias": torch.randn(E_F, 2 * I_F, generator=g),
            "w2_bias": torch.randn(E_F, H_F, generator=g).to(torch.bfloat16)}


def fe_fp8():
    g, kw = _fe_common()
    w13, w2 = _fe_weights(g)
    (q13, s13), (q2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    return {**kw, "w13": q13, "w2": q2, "w13_scale": s13, "w2_scale": s2, "quant": "fp8_block", "packed": False}


def fe_mx():
    g, kw = _fe_common()
    w13, w2 = _fe_weights(g)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    return {**kw, "w13": q13, "w2": q2, "w13_scale": s13, "w2_scale": s2, "quant": "mxfp4", "packed": False}


def _packed(base):
    kw = base()
    p13, s13, f13 = ops.prepack_moe_weight(kw["w13"], kw["w13_scale"], kw["quant"])
    p2, s2, f2 = ops.prepack_moe_weight(kw["w2"], kw["w2_scale"], kw["quant"])
    none = kw["quant"] == "bf16"
    return {**kw, "w13": p13, "w2": p2, "w13_scale": None if none else s13, "w2_scale": None if none else s2,
            "w13_slow": f13, "w2_slow": f2, "packed": True}


def fe_packed():
    return _packed(fe_base)


def fe_packed_mx():
    return _packed(fe_mx)


def fe_on_input():
    """apply_router_weight_on_input (SPEC 6) on prepacked fp8 weights with biases."""
    g = _gen(10)
    return {**_packed(fe_fp8), "apply_router_weight_on_input": True,
            "w13_bias": torch.randn(E_F, 2 * I_F, generator=g), "w2_bias": torch.randn(E_F, H_F, generator=g)}


def prepack_base():
    return dict(w=(torch.randn(3, 40, 24, generator=_gen(9)) * 0.1).to(torch.bfloat16), scale=None, quant="bf16")


def prepack_fp8():
    q, s = quantize_fp8_block(torch.randn(3, 40, 24, generator=_gen(9)))
    return dict(w=q, scale=s, quant="fp8_block")


def prepack_mx():
    q, s = quantize_mxfp4(torch.randn(3, 40, 64, generator=_gen(9)))
    return dict(w=q, scale=s, quant="mxfp4")


def _pack_experts(base):
    """moelab::pack_moe_experts (the pack cache's op) on the standard weights of a fused_experts
    base, into buffers shaped as prepack_moe_weight's."""
    kw = base()
    out = dict(topk_ids=kw["topk_ids"], done=torch.zeros(E_F, dtype=torch.uint8), w13=kw["w13"],
               w13_scale=kw["w13_scale"], w2=kw["w2"], w2_scale=kw["w2_scale"], quant=kw["quant"])
    for m in ("13", "2"):
        p, s, f = ops.prepack_moe_weight(kw["w" + m], kw[f"w{m}_scale"], kw["quant"])
        out.update({f"p{m}": torch.zeros_like(p), f"q{m}": None if kw["quant"] == "bf16" else torch.zeros_like(s),
                    f"f{m}": torch.zeros_like(f)})
    return out


def pack_base():
    return _pack_experts(fe_base)


def pack_fp8():
    return _pack_experts(fe_fp8)


def pack_mx():
    return _pack_experts(fe_mx)


def route_variant_serial():       # seed 004's before kernel (experiments only), same checks as route
    return {**route_base(), "selection": "serial"}


def route_variant_grouped():
    return {**route_grouped_softmax(), "selection": "serial"}


def fe_rows():
    """fused_experts_rows (the parallel layer's op): fused_experts' arguments plus a y_init."""
    kw = fe_oai()
    kw["y_init"] = torch.randn(kw["topk_ids"].numel(), H_F, generator=_gen(9))
    return kw


def fe_rows_fp8():
    return {**fe_fp8(), "y_init": None}


def read_stream_base():
    """The benchmarks' streaming-read probe (a measurement tool, csrc/torch/bench_probe.cpp)."""
    return {"buf": torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=_gen(11)), "streams_per_thread": 4}


BASES = {
    "fused_experts_rows": [fe_rows, fe_rows_fp8],
    "route": [route_base, route_grouped, route_softmax, route_grouped_softmax, route_softmax_bias],
    "route_variant": [route_variant_serial, route_variant_grouped],
    "router_gemm": [router_gemm_base],
    "skinny_gemm": [skinny_base],
    "permute": [permute_base, permute_map],
    "permute_out": [permute_out_base, permute_out_map],
    "unpermute": [unpermute_base],
    "fused_experts": [fe_base, fe_oai, fe_fp8, fe_mx, fe_packed, fe_packed_mx, fe_on_input],
    "prepack_moe_weight": [prepack_base, prepack_fp8, prepack_mx],
    "pack_moe_experts": [pack_base, pack_fp8, pack_mx],
    "read_stream": [read_stream_base],
}


def run(op, kw):
    return getattr(ops, op)(**kw)


def test_every_op_is_covered():
    """The sweep lists every op of the library (a new op must be added here)."""
    schemas = [s for s in torch._C._jit_get_all_schemas() if s.name.startswith("moelab::")]
    names = {s.name.split("::", 1)[1] for s in schemas}
    # introspection ops without tensor arguments (the gpu_* ones exist in GPU builds only)
    no_tensors = {s.name.split("::", 1)[1] for s in schemas
                  if not any("Tensor" in str(a.type) for a in s.arguments)}
    assert {"backend_info", "set_isa"} <= no_tensors
    assert all(n in ("backend_info", "set_isa") or n.startswith("gpu_") for n in no_tensors), no_tensors
    assert names - no_tensors == set(BASES), names


@pytest.mark.parametrize("op,base", [(op, b) for op, bs in BASES.items() for b in bs],
                         ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_base_calls_are_valid(op, base):
    """Every starting point runs (so each hostile case below differs from a valid call in
    exactly the argument it changes)."""
    run(op, base())


# ------------------------------------------------------------------ the hostile table
CASES = []


def bad(op, base, arg, desc, post=None, **over):
    """One case: `base` with the arguments in `over` replaced; a callable value is applied
    to the base kwargs (to derive the bad value from the valid one); `post(kw)` may then
    rearrange several arguments at once."""
    def make():
        kw = base()
        for k, v in over.items():
            kw[k] = v(kw) if callable(v) and not isinstance(v, torch.Tensor) else v
        if post is not None:
            post(kw)
        return kw
    CASES.append(pytest.param(op, arg, make, id=f"{op}-{base.__name__}-{arg}-{desc}"))


def dtypes_except(*ok):
    return [d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64,
                        torch.int16, torch.uint8, torch.int8, torch.bool, torch.float8_e4m3fn, torch.complex64)
            if d not in ok]


def recast(name, dtype):
    return lambda kw: kw[name].to(dtype)


# ---- route
for d in dtypes_except(torch.float32, torch.bfloat16, torch.float16):
    bad("route", route_base, "logits", f"dtype-{d}", logits=recast("logits", d))
for d in dtypes_except(torch.float32, torch.bfloat16):
    bad("route", route_base, "bias", f"dtype-{d}", bias=recast("bias", d))
bad("route", route_base, "logits", "rank1", logits=lambda kw: kw["logits"][0])
bad("route", route_base, "logits", "rank3", logits=lambda kw: kw["logits"][None])
bad("route", route_base, "logits", "rank0", logits=torch.tensor(1.0))
bad("route", route_base, "logits", "E0", logits=torch.zeros(5, 0), bias=torch.zeros(0))
bad("route", route_base, "logits", "E4096", logits=torch.zeros(5, 4096), bias=torch.zeros(4096))
# E out of range on a huge expanded tensor: rejected before the contiguous copy (which
# allocated T*E floats first and failed with an allocator error naming no op).
bad("route", route_base, "logits", "E-huge-expanded", logits=torch.zeros(1, 1).expand(2 ** 40, 2 ** 12))
bad("route", route_grouped, "logits", "grouped-E2048", logits=torch.zeros(5, 2048), bias=torch.zeros(2048),
    n_group=8)
for k in (0, -1, E_R + 1, 33, 2 ** 40):
    bad("route", route_base, "top_k", f"{k}", top_k=k)
bad("route", route_base, "top_k", "33-of-64", top_k=33, logits=torch.zeros(5, 64), bias=torch.zeros(64))
bad("route", route_softmax, "top_k", "llama4-k2", method="llama4", top_k=2, renormalize=False)
bad("route", route_grouped, "top_k", "more-than-kept-groups", top_k=9)
for m in ("nope", "", "softmax_topk ", "SOFTMAX_TOPK"):
    bad("route", route_base, "method", repr(m), method=m)
bad("route", route_base, "bias", "missing", bias=None)
bad("route", route_softmax, "bias", "not-used", bias=torch.zeros(E_R))
bad("route", route_base, "bias", "rank2", bias=lambda kw: kw["bias"][None])
bad("route", route_base, "bias", "rank0", bias=torch.tensor(1.0))
bad("route", route_base, "bias", "size-E+1", bias=torch.zeros(E_R + 1))
bad("route", route_base, "bias", "size0", bias=torch.zeros(0))
# Before: the binding made a contiguous copy of the bias before checking its size.
bad("route", route_base, "bias", "huge-expanded", bias=torch.zeros(1).expand(2 ** 40))
for s in (NAN, INF, -INF):
    bad("route", route_base, "scaling", f"{s}", scaling=s)
for s in (NAN, INF):   # scaling applies to every method (SPEC 6), finite
    bad("route", route_softmax, "scaling", f"softmax-{s}", scaling=s)
bad("route", route_softmax, "renormalize", "llama4", method="llama4", top_k=1)
for e in (NAN, INF, -INF, -1e-6, -0.5):
    bad("route", route_base, "norm_eps", f"{e}", norm_eps=e)
    bad("route", route_softmax_bias, "norm_eps", f"softmax_bias-{e}", norm_eps=e)
for m in ("softmax_topk", "topk_softmax"):   # methods that divide by the plain sum
    bad("route", route_softmax, "norm_eps", f"{m}", method=m, norm_eps=1e-6)
bad("route", route_softmax, "norm_eps", "llama4", method="llama4", top_k=1, renormalize=None, norm_eps=0.0)
bad("route", route_grouped_softmax, "norm_eps", "grouped_softmax", norm_eps=1e-6)
bad("route", route_softmax_bias, "bias", "softmax_bias-missing", bias=None)
bad("route", route_softmax_bias, "bias", "softmax_bias-size-E+1", bias=torch.zeros(E_R + 1))
bad("route", route_softmax_bias, "bias", "softmax_bias-dtype-f16", bias=recast("bias", torch.float16))
bad("route", route_grouped_softmax, "bias", "grouped_softmax-given", bias=torch.zeros(E_R))
# route_variant (seed 004's before/after pair): the selection name, then route's checks under its own name
for sel in ("", "Serial", "lanes ", "warp0"):
    bad("route_variant", route_variant_serial, "selection", repr(sel), selection=sel)
for k in (0, 33, 2 ** 40):
    bad("route_variant", route_variant_serial, "top_k", f"{k}", top_k=k)
bad("route_variant", route_variant_serial, "logits", "E4096", logits=torch.zeros(5, 4096), bias=torch.zeros(4096))
bad("route_variant", route_variant_serial, "logits", "E-huge-expanded",
    logits=torch.zeros(1, 1).expand(2 ** 40, 2 ** 12))
bad("route_variant", route_variant_serial, "bias", "huge-expanded", bias=torch.zeros(1).expand(2 ** 40))
bad("route_variant", route_variant_serial, "bias", "missing", bias=None)
bad("route_variant", route_variant_grouped, "n_group", "3", n_group=3)
for n in (0, 3, 16, 33):
    bad("route", route_grouped_softmax, "n_group", f"grouped_softmax-{n}", n_group=n)
for n in (0, 5):
    bad("route", route_grouped_softmax, "topk_group", f"grouped_softmax-{n}", topk_group=n)
bad("route", route_grouped_softmax, "top_k", "grouped_softmax-more-than-kept-groups", top_k=9)
bad("route", route_grouped_softmax, "logits", "grouped_softmax-E2048", logits=torch.zeros(5, 2048), n_group=8)
bad("route", route_softmax_bias, "n_group", "softmax_bias-not-grouped", n_group=2)
for n in (0, -4, 3, 16, 33, 2 ** 40):
    bad("route", route_grouped, "n_group", f"{n}", n_group=n)
bad("route", route_base, "n_group", "not-grouped", n_group=2)
for n in (0, -1, 5):
    bad("route", route_grouped, "topk_group", f"{n}", topk_group=n)
bad("route", route_base, "topk_group", "not-grouped", topk_group=2)

# ---- router_gemm
for d in dtypes_except(torch.float32, torch.bfloat16, torch.float16):
    bad("router_gemm", router_gemm_base, "x", f"dtype-{d}", x=recast("x", d))
for d in dtypes_except(torch.float32):
    bad("router_gemm", router_gemm_base, "weight", f"dtype-{d}", weight=recast("weight", d))
bad("router_gemm", router_gemm_base, "x", "rank1", x=lambda kw: kw["x"][0])
bad("router_gemm", router_gemm_base, "x", "rank3", x=lambda kw: kw["x"][None])
bad("router_gemm", router_gemm_base, "weight", "rank1", weight=lambda kw: kw["weight"][0])
bad("router_gemm", router_gemm_base, "weight", "rank3", weight=lambda kw: kw["weight"][None])
bad("router_gemm", router_gemm_base, "weight", "H-mismatch", weight=torch.zeros(8, 23))
bad("router_gemm", router_gemm_base, "x", "H0", x=torch.zeros(5, 0, dtype=torch.bfloat16), weight=torch.zeros(8, 0))
bad("router_gemm", router_gemm_base, "weight", "E0", weight=torch.zeros(0, 24))
bad("router_gemm", router_gemm_base, "x", "transposed", x=lambda kw: transposed(kw["x"]))
bad("router_gemm", router_gemm_base, "x", "stepped-H", x=lambda kw: stepped(kw["x"], 1))
bad("router_gemm", router_gemm_base, "x", "expanded-H", x=torch.zeros(5, 1, dtype=torch.bfloat16).expand(5, 24))
bad("router_gemm", router_gemm_base, "weight", "transposed", weight=lambda kw: transposed(kw["weight"]))
bad("router_gemm", router_gemm_base, "weight", "stepped", weight=lambda kw: stepped(kw["weight"]))
bad("router_gemm", router_gemm_base, "weight", "expanded", weight=huge(8, 24))
# T*E overflows int64 (T = 2^62 stride-0 rows): before, at::empty failed with a message that
# names no op.
bad("router_gemm", router_gemm_base, "x", "T*E-overflow", x=huge(BIG, 1, dtype=torch.bfloat16),
    weight=torch.zeros(8, 1))

# ---- skinny_gemm
for d in dtypes_except(torch.float32, torch.bfloat16, torch.float16):
    bad("skinny_gemm", skinny_base, "x", f"dtype-{d}", x=recast("x", d))
for d in dtypes_except(torch.bfloat16):
    bad("skinny_gemm", skinny_base, "weight", f"dtype-{d}", weight=recast("weight", d))
    bad("skinny_gemm", skinny_base, "bias", f"dtype-{d}", bias=recast("bias", d))
bad("skinny_gemm", skinny_base, "x", "rank1", x=lambda kw: kw["x"][0])
bad("skinny_gemm", skinny_base, "x", "rank3", x=lambda kw: kw["x"][None])
bad("skinny_gemm", skinny_base, "weight", "rank3", weight=lambda kw: kw["weight"][None])
bad("skinny_gemm", skinny_base, "bias", "rank2", bias=lambda kw: kw["bias"][None])
bad("skinny_gemm", skinny_base, "bias", "rank0", bias=torch.tensor(1.0, dtype=torch.bfloat16))
bad("skinny_gemm", skinny_base, "x", "T9", x=torch.zeros(9, 20, dtype=torch.bfloat16))
bad("skinny_gemm", skinny_base, "x", "T-huge-expanded", x=huge(BIG, 1, dtype=torch.bfloat16),
    weight=torch.zeros(7, 1, dtype=torch.bfloat16))
bad("skinny_gemm", skinny_base, "x", "K0", x=torch.zeros(3, 0, dtype=torch.bfloat16),
    weight=torch.zeros(7, 0, dtype=torch.bfloat16))
bad("skinny_gemm", skinny_base, "weight", "K-mismatch", weight=torch.zeros(7, 21, dtype=torch.bfloat16))
bad("skinny_gemm", skinny_base, "weight", "N0", weight=torch.zeros(0, 20, dtype=torch.bfloat16),
    bias=torch.zeros(0, dtype=torch.bfloat16))
bad("skinny_gemm", skinny_base, "bias", "size-N+1", bias=torch.zeros(8, dtype=torch.bfloat16))
bad("skinny_gemm", skinny_base, "bias", "stepped", bias=lambda kw: stepped(kw["bias"]))
bad("skinny_gemm", skinny_base, "bias", "expanded", bias=huge(7, dtype=torch.bfloat16))
bad("skinny_gemm", skinny_base, "x", "transposed", x=lambda kw: transposed(kw["x"]))
bad("skinny_gemm", skinny_base, "x", "stepped-K", x=lambda kw: stepped(kw["x"], 1))
bad("skinny_gemm", skinny_base, "weight", "transposed", weight=lambda kw: transposed(kw["weight"]))
bad("skinny_gemm", skinny_base, "weight", "stepped-K", weight=lambda kw: stepped(kw["weight"], 1))
# T*N overflows int64 (N = 2^62 stride-0 weight rows).
bad("skinny_gemm", skinny_base, "weight", "T*N-overflow", x=torch.zeros(3, 1, dtype=torch.bfloat16),
    weight=huge(BIG, 1, dtype=torch.bfloat16), bias=None)

# ---- permute and permute_out (same input checks; permute_out adds the buffers)
for op, base, mbase in (("permute", permute_base, permute_map), ("permute_out", permute_out_base, permute_out_map)):
    for d in dtypes_except(torch.float32, torch.bfloat16, torch.float16):
        if op == "permute_out":   # the input check fires first; hidden_out follows hidden's dtype
            bad(op, base, "hidden", f"dtype-{d}", hidden=recast("hidden", d),
                hidden_out=lambda kw, d=d: kw["hidden_out"].to(d))
        else:
            bad(op, base, "hidden", f"dtype-{d}", hidden=recast("hidden", d))
    for d in dtypes_except(torch.int32, torch.int64):
        bad(op, base, "ids", f"dtype-{d}", ids=recast("ids", d))
    for d in dtypes_except(torch.int32):
        bad(op, mbase, "expert_map", f"dtype-{d}", expert_map=recast("expert_map", d))
    bad(op, base, "hidden", "rank1", hidden=lambda kw: kw["hidden"].reshape(-1))
    bad(op, base, "hidden", "rank3", hidden=lambda kw: kw["hidden"][None])
    bad(op, base, "ids", "rank1", ids=lambda kw: kw["ids"].reshape(-1))
    bad(op, base, "ids", "rank3", ids=lambda kw: kw["ids"][None])
    bad(op, mbase, "expert_map", "rank2", expert_map=lambda kw: kw["expert_map"][None])
    bad(op, mbase, "expert_map", "rank0", expert_map=torch.tensor(0, dtype=torch.int32))
    bad(op, base, "ids", "T-mismatch", ids=lambda kw: kw["ids"][:-1])
    bad(op, base, "ids", "K0", ids=lambda kw: kw["ids"][:, :0])
    bad(op, base, "hidden", "transposed", hidden=lambda kw: transposed(kw["hidden"]))
    bad(op, base, "hidden", "stepped-H", hidden=lambda kw: stepped(kw["hidden"], 1))
    for n in (0, -1, 2 ** 31, 2 ** 62):
        bad(op, base, "n_experts", f"{n}", n_experts=n)
    for n in (0, -1, 2 ** 31):
        bad(op, mbase, "n_local_experts", f"{n}", n_local_experts=n)
    bad(op, base, "n_local_experts", "no-map-mismatch", n_local_experts=E_P - 1)
    for a in (0, -1, 2 ** 31, 2 ** 62):
        bad(op, base, "align", f"{a}", align=a)
    bad(op, mbase, "expert_map", "size-E-1", expert_map=lambda kw: kw["expert_map"][:-1])
    bad(op, mbase, "expert_map", "size-E+1", expert_map=lambda kw: torch.cat([kw["expert_map"], kw["expert_map"][:1]]))
    # index values
    for v in (E_P, -2, 2 ** 31 - 1, -2 ** 31):
        bad(op, base, "ids", f"value{v}", ids=lambda kw, v=v: kw["ids"].index_fill(0, torch.tensor([2]), v))
    for v in (2 ** 40, -2 ** 40, E_P):
        bad(op, base, "ids", f"int64-value{v}",
            ids=lambda kw, v=v: kw["ids"].to(torch.int64).index_fill(0, torch.tensor([3]), v))
    bad(op, base, "ids", "stepped-bad-value",
        ids=lambda kw: stepped(kw["ids"].index_fill(0, torch.tensor([4]), E_P), 1))
    for v in (3, -2, 2 ** 31 - 1):
        bad(op, mbase, "expert_map", f"value{v}", expert_map=lambda kw, v=v: kw["expert_map"].index_fill(0, torch.tensor([5]), v))
    # an unused map entry out of range is still a bad input
    bad(op, mbase, "expert_map", "unused-entry-bad",
        ids=lambda kw: torch.zeros_like(kw["ids"]), expert_map=lambda kw: kw["expert_map"].index_fill(0, torch.tensor([3]), 7))
    # T*K >= 2^31 (positions are int32), from stride-0 expanded inputs: no memory needed
    bad(op, base, "ids", "T*K-2^31", hidden=huge(2 ** 31, H_P), ids=huge(2 ** 31, 1, dtype=torch.int32))
    bad(op, base, "ids", "T*K-2^32", hidden=huge(2 ** 30, H_P), ids=huge(2 ** 30, 4, dtype=torch.int64))
    # capacity T*K + E_loc*(align-1) >= 2^31
    bad(op, base, "align", "capacity-2^31", align=2 ** 29)
    bad(op, mbase, "align", "capacity-2^31-map", n_local_experts=2 ** 20, align=2 ** 11 + 1)

# permute_out's buffers: dtype, shape, rank, contiguity, device, aliasing.
OUTS = {"offsets": torch.int64, "hidden_out": torch.float32, "src_row": torch.int32, "dst_pos": torch.int32,
        "counts": torch.int64}
for name, dt in OUTS.items():
    for d in dtypes_except(dt):
        bad("permute_out", permute_out_base, name, f"dtype-{d}", **{name: recast(name, d)})
    bad("permute_out", permute_out_base, name, "too-small",
        **{name: lambda kw, n=name: kw[n][:-1]})
    bad("permute_out", permute_out_base, name, "too-large",
        **{name: lambda kw, n=name: torch.cat([kw[n], kw[n][:1]])})
    bad("permute_out", permute_out_base, name, "empty", **{name: lambda kw, n=name: kw[n][:0]})
    bad("permute_out", permute_out_base, name, "rank+1", **{name: lambda kw, n=name: kw[n][None]})
    bad("permute_out", permute_out_base, name, "stepped", **{name: lambda kw, n=name: stepped(kw[n])})
    # internal overlap: every element the same memory
    bad("permute_out", permute_out_base, name, "expanded",
        **{name: lambda kw, n=name: kw[n][:1].expand(kw[n].shape)})
    if name != "dst_pos":   # (dst_pos has T*K entries in both calls)
        bad("permute_out", permute_out_map, name, "from-another-call",
            **{name: lambda kw, n=name: permute_out_buffers(permute_base())[n]})
bad("permute_out", permute_out_base, "hidden_out", "transposed",
    hidden_out=lambda kw: transposed(kw["hidden_out"]))
bad("permute_out", permute_out_base, "counts", "from-a-bigger-call", counts=torch.empty(E_P + 3, dtype=torch.int64))
bad("permute_out", permute_out_base, "hidden_out", "f64-of-f32", hidden_out=recast("hidden_out", torch.float64))


def bytes_of(t: torch.Tensor, like: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """A tensor of like's dtype and shape made of t's memory, starting `offset` bytes in."""
    flat = t.reshape(-1).view(torch.uint8)
    n = like.numel() * like.element_size()
    assert flat.numel() >= offset + n
    return flat[offset: offset + n].view(like.dtype).view(like.shape)


def into(buf_name: str, in_name: str, offset: int = 0):
    """A `post` step: input `in_name` moved into output `buf_name`'s memory (same values)."""
    def f(kw):
        kw[in_name] = bytes_of(kw[buf_name], kw[in_name], offset).copy_(kw[in_name])
    return f


def onto(out_name: str, in_name: str, offset: int = 0):
    """A `post` step: output `out_name` made of input `in_name`'s memory."""
    def f(kw):
        kw[out_name] = bytes_of(kw[in_name], kw[out_name], offset)
    return f


def overlap(a: str, b: str, shift: int):
    """A `post` step: outputs a and b carved from one buffer, b starting `shift` bytes after a."""
    def f(kw):
        na, nb = kw[a].numel() * kw[a].element_size(), kw[b].numel() * kw[b].element_size()
        buf = torch.empty(max(na, shift + nb) + 64, dtype=torch.uint8)
        kw[a], kw[b] = bytes_of(buf, kw[a]), bytes_of(buf, kw[b], shift)
    return f


# outputs that share memory with an input (the kernel reads ids twice and copies hidden rows
# while it writes): refused. Every alias is exact byte-range overlap of real tensors.
bad("permute_out", permute_out_base, "hidden_out", "holds-hidden", post=into("hidden_out", "hidden"))
bad("permute_out", permute_out_base, "hidden_out", "holds-hidden-tail", post=into("hidden_out", "hidden", 4 * H_P * 4))
bad("permute_out", permute_out_base, "src_row", "holds-ids", post=into("src_row", "ids"))
bad("permute_out", permute_out_base, "dst_pos", "holds-ids", post=into("dst_pos", "ids"))
bad("permute_out", permute_out_base, "offsets", "holds-ids", post=into("offsets", "ids"))
bad("permute_out", permute_out_base, "counts", "inside-ids", post=onto("counts", "ids"))
bad("permute_out", permute_out_map, "dst_pos", "holds-expert_map", post=into("dst_pos", "expert_map", 8))
bad("permute_out", permute_out_map, "counts", "holds-expert_map", post=into("counts", "expert_map"))
# outputs that share memory with each other: refused
bad("permute_out", permute_out_base, "counts", "overlaps-offsets", post=overlap("offsets", "counts", 24))
bad("permute_out", permute_out_base, "dst_pos", "overlaps-src_row", post=overlap("src_row", "dst_pos", 8))
bad("permute_out", permute_out_base, "dst_pos", "is-src_row", post=overlap("src_row", "dst_pos", 0))
bad("permute_out", permute_out_base, "offsets", "inside-hidden_out", post=overlap("hidden_out", "offsets", 16))
bad("permute_out", permute_out_base, "counts", "last-byte-of-src_row",
    post=overlap("src_row", "counts", T_P * K_P * 4 - 8))

# ---- unpermute
for d in dtypes_except(torch.float32, torch.bfloat16, torch.float16):
    bad("unpermute", unpermute_base, "expert_out", f"dtype-{d}", expert_out=recast("expert_out", d))
for d in dtypes_except(torch.float32):
    bad("unpermute", unpermute_base, "weights", f"dtype-{d}", weights=recast("weights", d))
for d in dtypes_except(torch.int32):
    bad("unpermute", unpermute_base, "dst_pos", f"dtype-{d}", dst_pos=recast("dst_pos", d))
bad("unpermute", unpermute_base, "expert_out", "rank1", expert_out=lambda kw: kw["expert_out"][0])
bad("unpermute", unpermute_base, "expert_out", "rank3", expert_out=lambda kw: kw["expert_out"][None])
bad("unpermute", unpermute_base, "weights", "rank1", weights=lambda kw: kw["weights"].reshape(-1))
bad("unpermute", unpermute_base, "dst_pos", "rank2", dst_pos=lambda kw: kw["dst_pos"].view(T_U, K_U))
bad("unpermute", unpermute_base, "dst_pos", "size-T*K-1", dst_pos=lambda kw: kw["dst_pos"][:-1])
bad("unpermute", unpermute_base, "dst_pos", "size-T*K+1", dst_pos=lambda kw: torch.cat([kw["dst_pos"], kw["dst_pos"][:1]]))
bad("unpermute", unpermute_base, "dst_pos", "stepped", dst_pos=lambda kw: stepped(kw["dst_pos"]))
bad("unpermute", unpermute_base, "dst_pos", "expanded", dst_pos=huge(T_U * K_U, dtype=torch.int32))
bad("unpermute", unpermute_base, "expert_out", "transposed", expert_out=lambda kw: transposed(kw["expert_out"]))
bad("unpermute", unpermute_base, "expert_out", "stepped-H", expert_out=lambda kw: stepped(kw["expert_out"], 1))
for v in (ROWS_U, -2, 2 ** 31 - 1, -2 ** 31):
    bad("unpermute", unpermute_base, "dst_pos", f"value{v}",
        dst_pos=lambda kw, v=v: kw["dst_pos"].index_fill(0, torch.tensor([5]), v))
bad("unpermute", unpermute_base, "dst_pos", "no-rows", expert_out=torch.zeros(0, H_U, dtype=torch.bfloat16))
# T = 2^31 stride-0 weight rows with K = 1: dst_pos would need 2^31 entries (not that many)
bad("unpermute", unpermute_base, "dst_pos", "T-huge", weights=huge(2 ** 31, 1))
bad("unpermute", unpermute_base, "dst_pos", "T*K-huge", weights=huge(2 ** 40, 2 ** 20))

# ---- fused_experts
FE_TENSORS = ("x", "w13", "w2", "topk_weights", "topk_ids")
for d in dtypes_except(torch.bfloat16):
    bad("fused_experts", fe_base, "x", f"dtype-{d}", x=recast("x", d))
    bad("fused_experts", fe_base, "w13", f"dtype-{d}", w13=recast("w13", d))
    bad("fused_experts", fe_base, "w2", f"dtype-{d}", w2=recast("w2", d))
for d in dtypes_except(torch.float8_e4m3fn):
    bad("fused_experts", fe_fp8, "w13", f"dtype-{d}", w13=lambda kw, d=d: kw["w13"].view(torch.uint8).to(d))
for d in dtypes_except(torch.uint8):
    bad("fused_experts", fe_mx, "w2", f"dtype-{d}", w2=recast("w2", d))
    bad("fused_experts", fe_mx, "w13_scale", f"dtype-{d}", w13_scale=recast("w13_scale", d))
    bad("fused_experts", fe_packed, "w13", f"dtype-{d}", w13=recast("w13", d))
    bad("fused_experts", fe_packed, "w2_slow", f"dtype-{d}", w2_slow=recast("w2_slow", d))
for d in dtypes_except(torch.float32):
    bad("fused_experts", fe_base, "topk_weights", f"dtype-{d}", topk_weights=recast("topk_weights", d))
    bad("fused_experts", fe_fp8, "w2_scale", f"dtype-{d}", w2_scale=recast("w2_scale", d))
for d in dtypes_except(torch.int32):
    bad("fused_experts", fe_base, "topk_ids", f"dtype-{d}", topk_ids=recast("topk_ids", d))
for d in dtypes_except(torch.float32, torch.bfloat16):
    bad("fused_experts", fe_oai, "w13_bias", f"dtype-{d}", w13_bias=recast("w13_bias", d))
    bad("fused_experts", fe_oai, "w2_bias", f"dtype-{d}", w2_bias=recast("w2_bias", d))
for name in FE_TENSORS:
    bad("fused_experts", fe_base, name, "rank+1", **{name: lambda kw, n=name: kw[n][None]})
    bad("fused_experts", fe_base, name, "rank-1", **{name: lambda kw, n=name: kw[n][0]})
bad("fused_experts", fe_oai, "w13_bias", "rank3", w13_bias=lambda kw: kw["w13_bias"][None])
bad("fused_experts", fe_oai, "w2_bias", "rank1", w2_bias=lambda kw: kw["w2_bias"][0])
bad("fused_experts", fe_fp8, "w13_scale", "rank2", w13_scale=lambda kw: kw["w13_scale"][0])
bad("fused_experts", fe_packed, "w13_slow", "rank3", w13_slow=lambda kw: kw["w13_slow"][None])
# sizes
bad("fused_experts", fe_base, "x", "H0", x=torch.zeros(T_F, 0, dtype=torch.bfloat16))
bad("fused_experts", fe_base, "w13", "H-mismatch", x=torch.zeros(T_F, H_F + 2, dtype=torch.bfloat16))
for e in (0, -1, 2 ** 20 + 1, 2 ** 62):
    bad("fused_experts", fe_base, "E", f"{e}", E=e)
bad("fused_experts", fe_base, "w13", "E-mismatch", E=E_F + 1)
for i in (0, -1, 2 ** 24 + 1, 2 ** 62):
    bad("fused_experts", fe_base, "I", f"{i}", I=i)
bad("fused_experts", fe_base, "w13", "I-mismatch", I=I_F - 1)
bad("fused_experts", fe_base, "w13", "E-short", w13=lambda kw: kw["w13"][:-1])
bad("fused_experts", fe_base, "w2", "E-short", w2=lambda kw: kw["w2"][:-1])
bad("fused_experts", fe_base, "w2", "I-short", w2=lambda kw: kw["w2"][:, :, :-1].contiguous())
bad("fused_experts", fe_base, "w13", "2I-short", w13=lambda kw: kw["w13"][:, :-1].contiguous())
bad("fused_experts", fe_mx, "x", "mxfp4-H%32", x=torch.zeros(T_F, 16, dtype=torch.bfloat16))
bad("fused_experts", fe_mx, "I", "mxfp4-I%32", I=16)
bad("fused_experts", fe_base, "topk_ids", "T-mismatch", topk_ids=lambda kw: kw["topk_ids"][:-1],
    topk_weights=lambda kw: kw["topk_weights"][:-1])
bad("fused_experts", fe_base, "topk_ids", "K0", topk_ids=lambda kw: kw["topk_ids"][:, :0],
    topk_weights=lambda kw: kw["topk_weights"][:, :0])
bad("fused_experts", fe_base, "topk_weights", "K-mismatch", topk_weights=lambda kw: kw["topk_weights"][:, :1])
bad("fused_experts", fe_base, "topk_weights", "T-mismatch", topk_weights=lambda kw: kw["topk_weights"][:-1])
bad("fused_experts", fe_oai, "w13_bias", "size", w13_bias=lambda kw: kw["w13_bias"][:, :-1])
bad("fused_experts", fe_oai, "w2_bias", "size", w2_bias=lambda kw: kw["w2_bias"][:-1])
bad("fused_experts", fe_oai, "w13_bias", "stepped", w13_bias=lambda kw: stepped(kw["w13_bias"]))
bad("fused_experts", fe_oai, "w2_bias", "expanded", w2_bias=huge(E_F, H_F))
bad("fused_experts", fe_fp8, "w13_scale", "size", w13_scale=lambda kw: kw["w13_scale"][:-1])
bad("fused_experts", fe_mx, "w2_scale", "size", w2_scale=lambda kw: kw["w2_scale"][:, :-1].contiguous())
bad("fused_experts", fe_packed, "w13", "size", w13=lambda kw: kw["w13"][:, :-1].contiguous())
bad("fused_experts", fe_packed, "w2_slow", "size", w2_slow=lambda kw: kw["w2_slow"][:, :-1].contiguous())
bad("fused_experts", fe_packed_mx, "w13_scale", "size", w13_scale=lambda kw: kw["w13_scale"][:, :-1].contiguous())
# contiguity of what the kernel reads as dense arrays
bad("fused_experts", fe_base, "x", "transposed", x=lambda kw: transposed(kw["x"]))
bad("fused_experts", fe_base, "x", "stepped-H", x=lambda kw: stepped(kw["x"], 1))
bad("fused_experts", fe_base, "w13", "stepped", w13=lambda kw: stepped(kw["w13"]))
bad("fused_experts", fe_base, "w2", "expanded", w2=lambda kw: kw["w2"][:1].expand(kw["w2"].shape))
bad("fused_experts", fe_base, "w2", "transposed", w2=lambda kw: kw["w2"].transpose(1, 2).contiguous().transpose(1, 2))
bad("fused_experts", fe_fp8, "w2_scale", "stepped", w2_scale=lambda kw: stepped(kw["w2_scale"]))
bad("fused_experts", fe_packed, "w13_slow", "stepped", w13_slow=lambda kw: stepped(kw["w13_slow"]))
# optional arguments present / absent where the format says otherwise
bad("fused_experts", fe_base, "w13_scale", "given-bf16", w13_scale=torch.ones(E_F, 1, 1))
bad("fused_experts", fe_fp8, "w2_scale", "missing", w2_scale=None)
bad("fused_experts", fe_mx, "w13_scale", "missing", w13_scale=None)
bad("fused_experts", fe_base, "w13_slow", "given-standard", w13_slow=torch.zeros(E_F, 1, dtype=torch.uint8))
bad("fused_experts", fe_packed, "w2_slow", "missing", w2_slow=None)
bad("fused_experts", fe_packed, "w13", "standard-weights-as-packed", w13=lambda kw: fe_base()["w13"])

# ---- fused_experts_rows: every fused_experts case again (its checks name the rows op), plus y_init
for _p in [c for c in CASES if c.values[0] == "fused_experts"]:
    _op, _arg, _make = _p.values
    CASES.append(pytest.param("fused_experts_rows", _arg, _make, id=_p.id.replace("fused_experts-", "fused_experts_rows-", 1)))
for d in dtypes_except(torch.float32):
    bad("fused_experts_rows", fe_rows, "y_init", f"dtype-{d}", y_init=recast("y_init", d))
bad("fused_experts_rows", fe_rows, "y_init", "rows-short", y_init=lambda kw: kw["y_init"][:-1])
bad("fused_experts_rows", fe_rows, "y_init", "rank1", y_init=lambda kw: kw["y_init"][0])
bad("fused_experts_rows", fe_rows, "y_init", "H-short", y_init=lambda kw: kw["y_init"][:, :-1].contiguous())
bad("fused_experts_rows", fe_rows, "y_init", "stepped", y_init=lambda kw: stepped(kw["y_init"]))
bad("fused_experts", fe_base, "w13", "packed-weights-as-standard", w13=lambda kw: fe_packed()["w13"])
# strings and scalars
for q in ("int4", "", "BF16", "fp8"):
    bad("fused_experts", fe_base, "quant", repr(q), quant=q)
bad("fused_experts", fe_base, "w13", "quant-fp8-on-bf16", quant="fp8_block")
for a in ("gelu", "", "SILU"):
    bad("fused_experts", fe_base, "activation", repr(a), activation=a)
for p in (-1, 3, 2 ** 40):
    bad("fused_experts", fe_base, "policy", f"{p}", policy=p)
# apply_router_weight_on_input is a bool in the schema: a value the dispatcher cannot read as one
# is refused before the kernel, naming the op and the argument. (It does read ints, floats, None
# and one-element tensors as bools, as for every bool argument; the Python layer refuses those.)
for v in ("yes", [True], (1,), {"on": True}):
    bad("fused_experts", fe_base, "apply_router_weight_on_input", f"type-{type(v).__name__}",
        apply_router_weight_on_input=v)
    bad("fused_experts", fe_on_input, "apply_router_weight_on_input", f"type-{type(v).__name__}",
        apply_router_weight_on_input=v)
bad("fused_experts", fe_on_input, "topk_weights", "K-mismatch", topk_weights=lambda kw: kw["topk_weights"][:, :1])
bad("fused_experts", fe_on_input, "topk_weights", "dtype-bfloat16", topk_weights=recast("topk_weights", torch.bfloat16))
for v in (NAN, INF, -INF):
    bad("fused_experts", fe_oai, "alpha", f"{v}", alpha=v)
    bad("fused_experts", fe_oai, "limit", f"{v}", limit=v)
# index values
for v in (E_F, -2, 2 ** 31 - 1, -2 ** 31):
    bad("fused_experts", fe_base, "topk_ids", f"value{v}",
        topk_ids=lambda kw, v=v: kw["topk_ids"].index_fill(0, torch.tensor([1]), v))
bad("fused_experts", fe_base, "topk_ids", "transposed-bad-value",
    topk_ids=lambda kw: transposed(kw["topk_ids"].index_fill(0, torch.tensor([2]), E_F)))
# T*K >= 2^31 from stride-0 expanded inputs
bad("fused_experts", fe_base, "topk_ids", "T*K-2^31", x=huge(2 ** 30, H_F, dtype=torch.bfloat16),
    topk_ids=huge(2 ** 30, 2, dtype=torch.int32), topk_weights=huge(2 ** 30, 2))

# ---- prepack_moe_weight
for d in dtypes_except(torch.bfloat16):
    bad("prepack_moe_weight", prepack_base, "w", f"dtype-{d}", w=recast("w", d))
for d in dtypes_except(torch.float32):
    bad("prepack_moe_weight", prepack_fp8, "scale", f"dtype-{d}", scale=recast("scale", d))
for d in dtypes_except(torch.uint8):
    bad("prepack_moe_weight", prepack_mx, "scale", f"dtype-{d}", scale=recast("scale", d))
bad("prepack_moe_weight", prepack_base, "w", "rank2", w=lambda kw: kw["w"][0])
bad("prepack_moe_weight", prepack_base, "w", "rank4", w=lambda kw: kw["w"][None])
for i in range(3):
    bad("prepack_moe_weight", prepack_base, "w", f"zero-dim{i}", w=lambda kw, i=i: kw["w"].narrow(i, 0, 0))
bad("prepack_moe_weight", prepack_base, "w", "stepped", w=lambda kw: stepped(kw["w"]))
bad("prepack_moe_weight", prepack_base, "w", "transposed", w=lambda kw: kw["w"].transpose(1, 2).contiguous().transpose(1, 2))
bad("prepack_moe_weight", prepack_base, "w", "expanded", w=lambda kw: kw["w"][:1].expand(kw["w"].shape))
bad("prepack_moe_weight", prepack_mx, "w", "K%32", w=lambda kw: kw["w"][..., :8].contiguous(),
    scale=lambda kw: kw["scale"][..., :0].contiguous())
bad("prepack_moe_weight", prepack_base, "scale", "given-bf16", scale=torch.ones(3, 1, 1))
bad("prepack_moe_weight", prepack_fp8, "scale", "missing", scale=None)
bad("prepack_moe_weight", prepack_fp8, "scale", "size", scale=lambda kw: kw["scale"][:-1])
bad("prepack_moe_weight", prepack_fp8, "scale", "rank2", scale=lambda kw: kw["scale"][0])
bad("prepack_moe_weight", prepack_mx, "scale", "size", scale=lambda kw: kw["scale"][:, :-1].contiguous())
bad("prepack_moe_weight", prepack_mx, "scale", "stepped", scale=lambda kw: stepped(kw["scale"]))
for q in ("int4", "", "mxfp4 "):
    bad("prepack_moe_weight", prepack_base, "quant", repr(q), quant=q)
bad("prepack_moe_weight", prepack_base, "w", "quant-mxfp4-on-bf16", quant="mxfp4", scale=torch.zeros(3, 40, 0, dtype=torch.uint8))

# ---- pack_moe_experts (the pack cache's op): ids, weights and every buffer
for v in (E_F, -2, 2 ** 31 - 1):
    bad("pack_moe_experts", pack_base, "topk_ids", f"value{v}",
        topk_ids=lambda kw, v=v: kw["topk_ids"].index_fill(0, torch.tensor([1]), v))
bad("pack_moe_experts", pack_base, "topk_ids", "int64", topk_ids=recast("topk_ids", torch.int64))
bad("pack_moe_experts", pack_base, "topk_ids", "rank1", topk_ids=lambda kw: kw["topk_ids"][0])
bad("pack_moe_experts", pack_base, "done", "size", done=torch.zeros(E_F + 1, dtype=torch.uint8))
bad("pack_moe_experts", pack_base, "done", "dtype", done=torch.zeros(E_F, dtype=torch.bool))
bad("pack_moe_experts", pack_base, "done", "stepped", done=lambda kw: stepped(kw["done"]))
bad("pack_moe_experts", pack_base, "w13", "transposed", w13=lambda kw: kw["w13"].transpose(1, 2).contiguous().transpose(1, 2))
bad("pack_moe_experts", pack_base, "w13", "expanded", w13=lambda kw: kw["w13"][:1].expand(kw["w13"].shape))
bad("pack_moe_experts", pack_base, "w2", "other-E", w2=lambda kw: kw["w2"][:-1].contiguous())
bad("pack_moe_experts", pack_base, "w2", "other-I", w2=lambda kw: kw["w2"][..., :-2].contiguous())
bad("pack_moe_experts", pack_fp8, "w13_scale", "missing", w13_scale=None)
bad("pack_moe_experts", pack_fp8, "w2_scale", "size", w2_scale=lambda kw: kw["w2_scale"][:-1])
bad("pack_moe_experts", pack_mx, "w13_scale", "stepped", w13_scale=lambda kw: stepped(kw["w13_scale"]))
bad("pack_moe_experts", pack_base, "w13_scale", "given-bf16", w13_scale=torch.ones(E_F, 1, 1))
for name in ("p13", "f13", "p2", "f2"):
    bad("pack_moe_experts", pack_base, name, "short", **{name: lambda kw, n=name: kw[n][:-1]})
    bad("pack_moe_experts", pack_base, name, "narrow", **{name: lambda kw, n=name: kw[n][:, :-1].contiguous()})
    bad("pack_moe_experts", pack_base, name, "stepped", **{name: lambda kw, n=name: stepped(kw[n])})
    bad("pack_moe_experts", pack_base, name, "dtype", **{name: lambda kw, n=name: kw[n].to(torch.int8)})
for name in ("q13", "q2"):
    bad("pack_moe_experts", pack_fp8, name, "missing", **{name: None})
    bad("pack_moe_experts", pack_fp8, name, "short", **{name: lambda kw, n=name: kw[n][:-1]})
    bad("pack_moe_experts", pack_mx, name, "narrow", **{name: lambda kw, n=name: kw[n][:, :-1].contiguous()})
    bad("pack_moe_experts", pack_base, name, "given-bf16", **{name: torch.zeros(E_F, 1, 1)})
for q in ("int4", "", "fp8_block"):
    bad("pack_moe_experts", pack_base, "quant", repr(q), quant=q) if q != "fp8_block" else \
        bad("pack_moe_experts", pack_base, "w13", "quant-fp8-on-bf16", quant=q)

bad("read_stream", read_stream_base, "buf", "stepped", buf=lambda kw: stepped(kw["buf"]))
bad("read_stream", read_stream_base, "buf", "expanded", buf=huge(8, 64, dtype=torch.uint8))
bad("read_stream", read_stream_base, "buf", "empty", buf=torch.empty(0, dtype=torch.uint8))
for v in (0, -1, 17):
    bad("read_stream", read_stream_base, "streams_per_thread", str(v), streams_per_thread=v)
for v in (-1, 4097):
    bad("read_stream", read_stream_base, "prefetch_blocks", str(v), prefetch_blocks=v)


@pytest.mark.parametrize("op,arg,make", CASES)
def test_hostile_call_raises(op, arg, make):
    kw = make()
    with pytest.raises(RuntimeError) as info:
        run(op, kw)
    msg = str(info.value)
    assert f"moelab::{op}" in msg, msg
    assert f"'{arg}'" in msg, msg


def test_set_isa_bad_name():
    for name in ("avx1024", "", "AVX2 "):
        with pytest.raises(RuntimeError, match=r"moelab::set_isa: argument 'name'"):
            ops.set_isa(name)


# ------------------------------------------------------------------ the meta device
def _tensor_names(kw):
    return [k for k, v in kw.items() if isinstance(v, torch.Tensor)]


def _on(kw, device, names=None):
    return {k: v.to(device) if isinstance(v, torch.Tensor) and (names is None or k in names) else v
            for k, v in kw.items()}


def _flat(result):
    if result is None or isinstance(result, int):   # pack_moe_experts returns a count
        return []
    return [result] if isinstance(result, torch.Tensor) else list(result)


ALL_BASES = [(op, b) for op, bs in BASES.items() for b in bs]


@pytest.mark.parametrize("op,base", ALL_BASES, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_all_meta_call_gives_the_real_shapes(op, base):
    """Only meta tensors: the fake kernel runs and its outputs match the real call's in
    shape and dtype (permute_out returns nothing either way)."""
    kw = base()
    real = _flat(run(op, kw))
    meta = _flat(run(op, _on(kw, "meta")))
    assert len(meta) == len(real)
    for m, r in zip(meta, real):
        assert m.device.type == "meta"
        assert (m.shape, m.dtype) == (r.shape, r.dtype)


MIXED = [(op, b, name) for op, b in ALL_BASES if len(_tensor_names(b())) > 1 for name in _tensor_names(b())]


@pytest.mark.parametrize("op,base,arg", MIXED, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_one_meta_argument_among_cpu_raises(op, base, arg):
    """The dispatcher runs the fake kernel when ANY argument is meta. Before the fakes checked
    devices, this returned uninitialized CPU tensors (permute_out: wrote nothing)."""
    kw = base()
    kw[arg] = kw[arg].to("meta")
    with pytest.raises(RuntimeError) as info:
        run(op, kw)
    msg = str(info.value)
    assert f"moelab::{op}" in msg and f"'{arg}'" in msg, msg


@pytest.mark.parametrize("op,base,arg", MIXED, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_one_cpu_argument_among_meta_raises(op, base, arg):
    cpu = base()
    kw = _on(cpu, "meta")
    kw[arg] = cpu[arg]
    with pytest.raises(RuntimeError) as info:
        run(op, kw)
    msg = str(info.value)
    assert f"moelab::{op}" in msg and f"'{arg}'" in msg, msg


META_RANKS = [("route", route_base, "logits"), ("route", route_base, "bias"), ("router_gemm", router_gemm_base, "x"),
              ("router_gemm", router_gemm_base, "weight"), ("skinny_gemm", skinny_base, "x"),
              ("skinny_gemm", skinny_base, "weight"), ("skinny_gemm", skinny_base, "bias"),
              ("permute", permute_map, "hidden"), ("permute", permute_map, "ids"),
              ("permute", permute_map, "expert_map"), ("unpermute", unpermute_base, "expert_out"),
              ("unpermute", unpermute_base, "weights"), ("unpermute", unpermute_base, "dst_pos"),
              ("fused_experts", fe_base, "x"), ("fused_experts", fe_base, "topk_ids"),
              ("fused_experts", fe_oai, "w2_bias"), ("prepack_moe_weight", prepack_base, "w")] + [
              ("permute_out", permute_out_map, n) for n in ("hidden", "ids", "expert_map", *OUTS)]


@pytest.mark.parametrize("op,base,arg", META_RANKS, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_meta_wrong_rank_raises(op, base, arg):
    """A fake reads the sizes it needs, so it checks those tensors' ranks (not a Python
    unpacking error)."""
    kw = _on(base(), "meta")
    kw[arg] = kw[arg][None]
    with pytest.raises(RuntimeError) as info:
        run(op, kw)
    msg = str(info.value)
    assert f"moelab::{op}" in msg and f"'{arg}'" in msg, msg


def test_meta_permute_bad_scalars_raise():
    for arg, v in (("align", 0), ("n_local_experts", 0), ("align", -3)):
        kw = _on(permute_base(), "meta")
        kw[arg] = v
        with pytest.raises(RuntimeError, match=rf"moelab::permute: argument '{arg}'"):
            run("permute", kw)
    with pytest.raises(RuntimeError, match=r"moelab::prepack_moe_weight: argument 'quant'"):
        run("prepack_moe_weight", _on({**prepack_base(), "quant": "int4"}, "meta"))


# ------------------------------------------------------ strided inputs a kernel accepts
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _outputs(op, kw, result):
    return [kw[n] for n in OUTS] if op == "permute_out" else _flat(result)


def _dense(kw):
    return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


ACCEPTED = []


def ok(op, base, desc, **over):
    """A strided (or otherwise unusual) input the binding accepts: the result must have the
    same bits as the call with every input made contiguous."""
    def make():
        kw = base()
        for k, v in over.items():
            kw[k] = v(kw) if callable(v) and not isinstance(v, torch.Tensor) else v
        return kw
    ACCEPTED.append(pytest.param(op, make, id=f"{op}-{base.__name__}-{desc}"))


def rows_expanded(name):
    """Every row of kw[name] replaced by its first row, stride 0."""
    return lambda kw: kw[name][:1].expand(kw[name].shape)


ok("route", route_base, "logits-transposed", logits=lambda kw: transposed(kw["logits"]))
ok("route", route_base, "logits-stepped-rows", logits=lambda kw: stepped(kw["logits"]))
ok("route", route_base, "logits-stepped-cols", logits=lambda kw: stepped(kw["logits"], 1))
ok("route", route_base, "logits-expanded-rows", logits=rows_expanded("logits"))
ok("route", route_base, "logits-column-slice", logits=lambda kw: torch.cat([kw["logits"], kw["logits"]], 1)[:, 3:3 + E_R])
ok("route", route_base, "bias-stepped", bias=lambda kw: stepped(kw["bias"]))
ok("route", route_grouped, "bias-expanded", bias=huge(E_R, fill=0.5))
ok("route", route_softmax, "logits-bf16-transposed", logits=lambda kw: transposed(kw["logits"].to(torch.bfloat16)))
ok("router_gemm", router_gemm_base, "x-stepped-rows", x=lambda kw: stepped(kw["x"]))
ok("router_gemm", router_gemm_base, "x-expanded-rows", x=rows_expanded("x"))
ok("router_gemm", router_gemm_base, "H1-any-column-stride", x=lambda kw: kw["x"].reshape(-1).as_strided((5, 1), (3, 7)),
   weight=lambda kw: kw["weight"][:, :1].contiguous())
ok("skinny_gemm", skinny_base, "x-stepped-rows", x=lambda kw: stepped(kw["x"]))
ok("skinny_gemm", skinny_base, "x-expanded-rows", x=rows_expanded("x"))
ok("skinny_gemm", skinny_base, "weight-stepped-rows", weight=lambda kw: stepped(kw["weight"]))
ok("skinny_gemm", skinny_base, "weight-expanded-rows", weight=rows_expanded("weight"))
ok("skinny_gemm", skinny_base, "K1-transposed", x=torch.ones(2, 4, dtype=torch.bfloat16)[:, :1],
   weight=torch.ones(3, 5, dtype=torch.bfloat16)[:, 2:3], bias=None)
for op, base, mbase in (("permute", permute_base, permute_map), ("permute_out", permute_out_base, permute_out_map)):
    ok(op, base, "hidden-stepped-rows", hidden=lambda kw: stepped(kw["hidden"]))
    ok(op, base, "hidden-expanded-rows", hidden=rows_expanded("hidden"))
    ok(op, base, "ids-transposed", ids=lambda kw: transposed(kw["ids"]))
    ok(op, base, "ids-stepped-cols", ids=lambda kw: stepped(kw["ids"], 1))
    ok(op, base, "ids-expanded-rows", ids=rows_expanded("ids"))
    ok(op, mbase, "ids-int64-transposed", ids=lambda kw: transposed(kw["ids"].to(torch.int64)))
    ok(op, mbase, "expert_map-stepped", expert_map=lambda kw: stepped(kw["expert_map"]))
    ok(op, mbase, "expert_map-expanded", expert_map=lambda kw: kw["expert_map"][4:5].expand(6))
ok("unpermute", unpermute_base, "expert_out-stepped-rows", expert_out=lambda kw: stepped(kw["expert_out"]))
ok("unpermute", unpermute_base, "weights-transposed", weights=lambda kw: transposed(kw["weights"]))
ok("unpermute", unpermute_base, "weights-expanded-rows", weights=rows_expanded("weights"))
ok("fused_experts", fe_base, "x-stepped-rows", x=lambda kw: stepped(kw["x"]))
ok("fused_experts", fe_base, "x-expanded-rows", x=rows_expanded("x"))
ok("fused_experts", fe_oai, "ids-and-weights-transposed", topk_ids=lambda kw: transposed(kw["topk_ids"]),
   topk_weights=lambda kw: transposed(kw["topk_weights"]))
ok("fused_experts", fe_packed_mx, "ids-stepped-weights-expanded", topk_ids=lambda kw: stepped(kw["topk_ids"], 1),
   topk_weights=rows_expanded("topk_weights"))


@pytest.mark.parametrize("op,make", ACCEPTED)
def test_accepted_strided_input_same_bits(op, make):
    kw = make()
    assert any(isinstance(v, torch.Tensor) and not v.is_contiguous() for v in kw.values())
    dense = _dense(kw)
    got = _outputs(op, kw, run(op, kw))
    want = _outputs(op, dense, run(op, dense))
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(_bits(g), _bits(w))


# -------------------------------------------------------------- zero-size dimensions
def test_zero_size_dims_give_empty_outputs():
    r = ops.route(torch.zeros(0, 8), 3, "softmax_topk")
    assert [t.shape for t in r] == [(0, 3), (0, 3)]
    assert ops.router_gemm(torch.zeros(0, 4), torch.zeros(5, 4)).shape == (0, 5)
    assert ops.skinny_gemm(torch.zeros(0, 4), torch.zeros(5, 4)).shape == (0, 5)
    # T = 0 with align 3: the capacity is E_loc * 2 zero rows
    p = ops.permute(torch.zeros(0, 6), torch.zeros(0, 2, dtype=torch.int32), 4, None, 4, 3)
    assert [t.shape for t in p] == [(5,), (8, 6), (8,), (0,)]
    assert p[0].tolist() == [0] * 5 and p[2].tolist() == [-1] * 8 and not p[1].any()
    # H = 0: the index outputs are still complete
    ids = torch.tensor([[1, 0], [1, -1]], dtype=torch.int32)
    p = ops.permute(torch.zeros(2, 0), ids, 2, None, 2, 1)
    assert p[0].tolist() == [0, 1, 3] and p[1].shape == (4, 0)
    assert p[2].tolist() == [1, 0, 2, -1] and p[3].tolist() == [1, 0, 2, -1]
    assert ops.unpermute(torch.zeros(0, 5), torch.zeros(2, 3), torch.full((6,), -1, dtype=torch.int32)).eq(0).all()
    assert ops.unpermute(torch.zeros(4, 0), torch.zeros(2, 1), torch.zeros(2, dtype=torch.int32)).shape == (2, 0)
    assert ops.unpermute(torch.zeros(4, 3), torch.zeros(0, 2), torch.zeros(0, dtype=torch.int32)).shape == (0, 3)
    kw = fe_base()
    kw.update(x=kw["x"][:0], topk_ids=kw["topk_ids"][:0], topk_weights=kw["topk_weights"][:0])
    assert run("fused_experts", kw).shape == (0, H_F)
    kw = fe_base()   # every slot dropped: zeros
    kw.update(topk_ids=torch.full_like(kw["topk_ids"], -1))
    out = run("fused_experts", kw)
    assert out.shape == (T_F, H_F) and not out.any()


# ------------------------------------------------------ permute_out stays in its buffers
PAD = 256  # bytes of canary around each buffer


def _guarded(t: torch.Tensor):
    """t's shape and dtype, living in the middle of a canary-filled byte buffer."""
    n = t.numel() * t.element_size()
    buf = torch.full((PAD + n + PAD,), 0xA5, dtype=torch.uint8)
    return buf, buf[PAD: PAD + n].view(t.dtype).view(t.shape)


GUARDED = [("valid", permute_out_base, {}), ("valid-map", permute_out_map, {}),
           ("valid-T0", permute_out_base, dict(hidden=torch.zeros(0, H_P), ids=torch.zeros(0, K_P, dtype=torch.int32))),
           ("bad-id-late", permute_out_base, dict(ids=lambda kw: kw["ids"].index_fill(0, torch.tensor([4]), E_P))),
           ("bad-map-entry", permute_out_map, dict(expert_map=lambda kw: kw["expert_map"].index_fill(0, torch.tensor([5]), 3))),
           ("hidden-expanded-T-huge", permute_out_base, dict(hidden=huge(2 ** 31, H_P), ids=huge(2 ** 31, 1, dtype=torch.int32)))]


@pytest.mark.parametrize("desc,base,over", GUARDED, ids=[g[0] for g in GUARDED])
def test_permute_out_writes_only_its_buffers(desc, base, over):
    kw = base()
    for k, v in over.items():
        kw[k] = v(kw) if callable(v) else v
    if desc == "valid-T0":
        kw.update(permute_out_buffers(kw))
    bufs = {}
    for name in OUTS:
        bufs[name], kw[name] = _guarded(kw[name])
    try:
        run("permute_out", kw)
        assert desc.startswith("valid")
    except RuntimeError as e:
        assert not desc.startswith("valid"), e
    for name, buf in bufs.items():
        assert (buf[:PAD] == 0xA5).all() and (buf[-PAD:] == 0xA5).all(), name


# ------------------------------------------------ negative-bit views (torch._neg_view)
PACK_OUTS = ("done", "p13", "q13", "f13", "p2", "q2", "f2")   # pack_moe_experts writes these
NEGATABLE = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)
NEG_INPUTS = [(op, b, name) for op, b in ALL_BASES for name, v in b().items()
              if isinstance(v, torch.Tensor) and v.dtype in NEGATABLE and not (op == "permute_out" and name in OUTS)
              and not (op == "pack_moe_experts" and name in PACK_OUTS)]


@pytest.mark.parametrize("op,base,arg", NEG_INPUTS, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_negative_view_input_is_read_as_its_value(op, base, arg):
    """A tensor carrying torch's lazy negation bit holds the values it shows: same bits as
    the plain call (the Negative key materializes it before the kernel)."""
    kw = base()
    want = _outputs(op, kw, run(op, kw))
    kw2 = base()
    kw2[arg] = torch._neg_view(-kw2[arg])
    assert kw2[arg].is_neg() and torch.equal(kw2[arg], kw[arg])
    got = _outputs(op, kw2, run(op, kw2))
    assert all(torch.equal(_bits(g), _bits(w)) for g, w in zip(got, want))


@pytest.mark.parametrize("name", [n for n, d in OUTS.items() if d in NEGATABLE])
def test_permute_out_refuses_negative_view_outputs(name):
    """Before: torch's Negative fallback hit an internal assert on permute_out (a mutable
    argument that is not returned) and the process crashed on its next call."""
    kw = permute_out_base()
    kw[name] = torch._neg_view(kw[name])
    with pytest.raises(RuntimeError, match=rf"moelab::permute_out: argument '{name}' must not be a negative view"):
        run("permute_out", kw)
    run("permute_out", permute_out_base())   # and the process is fine


@pytest.mark.parametrize("name", ["q13", "q2"])
def test_pack_moe_experts_refuses_negative_view_buffers(name):
    """pack_moe_experts has permute_out's Negative kernel: a buffer (fp8 scales: f32) with the
    negative bit is refused, and the process goes on."""
    kw = pack_fp8()
    kw[name] = torch._neg_view(kw[name])
    with pytest.raises(RuntimeError, match=rf"moelab::pack_moe_experts: argument '{name}' must not be a negative view"):
        run("pack_moe_experts", kw)
    assert run("pack_moe_experts", pack_fp8()) > 0
