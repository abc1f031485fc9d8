"""The transformers MoE blocks of the family presets (reference/families.py): build one, run it,
convert its weights to moelab's layout, and read its own routing.

    build_block(config)           -> the transformers MoE block with random weights, eval mode
    run_block(block, x)           -> block(x) as a tensor
    transformers_bf16(block)      -> a bf16 copy as transformers loads a bf16 model
    convert_block(block, family)  -> MoEWeights, moelab's layout (moe_forward's arguments)
    transformers_route(block, family, x) -> the block's own routing weights and ids

The presets say which arguments of moe_forward compute a block's function; this module is
where the transformers modeling code itself is touched (tests/test_families.py holds the two
to each other, optimized/hf.py converts a loaded model with convert_block).
"""
from __future__ import annotations

import copy
import importlib
import math
import re

import torch

from .families import _COMPOSITE, Family, MoEWeights, from_config
from .moe import SharedExpert

__all__ = ["build_block", "run_block", "transformers_bf16", "convert_block", "transformers_route"]


# ----------------------------------------------------------------------------- transformers blocks
def _block_class(family: Family):
    module, _, cls = family.block.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def _hf_config(config: dict):
    from transformers import AutoConfig
    cfg = dict(config)
    mt = cfg.pop("model_type")
    hf = AutoConfig.for_model(mt, **cfg)
    hf._experts_implementation = "eager"     # the modeling file's own loop, no warning
    return hf


def _round_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def build_block(config: dict, dtype=torch.float64, seed=0) -> torch.nn.Module:
    """The transformers MoE block of `config`'s family, random weights, eval mode, in `dtype`.

    Every floating parameter and buffer is drawn (router weights, experts, shared expert and its
    gate, router and expert biases, e_score_correction_bias / expert_bias) from a generator seeded
    with `seed`, and rounded to bf16-representable values, so that a bf16 copy of the block holds
    exactly the weights of the float64 one (the bf16 comparison then measures arithmetic only).
    Scales: weights ~ N(0, 1/fan_in) (the router's x2, so routing is decisive), biases ~ N(0, 0.1^2),
    selection biases ~ N(0, 0.05^2) (the shared-gate x1).
    """
    fam = from_config(config)
    hf = _hf_config(config if config.get("model_type") not in _COMPOSITE else
                    dict(config["text_config"], model_type=_COMPOSITE[config["model_type"]]))
    cls = _block_class(fam)
    block = cls(hf)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = list(block.named_parameters()) + list(block.named_buffers())
        for name, t in sorted(tensors, key=lambda nt: nt[0]):
            if not t.is_floating_point():
                continue
            leaf = name.rsplit(".", 1)[-1]
            if "correction_bias" in name or leaf == "expert_bias":
                std = 0.05
            elif leaf.endswith("bias"):
                std = 0.1
            else:
                fan_in = _fan_in(name, t, fam)
                std = (2.0 if _is_router(name) else 1.0) / math.sqrt(fan_in)
            t.copy_(_round_bf16(torch.randn(t.shape, generator=gen, dtype=torch.float64) * std).to(t.dtype))
    return block.to(dtype).eval()


def _is_router(name: str) -> bool:
    return bool(re.match(r"^(gate|router)(\.|$)", name)) and "shared" not in name


def _fan_in(name: str, t: torch.Tensor, fam: Family) -> int:
    leaf = name.rsplit(".", 1)[-1]
    if t.dim() == 3:                           # experts [E, out, in] or transposed [E, in, out]
        transposed = fam.name in ("gpt_oss", "aria", "llama4")
        return t.shape[1] if transposed else t.shape[2]
    if t.dim() == 2:                           # Linear [out, in]; Ernie's bias [1, E] is handled above
        return t.shape[1]
    return max(t.shape[-1], 1)


def run_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """block(x) as a tensor: GPT-OSS and Llama 4 return (hidden, router output) tuples."""
    with torch.no_grad():
        out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(x.shape)                 # Llama 4 returns [tokens, H]


def transformers_bf16(block: torch.nn.Module) -> torch.nn.Module:
    """A bf16 copy of `block` as transformers loads a bf16 model: everything bf16 except the
    parameters/buffers its model keeps in float32 (_keep_in_fp32_modules[_strict], e.g. DeepSeek-V3's
    gate.weight and e_score_correction_bias)."""
    mod = importlib.import_module(type(block).__module__)
    keep = set()
    for obj in vars(mod).values():
        if isinstance(obj, type):
            for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
                keep.update(getattr(obj, attr, None) or ())
    out = copy.deepcopy(block).to(torch.bfloat16)
    with torch.no_grad():
        for name, t in list(out.named_parameters()) + list(out.named_buffers()):
            if t.is_floating_point() and any(re.search(r"(^|\.)" + re.escape(p) + r"($|\.)", name) for p in keep):
                src = dict(list(block.named_parameters()) + list(block.named_buffers()))[name]
                t.data = src.detach().to(torch.float32)
    return out


# ----------------------------------------------------------------------------- conversion
def _router(block, family: Family):
    """(router weight [E, H], router bias or None, selection bias or None) of a block, as stored."""
    name = family.name
    if name == "gpt_oss":
        return block.router.weight, block.router.bias, None
    if name == "llama4":
        return block.router.weight, None, None
    if name == "afmoe":
        return block.router.gate.weight, None, block.expert_bias
    if name in ("granitemoe", "aria", "jamba"):
        return block.router.weight, None, None
    if name == "hunyuan_v1_moe":
        return block.gate.wg.weight, None, None
    if name in ("minimax_m2", "hy_v3"):
        return block.gate.weight, None, block.e_score_correction_bias
    if name == "lfm2_moe":
        bias = block.expert_bias if block.use_expert_bias else torch.zeros_like(block.gate.weight[:, 0])
        return block.gate.weight, None, bias
    if name == "ernie4_5_moe":
        return block.gate.weight, None, block.gate.moe_statics.e_score_correction_bias.reshape(-1)
    if family.route_bias:
        return block.gate.weight, None, block.gate.e_score_correction_bias
    return block.gate.weight, None, None


def _shared_module(block):
    for attr in ("shared_expert", "shared_experts", "shared_mlp"):
        m = getattr(block, attr, None)
        if m is not None:
            return m
    return None


def convert_block(block, family: Family, dtype=torch.bfloat16) -> MoEWeights:
    """A transformers MoE block -> MoEWeights in moelab's layout.

    dtype torch.float64: exact-mode weights (everything float64). torch.bfloat16: the standard
    layer (router weight, router bias, selection bias, expert and shared biases and the shared
    gate float32; expert and shared-expert matrices bf16). Layout: w13 [E, 2I, H] with the gate
    rows first for silu (transformers' gate_up_proj [E, 2I, H] as is; transposed stores
    [E, H, 2I] are transposed), GPT-OSS's interleaved gate/up kept interleaved (swiglu_oai reads
    h[0::2], h[1::2]); w2 [E, H, I]; Ernie's [1, E] bias flattened; the shared MLP's gate_proj and
    up_proj stacked into its w13, its down_proj times shared_scale into its w2.
    """
    if dtype not in (torch.float64, torch.bfloat16):
        raise ValueError(f"convert_block: argument 'dtype' must be torch.float64 or torch.bfloat16, got {dtype}")
    exact = dtype == torch.float64
    small = torch.float64 if exact else torch.float32     # router, biases, gate

    def mat(t):
        return t.detach().to(torch.float64).to(dtype).contiguous()

    def vec(t):
        return None if t is None else t.detach().to(torch.float64).to(small).contiguous()

    rw, rb, sb = _router(block, family)
    ex = block.experts
    if family.name in ("gpt_oss", "aria", "llama4"):      # [E, H, 2I] and [E, I, H]
        w13, w2 = ex.gate_up_proj.transpose(1, 2), ex.down_proj.transpose(1, 2)
    else:
        w13, w2 = ex.gate_up_proj, ex.down_proj
    w13_bias = w2_bias = None
    if family.expert_bias:
        w13_bias, w2_bias = ex.gate_up_proj_bias, ex.down_proj_bias

    shared = None
    sm = _shared_module(block)
    if family.shared_I and sm is not None:
        if hasattr(sm, "gate_proj"):
            g, u, d = sm.gate_proj, sm.up_proj, sm.down_proj
        else:                                             # LFM2-style w1/w3/w2 naming
            g, u, d = sm.w1, sm.w3, sm.w2
        s13 = torch.cat([g.weight, u.weight], 0).unsqueeze(0)
        s2 = (d.weight.to(torch.float64) * family.shared_scale).unsqueeze(0)
        s13b = s2b = None
        if g.bias is not None:
            s13b = torch.cat([g.bias, u.bias], 0).unsqueeze(0)
            s2b = (d.bias.to(torch.float64) * family.shared_scale).unsqueeze(0)
        gate = block.shared_expert_gate.weight if family.shared_gate else None
        shared = SharedExpert(w13=mat(s13), w2=mat(s2), quant="bf16", w13_bias=vec(s13b), w2_bias=vec(s2b),
                              gate=vec(gate))
    return MoEWeights(router_weight=vec(rw), router_bias=vec(rb), bias=vec(sb), w13=mat(w13), w2=mat(w2),
                      w13_bias=vec(w13_bias), w2_bias=vec(w2_bias), shared=shared)


# ----------------------------------------------------------------------------- transformers' routing
def transformers_route(block, family: Family, x: torch.Tensor):
    """The transformers router's own (weights [T, K], ids [T, K] int64) for x [..., H], as it
    hands them to its experts (unsorted where it uses torch.topk(sorted=False)), times any factor
    the block applies to the routed output after its experts (Cohere2's "average": 0.5), so that
    they are comparable with route's weights for the family."""
    h = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        name = family.name
        if name == "llama4":
            scores, _ = block.router(h)                          # [T, E], 0 off the selection
            ids = torch.topk(scores, family.top_k, dim=1).indices
            return scores.gather(1, ids), ids
        if hasattr(block, "route_tokens_to_experts"):           # Jamba in older transformers 5.x
            out = block.route_tokens_to_experts(h, block.router(h))
        elif name in ("gpt_oss", "granitemoe", "aria", "jamba"):
            out = block.router(h)
        elif name == "afmoe":
            out = block.router(h.unsqueeze(0), block.expert_bias)
        elif name in ("minimax_m2", "hy_v3"):
            out = block.gate(h, block.e_score_correction_bias)
        elif name == "lfm2_moe":
            out = block.gate(h, block.expert_bias if block.use_expert_bias else None)
        else:
            out = block.gate(h)
    # (logits, weights, ids) in most versions; Aria's router has returned (ids, weights, logits):
    # the ids are the integer tensor, the weights the float one of the same shape.
    ids = next(t for t in out if not t.is_floating_point())
    w = next(t for t in out if t.is_floating_point() and t.shape == ids.shape)
    if family.shared_scale != 1.0 and getattr(block, "shared_expert_combination_strategy", "") == "average":
        w = w * 0.5                 # Cohere2 halves (routed + shared) after the router: route's scaling 0.5
    return w, ids
