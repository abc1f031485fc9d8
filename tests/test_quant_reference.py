"""reference.quant: e4m3 / e2m1 decoding, FP8-block and MXFP4 quantizers, float rounding.

Expected values are computed independently of reference.quant: from the bit fields by
hand, by brute force over the whole code table, or with Python's exact Fractions.
"""
from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from reference.quant import (E2M1_VALUES, dequantize_expert_weights, dequantize_fp8_block,
                             dequantize_mxfp4, quantize_fp8_block, quantize_mxfp4, round_to_bf16)

SETTINGS = settings(max_examples=60, deadline=None)


# ------------------------------------------------------------------ hand-made decoders
def e4m3_by_hand(c: int) -> float:
    """float8_e4m3fn code -> value from its fields: s eeee mmm, bias 7, no inf, S.1111.111 = NaN."""
    sign = -1.0 if c & 0x80 else 1.0
    exp, man = (c >> 3) & 0xF, c & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * (man / 8.0) * 2.0 ** -6           # subnormal
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


def e2m1_by_hand(c: int) -> float:
    """e2m1 code -> value from its fields: s ee m, bias 1, no inf/NaN."""
    sign = -1.0 if c & 0x8 else 1.0
    exp, man = (c >> 1) & 0x3, c & 0x1
    if exp == 0:
        return sign * man * 0.5                          # subnormal: 0 or 0.5
    return sign * (1.0 + man / 2.0) * 2.0 ** (exp - 1)


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def same_f32(a: float, b: float) -> bool:
    """Bitwise f32 equality (so -0.0 != +0.0), any NaN equal to any NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return f32_bits(a) == f32_bits(b)


E4M3_FINITE_NONNEG = [(c, e4m3_by_hand(c)) for c in range(0x7F)]      # codes 0..126, 0 .. 448


# --------------------------------------------------------------------------- decoding
def test_every_e4m3_code_decodes_exactly():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    got = dequantize_fp8_block(codes, torch.ones(1, 1)).flatten().tolist()
    for c in range(256):
        assert same_f32(got[c], e4m3_by_hand(c)), f"code {c:#04x}: got {got[c]!r}, want {e4m3_by_hand(c)!r}"
    assert e4m3_by_hand(0x7E) == 448.0 and e4m3_by_hand(0x01) == 2.0 ** -9


def test_fp8_dequant_is_an_f32_product_per_block():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 0x7F, (200, 130), generator=g, dtype=torch.int32)
    codes |= torch.randint(0, 2, codes.shape, generator=g, dtype=torch.int32) << 7
    q = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.tensor([[1 / 3, 0.1], [7.25, 1e-3]], dtype=torch.float32)
    got = dequantize_fp8_block(q, scale).numpy()
    c = codes.numpy()
    for n, k in [(0, 0), (127, 127), (128, 0), (0, 128), (199, 129), (150, 3), (5, 129)]:
        want = np.float32(e4m3_by_hand(int(c[n, k]))) * scale.numpy()[n // 128, k // 128]   # f32 multiply
        assert got[n, k].tobytes() == np.float32(want).tobytes(), (n, k)


def test_e2m1_table_and_every_code_decodes_exactly():
    assert E2M1_VALUES == tuple(e2m1_by_hand(c) for c in range(16))
    assert [math.copysign(1, v) for v in E2M1_VALUES] == [1.0] * 8 + [-1.0] * 8
    codes = list(range(16)) + list(range(15, -1, -1))                 # K = 32
    packed = torch.tensor([[codes[2 * i] | codes[2 * i + 1] << 4 for i in range(16)]], dtype=torch.uint8)
    for s, factor in ((127, 1.0), (130, 8.0), (120, 2.0 ** -7)):
        got = dequantize_mxfp4(packed, torch.tensor([[s]], dtype=torch.uint8))[0].tolist()
        for k, c in enumerate(codes):
            assert same_f32(got[k], e2m1_by_hand(c) * factor), (s, k, c)


def test_nibble_order_low_nibble_is_even_k():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x71            # k = 0: code 1 (0.5); k = 1: code 7 (6.0)
    packed[0, 3] = 0xA2            # k = 6: code 2 (1.0); k = 7: code 10 (-1.0)
    got = dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))[0]
    want = torch.zeros(32)
    want[0], want[1], want[6], want[7] = 0.5, 6.0, 1.0, -1.0
    assert torch.equal(got, want)
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 0.5, 6.0
    q, s = quantize_mxfp4(w)
    assert q[0, 0].item() == 0x71 and s.tolist() == [[127]]


def test_scale_255_is_nan_and_scale_0_is_2_to_minus_127():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8)             # every code 2 (1.0)
    scales = torch.tensor([[255, 127], [0, 254]], dtype=torch.uint8)
    got = dequantize_mxfp4(packed, scales)
    assert torch.isnan(got[0, :32]).all() and (got[0, 32:] == 1.0).all()
    assert (got[1, :32] == 2.0 ** -127).all() and got[1, 0].item() != 0.0   # an f32 subnormal
    assert (got[1, 32:] == 2.0 ** 127).all()


# ------------------------------------------------------------------------- MXFP4 quant
def mx_expected(w_row_block, rule):
    """Independent MXFP4 oracle for one block of 32 floats: (scale byte, decoded values)."""
    amax = max(abs(Fraction(v)) for v in w_row_block)
    if amax == 0:
        e = -127
    else:
        e = math.floor(math.log2(amax)) - 3                          # a guess, then fixed exactly
        if rule == "ceil":
            while 6 * Fraction(2) ** e < amax:
                e += 1
            while 6 * Fraction(2) ** (e - 1) >= amax:
                e -= 1
        else:
            e0 = e
            while Fraction(2) ** (e0 + 1) <= amax:
                e0 += 1
            while Fraction(2) ** e0 > amax:
                e0 -= 1
            e = e0 - 2
    s = min(max(e + 127, 0), 254)
    scale = Fraction(2) ** (s - 127)
    mags = [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]
    out = []
    for v in w_row_block:
        a = abs(Fraction(v)) / scale
        dist = [abs(m - a) for m in mags]
        best = min(dist)
        code = [c for c in range(8) if dist[c] == best]
        code = code[0] if len(code) == 1 else [c for c in code if c % 2 == 0][0]
        val = float(mags[code] * scale)
        out.append(-val if v < 0 else val)
    return s, out


@st.composite
def mx_weights(draw):
    rows = draw(st.integers(1, 3))
    nblk = draw(st.integers(1, 2))
    center = draw(st.integers(-60, 60))
    vals = st.one_of(
        st.floats(-(2.0 ** 100), 2.0 ** 100, width=32),
        st.integers(-64, 64).map(lambda i: i * 2.0 ** (center - 3)),        # ties and grid points
        st.sampled_from([0.0, -0.0, 2.0 ** center, 6.0 * 2.0 ** center, 1.5 * 2.0 ** center]),
    )
    data = draw(st.lists(vals, min_size=rows * 32 * nblk, max_size=rows * 32 * nblk))
    return torch.tensor(data, dtype=torch.float32).reshape(rows, 32 * nblk)


@SETTINGS
@given(w=mx_weights(), rule=st.sampled_from(["ceil", "floor"]))
def test_mxfp4_matches_exact_oracle(w, rule):
    q, s = quantize_mxfp4(w, scale_rule=rule)
    assert q.dtype == torch.uint8 and s.dtype == torch.uint8
    assert q.shape == (w.shape[0], w.shape[1] // 2) and s.shape == (w.shape[0], w.shape[1] // 32)
    d = dequantize_mxfp4(q, s)
    for n in range(w.shape[0]):
        for b in range(w.shape[1] // 32):
            block = w[n, 32 * b:32 * (b + 1)].tolist()
            s_want, vals = mx_expected(block, rule)
            assert s[n, b].item() == s_want, (n, b, rule)
            assert d[n, 32 * b:32 * (b + 1)].tolist() == vals, (n, b, rule)


@SETTINGS
@given(w=mx_weights())
def test_mxfp4_ceil_rule_never_clips(w):
    q, s = quantize_mxfp4(w)                                 # default rule: ceil
    d = dequantize_mxfp4(q, s).double()
    scale = torch.pow(2.0, s.double() - 127).repeat_interleave(32, dim=1)
    scaled = w.double().abs() / scale
    assert scaled.max() <= 6.0                               # nothing beyond the grid
    half_step = torch.where(scaled <= 2, 0.25, torch.where(scaled <= 4, 0.5, 1.0)) * scale
    assert ((d - w.double()).abs() <= half_step).all()
    # and the scale is the smallest that fits: one exponent less would clip some block
    amax = w.double().abs().reshape(w.shape[0], -1, 32).amax(-1)
    smaller = torch.pow(2.0, s.double() - 128)
    assert ((6 * smaller < amax) | (s == 0)).all()


def test_mxfp4_floor_rule_can_clip():
    w = torch.zeros(1, 32)
    w[0, 0] = 7.5
    qf, sf = quantize_mxfp4(w, scale_rule="floor")
    assert sf.item() == 127                                  # floor(log2 7.5) - 2 = 0
    assert dequantize_mxfp4(qf, sf)[0, 0].item() == 6.0      # clipped: error 1.5 > half step
    qc, sc = quantize_mxfp4(w, scale_rule="ceil")
    assert sc.item() == 128 and dequantize_mxfp4(qc, sc)[0, 0].item() == 8.0   # 3.75 -> 4, error 0.5


@pytest.mark.parametrize("factor", [1.0, 8.0, 2.0 ** -20])
def test_mxfp4_ties_to_even(factor):
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    row = [6.0] + ties + [-t for t in ties] + [0.0] * 17
    w = torch.tensor([row]) * factor
    q, s = quantize_mxfp4(w)
    assert s.item() == 127 + round(math.log2(factor))
    d = dequantize_mxfp4(q, s)[0].tolist()
    assert d[1:8] == [v * factor for v in want]
    assert d[8:15] == [-v * factor for v in want]


def test_mxfp4_negative_zero_and_tiny_negatives_encode_as_code_0():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = -0.0, -0.1, 6.0
    q, _ = quantize_mxfp4(w)
    assert q[0, 0].item() == 0x00 and q[0, 1].item() == 0x07


@SETTINGS
@given(seed=st.integers(0, 2 ** 31), rows=st.integers(1, 4), nblk=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_mxfp4_grid_values_survive_round_trip(seed, rows, nblk, dtype):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, 32 * nblk), generator=g)
    exps = torch.randint(-100, 100, (rows, nblk), generator=g).double().repeat_interleave(32, dim=1)
    table = torch.tensor([e2m1_by_hand(c) for c in range(16)], dtype=torch.float64)
    w = (table[codes] * torch.pow(2.0, exps)).to(dtype)
    q, s = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(q, s), w.float())
    q, s = quantize_mxfp4(w, scale_rule="floor")
    assert torch.equal(dequantize_mxfp4(q, s), w.float())


def test_mxfp4_leading_dims():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 3, 4, 64, generator=g)
    q, s = quantize_mxfp4(w)
    assert q.shape == (2, 3, 4, 32) and s.shape == (2, 3, 4, 2)
    q1, s1 = quantize_mxfp4(w[1, 2])
    assert torch.equal(q[1, 2], q1) and torch.equal(s[1, 2], s1)
    assert torch.equal(dequantize_mxfp4(q, s)[1, 2], dequantize_mxfp4(q1, s1))


# --------------------------------------------------------------------------- FP8 quant
def fp8_oracle(w: torch.Tensor):
    """Independent FP8-block oracle: numpy f32 scales per block, brute-force nearest e4m3 code."""
    N, K = w.shape
    w32 = w.float().numpy()
    nb, kb = -(-N // 128), -(-K // 128)
    scale = np.ones((nb, kb), dtype=np.float32)
    for i in range(nb):
        for j in range(kb):
            amax = np.abs(w32[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]).max()
            if amax > 0:
                scale[i, j] = max(np.float32(amax) / np.float32(448.0), np.float32(2.0 ** -149))
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:N, :K].astype(np.float64)
    v = np.clip(w32.astype(np.float64) / full, -448.0, 448.0)
    table = np.array([val for _, val in E4M3_FINITE_NONNEG])          # codes 0..126
    dist = np.abs(np.abs(v)[..., None] - table)
    best = dist.min(-1, keepdims=True)
    cand = dist == best
    # among (at most two adjacent) nearest codes, take the even one
    even = cand & (np.arange(len(table)) % 2 == 0)
    code = np.where(cand.sum(-1) > 1, even.argmax(-1), cand.argmax(-1)).astype(np.int64)
    code |= np.signbit(v).astype(np.int64) << 7
    return code, scale


@st.composite
def fp8_weights(draw):
    N = draw(st.integers(1, 260))
    K = draw(st.integers(1, 140))
    seed = draw(st.integers(0, 2 ** 31))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.pow(2.0, torch.randint(-8, 8, (N, 1), generator=g).float())
    if draw(st.booleans()):
        w[: min(N, 128), : min(K, 128)] = 0.0                       # an all-zero block
    if draw(st.booleans()):
        w[torch.rand(N, K, generator=g) < 0.2] = -0.0
    return w.to(dtype)


@settings(max_examples=40, deadline=None)
@given(w=fp8_weights())
def test_fp8_quant_matches_oracle(w):
    q, scale = quantize_fp8_block(w)
    code_want, scale_want = fp8_oracle(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == scale_want.shape
    assert scale.numpy().tobytes() == scale_want.tobytes()
    assert np.array_equal(q.view(torch.uint8).numpy().astype(np.int64), code_want)


@settings(max_examples=40, deadline=None)
@given(w=fp8_weights())
def test_fp8_round_trip_within_half_ulp(w):
    q, scale = quantize_fp8_block(w)
    d = dequantize_fp8_block(q, scale).double()
    N, K = w.shape
    s = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    v = w.double() / s
    _, ex = torch.frexp(v)
    ulp = torch.pow(2.0, torch.clamp(ex.double() - 1, min=-6) - 3)        # e4m3 spacing at |v|
    bound = 0.5 * ulp * s + d.abs() * 2.0 ** -24                         # + the f32 product's rounding
    assert ((d - w.double()).abs() <= bound).all()
    assert not torch.isnan(d).any()


def test_fp8_scale_rounding_never_makes_nan():
    # amax / 448 rounded down in f32 means amax / scale > 448 (by an f32 ulp): still code 0x7E (448)
    found = 0
    for i in range(1, 400):
        amax = np.float32(1.0 + i * 2.0 ** -20)
        sc = np.float32(amax) / np.float32(448.0)
        if Fraction(float(amax)) / Fraction(float(sc)) > 448:
            found += 1
            q, scale = quantize_fp8_block(torch.tensor([[float(amax), -float(amax)]]))
            assert q.view(torch.uint8).tolist() == [[0x7E, 0xFE]]
            assert scale.item() == float(sc)
    assert found > 0


def test_fp8_zero_block_and_underflowing_scale():
    w = torch.zeros(130, 10)
    w[129, 0] = 100 * 2.0 ** -149                                      # amax / 448 underflows f32
    q, scale = quantize_fp8_block(w)
    assert scale.tolist() == [[1.0], [2.0 ** -149]]
    assert q.float()[129, 0].item() == 96.0                          # 100 ties 96 | 104 -> even 96
    assert (q.float()[:129] == 0).all()


def test_fp8_leading_dims_and_partial_blocks():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 2, 200, 130, generator=g)
    q, scale = quantize_fp8_block(w)
    assert q.shape == w.shape and scale.shape == (3, 2, 2, 2)
    q1, s1 = quantize_fp8_block(w[2, 1])
    assert torch.equal(q[2, 1].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(scale[2, 1], s1)


# ------------------------------------------------------------------------ bf16 rounding
def bf16_by_hand(v: float) -> float:
    """Round a Python float (f64) to bfloat16, nearest even, by exact integer rounding."""
    if v == 0 or math.isnan(v) or math.isinf(v):
        return v
    m, e = math.frexp(v)                                            # |v| in [2^(e-1), 2^e)
    quantum = 2.0 ** (max(e - 1, -126) - 7)
    r = math.copysign(round(v / quantum) * quantum, v)              # Python round(): half to even
    return math.copysign(math.inf, v) if abs(r) > 3.3895313892515355e38 else r


def test_round_to_bf16_rounds_once():
    assert round_to_bf16(torch.tensor([1 + 2 ** -8 + 2 ** -30], dtype=torch.float64)).item() == 1 + 2 ** -7
    g = torch.Generator().manual_seed(3)
    v = torch.randn(4000, generator=g, dtype=torch.float64) * torch.pow(
        2.0, torch.randint(-140, 128, (4000,), generator=g).double())
    ties = (torch.randint(-2 ** 9, 2 ** 9, (500,), generator=g).double() + 0.5) * 2.0 ** -8   # exact ties
    v = torch.cat([v, ties, torch.tensor([3.3961e38, -3.3961e38, 3.3e38, 2.0 ** -134, 3 * 2.0 ** -135])])
    got = round_to_bf16(v).float().tolist()
    for a, b in zip(v.tolist(), got):
        assert same_f32(b, bf16_by_hand(a)), (a, b)
    # the hand rounding agrees with torch's own (single) f32 -> bf16 rounding
    v32 = v.float()
    assert [bf16_by_hand(a) for a in v32.double().tolist()] == v32.to(torch.bfloat16).float().tolist()


# -------------------------------------------------------------------------- bad inputs
def _fp8_pair():
    return torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 1)


ERROR_CASES = [
    ("fp8 1-D w", "quantize_fp8_block", "w", lambda: quantize_fp8_block(torch.ones(8))),
    ("fp8 NaN w", "quantize_fp8_block", "w", lambda: quantize_fp8_block(torch.tensor([[1.0, float("nan")]]))),
    ("fp8 inf w", "quantize_fp8_block", "w", lambda: quantize_fp8_block(torch.tensor([[float("-inf")]]))),
    ("fp8 int w", "quantize_fp8_block", "w", lambda: quantize_fp8_block(torch.ones(2, 2, dtype=torch.int32))),
    ("fp8 list w", "quantize_fp8_block", "w", lambda: quantize_fp8_block([[1.0]])),
    ("mx K=48", "quantize_mxfp4", "w", lambda: quantize_mxfp4(torch.ones(2, 48))),
    ("mx 1-D", "quantize_mxfp4", "w", lambda: quantize_mxfp4(torch.ones(32))),
    ("mx inf", "quantize_mxfp4", "w", lambda: quantize_mxfp4(torch.full((1, 32), float("inf")))),
    ("mx f64", "quantize_mxfp4", "w", lambda: quantize_mxfp4(torch.ones(1, 32, dtype=torch.float64))),
    ("mx rule", "quantize_mxfp4", "scale_rule", lambda: quantize_mxfp4(torch.ones(1, 32), scale_rule="round")),
    ("dq fp8 scale shape", "dequantize_fp8_block", "scale",
     lambda: dequantize_fp8_block(_fp8_pair()[0], torch.ones(2, 1))),
    ("dq fp8 scale dtype", "dequantize_fp8_block", "scale",
     lambda: dequantize_fp8_block(_fp8_pair()[0], torch.ones(1, 1, dtype=torch.float64))),
    ("dq fp8 q dtype", "dequantize_fp8_block", "q", lambda: dequantize_fp8_block(torch.ones(4, 4), torch.ones(1, 1))),
    ("dq mx scales shape", "dequantize_mxfp4", "scales",
     lambda: dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))),
    ("dq mx packed K", "dequantize_mxfp4", "packed",
     lambda: dequantize_mxfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))),
    ("dq mx packed dtype", "dequantize_mxfp4", "packed",
     lambda: dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8))),
    ("dq expert quant", "dequantize_expert_weights", "quant",
     lambda: dequantize_expert_weights("int4", torch.zeros(2, 2))),
    ("dq expert no scale", "dequantize_expert_weights", "scale",
     lambda: dequantize_expert_weights("fp8_block", _fp8_pair()[0])),
    ("dq expert bf16 scale", "dequantize_expert_weights", "scale",
     lambda: dequantize_expert_weights("bf16", torch.zeros(2, 2, dtype=torch.bfloat16), torch.ones(1, 1))),
]


@pytest.mark.parametrize("desc,op,arg,call", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_inputs_raise(desc, op, arg, call):
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value).startswith(f"{op}: argument '{arg}'"), str(info.value)
