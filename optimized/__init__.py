"""moelab.optimized: the same functions as `reference`, backed by torch.ops.moelab kernels.

Importing this package builds (if needed) and loads the CPU extension. Every function
validates its arguments with reference.validate first, so errors read the same as the
reference's; the C++ bindings re-check what the kernels rely on.
"""
from __future__ import annotations

import torch

from . import _build

_build.load()

from . import dispatch, tune  # noqa: E402
from .dispatch import batch_invariant_mode, set_batch_invariant  # noqa: E402,F401
from .router_gemm import router_gemm  # noqa: E402,F401
from .route import route  # noqa: E402,F401
from .permute import Permuted, PermuteScratch, permute, unpermute  # noqa: E402,F401
from .gate_gemm import FusedGate, fused_gate_gemm, skinny_gemm, unquantized_gemm  # noqa: E402,F401
from .fused_experts import PackedMoEWeights, fused_experts, fused_experts_rows, prepack_moe_weights  # noqa: E402,F401
from . import bench_probe  # noqa: E402,F401  (moelab::read_stream's fake: a measurement tool)


def backend_info() -> dict[str, str]:
    """ISA of the CPU (detected), the level in use (active) and the level each op runs at;
    "sanitize": the sanitizers when this is the sanitized build (MOELAB_SANITIZE=1)."""
    info = dict(item.split(":", 1) for item in torch.ops.moelab.backend_info())
    return {**info, "sanitize": _build.SANITIZERS} if _build.SANITIZE else info


def set_isa(name: str) -> None:
    """Cap the CPU ISA level for this process: scalar, avx2, avx512 or avx512_bf16."""
    torch.ops.moelab.set_isa(name)
    tune.level_changed()    # auto's crossovers are chosen per level
