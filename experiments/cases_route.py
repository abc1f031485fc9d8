"""route (seed 004): the moelab CPU top-k routing kernel vs the eager PyTorch a user writes.

Eager baselines per method (f32 math on an upcast copy, torch.topk, gather, normalize):
  sigmoid_bias  s = sigmoid(x.float()); ids = topk(s + bias, K); w = s[ids];
                w = w / (w.sum() + 1e-20) * scaling
  softmax_topk  p = softmax(x.float()); w, ids = topk(p, K)
  grouped       DeepSeek-V3's group_limited routing (view, top-2 sum per group, topk of
                groups, mask, topk)
The issue's targets (2 threads): sigmoid_bias at (E, K) = (256, 8) and (896, 16): >= 5x at
T = 16 and T = 2048, >= 3x at T = 1. The logits are bf16, as a router GEMM in a bf16 model
hands them over; every call reads fresh logits (the row set is larger than the caches only
at T = 2048, where the logits are 0.5-3.7 MB).
Peers (--peers): vLLM's _C.biased_topk_cpu for sigmoid_bias (E = 256 only: it has no E = 896
kernel), its CPURouter functions for grouped and softmax_topk; issue 13's target: >= 1.0x."""
import torch

import optimized
from . import peers
from .bench import Case


def _eager_sigmoid_bias(x, bias, K, scaling):
    s = x.float().sigmoid()
    _, ids = torch.topk(s + bias, K)
    w = s.gather(1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * scaling, ids


def _eager_softmax_topk(x, K):
    p = torch.softmax(x.float(), dim=-1)
    return torch.topk(p, K)


def _eager_grouped(x, bias, K, n_group, topk_group, scaling):
    T, E = x.shape
    s = x.float().sigmoid()
    keys = s + bias
    g = keys.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
    gidx = torch.topk(g, topk_group, dim=-1).indices
    gmask = torch.zeros_like(g).scatter_(1, gidx, 1.0)
    mask = gmask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    _, ids = torch.topk(keys.masked_fill(mask == 0, float("-inf")), K)
    w = s.gather(1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * scaling, ids


def cases(quick: bool):
    out = []
    g = torch.Generator().manual_seed(4)
    for E, K in [(256, 8), (896, 16)]:
        bias = torch.randn(E, generator=g) * 0.1
        for T in ([1, 16, 2048] if quick else [1, 16, 128, 512, 2048]):
            x = torch.randn(T, E, generator=g).bfloat16()
            target = None if T not in (1, 16, 2048) else (3.0 if T == 1 else 5.0)
            out.append(Case("route", f"sigmoid_bias T={T} E={E} K={K}",
                            lambda x=x, b=bias, K=K: _eager_sigmoid_bias(x, b, K, 2.5),
                            lambda x=x, b=bias, K=K: optimized.route(x, K, "sigmoid_bias", bias=b, scaling=2.5),
                            nbytes=T * E * 2 + T * K * 8, target=target,
                            peers=lambda x=x, b=bias, K=K: peers.route_sigmoid_bias(x, b, K, 2.5),
                            peer_target=1.0))
    if not quick:
        for T in (16, 2048):
            x = torch.randn(T, 256, generator=g).bfloat16()
            bias = torch.randn(256, generator=g) * 0.1
            out.append(Case("route", f"grouped T={T} E=256 K=8 8/4",
                            lambda x=x, b=bias: _eager_grouped(x, b, 8, 8, 4, 2.5),
                            lambda x=x, b=bias: optimized.route(x, 8, "grouped_sigmoid_bias", bias=b,
                                                                n_group=8, topk_group=4, scaling=2.5),
                            nbytes=T * 256 * 2 + T * 64,
                            peers=lambda x=x, b=bias: peers.route_grouped(x, b, 8, 8, 4, 2.5), peer_target=1.0))
            x = torch.randn(T, 128, generator=g).bfloat16()
            out.append(Case("route", f"softmax_topk T={T} E=128 K=8",
                            lambda x=x: _eager_softmax_topk(x, 8),
                            lambda x=x: optimized.route(x, 8, "softmax_topk"),
                            nbytes=T * 128 * 2 + T * 64,
                            peers=lambda x=x: peers.route_softmax_topk(x, 8), peer_target=1.0))
    return out
