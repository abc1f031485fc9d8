"""optimized.fastcall: the ops a decode step calls, without torch.ops' argument parsing.

`torch.ops.moelab.<op>(...)` turns each Python argument into an IValue against the op's schema
before the dispatcher runs: ~1.1 us of a ~3.3 us T = 1 route call on a Zen 4 core
(`python -m experiments.micro route_call_cost`). The
module moelab_fastcall (csrc/python/fastcall.cpp, built with the CPU extension) binds route,
router_gemm, skinny_gemm, permute, permute_out and unpermute with their C++ types and calls
the same op through the dispatcher's typed handle, so dispatch, checks, errors and results are
those of torch.ops.

The wrappers (optimized.route, ...) call `ops.<op>` only where `direct(...)` says that is
exactly torch.ops' behaviour: in eager mode (torch.compile traces torch.ops; Dynamo cannot trace
a pybind11 call), and when every tensor argument is a plain tensor or Parameter (a tensor
subclass with its own __torch_function__ gets that hook from torch.ops, not from the dispatcher).
"""
from __future__ import annotations

import torch

from . import _build

ops = _build.load_fastcall()
_PLAIN = (torch.Tensor, torch.nn.Parameter)   # Parameter's __torch_function__ is torch's own (disabled)
_is_compiling = torch.compiler.is_compiling


def direct(a, b=None, c=None) -> bool:
    """Whether ops.<op> on these tensor arguments (None: an absent optional) behaves as torch.ops."""
    return (type(a) in _PLAIN and (b is None or type(b) in _PLAIN) and (c is None or type(c) in _PLAIN)
            and not _is_compiling())
