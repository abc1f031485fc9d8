"""Ops and scratch buffers used from two Python threads at once.

torch releases the GIL inside its ops (and the moelab ops), so two Python threads really do
run kernels at the same time.

PermuteScratch. `permute(..., scratch=s)` returns views of s's buffers, so two concurrent
calls with one scratch would write the same memory. The rule (reference.PermuteScratch's
docstring): one call at a time holds the scratch; a call that finds it held raises
RuntimeError "permute: argument 'scratch' is in use by another call" before touching a
buffer. What "correct" means for a call that returned: while it held the scratch, the views
it returns held exactly the reference result, and they are views of the scratch's buffers.
After it releases the scratch the next call from any thread may overwrite them (that is the
contract of a scratch, not a race to detect), so the tests snapshot the buffers at the
moment the call releases the scratch, i.e. still inside the call, and compare those.

Ops without a scratch argument (fused_experts with its per-thread workspace cache, route,
router_gemm, skinny_gemm, permute, unpermute, FusedGate) must give every thread its own
correct result: compared bit for bit with the same call made alone beforehand.
"""
from __future__ import annotations

import importlib
import threading
import time
import types

import pytest
import torch

import optimized
from reference.quant import quantize_mxfp4

ref_permute = importlib.import_module("reference.permute")
opt_permute = importlib.import_module("optimized.permute")

IN_USE = r"permute: argument 'scratch' is in use by another call"
T_MAX, K, E, H = 12, 2, 6, 40


def _case(seed: int, T: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, E, (T, K), generator=g, dtype=torch.int32)
    return hidden, ids


def _expected(hidden, ids, align):
    return ref_permute.permute(hidden, ids, E, align=align)


def _same(got, want) -> bool:
    return all(g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))


SCRATCHES = [pytest.param(optimized.PermuteScratch, optimized.permute, id="optimized"),
             pytest.param(ref_permute.PermuteScratch, ref_permute.permute, id="reference")]


@pytest.mark.parametrize("cls,permute", SCRATCHES)
def test_held_scratch_refuses_a_call_and_then_serves_the_next(cls, permute):
    """Deterministic: while the scratch is held (as a running call holds it) a call raises
    without writing anything; once released, calls work again, from any thread."""
    s = cls(T_MAX, K, E, H, torch.bfloat16, "cpu", align=4)
    hidden, ids = _case(1, 7)
    first = permute(hidden, ids, E, align=4, scratch=s)
    before = [t.clone() for t in (s.offsets, s.hidden, s.src_row, s.dst_pos)]
    s._claim()
    try:
        errors = []

        def other():
            try:
                permute(*_case(2, 9), E, align=4, scratch=s)
            except RuntimeError as e:
                errors.append(str(e))
        th = threading.Thread(target=other)
        th.start()
        th.join()
        assert len(errors) == 1 and "permute: argument 'scratch' is in use by another call" in errors[0]
        with pytest.raises(RuntimeError, match=IN_USE):   # the same thread too: the lock is not re-entrant
            permute(hidden, ids, E, align=4, scratch=s)
        after = [t.clone() for t in (s.offsets, s.hidden, s.src_row, s.dst_pos)]
        # (bitwise: the rows past this call's capacity were never written and may hold NaN)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before)), \
            "a refused call wrote the scratch"
    finally:
        s._release()
    assert _same(first, _expected(hidden, ids, 4))
    out = []
    th = threading.Thread(target=lambda: out.append(permute(*_case(3, 5), E, align=4, scratch=s)))
    th.start()
    th.join()
    assert _same(out[0], _expected(*_case(3, 5), 4))


def test_refused_while_the_kernel_runs(monkeypatch):
    """Deterministic overlap with the real kernel: thread A's permute_out has written the
    scratch and is paused inside the call; thread B's call is refused; A's views still hold
    A's result when A returns."""
    real = optimized.fastcall.ops.permute_out      # what the wrapper calls in eager mode
    inside, tried = threading.Event(), threading.Event()

    def paused(*args):
        real(*args)
        if threading.current_thread().name == "A":
            inside.set()
            assert tried.wait(30)

    monkeypatch.setattr(opt_permute, "fast", types.SimpleNamespace(permute_out=paused))
    s = optimized.PermuteScratch(T_MAX, K, E, H, torch.bfloat16, "cpu", align=4)
    (ha, ia), (hb, ib) = _case(4, 11), _case(5, 12)
    res = {}

    def a():
        res["a"] = optimized.permute(ha, ia, E, align=4, scratch=s)
        res["a_copy"] = [t.clone() for t in res["a"]]

    th = threading.Thread(target=a, name="A")
    th.start()
    assert inside.wait(30)
    with pytest.raises(RuntimeError, match=IN_USE):
        optimized.permute(hb, ib, E, align=4, scratch=s)
    tried.set()
    th.join()
    assert _same(res["a_copy"], _expected(ha, ia, 4))
    assert res["a"].hidden.data_ptr() == s.hidden.data_ptr()
    assert _same(optimized.permute(hb, ib, E, align=4, scratch=s), _expected(hb, ib, 4))   # sequential reuse


def _hammer(cls, permute, hold_s: float, iters: int):
    """Two threads, `iters` calls each with their own inputs, started together by a barrier.
    The scratch's _release is wrapped to snapshot the buffers the moment the call lets go
    (optionally after holding it `hold_s` seconds, GIL released, so the calls overlap)."""
    s = cls(T_MAX, K, E, H, torch.bfloat16, "cpu", align=2)
    local = threading.local()
    release = s._release

    def snapshot_then_release():
        if hold_s:
            time.sleep(hold_s)
        local.snap = [t.clone() for t in (s.offsets, s.hidden, s.src_row, s.dst_pos)]
        release()

    s._release = snapshot_then_release
    barrier = threading.Barrier(2)
    stats = {"ok": 0, "refused": 0, "bad": []}
    lock = threading.Lock()

    def worker(seed):
        cases = [_case(seed * 1000 + i, 1 + (seed + i) % T_MAX) for i in range(iters)]
        for i, (hidden, ids) in enumerate(cases):
            want = _expected(hidden, ids, 2)
            barrier.wait(timeout=60)
            try:
                got = permute(hidden, ids, E, align=2, scratch=s)
            except RuntimeError as e:
                with lock:
                    if "permute: argument 'scratch' is in use by another call" in str(e):
                        stats["refused"] += 1
                    else:
                        stats["bad"].append((seed, i, repr(e)))
                continue
            T = hidden.shape[0]
            cap, R = want.hidden.shape[0], T * K
            snap = local.snap
            at_release = (snap[0], snap[1][:cap], snap[2][:cap], snap[3][:R])
            views_ok = (got.hidden.data_ptr() == s.hidden.data_ptr() and got.src_row.data_ptr() == s.src_row.data_ptr()
                        and got.dst_pos.data_ptr() == s.dst_pos.data_ptr() and got.offsets.data_ptr() == s.offsets.data_ptr()
                        and [t.shape for t in got] == [t.shape for t in want])
            with lock:
                if _same(at_release, want) and views_ok:
                    stats["ok"] += 1
                else:
                    stats["bad"].append((seed, i))

    def guarded(seed):
        try:
            worker(seed)
        except BaseException as e:   # (a dead thread would leave its peer at the barrier)
            barrier.abort()
            stats["bad"].append((seed, repr(e)))

    threads = [threading.Thread(target=guarded, args=(k,)) for k in (1, 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not stats["bad"], stats
    assert stats["ok"] + stats["refused"] == 2 * iters
    return stats


@pytest.mark.parametrize("cls,permute", SCRATCHES)
def test_two_threads_hammer_one_scratch(cls, permute):
    """Calls overlap (each holds the scratch 5 ms): every call is either refused or correct,
    and the refusal does happen."""
    stats = _hammer(cls, permute, hold_s=0.005, iters=30)
    assert stats["refused"] >= 1 and stats["ok"] >= 1, stats


@pytest.mark.parametrize("cls,permute", SCRATCHES)
def test_two_threads_hammer_one_scratch_unpaused(cls, permute):
    """The real timing (no pause): whatever overlaps, nothing is silently wrong."""
    stats = _hammer(cls, permute, hold_s=0.0, iters=100)
    assert stats["ok"] >= 1, stats


# ------------------------------------------------------- ops without a scratch argument
def _fe_inputs(seed: int, T: int):
    g = torch.Generator().manual_seed(seed)
    Hf, If, Ef, Kf = 64, 64, 8, 2
    x = torch.randn(T, Hf, generator=g).to(torch.bfloat16)
    w13 = torch.randn(Ef, 2 * If, Hf, generator=g) * 0.1
    w2 = torch.randn(Ef, Hf, If, generator=g) * 0.1
    ids = torch.stack([torch.randperm(Ef, generator=g)[:Kf] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, Kf, generator=g)
    return x, w13, w2, w, ids


def _concurrent(calls, iters: int):
    """Run each zero-argument callable of `calls` (lists of (fn, expected) per thread) in
    its own thread, `iters` rounds started together; returns the mismatches."""
    barrier = threading.Barrier(len(calls))
    bad = []

    def worker(k, items):
        try:
            for i in range(iters):
                fn, want = items[i % len(items)]
                barrier.wait(timeout=60)
                got = fn()
                got = [got] if isinstance(got, torch.Tensor) else list(got)
                if len(got) != len(want) or not all(torch.equal(g, w) for g, w in zip(got, want)):
                    bad.append((k, i))
        except BaseException as e:   # (a dead thread would leave its peer at the barrier)
            barrier.abort()
            bad.append((k, repr(e)))

    threads = [threading.Thread(target=worker, args=(k, items)) for k, items in enumerate(calls)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return bad


def _with_expected(fns):
    out = []
    for fn in fns:
        r = fn()
        out.append((fn, [r] if isinstance(r, torch.Tensor) else [t.clone() for t in r]))
    return out


@pytest.fixture
def two_intra_op_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def test_fused_experts_two_threads(two_intra_op_threads):
    """fused_experts keeps its intermediates in a per-calling-thread cache (grown on demand)
    and allocates per-call GEMM scratch: two threads with different sizes (so the caches grow
    while the other thread runs) and formats get exactly their single-threaded results."""
    per_thread = []
    for k in range(2):
        fns = []
        for i, T in enumerate((1, 37, 5, 64) if k == 0 else (64, 3, 40, 1)):
            x, w13, w2, w, ids = _fe_inputs(10 * k + i, T)
            if i % 2:
                (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
                fns.append(lambda x=x, q13=q13, q2=q2, s13=s13, s2=s2, w=w, ids=ids: optimized.fused_experts(
                    x, q13, q2, w, ids, quant="mxfp4", w13_scale=s13, w2_scale=s2))
            else:
                b13, b2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
                fns.append(lambda x=x, b13=b13, b2=b2, w=w, ids=ids: optimized.fused_experts(
                    x, b13, b2, w, ids, quant="bf16", activation="swiglu_oai"))
        per_thread.append(_with_expected(fns))
    assert not _concurrent(per_thread, iters=24)


def test_other_ops_two_threads(two_intra_op_threads):
    """route, router_gemm, skinny_gemm, permute (no scratch), unpermute, FusedGate (its cached
    stacked weight): every thread gets its single-threaded result."""
    g = torch.Generator().manual_seed(7)
    per_thread = []
    gate = optimized.FusedGate(torch.randn(16, 48, generator=g).to(torch.bfloat16),
                               torch.randn(1, 48, generator=g).to(torch.bfloat16))
    for k in range(2):
        T = 3 + 20 * k
        logits = torch.randn(T, 64, generator=g)
        x = torch.randn(T, 48, generator=g).to(torch.bfloat16)
        hidden, ids = _case(40 + k, T)
        p = optimized.permute(hidden, ids, E, align=4)
        w = torch.rand(T, K, generator=g)
        fns = [
            lambda logits=logits: optimized.route(logits, 8, "sigmoid_bias", bias=torch.zeros(64), scaling=2.0),
            lambda x=x: optimized.router_gemm(x, torch.ones(16, 48)),
            lambda x=x: optimized.skinny_gemm(x[:8], torch.ones(5, 48, dtype=torch.bfloat16)),
            lambda hidden=hidden, ids=ids: optimized.permute(hidden, ids, E, align=4),
            lambda p=p, w=w: optimized.unpermute(p.hidden, w, p.dst_pos),
            lambda x=x: gate(x),
        ]
        per_thread.append(_with_expected(fns))
    assert not _concurrent(per_thread, iters=36)
