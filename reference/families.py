"""The MoE layer of real model families (SPEC 6): one table of presets, read from transformers.

Every family in `FAMILIES` names the transformers MoE block it reproduces and the arguments of
`reference.moe.moe_forward` that compute the same function. Each preset was read off the
installed transformers modeling code (the block's forward, its router, experts and shared
expert) and is checked against it by tests/test_families.py (float64 and bf16); docs/families.md
is the table in prose, with the semantic surprises found on the way.

    FAMILIES[name]               the presets (real sizes: defaults for benches)
    UNSUPPORTED[name]            transformers MoE families the layer cannot express, and what they need
    from_config(config.json)     -> the family's preset with sizes and arguments filled in
    tiny_config(name)            -> a small config dict for that family (tests)
    layer_kwargs(fam)            -> moe_forward's keyword arguments
    moe_layer(x, fam, weights)   -> moe_forward with the family's arguments and MoEWeights

The transformers blocks themselves (build one with random weights, convert its weights to
MoEWeights, read its own routing) are reference/transformers_blocks.py.

Decisions (SPEC 6 leaves them to the project; docs/families.md says the same):
- A family whose router scales the routed output or the weights by a factor (routed_scaling_factor,
  router_scaling_factor, route_scale) is expressed through route's `scaling`.
- Cohere2-MoE's shared_expert_combination_strategy = "average" ((routed + shared) / 2) is
  scaling = 0.5 on the routed weights plus the shared expert's down projection halved by
  convert_block (`Family.shared_scale`); halving is exact in every float format, so both branches
  compute exactly half of what "sum" would.
- Several shared experts (n_shared_experts, num_shared_experts, moe_num_shared_experts) are one
  MLP of the summed width, as the models store them; `Family.shared_I` is that width.
- LFM2-MoE without an expert bias is sigmoid_bias with a zero bias (it adds the 1e-6 epsilon
  either way); with use_expert_bias the bias is the model's expert_bias buffer.
- Llama 4 with K = 1 is route method "llama4"; with K > 1 it is sigmoid_topk, renormalize=False
  (its router takes the top K logits and applies sigmoid to each).
- DeepSeek-V3-style routers are grouped_sigmoid_bias for every n_group (n_group = 1 keeps the one
  group, the same selection as sigmoid_bias), as transformers computes them.
- renormalize=None is the route method's default (on for the biased methods, off otherwise): the
  presets of the biased methods leave it None when the model renormalizes, False when it does not
  (norm_topk_prob false), so a call that needs no SPEC 6 amendment does not pass one.
- Ties: transformers' torch.topk(sorted=False) leaves the order of the K ids unspecified and
  its group top-k leaves tied groups unordered; moelab's route orders slots by key, ties lower
  index first. The conformance tests use tie-free inputs and compare ids as sets where
  transformers does not sort.

Precision of transformers' float64 run (family.hf_f32, what the tests allow for): several routers
round to float32 even when the module runs in float64: "logits" = the router GEMM runs in f32
(DeepSeek-V2/V3-style `F.linear(x.float(), w.float())`, Ernie, HY-V3, AFMoE's `.to(float32)`,
GraniteMoE's `.float()`); "probs" = softmax/sigmoid in f32 from f64 logits (Mixtral's
`softmax(logits.float())`, Qwen's `softmax(dtype=float)`, ...); "weights" = selection on f64
logits, only the weights of the K selected in f32 (Llama 4's sigmoid, Cohere2's softmax over
the K). "" = the float64 run is float64 throughout. HY-V3 additionally combines routed and shared
outputs in f32 (enable_moe_fp32_combine, on by default), which in a float64 run rounds the
layer's output to f32.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .moe import SharedExpert, moe_forward

__all__ = ["Family", "FAMILIES", "UNSUPPORTED", "MoEWeights", "from_config", "tiny_config", "layer_kwargs",
           "moe_layer"]


@dataclass(frozen=True)
class Family:
    name: str            # preset name
    model_type: str      # transformers config model_type (of the text model for composite ones)
    block: str           # dotted path of the transformers MoE block class
    method: str          # route method
    top_k: int
    E: int
    H: int
    I: int               # the real model's sizes (defaults for benches)
    renormalize: Optional[bool] = None
    scaling: float = 1.0
    norm_eps: Optional[float] = None
    n_group: int = 1
    topk_group: int = 1
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    router_bias: bool = False        # GPT-OSS: a bias on the router GEMM
    route_bias: bool = False         # e_score_correction_bias / expert bias that steers selection
    expert_bias: bool = False        # w13/w2 biases (GPT-OSS)
    apply_router_weight_on_input: bool = False   # Llama 4
    shared_I: int = 0                # width of the shared MLP (0 = none)
    shared_gate: bool = False        # sigmoid gate [1, H] on the shared output (Qwen2-MoE, Qwen3-Next)
    notes: str = ""
    # Additions beyond the agreed API (all defaulted):
    shared_scale: float = 1.0        # the shared output's factor (Cohere2 "average": 0.5), folded into its w2
    shared_bias: bool = False        # the shared MLP has biases (mlp_bias / use_bias configs)
    hf_f32: str = ""                 # where transformers' float64 run rounds to f32 (module docstring)
    hf_sorted: bool = True           # transformers' ids come sorted by key (False: torch.topk(sorted=False))


_M = "transformers.models."


def _f(name, model_type, block, method, top_k, E, H, I, **kw) -> Family:
    return Family(name=name, model_type=model_type, block=_M + block, method=method, top_k=top_k,
                  E=E, H=H, I=I, **kw)


# The one table. Sizes: the named real model (notes); arguments: its config.json read by from_config.
FAMILIES: dict[str, Family] = {f.name: f for f in [
    _f("mixtral", "mixtral", "mixtral.modeling_mixtral.MixtralSparseMoeBlock", "softmax_topk", 2, 8, 4096, 14336,
       renormalize=True, hf_f32="probs", notes="Mixtral-8x7B"),
    _f("minimax_text_01", "minimax", "minimax.modeling_minimax.MiniMaxSparseMoeBlock", "softmax_topk", 2, 32, 6144, 9216,
       renormalize=True, hf_f32="probs", notes="MiniMax-Text-01; the MoE block is Mixtral's"),
    _f("qwen2_moe", "qwen2_moe", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock", "softmax_topk", 4, 60, 2048, 1408,
       renormalize=False, shared_I=5632, shared_gate=True, hf_f32="probs",
       notes="Qwen1.5-MoE-A2.7B (norm_topk_prob false); shared expert with a sigmoid gate"),
    _f("qwen3_moe", "qwen3_moe", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock", "softmax_topk", 8, 128, 2048, 768,
       renormalize=True, hf_f32="probs", notes="Qwen3-30B-A3B"),
    _f("qwen3_next", "qwen3_next", "qwen3_next.modeling_qwen3_next.Qwen3NextSparseMoeBlock", "softmax_topk", 10, 512, 2048, 512,
       renormalize=True, shared_I=512, shared_gate=True, hf_f32="probs",
       notes="Qwen3-Next-80B-A3B; shared expert with a sigmoid gate"),
    _f("qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextSparseMoeBlock",
       "softmax_topk", 8, 128, 2048, 768, renormalize=True, hf_f32="probs",
       notes="Qwen3-VL-30B-A3B text model; its router always renormalizes (no norm_topk_prob)"),
    _f("deepseek_v2", "deepseek_v2", "deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe", "softmax_topk", 6, 64, 2048, 1408,
       renormalize=False, scaling=1.0, shared_I=2816, hf_f32="logits", hf_sorted=False,
       notes="DeepSeek-V2-Lite, topk_method greedy; never renormalizes, routed_scaling_factor as scaling"),
    _f("deepseek_v2_group_limited", "deepseek_v2", "deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe", "grouped_softmax",
       6, 160, 5120, 1536, renormalize=False, scaling=16.0, n_group=8, topk_group=3, shared_I=3072,
       hf_f32="logits", hf_sorted=False,
       notes="DeepSeek-V2, topk_method group_limited_greedy (group score = max p; dropped experts get p = 0)"),
    _f("deepseek_v3", "deepseek_v3", "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE", "grouped_sigmoid_bias",
       8, 256, 7168, 2048, renormalize=None, scaling=2.5, n_group=8, topk_group=4, route_bias=True, shared_I=2048,
       hf_f32="logits", hf_sorted=False, notes="DeepSeek-V3 / R1"),
    _f("deepseek_v3_no_norm", "deepseek_v3", "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE", "grouped_sigmoid_bias",
       8, 384, 7168, 2048, renormalize=False, scaling=2.827, n_group=1, topk_group=1, route_bias=True, shared_I=2048,
       hf_f32="logits", hf_sorted=False,
       notes="DeepSeek-V3 code with norm_topk_prob false, Kimi-K2 shapes: w = s[sel] * scaling"),
    _f("glm4_moe", "glm4_moe", "glm4_moe.modeling_glm4_moe.Glm4MoeMoE", "grouped_sigmoid_bias", 8, 160, 5120, 1536,
       renormalize=None, scaling=2.5, n_group=1, topk_group=1, route_bias=True, shared_I=1536,
       hf_f32="logits", hf_sorted=False, notes="GLM-4.5; DeepSeek-V3's router"),
    _f("kimi_linear", "kimi_linear", "kimi_linear.modeling_kimi_linear.KimiLinearMoE", "grouped_sigmoid_bias",
       8, 256, 2304, 1024, renormalize=None, scaling=2.446, n_group=1, topk_group=1, route_bias=True, shared_I=1024,
       hf_f32="logits", hf_sorted=False, notes="Kimi-Linear-48B-A3B; DeepSeek-V3's router"),
    _f("minimax_m2", "minimax_m2", "minimax_m2.modeling_minimax_m2.MiniMaxM2SparseMoeBlock", "sigmoid_bias",
       8, 256, 3072, 1536, renormalize=None, route_bias=True, hf_f32="probs", hf_sorted=False,
       notes="MiniMax-M2; divides by the plain sum (route's 1e-20 is below float64 resolution of a sum ~1)"),
    _f("gpt_oss", "gpt_oss", "gpt_oss.modeling_gpt_oss.GptOssMLP", "topk_softmax", 4, 32, 2880, 2880,
       activation="swiglu_oai", alpha=1.702, limit=7.0, router_bias=True, expert_bias=True,
       notes="GPT-OSS-20B; experts stored transposed with gate/up interleaved"),
    _f("llama4", "llama4_text", "llama4.modeling_llama4.Llama4TextMoe", "llama4", 1, 16, 5120, 8192,
       apply_router_weight_on_input=True, shared_I=8192, hf_f32="weights",
       notes="Llama-4-Scout; K > 1 configs: sigmoid_topk, renormalize=False"),
    _f("olmoe", "olmoe", "olmoe.modeling_olmoe.OlmoeSparseMoeBlock", "softmax_topk", 8, 64, 2048, 1024,
       renormalize=False, hf_f32="probs", notes="OLMoE-1B-7B"),
    _f("flex_olmo", "flex_olmo", "flex_olmo.modeling_flex_olmo.FlexOlmoSparseMoeBlock", "softmax_topk", 2, 7, 4096, 11008,
       renormalize=False, hf_f32="probs", notes="FlexOlmo-7x7B"),
    _f("granitemoe", "granitemoe", "granitemoe.modeling_granitemoe.GraniteMoeMoE", "topk_softmax", 8, 40, 1536, 512,
       hf_f32="logits", notes="granite-3.0-3b-a800m; logits rounded to f32 (.float()) before top-k"),
    _f("aria", "aria_text", "aria.modeling_aria.AriaTextMoELayer", "topk_softmax", 6, 64, 2560, 1664, shared_I=3328,
       notes="Aria text model; experts stored transposed; routed experts always SiLU"),
    _f("jamba", "jamba", "jamba.modeling_jamba.JambaSparseMoeBlock", "softmax_topk", 2, 16, 4096, 14336,
       renormalize=False, hf_f32="probs", notes="Jamba-v0.1; never renormalizes"),
    _f("hunyuan_v1_moe", "hunyuan_v1_moe", "hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1Moe", "softmax_topk",
       8, 64, 4096, 3072, renormalize=True, shared_I=3072, hf_f32="probs",
       notes="Hunyuan-A13B; routed and shared experts both of intermediate_size"),
    _f("dots1", "dots1", "dots1.modeling_dots1.Dots1MoE", "grouped_sigmoid_bias", 6, 128, 4096, 1408,
       renormalize=None, scaling=2.5, n_group=1, topk_group=1, route_bias=True, shared_I=2816,
       hf_f32="logits", hf_sorted=False, notes="dots.llm1; DeepSeek-V3's router"),
    _f("hy_v3", "hy_v3", "hy_v3.modeling_hy_v3.HYV3MoE", "sigmoid_bias", 8, 192, 4096, 1536,
       renormalize=None, scaling=2.826, route_bias=True, shared_I=1536, hf_f32="logits", hf_sorted=False,
       notes="HY-V3 (config defaults); enable_moe_fp32_combine adds routed + shared in f32"),
    _f("afmoe", "afmoe", "afmoe.modeling_afmoe.AfmoeSparseMoeBlock", "sigmoid_bias", 6, 64, 2048, 1408,
       renormalize=None, scaling=1.0, route_bias=True, shared_I=2816, hf_f32="logits",
       notes="AFMoE (config defaults); route_scale as scaling"),
    _f("cohere2_moe", "cohere2_moe", "cohere2_moe.modeling_cohere2_moe.Cohere2MoeSparseMoeBlock", "topk_softmax",
       2, 8, 8192, 22528, hf_f32="weights",
       notes="Cohere2-MoE (config defaults, no shared expert); expert_selection_fn sigmoid: sigmoid_topk; "
             "'average' with a shared expert: scaling 0.5 and shared_scale 0.5"),
    _f("lfm2_moe", "lfm2_moe", "lfm2_moe.modeling_lfm2_moe.Lfm2MoeSparseMoeBlock", "sigmoid_bias", 4, 32, 2048, 1792,
       renormalize=None, norm_eps=1e-6, route_bias=True, notes="LFM2-8B-A1B; w / (sum + 1e-6) * scaling"),
    _f("ernie4_5_moe", "ernie4_5_moe", "ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeSparseMoeBlock", "softmax_bias",
       6, 64, 2560, 1536, renormalize=None, route_bias=True, shared_I=3072, hf_f32="logits",
       notes="ERNIE-4.5-21B-A3B; bias stored [1, E]; w / max(sum, moe_norm_min)"),
    # Further transformers families with the same blocks (byte-identical router/experts/block code):
    _f("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock", "softmax_topk",
       8, 256, 2048, 512, renormalize=True, shared_I=512, shared_gate=True, hf_f32="probs",
       notes="Qwen3.5-MoE text model: Qwen3-Next's block, router always renormalizes"),
    _f("glm4_moe_lite", "glm4_moe_lite", "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteMoE", "grouped_sigmoid_bias",
       4, 64, 2048, 1536, renormalize=None, scaling=1.8, n_group=1, topk_group=1, route_bias=True, shared_I=1536,
       hf_f32="logits", hf_sorted=False, notes="GLM-4.7-Flash-style (config defaults); DeepSeek-V3's router"),
    _f("exaone_moe", "exaone_moe", "exaone_moe.modeling_exaone_moe.ExaoneMoeSparseMoEBlock", "grouped_sigmoid_bias",
       8, 128, 6144, 2048, renormalize=None, scaling=2.5, n_group=1, topk_group=1, route_bias=True, shared_I=2048,
       hf_f32="logits", hf_sorted=False, notes="EXAONE-MoE (config defaults); DeepSeek-V3's router"),
]}


UNSUPPORTED: dict[str, str] = {
    "phimoe": "PhiMoE's sparsemixer router (a second-choice selection that masks the first expert and "
              "re-softmaxes with a jitter threshold): a route method of its own",
    "switch_transformers": "top-1 router with expert capacity (tokens beyond capacity dropped) and "
                           "a router in f32 with jitter: capacity dropping is a dispatch-level feature",
    "nllb_moe": "top-2 router with expert capacity, second-expert sampling/normalization policy and "
                "dropped tokens; ungated ReLU experts (fc1/fc2)",
    "deepseek_v4": "hash routing (a token-id -> expert table, DeepseekV4HashRouter) in its hash_moe layers: "
                   "a route method with the token ids as input",
    "nemotron_h": "latent experts (moe_latent_size projections around the experts) with an ungated relu2 "
                  "activation: needs an ungated activation and the latent projections",
    "longcat_flash": "zero-computation experts (identity experts beside the MLP experts): ids past E that "
                     "add the weighted input",
    "doge": "CDMoE product-key retrieval experts (single-neuron experts chosen by two sub-key top-ks)",
    "jetmoe": "mixture of attention heads (MoA) beside the MoE MLP; the MLP experts are ungated-able "
              "parallel experts with a top-k-softmax router (JetMoeMoE would need its own expert layout)",
    "dbrx": "router softmax, top-k, then division by the L-p norm of the K weights "
            "(moe_normalize_expert_weights): p = 1 is renormalize=True and None is False, other p need an "
            "L-p option; its experts (w1, v1, w2 stored per expert as [I, H] blocks) need a converter: not a preset yet",
    "gemma4": "router with an RMSNorm, a learned input scale and a per-expert output scale "
              "(per_expert_scale[ids]): needs per-expert weight factors",
    "mistral4": "DeepSeek-V3's group rule (sum of the top two) on softmax scores without a bias: a "
                "grouped softmax with top-2 group scores (route's grouped_softmax uses the max)",
    "granitemoeshared": "the routed block is GraniteMoE's (supported as 'granitemoe'); the shared MLP is in "
                        "the decoder layer, outside the MoE block",
    "zaya": "an MLP router (ZayaRouterMLP) instead of a linear layer",
    "ernie4_5_vl_moe": "modality-specific expert sets (text and vision experts chosen by token type)",
}


# ----------------------------------------------------------------------------- from_config
class _Missing:
    pass


_REQUIRED = _Missing()


def _err(msg: str):
    raise ValueError(f"from_config: {msg}")


def _get(cfg: dict, keys, default=_REQUIRED):
    """The value of the first of `keys` present in cfg; `default` when none is (required if not given)."""
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    if isinstance(default, _Missing):
        _err(f"key '{keys[0]}' is required for model_type '{cfg.get('model_type')}'"
             + (f" (or one of {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""))
    return default


def _int(cfg, keys, default=_REQUIRED, minimum=1) -> int:
    v = _get(cfg, keys, default)
    key = keys if isinstance(keys, str) else next((k for k in keys if k in cfg), keys[0])
    if isinstance(v, list):          # per-layer lists (HunYuan): one value for all MoE layers only
        if len(v) == 0 or any(u != v[0] for u in v):
            _err(f"key '{key}' is a per-layer list with different values {v!r}; one preset describes one layer")
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        _err(f"key '{key}' must be an int >= {minimum}, got {v!r}")
    return v


def _float(cfg, keys, default=_REQUIRED) -> float:
    v = _get(cfg, keys, default)
    key = keys if isinstance(keys, str) else next((k for k in keys if k in cfg), keys[0])
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        _err(f"key '{key}' must be a finite number, got {v!r}")
    return float(v)


def _bool(cfg, keys, default=_REQUIRED) -> bool:
    v = _get(cfg, keys, default)
    if not isinstance(v, bool):
        key = keys if isinstance(keys, str) else next((k for k in keys if k in cfg), keys[0])
        _err(f"key '{key}' must be true or false, got {v!r}")
    return v


def _choice(cfg, key, allowed, default=_REQUIRED):
    v = _get(cfg, key, default)
    if v not in allowed:
        _err(f"key '{key}' = {v!r} is not supported here (supported: {', '.join(map(repr, allowed))})")
    return v


@functools.lru_cache(maxsize=None)
def _hf_default(model_type: str, attr: str):
    """The transformers config class's default for `attr` (what the model uses when a key is absent)."""
    from transformers import AutoConfig
    return getattr(AutoConfig.for_model(model_type), attr)


def _act(cfg, key="hidden_act"):
    _choice(cfg, key, ("silu", "swish"), "silu")


def _sizes(fam: Family, cfg, E, K, I, **kw) -> Family:
    H = _int(cfg, "hidden_size")
    if K > E:
        _err(f"key 'num_experts_per_tok' (top-k) = {K} exceeds the expert count {E}")
    return dataclasses.replace(fam, E=E, top_k=K, H=H, I=I, **kw)


def _softmax_router(name, E_keys, I_keys, norm=None, shared=None, shared_gate=False):
    def read(cfg):
        _act(cfg)
        fam = FAMILIES[name]
        E, K = _int(cfg, E_keys), _int(cfg, ("num_experts_per_tok",))
        I = _int(cfg, I_keys)
        kw = {}
        if norm == "flag":
            kw["renormalize"] = _bool(cfg, "norm_topk_prob", _hf_default(fam.model_type, "norm_topk_prob"))
        if shared:
            kw["shared_I"] = _int(cfg, shared)
        return _sizes(fam, cfg, E, K, I, **kw)
    return read


def _read_deepseek_v2(cfg):
    _act(cfg)
    method = _choice(cfg, "topk_method", ("greedy", "group_limited_greedy"), "greedy")
    _choice(cfg, "scoring_func", ("softmax",), "softmax")
    if _get(cfg, "norm_topk_prob", False) is True:
        _err("key 'norm_topk_prob' = true: transformers' DeepseekV2 router never renormalizes (DeepSeek's "
             "own code does), so the config is ambiguous; set it false")
    fam = FAMILIES["deepseek_v2" if method == "greedy" else "deepseek_v2_group_limited"]
    E, K, I = _int(cfg, ("n_routed_experts", "num_experts")), _int(cfg, "num_experts_per_tok"), \
        _int(cfg, "moe_intermediate_size")
    kw = dict(scaling=_float(cfg, "routed_scaling_factor", 1.0),
              shared_I=I * _int(cfg, "n_shared_experts", 0, minimum=0),
              shared_bias=_bool(cfg, "mlp_bias", False))
    if method == "group_limited_greedy":
        kw.update(_groups(cfg, E, K, ("n_group",)))
    else:
        kw.update(n_group=1, topk_group=1)
    return _sizes(fam, cfg, E, K, I, **kw)


def _groups(cfg, E, K, group_keys):
    n_group, topk_group = _int(cfg, group_keys), _int(cfg, "topk_group")
    if E % n_group != 0 or E // n_group < 2:
        _err(f"key '{group_keys[0]}' = {n_group} must divide the {E} experts into groups of at least 2")
    if topk_group > n_group:
        _err(f"key 'topk_group' = {topk_group} exceeds {group_keys[0]} = {n_group}")
    if K > topk_group * (E // n_group):
        _err(f"key 'num_experts_per_tok' = {K} exceeds topk_group * experts per group = {topk_group * (E // n_group)}")
    return dict(n_group=n_group, topk_group=topk_group)


def _v3_router(name, E_keys=("n_routed_experts", "num_local_experts"), shared_keys=("n_shared_experts",),
               group_keys=("n_group",), K_keys=("num_experts_per_tok",), norm_keys=("norm_topk_prob",),
               default_norm=None):
    def read(cfg):
        _act(cfg)
        _choice(cfg, "scoring_func", ("sigmoid",), "sigmoid")
        _choice(cfg, "topk_method", ("noaux_tc",), "noaux_tc")
        E, K, I = _int(cfg, E_keys), _int(cfg, K_keys), _int(cfg, "moe_intermediate_size")
        fam = FAMILIES[name]
        norm = _bool(cfg, norm_keys, _hf_default(fam.model_type, "norm_topk_prob") if default_norm is None else default_norm)
        if name == "deepseek_v3" and not norm:
            fam = FAMILIES["deepseek_v3_no_norm"]
        kw = dict(renormalize=None if norm else False, scaling=_float(cfg, "routed_scaling_factor", 1.0),
                  shared_I=I * _int(cfg, shared_keys, 0, minimum=0), **_groups(cfg, E, K, group_keys))
        return _sizes(fam, cfg, E, K, I, **kw)
    return read


def _read_minimax_m2(cfg):
    _act(cfg)
    _choice(cfg, "scoring_func", ("sigmoid",), "sigmoid")
    return _sizes(FAMILIES["minimax_m2"], cfg, _int(cfg, ("num_local_experts", "num_experts")),
                  _int(cfg, "num_experts_per_tok"), _int(cfg, "intermediate_size"))


def _read_gpt_oss(cfg):
    fam = FAMILIES["gpt_oss"]
    return _sizes(fam, cfg, _int(cfg, ("num_local_experts", "num_experts")), _int(cfg, "num_experts_per_tok"),
                  _int(cfg, "intermediate_size"), limit=_float(cfg, "swiglu_limit", 7.0),
                  alpha=_float(cfg, "swiglu_alpha", 1.702))


def _read_llama4(cfg):
    _act(cfg)
    E, K, I = _int(cfg, "num_local_experts"), _int(cfg, "num_experts_per_tok"), _int(cfg, "intermediate_size")
    kw = dict(shared_I=I)
    if K > 1:
        kw.update(method="sigmoid_topk", renormalize=False)
    return _sizes(FAMILIES["llama4"], cfg, E, K, I, **kw)


def _read_aria(cfg):
    _act(cfg)
    I = _int(cfg, "intermediate_size")
    return _sizes(FAMILIES["aria"], cfg, _int(cfg, "moe_num_experts"), _int(cfg, "moe_topk"), I,
                  shared_I=I * _int(cfg, "moe_num_shared_experts", 2, minimum=0),
                  shared_bias=_bool(cfg, "mlp_bias", False))


def _read_hunyuan(cfg):
    _act(cfg)
    I = _int(cfg, "intermediate_size")
    return _sizes(FAMILIES["hunyuan_v1_moe"], cfg, _int(cfg, ("num_experts", "num_local_experts")),
                  _int(cfg, ("moe_topk", "num_experts_per_tok")), I, shared_I=I)


def _read_hy_v3(cfg):
    _act(cfg)
    E, K, I = _int(cfg, ("num_experts", "num_local_experts")), _int(cfg, "num_experts_per_tok"), \
        _int(cfg, "moe_intermediate_size")
    return _sizes(FAMILIES["hy_v3"], cfg, E, K, I, scaling=_float(cfg, "router_scaling_factor", 2.826),
                  shared_I=I * _int(cfg, "num_shared_experts", 1, minimum=0),
                  shared_bias=_bool(cfg, "mlp_bias", False))


def _read_afmoe(cfg):
    _act(cfg)
    E, K, I = _int(cfg, "num_experts"), _int(cfg, "num_experts_per_tok"), _int(cfg, "moe_intermediate_size")
    return _sizes(FAMILIES["afmoe"], cfg, E, K, I, scaling=_float(cfg, "route_scale", 1.0),
                  shared_I=I * _int(cfg, "num_shared_experts", 2, minimum=0))


def _read_cohere2(cfg):
    _act(cfg)
    fn = _choice(cfg, "expert_selection_fn", ("softmax", "sigmoid"), "softmax")
    E, K, I = _int(cfg, "num_experts"), _int(cfg, "num_experts_per_tok"), _int(cfg, "intermediate_size")
    n_shared = _int(cfg, "num_shared_experts", 0, minimum=0)
    kw = dict(shared_I=I * n_shared, scaling=1.0, shared_scale=1.0)
    if fn == "sigmoid":
        kw.update(method="sigmoid_topk", renormalize=_bool(cfg, "norm_topk_prob", True), hf_f32="")
    else:
        kw.update(method="topk_softmax", renormalize=None, hf_f32="weights")
    if n_shared > 0:
        strategy = _choice(cfg, "shared_expert_combination_strategy", ("sum", "average"), "average")
        if strategy == "average":
            kw.update(scaling=0.5, shared_scale=0.5)
    return _sizes(FAMILIES["cohere2_moe"], cfg, E, K, I, **kw)


def _read_lfm2(cfg):
    E, K, I = _int(cfg, "num_experts"), _int(cfg, "num_experts_per_tok"), _int(cfg, "moe_intermediate_size")
    _bool(cfg, "use_expert_bias", True)     # either way: sigmoid_bias (zero bias without one)
    norm = _bool(cfg, "norm_topk_prob", True)
    return _sizes(FAMILIES["lfm2_moe"], cfg, E, K, I, renormalize=None if norm else False,
                  scaling=_float(cfg, "routed_scaling_factor", 1.0))


def _read_ernie(cfg):
    _act(cfg)
    E, K, I = _int(cfg, ("moe_num_experts", "num_experts")), _int(cfg, ("moe_k", "num_experts_per_tok")), \
        _int(cfg, "moe_intermediate_size")
    eps = _float(cfg, "moe_norm_min", 1e-12)
    if eps < 0:
        _err(f"key 'moe_norm_min' must be >= 0, got {eps!r}")
    return _sizes(FAMILIES["ernie4_5_moe"], cfg, E, K, I, norm_eps=None if eps == 1e-12 else eps,
                  shared_I=I * _int(cfg, "moe_num_shared_experts", 0, minimum=0),
                  shared_bias=_bool(cfg, "use_bias", False))


def _read_granite(cfg):
    _act(cfg)
    return _sizes(FAMILIES["granitemoe"], cfg, _int(cfg, "num_local_experts"), _int(cfg, "num_experts_per_tok"),
                  _int(cfg, "intermediate_size"))


_READERS = {
    "mixtral": _softmax_router("mixtral", ("num_local_experts", "num_experts"), "intermediate_size"),
    "minimax": _softmax_router("minimax_text_01", ("num_local_experts", "num_experts"), "intermediate_size"),
    "qwen2_moe": _softmax_router("qwen2_moe", ("num_experts",), "moe_intermediate_size", norm="flag",
                                 shared="shared_expert_intermediate_size"),
    "qwen3_moe": _softmax_router("qwen3_moe", ("num_experts", "num_local_experts"), "moe_intermediate_size", norm="flag"),
    "qwen3_next": _softmax_router("qwen3_next", ("num_experts",), "moe_intermediate_size", norm="flag",
                                  shared="shared_expert_intermediate_size"),
    "qwen3_vl_moe_text": _softmax_router("qwen3_vl_moe", ("num_experts", "num_local_experts"), "moe_intermediate_size"),
    "qwen3_5_moe_text": _softmax_router("qwen3_5_moe", ("num_experts",), "moe_intermediate_size",
                                        shared="shared_expert_intermediate_size"),
    "olmoe": _softmax_router("olmoe", ("num_experts", "num_local_experts"), "intermediate_size", norm="flag"),
    "flex_olmo": _softmax_router("flex_olmo", ("num_experts", "num_local_experts"), "intermediate_size", norm="flag"),
    "jamba": _softmax_router("jamba", ("num_experts", "num_local_experts"), "intermediate_size"),
    "deepseek_v2": _read_deepseek_v2,
    "deepseek_v3": _v3_router("deepseek_v3"),
    "kimi_k2": _v3_router("deepseek_v3"),
    "glm4_moe": _v3_router("glm4_moe"),
    "glm4_moe_lite": _v3_router("glm4_moe_lite"),
    "dots1": _v3_router("dots1"),
    "exaone_moe": _v3_router("exaone_moe", E_keys=("num_experts", "n_routed_experts"),
                             shared_keys=("num_shared_experts", "n_shared_experts")),
    "kimi_linear": _v3_router("kimi_linear", E_keys=("num_experts", "num_local_experts"),
                              shared_keys=("num_shared_experts", "n_shared_experts"),
                              group_keys=("num_expert_group", "n_group"),
                              K_keys=("num_experts_per_token", "num_experts_per_tok"),
                              norm_keys=("moe_renormalize", "norm_topk_prob")),
    "minimax_m2": _read_minimax_m2,
    "gpt_oss": _read_gpt_oss,
    "llama4_text": _read_llama4,
    "granitemoe": _read_granite,
    "aria_text": _read_aria,
    "hunyuan_v1_moe": _read_hunyuan,
    "hy_v3": _read_hy_v3,
    "afmoe": _read_afmoe,
    "cohere2_moe": _read_cohere2,
    "lfm2_moe": _read_lfm2,
    "ernie4_5_moe": _read_ernie,
}

# Composite configs: the MoE layer is in the text model's config.
_COMPOSITE = {"llama4": "llama4_text", "qwen3_vl_moe": "qwen3_vl_moe_text", "aria": "aria_text",
              "qwen3_5_moe": "qwen3_5_moe_text"}


def from_config(config: dict) -> Family:
    """A transformers config.json dict -> its family's preset with sizes and arguments filled in.

    Composite configs (llama4, qwen3_vl_moe, aria, qwen3_5_moe) are read from their text_config.
    Keys are read by their config.json names (aliases such as num_experts / num_local_experts /
    n_routed_experts are accepted where transformers maps them); flags that are absent take the
    transformers config class's default. Raises ValueError("from_config: ...") naming the key
    for a missing, malformed or unsupported value, and naming model_type for a family that is
    not in the table (UNSUPPORTED's reason when it is listed there).
    """
    if not isinstance(config, dict):
        _err(f"argument 'config' must be a dict (a parsed config.json), got {type(config).__name__}")
    mt = config.get("model_type")
    if not isinstance(mt, str):
        _err(f"key 'model_type' is required and must be a string, got {mt!r}")
    if mt in _COMPOSITE:
        text = config.get("text_config")
        if not isinstance(text, dict):
            _err(f"key 'text_config' is required for model_type '{mt}' (its MoE layer is in the text model)")
        config = dict(text, model_type=text.get("model_type", _COMPOSITE[mt]))
        mt = config["model_type"]
    if mt in UNSUPPORTED:
        _err(f"key 'model_type' = '{mt}' is not expressible by moe_forward: {UNSUPPORTED[mt]}")
    reader = _READERS.get(mt)
    if reader is None:
        _err(f"key 'model_type' = '{mt}' is not a known MoE family (known: {', '.join(sorted(_READERS))})")
    return reader(config)


# ----------------------------------------------------------------------------- tiny configs
# Small configs from which the transformers block is built: H = 64, E = 8-16, I = 32, K = 2-4;
# grouped families with valid groups. Keys are config.json names.
_TINY = {
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "minimax_text_01": dict(model_type="minimax", num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "qwen3_next": dict(model_type="qwen3_next", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, norm_topk_prob=True),
    "qwen3_vl_moe": dict(model_type="qwen3_vl_moe_text", num_experts=16, num_experts_per_tok=4,
                         moe_intermediate_size=32),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", num_experts=16, num_experts_per_tok=4,
                        moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "deepseek_v2": dict(model_type="deepseek_v2", n_routed_experts=16, num_experts_per_tok=3,
                        moe_intermediate_size=32, n_shared_experts=2, topk_method="greedy",
                        routed_scaling_factor=1.0, n_group=1, topk_group=1),
    "deepseek_v2_group_limited": dict(model_type="deepseek_v2", n_routed_experts=16, num_experts_per_tok=3,
                                      moe_intermediate_size=32, n_shared_experts=2,
                                      topk_method="group_limited_greedy", routed_scaling_factor=16.0,
                                      n_group=4, topk_group=2),
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=16, num_experts_per_tok=4,
                        moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True),
    "deepseek_v3_no_norm": dict(model_type="deepseek_v3", n_routed_experts=16, num_experts_per_tok=4,
                                moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1,
                                routed_scaling_factor=2.827, norm_topk_prob=False),
    "glm4_moe": dict(model_type="glm4_moe", n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                     n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True),
    "glm4_moe_lite": dict(model_type="glm4_moe_lite", n_routed_experts=16, num_experts_per_tok=4,
                          moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
                          routed_scaling_factor=1.8, norm_topk_prob=True),
    "exaone_moe": dict(model_type="exaone_moe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                       num_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                       norm_topk_prob=True),
    "kimi_linear": dict(model_type="kimi_linear", num_experts=16, num_experts_per_token=4, moe_intermediate_size=32,
                        num_shared_experts=1, num_expert_group=1, topk_group=1, routed_scaling_factor=2.446,
                        moe_renormalize=True),
    "minimax_m2": dict(model_type="minimax_m2", num_local_experts=16, num_experts_per_tok=4, intermediate_size=32),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=4, intermediate_size=32,
                    swiglu_limit=7.0),
    "llama4": dict(model_type="llama4_text", num_local_experts=8, num_experts_per_tok=1, intermediate_size=32),
    "olmoe": dict(model_type="olmoe", num_experts=16, num_experts_per_tok=4, intermediate_size=32,
                  norm_topk_prob=False),
    "flex_olmo": dict(model_type="flex_olmo", num_experts=7, num_experts_per_tok=2, intermediate_size=32,
                      norm_topk_prob=False),
    "granitemoe": dict(model_type="granitemoe", num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "aria": dict(model_type="aria_text", moe_num_experts=8, moe_topk=2, intermediate_size=32,
                 moe_num_shared_experts=2),
    "jamba": dict(model_type="jamba", num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "hunyuan_v1_moe": dict(model_type="hunyuan_v1_moe", num_experts=8, moe_topk=2, intermediate_size=32),
    "dots1": dict(model_type="dots1", n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                  n_shared_experts=2, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True),
    "hy_v3": dict(model_type="hy_v3", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                  num_shared_experts=1, router_scaling_factor=2.826),
    "afmoe": dict(model_type="afmoe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                  num_shared_experts=2, route_scale=1.5),
    "cohere2_moe": dict(model_type="cohere2_moe", num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                        num_shared_experts=1, expert_selection_fn="softmax",
                        shared_expert_combination_strategy="average"),
    "lfm2_moe": dict(model_type="lfm2_moe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                     norm_topk_prob=True, routed_scaling_factor=1.25, use_expert_bias=True),
    "ernie4_5_moe": dict(model_type="ernie4_5_moe", moe_num_experts=16, moe_k=4, moe_intermediate_size=32,
                         moe_num_shared_experts=2, moe_norm_min=1e-12),
}


def tiny_config(name: str, **overrides) -> dict:
    """A small config dict for preset `name` (H = 64, E = 7-16, I = 32, K = 1-4), overrides applied."""
    if name not in _TINY:
        raise ValueError(f"tiny_config: argument 'name' must be one of {', '.join(sorted(_TINY))}, got {name!r}")
    cfg = dict(hidden_size=64, hidden_act="silu", **_TINY[name])
    cfg.update(overrides)
    return cfg


# ----------------------------------------------------------------------------- the layer
@dataclass
class MoEWeights:
    """One MoE layer's weights in moelab's layout (moe_forward's arguments)."""
    router_weight: torch.Tensor                  # [E, H] f32 (f64 exact)
    w13: torch.Tensor                            # [E, 2I, H] bf16 (f64 exact); silu: gate rows then up rows
    w2: torch.Tensor                             # [E, H, I]
    router_bias: Optional[torch.Tensor] = None   # [E] f32 (GPT-OSS)
    bias: Optional[torch.Tensor] = None          # [E] f32: route's selection bias
    w13_bias: Optional[torch.Tensor] = None      # [E, 2I] f32
    w2_bias: Optional[torch.Tensor] = None       # [E, H] f32
    shared: Optional[SharedExpert] = None


def layer_kwargs(family: Family) -> dict:
    """moe_forward's keyword arguments for `family` (weights not included)."""
    return dict(top_k=family.top_k, method=family.method, renormalize=family.renormalize,
                scaling=float(family.scaling), norm_eps=family.norm_eps, n_group=family.n_group,
                topk_group=family.topk_group, activation=family.activation, alpha=float(family.alpha),
                limit=float(family.limit), apply_router_weight_on_input=family.apply_router_weight_on_input)


def moe_layer(x: torch.Tensor, family: Family, weights: MoEWeights, *, ops=None, quant: str = "bf16",
              **overrides) -> torch.Tensor:
    """reference.moe.moe_forward with the family's arguments and `weights`.

    x: [..., H] bf16 (float64 with float64 weights: exact mode); the leading dimensions are
    flattened to tokens and restored. overrides: any moe_forward keyword (e.g. dispatch).
    """
    kw = layer_kwargs(family)
    kw.update(router_bias=weights.router_bias, bias=weights.bias, w13_bias=weights.w13_bias,
              w2_bias=weights.w2_bias, shared=weights.shared)
    kw.update(overrides)
    shape = x.shape
    out = moe_forward(x.reshape(-1, shape[-1]), weights.router_weight, weights.w13, weights.w2, quant=quant,
                      ops=ops, **kw)
    return out.reshape(shape)
