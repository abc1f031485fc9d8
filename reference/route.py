"""Top-k expert selection for a Mixture-of-Experts layer (SPEC.md section 1).

A router GEMM gives every token t a row of logits x[t, :] over E experts. `route` picks
K experts for each token and gives each picked expert a weight; the MoE layer's output is
then sum_j weights[t, j] * expert_{ids[t, j]}(hidden[t]). Two things vary between model
families, and `method` names the combination:

* the *selection key*, the number the K largest of which are picked:
  the softmax probability p = softmax(x) (Mixtral, Qwen-MoE), the raw logit x
  (topk_softmax, Llama-4), the sigmoid s = sigmoid(x), or s + bias, where a learned
  per-expert bias steers load balance (DeepSeek-V3, MiniMax-M2);
* the *weight* of a picked expert: p, a softmax over just the K picked logits, s,
  or s rescaled so that the K weights sum to `scaling`. The bias of the biased methods
  chooses experts but never enters a weight.

    method                 key                       weight of slot j (e = ids[t, j])
    softmax_topk           p = softmax(x)            p[e]   (renormalize: / sum of the K p)
    topk_softmax           x                         softmax over the K selected x
    sigmoid_topk           s = sigmoid(x)            s[e]   (renormalize: / max(sum, 1e-20))
    sigmoid_bias           s + bias                  s[e] * scaling / (sum of the K s + 1e-20)
    grouped_sigmoid_bias   s + bias, kept groups     as sigmoid_bias
    llama4 (K = 1)         x                         sigmoid(x[e])
    grouped_softmax        p, kept groups            p[e]   (renormalize: / sum of the K p)
    softmax_bias           p + bias                  p[e] / max(sum of the K p, norm_eps)

Every method's final weights are then multiplied by f32(scaling) (SPEC 6: DeepSeek-V2 and other
softmax routers with a routed scaling factor); the biased sigmoid methods fold it into their
formula as before, s * scaling / (sum + eps). `renormalize=None` takes the method's default (on
for the three biased methods, off for the rest); an explicit False on a biased method means
w = s[e] * scaling (DeepSeek-V3-style configs with norm_topk_prob = False). `norm_eps` is the
epsilon of each normalization in its family's form (defaults 1e-20, softmax_bias 1e-12).

`grouped_softmax`'s groups (DeepSeek-V2 `group_limited_greedy`) are scored by their largest p;
the other group rule is DeepSeek-V3's below.

`grouped_sigmoid_bias` (DeepSeek-V3 "node-limited" routing) first splits the E experts into
n_group equal contiguous groups, scores each group by the sum of its two largest keys, keeps
the topk_group best groups, sets the keys of every other expert to -inf, and only then
takes the top K.

Order and ties are part of the contract, because ids must be bit-identical on every
backend: slot j holds the j-th largest key under a *total order* in which NaN ranks above
+inf (all NaNs equal), -0.0 equals +0.0, and equal keys go lower expert index first. The
same order ranks groups (equal group scores: lower group index first). `torch.topk` does
not promise that tie rule, so this module sorts explicitly (`_topk_total_order`).

Precision: unlike the other reference ops (float64 throughout, rounded once at the end),
route is specified as "all math in f32", so this reference produces f32 values at every
step a kernel rounds to f32: logits and bias are upcast exactly to f32; p and s are the
exact softmax / sigmoid rounded once to f32; s + bias, the group scores, the sums over the
K selected (accumulated in increasing slot j) and the weight formulas are f32 operations.
p and s are evaluated in float64 and then rounded, rather than with torch's f32 kernels,
because on CPU torch's f32 sigmoid takes a vectorized path and a scalar tail path that
disagree in the last bit for a few percent of inputs: two equal logits of one row could
then get different keys (breaking the tie rule), and a token's keys would depend on where
it sits in the batch. An optimized kernel may compute exp/sigmoid a few ulps differently;
where that reorders two keys a few ulps apart, verify reports a near-tie flip (it uses
`selection_keys` to measure the gap) instead of a mismatch.

Exact mode (this reference only, docs/families.md): float64 logits (and bias) make every step
float64 and nothing is rounded to f32; the weights come back float64. That is the function a
model's float64 run computes, the truth the family conformance tests compare transformers with.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from reference.validate import BIAS_METHODS, GROUPED_METHODS, check_route

__all__ = ["route", "selection_keys"]

_F32 = torch.float32


def _topk_total_order(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] (int64) of the k largest entries of each row of `keys` [T, N] f32.

    The order is total: NaN ranks above +inf and NaNs tie among themselves; -0.0 equals
    +0.0; equal keys rank lower index first. Slot j holds the j-th largest key. Built as a
    lexicographic sort by (is_nan descending, value descending, index ascending) out of
    two stable sorts, the least significant criterion first:

    1. start from index order 0..N-1 (that is the `index ascending` criterion);
    2. stable sort by value, descending (NaN replaced by 0 here, the NaN flag decides them;
       `keys + 0.0` turns -0.0 into +0.0 so the two compare equal in any sort);
    3. stable sort by the NaN flag, descending.
    """
    is_nan = torch.isnan(keys)
    value = torch.where(is_nan, torch.zeros_like(keys), keys + 0.0)
    order = torch.sort(value, dim=-1, descending=True, stable=True).indices
    nan_in_order = is_nan.gather(-1, order).to(torch.int8)
    order = order.gather(-1, torch.sort(nan_in_order, dim=-1, descending=True, stable=True).indices)
    return order[..., :k]


def _group_mask_keys(keys: torch.Tensor, n_group: int, topk_group: int, top_n: int) -> torch.Tensor:
    """Group restriction: keys [T, E] -> keys with the experts of dropped groups set to -inf.

    group_score[t, g] = the sum of the top_n largest keys of group g, taken under the total
    order: top_n = 2 is DeepSeek-V3 (sum of the two largest, one f32 add; a NaN key makes its
    group's score NaN, which ranks first), top_n = 1 is DeepSeek-V2's group_limited_greedy
    (the largest key). The topk_group groups with the largest scores are kept (ties: lower
    group index; transformers leaves them unordered).

    Edge case, literal to SPEC: a kept expert whose own key is -inf (only possible with a
    bias of -inf) ties with the masked experts, so the index rule decides between them and
    a lower-index expert of a dropped group can then be picked. Finite biases never do this.
    """
    T, E = keys.shape
    grouped = keys.reshape(T, n_group, E // n_group)
    top = grouped.gather(-1, _topk_total_order(grouped, top_n))   # [T, n_group, top_n]
    group_score = top[..., 0] if top_n == 1 else top[..., 0] + top[..., 1]
    kept = _topk_total_order(group_score, topk_group)          # [T, topk_group]
    keep = torch.zeros(T, n_group, dtype=torch.bool, device=keys.device)
    keep.scatter_(-1, kept, True)
    keep = keep.repeat_interleave(E // n_group, dim=-1)       # [T, E]
    return torch.where(keep, keys, torch.full_like(keys, float("-inf")))


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) of f32 x, evaluated in f64 and rounded once to f32 (see module docstring:
    the same input always gives the same bits, wherever it sits in the tensor); f64 x stays f64."""
    return torch.sigmoid(x.to(torch.float64)).to(x.dtype)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of x, evaluated in f64 and rounded once to x's dtype."""
    return torch.softmax(x.to(torch.float64), dim=-1).to(x.dtype)


def _sum(w: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim [T, K] -> [T, 1] in w's dtype, accumulated in increasing j: a
    fixed order, so the rounding does not depend on T or on a library's reduction tree."""
    acc = w[:, 0].clone()
    for j in range(1, w.shape[1]):
        acc = acc + w[:, j]
    return acc.unsqueeze(-1)


def _keys(x: torch.Tensor, method: str, bias: Optional[torch.Tensor], n_group: int,
          topk_group: int) -> torch.Tensor:
    """Selection keys [T, E] of x's dtype (f32, or f64 in exact mode); inputs validated."""
    if method in ("topk_softmax", "llama4"):
        return x.clone()
    if method in ("softmax_topk", "grouped_softmax", "softmax_bias"):
        keys = _softmax(x)
    else:
        keys = _sigmoid(x)
    if method in BIAS_METHODS:
        keys = keys + bias.to(x.dtype)                         # f32 add (f64 in exact mode)
    if method in GROUPED_METHODS:
        keys = _group_mask_keys(keys, n_group, topk_group, top_n=1 if method == "grouped_softmax" else 2)
    return keys


def selection_keys(logits: torch.Tensor, method: str, bias: Optional[torch.Tensor] = None,
                   n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """The f32 keys [T, E] that `route` ranks, for measuring how close a choice was.

    Returns, with x = f32(logits): softmax(x) for softmax_topk; x for topk_softmax and
    llama4; sigmoid(x) for sigmoid_topk; sigmoid(x) + f32(bias) for sigmoid_bias; softmax(x)
    + f32(bias) for softmax_bias; and for the grouped methods the same keys after group
    masking (experts of dropped groups hold -inf). `route(...)[1][t, j]` is the column of the j-th largest entry of row t under the
    total order (NaN first, -0.0 == +0.0, ties lower index first). verify uses the gap
    between a row's keys to classify a differing id as a near-tie flip or a real error.

    Computed exactly as `route` computes them (same code, same bits), on logits' device.
    Raises ValueError (message starting with "route:") for the inputs `route` rejects;
    validation runs with top_k = 1, scaling = 1.0, renormalize = False.
    """
    check_route(logits, 1, method, bias, n_group, topk_group, 1.0, None, exact=True)
    return _keys(_working(logits), method, bias, n_group, topk_group)


def _working(logits: torch.Tensor) -> torch.Tensor:
    """The logits in the working precision: f32, or f64 in exact mode."""
    return logits if logits.dtype == torch.float64 else logits.to(_F32)


def route(logits: torch.Tensor, top_k: int, method: str, *, bias: Optional[torch.Tensor] = None,
          n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
          renormalize: Optional[bool] = None,
          norm_eps: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pick top_k experts per token and weight them (SPEC.md sections 1 and 6).

    Args:
        logits: [T, E] float32, bfloat16 or float16 router logits; upcast exactly to f32
            (x below). T >= 0, 1 <= E <= 2048 (grouped: E <= 1024). float64 selects the
            exact mode (module docstring).
        top_k: K, 1 <= K <= min(E, 32); K = 1 for llama4; grouped: K <= topk_group * E / n_group.
        method: softmax_topk | topk_softmax | sigmoid_topk | sigmoid_bias |
            grouped_sigmoid_bias | llama4 | grouped_softmax | softmax_bias (module docstring).
        bias: [E] float32 or bfloat16, upcast to f32; required by sigmoid_bias,
            grouped_sigmoid_bias and softmax_bias, rejected by the others. It changes the
            selection only.
        n_group, topk_group: the grouped methods only (1 otherwise): E % n_group == 0,
            E / n_group >= 2, n_group <= 32, 1 <= topk_group <= n_group.
        scaling: finite; every method's final weights are multiplied by f32(scaling).
        renormalize: None = the method's default (True for the biased methods, False for the
            rest); rejected (True) for llama4. A no-op for topk_softmax, whose weights
            already sum to 1.
        norm_eps: None = the method's default; sigmoid_topk, the biased methods only.

    Math (f32 values; softmax and sigmoid are the exact functions rounded once to f32;
    sums accumulate in f32 in increasing j; sel = ids[t, :]; keys as in `selection_keys`;
    c = f32(scaling), eps = norm_eps):
        ids[t, j]     = index of the j-th largest key of row t under the total order
                        (NaN > +inf, -0.0 == +0.0, equal keys: lower index first)
        softmax_topk, grouped_softmax
                      w = p[sel], p = softmax(x);     renormalize: w / sum(w);  then w * c
        topk_softmax  w = softmax(x[sel]) * c
        sigmoid_topk  w = s[sel], s = sigmoid(x);     renormalize: w / max(sum(w), eps); then w * c
        sigmoid_bias, grouped_sigmoid_bias
                      renormalize: w = (s[sel] * c) / (sum(s[sel]) + eps);  else w = s[sel] * c
        softmax_bias  w = p[sel];                     renormalize: w / max(sum(w), eps); then w * c
        llama4        w = sigmoid(x[sel]) * c
    Multiplying by c = 1 is exact, so calls without scaling keep their bits.

    Returns:
        (weights [T, K] float32 contiguous, ids [T, K] int32), fresh tensors on logits'
        device (weights float64 in exact mode). T = 0 gives two empty (0, K) tensors.

    Raises:
        ValueError "route: argument '<name>' ..." for a malformed call (see
        reference.validate.check_route): wrong type/rank/dtype/device of logits or bias,
        E or K out of range, a bias missing or given to a method without one, group
        constraints violated, unknown method, non-finite scaling, renormalize=True for
        llama4, a norm_eps for a method without one or a negative one.
    """
    renormalize, eps = check_route(logits, top_k, method, bias, n_group, topk_group, scaling,
                                   renormalize, norm_eps, exact=True)
    x = _working(logits)
    dt = x.dtype
    keys = _keys(x, method, bias, n_group, topk_group)
    sel = _topk_total_order(keys, top_k)                       # [T, K] int64
    c = torch.tensor(scaling, dtype=dt, device=x.device)

    if method in ("sigmoid_bias", "grouped_sigmoid_bias"):
        s = _sigmoid(x).gather(-1, sel)                        # bias left out on purpose
        w = (s * c) / (_sum(s) + eps) if renormalize else s * c
    else:
        if method in ("softmax_topk", "grouped_softmax"):
            w = keys.gather(-1, sel)                           # the keys are p (grouped: kept ones)
            if renormalize:
                w = w / _sum(w)
        elif method == "softmax_bias":
            w = _softmax(x).gather(-1, sel)                    # bias left out on purpose
            if renormalize:
                w = w / _sum(w).clamp_min(eps)
        elif method == "topk_softmax":
            w = _softmax(x.gather(-1, sel))                    # renormalize: already sums to 1
        elif method == "sigmoid_topk":
            w = keys.gather(-1, sel)                           # the keys are s
            if renormalize:
                w = w / _sum(w).clamp_min(eps)
        else:  # llama4
            w = _sigmoid(x.gather(-1, sel))
        w = w * c

    return w.to(dt).contiguous(), sel.to(torch.int32).contiguous()
