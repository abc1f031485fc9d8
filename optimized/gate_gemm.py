"""optimized.gate_gemm: the skinny decode GEMM, its dispatcher and the fused gate (seed 002).

Same contracts as reference.gate_gemm (SPEC section 4):

- `skinny_gemm(x[T,K], weight[N,K], bias=None)`, T <= 8: torch.ops.moelab.skinny_gemm, a
  CPU kernel that streams the weight once for all T tokens (csrc/cpu/skinny_gemm_kernel.h:
  algorithm, vdpbf16ps semantics, reduction order, floors).
- `unquantized_gemm(x, weight, bias=None)`: the platform dispatcher. It takes skinny_gemm
  where it wins and torch.nn.functional.linear otherwise; the crossover, the measurement
  behind it and the batch-invariant rule are in optimized/dispatch.py
  (`dispatch.explain("unquantized_gemm", x, weight, bias)` says what a call takes and why).
- `fused_gate_gemm(x, router_weight, shared_gate_weight)`: ONE unquantized_gemm over the
  stacked [E+S, H] weight, then split.
- `FusedGate`: reference.gate_gemm.FusedGate with `gemm = unquantized_gemm` from here, so
  the module keeps the reference's cache and rebuild rules and only the GEMM changes.

Arithmetic: f32 accumulation of exact products (bf16/f16 widen exactly; on AVX-512 BF16
the bf16 pairs go through vdpbf16ps, two chained FMAs with denormals flushed), plus bias in
f32, rounded once to x's dtype. The library path (F.linear) computes the same function
within the same tolerance but with its own blocking, which may change with T: it is not
batch invariant, so in batch-invariant mode the dispatcher avoids it (see dispatch.py).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

import reference.gate_gemm as _ref
from reference.validate import SKINNY_MAX_T, check_skinny_gemm, check_unquantized_gemm

from . import _fake, dispatch
from .fastcall import direct
from .fastcall import ops as fast

__all__ = ["skinny_gemm", "unquantized_gemm", "fused_gate_gemm", "FusedGate"]


@torch.library.register_fake("moelab::skinny_gemm")
def _skinny_gemm_fake(x, weight, bias=None):
    _fake.check("skinny_gemm", ("x", x, 2), ("weight", weight, 2), ("bias", bias, 1))
    torch._check(x.shape[0] <= SKINNY_MAX_T, lambda: f"moelab::skinny_gemm: argument 'x' must have T <= {SKINNY_MAX_T} rows")
    return x.new_empty((x.shape[0], weight.shape[0]))


_skinny_op = torch.ops.moelab.skinny_gemm.default


def _unit_k(t: torch.Tensor) -> torch.Tensor:
    """The kernel wants unit stride along K (rows may be strided); copy only otherwise."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _skinny(x, weight, bias):
    # Arguments already validated; strided rows of x are passed as they are (ldx), no copy.
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    x, weight = _unit_k(x), _unit_k(weight)
    return (fast.skinny_gemm if direct(x, weight, bias) else _skinny_op)(x, weight, bias)   # optimized.fastcall


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same contract as reference.skinny_gemm: x @ weight.T + bias, T <= 8, f32 accumulation,
    rounded once to x's dtype. Raises ValueError like the reference (T > 8 included)."""
    check_skinny_gemm(x, weight, bias)
    return _skinny(x, weight, bias)


def unquantized_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same contract as reference.unquantized_gemm (any T). The kernel is
    dispatch.unquantized_gemm_kernel(x, weight) (dispatch.explain says why): skinny_gemm,
    skinny_gemm over chunks of 8 rows (batch-invariant mode, T > 8), or F.linear."""
    check_unquantized_gemm(x, weight, bias)
    kernel = dispatch.unquantized_gemm_kernel(x, weight)
    if kernel == "skinny":
        return _skinny(x, weight, bias)
    if kernel == "skinny_chunked":
        T = x.shape[0]
        return torch.cat([_skinny(x[t:t + SKINNY_MAX_T], weight, bias) for t in range(0, T, SKINNY_MAX_T)])
    return F.linear(x, weight, bias)


def fused_gate_gemm(x: torch.Tensor, router_weight: torch.Tensor, shared_gate_weight: torch.Tensor,
                    *, gemm=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.fused_gate_gemm: ONE `gemm` call (default this module's
    unquantized_gemm) over concat([router_weight, shared_gate_weight]) ([E+S, H]), split
    into (router_logits [T, E], shared_gate_logits [T, S]), both contiguous, x's dtype.

    The reference does the stacking and splitting (one definition of the layout); only the
    GEMM is ours. The concatenation copies both weights on every call; a model keeps the
    stacked weight in a `FusedGate` instead (built once, rebuilt only when a source changes)."""
    return _ref.fused_gate_gemm(x, router_weight, shared_gate_weight,
                                gemm=unquantized_gemm if gemm is None else gemm)


class FusedGate(_ref.FusedGate):
    """reference.gate_gemm.FusedGate (same cache, same rebuild rules, same errors) whose
    forward runs ONE optimized.unquantized_gemm over the cached [E+S, H] weight."""

    gemm = staticmethod(unquantized_gemm)
