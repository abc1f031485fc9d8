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
NOT COVERED, never counted as passing. Adding an op is adding one entry to `REGISTRY`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from hypothesis import strategies as st

from reference.fused_experts import fused_experts as ref_fused_experts
from reference.gate_gemm import fused_gate_gemm as ref_fused_gate_gemm
from reference.gate_gemm import skinny_gemm as ref_skinny_gemm
from reference.gate_gemm import unquantized_gemm as ref_unquantized_gemm
from reference.moe import moe_forward as ref_moe_forward
from reference.permute import PermuteScratch as RefPermuteScratch
from reference.permute import permute as ref_permute
from reference.permute import unpermute as ref_unpermute
from reference.quant import quantize_fp8_block, quantize_mxfp4
from reference.route import route as ref_route
from reference.route import selection_keys
from reference.router_gemm import router_gemm as ref_router_gemm
from reference.validate import (BIAS_METHODS, GROUPED_METHODS, NORM_EPS_DEFAULT, ROUTE_METHODS, capacity,
                                check_route)

from . import distributions as D
from . import tolerance as tol

ALL_DISTS = D.ROUTING_DISTS
NO_NAN = tuple(d for d in ALL_DISTS if d != "nan_inf")
DTYPE_NAMES = tuple(D.DTYPES)
METHODS = ROUTE_METHODS          # SPEC 1's six and SPEC 6's grouped_softmax, softmax_bias
# renormalize is drawn unset (the method's default), False or True; llama4 refuses True
RENORM_DRAWS = (None, False, True)
# route's scaling applies to every method (SPEC 6); 0.375 and 2.5 are exact in f32, 0.1 is not
SCALINGS = (1.0, 2.5, 0.5, 0.375, 0.1)
# norm_eps for the methods that take one: unset (the default), LFM2's 1e-6, 0 (allowed: the
# plain sum) and 0.75, large enough that the floor max(sum, eps) binds and (sum + eps) moves
NORM_EPS_DRAWS = (None, 1e-6, 0.0, 0.75)
QUANTS = ("bf16", "fp8_block", "mxfp4")
ACTIVATIONS = ("silu", "swiglu_oai")
DISPATCHES = ("auto", "tiny", "blocked", "global", "per_block")


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

    def to_json(self) -> dict:
        return {"ok": self.ok, "kind": self.kind, "ratio": self.ratio, "flips": self.flips,
                "flip_gaps": self.flip_gaps[:20], "message": self.message[:2000], "path": self.path,
                "served": None if self.served is None else str(self.served)}


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
        return CaseResult(True, "ok", ratio=res.ratio)
    return CaseResult(False, "mismatch", ratio=res.ratio,
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


# ============================================================================ route
def _draw_groups_and_k(p: Picker, method: str, E: int, dist: str, k_cap: int):
    """(n_group, topk_group, K) valid for the method and E: groups that divide E into groups
    of >= 2 (grouped methods only), K <= k_cap, <= the experts the groups leave, <= the
    experts empty_experts leaves, and 1 for llama4."""
    n_group = topk_group = 1
    if method in GROUPED_METHODS:
        divisors = [d for d in range(1, 33) if E % d == 0 and E // d >= 2]
        n_group = p("n_group", st.sampled_from(divisors))
        topk_group = p("topk_group", st.integers(1, n_group))
    kmax = min(E, k_cap)
    if method in GROUPED_METHODS:
        kmax = min(kmax, topk_group * (E // n_group))
    if dist == "empty_experts":
        kmax = min(kmax, E - E // 2)
    return n_group, topk_group, (1 if method == "llama4" else p("K", st.integers(1, kmax)))


def _draw_route(draw, dist, fixed):
    p = Picker(draw, fixed)
    method = p("method", st.sampled_from(METHODS))
    E = p("E", st.sampled_from((1, 2, 3, 4, 6, 8, 16, 32, 60, 64, 128, 256, 384, 512, 896, 1024, 2048)))
    if method in GROUPED_METHODS:
        E = max(2, min(E, 1024))
    n_group, topk_group, K = _draw_groups_and_k(p, method, E, dist, 32)
    s = {"method": method, "E": E, "K": K, "n_group": n_group, "topk_group": topk_group,
         "renormalize": p("renormalize", st.sampled_from(RENORM_DRAWS if method != "llama4" else (None, False))),
         "scaling": p("scaling", st.sampled_from(SCALINGS)),
         "norm_eps": p("norm_eps", st.sampled_from(NORM_EPS_DRAWS)) if method in NORM_EPS_DEFAULT else None,
         "logits_dtype": p("logits_dtype", st.sampled_from(DTYPE_NAMES)),
         "bias_dtype": p("bias_dtype", st.sampled_from(("float32", "bfloat16"))),
         "T": _tokens(p)}
    s["T"] = _cap_tokens(s["T"], E, 300_000)
    s.update(_common(p, dist))
    return s


def _make_route(s: dict) -> Case:
    T, E, K = s["T"], s["E"], s["K"]
    dt = D.DTYPES[s["logits_dtype"]]
    params = D.dist_params(s["dist"], s["dchoice"])
    g = D.generator(s["seed"])
    logits = D.routing_logits(s["dist"], T, E, K, g, params, dt).to(dt)
    if s["dist"] == "ep_shard":   # the local experts' logits: a strided view with holes
        wide = torch.zeros(T, E + 5, dtype=dt)
        wide[:, 2:E + 2] = logits
        logits = wide[:, 2:E + 2]
    kwargs = {"n_group": s["n_group"], "topk_group": s["topk_group"], "scaling": s["scaling"],
              "renormalize": s["renormalize"], "bias": None}
    if s.get("norm_eps") is not None:            # (older saved cases have no norm_eps)
        kwargs["norm_eps"] = s["norm_eps"]
    if s["method"] in BIAS_METHODS:
        bdt = D.DTYPES[s["bias_dtype"]]
        # softmax_bias adds the bias to p ~ 1/E: a bias of that size competes with p
        size = 0.5 if s["method"] != "softmax_bias" else 0.5 / E
        if s["dist"] == "exact_ties":
            bias = torch.tensor((0.0, 0.25 if s["method"] != "softmax_bias" else 0.25 / 1024))[
                torch.randint(2, (E,), generator=g)]
        elif s["dist"] == "near_ties":
            bias = torch.zeros(E)
        else:
            bias = torch.randn(E, generator=g) * size
        kwargs["bias"] = bias.to(bdt)
    return Case("route", s, (logits, K, s["method"]), kwargs)


def _tie_classes(x: torch.Tensor, bias: Optional[torch.Tensor], method: str) -> torch.Tensor:
    """Per (t, e) an id of the inputs that determine the key: equal id <=> identical inputs
    (so the keys must be identical and the lower index must win). f32 bits, -0.0 as +0.0,
    every NaN one class; with a bias, the (x, bias) pair."""
    v = x.to(torch.float32) + 0.0
    v = torch.where(torch.isnan(v), torch.full_like(v, float("nan")), v)
    cls = v.view(torch.int32).to(torch.int64)
    if method in BIAS_METHODS and bias is not None:
        b = (bias.to(torch.float32) + 0.0).view(torch.int32).to(torch.int64)
        cls = cls * (2 ** 32) + (b & 0xFFFFFFFF).unsqueeze(0)
    return cls


F32_TINY = 2.0 ** -126


def key_allowance(x32: torch.Tensor, bias: Optional[torch.Tensor], method: str, keys: torch.Tensor) -> torch.Tensor:
    """How far (absolute, f64 [T, E]) an f32 implementation's key may be from the exact key.

    Raw-logit keys (topk_softmax, llama4) are not computed: 0, so any reordering of
    different logits is an error. Computed keys get at least 2 ulps each (a near tie is a
    gap of at most 4 ulps between two keys, SPEC's "a few ulps"), and more where an f32
    computation is necessarily less exact:
      softmax p = exp(x - max) / sum: the f32 difference x - max carries ~|x - max| / 2 ulps
        of relative error into exp, so (2 + |x - max|) ulps of p; p + bias: that plus 1 ulp
        of the sum;
      sigmoid s: 2 ulps of s; s + bias: 2 ulps of s plus 1 ulp of the sum (with a negative
        bias the sum can be much smaller than s);
      a subnormal exact key may be flushed to zero (FTZ): + 2^-126.
    """
    if method in ("topk_softmax", "llama4"):
        return torch.zeros(keys.shape, dtype=torch.float64)
    k64 = keys.to(torch.float64)
    if method in ("softmax_topk", "grouped_softmax", "softmax_bias"):
        xf = x32.to(torch.float64)
        m = torch.where(torch.isfinite(xf), xf, torch.full_like(xf, -math.inf)).amax(dim=-1, keepdim=True)
        spread = (xf - m).abs().nan_to_num(0.0, 0.0, 0.0)
        p = torch.softmax(xf, dim=-1).to(torch.float32).to(torch.float64)
        d = tol.ulp(p.nan_to_num(0.0), torch.float32) * (2.0 + spread)
        if method in BIAS_METHODS:   # p + bias: one more rounding, of the sum
            d = d + tol.ulp(k64.nan_to_num(0.0, 0.0, 0.0), torch.float32)
        base = p
    else:
        s = torch.sigmoid(x32.to(torch.float64)).to(torch.float32).to(torch.float64)
        d = 2.0 * tol.ulp(s.nan_to_num(0.0), torch.float32)
        if method in BIAS_METHODS:
            d = d + tol.ulp(k64.nan_to_num(0.0, 0.0, 0.0), torch.float32)
        base = s
    d = d + torch.where(base.abs() < F32_TINY, F32_TINY, 0.0)
    d = torch.maximum(d, 2.0 * tol.ulp(k64.nan_to_num(0.0, 0.0, 0.0), torch.float32))
    return torch.where(torch.isfinite(k64), d, torch.zeros_like(d))


def _dominates(ka, kb, ca, cb, ia, ib, da, db):
    """Vectorized 'a must rank above b' (broadcasting tensors): NaN above everything, exact
    input ties by index, otherwise a key larger by more than both keys' allowances."""
    a_nan, b_nan = torch.isnan(ka), torch.isnan(kb)
    tie = (ca == cb) | (a_nan & b_nan)
    by_nan = a_nan & ~b_nan
    ka64, kb64 = ka.to(torch.float64), kb.to(torch.float64)
    gap = torch.where(ka64 == kb64, torch.zeros_like(ka64), ka64 - kb64)      # inf - inf: equal
    larger = (~a_nan) & (~b_nan) & (ka64 > kb64) & (gap > da + db)
    return by_nan | (tie & (ia < ib)) | (~tie & larger)


def admissible_topk(keys: torch.Tensor, classes: torch.Tensor, delta: torch.Tensor,
                    sel: torch.Tensor) -> Tuple[bool, str]:
    """Is `sel` ([K] int64) an acceptable top-K of one row of keys, given each key's
    allowance `delta`? Acceptable: K distinct valid experts; no slot is dominated by a later
    slot, and no unselected expert dominates a selected one (`_dominates`)."""
    E = keys.shape[0]
    K = sel.shape[0]
    if bool(((sel < 0) | (sel >= E)).any()) or len(set(sel.tolist())) != K:
        return False, f"ids {sel.tolist()} are not {K} distinct experts in [0, {E})"
    ks, cs, ds = keys[sel], classes[sel], delta[sel]
    if K > 1:
        dom = _dominates(ks.unsqueeze(0), ks.unsqueeze(1), cs.unsqueeze(0), cs.unsqueeze(1),
                         sel.unsqueeze(0), sel.unsqueeze(1), ds.unsqueeze(0), ds.unsqueeze(1))   # [i, j]: j above i
        bad = dom & torch.triu(torch.ones(K, K, dtype=torch.bool), diagonal=1)
        if bool(bad.any()):
            i, j = (int(v) for v in torch.nonzero(bad)[0])
            return False, (f"slot {j} (expert {int(sel[j])}, key {float(ks[j]):.9g}) must rank above slot {i} "
                           f"(expert {int(sel[i])}, key {float(ks[i]):.9g})")
    mask = torch.ones(E, dtype=torch.bool)
    mask[sel] = False
    others = torch.nonzero(mask).reshape(-1)
    if others.numel():
        dom = _dominates(keys[others].unsqueeze(1), ks.unsqueeze(0), classes[others].unsqueeze(1),
                         cs.unsqueeze(0), others.unsqueeze(1), sel.unsqueeze(0),
                         delta[others].unsqueeze(1), ds.unsqueeze(0))
        if bool(dom.any()):
            o, j = (int(v) for v in torch.nonzero(dom)[0])
            e = int(others[o])
            return False, (f"unselected expert {e} (key {float(keys[e]):.9g}) must rank above selected "
                           f"expert {int(sel[j])} (key {float(ks[j]):.9g})")
    return True, ""


def _grouped_admissible(keys0, d0, classes, sel, n_group, topk_group, top2=True):
    """Grouped routing with near ties among group scores (top2: a group's score is the sum of
    its two largest keys, DeepSeek-V3; else its largest key, DeepSeek-V2's
    group_limited_greedy). A group is *surely kept* when it
    dominates at least n_group - topk_group others, *possibly kept* when fewer than
    topk_group groups dominate it. The groups sel uses must be possibly kept and, with the
    surely kept ones, at most topk_group; sel must then be an acceptable top-K of the keys
    masked to (used + surely kept) groups (experts of the other possibly kept groups may
    legitimately have been dropped with their group)."""
    from reference.route import _topk_total_order
    E = keys0.shape[0]
    gsz = E // n_group
    grouped = keys0.reshape(n_group, gsz)
    best = _topk_total_order(grouped, 2) + (torch.arange(n_group) * gsz).unsqueeze(1)     # expert ids
    c2 = classes[best]
    if top2:
        gscore = keys0[best[:, 0]] + keys0[best[:, 1]]                                     # f32 add
        gd = d0[best[:, 0]] + d0[best[:, 1]] + tol.ulp(gscore.to(torch.float64).nan_to_num(0.0, 0.0, 0.0),
                                                        torch.float32)
        gcls = c2[:, 0] * 1_000_003 + c2[:, 1]
    else:
        gscore, gd, gcls = keys0[best[:, 0]], d0[best[:, 0]].clone(), c2[:, 0]
    gd = torch.where(torch.isfinite(gscore), gd, torch.zeros_like(gd))
    gi = torch.arange(n_group)
    dom = _dominates(gscore.unsqueeze(1), gscore.unsqueeze(0), gcls.unsqueeze(1), gcls.unsqueeze(0),
                     gi.unsqueeze(1), gi.unsqueeze(0), gd.unsqueeze(1), gd.unsqueeze(0))   # [a, b]: a above b
    surely = dom.sum(dim=1) >= n_group - topk_group
    possibly = dom.sum(dim=0) < topk_group
    used = torch.zeros(n_group, dtype=torch.bool)
    used[torch.unique(sel // gsz)] = True
    if bool((used & ~possibly).any()):
        g = int(torch.nonzero(used & ~possibly)[0])
        return False, f"ids use group {g}, which at least topk_group = {topk_group} groups rank above"
    if int((used | surely).sum()) > topk_group:
        return False, (f"ids use groups {torch.nonzero(used).reshape(-1).tolist()} besides the surely kept "
                       f"{torch.nonzero(surely).reshape(-1).tolist()}: more than topk_group = {topk_group}")
    keep = (used | surely).repeat_interleave(gsz)
    masked = torch.where(keep, keys0, torch.full_like(keys0, float("-inf")))
    mcls = torch.where(keep, classes, torch.full_like(classes, -(2 ** 62)))
    return admissible_topk(masked, mcls, torch.where(keep, d0, torch.zeros_like(d0)), sel)


def route_flip_check(logits32, bias, method, n_group, topk_group, ids_ref, ids_opt):
    """Rows where ids differ: (flip rows, gaps in ulps, first failure message or None)."""
    keys = selection_keys(logits32, method, bias, n_group, topk_group)
    classes = _tie_classes(logits32, bias, method)
    diff = torch.nonzero((ids_ref != ids_opt).any(dim=1)).reshape(-1).tolist()
    flips, gaps = [], []
    if not diff:
        return flips, gaps, None
    if method in GROUPED_METHODS:
        # the unmasked keys: s + bias (grouped_sigmoid_bias) or p (grouped_softmax)
        keys0 = selection_keys(logits32, "sigmoid_bias" if method == "grouped_sigmoid_bias" else "softmax_topk", bias)
        delta = key_allowance(logits32, bias, method, keys0)
    else:
        delta = key_allowance(logits32, bias, method, keys)
    for t in diff:
        sel = ids_opt[t].to(torch.int64)
        if method in GROUPED_METHODS:
            ok, why = _grouped_admissible(keys0[t], delta[t], classes[t], sel, n_group, topk_group,
                                          top2=method == "grouped_sigmoid_bias")
        else:
            ok, why = admissible_topk(keys[t], classes[t], delta[t], sel)
        if not ok:
            return flips, gaps, (f"token {t}: ids {ids_opt[t].tolist()} vs reference {ids_ref[t].tolist()}: "
                                 f"not a near tie: {why}")
        r = ids_ref[t].to(torch.int64)
        d = ids_ref[t] != ids_opt[t]
        kk = keys0 if method in GROUPED_METHODS else keys
        gap = tol.ulp_distance_f32(kk[t][r[d]], kk[t][sel[d].clamp(0, kk.shape[1] - 1)])
        gaps.append(float(gap.max()) if gap.numel() else 0.0)
        flips.append(t)
    return flips, gaps, None


def _compare_route(out, ref, case: Case, ctx: Ctx) -> CaseResult:
    bad = _shape_check(out, ref, ("weights", "ids"))
    if bad:
        return bad
    (w_o, ids_o), (w_r, ids_r) = out, ref
    logits, K, method = case.args
    kw = case.kwargs
    bias, scaling = kw.get("bias"), kw.get("scaling", 1.0)
    # renormalize and norm_eps as the call resolves them (None: the method's defaults)
    renorm, eps = check_route(logits, K, method, bias, kw.get("n_group", 1), kw.get("topk_group", 1), scaling,
                              kw.get("renormalize"), kw.get("norm_eps"))
    x32 = logits.to(torch.float32)
    flips, gaps, why = route_flip_check(x32, bias, method, kw.get("n_group", 1), kw.get("topk_group", 1), ids_r, ids_o)
    if why:
        return CaseResult(False, "mismatch", flips=len(flips), flip_gaps=gaps, message="ids: " + why)
    w_exp = w_r.clone()
    ids_for = ids_r.clone()
    if flips:
        ft = torch.tensor(flips)
        w_exp[ft] = tol.route_weights_for_ids(x32[ft], ids_o[ft], method, bias=bias, scaling=scaling,
                                              renormalize=renorm, norm_eps=eps, exact=True)
        ids_for[ft] = ids_o[ft]
    w_eager = tol.route_weights_for_ids(x32, ids_for, method, bias=bias, scaling=scaling, renormalize=renorm,
                                        norm_eps=eps, exact=False)
    scale, key = tol.route_weight_scale(x32, ids_for, method, scaling=scaling, renormalize=renorm, norm_eps=eps)
    res = tol.route_weight_check(w_o, w_exp, w_eager, key=key, scale=scale)
    r = _arith_result(res, "weights")
    r.flips, r.flip_gaps = len(flips), gaps
    return r


def _route_gather(case: Case, rows) -> Case:
    logits, K, method = case.args
    return Case(case.op, case.structure, (logits[rows].contiguous(), K, method), dict(case.kwargs))


def _route_variants(case: Case):
    """route's kernel and seed 004's "before" selection (optimized.route.route_variant with
    selection="serial": one scalar pass on the CPU, warp 0 alone on CUDA), which must give
    the same bits; checked with batch invariance (route's kernel is held to the reference)."""
    return [("", case), ("selection=serial", Case(case.op, case.structure, case.args,
                                                  dict(case.kwargs, selection="serial")))]


def _call_route(fn, case: Case, device):
    """fn(logits, top_k, method, **kw); a `selection` variant runs route_variant when fn is
    optimized.route itself (a mutant or a peer has no before kernel: it runs as it is)."""
    args, kwargs = to_device((case.args, case.kwargs), device)
    selection = kwargs.pop("selection", None)
    ops = import_optimized()
    if selection is not None and ops is not None and fn is getattr(ops, "route", None):
        from optimized.route import route_variant
        return route_variant(*args, selection=selection, **kwargs)
    return fn(*args, **kwargs)


def _route_errors(seed: int) -> CallSpec:
    g = D.generator(seed)
    logits = torch.randn(5, 8, generator=g)
    # (float64 logits are the reference's exact mode, refused by optimized: an explicit case)
    f = (torch.int32, torch.int64)
    params = {"logits": logits, "top_k": 2, "method": "softmax_topk", "bias": None, "n_group": 1,
              "topk_group": 1, "scaling": 1.0, "renormalize": False, "norm_eps": None}
    bias8 = torch.randn(8, generator=g)
    explicit = [
        ("top_k = 0", {"top_k": 0}, ("top_k",)),
        ("K > E", {"top_k": 9}, ("top_k",)),
        ("K > 32", {"logits": torch.randn(2, 64, generator=g), "top_k": 33}, ("top_k",)),
        ("unknown method", {"method": "softmax"}, ("method",)),
        ("llama4 with K = 2", {"method": "llama4"}, ("top_k",)),
        ("sigmoid_bias without bias", {"method": "sigmoid_bias"}, ("bias",)),
        ("bias with softmax_topk", {"bias": bias8}, ("bias",)),
        ("bias of the wrong length", {"method": "sigmoid_bias", "bias": torch.randn(7, generator=g)}, ("bias",)),
        ("bias f16", {"method": "sigmoid_bias", "bias": bias8.half()}, ("bias",)),
        ("bias on meta", {"method": "sigmoid_bias", "bias": bias8.to("meta")}, ("bias",)),
        ("n_group not dividing E", {"method": "grouped_sigmoid_bias", "bias": bias8, "n_group": 3}, ("n_group",)),
        ("topk_group > n_group", {"method": "grouped_sigmoid_bias", "bias": bias8, "n_group": 2, "topk_group": 3},
         ("topk_group",)),
        ("grouped K > topk_group * E / n_group", {"method": "grouped_sigmoid_bias", "bias": bias8, "n_group": 4,
                                                   "topk_group": 1, "top_k": 3}, ("top_k",)),
        ("n_group with softmax_topk", {"n_group": 2}, ("n_group",)),
        ("scaling NaN", {"method": "sigmoid_bias", "bias": bias8, "scaling": float("nan")}, ("scaling",)),
        ("renormalize with llama4", {"method": "llama4", "top_k": 1, "renormalize": True}, ("renormalize",)),
        ("renormalize an int", {"renormalize": 1}, ("renormalize",)),
        ("norm_eps with softmax_topk", {"norm_eps": 1e-6}, ("norm_eps",)),
        ("norm_eps with grouped_softmax", {"method": "grouped_softmax", "n_group": 2, "norm_eps": 1e-6},
         ("norm_eps",)),
        ("norm_eps negative", {"method": "sigmoid_bias", "bias": bias8, "norm_eps": -1e-6}, ("norm_eps",)),
        ("norm_eps NaN", {"method": "softmax_bias", "bias": bias8, "norm_eps": float("nan")}, ("norm_eps",)),
        ("softmax_bias without bias", {"method": "softmax_bias"}, ("bias",)),
        ("grouped_softmax with bias", {"method": "grouped_softmax", "bias": bias8, "n_group": 2}, ("bias",)),
        ("grouped_softmax K > topk_group * E / n_group", {"method": "grouped_softmax", "n_group": 4,
                                                          "topk_group": 1, "top_k": 3}, ("top_k",)),
        ("scaling inf with softmax_topk", {"scaling": float("inf")}, ("scaling",)),
        # the reference (exact mode) and optimized both name the float64 logits
        ("logits float64 with an f32 bias", {"logits": logits.double(), "method": "sigmoid_bias", "bias": bias8},
         ("logits",)),
        ("E > 2048", {"logits": torch.randn(1, 2049, generator=g)}, ("logits",)),
        ("logits 1-D", {"logits": torch.randn(8, generator=g)}, ("logits",)),
        ("logits int", {"logits": torch.zeros(5, 8, dtype=torch.int32)}, ("logits",)),
        ("top_k not an int", {"top_k": 2.0}, ("top_k",)),
    ]
    rules = {"logits": TensorRule(f, device_ref=True)}
    return CallSpec(params, ("logits", "top_k", "method"), rules, explicit)


# ============================================================================ router_gemm
_H_CHOICES = (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 127, 128, 129, 256, 511, 512, 1024, 2048, 3072)
_N_CHOICES = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 32, 33, 64, 127, 128, 129, 256, 257, 512, 513)


def _draw_router_gemm(draw, dist, fixed):
    p = Picker(draw, fixed)
    s = {"E": p("E", st.sampled_from(_N_CHOICES)), "H": p("H", st.sampled_from(_H_CHOICES)),
         "x_dtype": p("x_dtype", st.sampled_from(DTYPE_NAMES)), "T": _tokens(p)}
    s["T"] = _cap_tokens(s["T"], s["E"] * s["H"], 3e7)
    s.update(_common(p, dist))
    return s


def _make_router_gemm(s):
    x, w, _ = D.make_gemm_operands(s["dist"], s["T"], s["E"], s["H"], s["seed"],
                                   D.dist_params(s["dist"], s["dchoice"]), D.DTYPES[s["x_dtype"]], torch.float32)
    return Case("router_gemm", s, (x, w), {})


def _compare_router_gemm(out, ref, case, ctx):
    bad = _shape_check(out, ref)
    if bad:
        return bad
    x, w = case.args
    res = tol.arith_check(out, ref, tol.eager_router_gemm(x, w), tol.exact_linear(x, w), tol.magnitude_linear(x, w),
                          torch.float32, n_floor=tol.gemm_floor(x.shape[1]))
    r = _arith_result(res, "logits")
    r.path = _explain(ctx.ops, "router_gemm", x, w)
    return r


def _x_gather(case: Case, rows) -> Case:
    """Tokens are the rows of the first argument (x); everything else is shared."""
    return Case(case.op, case.structure, (case.args[0][rows].contiguous(),) + tuple(case.args[1:]),
                dict(case.kwargs))


def _router_gemm_errors(seed):
    g = D.generator(seed)
    x = torch.randn(4, 16, generator=g).bfloat16()
    w = torch.randn(6, 16, generator=g)
    explicit = [
        ("weight bf16", {"weight": w.bfloat16()}, ("weight",)),
        ("H mismatch", {"weight": torch.randn(6, 15, generator=g)}, ("weight",)),
        ("no experts", {"weight": torch.randn(0, 16, generator=g)}, ("weight",)),
        ("H = 0", {"x": torch.randn(4, 0).bfloat16(), "weight": torch.randn(6, 0)}, ("x", "weight")),
        ("x int", {"x": torch.ones(4, 16, dtype=torch.int32)}, ("x",)),
        ("x 3-D", {"x": x.unsqueeze(0)}, ("x",)),
    ]
    rules = {"x": TensorRule((torch.float64, torch.int32), dims=(1,), dim_names=("x", "weight"), device_ref=True),
             "weight": TensorRule((torch.float64, torch.bfloat16, torch.int32), dims=(1,), dim_names=("weight",))}
    return CallSpec({"x": x, "weight": w}, ("x", "weight"), rules, explicit)


# ============================================================================ GEMMs
_K_CHOICES = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 128, 129, 256, 512, 513, 1024, 2048)


def _draw_linear(skinny: bool):
    def draw_fn(draw, dist, fixed):
        p = Picker(draw, fixed)
        s = {"N": p("N", st.sampled_from(_N_CHOICES)), "Kd": p("Kd", st.sampled_from(_K_CHOICES)),
             "dtype": p("dtype", st.sampled_from(DTYPE_NAMES)), "bias": bool(p("bias", st.booleans())),
             "T": p("T", st.integers(0, 8)) if skinny else _tokens(p)}
        s["T"] = _cap_tokens(s["T"], s["N"] * s["Kd"], 2e7)
        s.update(_common(p, dist))
        return s
    return draw_fn


def _make_linear(op):
    def make(s):
        dt = D.DTYPES[s["dtype"]]
        x, w, b = D.make_gemm_operands(s["dist"], s["T"], s["N"], s["Kd"], s["seed"],
                                       D.dist_params(s["dist"], s["dchoice"]), dt, dt, bias=s["bias"])
        return Case(op, s, (x, w), {"bias": b})
    return make


def _compare_linear(op):
    def compare(out, ref, case, ctx):
        bad = _shape_check(out, ref)
        if bad:
            return bad
        x, w = case.args
        b = case.kwargs.get("bias")
        res = tol.arith_check(out, ref, tol.eager_linear(x, w, b), tol.exact_linear(x, w, b),
                              tol.magnitude_linear(x, w, b), x.dtype, n_floor=tol.gemm_floor(x.shape[1]))
        r = _arith_result(res, "output")
        r.path = _explain(ctx.ops, op, x, w, b)
        return r
    return compare


def _linear_errors(op: str, skinny: bool):
    def spec(seed):
        g = D.generator(seed)
        x = torch.randn(3, 16, generator=g).bfloat16()
        w = torch.randn(5, 16, generator=g).bfloat16()
        b = torch.randn(5, generator=g).bfloat16()
        explicit = [
            ("weight dtype differs from x", {"weight": w.float()}, ("weight",)),
            ("K mismatch", {"weight": w[:, :15].contiguous()}, ("weight",)),
            ("bias wrong length", {"bias": b[:4].contiguous()}, ("bias",)),
            ("bias dtype differs", {"bias": b.float()}, ("bias",)),
            ("no output features", {"weight": w[:0]}, ("weight",)),
            ("K = 0", {"x": x[:, :0], "weight": w[:, :0]}, ("x", "weight")),
            ("x f64", {"x": x.double(), "weight": w.double(), "bias": b.double()}, ("x",)),
        ]
        if skinny:
            explicit.append(("T = 9 > 8", {"x": torch.randn(9, 16, generator=g).bfloat16()}, ("x",)))
        rules = {"x": TensorRule((torch.float64, torch.int32), dims=(1,), dim_names=("x", "weight"), device_ref=True),
                 "weight": TensorRule((torch.float64, torch.float32, torch.int16), dims=(1,), dim_names=("weight",)),
                 "bias": TensorRule((torch.float64, torch.float32), dims=(0,), dim_names=("bias",))}
        return CallSpec({"x": x, "weight": w, "bias": b}, ("x", "weight"), rules, explicit)
    return spec


def _draw_fused_gate(draw, dist, fixed):
    p = Picker(draw, fixed)
    s = {"E": p("E", st.sampled_from((1, 2, 3, 8, 16, 60, 64, 128, 256, 512))), "S": p("S", st.sampled_from((1, 1, 2, 3))),
         "H": p("H", st.sampled_from(_K_CHOICES)), "dtype": p("dtype", st.sampled_from(DTYPE_NAMES)), "T": _tokens(p),
         "module": bool(p("module", st.sampled_from((False, False, False, True))))}
    s["T"] = _cap_tokens(s["T"], (s["E"] + s["S"]) * s["H"], 2e7)
    s.update(_common(p, dist))
    return s


def _make_fused_gate(s):
    dt = D.DTYPES[s["dtype"]]
    x, w, _ = D.make_gemm_operands(s["dist"], s["T"], s["E"] + s["S"], s["H"], s["seed"],
                                   D.dist_params(s["dist"], s["dchoice"]), dt, dt)
    return Case("fused_gate_gemm", s, (x, w[:s["E"]].contiguous(), w[s["E"]:].contiguous()), {})


def _call_fused_gate(fn, case: Case, device):
    """fn(x, router_weight, shared_gate_weight); with structure["module"] (and when fn is
    optimized.fused_gate_gemm itself) through optimized.FusedGate instead: the module is
    built on other weights, run once (caching the stacked weight), then both weights are
    reloaded in place with the case's values, as a checkpoint load does, and run again.
    A stale cached weight shows as a mismatch."""
    x, rw, sw = to_device(case.args, device)
    ops = import_optimized()
    cls = getattr(ops, "FusedGate", None) if ops is not None else None
    if case.structure.get("module") and cls is not None and fn is getattr(ops, "fused_gate_gemm", None):
        g = D.generator(case.structure.get("seed", 0) + 9)
        old_rw = torch.randn(tuple(rw.shape), generator=g).to(rw.dtype).to(device)
        old_sw = torch.randn(tuple(sw.shape), generator=g).to(sw.dtype).to(device)
        gate = cls(old_rw, old_sw)
        gate(x)
        with torch.no_grad():
            old_rw.copy_(rw)
            old_sw.copy_(sw)
        return gate(x)
    return fn(x, rw, sw)


def _compare_fused_gate(out, ref, case, ctx):
    bad = _shape_check(out, ref, ("router_logits", "shared_gate_logits"))
    if bad:
        return bad
    x, rw, sw = case.args
    w = torch.cat([rw, sw])
    y = torch.cat([out[0], out[1]], dim=1)
    g = torch.cat([ref[0], ref[1]], dim=1)
    res = tol.arith_check(y, g, tol.eager_linear(x, w), tol.exact_linear(x, w), tol.magnitude_linear(x, w), x.dtype,
                          n_floor=tol.gemm_floor(x.shape[1]))
    r = _arith_result(res, "[router_logits | shared_gate_logits]")
    r.path = _explain(ctx.ops, "unquantized_gemm", x, w, None)
    return r


def _fused_gate_errors(seed):
    g = D.generator(seed)
    x = torch.randn(3, 16, generator=g)
    rw = torch.randn(8, 16, generator=g)
    sw = torch.randn(1, 16, generator=g)
    explicit = [
        ("router_weight dtype differs", {"router_weight": rw.bfloat16()}, ("router_weight",)),
        ("shared_gate_weight H mismatch", {"shared_gate_weight": torch.randn(1, 15, generator=g)},
         ("shared_gate_weight",)),
        ("no shared gate rows", {"shared_gate_weight": sw[:0]}, ("shared_gate_weight",)),
        ("H = 0", {"x": x[:, :0], "router_weight": rw[:, :0], "shared_gate_weight": sw[:, :0]}, ("x",)),
    ]
    rules = {"x": TensorRule((torch.float64, torch.int32), dims=(1,), dim_names=("x", "router_weight",
                                                                              "shared_gate_weight"), device_ref=True),
             "router_weight": TensorRule((torch.float64, torch.int32), dims=(1,), dim_names=("router_weight",)),
             "shared_gate_weight": TensorRule((torch.float64, torch.int32), dims=(1,),
                                              dim_names=("shared_gate_weight",))}
    return CallSpec({"x": x, "router_weight": rw, "shared_gate_weight": sw},
                    ("x", "router_weight", "shared_gate_weight"), rules, explicit)


# ============================================================================ permute
_ALIGNS = (1, 1, 2, 3, 4, 8, 16, 32, 64, 128)


def _draw_permute(draw, dist, fixed, unpermute=False):
    p = Picker(draw, fixed)
    E = p("E", st.sampled_from((1, 2, 3, 4, 7, 8, 16, 32, 64, 128, 256)))
    kmax = min(E, 16)
    if dist == "empty_experts":
        kmax = min(kmax, E - E // 2)
    hs = (1, 3, 8, 16, 33, 64, 128, 256) if unpermute else (0, 1, 3, 8, 16, 33, 64, 128, 256)
    s = {"E": E, "K": p("K", st.integers(1, kmax)), "H": p("H", st.sampled_from(hs)),
         "dtype": p("dtype", st.sampled_from(DTYPE_NAMES)), "align": p("align", st.sampled_from(_ALIGNS)),
         "T": _tokens(p)}
    if not unpermute:
        s["ids_dtype"] = p("ids_dtype", st.sampled_from(("int32", "int64")))
        s["scratch"] = bool(p("scratch", st.booleans()))
        s["extra_tokens"] = p("extra_tokens", st.sampled_from((0, 1, 5)))
    s["T"] = _cap_tokens(s["T"], s["K"] * max(1, s["H"]), 3e6)
    s.update(_common(p, dist))
    return s


def _permute_routing(s):
    r = D.make_routing(s["dist"], s["T"], s["E"], s["K"], s["seed"], D.dist_params(s["dist"], s["dchoice"]))
    return r


def _make_permute(s):
    r = _permute_routing(s)
    g = D.generator(s["seed"] + 1)
    hidden = torch.randn(s["T"], s["H"], generator=g).to(D.DTYPES[s["dtype"]])
    ids = r.ids.to(torch.int64 if s["ids_dtype"] == "int64" else torch.int32)
    kwargs = {"expert_map": r.expert_map, "n_local_experts": r.n_local if r.expert_map is not None else None,
              "align": s["align"]}
    return Case("permute", s, (hidden, ids, s["E"]), kwargs)


def _poison_scratch(scratch) -> None:
    if scratch.hidden.numel():
        scratch.hidden.fill_(float("nan"))
    scratch.offsets.fill_(0x5A5A5A5A5A)
    scratch.src_row.fill_(0x5A5A5A5A)
    scratch.dst_pos.fill_(0x5A5A5A5A)


def _call_permute(fn, case: Case, device):
    args, kwargs = to_device((case.args, case.kwargs), device)
    s = case.structure
    if s.get("scratch"):
        ops = import_optimized()
        # optimized's scratch class when optimized has permute (a mutant wraps that one)
        cls = None
        if ops is not None and callable(getattr(ops, "permute", None)):
            cls = getattr(ops, "PermuteScratch", None)
        cls = cls or RefPermuteScratch
        hidden, ids, n_experts = args
        n_local = kwargs["n_local_experts"] if kwargs["expert_map"] is not None else None
        scratch = cls(s["T"] + s["extra_tokens"], ids.shape[1], n_experts, hidden.shape[1], hidden.dtype, device,
                      n_local_experts=n_local, align=kwargs["align"])
        _poison_scratch(scratch)
        kwargs = dict(kwargs, scratch=scratch)
        out = fn(*args, **kwargs)
        names = ("offsets", "hidden", "src_row", "dst_pos")
        try:
            not_views = [nm for nm, o in zip(names, tuple(out)) if isinstance(o, torch.Tensor) and o.numel()
                         and _storage_of(o) != _storage_of(getattr(scratch, nm))]
        except TypeError:
            not_views = []
        return out, not_views
    return fn(*args, **kwargs), None


def _storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _compare_permute(out_pair, ref, case, ctx):
    out, scratch = out_pair       # scratch: names of outputs that are not scratch views
    names = ("offsets", "hidden", "src_row", "dst_pos")
    try:
        out = tuple(out)
    except TypeError:
        return CaseResult(False, "mismatch", message=f"permute returned {type(out).__name__}, not a Permuted")
    bad = _shape_check(out, tuple(ref), names)
    if bad:
        return bad
    for nm, o, r in zip(names, out, ref):
        if not _bits_equal(o, r):
            diff = (o != r) if not o.is_floating_point() else ~((o == r) | (o.isnan() & r.isnan()))
            if o.is_floating_point():
                diff = diff | (o.view(torch.int16 if o.element_size() == 2 else torch.int32)
                               != r.view(torch.int16 if r.element_size() == 2 else torch.int32))
            where = torch.nonzero(diff)[:3].tolist() if diff.numel() else []
            return CaseResult(False, "mismatch", message=f"{nm} differs from the reference (exact op) at {where}; "
                                                         f"got {o.reshape(-1)[:12].tolist()}..., "
                                                         f"expected {r.reshape(-1)[:12].tolist()}...")
    if scratch is not None and scratch:
        return CaseResult(False, "aliasing", message=f"with a scratch, {', '.join(scratch)} not views of the "
                                                     f"scratch's buffers (SPEC: permute allocates nothing)")
    return CaseResult(True, "ok")


def _permute_errors(seed):
    g = D.generator(seed)
    hidden = torch.randn(4, 8, generator=g)
    ids = torch.randint(0, 6, (4, 2), generator=g, dtype=torch.int32)
    emap = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)
    sc = RefPermuteScratch(4, 2, 6, 8, torch.float32, "cpu")
    sc_small = RefPermuteScratch(3, 2, 6, 8, torch.float32, "cpu")
    sc_k = RefPermuteScratch(4, 3, 6, 8, torch.float32, "cpu")
    sc_dt = RefPermuteScratch(4, 2, 6, 8, torch.bfloat16, "cpu")
    sc_al = RefPermuteScratch(4, 2, 6, 8, torch.float32, "cpu", align=4)
    bad_ids = ids.clone()
    bad_ids[1, 1] = 6
    neg_ids = ids.clone()
    neg_ids[0, 0] = -2
    explicit = [
        ("id = n_experts", {"ids": bad_ids}, ("ids",)),
        ("id = -2", {"ids": neg_ids}, ("ids",)),
        ("n_experts = 0", {"n_experts": 0}, ("n_experts",)),
        ("align = 0", {"align": 0}, ("align",)),
        ("ids rows != T", {"ids": ids[:3]}, ("ids",)),
        ("ids with no columns", {"ids": ids[:, :0]}, ("ids",)),
        ("expert_map int64", {"expert_map": emap.long(), "n_local_experts": 4}, ("expert_map",)),
        ("expert_map without n_local_experts", {"expert_map": emap}, ("n_local_experts",)),
        ("expert_map entry >= n_local_experts", {"expert_map": emap, "n_local_experts": 3}, ("expert_map",)),
        ("expert_map wrong length", {"expert_map": emap[:5], "n_local_experts": 4}, ("expert_map",)),
        ("n_local_experts without a map", {"n_local_experts": 3}, ("n_local_experts",)),
        ("scratch for fewer tokens", {"scratch": sc_small}, ("scratch",)),
        ("scratch for another K", {"scratch": sc_k}, ("scratch",)),
        ("scratch of another dtype", {"scratch": sc_dt}, ("scratch",)),
        ("scratch of another align", {"scratch": sc_al}, ("scratch",)),
        ("scratch not a PermuteScratch", {"scratch": {"hidden": sc.hidden}}, ("scratch",)),
        ("hidden f64", {"hidden": hidden.double()}, ("hidden",)),
    ]
    rules = {"hidden": TensorRule((torch.float64, torch.int32), device_ref=True),
             "ids": TensorRule((torch.float32, torch.int16, torch.uint8), dims=(0,), dim_names=("ids",), index=(-1, 6))}
    params = {"hidden": hidden, "ids": ids, "n_experts": 6, "expert_map": None, "n_local_experts": None,
              "align": 1, "scratch": None}
    return CallSpec(params, ("hidden", "ids", "n_experts"), rules, explicit)


# ============================================================================ unpermute
def _make_unpermute(s):
    r = _permute_routing(s)
    T, K, H = s["T"], s["K"], s["H"]
    dt = D.DTYPES[s["dtype"]]
    ph = torch.zeros(T, 0)
    pm = ref_permute(ph, r.ids, s["E"], expert_map=r.expert_map,
                     n_local_experts=r.n_local if r.expert_map is not None else None, align=s["align"])
    cap = capacity(T, K, r.n_local if r.expert_map is not None else s["E"], s["align"])
    g = D.generator(s["seed"] + 2)
    expert_out = (torch.randn(cap, H, generator=g) * 4).to(dt)
    used = torch.zeros(cap, dtype=torch.bool)
    valid = pm.dst_pos[pm.dst_pos >= 0].long()
    used[valid] = True
    expert_out[~used] = float("nan")              # poison: rows nobody references
    weights = torch.randn(T, K, generator=g)
    if s["dist"] == "exact_ties":
        weights = torch.randint(-2, 3, (T, K), generator=g).float() * 0.5
    return Case("unpermute", s, (expert_out, weights, pm.dst_pos.clone()), {})


def _compare_unpermute(out, ref, case, ctx):
    bad = _shape_check(out, ref)
    if bad:
        return bad
    if _bits_equal(out, ref):
        return CaseResult(True, "ok")
    o64, r64 = out.double(), ref.double()
    diff = ~((o64 == r64) | (o64.isnan() & r64.isnan()))
    idx = torch.nonzero(diff)
    first = idx[0].tolist() if idx.numel() else None
    msg = (f"not bitwise equal to the reference (SPEC fixes unpermute's f32 order: increasing j, no FMA); "
           f"{int(diff.sum())} elements differ, first at {first}")
    if first is not None:
        msg += f": got {float(o64[tuple(first)]):.9g}, expected {float(r64[tuple(first)]):.9g}"
    return CaseResult(False, "mismatch", message=msg)


def _unpermute_gather(case: Case, rows) -> Case:
    """Token t owns weights[t] and dst_pos[t*K:(t+1)*K]; expert_out is shared."""
    eo, w, dp = case.args
    K = w.shape[1]
    return Case(case.op, case.structure, (eo, w[rows].contiguous(), dp.view(-1, K)[rows].reshape(-1)), {})


def _unpermute_errors(seed):
    g = D.generator(seed)
    eo = torch.randn(8, 4, generator=g)
    w = torch.rand(3, 2, generator=g)
    dp = torch.tensor([0, 1, 2, -1, 3, 4], dtype=torch.int32)
    bad = dp.clone()
    bad[2] = 8
    neg = dp.clone()
    neg[0] = -2
    explicit = [
        ("dst_pos >= rows of expert_out", {"dst_pos": bad}, ("dst_pos",)),
        ("dst_pos = -2", {"dst_pos": neg}, ("dst_pos",)),
        ("dst_pos wrong length", {"dst_pos": dp[:5]}, ("dst_pos",)),
        ("dst_pos int64", {"dst_pos": dp.long()}, ("dst_pos",)),
        ("weights f16", {"weights": w.half()}, ("weights",)),
        ("weights 1-D", {"weights": w.reshape(-1)}, ("weights",)),
    ]
    rules = {"expert_out": TensorRule((torch.float64, torch.int32), device_ref=True),
             "weights": TensorRule((torch.float64, torch.bfloat16), dims=(1,), dim_names=("weights", "dst_pos")),
             "dst_pos": TensorRule((torch.int64, torch.float32), dims=(0,), dim_names=("dst_pos",), index=(-1, 8))}
    return CallSpec({"expert_out": eo, "weights": w, "dst_pos": dp}, ("expert_out", "weights", "dst_pos"),
                    rules, explicit)


# ============================================================================ fused_experts
_HI_MX = (32, 64, 96, 128, 160, 256, 384, 512)
_HI_ANY = (8, 24, 40, 100, 130, 200) + _HI_MX
_HI_BIG = (1024, 2048)


def _draw_experts_common(p: Picker, dist: str, max_e=64):
    quant = p("quant", st.sampled_from(QUANTS))
    sizes = _HI_MX if quant == "mxfp4" else _HI_ANY
    big = p("big", st.sampled_from((False,) * 24 + (True,)))
    H = p("H", st.sampled_from(_HI_BIG if big else sizes))
    I = p("I", st.sampled_from(sizes))
    E = p("E", st.sampled_from(tuple(e for e in (1, 2, 3, 4, 6, 8, 16, 32, 64) if e <= max_e)))
    return {"quant": quant, "H": H, "I": I, "E": E, "big": big,
            "activation": p("activation", st.sampled_from(ACTIVATIONS)),
            "dispatch": p("dispatch", st.sampled_from(DISPATCHES)),
            # SPEC 6: the router weight scales the expert input (Llama 4), a third of the cases
            "on_input": bool(p("on_input", st.sampled_from((False, False, True))))}


def _draw_fused_experts(draw, dist, fixed):
    p = Picker(draw, fixed)
    s = _draw_experts_common(p, dist)
    E = s["E"]
    s["E_global"] = E + p("E_extra", st.sampled_from((1, 3, 8))) if dist == "ep_shard" else E
    kmax = min(s["E_global"], 8)
    if dist == "empty_experts":
        kmax = min(kmax, s["E_global"] - s["E_global"] // 2)
    s["K"] = p("K", st.integers(1, kmax))
    s["bias"] = p("bias", st.sampled_from(("none", "none", "float32", "bfloat16")))
    s["T"] = _tokens(p)
    if s["E"] * 3 * s["H"] * s["I"] > 3e6:        # keep the weights (and their quantization) small
        s["E"] = max(1, int(3e6 // (3 * s["H"] * s["I"])))
        s["E_global"] = s["E"] + (s["E_global"] - E) if dist == "ep_shard" else s["E"]
        s["K"] = min(s["K"], s["E_global"] - (s["E_global"] // 2 if dist == "empty_experts" else 0))
    s["T"] = _cap_tokens(s["T"], s["K"] * 3 * s["H"] * s["I"], 1.5e8)
    s.update(_common(p, dist))
    return s


def make_expert_weights(s: dict, g: torch.Generator, E: int):
    """w13, w2 (+ scales, biases) of one format, from f32 weights with per-128-row-block
    magnitudes (so fp8 blocks get different scales and an off-by-one scale shows)."""
    H, I, quant = s["H"], s["I"], s["quant"]

    def weight(n, k):
        w = torch.randn(E, n, k, generator=g) / math.sqrt(k)
        nb = -(-n // 128)
        f = torch.exp2(torch.randint(-2, 3, (E, nb, 1), generator=g).float())
        f = f.repeat_interleave(128, dim=1)[:, :n]
        kb = -(-k // 128)
        fk = torch.exp2(torch.randint(-1, 2, (E, 1, kb), generator=g).float()).repeat_interleave(128, dim=2)[:, :, :k]
        return w * f * fk
    w13f, w2f = weight(2 * I, H), weight(H, I)
    kw = {}
    if quant == "bf16":
        w13, w2 = w13f.bfloat16(), w2f.bfloat16()
    elif quant == "fp8_block":
        w13, kw["w13_scale"] = quantize_fp8_block(w13f)
        w2, kw["w2_scale"] = quantize_fp8_block(w2f)
    else:
        w13, kw["w13_scale"] = quantize_mxfp4(w13f)
        w2, kw["w2_scale"] = quantize_mxfp4(w2f)
    if s.get("bias", "none") != "none":
        bdt = D.DTYPES[s["bias"]]
        kw["w13_bias"] = (torch.randn(E, 2 * I, generator=g) * 0.5).to(bdt)
        kw["w2_bias"] = (torch.randn(E, H, generator=g) * 0.5).to(bdt)
    return w13, w2, kw


def _expert_x(s, g, T, H):
    x = torch.randn(T, H, generator=g)
    if s["activation"] == "swiglu_oai" and T:
        big = torch.rand(T, generator=g) < 0.4     # h beyond the clamp limit for some tokens
        x[big] *= 8.0
    return x.bfloat16()


def _make_fused_experts(s):
    T, K = s["T"], s["K"]
    r = D.make_routing(s["dist"], T, s["E_global"], K, s["seed"], D.dist_params(s["dist"], s["dchoice"]) |
                       ({"n_local": s["E"]} if s["dist"] == "ep_shard" else {}))
    if s.get("on_input"):   # Llama 4's routing: sigmoid weights, not renormalized (not all 1.0 at K = 1)
        w_route, ids = ref_route(r.logits, K, "sigmoid_topk", renormalize=False)
    else:
        w_route, ids = ref_route(r.logits, K, "softmax_topk", renormalize=True)
    ids = r.local_ids if s["dist"] == "ep_shard" else ids
    g = D.generator(s["seed"] + 3)
    x = _expert_x(s, g, T, s["H"])
    w13, w2, kw = make_expert_weights(s, g, s["E"])
    kw.update(topk_weights=w_route.contiguous(), topk_ids=ids.to(torch.int32).contiguous(), quant=s["quant"],
              activation=s["activation"], dispatch=s["dispatch"])
    if s.get("on_input"):
        kw["apply_router_weight_on_input"] = True
    return Case("fused_experts", s, (x, w13, w2), kw)


def _fused_args(case: Case):
    x, w13, w2 = case.args
    kw = dict(case.kwargs)
    return x, w13, w2, kw.pop("topk_weights"), kw.pop("topk_ids"), kw


def _fused_check(y, g, x, w13, w2, tw, ti, kw, keep_ratios=False):
    eager, V, A, Fl = tol.fused_experts_baseline(x, w13, w2, tw, ti, **kw)
    res = tol.arith_check(y, g, eager, V, A, torch.bfloat16, n_floor=tol.gemm_floor(w2.shape[2] * (
        2 if kw.get("quant") == "mxfp4" else 1)), extra=Fl, keep_ratios=keep_ratios)
    return res, (eager, V, A, Fl)


def _compare_fused_experts(out, ref, case, ctx):
    bad = _shape_check(out, ref)
    if bad:
        return bad
    x, w13, w2, tw, ti, kw = _fused_args(case)
    res, _ = _fused_check(out, ref, x, w13, w2, tw, ti, kw)
    return _arith_result(res, "output")


def _fused_gather(case: Case, rows) -> Case:
    kw = dict(case.kwargs)
    kw["topk_weights"] = kw["topk_weights"][rows].contiguous()
    kw["topk_ids"] = kw["topk_ids"][rows].contiguous()
    return Case(case.op, case.structure, (case.args[0][rows].contiguous(),) + tuple(case.args[1:]), kw)


def _fused_variants(case: Case):
    """The case under every dispatch policy: SPEC promises the same bits from each."""
    return [(f"dispatch={d}", Case(case.op, case.structure, case.args, dict(case.kwargs, dispatch=d)))
            for d in DISPATCHES]


def _fused_errors(seed):
    g = D.generator(seed)
    s = {"H": 64, "I": 32, "quant": "fp8_block", "bias": "none"}
    w13, w2, kw = make_expert_weights(s, g, 3)
    s_bf = dict(s, quant="bf16")
    w13b, w2b, _ = make_expert_weights(s_bf, g, 3)
    s_mx = dict(s, quant="mxfp4")
    w13m, w2m, kwm = make_expert_weights(s_mx, g, 3)
    x = torch.randn(4, 64, generator=g).bfloat16()
    tw = torch.rand(4, 2, generator=g)
    ti = torch.randint(0, 3, (4, 2), generator=g, dtype=torch.int32)
    bad = ti.clone()
    bad[0, 0] = 3
    params = {"x": x, "w13": w13, "w2": w2, "topk_weights": tw, "topk_ids": ti, "quant": "fp8_block",
              "w13_scale": kw["w13_scale"], "w2_scale": kw["w2_scale"], "w13_bias": None, "w2_bias": None,
              "activation": "silu", "alpha": 1.702, "limit": 7.0, "dispatch": "auto",
              "apply_router_weight_on_input": False}
    explicit = [
        ("apply_router_weight_on_input not a bool", {"apply_router_weight_on_input": 1},
         ("apply_router_weight_on_input",)),
        ("apply_router_weight_on_input a string", {"apply_router_weight_on_input": "True"},
         ("apply_router_weight_on_input",)),
        ("unknown quant", {"quant": "int4"}, ("quant",)),
        ("unknown activation", {"activation": "gelu"}, ("activation",)),
        ("unknown dispatch", {"dispatch": "fastest"}, ("dispatch",)),
        ("fp8 without w13_scale", {"w13_scale": None}, ("w13_scale",)),
        ("bf16 weights with fp8 quant", {"w13": w13b, "w2": w2b}, ("w13",)),
        ("scale given for bf16", {"quant": "bf16", "w13": w13b, "w2": w2b}, ("w13_scale",)),
        ("w13 not contiguous", {"w13": _noncontig(w13)}, ("w13",)),
        ("w2_scale not contiguous", {"w2_scale": _noncontig(kw["w2_scale"])}, ("w2_scale",)),
        ("topk_ids = E", {"topk_ids": bad}, ("topk_ids",)),
        ("topk_ids int64", {"topk_ids": ti.long()}, ("topk_ids",)),
        ("topk_weights rows != T", {"topk_weights": tw[:3]}, ("topk_weights",)),
        ("topk_ids K != topk_weights K", {"topk_ids": ti[:, :1].contiguous()}, ("topk_ids",)),
        ("x f32", {"x": x.float()}, ("x",)),
        ("mxfp4 with H not a multiple of 32", {"quant": "mxfp4", "x": torch.randn(4, 48, generator=g).bfloat16(),
                                               "w13": w13m[:, :, :24].contiguous(), "w2": w2m,
                                               "w13_scale": kwm["w13_scale"], "w2_scale": kwm["w2_scale"]},
         ("x", "w13")),
        ("alpha inf", {"alpha": float("inf")}, ("alpha",)),
        ("w13_bias wrong shape", {"w13_bias": torch.zeros(3, 63)}, ("w13_bias",)),
        ("w2 I mismatch", {"w2": w2[:, :, :16].contiguous()}, ("w2",)),
    ]
    # float64 x is not a bad dtype for the reference: it is its exact mode (SPEC 6, docs/families.md)
    rules = {"x": TensorRule((torch.float32, torch.float16), dims=(1,), dim_names=("x", "w13", "w2"), device_ref=True),
             "w13": TensorRule((torch.bfloat16, torch.float32), dims=(2,), dim_names=("w13",), contiguous=True),
             "w2": TensorRule((torch.bfloat16, torch.float32), dims=(1, 2), dim_names=("w2",), contiguous=True),
             "topk_weights": TensorRule((torch.float64, torch.bfloat16), dims=(1,),
                                        dim_names=("topk_weights", "topk_ids")),
             "topk_ids": TensorRule((torch.int64, torch.float32), dims=(1,), dim_names=("topk_ids",), index=(-1, 3)),
             "w13_scale": TensorRule((torch.float64, torch.bfloat16), dims=(1, 2), dim_names=("w13_scale",),
                                     contiguous=True),
             "w2_scale": TensorRule((torch.float64, torch.bfloat16), dims=(1, 2), dim_names=("w2_scale",),
                                    contiguous=True)}
    return CallSpec(params, ("x", "w13", "w2", "topk_weights", "topk_ids"), rules, explicit)


# ============================================================================ moe_forward
def _draw_moe(draw, dist, fixed):
    p = Picker(draw, fixed)
    s = _draw_experts_common(p, dist, max_e=64)
    method = p("method", st.sampled_from(METHODS))
    E = max(2, s["E"])
    n_group, topk_group, K = _draw_groups_and_k(p, method, E, dist, 8)
    s.update({"E": E, "method": method, "n_group": n_group, "topk_group": topk_group, "K": K,
              "renormalize": p("renormalize", st.sampled_from(RENORM_DRAWS if method != "llama4" else (None, False))),
              "scaling": p("scaling", st.sampled_from((1.0, 2.5))),
              "bias": "none", "T": _tokens(p)})
    if s["E"] * 3 * s["H"] * s["I"] > 3e6:
        s["big"], s["H"] = False, min(s["H"], 512)
        s["E"] = max(2, min(s["E"], int(3e6 // (3 * s["H"] * s["I"]))))
        if method in GROUPED_METHODS and s["E"] % n_group:
            s["n_group"] = s["topk_group"] = 1
        s["K"] = max(1, min(s["K"], s["E"] - (s["E"] // 2 if dist == "empty_experts" else 0),
                            s["topk_group"] * (s["E"] // s["n_group"]) if method in GROUPED_METHODS else 99))
    s["T"] = _cap_tokens(s["T"], s["K"] * 3 * s["H"] * s["I"] + s["E"] * s["H"], 1.5e8)
    s.update(_common(p, dist))
    return s


def skew_router(x: torch.Tensor, W: torch.Tensor, dist: str, params: dict, g: torch.Generator,
                K: int) -> torch.Tensor:
    """Make the routing of tokens x [T, H] through router W [E, H] follow `dist`; modifies x
    in place, returns W (replaced for 'extreme').

    Feature 0 is a constant 1 and feature 1 a per-token flag: the router weight's columns
    0 and 1 then act as per-expert logit offsets, which is how the routing skew is made."""
    T, H = x.shape
    E = W.shape[0]
    if H >= 2 and T:
        x[:, 0] = 1.0
        x[:, 1] = 0.0
    if H >= 2:
        if dist == "zipf":
            ranks = torch.randperm(E, generator=g).float() + 1
            W[:, 0] = -params.get("s", 1.2) * torch.log(ranks) * 2.0
        elif dist == "hot_expert":
            hot = int(torch.randint(E, (1,), generator=g))
            n_hot = int(round(params.get("p", 0.9) * T))
            x[torch.randperm(T, generator=g)[:n_hot], 1] = 1.0
            W[hot, 1] = 30.0
        elif dist == "all_to_one":
            W[torch.randperm(E, generator=g)[:K], 0] = 30.0
        elif dist == "empty_experts":
            W[torch.randperm(E, generator=g)[:min(E // 2, E - K)], 0] = -60.0
        elif dist == "exact_ties":
            W[1::2] = W[0:(E // 2) * 2:2]
        elif dist == "near_ties":
            W[1::2] = W[0:(E // 2) * 2:2]
            W[1::2, 2 % H] = D.ulp_steps(W[1::2, 2 % H], torch.ones_like(W[1::2, 2 % H], dtype=torch.int64))
        elif dist == "extreme":
            W = W * 2.0 ** 12
    return W


def _make_moe(s):
    T, E, H, K = s["T"], s["E"], s["H"], s["K"]
    g = D.generator(s["seed"])
    params = D.dist_params(s["dist"], s["dchoice"])
    x = torch.randn(T, H, generator=g)
    if s["activation"] == "swiglu_oai" and T:
        x[torch.rand(T, generator=g) < 0.4] *= 8.0
    W = torch.randn(E, H, generator=g) / math.sqrt(H) * 2.0
    W = skew_router(x, W, s["dist"], params, g, K)
    dist = s["dist"]
    xb = x.bfloat16()
    if dist == "ep_shard" and T:
        wide = torch.zeros(2 * T, H + 2, dtype=torch.bfloat16)
        wide[0::2, 1:H + 1] = xb
        xb = wide[0::2, 1:H + 1]
    w13, w2, kw = make_expert_weights(s, g, E)
    if s["method"] in BIAS_METHODS:
        kw["bias"] = torch.randn(E, generator=g) * (0.3 if s["method"] != "softmax_bias" else 0.3 / E)
    kw.update(top_k=K, method=s["method"], n_group=s["n_group"], topk_group=s["topk_group"],
              scaling=s["scaling"], renormalize=s["renormalize"], quant=s["quant"],
              activation=s["activation"], dispatch=s["dispatch"])
    if s.get("on_input"):
        kw["apply_router_weight_on_input"] = True
    return Case("moe_forward", s, (xb, W, w13, w2), kw)


def _moe_opt(ops):
    fn = getattr(ops, "moe_forward", None)
    if callable(fn):
        return fn
    if all(callable(getattr(ops, n, None)) for n in ("router_gemm", "route", "fused_experts")):
        def composed(*args, **kwargs):
            return ref_moe_forward(*args, ops=ops, **kwargs)
        composed.__name__ = "moe_forward(ops=optimized)"
        return composed
    return None


_ROUTE_KW = ("bias", "n_group", "topk_group", "scaling", "renormalize", "norm_eps")
_FUSED_KW = ("quant", "w13_scale", "w2_scale", "w13_bias", "w2_bias", "activation", "alpha", "limit", "dispatch",
             "apply_router_weight_on_input")


def _moe_parts(case: Case):
    x, W, w13, w2 = case.args
    kw = case.kwargs
    rkw = {k: kw[k] for k in _ROUTE_KW if k in kw}
    fkw = {k: kw[k] for k in _FUSED_KW if k in kw}
    return x, W, w13, w2, kw["top_k"], kw["method"], rkw, fkw


def _compare_moe(out, ref, case, ctx):
    """The output against the reference layer, token by token, except for tokens the
    optimized pipeline routed differently (other ids, or weights more than 16 ulps off: a
    legitimately different logit can move a sigmoid_bias weight a lot when s is tiny next
    to the 1e-20 in its denominator) or that are over the tolerance: those
    are judged stage by stage (the layer is router_gemm -> route -> fused_experts). Their
    optimized logits must pass router_gemm's rule, the optimized routing of those logits
    must pass route's rule (near-tie flips allowed, exact ties never), and their output must
    pass fused_experts' rule against the reference MLP applied to that routing. Tokens whose
    experts changed are counted as near-tie flips when route itself flipped a near tie (the
    reference routing of the optimized logits agrees with the reference), else as reroutes
    (the logits' tolerated error changed the selection). (The optimized stages are rerun
    on the whole batch, as moe_forward ran them: a dispatcher may choose by T.)"""
    bad = _shape_check(out, ref)
    if bad:
        return bad
    x, W, w13, w2, K, method, rkw, fkw = _moe_parts(case)
    logits = ref_router_gemm(x, W)
    w_r, ids_r = ref_route(logits, K, method, **rkw)
    res, _ = _fused_check(out, ref, x, w13, w2, w_r, ids_r, fkw, keep_ratios=True)
    ops = ctx.ops
    rg = getattr(ops, "router_gemm", None) if ops is not None else None
    rt = getattr(ops, "route", None) if ops is not None else None
    rg = rg if callable(rg) else ref_router_gemm
    rt = rt if callable(rt) else ref_route
    try:
        lo_all = rg(to_device(x, ctx.device), to_device(W, ctx.device))
        w_a, ids_a = to_cpu(rt(lo_all, K, method, **to_device(rkw, ctx.device)))
        lo_all = to_cpu(lo_all)
    except Exception as e:
        if res.ok:
            return CaseResult(True, "ok", ratio=res.ratio)
        return _arith_result(res, f"output (and the optimized routing raised {type(e).__name__}: {e})")
    moved_mask = (ids_a != ids_r).any(dim=1) if ids_r.numel() else torch.zeros(0, dtype=torch.bool)
    w_diff = (w_a.double() - w_r.double()).abs() > 16 * tol.ulp(w_r.double().nan_to_num(0.0), torch.float32)
    judge = moved_mask | (res.ratios > 1.0).any(dim=1) | w_diff.any(dim=1)
    if not bool(judge.any()):
        return CaseResult(True, "ok", ratio=res.ratio)
    tt = torch.nonzero(judge).reshape(-1)
    xs, lo, w_a, ids_a = x[tt], lo_all[tt], w_a[tt], ids_a[tt]
    stage = _compare_router_gemm(lo, logits[tt], Case("router_gemm", {}, (xs, W), {}), ctx)
    if not stage.ok:
        return _arith_result(res, f"output (the optimized router logits of tokens {tt[:5].tolist()} fail "
                                  f"router_gemm's rule: {stage.message[:300]})")
    stage = _compare_route((w_a, ids_a), ref_route(lo, K, method, **rkw),
                           Case("route", {}, (lo, K, method), dict(rkw)), ctx)
    if not stage.ok:
        return _arith_result(res, f"output (the optimized routing of tokens {tt[:5].tolist()} fails route's rule: "
                                  f"{stage.message[:300]})")
    ws, ids_s = w_a.contiguous(), ids_a.contiguous()
    g_alt = ref_fused_experts(xs, w13, w2, ws, ids_s, **fkw)
    res2, _ = _fused_check(out[tt], g_alt, xs, w13, w2, ws, ids_s, fkw)
    if not res2.ok:
        return _arith_result(res2, f"output of tokens {tt[:5].tolist()} (judged against the reference MLP with "
                                   f"the optimized routing)")
    rest = res.ratios[~judge]
    ratio = max(float(rest.max()) if rest.numel() else 0.0, res2.ratio)
    # A moved token is a near-tie flip of route when the reference routing of the optimized
    # logits still picks the reference's experts (the gap is measured on those logits' keys);
    # otherwise the logits themselves (within router_gemm's rule) changed the selection: a
    # reroute, counted apart.
    _, ids_on_opt = ref_route(lo, K, method, **rkw)
    moved, gaps, rerouted = [], [], []
    for i, t in enumerate(tt.tolist()):
        if not bool(moved_mask[t]):
            continue
        if not torch.equal(ids_on_opt[i], ids_r[t]):
            rerouted.append(t)
            continue
        moved.append(t)
        keys = selection_keys(lo[i:i + 1], method, rkw.get("bias"), rkw.get("n_group", 1),
                              rkw.get("topk_group", 1))[0]
        d = ids_a[i] != ids_r[t]
        g = tol.ulp_distance_f32(keys[ids_r[t][d].long()], keys[ids_a[i][d].long()])
        gaps.append(float(g.max()) if g.numel() else 0.0)
    return CaseResult(True, "ok", ratio=ratio, flips=len(moved), flip_gaps=gaps, reroutes=len(rerouted),
                      message=f"tokens {tt[:10].tolist()} judged stage by stage; near-tie flips {moved[:10]}, "
                              f"rerouted by their logits {rerouted[:10]}")


def _moe_errors(seed):
    g = D.generator(seed)
    s = {"H": 64, "I": 32, "quant": "bf16", "bias": "none"}
    w13, w2, _ = make_expert_weights(s, g, 4)
    x = torch.randn(3, 64, generator=g).bfloat16()
    W = torch.randn(4, 64, generator=g)
    params = {"x": x, "router_weight": W, "w13": w13, "w2": w2, "top_k": 2, "method": "softmax_topk",
              "quant": "bf16"}
    explicit = [
        ("router_weight E != w13 E", {"router_weight": W[:3]}, ("router_weight",)),
        ("top_k > E", {"top_k": 5}, ("top_k",)),
        ("unknown method", {"method": "top1"}, ("method",)),
        ("unknown quant", {"quant": "fp4"}, ("quant",)),
        ("x f32", {"x": x.float()}, ("x",)),
        ("router_weight bf16", {"router_weight": W.bfloat16()}, ("weight", "router_weight")),
    ]
    # float64 x is not a bad dtype for the reference: it is its exact mode (SPEC 6, docs/families.md)
    rules = {"x": TensorRule((torch.float16, torch.int32), device_ref=True),
             "router_weight": TensorRule((torch.float64, torch.int32), dims=(1,),
                                         dim_names=("weight", "router_weight"), aliases=("weight",)),
             "w13": TensorRule((torch.float32, torch.int8), dims=(2,), dim_names=("w13",), contiguous=True),
             "w2": TensorRule((torch.float32, torch.int8), dims=(1,), dim_names=("w2",), contiguous=True)}
    return CallSpec(params, ("x", "router_weight", "w13", "w2"), rules, explicit)


# ============================================================================ the registry
REGISTRY: Dict[str, OpInfo] = {}


def register(info: OpInfo) -> OpInfo:
    REGISTRY[info.name] = info
    return info


register(OpInfo("route", ref_route, _draw_route, _make_route, _compare_route, _route_errors,
                dists=ALL_DISTS, token_gather=_route_gather, invariant_always=("cpu", "cuda"), weight=1.0,
                variants=_route_variants, call=_call_route,
                notes="ids exact (near-tie flips counted), weights within 8 f32 ulps + 4x eager; "
                      "seed 004's serial selection bit for bit with route (batch-invariance cases)"))
register(OpInfo("permute", ref_permute, _draw_permute, _make_permute, _compare_permute, _permute_errors,
                dists=NO_NAN, call=_call_permute, weight=0.8,
                notes="every output exact; scratch poisoned and aliasing checked"))
register(OpInfo("unpermute", ref_unpermute, lambda d, dist, f: _draw_permute(d, dist, f, unpermute=True),
                _make_unpermute, _compare_unpermute, _unpermute_errors, dists=NO_NAN,
                token_gather=_unpermute_gather,
                invariant_always=("cpu", "cuda"), weight=0.8, notes="bitwise (SPEC's f32 order)"))
register(OpInfo("router_gemm", ref_router_gemm, _draw_router_gemm, _make_router_gemm, _compare_router_gemm,
                _router_gemm_errors, dists=NO_NAN, token_gather=_x_gather, weight=1.0))
register(OpInfo("skinny_gemm", ref_skinny_gemm, _draw_linear(True), _make_linear("skinny_gemm"),
                _compare_linear("skinny_gemm"), _linear_errors("skinny_gemm", True), dists=NO_NAN,
                token_gather=_x_gather, invariant_always=("cpu", "cuda"), max_tokens=8, weight=0.7))
register(OpInfo("unquantized_gemm", ref_unquantized_gemm, _draw_linear(False), _make_linear("unquantized_gemm"),
                _compare_linear("unquantized_gemm"), _linear_errors("unquantized_gemm", False), dists=NO_NAN,
                token_gather=_x_gather, weight=0.8))
register(OpInfo("fused_gate_gemm", ref_fused_gate_gemm, _draw_fused_gate, _make_fused_gate, _compare_fused_gate,
                _fused_gate_errors, dists=NO_NAN, token_gather=_x_gather, weight=0.7, call=_call_fused_gate,
                notes="also through optimized.FusedGate with an in-place weight reload (structure 'module')",
                error_ops=("fused_gate_gemm", "unquantized_gemm")))
register(OpInfo("fused_experts", ref_fused_experts, _draw_fused_experts, _make_fused_experts, _compare_fused_experts,
                _fused_errors, dists=NO_NAN, token_gather=_fused_gather,
                invariant_always=("cpu",), variants=_fused_variants, weight=2.0))
register(OpInfo("moe_forward", ref_moe_forward, _draw_moe, _make_moe, _compare_moe, _moe_errors, dists=NO_NAN,
                token_gather=_x_gather, resolve=_moe_opt, weight=1.5,
                error_ops=("moe_forward", "router_gemm", "route", "fused_experts"),
                notes="optimized.moe_forward, else reference.moe_forward(ops=optimized) once the three ops exist"))


def reference_output(entry: OpInfo, case: Case):
    return entry.reference(*case.args, **case.kwargs)
