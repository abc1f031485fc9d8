"""dispatch.explain on CUDA/ROCm tensors: what each op does there, with or without the GPU
extension. CPU-only torch cannot make CUDA tensors, so stand-ins with a CUDA device are used."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from optimized import dispatch, gpu


def fake(shape, dtype=torch.bfloat16):
    return SimpleNamespace(shape=tuple(shape), dtype=dtype, device=torch.device("cuda", 0))


def test_gpu_policies_name_the_kernel_and_the_platform():
    x, w = fake((4, 3072)), fake((513, 3072))
    d = dispatch.explain("unquantized_gemm", x, w)
    if gpu.available():
        assert d.kernel == "skinny" and ("cuda" in d.reason or "rocm" in d.reason)
    else:
        assert d.kernel == "library" and "not built" in d.reason and ("cuBLAS" in d.reason or "hipBLASLt" in d.reason)
    d = dispatch.explain("unquantized_gemm", fake((64, 3072)), w)
    assert d.kernel in ("library", "skinny_chunked")
    with dispatch.batch_invariant_mode(True):
        d = dispatch.explain("unquantized_gemm", fake((64, 3072)), w)
        assert d.kernel == ("skinny_chunked" if gpu.available() else "library")


@pytest.mark.parametrize("op,args", [
    ("router_gemm", (fake((8, 3072)), fake((256, 3072), torch.float32))),
    ("route", (fake((512, 896), torch.float32), 16, "sigmoid_bias")),
    ("permute", (fake((8, 4096)), fake((8, 2), torch.int32), 8)),
    ("unpermute", (fake((16, 4096)), fake((8, 2), torch.float32), fake((16,), torch.int32))),
])
def test_every_gpu_op_has_a_policy(op, args):
    d = dispatch.explain(op, *args)
    assert d.op == op and d.reason
    if not gpu.available():
        assert "not built" in d.reason


def test_cpu_tensors_keep_the_cpu_policy():
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(8, 64)
    assert dispatch.explain("router_gemm", x, w).kernel == "moelab"
    assert "fused-cast kernel" in dispatch.explain("router_gemm", x, w).reason


def test_fused_experts_gpu_policy(monkeypatch):
    """The GPU policy of fused_experts: per-block paths from the real block sizes (ids on the
    CPU stand in for the device's), the provisional crossover, and batch-invariant mode putting
    every block on the small-m path whatever `dispatch` says. Without the GPU extension: the
    reference; the policy itself is checked with the extension's presence faked."""
    E, H, I, K, T = 8, 64, 32, 2, 24
    ids = torch.zeros(T, K, dtype=torch.int32)
    ids[:, 1] = torch.arange(T, dtype=torch.int32) % 7 + 1         # expert 0: 24 rows; 1..7: 3-4 rows
    x, w13, w2, tw = fake((T, H)), fake((E, 2 * I, H)), fake((E, H, I)), fake((T, K), torch.float32)
    d = dispatch.explain("fused_experts", x, w13, w2, tw, ids, quant="fp8_block")
    if not gpu.available():
        assert d.kernel == "reference" and "not built" in d.reason
        monkeypatch.setattr(dispatch, "_gpu_loaded", lambda: True)
        d = dispatch.explain("fused_experts", x, w13, w2, tw, ids, quant="fp8_block")
    assert d.kernel == "mixed" and d.counts == {"tiny": 7, "blocked": 1} and "small-m" in d.reason
    assert d.m_cross == dispatch.GPU_FUSED_EXPERTS_M_CROSS["fp8_block"]
    assert dispatch.explain("fused_experts", x, w13, w2, tw, ids, quant="fp8_block", dispatch="blocked").kernel == "blocked"
    with dispatch.batch_invariant_mode(True):
        d = dispatch.explain("fused_experts", x, w13, w2, tw, ids, quant="fp8_block", dispatch="blocked")
        assert d.kernel == "tiny" and d.counts == {"tiny": 8, "blocked": 0} and "batch-invariant" in d.reason


def test_fused_experts_gpu_plan_codes():
    """fused_experts_gpu_plan: the CPU's codes for explicit policies, the GPU crossover for auto,
    and the small-m path for everything in batch-invariant mode (runs without a GPU)."""
    assert dispatch.fused_experts_gpu_plan(4, 8, 128, "mxfp4", "tiny")[:2] == (0, 0)
    assert dispatch.fused_experts_gpu_plan(4, 8, 128, "mxfp4", "blocked")[:2] == (1, 0)
    code, m, _ = dispatch.fused_experts_gpu_plan(4, 8, 128, "mxfp4", "auto")
    assert code == 2 and m == dispatch.GPU_FUSED_EXPERTS_M_CROSS["mxfp4"]
    with dispatch.batch_invariant_mode(True):
        for p in ("auto", "blocked", "global", "per_block"):
            assert dispatch.fused_experts_gpu_plan(512, 8, 128, "fp8_block", p)[0] == 0
