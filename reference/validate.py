"""Input validation shared by `reference` and `optimized`: one place, so the two never drift.

Every public op calls its `check_<op>` function before it touches memory. A bad input
raises `ValueError` whose message starts with the op's name and names the argument:

    route: argument 'top_k' must satisfy 1 <= top_k <= min(E, 32) = 8, got 9

The C++ layer re-checks what its kernels rely on with TORCH_CHECK (RuntimeError), so a
direct `torch.ops.moelab.*` call cannot read or write out of bounds either.

Decisions where SPEC.md is silent are written next to the check that enforces them and
collected in docs/decisions.md.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The reference's exact mode (docs/families.md): float64 in, nothing rounded, float64 out.
EXACT_FLOAT_DTYPES = FLOAT_DTYPES + (torch.float64,)
INDEX_DTYPES = (torch.int32, torch.int64)

ROUTE_METHODS = (
    "softmax_topk", "topk_softmax", "sigmoid_topk", "sigmoid_bias", "grouped_sigmoid_bias", "llama4",
    "grouped_softmax", "softmax_bias",
)
BIAS_METHODS = ("sigmoid_bias", "grouped_sigmoid_bias", "softmax_bias")
GROUPED_METHODS = ("grouped_sigmoid_bias", "grouped_softmax")
# renormalize=None means the method's default (SPEC 6): on for the biased methods, off for the
# rest. llama4 (one sigmoid weight, K = 1) has nothing to renormalize and refuses True.
RENORMALIZE_METHODS = ("softmax_topk", "topk_softmax", "sigmoid_topk", "grouped_softmax") + BIAS_METHODS
RENORMALIZE_DEFAULT = {m: m in BIAS_METHODS for m in ROUTE_METHODS}
# The epsilon of each normalization, in the form each family writes it (SPEC 6):
# (sum + eps) for the biased sigmoid methods, max(sum, eps) for sigmoid_topk and softmax_bias.
# softmax_topk, topk_softmax and grouped_softmax divide by the plain sum; llama4 never divides.
NORM_EPS_DEFAULT = {"sigmoid_topk": 1e-20, "sigmoid_bias": 1e-20, "grouped_sigmoid_bias": 1e-20,
                    "softmax_bias": 1e-12}
MAX_TOP_K = 32
MAX_EXPERTS = 2048
MAX_EXPERTS_GROUPED = 1024
MAX_GROUPS = 32

QUANT_FORMATS = ("bf16", "fp8_block", "mxfp4")
ACTIVATIONS = ("silu", "swiglu_oai")
DISPATCH_POLICIES = ("auto", "tiny", "blocked", "global", "per_block")
SKINNY_MAX_T = 8
FP8_BLOCK = 128
MX_BLOCK = 32


def fail(op: str, arg: str, msg: str) -> None:
    raise ValueError(f"{op}: argument '{arg}' {msg}")


def _dt(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(op: str, name: str, t, *, ndim: Optional[int] = None,
                 dtypes: Optional[Sequence[torch.dtype]] = None,
                 shape: Optional[Sequence[Optional[int]]] = None,
                 device: Optional[torch.device] = None,
                 contiguous: bool = False) -> torch.Tensor:
    """Type, rank, dtype, shape (None = any size), device and contiguity of one tensor."""
    if not isinstance(t, torch.Tensor):
        fail(op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        fail(op, name, f"must be {ndim}-D, got {t.dim()}-D with shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(op, name, f"must have dtype {_dt(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None:
        want = tuple(shape)
        # (t.shape == want is the common, fast case; the element-wise test handles None = any)
        if t.shape != want and (len(want) != t.dim()
                                or any(w is not None and w != s for w, s in zip(want, t.shape))):
            shown = tuple("*" if w is None else w for w in want)
            fail(op, name, f"must have shape {shown}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        fail(op, name, f"must be on {device} like the other inputs, got {t.device}")
    if contiguous and not t.is_contiguous():
        fail(op, name, "must be contiguous")
    return t


def _exact_mismatch(op: str, name: str, other: str, t: torch.Tensor) -> None:
    """A float64 `name` selects the reference's exact mode, which takes float64 throughout: the
    message names the float64 argument, the one that is out of the ordinary."""
    fail(op, name, f"is float64 (the reference's exact mode, float64 throughout), but '{other}' is "
                   f"{str(t.dtype).replace('torch.', '')}; pass bf16/f32 inputs, or float64 everywhere")


def check_int(op: str, name: str, v, lo: Optional[int] = None, hi: Optional[int] = None,
              what: str = "") -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        fail(op, name, f"must be an int, got {type(v).__name__}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = what or f"{'' if lo is None else str(lo) + ' <= '}{name}{'' if hi is None else ' <= ' + str(hi)}"
        fail(op, name, f"must satisfy {rng}, got {v}")
    return v


def check_float(op: str, name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        fail(op, name, f"must be a finite float, got {v!r}")
    return float(v)


def check_choice(op: str, name: str, v, choices: Sequence[str]) -> str:
    if v not in choices:
        fail(op, name, f"must be one of {', '.join(choices)}; got {v!r}")
    return v


def check_index_range(op: str, name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    """Every element in [lo, hi). Reads the data (a host sync on a GPU).

    Skipped while torch.compile traces (a data-dependent check would break the graph); the
    C++ layer of every optimized op re-checks index ranges with TORCH_CHECK.
    """
    if t.numel() == 0 or torch.compiler.is_compiling():
        return
    mn, mx = int(t.min()), int(t.max())
    if mn < lo or mx >= hi:
        bad = mn if mn < lo else mx
        fail(op, name, f"holds {bad}, outside the valid range [{lo}, {hi})")


# --------------------------------------------------------------------------- route
def check_route(logits, top_k, method, bias, n_group, topk_group, scaling, renormalize,
                norm_eps=None, *, exact: bool = False):
    """Validates a route call (SPEC 1 and 6). Returns (renormalize, norm_eps) resolved: the
    method's defaults where the call passed None (norm_eps is 0.0 for methods without one).
    exact=True (the reference only) also accepts float64 logits and bias."""
    op = "route"
    check_tensor(op, "logits", logits, ndim=2, dtypes=EXACT_FLOAT_DTYPES if exact else FLOAT_DTYPES)
    E = logits.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        fail(op, "logits", f"must have 1 <= E <= {MAX_EXPERTS} columns (experts), got E = {E}")
    check_choice(op, "method", method, ROUTE_METHODS)
    k_max = min(E, MAX_TOP_K)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= k_max:
        check_int(op, "top_k", top_k, 1, k_max, what=f"1 <= top_k <= min(E, {MAX_TOP_K}) = {k_max}")
    if method == "llama4" and top_k != 1:
        fail(op, "top_k", f"must be 1 for method 'llama4', got {top_k}")
    if method in BIAS_METHODS:
        if bias is None:
            fail(op, "bias", f"is required by method '{method}'")
        if logits.dtype == torch.float64 and isinstance(bias, torch.Tensor) and bias.dtype != torch.float64:
            _exact_mismatch(op, "logits", "bias", bias)
        bias_dtypes = (torch.float64,) if logits.dtype == torch.float64 else (torch.float32, torch.bfloat16)
        check_tensor(op, "bias", bias, shape=(E,), dtypes=bias_dtypes, device=logits.device)
    elif bias is not None:
        fail(op, "bias", f"is only used by {', '.join(BIAS_METHODS)}; got a bias with method '{method}'")
    # (route runs once per MoE layer and decode step: plain in-range values skip the calls)
    if not (type(n_group) is int and type(topk_group) is int and n_group >= 1 and topk_group >= 1):
        check_int(op, "n_group", n_group, 1)
        check_int(op, "topk_group", topk_group, 1)
    if method in GROUPED_METHODS:
        if E > MAX_EXPERTS_GROUPED:
            fail(op, "logits", f"must have E <= {MAX_EXPERTS_GROUPED} for grouped routing, got E = {E}")
        check_int(op, "n_group", n_group, 1, MAX_GROUPS)
        if E % n_group != 0 or E // n_group < 2:
            fail(op, "n_group", f"must divide E = {E} into groups of at least 2 experts, got {n_group}")
        check_int(op, "topk_group", topk_group, 1, n_group)
        if top_k > topk_group * (E // n_group):
            fail(op, "top_k", f"must be <= topk_group * E / n_group = {topk_group * (E // n_group)}, "
                              f"got {top_k}")
    elif n_group != 1 or topk_group != 1:
        fail(op, "n_group" if n_group != 1 else "topk_group",
             f"only applies to {', '.join(GROUPED_METHODS)}; must be 1 with method '{method}'")
    if not (type(scaling) is float and math.isfinite(scaling)):
        check_float(op, "scaling", scaling)
    if renormalize is None:
        renormalize = RENORMALIZE_DEFAULT[method]
    elif not isinstance(renormalize, bool):
        fail(op, "renormalize", f"must be a bool or None, got {type(renormalize).__name__}")
    elif renormalize and method not in RENORMALIZE_METHODS:
        fail(op, "renormalize", f"only applies to {', '.join(RENORMALIZE_METHODS)}; "
                                f"method '{method}' has a single weight to normalize")
    default_eps = NORM_EPS_DEFAULT.get(method)
    if norm_eps is None:
        norm_eps = 0.0 if default_eps is None else default_eps
    else:
        if default_eps is None:
            fail(op, "norm_eps", f"only applies to {', '.join(NORM_EPS_DEFAULT)}; method '{method}' "
                                 "divides by the plain sum")
        norm_eps = check_float(op, "norm_eps", norm_eps)
        if norm_eps < 0.0:
            fail(op, "norm_eps", f"must be >= 0, got {norm_eps!r}")
    return renormalize, norm_eps


# ------------------------------------------------------------------------- permute
def check_ids(op: str, name: str, ids, T: int, K: Optional[int], n_experts: int, device,
              dtypes=INDEX_DTYPES, *, ranges: bool = True) -> None:
    """ranges=False skips the data-dependent range check (see check_permute)."""
    check_tensor(op, name, ids, ndim=2, dtypes=dtypes, shape=(T, K), device=device)
    if ranges:
        check_index_range(op, name, ids, -1, n_experts)


def check_expert_map(op: str, expert_map, n_experts: int, n_local_experts, device,
                     ranges: bool = True) -> int:
    """Returns E_loc. Without a map every expert is local."""
    if expert_map is None:
        if n_local_experts is not None and n_local_experts != n_experts:
            fail(op, "n_local_experts", f"must equal n_experts = {n_experts} without an expert_map, "
                                        f"got {n_local_experts}")
        return n_experts
    # Decision: with a map, n_local_experts must be given (inferring it would read the map,
    # a host sync on a GPU, and a map whose highest local id is unused would infer wrongly).
    if n_local_experts is None:
        fail(op, "n_local_experts", "is required when an expert_map is given")
    check_int(op, "n_local_experts", n_local_experts, 1)
    check_tensor(op, "expert_map", expert_map, ndim=1, dtypes=(torch.int32,), shape=(n_experts,),
                 device=device)
    if ranges:
        check_index_range(op, "expert_map", expert_map, -1, n_local_experts)
    return n_local_experts


def capacity(T: int, K: int, n_local_experts: int, align: int) -> int:
    """Rows of permute's `hidden`: every routed row plus the worst-case padding."""
    return T * K + n_local_experts * (align - 1)


def check_permute(hidden, ids, n_experts, expert_map, n_local_experts, align, *, ranges: bool = True) -> int:
    """Returns E_loc.

    ranges=False skips the data-dependent range checks of ids and expert_map (two reductions
    and a host read each): for a caller whose kernel checks them itself on its own pass over
    the data (optimized.permute, whose scratch path must allocate nothing); it re-runs this
    check with ranges=True to word the error when the kernel reports one.
    """
    op = "permute"
    check_tensor(op, "hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    check_int(op, "n_experts", n_experts, 1)
    check_tensor(op, "ids", ids, ndim=2, dtypes=INDEX_DTYPES)
    T = hidden.shape[0]
    if ids.shape[0] != T:
        fail(op, "ids", f"must have one row per token of hidden (T = {T}), got shape {tuple(ids.shape)}")
    if ids.shape[1] < 1:
        fail(op, "ids", "must have at least one column (top_k >= 1)")
    check_tensor(op, "ids", ids, device=hidden.device)   # rank, dtype and shape checked above
    if ranges:
        check_index_range(op, "ids", ids, -1, n_experts)
    check_int(op, "align", align, 1)
    return check_expert_map(op, expert_map, n_experts, n_local_experts, hidden.device, ranges=ranges)


def check_scratch_fits(scratch, hidden, ids, n_experts, n_local_experts, align) -> None:
    op = "permute"
    T, H = hidden.shape
    K = ids.shape[1]
    # This runs on every decode step of a scratch user: one short-circuit test first, and the
    # per-field walk (with its message) only when something does not fit.
    if (T <= scratch.max_tokens and scratch.top_k == K and scratch.n_experts == n_experts
            and scratch.n_local_experts == n_local_experts and scratch.hidden_size == H
            and scratch.dtype == hidden.dtype and scratch.align == align and scratch.device == hidden.device):
        return
    for field, got, ok in (
        ("max_tokens", T, T <= scratch.max_tokens),
        ("top_k", K, scratch.top_k == K),
        ("n_experts", n_experts, scratch.n_experts == n_experts),
        ("n_local_experts", n_local_experts, scratch.n_local_experts == n_local_experts),
        ("hidden_size", H, scratch.hidden_size == H),
        ("dtype", hidden.dtype, scratch.dtype == hidden.dtype),
        ("device", hidden.device, scratch.device == hidden.device),
        ("align", align, scratch.align == align),
    ):
        if not ok:
            want = (f"T = {T} <= max_tokens = {scratch.max_tokens}" if field == "max_tokens"
                    else f"{field} = {getattr(scratch, field)}")
            fail(op, "scratch", f"does not fit this call: it was built for {want}, the call has "
                                f"{field} = {got}")


def check_unpermute(expert_out, weights, dst_pos, *, ranges: bool = True) -> None:
    """ranges=False skips the range check of dst_pos (see check_permute)."""
    op = "unpermute"
    check_tensor(op, "expert_out", expert_out, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "weights", weights, ndim=2, dtypes=(torch.float32,), device=expert_out.device)
    T, K = weights.shape
    check_tensor(op, "dst_pos", dst_pos, ndim=1, dtypes=(torch.int32,), shape=(T * K,),
                 device=expert_out.device)
    if ranges:
        check_index_range(op, "dst_pos", dst_pos, -1, expert_out.shape[0])


# --------------------------------------------------------------------------- GEMMs
def check_router_gemm(x, weight, *, exact: bool = False) -> None:
    """exact=True (the reference only): float64 x with a float64 weight is accepted too."""
    op = "router_gemm"
    check_tensor(op, "x", x, ndim=2, dtypes=EXACT_FLOAT_DTYPES if exact else FLOAT_DTYPES)
    H = x.shape[1]
    if H < 1:
        fail(op, "x", "must have H >= 1 columns")
    if x.dtype == torch.float64 and isinstance(weight, torch.Tensor) and weight.dtype != torch.float64:
        _exact_mismatch(op, "x", "weight", weight)
    w_dtypes = (torch.float64,) if x.dtype == torch.float64 else (torch.float32,)
    check_tensor(op, "weight", weight, ndim=2, dtypes=w_dtypes, shape=(None, H), device=x.device)
    if weight.shape[0] < 1:
        fail(op, "weight", "must have E >= 1 rows")


def check_linear(op: str, x, weight, bias, max_t: Optional[int] = None) -> None:
    """x[T,K] @ weight[N,K].T + bias[N], one dtype for all three."""
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if max_t is not None and x.shape[0] > max_t:
        fail(op, "x", f"must have T <= {max_t} rows (a decode GEMM), got T = {x.shape[0]}")
    K = x.shape[1]
    if K < 1:
        fail(op, "x", "must have K >= 1 columns")
    check_tensor(op, "weight", weight, ndim=2, dtypes=(x.dtype,), shape=(None, K), device=x.device)
    if weight.shape[0] < 1:
        fail(op, "weight", "must have N >= 1 rows")
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=(x.dtype,), shape=(weight.shape[0],), device=x.device)


def check_skinny_gemm(x, weight, bias) -> None:
    check_linear("skinny_gemm", x, weight, bias, max_t=SKINNY_MAX_T)


def check_unquantized_gemm(x, weight, bias) -> None:
    check_linear("unquantized_gemm", x, weight, bias)


def check_fused_gate_gemm(x, router_weight, shared_gate_weight) -> None:
    op = "fused_gate_gemm"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    H = x.shape[1]
    if H < 1:
        # Without this the inner GEMM's check would fire and name unquantized_gemm, not this op.
        fail(op, "x", "must have H >= 1 columns")
    for name, w in (("router_weight", router_weight), ("shared_gate_weight", shared_gate_weight)):
        check_tensor(op, name, w, ndim=2, dtypes=(x.dtype,), shape=(None, H), device=x.device)
        if w.shape[0] < 1:
            fail(op, name, "must have at least one row")


# -------------------------------------------------------------------- fused_experts
def expert_weight_shapes(quant: str, E: int, H: int, I: int):
    """(w13, w2, w13_scale, w2_scale) shapes of one format, None where it has no scale."""
    cdiv = lambda a, b: -(-a // b)
    if quant == "bf16":
        return (E, 2 * I, H), (E, H, I), None, None
    if quant == "fp8_block":
        return ((E, 2 * I, H), (E, H, I),
                (E, cdiv(2 * I, FP8_BLOCK), cdiv(H, FP8_BLOCK)), (E, cdiv(H, FP8_BLOCK), cdiv(I, FP8_BLOCK)))
    return ((E, 2 * I, H // 2), (E, H, I // 2), (E, 2 * I, H // MX_BLOCK), (E, H, I // MX_BLOCK))


WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp8_block": torch.float8_e4m3fn, "mxfp4": torch.uint8}
SCALE_DTYPES = {"fp8_block": torch.float32, "mxfp4": torch.uint8}


def check_expert_weights(op: str, quant: str, w13, w2, w13_scale, w2_scale, device, H: Optional[int] = None,
                         *, exact: bool = False):
    """The expert weights and scales of one format (SPEC 5). H: the hidden size the caller
    knows from x (errors about it then name 'x'), or None to infer it from w13. exact=True:
    the reference's exact mode, float64 weights in the unquantized ('bf16') layout.
    Returns (E, H, I)."""
    wdt = torch.float64 if exact else WEIGHT_DTYPES[quant]
    if exact and quant != "bf16":
        fail(op, "quant", f"must be 'bf16' (the unquantized layout) with float64 x, got {quant!r}")
    check_tensor(op, "w13", w13, ndim=3, dtypes=(wdt,), device=device, contiguous=True)
    E, two_i = w13.shape[0], w13.shape[1]
    if E < 1 or two_i < 2 or two_i % 2:
        fail(op, "w13", f"must have shape (E, 2*I, ...) with E >= 1 and I >= 1, got {tuple(w13.shape)}")
    I = two_i // 2
    h_arg = "x"
    if H is None:
        H, h_arg = (2 * w13.shape[2] if quant == "mxfp4" else w13.shape[2]), "w13"
        if H < 1:
            fail(op, "w13", f"must have H >= 1, got shape {tuple(w13.shape)}")
    if quant == "mxfp4" and (H % MX_BLOCK or I % MX_BLOCK):
        fail(op, h_arg if H % MX_BLOCK else "w13",
             f"mxfp4 needs H and I to be multiples of {MX_BLOCK}, got H = {H}, I = {I}")
    s13, s2, sc13, sc2 = expert_weight_shapes(quant, E, H, I)
    check_tensor(op, "w13", w13, shape=s13)
    check_tensor(op, "w2", w2, ndim=3, dtypes=(wdt,), shape=s2, device=device, contiguous=True)
    for name, s, shp in (("w13_scale", w13_scale, sc13), ("w2_scale", w2_scale, sc2)):
        if shp is None:
            if s is not None:
                fail(op, name, f"must be None for quant '{quant}'")
        else:
            if s is None:
                fail(op, name, f"is required for quant '{quant}'")
            check_tensor(op, name, s, dtypes=(SCALE_DTYPES[quant],), shape=shp, device=device, contiguous=True)
    return E, H, I


def check_fused_experts(x, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale,
                        w13_bias, w2_bias, activation, alpha, limit, dispatch,
                        apply_router_weight_on_input=False, *, exact: bool = False, ranges: bool = True):
    """Returns (E, I) inferred from the weights. exact=True (the reference only) also accepts
    float64 x, which then needs float64 weights, biases and topk_weights (exact mode).
    ranges=False skips the range check of topk_ids (for a caller whose kernel checks it)."""
    op = "fused_experts"
    check_tensor(op, "x", x, ndim=2, dtypes=(torch.bfloat16, torch.float64) if exact else (torch.bfloat16,))
    T, H = x.shape
    dev = x.device
    f64 = x.dtype == torch.float64
    check_choice(op, "quant", quant, QUANT_FORMATS)
    check_choice(op, "activation", activation, ACTIVATIONS)
    check_choice(op, "dispatch", dispatch, DISPATCH_POLICIES)
    check_float(op, "alpha", alpha)
    check_float(op, "limit", limit)
    if not isinstance(apply_router_weight_on_input, bool):
        fail(op, "apply_router_weight_on_input", f"must be a bool, got {type(apply_router_weight_on_input).__name__}")
    if f64 and isinstance(w13, torch.Tensor) and w13.dtype != torch.float64:
        _exact_mismatch(op, "x", "w13", w13)
    E, H, I = check_expert_weights(op, quant, w13, w2, w13_scale, w2_scale, dev, H, exact=f64)
    # Decision: biases may be f32 or bf16 (GPT-OSS checkpoints ship bf16); both are upcast to f32.
    bias_dtypes = (torch.float64,) if f64 else (torch.float32, torch.bfloat16)
    for name, b, shp in (("w13_bias", w13_bias, (E, 2 * I)), ("w2_bias", w2_bias, (E, H))):
        if b is not None:
            check_tensor(op, name, b, dtypes=bias_dtypes, shape=shp, device=dev)
    check_tensor(op, "topk_weights", topk_weights, ndim=2, dtypes=(torch.float64 if f64 else torch.float32,),
                 device=dev)
    if topk_weights.shape[0] != T or topk_weights.shape[1] < 1:
        fail(op, "topk_weights", f"must have shape ({T}, K) with K >= 1, got {tuple(topk_weights.shape)}")
    check_ids(op, "topk_ids", topk_ids, T, topk_weights.shape[1], E, dev, dtypes=(torch.int32,), ranges=ranges)
    return E, I


def check_quant_input(op: str, w, block_last: int) -> None:
    check_tensor(op, "w", w, dtypes=FLOAT_DTYPES)
    if w.dim() < 2:
        fail(op, "w", f"must be at least 2-D (..., N, K), got {w.dim()}-D")
    if block_last and w.shape[-1] % block_last:
        fail(op, "w", f"must have K (last dim) a multiple of {block_last}, got {w.shape[-1]}")
    if not bool(torch.isfinite(w).all()):
        fail(op, "w", "must be finite (no NaN or inf) to be quantized")
