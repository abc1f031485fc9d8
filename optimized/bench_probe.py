"""The Python side of moelab::read_stream (csrc/torch/bench_probe.cpp), a measurement tool for
the benchmarks, not an MoE op: it reads a contiguous CPU buffer once with 64-byte vector loads,
split across the torch threads and, per thread, over `streams_per_thread` interleaved
sub-ranges (optionally prefetching `prefetch_blocks` blocks ahead in each), and returns the sum
of its bytes (unsigned, int64). experiments/timing.py times it for the DRAM floor
(read_bandwidth()). Here: its fake kernel, for the device checks every op makes (a meta buffer
holds no bytes to read: the fake returns 0)."""
from __future__ import annotations

import torch

from . import _fake

MAX_STREAMS = 16   # cpu::kReadStreamMaxStreams
MAX_PREFETCH = 4096   # cpu::kReadStreamMaxPrefetch (blocks)


@torch.library.register_fake("moelab::read_stream")
def _read_stream_fake(buf, streams_per_thread, prefetch_blocks=0):
    _fake.check("read_stream", ("buf", buf, None))
    if not 1 <= streams_per_thread <= MAX_STREAMS:
        _fake.fail("read_stream", "streams_per_thread", f"must be in [1, {MAX_STREAMS}], got {streams_per_thread}")
    if not 0 <= prefetch_blocks <= MAX_PREFETCH:
        _fake.fail("read_stream", "prefetch_blocks", f"must be in [0, {MAX_PREFETCH}], got {prefetch_blocks}")
    return 0


def read_stream(buf: torch.Tensor, streams_per_thread: int = 4, prefetch_blocks: int = 0) -> int:
    """Read every byte of `buf` (contiguous, CPU, any dtype, non-empty) once; their sum.
    prefetch_blocks > 0 adds a software prefetch that many 64-byte blocks ahead per stream."""
    return torch.ops.moelab.read_stream(buf, streams_per_thread, prefetch_blocks)
