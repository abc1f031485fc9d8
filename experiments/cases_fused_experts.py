"""fused_experts (seed 000): decode bandwidth, prefill GFLOP/s and the per-block dispatch grid.

Three entry points:
  * `cases(quick)` for `python -m experiments.bench --ops fused_experts`: decode points
    against the eager way with pre-dequantized bf16 weights (a Python loop over the routed
    experts, F.linear, the activation in torch, index_add_), prefill points against a dense
    matmul of the same work: bf16 where the CPU has native bf16 (target: ratio >= 0.5, i.e.
    >= 50% of its GFLOP/s), elsewhere the faster of bf16 and f32 (>= 0.6 against f32, issue 32).
  * `dispatch_grid(...)`: rows of the dispatch experiment (shape x batch size x concentrated
    routing x policy), for the notebook.
  * `python -m experiments.cases_fused_experts [--quick] [--grid] [--csv DIR]`: every target
    of issue 5 with GB/s, GFLOP/s, the read bandwidth measured in the same run and a verdict.

Shapes: Qwen3-30B-A3B (fp8_block, E=128, K=8, H=2048, I=768, silu), GPT-OSS-20B (mxfp4,
E=32, K=4, H=I=2880, swiglu_oai with biases) and, our choice for the grid, OLMoE-1B-7B
(bf16, E=64, K=8, H=2048, I=1024). Weights are random codes of the format (values do not
change the speed), prepacked once (`optimized.prepack_moe_weights`), and rotate through
cold copies (experiments.timing.Rotating) so every call reads its experts from memory.
Bytes read = the routed experts' quantized weights and scales only. Data for one shape at
a time is kept (the copies take ~1-4 GB).
"""
from __future__ import annotations

import argparse
import functools
import gc
import itertools
import math
import statistics
import sys

import torch
import torch.nn.functional as F

import optimized
from optimized.tune.calibrate import random_weights

from . import timing
from .bench import Case
from .timing import Rotating

SHAPES = {
    "qwen3-30b-a3b": dict(E=128, K=8, H=2048, I=768, quant="fp8_block", activation="silu", bias=False),
    "gpt-oss-20b": dict(E=32, K=4, H=2880, I=2880, quant="mxfp4", activation="swiglu_oai", bias=True),
    "olmoe-1b-7b": dict(E=64, K=8, H=2048, I=1024, quant="bf16", activation="silu", bias=False),
}
POLICIES = ("tiny", "blocked", "global", "per_block", "auto")
GRID_T = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRID_DISTS = ("hot_expert", "all_to_one")


# --------------------------------------------------------------------------- routing
def routing(dist: str, T: int, E: int, K: int, seed: int = 0, p: float = 0.9):
    """(topk_weights [T, K] f32, topk_ids [T, K] int32), distinct experts per token.

    uniform: K random experts per token. hot_expert: a fraction p of the tokens pick one hot
    expert (in slot 0), the other slots and tokens uniform. all_to_one: every token picks the
    same K experts. (The names and meanings of verify.distributions.)"""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.int64)
    if dist == "all_to_one" and T:
        ids[:] = torch.randperm(E, generator=g)[:K]
    elif dist == "hot_expert" and T:
        hot = int(torch.randint(E, (1,), generator=g))
        for t in torch.nonzero(torch.rand(T, generator=g) < p).flatten().tolist():
            row = ids[t]
            j = torch.nonzero(row == hot).flatten()
            if j.numel():
                row[j[0]] = row[0]
            row[0] = hot
    elif dist != "uniform":
        raise ValueError(f"routing: argument 'dist' must be uniform, hot_expert or all_to_one; got {dist!r}")
    w = torch.rand(T, K, generator=g)
    return w / w.sum(1, keepdim=True).clamp(min=1e-9), ids.to(torch.int32)


# ------------------------------------------------------------------------ the data
class ShapeData:
    """Prepacked weights (rotating cold copies), biases, and optionally pre-dequantized bf16
    weights for the eager baseline (rotating too)."""

    def __init__(self, name: str, eager: bool, min_copies: int = 2):
        s = SHAPES[name]
        self.name, self.s = name, s
        E, H, I, q = s["E"], s["H"], s["I"], s["quant"]
        w13, w2, s13, s2 = random_weights(q, 1, H, I)
        self.expert_bytes = sum(t.numel() * t.element_size() for t in (w13, w2, s13, s2) if t is not None)
        seeds = itertools.count()

        self.min_copies = min_copies
        self.packed = Rotating(lambda: self._packed(q, E, H, I, next(seeds)), E * self.expert_bytes,
                               min_copies=min_copies)
        g = torch.Generator().manual_seed(7)
        self.b13 = torch.randn(E, 2 * I, generator=g) * 0.1 if s["bias"] else None
        self.b2 = torch.randn(E, H, generator=g) * 0.1 if s["bias"] else None
        self.eager = None
        if eager:
            dt = eager_weight_dtype(name)

            def make():   # bf16 values, held in dt
                gg = torch.Generator().manual_seed(next(seeds))
                W13 = torch.empty(E, 2 * I, H, dtype=dt)
                W2 = torch.empty(E, H, I, dtype=dt)
                for e in range(E):
                    W13[e] = (torch.randn(2 * I, H, generator=gg) / H ** 0.5).bfloat16()
                    W2[e] = (torch.randn(H, I, generator=gg) / I ** 0.5).bfloat16()
                return W13, W2
            self.eager = Rotating(make, E * 3 * H * I * dt.itemsize)
            self.eb13 = None if self.b13 is None else self.b13.bfloat16().to(dt)
            self.eb2 = None if self.b2 is None else self.b2.bfloat16().to(dt)

    @staticmethod
    def _packed(q, E, H, I, seed):
        w13, w2, s13, s2 = random_weights(q, E, H, I, seed=seed)
        return optimized.prepack_moe_weights(w13, w2, q, s13, s2)

    def ours(self, x, tw, ids, dispatch="auto"):
        s = self.s
        return optimized.fused_experts(x, self.packed.next(), None, tw, ids, quant=s["quant"],
                                       w13_bias=self.b13, w2_bias=self.b2, activation=s["activation"],
                                       dispatch=dispatch)

    def standard(self) -> Rotating:
        """Standard-layout weights (rotating cold copies, built on first use), every copy's
        pack-cache entry filled for all experts (`warm_pack_cache`), so that calls measure the
        cache's steady state ("from the second call on"). Each copy is a different weight set,
        so each has its own entry; the cap must hold them all (checked by the caller)."""
        if getattr(self, "_std", None) is None:
            s = self.s
            E, H, I, q = s["E"], s["H"], s["I"], s["quant"]
            seeds = itertools.count(2000)
            self._std = Rotating(lambda: random_weights(q, E, H, I, seed=next(seeds)), E * self.expert_bytes,
                                 min_copies=self.min_copies)
            for w in self._std.items:
                warm_pack_cache(w, s)
        return self._std

    def cached(self, x, tw, ids, dispatch="auto"):
        """Standard-layout weights through the pack cache (optimized/pack_cache.py)."""
        s = self.s
        w13, w2, s13, s2 = self.standard().next()
        return optimized.fused_experts(x, w13, w2, tw, ids, quant=s["quant"], w13_scale=s13, w2_scale=s2,
                                       w13_bias=self.b13, w2_bias=self.b2, activation=s["activation"],
                                       dispatch=dispatch)

    def peer_set(self):
        """The peers' forms of this shape's weights (experiments/peers.py), made on first use from
        the same seeds as our prepacked copies (0, 1, ...: the same values), released with it."""
        if getattr(self, "_peers", None) is None:
            from .peers import FusedExpertsPeers
            self._peers = FusedExpertsPeers(self.s, list(range(len(self.packed.items) + 64)), (self.b13, self.b2))
        return self._peers

    def eager_call(self, x, tw, ids):
        W13, W2 = self.eager.next()
        return eager_moe(x, W13, W2, tw, ids, self.s["activation"], self.eb13, self.eb2)

    def routed_bytes(self, ids) -> int:
        return int(torch.unique(ids[ids >= 0]).numel()) * self.expert_bytes

    def flops(self, ids) -> float:
        return 2.0 * int((ids >= 0).sum()) * 3 * self.s["H"] * self.s["I"]


def warm_pack_cache(w, s) -> None:
    """One call routing every expert of weight set w, so its pack-cache entry is complete."""
    E, K, H = s["E"], s["K"], s["H"]
    ids = torch.arange(E, dtype=torch.int32).reshape(-1, K) if E % K == 0 else \
        torch.arange(E, dtype=torch.int32).reshape(-1, 1)
    tw = torch.full(ids.shape, 1.0 / ids.shape[1])
    optimized.fused_experts(torch.zeros(ids.shape[0], H, dtype=torch.bfloat16), w[0], w[1], tw, ids,
                            quant=s["quant"], w13_scale=w[2], w2_scale=w[3], activation=s["activation"])


def eager_moe(x, W13, W2, tw, ids, activation, b13=None, b2=None, alpha=1.702, limit=7.0):
    """The eager PyTorch way with pre-dequantized weights (bf16, or f32 where that is faster:
    eager_weight_dtype): a loop over routed experts."""
    T, H = x.shape
    I = W2.shape[2]
    out = torch.zeros(T, H, dtype=torch.float32)
    flat = ids.flatten()
    for e in torch.unique(flat[flat >= 0]).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        h = F.linear(x[tok].to(W13.dtype), W13[e], None if b13 is None else b13[e])
        if activation == "silu":
            a = F.silu(h[:, :I]) * h[:, I:]
        else:
            g = h[:, 0::2].clamp(max=limit)
            a = g * torch.sigmoid(alpha * g) * (h[:, 1::2].clamp(-limit, limit) + 1)
        y = F.linear(a, W2[e], None if b2 is None else b2[e])
        out.index_add_(0, tok, y.float() * tw[tok, slot].unsqueeze(1))
    return out.bfloat16()


_current: dict = {}


def shape_data(name: str, eager: bool, min_copies: int = 2) -> ShapeData:
    """One shape's data at a time (built on first use, the previous one released: collected
    before the next is built, since the peers' closures make reference cycles, and two shapes'
    weight copies do not fit in 24 GB: `--repeat 3` was killed for memory without it)."""
    d = _current.get(name)
    if d is None or (eager and d.eager is None):
        _current.clear()
        gc.collect()
        d = _current[name] = ShapeData(name, eager, min_copies)
    return d


class _Lazy:
    """A callable that builds its shape's data on first call (so `cases()` allocates nothing)."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __call__(self):
        return self.fn(shape_data(self.name, eager=True))


# --------------------------------------------------------------------------- cases
DECODE = (("qwen3-30b-a3b", (1, 4, 16), 1.3), ("gpt-oss-20b", (1, 4), None), ("olmoe-1b-7b", (1, 4, 16), None))
PREFILL_T = 512
# The targets follow the level the kernels run at. AVX-512 (issue 13), ours / the peer
# (experiments/peers.py): fp8 decode >= 1.0x vLLM's fused_experts_cpu, mxfp4 decode and prefill
# >= 1.1x it, bf16 decode and prefill >= 1.0x both vLLM's cpu_fused_moe and zentorch's fused MoE;
# fp8 decode >= 80% of the read bandwidth at 2 threads. avx2 (issue 32): bf16 decode >= 1.0x and
# bf16 prefill >= 1.5x vLLM's cpu_fused_moe (its AVX2 build; the fp8 / mxfp4 op is not in it);
# fp8 and mxfp4 decode >= 70% of the read bandwidth at 1 and 2 threads. A bandwidth target is
# judged on bench's probe_frac: each round against the read probe timed in that same round.
PEER_TARGET = {"fp8_block": 1.0, "mxfp4": 1.1, "bf16": 1.0}
PEER_PREFILL_TARGET_AVX2 = 1.5
BW_TARGET = {"fp8_block": 0.8}
BW_TARGET_AVX2 = {"fp8_block": 0.7, "mxfp4": 0.7}
PEER_PREFILL_T = {"olmoe-1b-7b": (128, 512), "qwen3-30b-a3b": (512,), "gpt-oss-20b": (512,)}


def avx2_level() -> bool:
    return optimized.backend_info()["active"] == "avx2"


def bw_target(quant: str) -> float | None:
    """The level's read-bandwidth target of a decode point (None: no such target)."""
    if avx2_level():
        return BW_TARGET_AVX2.get(quant)
    return BW_TARGET.get(quant) if torch.get_num_threads() >= 2 else None


def _x(T, H, seed=3):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).bfloat16()


def decode_points(quick: bool):
    """(shape, T, tw, ids, target) of the decode targets (uniform routing)."""
    out = []
    for name, Ts, target in DECODE:
        s = SHAPES[name]
        for T in (Ts[:2] if quick else Ts):
            tw, ids = routing("uniform", T, s["E"], s["K"], seed=T)
            out.append((name, T, tw, ids, target))
    return out


def prefill_dense(name: str, rows: int, dtype: torch.dtype = torch.bfloat16):
    """A dense matmul of the same work as `rows` routed rows of shape `name`: [rows, H] x
    [H, 2I], then [rows, I] x [I, H] (weights of one expert, so nothing but the GEMMs)."""
    H, I = SHAPES[name]["H"], SHAPES[name]["I"]
    g = torch.Generator().manual_seed(5)
    X = torch.randn(rows, H, generator=g).to(dtype)
    A = torch.randn(rows, I, generator=g).to(dtype)
    W1 = (torch.randn(2 * I, H, generator=g) / H ** 0.5).to(dtype)
    W2 = (torch.randn(H, I, generator=g) / I ** 0.5).to(dtype)
    return lambda: (F.linear(X, W1), F.linear(A, W2))


def native_bf16() -> bool:
    """Whether this run multiplies bf16 natively (the avx512_bf16 level); elsewhere torch's bf16
    GEMM is a slow fallback, and a user would run the dense baseline in f32. The active level, not
    the CPU's: a capped run caps torch's oneDNN too (timing.cap_libraries)."""
    return optimized.backend_info()["active"] == "avx512_bf16"


def faster_dtype(make) -> torch.dtype:
    """bf16 where the run has native bf16; elsewhere whichever of bf16 and f32 runs `make(dtype)`
    (a callable) faster, timed here in a few interleaved rounds."""
    if native_bf16():
        return torch.bfloat16
    t = timing.compare({"bf16": make(torch.bfloat16), "f32": make(torch.float32)}, rounds=3, min_time=0.05)
    return torch.float32 if t["f32"].median < t["bf16"].median else torch.bfloat16


@functools.lru_cache(maxsize=None)
def eager_weight_dtype(name: str) -> torch.dtype:
    """The decode baseline's weight dtype (faster_dtype of one token through 8 experts' W13:
    torch's bf16 GEMV can be a slow fallback without native bf16). Once per shape and process."""
    s = SHAPES[name]
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(8, 2 * s["I"], s["H"], generator=g) / s["H"] ** 0.5).bfloat16()
    x = torch.randn(1, s["H"], generator=g).bfloat16()

    def gemvs(dt):
        wd, xd = w.to(dt), x.to(dt)
        return lambda: [F.linear(xd, wd[e]) for e in range(wd.shape[0])]
    return faster_dtype(gemvs)


def prefill_baseline_dtype(name: str, rows: int) -> torch.dtype:
    """The dense prefill baseline's dtype: faster_dtype of the shape's dense GEMMs."""
    return faster_dtype(lambda dt: prefill_dense(name, rows, dt))


def cases(quick: bool):
    out = []
    for name, T, tw, ids, target in decode_points(quick):
        s = SHAPES[name]
        x = _x(T, s["H"])
        nbytes = int(torch.unique(ids).numel()) * _expert_bytes(name)
        # an f32 eager baseline says so in the name (bf16 is the default one)
        suffix = " (eager f32)" if eager_weight_dtype(name) == torch.float32 else ""
        out.append(Case("fused_experts", f"decode {name} {s['quant']} T={T}{suffix}",
                        _Lazy(name, lambda d, x=x, tw=tw, ids=ids: d.eager_call(x, tw, ids)),
                        _Lazy(name, lambda d, x=x, tw=tw, ids=ids: d.ours(x, tw, ids)),
                        nbytes=nbytes, target=target,
                        peers=_Lazy(name, lambda d, x=x, tw=tw, ids=ids: d.peer_set().peers(x, tw, ids)),
                        peer_target=PEER_TARGET[s["quant"]], cold=True,
                        bw_target=bw_target(s["quant"])))
        out.append(Case("fused_experts", f"decode {name} {s['quant']} T={T} standard layout (cached){suffix}",
                        _Lazy(name, lambda d, x=x, tw=tw, ids=ids: d.eager_call(x, tw, ids)),
                        _Lazy(name, lambda d, x=x, tw=tw, ids=ids: d.cached(x, tw, ids)),
                        nbytes=nbytes, target=target, cold=True))
    if not quick:
        for name in ("qwen3-30b-a3b", "gpt-oss-20b"):
            s = SHAPES[name]
            tw, ids = routing("uniform", PREFILL_T, s["E"], s["K"], seed=1)
            x = _x(PREFILL_T, s["H"])
            dense = {}
            rows = PREFILL_T * s["K"]
            dtype = prefill_baseline_dtype(name, rows)

            def eager(d, rows=rows, name=name, dtype=dtype):
                if name not in dense:
                    dense[name] = prefill_dense(name, rows, dtype)
                return dense[name]()

            # target: issue 5's 0.5 of torch's native bf16 GEMM; issue 32's 0.6 of an f32 GEMM
            base = "bf16" if dtype == torch.bfloat16 else "f32"
            out.append(Case("fused_experts", f"prefill {name} T={PREFILL_T} (vs dense {base})",
                            _Lazy(name, eager), _Lazy(name, lambda d, x=x, tw=tw, ids=ids: d.ours(x, tw, ids)),
                            nbytes=s["E"] * _expert_bytes(name), target=0.5 if base == "bf16" else 0.6,
                            peers=_Lazy(name, lambda d, x=x, tw=tw, ids=ids: d.peer_set().peers(x, tw, ids)),
                            peer_target=PEER_TARGET[s["quant"]], cold=True))
        s = SHAPES["olmoe-1b-7b"]
        for T in PEER_PREFILL_T["olmoe-1b-7b"]:
            tw, ids = routing("uniform", T, s["E"], s["K"], seed=1)
            x = _x(T, s["H"])
            out.append(Case("fused_experts", f"prefill olmoe-1b-7b bf16 T={T}",
                            _Lazy("olmoe-1b-7b", lambda d, x=x, tw=tw, ids=ids: d.eager_call(x, tw, ids)),
                            _Lazy("olmoe-1b-7b", lambda d, x=x, tw=tw, ids=ids: d.ours(x, tw, ids)),
                            nbytes=s["E"] * _expert_bytes("olmoe-1b-7b"),
                            peers=_Lazy("olmoe-1b-7b", lambda d, x=x, tw=tw, ids=ids: d.peer_set().peers(x, tw, ids)),
                            peer_target=PEER_PREFILL_TARGET_AVX2 if avx2_level() else 1.0, cold=True))
    return out


def _expert_bytes(name: str) -> int:
    s = SHAPES[name]
    H, I = s["H"], s["I"]
    return {"bf16": 6 * H * I, "fp8_block": 3 * H * I + 4 * (-(-2 * I // 128) * -(-H // 128) + -(-H // 128) * -(-I // 128)),
            "mxfp4": 3 * H * I // 2 + 3 * H * I // 32}[s["quant"]]


# ------------------------------------------------------------------------ the grid
def compare_cpu_time(candidates: dict, *, rounds: int = 5, min_time: float = 0.05) -> dict:
    """Like timing.compare, but each call runs on ONE thread and is timed by the calling
    thread's CPU clock (time.thread_time). On a machine shared with other jobs, 2-thread wall
    times are dominated by scheduling (a parallel region waits whenever one of its threads is
    descheduled: the same call takes 1 ms or 20 ms); CPU time counts only the cycles the
    kernel ran, memory stalls included, so it compares kernels fairly. Interleaved rounds,
    one Timing (seconds per call) per candidate."""
    import time
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {name: timing.Timing(name) for name in candidates}
        for fn in candidates.values():
            fn()
        for _ in range(rounds):
            for name, fn in candidates.items():
                n, t0 = 0, time.thread_time()
                while True:
                    fn()
                    n += 1
                    el = time.thread_time() - t0
                    if el >= min_time and n >= 2:
                        break
                out[name].times.append(el / n)
        return out
    finally:
        torch.set_num_threads(old)


def block_decisions(ids, E: int, quant: str) -> dict:
    """Per policy, the kernel of each expert block (True = blocked), from optimized.dispatch."""
    from optimized import dispatch
    T, K = ids.shape
    flat = ids.flatten().long()
    m = torch.bincount(flat[flat >= 0], minlength=E)
    m = m[m > 0].tolist()
    out = {}
    for p in POLICIES:
        code, cross, _ = dispatch.fused_experts_plan(T, K, E, quant, p)
        out[p] = tuple(code == 1 or (code == 2 and mm >= cross) for mm in m)
    return out


def dispatch_grid(shapes=("qwen3-30b-a3b", "gpt-oss-20b", "olmoe-1b-7b"), batch_sizes=GRID_T,
                  dists=GRID_DISTS, policies=POLICIES, rounds: int = 3, min_time: float = 0.02,
                  clock: str = "wall", progress=None) -> list[dict]:
    """Per (shape, T, dist): each policy's median time (interleaved rounds, cold weights),
    per_block / global speedup (median of per-round ratios) and auto against the best fixed
    policy (tiny, blocked, global, per_block). clock: "wall" (timing.compare, the op's own
    threads) or "cpu" (compare_cpu_time: one thread, CPU time). Returns rows."""
    rows = []
    for name in shapes:
        d = shape_data(name, eager=False)
        s = d.s
        for dist in dists:
            for T in batch_sizes:
                tw, ids = routing(dist, T, s["E"], s["K"], seed=T)
                x = _x(T, s["H"])
                fns = {p: (lambda p=p: d.ours(x, tw, ids, p)) for p in policies}
                t = compare_cpu_time(fns, rounds=rounds, min_time=min_time) if clock == "cpu" else \
                    timing.compare(fns, rounds=rounds, min_time=min_time)
                row = {"shape": name, "quant": s["quant"], "T": T, "dist": dist, "clock": clock,
                       "avg_m": max(1, T * s["K"] // s["E"])}
                for p in policies:
                    row[f"{p}_us"] = t[p].median * 1e6
                row["per_block_vs_global"] = timing.ratio(t["global"], t["per_block"])[0]
                fixed = [p for p in ("tiny", "blocked", "global", "per_block") if p in policies]
                best = min(fixed, key=lambda p: t[p].median)
                row["best_fixed"] = best
                row["auto_vs_best"] = timing.ratio(t[best], t["auto"])[0] if "auto" in policies else float("nan")
                # Policies whose per-block kernel choices equal auto's run the same code: any
                # time difference between them is measurement noise.
                dec = block_decisions(ids, s["E"], s["quant"])
                row["same_as_auto"] = "+".join(p for p in fixed if dec[p] == dec["auto"])
                row["n_blocks"] = len(dec["auto"])
                row["n_blocked_auto"] = sum(dec["auto"])
                rows.append(row)
                if progress:
                    progress(row)
    return rows


def geomean(v):
    v = list(v)
    return math.exp(sum(math.log(a) for a in v) / len(v)) if v else float("nan")


# -------------------------------------------------------------------------- report
def best_read_bandwidth(nbytes: int = 256 << 20, rounds: int = 9) -> float:
    """Read bandwidth from the fastest of several large f32 sums: on a shared machine other
    processes only ever slow a round down, so the best round is the least disturbed one (the
    same statistic as the `best` columns of run_targets)."""
    import time
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def run_targets(quick: bool, rounds: int):
    """Every target of issue 5. Per point: interleaved rounds (timing.compare); speedup = the
    median of per-round ratios; GB/s and the bandwidth fraction from the median time against
    timing.read_bandwidth() (median), and, as `best`, from the fastest round against the
    fastest read-bandwidth round (best_read_bandwidth)."""
    bw, bw_best = timing.read_bandwidth(), best_read_bandwidth()
    rows = []

    def row(point, t, base, nbytes, fl, target, met_fn, **extra):
        sp = timing.ratio(t[base], t["ours"])
        med, best = t["ours"].median, min(t["ours"].times)
        r = {"point": point, "ours_us": med * 1e6, "ours_best_us": best * 1e6, "ours_iqr_us": t["ours"].iqr * 1e6,
             "base_us": t[base].median * 1e6, "base_best_us": min(t[base].times) * 1e6,
             "speedup": sp[0], "speedup_min": sp[1], "speedup_max": sp[2],
             "speedup_best": min(t[base].times) / best,
             "GBps": nbytes / med / 1e9, "bw_frac": nbytes / med / bw,
             "GBps_best": nbytes / best / 1e9, "bw_frac_best": nbytes / best / bw_best,
             "GFLOPs": fl / med / 1e9, "target": target, **extra}
        r["met"] = met_fn(r)
        rows.append(r)

    big = torch.ones(64 << 20, dtype=torch.float32)   # 256 MB: the read-bandwidth probe
    for name, T, tw, ids, target in decode_points(quick):
        d = shape_data(name, eager=True)
        x = _x(T, d.s["H"])
        # The bandwidth probe runs in the same interleaved rounds, so each round's fraction
        # compares ours with the memory system as it was in that round (a shared machine).
        t = timing.compare({"eager": lambda: d.eager_call(x, tw, ids), "ours": lambda: d.ours(x, tw, ids),
                            "read": lambda: big.sum()}, rounds=rounds)
        nbytes = d.routed_bytes(ids)
        fr = sorted((nbytes / o) / (big.numel() * 4 / r) for o, r in zip(t["ours"].times, t["read"].times))
        row(f"decode {name} T={T}", t, "eager", nbytes, d.flops(ids),
            "bw>=60%" + (f", >={target}x eager" if target else ""),
            lambda r, target=target: r["bw_frac_rounds"] >= 0.6 and (target is None or r["speedup"] >= target),
            bw_frac_rounds=statistics.median(fr), bw_frac_rounds_min=fr[0], bw_frac_rounds_max=fr[-1],
            read_GBps=big.numel() * 4 / t["read"].median / 1e9)
    if not quick:
        for name in ("qwen3-30b-a3b", "gpt-oss-20b"):
            d = shape_data(name, eager=False)
            s = d.s
            tw, ids = routing("uniform", PREFILL_T, s["E"], s["K"], seed=1)
            x = _x(PREFILL_T, s["H"])
            dtype = prefill_baseline_dtype(name, PREFILL_T * s["K"])
            dense = prefill_dense(name, PREFILL_T * s["K"], dtype)
            t = timing.compare({"dense": dense, "ours": lambda: d.ours(x, tw, ids)}, rounds=max(3, rounds // 2),
                               min_time=0.2)
            fl = d.flops(ids)
            goal = 0.5 if dtype == torch.bfloat16 else 0.6
            row(f"prefill {name} T={PREFILL_T}", t, "dense", s["E"] * d.expert_bytes, fl,
                f">={goal:.0%} of dense {str(dtype).removeprefix('torch.')} GFLOP/s",
                lambda r, goal=goal: r["speedup"] >= goal, dense_GFLOPs=fl / t["dense"].median / 1e9)
    return bw, bw_best, rows


CACHED_SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b", "olmoe-1b-7b")
CACHED_T = (1, 4, 16)


def _same_buffers(d: ShapeData) -> Rotating:
    """PackedMoEWeights over the pack cache's own buffers of each standard copy (the control of
    `run_cached(control=True)`: the prepacked path reading the very memory the cached path
    reads, so cached vs this is the cache's bookkeeping alone, and prepacked vs this is where
    the two sets of buffers happen to sit in memory)."""
    from optimized import pack_cache
    from optimized.fused_experts import PackedMoEWeights
    s = d.s
    E, K, H, I, q = s["E"], s["K"], s["H"], s["I"], s["quant"]
    ids = torch.arange(E, dtype=torch.int32).reshape(-1, K)
    items = []
    for w13, w2, s13, s2 in d.standard().items:
        p13, p2, q13, q2, f13, f2 = pack_cache.packed_weights(w13, w2, s13, s2, q, ids)
        items.append(PackedMoEWeights(q, E, H, I, p13, p2, q13, q2, f13, f2))
    r = Rotating.__new__(Rotating)
    r.items, r.i = items, 0
    return r


def run_cached(shapes=CACHED_SHAPES, batch_sizes=CACHED_T, threads=(1, 2), rounds: int = 7,
               min_time: float = 0.05, progress=None, control: bool = False, copies: int = 2) -> list[dict]:
    """Issue 18: standard-layout weights through the pack cache against the same weights
    prepacked, decode (uniform routing), side by side in interleaved rounds (timing.compare),
    both rotating through cold copies. Every standard copy's entry is filled before timing
    (`ShapeData.standard`), so this is the steady state from the second call on; the rows
    record the cache's counters around the timing (no eviction, no packing may happen).
    ratio = prepacked time / cached time per round = cached bandwidth / prepacked bandwidth
    (the same bytes): median, min, max over the rounds. copies: weight sets per side (at least;
    more average over where each set happens to sit in memory, which moves a decode call by
    several percent on this machine: the A/A control of --control)."""
    from optimized import pack_cache
    rows = []
    old = torch.get_num_threads()
    try:
        for name in shapes:
            _current.clear()
            pack_cache.clear()
            d = shape_data(name, eager=False, min_copies=copies)
            s = d.s
            d.standard()
            same = _same_buffers(d) if control else None
            again = None
            if control:   # an A/A control: a second prepacked copy of the same standard weights, made now
                again = Rotating.__new__(Rotating)
                again.items, again.i = [optimized.prepack_moe_weights(w[0], w[1], s["quant"], w[2], w[3])
                                        for w in d.standard().items], 0
            for th in threads:
                torch.set_num_threads(th)
                for T in batch_sizes:
                    tw, ids = routing("uniform", T, s["E"], s["K"], seed=T)
                    x = _x(T, s["H"])
                    before = pack_cache.stats()
                    fns = {"prepacked": lambda: d.ours(x, tw, ids), "cached": lambda: d.cached(x, tw, ids)}
                    if control:
                        fns["same_buffers"] = lambda: optimized.fused_experts(
                            x, same.next(), None, tw, ids, quant=s["quant"], w13_bias=d.b13, w2_bias=d.b2,
                            activation=s["activation"])
                        fns["prepacked_again"] = lambda: optimized.fused_experts(
                            x, again.next(), None, tw, ids, quant=s["quant"], w13_bias=d.b13, w2_bias=d.b2,
                            activation=s["activation"])
                    t = timing.compare(fns, rounds=rounds, min_time=min_time)
                    after = pack_cache.stats()
                    nbytes = d.routed_bytes(ids)
                    r = timing.ratio(t["prepacked"], t["cached"])
                    row = {"shape": name, "quant": s["quant"], "T": T, "threads_used": th,
                           "prepacked_us": t["prepacked"].median * 1e6, "cached_us": t["cached"].median * 1e6,
                           "prepacked_min_us": min(t["prepacked"].times) * 1e6,
                           "cached_min_us": min(t["cached"].times) * 1e6,
                           "prepacked_GBps": nbytes / t["prepacked"].median / 1e9,
                           "cached_GBps": nbytes / t["cached"].median / 1e9,
                           "bw_ratio": r[0], "bw_ratio_min": r[1], "bw_ratio_max": r[2], "rounds": rounds,
                           "copies": len(d.standard().items),
                           "cache_entries": after["entries"], "cache_bytes": after["bytes"],
                           "evicted_during": after["evicted"] - before["evicted"],
                           "packed_during": after["experts_packed"] - before["experts_packed"],
                           "load_after": _loadavg().split()[0]}
                    if control:
                        rc = timing.ratio(t["same_buffers"], t["cached"])
                        rp = timing.ratio(t["prepacked"], t["same_buffers"])
                        row.update(same_buffers_us=t["same_buffers"].median * 1e6, cached_vs_same=rc[0],
                                   cached_vs_same_min=rc[1], cached_vs_same_max=rc[2], same_vs_prepacked=rp[0],
                                   same_vs_prepacked_min=rp[1], same_vs_prepacked_max=rp[2])
                        ra = timing.ratio(t["prepacked"], t["prepacked_again"])
                        row.update(again_us=t["prepacked_again"].median * 1e6, again_vs_prepacked=ra[0],
                                   again_vs_prepacked_min=ra[1], again_vs_prepacked_max=ra[2])
                    rows.append(row)
                    if progress:
                        progress(row)
    finally:
        torch.set_num_threads(old)
        _current.clear()
    return rows


def cache_costs(shapes=CACHED_SHAPES, reps: int = 200) -> list[dict]:
    """The pack cache's own costs per shape, on the current threads: `hit_us`, the per-call
    bookkeeping of a call whose experts are all packed (key check + the pack op's id scan,
    T=1, median of `reps`); `first_us`, a T=1 decode's first call on fresh weights (packs its
    K experts, then runs) and `pack_us_per_expert` = its packing part per expert (the first
    call's time minus a warm call's, over K); `prepack_all_s`, prepack_moe_weights of all E."""
    import time
    from optimized import pack_cache
    rows = []
    for name in shapes:
        s = SHAPES[name]
        E, K, H, I, q = s["E"], s["K"], s["H"], s["I"], s["quant"]
        w = random_weights(q, E, H, I, seed=11)
        tw, ids = routing("uniform", 1, E, K, seed=1)
        x = _x(1, H)
        kw = dict(quant=q, w13_scale=w[2], w2_scale=w[3], activation=s["activation"])
        pack_cache.clear()
        t0 = time.perf_counter()
        optimized.fused_experts(x, w[0], w[1], tw, ids, **kw)
        first = time.perf_counter() - t0
        warm = []
        for _ in range(5):
            t0 = time.perf_counter()
            optimized.fused_experts(x, w[0], w[1], tw, ids, **kw)
            warm.append(time.perf_counter() - t0)
        hits = []
        for _ in range(reps):
            t0 = time.perf_counter()
            pack_cache.packed_weights(w[0], w[1], w[2], w[3], q, ids)
            hits.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        optimized.prepack_moe_weights(w[0], w[1], q, w[2], w[3])
        pre = time.perf_counter() - t0
        rows.append({"shape": name, "quant": q, "E": E, "K": K, "threads_used": torch.get_num_threads(),
                     "hit_us": statistics.median(hits) * 1e6, "first_us": first * 1e6,
                     "warm_us": statistics.median(warm) * 1e6,
                     "pack_us_per_expert": (first - statistics.median(warm)) / K * 1e6,
                     "prepack_all_s": pre, "entry_bytes": pack_cache.stats()["bytes"]})
        pack_cache.clear()
        del w
    return rows


def summarize_cached(paths, disturbed: float = 1.5) -> list[str]:
    """Lines summarizing several `--cached` runs (their printed .txt output): per point, each
    run's cached/prepacked ratio, then the median (min..max) over the runs whose prepacked time
    is under `disturbed` x the point's best run (a slower one was disturbed by other jobs)."""
    import re
    pat = re.compile(r"(\S+)\s+(\S+)\s+T=(\d+)\s+threads=(\d)\s+prepacked\s+(\d+) us.*?cached\s+(\d+) us.*?"
                     r"cached/prepacked ([\d.]+)")
    data: dict = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                m = pat.search(line)
                if m:
                    data.setdefault((m[2], int(m[3]), int(m[4])), []).append((float(m[5]), float(m[7])))
    out = []
    for (q, T, th), v in sorted(data.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        best = min(t for t, _ in v)
        ok = [(t, r) for t, r in v if t < disturbed * best]
        rs = [r for _, r in ok]
        out.append(f"{q:<10} T={T:<3} threads={th}  per run: " + " ".join(f"{r:.3f}" for _, r in v) +
                   f"  | {len(ok)} of {len(v)} undisturbed: median {statistics.median(rs):.3f} "
                   f"({min(rs):.3f}..{max(rs):.3f}), prepacked {statistics.median([t for t, _ in ok]):.0f} us")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.cases_fused_experts", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--grid", action="store_true", help="also run the 27-point dispatch grid (x2 routings)")
    p.add_argument("--no-targets", action="store_true")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="grid timing: wall clock on --threads, or CPU time on one thread (shared machines)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--grid-rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--csv", default=None, help="folder for fused_experts_targets.csv / _grid.csv")
    p.add_argument("--control", action="store_true",
                   help="with --cached: also time the prepacked path on the cache's own buffers")
    p.add_argument("--cached", default=None, metavar="NAME",
                   help="only the issue-18 comparison (standard layout through the pack cache vs prepacked, "
                        "decode, 1 and 2 threads); rows to results/<machine>/NAME.csv")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="with --cached: these shapes only")
    p.add_argument("--T", nargs="+", type=int, help="with --cached: these batch sizes only")
    p.add_argument("--thread-counts", nargs="+", type=int, default=[1, 2], help="with --cached (default 1 2)")
    p.add_argument("--copies", type=int, default=2, help="with --cached: weight sets per side (default 2)")
    p.add_argument("--summarize", nargs="+", metavar="TXT", help="summarize the printed output of --cached runs")
    a = p.parse_args(argv)
    if a.summarize:
        print("\n".join(summarize_cached(a.summarize)))
        return 0
    torch.set_num_threads(a.threads)
    m = timing.machine()
    print(f"# {m['cpu']}, ISA {m['isa']}, {m['threads']} threads, torch {m['torch']}")
    if a.cached:
        print(f"# load average {_loadavg()}; cached/prepacked bandwidth = median of per-round time ratios "
              f"prepacked/cached ({a.rounds} interleaved rounds, min..max)", flush=True)

        def show(r):
            print(f"{r['shape']:<15}{r['quant']:<10}T={r['T']:<3} threads={r['threads_used']}  prepacked "
                  f"{r['prepacked_us']:8.0f} us {r['prepacked_GBps']:5.1f} GB/s  cached {r['cached_us']:8.0f} us "
                  f"{r['cached_GBps']:5.1f} GB/s  cached/prepacked {r['bw_ratio']:.3f} ({r['bw_ratio_min']:.3f}.."
                  f"{r['bw_ratio_max']:.3f})  evicted {r['evicted_during']} packed {r['packed_during']} "
                  f"load {r['load_after']}" + (
                      f"\n{'':<28}control: same buffers prepacked {r['same_buffers_us']:8.0f} us; cached/same "
                      f"{r['cached_vs_same']:.3f} ({r['cached_vs_same_min']:.3f}..{r['cached_vs_same_max']:.3f}); "
                      f"same/prepacked {r['same_vs_prepacked']:.3f} ({r['same_vs_prepacked_min']:.3f}.."
                      f"{r['same_vs_prepacked_max']:.3f}); A/A: a second prepacked copy/prepacked "
                      f"{r['again_vs_prepacked']:.3f} ({r['again_vs_prepacked_min']:.3f}..{r['again_vs_prepacked_max']:.3f})"
                      if "cached_vs_same" in r else ""), flush=True)

        rows = run_cached(shapes=a.shapes or CACHED_SHAPES, batch_sizes=a.T or CACHED_T, threads=a.thread_counts,
                          rounds=a.rounds, progress=show, control=a.control, copies=a.copies)
        print(f"# load average at the end {_loadavg()}")
        print("wrote", _rel(timing.write_csv(a.cached, rows)))
        costs = cache_costs(a.shapes or CACHED_SHAPES)
        for r in costs:
            print(f"{r['shape']:<15}{r['quant']:<10} threads={r['threads_used']}  hit (bookkeeping) {r['hit_us']:.1f} us  "
                  f"first T=1 call {r['first_us'] / 1e3:.1f} ms (warm {r['warm_us'] / 1e3:.2f} ms; packing "
                  f"{r['pack_us_per_expert'] / 1e3:.2f} ms per expert)  prepack all {r['E']}: "
                  f"{r['prepack_all_s']:.2f} s  entry {r['entry_bytes'] / 2**20:.0f} MiB", flush=True)
        print("wrote", _rel(timing.write_csv(a.cached + "_costs", costs)))
        return 0
    if not a.no_targets:
        bw, bw_best, rows = run_targets(a.quick, a.rounds)
        print(f"read bandwidth (same run): {bw / 1e9:.1f} GB/s median, {bw_best / 1e9:.1f} GB/s best round; "
              f"load average {_loadavg()}")
        print("bw: achieved / read bandwidth, per round (the probe runs interleaved with each decode "
              "point), median (min..max); prefill rows: against the run's bandwidth")
        print(f"{'point':<30}{'ours us':>9}{'(best)':>8}{'base us':>9}{'speedup (min..max)':>22}{'GB/s':>7}"
              f"{'bw (min..max)':>20}{'GFLOP/s':>9}  target")
        for r in rows:
            bwc = (f"{r['bw_frac_rounds']:.0%} ({r['bw_frac_rounds_min']:.0%}..{r['bw_frac_rounds_max']:.0%})"
                   if "bw_frac_rounds" in r else f"{r['bw_frac']:.0%}")
            print(f"{r['point']:<30}{r['ours_us']:>9.0f}{r['ours_best_us']:>8.0f}{r['base_us']:>9.0f}"
                  f"{r['speedup']:>9.2f}x ({r['speedup_min']:.2f}..{r['speedup_max']:.2f})"
                  f"{r['GBps']:>7.1f}{bwc:>20}{r['GFLOPs']:>9.1f}  "
                  f"{'ok' if r['met'] else 'MISS'} {r['target']}"
                  + (f" (dense {r['dense_GFLOPs']:.0f} GFLOP/s)" if "dense_GFLOPs" in r else "")
                  + (f" (read {r['read_GBps']:.1f} GB/s)" if "read_GBps" in r else ""))
        _write(a.csv, "fused_experts_targets.csv", rows)
    if a.grid:
        _current.clear()

        def show(r):
            print(f"{r['shape']:<15}{r['dist']:<12}T={r['T']:<4} avg_m={r['avg_m']:<3} " +
                  " ".join(f"{q}={r[f'{q}_us']:.0f}" for q in POLICIES) +
                  f"  per_block/global={r['per_block_vs_global']:.2f} auto/best({r['best_fixed']})="
                  f"{r['auto_vs_best']:.2f} auto==[{r['same_as_auto']}]", flush=True)

        grid = dispatch_grid(batch_sizes=GRID_T[::2] if a.quick else GRID_T, rounds=a.grid_rounds, clock=a.clock,
                             progress=show)
        for dist in GRID_DISTS:
            sub = [r for r in grid if r["dist"] == dist]
            print(f"{dist}: per_block vs global geomean {geomean(r['per_block_vs_global'] for r in sub):.3f} "
                  f"over {len(sub)} points; auto worst vs best fixed {min(r['auto_vs_best'] for r in sub):.3f}")
        slow = [r for r in grid if r["auto_vs_best"] < 0.97]
        real = [r for r in slow if r["best_fixed"] not in r["same_as_auto"].split("+")]
        print(f"all: per_block vs global geomean {geomean(r['per_block_vs_global'] for r in grid):.3f}; "
              f"auto >3% slower than the best fixed at {len(slow)} of {len(grid)} points, of which "
              f"{len(real)} with different kernel choices (the others run the same code: noise)")
        _write(a.csv, "fused_experts_grid.csv", grid)
    return 0


def _rel(path) -> str:
    """A path relative to the working folder when under it (outputs get committed; no machine paths)."""
    import os
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _write(folder, fname, rows):
    if not folder or not rows:
        return
    import csv
    import os
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, fname), "w", newline="") as f:
        names = list(dict.fromkeys(k for r in rows for k in r))
        w = csv.DictWriter(f, fieldnames=names, restval="")
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
