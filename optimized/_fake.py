"""The checks every fake (meta / FakeTensor) kernel of a torch.ops.moelab op makes first.

torch's dispatcher sends a call to the op's Meta kernel (the function registered with
torch.library.register_fake) whenever ANY tensor argument is on the meta device, also when
the others are CPU (or CUDA) tensors. A fake that only read shapes would then return
outputs on its first argument's device, i.e. uninitialized CPU tensors, for a call that the
real kernel would refuse, and permute_out's fake would return having written nothing: a
silent wrong answer. So each fake first checks that all its tensor arguments share one
device, and the ranks of the tensors whose sizes it reads, raising the RuntimeError the C++
bindings raise ("moelab::<op>: argument '<name>' ..."). Dtypes, the remaining size rules and
index ranges are the real kernel's checks: they run when the call executes.
"""
from __future__ import annotations

from typing import Optional

import torch


def fail(op: str, arg: str, msg: str) -> None:
    raise RuntimeError(f"moelab::{op}: argument '{arg}' {msg}")


def check(op: str, *tensors: tuple[str, Optional[torch.Tensor], Optional[int]]) -> None:
    """tensors: (name, tensor or None for an absent optional, required rank or None)."""
    first = None
    for name, t, ndim in tensors:
        if t is None:
            continue
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            fail(op, name, f"must be on {first[1]} like argument '{first[0]}', got {t.device}")
        if ndim is not None and t.dim() != ndim:
            fail(op, name, f"must be {ndim}-D, got {t.dim()}-D")


def check_positive(op: str, name: str, v: int) -> None:
    if v < 1:
        fail(op, name, f"must be >= 1, got {v}")
