"""Semantics of reference.route (SPEC.md sections 1 and 6).

Expected values are computed here independently of the module under test: by hand, with
plain Python math on floats, or (for the selection order) with Python's `sorted` over an
explicit total-order key. Keys that depend on f32 rounding (softmax, sigmoid) are computed
with torch's f32 kernels in the test, so ids can be compared exactly.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from reference.route import route, selection_keys

NAN, INF = float("nan"), float("inf")
METHODS = ("softmax_topk", "topk_softmax", "sigmoid_topk", "sigmoid_bias", "grouped_sigmoid_bias", "llama4",
           "grouped_softmax", "softmax_bias")
BIASED = ("sigmoid_bias", "grouped_sigmoid_bias", "softmax_bias")
GROUPED = ("grouped_sigmoid_bias", "grouped_softmax")

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- helpers
def sig(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def t32(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def order_key(v: float, i: int):
    """Total order as a Python sort key: NaN first, then larger value, then lower index.
    -v maps -0.0 and +0.0 to values Python compares equal, so they tie by index."""
    return (0, 0.0, i) if math.isnan(v) else (1, -v, i)


def py_topk(vals, k):
    return sorted(range(len(vals)), key=lambda i: order_key(vals[i], i))[:k]


def ranks_before(a: float, ia: int, b: float, ib: int) -> bool:
    return order_key(a, ia) < order_key(b, ib)


def py_grouped(keys_row, n_group, topk_group, top2=True):
    """Keys after group masking, and the kept group indices, in plain Python. Group score
    (total order) = f32 sum of the two largest keys of the group (DeepSeek-V3), or with
    top2=False the largest key (DeepSeek-V2 group_limited_greedy)."""
    gs = len(keys_row) // n_group
    scores = []
    for g in range(n_group):
        vals = keys_row[g * gs:(g + 1) * gs]
        a, b = (vals[i] for i in py_topk(vals, 2))
        scores.append(float(np.float32(a) + np.float32(b)) if top2 else a)
    kept = set(py_topk(scores, topk_group))
    return [v if i // gs in kept else -INF for i, v in enumerate(keys_row)], kept


def sigmoid32(x: torch.Tensor) -> torch.Tensor:
    """The exact sigmoid rounded once to f32 (what SPEC's f32 sigmoid means here)."""
    return torch.sigmoid(x.double()).float()


def independent_keys(x: torch.Tensor, method: str, bias) -> torch.Tensor:
    """Keys before group masking: exact function rounded to f32 (not the module's code)."""
    x = x.float()
    if method in ("softmax_topk", "grouped_softmax"):
        return torch.softmax(x.double(), dim=-1).float()
    if method == "softmax_bias":
        return torch.softmax(x.double(), dim=-1).float() + bias.float()
    if method in ("topk_softmax", "llama4"):
        return x
    s = sigmoid32(x)
    return s if method == "sigmoid_topk" else s + bias.float()


def expected_ids(x, method, K, bias=None, n_group=1, topk_group=1):
    keys = independent_keys(x, method, bias).tolist()
    out = []
    for row in keys:
        if method in GROUPED:
            row, _ = py_grouped(row, n_group, topk_group, top2=method == "grouped_sigmoid_bias")
        out.append(py_topk(row, K))
    return out


def assert_close_list(got: torch.Tensor, want, rel=2e-6):
    got = got.tolist()
    assert len(got) == len(want)
    for g_row, w_row in zip(got, want):
        assert len(g_row) == len(w_row)
        for g, w in zip(g_row, w_row):
            assert math.isclose(g, w, rel_tol=rel, abs_tol=1e-30), (got, want)


# ------------------------------------------------------------------ hand-computed cases
X = [[1.0, 3.0, 2.0, 0.5]]          # descending order of x: 1 (3.0), 2 (2.0), 0 (1.0), 3 (0.5)


def test_softmax_topk_hand():
    z = sum(math.exp(v) for v in X[0])
    w, ids = route(t32(X), 2, "softmax_topk")
    assert ids.tolist() == [[1, 2]]
    assert_close_list(w, [[math.exp(3.0) / z, math.exp(2.0) / z]])
    w, ids = route(t32(X), 2, "softmax_topk", renormalize=True)
    assert ids.tolist() == [[1, 2]]
    zz = math.exp(3.0) + math.exp(2.0)
    assert_close_list(w, [[math.exp(3.0) / zz, math.exp(2.0) / zz]])


def test_topk_softmax_hand():
    zz = math.exp(3.0) + math.exp(2.0) + math.exp(1.0)
    want = [[math.exp(3.0) / zz, math.exp(2.0) / zz, math.exp(1.0) / zz]]
    for renorm in (False, True):                   # renormalize is a no-op here
        w, ids = route(t32(X), 3, "topk_softmax", renormalize=renorm)
        assert ids.tolist() == [[1, 2, 0]]
        assert_close_list(w, want)


def test_sigmoid_topk_hand():
    w, ids = route(t32(X), 2, "sigmoid_topk")
    assert ids.tolist() == [[1, 2]]
    assert_close_list(w, [[sig(3.0), sig(2.0)]])
    w, ids = route(t32(X), 2, "sigmoid_topk", renormalize=True)
    s = sig(3.0) + sig(2.0)
    assert_close_list(w, [[sig(3.0) / s, sig(2.0) / s]])


def test_sigmoid_topk_renormalize_floor():
    # sigmoid(-80) ~ 1.8e-35 and sigmoid(-200) underflows to 0: the sum is below 1e-20, so
    # the weights are s / 1e-20 ~ 1.8e-15, not s / sum (which would be 0.5 each).
    w, ids = route(t32([[-80.0, -80.0, -200.0]]), 2, "sigmoid_topk", renormalize=True)
    assert ids.tolist() == [[0, 1]]
    assert_close_list(w, [[sig(-80.0) / 1e-20] * 2], rel=1e-5)


def test_sigmoid_bias_hand():
    bias = t32([0.0, -1.0, 0.0, 2.0])
    # row 0 keys: s(1)=.731, s(3)-1=-.047, s(2)=.881, s(.5)+2=2.62 -> ids [3, 2]
    # row 1 (x = 0, s = .5): keys .5, -.5, .5, 2.5 -> ids [3, 0] (tie 0 vs 2: lower index)
    x = t32([X[0], [0.0, 0.0, 0.0, 0.0]])
    w, ids = route(x, 2, "sigmoid_bias", bias=bias, scaling=2.5)
    assert ids.tolist() == [[3, 2], [3, 0]]
    s0 = sig(0.5) + sig(2.0)
    assert_close_list(w, [[sig(0.5) * 2.5 / s0, sig(2.0) * 2.5 / s0], [1.25, 1.25]])


def test_sigmoid_bias_epsilon():
    # every s is 0: weights are 0 * scaling / (0 + 1e-20) = 0, not 0/0 = NaN
    w, ids = route(t32([[-INF, -INF, -INF]]), 2, "sigmoid_bias", bias=t32([0.0, 1.0, 0.0]))
    assert ids.tolist() == [[1, 0]]
    assert w.tolist() == [[0.0, 0.0]]


def test_grouped_sigmoid_bias_hand():
    x = [4.0, -3.0, 3.0, 2.5, 0.0, 0.0, 3.5, -5.0]
    s = [sig(v) for v in x]
    # groups {0,1} {2,3} {4,5} {6,7}; zero bias: scores s0+s1 = 1.029, s2+s3 = 1.877,
    # s4+s5 = 1.0, s6+s7 = 0.977 -> keep groups 1 and 0; top 3 of experts 0..3: [0, 2, 3].
    # (Ungrouped, expert 6 with s = .971 would beat expert 2.)
    assert s[2] + s[3] > s[0] + s[1] > s[4] + s[5] > s[6] + s[7]
    w, ids = route(t32([x]), 3, "grouped_sigmoid_bias", bias=torch.zeros(8), n_group=4, topk_group=2,
                   scaling=2.5)
    assert ids.tolist() == [[0, 2, 3]]
    tot = s[0] + s[2] + s[3]
    assert_close_list(w, [[s[0] * 2.5 / tot, s[2] * 2.5 / tot, s[3] * 2.5 / tot]])
    # bias 0.1 on expert 4: group 2 scores 0.6 + 0.5 = 1.1 > 1.029, so groups 1 and 2 are
    # kept; keys of 2..5: .953, .924, .6, .5 -> [2, 3, 4]. The weight uses s, not s + bias.
    bias = t32([0, 0, 0, 0, 0.1, 0, 0, 0])
    assert s[4] + 0.1 + s[5] > s[0] + s[1]
    w, ids = route(t32([x]), 3, "grouped_sigmoid_bias", bias=bias, n_group=4, topk_group=2, scaling=2.5)
    assert ids.tolist() == [[2, 3, 4]]
    tot = s[2] + s[3] + s[4]
    assert_close_list(w, [[s[2] * 2.5 / tot, s[3] * 2.5 / tot, s[4] * 2.5 / tot]])


def test_llama4_hand():
    w, ids = route(t32([X[0], [-1.0, -2.0, -0.5, -3.0]]), 1, "llama4")
    assert ids.tolist() == [[1], [2]]
    assert_close_list(w, [[sig(3.0)], [sig(-0.5)]])


def test_bias_never_enters_weight():
    x = t32([[0.3, -1.2, 2.0, 0.7, -0.1]])
    w1, i1 = route(x, 2, "sigmoid_bias", bias=t32([0, 0, 0, 5.0, 5.0]))
    w2, i2 = route(x, 2, "sigmoid_bias", bias=t32([0, 0, 0, 9.0, 7.0]))
    assert i1.tolist() == [[3, 4]] and i2.tolist() == [[3, 4]]
    assert torch.equal(w1, w2)


# ------------------------------------------------------- SPEC 6: the December amendment
def f32(v: float) -> float:
    return float(np.float32(v))


def test_renormalize_none_is_the_methods_default():
    x = t32([X[0], [0.2, -1.0, 0.7, 0.1]])
    bias = t32([0.0, 0.3, -0.2, 0.1])
    for method, kw, default in (("softmax_topk", {}, False), ("sigmoid_topk", {}, False),
                                ("sigmoid_bias", dict(bias=bias), True), ("softmax_bias", dict(bias=bias / 8), True),
                                ("grouped_sigmoid_bias", dict(bias=bias, n_group=2, topk_group=1), True),
                                ("grouped_softmax", dict(n_group=2, topk_group=1), False)):
        a = route(x, 2, method, **kw)
        b = route(x, 2, method, renormalize=default, **kw)
        c = route(x, 2, method, renormalize=not default, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), method
        assert torch.equal(a[1], c[1]) and not torch.equal(a[0], c[0]), method


def test_biased_without_renormalize_is_s_times_scaling():
    # X with bias [0, -1, 0, 2] picks [3, 2] (test_sigmoid_bias_hand); renormalize=False:
    # w = f32(s) * f32(2.5), no sum (DeepSeek-V3 configs with norm_topk_prob = False)
    bias = t32([0.0, -1.0, 0.0, 2.0])
    w, ids = route(t32(X), 2, "sigmoid_bias", bias=bias, scaling=2.5, renormalize=False)
    assert ids.tolist() == [[3, 2]]
    assert w.tolist() == [[f32(f32(sig(0.5)) * 2.5), f32(f32(sig(2.0)) * 2.5)]]
    w, ids = route(t32([[4.0, -3.0, 3.0, 2.5, 0.0, 0.0, 3.5, -5.0]]), 3, "grouped_sigmoid_bias",
                   bias=torch.zeros(8), n_group=4, topk_group=2, scaling=0.5, renormalize=False)
    assert ids.tolist() == [[0, 2, 3]]
    assert_close_list(w, [[sig(4.0) * 0.5, sig(3.0) * 0.5, sig(2.5) * 0.5]])


def test_scaling_applies_to_every_method():
    # final weights times f32(scaling), after any normalization; 0.1 is not exact in f32
    c = f32(0.1)
    z = sum(math.exp(v) for v in X[0])
    zz = math.exp(3.0) + math.exp(2.0)
    cases = [
        ("softmax_topk", 2, {}, [math.exp(3.0) / z, math.exp(2.0) / z]),
        ("softmax_topk", 2, dict(renormalize=True), [math.exp(3.0) / zz, math.exp(2.0) / zz]),
        ("topk_softmax", 2, {}, [math.exp(3.0) / zz, math.exp(2.0) / zz]),
        ("sigmoid_topk", 2, {}, [sig(3.0), sig(2.0)]),
        ("sigmoid_topk", 2, dict(renormalize=True), [sig(3.0) / (sig(3.0) + sig(2.0)), sig(2.0) / (sig(3.0) + sig(2.0))]),
        ("llama4", 1, {}, [sig(3.0)]),
    ]
    for method, K, kw, want in cases:
        w, ids = route(t32(X), K, method, scaling=0.1, **kw)
        assert ids.tolist() == [[1, 2][:K]]
        assert_close_list(w, [[v * c for v in want]], rel=4e-7)
        w1, _ = route(t32(X), K, method, **kw)                    # the f32 product of the unscaled
        assert torch.equal(w, w1 * torch.tensor(c, dtype=torch.float32)), method


def test_norm_eps_forms():
    # tiny sigmoids: s(-12) = 6.1e-6, s(-13) = 2.3e-6, so the epsilon is visible
    x = t32([[-12.0, -13.0, -20.0]])
    s0, s1 = sig(-12.0), sig(-13.0)
    # biased sigmoid: s * c / (sum + eps), LFM2-MoE's 1e-6
    w, ids = route(x, 2, "sigmoid_bias", bias=torch.zeros(3), norm_eps=1e-6, scaling=2.0)
    assert ids.tolist() == [[0, 1]]
    assert_close_list(w, [[2 * s0 / (s0 + s1 + 1e-6), 2 * s1 / (s0 + s1 + 1e-6)]], rel=1e-6)
    # default 1e-20: the plain ratio
    w, _ = route(x, 2, "sigmoid_bias", bias=torch.zeros(3))
    assert_close_list(w, [[s0 / (s0 + s1), s1 / (s0 + s1)]], rel=1e-6)
    # sigmoid_topk: s / max(sum, eps); 1e-4 > sum = 8.4e-6 binds, 1e-6 does not
    w, _ = route(x, 2, "sigmoid_topk", renormalize=True, norm_eps=1e-4)
    assert_close_list(w, [[s0 / 1e-4, s1 / 1e-4]], rel=1e-6)
    w, _ = route(x, 2, "sigmoid_topk", renormalize=True, norm_eps=1e-6)
    assert_close_list(w, [[s0 / (s0 + s1), s1 / (s0 + s1)]], rel=1e-6)
    # norm_eps = 0 is allowed: the plain sum (0 / 0 = NaN for an all-zero selection)
    w, _ = route(t32([[-INF, -INF]]), 2, "sigmoid_bias", bias=torch.zeros(2), norm_eps=0.0)
    assert bool(torch.isnan(w).all())


def test_grouped_softmax_hand():
    # groups {0..3} {4..7}: group 0 holds the largest p (e^4), group 1 the largest sum of two
    # (2 e^3.5 > e^4 + 1): DeepSeek-V2's group_limited_greedy scores by the max -> group 0.
    x = [4.0, 0.0, 0.0, 0.0, 3.5, 3.5, 0.0, 0.0]
    z = math.exp(4.0) + 2 * math.exp(3.5) + 5
    w, ids = route(t32([x]), 2, "grouped_softmax", n_group=2, topk_group=1)
    assert ids.tolist() == [[0, 1]]                          # 1, 2, 3 tie at p = 1/z: lower index
    assert_close_list(w, [[math.exp(4.0) / z, 1 / z]])
    # ungrouped (or scored by a top-2 sum) the picks would be 0, 4 (softmax_topk)
    assert route(t32([x]), 2, "softmax_topk")[1].tolist() == [[0, 4]]
    # DeepSeek-V2 itself: no renormalization, routed_scaling_factor 16
    w, _ = route(t32([x]), 2, "grouped_softmax", n_group=2, topk_group=1, scaling=16.0)
    assert_close_list(w, [[16 * math.exp(4.0) / z, 16 / z]])
    w, _ = route(t32([x]), 2, "grouped_softmax", n_group=2, topk_group=1, renormalize=True, scaling=2.0)
    assert_close_list(w, [[2 * math.exp(4.0) / (math.exp(4.0) + 1), 2 / (math.exp(4.0) + 1)]])
    # four groups, keep two: group maxima e^4 (g0), e^3.5 (g2), 1 (g1, g3) -> experts 0..1, 4..5
    w, ids = route(t32([x]), 3, "grouped_softmax", n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 4, 5]]
    # group ties: equal maxima, the lower group is kept
    _, ids = route(torch.zeros(1, 8), 2, "grouped_softmax", n_group=4, topk_group=1)
    assert ids.tolist() == [[0, 1]]
    _, ids = route(t32([[0, 0, 1, 0, 0, 1, 0, 0]]), 2, "grouped_softmax", n_group=4, topk_group=1)
    assert ids.tolist() == [[2, 3]]


def test_softmax_bias_hand():
    # Ernie 4.5: key p + bias, weight p (the bias left out), / max(sum, 1e-12), times scaling
    p = [math.exp(v) / sum(math.exp(u) for u in X[0]) for v in X[0]]   # .085, .631, .232, .052
    bias = t32([0.5, 0.0, 0.0, 0.3])                         # keys .585, .631, .232, .352
    w, ids = route(t32(X), 2, "softmax_bias", bias=bias)
    assert ids.tolist() == [[1, 0]]
    assert_close_list(w, [[p[1] / (p[1] + p[0]), p[0] / (p[1] + p[0])]])
    w, _ = route(t32(X), 2, "softmax_bias", bias=bias, renormalize=False, scaling=2.0)
    assert_close_list(w, [[2 * p[1], 2 * p[0]]])
    # norm_eps 0.9 > p1 + p0 = .716: the floor binds
    w, _ = route(t32(X), 2, "softmax_bias", bias=bias, norm_eps=0.9)
    assert_close_list(w, [[p[1] / 0.9, p[0] / 0.9]])
    # the bias never enters a weight: another bias with the same picks (keys .605, .631,
    # .232, .452) gives the same weights
    w2, i2 = route(t32(X), 2, "softmax_bias", bias=t32([0.52, 0.0, 0.0, 0.4]))
    assert i2.tolist() == [[1, 0]]
    assert torch.equal(w2, route(t32(X), 2, "softmax_bias", bias=bias)[0])


def test_exact_mode_float64_new_methods():
    """float64 logits: every step in float64, nothing rounded to f32 (the family truth)."""
    d = torch.float64
    x = torch.tensor([[4.0, 0.0, 0.0, 0.0, 3.5, 3.5, 0.0, 0.0]], dtype=d)
    z = math.exp(4.0) + 2 * math.exp(3.5) + 5
    w, ids = route(x, 2, "grouped_softmax", n_group=2, topk_group=1, scaling=16.0)
    assert w.dtype == d and ids.tolist() == [[0, 1]]
    assert_close_list(w, [[16 * math.exp(4.0) / z, 16 / z]], rel=1e-15)
    p = [math.exp(v) / sum(math.exp(u) for u in X[0]) for v in X[0]]
    w, ids = route(torch.tensor(X, dtype=d), 2, "softmax_bias", bias=torch.tensor([0.5, 0, 0, 0.3], dtype=d),
                   scaling=1.5, norm_eps=0.9)
    assert ids.tolist() == [[1, 0]]
    assert_close_list(w, [[1.5 * p[1] / 0.9, 1.5 * p[0] / 0.9]], rel=1e-15)
    x = torch.tensor([[-12.0, -13.0, -20.0]], dtype=d)
    s0, s1 = sig(-12.0), sig(-13.0)
    w, _ = route(x, 2, "sigmoid_bias", bias=torch.zeros(3, dtype=d), norm_eps=1e-6, scaling=2.5)
    assert_close_list(w, [[2.5 * s0 / (s0 + s1 + 1e-6), 2.5 * s1 / (s0 + s1 + 1e-6)]], rel=1e-15)
    w, _ = route(x, 2, "sigmoid_bias", bias=torch.zeros(3, dtype=d), renormalize=False, scaling=2.5)
    assert_close_list(w, [[2.5 * s0, 2.5 * s1]], rel=1e-15)


# -------------------------------------------------------------------------- tie rules
@pytest.mark.parametrize("method", ["softmax_topk", "topk_softmax", "sigmoid_topk"])
def test_exact_ties_lower_index_first(method):
    # ties spread across the row and straddling the K boundary (2 vs 5 for the last slot)
    x = t32([[1.0, 5.0, 3.0, 5.0, 5.0, 3.0],
             [2.0, 7.0, 2.0, 7.0, 7.0, 2.0],
             [0.0] * 6])
    _, ids = route(x, 4, method)
    assert ids.tolist() == [[1, 3, 4, 2], [1, 3, 4, 0], [0, 1, 2, 3]]


def test_exact_ties_biased_methods():
    # x = 0 -> s = 0.5 exactly; keys .5, 1, 1, .5, 1, .5 -> [1, 2, 4, 0]
    bias = t32([0.0, 0.5, 0.5, 0.0, 0.5, 0.0])
    _, ids = route(torch.zeros(1, 6), 4, "sigmoid_bias", bias=bias)
    assert ids.tolist() == [[1, 2, 4, 0]]
    # every group scores the same: groups 0 and 1 are kept -> experts 0..3
    _, ids = route(torch.zeros(1, 8), 4, "grouped_sigmoid_bias", bias=torch.zeros(8), n_group=4,
                   topk_group=2)
    assert ids.tolist() == [[0, 1, 2, 3]]
    # groups 1 and 2 tie on score 3.0 (above groups 0 and 3): the lower, group 1, is kept
    bias = t32([0, 0, 1, 1, 1, 1, 0, 0])
    _, ids = route(torch.zeros(1, 8), 2, "grouped_sigmoid_bias", bias=bias, n_group=4, topk_group=1)
    assert ids.tolist() == [[2, 3]]


def test_llama4_ties():
    _, ids = route(t32([[1.0, 4.0, 4.0], [-0.0, 0.0, -1.0], [0.0, -0.0, -1.0]]), 1, "llama4")
    assert ids.tolist() == [[1], [0], [0]]


@pytest.mark.parametrize("method", ["softmax_topk", "sigmoid_topk", "sigmoid_bias"])
def test_equal_logits_give_equal_keys_anywhere_in_the_row(method):
    """Equal logits at a vectorized position and at a scalar-tail position of the row must
    get bit-equal keys, so the tie goes to the lower index. (torch's own f32 sigmoid on CPU
    breaks this for a few percent of values, e.g. x = -4.93654: ids [35, 0].)"""
    vals = (torch.randn(200, generator=torch.Generator().manual_seed(0)) * 4).tolist() + [-4.936540126800537]
    bias = torch.zeros(45) if method == "sigmoid_bias" else None
    for E in (40, 45):
        x = torch.full((len(vals), E), -50.0)
        x[:, 0] = x[:, 35] = torch.tensor(vals)
        _, ids = route(x, 2, method, bias=bias[:E] if bias is not None else None)
        assert ids.tolist() == [[0, 35]] * len(vals)
        keys = selection_keys(x, method, bias[:E] if bias is not None else None)
        assert torch.equal(keys[:, 0], keys[:, 35])


def test_nan_ranks_above_inf_and_nans_tie_by_index():
    x = t32([[1.0, NAN, INF, NAN, 0.0], [INF, 3.0, NAN, -INF, INF]])
    _, ids = route(x, 5, "topk_softmax")
    assert ids.tolist() == [[1, 3, 2, 0, 4], [2, 0, 4, 1, 3]]
    _, ids = route(x, 3, "sigmoid_topk")     # sigmoid(NaN) = NaN, sigmoid(inf) = sigmoid(1e9) = 1
    assert ids.tolist() == [[1, 3, 2], [2, 0, 4]]
    _, ids = route(x, 1, "llama4")
    assert ids.tolist() == [[1], [2]]


def test_nan_group_score_ranks_first():
    # s = [.993, .993, NaN, .007]: group 1's score is NaN, which ranks above group 0's 1.987
    _, ids = route(t32([[5.0, 5.0, NAN, -5.0]]), 2, "grouped_sigmoid_bias", bias=torch.zeros(4),
                   n_group=2, topk_group=1)
    assert ids.tolist() == [[2, 3]]


def test_negative_zero_equals_positive_zero():
    x = t32([[-0.0, 0.0, -0.0, 0.0], [-0.0, -1.0, 0.0, 0.0], [0.0, -0.0, 1.0, -1.0]])
    _, ids = route(x, 3, "topk_softmax")
    assert ids.tolist() == [[0, 1, 2], [0, 2, 3], [2, 0, 1]]


# ------------------------------------------------------------------ hypothesis properties
@st.composite
def route_cases(draw, methods=METHODS, specials=True):
    """(x, method, K, bias, n_group, topk_group): random shapes, optionally coarse values
    (many exact ties, -0.0 from rounding) and NaN / +-inf / -0.0 sprinkled in."""
    method = draw(st.sampled_from(methods))
    T = draw(st.integers(1, 6))
    n_group = topk_group = 1
    if method in GROUPED:
        n_group = draw(st.sampled_from([1, 2, 3, 4, 8]))
        gs = draw(st.integers(2, 8))
        E = n_group * gs
        topk_group = draw(st.integers(1, n_group))
        K = draw(st.integers(1, min(32, topk_group * gs)))
    else:
        E = draw(st.integers(1, 48))
        K = 1 if method == "llama4" else draw(st.integers(1, min(E, 32)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(T, E, generator=g) * 3
    coarse = draw(st.booleans())
    if coarse:
        x = torch.round(x * 2) / 2
    if specials:
        frac = draw(st.sampled_from([0.0, 0.05, 0.25]))
        pick = torch.rand(T, E, generator=g)
        choice = torch.randint(0, 4, (T, E), generator=g)
        vals = t32([NAN, INF, -INF, -0.0])[choice]
        x = torch.where(pick < frac, vals, x)
    bias = None
    if method in BIASED:
        bias = torch.randn(E, generator=g) * (0.5 if method != "softmax_bias" else 0.05)
        if coarse:
            bias = torch.round(bias * 4) / 4 if method != "softmax_bias" else torch.round(bias * 32) / 32
    return x, method, K, bias, n_group, topk_group


@SETTINGS
@given(route_cases())
def test_ids_follow_total_order(case):
    """ids are exactly the first K experts of an independent Python sort by the total order."""
    x, method, K, bias, n_group, topk_group = case
    w, ids = route(x, K, method, bias=bias, n_group=n_group, topk_group=topk_group)
    assert ids.tolist() == expected_ids(x, method, K, bias, n_group, topk_group)


@SETTINGS
@given(route_cases())
def test_ids_distinct_in_range_and_keys_non_increasing(case):
    x, method, K, bias, n_group, topk_group = case
    w, ids = route(x, K, method, bias=bias, n_group=n_group, topk_group=topk_group)
    T, E = x.shape
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.shape == (T, K) and w.shape == (T, K)
    assert ids.is_contiguous() and w.is_contiguous()
    keys = selection_keys(x, method, bias, n_group, topk_group)
    for t, row in enumerate(ids.tolist()):
        assert len(set(row)) == K and all(0 <= e < E for e in row)
        kr = keys[t].tolist()
        for a, b in zip(row, row[1:]):
            assert ranks_before(kr[a], a, kr[b], b), (kr, row)
        # and nothing left out ranks before the last selected key
        chosen = set(row)
        last = row[-1]
        assert not any(ranks_before(kr[e], e, kr[last], last) for e in range(E) if e not in chosen)


@SETTINGS
@given(route_cases(methods=("grouped_sigmoid_bias",)))
def test_grouped_never_picks_a_dropped_group(case):
    x, method, K, bias, n_group, topk_group = case
    _, ids = route(x, K, method, bias=bias, n_group=n_group, topk_group=topk_group)
    keys = (sigmoid32(x) + bias.float()).tolist()
    gs = x.shape[1] // n_group
    for row_keys, row_ids in zip(keys, ids.tolist()):
        _, kept = py_grouped(row_keys, n_group, topk_group)
        assert len(kept) == topk_group
        assert all(e // gs in kept for e in row_ids), (kept, row_ids)


@SETTINGS
@given(route_cases(methods=("sigmoid_bias", "grouped_sigmoid_bias"), specials=False),
       st.floats(0.01, 100.0))
def test_biased_weights_sum_to_scaling(case, scaling):
    x, method, K, bias, n_group, topk_group = case
    w, _ = route(x, K, method, bias=bias, n_group=n_group, topk_group=topk_group, scaling=scaling)
    # |x| < ~20 here, so sum(s) >= sigmoid(-20) ~ 2e-9 and the 1e-20 is invisible in f32
    assert torch.all(w >= 0)
    for total in w.double().sum(-1).tolist():
        assert math.isclose(total, scaling, rel_tol=(K + 4) * 2**-23)


@SETTINGS
@given(route_cases(methods=("topk_softmax", "softmax_topk"), specials=False))
def test_softmax_weights_sum_to_one(case):
    x, method, K, bias, n_group, topk_group = case
    w, _ = route(x, K, method, renormalize=True)
    for total in w.double().sum(-1).tolist():
        assert math.isclose(total, 1.0, rel_tol=(K + 4) * 2**-23)


@SETTINGS
@given(route_cases(methods=("sigmoid_bias",)))
def test_grouped_with_one_group_is_sigmoid_bias(case):
    x, _, K, bias, _, _ = case
    assume(x.shape[1] >= 2)                        # a group holds at least 2 experts
    a = route(x, K, "sigmoid_bias", bias=bias, scaling=1.5)
    b = route(x, K, "grouped_sigmoid_bias", bias=bias, n_group=1, topk_group=1, scaling=1.5)
    assert torch.equal(a[1], b[1])
    assert torch.allclose(a[0], b[0], rtol=0, atol=0, equal_nan=True)   # bit-equal, NaN == NaN


@SETTINGS
@given(route_cases())
def test_batch_invariance(case):
    """Each token's outputs are bit-identical whether routed alone or in the batch."""
    x, method, K, bias, n_group, topk_group = case
    w, ids = route(x, K, method, bias=bias, n_group=n_group, topk_group=topk_group)
    for t in range(x.shape[0]):
        w1, i1 = route(x[t:t + 1], K, method, bias=bias, n_group=n_group, topk_group=topk_group)
        assert torch.equal(i1[0], ids[t])
        assert torch.allclose(w1[0], w[t], rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", METHODS)
def test_half_logits_equal_their_f32_upcast(dtype, method):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 32, generator=g) * 4).to(dtype)   # many exact ties after rounding
    K = 1 if method == "llama4" else 6
    kw = {}
    if method in BIASED:
        kw["bias"] = torch.randn(32, generator=g).to(torch.bfloat16)
    if method in GROUPED:
        kw.update(n_group=4, topk_group=2)
    w_h, i_h = route(x, K, method, **kw)
    kw32 = dict(kw, bias=kw["bias"].float()) if "bias" in kw else kw
    w_f, i_f = route(x.float(), K, method, **kw32)
    assert torch.equal(i_h, i_f)
    assert torch.equal(w_h, w_f)
    assert w_h.dtype == torch.float32 and i_h.dtype == torch.int32


def test_bf16_upcast_is_exact_not_rounded_through_f16():
    # 2^-20 * (1 + 2^-7) is a bf16 value but not an f16 one (f16 is subnormal there, step
    # 2^-24): an upcast that went through f16 would tie it with 2^-20 and swap the order
    x = torch.tensor([[2.0**-20, 2.0**-20 * 1.0078125, 0.0]], dtype=torch.bfloat16)
    _, ids = route(x, 3, "topk_softmax")
    assert ids.tolist() == [[1, 0, 2]]


# ---------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("method", METHODS)
def test_empty_batch(method):
    K = 1 if method == "llama4" else 3
    kw = {}
    if method in BIASED:
        kw["bias"] = torch.zeros(8)
    if method in GROUPED:
        kw.update(n_group=4, topk_group=2)
    w, ids = route(torch.empty(0, 8, dtype=torch.bfloat16), K, method, **kw)
    assert w.shape == (0, K) and ids.shape == (0, K)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert w.device == ids.device == torch.device("cpu")
    assert selection_keys(torch.empty(0, 8), method, kw.get("bias"), kw.get("n_group", 1),
                          kw.get("topk_group", 1)).shape == (0, 8)


def test_largest_supported_shapes_and_inputs_untouched():
    g = torch.Generator().manual_seed(3)
    x = torch.round(torch.randn(3, 2048, generator=g) * 8) / 8   # ties at E = 2048
    x0 = x.clone()
    _, ids = route(x, 32, "topk_softmax")
    assert ids.tolist() == expected_ids(x, "topk_softmax", 32)
    assert torch.equal(x, x0)
    x = torch.round(torch.randn(3, 1024, generator=g) * 8) / 8
    bias = torch.round(torch.randn(1024, generator=g) * 8) / 8
    _, ids = route(x, 32, "grouped_sigmoid_bias", bias=bias, n_group=32, topk_group=4)
    assert ids.tolist() == expected_ids(x, "grouped_sigmoid_bias", 32, bias, 32, 4)


def test_selection_keys_values():
    x = t32([[1.0, 3.0, 2.0, 0.5]])
    assert torch.equal(selection_keys(x, "topk_softmax"), x)
    assert torch.equal(selection_keys(x, "sigmoid_topk"), sigmoid32(x))
    assert torch.equal(selection_keys(x, "softmax_topk"), torch.softmax(x.double(), -1).float())
    keys = selection_keys(t32([[4.0, -3.0, 3.0, 2.5, 0.0, 0.0, 3.5, -5.0]]), "grouped_sigmoid_bias",
                          torch.zeros(8), 4, 2)
    assert keys[0, 4:].tolist() == [-INF] * 4 and bool(torch.isfinite(keys[0, :4]).all())


# ------------------------------------------------------------------------ error inputs
def L(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


ERROR_CASES = [
    # (description, args, kwargs, argument named in the message)
    ("logits 1-D", (L(8), 2, "softmax_topk"), {}, "logits"),
    ("logits 3-D", (L(2, 2, 8), 2, "softmax_topk"), {}, "logits"),
    ("logits int32", (L(2, 8, dtype=torch.int32), 2, "softmax_topk"), {}, "logits"),
    ("logits float64 with an f32 bias", (L(2, 8, dtype=torch.float64), 2, "sigmoid_bias"), dict(bias=L(8)),
     "logits"),
    ("logits float32 with an f64 bias", (L(2, 8), 2, "sigmoid_bias"), dict(bias=L(8, dtype=torch.float64)),
     "bias"),
    ("logits a list", ([[0.0] * 8], 2, "softmax_topk"), {}, "logits"),
    ("E = 0", (L(2, 0), 1, "softmax_topk"), {}, "logits"),
    ("E > 2048", (L(1, 2049), 2, "softmax_topk"), {}, "logits"),
    ("K = 0", (L(2, 8), 0, "softmax_topk"), {}, "top_k"),
    ("K > E", (L(2, 8), 9, "softmax_topk"), {}, "top_k"),
    ("K > 32", (L(2, 64), 33, "sigmoid_topk"), {}, "top_k"),
    ("K a float", (L(2, 8), 2.0, "softmax_topk"), {}, "top_k"),
    ("K a bool", (L(2, 8), True, "softmax_topk"), {}, "top_k"),
    ("llama4 with K = 2", (L(2, 8), 2, "llama4"), {}, "top_k"),
    ("unknown method", (L(2, 8), 2, "softmax"), {}, "method"),
    ("sigmoid_bias without bias", (L(2, 8), 2, "sigmoid_bias"), {}, "bias"),
    ("grouped without bias", (L(2, 8), 2, "grouped_sigmoid_bias"), dict(n_group=2, topk_group=1), "bias"),
    ("softmax_topk with bias", (L(2, 8), 2, "softmax_topk"), dict(bias=L(8)), "bias"),
    ("bias of E + 1", (L(2, 8), 2, "sigmoid_bias"), dict(bias=L(9)), "bias"),
    ("bias 2-D", (L(2, 8), 2, "sigmoid_bias"), dict(bias=L(1, 8)), "bias"),
    ("bias float16", (L(2, 8), 2, "sigmoid_bias"), dict(bias=L(8, dtype=torch.float16)), "bias"),
    ("bias on another device", (L(2, 8), 2, "sigmoid_bias"), dict(bias=torch.zeros(8, device="meta")), "bias"),
    ("grouped E % n_group", (L(2, 8), 2, "grouped_sigmoid_bias"), dict(bias=L(8), n_group=3), "n_group"),
    ("grouped groups of 1", (L(2, 8), 2, "grouped_sigmoid_bias"), dict(bias=L(8), n_group=8), "n_group"),
    ("grouped n_group > 32", (L(2, 66), 2, "grouped_sigmoid_bias"), dict(bias=L(66), n_group=33), "n_group"),
    ("grouped E > 1024", (L(1, 1026), 2, "grouped_sigmoid_bias"), dict(bias=L(1026), n_group=2), "logits"),
    ("grouped topk_group > n_group", (L(2, 8), 2, "grouped_sigmoid_bias"),
     dict(bias=L(8), n_group=2, topk_group=3), "topk_group"),
    ("grouped topk_group = 0", (L(2, 8), 2, "grouped_sigmoid_bias"),
     dict(bias=L(8), n_group=2, topk_group=0), "topk_group"),
    ("grouped K > topk_group * E / n_group", (L(2, 8), 3, "grouped_sigmoid_bias"),
     dict(bias=L(8), n_group=4, topk_group=1), "top_k"),
    ("n_group with sigmoid_bias", (L(2, 8), 2, "sigmoid_bias"), dict(bias=L(8), n_group=2), "n_group"),
    ("topk_group with softmax_topk", (L(2, 8), 2, "softmax_topk"), dict(topk_group=2), "topk_group"),
    ("scaling NaN", (L(2, 8), 2, "sigmoid_bias"), dict(bias=L(8), scaling=NAN), "scaling"),
    ("scaling inf", (L(2, 8), 2, "sigmoid_bias"), dict(bias=L(8), scaling=INF), "scaling"),
    ("scaling a string", (L(2, 8), 2, "sigmoid_bias"), dict(bias=L(8), scaling="2"), "scaling"),
    ("softmax_bias without bias", (L(2, 8), 2, "softmax_bias"), {}, "bias"),
    ("grouped_softmax with bias", (L(2, 8), 2, "grouped_softmax"), dict(bias=L(8), n_group=2), "bias"),
    ("grouped_softmax E % n_group", (L(2, 8), 2, "grouped_softmax"), dict(n_group=3), "n_group"),
    ("grouped_softmax K > topk_group * E / n_group", (L(2, 8), 3, "grouped_softmax"),
     dict(n_group=4, topk_group=1), "top_k"),
    ("grouped_softmax E > 1024", (L(1, 1026), 2, "grouped_softmax"), dict(n_group=2), "logits"),
    ("n_group with softmax_bias", (L(2, 8), 2, "softmax_bias"), dict(bias=L(8), n_group=2), "n_group"),
    ("norm_eps with softmax_topk", (L(2, 8), 2, "softmax_topk"), dict(norm_eps=1e-6), "norm_eps"),
    ("norm_eps with grouped_softmax", (L(2, 8), 2, "grouped_softmax"), dict(n_group=2, norm_eps=1e-6),
     "norm_eps"),
    ("norm_eps negative", (L(2, 8), 2, "sigmoid_bias"), dict(bias=L(8), norm_eps=-1e-6), "norm_eps"),
    ("norm_eps NaN", (L(2, 8), 2, "softmax_bias"), dict(bias=L(8), norm_eps=NAN), "norm_eps"),
    ("norm_eps a string", (L(2, 8), 2, "sigmoid_topk"), dict(norm_eps="1e-6"), "norm_eps"),
    ("renormalize with llama4", (L(2, 8), 1, "llama4"), dict(renormalize=True), "renormalize"),
    ("renormalize an int", (L(2, 8), 2, "softmax_topk"), dict(renormalize=1), "renormalize"),
]


@pytest.mark.parametrize("desc,args,kwargs,arg", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_inputs(desc, args, kwargs, arg):
    with pytest.raises(ValueError) as ei:
        route(*args, **kwargs)
    msg = str(ei.value)
    assert msg.startswith("route"), msg
    assert f"'{arg}'" in msg, msg


def test_selection_keys_validates():
    with pytest.raises(ValueError, match="route.*'method'"):
        selection_keys(L(2, 8), "nope")
    with pytest.raises(ValueError, match="route.*'bias'"):
        selection_keys(L(2, 8), "sigmoid_bias")
