"""How fast fused_experts' fp8 decode runs when memory is not the limit: the same call with its
weights hot in L3 against cold (rotating copies, as `make bench` times it), one process,
interleaved rounds, with the read probe in each round.

    python -m experiments.micro fe_hot_rate        (~1 minute)

Qwen3-30B-A3B fp8_block (H = 2048, I = 768), T = 1 routed to 4 experts (18.9 MB of weights,
inside the 32 MB L3 of the 2-core EPYC), prepacked. hot: one weight copy, every call the same
experts; cold: experiments.cases_fused_experts.ShapeData's rotating copies (every call reads
its experts from DRAM). If hot is far above the probe, the kernel has arithmetic to spare and
a cold rate below the probe is a latency / overlap matter; if hot is near the probe, the decode
arithmetic itself is what keeps a core from streaming faster.
Output: experiments/results/<machine>/fe_hot_rate.txt
"""
from __future__ import annotations

import statistics
import time

import torch

import optimized
from experiments import timing
from experiments.cases_fused_experts import ShapeData


def main() -> None:
    d = ShapeData("qwen3-30b-a3b", eager=False)
    s = d.s
    ids = torch.tensor([[3, 40, 77, 101]], dtype=torch.int32)
    tw = torch.full((1, 4), 0.25)
    x = torch.randn(1, s["H"]).bfloat16()
    nb = 4 * d.expert_bytes
    hot_w = d.packed.items[0]

    def call(w):
        return optimized.fused_experts(x, w, None, tw, ids, quant=s["quant"], activation=s["activation"])

    probe, pbytes = timing.read_probe()
    print(f"fused_experts fp8_block qwen3-30b-a3b T=1, 4 experts ({nb / 1e6:.1f} MB), {timing.machine()['isa']}")
    for th in (1, 2):
        torch.set_num_threads(th)
        for _ in range(20):
            call(hot_w)
        hot, cold, pr = [], [], []
        for _ in range(9):
            t0 = time.perf_counter()
            probe()
            pr.append(pbytes / (time.perf_counter() - t0) / 1e9)
            for out, pick in ((hot, lambda: hot_w), (cold, d.packed.next)):
                ts = []
                for _ in range(20):
                    w = pick()
                    t0 = time.perf_counter()
                    call(w)
                    ts.append(time.perf_counter() - t0)
                out.append(nb / statistics.median(ts) / 1e9)
        q = lambda v: f"{statistics.median(v):5.1f} GB/s ({min(v):.1f}..{max(v):.1f})"
        print(f"{th} thread(s): hot {q(hot)}   cold {q(cold)}   read probe {q(pr)}   "
              f"hot/probe {statistics.median(hot) / statistics.median(pr):.2f}  "
              f"cold/probe {statistics.median(cold) / statistics.median(pr):.2f}", flush=True)


if __name__ == "__main__":
    main()
