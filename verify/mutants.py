"""Mutants: deliberately wrong versions of every op, to prove the checker can fail.

Each mutant wraps the op's optimized function (the reference one while `optimized` lacks the
op) and corrupts its inputs or outputs the way a real kernel bug would: a tie broken the
wrong way, a tail loop that stops early, a scale read from the neighbouring block, nibbles
in the wrong order, a clamp forgotten. `python -m verify --mutants` runs each one through the
normal machinery (same distributions, same comparison) and must kill all of them; a
surviving mutant means the tolerance is too loose or a distribution is missing.

`dists` says where a mutant is meant to show (a tie bug needs ties), `fixed` pins structure
fields it needs (swiglu's clamp needs activation="swiglu_oai"); everything else is drawn.
Adding a mutant: write `wrap(fn) -> fn'` and list it in `MUTANTS`.
"""
from __future__ import annotations

import functools
from typing import List

import torch

from .families import family_mutants
from .registry import REGISTRY, Mutant

TWO_M10 = 2.0 ** -10


def _wraps(fn):
    return functools.wraps(fn, assigned=("__name__", "__doc__"))


# ============================================================================ route
def route_ties_high_index(fn):
    """Ties broken toward the higher expert index: run on mirrored columns, mirror ids back."""
    @_wraps(fn)
    def f(logits, top_k, method, *, bias=None, **kw):
        E = logits.shape[1]
        w, ids = fn(logits.flip(-1), top_k, method, bias=None if bias is None else bias.flip(-1), **kw)
        return w, (E - 1 - ids).to(ids.dtype)
    return f


def route_last_expert_dropped(fn):
    """The last expert is never considered (a loop bound of E-1)."""
    @_wraps(fn)
    def f(logits, top_k, method, *, bias=None, **kw):
        x = logits.clone()
        x[:, -1] = float("-inf")
        return fn(x, top_k, method, bias=bias, **kw)
    return f


def route_nan_last(fn):
    """NaN ranked below everything (a comparison that is false for NaN)."""
    @_wraps(fn)
    def f(logits, top_k, method, **kw):
        x = torch.where(torch.isnan(logits), torch.full_like(logits, float("-inf")), logits)
        return fn(x, top_k, method, **kw)
    return f


def route_no_renormalize(fn):
    """renormalize ignored."""
    @_wraps(fn)
    def f(logits, top_k, method, *, renormalize=False, **kw):
        return fn(logits, top_k, method, renormalize=False, **kw)
    return f


def route_norm_eps_ignored(fn):
    """norm_eps ignored: every normalization with its method's default epsilon."""
    @_wraps(fn)
    def f(logits, top_k, method, *, norm_eps=None, **kw):
        return fn(logits, top_k, method, **kw)
    return f


def route_scaling_only_biased(fn):
    """scaling applied by the biased sigmoid methods only (the rule before SPEC 6)."""
    @_wraps(fn)
    def f(logits, top_k, method, *, scaling=1.0, **kw):
        keep = method in ("sigmoid_bias", "grouped_sigmoid_bias")
        return fn(logits, top_k, method, scaling=scaling if keep else 1.0, **kw)
    return f


def route_grouped_softmax_top2(fn):
    """grouped_softmax scoring each group by the sum of its two largest p (DeepSeek-V3's rule)
    instead of the largest (DeepSeek-V2's group_limited_greedy): a kernel that reused the
    grouped_sigmoid_bias group pass. Everything else as SPEC 6 says, built from the
    reference's helpers."""
    from reference.route import _group_mask_keys, _softmax, _sum, _topk_total_order

    @_wraps(fn)
    def f(logits, top_k, method, *, n_group=1, topk_group=1, scaling=1.0, renormalize=None, **kw):
        if method != "grouped_softmax":
            return fn(logits, top_k, method, n_group=n_group, topk_group=topk_group, scaling=scaling,
                      renormalize=renormalize, **kw)
        fn(logits, top_k, method, n_group=n_group, topk_group=topk_group, scaling=scaling,
           renormalize=renormalize, **kw)                       # (its validation and errors)
        keys = _group_mask_keys(_softmax(logits.float()), n_group, topk_group, top_n=2)
        sel = _topk_total_order(keys, top_k)
        w = keys.gather(-1, sel)
        if renormalize:
            w = w / _sum(w)
        w = w * torch.tensor(scaling, dtype=torch.float32, device=w.device)
        return w.contiguous(), sel.to(torch.int32).contiguous()
    return f


# ============================================================================ permute
def _segments(out):
    offsets = out.offsets.tolist()
    counts = []
    for e in range(len(offsets) - 1):
        seg = out.src_row[offsets[e]:offsets[e + 1]]
        counts.append(int((seg >= 0).sum()))
    return offsets, counts


def permute_neighbour_row(fn):
    """The last used row is a copy of its neighbour (an off-by-one in the copy loop)."""
    @_wraps(fn)
    def f(*args, **kw):
        out = fn(*args, **kw)
        P = int(out.offsets[-1])
        if P >= 2 and out.hidden.shape[1]:
            out.hidden[P - 1] = out.hidden[P - 2]
        return out
    return f


def permute_unstable(fn):
    """Rows within each expert segment in decreasing r (a non-stable sort)."""
    @_wraps(fn)
    def f(*args, **kw):
        out = fn(*args, **kw)
        offsets, counts = _segments(out)
        for e, n in enumerate(counts):
            if n < 2:
                continue
            a = offsets[e]
            idx = torch.arange(a, a + n, device=out.src_row.device)
            rev = idx.flip(0)
            src = out.src_row[rev].clone()
            out.hidden[idx] = out.hidden[rev].clone()
            out.src_row[idx] = src
            out.dst_pos[src.long()] = idx.to(out.dst_pos.dtype)
        return out
    return f


def permute_padding_garbage(fn):
    """Padding and unused rows left as they were (here: ones) instead of zeroed."""
    @_wraps(fn)
    def f(*args, **kw):
        out = fn(*args, **kw)
        pad = out.src_row < 0
        if bool(pad.any()) and out.hidden.shape[1]:
            out.hidden[pad] = 1.0
        return out
    return f


def permute_last_expert_dropped(fn):
    """Rows of the last global expert are dropped (a loop bound of E-1)."""
    @_wraps(fn)
    def f(hidden, ids, n_experts, **kw):
        ids = torch.where(ids == n_experts - 1, torch.full_like(ids, -1), ids)
        return fn(hidden, ids, n_experts, **kw)
    return f


# ============================================================================ unpermute
def unpermute_ignore_weights(fn):
    """The routing weights are not applied."""
    @_wraps(fn)
    def f(expert_out, weights, dst_pos):
        return fn(expert_out, torch.ones_like(weights), dst_pos)
    return f


def unpermute_reverse_order(fn):
    """Accumulates j in decreasing order (SPEC fixes increasing j)."""
    @_wraps(fn)
    def f(expert_out, weights, dst_pos):
        T, K = weights.shape
        return fn(expert_out, weights.flip(1).contiguous(), dst_pos.reshape(T, K).flip(1).reshape(-1).contiguous())
    return f


def unpermute_dropped_as_row0(fn):
    """A dropped row (dst_pos = -1) read as row 0 instead of skipped."""
    @_wraps(fn)
    def f(expert_out, weights, dst_pos):
        return fn(expert_out, weights, dst_pos.clamp(min=0))
    return f


# ============================================================================ GEMMs
def router_gemm_column_off(fn):
    """One output column off by a relative 2^-10 (the tightness requirement of SPEC)."""
    @_wraps(fn)
    def f(x, weight):
        y = fn(x, weight)
        c = weight.shape[0] // 2
        y[:, c] = y[:, c] * (1.0 + TWO_M10)
        return y
    return f


def router_gemm_x_to_bf16(fn):
    """f32 activations squeezed through bf16 (a wrong cast in the load)."""
    @_wraps(fn)
    def f(x, weight):
        return fn(x.to(torch.bfloat16), weight)
    return f


def router_gemm_h_tail_skipped(fn):
    """The last H % 16 columns (the vector tail) are skipped."""
    @_wraps(fn)
    def f(x, weight):
        H = x.shape[1]
        tail = H % 16
        if tail:
            x = x.clone()
            x[:, H - tail:] = 0
        return fn(x, weight)
    return f


def linear_odd_tail_skipped(fn):
    """For odd N the last output column is never written (zero here)."""
    @_wraps(fn)
    def f(x, weight, bias=None):
        y = fn(x, weight, bias)
        if weight.shape[0] % 2:
            y[:, -1] = 0
        return y
    return f


def linear_bias_ignored(fn):
    """The bias is not added."""
    @_wraps(fn)
    def f(x, weight, bias=None):
        return fn(x, weight, None)
    return f


def linear_k_tail_skipped(fn):
    """The last K % 8 elements of each dot product are skipped."""
    @_wraps(fn)
    def f(x, weight, bias=None):
        K = x.shape[1]
        tail = K % 8
        if tail:
            x = x.clone()
            x[:, K - tail:] = 0
        return fn(x, weight, bias)
    return f


def gate_split_off_by_one(fn):
    """The fused output is split one column late for the shared gate."""
    @_wraps(fn)
    def f(x, router_weight, shared_gate_weight):
        r, s = fn(x, router_weight, shared_gate_weight)
        y = torch.cat([r, s], dim=1)
        E, S = r.shape[1], s.shape[1]
        return r, y[:, E - 1:E - 1 + S].contiguous()
    return f


def gate_stale_shared_weight(fn):
    """The concatenated weight was not rebuilt after a reload of the shared gate weight
    (the old weight, here half the new one, is used)."""
    @_wraps(fn)
    def f(x, router_weight, shared_gate_weight):
        return fn(x, router_weight, shared_gate_weight * 0.5)
    return f


# ============================================================================ fused_experts
def _swap_halves(w, s, quant):
    I2 = w.shape[1]
    I = I2 // 2
    w = torch.cat([w[:, I:], w[:, :I]], dim=1).contiguous()
    if s is not None:
        if quant == "fp8_block":
            if I % 128:
                return None
            b = I // 128
            s = torch.cat([s[:, b:], s[:, :b]], dim=1).contiguous()
        else:
            s = torch.cat([s[:, I:], s[:, :I]], dim=1).contiguous()
    return w, s


def experts_gate_up_swapped(fn):
    """silu applied to the up half and multiplied by the gate half."""
    @_wraps(fn)
    def f(x, w13, w2, topk_weights, topk_ids, *, quant, w13_scale=None, w13_bias=None, **kw):
        sw = _swap_halves(w13, w13_scale, quant)
        if sw is not None:
            w13, w13_scale = sw
            if w13_bias is not None:
                I = w13_bias.shape[1] // 2
                w13_bias = torch.cat([w13_bias[:, I:], w13_bias[:, :I]], dim=1).contiguous()
        return fn(x, w13, w2, topk_weights, topk_ids, quant=quant, w13_scale=w13_scale, w13_bias=w13_bias, **kw)
    return f


def experts_no_clamp(fn):
    """swiglu_oai without its clamp (limit ignored)."""
    @_wraps(fn)
    def f(*args, limit=7.0, **kw):
        return fn(*args, limit=1e30, **kw)
    return f


def experts_fp8_scale_off_by_one(fn):
    """fp8 block scale read from the next block along K (index k // 128 + 1, clamped)."""
    @_wraps(fn)
    def f(*args, quant, w13_scale=None, w2_scale=None, **kw):
        if quant == "fp8_block":
            def shift(s):
                return torch.cat([s[..., 1:], s[..., -1:]], dim=-1).contiguous()
            w13_scale, w2_scale = shift(w13_scale), shift(w2_scale)
        return fn(*args, quant=quant, w13_scale=w13_scale, w2_scale=w2_scale, **kw)
    return f


def experts_nibbles_swapped(fn):
    """mxfp4: the high nibble decoded as the even element."""
    @_wraps(fn)
    def f(x, w13, w2, *args, quant, **kw):
        if quant == "mxfp4":
            sw = lambda p: ((p >> 4) | (p << 4)).contiguous()
            w13, w2 = sw(w13), sw(w2)
        return fn(x, w13, w2, *args, quant=quant, **kw)
    return f


def experts_last_expert_dropped(fn):
    """Rows of the last expert are never computed."""
    @_wraps(fn)
    def f(x, w13, w2, topk_weights, topk_ids, **kw):
        E = w13.shape[0]
        ids = torch.where(topk_ids == E - 1, torch.full_like(topk_ids, -1), topk_ids)
        return fn(x, w13, w2, topk_weights, ids, **kw)
    return f


def experts_weights_ignored(fn):
    """The routing weights are not applied to the expert outputs."""
    @_wraps(fn)
    def f(x, w13, w2, topk_weights, topk_ids, **kw):
        return fn(x, w13, w2, torch.ones_like(topk_weights), topk_ids, **kw)
    return f


def experts_policy_dependent(fn):
    """The blocked micro-kernel rounds differently from tiny (last bit of one column): within
    the tolerance, but a token's bits then depend on the policy (SPEC's batch invariance)."""
    @_wraps(fn)
    def f(x, w13, w2, topk_weights, topk_ids, **kw):
        y = fn(x, w13, w2, topk_weights, topk_ids, **kw)
        if kw.get("dispatch") == "blocked" and y.numel():
            y = y.clone()
            y[:, 0] = (y[:, 0].view(torch.int16) ^ 1).view(y.dtype)
        return y
    return f


def _round_bf16(v):
    from reference.quant import round_to_bf16
    return round_to_bf16(v)


def experts_input_weight_unrounded(fn):
    """apply_router_weight_on_input: the input scaled by the f32 weight, bf16(x * w), instead of
    bf16(x * bf16(w)) (the weight not rounded to bf16 first). Emulated exactly at K = 1 (the
    scaled rows through the unflagged kernel with weight 1); other calls pass through."""
    @_wraps(fn)
    def f(x, w13, w2, topk_weights, topk_ids, *, apply_router_weight_on_input=False, **kw):
        if not apply_router_weight_on_input or topk_ids.shape[1] != 1:
            return fn(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=apply_router_weight_on_input, **kw)
        xs = _round_bf16(x.double() * topk_weights.double())
        return fn(xs, w13, w2, torch.ones_like(topk_weights), topk_ids, **kw)
    return f


def experts_weight_on_input_and_output(fn):
    """apply_router_weight_on_input: the weight applied twice, to the input and again in the
    combine. Emulated exactly at K = 1 (the correctly scaled rows through the unflagged, weighted
    kernel); other calls pass through."""
    @_wraps(fn)
    def f(x, w13, w2, topk_weights, topk_ids, *, apply_router_weight_on_input=False, **kw):
        if not apply_router_weight_on_input or topk_ids.shape[1] != 1:
            return fn(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=apply_router_weight_on_input, **kw)
        xs = _round_bf16(x.double() * _round_bf16(topk_weights.double()).double())
        return fn(xs, w13, w2, topk_weights, topk_ids, **kw)
    return f


def experts_input_weight_ignored(fn):
    """apply_router_weight_on_input: the gather forgets the weight (input x, output unweighted)."""
    @_wraps(fn)
    def f(x, w13, w2, topk_weights, topk_ids, *, apply_router_weight_on_input=False, **kw):
        if apply_router_weight_on_input:
            topk_weights = torch.ones_like(topk_weights)
        return fn(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=apply_router_weight_on_input, **kw)
    return f


# ============================================================================ batch invariance
def router_gemm_batch_dependent(fn):
    """A library GEMM for batches above 8 tokens (another summation order: last bits move),
    as a dispatcher that forgets batch-invariant mode would do."""
    @_wraps(fn)
    def f(x, weight):
        if x.shape[0] > 8:
            return torch.nn.functional.linear(x.double(), weight.double()).float()
        return fn(x, weight)
    return f


def route_variant_outside_mode(fn):
    """Weights one f32 ulp off for batches of several tokens unless batch-invariant mode is
    on: an op declared invariant by construction that is so only in the mode."""
    @_wraps(fn)
    def f(logits, top_k, method, **kw):
        w, ids = fn(logits, top_k, method, **kw)
        from optimized import dispatch
        if logits.shape[0] > 1 and not dispatch.batch_invariant() and w.numel():
            w = torch.nextafter(w, torch.full_like(w, 2.0))
        return w, ids
    return f


# ============================================================================ moe_forward
def moe_bias_ignored(fn):
    """The selection bias of sigmoid_bias routing is dropped."""
    @_wraps(fn)
    def f(*args, bias=None, **kw):
        return fn(*args, bias=None if bias is None else torch.zeros_like(bias), **kw)
    return f


def moe_last_expert_dropped(fn):
    """The last expert never wins the router (its logits pushed to -inf)."""
    @_wraps(fn)
    def f(x, router_weight, *args, **kw):
        rw = router_weight.clone()
        rw[-1] = 0.0
        rw[-1, 0] = -1e30        # feature 0 of verify's moe cases is a constant 1
        return fn(x, rw, *args, **kw)
    return f


def moe_nibbles_swapped(fn):
    @_wraps(fn)
    def f(x, router_weight, w13, w2, *, quant, **kw):
        if quant == "mxfp4":
            sw = lambda p: ((p >> 4) | (p << 4)).contiguous()
            w13, w2 = sw(w13), sw(w2)
        return fn(x, router_weight, w13, w2, quant=quant, **kw)
    return f


def moe_topk_minus_one(fn):
    """One expert too few per token (K - 1 slots used)."""
    @_wraps(fn)
    def f(*args, top_k, **kw):
        return fn(*args, top_k=max(1, top_k - 1), **kw)
    return f


MUTANTS: List[Mutant] = [
    Mutant("route.ties_high_index", "route", "ties broken toward the higher expert index", route_ties_high_index,
           dists=("exact_ties",)),
    Mutant("route.last_expert_dropped", "route", "the last expert is never selected", route_last_expert_dropped,
           dists=("uniform", "all_to_one")),
    Mutant("route.nan_last", "route", "NaN logits rank last instead of first", route_nan_last, dists=("nan_inf",),
           fixed={"method": "topk_softmax"}),
    Mutant("route.no_renormalize", "route", "renormalize=True ignored", route_no_renormalize,
           dists=("uniform", "zipf"), fixed={"method": "softmax_topk", "renormalize": True}),
    # SPEC 6: only the December draws (norm_eps, scaling on every method, grouped_softmax) kill these
    Mutant("route.norm_eps_ignored", "route", "norm_eps ignored (the default epsilon used)", route_norm_eps_ignored,
           dists=("uniform", "zipf"), fixed={"method": "sigmoid_bias", "renormalize": None, "norm_eps": 0.75}),
    Mutant("route.scaling_only_biased", "route", "scaling ignored outside the biased sigmoid methods",
           route_scaling_only_biased, dists=("uniform", "zipf"), fixed={"method": "softmax_bias", "scaling": 2.5}),
    Mutant("route.grouped_softmax_top2", "route", "grouped_softmax groups scored by their top-2 sum",
           route_grouped_softmax_top2, dists=("uniform", "zipf"), fixed={"method": "grouped_softmax"}),
    Mutant("permute.neighbour_row", "permute", "one permuted row copied from its neighbour", permute_neighbour_row,
           dists=("uniform",)),
    Mutant("permute.unstable", "permute", "rows within a segment not in increasing r", permute_unstable,
           dists=("uniform", "hot_expert")),
    Mutant("permute.padding_garbage", "permute", "padding rows not zeroed", permute_padding_garbage,
           dists=("ep_shard", "uniform")),
    Mutant("permute.last_expert_dropped", "permute", "rows of the last expert dropped", permute_last_expert_dropped,
           dists=("uniform", "all_to_one")),
    Mutant("unpermute.ignore_weights", "unpermute", "routing weights not applied", unpermute_ignore_weights,
           dists=("uniform",)),
    Mutant("unpermute.reverse_order", "unpermute", "accumulates j in decreasing order", unpermute_reverse_order,
           dists=("uniform",), fixed={"dtype": "float32"}),
    Mutant("unpermute.dropped_as_row0", "unpermute", "dropped rows read as row 0", unpermute_dropped_as_row0,
           dists=("ep_shard",)),
    Mutant("router_gemm.column_off_2^-10", "router_gemm", "one logit column off by a relative 2^-10",
           router_gemm_column_off, dists=("uniform", "zipf")),
    Mutant("router_gemm.x_to_bf16", "router_gemm", "f32 x squeezed through bf16", router_gemm_x_to_bf16,
           dists=("uniform",), fixed={"x_dtype": "float32"}),
    Mutant("router_gemm.h_tail_skipped", "router_gemm", "the H % 16 tail skipped", router_gemm_h_tail_skipped,
           dists=("uniform",)),
    Mutant("skinny_gemm.odd_tail_skipped", "skinny_gemm", "last column of an odd N not written",
           linear_odd_tail_skipped, dists=("uniform",)),
    Mutant("skinny_gemm.bias_ignored", "skinny_gemm", "bias not added", linear_bias_ignored, dists=("uniform",),
           fixed={"bias": True}),
    Mutant("skinny_gemm.k_tail_skipped", "skinny_gemm", "the K % 8 tail skipped", linear_k_tail_skipped,
           dists=("uniform",)),
    Mutant("unquantized_gemm.odd_tail_skipped", "unquantized_gemm", "last column of an odd N not written",
           linear_odd_tail_skipped, dists=("uniform",)),
    Mutant("unquantized_gemm.bias_ignored", "unquantized_gemm", "bias not added", linear_bias_ignored,
           dists=("uniform",), fixed={"bias": True}),
    Mutant("fused_gate_gemm.split_off_by_one", "fused_gate_gemm", "shared gate split one column late",
           gate_split_off_by_one, dists=("uniform",)),
    Mutant("fused_gate_gemm.stale_shared_weight", "fused_gate_gemm", "stale concatenated weight after a reload",
           gate_stale_shared_weight, dists=("uniform",)),
    Mutant("fused_experts.gate_up_swapped", "fused_experts", "silu's gate and up halves swapped",
           experts_gate_up_swapped, dists=("uniform",), fixed={"activation": "silu", "quant": "bf16"}),
    Mutant("fused_experts.swiglu_no_clamp", "fused_experts", "swiglu_oai's clamp missing", experts_no_clamp,
           dists=("uniform",), fixed={"activation": "swiglu_oai"}),
    Mutant("fused_experts.fp8_scale_off_by_one", "fused_experts", "fp8 scale block index off by one",
           experts_fp8_scale_off_by_one, dists=("uniform",), fixed={"quant": "fp8_block", "H": 384}),
    Mutant("fused_experts.mxfp4_nibbles_swapped", "fused_experts", "mxfp4 nibbles swapped", experts_nibbles_swapped,
           dists=("uniform",), fixed={"quant": "mxfp4"}),
    Mutant("fused_experts.last_expert_dropped", "fused_experts", "the last expert's rows skipped",
           experts_last_expert_dropped, dists=("uniform", "all_to_one")),
    Mutant("fused_experts.weights_ignored", "fused_experts", "routing weights not applied", experts_weights_ignored,
           dists=("uniform",)),
    Mutant("fused_experts.input_weight_unrounded", "fused_experts",
           "apply_router_weight_on_input: input scaled by the f32 weight, not bf16(w)", experts_input_weight_unrounded,
           fixed={"on_input": True, "K": 1}),
    Mutant("fused_experts.weight_on_input_and_output", "fused_experts",
           "apply_router_weight_on_input: weight applied to the input and again to the output",
           experts_weight_on_input_and_output, fixed={"on_input": True, "K": 1}),
    Mutant("fused_experts.input_weight_ignored", "fused_experts",
           "apply_router_weight_on_input: the input not scaled", experts_input_weight_ignored,
           fixed={"on_input": True}),
    Mutant("moe_forward.bias_ignored", "moe_forward", "routing bias ignored in the selection", moe_bias_ignored,
           dists=("uniform",), fixed={"method": "sigmoid_bias"}),
    Mutant("moe_forward.last_expert_dropped", "moe_forward", "the last expert never routed to",
           moe_last_expert_dropped, dists=("uniform", "zipf")),
    Mutant("moe_forward.mxfp4_nibbles_swapped", "moe_forward", "mxfp4 nibbles swapped", moe_nibbles_swapped,
           dists=("uniform",), fixed={"quant": "mxfp4"}),
    Mutant("moe_forward.topk_minus_one", "moe_forward", "one expert too few per token", moe_topk_minus_one,
           dists=("uniform",)),
    # batch invariance (SPEC): accurate everywhere, killed only by the bitwise property
    Mutant("fused_experts.policy_dependent", "fused_experts", "blocked's bits differ from tiny's (within tolerance)",
           experts_policy_dependent, dists=("uniform",), fixed={"dispatch": "auto", "bi": True, "quant": "bf16"},
           kind="batch_invariance"),
    Mutant("router_gemm.batch_dependent", "router_gemm", "another summation order above 8 tokens",
           router_gemm_batch_dependent, dists=("uniform",), fixed={"bi": True, "x_dtype": "float32"},
           kind="batch_invariance"),
    Mutant("route.variant_outside_mode", "route", "batch dependent unless batch_invariant_mode is on",
           route_variant_outside_mode, dists=("uniform",), fixed={"bi": True, "method": "softmax_topk"},
           kind="batch_invariance"),
]


# The MoE layer of every model family (verify/families.py): a stage kernel and a composition bug.
MUTANTS += family_mutants(Mutant)


def all_mutants() -> List[Mutant]:
    for m in MUTANTS:
        if m not in REGISTRY[m.op].mutants:
            REGISTRY[m.op].mutants.append(m)
    return list(MUTANTS)
