"""The shared-expert gate: skinny GEMMs and the fused router + shared-gate GEMM.

Models with a shared expert (Qwen2-MoE, Qwen3-Next and similar) compute two small
products from the same input x[T, H] at every layer: the router logits
x @ router_weight[E, H].T and the shared expert's gate x @ shared_gate_weight[S, H].T
(S = 1: one scalar per token that scales the shared expert's output). Concatenating
the two weights into one [E+S, H] matrix turns two kernel launches into one GEMM whose
output is then split: `fused_gate_gemm`. The width N = E+S is odd (513 for E = 512,
S = 1), which is exactly where vector kernels need a tail path.

In decode, T is tiny (a few tokens), so the GEMM is "skinny": it reads the whole
weight to produce a handful of outputs and is bound by memory bandwidth. Vendor
library GEMMs are tuned for large T and waste most of their work there, so platforms
ship a dedicated skinny kernel (ROCm's wvSplitK) and a dispatcher,
`unquantized_gemm`, that picks it for small T and falls back to
torch.nn.functional.linear otherwise. vLLM's fused gate once called F.linear directly
and so missed the skinny kernel on ROCm (seed 002); routing it through the dispatcher
halved the time. `FusedGate` is the module form: it keeps the concatenated weight and
rebuilds it whenever either source weight changes, so a weight reload never leaves a
stale copy behind.

Arithmetic: the reference computes every product in float64 from the exact upcasts of
its inputs, adds the bias in float64, and rounds once to x's dtype. That is the exact
function rounded to the output dtype for every practical input (the f64 error, about
K * 2^-53 relative, is far below a bf16/f16/f32 rounding). Optimized kernels accumulate
in float32 and round the f32 result, so they may differ by an accumulation error plus
one rounding; verify bounds that distance.

In the reference `skinny_gemm` and `unquantized_gemm` compute the same function; the
only difference is the T <= 8 limit of `skinny_gemm`. Which kernel a call takes is an
optimized-side concern (optimized.dispatch), invisible in the result up to rounding.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from . import validate
from .quant import round_to_float_format
from .validate import fail

__all__ = ["skinny_gemm", "unquantized_gemm", "fused_gate_gemm", "FusedGate"]


# (stored fraction bits, smallest normal exponent) of the formats the GEMMs output
_FORMAT = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}


def _round_once(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 -> dtype, one rounding to nearest even.

    Not `y.to(dtype)`: PyTorch converts float64 to bfloat16/float16 through float32, which
    rounds twice (1 + 2^-8 + 2^-30 would become 1.0 in bfloat16 instead of 1 + 2^-7).
    float64 -> float32 is a single rounding.
    """
    if dtype == torch.float32:
        return y.to(torch.float32)
    mantissa_bits, min_exponent = _FORMAT[dtype]
    return round_to_float_format(y, mantissa_bits, min_exponent, float(torch.finfo(dtype).max)).to(dtype)


def _linear_f64(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """f64(x) @ f64(weight).T (+ f64(bias)), rounded once to x's dtype."""
    y = x.to(torch.float64) @ weight.to(torch.float64).T
    if bias is not None:
        y = y + bias.to(torch.float64)
    return _round_once(y, x.dtype)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode-shaped linear layer: y = x @ weight.T + bias, for T <= 8 rows.

    Args:
        x: [T, K] bfloat16, float16 or float32, 0 <= T <= 8, K >= 1; strided rows allowed.
        weight: [N, K] of x's dtype, N >= 1 (any N, odd included), on x's device.
        bias: optional [N] of x's dtype.

    Math: y[t, n] = sum_k x[t, k] * weight[n, k] + bias[n], in float64 from the exact
    upcasts, rounded once to x's dtype.

    Returns:
        [T, N] in x's dtype, a fresh tensor.

    Raises:
        ValueError: "skinny_gemm: argument '<name>' ...", including T > 8 (argument 'x'),
            a dtype mismatch or a wrong shape (see validate.check_skinny_gemm).
    """
    validate.check_skinny_gemm(x, weight, bias)
    return _linear_f64(x, weight, bias)


def unquantized_gemm(x: torch.Tensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The platform GEMM dispatcher's function: y = x @ weight.T + bias, any T >= 0.

    Args:
        x: [T, K] bfloat16, float16 or float32, K >= 1; any strides.
        weight: [N, K] of x's dtype, N >= 1, on x's device.
        bias: optional [N] of x's dtype.

    Math: as `skinny_gemm` (float64 from the exact upcasts, plus bias, rounded once to
    x's dtype) without the T limit. In the reference there is nothing to dispatch; the
    optimized version picks skinny_gemm or torch.nn.functional.linear per call.

    Returns:
        [T, N] in x's dtype, a fresh tensor.

    Raises:
        ValueError: "unquantized_gemm: argument '<name>' ..." (see
            validate.check_unquantized_gemm).
    """
    validate.check_unquantized_gemm(x, weight, bias)
    return _linear_f64(x, weight, bias)


GemmFn = Callable[..., torch.Tensor]


def _split(y: torch.Tensor, E: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return y[:, :E].contiguous(), y[:, E:].contiguous()


def fused_gate_gemm(x: torch.Tensor, router_weight: torch.Tensor, shared_gate_weight: torch.Tensor,
                    *, gemm: Optional[GemmFn] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Router logits and shared-expert gate logits from ONE GEMM over the stacked weight.

    Args:
        x: [T, H] bfloat16, float16 or float32 (T >= 0, H >= 1).
        router_weight: [E, H] of x's dtype, E >= 1.
        shared_gate_weight: [S, H] of x's dtype, S >= 1 (usually 1, making N = E+1 odd).
        gemm: the GEMM to call as gemm(x, weight) -> [T, N]; default this module's
            `unquantized_gemm`. Called exactly once.

    Math: W = concat([router_weight, shared_gate_weight]) ([E+S, H]); y = gemm(x, W);
    router_logits = y[:, :E], shared_gate_logits = y[:, E:]. With the default gemm each
    output is therefore f64 math rounded once to x's dtype, exactly what two separate
    `unquantized_gemm` calls give.

    Returns:
        (router_logits [T, E], shared_gate_logits [T, S]), both contiguous, x's dtype.

    Raises:
        ValueError: "fused_gate_gemm: argument '<name>' ..." (see
            validate.check_fused_gate_gemm), or argument 'gemm' if it is not callable.
    """
    validate.check_fused_gate_gemm(x, router_weight, shared_gate_weight)
    if gemm is None:
        gemm = unquantized_gemm
    elif not callable(gemm):
        fail("fused_gate_gemm", "gemm", f"must be callable or None, got {type(gemm).__name__}")
    weight = torch.cat([router_weight, shared_gate_weight], dim=0)
    return _split(gemm(x, weight), router_weight.shape[0])


def _check_source(op: str, name: str, t) -> None:
    validate.check_tensor(op, name, t, ndim=2, dtypes=validate.FLOAT_DTYPES)
    if t.shape[0] < 1 or t.shape[1] < 1:
        fail(op, name, f"must have at least one row and one column, got shape {tuple(t.shape)}")


_SOURCES = ("router_weight", "shared_gate_weight")


class FusedGate(torch.nn.Module):
    """Module form of `fused_gate_gemm` that keeps the stacked weight between calls.

    FusedGate(router_weight [E, H], shared_gate_weight [S, H]) holds references to the
    two source tensors (typically nn.Parameters owned by the model; they are neither
    copied nor registered as this module's parameters, so they stay in their owner's
    state_dict only) and a cached concatenation [E+S, H]. `forward(x)` returns
    (router_logits [T, E], shared_gate_logits [T, S]) from ONE call of `self.gemm` over
    the cached weight, both contiguous, in x's dtype.

    Staleness. The cache is rebuilt (and `rebuilds` incremented) before a forward when
      - a different tensor object was assigned: `gate.router_weight = new`, or
      - a source was changed in place or reallocated: its `_version` (bumped by every
        in-place op such as `w.copy_(...)` under no_grad, and by `load_state_dict`),
        data_ptr, shape, stride, dtype or device differ from when the cache was built
        (this covers `module.to(...)`, `module.half()` and `w.data = ...`).
    Not detected: writes through `w.data` (e.g. `w.data.copy_(new)`), which PyTorch
    does not record in the version counter. After such a write call `invalidate()`.

    `rebuilds` counts cache builds, the one in __init__ included; tests read it.
    `gemm` is a class attribute so `optimized` can subclass with its own dispatcher:
        class OptimizedFusedGate(FusedGate): gemm = staticmethod(optimized.unquantized_gemm)
    The cache is built under torch.no_grad(): this is an inference module.

    Raises:
        ValueError: "FusedGate: argument '<name>' ..." for bad source weights (not 2-D
            floating tensors of one dtype, width and device); forward raises
            "fused_gate_gemm: ..." for a bad x (validate.check_fused_gate_gemm).
    """

    gemm = staticmethod(unquantized_gemm)

    def __init__(self, router_weight: torch.Tensor, shared_gate_weight: torch.Tensor) -> None:
        super().__init__()
        op = "FusedGate"
        _check_source(op, "router_weight", router_weight)
        _check_source(op, "shared_gate_weight", shared_gate_weight)
        validate.check_tensor(op, "shared_gate_weight", shared_gate_weight, dtypes=(router_weight.dtype,),
                              shape=(None, router_weight.shape[1]), device=router_weight.device)
        self._sources = {"router_weight": router_weight, "shared_gate_weight": shared_gate_weight}
        self._weight: Optional[torch.Tensor] = None
        self._fingerprint = None
        self.rebuilds = 0
        self._refresh()

    # The sources are plain attributes backed by _sources, not registered parameters:
    # nn.Module.__setattr__ would register an nn.Parameter (and refuse a plain tensor
    # replacing one), so these two names bypass it.
    def __setattr__(self, name, value) -> None:
        if name in _SOURCES:
            _check_source("FusedGate", name, value)
            if value is not self._sources[name]:
                self._sources[name] = value
                self.invalidate()
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name):
        sources = self.__dict__.get("_sources")
        if name in _SOURCES and sources is not None:
            return sources[name]
        return super().__getattr__(name)

    @staticmethod
    def _state(t: torch.Tensor):
        # Inference-mode tensors have no version counter (and cannot be modified in place
        # outside inference mode); their other fields are still tracked.
        version = None if t.is_inference() else t._version
        return (version, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)

    def _current_fingerprint(self):
        return tuple(self._state(self._sources[n]) for n in _SOURCES)

    def invalidate(self) -> None:
        """Drop the cached weight; the next forward (or fused_weight()) rebuilds it."""
        self._weight = None
        self._fingerprint = None

    def _refresh(self) -> torch.Tensor:
        fp = self._current_fingerprint()
        if self._weight is None or fp != self._fingerprint:
            with torch.no_grad():
                self._weight = torch.cat([self._sources[n] for n in _SOURCES], dim=0)
            self._fingerprint = fp
            self.rebuilds += 1
        return self._weight

    def fused_weight(self) -> torch.Tensor:
        """The up-to-date stacked weight [E+S, H] (rebuilding it first if stale)."""
        return self._refresh()

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        rw, sw = self._sources["router_weight"], self._sources["shared_gate_weight"]
        validate.check_fused_gate_gemm(x, rw, sw)
        return _split(self.gemm(x, self._refresh()), rw.shape[0])

    def extra_repr(self) -> str:
        rw, sw = self._sources["router_weight"], self._sources["shared_gate_weight"]
        return f"E={rw.shape[0]}, S={sw.shape[0]}, H={rw.shape[1]}, dtype={rw.dtype}, rebuilds={self.rebuilds}"
