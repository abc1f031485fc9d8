"""`python -m experiments.micro route_call_cost [--rounds N]`: where a decode-size route call's
time goes (the bench's sigmoid_bias point: bf16 logits, E = 256, K = 8, one thread).

Side by side, interleaved rounds (timing.compare), the same op called three ways: through
`torch.ops.moelab.route` (the schema parses each Python argument), through
`optimized.fastcall.ops.route` (pybind11 with the op's C++ types, the same dispatcher call),
and through `optimized.route` (the Python wrapper over the fast binding); at T = 0 (the
binding's checks and its two empty outputs, no kernel), T = 1, 16 and 512. Derived: the
per-token kernel cost (the slope from T = 16 to 512), the fixed cost of a call, and what the
wrapper and torch.ops' parsing add. Output: experiments/results/<machine>/route_call_cost.txt.
"""
from __future__ import annotations

import argparse
import os

import torch

from .. import timing

E, K, METHOD = 256, 8, "sigmoid_bias"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.micro route_call_cost")
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    import optimized
    from optimized import fastcall

    g = torch.Generator().manual_seed(0)
    bias = torch.randn(E, generator=g) * 0.1
    x = {T: torch.randn(T, E, generator=g).bfloat16() for T in (0, 1, 16, 512)}
    op, fast = torch.ops.moelab.route.default, fastcall.ops.route
    for T in (1, 16):   # the three ways give the same bits
        ref = op(x[T], K, METHOD, bias)
        for got in (fast(x[T], K, METHOD, bias, 1.0, None, 1, 1, None), optimized.route(x[T], K, METHOD, bias=bias)):
            assert all(torch.equal(r, s) for r, s in zip(ref, got))
    cands = {}
    for T in (0, 1, 16, 512):
        cands[f"fastcall T={T}"] = lambda T=T: fast(x[T], K, METHOD, bias, 1.0, None, 1, 1, None)
    for T in (1, 16):
        cands[f"torch.ops T={T}"] = lambda T=T: op(x[T], K, METHOD, bias)
        cands[f"optimized.route T={T}"] = lambda T=T: optimized.route(x[T], K, METHOD, bias=bias)
    t = timing.compare(cands, rounds=a.rounds, min_time=0.05)
    us = {name: v.median * 1e6 for name, v in t.items()}
    print(f"route {METHOD}, bf16 logits, E = {E}, K = {K}, one thread, {a.rounds} interleaved rounds; "
          f"load {os.getloadavg()[0]:.2f}")
    for name, v in t.items():
        lo, hi = min(v.times) * 1e6, max(v.times) * 1e6
        print(f"  {name:<22} {us[name]:8.2f} us  (rounds {lo:.2f}..{hi:.2f})")
    per_token = (us["fastcall T=512"] - us["fastcall T=16"]) / (512 - 16)
    print(f"kernel per token (fastcall, T = 16 -> 512): {per_token * 1e3:.0f} ns")
    print(f"fixed cost of a call (fastcall T = 0: argument conversion, checks, two output tensors): "
          f"{us['fastcall T=0']:.2f} us")
    for T in (1, 16):
        print(f"T = {T}: torch.ops' parsing adds {us[f'torch.ops T={T}'] - us[f'fastcall T={T}']:.2f} us, "
              f"the optimized.route wrapper {us[f'optimized.route T={T}'] - us[f'fastcall T={T}']:.2f} us "
              f"over the fast binding")
    return 0
