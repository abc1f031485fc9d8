"""experiments/gpu_bench.py's CPU-side logic: the seeds' pairs it times on a lent GPU are the
seeds' own (004: warp 0 alone vs lane-owned, through route_variant; 001: a cast kernel and the
GEMM as separate launches vs the fused kernel), labelled so the notebooks pair them, and the
pairs compute the same thing. The callables are torch-only, so they run here on CPU tensors
(the CPU kernels of the same ops); the timing itself needs a GPU and is not run."""
from __future__ import annotations

import csv

import pytest
import torch

from experiments import gpu_bench, nb


def _labels(impls):
    ours = [k for k in impls if k.startswith("moelab")]
    before = [k for k in impls if k.startswith("before:")]
    return ours, before


def test_route_pair_is_seed_004s_and_agrees():
    g = torch.Generator().manual_seed(0)
    E, K, T = 896, 16, 64
    logits, bias = torch.randn(T, E, generator=g), torch.randn(E, generator=g) * 0.1
    impls = gpu_bench.route_impls(logits, bias, K)
    ours, before = _labels(impls)
    assert len(ours) == 1 and len(before) == 1, impls.keys()
    assert "warp 0" in before[0] and "lanes" in ours[0]
    assert not any("eager" in k for k in ours + before), "the eager chain must not be the seed's before"
    gpu_bench.check_route_pair(impls)                      # serial == lanes, bit for bit
    (w_l, i_l), (w_s, i_s) = impls[ours[0]](), impls[before[0]]()
    assert torch.equal(i_l, i_s)
    w_e, i_e = impls["eager torch.topk chain (not seed 004's pair)"]()
    assert (i_e == i_l).float().mean() > 0.99             # the same routing, up to sigmoid near-ties


def test_check_route_pair_catches_a_difference():
    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(8, 512, generator=g), torch.randn(512, generator=g) * 0.1
    impls = gpu_bench.route_impls(logits, bias, 9)
    ours, before = _labels(impls)
    good = impls[before[0]]
    impls[before[0]] = lambda: (good()[0], good()[1].flip(-1))
    with pytest.raises(AssertionError, match="differ"):
        gpu_bench.check_route_pair(impls)


def test_router_gemm_before_is_cast_then_gemm():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3072, generator=g).bfloat16()
    w = torch.randn(256, 3072, generator=g) / 3072 ** 0.5
    impls = gpu_bench.router_gemm_impls(x, w)
    ours, before = _labels(impls)
    assert len(ours) == 1 and len(before) == 1 and "2 launches" in before[0]
    ref = x.double() @ w.double().t()
    for fn in impls.values():
        assert torch.allclose(fn().double(), ref, rtol=1e-4, atol=1e-4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        impls[before[0]]()
    ops = [e.name for e in prof.events() if e.name.startswith("aten::") and e.name in ("aten::copy_", "aten::mm")]
    assert ops.count("aten::copy_") >= 1 and ops.count("aten::mm") == 1, ops


def test_notebook_pairs_the_bench_rows(tmp_path, monkeypatch):
    """nb.gpu_speedups(op, "moelab", <004's before prefix>) picks exactly the seed's pair from
    rows labelled as bench_route writes them (the eager row is not taken as the before)."""
    g = torch.Generator().manual_seed(3)
    impls = gpu_bench.route_impls(torch.randn(2, 896, generator=g), torch.zeros(896), 16)
    root = tmp_path / "results" / "fake-gpu"
    root.mkdir(parents=True)
    with open(root / "gpu_bench.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["op", "case", "impl", "median_us", "p10_us", "p90_us", "floor_us", "note"])
        for label, us in zip(impls, (12.0, 20.0, 90.0)):
            w.writerow(["route", "E=896 K=16 T=512 sigmoid_bias", label, us, us, us, 1.0, ""])
    monkeypatch.setattr(nb, "results_root", lambda: tmp_path / "results")
    sp = nb.gpu_speedups("route", "moelab", "before: warp 0")
    assert len(sp) == 1 and sp["speedup"].iloc[0] == pytest.approx(20.0 / 12.0)


def test_eager_permute_baseline_is_the_reference_and_has_no_host_sync():
    """The eager baseline the GPU bench captures in a CUDA graph: the reference's offsets and
    rows, built without torch.bincount (on CUDA it reads the largest id back to the host, which
    graph capture refuses: the first H200 run failed there)."""
    import inspect

    import reference
    g = torch.Generator().manual_seed(3)
    T, E, K, H = 37, 8, 2, 16
    hidden = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids[ids == 5] = 4                                         # an empty expert, a crowded one
    offsets, rows, order = gpu_bench.eager_permute(hidden, ids, E)
    ref = reference.permute(hidden, ids, E)
    assert torch.equal(offsets, ref.offsets.to(offsets.dtype))
    assert torch.equal(rows, ref.hidden[: T * K])
    assert torch.equal(order.to(torch.int32), ref.src_row[: T * K])
    assert "bincount" not in inspect.getsource(gpu_bench.eager_permute).split('"""')[-1]


@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_grouped_mm_baseline_computes_the_expert_mlps(act):
    """The prefill baseline (torch._grouped_mm over expert-sorted slots, bf16 weights) computes
    the reference's expert MLPs: within bf16 rounding of the reference, a fully dropped token an
    exact zero row; with the experts' weights permuted it is far off (the check can fail)."""
    from reference.fused_experts import fused_experts as reference
    g = torch.Generator().manual_seed(0)
    E, H, I, T, K = 6, 64, 32, 9, 3
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    tw = torch.rand(T, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids[2, 1] = -1
    ids[5] = -1
    b13 = torch.randn(E, 2 * I, generator=g) * 0.1 if act == "swiglu_oai" else None
    b2 = (torch.randn(E, H, generator=g) * 0.1).bfloat16() if act == "swiglu_oai" else None
    want = reference(x, w13, w2, tw, ids, quant="bf16", w13_bias=b13, w2_bias=b2, activation=act).float()
    got = gpu_bench.grouped_mm_experts(x, w13, w2, tw, ids, act, b13, b2).float()
    assert torch.equal(got[5], torch.zeros(H))
    scale = want.abs().max()
    assert (got - want).abs().max() <= 2e-2 * scale
    wrong = gpu_bench.grouped_mm_experts(x, w13.roll(1, 0), w2, tw, ids, act, b13, b2).float()
    assert (wrong - want).abs().max() > 0.1 * scale


@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "mxfp4"])
def test_bench_weights_feed_the_grouped_mm_baseline(quant, monkeypatch):
    """The bench's random weights of each format (made on the device; here the CPU) dequantize
    to the bf16 stacks the prefill baseline takes, and the bytes per expert count what a decode
    call reads (weights and scales)."""
    from reference.quant import dequantize_expert_weights
    monkeypatch.setattr(gpu_bench, "DEV", "cpu")
    E, H, I = 3, 64, 32
    w13, s13 = gpu_bench._fe_weights(quant, E, 2 * I, H)
    w2, s2 = gpu_bench._fe_weights(quant, E, H, I)
    nbytes = sum(t.numel() * t.element_size() for t in (w13, w2, s13, s2) if t is not None)
    assert gpu_bench._fe_expert_bytes(quant, H, I) * E == nbytes
    dense = [w if quant == "bf16" else dequantize_expert_weights(quant, w, sc).bfloat16()
             for w, sc in ((w13, s13), (w2, s2))]
    assert [tuple(d.shape) for d in dense] == [(E, 2 * I, H), (E, H, I)] and dense[0].dtype == torch.bfloat16
    T, K = 5, 2
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(torch.int32)
    out = gpu_bench.grouped_mm_experts(torch.randn(T, H).bfloat16(), dense[0], dense[1], torch.rand(T, K), ids)
    assert out.shape == (T, H) and bool(torch.isfinite(out.float()).all()) and out.abs().max() > 0


def test_every_row_reaches_the_csv_at_once(tmp_path, monkeypatch):
    """A bench step killed at its time limit keeps the rows it measured: add() rewrites the CSV."""
    monkeypatch.setattr(gpu_bench, "ROWS", [])
    monkeypatch.setattr(gpu_bench, "CSV_PATH", [tmp_path / "gpu_bench.csv"])
    gpu_bench.add("route", "E=8 K=2 T=1", "moelab lanes", (1.0, 0.9, 1.1), 0.5)
    gpu_bench.add("route", "E=8 K=2 T=1", "before: warp 0 alone", (2.0, 1.9, 2.1), 0.5)
    rows = list(csv.DictReader(open(tmp_path / "gpu_bench.csv")))
    assert [r["impl"] for r in rows] == ["moelab lanes", "before: warp 0 alone"] and rows[1]["median_us"] == "2.0"
