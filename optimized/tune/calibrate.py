"""`python -m optimized.tune [--quick] [--threads N] [--print]`: calibrate this machine's crossovers.

fused_experts: for each weight format, one expert block of m rows (m = 1 .. 48) is run with
the `tiny` and the `blocked` micro-kernel, side by side in interleaved rounds (each round times
both, in alternating order), on a realistic shape
(fp8_block: Qwen3-30B-A3B's H=2048, I=768; mxfp4: GPT-OSS-20B's H=I=2880 with swiglu_oai and
biases; bf16: OLMoE's H=2048, I=1024). The weights rotate over enough experts that every
call reads them from memory, as in a model where each layer has its own. m_cross is the
threshold that loses least against the faster kernel summed over the measured m (`crossover`),
judged by the median over rounds of the paired ratio tiny / blocked (one round's two times
share the machine's state: a drift of the host's bandwidth between rounds moves both, where
the minimum of each kernel over all rounds could take the two from different moments and
flip a close point); `auto` then takes blocked for a block of m rows iff m >= m_cross.

The result goes to optimized.tune.tune_file() (~/.cache/moelab/tune-<cpu>.json, or
$MOELAB_CACHE_DIR), outside the repository: it describes this machine, not the code. The file
keeps one entry per ISA level the run's kernels ran at (MOELAB_ISA=avx2 caps it: the run is
then filed under avx2) and per way of measuring ("threads=N" for the wall clock on N threads,
"cpu" for --clock cpu); `auto` uses the entry of the process's level and torch thread count
(optimized.tune.entry).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from .. import tune
from ..fused_experts import fused_experts, prepack_moe_weights

SHAPES = {  # quant: (H, I, activation, biases)
    "fp8_block": (2048, 768, "silu", False),
    "mxfp4": (2880, 2880, "swiglu_oai", True),
    "bf16": (2048, 1024, "silu", False),
}
M_GRID = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48)


def random_weights(quant: str, E: int, H: int, I: int, seed: int = 0):
    """Quantized weights with realistic codes (normal values through the format's rounding),
    built one expert at a time (no full-size f32 temporary)."""
    g = torch.Generator().manual_seed(seed)
    if quant == "mxfp4":    # every byte is two valid e2m1 codes; scales near 2^-6
        return (torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=g),
                torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=g),
                torch.randint(118, 123, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g),
                torch.randint(118, 123, (E, H, I // 32), dtype=torch.uint8, generator=g))
    dt = torch.bfloat16 if quant == "bf16" else torch.float8_e4m3fn
    w13 = torch.empty(E, 2 * I, H, dtype=dt)
    w2 = torch.empty(E, H, I, dtype=dt)
    for e in range(E):
        for w, fan_in in ((w13, H), (w2, I)):
            v = torch.randn(w.shape[1:], generator=g)
            w[e] = (v / fan_in ** 0.5).to(dt) if quant == "bf16" else (v * 64).clamp(-448, 448).to(dt)
    if quant == "bf16":
        return w13, w2, None, None
    s13 = torch.full((E, -(-2 * I // 128), -(-H // 128)), 1.0 / (64 * H ** 0.5))
    s2 = torch.full((E, -(-H // 128), -(-I // 128)), 1.0 / (64 * I ** 0.5))
    return w13, w2, s13, s2


def _time(fn, min_time: float, clock=time.perf_counter) -> float:
    n, t0 = 0, clock()
    while True:
        fn()
        n += 1
        el = clock() - t0
        if el >= min_time and n >= 3:
            return el / n


def measure(quant: str, m_grid=M_GRID, rounds: int = 5, min_time: float = 0.03, cold_bytes: int = 256 << 20,
            cpu_clock: bool = False):
    """{m: (tiny seconds, blocked seconds, median ratio)} for one block of m rows: each kernel's
    minimum over rounds (on a shared machine other processes only ever add time, so the minimum
    is the least disturbed time of each), and the median over rounds of the paired ratio
    tiny / blocked of the same round (> 1: blocked faster), which `crossover` judges by.
    cpu_clock: time with the calling thread's CPU clock (run with one thread): immune to the
    scheduling delays that dominate wall times of short parallel regions on a busy machine."""
    H, I, act, biased = SHAPES[quant]
    w13, w2, s13, s2 = random_weights(quant, 1, H, I)
    per_expert = sum(t.numel() * t.element_size() for t in (w13, w2, s13, s2) if t is not None)
    E = max(2, min(128, -(-cold_bytes // per_expert)))
    w13, w2, s13, s2 = random_weights(quant, E, H, I)
    pw = prepack_moe_weights(w13, w2, quant, s13, s2)
    del w13, w2
    g = torch.Generator().manual_seed(1)
    b13 = torch.randn(E, 2 * I, generator=g) if biased else None
    b2 = torch.randn(E, H, generator=g) if biased else None
    clock = time.thread_time if cpu_clock else time.perf_counter
    out = {}
    for m in m_grid:
        x = torch.randn(m, H, generator=g).bfloat16()
        tw = torch.rand(m, 1, generator=g)
        state = {"e": 0}

        def call(policy):
            state["e"] = (state["e"] + 1) % E          # a different (cold) expert every call
            ids = torch.full((m, 1), state["e"], dtype=torch.int32)
            fused_experts(x, pw, None, tw, ids, quant=quant, w13_bias=b13, w2_bias=b2,
                          activation=act, dispatch=policy)

        call("tiny"), call("blocked")
        times = {"tiny": [], "blocked": []}
        for r in range(rounds):
            for p in (("tiny", "blocked") if r % 2 == 0 else ("blocked", "tiny")):
                times[p].append(_time(lambda: call(p), min_time, clock))
        ratio = statistics.median(t / b for t, b in zip(times["tiny"], times["blocked"]))
        out[m] = (min(times["tiny"]), min(times["blocked"]), ratio)
    return out


def crossover(meas: dict) -> int:
    """The threshold c (blocked iff m >= c; a measured m, or max m + 1 for never) that loses
    least against the faster kernel summed over the measured m: loss(c) = sum over m < c of
    log(tiny / blocked) where blocked was faster, plus sum over m >= c of log(blocked / tiny)
    where tiny was faster; the smallest c among equals. A point near a ratio of 1 then moves the
    threshold only as much as it costs, where "blocked wins at every larger m" would let one
    such point at a large m hold tiny for every smaller m, however far blocked is ahead. Judged by
    the median paired ratio where `measure` gives one (a third value), else by the two times."""
    ms = sorted(meas)
    logr = {m: math.log(v[2] if len(v) > 2 else v[0] / v[1]) for m, v in meas.items()}

    def loss(c: int) -> float:
        return sum(max(0.0, logr[m]) if m < c else max(0.0, -logr[m]) for m in ms)

    return min([*ms, ms[-1] + 1], key=lambda c: (loss(c), c))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m optimized.tune", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer m values and rounds")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default=",".join(SHAPES))
    p.add_argument("--print", action="store_true", help="print the stored file and exit")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: wall clock on --threads threads; cpu: one thread's CPU time (busy machines)")
    a = p.parse_args(argv)
    path = tune.tune_file()
    if a.print:
        print(path)
        print(path.read_text() if path.exists() else "(none)")
        return 0
    torch.set_num_threads(1 if a.clock == "cpu" else a.threads)
    level = tune.active_level()
    grid = (1, 2, 4, 6, 8, 16) if a.quick else M_GRID
    result = {"threads": 1 if a.clock == "cpu" else a.threads, "clock": a.clock, "isa": level,
              "torch": torch.__version__, "m_cross": {}, "seconds": {}}
    for q in a.formats.split(","):
        meas = measure(q, grid, rounds=3 if a.quick else 5, min_time=0.01 if a.quick else 0.03,
                       cpu_clock=a.clock == "cpu")
        result["m_cross"][q] = crossover(meas)
        result["seconds"][q] = {str(m): list(v) for m, v in meas.items()}
        print(f"{q:10s} m_cross = {result['m_cross'][q]:3d}   " +
              "  ".join(f"m={m}: {v[0] * 1e3:.2f}/{v[1] * 1e3:.2f} ({v[2]:.2f}x)" for m, v in meas.items()) +
              "  (tiny/blocked ms, median tiny/blocked ratio)", flush=True)
    # One entry per ISA level and way of measuring (optimized.tune.entry picks by both);
    # formats not measured now keep their earlier value in the same entry.
    path = tune.store("fused_experts", level, "cpu" if a.clock == "cpu" else f"threads={a.threads}", result)
    print(f"wrote {path} (level {level})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
