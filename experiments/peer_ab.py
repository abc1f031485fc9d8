"""One fused_experts point, ours against one peer, in one process: the quick check of a peer
ratio that `make bench PEERS=1` reports from three whole runs (docs/performance.md).

    python -m experiments.peer_ab [--shape olmoe-1b-7b] [--T 1] [--threads 2] [--rounds 8]
                                  [--peer "vllm cpu_fused_moe"]

Same inputs as the bench's point (experiments.cases_fused_experts: uniform routing, seed T),
our prepacked weights and the peer's own form of the same values, each as rotating copies
larger than the cache (cold reads). Rounds interleave the two with the order alternating; a
round times 5 calls of each and keeps each side's median; the result is the median over rounds
of the per-round ratio peer / ours (> 1: ours faster), with its min..max. One process and one
memory phase: a whole-run bench is still what a target is judged on."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from experiments.cases_fused_experts import ShapeData, _x, routing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="olmoe-1b-7b")
    p.add_argument("--T", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--peer", default="vllm cpu_fused_moe")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    d = ShapeData(a.shape, eager=False)
    tw, ids = routing("uniform", a.T, d.s["E"], d.s["K"], seed=a.T)
    x = _x(a.T, d.s["H"])
    peer = d.peer_set().peers(x, tw, ids).get(a.peer)
    if not callable(peer):
        p.error(f"peer {a.peer!r} is not available for {a.shape}: {peer}")
    fns = {"ours": lambda: d.ours(x, tw, ids), "peer": peer}
    for f in fns.values():
        for _ in range(4):
            f()
    times = {k: [] for k in fns}
    ratios = []
    for r in range(a.rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                fns[k]()
                ts.append(time.perf_counter() - t0)
            times[k].append(statistics.median(ts))
        ratios.append(times["peer"][-1] / times["ours"][-1])
    ratios.sort()
    print(f"{a.shape} {d.s['quant']} T={a.T}, {a.threads} thread(s), {a.rounds} rounds: ours "
          f"{statistics.median(times['ours']) * 1e3:.3f} ms, {a.peer} {statistics.median(times['peer']) * 1e3:.3f} ms;"
          f" {a.peer} / ours {statistics.median(ratios):.3f}x ({ratios[0]:.3f}..{ratios[-1]:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
