"""The shared machinery of verify's op registry: the data types every op module fills in
(Case, CaseResult, OpInfo, the bad-input CallSpec/TensorRule, Mutant), the lazy import of
`optimized`, and the small helpers the op modules share (drawing token counts, moving
tensors between devices, shape and bitwise checks). The ops themselves live one per module
beside this one; verify/registry.py holds the table."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from hypothesis import strategies as st

from .. import distributions as D
from .. import tolerance as tol

ALL_DISTS = D.ROUTING_DISTS
NO_NAN = tuple(d for d in ALL_DISTS if d != "nan_inf")
DTYPE_NAMES = tuple(D.DTYPES)

# ============================================================================ data types
@dataclass
class Case:
    """One concrete case: positional args, keyword args (CPU tensors and plain values)."""
    op: str
    structure: dict
    args: tuple
    kwargs: dict
    aux: dict = field(default_factory=dict)


@dataclass
class CaseResult:
    ok: bool
    kind: str = "ok"                 # ok | mismatch | exception | batch_invariance | aliasing | not_available
    ratio: Optional[float] = None    # worst error / tolerance (None: exact comparison only)
    flips: int = 0                   # near-tie flips (route ids; moe_forward tokens)
    flip_gaps: List[float] = field(default_factory=list)   # key gap of each flip, in f32 ulps
    message: str = ""
    path: Optional[str] = None       # which kernel the dispatcher chose, when it says
    bi_checked: bool = False         # the batch-invariance property was checked and held
    reroutes: int = 0                # moe_forward: tokens whose (tolerated) logit error changed the experts
    served: Any = None               # what ran: verify.provenance.Served (kernel, library, empty, fallback)
    bound: str = ""                  # the tolerance term at the worst element (verify.tolerance.BOUNDS)

    def to_json(self) -> dict:
        return {"ok": self.ok, "kind": self.kind, "ratio": self.ratio, "flips": self.flips,
                "flip_gaps": self.flip_gaps[:20], "message": self.message[:2000], "path": self.path,
                "served": None if self.served is None else str(self.served), "bound": self.bound}


@dataclass
class Ctx:
    """What a comparison may need besides the outputs."""
    device: torch.device
    ops: Any                         # namespace to resolve optimized functions (module `optimized`)


@dataclass
class TensorRule:
    """How a tensor argument may be made malformed (bad-input fuzz)."""
    bad_dtypes: Tuple[torch.dtype, ...]
    dims: Tuple[int, ...] = ()       # dims whose size is tied to another argument
    dim_names: Tuple[str, ...] = ()  # argument names an error about those dims may name
    contiguous: bool = False         # the op requires it contiguous
    index: Optional[Tuple[int, int]] = None   # valid value range [lo, hi) of an index tensor
    device_ref: bool = False         # the device every other tensor must match
    aliases: Tuple[str, ...] = ()    # other names an error may use (an inner op's argument name)


@dataclass
class CallSpec:
    params: Dict[str, Any]
    positional: Tuple[str, ...]
    rules: Dict[str, TensorRule]
    explicit: List[Tuple[str, Dict[str, Any], Tuple[str, ...]]]   # (description, overrides, names)

    def build(self, overrides: Optional[Dict[str, Any]] = None):
        p = dict(self.params)
        p.update(overrides or {})
        return tuple(p[n] for n in self.positional), {k: v for k, v in p.items() if k not in self.positional}


@dataclass
class Mutant:
    """A deliberately wrong version of an op: `wrap(fn)` returns the broken function."""
    name: str
    op: str
    description: str
    wrap: Callable[[Callable], Callable]
    dists: Optional[Tuple[str, ...]] = None     # where it is meant to show (None: all of the op's)
    fixed: Dict[str, Any] = field(default_factory=dict)   # structure fields forced for it
    kind: str = "mismatch"                      # the failure kind that must kill it


@dataclass
class OpInfo:
    name: str
    reference: Callable
    draw: Callable
    make_case: Callable[[dict], Case]
    compare: Callable
    error_spec: Callable[[int], CallSpec]
    dists: Tuple[str, ...] = ALL_DISTS
    call: Optional[Callable] = None
    token_gather: Optional[Callable] = None
    invariant_always: Tuple[str, ...] = ()
    variants: Optional[Callable] = None
    max_tokens: Optional[int] = None             # the op's own limit on T (skinny_gemm: 8)
    resolve: Optional[Callable] = None
    opt_name: str = ""
    weight: float = 1.0              # share of the time budget
    error_ops: Tuple[str, ...] = ()  # op names an error message may start with
    mutants: List[Mutant] = field(default_factory=list)
    notes: str = ""

    def __post_init__(self):
        self.opt_name = self.opt_name or self.name
        self.error_ops = self.error_ops or (self.name,)

    def optimized(self, ops=None) -> Optional[Callable]:
        """The optimized function, looked up now (None when `optimized` lacks it)."""
        if ops is None:
            ops = import_optimized()
            if ops is None:
                return None
        if self.resolve is not None:
            return self.resolve(ops)
        fn = getattr(ops, self.opt_name, None)
        return fn if callable(fn) else None

    def run(self, fn: Callable, case: Case, device: torch.device):
        if self.call is not None:
            return self.call(fn, case, device)
        args, kwargs = to_device((case.args, case.kwargs), device)
        return fn(*args, **kwargs)


_OPTIMIZED = None
_OPTIMIZED_ERROR: Optional[str] = None


def import_optimized():
    """The `optimized` package, or None (with the import error kept for the report)."""
    global _OPTIMIZED, _OPTIMIZED_ERROR
    if _OPTIMIZED is None and _OPTIMIZED_ERROR is None:
        try:
            import optimized
            _OPTIMIZED = optimized
        except Exception as e:  # a failed build is reported, not hidden
            _OPTIMIZED_ERROR = f"{type(e).__name__}: {e}"
    return _OPTIMIZED


def optimized_import_error() -> Optional[str]:
    import_optimized()
    return _OPTIMIZED_ERROR


# ============================================================================ helpers
def to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        if obj.device == torch.device(device):
            return obj
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_device(v, device) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def to_cpu(obj):
    return to_device(obj, torch.device("cpu"))


class Picker:
    """Draws structure fields, honouring fields a mutant or a repro fixes."""

    def __init__(self, draw, fixed: Optional[dict] = None):
        self.draw = draw
        self.fixed = fixed or {}

    def __call__(self, name: str, strategy):
        if name in self.fixed:
            return self.fixed[name]
        return self.draw(strategy)


def _tokens(p: Picker, name: str = "T", hi: int = 600) -> int:
    return p(name, st.one_of(st.sampled_from(D.TILE_TOKENS), st.integers(0, hi)))


def _common(p: Picker, dist: str) -> dict:
    return {"seed": p("seed", st.integers(0, 2 ** 31 - 1)),
            "dchoice": p("dchoice", st.integers(0, 5)),
            "bi": p("bi", st.sampled_from((False, False, False, True)))}


def _cap_tokens(T: int, per_token_cost: float, budget: float) -> int:
    if T == 0 or per_token_cost <= 0:
        return T
    return max(1, min(T, int(budget // per_token_cost)))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included), shapes and dtypes first."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    if a.is_floating_point():
        return bool(torch.equal(a.contiguous().view(view), b.contiguous().view(view)))
    return bool(torch.equal(a, b))


def _shape_check(out, ref, names=("output",)) -> Optional[CaseResult]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    if len(outs) != len(refs):
        return CaseResult(False, "mismatch", message=f"returned {len(outs)} outputs, expected {len(refs)}")
    for i, (o, r) in enumerate(zip(outs, refs)):
        nm = names[i] if i < len(names) else f"output {i}"
        if not isinstance(o, torch.Tensor):
            return CaseResult(False, "mismatch", message=f"{nm}: not a tensor ({type(o).__name__})")
        if o.shape != r.shape or o.dtype != r.dtype:
            return CaseResult(False, "mismatch", message=f"{nm}: got {tuple(o.shape)} {o.dtype}, "
                                                          f"expected {tuple(r.shape)} {r.dtype}")
    return None


def _arith_result(res: tol.ArithResult, what: str) -> CaseResult:
    if res.ok:
        return CaseResult(True, "ok", ratio=res.ratio, bound=res.bound)
    return CaseResult(False, "mismatch", ratio=res.ratio, bound=res.bound,
                      message=f"{what}: error/tolerance {res.ratio:.3g} > 1; {res.detail}")


def _explain(ops, op: str, *args) -> Optional[str]:
    try:
        return str(ops.dispatch.explain(op, *args))
    except Exception:
        return None


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, not contiguous (a strided view into a wider buffer)."""
    wide = torch.stack([t, t], dim=-1)
    return wide[..., 0]


def _x_gather(case: Case, rows) -> Case:
    """Tokens are the rows of the first argument (x); everything else is shared."""
    return Case(case.op, case.structure, (case.args[0][rows].contiguous(),) + tuple(case.args[1:]),
                dict(case.kwargs))

