"""`python -m experiments.micro tune_crossover [--runs N] [--threads T] [--formats ...]`: the
measurement behind fused_experts' `auto` defaults (optimized/dispatch.py,
FUSED_EXPERTS_DEFAULT_M_CROSS): for each weight format, `optimized.tune`'s measurement (one
expert block of m rows, tiny against blocked, cold weights, interleaved rounds; its module
docstring) repeated in N whole runs, each run's tiny / blocked ms and median paired ratio per
m, and the crossover its rule (calibrate.crossover) takes from each run. Run it under
MOELAB_ISA=<level> to measure a lower level on this CPU. Output:
experiments/results/<machine>/tune_crossover.txt."""
from __future__ import annotations

import argparse

import torch

import optimized
from optimized.tune import calibrate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.micro tune_crossover")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--formats", default=",".join(calibrate.SHAPES))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"# fused_experts level {optimized.backend_info()['fused_experts']}, {a.threads} thread(s), "
          f"{a.runs} runs; per m: tiny/blocked ms (the minimum over rounds) and the median paired "
          f"ratio tiny/blocked (> 1: blocked faster)")
    for q in a.formats.split(","):
        picks = []
        for r in range(a.runs):
            meas = calibrate.measure(q)
            picks.append(calibrate.crossover(meas))
            print(f"{q:9s} run {r + 1}: m_cross {picks[-1]:3d} | " +
                  "  ".join(f"m={m}: {t * 1e3:.2f}/{b * 1e3:.2f} ({ratio:.2f})" for m, (t, b, ratio) in meas.items()),
                  flush=True)
        print(f"{q:9s} m_cross per run: {picks}")
    return 0
