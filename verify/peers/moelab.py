"""moelab's own kernels as an implementation: `optimized`, every op, no deviations from SPEC."""
from __future__ import annotations

from . import Coverage, Impl


def load() -> Impl:
    from ..registry import REGISTRY, import_optimized, optimized_import_error
    ops = import_optimized()
    if ops is None:
        return Impl("moelab", reason=f"import optimized failed: {optimized_import_error()}")
    covers = {name: Coverage("the whole contract") for name, e in REGISTRY.items() if e.optimized(ops) is not None}
    import torch
    return Impl("moelab", ops=ops, version=str(ops.backend_info()), covers=covers,
                notes="the project's optimized kernels; the contract is SPEC itself",
                backends=("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))
