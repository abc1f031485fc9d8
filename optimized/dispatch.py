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
# skinny_gemm streams the weight once for all T <= 8 tokens (a memory-bound decode GEMM);
# F.linear (oneDNN/MKL) is tuned for large T. SKINNY_MAX_T is the kernel's contract limit.
# Measured crossover (`python -m experiments.cases_skinny_gemm`: the raw op vs F.linear,
# weights rotating through cold copies, calls alternated one by one, 2 threads, AMD EPYC with
# AVX-512 BF16, torch 2.13; median of per-call ratios):
#   bf16: skinny 1.5-4.8x faster at every T <= 8, weights 1 KiB .. 16 MiB (T = 8 is the
#         smallest win: 1.5x at 513x4096);
#   f16:  1.0-1.3x at T = 1 (F.linear has a good f16 GEMV), 1.4-5x at T = 2..8;
#   f32:  2-3.5x from 256 KiB of weight on; at T = 1 with <= 128 KiB, F.linear (MKL
#         SGEMV) is ~0.3 us faster (0.85-0.98x): SKINNY_F32_T1_MIN_BYTES.
# Above T = 8 the library GEMM runs, except in batch-invariant mode, where the batch goes
# through skinny_gemm in chunks of SKINNY_MAX_T rows (each row's reduction order stays fixed;
# the weight is then read once per chunk, ceil(T/8) reads instead of one). In batch-invariant
# mode the f32 T = 1 exception is off too: a row alone must equal the row inside a batch.
SKINNY_MAX_T = 8
SKINNY_DTYPES = ("bfloat16", "float16", "float32")
SKINNY_F32_T1_MIN_BYTES = 256 << 10
_SKINNY_TORCH_DTYPES = frozenset(getattr(torch, name) for name in SKINNY_DTYPES)


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def unquantized_gemm_kernel(x, weight) -> str:
    """The kernel optimized.unquantized_gemm runs (the hot path: no reason string)."""
    if x.device.type != "cpu" or x.dtype not in _SKINNY_TORCH_DTYPES:
        return "library"
    T = x.shape[0]
    if T <= SKINNY_MAX_T:
        if (T == 1 and x.dtype == torch.float32 and not _batch_invariant
                and weight.numel() * 4 < SKINNY_F32_T1_MIN_BYTES):
            return "library"
        return "skinny"
    return "skinny_chunked" if _batch_invariant else "library"


def unquantized_gemm_decision(x, weight, bias=None) -> Decision:
    """skinny (T <= 8, CPU, bf16/f16/f32), skinny_chunked (T > 8 in batch-invariant mode),
    or library (F.linear: other devices, T > 8, f32 T = 1 small weights; not batch invariant)."""
    op = "unquantized_gemm"
    T = x.shape[0]
    kernel = unquantized_gemm_kernel(x, weight)
    lib = "F.linear (library GEMM; NOT batch invariant, its blocking may change with T; " \
          "set_batch_invariant(True) avoids it)"
    if x.device.type != "cpu":
        return Decision(op, kernel, f"no moelab kernel for device {x.device.type}: F.linear")
    if _dtype_name(x) not in SKINNY_DTYPES:
        return Decision(op, kernel, f"skinny_gemm does not take {_dtype_name(x)}: F.linear")
    if kernel == "skinny":
        mode = ", batch-invariant mode" if _batch_invariant else ""
        return Decision(op, kernel, f"T = {T} <= {SKINNY_MAX_T}{mode}: skinny_gemm streams the weight once "
                                    f"for all tokens, faster than F.linear here (measured: "
                                    f"experiments/cases_skinny_gemm.crossover); batch invariant")
    if kernel == "skinny_chunked":
        return Decision(op, kernel, f"T = {T} > {SKINNY_MAX_T} in batch-invariant mode: skinny_gemm "
                                    f"over {-(-T // SKINNY_MAX_T)} chunks of <= {SKINNY_MAX_T} rows "
                                    f"(invariant; reads the weight once per chunk)")
    if T <= SKINNY_MAX_T:
        return Decision(op, kernel, f"T = 1, float32, weight {weight.numel() * 4} bytes < "
                                    f"{SKINNY_F32_T1_MIN_BYTES}: MKL's SGEMV beats skinny_gemm by ~0.3 us; {lib}")
    return Decision(op, kernel, f"T = {T} > {SKINNY_MAX_T}: {lib}")


_EXPLAINERS = {"router_gemm": router_gemm_decision, "unquantized_gemm": unquantized_gemm_decision}


def explain(op: str, *args, **kwargs) -> Decision:
    """Which kernel `optimized.<op>(*args, **kwargs)` would run, and why."""
    if op not in _EXPLAINERS:
        raise ValueError(f"explain: argument 'op' must be one of {', '.join(sorted(_EXPLAINERS))}; got {op!r}")
    return _EXPLAINERS[op](*args, **kwargs)
