"""verify --world N: the parallel MoE layer (optimized/parallel.py) against the single-process layer.

One process group of N ranks (gloo, spawned here) runs every case: each case is a whole layer
(weights from a seed), a global batch of tokens split over the ranks (some ranks may get none),
a routing distribution from verify/distributions.py, and a layout (ep x tp, contiguous or
round-robin expert placement, padded or not). Every rank computes the single-process layer
on the WHOLE batch and its own parallel output, and compares its rows:
  exact mode (batch-invariant): bit for bit (any differing bit is a failure), both the bf16
  output and the f32 combine before its rounding (against the single-process fused_experts_rows
  rows combined by unpermute: fused_experts' own last step);
  fast mode (independent TP partials): verify's fused_experts tolerance (verify/tolerance.py:
  at most 4x the eager PyTorch error against the f64 truth, plus the bf16 flip floor); the
  "worst" figure is then the error over tolerance (<= 1 passes), in exact mode the count of
  differing elements.
Rank 0 writes the results (one JSON line per case) where the caller asked.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional

import torch

from .distributions import ROUTING_DISTS, make_routing

# Distributions that give routing (route's nan_inf is about router logits, covered by route's
# own cases; here it would only drop rows).
LAYER_DISTS = tuple(d for d in ROUTING_DISTS if d != "nan_inf")


@dataclasses.dataclass
class ParallelCase:
    seed: int
    dist: str
    quant: str = "bf16"
    E: int = 8
    H: int = 64
    I: int = 64
    K: int = 2
    T: int = 24
    ep: int = 1
    tp: int = 1
    placement: str = "contiguous"     # or "round_robin"
    pad: bool = False
    activation: str = "silu"
    shared: bool = False
    biases: bool = False
    awi: bool = False                  # apply_router_weight_on_input
    router: bool = False               # route with the layer's router instead of the distribution
    zero_rank: int = -1                # this rank gets no tokens
    exact: bool = True

    def name(self) -> str:
        return (f"{self.dist}/{self.quant}/ep{self.ep}xtp{self.tp}/{self.placement}"
                f"{'/pad' if self.pad else ''}{'/shared' if self.shared else ''}{'/bias' if self.biases else ''}"
                f"{'/awi' if self.awi else ''}{'/router' if self.router else ''}"
                f"{f'/zero{self.zero_rank}' if self.zero_rank >= 0 else ''}{'' if self.exact else '/fast'}"
                f" E={self.E} H={self.H} I={self.I} K={self.K} T={self.T} seed={self.seed}")


def _weights(g: torch.Generator, quant: str, E: int, N: int, K: int, scale: float):
    from reference.quant import quantize_fp8_block, quantize_mxfp4
    w = torch.randn(E, N, K, generator=g) * scale
    if quant == "bf16":
        return w.to(torch.bfloat16), None
    if quant == "fp8_block":
        return quantize_fp8_block(w)
    return quantize_mxfp4(w)


def make_spec(c: ParallelCase):
    """The whole layer of a case (the same bits on every rank: a seeded CPU generator)."""
    from optimized.parallel import MoELayerSpec
    from reference.moe import SharedExpert
    g = torch.Generator().manual_seed(10_000 + c.seed)
    w13, s13 = _weights(g, c.quant, c.E, 2 * c.I, c.H, c.H ** -0.5)
    w2, s2 = _weights(g, c.quant, c.E, c.H, c.I, c.I ** -0.5)
    b13 = (torch.randn(c.E, 2 * c.I, generator=g) * 0.1) if c.biases else None
    b2 = (torch.randn(c.E, c.H, generator=g) * 0.1) if c.biases else None
    router = torch.randn(c.E, c.H, generator=g) * c.H ** -0.5
    shared = None
    if c.shared:
        sw13 = (torch.randn(1, 2 * 32, c.H, generator=g) * c.H ** -0.5).to(torch.bfloat16)
        sw2 = (torch.randn(1, c.H, 32, generator=g) * 32 ** -0.5).to(torch.bfloat16)
        gate = torch.randn(1, c.H, generator=g) * c.H ** -0.5
        shared = SharedExpert(w13=sw13, w2=sw2, gate=gate)
    return MoELayerSpec(router_weight=router, w13=w13, w2=w2, top_k=c.K, quant=c.quant, w13_scale=s13, w2_scale=s2,
                        w13_bias=b13, w2_bias=b2, activation=c.activation, shared=shared,
                        apply_router_weight_on_input=c.awi, method="sigmoid_topk" if c.awi else "softmax_topk")


def make_inputs(c: ParallelCase):
    """x [T, H] bf16 and the routing (weights, ids) of the whole batch (None with c.router)."""
    g = torch.Generator().manual_seed(20_000 + c.seed)
    x = torch.randn(c.T, c.H, generator=g).to(torch.bfloat16)
    if c.router:
        return x, None
    r = make_routing(c.dist, c.T, c.E, c.K, seed=c.seed)
    w = torch.rand(c.T, c.K, generator=g) + 0.05
    ids = r.ids
    if c.dist == "ep_shard":   # its holes: the map's -1 experts dropped as well as the padded slots
        ids = torch.where(r.local_ids >= 0, ids, torch.full_like(ids, -1))
    return x, (w.to(torch.float32).contiguous(), ids.to(torch.int32).contiguous())


def token_split(T: int, world: int, zero_rank: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's tokens: as even as possible, none for zero_rank."""
    ranks = [r for r in range(world) if r != zero_rank] or [0]
    bounds, a = [(0, 0)] * world, 0
    for i, r in enumerate(ranks):
        b = T * (i + 1) // len(ranks)
        bounds[r] = (a, b)
        a = b
    return bounds


def _tolerance_ok(out: torch.Tensor, x: torch.Tensor, spec, routing) -> tuple[bool, float]:
    """fast mode: verify's fused_experts rule (verify/tolerance.py: at most 4x the eager
    PyTorch error against the f64 truth, plus the bf16 flip floor), on the routed output (fast
    cases have no shared expert and take the routing as given). Returns (ok, error over tolerance)."""
    from reference.fused_experts import fused_experts as reference_fused_experts

    from . import tolerance as tol
    w, ids = routing
    kw = dict(quant=spec.quant, w13_scale=spec.w13_scale, w2_scale=spec.w2_scale, w13_bias=spec.w13_bias,
              w2_bias=spec.w2_bias, activation=spec.activation, alpha=spec.alpha, limit=spec.limit,
              apply_router_weight_on_input=spec.apply_router_weight_on_input)
    g = reference_fused_experts(x, spec.w13, spec.w2, w, ids, **kw)
    eager, V, A, Fl = tol.fused_experts_baseline(x, spec.w13, spec.w2, w, ids, **kw)
    res = tol.arith_check(out, g, eager, V, A, torch.bfloat16, n_floor=tol.gemm_floor(spec.I), extra=Fl)
    return res.ratio <= 1.0, res.ratio


def _f32_bits_differ(routed32: torch.Tensor, x: torch.Tensor, spec, routing, optimized) -> int:
    """Elements where the layer's f32 combine differs in any bit from one process's (routing given
    or recomputed by the single-process router)."""
    if routing is None:
        logits = optimized.router_gemm(x, spec.router_weight)
        if spec.router_bias is not None:
            logits = logits + spec.router_bias.to(logits.dtype)
        routing = optimized.route(logits, spec.top_k, spec.method, **spec.route_kwargs())
    w, ids = routing
    T, K = ids.shape
    if T == 0:
        return 0 if routed32.shape == (0, spec.H) else -1
    y = optimized.fused_experts_rows(x, spec.w13, spec.w2, w, ids, quant=spec.quant, w13_scale=spec.w13_scale,
                                     w2_scale=spec.w2_scale, w13_bias=spec.w13_bias, w2_bias=spec.w2_bias,
                                     activation=spec.activation, alpha=spec.alpha, limit=spec.limit,
                                     apply_router_weight_on_input=spec.apply_router_weight_on_input)
    dst = torch.where(ids.reshape(-1) >= 0, torch.arange(T * K, dtype=torch.int32), -1).to(torch.int32)
    cw = torch.ones_like(w) if spec.apply_router_weight_on_input else w
    want = optimized.unpermute(y, cw, dst)
    if routed32.shape != want.shape:
        return -1
    return int((routed32.view(torch.int32) != want.view(torch.int32)).sum())


def run_cases(rank: int, world: int, cases: list[ParallelCase]) -> list[dict]:
    """Inside an initialized group: every case; returns rank 0's view of all ranks' results."""
    import torch.distributed as dist

    import optimized
    from optimized.parallel import ParallelMoE, round_robin_owner, single_process_forward
    results = []
    for c in cases:
        t0 = time.perf_counter()
        spec = make_spec(c)
        x, routing = make_inputs(c)
        with optimized.batch_invariant_mode(True):
            truth = single_process_forward(x, spec, routing)
            owner = round_robin_owner(c.E, c.ep) if c.placement == "round_robin" else None
            layer = ParallelMoE(spec, ep=c.ep, tp=c.tp, owner=owner, pad=c.pad)
            a, b = token_split(c.T, world, c.zero_rank)[rank]
            rt = None if routing is None else (routing[0][a:b], routing[1][a:b])
            out = layer(x[a:b], exact=c.exact, routing=rt)
        want = truth[a:b]
        if c.exact:
            diff = int((out.view(torch.int16) != want.view(torch.int16)).sum())
            ok, worst = diff == 0, float(diff)
        else:
            if c.shared or routing is None:
                raise ValueError(f"verify --world: a fast-mode case takes its routing as given and has no shared "
                                 f"expert ({c.name()})")
            ok, worst = _tolerance_ok(out, x[a:b], spec, rt)
        shape_ok = tuple(out.shape) == tuple(want.shape)
        bits = int((out.view(torch.int16) != want.view(torch.int16)).sum()) if shape_ok else -1
        # The f32 combine before rounding against the single-process rows' combine (fused_experts'
        # own step 6 on fused_experts_rows: the same bits as its output before rounding, tested in
        # tests/test_parallel.py): bf16 output rounding hides most f32 differences, this does not.
        f32_bits = _f32_bits_differ(layer.last_routed_f32, x[a:b], spec, rt, optimized)
        if c.exact and f32_bits != 0:
            ok = False
        mine = dict(rank=rank, rows=b - a, ok=bool(ok), worst=worst, shape_ok=shape_ok, bits_differ=bits,
                    f32_bits_differ=f32_bits)
        allr: list = [None] * world
        dist.all_gather_object(allr, mine)
        results.append(dict(case=dataclasses.asdict(c), name=c.name(), world=world,
                            ok=all(r["ok"] and r["shape_ok"] for r in allr), ranks=allr,
                            seconds=time.perf_counter() - t0))
    return results


def default_cases(world: int, seed: int = 0, quick: bool = False) -> list[ParallelCase]:
    """Every layer distribution at every layout of this world size, plus formats, shared experts,
    biases, padding, a zero-token rank, the router path and the fast mode."""
    layouts = [(ep, world // ep) for ep in range(1, world + 1) if world % ep == 0]
    cases, s = [], seed
    dists = LAYER_DISTS
    for (ep, tp) in layouts:
        for d in dists:
            s += 1
            cases.append(ParallelCase(seed=s, dist=d, ep=ep, tp=tp, placement="round_robin" if s % 2 else "contiguous",
                                      zero_rank=(world - 1) if d in ("hot_expert", "all_to_one") else -1))
    fmt = [("fp8_block", dict(H=128, I=512)), ("mxfp4", dict(H=64, I=128))]
    for q, sz in fmt:
        for (ep, tp) in layouts:
            s += 1
            cases.append(ParallelCase(seed=s, dist="uniform", quant=q, ep=ep, tp=tp, **sz))
    ep, tp = layouts[-1] if len(layouts) == 1 else layouts[len(layouts) // 2]
    s += 1
    cases.append(ParallelCase(seed=s, dist="zipf", quant="mxfp4", H=64, I=96, tp=world, ep=1, pad=True,
                              activation="swiglu_oai", biases=True))
    if world % 2 == 0:   # fp8 with I % 128 != 0: the shard becomes its exact bf16 dequantization
        s += 1
        cases.append(ParallelCase(seed=s, dist="uniform", quant="fp8_block", H=128, I=320, tp=2, ep=world // 2))
    s += 1
    cases.append(ParallelCase(seed=s, dist="uniform", ep=ep, tp=tp, shared=True, router=True, zero_rank=0))
    s += 1
    cases.append(ParallelCase(seed=s, dist="uniform", ep=ep, tp=tp, awi=True, router=True, K=2))
    s += 1
    cases.append(ParallelCase(seed=s, dist="hot_expert", ep=ep, tp=tp, biases=True, exact=False, I=128))
    s += 1
    cases.append(ParallelCase(seed=s, dist="zipf", quant="mxfp4", H=64, I=256, ep=1, tp=world, exact=False))
    if quick:
        cases = cases[::3] + cases[-4:]
    return cases


def _worker(rank: int, world: int, cases: list[ParallelCase], out_path: str) -> None:
    res = run_cases(rank, world, cases)
    if rank == 0:
        with open(out_path, "w") as f:
            for r in res:
                f.write(json.dumps(r) + "\n")


def run_world(world: int, cases: Optional[list[ParallelCase]] = None, *, seed: int = 0, quick: bool = False,
              timeout_s: float = 120.0) -> list[dict]:
    """Spawn `world` ranks, run the cases, return one result dict per case."""
    import os
    import tempfile

    from optimized.parallel import spawn
    cases = cases if cases is not None else default_cases(world, seed, quick)
    with tempfile.TemporaryDirectory(prefix="moelab-verify-world-") as d:
        out = os.path.join(d, "results.jsonl")
        spawn(_worker, world, cases, out, timeout_s=timeout_s)
        with open(out) as f:
            return [json.loads(line) for line in f]


def main_world(world: int, seed: int, quiet: bool, report: Optional[str]) -> int:
    """python -m verify --world N."""
    t0 = time.perf_counter()
    res = run_world(world, seed=seed)
    bad = [r for r in res if not r["ok"]]
    for r in res:
        if not quiet or not r["ok"]:
            worst = max(x["worst"] for x in r["ranks"])
            print(f"{'PASS' if r['ok'] else 'FAIL'} world={world} {r['name']} "
                  f"(rows per rank {[x['rows'] for x in r['ranks']]}, worst {worst:g})")
    print(f"parallel layer, world {world}: {len(res) - len(bad)}/{len(res)} cases pass "
          f"({time.perf_counter() - t0:.1f} s); exact cases are bit for bit against the single-process layer")
    if report:
        with open(report + ".world.json", "w") as f:
            json.dump(res, f, indent=1)
        print(f"report: {report}.world.json")
    return 0 if not bad else 1
