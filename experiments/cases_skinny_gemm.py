"""skinny_gemm and the fused shared-expert gate (seed 002) vs `F.linear`, decode shapes.

Weights rotate through copies larger than the last-level cache (timing.Rotating), as in a
model where every layer has its own weights: a decode GEMM is judged against DRAM
bandwidth, and its floor is the weight read (N*K*2 bytes for bf16).

- skinny_gemm: N = 513 (E = 512 experts + 1 shared gate), K = 2048 and 4096, bf16; the
  issue's target is >= 2x over F.linear at T = 1 and 4 (T = 2 and 8 shown, no target).
- gate: the fused [E+1, H] weight through optimized.unquantized_gemm (the dispatcher vLLM's
  fused gate should have called) vs F.linear on the same weight (what it called), split
  into router and shared-gate logits in both, N = 257 and 513, H = 2048, T = 1..8.
"""
import torch
import torch.nn.functional as F

import optimized
from .bench import Case
from .timing import Rotating


def _split(y, E):
    return y[:, :E], y[:, E:]


def cases(quick: bool):
    out = []
    N = 513
    for K in (2048, 4096):
        ws = Rotating(lambda K=K: torch.randn(N, K).bfloat16(), N * K * 2)
        for T in ([1, 4] if quick else [1, 2, 4, 8]):
            x = torch.randn(T, K).bfloat16()
            out.append(Case("skinny_gemm", f"T={T} N={N} K={K} bf16",
                            lambda x=x, ws=ws: F.linear(x, ws.next()),
                            lambda x=x, ws=ws: optimized.skinny_gemm(x, ws.next()),
                            nbytes=N * K * 2 + T * K * 2 + T * N * 2,
                            target=2.0 if T in (1, 4) else None, cold=True))
    H = 2048
    for E in (256, 512):
        N = E + 1
        ws = Rotating(lambda N=N: torch.randn(N, H).bfloat16(), N * H * 2)
        for T in ([1, 8] if quick else range(1, 9)):
            x = torch.randn(T, H).bfloat16()
            out.append(Case("gate", f"T={T} N={N} H={H} bf16",
                            lambda x=x, ws=ws, E=E: _split(F.linear(x, ws.next()), E),
                            lambda x=x, ws=ws, E=E: _split(optimized.unquantized_gemm(x, ws.next()), E),
                            nbytes=N * H * 2 + T * H * 2 + T * N * 2, cold=True))
    return out


def _alternating(a, b, n: int):
    """Per-call times of a and b, called alternately (a, b / b, a), so both see the same
    machine: on a shared machine the load changes faster than blocks of calls last."""
    import time
    ta, tb = [], []
    for _ in range(10):
        a(), b()
    for i in range(n):
        first, second = (a, b) if i % 2 else (b, a)
        t0 = time.perf_counter(); first(); t1 = time.perf_counter(); second(); t2 = time.perf_counter()
        (ta if i % 2 else tb).append(t1 - t0)
        (tb if i % 2 else ta).append(t2 - t1)
    return ta, tb


def crossover(calls: int = 400) -> list[dict]:
    """The measurement behind optimized.dispatch's skinny-vs-library policy: skinny_gemm
    (the raw op, no Python validation) vs F.linear for every dtype, T = 1..8 and small to
    large weights, cold weights, calls alternated one by one; speedup = median of the
    per-call-pair ratios (with the 25..75% range). `python -m experiments.cases_skinny_gemm`
    prints it."""
    import statistics
    rows = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        es = torch.tensor([], dtype=dtype).element_size()
        for N, K in ((8, 64), (64, 512), (257, 2048), (513, 4096), (2048, 4096)):
            ws = Rotating(lambda N=N, K=K: torch.randn(N, K).to(dtype), N * K * es)
            for T in (1, 2, 4, 8):
                x = torch.randn(T, K).to(dtype)
                tl, ts = _alternating(lambda x=x, ws=ws: F.linear(x, ws.next()),
                                      lambda x=x, ws=ws: torch.ops.moelab.skinny_gemm(x, ws.next(), None), calls)
                r = sorted(a / b for a, b in zip(tl, ts))
                rows.append({"dtype": str(dtype).replace("torch.", ""), "N": N, "K": K, "T": T,
                             "linear_us": statistics.median(tl) * 1e6, "skinny_us": statistics.median(ts) * 1e6,
                             "speedup": r[len(r) // 2], "q25": r[len(r) // 4], "q75": r[3 * len(r) // 4]})
    return rows


if __name__ == "__main__":
    import sys
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    from .timing import machine
    m = machine()
    print(f"# {m['cpu']}, ISA {m['isa']}, {m['threads']} threads, torch {m['torch']}")
    print(f"{'dtype':<10}{'N':>6}{'K':>6}{'T':>3}{'F.linear us':>13}{'skinny us':>11}{'speedup (25..75%)':>22}")
    for r in crossover():
        print(f"{r['dtype']:<10}{r['N']:>6}{r['K']:>6}{r['T']:>3}{r['linear_us']:>13.1f}{r['skinny_us']:>11.1f}"
              f"{r['speedup']:>9.2f}x ({r['q25']:.2f}..{r['q75']:.2f})", flush=True)
