"""optimized.route: top-k expert selection on the CPU (SPEC sections 1 and 6), backed by
torch.ops.moelab.route; csrc/cpu/route_kernel.h describes the algorithm and its cost.

Same signature, validation and results as reference.route (float32/bfloat16/float16 logits;
the reference's float64 exact mode is refused here, ValueError naming 'logits'): ids are
identical wherever the keys are (the tie rule is exact, on every ISA level, for any thread
count and batch). The kernel's sigmoid/softmax keys are within one ulp of the reference's
exactly rounded ones (~96% identical); where that reorders two keys an ulp apart, the ids
differ by a near-tie flip (reference.route's docstring), never for exactly equal keys.
Weights: within 1-2 ulps (p, s, softmax over the selected), up to ~4 after a normalization
by their sum, one more after a scaling.

The op itself, for direct use (same checks, RuntimeError naming the argument):
    torch.ops.moelab.route(logits, top_k, method, bias=None, scaling=1.0, renormalize=None,
                           n_group=1, topk_group=1, norm_eps=None) -> (weights, ids)
with method given by name; renormalize and norm_eps left None take the method's defaults
(resolved in C++ exactly as reference.validate.check_route resolves them).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from reference.route import route as reference_route
from reference.validate import check_route

from . import _fake, dispatch
from .fastcall import direct
from .fastcall import ops as fast

_op = torch.ops.moelab.route.default


def _fake_outputs(op: str, logits, top_k, bias):
    """Shapes of route's outputs on meta tensors (route and route_variant alike)."""
    _fake.check(op, ("logits", logits, 2), ("bias", bias, 1))
    _fake.check_positive(op, "top_k", top_k)
    T = logits.shape[0]
    return (logits.new_empty((T, top_k), dtype=torch.float32),
            logits.new_empty((T, top_k), dtype=torch.int32))


@torch.library.register_fake("moelab::route")
def _route_fake(logits, top_k, method, bias=None, scaling=1.0, renormalize=None, n_group=1,
                topk_group=1, norm_eps=None):
    return _fake_outputs("route", logits, top_k, bias)


def route(logits: torch.Tensor, top_k: int, method: str, *, bias: Optional[torch.Tensor] = None,
          n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
          renormalize: Optional[bool] = None,
          norm_eps: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.route: (weights [T, K] f32, ids [T, K] int32).

    Validation gives reference.validate.check_route's errors (ValueError naming the argument).
    CPU tensors run the moelab kernel; other devices take route_off_cpu. Logits with
    a row stride (a column slice of a wider matrix) are read in place; a non-unit stride
    along E, or a strided bias, is copied first.

    On the CPU the op is called first and check_route runs only when the op refuses the call:
    the binding checks everything check_route does (tests/test_route_optimized.py holds every
    reference error input to the same ValueError, tests/test_hostile.py the op to its own
    RuntimeError), so a valid call pays only the binding's checks. The op is called through
    optimized.fastcall where that behaves as torch.ops does (eager mode, plain tensors), which
    saves the ~1.1 us of torch.ops' argument parsing per call.
    """
    if not (isinstance(logits, torch.Tensor) and logits.is_cpu):
        check_route(logits, top_k, method, bias, n_group, topk_group, scaling, renormalize, norm_eps)
        return route_off_cpu(logits, top_k, method, bias=bias, n_group=n_group, topk_group=topk_group,
                             scaling=scaling, renormalize=renormalize, norm_eps=norm_eps)
    # The schema converts what check_route refuses (a bool top_k, an int renormalize, a numeric
    # string scaling), so only plainly typed scalars skip the Python checks.
    if not (type(top_k) is int and type(n_group) is int and type(topk_group) is int
            and type(scaling) in _NUM and (renormalize is None or type(renormalize) is bool)
            and (norm_eps is None or type(norm_eps) in _NUM)):
        check_route(logits, top_k, method, bias, n_group, topk_group, scaling, renormalize, norm_eps)
    eps = None if norm_eps is None else float(norm_eps)
    try:
        op = fast.route if direct(logits, bias) else _op
        return op(logits, top_k, method, bias, float(scaling), renormalize, n_group, topk_group, eps)
    except (RuntimeError, TypeError, ValueError):
        check_route(logits, top_k, method, bias, n_group, topk_group, scaling, renormalize, norm_eps)
        raise   # check_route accepts what the op refused: the op's own error says why


def route_off_cpu(logits, top_k, method, **kwargs):
    """route off the CPU (arguments checked): the device's moelab::route kernel if one is
    registered (meta: shapes only), else the reference (same results, reference speed), as
    dispatch.route_decision says."""
    if dispatch.has_kernel("moelab::route", logits.device.type):
        eps = kwargs.get("norm_eps")
        return _op(logits, top_k, method, kwargs.get("bias"), float(kwargs.get("scaling", 1.0)),
                   kwargs.get("renormalize"), kwargs.get("n_group", 1), kwargs.get("topk_group", 1),
                   None if eps is None else float(eps))
    return reference_route(logits, top_k, method, **kwargs)


_NUM = (float, int)


# ------------------------------------------------------- seed 004's before/after pair
# Selection algorithms of moelab::route_variant, by name. Never chosen by a dispatcher: only the
# experiments (004), the tests and verify call route_variant. Both give route's bits exactly.
#   "lanes"   today's kernel, what route runs. CPU: SIMD lanes each keep the best keys of their
#             strided experts while the keys are computed, then a compress-and-rank pass
#             (csrc/cpu/route_kernel.h, step 3). GPU: the tier table (csrc/gpu/route.cu); at
#             E 512..2048, K 9..32 the lane-owned block path.
#   "serial"  seed 004's "before". CPU analogue: one scalar pass over all E order keys, each
#             offered to a sorted top-K list. GPU: one block per token whose warp 0 alone
#             scans every expert (each lane a sorted K-slot list of its strided experts) and
#             merges them by K warp arg-max rounds while the other warps wait.
SELECTIONS = ("lanes", "serial")
_variant_op = torch.ops.moelab.route_variant.default


@torch.library.register_fake("moelab::route_variant")
def _route_variant_fake(logits, top_k, method, selection, bias=None, scaling=1.0, renormalize=None, n_group=1,
                        topk_group=1, norm_eps=None):
    return _fake_outputs("route_variant", logits, top_k, bias)


def route_variant(logits: torch.Tensor, top_k: int, method: str, *, selection: str,
                  bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                  scaling: float = 1.0, renormalize: Optional[bool] = None,
                  norm_eps: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """route with the selection algorithm named (SELECTIONS above): seed 004's pair for
    experiments/004_routing.ipynb, the tests and verify. Same contract and bits as route; a
    selection outside SELECTIONS raises ValueError naming 'selection'. CPU and CUDA tensors
    (the kernel of that device); no fallback for other devices."""
    if selection not in SELECTIONS:
        raise ValueError(f"route_variant: argument 'selection' must be one of {SELECTIONS}, got {selection!r}")
    try:
        _, eps = check_route(logits, top_k, method, bias, n_group, topk_group, scaling, renormalize, norm_eps)
    except ValueError as e:   # route's checks, under this function's name
        msg = str(e)
        raise ValueError("route_variant" + msg[len("route"):] if msg.startswith("route:") else msg) from None
    if not (logits.is_cpu or logits.is_cuda):
        raise ValueError(f"route_variant: argument 'logits' must be a CPU or CUDA tensor, got {logits.device}")
    return _variant_op(logits, top_k, method, selection, bias, float(scaling), renormalize, n_group, topk_group,
                       None if norm_eps is None else eps)
