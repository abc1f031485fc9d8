"""How close is close enough: verify's tolerance rule, its eager baselines and magnitudes.

Ground truth is the reference, which computes in float64 and rounds at exactly SPEC's
rounding points. A kernel that accumulates in f32 (or rounds intermediates to bf16) cannot
match it bit for bit, so arithmetic outputs get a tolerance; index outputs (ids, offsets,
positions, permuted rows) and unpermute (SPEC fixes its f32 order) are compared exactly.

The rule (FlashAttention's, normalized per output)
--------------------------------------------------
For output element i let v_i be the exact value before the final rounding (f64: the
reference's math without its last rounding; the reference's output is v rounded to the
output dtype), and a_i the magnitude of the sums behind it: for a GEMM
a_i = (|x| @ |w|.T)_i (+ |bias|), the quantity every rounding error of that dot product is
proportional to. A result y in the output dtype is within half an output ulp of the value
the code computed before its last rounding, so its *computation error* is

    e(y)_i = max(0, |y_i - v_i| - ulp_out(y_i) / 2)

(the final rounding taken out exactly; a correctly rounded exact result has e = 0), and its
normalized error is n(y) = max_i e(y)_i / a_i. The eager baseline b is the same op written
the plain PyTorch way in the op's working precision (the `eager_*` functions below). The
kernel's output y passes iff, for every i,

    e(y)_i <= c * max(n(b), n_floor) * a_i + f_i

    c = 4 (C below): the kernel may be 4x worse than eager PyTorch, and no more;
    n_floor: sqrt(k) * u for a k-term f32 dot product (u = 2^-24), one standard deviation
        of a random-walk f32 sum: eager can be luckily exact on a tiny case (a 1x1 output,
        or every error hidden under a bf16 half-ulp) while a kernel summing in another
        order is not; it is far below any real bug (below);
    f_i: a floor for ops with intermediate bf16 roundings (fused_experts: an intermediate
        bf16 rounding landing on the other side, see `fused_experts_baseline`), 0 otherwise.

"Error over tolerance" is max_i e(y)_i / tol_i; a case passes at <= 1 and the report shows
its distribution. An honest kernel sits near 1/c = 1/4 or below: its error is about eager's.

Why this is tight: a router_gemm (f32 output) whose one column is off by a relative 2^-10
has e ~ 2^-10 |v_i| while tol_i = 4 * n(b) * a_i with n(b) around 2^-24..2^-19 (measured,
H <= 3072, random data |v_i| ~ a_i / sqrt(H)): the bug is 2^5..2^10 times over the tolerance
(tests/test_verify.py). The worst-case bound gamma_k * a_i (k*u*a_i, 2^-13 a_i at k = 2048)
would pass it. For bf16/f16 outputs the output rounding is taken out exactly, so a kernel
that accumulates in bf16 (error ~ sqrt(k) * 2^-9 * a) fails by orders of magnitude.

Reading a worst ratio near 1: the report names the term of tol that bounded each op's worst
case (BOUNDS below). Under the eager term the kernel is about c times less exact than eager
PyTorch, the margin the rule means. Under the one-flip floor (fused_experts, moe_forward, the
layers) the output moved by one intermediate bf16 rounding, of h or of a, that landed on the
other side of its midpoint on a term near the largest: every f32 implementation does that
somewhere (eager too, on other elements), whatever its reduction order, so a ratio near 1
there is one such flip, not a drifting kernel (two flips on the largest terms of one output
would fail). For example
    python -m verify --repro '{"op": "layer.flex_olmo", "backend": "cpu", "dist": "zipf",
      "family": "flex_olmo", "quant": "bf16", "H": 256, "I": 32, "E": 32, "K": 2, "n_group": 1,
      "topk_group": 1, "S": 0, "dispatch": "tiny", "T": 72, "seed": 1005, "dchoice": 5, "bi": false}'
is such a flip (its fused_experts stage), with the same ratio and bound under every
MOELAB_ISA level: the AVX2 kernels use the tolerance as the AVX-512 ones do.

Nonfinite outputs: where the reference output g is NaN or +-inf the kernel must give the
same (NaN for NaN, the same infinity); a nonfinite y where g is finite is a failure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

C = 4.0                      # the kernel may be this many times worse than eager PyTorch
U_F32 = 2.0 ** -24           # unit roundoff of f32 accumulation
ROUTE_WEIGHT_ULPS = 8        # route weights: within 8 f32 ulps (+ c * eager error)
NEAR_TIE_ULPS = 4            # route: computed keys at most 4 f32 ulps apart (2 per key) are always a near tie

_MANT = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at |v| (float64 in, float64 out): 2^(e - mantissa_bits)
    with |v| in [2^e, 2^(e+1)), e clamped to the smallest normal exponent (subnormals)."""
    v = v.to(torch.float64).abs()
    emin = int(math.log2(torch.finfo(dtype).smallest_normal))
    _, ex = torch.frexp(v)
    e = torch.where(v == 0, torch.full_like(ex, emin), torch.clamp(ex - 1, min=emin))
    return torch.exp2((e - _MANT[dtype]).to(torch.float64))


def unravel(flat: int, shape) -> tuple:
    """Flat index -> index tuple (torch.unravel_index imports half of torch on first use)."""
    out = []
    for n in reversed(tuple(shape)):
        out.append(flat % n if n else 0)
        flat = flat // n if n else 0
    return tuple(reversed(out))


def round_f64_to_bf16(v: torch.Tensor) -> torch.Tensor:
    """float64 -> bfloat16 rounded once to nearest even, fast: round to f32 with "round to
    odd" (if the f32 rounding was inexact and landed on an even number, step to the odd
    neighbour on v's side), then f32 -> bf16. Round-to-odd at >= 2 extra bits makes the
    second rounding equal the single one; f32 has 16 more bits than bf16 over bf16's whole
    range (subnormals included). Same results as reference.quant.round_to_bf16 (a test
    checks), about 10x faster."""
    r = v.to(torch.float32)
    inexact = (r.to(torch.float64) != v) & torch.isfinite(r)
    even = (r.view(torch.int32) & 1) == 0
    toward = torch.where(v > r.to(torch.float64), torch.inf, -torch.inf).to(torch.float32)
    return torch.where(inexact & even, torch.nextafter(r, toward), r).to(torch.bfloat16)


def f32_ordinal(x: torch.Tensor) -> torch.Tensor:
    """Map f32 values to int64 so that ordinal(b) - ordinal(a) counts the f32 numbers
    between them (-0.0 and +0.0 map to the same ordinal). NaN is not meaningful here."""
    x = x.to(torch.float32) + 0.0
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def ulp_distance_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many f32 ulps apart a and b are (int64; infinities count as the next number
    after the largest finite one)."""
    return (f32_ordinal(a) - f32_ordinal(b)).abs()


@dataclass
class ArithResult:
    """The outcome of one tolerance check."""
    ratio: float             # max_i e(y)_i / tol_i (0 when within rounding, inf on a nonfinite mismatch)
    n_kernel: float          # n(y)
    n_eager: float           # n(b)
    worst: tuple             # index of the worst element
    detail: str
    ratios: Optional[torch.Tensor] = None   # per element (float64), when asked for
    bound: str = ""          # the term of tol that is largest at the worst element (BOUNDS)
    bounds: Optional[torch.Tensor] = None   # that term's index per element (int8), with ratios

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


# The three terms a tolerance is the larger of (tol_i = c * max(n(b), n_floor) * a_i + f_i): which
# one bounds the worst element says what a ratio near 1 means. "eager term": the kernel's error is
# about c times the eager code's; "sum floor": eager was (luckily) more exact than a k-term f32
# sum can be promised to be; "one-flip floor": the error is one intermediate bf16 rounding
# landing on the other side of its midpoint on the largest term (fused_experts), which both
# the eager code and any kernel do somewhere; a ratio near 1 there is one flip on a term near
# the largest, whatever the kernel's reduction order.
BOUNDS = ("eager term", "sum floor", "one-flip floor")


def computation_error(y: torch.Tensor, v: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """e(y) = max(0, |y - v| - ulp_out(y)/2), float64 (0 where y or v is not finite)."""
    y64, v64 = y.to(torch.float64), v.to(torch.float64)
    fin = torch.isfinite(y64) & torch.isfinite(v64)
    e = (y64 - v64).abs() - 0.5 * ulp(y64.nan_to_num(0.0, 0.0, 0.0), out_dtype)
    return torch.where(fin, e.clamp_min(0.0), torch.zeros_like(e))


def arith_check(y: torch.Tensor, g: torch.Tensor, b: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                out_dtype: torch.dtype, *, n_floor: float = 0.0, extra: Optional[torch.Tensor] = None,
                c: float = C, keep_ratios: bool = False) -> ArithResult:
    """The rule of the module docstring for one output (all tensors of one shape, on CPU).

    y: kernel output, g: reference output (v rounded; decides the nonfinite cases),
    b: eager baseline, v: exact unrounded values (f64), a: magnitudes (>= 0), out_dtype:
    the dtype y and b are rounded to, n_floor: the accumulation floor, extra: the
    per-element floor f_i (or None)."""
    y64, g64, v64, a64 = (t.to(torch.float64) for t in (y, g, v, a))
    if y64.numel() == 0:
        return ArithResult(0.0, 0.0, 0.0, (), "empty", torch.zeros(y64.shape, dtype=torch.float64))
    g_fin = torch.isfinite(g64)
    y_fin = torch.isfinite(y64)
    same_nonfinite = (y64 == g64) | (torch.isnan(y64) & torch.isnan(g64))
    bad = (~g_fin & ~same_nonfinite) | (g_fin & ~y_fin)
    pos = a64 > 0
    safe_a = torch.where(pos, a64, torch.ones_like(a64))
    ey = torch.where(g_fin, computation_error(y64, v64, out_dtype), torch.zeros_like(v64))
    eb = torch.where(g_fin & torch.isfinite(b.to(torch.float64)), computation_error(b, v64, out_dtype),
                     torch.zeros_like(v64))
    n_eager = float(torch.where(pos, eb / safe_a, torch.zeros_like(eb)).max())
    n_kernel = float(torch.where(pos, ey / safe_a, torch.where(ey > 0, math.inf, 0.0)).max())
    n_eff = max(n_eager, n_floor)
    tol = c * n_eff * a64
    kinds = torch.full(a64.shape, 0 if n_eager >= n_floor else 1, dtype=torch.int8)
    if extra is not None:
        kinds = torch.where(extra.to(torch.float64) > tol, torch.full_like(kinds, 2), kinds)
        tol = tol + extra.to(torch.float64)
    ratio_i = torch.where(ey > 0, ey / tol, torch.zeros_like(ey))       # ey > 0 and tol == 0: inf
    ratio_i = torch.where(bad, torch.full_like(ratio_i, math.inf), ratio_i)
    ratio_i = ratio_i.nan_to_num(math.inf)
    flat = int(torch.argmax(ratio_i))
    worst = unravel(flat, ratio_i.shape)
    ratio = float(ratio_i.reshape(-1)[flat])
    detail = (f"worst at {worst}: kernel {float(y64[worst]):.9g}, exact {float(v64[worst]):.9g}, "
              f"reference {float(g64[worst]):.9g}, eager {float(b.to(torch.float64)[worst]):.9g}, "
              f"magnitude {float(a64[worst]):.4g}, tolerance {float(tol[worst]):.4g}; n(kernel) = {n_kernel:.3g}, "
              f"n(eager) = {n_eager:.3g}, floor {n_floor:.3g}")
    bound = BOUNDS[int(kinds.reshape(-1)[flat])] if ratio > 0 else ""
    return ArithResult(ratio, n_kernel, n_eager, worst, detail + (f"; bounded by the {bound}" if bound else ""),
                       ratio_i if keep_ratios else None, bound, kinds if keep_ratios else None)


def gemm_floor(k: int) -> float:
    """The accumulation floor n_floor for a k-term f32 dot product: sqrt(k) * 2^-24."""
    return math.sqrt(max(1, k)) * U_F32


# ------------------------------------------------------------------- GEMM baselines
def magnitude_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a = |x| @ |w|.T (+ |bias|), float64."""
    a = x.to(torch.float64).abs() @ w.to(torch.float64).abs().T
    if bias is not None:
        a = a + bias.to(torch.float64).abs()
    return a


def exact_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """v = x @ w.T (+ bias) in float64 from the exact upcasts (unrounded; every product of
    two f32/bf16/f16 numbers is exact in f64 and the f64 sum error is ~k * 2^-53)."""
    v = x.to(torch.float64) @ w.to(torch.float64).T
    if bias is not None:
        v = v + bias.to(torch.float64)
    return v


def eager_router_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The plain PyTorch router GEMM: an f32 copy of x, then an f32 GEMM."""
    return F.linear(x.float(), w)


def eager_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch.nn.functional.linear in the operands' dtype (what unquantized_gemm falls back to)."""
    return F.linear(x, w, bias)


# ------------------------------------------------------------------- route baselines
def _route_sum_f32(w: torch.Tensor) -> torch.Tensor:
    acc = w[:, 0].clone()
    for j in range(1, w.shape[1]):
        acc = acc + w[:, j]
    return acc.unsqueeze(-1)


def _route_resolved(method: str, renormalize, norm_eps):
    """renormalize and norm_eps with None taken as the method's defaults (SPEC 6)."""
    from reference.validate import NORM_EPS_DEFAULT, RENORMALIZE_DEFAULT
    if renormalize is None:
        renormalize = RENORMALIZE_DEFAULT[method]
    if norm_eps is None:
        norm_eps = NORM_EPS_DEFAULT.get(method, 0.0)
    return renormalize, norm_eps


def route_weights_for_ids(logits: torch.Tensor, ids: torch.Tensor, method: str, *,
                          bias=None, scaling: float = 1.0, renormalize: Optional[bool] = None,
                          norm_eps: Optional[float] = None, exact: bool = True) -> torch.Tensor:
    """SPEC's weight formula of `method` for given ids [T, K] (f32 [T, K]); renormalize and
    norm_eps None: the method's defaults.

    exact=True: softmax and sigmoid are the exact functions rounded once to f32 (as the
    reference computes them), so for the reference's own ids this reproduces its weights;
    verify uses it to get the expected weights of a row whose ids legitimately differ (a
    near-tie flip). exact=False: torch's f32 softmax/sigmoid, the eager baseline."""
    renormalize, eps = _route_resolved(method, renormalize, norm_eps)
    x = logits.to(torch.float32)
    sel = ids.to(torch.int64)
    c = torch.tensor(scaling, dtype=torch.float32)
    if exact:
        sig = lambda v: torch.sigmoid(v.to(torch.float64)).to(torch.float32)
        smax = lambda v: torch.softmax(v.to(torch.float64), dim=-1).to(torch.float32)
    else:
        sig = torch.sigmoid
        smax = lambda v: torch.softmax(v, dim=-1)
    if sel.shape[1] == 0 or sel.shape[0] == 0:
        return torch.zeros(sel.shape, dtype=torch.float32)
    if method in ("sigmoid_bias", "grouped_sigmoid_bias"):
        s = sig(x).gather(-1, sel)
        w = (s * c) / (_route_sum_f32(s) + eps) if renormalize else s * c
        return w.to(torch.float32)
    if method in ("softmax_topk", "grouped_softmax"):
        w = smax(x).gather(-1, sel)
        if renormalize:
            w = w / _route_sum_f32(w)
    elif method == "softmax_bias":
        w = smax(x).gather(-1, sel)
        if renormalize:
            w = w / _route_sum_f32(w).clamp_min(eps)
    elif method == "topk_softmax":
        w = smax(x.gather(-1, sel))
    elif method == "sigmoid_topk":
        w = sig(x).gather(-1, sel)
        if renormalize:
            w = w / _route_sum_f32(w).clamp_min(eps)
    elif method == "llama4":
        w = sig(x.gather(-1, sel))
    else:
        raise ValueError(f"unknown method {method!r}")
    return (w * c).to(torch.float32)


def route_weight_scale(logits: torch.Tensor, ids: torch.Tensor, method: str, *, scaling: float = 1.0,
                       renormalize: Optional[bool] = None, norm_eps: Optional[float] = None):
    """(m [T, 1], key [T, K]): route's weights are key * m per row, with key the exact f32
    sigmoid or softmax of the selected experts (topk_softmax/llama4: m = |scaling|, key = the
    unscaled weight). verify uses it for subnormal keys: SPEC's exact sigmoid of a logit below
    about -87 is an f32 subnormal, which many f32 implementations (torch's included) flush to
    0; a few subnormal ulps of the key are then amplified by m (up to scaling / norm_eps)."""
    renormalize, eps = _route_resolved(method, renormalize, norm_eps)
    x = logits.to(torch.float32)
    sel = ids.to(torch.int64).clamp_min(0)
    c = abs(float(torch.tensor(scaling, dtype=torch.float32)))
    ones = torch.ones(sel.shape[0], 1)
    if sel.numel() == 0:
        return ones, torch.zeros(sel.shape, dtype=torch.float32)
    sig = lambda v: torch.sigmoid(v.to(torch.float64)).to(torch.float32)
    # (a floor of 2^-126 keeps m finite where a normalization divides by a zero sum: eps = 0)
    tiny = torch.finfo(torch.float32).tiny
    if method in ("softmax_topk", "grouped_softmax", "softmax_bias"):
        key = torch.softmax(x.to(torch.float64), dim=-1).to(torch.float32).gather(-1, sel)
        floor = max(eps, tiny) if method == "softmax_bias" else tiny
        m = c / _route_sum_f32(key).clamp_min(floor) if renormalize else c * ones
    elif method == "sigmoid_topk":
        key = sig(x).gather(-1, sel)
        m = c / _route_sum_f32(key).clamp_min(max(eps, tiny)) if renormalize else c * ones
    elif method in ("sigmoid_bias", "grouped_sigmoid_bias"):
        key = sig(x).gather(-1, sel)
        m = c / (_route_sum_f32(key) + eps).clamp_min(tiny) if renormalize else c * ones
    else:
        key = route_weights_for_ids(x, ids, method)
        m = c * ones
    return m.to(torch.float64), key


def route_weight_check(w_opt: torch.Tensor, w_exp: torch.Tensor, w_eager: torch.Tensor,
                       key: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None,
                       c: float = C) -> ArithResult:
    """Route weights (f32 values of f32 math, SPEC: 'all math in f32'): per element

        |w - w_exp| <= 8 ulp_f32(w_exp) + c * n_eager * |w_exp| + 2^-126 * m

    n_eager: the largest relative error of torch's own f32 formula, over elements whose key
    is a normal f32 number (torch flushes subnormal sigmoids to 0, which would blow the
    tolerance up for the whole case); the last term lets a subnormal key be flushed to zero
    (FTZ, common in f32 math libraries and GPU fast math), amplified by the row's
    multiplier m (`route_weight_scale`). NaN must match NaN, infinities must match."""
    w64, e64, b64 = (t.to(torch.float64) for t in (w_opt, w_exp, w_eager))
    if w64.numel() == 0:
        return ArithResult(0.0, 0.0, 0.0, (), "empty")
    e_fin = torch.isfinite(e64)
    same = (w64 == e64) | (torch.isnan(w64) & torch.isnan(e64))
    bad = (~e_fin & ~same) | (e_fin & ~torch.isfinite(w64))
    mag = e64.abs()
    pos = mag > 0
    normal = torch.ones_like(pos) if key is None else key.to(torch.float64).abs() >= torch.finfo(torch.float32).tiny
    rel_b = torch.where(pos & e_fin & torch.isfinite(b64) & normal, (b64 - e64).abs() / torch.where(pos, mag, 1.0),
                        torch.zeros_like(mag))
    n_eager = float(rel_b.max())
    err = torch.where(e_fin & torch.isfinite(w64), (w64 - e64).abs(), torch.zeros_like(mag))
    tolv = ROUTE_WEIGHT_ULPS * ulp(mag.nan_to_num(0.0), torch.float32) + c * n_eager * mag
    if scale is not None:
        tolv = tolv + 2.0 ** -126 * scale.to(torch.float64).nan_to_num(0.0, 0.0, 0.0)
    r = torch.where(err > 0, err / tolv, torch.zeros_like(err))
    r = torch.where(bad, torch.full_like(r, math.inf), r).nan_to_num(math.inf)
    flat = int(torch.argmax(r))
    worst = unravel(flat, r.shape)
    n_k = float(torch.where(pos, err / torch.where(pos, mag, 1.0), torch.zeros_like(err)).max())
    detail = (f"worst at {worst}: kernel {float(w64[worst]):.9g}, expected {float(e64[worst]):.9g}, "
              f"eager {float(b64[worst]):.9g}, tolerance {float(tolv[worst]):.4g} "
              f"({ROUTE_WEIGHT_ULPS} ulps + {c:g} x eager relative error {n_eager:.3g})")
    return ArithResult(float(r.reshape(-1)[flat]), n_k, n_eager, worst, detail)


# ----------------------------------------------------------- fused_experts baselines
def _act_f32(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "silu":
        I = h.shape[1] // 2
        return F.silu(h[:, :I]) * h[:, I:]
    g = torch.clamp(h[:, 0::2], max=limit)
    u = torch.clamp(h[:, 1::2], min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + 1.0)


def fused_experts_baseline(x, w13, w2, topk_weights, topk_ids, *, quant, w13_scale=None, w2_scale=None,
                           w13_bias=None, w2_bias=None, activation="silu", alpha=1.702, limit=7.0,
                           dispatch="auto", apply_router_weight_on_input=False):
    """Eager baseline, magnitudes and flip floor of fused_experts (all on CPU).

    Eager (the plain PyTorch way, what a straightforward implementation does): per expert,
    dequantize in f32 and round the weights to bf16 (what the `blocked` micro-kernel does;
    exact for bf16 and mxfp4 weights, a 2^-9 rounding for fp8), h = f32 matmul (+ bias),
    rounded to bf16; a = f32 activation rounded to bf16; y = f32 matmul (+ bias); the
    weighted sum in f32, rounded to bf16.

    Magnitude A[t, i] = sum_j |w_tj| * ((|a_j| @ |W2_e|.T)_i + |b2_e,i|), with a_j the
    activation rounded as the reference rounds it (f64 math, bf16): every rounding error
    downstream of a is proportional to it, and an error in a (from h) is relative to |a|.

    Flip floor F[t, i] = sum_j |w_tj| * max_k m_jk * |W2_e,ik|, with m_jk the most that one
    intermediate bf16 rounding landing on the other side of its midpoint can move a_jk: an
    ulp of a_jk (a's own rounding), or the move of bf16(act(h')) where h' is one of a_jk's two
    inputs (gate, up) one bf16 ulp away, computed exactly (f64, rounded as the reference
    rounds). The latter reaches two ulps of a where the moved value rounds the other way
    (an up input flipped by a relative 2^-7.2 moved a by 2^-6.7: verify's layer.glm4_moe
    hot_expert bf16 case T = 142, seed 1448596042, at the scalar to avx512 levels), and more
    where the gate sits on silu's steep side. Both the eager code and a kernel flip some
    roundings relative to the f64 truth (that is what n(eager) measures); on a small case
    eager may flip none while the kernel flips one, which this floor allows, on the largest
    term of the sum; two flips on the largest terms of one output are not allowed.

    Exact V[t, i]: the reference's function before its final rounding (f64 math, h and a
    rounded to bf16 as SPEC says, the weighted sum in f64): the truth `arith_check` measures
    against (the reference output is V rounded once to bf16).

    apply_router_weight_on_input (SPEC 6): every one of these with slot j's input
    bf16(x * bf16(w_tj)) (exact in f32 and in f64: the product of two bf16 values, rounded once)
    and |w_tj| replaced by 1 in the sums.

    Subnormals: the CPU kernel at avx512_bf16 (vdpbf16ps) treats bf16-subnormal GEMM inputs
    (x, or a) as zero and flushes subnormal partial sums (docs/fused_experts.md). A tiny routing
    weight on the input makes them common (x * w ~ 1e-20 gives a ~ 1e-40, y ~ 1e-37). F holds,
    per slot, |y - y with subnormal x and a elements read as 0| (zero unless there are some),
    plus 2^-126 * (ceil(I/2) + 1 + sum_k |W2_ik|): every flushed partial sum of GEMM2 (one per
    k pair) and every a_k at the subnormal boundary moves y by less than 2^-126 (* |W2_ik|).
    Far below any tolerance unless the outputs themselves are near 2^-126.

    Returns (eager bf16 [T, H], V f64 [T, H], A f64 [T, H], F f64 [T, H]).
    """
    from reference.fused_experts import activate
    from reference.quant import dequantize_expert_weights
    round_to_bf16 = round_f64_to_bf16

    T, H = x.shape
    E = w13.shape[0]
    out = torch.zeros(T, H, dtype=torch.float32)
    A = torch.zeros(T, H, dtype=torch.float64)
    Fl = torch.zeros(T, H, dtype=torch.float64)
    V = torch.zeros(T, H, dtype=torch.float64)
    Fsub = torch.zeros(T, H, dtype=torch.float64)

    def subnormal(v):
        return (v.double().abs() < 2.0 ** -126) & (v != 0)

    def mlp64(xin, W13, W2, e, flush=False):
        """(a, y) of the rows xin in f64 with the reference's roundings (flush: subnormal x and
        a elements read as 0)."""
        if flush:
            xin = torch.where(subnormal(xin), torch.zeros_like(xin), xin)
        h64 = xin.double() @ W13.double().T
        if w13_bias is not None:
            h64 = h64 + w13_bias[e].double()
        h64 = round_to_bf16(h64).double()
        a64 = round_to_bf16(activate(h64, activation, alpha, limit)).double()
        if flush:
            a64 = torch.where(subnormal(a64), torch.zeros_like(a64), a64)
        y64 = a64 @ W2.double().T
        if w2_bias is not None:
            y64 = y64 + w2_bias[e].double()
        return a64, y64, h64

    def flip_moves(h64, a64):
        """m [rows, I]: the most one bf16 rounding of h (either input of a_k one ulp away) or of
        a_k itself moves a_k (flip floor above)."""
        hb = h64.to(torch.bfloat16)
        m = ulp(a64.nan_to_num(0.0), torch.bfloat16)
        half = h64.shape[1] // 2                    # silu: [gate | up]; swiglu_oai: interleaved
        inputs = ((slice(0, half), slice(half, None)) if activation == "silu"
                  else (slice(0, None, 2), slice(1, None, 2)))
        for to in (float("inf"), -float("inf")):
            nb = torch.nextafter(hb, torch.full_like(hb, to)).double()
            for cols in inputs:
                hp = h64.clone()
                hp[:, cols] = nb[:, cols]
                moved = (round_to_bf16(activate(hp, activation, alpha, limit)).double() - a64).abs()
                m = torch.maximum(m, moved.nan_to_num(0.0, posinf=0.0))
        return m

    for e in range(E):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        W13 = dequantize_expert_weights(quant, w13[e], None if w13_scale is None else w13_scale[e])
        W2 = dequantize_expert_weights(quant, w2[e], None if w2_scale is None else w2_scale[e])
        wt = topk_weights[tok, slot]
        xin = x[tok]
        if apply_router_weight_on_input:
            xin = round_to_bf16(x[tok].double() * round_to_bf16(wt.double()).double().unsqueeze(1))
            wt = torch.ones_like(wt)
        # eager
        h = xin.float() @ W13.to(torch.bfloat16).float().T
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        h = h.to(torch.bfloat16).float()
        a = _act_f32(h, activation, alpha, limit).to(torch.bfloat16).float()
        y = a @ W2.to(torch.bfloat16).float().T
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, tok, wt.unsqueeze(1) * y)
        # magnitudes (f64, reference roundings)
        a64, y64, h64 = mlp64(xin, W13, W2, e)
        moves = flip_moves(h64, a64)
        ftz = (W2.double().abs().sum(1) + (W2.shape[1] + 1) // 2 + 1) * 2.0 ** -126
        if bool(subnormal(xin).any()) or bool(subnormal(a64).any()):
            _, y64f, _ = mlp64(xin, W13, W2, e, flush=True)
            ftz = ftz + (y64f - y64).abs().nan_to_num(0.0)
        Fsub.index_add_(0, tok, wt.double().abs().unsqueeze(1) * ftz.nan_to_num(0.0, posinf=0.0))
        V.index_add_(0, tok, wt.double().unsqueeze(1) * y64)
        a64 = a64.abs()
        W2a = W2.double().abs()
        mag = a64 @ W2a.T
        if w2_bias is not None:
            mag = mag + w2_bias[e].double().abs()
        wabs = wt.double().abs().unsqueeze(1)
        A.index_add_(0, tok, wabs * mag)
        Fl.index_add_(0, tok, wabs * _largest_term(moves, W2a.nan_to_num(0.0)))
    return out.to(torch.bfloat16), V, A, Fl + Fsub


def _largest_term(a: torch.Tensor, w: torch.Tensor, chunk_elems: int = 1 << 22) -> torch.Tensor:
    """max_k a[m, k] * w[n, k] for a [M, K], w [N, K] (both >= 0): [M, N], in row chunks."""
    M, K = a.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=a.dtype)
    step = max(1, chunk_elems // max(1, N * K))
    for i in range(0, M, step):
        out[i:i + step] = (a[i:i + step, None, :] * w[None, :, :]).amax(dim=-1) if K else 0.0
    return out
