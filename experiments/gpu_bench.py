"""GPU timings of every moelab op against the eager-PyTorch way and the seeds' "before" paths.

    python -m experiments.gpu_bench --out DIR [--quick]      (scripts/gpu_check.sh runs it)

Each seed's "before" is the seed's own before path, so a lent GPU measures the seeds'
comparisons: 001 a cast kernel plus the f32 GEMM as two launches (router_gemm_impls), 002 the
library GEMM (F.linear), 003 the allocating permute, 004 warp 0 alone selecting over every
expert (route_variant "serial", route_impls) against the lane-owned kernel; other comparisons
(the eager torch.topk chain) are rows of their own, not labelled "before".

Method (see the seeds and the issues' targets):
- Each implementation is timed as a CUDA graph of `reps` back-to-back calls (small launches
  are dominated by CPU launch overhead otherwise), replayed `repeats` times; per-call time =
  replay time / reps, measured with CUDA events; we report the median and the 10th/90th
  percentiles over repeats. Inputs are made once; graphs keep them alive.
- permute's scratch comparison is also timed eagerly (host path included, with the
  device-side index check read-back switched off: MOELAB_GPU_SYNC_CHECKS=0), since an
  allocation inside a captured graph costs nothing at replay.
- Floors: the faster of two measured device bandwidths, a large tensor copy (read + write
  counted) and a large sum (read only), turns each op's bytes into a memory floor; the
  measured replay cost of one tiny kernel is the launch floor.
- fused_experts: every call captured in a graph has its own routing, so consecutive calls
  read other experts and the weights stream from HBM (an expert set stays in the 50 MB L2
  otherwise); bytes = the distinct routed experts' weights and scales per call, reported as
  GB/s and as a fraction of the read probe (issue 35: >= 60%) and of the floor bandwidth.
  Prefill T = 512 (full run) also times torch._grouped_mm over the same routings with the
  weights in bf16 (grouped_mm_experts, transformers' GPU path; issue 35: ours >= 1.0x).
Writes DIR/gpu_bench.csv (one row per op, case, implementation) and DIR/gpu_env.csv.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("MOELAB_GPU_SYNC_CHECKS", "0")   # read once by the binding, before the first call

import torch
import torch.nn.functional as F

import optimized  # noqa: F401  (loads the extensions)
from optimized import gpu

OPS = torch.ops.moelab
DEV = "cuda"


def graph_time(fn, reps: int = 20, repeats: int = 15) -> tuple[float, float, float]:
    """(median, p10, p90) microseconds per call of fn, replayed as a CUDA graph of reps calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / reps)
    return _stats(times)


def eager_time(fn, reps: int = 50, repeats: int = 15) -> tuple[float, float, float]:
    """Per-call microseconds of fn called eagerly (host overhead included)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / reps)
    return _stats(times)


def _stats(t):
    t = sorted(t)
    return statistics.median(t), t[max(0, len(t) // 10)], t[min(len(t) - 1, (9 * len(t)) // 10)]


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write counted), from a 1 GiB copy."""
    n = 1 << 28
    a, b = torch.empty(n, device=DEV), torch.empty(n, device=DEV)
    med, _, _ = graph_time(lambda: b.copy_(a), reps=5, repeats=7)
    return 2 * n * 4 / (med * 1e-6)


def read_bandwidth() -> float:
    """Device read bandwidth in bytes/s, from summing 2 GiB of f32: the ceiling of a weight
    stream, which reads and writes almost nothing (the first H200 run measured only the copy,
    2711.4 GB/s read + written, and rated decode against it)."""
    n = 1 << 29
    a = torch.ones(n, device=DEV)
    out = torch.empty((), device=DEV)
    med, _, _ = graph_time(lambda: torch.sum(a, out=out), reps=5, repeats=7)
    return n * 4 / (med * 1e-6)


def launch_floor() -> float:
    x = torch.zeros(1, device=DEV)
    return graph_time(lambda: x.add_(1), reps=50, repeats=9)[0]


ROWS: list[dict] = []
CSV_PATH: list[Path] = []   # gpu_bench.csv of this run (set by main)
READ_BW = [0.0]             # the read probe of this run in bytes/s (set by main): issue 35's decode target


def add(op, case, impl, t, floor_us, note=""):
    med, p10, p90 = t
    ROWS.append(dict(op=op, case=case, impl=impl, median_us=round(med, 3), p10_us=round(p10, 3),
                     p90_us=round(p90, 3), floor_us=round(floor_us, 3), note=note))
    print(f"  {op:12s} {case:34s} {impl:26s} {med:9.2f} us  [{p10:.2f}, {p90:.2f}]  floor {floor_us:.2f} us {note}")
    if CSV_PATH:   # rewritten at every row: a step killed at its time limit keeps what it measured
        write_rows(CSV_PATH[0])


def write_rows(path: Path) -> None:
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(ROWS[0]) if ROWS else ["op"])
        wr.writeheader()
        wr.writerows(ROWS)


# ------------------------------------------------------------- the seeds' pairs, by label
# Each *_impls function returns {label: callable} on the inputs' device: the moelab side (label
# starting "moelab", what the notebooks read as "ours"), the seed's own "before" (label starting
# "before:"), and any other comparison under a label that starts with neither. Torch-only, so
# tests/test_gpu_bench.py runs them on the CPU.
def router_gemm_impls(x, w) -> dict:
    """Seed 001: before = a cast kernel (bf16 -> f32 into a buffer) and the f32 GEMM as two
    separate launches; after = moelab's fused cast+GEMM (one launch)."""
    xf = torch.empty(x.shape, dtype=torch.float32, device=x.device)

    def before():
        xf.copy_(x)                       # launch 1: the cast
        return torch.mm(xf, w.t())        # launch 2: the GEMM (cuBLAS; may split K itself)
    return {"moelab fused cast": lambda: OPS.router_gemm(x, w),
            "before: cast kernel + GEMM (2 launches)": before}


def _route_plan_label(E, K) -> str:
    try:
        return gpu.route_plan(E, K).split(":")[0]
    except Exception:                     # no GPU extension (the CPU tests)
        return "cpu"


def route_impls(logits, bias, K, scaling=2.5) -> dict:
    """Seed 004: before = route_variant(selection="serial"), warp 0 alone scans every expert
    while the other warps wait; after = selection "lanes", the tier table (what route runs:
    the lane-owned block path at E 512..2048, K 9..32). The eager torch.topk chain is a third,
    separate row: fusion, not the seed's change."""
    E = logits.shape[1]
    return {f"moelab lanes [{_route_plan_label(E, K)}]":
            lambda: OPS.route_variant(logits, K, "sigmoid_bias", "lanes", bias, scaling),
            "before: warp 0 alone (route_variant serial)":
            lambda: OPS.route_variant(logits, K, "sigmoid_bias", "serial", bias, scaling),
            "eager torch.topk chain (not seed 004's pair)":
            lambda: eager_route_sigmoid_bias(logits, bias, K, scaling)}


def check_route_pair(impls: dict) -> None:
    """Validate before timing: the seed's two kernels give the same bits, the eager chain the same ids
    (up to near-ties of its own sigmoid)."""
    outs = {k: fn() for k, fn in impls.items()}
    (wa, ia), (wb, ib) = [v for k, v in outs.items() if k.startswith(("moelab", "before:"))]
    assert torch.equal(ia, ib) and torch.equal(wa.view(torch.int32), wb.view(torch.int32)), \
        "route_variant serial and lanes differ"


ROUTE_SHAPES_QUICK = [(896, 16, 512), (512, 9, 512), (1024, 16, 512), (256, 8, 64)]
# seed 004's headline, then its grid region (E 512..1024, K 9..16) and shapes outside it
ROUTE_SHAPES = [(896, 16, 512), (896, 16, 64), (896, 16, 2048), (512, 9, 512), (512, 16, 512), (768, 12, 512),
                (1024, 9, 512), (1024, 16, 512), (256, 8, 512), (128, 8, 64), (2048, 32, 256)]


def bench_router_gemm(bw, lf, quick):
    H, E = 3072, 256
    w = torch.randn(E, H, device=DEV) / H ** 0.5
    for T in ([1, 8, 32] if quick else [1, 2, 4, 8, 16, 32]):
        x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
        floor = max(lf, (E * H * 4 + T * H * 2 + T * E * 4) / bw * 1e6)
        case = f"T={T} H={H} E={E} bf16"
        for label, fn in router_gemm_impls(x, w).items():
            add("router_gemm", case, label, graph_time(fn), floor,
                "seed 001's before path" if label.startswith("before:") else "")


def bench_skinny(bw, lf, quick):
    for K in ([7168] if quick else [4096, 7168]):
        N = 513
        w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) / K ** 0.5
        for T in [1, 2, 4, 8]:
            x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
            floor = max(lf, (N * K * 2 + T * K * 2 + T * N * 2) / bw * 1e6)
            case = f"T={T} K={K} N={N} bf16"
            add("skinny_gemm", case, f"moelab {gpu.skinny_kernel(torch.bfloat16, T, K).split(' (')[0]}",
                graph_time(lambda: OPS.skinny_gemm(x, w, None)), floor)
            add("skinny_gemm", case, "before: F.linear", graph_time(lambda: F.linear(x, w)), floor,
                "seed 002's before path")


def eager_route_sigmoid_bias(logits, bias, K, scaling):
    """The eager-PyTorch way (torch.topk): sigmoid, + bias, topk, gather, normalize."""
    s = torch.sigmoid(logits.float())
    idx = torch.topk(s + bias, K, dim=-1).indices
    w = s.gather(-1, idx)
    return w * scaling / (w.sum(-1, keepdim=True) + 1e-20), idx.to(torch.int32)


def bench_route(bw, lf, quick):
    for E, K, T in (ROUTE_SHAPES_QUICK if quick else ROUTE_SHAPES):
        logits = torch.randn(T, E, device=DEV)
        bias = torch.randn(E, device=DEV) * 0.1
        floor = max(lf, (T * E * 4 + T * K * 8) / bw * 1e6)
        case = f"E={E} K={K} T={T} sigmoid_bias"
        impls = route_impls(logits, bias, K)
        check_route_pair(impls)
        for label, fn in impls.items():
            add("route", case, label, graph_time(fn), floor,
                "seed 004's before (warp 0 alone)" if label.startswith("before:") else
                "" if label.startswith("moelab") else "fusion vs the eager chain: a separate comparison")


def eager_permute(hidden, ids, E):
    """The eager-PyTorch way: a stable argsort of the flattened expert ids, a count per expert
    and a gather. It must be capturable in a CUDA graph: torch.bincount is not (on CUDA it reads
    the largest id back to the host to size its output, which capture refuses; the first H200
    run failed there), so the counts are a scatter_add into E zeros."""
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(E, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]), hidden[order // ids.shape[1]], order


def bench_permute(bw, lf, quick):
    E, K, H = 8, 2, 4096     # Mixtral (seed 003)
    for T in ([1, 8, 64] if quick else [1, 8, 32, 128, 512]):
        hidden = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=DEV)[:K] for _ in range(T)]).to(torch.int32)
        cap = T * K
        scratch = (torch.empty(E + 1, dtype=torch.int64, device=DEV), torch.empty(cap, H, dtype=torch.bfloat16, device=DEV),
                   torch.empty(cap, dtype=torch.int32, device=DEV), torch.empty(cap, dtype=torch.int32, device=DEV),
                   torch.empty(gpu.permute_counts_numel(cap, E), dtype=torch.int64, device=DEV))
        floor = max(lf, (T * H * 2 + cap * H * 2 + 12 * cap) / bw * 1e6)
        case = f"T={T} E={E} K={K} H={H} bf16"
        with_scratch = lambda: OPS.permute_out(hidden, ids, E, None, E, 1, *scratch)  # noqa: E731
        fresh = lambda: OPS.permute(hidden, ids, E, None, E, 1)  # noqa: E731
        add("permute", case, "moelab scratch (eager)", eager_time(with_scratch), floor, "host path included")
        add("permute", case, "before: allocating (eager)", eager_time(fresh), floor, "seed 003's before path")
        add("permute", case, "moelab scratch (graph)", graph_time(with_scratch), floor)
        add("permute", case, "eager torch sort+gather", graph_time(lambda: eager_permute(hidden, ids, E)), floor)
        offsets, hout, src_row, dst_pos = fresh()
        w = torch.rand(T, K, device=DEV)
        ufloor = max(lf, (cap * H * 2 + T * H * 2) / bw * 1e6)
        add("unpermute", case, "moelab", graph_time(lambda: OPS.unpermute(hout, w, dst_pos)), ufloor)
        add("unpermute", case, "eager torch gather+sum",
            graph_time(lambda: (hout[dst_pos.long()].view(T, K, H).float() * w[..., None]).sum(1).to(hout.dtype)), ufloor)


# ------------------------------------------------------------------------ fused_experts
def _fe_weights(quant, E, N, K):
    """Random weights of one format straight on the device (no quantization pass): bf16 ~
    N(0, 1/K); fp8 codes without the NaN codes and f32 block scales ~2^-8; mxfp4 codes and e8m0
    scales 2^-9..2^-5."""
    if quant == "bf16":
        return (torch.randn(E, N, K, device=DEV) * K ** -0.5).bfloat16(), None
    if quant == "fp8_block":
        q = torch.randint(0, 256, (E, N, K), dtype=torch.uint8, device=DEV)
        q[(q & 0x7F) == 0x7F] = 0
        s = (torch.rand(E, -(-N // 128), -(-K // 128), device=DEV) + 0.5) * 2.0 ** -8
        return q.view(torch.float8_e4m3fn), s
    q = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=DEV)
    return q, torch.randint(118, 123, (E, N, K // 32), dtype=torch.uint8, device=DEV)


def _fe_expert_bytes(quant, H, I):
    """Bytes one expert's weights and scales occupy (what a decode call must read per expert)."""
    if quant == "bf16":
        return 3 * H * I * 2
    if quant == "fp8_block":
        return 3 * H * I + 4 * ((-(-2 * I // 128)) * (-(-H // 128)) + (-(-H // 128)) * (-(-I // 128)))
    return 3 * H * I // 2 + 3 * H * I // 32


def _fe_routings(n, T, E, K, seed, all_to_one=False):
    """n different routings (one per call captured in a graph, so consecutive calls read other
    experts and the weights come from HBM, not from the 50 MB L2)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if all_to_one:
            ids = torch.randperm(E, generator=gen)[:K].repeat(T, 1)
        else:
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        out.append(ids.to(torch.int32))
    return out


def grouped_mm_experts(x, w13, w2, tw, ids, act="silu", b13=None, b2=None, alpha=1.702, limit=7.0):
    """The expert MLPs the way transformers' grouped-GEMM experts compute them on a GPU (issue
    35's prefill baseline, its weights bf16): the T*K slots sorted by expert, torch._grouped_mm
    over each expert's rows for GEMM1, the activation in f32, GEMM2, then each token's weighted
    sum. No host synchronisation (dropped slots, id -1, sort last and are masked, not removed),
    so a CUDA graph can hold it. x [T, H] bf16, w13 [E, 2I, H] / w2 [E, H, I] bf16."""
    from reference.fused_experts import activate
    T, K = ids.shape
    E = w13.shape[0]
    key = ids.reshape(-1).long()
    key = torch.where(key < 0, E, key)                     # dropped slots after every expert
    order = torch.argsort(key, stable=True)
    ks = key[order]
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device).scatter_add_(0, ks, torch.ones_like(ks))
    offs = torch.cumsum(counts[:E], 0).to(torch.int32)
    tok = order // K
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs).float()
    e = ks.clamp(max=E - 1)
    if b13 is not None:
        h = h + b13[e].float()
    a = activate(h.bfloat16().float(), act, alpha, limit).bfloat16()
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs).float()
    if b2 is not None:
        y = y + b2[e].float()
    wt = tw.reshape(-1)[order].float().unsqueeze(1)
    y = torch.where((ks < E).unsqueeze(1), y * wt, 0.0)   # rows past the last group: unset, dropped
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y)
    return out.bfloat16()


def bench_fused_experts(bw, lf, quick):
    """Decode: Qwen3-30B-A3B fp8, GPT-OSS-20B mxfp4 (swiglu_oai, biases) and OLMoE-1B-7B bf16,
    the weight-read bandwidth against the read probe of this run (issue 35's target: >= 60%).
    Then the crossover of the two paths (fp8; all tokens on the same K experts, so every block
    has m = T) and, in the full run, prefill T = 512 of each model against torch._grouped_mm on
    the same routings with the weights in bf16 (issue 35: >= 1.0x), plus fp8 in batch-invariant
    mode (small-m path only)."""
    from optimized import dispatch
    from reference.quant import dequantize_expert_weights
    reps = 20
    models = [("Qwen3-30B-A3B", "fp8_block", 128, 8, 2048, 768, "silu", False, [1, 4, 16]),
              ("GPT-OSS-20B", "mxfp4", 32, 4, 2880, 2880, "swiglu_oai", True, [1, 4]),
              ("OLMoE-1B-7B", "bf16", 64, 8, 2048, 1024, "silu", False, [1, 4, 16])]
    for name, quant, E, K, H, I, act, bias, Ts in models:
        w13, s13 = _fe_weights(quant, E, 2 * I, H)
        w2, s2 = _fe_weights(quant, E, H, I)
        b13 = torch.randn(E, 2 * I, device=DEV) * 0.1 if bias else None
        b2 = (torch.randn(E, H, device=DEV) * 0.1).bfloat16() if bias else None
        per_expert = _fe_expert_bytes(quant, H, I) + (2 * I * 4 + H * 2 if bias else 0)

        def timed(T, routes, policy, invariant=False, baseline=None):
            x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
            tw = torch.rand(T, K, device=DEV)
            ids = [r.to(DEV) for r in routes]
            with dispatch.batch_invariant_mode(invariant):
                code, m_cross, _ = dispatch.fused_experts_gpu_plan(T, K, E, quant, policy)
            it = iter(range(1 << 30))

            def call():
                OPS.fused_experts(x, w13, w2, tw, ids[next(it) % len(ids)], quant, False, E, I, s13, s2, None, None,
                                  b13, b2, act, 1.702, 7.0, code, m_cross)

            def call_baseline():
                grouped_mm_experts(x, baseline[0], baseline[1], tw, ids[next(it) % len(ids)], act, b13, b2)
            return graph_time(call if baseline is None else call_baseline, reps=reps)

        for T in Ts[:2] if quick else Ts:
            routes = _fe_routings(reps + 3, T, E, K, seed=T)
            nbytes = sum(int(torch.unique(r[r >= 0]).numel()) for r in routes) / len(routes) * per_expert
            floor = max(lf, nbytes / bw * 1e6)
            t = timed(T, routes, "auto")
            gbs = nbytes / (t[0] * 1e-6) / 1e9
            add("fused_experts", f"{name} {quant} T={T} decode", "moelab auto", t, floor,
                f"{nbytes / 1e6:.1f} MB of weights: {gbs:.0f} GB/s = {100 * gbs * 1e9 / READ_BW[0]:.0f}% of the read "
                f"probe (target >= 60%), {100 * gbs * 1e9 / bw:.0f}% of the floor bandwidth")
        if quant == "fp8_block":
            for T in ([16, 64] if quick else [8, 16, 32, 64]):          # m = T rows in each of K blocks
                routes = _fe_routings(reps + 3, T, E, K, seed=100 + T, all_to_one=True)
                floor = max(lf, K * per_expert / bw * 1e6)
                for policy in ("tiny", "blocked"):
                    add("fused_experts", f"{name} {quant} m={T} crossover", f"moelab {policy}",
                        timed(T, routes, policy), floor, "all tokens on the same K experts "
                        "(GPU_FUSED_EXPERTS_M_CROSS is provisional)")
        if not quick:
            T = 512
            routes = _fe_routings(4, T, E, K, seed=512)
            flops = 2 * T * K * 3 * H * I
            floor = max(lf, E * per_expert / bw * 1e6, flops / 990e12 * 1e6)
            dense = tuple(w if quant == "bf16" else dequantize_expert_weights(quant, w, sc).bfloat16()
                          for w, sc in ((w13, s13), (w2, s2)))
            runs = [("moelab auto", dict(policy="auto")), ("torch._grouped_mm (bf16 weights)",
                                                           dict(policy="auto", baseline=dense))]
            if quant == "fp8_block":
                runs.append(("moelab auto batch-invariant", dict(policy="auto", invariant=True)))
            for impl, kw in runs:
                try:
                    t = timed(T, routes, **kw)
                except Exception as e:   # the baseline's failure must not cost our rows
                    print(f"fused_experts {name} T={T} prefill, {impl} FAILED: {type(e).__name__}: {e}")
                    continue
                add("fused_experts", f"{name} {quant} T={T} prefill", impl, t, floor,
                    f"{flops / (t[0] * 1e-6) / 1e12:.1f} TFLOP/s (floor: 990 TFLOP/s dense bf16, all {E} experts' "
                    f"weights once); target: moelab auto >= 1.0x torch._grouped_mm")
            del dense
        del w13, w2, s13, s2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    assert torch.cuda.is_available() and gpu.available(), "needs a GPU and the moelab GPU extension"
    # Floors take the faster of the two probes: bytes over the best rate this run saw the memory
    # move, so no kernel can beat its floor.
    cbw, rbw, lf = copy_bandwidth(), read_bandwidth(), launch_floor()
    bw = max(cbw, rbw)
    READ_BW[0] = rbw
    CSV_PATH[:] = [out / "gpu_bench.csv"]
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda or "",
               hip=getattr(torch.version, "hip", "") or "", copy_bandwidth_GBps=round(cbw / 1e9, 1),
               read_bandwidth_GBps=round(rbw / 1e9, 1), floor_bandwidth_GBps=round(bw / 1e9, 1),
               launch_floor_us=round(lf, 3), **{f"moelab_{k}": v for k, v in gpu.info().items()})
    print(env)
    with open(out / "gpu_env.csv", "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerows(env.items())
    failures = 0
    for b in (bench_router_gemm, bench_skinny, bench_route, bench_permute, bench_fused_experts):
        try:
            b(bw, lf, args.quick)
        except Exception as e:   # keep timing the others; the log says what broke
            failures += 1
            print(f"{b.__name__} FAILED: {type(e).__name__}: {e}")
        write_rows(out / "gpu_bench.csv")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
