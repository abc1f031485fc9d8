"""`python -m experiments.micro huge_pages [--shapes ...] [--threads N]`: fused_experts decode on
prepacked weights in transparent huge pages (what prepack_moe_weights and the pack cache ask for,
csrc/cpu/fused_experts_schedule.h: advise_huge_pages) against the same bytes copied into 4 KiB pages
(madvise MADV_NOHUGEPAGE before the first write), side by side, interleaved rounds, rotating cold
copies (two per side). Linux only. Output: experiments/results/<machine>/huge_pages.txt."""
from __future__ import annotations

import argparse
import ctypes
import sys

import torch

import optimized
from optimized.fused_experts import PackedMoEWeights
from optimized.tune.calibrate import random_weights

from .. import timing
from ..cases_fused_experts import SHAPES, routing

_HUGE = 2 << 20
_MADV_NOHUGEPAGE = 15


def _small_pages_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    """t's bytes in a fresh buffer whose 2 MiB-aligned part is advised NOHUGEPAGE before it is written."""
    if t is None:
        return None
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    n = t.numel() * t.element_size()
    raw = torch.empty(n + _HUGE, dtype=torch.uint8)
    p = raw.data_ptr()
    a = (p + _HUGE - 1) // _HUGE * _HUGE
    libc.madvise(a, (n + _HUGE - 1) // _HUGE * _HUGE, _MADV_NOHUGEPAGE)
    out = raw[a - p: a - p + n].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def _anon_huge_kb() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("AnonHugePages"):
            return int(line.split()[1])
    return -1


def run(name: str, batch_sizes=(1, 4, 16), rounds: int = 9) -> list[str]:
    s = SHAPES[name]
    E, K, H, I, q = s["E"], s["K"], s["H"], s["I"], s["quant"]
    before = _anon_huge_kb()
    huge = [optimized.prepack_moe_weights(*(lambda w: (w[0], w[1], q, w[2], w[3]))(random_weights(q, E, H, I, seed=i)))
            for i in range(2)]
    after = _anon_huge_kb()
    small = [PackedMoEWeights(p.quant, p.E, p.H, p.I, *[_small_pages_copy(t) for t in
                                                        (p.w13, p.w2, p.w13_scale, p.w2_scale, p.w13_slow, p.w2_slow)])
             for p in huge]
    g = torch.Generator().manual_seed(7)
    b13 = torch.randn(E, 2 * I, generator=g) * 0.1 if s["bias"] else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if s["bias"] else None
    lines = [f"{name} {q}: AnonHugePages {before} -> {after} kB after prepacking two copies "
             f"({2 * huge[0].nbytes / 2**20:.0f} MiB)"]
    for T in batch_sizes:
        tw, ids = routing("uniform", T, E, K, seed=T)
        x = torch.randn(T, H, generator=g).bfloat16()
        nbytes = int(torch.unique(ids).numel()) * huge[0].nbytes / E
        it = {"small": 0, "huge": 0}

        def call(side, items):
            it[side] = (it[side] + 1) % len(items)
            return optimized.fused_experts(x, items[it[side]], None, tw, ids, quant=q, w13_bias=b13, w2_bias=b2,
                                           activation=s["activation"])
        t = timing.compare({"small": lambda: call("small", small), "huge": lambda: call("huge", huge)},
                           rounds=rounds)
        r = timing.ratio(t["small"], t["huge"])
        lines.append(f"{name} {q} T={T} threads={torch.get_num_threads()}: 4 KiB pages {t['small'].median * 1e6:.0f} us "
                     f"{nbytes / t['small'].median / 1e9:.1f} GB/s | huge pages {t['huge'].median * 1e6:.0f} us "
                     f"{nbytes / t['huge'].median / 1e9:.1f} GB/s | huge speedup {r[0]:.3f} ({r[1]:.3f}..{r[2]:.3f})")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.micro huge_pages", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"], choices=list(SHAPES))
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    m = timing.machine()
    print(f"# {m['cpu']}, ISA {m['isa']}, {a.threads} thread(s), torch {m['torch']}, load {m.get('load', '?')}; "
          "median of per-round time ratios 4 KiB / huge (interleaved rounds, min..max)", flush=True)
    for name in a.shapes:
        for line in run(name):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
