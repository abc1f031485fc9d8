"""Cases of experiment 006 (the parallel layer): communication volumes, load imbalance, gloo timings.

The timing worker is module level so that optimized.parallel.spawn's fresh processes can import it.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time

import torch

# (E, K, H, I) of the three model shapes the issue names (config.json values)
MODELS = {
    "DeepSeek-V3": dict(E=256, K=8, H=7168, I=2048),
    "Qwen3-235B-A22B": dict(E=128, K=8, H=4096, I=1536),
    "GPT-OSS-120B": dict(E=128, K=4, H=2880, I=2880),
}
EP_SIZES = (8, 16, 32, 64, 128, 256)


def expected_groups_hit(E: int, K: int, ep: int) -> float:
    """E[number of distinct EP groups among a token's K distinct experts], uniform routing,
    contiguous placement of E/ep experts per group: ep * (1 - C(E - E/ep, K) / C(E, K))."""
    per = E // ep
    return ep * (1.0 - math.comb(E - per, K) / math.comb(E, K))


def volume_rows() -> list[dict]:
    from optimized.parallel import comm_bytes_per_token
    rows = []
    for model, s in MODELS.items():
        for ep in EP_SIZES:
            if ep > s["E"]:
                continue
            hit = expected_groups_hit(s["E"], s["K"], ep)
            bf = comm_bytes_per_token(s["H"], s["K"], hit)
            f8 = comm_bytes_per_token(s["H"], s["K"], hit, dispatch_bytes=1.0)
            rows.append(dict(model=model, ep=ep, E=s["E"], K=s["K"], H=s["H"], groups_hit=round(hit, 3),
                             dispatch_bf16_B=bf["dispatch"], dispatch_fp8_B=f8["dispatch"],
                             combine_exact_f32_B=bf["combine"], combine_bf16_per_group_B=hit * 2 * s["H"],
                             remote_fraction=round((ep - 1) / ep, 4)))
    return rows


def imbalance_rows(dists, T: int, E: int, K: int, ep_sizes, seed: int = 0) -> list[dict]:
    """max/mean over EP groups of the routed slots (expert work) and of the distinct token rows
    received, for each routing distribution (contiguous placement)."""
    from optimized.parallel import contiguous_owner
    from verify.distributions import make_routing
    rows = []
    for d in dists:
        r = make_routing(d, T, E, K, seed=seed)
        ids = r.ids.long()
        if d == "ep_shard":
            ids = torch.where(r.local_ids >= 0, ids, torch.full_like(ids, -1))
        for ep in ep_sizes:
            owner = torch.tensor(contiguous_owner(E, ep))
            valid = ids >= 0
            g = torch.where(valid, owner[ids.clamp(min=0)], torch.full_like(ids, -1))
            slots = torch.stack([(g == q).sum() for q in range(ep)]).double()
            toks = torch.stack([(g == q).any(1).sum() for q in range(ep)]).double()
            rows.append(dict(dist=d, ep=ep, T=T, E=E, K=K,
                             slots_max_over_mean=float(slots.max() / slots.mean()) if slots.sum() else float("nan"),
                             tokens_max_over_mean=float(toks.max() / toks.mean()) if toks.sum() else float("nan"),
                             idle_groups=int((slots == 0).sum())))
    return rows


def _time_worker(rank: int, world: int, cfg: dict, out_path: str) -> None:
    import torch.distributed as dist

    import optimized
    from optimized.parallel import ParallelMoE
    from verify.parallel import ParallelCase, make_spec
    spec = make_spec(ParallelCase(seed=1, dist="uniform", E=cfg["E"], H=cfg["H"], I=cfg["I"], K=cfg["K"]))
    rows = []
    for (ep, tp) in [(e, world // e) for e in range(1, world + 1) if world % e == 0]:
        layer = ParallelMoE(spec, ep=ep, tp=tp)
        for T in cfg["tokens"]:
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(T, spec.H, generator=g).to(torch.bfloat16)
            for exact in (True, False):
                with optimized.batch_invariant_mode(True):
                    layer(x, exact=exact)   # warm: pack caches, buffers
                    ts = []
                    for _ in range(cfg["rounds"]):
                        dist.barrier()
                        t0 = time.perf_counter()
                        layer(x, exact=exact)
                        dist.barrier()
                        ts.append(time.perf_counter() - t0)
                rows.append(dict(world=world, ep=ep, tp=tp, tokens_per_rank=T, variant="exact" if exact else "fast",
                                 median_ms=1e3 * sorted(ts)[len(ts) // 2], min_ms=1e3 * min(ts), max_ms=1e3 * max(ts),
                                 rounds=len(ts)))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def time_worlds(worlds, cfg: dict) -> list[dict]:
    """Wall time of one layer forward (barrier to barrier) per world size and layout, on gloo."""
    from optimized.parallel import spawn
    rows = []
    for w in worlds:
        with tempfile.TemporaryDirectory(prefix="moelab-006-") as d:
            out = os.path.join(d, "t.json")
            spawn(_time_worker, w, cfg, out, timeout_s=300)
            with open(out) as f:
                rows += json.load(f)
    return rows
