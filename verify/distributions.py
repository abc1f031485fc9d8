"""Named input distributions: routing skew for the routed ops, value shapes for the GEMMs.

Uniform random routing is the easy case; the bugs live in skew. Every distribution here is
a pure function of (parameters, seed): tensors come from a `torch.Generator` on the CPU, so
a case rebuilt from its JSON structure is bit-identical, whatever backend then runs it.

Routing distributions (`make_routing`) give router logits [T, E] f32, top-k ids [T, K]
int32 (the top K logits under route's total order: larger first, ties to the lower
index), and for `ep_shard` an expert map:

    uniform        logits ~ N(0, 1)
    zipf           expert popularity p_e ~ rank^-s (s = 0.8, 1.2 or 2.0, ranks in a random
                   order); logits = log p_e + Gumbel noise, so the top K of a token is a
                   draw without replacement from p (the Gumbel-top-k trick)
    hot_expert     a fraction p (0.5 or 0.9) of the tokens all pick one hot expert
    all_to_one     every token picks the same K experts
    empty_experts  half the experts (E // 2, at most E - K) are never picked
    ep_shard       an expert map [E] int32 sends a random subset of the experts to local
                   ids (a random order) and the rest to -1 (the holes); about 10% of the
                   id slots are -1 as well (padded slots): rows drop both ways
    exact_ties     logits from a five-value set, so most rows hold equal logits: the
                   tie rule (lower index first) decides
    near_ties      clusters of logits a few f32 ulps apart: implementations that compute
                   exp/sigmoid a few ulps differently may legitimately reorder them
    extreme        very large and very small magnitudes (up to ~3e38 for f32 and bf16,
                   ~6e4 for f16; subnormals), where softmax saturates to 0 and 1
    nan_inf        NaN, +inf and -inf scattered in (route only: SPEC's NaN order)

Dense operands (`make_gemm_operands`, for router_gemm and the gate GEMMs, which have no
routing) read the same names as shapes of the numbers a GEMM sees, so every op runs under
every name:

    uniform        x, w ~ N(0, 1)
    zipf           weight row norms fall as rank^-s: output columns of very different size
    hot_expert     a fraction p of the tokens and one weight row are 2^8 times larger
    all_to_one     every token row is the same row (outputs must agree row for row)
    empty_experts  half the weight rows are exactly zero
    ep_shard       x is a strided view with holes (every other row of a wider buffer)
    exact_ties     small integers: products and f32 sums are exact, only the output
                   rounding remains
    near_ties      heavy cancellation: x = [u, u], w = [v, -v + d] with d ~ 2^-8 v, so
                   each output is tiny next to its magnitude |x| @ |w|
    extreme        per-row and per-column power-of-two scales over a wide exponent range
                   (kept finite for the dtype)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

ROUTING_DISTS = ("uniform", "zipf", "hot_expert", "all_to_one", "empty_experts", "ep_shard",
                 "exact_ties", "near_ties", "extreme", "nan_inf")
ZIPF_EXPONENTS = (0.8, 1.2, 2.0)
HOT_FRACTIONS = (0.5, 0.9)
# Token counts on and around tile boundaries (vector widths 8/16, tiles of 4/16/32/128,
# thread blocks of 128/256/512), drawn first by the runner; random counts come second.
TILE_TOKENS = (0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 127, 128, 129, 255, 256, 257, 511, 513)
TIE_VALUES = (-1.0, 0.0, 0.5, 1.0, 2.0)   # exact in bf16 and f16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF)
    return g


def dist_params(dist: str, choice: int = 0) -> dict:
    """The parameters of a distribution, selected by a small integer (drawn by the runner)."""
    if dist == "zipf":
        return {"s": ZIPF_EXPONENTS[choice % len(ZIPF_EXPONENTS)]}
    if dist == "hot_expert":
        return {"p": HOT_FRACTIONS[choice % len(HOT_FRACTIONS)]}
    return {}


@dataclass
class Routing:
    """One routing draw. `ids` index local experts when `expert_map` is None and global
    experts otherwise; `local_ids` are always the ids mapped through the map (-1 dropped)."""
    logits: torch.Tensor                   # [T, E] f32
    ids: torch.Tensor                      # [T, K] int32, in [-1, E)
    expert_map: Optional[torch.Tensor]     # [E] int32 or None
    n_local: int                           # E_loc
    local_ids: torch.Tensor                # [T, K] int32 in [-1, E_loc)


def _randn(shape, g) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32)


def _perm(n: int, g) -> torch.Tensor:
    return torch.randperm(n, generator=g)


def _rand_subset(n: int, k: int, g) -> torch.Tensor:
    return _perm(n, g)[:k]


def ulp_steps(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """v moved by k f32 ulps (k int tensor; v finite f32, same sign region): bit arithmetic."""
    bits = v.view(torch.int32).to(torch.int64)
    sign = torch.where(v < 0, -1, 1)
    return (bits + sign * k).to(torch.int32).view(torch.float32)


def routing_logits(dist: str, T: int, E: int, K: int, g: torch.Generator, params: dict,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Router logits [T, E] f32 with the distribution's structure (exact in `dtype`)."""
    x = _randn((T, E), g)
    if dist == "uniform" or dist == "ep_shard":
        pass
    elif dist == "zipf":
        ranks = _perm(E, g).to(torch.float32) + 1.0
        logp = -params.get("s", 1.2) * torch.log(ranks)
        u = torch.rand(T, E, generator=g).clamp(1e-12, 1 - 1e-7)
        x = logp - torch.log(-torch.log(u))            # log p + Gumbel
    elif dist == "hot_expert":
        hot = int(torch.randint(E, (1,), generator=g))
        n_hot = int(round(params.get("p", 0.9) * T))
        tok = _rand_subset(T, n_hot, g)
        x[tok, hot] += 30.0
    elif dist == "all_to_one":
        chosen = _rand_subset(E, K, g)
        x[:, chosen] += 30.0
    elif dist == "empty_experts":
        n_empty = min(E // 2, E - K)
        empty = _rand_subset(E, n_empty, g)
        x[:, empty] -= 60.0
    elif dist == "exact_ties":
        vals = torch.tensor(TIE_VALUES)
        x = vals[torch.randint(len(TIE_VALUES), (T, E), generator=g)]
    elif dist == "near_ties":
        # Per row a base value; every expert sits 0..6 ulps from it, or (a third of them)
        # clearly below, so the top K comes from the cluster.
        base = (torch.rand(T, 1, generator=g) * 4.0 - 1.0).expand(T, E).contiguous()
        base = torch.where(base == 0, torch.full_like(base, 0.5), base)
        steps = torch.randint(0, 7, (T, E), generator=g)
        x = ulp_steps(base, steps)
        low = torch.rand(T, E, generator=g) < 0.33
        x = torch.where(low, x - 3.0, x)
    elif dist == "extreme":
        big = 5.0e4 if dtype == torch.float16 else 2.5e38
        choices = torch.tensor([big, -big, big / 7, -big / 3, 1e-40 if dtype != torch.float16 else 6e-8,
                                -1e-40 if dtype != torch.float16 else -6e-8, 0.0, 1e4, -1e4, 88.0, -104.0])
        pick = torch.randint(len(choices), (T, E), generator=g)
        scale = torch.rand(T, E, generator=g) * 0.5 + 0.75
        x = choices[pick] * scale
        keep_normal = torch.rand(T, E, generator=g) < 0.3
        x = torch.where(keep_normal, _randn((T, E), g) * 50.0, x)
    elif dist == "nan_inf":
        r = torch.rand(T, E, generator=g)
        x = torch.where(r < 0.08, torch.full_like(x, float("nan")), x)
        x = torch.where((r >= 0.08) & (r < 0.16), torch.full_like(x, float("inf")), x)
        x = torch.where((r >= 0.16) & (r < 0.26), torch.full_like(x, float("-inf")), x)
        if T >= 3:  # whole rows of one kind
            x[0] = float("-inf")
            x[1] = float("nan")
            x[2, : max(1, E // 2)] = float("inf")
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    return x.to(dtype).to(torch.float32)


def topk_ids(logits: torch.Tensor, K: int) -> torch.Tensor:
    """Top K column indices [T, K] int32 of each row under route's total order."""
    from reference.route import _topk_total_order  # the same order the contract defines
    return _topk_total_order(logits.to(torch.float32), K).to(torch.int32)


def make_expert_map(E: int, g: torch.Generator, n_local: Optional[int] = None):
    """An expert map [E] int32 with holes: n_local experts (a random subset, random local
    order) map to 0..n_local-1, the others to -1. Returns (map, n_local)."""
    if n_local is None:
        n_local = max(1, int(torch.randint(1, max(2, E), (1,), generator=g))) if E > 1 else 1
    local = _rand_subset(E, n_local, g)
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[local] = _perm(n_local, g).to(torch.int32)
    return emap, n_local


def make_routing(dist: str, T: int, E: int, K: int, seed: int, params: Optional[dict] = None,
                 dtype: torch.dtype = torch.float32) -> Routing:
    """Logits, ids and (ep_shard) expert map of one draw; see the module docstring."""
    params = params or {}
    g = generator(seed)
    logits = routing_logits(dist, T, E, K, g, params, dtype)
    ids = topk_ids(logits, K)
    emap, n_local, local = None, E, ids
    if dist == "ep_shard":
        emap, n_local = make_expert_map(E, g, params.get("n_local"))
        pad = torch.rand(T, K, generator=g) < 0.1
        ids = torch.where(pad, torch.full_like(ids, -1), ids)
        local = torch.where(ids >= 0, emap[ids.clamp(min=0).long()], torch.full_like(ids, -1))
    return Routing(logits, ids.contiguous(), emap, n_local, local.to(torch.int32).contiguous())


# ------------------------------------------------------------------ dense GEMM operands
def _finite_exponent_range(dtype: torch.dtype) -> int:
    return {torch.float32: 24, torch.bfloat16: 24, torch.float16: 3}[dtype]


def make_gemm_operands(dist: str, T: int, N: int, Kd: int, seed: int, params: Optional[dict] = None,
                       x_dtype: torch.dtype = torch.float32, w_dtype: Optional[torch.dtype] = None,
                       bias: bool = False):
    """(x [T, Kd], w [N, Kd], b [N] or None) for one draw, x in x_dtype, w and b in w_dtype
    (default x_dtype). Values are exact in their dtypes. For `ep_shard` x is a strided view.
    See the module docstring for what each name means here."""
    params = params or {}
    w_dtype = w_dtype or x_dtype
    g = generator(seed)
    x = _randn((T, Kd), g)
    w = _randn((N, Kd), g)
    b = _randn((N,), g) if bias else None
    if dist in ("uniform", "nan_inf", "ep_shard"):
        pass
    elif dist == "zipf":
        ranks = _perm(N, g).to(torch.float32) + 1.0
        w = w * ranks.pow(-params.get("s", 1.2)).unsqueeze(1) * 8.0
    elif dist == "hot_expert":
        n_hot = int(round(params.get("p", 0.9) * T))
        big = 8.0 if x_dtype == torch.float16 else 256.0   # f16 outputs stay finite
        x[_rand_subset(T, n_hot, g)] *= big
        w[int(torch.randint(N, (1,), generator=g))] *= big
    elif dist == "all_to_one":
        if T > 0:
            x = x[:1].expand(T, Kd).contiguous()
    elif dist == "empty_experts":
        w[_rand_subset(N, N // 2, g)] = 0.0
    elif dist == "exact_ties":
        x = torch.randint(-4, 5, (T, Kd), generator=g).to(torch.float32)
        w = torch.randint(-4, 5, (N, Kd), generator=g).to(torch.float32)
        if b is not None:
            b = torch.randint(-8, 9, (N,), generator=g).to(torch.float32)
    elif dist == "near_ties":
        half = Kd // 2
        if half > 0:
            x[:, half:2 * half] = x[:, :half]
            d = _randn((N, half), g) * 2.0 ** -8
            w[:, half:2 * half] = -w[:, :half] + d * w[:, :half].abs()
    elif dist == "extreme":
        r = _finite_exponent_range(x_dtype)
        ex = torch.randint(-r, r // 2 + 1, (T, 1), generator=g).to(torch.float32)
        ew = torch.randint(-r, r // 2 + 1, (N, 1), generator=g).to(torch.float32)
        x = x * torch.exp2(ex)
        w = w * torch.exp2(ew)
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    if dist == "extreme" and x_dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
        w = w.clamp(-6e4, 6e4)
    x = x.to(x_dtype)
    w = w.to(w_dtype).contiguous()
    if b is not None:
        b = b.to(w_dtype)
    if dist == "ep_shard" and T > 0:
        wide = torch.zeros(2 * T, Kd + 3, dtype=x_dtype)
        wide[0::2, 1:Kd + 1] = x
        x = wide[0::2, 1:Kd + 1]          # row stride 2*(Kd+3), holes between rows
    return x, w, b
