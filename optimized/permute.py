"""optimized.permute / unpermute / PermuteScratch (SPEC 2; seed 003, vLLM's permute scratch).

Same contract as reference.permute: see csrc/cpu/permute_kernel.h for the kernels (a stable
counting sort, then parallel wide row copies; a no-FMA f32 weighted gather back) and their
floors. Every output is bit-identical to the reference's.

The scratch path allocates nothing: `PermuteScratch` here holds every buffer the kernel
touches, the outputs and the expert histogram (`counts`), and `permute(..., scratch=s)`
runs torch.ops.moelab.permute_out, which writes into views of those buffers. The views of
each token count are made once and kept in the scratch, so a decode step costs no tensor
allocation at all (tests/test_permute_optimized.py counts allocator events to check it).

Validation: reference.validate checks everything but the index ranges up front; the ranges
(ids, expert_map, dst_pos) are checked by the C++ kernels on their own pass over the data
(no reductions, no temporaries). When the kernel reports one, the reference's full check
runs again so the error is the same ValueError the reference raises.
"""
from __future__ import annotations

from typing import Optional

import torch

import importlib

_ref = importlib.import_module("reference.permute")  # the module: reference/__init__ rebinds `reference.permute` to the function
from reference import validate
from reference.permute import Permuted
from reference.validate import capacity

from . import _fake, dispatch, gpu
from .fastcall import direct
from .fastcall import ops as fast

__all__ = ["Permuted", "PermuteScratch", "permute", "unpermute"]

# The overloads themselves: skips the packet's overload lookup on every call.
_permute_op = torch.ops.moelab.permute.default
_permute_out_op = torch.ops.moelab.permute_out.default
_unpermute_op = torch.ops.moelab.unpermute.default


class PermuteScratch(_ref.PermuteScratch):
    """reference.PermuteScratch plus the kernel's workspace, so a call allocates nothing.

    Same constructor, attributes and fit rule (validate.check_scratch_fits) as
    reference.permute.PermuteScratch. Extra buffer: counts [n_local_experts] int64, the
    histogram / cursors of the counting sort (on a GPU: the GPU sort's workspace, one
    histogram per unit of rows, optimized.gpu.permute_counts_numel elements). Buffer contents
    between calls are unspecified; the views a call returns stay valid until the next call
    with this scratch. The buffers are fixed at construction (the per-T views are cached);
    make a new scratch rather than assigning new tensors to its attributes.

    Threads (as reference.PermuteScratch): one call at a time. `permute` holds the scratch
    (a non-blocking lock, ~0.1 us) from taking its views until the kernel has returned; a
    concurrent call from another thread raises RuntimeError "permute: argument 'scratch' is
    in use by another call ..." before it touches a buffer, so two threads never write one
    scratch at once. Sequential calls from several threads work, but each call's results
    (views) are overwritten by the next call from any thread: copy them, or give each thread
    its own scratch.
    """

    def __init__(self, max_tokens: int, top_k: int, n_experts: int, hidden_size: int,
                 dtype: torch.dtype, device, *, n_local_experts: Optional[int] = None,
                 align: int = 1) -> None:
        super().__init__(max_tokens, top_k, n_experts, hidden_size, dtype, device,
                         n_local_experts=n_local_experts, align=align)
        n = self.n_local_experts
        if self.device.type == "cuda" and gpu.available():
            n = gpu.permute_counts_numel(self.max_tokens * self.top_k, self.n_local_experts)
        self.counts = torch.empty(n, dtype=torch.int64, device=self.device)
        self._views: dict[int, tuple[Permuted, tuple]] = {}

    def views(self, T: int) -> tuple[Permuted, tuple]:
        """For a call with T tokens: the Permuted of views it returns, and the five buffers the
        op writes (offsets, hidden, src_row, dst_pos, counts). Made once per T and kept."""
        v = self._views.get(T)
        if v is None:
            cap = capacity(T, self.top_k, self.n_local_experts, self.align)
            out = Permuted(self.offsets, self.hidden[:cap], self.src_row[:cap], self.dst_pos[:T * self.top_k])
            v = self._views[T] = (out, (*out, self.counts))
        return v


@torch.library.register_fake("moelab::permute")
def _permute_fake(hidden, ids, n_experts, expert_map, n_local_experts, align):
    _fake.check("permute", ("hidden", hidden, 2), ("ids", ids, 2), ("expert_map", expert_map, 1))
    _fake.check_positive("permute", "n_local_experts", n_local_experts)
    _fake.check_positive("permute", "align", align)
    T, H = hidden.shape
    cap = capacity(T, ids.shape[1], n_local_experts, align)
    return (hidden.new_empty(n_local_experts + 1, dtype=torch.int64), hidden.new_empty(cap, H),
            hidden.new_empty(cap, dtype=torch.int32), hidden.new_empty(T * ids.shape[1], dtype=torch.int32))


@torch.library.register_fake("moelab::permute_out")
def _permute_out_fake(hidden, ids, n_experts, expert_map, n_local_experts, align, offsets,
                      hidden_out, src_row, dst_pos, counts):
    # (a call with any meta argument lands here: with CPU buffers it would write nothing)
    _fake.check("permute_out", ("hidden", hidden, 2), ("ids", ids, 2), ("expert_map", expert_map, 1),
                ("offsets", offsets, 1), ("hidden_out", hidden_out, 2), ("src_row", src_row, 1),
                ("dst_pos", dst_pos, 1), ("counts", counts, 1))
    return None


@torch.library.register_fake("moelab::unpermute")
def _unpermute_fake(expert_out, weights, dst_pos):
    _fake.check("unpermute", ("expert_out", expert_out, 2), ("weights", weights, 2), ("dst_pos", dst_pos, 1))
    return expert_out.new_empty(weights.shape[0], expert_out.shape[1])


def _unit_inner(t: torch.Tensor) -> torch.Tensor:
    """Rows must be contiguous runs (the kernels copy/read whole rows); copy only if not."""
    if t.stride(1) != 1 and t.numel() and t.shape[1] > 1:
        return t.contiguous()
    return t


def permute(hidden: torch.Tensor, ids: torch.Tensor, n_experts: int, *,
            expert_map: Optional[torch.Tensor] = None, n_local_experts: Optional[int] = None,
            align: int = 1, scratch: Optional[PermuteScratch] = None) -> Permuted:
    """Same contract as reference.permute (a stable counting sort of the rows by expert).

    With `scratch` (an optimized.PermuteScratch) the outputs are views of its buffers and
    nothing is allocated. Raises ValueError as the reference does ("permute: argument ..."),
    and for a scratch that is not an optimized.PermuteScratch; RuntimeError "permute:
    argument 'scratch' is in use by another call" while another thread's call holds it.
    """
    # Plain CPU tensors and plainly typed ints skip check_permute: the binding checks all it does
    # (test_error_inputs_same_as_reference holds every reference error input to the reference's
    # ValueError), and check_permute runs when the op refuses, to word the error.
    lean = (type(hidden) is torch.Tensor and type(ids) is torch.Tensor and hidden.is_cpu
            and type(n_experts) is int and type(align) is int and hidden.dim() == 2 and ids.dim() == 2
            and (expert_map is None if n_local_experts is None
                 else type(n_local_experts) is int and (expert_map is None or type(expert_map) is torch.Tensor)))
    if lean:
        E_loc = n_experts if n_local_experts is None else n_local_experts
    else:
        E_loc = validate.check_permute(hidden, ids, n_experts, expert_map, n_local_experts, align, ranges=False)
    if scratch is not None:
        try:
            if not isinstance(scratch, PermuteScratch):
                validate.fail("permute", "scratch", "must be an optimized.PermuteScratch (it holds the kernel's "
                                                    f"workspace too) or None, got {type(scratch).__qualname__}")
            validate.check_scratch_fits(scratch, hidden, ids, n_experts, E_loc, align)
        except ValueError:
            if lean:   # an error of the other arguments comes first, as in the reference
                validate.check_permute(hidden, ids, n_experts, expert_map, n_local_experts, align, ranges=False)
            raise
    if dispatch.permute_decision(hidden, ids, n_experts).kernel != "moelab":
        return _ref.permute(hidden, ids, n_experts, expert_map=expert_map, n_local_experts=n_local_experts,
                            align=align, scratch=scratch)
    hidden = _unit_inner(hidden)
    if scratch is not None:
        # Hold the scratch for this call (see PermuteScratch); the lock is taken inline, as the
        # decode path's every 0.1 us counts, and _claim words the error when it is held.
        if not scratch._busy.acquire(False):
            scratch._claim("permute")
    try:
        fast_ok = direct(hidden, ids, expert_map)   # optimized.fastcall
        if scratch is None:
            op = fast.permute if fast_ok else _permute_op
            return Permuted(*op(hidden, ids, n_experts, expert_map, E_loc, align))
        out, buffers = scratch.views(hidden.shape[0])
        (fast.permute_out if fast_ok else _permute_out_op)(hidden, ids, n_experts, expert_map, E_loc, align, *buffers)
        return out
    except (RuntimeError, TypeError):
        # The binding refused the call (an index out of range, or, for a lean call, any
        # argument): word it as the reference does.
        validate.check_permute(hidden, ids, n_experts, expert_map, n_local_experts, align)
        raise
    finally:
        if scratch is not None:
            scratch._release()


def unpermute(expert_out: torch.Tensor, weights: torch.Tensor, dst_pos: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.unpermute, bit for bit (f32, j ascending, no FMA)."""
    # As in permute: plain CPU tensors skip check_unpermute unless the op refuses the call.
    if not (type(expert_out) is torch.Tensor and type(weights) is torch.Tensor and type(dst_pos) is torch.Tensor
            and expert_out.is_cpu and expert_out.dim() == 2):
        validate.check_unpermute(expert_out, weights, dst_pos, ranges=False)
    if dispatch.unpermute_decision(expert_out, weights, dst_pos).kernel != "moelab":
        return _ref.unpermute(expert_out, weights, dst_pos)
    expert_out = _unit_inner(expert_out)
    if not dst_pos.is_contiguous():
        dst_pos = dst_pos.contiguous()
    try:
        op = fast.unpermute if direct(expert_out, weights, dst_pos) else _unpermute_op   # optimized.fastcall
        return op(expert_out, weights, dst_pos)
    except (RuntimeError, TypeError):
        validate.check_unpermute(expert_out, weights, dst_pos)
        raise
