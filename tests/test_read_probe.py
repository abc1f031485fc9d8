"""moelab::read_stream, the streaming-read probe behind the bench's DRAM floor
(csrc/torch/bench_probe.cpp, experiments/timing.py read_bandwidth): it must read exactly the
buffer -- every byte once, nothing outside it -- at every ISA level, for sizes that are not
multiples of 64 or of the stream count, on one thread and split across threads; refuse bad
input naming the op and the argument; and the floor built on it must come back as a positive
finite number. No timing is asserted (the machine is shared)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import optimized
from tests import levels
from experiments import timing

op = torch.ops.moelab.read_stream
CANARY = 255
# around the 64-byte block, the per-stream split and the binding's 4096-block thread grain
SIZES = [1, 2, 63, 64, 65, 127, 129, 64 * 16 - 1, 64 * 16 + 13, 64 * 17 * 3 + 5, 100_003,
         4096 * 64 + 1, 2 * 4096 * 64 + 4097]


@pytest.fixture(params=["scalar", "avx2", "avx512", "avx512_bf16"])
def isa(request):
    with levels.capped(request.param):
        yield request.param


def _inside_canaries(n: int, offset: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n random bytes at `offset` inside a larger buffer of CANARY bytes: (view, whole)."""
    whole = torch.full((n + offset + 192,), CANARY, dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    view = whole[offset: offset + n]
    view.copy_(torch.randint(0, 200, (n,), generator=g, dtype=torch.uint8))
    return view, whole


@pytest.mark.parametrize("threads", [1, 2])
def test_sum_is_the_byte_sum_for_every_size_and_stream_count(isa, threads):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, n in enumerate(SIZES):
            for offset in (0, 5):     # 5: no load is 64-byte aligned
                view, whole = _inside_canaries(n, offset, seed=i)
                want = int(view.sum(dtype=torch.int64))
                for s in range(1, optimized.bench_probe.MAX_STREAMS + 1):
                    # a block read twice or skipped changes the sum (random bytes); a byte read
                    # outside the view adds a 255
                    assert op(view, s) == want, (isa, threads, n, offset, s)
                for s, d in ((1, 1), (3, 16), (4, 4096), (16, 7)):   # with a software prefetch
                    assert op(view, s, d) == want, (isa, threads, n, offset, s, d)
                assert int(whole.sum(dtype=torch.int64)) - want == CANARY * (whole.numel() - n)
    finally:
        torch.set_num_threads(prev)


def test_any_dtype_is_read_as_its_bytes():
    x = torch.randn(1000, 3)
    assert op(x, 4) == int(x.view(torch.uint8).sum(dtype=torch.int64))
    b = torch.arange(77, dtype=torch.int16)
    assert optimized.bench_probe.read_stream(b, 2) == int(b.view(torch.uint8).sum(dtype=torch.int64))


@pytest.mark.parametrize("make,arg,streams", [
    (lambda: torch.ones(256, dtype=torch.uint8)[::2], "buf", 1),              # not contiguous
    (lambda: torch.ones(16, 16).t(), "buf", 1),
    (lambda: torch.ones(64, dtype=torch.uint8).expand(4, 64), "buf", 1),     # stride 0
    (lambda: torch.empty(0, dtype=torch.uint8), "buf", 1),                   # empty
    (lambda: torch.empty(3, 0), "buf", 2),
    (lambda: torch.ones(64, dtype=torch.uint8), "streams_per_thread", 0),
    (lambda: torch.ones(64, dtype=torch.uint8), "streams_per_thread", -3),
    (lambda: torch.ones(64, dtype=torch.uint8), "streams_per_thread", 17),
])
def test_bad_input_raises_naming_the_argument(make, arg, streams):
    with pytest.raises(RuntimeError, match=rf"moelab::read_stream: argument '{arg}'"):
        op(make(), streams)


@pytest.mark.parametrize("prefetch", [-1, 4097])
def test_bad_prefetch_raises(prefetch):
    with pytest.raises(RuntimeError, match=r"moelab::read_stream: argument 'prefetch_blocks'"):
        op(torch.ones(64, dtype=torch.uint8), 2, prefetch)


def test_meta_buffer_runs_the_fake():
    assert op(torch.empty(100, device="meta"), 4) == 0
    with pytest.raises(RuntimeError, match=r"moelab::read_stream: argument 'streams_per_thread'"):
        op(torch.empty(100, device="meta"), 0)


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are not available here")
@pytest.mark.parametrize("huge,flag", [(True, "hg"), (False, "nh")])
def test_stream_buffer_is_advised(huge, flag):
    from tests.test_huge_pages import _vm_flags, _middle
    buf = timing.stream_buffer(8 << 20, huge=huge, fill=3)
    assert buf.is_contiguous() and buf.numel() == 8 << 20
    assert flag in _vm_flags(_middle(buf)), f"stream_buffer(huge={huge}) not advised {flag}"
    assert op(buf, 4) == 3 * (8 << 20)


def test_read_bandwidth_is_a_positive_finite_number_and_memoized():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)      # a shared 2-core machine stalls parallel regions for ms
    try:
        key = (4 << 20, 1)
        timing._read_bw.pop(key, None)
        bw = timing.read_bandwidth(4 << 20, rounds=1, min_time=0.005)    # tiny: a few ms
        assert math.isfinite(bw) and bw > 1e8
        assert timing._read_bw[key] == bw and timing.read_bandwidth(4 << 20) == bw
        t = timing.read_stream_timings(timing.stream_buffer(1 << 20), streams=(1, 3), prefetch=(0, 8), rounds=1,
                                       min_time=0.005)
        assert sorted(t) == [(1, 0), (1, 8), (3, 0), (3, 8)] and all(v.median > 0 for v in t.values())
    finally:
        torch.set_num_threads(prev)
        timing._read_bw.pop((4 << 20, 1), None)


def test_read_stream_timings_refuses_a_probe_that_misreads(monkeypatch):
    """The floor is only measured from a probe that read exactly the buffer."""
    class Fake:
        read_stream = staticmethod(lambda buf, s, d=0: 12345)
    monkeypatch.setattr(torch.ops, "moelab", Fake())
    with pytest.raises(RuntimeError, match="read_stream read 12345"):
        timing.read_stream_timings(timing.stream_buffer(4096, huge=False), streams=(1,), prefetch=(0,), rounds=1,
                                   min_time=0.001)
