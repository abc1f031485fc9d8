"""optimized.parallel: the MoE layer across processes (torch.distributed), bit-identical to one process.

Design (docs/parallel.md has the long form)
-------------------------------------------
Ranks form a grid of `ep` expert-parallel groups x `tp` tensor-parallel ranks:
rank = g * tp + s (EP group g, TP index s). Every rank holds its own tokens (any T_r >= 0, the
data-parallel layout of DeepEP / pplx: the layer's input is sharded by token), a replicated
router and shared expert, and the routed experts that its EP group owns (`owner[e] = g`), each
expert cut along its intermediate dimension I into `tp` contiguous slices (TP index s holds
slice s; slices are whole quantization blocks: 2 for bf16 (a k pair), 128 for fp8_block, 32
for mxfp4; `tp_slices`).

Forward, for the tokens of one rank (the "home" rank):
  1. router_gemm + route locally (the single-process ops: same bits per token in
     batch-invariant mode).
  2. Dispatch (all_to_all_single, counts first, then rows): every token that has a slot on EP
     group g is sent ONCE to each TP rank of g, as one byte row: x[t] (bf16), the K local
     expert ids (-1 for slots that belong to other groups) and, for
     apply_router_weight_on_input, the K weights. Rows go in increasing token order; a
     receiver concatenates its sources in rank order. Bytes per token: (distinct EP groups of
     its K experts) * tp * (2H + 4K [+ 4K]).
  3. Experts: optimized.fused_experts_rows on the received rows: y per (row, slot) in f32, the
     exact values fused_experts computes before its combine.
     - exact mode (batch-invariant): the TP slices are chained. TP rank 0 computes its slice's
       y from +0, sends the f32 rows to TP rank 1 (all_to_all_single), which continues the
       SAME f32 accumulators over its slice (y_init), ... the last adds w2_bias. GEMM2's
       accumulation over I is one dp sequence over k pairs 0, 1, ... in the kernel, so the
       chain reproduces it exactly; a sum of independent partials would not.
     - fast mode: every TP rank computes its slice from +0 at the same time and sends its
       partial; the home rank adds the tp partials in TP order (within the tolerance, not
       bitwise).
  4. Combine (all_to_all_single back): the last TP rank of g returns, per source, the f32 y
     of every valid slot in increasing (row, j) order, which is increasing r = t*K + j on the
     home rank. The home rank scatters them into Y [T*K, H] f32 and runs the single-process
     combine itself: optimized.unpermute(Y, weights, r or -1) (f32, j ascending, no FMA, from
     +0), rounded once to bf16: fused_experts' own step 6, so the same bits. Bytes per token:
     (valid slots) * 4H (f32: the combine must see the unrounded y; the fast mode sends the
     same rows, per TP rank).
  5. Shared expert (replicated) and bf16(routed + shared) exactly as reference.moe.moe_forward.

Ordering guarantees: every buffer's row order is a pure function of the routing (token,
slot and rank order), never of arrival time; every reduction the output depends on runs in
a fixed order on one rank (the chain over TP, the combine over j). So in exact mode the output
of every token equals the single-process optimized layer's, bit for bit, for any world size,
expert placement and routing skew (a rank with zero tokens, or with no routed rows, still
takes part in every collective with empty buffers).

Failure handling: the constructor all_gathers every rank's metadata (E, H, I, K, quant, the
expert placement, ...) and every rank raises the same ValueError when they disagree. Each
forward first all_gathers a flag for "my local inputs are valid" (and the messages when any
is not), and every local compute phase is followed by the same agreement, so an error on
one rank raises on every rank (naming the rank) instead of leaving the others blocked in a
collective. Collectives run under the process group's timeout (init_process_group(timeout=)).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import tempfile
import time
import traceback
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import optimized
from reference.moe import SharedExpert, _shared_weights, moe_forward
from reference.quant import round_to_bf16
from reference.validate import fail

__all__ = ["MoELayerSpec", "ParallelMoE", "tp_slices", "slice_block", "contiguous_owner", "round_robin_owner",
           "expert_map_of", "single_process_forward", "spawn", "ParallelError", "comm_bytes_per_token"]

OP = "parallel_moe"


class ParallelError(RuntimeError):
    """Another rank failed; the message is that rank's error."""


# ----------------------------------------------------------------------------- the layer's weights
@dataclasses.dataclass
class MoELayerSpec:
    """A whole MoE layer (reference.moe.moe_forward's arguments), as every rank loads it."""
    router_weight: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    top_k: int
    method: str = "softmax_topk"
    quant: str = "bf16"
    w13_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    w13_bias: Optional[torch.Tensor] = None
    w2_bias: Optional[torch.Tensor] = None
    router_bias: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    renormalize: Optional[bool] = None
    norm_eps: Optional[float] = None
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    apply_router_weight_on_input: bool = False
    shared: Optional[SharedExpert] = None

    @property
    def E(self) -> int:
        return self.w13.shape[0]

    @property
    def H(self) -> int:
        return self.router_weight.shape[1]

    @property
    def I(self) -> int:   # noqa: E743
        return self.w2.shape[2] * (2 if self.quant == "mxfp4" else 1)

    def route_kwargs(self) -> dict:
        kw = dict(bias=self.bias, n_group=self.n_group, topk_group=self.topk_group, scaling=self.scaling,
                  renormalize=self.renormalize)
        if self.norm_eps is not None:
            kw["norm_eps"] = self.norm_eps
        return kw

    def forward_kwargs(self) -> dict:
        """reference.moe.moe_forward's keywords for this layer (weights included but x)."""
        return dict(router_weight=self.router_weight, w13=self.w13, w2=self.w2, top_k=self.top_k,
                    method=self.method, quant=self.quant, w13_scale=self.w13_scale, w2_scale=self.w2_scale,
                    w13_bias=self.w13_bias, w2_bias=self.w2_bias, router_bias=self.router_bias,
                    activation=self.activation, alpha=self.alpha, limit=self.limit,
                    apply_router_weight_on_input=self.apply_router_weight_on_input, shared=self.shared,
                    **self.route_kwargs())


def single_process_forward(x: torch.Tensor, spec: MoELayerSpec, routing=None) -> torch.Tensor:
    """The truth the parallel layer is held to: moe_forward with the optimized ops, one process.
    routing (weights [T, K] f32, ids [T, K] int32, -1 = dropped slot): skip the router and use
    these (fused_experts' own topk arguments), then the shared expert as moe_forward adds it."""
    kw = spec.forward_kwargs()
    if routing is None:
        return moe_forward(x, kw.pop("router_weight"), kw.pop("w13"), kw.pop("w2"), ops=optimized, **kw)
    weights, ids = routing
    routed = optimized.fused_experts(x, spec.w13, spec.w2, weights, ids, quant=spec.quant, w13_scale=spec.w13_scale,
                                     w2_scale=spec.w2_scale, w13_bias=spec.w13_bias, w2_bias=spec.w2_bias,
                                     activation=spec.activation, alpha=spec.alpha, limit=spec.limit,
                                     apply_router_weight_on_input=spec.apply_router_weight_on_input)
    return _add_shared(x, routed, spec)


def _add_shared(x: torch.Tensor, routed: torch.Tensor, spec: MoELayerSpec) -> torch.Tensor:
    """moe_forward's tail: bf16(routed + shared expert(x)), or routed without one."""
    s = spec.shared
    if s is None:
        return routed
    g = _shared_weights(x, s, optimized)
    zeros = torch.zeros(x.shape[0], 1, dtype=torch.int32)
    out = optimized.fused_experts(x, s.w13, s.w2, g, zeros, quant=s.quant, w13_scale=s.w13_scale,
                                  w2_scale=s.w2_scale, w13_bias=s.w13_bias, w2_bias=s.w2_bias,
                                  activation=s.activation, alpha=spec.alpha, limit=spec.limit)
    return round_to_bf16(routed.to(torch.float64) + out.to(torch.float64))


# ----------------------------------------------------------------------------- placement
def contiguous_owner(E: int, ep: int) -> list[int]:
    """Expert e on EP group e * ep // E: contiguous shards, sizes differing by at most one."""
    return [e * ep // E for e in range(E)]


def round_robin_owner(E: int, ep: int) -> list[int]:
    """Expert e on EP group e % ep: a non-contiguous placement."""
    return [e % ep for e in range(E)]


def expert_map_of(owner: Sequence[int], g: int) -> torch.Tensor:
    """permute's expert_map [E] int32 for EP group g: the experts it owns get local ids 0.. in
    increasing global id, the others -1."""
    m = torch.full((len(owner),), -1, dtype=torch.int32)
    mine = [e for e, o in enumerate(owner) if o == g]
    m[mine] = torch.arange(len(mine), dtype=torch.int32)
    return m


def slice_block(quant: str) -> int:
    """The granularity of a TP slice of I: a k pair (bf16: the kernel's dp works on pairs), the
    fp8 128x128 scale block, the MXFP4 32-element scale block."""
    return {"bf16": 2, "fp8_block": 128, "mxfp4": 32}[quant]


def tp_slices(I: int, tp: int, quant: str, *, pad: bool = False) -> list[tuple[int, int]]:
    """[start, end) of each TP rank's slice of I.

    pad=False (default): whole blocks, as even as they come (GPT-OSS I = 2880 mxfp4, TP = 4:
    90 blocks -> 22, 23, 22, 23 blocks = 704, 736, 704, 736); no padding, exact.
    pad=True: equal slices of I_pad = roundup(I, block * tp) (GPT-OSS: 2944 -> 4 x 736); the
    slices past I are zero padding (slice_weights fills them). A zero pair adds +0 to the f32
    accumulator, which changes nothing the combine can see (it starts from +0, so a -0 y and a
    +0 y give the same sum), so padding keeps the output bits too.
    A rank may get an empty slice (tp larger than the number of blocks): it then only relays.
    """
    b = slice_block(quant)
    nb = -(-I // b)
    if pad:
        per = -(-nb // tp) * b
        return [(s * per, (s + 1) * per) for s in range(tp)]
    cuts = [min(I, (s * nb // tp) * b) for s in range(tp)] + [I]
    return [(cuts[s], cuts[s + 1]) for s in range(tp)]


def _exact_bf16_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8_block weights [E, N, K] dequantized exactly as the kernels decode them: bf16(f32(q) * s)."""
    E, N, K = q.shape
    s = scale.repeat_interleave(128, 1)[:, :N].repeat_interleave(128, 2)[:, :, :K]
    return (q.to(torch.float32) * s).to(torch.bfloat16)


def slice_weights(spec: MoELayerSpec, experts: list[int], lo: int, hi: int, pad_to: Optional[int] = None):
    """(quant, w13, w2, w13_scale, w2_scale, w13_bias, w2_bias) of the listed experts, cut to the
    slice [lo, hi) of I (zero-padded up to pad_to columns when given). w2_bias is returned in full
    (the caller gives it to the last slice only). An fp8 w13 whose gate/up halves do not start on
    a 128-row scale block (I % 128 != 0, tp > 1) cannot be cut in its block format: that shard is
    stored as its exact bf16 dequantization (the kernel rounds fp8 to bf16 the same way: same bits,
    twice the bytes)."""
    q, I = spec.quant, spec.I
    idx = torch.tensor(experts, dtype=torch.long)
    n = hi - lo
    width = pad_to if pad_to is not None else n
    act_interleaved = spec.activation == "swiglu_oai"
    if act_interleaved:   # h[0::2] gate, h[1::2] up: rows 2i, 2i+1 belong to column i
        cols = torch.arange(lo, hi)
        rows = torch.stack([2 * cols, 2 * cols + 1], 1).reshape(-1)
    else:
        rows = torch.cat([torch.arange(lo, hi), torch.arange(I + lo, I + hi)])

    def pad_rows13(t):   # [E, 2n, ...] -> [E, 2*width, ...] keeping the gate/up structure
        if width == n:
            return t.contiguous()
        z = t.new_zeros((t.shape[0], 2 * width) + tuple(t.shape[2:]))
        if act_interleaved:
            z[:, :2 * n] = t
        else:
            z[:, :n], z[:, width:width + n] = t[:, :n], t[:, n:]
        return z

    def pad_cols2(t, per=1, fill=0):   # [E, H, n/per] -> [E, H, width/per]
        if width == n:
            return t.contiguous()
        z = torch.full((t.shape[0], t.shape[1], width // per), fill, dtype=t.dtype)
        z[:, :, :n // per] = t
        return z

    w13_bias = None if spec.w13_bias is None else pad_rows13(spec.w13_bias[idx][:, rows].unsqueeze(-1)).squeeze(-1)
    w2_bias = None if spec.w2_bias is None else spec.w2_bias[idx].contiguous()
    if q == "fp8_block" and (I % 128 != 0 and (lo, hi) != (0, I)):
        w13 = _exact_bf16_fp8(spec.w13[idx], spec.w13_scale[idx])
        w2 = _exact_bf16_fp8(spec.w2[idx], spec.w2_scale[idx])
        return ("bf16", pad_rows13(w13[:, rows]), pad_cols2(w2[:, :, lo:hi]), None, None, w13_bias, w2_bias)
    if q == "bf16":
        return ("bf16", pad_rows13(spec.w13[idx][:, rows]), pad_cols2(spec.w2[idx][:, :, lo:hi]), None, None,
                w13_bias, w2_bias)
    if q == "fp8_block":
        w13 = spec.w13[idx][:, rows]
        s13 = spec.w13_scale[idx]
        nb = -(-n // 128)
        if act_interleaved:   # rows 2lo .. 2hi: 2nb whole blocks
            s13 = s13[:, 2 * lo // 128: 2 * lo // 128 + 2 * nb]
        else:
            s13 = torch.cat([s13[:, lo // 128: lo // 128 + nb], s13[:, (I + lo) // 128: (I + lo) // 128 + nb]], 1)
        w2 = spec.w2[idx][:, :, lo:hi]
        s2 = spec.w2_scale[idx][:, :, lo // 128: lo // 128 + nb]
        if width != n:   # whole zero blocks appended (n and width multiples of 128 here)
            wb = width // 128
            z13 = torch.ones(s13.shape[0], 2 * wb, s13.shape[2])
            if act_interleaved:
                z13[:, :2 * nb] = s13
            else:
                z13[:, :nb], z13[:, wb:wb + nb] = s13[:, :nb], s13[:, nb:]
            s13 = z13
            s2 = torch.cat([s2, torch.ones(s2.shape[0], s2.shape[1], wb - nb)], 2)
            w13 = pad_rows13(w13.view(torch.uint8)).view(torch.float8_e4m3fn)
            w2 = pad_cols2(w2.view(torch.uint8)).view(torch.float8_e4m3fn)
        return ("fp8_block", w13.contiguous(), w2.contiguous(), s13.contiguous(), s2.contiguous(), w13_bias, w2_bias)
    # mxfp4: w13 rows free (its blocks run along H); w2 [E, H, I/2] bytes, scales [E, H, I/32]
    w13 = pad_rows13(spec.w13[idx][:, rows])
    s13 = pad_rows13(spec.w13_scale[idx][:, rows])
    w2 = pad_cols2(spec.w2[idx][:, :, lo // 2: hi // 2], per=2)
    s2 = pad_cols2(spec.w2_scale[idx][:, :, lo // 32: hi // 32], per=32, fill=127)
    return ("mxfp4", w13, w2, s13, s2, w13_bias, w2_bias)


# ----------------------------------------------------------------------------- the parallel layer
@dataclasses.dataclass
class _Shard:
    quant: str
    w13: Optional[torch.Tensor]
    w2: Optional[torch.Tensor]
    w13_scale: Optional[torch.Tensor]
    w2_scale: Optional[torch.Tensor]
    w13_bias: Optional[torch.Tensor]
    w2_bias: Optional[torch.Tensor]     # only on the last TP rank (exact mode) / the last slice
    n_local: int
    width: int                          # columns of I held (0: nothing to compute)


class ParallelMoE:
    """One MoE layer on the ranks of a process group (module docstring).

    Args:
        spec: the whole layer (every rank passes the same; only its shard is kept).
        ep, tp: the grid; ep * tp must equal the group's world size.
        owner: [E] EP group of each expert (default: contiguous shards); any placement works.
        expert_map: this rank's permute expert_map [E] int32 (global id -> local id or -1) instead
            of `owner` (it must agree with the other ranks': validated).
        pad: equal-width TP slices with zero padding (tp_slices(pad=True)).
        group: the process group (default: the world).
    Raises ValueError "parallel_moe: argument '<name>' ..." on every rank when the ranks disagree.
    """

    def __init__(self, spec: MoELayerSpec, *, ep: Optional[int] = None, tp: int = 1,
                 owner: Optional[Sequence[int]] = None, expert_map: Optional[torch.Tensor] = None,
                 pad: bool = False, group=None) -> None:
        if not dist.is_initialized():
            fail(OP, "group", "needs torch.distributed initialized (torchrun, or optimized.parallel.spawn)")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if ep is None:
            ep = self.world // tp if tp >= 1 and self.world % tp == 0 else -1
        self.spec, self.ep, self.tp = spec, ep, tp
        E = spec.E
        local_err = None
        try:
            if not (isinstance(tp, int) and isinstance(ep, int) and tp >= 1 and ep >= 1 and ep * tp == self.world):
                fail(OP, "tp", f"ep * tp must equal the world size {self.world}, got ep = {ep}, tp = {tp}")
            g = self.rank // tp
            if expert_map is not None:
                if not (isinstance(expert_map, torch.Tensor) and expert_map.dim() == 1 and expert_map.shape[0] == E):
                    fail(OP, "expert_map", f"must be a 1-D tensor of E = {E} entries, got "
                         f"{tuple(expert_map.shape) if isinstance(expert_map, torch.Tensor) else type(expert_map).__name__}")
                emap = [int(v) for v in expert_map.tolist()]
            else:
                own = list(owner) if owner is not None else contiguous_owner(E, ep)
                if len(own) != E or any((not isinstance(o, int)) or o < 0 or o >= ep for o in own):
                    fail(OP, "owner", f"must list an EP group in [0, {ep}) for each of the E = {E} experts")
                emap = [int(v) for v in expert_map_of(own, g).tolist()]
        except ValueError as e:
            local_err, emap = str(e), []
        meta = dict(E=E, H=spec.H, I=spec.I, K=spec.top_k, quant=spec.quant, method=spec.method,
                    activation=spec.activation, awi=spec.apply_router_weight_on_input,
                    shared=spec.shared is not None, ep=ep, tp=tp, pad=pad, emap=emap, err=local_err)
        metas: list = [None] * self.world
        dist.all_gather_object(metas, meta, group=group)
        self._check_meta(metas)
        # the global placement, from every group's map
        self.owner = [-1] * E
        self.local_id = [-1] * E
        for r in range(0, self.world, tp):
            for e, v in enumerate(metas[r]["emap"]):
                if v >= 0:
                    self.owner[e], self.local_id[e] = r // tp, v
        g, s = self.rank // tp, self.rank % tp
        self.g, self.s = g, s
        mine = sorted((v, e) for e, v in enumerate(metas[self.rank]["emap"]) if v >= 0)
        experts = [e for _, e in mine]
        slices = tp_slices(spec.I, tp, spec.quant, pad=pad)
        if any(b <= a for a, b in slices):   # the same on every rank (metadata agreed)
            fail(OP, "tp", f"cuts I = {spec.I} into slices of whole {slice_block(spec.quant)}-element blocks; "
                           f"tp = {tp} leaves a slice empty ({slices}) (every rank raises this)")
        lo, hi = slices[s]
        lo_r, hi_r = min(lo, spec.I), min(hi, spec.I)
        width = hi - lo
        q, w13, w2, s13, s2, b13, b2 = spec.quant, None, None, None, None, None, None
        err = None
        try:
            if experts and width > 0:
                q, w13, w2, s13, s2, b13, b2 = slice_weights(spec, experts, lo_r, hi_r, pad_to=width)
        except (ValueError, RuntimeError, IndexError, TypeError) as e:
            err = f"{OP}: argument 'spec' could not be sharded on this rank: {type(e).__name__}: {e}"
        self._agree(err, "sharding")
        if s != tp - 1:
            b2 = None
        self.shard = _Shard(q, w13, w2, s13, s2, b13, b2, len(experts), width if experts else 0)
        self.emap = torch.tensor(metas[self.rank]["emap"], dtype=torch.int32)

    def _check_meta(self, metas: list) -> None:
        errs = [(r, m["err"]) for r, m in enumerate(metas) if m["err"]]
        if errs:
            r, msg = errs[0]
            raise ValueError(f"{msg} (on rank {r}; every rank raises this)")
        ref = metas[0]
        for key in ("E", "H", "I", "K", "quant", "method", "activation", "awi", "shared", "ep", "tp", "pad"):
            for r, m in enumerate(metas):
                if m[key] != ref[key]:
                    name = {"E": "spec", "H": "spec", "I": "spec", "K": "spec"}.get(key, key)
                    fail(OP, name, f"differs across ranks: {key} = {ref[key]!r} on rank 0, {m[key]!r} on rank {r} "
                                   f"(every rank raises this)")
        E, ep, tp = ref["E"], ref["ep"], ref["tp"]
        seen: dict[int, int] = {}
        for r in range(len(metas)):
            g = r // tp
            em = metas[r]["emap"]
            if r % tp and em != metas[g * tp]["emap"]:
                fail(OP, "expert_map", f"rank {r} holds a different expert_map from rank {g * tp} of its EP group "
                                       f"{g} (the TP ranks of a group must agree; every rank raises this)")
            if r % tp:
                continue
            loc = sorted(v for v in em if v >= 0)
            if loc != list(range(len(loc))) or any(v < -1 for v in em):
                fail(OP, "expert_map", f"rank {r}'s expert_map must map its experts to 0..n_local-1 once each and "
                                       f"the others to -1, got {em} (every rank raises this)")
            for e, v in enumerate(em):
                if v >= 0:
                    if e in seen:
                        fail(OP, "expert_map", f"expert {e} is owned by EP groups {seen[e]} and {g} "
                                               f"(every rank raises this)")
                    seen[e] = g
        missing = [e for e in range(E) if e not in seen]
        if missing:
            fail(OP, "expert_map", f"experts {missing[:8]}{'...' if len(missing) > 8 else ''} are owned by no EP "
                                   f"group (every rank raises this)")

    # ------------------------------------------------------------------ agreement
    def _agree(self, err: Optional[str], phase: str) -> None:
        """Every rank says whether its last local step failed; if any did, all raise its message."""
        flag = torch.tensor([1 if err else 0], dtype=torch.int32)
        flags = [torch.zeros(1, dtype=torch.int32) for _ in range(self.world)]
        dist.all_gather(flags, flag, group=self.group)
        if not any(int(f) for f in flags):
            return
        msgs: list = [None] * self.world
        dist.all_gather_object(msgs, err, group=self.group)
        r = next(i for i, m in enumerate(msgs) if m)
        if r == self.rank:
            raise ValueError(f"{msgs[r]} (rank {r}, {phase}; every rank raises)")
        raise ParallelError(f"{OP}: rank {r} failed in {phase}: {msgs[r]}")

    def _a2a(self, send: list[torch.Tensor], width: int, dtype) -> list[torch.Tensor]:
        """all_to_all_single of byte rows: counts first, then the rows, sources in rank order.
        send[d]: rows [n_d, width] for rank d. Returns the received row blocks per source."""
        counts = torch.tensor([t.shape[0] for t in send], dtype=torch.int64)
        rcounts = torch.empty(self.world, dtype=torch.int64)
        dist.all_to_all_single(rcounts, counts, group=self.group)
        out = torch.empty(int(rcounts.sum()), width, dtype=dtype)
        inp = torch.cat(send) if send else torch.empty(0, width, dtype=dtype)
        dist.all_to_all_single(out, inp.contiguous(), output_split_sizes=rcounts.tolist(),
                               input_split_sizes=counts.tolist(), group=self.group)
        return list(out.split(rcounts.tolist()))

    # ------------------------------------------------------------------ forward
    def __call__(self, x: torch.Tensor, *, exact: Optional[bool] = None, routing=None) -> torch.Tensor:
        return self.forward(x, exact=exact, routing=routing)

    def forward(self, x: torch.Tensor, *, exact: Optional[bool] = None, routing=None) -> torch.Tensor:
        """This rank's tokens x [T, H] bf16 -> [T, H] bf16. exact (default: optimized's
        batch-invariant mode): chain the TP slices (bit-identical to single_process_forward);
        False: independent TP partials added on the home rank (within the tolerance).
        routing: (weights [T, K] f32, ids [T, K] int32) instead of the router (as
        single_process_forward takes it)."""
        if exact is None:
            exact = optimized.dispatch.batch_invariant()
        spec = self.spec
        err, weights, ids = None, None, None
        try:
            if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype == torch.bfloat16
                    and x.shape[1] == spec.H and x.device.type == "cpu"):
                fail(OP, "x", f"must be a CPU bf16 tensor [T, H = {spec.H}], got "
                              f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__} "
                              f"{getattr(x, 'dtype', '')}")
            x = x.contiguous()
            if routing is not None:
                weights, ids = routing
                if not (isinstance(ids, torch.Tensor) and ids.dtype == torch.int32 and ids.shape == (x.shape[0], spec.top_k)
                        and isinstance(weights, torch.Tensor) and weights.dtype == torch.float32
                        and weights.shape == ids.shape):
                    fail(OP, "routing", f"must be (weights f32, ids int32) of shape ({x.shape[0]}, {spec.top_k})")
                if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= spec.E):
                    fail(OP, "routing", f"ids must lie in [-1, {spec.E}), got [{int(ids.min())}, {int(ids.max())}]")
                weights, ids = weights.contiguous(), ids.contiguous()
            else:
                logits = optimized.router_gemm(x, spec.router_weight)
                if spec.router_bias is not None:
                    logits = logits + spec.router_bias.to(logits.dtype)
                weights, ids = optimized.route(logits, spec.top_k, spec.method, **spec.route_kwargs())
        except (ValueError, RuntimeError) as e:
            err = str(e)
        self._agree(err, "routing")
        T, K, H = x.shape[0], spec.top_k, spec.H
        awi = spec.apply_router_weight_on_input
        owner = torch.tensor(self.owner, dtype=torch.long)
        lid = torch.tensor(self.local_id, dtype=torch.int32)
        idsl = ids.long()
        valid = idsl >= 0
        slot_g = torch.where(valid, owner[idsl.clamp(min=0)], torch.full_like(idsl, -1))   # [T, K]
        loc = torch.where(valid, lid[idsl.clamp(min=0)], torch.full_like(ids, -1))          # [T, K] int32
        xb = x.view(torch.uint8).reshape(T, 2 * H)
        send, sent_tokens = [], []
        for g in range(self.ep):
            in_g = slot_g == g
            tok = in_g.any(1).nonzero().flatten()
            li = torch.where(in_g[tok], loc[tok], torch.full_like(loc[tok], -1))
            parts = [xb[tok], li.contiguous().view(torch.uint8).reshape(-1, 4 * K)]
            if awi:
                parts.append(weights[tok].contiguous().view(torch.uint8).reshape(-1, 4 * K))
            row = torch.cat(parts, 1) if tok.numel() else torch.empty(0, sum(p.shape[1] for p in parts),
                                                                        dtype=torch.uint8)
            sent_tokens.append(tok)
            send.extend([row] * self.tp)
        width = 2 * H + 4 * K * (2 if awi else 1)
        blocks = self._a2a(send, width, torch.uint8)
        recv_counts = [b.shape[0] for b in blocks]
        recv = torch.cat(blocks)
        N = recv.shape[0]
        xr = recv[:, :2 * H].contiguous().view(torch.bfloat16).reshape(N, H)
        ir = recv[:, 2 * H:2 * H + 4 * K].contiguous().view(torch.int32).reshape(N, K)
        wr = (recv[:, 2 * H + 4 * K:].contiguous().view(torch.float32).reshape(N, K) if awi
              else torch.ones(N, K, dtype=torch.float32))

        # experts: the TP chain (exact) or independent partials (fast)
        y, err = None, None
        steps = range(self.tp) if exact else [None]
        for step in steps:
            err = None
            try:
                if step is None or step == self.s:
                    y = self._compute(xr, wr, ir, y if step else None, exact)
            except (ValueError, RuntimeError) as e:
                err = str(e)
            self._agree(err, "experts")
            if step is not None and step < self.tp - 1:
                # TP rank `step` of every group hands its f32 rows to TP rank step + 1
                blocks = [torch.empty(0, 4 * H, dtype=torch.uint8) for _ in range(self.world)]
                if self.s == step:
                    blocks[self.rank + 1] = y.view(torch.uint8).reshape(-1, 4 * H)
                got = self._a2a(blocks, 4 * H, torch.uint8)
                if self.s == step + 1:
                    y = got[self.rank - 1].contiguous().view(torch.float32).reshape(N * K, H)
        # combine: valid slot rows back to their home ranks
        back = [torch.empty(0, 4 * H, dtype=torch.uint8) for _ in range(self.world)]
        if (not exact) or self.s == self.tp - 1:
            vr = (ir >= 0).reshape(-1)
            yv = y[vr] if y is not None else torch.empty(0, H)
            start = 0
            per_src_valid = [int((ir[a:b] >= 0).sum()) for a, b in _bounds(recv_counts)]
            for src, nv in enumerate(per_src_valid):
                back[src] = yv[start:start + nv].contiguous().view(torch.uint8).reshape(-1, 4 * H)
                start += nv
        got = self._a2a(back, 4 * H, torch.uint8)
        Y = torch.zeros(T * K, H, dtype=torch.float32)
        for g in range(self.ep):
            mask = (slot_g == g).reshape(-1)
            nv = int(mask.sum())
            srcs = [g * self.tp + self.tp - 1] if exact else [g * self.tp + s for s in range(self.tp)]
            acc = None
            for src in srcs:                 # fast mode: the TP partials added in TP order
                blk = got[src].contiguous().view(torch.float32).reshape(nv, H)
                acc = blk if acc is None else acc + blk
            if nv:
                Y[mask] = acc
        dst = torch.where(valid.reshape(-1), torch.arange(T * K, dtype=torch.int32),
                          torch.full((T * K,), -1, dtype=torch.int32))
        cw = torch.ones(T, K, dtype=torch.float32) if awi else weights
        routed32 = optimized.unpermute(Y, cw, dst) if T else torch.zeros(0, H)
        # The f32 combine before its one rounding, kept for checks (verify --world compares it bit for bit
        # with the single-process rows' combine: a TP chain that lost a bit shows here even where the bf16
        # rounding would hide it).
        self.last_routed_f32 = routed32
        routed = routed32.to(torch.bfloat16)
        return _add_shared(x, routed, spec)

    def _compute(self, xr, wr, ir, y_init, exact):
        """y [N*K, H] f32 of this rank's slice for the received rows (zeros when it holds nothing)."""
        sh, spec = self.shard, self.spec
        N, K, H = xr.shape[0], ir.shape[1], xr.shape[1]
        if N == 0 or sh.width == 0 or sh.w13 is None:
            return y_init if y_init is not None else torch.zeros(N * K, H, dtype=torch.float32)
        return optimized.fused_experts_rows(
            xr, sh.w13, sh.w2, wr, ir, quant=sh.quant, w13_scale=sh.w13_scale, w2_scale=sh.w2_scale,
            w13_bias=sh.w13_bias, w2_bias=sh.w2_bias, activation=spec.activation, alpha=spec.alpha,
            limit=spec.limit, apply_router_weight_on_input=spec.apply_router_weight_on_input, y_init=y_init)


def _bounds(counts: list[int]):
    a = 0
    for c in counts:
        yield a, a + c
        a += c


# ----------------------------------------------------------------------------- launching
def _worker(rank: int, world: int, init: str, timeout_s: float, fn: Callable, args: tuple, errdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    except BaseException:
        with open(os.path.join(errdir, f"rank{rank}.err"), "w") as f:   # when, then what: spawn picks the first
            f.write(f"{time.time():.6f}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args, timeout_s: float = 60.0) -> None:
    """Run fn(rank, world, *args) in `world` fresh processes joined in a gloo group (a file://
    rendezvous in a temporary folder, collective timeout timeout_s, one torch thread each).
    fn must be importable (a module-level function). A rank that raises ends the run: the others
    are terminated and torch.multiprocessing's ProcessRaisedException carries its traceback.
    (torchrun --standalone --nproc-per-node N does the same for a script: docs/parallel.md.)
    Raises ParallelError with the traceback of the rank that failed FIRST (the others then fail
    in a collective with a connection error, which would hide the cause)."""
    with tempfile.TemporaryDirectory(prefix="moelab-pg-") as d:
        init = "file://" + os.path.join(d, "rendezvous")
        try:
            mp.start_processes(_worker, args=(world, init, timeout_s, fn, args, d), nprocs=world, join=True,
                               start_method="spawn")
        except mp.ProcessRaisedException as e:
            errs = []
            for r in range(world):
                p = os.path.join(d, f"rank{r}.err")
                if os.path.exists(p):
                    with open(p) as f:
                        when, _, tb = f.read().partition("\n")
                    errs.append((float(when), r, tb))
            if not errs:
                raise
            when, r, tb = min(errs)
            raise ParallelError(f"{OP}: rank {r} of {world} failed first (the group was brought down):\n{tb}") from e


# ----------------------------------------------------------------------------- volumes
def comm_bytes_per_token(H: int, K: int, groups_hit: float, *, tp: int = 1, dispatch_bytes: float = 2.0,
                         combine_bytes: float = 4.0, awi: bool = False) -> dict:
    """Bytes one token moves per layer in this layer's protocol (both directions counted once).

    dispatch: its row (H elements of dispatch_bytes: 2 for bf16, 1 for fp8 plus H/128 f32 scales)
    and its K local ids (4 bytes each; + K f32 weights with apply_router_weight_on_input), sent
    once to each TP rank of each of the `groups_hit` EP groups its K experts fall in.
    combine: one row of H elements (combine_bytes: 4 for the exact f32 rows, 2 for a bf16 partial
    sum of the fast engines' kind) per routed slot, K of them (x tp in the fast TP mode).
    Tokens whose expert is on their own rank move nothing on a real interconnect; this counts
    them (the upper bound) - scale by (ep - 1) / ep for uniform placement."""
    row = H * dispatch_bytes + (4 * H / 128 if dispatch_bytes == 1.0 else 0) + 4 * K * (2 if awi else 1)
    return dict(dispatch=groups_hit * tp * row, combine=K * H * combine_bytes)
