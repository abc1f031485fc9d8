"""Semantics of reference.router_gemm and reference.gate_gemm (SPEC sections 3 and 4).

Expected values are small-integer products computed with Python ints (exact in every
dtype), or sums computed with math.fsum (correctly rounded) and rounded once.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from reference.gate_gemm import FusedGate, fused_gate_gemm, skinny_gemm, unquantized_gemm
from reference.router_gemm import router_gemm

SETTINGS = settings(max_examples=50, deadline=None)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def int_tensor(shape, lo, hi, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, shape, generator=g).to(dtype)


def hand_linear(x, w, b=None):
    """Python-int (or exact-float via fsum) loops: [[sum_k x[t,k]*w[n,k] + b[n]]]."""
    xl, wl = x.double().tolist(), w.double().tolist()
    bl = b.double().tolist() if b is not None else [0.0] * len(wl)
    return [[math.fsum([a * c for a, c in zip(row, wrow)] + [bl[n]]) for n, wrow in enumerate(wl)] for row in xl]


# (significant bits, smallest normal exponent) of each format
_FORMATS = {torch.float32: (24, -126), torch.bfloat16: (8, -126), torch.float16: (11, -14)}


def exact_round(v: float, dtype) -> float:
    """Round a Python float to dtype's grid, nearest, ties to even (Python's round() is exact).

    Finite values inside the format's range only (what these tests produce)."""
    if v == 0 or not math.isfinite(v):
        return v
    p, emin = _FORMATS[dtype]
    e = math.frexp(v)[1] - 1                 # v = 1.f * 2^e
    q = max(e, emin) - (p - 1)               # exponent of the last significant bit (subnormals: fixed)
    return math.ldexp(round(math.ldexp(v, -q)), q)


def as_tensor(vals, T, N, dtype):
    """Round f64 values once to dtype (not with .to(): torch's f64 -> bf16/f16 rounds twice)."""
    flat = [exact_round(v, dtype) for row in vals for v in row]
    return torch.tensor(flat, dtype=torch.float64).reshape(T, N).to(dtype)  # exact: on the grid


# -------------------------------------------------------------------- router_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_router_gemm_tiny_by_hand(dtype):
    x = torch.tensor([[1, 2, 3], [0, -1, 4]], dtype=dtype)
    w = torch.tensor([[1, 0, -1], [2, 2, 2], [-3, 1, 0.5]], dtype=torch.float32)
    out = router_gemm(x, w)
    # row 0: 1-3 = -2, 2+4+6 = 12, -3+2+1.5 = 0.5; row 1: 0+0-4 = -4, 0-2+8 = 6, 0-1+2 = 1
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    assert out.tolist() == [[-2.0, 12.0, 0.5], [-4.0, 6.0, 1.0]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", [1, 3, 257])
def test_router_gemm_odd_e_small_integers(dtype, E):
    x = int_tensor((5, 37), -4, 4, 1, dtype)
    w = int_tensor((E, 37), -3, 3, 2, torch.float32)
    assert torch.equal(router_gemm(x, w), as_tensor(hand_linear(x, w), 5, E, torch.float32))


def test_router_gemm_rounds_once_from_exact():
    # 1 + 2^-24 + 2^-24: f32 accumulation from the left gives 1; the exact sum is 1 + 2^-23.
    x = torch.tensor([[1.0, 2.0**-24, 2.0**-24]], dtype=torch.float32)
    assert router_gemm(x, torch.ones(1, 3)).item() == 1.0 + 2.0**-23


@SETTINGS
@given(st.integers(0, 6), st.integers(1, 70), st.integers(1, 9), st.integers(0, 2**16), st.sampled_from(DTYPES))
def test_prop_router_gemm_is_exact_sum_rounded(T, H, E, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.randn(E, H, generator=g)
    assert torch.equal(router_gemm(x, w), as_tensor(hand_linear(x, w), T, E, torch.float32))


def test_router_gemm_t0_and_strided_x():
    out = router_gemm(torch.empty(0, 8, dtype=torch.bfloat16), torch.ones(5, 8))
    assert out.shape == (0, 5) and out.dtype == torch.float32
    big = int_tensor((4, 20), -3, 3, 4, torch.bfloat16)
    x = big[:, 2:10]  # row stride 20
    w = int_tensor((3, 8), -3, 3, 5, torch.float32)
    assert torch.equal(router_gemm(x, w), router_gemm(x.contiguous(), w))
    assert torch.equal(router_gemm(x, w), as_tensor(hand_linear(x, w), 4, 3, torch.float32))


# ------------------------------------------------------------ skinny / unquantized
GEMMS = [skinny_gemm, unquantized_gemm]


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_tiny_by_hand(gemm, dtype):
    x = torch.tensor([[1, 2], [3, -1]], dtype=dtype)
    w = torch.tensor([[2, 0], [1, 1], [-1, 4]], dtype=dtype)
    b = torch.tensor([0.5, -1, 3], dtype=dtype)
    # x @ w.T = [[2, 3, 7], [6, 2, -7]]
    out = gemm(x, w)
    assert out.dtype == dtype and out.tolist() == [[2, 3, 7], [6, 2, -7]]
    assert gemm(x, w, b).tolist() == [[2.5, 2, 10], [6.5, 1, -4]]


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 3, 257])
@pytest.mark.parametrize("T", [0, 1, 3, 8])
def test_linear_odd_n_small_integers(gemm, dtype, N, T):
    K = 13  # |sum| <= 13*9 + 5 < 256: exact in bf16
    x = int_tensor((T, K), -3, 3, N + T, dtype)
    w = int_tensor((N, K), -3, 3, N * 7, dtype)
    b = int_tensor((N,), -5, 5, 11, dtype)
    out = gemm(x, w, b)
    assert out.dtype == dtype and out.shape == (T, N)
    assert torch.equal(out, as_tensor(hand_linear(x, w, b), T, N, dtype))
    assert torch.equal(gemm(x, w), as_tensor(hand_linear(x, w), T, N, dtype))


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("dtype,small,want", [
    # exact 1 + 2^-8 + 2^-30 rounds up to 1 + 2^-7 in bf16; an f32 accumulation loses 2^-30
    # and the bf16 tie 1 + 2^-8 goes to even (1).
    (torch.bfloat16, (2.0**-8, 2.0**-30), 1.0 + 2.0**-7),
    # f16: 1 + 2^-11 + 2^-24 -> 1 + 2^-10 (f32 accumulation would give 1).
    (torch.float16, (2.0**-11, 2.0**-24), 1.0 + 2.0**-10),
    # f32: 1 + 2^-24 + 2^-24 = 1 + 2^-23 exactly (f32 accumulation would give 1).
    (torch.float32, (2.0**-24, 2.0**-24), 1.0 + 2.0**-23),
])
def test_linear_rounds_once(gemm, dtype, small, want):
    x = torch.tensor([[1.0, *small]], dtype=dtype)
    assert gemm(x, torch.ones(1, 3, dtype=dtype)).item() == want
    # the bias takes part in the single rounding too
    x2 = torch.tensor([[1.0, small[0]]], dtype=dtype)
    b = torch.tensor([small[1]], dtype=dtype)
    assert gemm(x2, torch.ones(1, 2, dtype=dtype), b).item() == want


@SETTINGS
@given(st.integers(0, 8), st.integers(1, 40), st.integers(1, 9), st.integers(0, 2**16), st.sampled_from(DTYPES),
       st.booleans())
def test_prop_linear_is_exact_sum_rounded(T, K, N, seed, dtype, with_bias):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if with_bias else None
    want = as_tensor(hand_linear(x, w, b), T, N, dtype)
    assert torch.equal(skinny_gemm(x, w, b), want)
    assert torch.equal(unquantized_gemm(x, w, b), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_strided_rows(dtype):
    big = int_tensor((8, 40), -3, 3, 3, dtype)
    x = big[::2, 5:20]  # 4 rows, row stride 80, K = 15
    w = int_tensor((3, 15), -3, 3, 4, dtype)
    assert not x.is_contiguous()
    assert torch.equal(skinny_gemm(x, w), as_tensor(hand_linear(x, w), 4, 3, dtype))


def test_unquantized_any_t_equals_skinny_per_chunk():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 24, generator=g).to(torch.bfloat16)
    w = torch.randn(7, 24, generator=g).to(torch.bfloat16)
    b = torch.randn(7, generator=g).to(torch.bfloat16)
    big = unquantized_gemm(x, w, b)
    assert big.shape == (50, 7)
    assert torch.equal(big, torch.cat([skinny_gemm(x[i:i + 8], w, b) for i in range(0, 50, 8)]))
    assert skinny_gemm(x[:8], w).shape == (8, 7)  # T = 8 is the largest skinny T


# ---------------------------------------------------------------- fused_gate_gemm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [0, 1, 5, 20])
@pytest.mark.parametrize("E,S", [(1, 1), (8, 1), (512, 1), (6, 3)])
def test_fused_gate_gemm_equals_separate(dtype, T, E, S):
    g = torch.Generator().manual_seed(E + S + T)
    H = 33
    x = torch.randn(T, H, generator=g).to(dtype)
    rw = torch.randn(E, H, generator=g).to(dtype)
    sw = torch.randn(S, H, generator=g).to(dtype)
    r, s = fused_gate_gemm(x, rw, sw)
    assert r.shape == (T, E) and s.shape == (T, S) and r.dtype == dtype and s.dtype == dtype
    assert r.is_contiguous() and s.is_contiguous()
    assert torch.equal(r, unquantized_gemm(x, rw)) and torch.equal(s, unquantized_gemm(x, sw))


def test_fused_gate_gemm_by_hand():
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.0]])
    rw = torch.tensor([[1.0, 1.0], [0.0, 3.0]])
    sw = torch.tensor([[2.0, -1.0]])
    r, s = fused_gate_gemm(x, rw, sw)
    assert r.tolist() == [[3.0, 6.0], [-1.0, 0.0]] and s.tolist() == [[0.0], [-2.0]]


def test_fused_gate_gemm_calls_gemm_once_on_stacked_weight():
    calls = []

    def spy(x, w, bias=None):
        calls.append(w.clone())
        return unquantized_gemm(x, w, bias)

    x = int_tensor((3, 4), -2, 2, 0, torch.float32)
    rw = int_tensor((5, 4), -2, 2, 1, torch.float32)
    sw = int_tensor((1, 4), -2, 2, 2, torch.float32)
    r, s = fused_gate_gemm(x, rw, sw, gemm=spy)
    assert len(calls) == 1 and torch.equal(calls[0], torch.cat([rw, sw]))
    assert torch.equal(r, as_tensor(hand_linear(x, rw), 3, 5, torch.float32))
    assert torch.equal(s, as_tensor(hand_linear(x, sw), 3, 1, torch.float32))
    # a custom gemm's result is what gets split
    r2, s2 = fused_gate_gemm(x, rw, sw, gemm=lambda x, w: torch.arange(18.0).reshape(3, 6))
    assert r2.tolist() == [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10], [12, 13, 14, 15, 16]]
    assert s2.tolist() == [[5], [11], [17]]


# ---------------------------------------------------------------------- FusedGate
def _gate_weights(E=4, S=1, H=6, dtype=torch.float32, seed=0):
    return (int_tensor((E, H), -3, 3, seed, dtype), int_tensor((S, H), -3, 3, seed + 1, dtype))


def _check_gate(gate, x):
    r, s = gate(x)
    rw, sw = gate.router_weight, gate.shared_gate_weight
    assert torch.equal(r, unquantized_gemm(x, rw)) and torch.equal(s, unquantized_gemm(x, sw))
    assert r.is_contiguous() and s.is_contiguous()
    return r, s


def test_fused_gate_no_rebuild_without_change():
    rw, sw = _gate_weights()
    gate = FusedGate(rw, sw)
    assert gate.rebuilds == 1
    x = int_tensor((3, 6), -2, 2, 9, torch.float32)
    for _ in range(3):
        _check_gate(gate, x)
    assert gate.rebuilds == 1
    assert torch.equal(gate.fused_weight(), torch.cat([rw, sw])) and gate.rebuilds == 1
    gate.router_weight = rw  # the same object: nothing changed
    _check_gate(gate, x)
    assert gate.rebuilds == 1
    assert gate.router_weight is rw and gate.shared_gate_weight is sw  # references, not copies


@pytest.mark.parametrize("which", ["router_weight", "shared_gate_weight"])
def test_fused_gate_rebuilds_on_replacement(which):
    rw, sw = _gate_weights()
    gate = FusedGate(rw, sw)
    x = int_tensor((2, 6), -2, 2, 9, torch.float32)
    before = _check_gate(gate, x)
    old = getattr(gate, which)
    setattr(gate, which, old + 1)
    assert gate.rebuilds == 1  # lazily, at the next forward
    after = _check_gate(gate, x)
    assert gate.rebuilds == 2
    assert not (torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]))
    _check_gate(gate, x)
    assert gate.rebuilds == 2
    # another object over the same storage and version counter (same fingerprint) still counts
    setattr(gate, which, getattr(gate, which).detach())
    _check_gate(gate, x)
    assert gate.rebuilds == 3


def test_fused_gate_rebuilds_on_in_place_change():
    rw, sw = _gate_weights()
    gate = FusedGate(rw, sw)
    x = int_tensor((2, 6), -2, 2, 9, torch.float32)
    _check_gate(gate, x)
    with torch.no_grad():
        sw.mul_(2)
    r, s = _check_gate(gate, x)
    assert gate.rebuilds == 2
    rw[1].zero_()  # through a view: the version counter is shared
    r, s = _check_gate(gate, x)
    assert gate.rebuilds == 3 and (r[:, 1] == 0).all()
    _check_gate(gate, x)
    assert gate.rebuilds == 3


def test_fused_gate_with_parameters_owned_elsewhere():
    owner = torch.nn.Module()
    rw, sw = _gate_weights()
    owner.router = torch.nn.Parameter(rw.clone())
    owner.shared = torch.nn.Parameter(sw.clone())
    gate = FusedGate(owner.router, owner.shared)
    assert list(gate.parameters()) == [] and list(gate.state_dict()) == []
    assert gate.router_weight is owner.router
    x = int_tensor((2, 6), -2, 2, 9, torch.float32)
    _check_gate(gate, x)
    assert gate.rebuilds == 1
    # weight reload through load_state_dict (in-place copy into the same Parameter)
    owner.load_state_dict({"router": rw * 3, "shared": sw})
    r, _ = _check_gate(gate, x)
    assert gate.rebuilds == 2 and torch.equal(r, unquantized_gemm(x, rw * 3))
    # a Parameter may be replaced by a plain tensor and vice versa
    gate.shared_gate_weight = sw - 1
    _check_gate(gate, x)
    assert gate.rebuilds == 3
    gate.shared_gate_weight = torch.nn.Parameter(sw + 2)
    _check_gate(gate, x)
    assert gate.rebuilds == 4 and list(gate.parameters()) == []
    # owner.half(): the same Parameter objects get new storage in a new dtype
    owner.half()
    gate.shared_gate_weight = owner.shared
    xh = x.half()
    r, s = _check_gate(gate, xh)
    assert r.dtype == torch.float16 and gate.fused_weight().dtype == torch.float16
    # `.data =` swaps the storage (new data_ptr) without bumping the version
    owner.router.data = owner.router.data + 1
    r2, _ = _check_gate(gate, xh)
    assert not torch.equal(r, r2)


def test_fused_gate_data_writes_need_invalidate():
    rw, sw = _gate_weights()
    p = torch.nn.Parameter(rw.clone())
    gate = FusedGate(p, sw)
    x = int_tensor((2, 6), -2, 2, 9, torch.float32)
    r0, _ = gate(x)
    p.data.copy_(rw * 2)  # invisible to the version counter: documented limitation
    assert torch.equal(gate(x)[0], r0) and gate.rebuilds == 1
    gate.invalidate()
    r1, _ = _check_gate(gate, x)
    assert gate.rebuilds == 2 and torch.equal(r1, r0 * 2)


def test_fused_gate_subclass_gemm_called_once():
    calls = []

    class SpyGate(FusedGate):
        @staticmethod
        def gemm(x, w, bias=None):
            calls.append(tuple(w.shape))
            return unquantized_gemm(x, w, bias)

    rw, sw = _gate_weights(E=512, S=1, H=8)
    gate = SpyGate(rw, sw)
    x = int_tensor((3, 8), -2, 2, 9, torch.float32)
    _check_gate(gate, x)
    assert calls == [(513, 8)]
    r, s = gate(torch.empty(0, 8))
    assert r.shape == (0, 512) and s.shape == (0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_gate_dtypes(dtype):
    rw, sw = _gate_weights(dtype=dtype)
    gate = FusedGate(rw, sw)
    x = int_tensor((4, 6), -2, 2, 9, dtype)
    r, s = _check_gate(gate, x)
    assert r.dtype == dtype and s.dtype == dtype


# ------------------------------------------------------------------- error tables
f32, bf16 = torch.float32, torch.bfloat16


def _t(*shape, dtype=f32, device="cpu"):
    return torch.ones(*shape, dtype=dtype, device=device)


ROUTER_ERRORS = [
    ("x 1-D", lambda: router_gemm(_t(4), _t(2, 4)), "x"),
    ("x int", lambda: router_gemm(_t(1, 4, dtype=torch.int32), _t(2, 4)), "x"),
    ("x float64 with an f32 weight (exact mode wants both f64)",
     lambda: router_gemm(_t(1, 4, dtype=torch.float64), _t(2, 4)), "x"),
    ("x H = 0", lambda: router_gemm(_t(1, 0), _t(2, 0)), "x"),
    ("x not a tensor", lambda: router_gemm([[1.0]], _t(2, 1)), "x"),
    ("weight bf16", lambda: router_gemm(_t(1, 4, dtype=bf16), _t(2, 4, dtype=bf16)), "weight"),
    ("weight wrong H", lambda: router_gemm(_t(1, 4), _t(2, 5)), "weight"),
    ("weight 1-D", lambda: router_gemm(_t(1, 4), _t(4)), "weight"),
    ("weight E = 0", lambda: router_gemm(_t(1, 4), _t(0, 4)), "weight"),
    ("weight other device", lambda: router_gemm(_t(1, 4), _t(2, 4, device="meta")), "weight"),
]


def _linear_errors(gemm):
    return [
        ("x 1-D", lambda: gemm(_t(4), _t(2, 4)), "x"),
        ("x int", lambda: gemm(_t(1, 4, dtype=torch.int32), _t(2, 4, dtype=torch.int32)), "x"),
        ("x float64", lambda: gemm(_t(1, 4, dtype=torch.float64), _t(2, 4, dtype=torch.float64)), "x"),
        ("x K = 0", lambda: gemm(_t(1, 0), _t(2, 0)), "x"),
        ("weight dtype differs", lambda: gemm(_t(1, 4), _t(2, 4, dtype=bf16)), "weight"),
        ("weight wrong K", lambda: gemm(_t(1, 4), _t(2, 3)), "weight"),
        ("weight 3-D", lambda: gemm(_t(1, 4), _t(1, 2, 4)), "weight"),
        ("weight N = 0", lambda: gemm(_t(1, 4), _t(0, 4)), "weight"),
        ("weight other device", lambda: gemm(_t(1, 4), _t(2, 4, device="meta")), "weight"),
        ("bias wrong length", lambda: gemm(_t(1, 4), _t(2, 4), _t(3)), "bias"),
        ("bias 2-D", lambda: gemm(_t(1, 4), _t(2, 4), _t(1, 2)), "bias"),
        ("bias dtype differs", lambda: gemm(_t(1, 4), _t(2, 4), _t(2, dtype=bf16)), "bias"),
    ]


SKINNY_ERRORS = [
    ("T = 9", lambda: skinny_gemm(_t(9, 4), _t(2, 4)), "x"),
    ("T = 64", lambda: skinny_gemm(_t(64, 4, dtype=bf16), _t(2, 4, dtype=bf16)), "x"),
] + _linear_errors(skinny_gemm)
UNQUANTIZED_ERRORS = _linear_errors(unquantized_gemm)

FUSED_ERRORS = [
    ("x 1-D", lambda: fused_gate_gemm(_t(4), _t(2, 4), _t(1, 4)), "x"),
    ("x int", lambda: fused_gate_gemm(_t(1, 4, dtype=torch.int32), _t(2, 4), _t(1, 4)), "x"),
    ("x H = 0", lambda: fused_gate_gemm(_t(1, 0), _t(2, 0), _t(1, 0)), "x"),
    ("router_weight dtype differs", lambda: fused_gate_gemm(_t(1, 4), _t(2, 4, dtype=bf16), _t(1, 4)),
     "router_weight"),
    ("router_weight wrong H", lambda: fused_gate_gemm(_t(1, 4), _t(2, 3), _t(1, 4)), "router_weight"),
    ("router_weight no rows", lambda: fused_gate_gemm(_t(1, 4), _t(0, 4), _t(1, 4)), "router_weight"),
    ("shared_gate_weight 1-D", lambda: fused_gate_gemm(_t(1, 4), _t(2, 4), _t(4)), "shared_gate_weight"),
    ("shared_gate_weight no rows", lambda: fused_gate_gemm(_t(1, 4), _t(2, 4), _t(0, 4)), "shared_gate_weight"),
    ("shared_gate_weight other device",
     lambda: fused_gate_gemm(_t(1, 4), _t(2, 4), _t(1, 4, device="meta")), "shared_gate_weight"),
    ("gemm not callable", lambda: fused_gate_gemm(_t(1, 4), _t(2, 4), _t(1, 4), gemm=3), "gemm"),
]

FUSED_GATE_ERRORS = [
    ("router_weight 1-D", lambda: FusedGate(_t(4), _t(1, 4)), "router_weight"),
    ("router_weight int", lambda: FusedGate(_t(2, 4, dtype=torch.int32), _t(1, 4)), "router_weight"),
    ("router_weight no rows", lambda: FusedGate(_t(0, 4), _t(1, 4)), "router_weight"),
    ("shared_gate_weight dtype differs", lambda: FusedGate(_t(2, 4), _t(1, 4, dtype=bf16)), "shared_gate_weight"),
    ("shared_gate_weight wrong H", lambda: FusedGate(_t(2, 4), _t(1, 5)), "shared_gate_weight"),
    ("shared_gate_weight other device", lambda: FusedGate(_t(2, 4), _t(1, 4, device="meta")),
     "shared_gate_weight"),
    ("assign a non-tensor", lambda: setattr(FusedGate(_t(2, 4), _t(1, 4)), "router_weight", 3.0),
     "router_weight"),
]


def _forward_bad_x():
    FusedGate(_t(2, 4), _t(1, 4))(_t(1, 5))


def _cases(table, op):
    return [pytest.param(fn, op, arg, id=f"{op}: {desc}") for desc, fn, arg in table]


@pytest.mark.parametrize("fn,op,arg", _cases(ROUTER_ERRORS, "router_gemm") + _cases(SKINNY_ERRORS, "skinny_gemm")
                         + _cases(UNQUANTIZED_ERRORS, "unquantized_gemm")
                         + _cases(FUSED_ERRORS, "fused_gate_gemm") + _cases(FUSED_GATE_ERRORS, "FusedGate")
                         + [pytest.param(_forward_bad_x, "fused_gate_gemm", "router_weight",
                                         id="FusedGate forward: x of another H")])
def test_error_inputs(fn, op, arg):
    with pytest.raises(ValueError) as ei:
        fn()
    msg = str(ei.value)
    assert msg.startswith(op + ":") and f"'{arg}'" in msg, msg


def test_error_tables_large_enough():
    tables = (ROUTER_ERRORS, SKINNY_ERRORS, UNQUANTIZED_ERRORS, FUSED_ERRORS, FUSED_GATE_ERRORS)
    assert min(map(len, tables)) >= 5
    assert any(desc == "T = 9" for desc, _, _ in SKINNY_ERRORS)
