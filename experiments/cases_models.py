"""models (issue 12): a transformers model with its MoE blocks on moelab kernels, against
transformers' own CPU path, side by side in one run.

Models: Qwen3-30B-A3B and GPT-OSS-20B as transformers builds them from their configs (the
real layer sizes: hidden, attention heads, experts, expert widths, top-k), with 2 decoder
layers, random weights (no download) and bf16 parameters. Our side is a deep copy of the same
model with `optimized.hf.patch_moe_blocks` applied (bf16 experts, prepacked once); everything
but the MoE blocks (embedding, attention, norms, head) is transformers' in both.

Two choices, stated because they move the ratio:
- vocab_size = 4096 instead of 151936 / 201088: the LM head of the real vocabulary reads
  0.6-1.2 GB per step, more than the two layers' active weights, and is the same code on both
  sides; with it the bench would time the head. The ratios are those of 2 decoder layers.
- A step is one forward without a KV cache: "decode T=B" is B sequences of one token (the MoE
  layer sees T = B tokens, attention over one position), "prefill T=128" one sequence of 128.
  The MoE layer, the part we replace, sees exactly a decode step's or a prefill's tokens.

transformers' path is whatever `experts_implementation` the model resolves to by default on
this machine (printed in the point's name: grouped_mm when torch can run it, else eager).
Bytes (the floor column) = the weights a step must read at least: attention, norms, head and
K experts per layer (more experts are touched when T > 1, so the floor fraction is a lower
bound there). Weights are not rotated: two layers of real size already exceed the caches.
"""
from __future__ import annotations

import copy

import torch

from .bench import Case

MODELS = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[]),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                        num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        sliding_window=128, layer_types=["sliding_attention", "full_attention"],
                        rms_norm_eps=1e-5, swiglu_limit=7.0),
}
LAYERS = 2
VOCAB = 4096
POINTS_QUICK = (1, 8, 128)
POINTS = (1, 4, 16, 128)


def build(name: str, seed: int = 0):
    """(the transformers model, its deep copy with the MoE blocks patched)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import optimized.hf

    kw = dict(MODELS[name])
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=LAYERS, vocab_size=VOCAB, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ours = copy.deepcopy(model)
    optimized.hf.patch_moe_blocks(ours)
    return model, ours


def _min_bytes(model, name: str) -> int:
    """Every parameter but the expert weights and the embedding table (a step reads only its
    rows), plus K experts per layer: the bytes a step reads at least."""
    kw = MODELS[name]
    H = kw["hidden_size"]
    I = kw.get("moe_intermediate_size", kw["intermediate_size"])
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if ".experts." not in n and "embed_tokens" not in n)
    return dense + LAYERS * kw["num_experts_per_tok"] * 3 * H * I * 2


def cases(quick: bool) -> list[Case]:
    out = []
    for name in MODELS:
        model, ours = build(name)
        impl = getattr(model.config, "_experts_implementation", None) or "eager"
        nbytes = _min_bytes(model, name)
        g = torch.Generator().manual_seed(1)
        for T in (POINTS_QUICK if quick else POINTS):
            B, S = (T, 1) if T <= 16 else (1, T)
            ids = torch.randint(0, VOCAB, (B, S), generator=g)

            def run(m, ids=ids):
                with torch.inference_mode():
                    return m(input_ids=ids, use_cache=False).logits

            kind = "decode" if S == 1 else "prefill"
            out.append(Case("model", f"{name} {kind} T={T} (hf {impl})", lambda m=model, r=run: r(m),
                            lambda m=ours, r=run: r(m), nbytes))
    return out
