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
        return gpu_decision("router_gemm", x, weight)
    if T <= ROUTER_GEMM_MAX_T:
        return Decision("router_gemm", "moelab", f"T = {T} <= {ROUTER_GEMM_MAX_T}: fused-cast kernel")
    if _batch_invariant:
        return Decision("router_gemm", "moelab", "batch-invariant mode: library GEMM avoided")
    return Decision("router_gemm", "library", f"T = {T} > {ROUTER_GEMM_MAX_T}: F.linear(x.float(), w)")


_EXPLAINERS = {"router_gemm": router_gemm_decision}


def explain(op: str, *args, **kwargs) -> Decision:
    """Which kernel `optimized.<op>(*args, **kwargs)` would run, and why."""
    if op in _GPU_POLICIES and _on_gpu(args):
        return gpu_decision(op, *args, **kwargs)
    if op not in _EXPLAINERS:
        raise ValueError(f"explain: argument 'op' must be one of {', '.join(sorted(_EXPLAINERS))}; got {op!r}")
    return _EXPLAINERS[op](*args, **kwargs)


# ------------------------------------------------------------------ GPU (CUDA and ROCm)
# What each op does with tensors on a CUDA or ROCm device. The moelab GPU kernels
# (csrc/gpu, csrc/hip) are used when the moelab_gpu extension is loaded (a CUDA/ROCm torch
# with nvcc/hipcc); otherwise the op's own fallback runs. Crossovers marked "provisional"
# have not been measured on a GPU yet: scripts/gpu_check.sh measures them (experiments/
# results/) and these numbers are to be replaced by the measured ones.
GPU_ROUTER_GEMM_MAX_T = 32     # the fused-cast kernel's templated token counts (1..32)
GPU_SKINNY_MAX_T = 8           # skinny_gemm's contract limit; provisional crossover vs F.linear
GPU_MEASURED = "provisional: not yet measured on a GPU"


def _on_gpu(args) -> bool:
    for a in args:
        if hasattr(a, "device"):
            return a.device.type == "cuda"
    return False


def _gpu_platform() -> str:
    import torch
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def _gpu_loaded() -> bool:
    from . import gpu
    return gpu.available()


def _gpu_router_gemm(x, weight) -> Decision:
    op, T = "router_gemm", x.shape[0]
    if not _gpu_loaded():
        return Decision(op, "library", "moelab GPU extension not built: F.linear(x.float(), w)")
    if T <= GPU_ROUTER_GEMM_MAX_T:
        return Decision(op, "moelab", f"T = {T} <= {GPU_ROUTER_GEMM_MAX_T}: fused-cast GPU kernel (16-byte bf16 "
                                      f"loads widened in registers, one launch; {GPU_MEASURED})")
    if _batch_invariant:
        return Decision(op, "moelab", "batch-invariant mode: fused-cast GPU kernel over chunks of 32 tokens")
    return Decision(op, "library", f"T = {T} > {GPU_ROUTER_GEMM_MAX_T}: F.linear(x.float(), w) (cuBLAS / "
                                   f"hipBLASLt; not batch invariant)")


def _gpu_unquantized_gemm(x, weight, bias=None) -> Decision:
    op, T, platform = "unquantized_gemm", x.shape[0], _gpu_platform()
    blas = "hipBLASLt/Tensile" if platform == "rocm" else "cuBLAS"
    if not _gpu_loaded():
        return Decision(op, "library", f"moelab GPU extension not built: F.linear ({blas})")
    if str(x.dtype) not in ("torch.bfloat16", "torch.float16", "torch.float32"):
        return Decision(op, "library", f"skinny_gemm does not take {x.dtype}: F.linear ({blas})")
    if T <= GPU_SKINNY_MAX_T:
        from . import gpu
        kernel = gpu.skinny_kernel(x.dtype, T, x.shape[1])
        return Decision(op, "skinny", f"{platform}, T = {T} <= {GPU_SKINNY_MAX_T}: {kernel} ({GPU_MEASURED})")
    if _batch_invariant:
        return Decision(op, "skinny_chunked", f"{platform}, T = {T} > {GPU_SKINNY_MAX_T} in batch-invariant mode: "
                                              f"skinny_gemm over chunks of {GPU_SKINNY_MAX_T} rows")
    return Decision(op, "library", f"{platform}, T = {T} > {GPU_SKINNY_MAX_T}: F.linear ({blas}; not batch invariant)")


def _gpu_route(logits, top_k, method=None, **kwargs) -> Decision:
    op = "route"
    if not _gpu_loaded():
        return Decision(op, "reference", "moelab GPU extension not built: the reference implementation")
    from . import gpu
    return Decision(op, "moelab", f"GPU kernel, E = {logits.shape[1]}, K = {top_k}: "
                                  f"{gpu.route_plan(logits.shape[1], top_k)}")


def _gpu_permute(hidden, ids, *args, **kwargs) -> Decision:
    if not _gpu_loaded():
        return Decision("permute", "reference", "moelab GPU extension not built: the reference implementation")
    T, K = ids.shape[0], ids.shape[1]
    path = "1 fused planning block + 1 row-copy launch" if T * K <= 4096 else "3 planning launches + 1 row copy"
    return Decision("permute", "moelab", f"GPU stable counting sort, T*K = {T * K}: {path}")


def _gpu_unpermute(expert_out, weights, dst_pos) -> Decision:
    if not _gpu_loaded():
        return Decision("unpermute", "reference", "moelab GPU extension not built: the reference implementation")
    return Decision("unpermute", "moelab", "GPU weighted gather (f32, j ascending, no FMA; bit-identical)")


_GPU_POLICIES = {
    "router_gemm": _gpu_router_gemm,
    "unquantized_gemm": _gpu_unquantized_gemm,
    "route": _gpu_route,
    "permute": _gpu_permute,
    "unpermute": _gpu_unpermute,
}


def gpu_decision(op: str, *args, **kwargs) -> Decision:
    """The GPU policy of `op` (tensors on a CUDA/ROCm device): which kernel, and why."""
    return _GPU_POLICIES[op](*args, **kwargs)
