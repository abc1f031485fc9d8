"""reference.fused_experts and reference.moe.moe_forward.

The oracle here is a plain Python loop over tokens and slots on Python floats (f64),
with bf16 rounding done by exact integer rounding: it shares no code with the reference.
"""
from __future__ import annotations

import math
import operator
import types

import pytest
import torch
from hypothesis import given, settings, strategies as st

from reference.fused_experts import fused_experts
from reference.moe import moe_forward
from reference.quant import dequantize_fp8_block, dequantize_mxfp4
from reference.validate import DISPATCH_POLICIES

SETTINGS = settings(max_examples=50, deadline=None)
BF16_MAX = 3.3895313892515355e38


# ----------------------------------------------------------------------------- oracle
def bf16(v: float) -> float:
    """Round a Python float to bfloat16, nearest even (exact integer rounding, sign kept)."""
    if v == 0 or math.isnan(v) or math.isinf(v):
        return v
    _, e = math.frexp(v)
    quantum = 2.0 ** (max(e - 1, -126) - 7)
    r = math.copysign(round(v / quantum) * quantum, v)
    return math.copysign(math.inf, v) if abs(r) > BF16_MAX else r


def sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    ez = math.exp(z)
    return ez / (1.0 + ez)


def dot(a, b, bias=0.0) -> float:
    return math.fsum(list(map(operator.mul, a, b)) + [bias])


def oracle(x, W13, W2, topk_weights, topk_ids, b13=None, b2=None, activation="silu",
           alpha=1.702, limit=7.0, on_input=False):
    """Per token, per slot, on Python floats. W13/W2: f32 dequantized weights as tensors.
    on_input (apply_router_weight_on_input): slot j's input is bf16(x * bf16(w_j)), out unweighted."""
    T, H = x.shape
    E, two_i, _ = W13.shape
    I = two_i // 2
    xs, w13s, w2s = x.double().tolist(), W13.double().tolist(), W2.double().tolist()
    tw, ids = topk_weights.double().tolist(), topk_ids.tolist()
    b13s = b13.double().tolist() if b13 is not None else [[0.0] * two_i] * E
    b2s = b2.double().tolist() if b2 is not None else [[0.0] * H] * E
    out = []
    for t in range(T):
        acc = [0.0] * H
        for j, e in enumerate(ids[t]):
            if e < 0:
                continue
            xin = [bf16(v * bf16(tw[t][j])) for v in xs[t]] if on_input else xs[t]
            h = [bf16(dot(xin, w13s[e][n], b13s[e][n])) for n in range(two_i)]
            if activation == "silu":
                a = [bf16(h[i] * sigmoid(h[i]) * h[I + i]) for i in range(I)]
            else:
                a = []
                for i in range(I):
                    g = min(h[2 * i], limit)
                    u = min(max(h[2 * i + 1], -limit), limit)
                    a.append(bf16(g * sigmoid(alpha * g) * (u + 1.0)))
            for n in range(H):
                acc[n] += (1.0 if on_input else tw[t][j]) * dot(a, w2s[e][n], b2s[e][n])
        out.append([bf16(v) for v in acc])
    return torch.tensor(out, dtype=torch.float64).reshape(T, H).to(torch.bfloat16)  # exact: values are bf16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


# ---------------------------------------------------------------------------- inputs
def make_case(seed, T, E, K, H, I, *, quant="bf16", bias=None, drop=0.2, xscale=1.0):
    """Random inputs in the standard layout. Returns (kwargs for fused_experts, W13 f32, W2 f32)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * xscale).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    ids[torch.rand(T, K, generator=g) < drop] = -1
    tw = torch.rand(T, K, generator=g)
    kw = dict(x=x, topk_weights=tw, topk_ids=ids, quant=quant)
    if quant == "bf16":
        kw["w13"] = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(torch.bfloat16)
        kw["w2"] = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(torch.bfloat16)
        W13, W2 = kw["w13"].float(), kw["w2"].float()
    elif quant == "fp8_block":
        # codes with |value| <= 15 (exponent field <= 10) and random signs; power-of-two scales
        def codes(*shape):
            c = torch.randint(0, 0x58, shape, generator=g, dtype=torch.int32)
            c |= torch.randint(0, 2, shape, generator=g, dtype=torch.int32) << 7
            return c.to(torch.uint8).view(torch.float8_e4m3fn)
        cd = lambda n: -(-n // 128)
        kw["w13"], kw["w2"] = codes(E, 2 * I, H), codes(E, H, I)
        kw["w13_scale"] = torch.pow(2.0, torch.randint(-9, -3, (E, cd(2 * I), cd(H)), generator=g).float())
        kw["w2_scale"] = torch.pow(2.0, torch.randint(-9, -3, (E, cd(H), cd(I)), generator=g).float())
        W13, W2 = dequantize_fp8_block(kw["w13"], kw["w13_scale"]), dequantize_fp8_block(kw["w2"], kw["w2_scale"])
    else:
        kw["w13"] = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.int32).to(torch.uint8)
        kw["w2"] = torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.int32).to(torch.uint8)
        kw["w13_scale"] = torch.randint(121, 126, (E, 2 * I, H // 32), generator=g, dtype=torch.int32).to(torch.uint8)
        kw["w2_scale"] = torch.randint(121, 126, (E, H, I // 32), generator=g, dtype=torch.int32).to(torch.uint8)
        W13, W2 = dequantize_mxfp4(kw["w13"], kw["w13_scale"]), dequantize_mxfp4(kw["w2"], kw["w2_scale"])
    if bias is not None:
        kw["w13_bias"] = (torch.randn(E, 2 * I, generator=g) * 0.5).to(bias)
        kw["w2_bias"] = (torch.randn(E, H, generator=g) * 0.5).to(bias)
    return kw, W13, W2


def call(kw, **extra):
    kw = dict(kw, **extra)
    return fused_experts(kw.pop("x"), kw.pop("w13"), kw.pop("w2"), kw.pop("topk_weights"),
                         kw.pop("topk_ids"), **kw)


def run_oracle(kw, W13, W2, activation="silu", alpha=1.702, limit=7.0, on_input=False):
    return oracle(kw["x"], W13, W2, kw["topk_weights"], kw["topk_ids"], kw.get("w13_bias"),
                  kw.get("w2_bias"), activation, alpha, limit, on_input)


@st.composite
def shapes(draw):
    T = draw(st.integers(0, 6))
    E = draw(st.integers(1, 5))
    K = draw(st.integers(1, E))
    H = draw(st.sampled_from([32, 64]))
    I = draw(st.sampled_from([32, 64]))
    return T, E, K, H, I


# ------------------------------------------------------------------------ semantics
@SETTINGS
@given(shape=shapes(), seed=st.integers(0, 2 ** 31), activation=st.sampled_from(["silu", "swiglu_oai"]),
       bias=st.sampled_from([None, torch.float32, torch.bfloat16]), xscale=st.sampled_from([1.0, 16.0]),
       drop=st.sampled_from([0.0, 0.3]))
def test_bf16_matches_python_loop_bitwise(shape, seed, activation, bias, xscale, drop):
    T, E, K, H, I = shape
    kw, W13, W2 = make_case(seed, T, E, K, H, I, bias=bias, drop=drop, xscale=xscale)
    got = call(kw, activation=activation)
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)
    assert torch.equal(bits(got), bits(run_oracle(kw, W13, W2, activation)))


@settings(max_examples=25, deadline=None)
@given(shape=shapes(), seed=st.integers(0, 2 ** 31), quant=st.sampled_from(["fp8_block", "mxfp4"]),
       activation=st.sampled_from(["silu", "swiglu_oai"]), bias=st.sampled_from([None, torch.float32]))
def test_quantized_formats_equal_bf16_path_on_dequantized_weights(shape, seed, quant, activation, bias):
    T, E, K, H, I = shape
    kw, W13, W2 = make_case(seed, T, E, K, H, I, quant=quant, bias=bias)
    # the premise: these dequantized weights are exactly bf16 numbers
    assert torch.equal(W13.to(torch.bfloat16).float(), W13) and torch.equal(W2.to(torch.bfloat16).float(), W2)
    got = call(kw, activation=activation)
    as_bf16 = dict(kw, quant="bf16", w13=W13.to(torch.bfloat16), w2=W2.to(torch.bfloat16),
                   w13_scale=None, w2_scale=None)
    assert torch.equal(bits(got), bits(call(as_bf16, activation=activation)))
    assert torch.equal(bits(got), bits(run_oracle(kw, W13, W2, activation)))


@pytest.mark.parametrize("H,I", [(160, 96), (128, 256), (32, 32)])
def test_fp8_partial_blocks_and_non_bf16_scales(H, I):
    # quantize real weights (scales not powers of two, dequantized weights not bf16): the
    # oracle gets the f32 dequantized weights, fused_experts the f8 codes and scales
    from reference.quant import quantize_fp8_block
    g = torch.Generator().manual_seed(H + I)
    kw, _, _ = make_case(H * I, 5, 3, 2, H, I, bias=torch.float32)
    q13, s13 = quantize_fp8_block(torch.randn(3, 2 * I, H, generator=g) * H ** -0.5)
    q2, s2 = quantize_fp8_block(torch.randn(3, H, I, generator=g) * I ** -0.5)
    kw.update(quant="fp8_block", w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)
    W13, W2 = dequantize_fp8_block(q13, s13), dequantize_fp8_block(q2, s2)
    assert not torch.equal(W13.to(torch.bfloat16).float(), W13)
    assert torch.equal(bits(call(kw)), bits(run_oracle(kw, W13, W2)))


def test_mxfp4_quantized_weights_match_oracle():
    from reference.quant import quantize_mxfp4
    g = torch.Generator().manual_seed(7)
    kw, _, _ = make_case(7, 6, 4, 3, 64, 32)
    q13, s13 = quantize_mxfp4(torch.randn(4, 64, 64, generator=g))
    q2, s2 = quantize_mxfp4(torch.randn(4, 64, 32, generator=g) * 0.1)
    kw.update(quant="mxfp4", w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)
    for act in ("silu", "swiglu_oai"):
        got = call(kw, activation=act, alpha=1.5, limit=2.0)
        want = run_oracle(kw, dequantize_mxfp4(q13, s13), dequantize_mxfp4(q2, s2), act, 1.5, 2.0)
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "mxfp4"])
def test_every_dispatch_gives_identical_output(quant):
    kw, _, _ = make_case(11, 6, 5, 3, 64, 32, quant=quant, bias=torch.bfloat16)
    outs = [call(kw, dispatch=d) for d in DISPATCH_POLICIES]
    assert outs[0].abs().sum() > 0
    for o in outs[1:]:
        assert torch.equal(bits(o), bits(outs[0]))


@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "mxfp4"])
def test_zero_tokens(quant):
    kw, _, _ = make_case(3, 0, 4, 2, 64, 32, quant=quant, bias=torch.float32)
    out = call(kw)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


def test_all_slots_dropped_gives_zeros_even_with_biases():
    kw, _, _ = make_case(5, 4, 3, 2, 32, 32, bias=torch.float32)
    kw["topk_ids"] = torch.full((4, 2), -1, dtype=torch.int32)
    out = call(kw)
    assert torch.equal(out, torch.zeros(4, 32, dtype=torch.bfloat16))


def test_rounding_points_hand_case():
    # One token, one expert, H = I = 1 (silu, bf16 weights): gate row 0, up row 1, x = 1,
    # b13 = (2, 2^-9), W2 = 1, b2 = 2^-9.
    #   h = (2, 1 + 2^-9) -> bf16 (2, 1)                       [unrounded h would give a = 1.765625]
    #   a = silu(2) * 1 = 1.76159... -> bf16 1.7578125 (225/128) [unrounded a would give out 1.765625]
    #   y = 1.7578125 + 2^-9 = 1.759765625 -> out = bf16(w * y)
    x = torch.tensor([[1.0]], dtype=torch.bfloat16)
    w13 = torch.tensor([[[0.0], [1.0]]], dtype=torch.bfloat16)
    w2 = torch.tensor([[[1.0]]], dtype=torch.bfloat16)
    kw = dict(x=x, w13=w13, w2=w2, topk_weights=torch.tensor([[1.0]]),
              topk_ids=torch.tensor([[0]], dtype=torch.int32), quant="bf16",
              w13_bias=torch.tensor([[2.0, 2.0 ** -9]]), w2_bias=torch.tensor([[2.0 ** -9]]))
    assert bf16(2.0 * sigmoid(2.0)) == 1.7578125
    assert bf16(2.0 * sigmoid(2.0) * (1 + 2.0 ** -9)) == 1.765625
    assert bf16(2.0 * sigmoid(2.0) + 2.0 ** -9) == 1.765625
    assert call(kw).item() == 1.7578125
    kw["topk_weights"] = torch.tensor([[2.0]])              # 3.51953125 -> 3.515625 (spacing 2^-6)
    assert call(kw).item() == 3.515625
    kw["topk_ids"] = torch.tensor([[-1]], dtype=torch.int32)
    assert call(kw).item() == 0.0


# ------------------------------------------- apply_router_weight_on_input (SPEC 6)
# swiglu_oai with a huge alpha and limit is relu(g) * (u + 1) exactly in f64 (sigmoid(1e4 * g)
# is 1.0 for g >= 0.1 and underflows to 0 for g <= -0.1): small integers stay computable by hand.
RELU = dict(activation="swiglu_oai", alpha=1e4, limit=1e3)


def test_weighted_input_hand_case_weight_rounded_first():
    # H = I = 1, one slot. gate row 0 = 1, up row 1 = 0: h = (x_in, 0), a = x_in, y = a (W2 = 1).
    # w = 1 + 2^-8 + 2^-10 (f32). bf16(w) = 1 + 2^-7 (2^-8 + 2^-10 is above half of 2^-7).
    # x = 3: x * bf16(w) = 3 + 3 * 2^-7 = 3.0234375, exactly halfway between 3 + 2^-6 and
    # 3 + 2^-5 (bf16 spacing 2^-6 in [2, 4)); ties to even: 3 + 2^-5 = 3.03125.
    # Without rounding w first: 3 * w = 3.0146484375 -> 3.015625. Unflagged: bf16(w * 3) = the same 3.015625.
    w = 1 + 2.0 ** -8 + 2.0 ** -10
    assert bf16(w) == 1 + 2.0 ** -7 and bf16(3 * bf16(w)) == 3.03125 and bf16(3 * w) == 3.015625
    kw = dict(x=torch.tensor([[3.0]], dtype=torch.bfloat16),
              w13=torch.tensor([[[1.0], [0.0]]], dtype=torch.bfloat16), w2=torch.tensor([[[1.0]]], dtype=torch.bfloat16),
              topk_weights=torch.tensor([[w]]), topk_ids=torch.tensor([[0]], dtype=torch.int32), quant="bf16", **RELU)
    assert call(kw, apply_router_weight_on_input=True).item() == 3.03125
    assert call(kw).item() == 3.015625


def test_weighted_input_hand_case_two_slots():
    # x = (1, 2), slots -> experts (0, 1) with w = (2, 0.5), a third slot dropped (-1, weight 7).
    # Both experts: gate = x0 + x1, up = x0, so a = g * (u + 1); W2[0] = (1, 1), W2[1] = (1, -1).
    #   flag:  slot 0 input (2, 4): g = 6, u = 2, a = 18;  slot 1 input (0.5, 1): g = 1.5, u = 0.5,
    #          a = 2.25;  out = (18 + 2.25, 18 - 2.25) = (20.25, 15.75), unweighted.
    #   no flag: input (1, 2): g = 3, u = 1, a = 6 for both; out = 2 * (6, 6) + 0.5 * (6, -6) = (15, 9).
    W13 = torch.tensor([[1.0, 1.0], [1.0, 0.0]]).expand(2, 2, 2).contiguous()   # rows: gate, up (interleaved)
    W2 = torch.tensor([[[1.0], [1.0]], [[1.0], [-1.0]]])
    kw = dict(x=torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16), w13=W13.bfloat16(), w2=W2.bfloat16(),
              topk_weights=torch.tensor([[2.0, 0.5, 7.0]]), topk_ids=torch.tensor([[0, 1, -1]], dtype=torch.int32),
              quant="bf16", **RELU)
    assert call(kw, apply_router_weight_on_input=True).tolist() == [[20.25, 15.75]]
    assert call(kw).tolist() == [[15.0, 9.0]]
    # biases are not scaled by the weight: b13 = (1, 0) per expert adds 1 to g; b2 = (1, 0) adds 1 per slot
    kw.update(w13_bias=torch.tensor([[1.0, 0.0], [1.0, 0.0]]), w2_bias=torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    # slot 0: g = 7, a = 21, y = (22, 21); slot 1: g = 2.5, a = 3.75, y = (4.75, -3.75); sum (26.75, 17.25)
    assert call(kw, apply_router_weight_on_input=True).tolist() == [[26.75, 17.25]]


@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "mxfp4"])
def test_weighted_input_k1_and_equal_weights_are_unflagged_on_scaled_x(quant):
    """K = 1, or K > 1 with one weight per token for all its slots: the flag equals the plain call
    on x' = bf16(x * bf16(w)) with weights 1, bit for bit; weights exactly 1 make the flag a no-op."""
    for K in (1, 3):
        kw, _, _ = make_case(40 + K, 6, 4, K, 64, 32, quant=quant, bias=torch.float32, drop=0.2)
        c = torch.rand(6, 1, generator=torch.Generator().manual_seed(K)) * 3
        kw["topk_weights"] = c.expand(6, K).contiguous()
        xw = (kw["x"].double() * c.bfloat16().double()).bfloat16()     # exact product, one rounding
        plain = dict(kw, x=xw, topk_weights=torch.ones(6, K))
        got = call(kw, apply_router_weight_on_input=True)
        assert torch.equal(bits(got), bits(call(plain))) and got.abs().sum() > 0
        ones = dict(kw, topk_weights=torch.ones(6, K))
        assert torch.equal(bits(call(ones, apply_router_weight_on_input=True)), bits(call(ones)))


@SETTINGS
@given(shape=shapes(), seed=st.integers(0, 2 ** 31), activation=st.sampled_from(["silu", "swiglu_oai"]),
       bias=st.sampled_from([None, torch.float32, torch.bfloat16]), quant=st.sampled_from(["bf16", "mxfp4"]))
def test_weighted_input_matches_python_loop_bitwise(shape, seed, activation, bias, quant):
    T, E, K, H, I = shape
    kw, W13, W2 = make_case(seed, T, E, K, H, I, quant=quant, bias=bias)
    kw["topk_weights"] = kw["topk_weights"] * 4 - 1           # negative and > 1 weights too
    got = call(kw, activation=activation, apply_router_weight_on_input=True)
    assert torch.equal(bits(got), bits(run_oracle(kw, W13, W2, activation, on_input=True)))


def test_weighted_input_bad_type():
    kw, _, _ = make_case(1, 2, 3, 2, 32, 32)
    for v in (1, 0, "yes", None, torch.tensor(True)):
        with pytest.raises(ValueError, match="argument 'apply_router_weight_on_input'"):
            call(kw, apply_router_weight_on_input=v)


# ------------------------------------------------------------------------ bad inputs
def base(quant="bf16", H=64, I=32):
    kw, _, _ = make_case(1, 3, 4, 2, H, I, quant=quant)
    return kw


def with_(quant="bf16", **changes):
    def run():
        kw = base(quant)
        for k, v in changes.items():
            kw[k] = v(kw) if callable(v) else v
        return call(kw)
    return run


ERROR_CASES = [
    ("x f32", "x", with_(x=lambda k: k["x"].float())),
    ("x 1-D", "x", with_(x=lambda k: k["x"][0])),
    ("x not a tensor", "x", with_(x=lambda k: k["x"].tolist())),
    ("w13 wrong H", "w13", with_(w13=torch.zeros(4, 64, 65, dtype=torch.bfloat16))),
    ("w13 odd 2I", "w13", with_(w13=torch.zeros(4, 63, 64, dtype=torch.bfloat16))),
    ("w13 f32", "w13", with_(w13=lambda k: k["w13"].float())),
    ("w13 not contiguous", "w13", with_(w13=torch.zeros(4, 64, 128, dtype=torch.bfloat16)[:, :, ::2])),
    ("w2 wrong shape", "w2", with_(w2=torch.zeros(4, 64, 31, dtype=torch.bfloat16))),
    ("fp8 missing scale", "w13_scale", with_("fp8_block", w13_scale=None)),
    ("fp8 weights as bf16", "w13", with_("fp8_block", w13=torch.zeros(4, 64, 64, dtype=torch.bfloat16))),
    ("fp8 wrong scale shape", "w2_scale", with_("fp8_block", w2_scale=torch.ones(4, 1, 2))),
    ("fp8 scale bf16", "w13_scale", with_("fp8_block", w13_scale=lambda k: k["w13_scale"].bfloat16())),
    ("bf16 with scale", "w2_scale", with_(w2_scale=torch.ones(4, 1, 1))),
    ("mxfp4 f32 scale", "w13_scale", with_("mxfp4", w13_scale=lambda k: k["w13_scale"].float())),
    ("mxfp4 H=48", "x", lambda: call(dict(base("bf16", H=48), quant="mxfp4",
                                           w13=torch.zeros(4, 64, 24, dtype=torch.uint8),
                                           w2=torch.zeros(4, 48, 16, dtype=torch.uint8),
                                           w13_scale=torch.zeros(4, 64, 1, dtype=torch.uint8),
                                           w2_scale=torch.zeros(4, 48, 1, dtype=torch.uint8)))),
    ("mxfp4 I=48", "w13", lambda: call(dict(base("bf16"), quant="mxfp4",
                                            w13=torch.zeros(4, 96, 32, dtype=torch.uint8),
                                            w2=torch.zeros(4, 64, 24, dtype=torch.uint8),
                                            w13_scale=torch.zeros(4, 96, 2, dtype=torch.uint8),
                                            w2_scale=torch.zeros(4, 64, 1, dtype=torch.uint8)))),
    ("ids == E", "topk_ids", with_(topk_ids=torch.full((3, 2), 4, dtype=torch.int32))),
    ("ids < -1", "topk_ids", with_(topk_ids=torch.full((3, 2), -2, dtype=torch.int32))),
    ("ids int64", "topk_ids", with_(topk_ids=lambda k: k["topk_ids"].long())),
    ("ids wrong K", "topk_ids", with_(topk_ids=torch.zeros(3, 3, dtype=torch.int32))),
    ("weights wrong T", "topk_weights", with_(topk_weights=torch.ones(4, 2))),
    ("weights bf16", "topk_weights", with_(topk_weights=lambda k: k["topk_weights"].bfloat16())),
    ("unknown activation", "activation", with_(activation="gelu")),
    ("unknown dispatch", "dispatch", with_(dispatch="fast")),
    ("unknown quant", "quant", with_(quant="int4")),
    ("alpha nan", "alpha", with_(alpha=float("nan"))),
    ("limit inf", "limit", with_(limit=float("inf"))),
    ("alpha str", "alpha", with_(alpha="1.7")),
    ("w13_bias wrong shape", "w13_bias", with_(w13_bias=torch.zeros(4, 63))),
    ("w2_bias f16", "w2_bias", with_(w2_bias=torch.zeros(4, 64, dtype=torch.float16))),
]


@pytest.mark.parametrize("desc,arg,run", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_inputs_raise(desc, arg, run):
    with pytest.raises(ValueError) as info:
        run()
    assert str(info.value).startswith(f"fused_experts: argument '{arg}'"), str(info.value)


def test_error_table_base_is_valid():
    for quant in ("bf16", "fp8_block", "mxfp4"):
        assert call(base(quant)).shape == (3, 64)


# ------------------------------------------------------------------------ moe_forward
def moe_case(seed, T, E=6, H=64, I=32):
    g = torch.Generator().manual_seed(seed)
    kw, _, _ = make_case(seed, T, E, 2, H, I, bias=torch.float32)
    router = torch.randn(E, H, generator=g)
    return kw, router


@pytest.mark.parametrize("T", [0, 1, 7])
@pytest.mark.parametrize("method,extra", [("softmax_topk", dict(renormalize=True)),
                                          ("sigmoid_bias", dict(bias="b", scaling=2.5))])
def test_moe_forward_equals_the_three_ops(T, method, extra):
    from reference.route import route
    from reference.router_gemm import router_gemm
    kw, router = moe_case(T + 1, T)
    extra = dict(extra)
    if extra.get("bias") == "b":
        extra["bias"] = torch.linspace(-1, 1, 6)
    got = moe_forward(kw["x"], router, kw["w13"], kw["w2"], top_k=2, method=method, **extra,
                      w13_bias=kw["w13_bias"], w2_bias=kw["w2_bias"], activation="swiglu_oai")
    logits = router_gemm(kw["x"], router)
    w, ids = route(logits, 2, method, **extra)
    want = fused_experts(kw["x"], kw["w13"], kw["w2"], w, ids, quant="bf16", w13_bias=kw["w13_bias"],
                         w2_bias=kw["w2_bias"], activation="swiglu_oai")
    assert got.shape == (T, 64) and got.dtype == torch.bfloat16
    assert torch.equal(bits(got), bits(want))
    if T:
        assert got.abs().sum() > 0


def test_moe_forward_uses_the_given_ops():
    calls = []
    logits_t = torch.full((2, 3), 0.5)
    w_t, ids_t = torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    out_t = torch.zeros(2, 32, dtype=torch.bfloat16)

    def router_gemm(x, weight):
        calls.append(("router_gemm", x, weight))
        return logits_t

    def route(logits, top_k, method, **kw):
        calls.append(("route", logits, top_k, method, kw))
        return w_t, ids_t

    def fused(x, w13, w2, w, ids, **kw):
        calls.append(("fused_experts", w, ids, kw))
        return out_t

    ops = types.SimpleNamespace(router_gemm=router_gemm, route=route, fused_experts=fused)
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    rw = torch.zeros(3, 32)
    w13 = torch.zeros(3, 64, 32, dtype=torch.bfloat16)
    out = moe_forward(x, rw, w13, torch.zeros(3, 32, 32, dtype=torch.bfloat16), top_k=1, method="topk_softmax",
                      activation="swiglu_oai", alpha=1.0, limit=3.0, dispatch="tiny", ops=ops)
    assert out is out_t
    assert [c[0] for c in calls] == ["router_gemm", "route", "fused_experts"]
    assert calls[0][1] is x and calls[0][2] is rw
    assert calls[1][1] is logits_t and calls[1][2:4] == (1, "topk_softmax")
    assert calls[1][4] == dict(bias=None, n_group=1, topk_group=1, scaling=1.0, renormalize=None)
    assert calls[2][1] is w_t and calls[2][2] is ids_t
    assert calls[2][3]["activation"] == "swiglu_oai" and calls[2][3]["limit"] == 3.0
    assert calls[2][3]["dispatch"] == "tiny" and calls[2][3]["quant"] == "bf16"


def test_moe_forward_bad_inputs():
    kw, router = moe_case(0, 2)
    with pytest.raises(ValueError, match=r"^moe_forward: argument 'ops'"):
        moe_forward(kw["x"], router, kw["w13"], kw["w2"], top_k=2, ops=types.SimpleNamespace(route=None))
    with pytest.raises(ValueError, match=r"^moe_forward: argument 'router_weight'"):
        moe_forward(kw["x"], router[:5], kw["w13"], kw["w2"], top_k=2)
    with pytest.raises(ValueError, match=r"^route: argument 'top_k'"):
        moe_forward(kw["x"], router, kw["w13"], kw["w2"], top_k=7)
