"""optimized.router_gemm against reference.router_gemm (SPEC 3), at every ISA level.

Tolerance: the kernel accumulates in f32, so against the f64 reference each output may be
off by at most gamma_H * (|x| @ |w|.T) (the worst-case dot-product bound). The tests use a
tighter probabilistic-style bound, 2 * sqrt(H) * u32 * (|x| @ |w|.T) + a subnormal floor,
and check that it is tight enough to catch a 2^-10 error in one output column.
"""
from __future__ import annotations

import pytest
import torch

import optimized
from tests import levels
from reference import router_gemm as ref_router_gemm

LEVELS = list(levels.LEVELS)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
U32 = 2.0 ** -24


@pytest.fixture(params=LEVELS)
def level(request):
    with levels.capped(request.param):
        yield request.param


def bound(x, w):
    mag = x.double().abs() @ w.double().abs().T
    return 2 * x.shape[1] ** 0.5 * U32 * mag + 1e-30


def within(out, x, w):
    err = (out.double() - ref_router_gemm(x, w).double()).abs()
    return bool((err <= bound(x, w)).all()), float((err / bound(x, w)).max()) if out.numel() else 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,E", [(0, 8, 3), (1, 1, 1), (1, 3072, 256), (3, 17, 5), (4, 33, 4),
                                   (5, 100, 9), (8, 64, 7), (31, 48, 6), (32, 3072, 256), (33, 31, 2)])
def test_matches_reference(level, dtype, T, H, E):
    g = torch.Generator().manual_seed(T * 1000 + H + E)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.randn(E, H, generator=g)
    out = torch.ops.moelab.router_gemm(x, w)     # the kernel itself, whatever the dispatch
    assert out.shape == (T, E) and out.dtype == torch.float32
    ok, worst = within(out, x, w)
    assert ok, f"error/bound {worst:.2f}"


def test_small_integers_exact(level):
    # Products and sums of small integers are exact in f32: any missed or doubled term shows.
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-4, 5, (7, 77), generator=g).to(torch.bfloat16)
    w = torch.randint(-4, 5, (13, 77), generator=g).float()
    expect = [[sum(float(x[t, h]) * float(w[e, h]) for h in range(77)) for e in range(13)] for t in range(7)]
    assert torch.equal(torch.ops.moelab.router_gemm(x, w), torch.tensor(expect))


def test_bound_catches_one_column_off_by_2_pow_minus_10():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 3072, generator=g).bfloat16(), torch.randn(256, 3072, generator=g)
    out = optimized.router_gemm(x, w)
    assert within(out, x, w)[0]
    bad = out.clone()
    bad[:, 17] *= 1 + 2.0 ** -10
    assert not within(bad, x, w)[0]


def test_strided_rows_read_in_place(level):
    base = torch.randn(6, 80).bfloat16()
    x = base[:, 8:72]                      # row stride 80, unit column stride
    w = torch.randn(5, 64)
    assert torch.equal(torch.ops.moelab.router_gemm(x, w), torch.ops.moelab.router_gemm(x.contiguous(), w))


def test_batch_invariant_and_thread_count_independent(level):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(29, 300, generator=g).bfloat16(), torch.randn(37, 300, generator=g)
    full = torch.ops.moelab.router_gemm(x, w)
    for t in (0, 5, 28):
        assert torch.equal(torch.ops.moelab.router_gemm(x[t:t + 1], w)[0], full[t])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.moelab.router_gemm(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, full)


@pytest.mark.parametrize("H", [64, 3072, 3072 + 7])
def test_every_tile_shape_bitwise_equals_per_token_calls(level, H):
    # T covers every token-tile remainder (1..4 tokens) and several token blocks (whose
    # prefetch duties differ); E = 13 gives full and partial expert blocks; H = 3079 has a
    # tail chunk at every level (H % 16 == 7, H % 8 == 7).
    g = torch.Generator().manual_seed(H)
    w = torch.randn(13, H, generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(33, H, generator=g).to(dtype)
        one = torch.cat([torch.ops.moelab.router_gemm(x[t:t + 1], w) for t in range(33)])
        for T in [*range(1, 10), 17, 33]:
            assert torch.equal(torch.ops.moelab.router_gemm(x[:T], w), one[:T]), (dtype, T)


def test_dispatch_library_above_crossover_and_invariant_mode():
    x, w = torch.randn(64, 32).bfloat16(), torch.randn(8, 32)
    assert optimized.dispatch.explain("router_gemm", x, w).kernel == "library"
    assert optimized.dispatch.explain("router_gemm", x[:32], w).kernel == "moelab"
    with optimized.batch_invariant_mode():
        assert optimized.dispatch.explain("router_gemm", x, w).kernel == "moelab"
        assert torch.equal(optimized.router_gemm(x, w)[3], optimized.router_gemm(x[3:4], w)[0])


@pytest.mark.parametrize("args,arg", [
    ((torch.randn(2, 4, 1).bfloat16(), torch.randn(3, 4)), "x"),
    ((torch.randn(2, 4).to(torch.int32), torch.randn(3, 4)), "x"),
    ((torch.randn(2, 4).bfloat16(), torch.randn(3, 5)), "weight"),
    ((torch.randn(2, 4).bfloat16(), torch.randn(3, 4).bfloat16()), "weight"),
    ((torch.randn(2, 4).bfloat16(), torch.randn(0, 4)), "weight"),
    ((torch.randn(2, 0).bfloat16(), torch.randn(3, 0)), "x"),
    ((torch.randn(2, 4).bfloat16(), torch.randn(3, 4, device="meta")), "weight"),
])
def test_errors_name_the_argument(args, arg):
    for fn in (optimized.router_gemm, ref_router_gemm):
        with pytest.raises(ValueError, match=rf"router_gemm: argument '{arg}'"):
            fn(*args)


@pytest.mark.parametrize("args,arg", [
    ((torch.randn(2, 4).to(torch.int32), torch.randn(3, 4)), "x"),
    ((torch.randn(2, 4).bfloat16(), torch.randn(3, 5)), "weight"),
    ((torch.randn(2, 4).bfloat16(), torch.randn(3, 4).double()), "weight"),
    ((torch.randn(2, 4).bfloat16(), torch.randn(4, 3).T), "weight"),
    ((torch.randn(4, 2).bfloat16().T, torch.randn(3, 4)), "x"),
])
def test_direct_op_rejects_hostile_arguments(args, arg):
    with pytest.raises(RuntimeError, match=rf"moelab::router_gemm: argument '{arg}'"):
        torch.ops.moelab.router_gemm(*args)


def test_opcheck_and_compile():
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(8, 64)
    torch.library.opcheck(torch.ops.moelab.router_gemm.default, (x, w))
    f = torch.compile(lambda a, b: optimized.router_gemm(a, b) * 2, fullgraph=True)
    assert torch.equal(f(x, w), optimized.router_gemm(x, w) * 2)
