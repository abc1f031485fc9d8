"""optimized.skinny_gemm / unquantized_gemm / fused_gate_gemm / FusedGate against the
reference (SPEC section 4), at every CPU ISA level.

Ground truth is the reference's function before its one rounding: float64 products and sums
of the exact upcasts (+ bias), computed here as f64(x) @ f64(w).T (the reference's own
output, rounded to the dtype, is checked too, within one more rounding).

Tolerance, per output element (`tolerance` below):

    acc = u32 * (2*sqrt(K) + 2) * (|x| @ |w|.T + |bias|) + (K + 1) * 2^-126
    tol = acc + half_ulp_dtype(|exact| + acc)

u32 = 2^-24; half_ulp_dtype(v) is half the spacing of the output dtype's grid in v's binade
(bf16: 2^-8..2^-9 relative, f16: 2^-11..2^-12, subnormal spacing at the bottom; 0 for f32,
whose output rounding is the last accumulation step). Why this bound:
- Sound where it must be: the kernel adds each product (exact for bf16/f16, FMA-fused for
  f32) with one f32 rounding per step, so the deterministic worst case is
  K*u32*(|x|@|w|.T); for K <= 4, 2*sqrt(K) + 2 >= K + 1 covers it with the bias rounding.
  For larger K the rounding errors of a sum behave like a random walk and the bound grows
  like sqrt(K). The largest error seen over normal, uniform-positive and heavy-tailed
  (lognormal) data at every level was 1.7*sqrt(K)*u32*(|x|@|w|.T) (scalar level, K = 17,
  sequential sum); the vector levels stay below 0.7*sqrt(K) for K >= 64. The "+2" and the
  factor 2 leave margin over that.
- vdpbf16ps flushes denormal inputs and results (see csrc/cpu/skinny_gemm_kernel.h): an
  absolute error below 2^-126 per step, hence the (K + 1) * 2^-126 floor.
- Tight enough to catch a 2^-10 relative error in one output column of an f32 GEMM
  (SPEC's tolerance model): at K = 4096 the accumulation term is 130*u32*(|x|@|w|.T), under
  2^-10*|y| whenever |y| > 0.8% of |x|@|w|.T, i.e. for about 3 of 4 elements of normal data.
  In bf16/f16 outputs the output rounding is what such an error must cross; with the
  half-ulp taken in the value's own binade (not the worst case of the format) the error is
  caught in one 8-row column for f16 and, bf16's rounding being 2-4x coarser than the error,
  within 64 rows for bf16. test_tolerance_catches_column_error proves all three.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import optimized
import reference.gate_gemm as ref
from optimized import dispatch
from tests import levels

LEVELS = list(levels.LEVELS)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
U32 = 2.0 ** -24
SIGNIFICAND = {torch.bfloat16: 8, torch.float16: 11}
SUBNORMAL_HALF = {torch.float32: 2.0 ** -150, torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}
SETTINGS = settings(max_examples=60, deadline=None)
bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(params=LEVELS)
def level(request):
    """Run the test with the CPU ISA capped at each level (CI runs the top one by default)."""
    with levels.capped(request.param):
        assert optimized.backend_info()["skinny_gemm"] == request.param
        yield request.param


@pytest.fixture(autouse=True)
def _restore_modes():
    yield
    dispatch.set_batch_invariant(False)
    levels.restore()


# ------------------------------------------------------------------ data and tolerance
def make(T, N, K, dtype, seed, *, dist="normal", bias=False, pad=0):
    """x [T, K] (rows `K + pad` apart when pad > 0), w [N, K], bias [N] or None."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        if dist == "normal":
            return torch.randn(*shape, generator=g)
        if dist == "positive":
            return torch.rand(*shape, generator=g)
        if dist == "lognormal":   # heavy tails: a few terms dominate a sum
            return torch.randn(*shape, generator=g).mul(2).exp() * torch.randn(*shape, generator=g).sign()
        raise ValueError(dist)

    x = draw(T, K + pad).to(dtype)[:, :K]
    w = draw(N, K).to(dtype)
    b = draw(N).to(dtype) if bias else None
    return x, w, b


def truth(x, w, b):
    """(exact f64 value, magnitude |x| @ |w|.T + |b|) of every output element."""
    xd, wd = x.double(), w.double()
    exact, mag = xd @ wd.T, xd.abs() @ wd.abs().T
    if b is not None:
        exact, mag = exact + b.double(), mag + b.double().abs()
    return exact, mag


def half_ulp(v, dtype):
    """Half the spacing of dtype's grid at magnitude v >= 0: the largest rounding error of a
    value in v's binade (subnormal spacing below the smallest normal). 0 for float32 outputs,
    whose rounding is the last accumulation step, already counted."""
    if dtype == f32:
        return torch.zeros_like(v)
    p = SIGNIFICAND[dtype]
    _, e = torch.frexp(v)                  # v = m * 2^e, m in [0.5, 1): binade 2^(e-1)
    return torch.where(v > 0, torch.ldexp(torch.ones_like(v), e - 1 - p), torch.zeros_like(v)).clamp(
        min=SUBNORMAL_HALF[dtype])


def tolerance(x, w, b):
    exact, mag = truth(x, w, b)
    K, dt = x.shape[1], x.dtype
    acc = U32 * (2 * math.sqrt(K) + 2) * mag + (K + 1) * 2.0 ** -126
    return exact, acc + half_ulp(exact.abs() + acc, dt)


def _overflowed(out, exact, tol):
    """Elements correctly rounded to +-inf: the exact value (within tol) reaches the dtype's
    overflow threshold max + half an ulp of max (65520 for f16)."""
    fi = torch.finfo(out.dtype)
    threshold = fi.max + fi.max * fi.eps / 4            # eps/2 relative ulp at max, half of it
    return out.isinf() & (out.double().sign() == exact.sign()) & (exact.abs() + tol >= threshold)


def assert_close(out, x, w, b, what=""):
    T, N = x.shape[0], w.shape[0]
    assert out.shape == (T, N) and out.dtype == x.dtype and out.is_contiguous(), (out.shape, out.dtype)
    exact, tol = tolerance(x, w, b)
    err = (out.double() - exact).abs()
    inf_ok = _overflowed(out, exact, tol)
    bad = ~(err <= tol) & ~inf_ok              # NaN is bad
    if bad.any():
        t, n = (int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {T * N} elements over tolerance; first [{t}, {n}]: "
                             f"got {out[t, n].item()!r}, exact {exact[t, n].item()!r}, err/tol = "
                             f"{(err[t, n] / tol[t, n]).item():.3g} (T={T} N={N} K={x.shape[1]} {x.dtype})")
    # The reference's own output (rounded once more) is at most one more rounding away.
    r = ref.skinny_gemm(x, w, b) if T <= 8 else ref.unquantized_gemm(x, w, b)
    ref_tol = tol + half_ulp(exact.abs() * (1 + U32), x.dtype) + U32 * exact.abs()
    ok = ((out.double() - r.double()).abs() <= ref_tol) | (inf_ok & (r == out))
    assert bool(ok.all()), f"{what}: differs from reference output"


# ------------------------------------------------------------------ skinny_gemm vs reference
NS = (1, 3, 257, 513)
KS = (1, 15, 17, 2047, 4096)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_skinny_matches_reference(level, dtype):
    """Every T = 0..8, odd N, K with vector tails, bias and strided x, at this ISA level."""
    for i, (N, K) in enumerate((N, K) for N in NS for K in KS):
        use_bias, pad = i % 2 == 0, (3 if i % 3 == 0 else 0)
        x8, w, b = make(8, N, K, dtype, seed=100 + i, bias=use_bias, pad=pad)
        if pad:
            assert x8.stride(0) == K + pad and not x8.is_contiguous()
        for T in range(9):
            x = x8[:T]
            out = optimized.skinny_gemm(x, w, b)
            assert_close(out, x, w, b, f"{level} T={T} N={N} K={K} bias={use_bias} pad={pad}")


@pytest.mark.parametrize("dist", ["positive", "lognormal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_skinny_other_distributions(level, dtype, dist):
    """Same-sign data (error grows like sqrt(K) relative to |y|) and heavy tails."""
    for i, (N, K) in enumerate([(3, 2), (3, 3), (257, 17), (33, 64), (513, 2047), (7, 4096)]):
        x, w, b = make(8, N, K, dtype, seed=7 + i, dist=dist, bias=i % 2 == 1)
        assert_close(optimized.skinny_gemm(x, w, b), x, w, b, f"{level} {dist} N={N} K={K}")


@SETTINGS
@given(T=st.integers(0, 8), N=st.integers(1, 70), K=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(DTYPES), use_bias=st.booleans(), pad=st.sampled_from([0, 1, 16]),
       level=st.sampled_from(LEVELS))
def test_prop_skinny_matches_reference(T, N, K, seed, dtype, use_bias, pad, level):
    with levels.capped(levels.clamp(level)):
        x, w, b = make(T, N, K, dtype, seed, bias=use_bias, pad=pad)
        assert_close(optimized.skinny_gemm(x, w, b), x, w, b, f"{level}")


def test_skinny_small_integers_exact(level):
    """Small integers: every product and partial sum is exact in f32, so the result is
    exactly the hand-computed integer (bf16 holds integers up to 256 exactly)."""
    for dtype in DTYPES:
        T, N, K = 5, 37, 67
        g = torch.Generator().manual_seed(3)
        x = torch.randint(-3, 4, (T, K), generator=g)
        w = torch.randint(-3, 4, (N, K), generator=g)
        b = torch.randint(-5, 6, (N,), generator=g)
        want = [[sum(int(x[t, k]) * int(w[n, k]) for k in range(K)) + int(b[n]) for n in range(N)] for t in range(T)]
        out = optimized.skinny_gemm(x.to(dtype), w.to(dtype), b.to(dtype))
        assert out.dtype == dtype and out.float().tolist() == [[float(v) for v in row] for row in want]


def test_skinny_nan_inf_propagate(level):
    for dtype in DTYPES:
        x, w, _ = make(4, 19, 40, dtype, seed=5)
        x[1, 33] = float("nan")          # in the tail chunk at every level
        w[6, 2] = float("inf")
        x[:, 2] = x[:, 2].abs() + 1      # so column 6 is +inf in the other rows
        out = optimized.skinny_gemm(x, w)
        want = x.double() @ w.double().T
        assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.isinf(), want.isinf())
        assert bool(out[1].isnan().all()) and bool((out[[0, 2, 3], 6] == float("inf")).all())


def test_skinny_zero_tokens_and_noncontiguous_weight_bias(level):
    x, w, b = make(0, 5, 9, bf16, seed=1, bias=True)
    out = optimized.skinny_gemm(x, w, b)
    assert out.shape == (0, 5) and out.dtype == bf16
    # weight rows strided, K-strided weight and x, strided bias: wrapper copies what it must
    xs, ws, bs = make(3, 6, 20, f32, seed=2, bias=True)
    wide = torch.randn(6, 40)
    wide[:, :20] = ws
    bias_wide = torch.stack([bs, bs], 1).reshape(-1)[::2]
    assert not bias_wide.is_contiguous() and torch.equal(bias_wide, bs)
    x_t = xs.t().contiguous().t()        # stride(1) != 1
    assert x_t.stride(1) != 1
    out = optimized.skinny_gemm(x_t, wide[:, :20], bias_wide)
    assert torch.equal(out, optimized.skinny_gemm(xs.contiguous(), ws.contiguous(), bs))
    assert_close(out, xs, ws, bs)


# ------------------------------------------------------------------ the tolerance can fail
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tolerance_catches_column_error(dtype):
    """A 2^-10 relative error in ONE output column (in the f32 value, before the output
    rounding) violates the tolerance: in every 8-row column for f32 and f16, and within 64
    rows (8 calls) for bf16, whose own rounding is 4x coarser than the error."""
    calls = 8 if dtype == bf16 else 1
    for i, (N, K) in enumerate((N, K) for N in (3, 513) for K in KS):
        caught = False
        for c in range(calls):
            x, w, b = make(8, N, K, dtype, seed=1000 + 10 * i + c, bias=True)
            exact, _ = truth(x, w, b)
            col = N // 2
            mutant = exact.clone()
            mutant[:, col] *= 1 + 2.0 ** -10
            out = mutant.float().to(dtype)    # f64 -> f32 -> dtype: a negligible 2^-24 extra
            try:
                assert_close(out, x, w, b)
            except AssertionError:
                caught = True
                break
        assert caught, f"2^-10 error in column {col} not caught (N={N} K={K} {dtype})"
        # and the unmutated rounding of the exact value passes
        assert_close(exact.to(dtype), x, w, b, "exact rounded")


# ------------------------------------------------------------------ batch invariance
def order_sensitive(x, w):
    """Make rounding-order changes visible in the output: +2^14 and -2^14 enter at k = 0
    and k = 2 (different vector lanes at every level) and cancel, so the other, small terms
    (x scaled by 1/16) are added next to a large partial sum: any change of the
    accumulation or horizontal-sum order moves the result by ~2^-10 of |y|, which shows up
    even after bf16 rounding. (With plain random data a changed order differs by ~2^-20
    relative and bf16/f16 rounding hides it almost always.)"""
    x = x / 16
    if x.shape[1] >= 3:
        x[:, 0], x[:, 2] = 2.0 ** 14, -(2.0 ** 14)
        w[:, 0] = w[:, 2] = 1
    return x, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_skinny_batch_invariant(level, dtype):
    """A row's output alone equals its output inside any batch of T = 1..8, bit for bit."""
    for N, K in [(3, 17), (513, 2047), (257, 4096)]:
        x8, w, b = make(8, N, K, dtype, seed=N + K, bias=True)
        x8, w = order_sensitive(x8, w)
        x8 = torch.cat([x8, x8], 1)[:, :K]          # strided rows
        alone = torch.cat([optimized.skinny_gemm(x8[t:t + 1], w, b) for t in range(8)])
        assert_close(alone, x8, w, b)
        for T in range(1, 9):
            assert torch.equal(optimized.skinny_gemm(x8[:T], w, b), alone[:T]), (level, N, K, T)
        # the same row at other positions, among other batch-mates
        others, _, _ = make(7, N, K, dtype, seed=1)
        for pos in (0, 3, 7):
            batch = torch.cat([others[:pos], x8[2:3], others[pos:]])
            assert torch.equal(optimized.skinny_gemm(batch, w, b)[pos], alone[2]), (level, N, K, pos)


@pytest.mark.parametrize("dtype", [bf16, f32], ids=str)
def test_unquantized_batch_invariant_mode_up_to_64(dtype):
    x64, w, b = make(64, 257, 1000, dtype, seed=9, bias=True)
    x64, w = order_sensitive(x64, w)
    with dispatch.batch_invariant_mode():
        alone = torch.cat([optimized.unquantized_gemm(x64[t:t + 1], w, b) for t in range(64)])
        for T in range(1, 65):
            d = dispatch.explain("unquantized_gemm", x64[:T], w, b)
            assert d.kernel == ("skinny" if T <= 8 else "skinny_chunked"), d
            out = optimized.unquantized_gemm(x64[:T], w, b)
            assert torch.equal(out, alone[:T]), T
    assert_close(alone, x64, w, b, "chunked")
    assert not dispatch.batch_invariant()


# ------------------------------------------------------------------ unquantized_gemm / dispatch
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unquantized_matches_reference_any_t(dtype):
    for T in (0, 1, 5, 8, 9, 33, 130):
        x, w, b = make(T, 129, 300, dtype, seed=T, bias=T % 2 == 1, pad=2)
        out = optimized.unquantized_gemm(x, w, b)
        assert_close(out, x, w, b, f"unquantized T={T}")
        kernel = dispatch.explain("unquantized_gemm", x, w, b).kernel
        small_f32_gemv = T == 1 and dtype == f32          # 129x300 f32 = 151 KiB < 256 KiB
        assert kernel == ("skinny" if T <= dispatch.SKINNY_MAX_T and not small_f32_gemv else "library")
        if kernel == "skinny":
            assert torch.equal(out, optimized.skinny_gemm(x, w, b))
        else:
            assert torch.equal(out, F.linear(x, w, b))


def test_explain_unquantized_gemm():
    x, w, b = make(4, 513, 64, bf16, seed=0, bias=True)
    d = dispatch.explain("unquantized_gemm", x, w, b)
    assert d.op == "unquantized_gemm" and d.kernel == "skinny" and "T = 4" in d.reason
    assert str(d).startswith("unquantized_gemm: skinny (")
    big = make(9, 513, 64, bf16, seed=0)[0]
    d = dispatch.explain("unquantized_gemm", big, w)
    assert d.kernel == "library" and "T = 9" in d.reason and "NOT batch invariant" in d.reason
    with dispatch.batch_invariant_mode():
        d = dispatch.explain("unquantized_gemm", big, w)
        assert d.kernel == "skinny_chunked" and "batch-invariant" in d.reason
        assert dispatch.explain("unquantized_gemm", x, w).kernel == "skinny"
    # f32 GEMV (T = 1) on a small weight: MKL wins outside batch-invariant mode only
    xf, wf = make(1, 100, 64, f32, seed=0)[:2]
    d = dispatch.explain("unquantized_gemm", xf, wf)
    assert d.kernel == "library" and "float32" in d.reason and "NOT batch invariant" in d.reason
    assert dispatch.explain("unquantized_gemm", xf, make(1, 1024, 64, f32, seed=0)[1]).kernel == "skinny"
    with dispatch.batch_invariant_mode():
        assert dispatch.explain("unquantized_gemm", xf, wf).kernel == "skinny"
    meta = torch.empty(2, 64, dtype=bf16, device="meta")
    d = dispatch.explain("unquantized_gemm", meta, torch.empty(3, 64, dtype=bf16, device="meta"))
    assert d.kernel == "library" and "meta" in d.reason
    with pytest.raises(ValueError, match="explain: argument 'op'"):
        dispatch.explain("no_such_op", x, w)


def test_dispatcher_is_what_runs(monkeypatch):
    """unquantized_gemm takes the kernel explain() names: swap the decision, see the path."""
    x, w, _ = make(2, 9, 16, bf16, seed=4)
    calls = []
    real = torch.ops.moelab.skinny_gemm
    assert dispatch.explain("unquantized_gemm", x, w).kernel == dispatch.unquantized_gemm_kernel(x, w) == "skinny"
    monkeypatch.setattr(dispatch, "unquantized_gemm_kernel", lambda x, w: "library")
    lib = optimized.unquantized_gemm(x, w)
    assert torch.equal(lib, F.linear(x, w))
    assert dispatch.explain("unquantized_gemm", x, w).kernel == "library"     # explain follows the policy
    monkeypatch.setattr(dispatch, "unquantized_gemm_kernel", lambda x, w: calls.append(x) or "skinny")
    assert torch.equal(optimized.unquantized_gemm(x, w), real(x, w, None)) and len(calls) == 1


# ------------------------------------------------------------------ fused gate
@pytest.mark.parametrize("T", [0, 1, 3, 8, 12])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_gate_gemm(dtype, T):
    E, S, H = 64, 1, 200
    x, rw, _ = make(T, E, H, dtype, seed=T)
    sw = make(1, S, H, dtype, seed=T + 50)[1]
    r, s = optimized.fused_gate_gemm(x, rw, sw)
    assert r.shape == (T, E) and s.shape == (T, S) and r.is_contiguous() and s.is_contiguous()
    both = optimized.unquantized_gemm(x, torch.cat([rw, sw]))
    assert torch.equal(r, both[:, :E]) and torch.equal(s, both[:, E:])
    assert_close(r, x, rw, None, "router part")
    assert_close(s, x, sw, None, "shared part")
    if dispatch.explain("unquantized_gemm", x, torch.cat([rw, sw])).kernel == "skinny":
        # each output's reduction order depends on K only, so fusing is exact
        assert torch.equal(r, optimized.skinny_gemm(x, rw)) and torch.equal(s, optimized.skinny_gemm(x, sw))


def _spy_skinny(monkeypatch) -> list:
    """Records the weight shape of every skinny_gemm kernel call (either call path)."""
    mod = sys.modules["optimized.gate_gemm"]
    seen, real = [], mod._skinny
    monkeypatch.setattr(mod, "_skinny", lambda x, w, b: seen.append(tuple(w.shape)) or real(x, w, b))
    return seen


def test_fused_gate_gemm_one_dispatch(monkeypatch):
    x, rw, _ = make(2, 16, 32, bf16, seed=0)
    sw = make(1, 1, 32, bf16, seed=1)[1]
    seen = _spy_skinny(monkeypatch)
    optimized.fused_gate_gemm(x, rw, sw)
    assert seen == [(17, 32)]


def test_fused_gate_module_rebuilds(monkeypatch):
    E, H = 40, 96
    rw = torch.nn.Parameter(make(1, E, H, bf16, seed=1)[1], requires_grad=False)
    sw = torch.nn.Parameter(make(1, 1, H, bf16, seed=2)[1], requires_grad=False)
    gate = optimized.FusedGate(rw, sw)
    assert isinstance(gate, ref.FusedGate) and optimized.FusedGate.gemm is optimized.unquantized_gemm
    assert gate.rebuilds == 1
    seen = _spy_skinny(monkeypatch)
    x = make(3, 1, H, bf16, seed=3)[0]
    r, s = gate(x)
    assert seen == [(E + 1, H)] and gate.rebuilds == 1
    assert torch.equal(r, optimized.skinny_gemm(x, rw)) and torch.equal(s, optimized.skinny_gemm(x, sw))
    gate(x)
    assert gate.rebuilds == 1                               # nothing changed: cache reused
    with torch.no_grad():
        rw.mul_(2)                                          # in place: version bump
    r2, _ = gate(x)
    assert gate.rebuilds == 2 and torch.equal(r2, optimized.skinny_gemm(x, rw))
    new_sw = make(1, 1, H, bf16, seed=4)[1]
    gate.shared_gate_weight = new_sw                        # replacement
    _, s3 = gate(x)
    assert gate.rebuilds == 3 and torch.equal(s3, optimized.skinny_gemm(x, new_sw))
    big = make(20, 1, H, bf16, seed=5)[0]                   # T > 8: library path, same cache
    r4, s4 = gate(big)
    assert gate.rebuilds == 3
    assert_close(r4, big, rw, None) and assert_close(s4, big, new_sw, None)


# ------------------------------------------------------------------ errors
def _t(*shape, dtype=f32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


def _linear_errors(gemm):
    return [
        ("x not a tensor", lambda: gemm([[1.0]], _t(2, 1)), "x"),
        ("x 1-D", lambda: gemm(_t(4), _t(2, 4)), "x"),
        ("x float64", lambda: gemm(_t(1, 4, dtype=torch.float64), _t(2, 4, dtype=torch.float64)), "x"),
        ("x K = 0", lambda: gemm(_t(1, 0), _t(2, 0)), "x"),
        ("weight dtype differs", lambda: gemm(_t(1, 4), _t(2, 4, dtype=bf16)), "weight"),
        ("weight wrong K", lambda: gemm(_t(1, 4), _t(2, 3)), "weight"),
        ("weight N = 0", lambda: gemm(_t(1, 4), _t(0, 4)), "weight"),
        ("weight other device", lambda: gemm(_t(1, 4), _t(2, 4, device="meta")), "weight"),
        ("bias wrong length", lambda: gemm(_t(1, 4), _t(2, 4), _t(3)), "bias"),
        ("bias dtype differs", lambda: gemm(_t(1, 4), _t(2, 4), _t(2, dtype=bf16)), "bias"),
    ]


ERRORS = (
    [("skinny_gemm", "T = 9", lambda: optimized.skinny_gemm(_t(9, 4), _t(2, 4)), "x")]
    + [("skinny_gemm", d, f, a) for d, f, a in _linear_errors(optimized.skinny_gemm)]
    + [("unquantized_gemm", d, f, a) for d, f, a in _linear_errors(optimized.unquantized_gemm)]
    + [("fused_gate_gemm", "router_weight wrong H",
        lambda: optimized.fused_gate_gemm(_t(1, 4), _t(2, 3), _t(1, 4)), "router_weight"),
       ("fused_gate_gemm", "shared_gate_weight dtype",
        lambda: optimized.fused_gate_gemm(_t(1, 4), _t(2, 4), _t(1, 4, dtype=bf16)), "shared_gate_weight"),
       ("fused_gate_gemm", "shared_gate_weight no rows",
        lambda: optimized.fused_gate_gemm(_t(1, 4), _t(2, 4), _t(0, 4)), "shared_gate_weight"),
       ("fused_gate_gemm", "x H = 0", lambda: optimized.fused_gate_gemm(_t(1, 0), _t(2, 0), _t(1, 0)), "x"),
       ("fused_gate_gemm", "gemm not callable",
        lambda: optimized.fused_gate_gemm(_t(1, 4), _t(2, 4), _t(1, 4), gemm=3), "gemm"),
       ("FusedGate", "shared_gate_weight wrong H", lambda: optimized.FusedGate(_t(2, 4), _t(1, 5)),
        "shared_gate_weight"),
       ("fused_gate_gemm", "FusedGate forward: x of another H",
        lambda: optimized.FusedGate(_t(2, 4), _t(1, 4))(_t(1, 5)), "router_weight")]
)


@pytest.mark.parametrize("op,desc,fn,arg", ERRORS, ids=[f"{e[0]}: {e[1]}" for e in ERRORS])
def test_error_inputs(op, desc, fn, arg):
    with pytest.raises(ValueError) as ei:
        fn()
    msg = str(ei.value)
    assert msg.startswith(op + ":") and f"'{arg}'" in msg, msg


HOSTILE = [
    ("T = 9", lambda: (_t(9, 4), _t(2, 4), None), "'x'"),
    ("x 1-D", lambda: (_t(4), _t(2, 4), None), "'x'"),
    ("x float64", lambda: (_t(1, 4, dtype=torch.float64), _t(2, 4, dtype=torch.float64), None), "'x'"),
    ("x int", lambda: (_t(1, 4, dtype=torch.int32), _t(2, 4, dtype=torch.int32), None), "'x'"),
    ("x K = 0", lambda: (_t(1, 0), _t(2, 0), None), "'x'"),
    ("x K-strided", lambda: (_t(2, 8)[:, ::2], _t(2, 4), None), "'x'"),
    ("weight dtype differs", lambda: (_t(1, 4), _t(2, 4, dtype=bf16), None), "'weight'"),
    ("weight wrong K (reads past a row)", lambda: (_t(1, 64), _t(2, 4), None), "'weight'"),
    ("weight N = 0", lambda: (_t(1, 4), _t(0, 4), None), "'weight'"),
    ("weight K-strided", lambda: (_t(1, 4), _t(2, 8)[:, ::2], None), "'weight'"),
    ("weight 3-D", lambda: (_t(1, 4), _t(1, 2, 4), None), "'weight'"),
    ("bias too short (writes/reads past it)", lambda: (_t(1, 4), _t(40, 4), _t(3)), "'bias'"),
    ("bias dtype differs", lambda: (_t(1, 4), _t(2, 4), _t(2, dtype=bf16)), "'bias'"),
    ("bias strided", lambda: (_t(1, 4), _t(2, 4), _t(4)[::2]), "'bias'"),
    ("bias 2-D", lambda: (_t(1, 4), _t(2, 4), _t(1, 2)), "'bias'"),
]


@pytest.mark.parametrize("desc,args,arg", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_direct_op_hostile_arguments(desc, args, arg):
    with pytest.raises(RuntimeError) as ei:
        torch.ops.moelab.skinny_gemm(*args())
    assert "moelab::skinny_gemm" in str(ei.value) and arg in str(ei.value), str(ei.value)


# ------------------------------------------------------------------ torch integration
def test_opcheck():
    samples = [make(3, 5, 40, bf16, seed=0, bias=True), make(8, 513, 17, f16, seed=1, pad=3),
               make(1, 1, 1, f32, seed=2, bias=True), make(0, 3, 7, bf16, seed=3)]
    for x, w, b in samples:
        torch.library.opcheck(torch.ops.moelab.skinny_gemm.default, (x, w, b))


@pytest.mark.parametrize("use_bias", [False, True])
def test_autograd_matches_linear(use_bias):
    x, w, b = make(5, 7, 33, f32, seed=11, bias=use_bias, pad=2)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w) + ((b,) if use_bias else ())]
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    g = torch.randn(5, 7)
    optimized.skinny_gemm(*leaves).backward(g)
    F.linear(*twins).backward(g)
    for a, t in zip(leaves, twins):
        torch.testing.assert_close(a.grad, t.grad)
    torch.library.opcheck(torch.ops.moelab.skinny_gemm.default, tuple(leaves) + ((None,) if not use_bias else ()))


def test_torch_compile_fullgraph():
    def f(x, w, b):
        return optimized.skinny_gemm(x, w, b) * 2

    compiled = torch.compile(f, fullgraph=True)
    for T in (1, 4):
        x, w, b = make(T, 33, 48, bf16, seed=T, bias=True)
        assert torch.equal(compiled(x, w, b), f(x, w, b))

    def g(x, w):   # the dispatcher too (its decision is traced as Python)
        return optimized.unquantized_gemm(x, w) + 1

    x, w, _ = make(3, 17, 40, f32, seed=0)
    assert torch.equal(torch.compile(g, fullgraph=True)(x, w), g(x, w))


def test_backend_info_reports_level():
    info = optimized.backend_info()
    assert info["skinny_gemm"] == info["active"]
