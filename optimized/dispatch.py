"""Every kernel-choice policy of `optimized`, in one readable place.

A policy is data: a threshold with the reason for it and the measurement behind it.
`explain(op, *args)` says which kernel a call takes and why; experiments and tests read it.

Batch invariance (SPEC general rules): a path is *invariant* when each output element's
reduction order is fixed independently of T and of the other tokens. Our own CPU kernels
are invariant by construction. A vendor/library GEMM (F.linear through oneDNN/MKL) may
change its blocking with T, so in batch-invariant mode every dispatcher avoids it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

_batch_invariant = False


def set_batch_invariant(enabled: bool) -> None:
    """Make every dispatcher choose batch-invariant kernels (see the module docstring)."""
    global _batch_invariant
    _batch_invariant = bool(enabled)


def batch_invariant() -> bool:
    return _batch_invariant


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True):
    previous = _batch_invariant
    set_batch_invariant(enabled)
    try:
        yield
    finally:
        set_batch_invariant(previous)


@dataclass(frozen=True)
class Decision:
    op: str
    kernel: str
    reason: str

    def __str__(self) -> str:
        return f"{self.op}: {self.kernel} ({self.reason})"


# ---------------------------------------------------------------- router_gemm
# The fused-cast kernel streams the f32 weight once for all tokens; its cost is flat in T
# until the FLOPs dominate. Beyond ROUTER_GEMM_MAX_T a library GEMM over an f32 copy of x
# is faster (measured: experiments/bench.py, router_gemm rows).
ROUTER_GEMM_MAX_T = 32


def router_gemm_decision(x, weight) -> Decision:
    T = x.shape[0]
    if x.device.type != "cpu":
        return Decision("router_gemm", "library", f"no moelab kernel for device {x.device.type}")
    if T <= ROUTER_GEMM_MAX_T:
        return Decision("router_gemm", "moelab", f"T = {T} <= {ROUTER_GEMM_MAX_T}: fused-cast kernel")
    if _batch_invariant:
        return Decision("router_gemm", "moelab", "batch-invariant mode: library GEMM avoided")
    return Decision("router_gemm", "library", f"T = {T} > {ROUTER_GEMM_MAX_T}: F.linear(x.float(), w)")


# ----------------------------------------------------------- unquantized_gemm (skinny vs library)
# skinny_gemm streams the weight once for all T <= 8 tokens (memory-bound decode GEMM);
# F.linear (oneDNN/MKL) is tuned for large T. SKINNY_MAX_T is the kernel's contract limit,
# and the crossover: measured with `python -m experiments.cases_skinny_gemm` (skinny op vs
# F.linear, cold weights, 2 threads, every dtype, T = 1..8, weights from 8x64 to 2048x4096),
# skinny was never slower than F.linear at T <= 8 beyond the noise (see SKINNY_EVIDENCE),
# so there is no size or dtype exception below the limit. Above T = 8 the library GEMM is
# used, except in batch-invariant mode, where the batch goes through skinny_gemm in chunks
# of SKINNY_MAX_T rows (every row's reduction order stays fixed; the weight is then read
# once per chunk, so it costs ceil(T/8) weight reads instead of one).
SKINNY_MAX_T = 8
SKINNY_DTYPES = ("bfloat16", "float16", "float32")
SKINNY_EVIDENCE = "measured: experiments/cases_skinny_gemm.crossover"


_SKINNY_TORCH_DTYPES = frozenset(getattr(torch, name) for name in SKINNY_DTYPES)


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def unquantized_gemm_kernel(x) -> str:
    """The kernel optimized.unquantized_gemm runs for x (the hot path: no reason string)."""
    if x.device.type != "cpu" or x.dtype not in _SKINNY_TORCH_DTYPES:
        return "library"
    if x.shape[0] <= SKINNY_MAX_T:
        return "skinny"
    return "skinny_chunked" if _batch_invariant else "library"


def unquantized_gemm_decision(x, weight, bias=None) -> Decision:
    """skinny (T <= 8, CPU, bf16/f16/f32), skinny_chunked (T > 8 in batch-invariant mode),
    or library (F.linear: other devices, T > 8; not batch invariant)."""
    op = "unquantized_gemm"
    T = x.shape[0]
    kernel = unquantized_gemm_kernel(x)
    if x.device.type != "cpu":
        return Decision(op, kernel, f"no moelab kernel for device {x.device.type}: F.linear")
    if _dtype_name(x) not in SKINNY_DTYPES:
        return Decision(op, kernel, f"skinny_gemm does not take {_dtype_name(x)}: F.linear")
    if kernel == "skinny":
        mode = ", batch-invariant mode" if _batch_invariant else ""
        return Decision(op, kernel, f"T = {T} <= {SKINNY_MAX_T}{mode}: skinny_gemm streams the weight once "
                                    f"for all tokens, faster than F.linear at every T <= {SKINNY_MAX_T} "
                                    f"({SKINNY_EVIDENCE}); batch invariant")
    if kernel == "skinny_chunked":
        return Decision(op, kernel, f"T = {T} > {SKINNY_MAX_T} in batch-invariant mode: skinny_gemm "
                                    f"over {-(-T // SKINNY_MAX_T)} chunks of <= {SKINNY_MAX_T} rows "
                                    f"(invariant; reads the weight once per chunk)")
    return Decision(op, kernel, f"T = {T} > {SKINNY_MAX_T}: F.linear (library GEMM; NOT batch invariant, "
                                f"its blocking may change with T; set_batch_invariant(True) avoids it)")


_EXPLAINERS = {"router_gemm": router_gemm_decision, "unquantized_gemm": unquantized_gemm_decision}


def explain(op: str, *args, **kwargs) -> Decision:
    """Which kernel `optimized.<op>(*args, **kwargs)` would run, and why."""
    if op not in _EXPLAINERS:
        raise ValueError(f"explain: argument 'op' must be one of {', '.join(sorted(_EXPLAINERS))}; got {op!r}")
    return _EXPLAINERS[op](*args, **kwargs)
