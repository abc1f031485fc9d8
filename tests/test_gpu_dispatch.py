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
