"""optimized.router_gemm: the fused-cast f32 router GEMM (seed 001), see
csrc/cpu/router_gemm_kernel.h for the algorithm and its cost."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from reference.validate import check_router_gemm

from . import _fake, dispatch
from .fastcall import direct
from .fastcall import ops as fast

_op = torch.ops.moelab.router_gemm.default


@torch.library.register_fake("moelab::router_gemm")
def _router_gemm_fake(x, weight):
    _fake.check("router_gemm", ("x", x, 2), ("weight", weight, 2))
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def router_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.router_gemm: upcast(x) @ weight.T in f32."""
    check_router_gemm(x, weight)
    if dispatch.router_gemm_decision(x, weight).kernel == "library":
        return F.linear(x.float(), weight)
    if x.shape[0] > 0 and x.stride(1) != 1:
        x = x.contiguous()
    return (fast.router_gemm if direct(x, weight) else _op)(x, weight)   # optimized.fastcall
