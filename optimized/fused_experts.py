"""optimized.fused_experts: the expert MLPs with bf16 / FP8 block / MXFP4 weights (seed 000).

Same contract as reference.fused_experts (SPEC 5); design, layout, costs and the exact
arithmetic are in docs/fused_experts.md and csrc/cpu/fused_experts_kernel.h. In short:
rows are grouped by expert with the permute op's counting sort, each (expert block, 64-column
tile) runs one of two micro-kernels (`tiny`: weights decoded in registers; `blocked`: the
tile decoded once into a bf16 buffer), chosen per block by optimized/dispatch.py. Every
path rounds the dequantized weight to bf16 the same way and accumulates K in the same
order, so the result is bit-identical across policies, batches and thread counts at one
ISA level (batch invariant). Against the f64 reference the one deliberate difference is
that fp8 weights are rounded to bf16 (relative error <= 2^-8 per weight); bf16 and mxfp4
weights are exact in bf16.

Weights may be prepacked once with `prepack_moe_weights` (the kernels' blocked VNNI
layout); `fused_experts(x, packed, None, ...)` then runs without any packing. Standard-layout
CPU weights are packed invisibly: the pack cache (optimized/pack_cache.py) packs each expert
the first time it is routed to, keeps the packed copy while the weights live and are not
changed, and runs the prepacked path on it (same bits); MOELAB_PACK_CACHE=0 turns it off
(every call then repacks its routed tiles in per-thread scratch).

apply_router_weight_on_input=True (SPEC 6, Llama 4) is done inside the kernels: the row gather
writes bf16(x[t] * bf16(w[t, j])) for slot j (exact: one f32 product of two bf16 values, one
rounding) and the combine sums the expert outputs unweighted; the rest of the pipeline is
unchanged, so every policy, ISA level and weight layout stays bit-identical and batch invariant.

Validation: reference.validate's rules, all of them up front but, on the CPU, the range of
topk_ids, which the C++ op checks on its first pass over the ids before it writes anything; when
it raises, the full check words the error as the reference does (docs/decisions.md).

CUDA/ROCm tensors run csrc/gpu/fused_experts.cu (docs/gpu.md): the standard layout only
(prepacked weights are CPU-only), a small-m path or a tiled (tensor-core on CUDA) path per
expert block, chosen by optimized.dispatch's GPU policy; batch-invariant mode keeps every
block on the small-m path. Without the GPU extension, CUDA tensors run the reference.
"""
from __future__ import annotations

from typing import Optional

import torch

from reference.fused_experts import fused_experts as reference_fused_experts
from reference.validate import (ACTIVATIONS, DISPATCH_POLICIES, MX_BLOCK, QUANT_FORMATS, check_choice,
                                check_expert_weights, check_float, check_fused_experts, check_ids, check_tensor,
                                fail)

from . import _fake
from . import dispatch as _dispatch
from . import gpu
from . import pack_cache as _pack_cache

__all__ = ["fused_experts", "fused_experts_rows", "prepack_moe_weights", "PackedMoEWeights"]


class PackedMoEWeights:
    """Expert weights repacked once into the CPU kernels' blocked VNNI layout (opaque).

    Made by `prepack_moe_weights`; pass it as `w13` (and `None` or the same object as
    `w2`, no scales) to `optimized.fused_experts` with the same `quant`. Holds the packed
    quantized bytes, the scales (fp8: a copy; mxfp4: rearranged), per-tile decoder flags,
    and the format and sizes it was made for (checked on every call).
    """

    __slots__ = ("quant", "E", "H", "I", "w13", "w2", "w13_scale", "w2_scale", "w13_slow", "w2_slow")

    def __init__(self, quant, E, H, I, w13, w2, w13_scale, w2_scale, w13_slow, w2_slow):
        self.quant, self.E, self.H, self.I = quant, E, H, I
        self.w13, self.w2 = w13, w2
        self.w13_scale, self.w2_scale = w13_scale, w2_scale
        self.w13_slow, self.w2_slow = w13_slow, w2_slow

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2, self.w13_scale, self.w2_scale,
                                                          self.w13_slow, self.w2_slow) if t is not None)

    def __repr__(self) -> str:
        return (f"PackedMoEWeights(quant='{self.quant}', E={self.E}, H={self.H}, I={self.I}, "
                f"{self.nbytes / 2**20:.1f} MiB)")


@torch.library.register_fake("moelab::fused_experts")
def _fused_experts_fake(x, w13, w2, topk_weights, topk_ids, quant, packed, E, I, w13_scale, w2_scale,
                        w13_slow, w2_slow, w13_bias, w2_bias, activation, alpha, limit, policy, m_cross,
                        apply_router_weight_on_input=False):
    _fake.check("fused_experts", ("x", x, 2), ("w13", w13, None), ("w2", w2, None),
                ("topk_weights", topk_weights, 2), ("topk_ids", topk_ids, 2), ("w13_scale", w13_scale, None),
                ("w2_scale", w2_scale, None), ("w13_slow", w13_slow, None), ("w2_slow", w2_slow, None),
                ("w13_bias", w13_bias, 2), ("w2_bias", w2_bias, 2))
    return x.new_empty((x.shape[0], x.shape[1]))


@torch.library.register_fake("moelab::fused_experts_rows")
def _fused_experts_rows_fake(x, w13, w2, topk_weights, topk_ids, quant, packed, E, I, w13_scale, w2_scale,
                             w13_slow, w2_slow, w13_bias, w2_bias, activation, alpha, limit, policy, m_cross,
                             apply_router_weight_on_input=False, y_init=None):
    _fake.check("fused_experts_rows", ("x", x, 2), ("w13", w13, None), ("w2", w2, None),
                ("topk_weights", topk_weights, 2), ("topk_ids", topk_ids, 2), ("w13_scale", w13_scale, None),
                ("w2_scale", w2_scale, None), ("w13_slow", w13_slow, None), ("w2_slow", w2_slow, None),
                ("w13_bias", w13_bias, 2), ("w2_bias", w2_bias, 2), ("y_init", y_init, 2))
    return x.new_empty((x.shape[0] * topk_ids.shape[1], x.shape[1]), dtype=torch.float32)


@torch.library.register_fake("moelab::prepack_moe_weight")
def _prepack_fake(w, scale, quant):
    _fake.check("prepack_moe_weight", ("w", w, 3), ("scale", scale, 3))
    if quant not in QUANT_FORMATS:
        _fake.fail("prepack_moe_weight", "quant", f"must be one of {', '.join(QUANT_FORMATS)}; got {quant!r}")
    E, N, last = w.shape
    K = 2 * last if quant == "mxfp4" else last
    n16, k2 = -(-N // 16), -(-K // 2)
    per_group = {"bf16": k2 * 64, "fp8_block": k2 * 32, "mxfp4": (K // 4) * 32}[quant]
    if quant == "bf16":
        s = w.new_empty((0,), dtype=torch.float32)
    elif quant == "fp8_block":
        s = scale.new_empty(scale.shape)
    else:
        s = w.new_empty((E, n16 * (K // MX_BLOCK) * 16), dtype=torch.uint8)
    return (w.new_empty((E, n16 * per_group), dtype=torch.uint8), s,
            w.new_empty((E, -(-N // 64)), dtype=torch.uint8))


@torch.library.register_fake("moelab::pack_moe_experts")
def _pack_experts_fake(topk_ids, done, w13, w13_scale, w2, w2_scale, quant, p13, q13, f13, p2, q2, f2):
    # The pack cache's op (optimized/pack_cache.py) is never traced (the cache is off under
    # torch.compile); this fake exists for the device checks every op makes.
    _fake.check("pack_moe_experts", ("topk_ids", topk_ids, 2), ("done", done, 1), ("w13", w13, 3),
                ("w13_scale", w13_scale, None), ("w2", w2, 3), ("w2_scale", w2_scale, None), ("p13", p13, 2),
                ("q13", q13, None), ("f13", f13, 2), ("p2", p2, 2), ("q2", q2, None), ("f2", f2, 2))
    return 0


def prepack_moe_weights(w13: torch.Tensor, w2: torch.Tensor, quant: str,
                        w13_scale: Optional[torch.Tensor] = None,
                        w2_scale: Optional[torch.Tensor] = None) -> PackedMoEWeights:
    """Repack expert weights (SPEC 5 standard layout) once for `optimized.fused_experts`.

    Args: w13 [E, 2I, H(/2)], w2 [E, H, I(/2)] and scales exactly as fused_experts takes
        them for `quant` ("bf16" | "fp8_block" | "mxfp4"); CPU tensors.
    Returns: a PackedMoEWeights (about the size of the quantized weights; the quantized
        bytes are rearranged, never dequantized).
    Raises: ValueError 'prepack_moe_weights: argument '<name>' ...' for a bad argument.
    """
    op = "prepack_moe_weights"
    check_choice(op, "quant", quant, QUANT_FORMATS)
    check_tensor(op, "w13", w13)
    if w13.device.type != "cpu":
        fail(op, "w13", f"must be a CPU tensor, got {w13.device}")
    E, H, I = check_expert_weights(op, quant, w13, w2, w13_scale, w2_scale, w13.device)
    p13, q13, f13 = torch.ops.moelab.prepack_moe_weight(w13, w13_scale, quant)
    p2, q2, f2 = torch.ops.moelab.prepack_moe_weight(w2, w2_scale, quant)
    if quant == "bf16":
        q13 = q2 = None
    return PackedMoEWeights(quant, E, H, I, p13, p2, q13, q2, f13, f2)


def _check_packed(x, w13: PackedMoEWeights, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale,
                  w13_bias, w2_bias, activation, alpha, limit, dispatch, apply_router_weight_on_input,
                  ranges=True):
    """check_fused_experts' rules for a call with prepacked weights."""
    op = "fused_experts"
    if not isinstance(apply_router_weight_on_input, bool):
        fail(op, "apply_router_weight_on_input", f"must be a bool, got {type(apply_router_weight_on_input).__name__}")
    check_tensor(op, "x", x, ndim=2, dtypes=(torch.bfloat16,))
    T, H = x.shape
    check_choice(op, "quant", quant, QUANT_FORMATS)
    check_choice(op, "activation", activation, ACTIVATIONS)
    check_choice(op, "dispatch", dispatch, DISPATCH_POLICIES)
    check_float(op, "alpha", alpha)
    check_float(op, "limit", limit)
    if w13.quant != quant:
        fail(op, "w13", f"was prepacked for quant '{w13.quant}', the call says quant '{quant}'")
    if w13.H != H:
        fail(op, "w13", f"was prepacked for H = {w13.H}, x has H = {H}")
    if w2 is not None and w2 is not w13:
        fail(op, "w2", "must be None (or the same PackedMoEWeights) when w13 is prepacked")
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if s is not None:
            fail(op, name, "must be None with prepacked weights (the scales are inside)")
    if x.device.type != "cpu":
        fail(op, "x", f"must be on cpu like the prepacked weights, got {x.device} (prepacked weights are "
                      f"the CPU kernels' layout; on CUDA/ROCm pass the standard layout)")
    E, I = w13.E, w13.I
    for name, b, shp in (("w13_bias", w13_bias, (E, 2 * I)), ("w2_bias", w2_bias, (E, H))):
        if b is not None:
            check_tensor(op, name, b, dtypes=(torch.float32, torch.bfloat16), shape=shp, device=x.device)
    check_tensor(op, "topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,), device=x.device)
    if topk_weights.shape[0] != T or topk_weights.shape[1] < 1:
        fail(op, "topk_weights", f"must have shape ({T}, K) with K >= 1, got {tuple(topk_weights.shape)}")
    check_ids(op, "topk_ids", topk_ids, T, topk_weights.shape[1], E, x.device, dtypes=(torch.int32,), ranges=ranges)
    return E, I


def fused_experts(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  quant: str, w13_scale: Optional[torch.Tensor] = None,
                  w2_scale: Optional[torch.Tensor] = None, w13_bias: Optional[torch.Tensor] = None,
                  w2_bias: Optional[torch.Tensor] = None, activation: str = "silu", alpha: float = 1.702,
                  limit: float = 7.0, dispatch: str = "auto",
                  apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """Same contract as reference.fused_experts (SPEC 5); w13 may be a PackedMoEWeights.

    apply_router_weight_on_input (SPEC 6; vLLM's parameter, Llama 4): slot j's expert input is
    bf16(x[t] * bf16(topk_weights[t, j])) and out[t] = bf16(sum_j y_j), unweighted. The
    kernels apply it themselves (CPU: in the row gather and the combine; GPU: a weighted
    gather pass and the combine), for every format, policy, ISA level and weight layout;
    the default False takes exactly the path (and bits) it always did.

    Returns [T, H] bf16. Raises ValueError (message 'fused_experts: argument <name> ...')
    like the reference, plus for a PackedMoEWeights that does not match quant / H / E.
    The kernel choice per expert block is `optimized.dispatch.explain("fused_experts", ...)`.
    """
    return _run(False, None, x, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale, w13_bias, w2_bias,
                activation, alpha, limit, dispatch, apply_router_weight_on_input)


def fused_experts_rows(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                       quant: str, w13_scale: Optional[torch.Tensor] = None,
                       w2_scale: Optional[torch.Tensor] = None, w13_bias: Optional[torch.Tensor] = None,
                       w2_bias: Optional[torch.Tensor] = None, activation: str = "silu", alpha: float = 1.702,
                       limit: float = 7.0, dispatch: str = "auto", apply_router_weight_on_input: bool = False,
                       y_init: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fused_experts without the combine: the per-slot expert outputs, for the parallel layer.

    Returns y [T*K, H] float32, row r = t*K + j: slot j's expert output for token t exactly as
    fused_experts computes it before its combine (steps 1-3 of SPEC 5, + w2_bias; unweighted,
    and with apply_router_weight_on_input the expert input is the weighted row), 0 for a dropped
    slot (id -1). So fused_experts(...) == bf16(unpermute(y, w, r or -1)) bit for bit.
    y_init [T*K, H] float32 (optional): GEMM2's f32 accumulators of slot r start from y_init[r]
    instead of +0. With w13 / w2 / biases cut to a contiguous slice of I (whole 32-element
    blocks), chaining the slices (y_init = the previous slice's y, w2_bias only on the last)
    gives the unsliced y bit for bit: the exact tensor-parallel reduction of optimized/parallel.py.
    CPU only. Raises ValueError "fused_experts_rows: argument 'y_init' ..." for a bad y_init,
    otherwise fused_experts' errors.
    """
    if x.device.type != "cpu":
        fail("fused_experts_rows", "x", f"must be a CPU tensor (the rows op is CPU-only), got {x.device}")
    if y_init is not None:
        T = x.shape[0] if x.dim() == 2 else -1
        K = topk_ids.shape[1] if topk_ids.dim() == 2 else -1
        H = x.shape[1] if x.dim() == 2 else -1
        check_tensor("fused_experts_rows", "y_init", y_init, dtypes=(torch.float32,), shape=(T * K, H),
                     device=x.device)
        y_init = y_init.contiguous()
    return _run(True, y_init, x, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale, w13_bias, w2_bias,
                activation, alpha, limit, dispatch, apply_router_weight_on_input)


def _run(rows, y_init, x, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale, w13_bias, w2_bias,
         activation, alpha, limit, dispatch, apply_router_weight_on_input):
    """fused_experts (rows False) or fused_experts_rows (rows True) after the same checks."""
    packed = isinstance(w13, PackedMoEWeights)

    def check(ranges):
        return (_check_packed if packed else check_fused_experts)(
            x, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale, w13_bias, w2_bias, activation,
            alpha, limit, dispatch, apply_router_weight_on_input, ranges=ranges)

    # On the CPU the C++ op checks topk_ids' range itself, on its first pass over them (the row
    # grouping; the pack cache's op), before it writes anything; the Python check (two
    # reductions and two host reads) was ~4% of an OLMoE decode call on two threads
    # (docs/fused_experts.md, "Call overhead"). When the op raises, the full check words the
    # error as the reference does.
    ranges = not (isinstance(x, torch.Tensor) and x.device.type == "cpu")
    E, I = check(ranges)
    try:
        return _launch(rows, y_init, x, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale, w13_bias,
                       w2_bias, activation, alpha, limit, dispatch, apply_router_weight_on_input, packed, E, I)
    except RuntimeError:
        if not ranges:
            check(True)
        raise


def _launch(rows, y_init, x, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale, w13_bias, w2_bias,
            activation, alpha, limit, dispatch, apply_router_weight_on_input, packed, E, I):
    if packed:
        pw = w13
        args = (pw.w13, pw.w2)
        w13_scale, w2_scale, slow13, slow2 = pw.w13_scale, pw.w2_scale, pw.w13_slow, pw.w2_slow
    else:
        if x.device.type not in ("cpu", "cuda"):
            fail("fused_experts", "x", f"must be a CPU or CUDA/ROCm tensor (no moelab kernel for {x.device.type})")
        if rows and x.device.type != "cpu":
            fail("fused_experts_rows", "x", f"must be a CPU tensor, got {x.device}")
        if x.device.type == "cuda" and not gpu.available():   # no GPU extension: the reference
            return reference_fused_experts(x, w13, w2, topk_weights, topk_ids, quant=quant, w13_scale=w13_scale,
                                           w2_scale=w2_scale, w13_bias=w13_bias, w2_bias=w2_bias,
                                           activation=activation, alpha=alpha, limit=limit, dispatch=dispatch,
                                           apply_router_weight_on_input=apply_router_weight_on_input)
        args = (w13, w2)
        slow13 = slow2 = None
        if x.device.type == "cpu" and topk_ids.numel() and not torch.compiler.is_compiling():
            # Standard layout on the CPU: the pack cache (optimized/pack_cache.py) packs the routed
            # experts not packed yet, once, and the call runs the prepacked path (same bits).
            pk = _pack_cache.packed_weights(w13, w2, w13_scale, w2_scale, quant, topk_ids)
            if pk is not None:
                packed = True
                args = pk[:2]
                w13_scale, w2_scale, slow13, slow2 = pk[2:]
    T, K = topk_ids.shape
    plan = _dispatch.fused_experts_gpu_plan if x.device.type == "cuda" else _dispatch.fused_experts_plan
    code, m_cross, _ = plan(T, K, E, quant, dispatch)
    if T > 0 and x.stride(1) != 1:
        x = x.contiguous()
    if rows:
        return torch.ops.moelab.fused_experts_rows(x, args[0], args[1], topk_weights, topk_ids, quant, packed, E, I,
                                                   w13_scale, w2_scale, slow13, slow2, w13_bias, w2_bias,
                                                   activation, float(alpha), float(limit), code, m_cross,
                                                   apply_router_weight_on_input, y_init)
    return torch.ops.moelab.fused_experts(x, args[0], args[1], topk_weights, topk_ids, quant, packed, E, I,
                                          w13_scale, w2_scale, slow13, slow2, w13_bias, w2_bias,
                                          activation, float(alpha), float(limit), code, m_cross,
                                          apply_router_weight_on_input)
