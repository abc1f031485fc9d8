"""Semantics of reference.permute / unpermute / PermuteScratch (SPEC section 2).

Expected layouts come from `hand_permute`, a plain-Python counting sort written
independently of the reference, or from values worked out by hand.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from reference.permute import Permuted, PermuteScratch, permute, unpermute

SETTINGS = settings(max_examples=60, deadline=None)


# ------------------------------------------------------------------ independent model
def hand_permute(hidden, ids, expert_map, E_loc, align):
    """Plain-Python stable counting sort -> (offsets, src_row, dst_pos, hidden rows), as tensors."""
    rows_in = hidden.tolist()
    id_list = ids.tolist()
    T = hidden.shape[0]
    H = hidden.shape[1]
    K = ids.shape[1]
    buckets = [[] for _ in range(E_loc)]
    for t in range(T):
        for j in range(K):
            g = id_list[t][j]
            if g == -1:
                continue
            e = g if expert_map is None else expert_map[g]
            if e == -1:
                continue
            buckets[e].append(t * K + j)
    offsets, src = [0], []
    for rows in buckets:
        src.extend(rows)
        while (len(src) - offsets[-1]) % align:
            src.append(-1)
        offsets.append(len(src))
    cap = T * K + E_loc * (align - 1)
    assert len(src) <= cap
    src = src + [-1] * (cap - len(src))
    dst = [-1] * (T * K)
    for p, r in enumerate(src):
        if r >= 0:
            dst[r] = p
    out = [[0.0] * H if r < 0 else rows_in[r // K] for r in src]
    return (torch.tensor(offsets, dtype=torch.int64), torch.tensor(out, dtype=hidden.dtype).reshape(cap, H),
            torch.tensor(src, dtype=torch.int32), torch.tensor(dst, dtype=torch.int32))


def assert_permuted_equal(got: Permuted, want):
    names = ("offsets", "hidden", "src_row", "dst_pos")
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert torch.equal(g, w), (name, g, w)


def hand_unpermute(expert_out, weights, dst_pos):
    """f32 accumulation in increasing j with numpy float32 scalars, one final rounding."""
    T, K = weights.shape
    H = expert_out.shape[1]
    eo = expert_out.to(torch.float32).tolist()
    w = weights.tolist()
    d = dst_pos.tolist()
    out = []
    for t in range(T):
        row = []
        for h in range(H):
            acc = np.float32(0.0)
            for j in range(K):
                p = d[t * K + j]
                if p < 0:
                    continue
                acc = np.float32(acc + np.float32(np.float32(w[t][j]) * np.float32(eo[p][h])))
            row.append(float(acc))
        out.append(row)
    return torch.tensor(out, dtype=torch.float32).reshape(T, H).to(expert_out.dtype)


def rand_hidden(T, H, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # non-zero rows, distinct per token, so a misplaced or zeroed row cannot pass
    return (torch.randn(T, H, generator=g) + 3.0).to(dtype)


# --------------------------------------------------------------------- hand cases
def test_doc_example_by_hand():
    hidden = torch.arange(6.0).reshape(3, 2)
    ids = torch.tensor([[1, 0], [1, -1], [0, 1]], dtype=torch.int32)
    p = permute(hidden, ids, 2)
    assert p.offsets.tolist() == [0, 2, 5]
    assert p.src_row.tolist() == [1, 4, 0, 2, 5, -1]
    assert p.dst_pos.tolist() == [2, 0, 3, -1, 1, 4]
    assert p.hidden.tolist() == [[0, 1], [4, 5], [0, 1], [2, 3], [4, 5], [0, 0]]


def test_expert_map_holes_and_align4_by_hand():
    # map: global 0 -> local 1, global 2 -> local 0, globals 1 and 3 live elsewhere.
    hidden = torch.tensor([[1.0, -1.0], [2.0, -2.0], [3.0, -3.0]], dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [-1, 0]], dtype=torch.int64)
    emap = torch.tensor([1, -1, 0, -1], dtype=torch.int32)
    p = permute(hidden, ids, 4, expert_map=emap, n_local_experts=2, align=4)
    # rows: r0 -> 1, r1 drop, r2 -> 0, r3 drop, r4 drop (-1 id), r5 -> 1; capacity 6 + 2*3 = 12
    assert p.offsets.tolist() == [0, 4, 8]
    assert p.src_row.tolist() == [2, -1, -1, -1, 0, 5, -1, -1, -1, -1, -1, -1]
    assert p.dst_pos.tolist() == [4, -1, 0, -1, -1, 5]
    want = torch.zeros(12, 2, dtype=torch.bfloat16)
    want[0] = hidden[1]
    want[4] = hidden[0]
    want[5] = hidden[2]
    assert p.hidden.dtype == torch.bfloat16 and torch.equal(p.hidden, want)


def test_empty_experts_and_all_dropped_by_hand():
    hidden = torch.ones(2, 3)
    p = permute(hidden, torch.tensor([[2], [2]], dtype=torch.int32), 4, align=2)
    assert p.offsets.tolist() == [0, 0, 0, 2, 2]
    assert p.src_row.tolist() == [0, 1] + [-1] * 4  # capacity 2 + 4*(2-1)
    p = permute(hidden, torch.full((2, 1), -1, dtype=torch.int32), 4, align=3)
    assert p.offsets.tolist() == [0] * 5
    assert p.src_row.tolist() == [-1] * (2 + 4 * 2)
    assert p.dst_pos.tolist() == [-1, -1]
    assert torch.equal(p.hidden, torch.zeros(10, 3))


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("align", [1, 4])
@pytest.mark.parametrize("use_map", [False, True])
def test_matches_hand_loop(ids_dtype, align, use_map):
    T, K, E = 11, 3, 6
    g = torch.Generator().manual_seed(align * 10 + use_map)
    ids = torch.randint(-1, E, (T, K), generator=g).to(ids_dtype)
    hidden = rand_hidden(T, 5, seed=3)
    if use_map:
        emap = torch.tensor([2, -1, 0, 3, -1, 1], dtype=torch.int32)
        got = permute(hidden, ids, E, expert_map=emap, n_local_experts=4, align=align)
        want = hand_permute(hidden, ids, emap.tolist(), 4, align)
    else:
        got = permute(hidden, ids, E, align=align)
        want = hand_permute(hidden, ids, None, E, align)
    assert_permuted_equal(got, want)


def test_t0():
    p = permute(torch.empty(0, 4), torch.empty(0, 2, dtype=torch.int32), 3, align=4)
    assert p.offsets.tolist() == [0, 0, 0, 0]
    assert p.hidden.shape == (9, 4) and torch.equal(p.hidden, torch.zeros(9, 4))
    assert p.src_row.tolist() == [-1] * 9 and p.dst_pos.shape == (0,)
    out = unpermute(p.hidden, torch.empty(0, 2), p.dst_pos)
    assert out.shape == (0, 4) and out.dtype == torch.float32


def test_outputs_are_fresh_and_typed():
    hidden = rand_hidden(4, 3, torch.float16)
    ids = torch.tensor([[0, 1]] * 4)
    p = permute(hidden, ids, 2)
    assert isinstance(p, Permuted) and p._fields == ("offsets", "hidden", "src_row", "dst_pos")
    assert (p.offsets.dtype, p.hidden.dtype, p.src_row.dtype, p.dst_pos.dtype) == (
        torch.int64, torch.float16, torch.int32, torch.int32)
    assert p.hidden.untyped_storage().data_ptr() != hidden.untyped_storage().data_ptr()


def test_vectorized_fast_enough():
    T, K, E = 2000, 8, 64
    hidden = torch.randn(T, 256, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, K), dtype=torch.int32)
    t0 = time.perf_counter()
    p = permute(hidden, ids, E, align=16)
    out = unpermute(p.hidden, torch.full((T, K), 1.0 / K), p.dst_pos)
    assert time.perf_counter() - t0 < 1.0
    assert out.shape == (T, 256)


# ----------------------------------------------------------------- hypothesis props
@st.composite
def permute_case(draw):
    T = draw(st.integers(0, 12))
    K = draw(st.integers(1, 4))
    E = draw(st.integers(1, 6))
    align = draw(st.integers(1, 5))
    H = draw(st.integers(1, 3))
    use_map = draw(st.booleans())
    ids = draw(st.lists(st.lists(st.integers(-1, E - 1), min_size=K, max_size=K), min_size=T, max_size=T))
    if use_map:
        E_loc = draw(st.integers(1, 4))
        emap = draw(st.lists(st.integers(-1, E_loc - 1), min_size=E, max_size=E))
    else:
        E_loc, emap = E, None
    ids_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    seed = draw(st.integers(0, 2**16))
    ids_t = torch.tensor(ids, dtype=ids_dtype).reshape(T, K)
    return dict(T=T, K=K, E=E, E_loc=E_loc, align=align, H=H, ids=ids_t, emap=emap,
                hidden=rand_hidden(T, H, dtype, seed))


def run_case(c, scratch=None):
    kw = {}
    if c["emap"] is not None:
        kw = dict(expert_map=torch.tensor(c["emap"], dtype=torch.int32), n_local_experts=c["E_loc"])
    return permute(c["hidden"], c["ids"], c["E"], align=c["align"], scratch=scratch, **kw)


def expected(c):
    return hand_permute(c["hidden"], c["ids"], c["emap"], c["E_loc"], c["align"])


@SETTINGS
@given(permute_case())
def test_prop_matches_hand_loop(c):
    assert_permuted_equal(run_case(c), expected(c))


@SETTINGS
@given(permute_case())
def test_prop_structure(c):
    p = run_case(c)
    T, K, E_loc, align = c["T"], c["K"], c["E_loc"], c["align"]
    cap = T * K + E_loc * (align - 1)
    # offsets = histogram of local experts (torch.bincount), each padded up to align
    glob = c["ids"].reshape(-1).long()
    if c["emap"] is None:
        local = glob
    else:
        local = torch.tensor(c["emap"] + [-1], dtype=torch.long)[glob]  # id -1 picks the appended -1
    hist = torch.bincount(local[local >= 0], minlength=E_loc)
    assert p.offsets[0].item() == 0
    assert torch.equal(p.offsets.diff(), ((hist + align - 1) // align) * align)
    P = int(p.offsets[-1])
    assert P <= cap and p.hidden.shape == (cap, c["H"]) and p.src_row.shape == (cap,)
    assert p.dst_pos.shape == (T * K,)
    # src_row and dst_pos are inverse maps; dropped rows are exactly the unmapped ones
    for r, pos in enumerate(p.dst_pos.tolist()):
        if pos >= 0:
            assert p.src_row[pos].item() == r
        else:
            assert local[r].item() == -1
    for pos, r in enumerate(p.src_row.tolist()):
        if r >= 0:
            assert p.dst_pos[r].item() == pos
            assert torch.equal(p.hidden[pos], c["hidden"][r // K])
        else:
            assert torch.count_nonzero(p.hidden[pos]).item() == 0  # padding / unused rows are zero
    assert (p.src_row[P:] == -1).all()
    # within each segment rows increase (stable) and all belong to that expert
    for e in range(E_loc):
        rows = [r for r in p.src_row[p.offsets[e]:p.offsets[e + 1]].tolist() if r >= 0]
        assert rows == sorted(rows)
        assert all(local[r].item() == e for r in rows)


@SETTINGS
@given(permute_case(), st.data())
def test_prop_roundtrip_one_hot(c, data):
    p = run_case(c)
    T, K = c["T"], c["K"]
    kept = (p.dst_pos.reshape(T, K) >= 0).tolist()
    weights = torch.zeros(T, K)
    has_one = []
    for t in range(T):
        choices = [j for j in range(K) if kept[t][j]]
        if choices:
            weights[t, data.draw(st.sampled_from(choices))] = 1.0
        has_one.append(bool(choices))
    out = unpermute(p.hidden, weights, p.dst_pos)
    assert out.dtype == c["hidden"].dtype and out.shape == c["hidden"].shape
    for t in range(T):
        want = c["hidden"][t] if has_one[t] else torch.zeros_like(c["hidden"][t])
        assert torch.equal(out[t], want)


def test_roundtrip_k1_exact():
    hidden = rand_hidden(9, 7, torch.bfloat16, seed=5)
    ids = torch.tensor([[3], [0], [3], [1], [2], [0], [3], [1], [1]], dtype=torch.int32)
    p = permute(hidden, ids, 4, align=4)
    assert torch.equal(unpermute(p.hidden, torch.ones(9, 1), p.dst_pos), hidden)


# ------------------------------------------------------------------------ scratch
def make_scratch(c, max_tokens, **over):
    """A scratch that fits case c for up to max_tokens tokens, with `over` fields changed."""
    kw = dict(max_tokens=max_tokens, top_k=c["K"], n_experts=c["E"], hidden_size=c["H"],
              dtype=c["hidden"].dtype, device="cpu", n_local_experts=c["E_loc"], align=c["align"])
    kw.update(over)
    pos = [kw.pop(k) for k in ("max_tokens", "top_k", "n_experts", "hidden_size", "dtype", "device")]
    return PermuteScratch(*pos, **kw)


def poison(s: PermuteScratch):
    s.hidden.fill_(float("nan"))
    s.src_row.fill_(12345)
    s.dst_pos.fill_(-777)
    s.offsets.fill_(999)


@SETTINGS
@given(permute_case(), st.integers(0, 5))
def test_prop_scratch_equals_hand_and_writes_everything(c, extra):
    s = make_scratch(c, c["T"] + extra)
    poison(s)
    got = run_case(c, scratch=s)
    assert_permuted_equal(got, expected(c))  # torch.equal: a stale NaN / 12345 / -777 / 999 fails
    assert not torch.isnan(got.hidden).any()


def test_scratch_outputs_share_storage():
    c = dict(T=5, K=2, E=4, E_loc=4, align=4, H=3, emap=None, hidden=rand_hidden(5, 3),
             ids=torch.tensor([[0, 1], [1, 2], [3, 3], [0, -1], [2, 1]], dtype=torch.int32))
    s = make_scratch(c, 16)
    assert s.hidden.shape == (16 * 2 + 4 * 3, 3) and s.src_row.shape == (44,)
    assert s.dst_pos.shape == (32,) and s.offsets.shape == (5,)
    p = run_case(c, scratch=s)
    for name in ("offsets", "hidden", "src_row", "dst_pos"):
        assert getattr(p, name).data_ptr() == getattr(s, name).data_ptr(), name
    assert p.hidden.shape == (10 + 12, 3) and p.src_row.shape == (22,) and p.dst_pos.shape == (10,)
    assert_permuted_equal(p, expected(c))
    # a second, smaller call reuses the same storage and is still exact
    poison(s)
    c2 = dict(c, T=2, hidden=rand_hidden(2, 3, seed=9), ids=torch.tensor([[3, 0], [3, -1]], dtype=torch.int32))
    p2 = run_case(c2, scratch=s)
    assert p2.hidden.data_ptr() == s.hidden.data_ptr() and p2.src_row.data_ptr() == s.src_row.data_ptr()
    assert_permuted_equal(p2, expected(c2))


def test_scratch_t0_and_defaults():
    s = PermuteScratch(4, 2, 3, 5, torch.bfloat16, torch.device("cpu"))
    assert (s.max_tokens, s.top_k, s.n_experts, s.n_local_experts, s.hidden_size, s.dtype, s.device, s.align) == (
        4, 2, 3, 3, 5, torch.bfloat16, torch.device("cpu"), 1)
    poison(s)
    p = permute(torch.empty(0, 5, dtype=torch.bfloat16), torch.empty(0, 2, dtype=torch.int32), 3, scratch=s)
    assert p.offsets.tolist() == [0, 0, 0, 0] and p.hidden.shape == (0, 5) and p.dst_pos.shape == (0,)


def test_scratch_with_expert_map():
    hidden = rand_hidden(3, 2)
    ids = torch.tensor([[0, 1], [2, 3], [-1, 0]])
    emap = torch.tensor([1, -1, 0, -1], dtype=torch.int32)
    s = PermuteScratch(8, 2, 4, 2, torch.float32, "cpu", n_local_experts=2, align=4)
    poison(s)
    p = permute(hidden, ids, 4, expert_map=emap, n_local_experts=2, align=4, scratch=s)
    assert_permuted_equal(p, hand_permute(hidden, ids, emap.tolist(), 2, 4))


@pytest.mark.parametrize("field,over", [
    ("max_tokens", dict(max_tokens=2)),
    ("top_k", dict(top_k=3)),
    ("n_experts", dict(n_experts=5, n_local_experts=4)),
    ("n_local_experts", dict(n_local_experts=5)),
    ("hidden_size", dict(hidden_size=4)),
    ("dtype", dict(dtype=torch.bfloat16)),
    ("device", dict(device="meta")),
    ("align", dict(align=1)),
])
def test_scratch_mismatch_raises(field, over):
    c = dict(T=3, K=2, E=4, E_loc=4, align=2, H=3, emap=None, hidden=rand_hidden(3, 3),
             ids=torch.tensor([[0, 1], [2, 3], [1, 1]]))
    run_case(c, scratch=make_scratch(c, 8))  # the unmodified scratch fits
    over = dict(over)
    s = make_scratch(c, over.pop("max_tokens", 8), **over)
    with pytest.raises(ValueError, match=rf"^permute: argument 'scratch'.*{field}"):
        run_case(c, scratch=s)


def test_scratch_mismatch_n_local_with_map():
    hidden = rand_hidden(2, 2)
    ids = torch.tensor([[0], [1]])
    emap = torch.tensor([0, 1], dtype=torch.int32)
    s = PermuteScratch(4, 1, 2, 2, torch.float32, "cpu", n_local_experts=3)
    with pytest.raises(ValueError, match=r"^permute: argument 'scratch'.*n_local_experts"):
        permute(hidden, ids, 2, expert_map=emap, n_local_experts=2, scratch=s)


# ---------------------------------------------------------------------- unpermute
def test_unpermute_order_and_f32_accumulation_by_hand():
    # 1 + 2^-24 + 2^-24 in f32, increasing j: each add is a tie that rounds to even -> 1.
    # f64 accumulation, or adding the small terms first, would give 1 + 2^-23.
    eo = torch.tensor([[1.0], [2.0**-24], [2.0**-24]])
    w = torch.ones(1, 3)
    assert unpermute(eo, w, torch.tensor([0, 1, 2], dtype=torch.int32)).item() == 1.0
    assert unpermute(eo, w, torch.tensor([1, 2, 0], dtype=torch.int32)).item() == 1.0 + 2.0**-23


def test_unpermute_rounds_once_to_output_dtype():
    # bf16 terms 1 and 2^-8 + 2^-16: f32 sum 1 + 2^-8 + 2^-16 rounds up to 1 + 2^-7 in bf16;
    # rounding after each term would give 1 (the tie 1 + 2^-8 goes to even).
    eo = torch.tensor([[1.0], [2.0**-8], [2.0**-16]], dtype=torch.bfloat16)
    out = unpermute(eo, torch.ones(1, 3), torch.tensor([0, 1, 2], dtype=torch.int32))
    assert out.dtype == torch.bfloat16 and out.item() == 1.0 + 2.0**-7


def test_unpermute_dropped_rows_ignored_even_nan():
    eo = torch.tensor([[float("nan")], [2.0], [float("inf")], [3.0]])
    w = torch.tensor([[0.5, 7.0, 0.25]])
    assert unpermute(eo, w, torch.tensor([1, -1, 3], dtype=torch.int32)).tolist() == [[0.5 * 2.0 + 0.25 * 3.0]]
    assert unpermute(eo, w, torch.tensor([-1, -1, -1], dtype=torch.int32)).tolist() == [[0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unpermute_matches_hand_loop(dtype):
    g = torch.Generator().manual_seed(7)
    T, K, H, cap = 6, 4, 5, 30
    eo = (torch.randn(cap, H, generator=g) * 3).to(dtype)
    w = torch.rand(T, K, generator=g)
    dst = torch.randperm(cap, generator=g)[: T * K].to(torch.int32)
    dst[torch.tensor([1, 5, 6, 13])] = -1
    got = unpermute(eo, w, dst)
    assert got.dtype == dtype and got.shape == (T, H)
    assert torch.equal(got, hand_unpermute(eo, w, dst))


@SETTINGS
@given(st.integers(0, 6), st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**16),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_prop_unpermute_matches_hand_loop(T, K, H, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    cap = T * K + 3
    eo = (torch.randn(cap, H, generator=g) * 10).to(dtype)
    w = torch.randn(T, K, generator=g)
    dst = torch.randint(-1, cap, (T * K,), generator=g).to(torch.int32)
    assert torch.equal(unpermute(eo, w, dst), hand_unpermute(eo, w, dst))


# ------------------------------------------------------------------- error tables
def _h(T=3, H=2, dtype=torch.float32):
    return torch.ones(T, H, dtype=dtype)


def _ids(vals=((0, 1), (1, 0), (0, 0)), dtype=torch.int32):
    return torch.tensor(vals, dtype=dtype)


_map = torch.tensor([0, -1], dtype=torch.int32)
_i32 = dict(dtype=torch.int32)

PERMUTE_ERRORS = [
    ("hidden 1-D", lambda: permute(torch.ones(3), _ids(), 2), "hidden"),
    ("hidden int dtype", lambda: permute(_h().int(), _ids(), 2), "hidden"),
    ("hidden float64", lambda: permute(_h().double(), _ids(), 2), "hidden"),
    ("hidden not a tensor", lambda: permute([[1.0]], _ids(((0,),)), 2), "hidden"),
    ("ids float", lambda: permute(_h(), _ids().float(), 2), "ids"),
    ("ids int16", lambda: permute(_h(), _ids().to(torch.int16), 2), "ids"),
    ("ids 1-D", lambda: permute(_h(), torch.tensor([0, 1, 0], **_i32), 2), "ids"),
    ("ids wrong T", lambda: permute(_h(), _ids(((0, 1),)), 2), "ids"),
    ("ids K = 0", lambda: permute(_h(), torch.empty(3, 0, **_i32), 2), "ids"),
    ("id >= n_experts", lambda: permute(_h(), _ids(((0, 2), (0, 0), (0, 0))), 2), "ids"),
    ("id < -1", lambda: permute(_h(), _ids(((0, -2), (0, 0), (0, 0))), 2), "ids"),
    ("ids on another device", lambda: permute(_h(), _ids().to("meta"), 2), "ids"),
    ("n_experts 0", lambda: permute(_h(), _ids(((-1, -1),) * 3), 0), "n_experts"),
    ("n_experts float", lambda: permute(_h(), _ids(), 2.0), "n_experts"),
    ("align 0", lambda: permute(_h(), _ids(), 2, align=0), "align"),
    ("align float", lambda: permute(_h(), _ids(), 2, align=1.5), "align"),
    ("map without n_local_experts", lambda: permute(_h(), _ids(), 2, expert_map=_map), "n_local_experts"),
    ("n_local_experts without map", lambda: permute(_h(), _ids(), 2, n_local_experts=1), "n_local_experts"),
    ("n_local_experts 0", lambda: permute(_h(), _ids(), 2, expert_map=_map, n_local_experts=0),
     "n_local_experts"),
    ("map int64", lambda: permute(_h(), _ids(), 2, expert_map=_map.long(), n_local_experts=1), "expert_map"),
    ("map wrong length", lambda: permute(_h(), _ids(), 2, expert_map=torch.zeros(3, **_i32),
                                         n_local_experts=1), "expert_map"),
    ("map entry >= n_local", lambda: permute(_h(), _ids(), 2, expert_map=torch.tensor([0, 1], **_i32),
                                             n_local_experts=1), "expert_map"),
    ("scratch not a PermuteScratch", lambda: permute(_h(), _ids(), 2, scratch=object()), "scratch"),
]


def _unp(eo=(4, 2), w=(2, 1), dst=(0, 1), eo_dtype=torch.float32, w_dtype=torch.float32,
         dst_dtype=torch.int32, w_device="cpu"):
    return lambda: unpermute(torch.ones(*eo, dtype=eo_dtype), torch.ones(*w, dtype=w_dtype, device=w_device),
                             torch.tensor(dst, dtype=dst_dtype))


UNPERMUTE_ERRORS = [
    ("expert_out 1-D", _unp(eo=(4,)), "expert_out"),
    ("expert_out int", _unp(eo_dtype=torch.int32), "expert_out"),
    ("expert_out float64", _unp(eo_dtype=torch.float64), "expert_out"),
    ("weights bf16", _unp(w_dtype=torch.bfloat16), "weights"),
    ("weights 1-D", _unp(w=(2,)), "weights"),
    ("weights other device", _unp(w_device="meta"), "weights"),
    ("dst_pos int64", _unp(dst_dtype=torch.int64), "dst_pos"),
    ("dst_pos wrong length", _unp(w=(2, 2)), "dst_pos"),
    ("dst_pos 2-D", _unp(dst=((0,), (1,))), "dst_pos"),
    ("dst_pos >= rows", _unp(dst=(0, 4)), "dst_pos"),
    ("dst_pos < -1", _unp(dst=(0, -2)), "dst_pos"),
]


def _scratch(**over):
    kw = dict(max_tokens=4, top_k=2, n_experts=3, hidden_size=8, dtype=torch.float32, device="cpu")
    kw.update(over)
    pos = [kw.pop(k) for k in ("max_tokens", "top_k", "n_experts", "hidden_size", "dtype", "device")]
    return lambda: PermuteScratch(*pos, **kw)


SCRATCH_ERRORS = [
    ("max_tokens -1", _scratch(max_tokens=-1), "max_tokens"),
    ("max_tokens float", _scratch(max_tokens=4.0), "max_tokens"),
    ("top_k 0", _scratch(top_k=0), "top_k"),
    ("top_k bool", _scratch(top_k=True), "top_k"),
    ("n_experts 0", _scratch(n_experts=0), "n_experts"),
    ("hidden_size -1", _scratch(hidden_size=-1), "hidden_size"),
    ("dtype int32", _scratch(dtype=torch.int32), "dtype"),
    ("dtype float64", _scratch(dtype=torch.float64), "dtype"),
    ("dtype a string", _scratch(dtype="float32"), "dtype"),
    ("device bogus", _scratch(device="bogus"), "device"),
    ("device not a device", _scratch(device=3.5), "device"),
    ("n_local_experts 0", _scratch(n_local_experts=0), "n_local_experts"),
    ("align 0", _scratch(align=0), "align"),
]


def _cases(table, op):
    return [pytest.param(fn, op, arg, id=f"{op}: {desc}") for desc, fn, arg in table]


@pytest.mark.parametrize("fn,op,arg", _cases(PERMUTE_ERRORS, "permute") + _cases(UNPERMUTE_ERRORS, "unpermute")
                         + _cases(SCRATCH_ERRORS, "PermuteScratch"))
def test_error_inputs(fn, op, arg):
    with pytest.raises(ValueError) as ei:
        fn()
    msg = str(ei.value)
    assert msg.startswith(op + ":") and f"'{arg}'" in msg, msg


def test_error_tables_large_enough():
    assert min(len(PERMUTE_ERRORS), len(UNPERMUTE_ERRORS), len(SCRATCH_ERRORS)) >= 5
