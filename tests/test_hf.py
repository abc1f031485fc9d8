"""optimized.hf: a small random transformers model of several families with its MoE blocks
swapped for moelab's optimized layer gives the unpatched model's logits within bf16 precision.

The truth is the model in float64 (transformers' own code, eager experts). Both bf16 runs, the
unpatched model and the patched one, are measured against it: the patched model's error must not
exceed C times the unpatched model's. C = 1.5: attention, norms and head run the same bf16 code
on both sides and dominate the error; the MoE layer rounds at other points than transformers'
(route weights kept in f32, one rounding of the routed sum) and is at least as accurate
(tests/test_families.py), so the two errors differ by the random walk of the roundings only
(measured here over these families with seeds 0-3: ratios 0.22-1.22; 0.22 where transformers'
bf16 router, cast with the rest of the model, moved a token to other experts).
"""
from __future__ import annotations

import copy
import re

import pytest
import torch

import optimized
import optimized.hf as hf
from reference.families import FAMILIES, tiny_config

C = 1.5
MODEL_KW = dict(num_hidden_layers=2, first_k_dense_replace=0, num_dense_layers=0, vocab_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
EXTRA = {
    "deepseek_v3": dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=None,
                        head_dim=8),
    "lfm2_moe": dict(layer_types=["full_attention", "full_attention"]),
    "ernie4_5_moe": dict(moe_layer_start_index=0),
}
# Shared gate (Qwen2-MoE), groups + shared experts (DeepSeek-V3), router and expert biases and a
# tuple-returning block (GPT-OSS), the weight on the input (Llama 4), softmax + bias (Ernie 4.5),
# the 1e-6 epsilon (LFM2-MoE), the plain softmax router (Mixtral).
NAMES = ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "llama4", "ernie4_5_moe", "lfm2_moe"]


def _model(name, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = dict(tiny_config(name), **dict(MODEL_KW, **EXTRA.get(name, {})))
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager").eval()
    # transformers initializes some router weights and selection biases to zero: every logit of a
    # token ties, and which experts win a tie is unspecified in transformers (SPEC: the lowest
    # index). Draw them, and make every router decisive (std 2/sqrt(H)): with the init's std of 0.02
    # two experts' logits are often within bf16 noise of each other, and a near-tie that the bf16
    # model and the patched one break differently moves one token's logits by O(1) (seen: GPT-OSS,
    # seed 1, token 0). The comparison is then one of arithmetic, as intended.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point() or p.numel() <= 1:
                continue
            if re.search(r"\.(gate|router)\.weight$", name):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 2 * p.shape[-1] ** -0.5)
            elif not p.any():
                std = p.shape[-1] ** -0.5 if p.dim() >= 2 and p.shape[-1] > 1 else 0.05
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def _rel(a, truth):
    return float((a - truth).abs().max() / truth.abs().max())


@pytest.mark.parametrize("name", NAMES)
def test_patched_model_logits_are_as_close_to_float64_as_transformers_bf16(name):
    truth_model = _model(name)
    theirs = copy.deepcopy(truth_model).to(torch.bfloat16)
    ours = copy.deepcopy(theirs)
    replaced = hf.patch_moe_blocks(ours)
    assert len(replaced) == 2, replaced
    block_cls = FAMILIES[name].block.rsplit(".", 1)[-1]
    assert not any(type(m).__name__ == block_cls for m in ours.modules())
    assert sum(isinstance(m, hf.MoELayer) for m in ours.modules()) == 2

    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    truth = _logits(truth_model, ids)
    e_theirs, e_ours = _rel(_logits(theirs, ids), truth), _rel(_logits(ours, ids), truth)
    assert e_ours <= C * e_theirs, f"{name}: ours {e_ours:.3e} vs transformers bf16 {e_theirs:.3e}"
    assert e_ours < 0.05          # and both are bf16-sized, not a broken layer that happens to match


@pytest.mark.parametrize("quant,bound", [("fp8_block", 3.0), ("mxfp4", 20.0)])
def test_quantized_experts_stay_close(quant, bound):
    """The same model with its experts quantized by the reference quantizers: the weights change
    (fp8: up to 2^-4 relative per weight; mxfp4: up to 2^-2), so the error grows against the
    patched bf16 model's by a bounded factor (measured: 1.6x and 11.4x); a wrong layout or
    scale would be off by the size of the logits."""
    name = "deepseek_v3"          # widths that are multiples of 32, as mxfp4 needs; shared expert too
    truth_model = _model(name)
    plain = copy.deepcopy(truth_model).to(torch.bfloat16)
    quantized = copy.deepcopy(plain)
    hf.patch_moe_blocks(plain)
    hf.patch_moe_blocks(quantized, quant=quant)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    truth = _logits(truth_model, ids)
    e_plain, e_quant = _rel(_logits(plain, ids), truth), _rel(_logits(quantized, ids), truth)
    assert e_plain < e_quant <= bound * e_plain, (e_quant, e_plain)


def test_patched_layer_takes_any_float_dtype_and_shape():
    model = _model("mixtral").to(torch.float32)
    block = model.model.layers[0].mlp
    hf.patch_moe_blocks(model)
    layer = model.model.layers[0].mlp
    assert isinstance(layer, hf.MoELayer) and block is not layer
    x = torch.randn(3, 5, 64)
    out = layer(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    # the same tokens, flattened, give the same bits (the layer is batch invariant on the CPU)
    flat = layer(x.reshape(15, 64))
    assert torch.equal(out.reshape(15, 64), flat)


def test_patch_errors_name_the_problem():
    model = _model("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="^patch_moe_blocks: argument 'model' has output_router_logits"):
        hf.patch_moe_blocks(model)
    with pytest.raises(ValueError, match="^patch_moe_blocks: argument 'model' has no config"):
        hf.patch_moe_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="^patch_moe_blocks: argument 'model' has no MixtralSparseMoeBlock"):
        hf.patch_moe_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)), family=FAMILIES["mixtral"])
    with pytest.raises(ValueError, match="^MoELayer: argument 'quant'"):
        hf.patch_moe_blocks(_model("mixtral"), quant="int4")


def test_patched_model_runs_through_optimized_kernels(monkeypatch):
    """The layer's ops are the optimized ones (not the reference): count the calls."""
    model = _model("qwen2_moe").to(torch.bfloat16)
    hf.patch_moe_blocks(model)
    calls = []
    real = optimized.fused_experts
    monkeypatch.setattr(optimized, "fused_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert len(calls) == 4          # 2 layers x (routed + shared)
