"""Which implementation served a case: a moelab kernel, a library GEMM the dispatcher chose, or a
fallback that only re-runs the reference.

Why it matters: `optimized` keeps working on a CUDA tensor when the GPU extension (moelab_gpu)
is absent: route, permute, unpermute and fused_experts then run the pure-PyTorch reference on
the device, router_gemm and unquantized_gemm run F.linear (optimized/dispatch.py: the GPU
decisions say "moelab GPU extension not built"). Such a case compares the reference with
itself, so it always "passes" and proves nothing about the kernels. verify therefore records,
for every case, what actually ran, and a cell served by a fallback is reported NOT VERIFIED
and fails the run (python -m verify --allow-fallback accepts it, still reported).

How it is decided, from what ran rather than from what the code says it would run:
  kernel    a torch.ops.moelab op ran on the case's device during the call (KernelWatch, a
            TorchDispatchMode that sees every op dispatched inside the call);
  library   no moelab op ran, and the dispatcher's own decision for the case (the comparison
            records optimized.dispatch.explain as the case's `path`) names the library GEMM,
            with the moelab kernels for that device loaded: router_gemm above its token
            crossover, unquantized_gemm above the skinny limit. The op's contract is what is
            verified there, through the vendor GEMM the op documents;
  empty     no moelab op ran and every output is empty (T = 0): nothing was computed, so
            there is nothing a fallback could have passed off;
  fallback  anything else: nothing of ours ran (the reference, or a library GEMM standing in
            for a kernel that is not built).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

KERNEL, LIBRARY, EMPTY, FALLBACK = "kernel", "library", "empty", "fallback"
NAMESPACE = "moelab"


class KernelWatch(TorchDispatchMode):
    """Counts the torch.ops.moelab ops that run with a tensor on `device_type` inside the block
    (ops without tensor arguments, like gpu_info, are not kernels and are not counted)."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.kernels: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) == NAMESPACE:
            if any(isinstance(t, torch.Tensor) and t.device.type == self.device_type
                   for t in tree_leaves((args, kwargs))):
                self.kernels[func.name()] += 1
        return func(*args, **kwargs)


@dataclass(frozen=True)
class Served:
    impl: str        # kernel | library | empty | fallback
    detail: str

    @property
    def verified(self) -> bool:
        return self.impl != FALLBACK

    def __str__(self) -> str:
        return f"{self.impl}: {self.detail}" if self.detail else self.impl


def decision_kernel(path: Optional[str]) -> Optional[str]:
    """The kernel named by a recorded dispatch decision ("op: kernel (reason)"), or None."""
    if not path or ": " not in path:
        return None
    return path.split(": ", 1)[1].split(" (", 1)[0].strip() or None


def device_kernels_loaded(ops, backend: str) -> bool:
    """Whether the namespace under test has its own kernels for a verify backend: always on the
    CPU (the CPU extension is what `import optimized` loads); on "cuda" (CUDA or ROCm),
    optimized.gpu.available() (the moelab_gpu extension)."""
    if backend == "cpu":
        return True
    gpu = getattr(ops, "gpu", None)
    if gpu is None and getattr(ops, "__name__", None):
        try:
            import importlib
            gpu = importlib.import_module(f"{ops.__name__}.gpu")
        except ImportError:
            gpu = None
    try:
        return bool(gpu is not None and gpu.available())
    except Exception:
        return False


def _all_empty(tensors: Iterable) -> bool:
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    return bool(ts) and all(t.numel() == 0 for t in ts)


def classify(kernels: Counter, path: Optional[str], outputs, backend: str, kernels_loaded: bool) -> Served:
    """What served a case (see the module docstring). kernels: KernelWatch's count of the moelab
    ops that ran on the case's device; path: the dispatcher's recorded decision, if any."""
    if kernels:
        return Served(KERNEL, ", ".join(f"{k} x{n}" if n > 1 else k for k, n in sorted(kernels.items())))
    if _all_empty(tree_leaves(outputs)):
        return Served(EMPTY, "no output elements")
    if decision_kernel(path) == LIBRARY and kernels_loaded:
        return Served(LIBRARY, path)
    if not kernels_loaded:
        why = f"no moelab kernels loaded for backend {backend} (on CUDA/ROCm: the moelab_gpu extension is not built)"
    else:
        why = "no moelab op ran and the dispatcher named no library path"
    return Served(FALLBACK, why + (f"; dispatcher said: {path}" if path else ""))
