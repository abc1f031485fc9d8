"""The op registry: one `OpInfo` entry per op of SPEC.md (PyTorch OpInfo style).

An entry says everything verify needs to hold `optimized.<op>` against `reference.<op>`:

    draw(draw, dist, fixed) -> structure    the shape of one case, drawn by hypothesis: a
                                            JSON-able dict (sizes, dtypes, options, seed)
    make_case(structure) -> Case            the tensors, built from structure["seed"] on CPU
    call(fn, case, device) -> output        how to invoke fn (optimized, reference or a
                                            mutant) on that device; poisons scratch buffers
    compare(out, ref, case, ctx) -> CaseResult   exact for indices, the tolerance rule of
                                            verify.tolerance for arithmetic
    token_gather(case, rows) -> Case        the case made of the given tokens (rows: token
                                            indices, repeats allowed): the batch-invariance
                                            property runs a token alone and inside random
                                            batches of other tokens through it
    invariant_always                        the backends where the op is batch invariant by
                                            construction, i.e. also outside
                                            optimized.batch_invariant_mode (docs/batch_invariance.md)
    variants(case) -> [(label, Case)]       other ways to compute the same case that must agree
                                            bit for bit (fused_experts: every dispatch policy)
    error_spec(seed) -> CallSpec            a small valid call + rules for malformed variants
                                            + explicit error inputs that must raise
    dists                                   the distributions the op runs under
    mutants                                 filled in by verify.mutants

The optimized function is looked up by name when a case runs (`resolve`), so ops that land
in `optimized` later are picked up without touching verify; a missing one is reported as
NOT COVERED, never counted as passing.

Each op lives in its own module under verify/ops/ (cases, comparison, error inputs, read top
to bottom; verify/ops/common.py holds the data types and helpers they share) and ends with its
`ENTRIES`; this module keeps the table. Adding an op is adding a module there and listing it
in `_OP_MODULES`.
"""
from __future__ import annotations

from typing import Dict

from . import tolerance as tol  # noqa: F401  (tests reach it as registry.tol)
from .ops import fused_experts as _fused_experts_mod
from .ops import gate_gemm as _gate_gemm_mod
from .ops import moe as _moe_mod
from .ops import permute as _permute_mod
from .ops import route as _route_mod
from .ops import router_gemm as _router_gemm_mod
# The shared machinery and the names other modules (verify.families, verify.mutants, the
# runner, the tests) import from here, re-exported so `from verify.registry import X` keeps working.
from .ops.common import (ALL_DISTS, DTYPE_NAMES, NO_NAN, CallSpec, Case, CaseResult, Ctx, Mutant,  # noqa: F401
                         OpInfo, Picker, TensorRule, _arith_result, _bits_equal, _cap_tokens, _common, _explain,
                         _noncontig, _shape_check, _tokens, _x_gather, import_optimized, optimized_import_error,
                         to_cpu, to_device)
from .ops.fused_experts import (ACTIVATIONS, DISPATCHES, QUANTS, _compare_fused_experts,  # noqa: F401
                                _draw_experts_common, _fused_args, _fused_check, _fused_errors, make_expert_weights)
from .ops.gate_gemm import ref_unquantized_gemm  # noqa: F401
from .ops.moe import _compare_moe, _moe_errors, _moe_parts, skew_router  # noqa: F401
from .ops.route import (METHODS, NORM_EPS_DRAWS, RENORM_DRAWS, SCALINGS, _compare_route,  # noqa: F401
                        _draw_groups_and_k, admissible_topk, key_allowance, route_flip_check)
from .ops.router_gemm import _compare_router_gemm  # noqa: F401

# the table's order is the order of a full run (and of --ops' default)
_OP_MODULES = (_route_mod, _permute_mod, _router_gemm_mod, _gate_gemm_mod, _fused_experts_mod, _moe_mod)

REGISTRY: Dict[str, OpInfo] = {}


def register(info: OpInfo) -> OpInfo:
    REGISTRY[info.name] = info
    return info


for _mod in _OP_MODULES:
    for _entry in _mod.ENTRIES:
        register(_entry)


def reference_output(entry: OpInfo, case: Case):
    return entry.reference(*case.args, **case.kwargs)
