"""optimized.gpu: the CUDA / ROCm side of `optimized`, as far as Python needs to see it.

The kernels live in csrc/gpu (torch-free, one source for CUDA and HIP) and csrc/hip (the
ROCm-only wave64 skinny GEMM); csrc/torch_gpu registers them as the CUDA implementations of
the same torch.ops.moelab ops the CPU extension defines, so `optimized.route(...)` etc. run on
the GPU when given GPU tensors. The extension is built only with a CUDA/ROCm torch and a
device compiler (optimized/_build.py); everything here answers sensibly without it.
"""
from __future__ import annotations

import torch

__all__ = ["available", "info", "permute_counts_numel", "route_plan", "skinny_kernel"]


def available() -> bool:
    """True when the moelab_gpu extension is loaded (CUDA or ROCm implementations registered)."""
    return hasattr(torch.ops.moelab, "gpu_info")


def info() -> dict[str, str]:
    """{'platform': 'cuda'|'rocm', 'warp': '32'|'64'}, or {} without the GPU extension."""
    if not available():
        return {}
    return dict(item.split(":", 1) for item in torch.ops.moelab.gpu_info())


def _need() -> None:
    if not available():
        raise RuntimeError("moelab GPU extension not loaded: it needs a CUDA or ROCm build of torch and "
                           "nvcc / hipcc (see optimized/_build.py)")


def permute_counts_numel(rows: int, n_local_experts: int) -> int:
    """Elements (int64) that PermuteScratch.counts needs on the GPU for up to `rows` = T*K routed
    rows: the counting sort's workspace (a status block and one expert histogram per unit of
    rows). On the CPU the kernel needs n_local_experts; on the GPU this many."""
    _need()
    words = int(torch.ops.moelab.gpu_permute_workspace_words(int(rows), int(n_local_experts)))
    return max(int(n_local_experts), (words + 1) // 2)


def route_plan(E: int, K: int) -> str:
    """The row of route's GPU tier table a call with (E, K) takes, with its reason."""
    _need()
    return torch.ops.moelab.gpu_route_plan(int(E), int(K))


def skinny_kernel(dtype: torch.dtype, T: int, K: int) -> str:
    """Which GPU kernel skinny_gemm runs for (dtype, T, K) on this build (ROCm: wave64 or portable)."""
    _need()
    return torch.ops.moelab.gpu_skinny_kernel(str(dtype).replace("torch.", ""), int(T), int(K))
