"""`python -m experiments.micro read_bandwidth [--threads 1 2] [--rounds N] [--mib M]`: what this
machine can stream, the bench's DRAM floor (timing.read_bandwidth). Side by side, interleaved
rounds, per thread count: the streaming-read probe moelab::read_stream (64-byte vector loads,
S interleaved streams per thread, S = 1, 2, 4, 8, 16, without and with a software prefetch pf
blocks ahead: timing.STREAMS x timing.PREFETCH) and a torch f32 sum (the old probe), each
over one buffer in 4 KiB pages (madvise MADV_NOHUGEPAGE before the first write) and one in
transparent huge pages (MADV_HUGEPAGE, as the packed weights). Each buffer is read whole per
call, and is far above the last-level cache. Output: experiments/results/<machine>/read_bandwidth.txt."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from .. import timing


def run(threads: int, nbytes: int, rounds: int) -> list[str]:
    torch.set_num_threads(threads)
    import optimized   # noqa: F401
    op = torch.ops.moelab.read_stream
    bufs = {"4k": timing.stream_buffer(nbytes, huge=False), "huge": timing.stream_buffer(nbytes, huge=True)}
    f32 = {k: b.view(torch.float32) for k, b in bufs.items()}
    for k, b in bufs.items():   # the probe reads exactly the buffer
        assert op(b, 3) == int(b.sum(dtype=torch.int64)), k
    cands = {}
    for k in bufs:
        cands[f"torch sum {k}"] = lambda k=k: f32[k].sum()
    for k in bufs:
        for d in timing.PREFETCH:
            for s in timing.STREAMS:
                cands[f"read_stream {k} S={s} pf={d}"] = lambda k=k, s=s, d=d: op(bufs[k], s, d)
    t = timing.compare(cands, rounds=rounds, min_time=0.1)
    lines = [f"threads={threads}: {nbytes >> 20} MiB buffers; huge-page bytes: 4k buffer "
             f"{max(timing.huge_page_bytes(bufs['4k']), 0) >> 20} MiB, huge buffer "
             f"{max(timing.huge_page_bytes(bufs['huge']), 0) >> 20} MiB; load {os.getloadavg()[0]:.2f}"]
    for name, v in t.items():
        gbs = sorted(nbytes / x / 1e9 for x in v.times)
        lines.append(f"threads={threads} {name:<30} {nbytes / v.median / 1e9:6.1f} GB/s "
                     f"(rounds {gbs[0]:.1f}..{gbs[-1]:.1f})")
    best = {k: max((nbytes / t[f"read_stream {k} S={s} pf={d}"].median, s, d)
                   for s in timing.STREAMS for d in timing.PREFETCH) for k in bufs}
    for k in bufs:
        lines.append(f"threads={threads} best read_stream {k}: {best[k][0] / 1e9:.1f} GB/s at S={best[k][1]} "
                     f"pf={best[k][2]}, "
                     f"{best[k][0] / (nbytes / t[f'torch sum {k}'].median):.2f}x the torch sum over the same buffer")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.micro read_bandwidth", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mib", type=int, default=256)
    a = p.parse_args(argv)
    m = timing.machine()
    print(f"# {m['cpu']}, ISA {m['isa']}, torch {m['torch']}, load {os.getloadavg()[0]:.2f} at start; "
          f"`python -m experiments.micro read_bandwidth {' '.join(argv if argv is not None else sys.argv[1:])}`; "
          f"GB/s = buffer bytes / median time per pass (min..max over {a.rounds} interleaved rounds)", flush=True)
    for n in a.threads:
        for line in run(n, a.mib << 20, a.rounds):
            print(line, flush=True)
    print(f"# load {os.getloadavg()[0]:.2f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
