"""verify cannot pass a fallback as a kernel (verify/provenance.py).

On a machine with a CUDA torch but without the moelab_gpu extension, `optimized` serves CUDA
tensors with the reference (route, permute, unpermute, fused_experts) or F.linear (router_gemm,
unquantized_gemm). This machine has no GPU, so the situation is staged here: the "cuda" cells
run on the CPU (runner.device_of patched), and optimized's dispatcher is made to take its own
GPU decisions (optimized/dispatch.py: _gpu_permute, _gpu_router_gemm, ...) with the extension
absent, so the very fallback code that would run on such a machine runs here. Each test has
its control: the same staging with the kernels "loaded" is verified, so the verdict comes from
what ran, not from the backend's name.
"""
from __future__ import annotations

import types
from collections import Counter

import pytest
import torch

import verify.__main__ as cli
from verify import provenance as P
from verify import registry as R
from verify import runner
from verify.report import markdown, summary_table

OPTIMIZED = R.import_optimized()
pytestmark = pytest.mark.skipif(OPTIMIZED is None, reason=f"optimized failed to import: {R.optimized_import_error()}")


@pytest.fixture
def fake_cuda(monkeypatch):
    """'cuda' cells run on this CPU, and optimized decides as on a CUDA device whose moelab
    kernels are absent (gpu_loaded=False) or present (True, the control)."""
    import optimized
    from optimized import dispatch, gpu

    monkeypatch.setattr(runner, "device_of", lambda backend: torch.device("cpu"))
    monkeypatch.setattr(cli, "available_backends", lambda: ["cpu", "cuda"])

    def stage(gpu_loaded: bool):
        monkeypatch.setattr(gpu, "available", lambda: gpu_loaded)
        for op in ("router_gemm", "permute", "unpermute", "unquantized_gemm"):
            decide = (lambda op_: lambda *a, **k: dispatch.gpu_decision(op_, *a, **k))(op)
            monkeypatch.setattr(dispatch, f"{op}_decision", decide)
            monkeypatch.setitem(dispatch._EXPLAINERS, op, decide)
        monkeypatch.setattr(dispatch, "unquantized_gemm_kernel", lambda x, w: dispatch.gpu_decision(
            "unquantized_gemm", x, w).kernel)
        return optimized
    return stage


def _run(ops_names, allow_fallback=False, budget=4.0):
    return runner.run(ops_names, ["cuda"], ["uniform"], budget, seed=3, corpus=None, progress=False,
                      bad_random=2, shrink_budget_s=1.0, allow_fallback=allow_fallback)


def test_classify_rules():
    loaded_lib = "router_gemm: library (T = 40 > 32: F.linear(x.float(), w))"
    out = torch.zeros(2, 3)
    assert P.classify(Counter({"moelab::route": 1}), None, out, "cuda", False).impl == P.KERNEL
    assert P.classify(Counter(), loaded_lib, out, "cuda", True).impl == P.LIBRARY
    # the same library decision without the GPU kernels is a stand-in, not the op's choice
    assert P.classify(Counter(), loaded_lib, out, "cuda", False).impl == P.FALLBACK
    # nothing of ours ran and the dispatcher did not say library: the reference
    assert P.classify(Counter(), "route: moelab (GPU kernel)", out, "cuda", True).impl == P.FALLBACK
    assert P.classify(Counter(), None, out, "cpu", True).impl == P.FALLBACK
    assert P.classify(Counter(), None, (torch.zeros(0, 3), torch.zeros(0, 2)), "cuda", False).impl == P.EMPTY
    assert not P.Served(P.FALLBACK, "x").verified and P.Served(P.LIBRARY, "x").verified


def test_kernel_watch_sees_moelab_ops_on_the_device_only():
    x = torch.randn(3, 8)
    w = P.KernelWatch("cpu")
    with w:
        OPTIMIZED.route(x, 2, "softmax_topk")
        torch.nn.functional.linear(x, x)                       # aten: not ours
    assert w.kernels == Counter({"moelab::route": 1})
    other = P.KernelWatch("cuda")
    with other:
        OPTIMIZED.route(x, 2, "softmax_topk")                  # a CPU kernel is not a CUDA kernel
    assert not other.kernels


def _router_gemm_cell(budget=3.0):
    # bi=False: with the extension absent the GPU decision is F.linear even in batch-invariant
    # mode, which a batch-invariance case then (rightly) fails; this test is about provenance
    return runner.run_cell(R.REGISTRY["router_gemm"], "cuda", "uniform", budget, seed=5, fixed={"bi": False},
                           shrink=False, min_cases=3, ops=OPTIMIZED)


def test_reference_fallback_on_cuda_is_not_verified(fake_cuda):
    fake_cuda(gpu_loaded=False)
    res = _run(["permute", "unpermute"])
    cells = {c.op: c for c in res.cells}
    assert cells["permute"].cases >= 1 and cells["unpermute"].cases >= 1
    # every case compared equal (the reference against itself) ...
    assert not res.failures, res.failures
    # ... and still none of it counts
    for c in cells.values():
        assert c.not_verified and c.served["fallback"] == c.cases - c.served.get("empty", 0), c.served
        assert "moelab_gpu extension is not built" in c.fallback_example["why"]
    assert not res.ok
    text = summary_table(res)
    assert "NOT VERIFIED" in text and "fails the run" in text
    assert "**FAIL**" in markdown(res)
    assert res.to_json()["not_verified"] == ["permute cuda uniform", "unpermute cuda uniform"]
    # allowed: the run passes, the cells are still reported and never as passing
    res2 = _run(["permute"], allow_fallback=True)
    assert res2.ok and res2.not_verified and "NOT VERIFIED (allowed by --allow-fallback" in summary_table(res2)
    # router_gemm: F.linear standing in for the unbuilt kernel is within tolerance, and not verified
    st = _router_gemm_cell()
    assert st.cases >= 3 and not st.failure and st.not_verified and st.served["fallback"] >= 1, st.served


def test_same_staging_with_the_kernels_loaded_is_verified(fake_cuda):
    """Control: the GPU decisions with the extension 'present' run moelab kernels (the CPU ones,
    standing in), or the library GEMM the dispatcher chose above its crossover: verified."""
    fake_cuda(gpu_loaded=True)
    res = _run(["permute", "unpermute"])
    assert res.ok and not res.not_verified, summary_table(res)
    assert all(c.served["kernel"] >= 1 for c in res.cells), [c.served for c in res.cells]
    st = _router_gemm_cell()
    assert st.cases >= 3 and not st.failure and not st.not_verified and st.served["kernel"] >= 1, st.served


def test_a_fallback_inside_the_op_is_caught_whatever_the_dispatcher_says(fake_cuda):
    """route on CUDA without the extension: optimized.route calls route_off_cpu, which runs the
    reference when no moelab::route kernel is registered for the device. Nothing in the
    comparison records a dispatch path for route, so only what ran can tell."""
    from optimized import dispatch
    from optimized.route import route_off_cpu
    fake_cuda(gpu_loaded=False)
    ns = types.SimpleNamespace(**{k: getattr(OPTIMIZED, k) for k in dir(OPTIMIZED) if not k.startswith("__")})
    ns.route = lambda logits, top_k, method, **kw: route_off_cpu(logits, top_k, method, **kw)
    has_kernel = dispatch.has_kernel
    try:
        dispatch.has_kernel = lambda op, dev: False
        res = runner.run(["route"], ["cuda"], ["uniform"], 3.0, seed=1, corpus=None, progress=False, bad_random=2,
                         ops=ns)
    finally:
        dispatch.has_kernel = has_kernel
    (cell,) = res.cells
    assert cell.cases >= 1 and not res.failures and cell.not_verified and not res.ok
    # control: the real optimized.route (its CPU kernel standing in for the device's) is verified
    res = runner.run(["route"], ["cuda"], ["uniform"], 2.0, seed=1, corpus=None, progress=False, bad_random=2)
    assert res.ok and res.cells[0].served["kernel"] == res.cells[0].cases


def test_command_line_exits_nonzero_unless_allowed(fake_cuda, capsys):
    fake_cuda(gpu_loaded=False)
    args = ["--backends", "cuda", "--ops", "permute", "--dists", "uniform", "--budget", "3", "--no-corpus",
            "--quiet"]
    assert cli.main(args) == 1
    assert "NOT VERIFIED" in capsys.readouterr().out
    assert cli.main(args + ["--allow-fallback"]) == 0
    assert "NOT VERIFIED (allowed" in capsys.readouterr().out
