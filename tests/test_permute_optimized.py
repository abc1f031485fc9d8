"""optimized.permute / unpermute / PermuteScratch against reference.permute (SPEC 2).

Every output is exact (the layout is a stable sort; unpermute's f32 order is fixed and has
no FMA), so every comparison here is bit for bit, at every ISA level and thread count.
Also: the scratch path allocates nothing (allocator events counted with torch.profiler)
and survives poisoned buffers; the error inputs of the reference raise the same errors; the
C++ ops reject hostile direct calls with RuntimeError; opcheck and torch.compile.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.profiler import ProfilerActivity, profile

import optimized
from reference.validate import capacity
from tests import levels

ref = importlib.import_module("reference.permute")  # the module: the package exports a function of that name

SETTINGS = settings(max_examples=60, deadline=None)
ISAS = list(levels.LEVELS)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
ops = torch.ops.moelab


@pytest.fixture(params=ISAS)
def isa(request):
    with levels.capped(request.param):
        yield request.param


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor: equality is then bitwise (-0.0 != +0.0, NaN == NaN)."""
    return t.view(BITS[t.dtype]) if t.dtype in BITS else t


def assert_same(got, want, what=""):
    assert type(got) is type(want), what
    for name, g, w in zip(getattr(want, "_fields", None) or range(len(want)), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (what, name, g.dtype, w.dtype, g.shape, w.shape)
        assert torch.equal(bits(g), bits(w)), (what, name)


def make_case(T, K, E, H, dtype, *, align=1, e_loc=None, drop=0.1, ids_dtype=torch.int32, seed=0):
    """Inputs with -1 ids (drop rate `drop`) and, when e_loc is given, an expert_map with holes."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[torch.rand(T, K, generator=g) < drop] = -1
    kw = dict(align=align)
    if e_loc is not None:
        emap = torch.randint(0, e_loc, (E,), generator=g)
        emap[torch.rand(E, generator=g) < 0.3] = -1         # holes: experts on other ranks
        kw.update(expert_map=emap.to(torch.int32), n_local_experts=e_loc)
    return hidden, ids.to(ids_dtype), kw


def check_both(hidden, ids, E, kw, what=""):
    want = ref.permute(hidden, ids, E, **kw)
    got = optimized.permute(hidden, ids, E, **kw)
    assert_same(got, want, what)
    T, K = ids.shape
    w = torch.rand(T, K, generator=torch.Generator().manual_seed(T * 7 + K)) * 2 - 0.5
    eo = torch.randn(want.hidden.shape, generator=torch.Generator().manual_seed(3)).to(hidden.dtype)
    assert torch.equal(bits(optimized.unpermute(eo, w, want.dst_pos)), bits(ref.unpermute(eo, w, want.dst_pos))), what
    return want


# ------------------------------------------------------------------ differential, exact
# T on tile/grain boundaries; H around the 64/256-byte move widths and the 16/64-float
# unpermute chunks (odd and even); K 1..8; E 1..256.
SHAPES = [
    (0, 1, 1, 8), (0, 4, 16, 33), (1, 1, 1, 1), (1, 8, 256, 4096), (2, 2, 3, 3), (3, 3, 7, 16),
    (7, 8, 64, 17), (15, 5, 31, 31), (16, 6, 256, 32), (17, 7, 64, 33), (63, 2, 8, 63),
    (64, 8, 64, 64), (65, 4, 9, 65), (127, 3, 128, 127), (129, 8, 256, 129), (33, 1, 2, 255),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,K,E,H", SHAPES)
def test_matches_reference_every_isa(isa, dtype, T, K, E, H):
    for align, e_loc, ids_dtype in ((1, None, torch.int32), (3, None, torch.int64),
                                    (16, max(1, E // 2), torch.int32), (1, E + 2, torch.int64)):
        hidden, ids, kw = make_case(T, K, E, H, dtype, align=align, e_loc=e_loc, ids_dtype=ids_dtype, seed=T + H)
        check_both(hidden, ids, E, kw, f"{isa} {dtype} T={T} K={K} E={E} H={H} align={align} e_loc={e_loc}")


@st.composite
def cases(draw):
    T = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 16, 31, 64, 100]))
    K = draw(st.integers(1, 8))
    E = draw(st.sampled_from([1, 2, 3, 8, 17, 64, 256]))
    H = draw(st.sampled_from([1, 2, 7, 16, 31, 64, 65, 130, 257]))
    dtype = draw(st.sampled_from(DTYPES))
    align = draw(st.sampled_from([1, 2, 3, 16]))
    e_loc = draw(st.sampled_from([None, 1, max(1, E // 3), E + 1]))
    drop = draw(st.sampled_from([0.0, 0.2, 1.0]))
    ids_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    seed = draw(st.integers(0, 2**16))
    return T, K, E, H, dtype, align, e_loc, drop, ids_dtype, seed


@SETTINGS
@given(c=cases(), isa_name=st.sampled_from(ISAS))
def test_prop_matches_reference(c, isa_name):
    T, K, E, H, dtype, align, e_loc, drop, ids_dtype, seed = c
    hidden, ids, kw = make_case(T, K, E, H, dtype, align=align, e_loc=e_loc, drop=drop, ids_dtype=ids_dtype,
                                seed=seed)
    with levels.capped(levels.clamp(isa_name)):
        check_both(hidden, ids, E, kw, repr(c))


def test_t0_shapes():
    for kw in (dict(), dict(align=4), dict(expert_map=torch.tensor([1, -1, 0], dtype=torch.int32),
                                          n_local_experts=2, align=3)):
        p = optimized.permute(torch.empty(0, 5, dtype=torch.bfloat16), torch.empty(0, 2, dtype=torch.int32), 3, **kw)
        e_loc = kw.get("n_local_experts", 3)
        cap = e_loc * (kw.get("align", 1) - 1)
        assert p.offsets.tolist() == [0] * (e_loc + 1)
        assert p.hidden.shape == (cap, 5) and p.src_row.shape == (cap,) and p.dst_pos.shape == (0,)
        assert bool((p.hidden == 0).all()) and bool((p.src_row == -1).all())
    out = optimized.unpermute(torch.zeros(3, 5), torch.empty(0, 2), torch.empty(0, dtype=torch.int32))
    assert out.shape == (0, 5) and out.dtype == torch.float32


def test_noncontiguous_inputs(isa):
    T, K, E, H = 20, 4, 9, 40
    hidden, ids, kw = make_case(T, K, E, H, torch.float16, align=2, e_loc=5, seed=1)
    wide = torch.zeros(T, 2 * H, dtype=hidden.dtype)
    wide[:, :H] = hidden                                    # row stride 2H
    col = hidden.t().contiguous().t()                       # stride(1) != 1: copied by the wrapper
    ids_t = ids.t().contiguous().t()                        # column-major ids
    emap = torch.stack([kw["expert_map"], kw["expert_map"]], 1)[:, 0]  # map with stride 2
    kw2 = dict(kw, expert_map=emap)
    want = ref.permute(hidden, ids, E, **kw)
    for h in (wide[:, :H], col):
        assert_same(optimized.permute(h, ids_t, E, **kw2), want, "strided")
    w = torch.rand(K, T).t()                                # weights column-major
    eo = torch.randn(want.hidden.shape[0], 2 * H).to(hidden.dtype)[:, 1:H + 1]
    dst = torch.stack([want.dst_pos, want.dst_pos], 1)[:, 1]
    assert torch.equal(bits(optimized.unpermute(eo, w, dst)), bits(ref.unpermute(eo, w, want.dst_pos)))


def test_layout_by_hand():
    # SPEC/reference doc example, worked by hand: rows r = t*K + j, row 3 dropped.
    hidden = torch.arange(6.0).reshape(3, 2)
    p = optimized.permute(hidden, torch.tensor([[1, 0], [1, -1], [0, 1]]), 2)
    assert p.offsets.tolist() == [0, 2, 5]
    assert p.src_row.tolist() == [1, 4, 0, 2, 5, -1]
    assert p.dst_pos.tolist() == [2, 0, 3, -1, 1, 4]
    assert p.hidden.tolist() == [[0, 1], [4, 5], [0, 1], [2, 3], [4, 5], [0, 0]]
    # align 2 with a map that drops expert 1 and swaps nothing: segment of 0 = rows 1, 4, pad.
    p = optimized.permute(hidden, torch.tensor([[1, 0], [1, -1], [0, 1]]), 2, align=2,
                          expert_map=torch.tensor([0, -1], dtype=torch.int32), n_local_experts=1)
    assert p.offsets.tolist() == [0, 2] and p.src_row.tolist() == [1, 4, -1, -1, -1, -1, -1]
    assert p.dst_pos.tolist() == [-1, 0, -1, -1, 1, -1]


def test_unpermute_f32_order_no_fma_by_hand():
    # acc = -1 after j = 0; then acc + w*x with w = x = 1 + 2^-12: w*x = 1 + 2^-11 + 2^-24 rounds
    # (tie to even) to 1 + 2^-11 in f32, so the sum is 2^-11. A fused multiply-add would keep
    # the 2^-24 and give 2^-11 + 2^-24.
    x = w = 1.0 + 2.0**-12             # exact in f32
    eo = torch.tensor([[-1.0], [x]], dtype=torch.float32)
    dst = torch.tensor([0, 1], dtype=torch.int32)
    for name in levels.below_ceiling():
        with levels.capped(name):
            got = optimized.unpermute(eo, torch.tensor([[1.0, w]]), dst).item()
        assert got == 2.0**-11, (name, got)
        assert ref.unpermute(eo, torch.tensor([[1.0, w]]), dst).item() == 2.0**-11
    # A token whose only kept term is -0.0 gets +0.0 (acc starts at +0), dropped rows ignored even if NaN.
    eo = torch.tensor([[-0.0, 1.0], [float("nan"), float("nan")]])
    out = optimized.unpermute(eo, torch.tensor([[1.0, 5.0]]), torch.tensor([0, -1], dtype=torch.int32))
    assert torch.equal(bits(out), bits(torch.tensor([[0.0, 1.0]])))


# ------------------------------------------------------------------ threads
def test_one_and_two_threads_identical(threads):
    # Large enough that the row copies and the token loop split across both threads, and that
    # the fresh output (12 MB) takes the huge-page advice.
    T, K, E, H = 300, 8, 64, 2048
    hidden, ids, kw = make_case(T, K, E, H, torch.bfloat16, align=16, e_loc=40, seed=5)
    w = torch.rand(T, K)
    res = []
    for n in (1, 2):
        torch.set_num_threads(n)
        p = optimized.permute(hidden, ids, E, **kw)
        res.append((p, optimized.unpermute(p.hidden, w, p.dst_pos)))
    assert_same(res[0][0], res[1][0], "threads")
    assert torch.equal(bits(res[0][1]), bits(res[1][1]))
    assert_same(res[0][0], ref.permute(hidden, ids, E, **kw), "vs reference")


# ------------------------------------------------------------------ scratch
def poison(s: optimized.PermuteScratch) -> None:
    s.hidden.fill_(float("nan"))
    for buf in (s.offsets, s.src_row, s.dst_pos, s.counts):
        buf.fill_(-12345 if buf.dtype == torch.int32 else 1 << 40)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scratch_reuse_poisoned(dtype):
    E, K, H, e_loc, align = 19, 4, 33, 7, 3
    s = optimized.PermuteScratch(50, K, E, H, dtype, "cpu", n_local_experts=e_loc, align=align)
    for T in (50, 0, 1, 17, 50, 3, 17):
        hidden, ids, kw = make_case(T, K, E, H, dtype, align=align, e_loc=e_loc, seed=T)
        poison(s)
        got = optimized.permute(hidden, ids, E, scratch=s, **kw)
        assert_same(got, ref.permute(hidden, ids, E, **kw), f"T={T}")
        cap = capacity(T, K, e_loc, align)
        # Views of the scratch's buffers, not copies.
        assert got.offsets.data_ptr() == s.offsets.data_ptr()
        for out, buf in ((got.hidden, s.hidden), (got.src_row, s.src_row), (got.dst_pos, s.dst_pos)):
            assert out.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert out.numel() == 0 or out.data_ptr() == buf.data_ptr()
        assert got.hidden.shape[0] == cap and got.dst_pos.shape[0] == T * K


def _allocations(fn) -> list:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage != 0]


def test_scratch_call_allocates_nothing():
    E, K, H = 64, 8, 256
    hidden, ids, kw = make_case(8, K, E, H, torch.bfloat16, align=4, e_loc=32, seed=2)
    s = optimized.PermuteScratch(8, K, E, H, torch.bfloat16, "cpu", n_local_experts=32, align=4)
    optimized.permute(hidden, ids, E, scratch=s, **kw)      # first call of this T makes the views
    got = []
    assert _allocations(lambda: got.append(optimized.permute(hidden, ids, E, scratch=s, **kw))) == []
    assert_same(got[0], ref.permute(hidden, ids, E, **kw))
    # The counter sees allocations when there are some (so the check above can fail).
    assert len(_allocations(lambda: optimized.permute(hidden, ids, E, **kw))) >= 4


@pytest.mark.parametrize("field,value", [("max_tokens", 7), ("top_k", 3), ("n_experts", 65), ("hidden_size", 255),
                                         ("dtype", torch.float16), ("align", 2), ("n_local_experts", 31)])
def test_scratch_misfit_raises(field, value):
    E, K, H, T = 64, 8, 256, 8
    hidden, ids, kw = make_case(T, K, E, H, torch.bfloat16, e_loc=32, seed=2)
    args = dict(max_tokens=T, top_k=K, n_experts=E, hidden_size=H, dtype=torch.bfloat16, device="cpu",
                n_local_experts=32, align=1)
    args[field] = value
    pos = [args.pop(k) for k in ("max_tokens", "top_k", "n_experts", "hidden_size", "dtype", "device")]
    s, s_ref = optimized.PermuteScratch(*pos, **args), ref.PermuteScratch(*pos, **args)
    with pytest.raises(ValueError) as want:
        ref.permute(hidden, ids, E, scratch=s_ref, **kw)
    with pytest.raises(ValueError) as got:
        optimized.permute(hidden, ids, E, scratch=s, **kw)
    assert str(got.value) == str(want.value) and "'scratch'" in str(got.value) and field in str(got.value)


def test_scratch_of_the_reference_rejected():
    s = ref.PermuteScratch(4, 2, 3, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"^permute: argument 'scratch' must be an optimized.PermuteScratch"):
        optimized.permute(torch.ones(2, 8), torch.zeros(2, 2, dtype=torch.int32), 3, scratch=s)


def test_scratch_with_shrunken_buffer_raises_not_overflows():
    s = optimized.PermuteScratch(4, 2, 3, 8, torch.float32, "cpu")
    s.hidden = torch.zeros(3, 8)            # smaller than capacity(4, 2, 3, 1) = 8 rows
    s._views.clear()
    with pytest.raises(RuntimeError, match="hidden_out"):
        optimized.permute(torch.ones(4, 8), torch.zeros(4, 2, dtype=torch.int32), 3, scratch=s)
    assert bool((s.hidden == 0).all())


# ------------------------------------------------------------------ error inputs
def _h(T=3, H=2, dtype=torch.float32):
    return torch.ones(T, H, dtype=dtype)


def _ids(vals=((0, 1), (1, 0), (0, 0)), dtype=torch.int32):
    return torch.tensor(vals, dtype=dtype)


_i32 = dict(dtype=torch.int32)
_map = torch.tensor([0, -1], **_i32)

# (description, (args, kwargs), argument named in the message). Called on both modules.
PERMUTE_ERRORS = [
    ("hidden 1-D", ((torch.ones(3), _ids(), 2), {}), "hidden"),
    ("hidden int", ((_h().int(), _ids(), 2), {}), "hidden"),
    ("hidden float64", ((_h().double(), _ids(), 2), {}), "hidden"),
    ("hidden a list", (([[1.0]], _ids(((0,),)), 2), {}), "hidden"),
    ("ids float", ((_h(), _ids().float(), 2), {}), "ids"),
    ("ids int16", ((_h(), _ids().to(torch.int16), 2), {}), "ids"),
    ("ids 1-D", ((_h(), torch.tensor([0, 1, 0], **_i32), 2), {}), "ids"),
    ("ids wrong T", ((_h(), _ids(((0, 1),)), 2), {}), "ids"),
    ("ids K = 0", ((_h(), torch.empty(3, 0, **_i32), 2), {}), "ids"),
    ("id >= n_experts", ((_h(), _ids(((0, 2), (0, 0), (0, 0))), 2), {}), "ids"),
    ("id < -1 (int64)", ((_h(), _ids(((0, 0), (0, -2), (0, 0)), torch.int64), 2), {}), "ids"),
    ("ids on meta", ((_h(), _ids().to("meta"), 2), {}), "ids"),
    ("n_experts 0", ((_h(), _ids(((-1, -1),) * 3), 0), {}), "n_experts"),
    ("n_experts float", ((_h(), _ids(), 2.0), {}), "n_experts"),
    ("align 0", ((_h(), _ids(), 2), dict(align=0)), "align"),
    ("align float", ((_h(), _ids(), 2), dict(align=1.5)), "align"),
    ("map without n_local", ((_h(), _ids(), 2), dict(expert_map=_map)), "n_local_experts"),
    ("n_local without map", ((_h(), _ids(), 2), dict(n_local_experts=1)), "n_local_experts"),
    ("n_local 0", ((_h(), _ids(), 2), dict(expert_map=_map, n_local_experts=0)), "n_local_experts"),
    ("map int64", ((_h(), _ids(), 2), dict(expert_map=_map.long(), n_local_experts=1)), "expert_map"),
    ("map wrong length", ((_h(), _ids(), 2), dict(expert_map=torch.zeros(3, **_i32), n_local_experts=1)),
     "expert_map"),
    ("map entry >= n_local", ((_h(), _ids(), 2), dict(expert_map=torch.tensor([0, 1], **_i32), n_local_experts=1)),
     "expert_map"),
    ("map entry < -1", ((_h(), _ids(), 2), dict(expert_map=torch.tensor([0, -3], **_i32), n_local_experts=1)),
     "expert_map"),
]

UNPERMUTE_ERRORS = [
    ("expert_out 1-D", ((torch.ones(4), torch.ones(2, 1), torch.tensor([0, 1], **_i32)), {}), "expert_out"),
    ("expert_out int", ((torch.ones(4, 2, **_i32), torch.ones(2, 1), torch.tensor([0, 1], **_i32)), {}), "expert_out"),
    ("expert_out f64", ((torch.ones(4, 2).double(), torch.ones(2, 1), torch.tensor([0, 1], **_i32)), {}),
     "expert_out"),
    ("weights bf16", ((torch.ones(4, 2), torch.ones(2, 1).bfloat16(), torch.tensor([0, 1], **_i32)), {}), "weights"),
    ("weights 1-D", ((torch.ones(4, 2), torch.ones(2), torch.tensor([0, 1], **_i32)), {}), "weights"),
    ("weights meta", ((torch.ones(4, 2), torch.ones(2, 1, device="meta"), torch.tensor([0, 1], **_i32)), {}),
     "weights"),
    ("dst_pos int64", ((torch.ones(4, 2), torch.ones(2, 1), torch.tensor([0, 1])), {}), "dst_pos"),
    ("dst_pos wrong length", ((torch.ones(4, 2), torch.ones(2, 2), torch.tensor([0, 1], **_i32)), {}), "dst_pos"),
    ("dst_pos >= rows", ((torch.ones(4, 2), torch.ones(2, 1), torch.tensor([0, 4], **_i32)), {}), "dst_pos"),
    ("dst_pos < -1", ((torch.ones(4, 2), torch.ones(2, 1), torch.tensor([-2, 0], **_i32)), {}), "dst_pos"),
]


def _params(table, op):
    return [pytest.param(op, args, kwargs, arg, id=f"{op}: {desc}") for desc, (args, kwargs), arg in table]


@pytest.mark.parametrize("op,args,kwargs,arg", _params(PERMUTE_ERRORS, "permute") + _params(UNPERMUTE_ERRORS, "unpermute"))
def test_error_inputs_same_as_reference(op, args, kwargs, arg):
    with pytest.raises(ValueError) as want:
        getattr(ref, op)(*args, **kwargs)
    with pytest.raises(ValueError) as got:
        getattr(optimized, op)(*args, **kwargs)
    msg = str(got.value)
    assert msg == str(want.value)
    assert msg.startswith(op + ":") and f"'{arg}'" in msg, msg


def test_plain_calls_leave_the_checks_to_the_binding(monkeypatch):
    """Valid calls with plain CPU tensors and ints run none of the reference's Python checks (the
    binding checks the same: test_error_inputs_same_as_reference), with or without a scratch and
    an expert map; each still gives the reference's result."""
    from reference import validate

    def refuse(*args, **kwargs):
        raise AssertionError("a Python check ran on a valid plain call")

    h = torch.randn(3, 8).bfloat16()
    ids = _ids(((0, 1), (1, 0), (0, 0)))
    emap = torch.tensor([1, 0], dtype=torch.int32)
    want = [ref.permute(h, ids, 2), ref.permute(h, ids, 2, expert_map=emap, n_local_experts=2, align=4)]
    y, w = torch.randn(6, 8), torch.rand(3, 2)
    want_y = ref.unpermute(y, w, want[0].dst_pos)
    monkeypatch.setattr(validate, "check_permute", refuse)
    monkeypatch.setattr(validate, "check_unpermute", refuse)
    scratch = optimized.PermuteScratch(3, 2, 2, 8, torch.bfloat16, "cpu", n_local_experts=2, align=4)
    got = [optimized.permute(h, ids, 2),
           optimized.permute(h, ids, 2, expert_map=emap, n_local_experts=2, align=4, scratch=scratch)]
    for mine, theirs in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert torch.equal(optimized.unpermute(y, w, got[0].dst_pos), want_y)


# ------------------------------------------------------------------ hostile direct op calls
def _ok_permute_args(T=4, K=2, E=3, H=8):
    return [torch.ones(T, H), torch.zeros(T, K, **_i32), E, None, E, 1]


def _outs(T=4, K=2, E=3, H=8, align=1, e_loc=None):
    e_loc = e_loc or E
    cap = capacity(T, K, e_loc, align)
    return [torch.empty(e_loc + 1, dtype=torch.int64), torch.empty(cap, H), torch.empty(cap, **_i32),
            torch.empty(T * K, **_i32), torch.empty(e_loc, dtype=torch.int64)]


def _with(lst, i, v):
    lst = list(lst)
    lst[i] = v
    return lst


_A = _ok_permute_args()
_O = _outs()
_big = torch.empty(64, dtype=torch.int32)
HOSTILE = [
    ("id out of range", lambda: ops.permute(*_with(_A, 1, torch.full((4, 2), 3, **_i32))), "ids"),
    ("id -2", lambda: ops.permute(*_with(_A, 1, torch.full((4, 2), -2, dtype=torch.int64))), "ids"),
    ("ids float", lambda: ops.permute(*_with(_A, 1, torch.zeros(4, 2))), "ids"),
    ("ids wrong T", lambda: ops.permute(*_with(_A, 1, torch.zeros(5, 2, **_i32))), "ids"),
    ("ids K = 0", lambda: ops.permute(*_with(_A, 1, torch.zeros(4, 0, **_i32))), "ids"),
    ("hidden f64", lambda: ops.permute(*_with(_A, 0, torch.ones(4, 8).double())), "hidden"),
    ("hidden column stride", lambda: ops.permute(*_with(_A, 0, torch.ones(8, 4).t())), "hidden"),
    ("n_experts 0", lambda: ops.permute(*_with(_with(_A, 2, 0), 4, 0)), "n_experts"),
    ("n_local != n_experts w/o map", lambda: ops.permute(*_with(_A, 4, 2)), "n_local_experts"),
    ("map entry out of range", lambda: ops.permute(*_with(_with(_A, 3, torch.tensor([0, 5, 1], **_i32)), 4, 2)),
     "expert_map"),
    ("map wrong length", lambda: ops.permute(*_with(_with(_A, 3, torch.zeros(2, **_i32)), 4, 2)), "expert_map"),
    ("map int64", lambda: ops.permute(*_with(_with(_A, 3, torch.zeros(3, dtype=torch.int64)), 4, 2)), "expert_map"),
    ("align 0", lambda: ops.permute(*_with(_A, 5, 0)), "align"),
    ("capacity over int32", lambda: ops.permute(*_with(_A, 5, 2**30)), "align"),
    ("T*K over int32", lambda: ops.permute(torch.empty(2**31, 0), torch.zeros(1, 1, **_i32).expand(2**31, 2), 3,
                                           None, 3, 1), "ids"),
    ("out: hidden_out too few rows", lambda: ops.permute_out(*_A, *_with(_O, 1, torch.empty(7, 8))), "hidden_out"),
    ("out: hidden_out wrong dtype", lambda: ops.permute_out(*_A, *_with(_O, 1, torch.empty(8, 8).half())),
     "hidden_out"),
    ("out: hidden_out strided", lambda: ops.permute_out(*_A, *_with(_O, 1, torch.empty(8, 16)[:, :8])), "hidden_out"),
    ("out: src_row short", lambda: ops.permute_out(*_A, *_with(_O, 2, torch.empty(7, **_i32))), "src_row"),
    ("out: dst_pos int64", lambda: ops.permute_out(*_A, *_with(_O, 3, torch.empty(8, dtype=torch.int64))), "dst_pos"),
    ("out: offsets short", lambda: ops.permute_out(*_A, *_with(_O, 0, torch.empty(3, dtype=torch.int64))), "offsets"),
    ("out: counts short", lambda: ops.permute_out(*_A, *_with(_O, 4, torch.empty(2, dtype=torch.int64))), "counts"),
    ("out: src_row aliases dst_pos", lambda: ops.permute_out(*_A, *_with(_with(_O, 2, _big[:8]), 3, _big[4:12])),
     "src_row"),
    ("out: dst_pos aliases ids", lambda: ops.permute_out(*_with(_A, 1, _big[:8].view(4, 2)),
                                                        *_with(_O, 3, _big[:8])), "dst_pos"),
    ("out: hidden_out aliases hidden", lambda: ops.permute_out(*_with(_A, 0, _O[1][:4]), *_O), "hidden_out"),
    ("unpermute dst_pos >= rows", lambda: ops.unpermute(torch.ones(4, 2), torch.ones(2, 1),
                                                        torch.tensor([0, 4], **_i32)), "dst_pos"),
    ("unpermute dst_pos < -1", lambda: ops.unpermute(torch.ones(4, 2), torch.ones(2, 1),
                                                     torch.tensor([0, -7], **_i32)), "dst_pos"),
    ("unpermute dst_pos short", lambda: ops.unpermute(torch.ones(4, 2), torch.ones(2, 2),
                                                      torch.tensor([0, 1], **_i32)), "dst_pos"),
    ("unpermute dst_pos strided", lambda: ops.unpermute(torch.ones(4, 2), torch.ones(2, 1),
                                                        torch.zeros(4, **_i32)[::2]), "dst_pos"),
    ("unpermute weights f16", lambda: ops.unpermute(torch.ones(4, 2), torch.ones(2, 1).half(),
                                                    torch.tensor([0, 1], **_i32)), "weights"),
    ("unpermute expert_out column stride", lambda: ops.unpermute(torch.ones(2, 4).t(), torch.ones(2, 1),
                                                                 torch.tensor([0, 1], **_i32)), "expert_out"),
    ("unpermute expert_out int", lambda: ops.unpermute(torch.ones(4, 2, **_i32), torch.ones(2, 1),
                                                       torch.tensor([0, 1], **_i32)), "expert_out"),
]


@pytest.mark.parametrize("fn,arg", [pytest.param(f, a, id=d) for d, f, a in HOSTILE])
def test_hostile_direct_calls_raise(fn, arg):
    with pytest.raises(RuntimeError) as ei:
        fn()
    msg = str(ei.value)
    assert f"'{arg}'" in msg and ("moelab::permute" in msg or "moelab::unpermute" in msg), msg


def test_kernel_range_errors_worded_like_reference():
    # The Python layer leaves the id / map / dst_pos ranges to the kernels; their failures
    # still come out as the reference's ValueError (checked across the table above), and a
    # scratch call with a bad id leaves a reusable scratch behind.
    s = optimized.PermuteScratch(3, 2, 2, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"^permute: argument 'ids' holds 2, outside the valid range \[-1, 2\)"):
        optimized.permute(_h(), _ids(((0, 2), (0, 0), (0, 0))), 2, scratch=s)
    assert_same(optimized.permute(_h(), _ids(), 2, scratch=s), ref.permute(_h(), _ids(), 2))


# ------------------------------------------------------------------ custom-op machinery
def test_opcheck():
    hidden, ids, kw = make_case(6, 3, 5, 17, torch.bfloat16, align=2, e_loc=4, seed=9)
    args = [hidden, ids, 5, kw["expert_map"], 4, 2]
    torch.library.opcheck(ops.permute.default, args)
    torch.library.opcheck(ops.permute_out.default, args + _outs(6, 3, 5, 17, align=2, e_loc=4)[:1]
                          + [torch.empty(capacity(6, 3, 4, 2), 17, dtype=torch.bfloat16)]
                          + _outs(6, 3, 5, 17, align=2, e_loc=4)[2:])
    p = ref.permute(hidden, ids, 5, **kw)
    torch.library.opcheck(ops.unpermute.default, [p.hidden, torch.rand(6, 3), p.dst_pos])


def test_torch_compile_fullgraph():
    def layer(h, ids, w):
        p = optimized.permute(h, ids, 16, align=4)
        return optimized.unpermute(p.hidden * 2, w, p.dst_pos), p.offsets

    hidden, ids, _ = make_case(12, 4, 16, 40, torch.bfloat16, seed=4)
    w = torch.rand(12, 4)
    compiled = torch.compile(layer, fullgraph=True)
    got, want = compiled(hidden, ids, w), layer(hidden, ids, w)
    assert torch.equal(bits(got[0]), bits(want[0])) and torch.equal(got[1], want[1])


def test_explain():
    h, ids = torch.ones(2, 4), torch.zeros(2, 2, **_i32)
    assert optimized.dispatch.explain("permute", h, ids, 3).kernel == "moelab"
    assert optimized.dispatch.explain("unpermute", h, torch.ones(2, 2), torch.zeros(4, **_i32)).kernel == "moelab"
    assert optimized.backend_info()["permute"] == optimized.backend_info()["unpermute"] != ""
