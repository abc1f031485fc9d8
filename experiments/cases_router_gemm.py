"""router_gemm (seed 001): fused-cast kernel vs `F.linear(x.float(), w)`, MiniMax-M2 shape.

Weights rotate through copies larger than the last-level cache (timing.Rotating), as in a
model where every layer has its own router. Peers (--peers): the f32 gate as vLLM's CPU linear
dispatcher runs it (oneDNN) and as it runs it on a Zen CPU (zentorch_linear_unary), each on
x.float(); issue 13's target: ours >= 1.0x the best of them for T <= 32."""
import torch
import torch.nn.functional as F

import optimized
from . import peers
from .bench import Case
from .timing import Rotating


def cases(quick: bool):
    H, E = 3072, 256
    ws = Rotating(lambda: torch.randn(E, H), E * H * 4)
    out = []
    for T in ([1, 4, 8, 32] if quick else [1, 4, 8, 16, 32]):
        x = torch.randn(T, H).bfloat16()
        out.append(Case("router_gemm", f"T={T} H={H} E={E} bf16",
                        lambda x=x: F.linear(x.float(), ws.next()),
                        lambda x=x: optimized.router_gemm(x, ws.next()),
                        nbytes=E * H * 4 + T * H * 2 + T * E * 4,
                        target=1.0 if T == 1 else 2.0,
                        peers=lambda x=x: peers.router_gemm(x, ws), peer_target=1.0, cold=True))  # issue: >= 2x at T = 4, 8, 32; not slower at 1
    return out
