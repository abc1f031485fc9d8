"""optimized.route (the moelab CPU kernel) against reference.route, at every ISA level.

What must hold (SPEC section 1, tolerance model):
- ids: exactly the reference's wherever the keys are computed identically (topk_softmax,
  llama4: the keys are the logits) and for every exact tie (equal logits, NaN, +-inf,
  -0.0 vs +0.0, underflow to 0). Where the key is softmax/sigmoid, the kernel's exp may
  differ from the reference's exactly rounded one by about an ulp; a differing id is then
  accepted only as a near-tie flip: the two keys (reference's own values) are within
  NEAR_TIE_ULPS of each other, and such rows are rare.
- weights: within a few f32 ulps of the reference (WEIGHT_ULPS; NaN where it has NaN).
- bit-identical results on every ISA level, for 1 and 2 threads, for repeated calls and
  whatever else shares the batch.
- every reference error input raises the same ValueError; hostile direct calls of
  torch.ops.moelab.route raise RuntimeError naming the argument; opcheck and
  torch.compile(fullgraph=True) work.
"""
from __future__ import annotations

import math

import pytest
import torch

import optimized
from reference.route import route as reference_route, selection_keys
from optimized import dispatch
from tests import levels
from reference.validate import NORM_EPS_DEFAULT, RENORMALIZE_DEFAULT, ROUTE_METHODS, check_route
from tests.test_route_reference import ERROR_CASES

METHODS = ROUTE_METHODS   # softmax_topk ... llama4, grouped_softmax, softmax_bias (SPEC 1 and 6)
BIASED = ("sigmoid_bias", "grouped_sigmoid_bias", "softmax_bias")
GROUPED = ("grouped_sigmoid_bias", "grouped_softmax")
EXACT_KEY_METHODS = ("topk_softmax", "llama4")          # keys are the logits themselves
ISA_LEVELS = levels.LEVELS
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NEAR_TIE_ULPS = 4
WEIGHT_ULPS = {"softmax_topk": 2, "topk_softmax": 2, "sigmoid_topk": 2, "llama4": 2,
               "sigmoid_bias": 6, "grouped_sigmoid_bias": 6, "grouped_softmax": 2, "softmax_bias": 2}
RENORM_WEIGHT_ULPS = 6
SCALING_ULPS = 1          # one more rounding: the final multiplication by scaling
op = torch.ops.moelab.route.default


@pytest.fixture(params=ISA_LEVELS)
def isa(request):
    with levels.capped(request.param):
        yield request.param


# ----------------------------------------------------------------------------- helpers
def ordered_bits(w: torch.Tensor) -> torch.Tensor:
    """f32 -> int64 whose differences count ulps (monotone across zero)."""
    i = w.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def ulp_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (ordered_bits(a) - ordered_bits(b)).abs()


def make_kwargs(method, E, g, bias_dtype=torch.float32, n_group=None, topk_group=None, scaling=None,
                renormalize=None, norm_eps=None):
    """renormalize None: left unset (the method's default); norm_eps likewise."""
    kw = {}
    if method in BIASED:
        # softmax_bias: p is ~1/E, so a bias of that size decides between experts
        kw["bias"] = (torch.randn(E, generator=g) * (0.3 if method != "softmax_bias" else 0.3 / E)).to(bias_dtype)
        kw["scaling"] = 2.5 if scaling is None else scaling
    elif scaling is not None:
        kw["scaling"] = scaling
    if method in GROUPED:
        kw["n_group"], kw["topk_group"] = n_group, topk_group
    if renormalize is not None:
        kw["renormalize"] = renormalize
    if norm_eps is not None:
        kw["norm_eps"] = norm_eps
    return kw


def fit_k(method, E, K, kw):
    if method == "llama4":
        return 1
    K = min(K, E)
    if method in GROUPED:
        K = min(K, kw["topk_group"] * (E // kw["n_group"]))
    return K


def group_kwargs(E):
    """A grouping of E (DeepSeek-V3-like where it divides), or None when E cannot be grouped."""
    if E > 1024 or E < 2:
        return None
    for ng in (8, 4, 2, 1):
        if E % ng == 0 and E // ng >= 2:
            return dict(n_group=ng, topk_group=max(1, ng // 2))
    return None


_REF_CACHE: dict = {}


def check_against_reference(x, K, method, kw, *, allow_flips, cache_key=None):
    """ids equal (or documented near-tie flips); weights within WEIGHT_ULPS. Returns flips.
    cache_key: the inputs are a deterministic function of it; the reference's answer is then
    computed once for all ISA levels."""
    if cache_key is None or cache_key not in _REF_CACHE:
        out = reference_route(x, K, method, **kw)
        if cache_key is not None:
            _REF_CACHE[cache_key] = out
    w0, i0 = out if cache_key is None else _REF_CACHE[cache_key]
    w1, i1 = optimized.route(x, K, method, **kw)
    assert w1.dtype == torch.float32 and i1.dtype == torch.int32
    assert w1.shape == i1.shape == (x.shape[0], K)
    assert w1.is_contiguous() and i1.is_contiguous()
    same = (i0 == i1).all(dim=1)
    flips = int((~same).sum())
    if flips:
        assert allow_flips, f"{method}: {flips} rows with different ids, e.g. {i0[~same][0]} vs {i1[~same][0]}"
        assert_near_tie_flips(x, K, method, kw, i0, i1)
        assert flips <= max(1, x.shape[0] // 100), f"{method}: {flips} near-tie flips in {x.shape[0]} rows"
    renorm, _ = check_route(x, K, method, kw.get("bias"), kw.get("n_group", 1), kw.get("topk_group", 1),
                            kw.get("scaling", 1.0), kw.get("renormalize"), kw.get("norm_eps"))
    tol = RENORM_WEIGHT_ULPS if renorm else WEIGHT_ULPS[method]
    if method not in ("sigmoid_bias", "grouped_sigmoid_bias") and kw.get("scaling", 1.0) != 1.0:
        tol += SCALING_ULPS
    nan0, nan1 = torch.isnan(w0[same]), torch.isnan(w1[same])
    assert torch.equal(nan0, nan1)
    d = ulp_dist(w0[same][~nan0], w1[same][~nan0])
    assert d.numel() == 0 or int(d.max()) <= tol, f"{method}: weights {int(d.max())} ulps apart"
    return flips


def assert_near_tie_flips(x, K, method, kw, i0, i1):
    """Every row where i1 differs from the reference's i0 must be a near-tie flip: valid
    distinct ids, and at each differing slot the two experts' reference keys within
    NEAR_TIE_ULPS (grouped: or the group scores at the kept/dropped boundary that close)."""
    keys = selection_keys(x, method, kw.get("bias"), kw.get("n_group", 1), kw.get("topk_group", 1))
    for t in torch.nonzero((i0 != i1).any(dim=1)).flatten().tolist():
        a, b = i0[t].long(), i1[t].long()
        assert len(set(b.tolist())) == K and int(b.min()) >= 0 and int(b.max()) < x.shape[1]
        gap = int(ulp_dist(keys[t, a], keys[t, b])[a != b].max())
        if method in GROUPED and gap > NEAR_TIE_ULPS:
            gap = group_score_gap(x[t:t + 1], method, kw)
        assert gap <= NEAR_TIE_ULPS, f"{method}: row {t} differs with a key gap of {gap} ulps"


def test_near_tie_classification_can_fail():
    """The flip check accepts a swap of two keys one ulp apart and rejects any other swap."""
    x = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    x[0, 2] = torch.nextafter(x[0, 1], torch.tensor(0.0))          # one ulp below expert 1
    i0 = torch.tensor([[1, 2]], dtype=torch.int32)
    assert_near_tie_flips(x, 2, "topk_softmax", {}, i0, torch.tensor([[2, 1]], dtype=torch.int32))
    for bad in ([[1, 0]], [[0, 1]], [[1, 1]], [[1, 7]]):
        with pytest.raises((AssertionError, IndexError)):
            assert_near_tie_flips(x, 2, "topk_softmax", {}, i0, torch.tensor(bad, dtype=torch.int32))


def group_score_gap(x_row, method, kw):
    """Smallest ulp gap between the topk_group-th and the next group score of one row
    (grouped_sigmoid_bias: sum of a group's two largest keys; grouped_softmax: the largest)."""
    if method == "grouped_sigmoid_bias":
        keys = selection_keys(x_row, "sigmoid_bias", kw["bias"])[0]
    else:
        keys = selection_keys(x_row, "softmax_topk")[0]
    ng, tg = kw["n_group"], kw["topk_group"]
    top = keys.view(ng, -1).topk(2, dim=-1).values
    score = top.sum(-1) if method == "grouped_sigmoid_bias" else top[:, 0]
    s = score.sort(descending=True).values
    if tg >= ng:
        return 0
    return int(ulp_dist(s[tg - 1:tg], s[tg:tg + 1])[0])


# --------------------------------------------------------------- random differential
SHAPES = [  # (T, E, K): T on tile boundaries, E around the 16- and 8-lane chunks
    (1, 1, 1), (3, 2, 2), (7, 7, 2), (17, 16, 8), (16, 16, 16), (33, 64, 8), (9, 64, 32),
    (65, 256, 8), (20, 256, 16), (31, 896, 16), (12, 896, 32), (8, 2048, 32), (5, 2048, 1),
    (4, 17, 16), (6, 33, 32), (2, 129, 2),
]


@pytest.mark.parametrize("method", METHODS)
def test_random_logits_match_reference(isa, method):
    g = torch.Generator().manual_seed(1000 + METHODS.index(method))
    flips = 0
    for n, (T, E, K) in enumerate(SHAPES):
        gk = group_kwargs(E)
        if method in GROUPED and gk is None:
            continue
        kw = make_kwargs(method, E, g, bias_dtype=(torch.bfloat16 if n % 2 else torch.float32),
                         **(gk or {}) if method in GROUPED else {},
                         renormalize=(True if n % 3 == 0 and method != "llama4" else None))
        Kf = fit_k(method, E, K, kw)
        for dt in DTYPES:
            x = (torch.randn(T, E, generator=g) * (1.0 + 3.0 * (n % 3))).to(dt)
            flips += check_against_reference(x, Kf, method, kw, allow_flips=method not in EXACT_KEY_METHODS,
                                             cache_key=("random", method, n, str(dt)))
    assert flips <= 2


@pytest.mark.parametrize("method", ["softmax_topk", "sigmoid_topk", "sigmoid_bias"])
def test_near_tie_flips_are_rare_on_many_rows(method):
    """2048 rows of DeepSeek/Qwen-sized routing at the top level: flips (if any) are near ties."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 256, generator=g)
    kw = make_kwargs(method, 256, g)
    assert check_against_reference(x, 8, method, kw, allow_flips=True) <= 20


# ------------------------------------------------------- SPEC 6: renormalize, scaling, norm_eps
def spec6_variants(method):
    """Every renormalize (unset / False / True, where allowed) x scaling (1, 2.5, 0.375) x
    norm_eps (unset; where the method has one: 1e-6, LFM2's, and 0.75, large enough to
    decide the weights: the max(sum, eps) floor binds and (sum + eps) moves)."""
    renorms = (None, False) if method == "llama4" else (None, False, True)
    epss = (None, 1e-6, 0.75) if method in NORM_EPS_DEFAULT else (None,)
    return [(r, c, e) for r in renorms for c in (1.0, 2.5, 0.375) for e in epss]


SPEC6_SHAPES = [(5, 16, 4), (9, 64, 8), (3, 256, 8), (2, 896, 16)]   # (T, E, K)


@pytest.mark.parametrize("method", METHODS)
def test_spec6_arguments_match_reference(isa, method):
    g = torch.Generator().manual_seed(600 + METHODS.index(method))
    flips = 0
    for n, (T, E, K) in enumerate(SPEC6_SHAPES):
        gk = group_kwargs(E) if method in GROUPED else {}
        base = make_kwargs(method, E, g, bias_dtype=(torch.bfloat16 if n % 2 else torch.float32), **gk)
        Kf = fit_k(method, E, K, base)
        x = (torch.randn(T, E, generator=g) * 2).to(DTYPES[n % 3])
        for r, c, e in spec6_variants(method):
            kw = {k: v for k, v in base.items() if k not in ("scaling", "renormalize", "norm_eps")}
            kw["scaling"] = c
            if r is not None:
                kw["renormalize"] = r
            if e is not None:
                kw["norm_eps"] = e
            flips += check_against_reference(x, Kf, method, kw, allow_flips=method not in EXACT_KEY_METHODS,
                                             cache_key=("spec6", method, n, r, c, e))
    assert flips <= 2


@pytest.mark.parametrize("method", ["sigmoid_topk", "sigmoid_bias", "softmax_bias"])
def test_norm_eps_decides_the_weights(method):
    """A large norm_eps changes the weights in its family's form, as the reference computes."""
    g = torch.Generator().manual_seed(61)
    E = 64
    x = torch.randn(4, E, generator=g) - (6.0 if method == "sigmoid_topk" else 0.0)   # small s: a small sum
    kw = make_kwargs(method, E, g, scaling=1.0, renormalize=True)
    w_default, _ = optimized.route(x, 4, method, **kw)
    w_eps, ids = optimized.route(x, 4, method, norm_eps=0.75, **kw)
    w_ref, ids_ref = reference_route(x, 4, method, norm_eps=0.75, **kw)
    assert torch.equal(ids, ids_ref) and not torch.equal(w_eps, w_default)
    assert int(ulp_dist(w_eps, w_ref).max()) <= RENORM_WEIGHT_ULPS


def test_direct_op_defaults_keep_their_meaning():
    """torch.ops.moelab.route with renormalize / norm_eps unset takes the method's defaults, as
    reference.validate.check_route resolves them: a direct call written before SPEC 6 (which
    never passed renormalize to a biased method) keeps its bits; an explicit False means it."""
    g = torch.Generator().manual_seed(62)
    x = torch.randn(6, 64, generator=g)
    bias = torch.randn(64, generator=g) * 0.3
    for method, b in (("sigmoid_bias", bias), ("softmax_bias", bias / 64), ("softmax_topk", None),
                      ("sigmoid_topk", None)):
        for args, kw in ((( ), {}), ((2.5,), dict(scaling=2.5)), ((2.5, False), dict(scaling=2.5, renormalize=False)),
                         ((1.0, True), dict(renormalize=True))):
            w, i = op(x, 8, method, b, *args)
            w_opt, i_opt = optimized.route(x, 8, method, bias=b, **kw)
            assert torch.equal(i, i_opt) and torch.equal(w.view(torch.int32), w_opt.view(torch.int32)), (method, kw)
            w_ref, i_ref = reference_route(x, 8, method, bias=b, **kw)
            assert torch.equal(i, i_ref) and int(ulp_dist(w, w_ref).max()) <= RENORM_WEIGHT_ULPS + SCALING_ULPS
    # renormalize=False on sigmoid_bias: w = s * scaling, no sum
    w, i = op(x, 8, "sigmoid_bias", bias, 2.5, False)
    s = torch.sigmoid(x.double()).float().gather(1, i.long())
    assert torch.allclose(w, s * 2.5, rtol=1e-6, atol=0)
    # grouped_softmax with n_group = 1 is softmax_topk (scaling and renormalize alike)
    for kw in ({}, dict(scaling=0.5, renormalize=True)):
        a = optimized.route(x, 8, "grouped_softmax", n_group=1, topk_group=1, **kw)
        b = optimized.route(x, 8, "softmax_topk", **kw)
        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_grouped_softmax_scores_groups_by_their_largest_p():
    """Group 0 holds the largest p, group 1 the largest top-2 sum: DeepSeek-V2 keeps group 0
    (a top-2 scorer would keep group 1), at every ISA level."""
    x = torch.tensor([[4.0, 0.0, 0.0, 0.0, 3.5, 3.5, 0.0, 0.0]])
    for level in levels.below_ceiling():
        with levels.capped(level):
            w, ids = optimized.route(x, 2, "grouped_softmax", n_group=2, topk_group=1)
        assert ids.tolist() == [[0, 1]]
        assert torch.equal(w, reference_route(x, 2, "grouped_softmax", n_group=2, topk_group=1)[0])


# ------------------------------------------------------------------ engineered rows
def special_rows(E, g):
    """Rows whose keys tie exactly or are far apart, so ids must match with no flips:
    a coarse grid (many exact ties), NaN, +-inf, -0.0 next to +0.0, and logits far enough
    below the max that softmax/sigmoid underflow to exactly 0 (a tie at 0)."""
    rows = [torch.round(torch.randn(E, generator=g) * 2) / 4,                    # grid of 0.25
            torch.zeros(E),                                                       # all tied
            torch.full((E,), -0.0)]
    r = torch.round(torch.randn(E, generator=g) * 2) / 4
    r[torch.arange(E) % 3 == 1] = float("nan")
    rows.append(r)
    r = torch.round(torch.randn(E, generator=g) * 2) / 4
    r[torch.arange(E) % 4 == 2] = float("inf")
    r[torch.arange(E) % 5 == 3] = float("-inf")
    rows.append(r)
    r = torch.zeros(E)
    r[torch.arange(E) % 2 == 0] = -0.0
    rows.append(r)
    r = -200.0 - torch.round(torch.rand(E, generator=g) * 8)                     # underflow ties
    r[E // 2] = 0.0
    rows.append(r)
    rows.append(torch.full((E,), float("-inf")))
    rows.append(torch.full((E,), float("nan")))
    r = torch.round(torch.randn(E, generator=g) * 2) / 4
    r[-1] = float("nan")
    rows.append(r)
    return torch.stack(rows)


# grouped routing needs E % n_group == 0, E / n_group >= 2 and E <= 1024: E = 1 and 2048 are
# outside its contract (their errors are tested with the error inputs).
TIE_CASES = [(m, E) for m in METHODS for E in (1, 2, 7, 16, 64, 256, 896, 2048)
             if m not in GROUPED or group_kwargs(E) is not None]


@pytest.mark.parametrize("method,E", TIE_CASES)
def test_exact_ties_and_special_values(isa, method, E):
    g = torch.Generator().manual_seed(E)
    gk = group_kwargs(E)
    for dt in DTYPES:
        x = special_rows(E, g).to(dt)
        for K in sorted({1, 2, 8, 16, 32}):
            if K > E:
                continue
            kw = make_kwargs(method, E, g, **(gk or {}) if method in GROUPED else {})
            if method in BIASED:   # a bias on the same coarse grid: exact ties survive s + bias
                kw["bias"] = torch.round(torch.randn(E, generator=g) * 2) / 8
            Kf = fit_k(method, E, K, kw)
            check_against_reference(x, Kf, method, kw, allow_flips=False,
                                    cache_key=("ties", method, E, str(dt), K))


@pytest.mark.parametrize("method", METHODS)
def test_equal_logits_anywhere_tie_by_index(isa, method):
    """The same value at every position of a long row (any chunk, any tail lane): ids 0..K-1."""
    for E in (17, 100, 2048):
        kw = make_kwargs(method, E, torch.Generator().manual_seed(1),
                         **group_kwargs(min(E, 1024)) if method in GROUPED else {})
        if method in GROUPED and E > 1024:
            continue
        if method in BIASED:
            kw["bias"] = torch.zeros(E)
        K = fit_k(method, E, 16, kw)
        for v in (0.3, -7.0, 0.0):
            _, ids = optimized.route(torch.full((3, E), v), K, method, **kw)
            assert ids.tolist() == [list(range(K))] * 3


def test_large_top_value_late_in_row():
    """Order keys of the whole row count: the best expert last, the rest increasing."""
    x = torch.arange(2048, dtype=torch.float32).unsqueeze(0) / 64
    _, ids = optimized.route(x, 32, "topk_softmax")
    assert ids.tolist() == [list(range(2047, 2015, -1))]
    _, ids = optimized.route(-x, 32, "topk_softmax")
    assert ids.tolist() == [list(range(32))]


# ------------------------------------------------------------------ determinism
def random_case(method, T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    kw = make_kwargs(method, E, g, **group_kwargs(E) if method in GROUPED else {})
    return torch.randn(T, E, generator=g).bfloat16(), fit_k(method, E, K, kw), kw


@pytest.mark.parametrize("method", METHODS)
def test_isa_levels_bit_identical(method):
    x, K, kw = random_case(method, 97, 896 if method not in GROUPED else 256, 16, 3)
    x = torch.cat([x, special_rows(x.shape[1], torch.Generator().manual_seed(2)).bfloat16()])
    outs = []
    for level in levels.below_ceiling():
        with levels.capped(level):
            outs.append(optimized.route(x, K, method, **kw))
    for w, i in outs[1:]:
        assert torch.equal(i, outs[0][1])
        assert torch.equal(w.view(torch.int32), outs[0][0].view(torch.int32))


@pytest.mark.parametrize("method", METHODS)
def test_threads_repeats_and_batch_invariance(method):
    E = 256
    grain = max(1, dispatch.ROUTE_GRAIN_ELEMS // E)
    x, K, kw = random_case(method, 4 * grain + 3, E, 8, 5)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        w1, i1 = optimized.route(x, K, method, **kw)
        torch.set_num_threads(2)
        w2, i2 = optimized.route(x, K, method, **kw)
        w3, i3 = optimized.route(x, K, method, **kw)
    finally:
        torch.set_num_threads(prev)
    for w, i in ((w2, i2), (w3, i3)):
        assert torch.equal(i, i1) and torch.equal(w.view(torch.int32), w1.view(torch.int32))
    for t in (0, 5, x.shape[0] - 1):   # a token alone gives the bits it gets in the batch
        w, i = optimized.route(x[t:t + 1], K, method, **kw)
        assert torch.equal(i[0], i1[t]) and torch.equal(w[0].view(torch.int32), w1[t].view(torch.int32))


def test_strided_logits_and_bias_read_in_place():
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(40, 300, generator=g).bfloat16()
    x = wide[:, 10:266]                       # row stride 300, unit column stride
    bias_wide = torch.randn(512, generator=g)
    bias = bias_wide[::2]                     # non-contiguous bias
    a = optimized.route(x, 8, "sigmoid_bias", bias=bias, scaling=2.5)
    b = optimized.route(x.contiguous(), 8, "sigmoid_bias", bias=bias.contiguous(), scaling=2.5)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    xt = torch.randn(256, 40, generator=g).t()  # stride along E != 1: copied first
    a = optimized.route(xt, 8, "softmax_topk")
    b = optimized.route(xt.contiguous(), 8, "softmax_topk")
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    a = op(xt, 8, "sigmoid_bias", bias, 2.5)      # the op itself takes any layout
    b = op(xt.contiguous(), 8, "sigmoid_bias", bias.contiguous(), 2.5)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


@pytest.mark.parametrize("method", METHODS)
def test_empty_batch(method):
    E = 16
    kw = make_kwargs(method, E, torch.Generator().manual_seed(0),
                     **group_kwargs(E) if method in GROUPED else {})
    K = fit_k(method, E, 4, kw)
    for dt in DTYPES:
        w, i = optimized.route(torch.empty(0, E, dtype=dt), K, method, **kw)
        assert w.shape == i.shape == (0, K) and w.dtype == torch.float32 and i.dtype == torch.int32


# ----------------------------------------------------------------------- errors
# The reference's float64 exact mode is the reference's alone: optimized refuses float64 logits
# (naming 'logits' where the reference's error names the bias that does not match them).
OPT_ERROR_CASES = [c for c in ERROR_CASES if not (isinstance(c[1][0], torch.Tensor) and c[1][0].dtype == torch.float64)]
OPT_ERROR_CASES += [
    ("logits float64 (exact mode is the reference's)", (torch.zeros(2, 8, dtype=torch.float64), 2, "softmax_topk"),
     {}, "logits"),
    ("logits float64 with a float64 bias", (torch.zeros(2, 8, dtype=torch.float64), 2, "sigmoid_bias"),
     dict(bias=torch.zeros(8, dtype=torch.float64)), "logits"),
]


def test_float64_logits_are_the_references_only():
    x = torch.randn(3, 8, dtype=torch.float64)
    assert reference_route(x, 2, "softmax_topk")[0].dtype == torch.float64
    with pytest.raises(ValueError, match="route: argument 'logits'"):
        optimized.route(x, 2, "softmax_topk")


@pytest.mark.parametrize("desc,args,kwargs,arg", OPT_ERROR_CASES, ids=[c[0] for c in OPT_ERROR_CASES])
def test_reference_error_inputs_raise_the_same(desc, args, kwargs, arg):
    with pytest.raises(ValueError) as ei:
        optimized.route(*args, **kwargs)
    msg = str(ei.value)
    assert msg.startswith("route") and f"'{arg}'" in msg, msg


def Z(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


HOSTILE = [
    # (description, op args, argument named in the RuntimeError)
    ("logits float64", (Z(2, 8, dtype=torch.float64), 2, "softmax_topk"), "logits"),
    ("logits int32", (Z(2, 8, dtype=torch.int32), 2, "softmax_topk"), "logits"),
    ("logits 1-D", (Z(8), 2, "softmax_topk"), "logits"),
    ("logits 3-D", (Z(1, 2, 8), 2, "softmax_topk"), "logits"),
    ("E = 0", (Z(2, 0), 1, "softmax_topk"), "logits"),
    ("E > 2048", (Z(1, 2049), 2, "softmax_topk"), "logits"),
    ("K = 0", (Z(2, 8), 0, "softmax_topk"), "top_k"),
    ("K < 0", (Z(2, 8), -3, "softmax_topk"), "top_k"),
    ("K > E", (Z(2, 8), 9, "softmax_topk"), "top_k"),
    ("K > 32", (Z(2, 64), 33, "topk_softmax"), "top_k"),
    ("K huge", (Z(2, 64), 1 << 40, "topk_softmax"), "top_k"),
    ("llama4 K = 2", (Z(2, 8), 2, "llama4"), "top_k"),
    ("unknown method", (Z(2, 8), 2, "softmax"), "method"),
    ("bias missing", (Z(2, 8), 2, "sigmoid_bias"), "bias"),
    ("bias with softmax_topk", (Z(2, 8), 2, "softmax_topk", Z(8)), "bias"),
    ("bias too short", (Z(2, 8), 2, "sigmoid_bias", Z(7)), "bias"),
    ("bias 2-D", (Z(2, 8), 2, "sigmoid_bias", Z(1, 8)), "bias"),
    ("bias float16", (Z(2, 8), 2, "sigmoid_bias", Z(8, dtype=torch.float16)), "bias"),
    ("bias int64", (Z(2, 8), 2, "sigmoid_bias", Z(8, dtype=torch.int64)), "bias"),
    ("scaling inf", (Z(2, 8), 2, "sigmoid_bias", Z(8), float("inf")), "scaling"),
    ("scaling NaN", (Z(2, 8), 2, "sigmoid_bias", Z(8), float("nan")), "scaling"),
    ("scaling inf with softmax", (Z(2, 8), 2, "softmax_topk", None, float("inf")), "scaling"),
    ("renormalize with llama4", (Z(2, 8), 1, "llama4", None, 1.0, True), "renormalize"),
    ("norm_eps negative", (Z(2, 8), 2, "sigmoid_bias", Z(8), 1.0, None, 1, 1, -1e-6), "norm_eps"),
    ("norm_eps NaN", (Z(2, 8), 2, "softmax_bias", Z(8), 1.0, None, 1, 1, float("nan")), "norm_eps"),
    ("norm_eps inf", (Z(2, 8), 2, "sigmoid_topk", None, 1.0, True, 1, 1, float("inf")), "norm_eps"),
    ("norm_eps with softmax_topk", (Z(2, 8), 2, "softmax_topk", None, 1.0, True, 1, 1, 1e-6), "norm_eps"),
    ("norm_eps with topk_softmax", (Z(2, 8), 2, "topk_softmax", None, 1.0, None, 1, 1, 1e-6), "norm_eps"),
    ("norm_eps with llama4", (Z(2, 8), 1, "llama4", None, 1.0, None, 1, 1, 0.0), "norm_eps"),
    ("norm_eps with grouped_softmax", (Z(2, 8), 2, "grouped_softmax", None, 1.0, None, 2, 1, 1e-6), "norm_eps"),
    ("softmax_bias without bias", (Z(2, 8), 2, "softmax_bias"), "bias"),
    ("softmax_bias bias too short", (Z(2, 8), 2, "softmax_bias", Z(7)), "bias"),
    ("grouped_softmax with bias", (Z(2, 8), 2, "grouped_softmax", Z(8), 1.0, None, 2, 1), "bias"),
    ("grouped_softmax E % n_group", (Z(2, 8), 2, "grouped_softmax", None, 1.0, None, 3, 1), "n_group"),
    ("grouped_softmax topk_group > n_group", (Z(2, 8), 2, "grouped_softmax", None, 1.0, None, 2, 3), "topk_group"),
    ("grouped_softmax K too large", (Z(2, 8), 3, "grouped_softmax", None, 1.0, None, 4, 1), "top_k"),
    ("grouped_softmax E > 1024", (Z(1, 1026), 2, "grouped_softmax", None, 1.0, None, 2, 1), "logits"),
    ("n_group with softmax_bias", (Z(2, 8), 2, "softmax_bias", Z(8), 1.0, None, 2, 1), "n_group"),
    ("n_group with sigmoid_bias", (Z(2, 8), 2, "sigmoid_bias", Z(8), 1.0, False, 2, 1), "n_group"),
    ("topk_group with softmax", (Z(2, 8), 2, "softmax_topk", None, 1.0, False, 1, 2), "topk_group"),
    ("grouped E % n_group", (Z(2, 8), 2, "grouped_sigmoid_bias", Z(8), 1.0, False, 3, 1), "n_group"),
    ("grouped n_group = 0", (Z(2, 8), 2, "grouped_sigmoid_bias", Z(8), 1.0, False, 0, 1), "n_group"),
    ("grouped n_group > 32", (Z(2, 66), 2, "grouped_sigmoid_bias", Z(66), 1.0, False, 33, 1), "n_group"),
    ("grouped groups of 1", (Z(2, 8), 2, "grouped_sigmoid_bias", Z(8), 1.0, False, 8, 1), "n_group"),
    ("grouped topk_group > n_group", (Z(2, 8), 2, "grouped_sigmoid_bias", Z(8), 1.0, False, 2, 3), "topk_group"),
    ("grouped topk_group = 0", (Z(2, 8), 2, "grouped_sigmoid_bias", Z(8), 1.0, False, 2, 0), "topk_group"),
    ("grouped K too large", (Z(2, 8), 3, "grouped_sigmoid_bias", Z(8), 1.0, False, 4, 1), "top_k"),
    ("grouped E > 1024", (Z(1, 1026), 2, "grouped_sigmoid_bias", Z(1026), 1.0, False, 2, 1), "logits"),
]


@pytest.mark.parametrize("desc,args,arg", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_direct_calls_raise(desc, args, arg):
    with pytest.raises(RuntimeError) as ei:
        op(*args)
    msg = str(ei.value)
    assert "moelab::route" in msg and f"'{arg}'" in msg, msg


# --------------------------------------------------------------- torch integration
def test_opcheck():
    g = torch.Generator().manual_seed(11)
    samples = [
        (torch.randn(5, 64, generator=g), 8, "softmax_topk"),
        (torch.randn(3, 256, generator=g).bfloat16(), 8, "sigmoid_bias", torch.randn(256, generator=g), 2.5),
        (torch.randn(4, 64, generator=g).half(), 4, "grouped_sigmoid_bias", torch.randn(64, generator=g).bfloat16(),
         1.0, False, 8, 4),
        (torch.randn(0, 16, generator=g), 1, "llama4"),
        (torch.randn(2, 16, generator=g), 4, "sigmoid_topk", None, 1.0, True),
        (torch.randn(3, 64, generator=g), 4, "grouped_softmax", None, 2.0, True, 8, 3),
        (torch.randn(3, 64, generator=g).bfloat16(), 6, "softmax_bias", torch.randn(64, generator=g) * 0.01, 1.5,
         None, 1, 1, 1e-6),
        (torch.randn(3, 32, generator=g), 4, "sigmoid_bias", torch.randn(32, generator=g), 2.5, False, 1, 1, 0.1),
    ]
    for args in samples:
        torch.library.opcheck(op, args)


def test_torch_compile_fullgraph():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(9, 256, generator=g).bfloat16()
    bias = torch.randn(256, generator=g)

    def moe_route(logits, bias):
        w, ids = optimized.route(logits, 8, "sigmoid_bias", bias=bias, scaling=2.5)
        return w * 2, ids

    compiled = torch.compile(moe_route, fullgraph=True, dynamic=False)
    w, ids = compiled(x, bias)
    w0, i0 = optimized.route(x, 8, "sigmoid_bias", bias=bias, scaling=2.5)
    assert torch.equal(ids, i0) and torch.equal(w, w0 * 2)


def test_dispatch_explains_route():
    d = dispatch.explain("route", torch.zeros(4, 256), 8, "sigmoid_bias")
    assert d.op == "route" and d.kernel == "moelab" and "calling thread" in d.reason
    big = dispatch.explain("route", torch.zeros(4096, 256), 8, "sigmoid_bias")
    assert "tasks of" in big.reason
    assert optimized.backend_info()["route"] in ISA_LEVELS
    meta = torch.zeros(4, 64, device="meta")
    assert "meta kernel" in dispatch.explain("route", meta, 8, "softmax_topk").reason
    w, ids = optimized.route(meta, 8, "softmax_topk")           # shapes only
    assert w.shape == ids.shape == (4, 8) and w.dtype == torch.float32 and ids.dtype == torch.int32


def test_weights_bound_the_reference_math_by_hand():
    """A tiny case checked against plain-float math (not the reference): sigmoid_bias picks by
    s + bias, weights s * scaling / sum(s)."""
    x = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    bias = torch.tensor([0.0, -5.0, 2.0, 0.0])
    w, ids = optimized.route(x, 2, "sigmoid_bias", bias=bias, scaling=2.0)
    s = [1 / (1 + math.exp(-v)) for v in (0.0, 2.0, -1.0, 1.0)]
    assert ids.tolist() == [[2, 3]]
    want = [2.0 * s[2] / (s[2] + s[3]), 2.0 * s[3] / (s[2] + s[3])]
    assert all(abs(a - b) <= 4e-7 * abs(b) for a, b in zip(w[0].tolist(), want))


# ------------------------------------------- seed 004's before/after pair (route_variant)
from optimized.route import SELECTIONS, route_variant   # noqa: E402


def _same_bits(a, b):
    (wa, ia), (wb, ib) = a, b
    return torch.equal(ia, ib) and torch.equal(wa.view(torch.int32), wb.view(torch.int32))


# E x K across the lane sink's R = 1, 2, 3 (K <= 8, 16, 32), seed 004's shape and its grid region,
# tails (E not a multiple of 16) and K = E.
PAIR_SHAPES = [(896, 16), (512, 9), (1024, 16), (768, 12), (256, 8), (100, 7), (2048, 32), (33, 32), (32, 32), (1, 1)]


@pytest.mark.parametrize("method", METHODS)
def test_serial_selection_equals_lanes_bit_for_bit(isa, method):
    """The seed's 'before' (one scalar insertion pass over all E keys) and today's kernel (SIMD
    lanes own strided candidates, then compress and rank): the same ids and weight bits, on
    random rows (three logit distributions) and on the engineered tie / NaN / inf / -0 rows."""
    checked = 0
    for E, K in PAIR_SHAPES:
        g = torch.Generator().manual_seed(E * 31 + K)
        gk = group_kwargs(E)
        if method in GROUPED and gk is None:
            continue
        kw = make_kwargs(method, E, g, **(gk if method in GROUPED else {}))
        Kf = fit_k(method, E, K, kw)
        rows = [torch.randn(6, E, generator=g) * 3,                                  # normal
                torch.rand(6, E, generator=g) * 0.01,                                 # near-uniform
                torch.randn(6, E, generator=g) - 8 * (torch.arange(E) % 5 == 0),      # skewed
                special_rows(E, g)]
        for dt in DTYPES:
            x = torch.cat(rows).to(dt)
            before = route_variant(x, Kf, method, selection="serial", **kw)
            after = route_variant(x, Kf, method, selection="lanes", **kw)
            assert _same_bits(before, after), (method, E, Kf, dt)
            assert _same_bits(after, optimized.route(x, Kf, method, **kw)), "lanes must be route's kernel"
            checked += 1
    assert checked >= 9


def test_serial_selection_many_ties_at_the_bound():
    """More than 64 experts tied at the K-th key: today's kernel leaves its compress-and-rank
    path for the insertion fallback; the serial kernel must agree on both sides of that."""
    E = 896
    x = torch.zeros(4, E)
    x[0, ::7] = 1.0          # 128 tied at the top, K = 16 of them selected
    x[1, 100:300] = 0.5      # 200 tied
    x[2, ::2] = float("nan")
    x[3, -70:] = 2.0
    for method in ("topk_softmax", "sigmoid_topk", "softmax_topk"):
        a = route_variant(x, 16, method, selection="serial")
        b = route_variant(x, 16, method, selection="lanes")
        assert _same_bits(a, b), method
        assert a[1][0].tolist() == list(range(0, 16 * 7, 7))


def test_route_variant_rejects_bad_selection_and_checks_like_route():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="route_variant: argument 'selection'"):
        route_variant(x, 4, "softmax_topk", selection="warp0")
    with pytest.raises(RuntimeError, match="moelab::route_variant: argument 'selection'"):
        torch.ops.moelab.route_variant(x, 4, "softmax_topk", "fast")
    with pytest.raises(RuntimeError, match="moelab::route_variant: argument 'top_k'"):
        torch.ops.moelab.route_variant(x, 33, "softmax_topk", "serial")
    with pytest.raises(ValueError, match="route_variant: argument 'top_k'"):
        route_variant(x, 0, "softmax_topk", selection="serial")
    with pytest.raises(ValueError, match="route_variant: argument 'bias'"):
        route_variant(x, 4, "sigmoid_bias", selection="serial")
    assert SELECTIONS == ("lanes", "serial")
    w, i = route_variant(torch.randn(0, 64), 4, "softmax_topk", selection="serial")
    assert w.shape == (0, 4) and i.shape == (0, 4)


def test_route_variant_opcheck_and_no_dispatcher_reaches_it():
    g = torch.Generator().manual_seed(13)
    for sel in SELECTIONS:
        torch.library.opcheck(torch.ops.moelab.route_variant.default,
                              (torch.randn(3, 896, generator=g).bfloat16(), 16, "sigmoid_bias", sel,
                               torch.randn(896, generator=g), 2.5))
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    for path in list((root / "optimized").glob("*.py")) + list((root / "reference").glob("*.py")):
        if path.name == "route.py" and path.parent.name == "optimized":
            continue
        assert "route_variant" not in path.read_text(encoding="utf-8"), f"{path.name} reaches route_variant"
