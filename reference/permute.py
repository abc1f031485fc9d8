"""Token permute / unpermute: regroup routed token rows by expert, and combine them back.

After routing, every token t has K (expert id, weight) pairs. An expert MLP wants its
inputs as one contiguous block of rows, so `permute` copies token rows into a new
buffer grouped by expert, and `unpermute` sums the experts' outputs back into token
order, weighted by the routing weights. This is the "permute -> grouped GEMM ->
unpermute" formulation of a MoE layer (vLLM's moe_permute / moe_unpermute).

Rows. The routing tensor ids[T, K] is read as T*K rows; row r = t*K + j is token t's
j-th choice. Row r goes to local expert `expert_map[ids[t, j]]` when an `expert_map`
is given (expert parallelism: global id -> local id, -1 for experts that live on
another rank), else to `ids[t, j]` itself. An id of -1 (a padded routing slot) or a
map entry of -1 drops the row: it is copied nowhere and contributes nothing.

Layout. The result is a stable counting sort of the rows by local expert:

    offsets[e] .. offsets[e+1]   local expert e's segment, e = 0 .. E_loc-1
    inside a segment             that expert's rows in increasing r, then zero rows
                                 up to a multiple of `align` (GEMM tile alignment)
    offsets[-1] = P              rows in use; rows P .. capacity-1 are zero too

Because the sort is stable the layout is a pure function of the inputs, so every
backend must produce bit-identical `offsets`, `src_row`, `dst_pos` and `hidden`.
`capacity = T*K + E_loc*(align-1)` is the most rows any routing can need, so the
output shape depends only on (T, K, E_loc, align), never on the data (what a CUDA
graph needs). `src_row[p]` names the row placed at p (-1 for padding and unused rows);
`dst_pos[r]` is the inverse map (-1 for dropped rows).

    >>> hidden = torch.arange(6.).reshape(3, 2)          # T=3 tokens, H=2
    >>> ids = torch.tensor([[1, 0], [1, -1], [0, 1]])    # K=2; row 3 is dropped
    >>> p = permute(hidden, ids, n_experts=2)
    >>> p.offsets.tolist(), p.src_row.tolist(), p.dst_pos.tolist()
    ([0, 2, 5], [1, 4, 0, 2, 5, -1], [2, 0, 3, -1, 1, 4])

Scratch. `PermuteScratch` preallocates every output for a maximum token count (vLLM's
MoEPermuteScratch); `permute(..., scratch=s)` then writes into those buffers and
returns views of them, so a decode step allocates nothing. The views stay valid until
the next call with the same scratch. A call that does not fit (more tokens, another
K, H, dtype, device, expert count or align) raises instead of reallocating.

`unpermute(expert_out, weights, dst_pos)` is the weighted gather back:
out[t] = sum over kept j of weights[t, j] * expert_out[dst_pos[t*K + j]], accumulated
in float32 in increasing j and rounded once to expert_out's dtype.
"""
from __future__ import annotations

import threading
from typing import NamedTuple, Optional

import torch

from . import validate
from .validate import capacity, check_int, fail

__all__ = ["Permuted", "PermuteScratch", "permute", "unpermute"]


class Permuted(NamedTuple):
    """What `permute` returns (E_loc local experts, capacity = T*K + E_loc*(align-1)).

    offsets: [E_loc+1] int64. offsets[e] is where local expert e's segment starts;
        each segment is that expert's row count rounded up to a multiple of align;
        offsets[0] = 0 and offsets[-1] = P, the number of rows in use.
    hidden: [capacity, H], the input's dtype. Row p < P that holds routed row r is a
        copy of the input's row r // K; padding rows and rows p >= P are zero.
    src_row: [capacity] int32. p -> r for the row placed at p, -1 for padding and
        unused rows.
    dst_pos: [T*K] int32. r -> p, the inverse of src_row; -1 for dropped rows.
    """

    offsets: torch.Tensor
    hidden: torch.Tensor
    src_row: torch.Tensor
    dst_pos: torch.Tensor


class PermuteScratch:
    """Preallocated buffers for `permute`, outputs included, sized for up to max_tokens.

    Args:
        max_tokens: the largest T a call may have (>= 0).
        top_k: K of every call (>= 1).
        n_experts: global expert count of every call (>= 1).
        hidden_size: H of every call (>= 0).
        dtype: the hidden dtype of every call (float32, bfloat16 or float16).
        device: where the buffers live (a torch.device or a string such as "cuda:0").
        n_local_experts: E_loc of every call (>= 1); defaults to n_experts (no
            expert_map).
        align: the segment alignment of every call (>= 1).

    Attributes (the buffers carry the field names of `Permuted`):
        offsets [E_loc+1] int64, hidden [capacity(max_tokens, top_k, E_loc, align), H],
        src_row [that capacity] int32, dst_pos [max_tokens*top_k] int32, and the
        constructor arguments as given (device as the buffers' torch.device).

    The buffers' contents between calls are unspecified: each call writes every
    element of the views it returns.

    Threads: a scratch serves one call at a time. A `permute` call holds it (a
    non-blocking lock) while it writes the buffers; a second call that finds it held,
    from another thread, raises RuntimeError "permute: argument 'scratch' is in use by
    another call ..." instead of writing into buffers the first call is filling.
    Sequential calls from any threads work; but since the results are views of the
    buffers, each call's results are overwritten by the next call from ANY thread: a
    thread that needs its results after another thread may have used the scratch must
    copy them first, or use a scratch of its own (the usual design: one per thread or
    per stream). On a GPU the lock covers the launch only: calls on different streams
    must also be ordered on the device by the caller.

    Raises:
        ValueError: "PermuteScratch: argument '<name>' ..." for a bad argument.
    """

    def __init__(self, max_tokens: int, top_k: int, n_experts: int, hidden_size: int,
                 dtype: torch.dtype, device, *, n_local_experts: Optional[int] = None,
                 align: int = 1) -> None:
        op = "PermuteScratch"
        check_int(op, "max_tokens", max_tokens, 0)
        check_int(op, "top_k", top_k, 1)
        check_int(op, "n_experts", n_experts, 1)
        check_int(op, "hidden_size", hidden_size, 0)
        if dtype not in validate.FLOAT_DTYPES:
            fail(op, "dtype", f"must be one of {validate._dt(validate.FLOAT_DTYPES)}, got {dtype!r}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            fail(op, "device", f"must be a torch.device or a device string, got {device!r} ({e})")
        if n_local_experts is None:
            n_local_experts = n_experts
        check_int(op, "n_local_experts", n_local_experts, 1)
        check_int(op, "align", align, 1)

        self.max_tokens = max_tokens
        self.top_k = top_k
        self.n_experts = n_experts
        self.n_local_experts = n_local_experts
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.align = align

        cap = capacity(max_tokens, top_k, n_local_experts, align)
        self.offsets = torch.empty(n_local_experts + 1, dtype=torch.int64, device=device)
        self.hidden = torch.empty(cap, hidden_size, dtype=dtype, device=device)
        self.src_row = torch.empty(cap, dtype=torch.int32, device=device)
        self.dst_pos = torch.empty(max_tokens * top_k, dtype=torch.int32, device=device)
        # The allocated tensor's device, so "cuda" becomes "cuda:<current>" and compares
        # equal to the device of the tensors a call passes in.
        self.device = self.hidden.device
        self._busy = threading.Lock()   # held by the call writing the buffers (see Threads)

    def _claim(self, op: str = "permute") -> None:
        """Take the scratch for one call, or raise if another call (thread) holds it.
        The caller releases it with `_release()` in a finally block."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"{op}: argument 'scratch' is in use by another call (a PermuteScratch serves "
                               "one call at a time; give each thread its own scratch, or serialize the calls)")

    def _release(self) -> None:
        self._busy.release()

    def __repr__(self) -> str:
        return (f"PermuteScratch(max_tokens={self.max_tokens}, top_k={self.top_k}, "
                f"n_experts={self.n_experts}, hidden_size={self.hidden_size}, dtype={self.dtype}, "
                f"device={self.device}, n_local_experts={self.n_local_experts}, align={self.align})")


def permute(hidden: torch.Tensor, ids: torch.Tensor, n_experts: int, *,
            expert_map: Optional[torch.Tensor] = None, n_local_experts: Optional[int] = None,
            align: int = 1, scratch: Optional[PermuteScratch] = None) -> Permuted:
    """Group the T*K routed rows of `hidden` by local expert (a stable counting sort).

    Args:
        hidden: [T, H] float32, bfloat16 or float16, the token activations.
        ids: [T, K] int32 or int64, expert ids in [0, n_experts) or -1 (dropped).
        n_experts: the global expert count E (>= 1).
        expert_map: optional [n_experts] int32 on hidden's device, global id -> local id
            in [0, n_local_experts) or -1 (the expert is not local: its rows are dropped).
        n_local_experts: E_loc; required with expert_map; without one it must be None
            or n_experts.
        align: each expert segment is padded with zero rows to a multiple of align (>= 1).
        scratch: optional PermuteScratch; the outputs are then views of its buffers.

    Math, with r = t*K + j, e(r) the local expert of row r (or dropped), and
    n_e the number of kept rows of expert e:
        offsets[0] = 0, offsets[e+1] = offsets[e] + align * ceil(n_e / align)
        the i-th kept row of expert e (in increasing r) goes to p = offsets[e] + i:
            dst_pos[r] = p, src_row[p] = r, out_hidden[p] = hidden[r // K]
        everything else: dst_pos = -1, src_row = -1, out_hidden row = 0.
    No arithmetic: the copies are exact.

    Returns:
        Permuted(offsets, hidden, src_row, dst_pos); see `Permuted` for the shapes.
        Fresh tensors without a scratch; views into the scratch with one (hidden and
        src_row are the first `capacity` rows, dst_pos the first T*K entries).

    Raises:
        ValueError: "permute: argument '<name>' ..." for a bad input (see
            validate.check_permute), or argument 'scratch' when the scratch is not a
            PermuteScratch or does not fit this call (validate.check_scratch_fits).
        RuntimeError: "permute: argument 'scratch' is in use by another call ..." when
            another thread's call is writing the same scratch (see PermuteScratch).
    """
    E_loc = validate.check_permute(hidden, ids, n_experts, expert_map, n_local_experts, align)
    if scratch is not None:
        if not isinstance(scratch, PermuteScratch):
            fail("permute", "scratch", f"must be a PermuteScratch or None, got {type(scratch).__name__}")
        validate.check_scratch_fits(scratch, hidden, ids, n_experts, E_loc, align)

    T, H = hidden.shape
    K = ids.shape[1]
    R = T * K
    cap = capacity(T, K, E_loc, align)
    dev = hidden.device

    # 1. The local expert of every row, or -1 for a dropped row.
    glob = ids.reshape(R).to(torch.int64)
    if expert_map is None:
        local = glob
    else:
        mapped = expert_map.to(torch.int64)[glob.clamp(min=0)]
        local = torch.where(glob >= 0, mapped, torch.full_like(glob, -1))
    kept = local >= 0

    # 2. Segment sizes: a histogram of the kept rows, each rounded up to a multiple of align.
    counts = torch.bincount(local[kept], minlength=E_loc)
    padded = (counts + (align - 1)) // align * align
    offsets = torch.zeros(E_loc + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    first_kept = torch.cumsum(counts, 0) - counts  # where expert e's rows start among the kept rows

    # 3. A stable sort by local expert puts the kept rows in (expert, r) order; dropped rows
    #    (key E_loc) sort last and are cut off. The i-th row of the sorted order that belongs
    #    to expert e is that expert's (i - first_kept[e])-th row.
    key = torch.where(kept, local, torch.full_like(local, E_loc))
    order = torch.sort(key, stable=True).indices
    n_kept = int(kept.sum())
    rows = order[:n_kept]                          # the kept rows r, in output order
    expert_of = key[rows]
    pos = offsets[expert_of] + (torch.arange(n_kept, device=dev) - first_kept[expert_of])

    # 4. The outputs: fresh, or the scratch's storage. Every element is written. A scratch
    #    is held by this call while it is written (one call at a time: see PermuteScratch).
    if scratch is None:
        out_offsets = torch.empty(E_loc + 1, dtype=torch.int64, device=dev)
        out_hidden = torch.empty(cap, H, dtype=hidden.dtype, device=dev)
        out_src = torch.empty(cap, dtype=torch.int32, device=dev)
        out_dst = torch.empty(R, dtype=torch.int32, device=dev)
    else:
        scratch._claim("permute")
        out_offsets = scratch.offsets
        out_hidden = scratch.hidden[:cap]
        out_src = scratch.src_row[:cap]
        out_dst = scratch.dst_pos[:R]
    try:
        out_offsets.copy_(offsets)
        out_hidden.zero_()
        out_hidden[pos] = hidden[rows // K]
        out_src.fill_(-1)
        out_src[pos] = rows.to(torch.int32)
        out_dst.fill_(-1)
        out_dst[rows] = pos.to(torch.int32)
    finally:
        if scratch is not None:
            scratch._release()
    return Permuted(out_offsets, out_hidden, out_src, out_dst)


def unpermute(expert_out: torch.Tensor, weights: torch.Tensor, dst_pos: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's expert outputs back in token order.

    Args:
        expert_out: [capacity, H] float32, bfloat16 or float16: row p is the expert
            output for the row permute placed at p (rows never referenced are ignored,
            even if they hold NaN).
        weights: [T, K] float32, the routing weights.
        dst_pos: [T*K] int32, permute's dst_pos: row r = t*K + j -> p, or -1 (dropped).

    Math (float32, j in increasing order, each product rounded to float32 and then
    added, no fused multiply-add; T = weights.shape[0]):
        acc = 0
        for j in 0 .. K-1:
            if dst_pos[t*K + j] >= 0:
                acc = acc + weights[t, j] * f32(expert_out[dst_pos[t*K + j]])
        out[t] = round_to(expert_out.dtype, acc)
    SPEC fixes this f32 order, so the reference follows it literally instead of using
    float64: an optimized kernel that keeps the same order and no FMA matches bit for bit.

    Returns:
        [T, H] in expert_out's dtype, a fresh tensor. A token whose rows are all
        dropped gets zeros.

    Raises:
        ValueError: "unpermute: argument '<name>' ..." (see validate.check_unpermute).
    """
    validate.check_unpermute(expert_out, weights, dst_pos)
    T, K = weights.shape
    H = expert_out.shape[1]
    pos = dst_pos.reshape(T, K).to(torch.int64)
    acc = torch.zeros(T, H, dtype=torch.float32, device=expert_out.device)
    for j in range(K):  # a loop over the K slots (to fix the order), not over tokens
        p = pos[:, j]
        valid = (p >= 0).unsqueeze(1)
        term = weights[:, j].unsqueeze(1) * expert_out[p.clamp(min=0)].to(torch.float32)
        # A dropped slot leaves acc untouched (not "+ 0": that would also pull NaN/inf from
        # the clamped row 0, and turn an accumulated -0.0 into +0.0).
        acc = torch.where(valid, acc + term, acc)
    return acc.to(expert_out.dtype)
