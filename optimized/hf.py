"""A transformers model on moelab kernels: swap every MoE block for the optimized layer.

    from transformers import AutoModelForCausalLM
    import optimized.hf
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)   # or from_pretrained
    replaced = optimized.hf.patch_moe_blocks(model)          # weights converted once, prepacked
    logits = model(input_ids).logits                          # the MoE layers now run moelab's kernels

What happens:
- The family comes from the model's config (`reference.families.from_config`, the text config of a
  multimodal model); every module of that family's MoE block class is found.
- Each block's weights are converted once to moelab's layout (`reference.transformers_blocks.convert_block`:
  gate/up order and interleaving, transposes, biases, shared experts), optionally quantized
  (`quant="fp8_block"` or `"mxfp4"`, by the reference quantizers), and prepacked into the CPU
  kernels' layout (`optimized.prepack_moe_weights`); the transformers parameters are then
  dropped from the block's place in the model (the layer keeps only its own copies).
- The block is replaced by a `MoELayer`, whose forward is `reference.moe.moe_forward(...,
  ops=optimized)` with the family's arguments: router_gemm, route, fused_experts (and a
  one-expert fused_experts for the shared expert). Hidden states are taken in any float dtype,
  computed in bf16 (the layer's contract) and returned in the input's dtype and shape.
- Blocks that return a tuple in transformers (Llama 4's, GPT-OSS's: (out, router_logits)) get
  (out, None): the router logits feed only the training-time auxiliary loss, which a patched
  model does not support (`output_router_logits=True` raises).

The result is the family's bf16 layer (docs/families.md): within the bf16 tolerance of the
unpatched model's MoE blocks, not bit-identical to them (transformers rounds at other points).
"""
from __future__ import annotations

from typing import List, Optional

import torch

import optimized
from reference.families import Family, MoEWeights, from_config, layer_kwargs
from reference.moe import SharedExpert, moe_forward
from reference.quant import quantize_fp8_block, quantize_mxfp4
from reference.transformers_blocks import convert_block
from reference.validate import QUANT_FORMATS, check_choice

__all__ = ["MoELayer", "patch_moe_blocks", "find_moe_blocks"]


def _quantize(w: torch.Tensor, quant: str):
    """bf16 [E, N, K] -> (weights, scale) in `quant`'s layout (reference quantizers)."""
    if quant == "bf16":
        return w.to(torch.bfloat16).contiguous(), None
    q = quantize_fp8_block if quant == "fp8_block" else quantize_mxfp4
    return q(w.to(torch.float32))


class MoELayer(torch.nn.Module):
    """One MoE layer of a family on moelab's optimized kernels (module docstring).

    Holds the converted weights (prepacked for the CPU kernels when `prepack`), the family's
    arguments, and nothing of the transformers block. The weights are plain attributes, not
    parameters or buffers: the layer is for CPU inference, `state_dict()` does not hold them and
    `.to(device)` does not move them (load, then patch). forward(hidden_states[..., H]) -> same
    shape and dtype (a tuple (out, None) when the replaced block returned one).
    """

    def __init__(self, family: Family, weights: MoEWeights, *, quant: str = "bf16", prepack: bool = True,
                 dispatch: str = "auto", returns_tuple: bool = False):
        super().__init__()
        check_choice("MoELayer", "quant", quant, QUANT_FORMATS)
        self.family, self.quant, self.dispatch, self.returns_tuple = family, quant, dispatch, returns_tuple
        self.router_weight = weights.router_weight.to(torch.float32).contiguous()
        self.router_bias = None if weights.router_bias is None else weights.router_bias.to(torch.float32)
        self.route_bias = None if weights.bias is None else weights.bias.to(torch.float32)
        self.w13_bias, self.w2_bias = weights.w13_bias, weights.w2_bias
        self.w13, self.w2, self.w13_scale, self.w2_scale = self._experts(weights.w13, weights.w2, quant, prepack)
        self.shared: Optional[SharedExpert] = None
        if weights.shared is not None:
            s = weights.shared
            w13, w2, s13, s2 = self._experts(s.w13, s.w2, quant, prepack)
            gate = None if s.gate is None else s.gate.to(torch.float32).contiguous()
            self.shared = SharedExpert(w13, w2, quant=quant, w13_scale=s13, w2_scale=s2, w13_bias=s.w13_bias,
                                       w2_bias=s.w2_bias, gate=gate, activation=s.activation)
        self.H = self.router_weight.shape[1]

    @staticmethod
    def _experts(w13, w2, quant, prepack):
        q13, s13 = _quantize(w13, quant)
        q2, s2 = _quantize(w2, quant)
        if prepack:
            return optimized.prepack_moe_weights(q13, q2, quant, s13, s2), None, None, None
        return q13, q2, s13, s2

    def extra_repr(self) -> str:
        return f"family={self.family.name}, quant={self.quant}, H={self.H}, E={self.router_weight.shape[0]}"

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        shape, dtype = hidden_states.shape, hidden_states.dtype
        x = hidden_states.reshape(-1, shape[-1]).to(torch.bfloat16)
        kw = layer_kwargs(self.family)
        out = moe_forward(x, self.router_weight, self.w13, self.w2, bias=self.route_bias,
                          router_bias=self.router_bias, quant=self.quant, w13_scale=self.w13_scale,
                          w2_scale=self.w2_scale, w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                          shared=self.shared, dispatch=self.dispatch, ops=optimized, **kw)
        out = out.to(dtype).reshape(shape)
        return (out, None) if self.returns_tuple else out


def _block_class_name(family: Family) -> str:
    return family.block.rsplit(".", 1)[-1]


def find_moe_blocks(model: torch.nn.Module, family: Family) -> List[str]:
    """Qualified names of the modules of `family`'s MoE block class in `model`."""
    cls = _block_class_name(family)
    return [name for name, m in model.named_modules() if type(m).__name__ == cls]


def _returns_tuple(block: torch.nn.Module, H: int, dtype: torch.dtype) -> bool:
    with torch.no_grad():
        out = block(torch.zeros(1, 1, H, dtype=dtype))
    return isinstance(out, tuple)


def patch_moe_blocks(model: torch.nn.Module, *, quant: str = "bf16", prepack: bool = True,
                     dispatch: str = "auto", family: Optional[Family] = None) -> List[str]:
    """Replace every MoE block of `model` by a `MoELayer` (module docstring). Returns the names
    of the replaced modules. The family is read from model.config unless given.

    Raises: ValueError 'patch_moe_blocks: ...' when the model has no config, its family is not
    supported (reference.families.from_config's message), or no block of the family is found;
    'patch_moe_blocks: argument 'model' ...' when the model asks for router logits.
    """
    config = getattr(model, "config", None)
    if family is None:
        if config is None:
            raise ValueError("patch_moe_blocks: argument 'model' has no config; pass family=")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        family = from_config(text.to_dict())
    if config is not None and getattr(config, "output_router_logits", False):
        raise ValueError("patch_moe_blocks: argument 'model' has output_router_logits=True; a patched MoE "
                         "layer returns no router logits (they only feed the training-time auxiliary loss)")
    names = find_moe_blocks(model, family)
    if not names:
        raise ValueError(f"patch_moe_blocks: argument 'model' has no {_block_class_name(family)} "
                         f"(family '{family.name}')")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        block = getattr(parent, child)
        p = next(block.parameters())
        weights = convert_block(block, family, dtype=torch.bfloat16)
        layer = MoELayer(family, weights, quant=quant, prepack=prepack, dispatch=dispatch,
                         returns_tuple=_returns_tuple(block, weights.router_weight.shape[1], p.dtype))
        setattr(parent, child, layer)
        del block
    return names
