#!/usr/bin/env python3
"""On a GPU machine: torch.library.opcheck of every moelab op on CUDA tensors, and a quick
differential check of each GPU kernel against the CPU kernel of the same op.

    python scripts/gpu_opcheck.py --out DIR        (scripts/gpu_check.sh runs it)

Checks (one CSV row each, DIR/opcheck.csv):
  opcheck   torch.library.opcheck(op, args) on CUDA inputs (schema, fake tensor, dispatch)
  ids       route's ids bit-identical to the CPU kernel's, and to the reference's
  exact     permute's offsets/src_row/dst_pos/hidden and unpermute's output bit-identical to CPU
  close     router_gemm / skinny_gemm within 4x the CPU kernel's error against an f64 GEMM,
            plus one output rounding
  invariant a token's GEMM output is the same bits alone and inside the batch
Exit status 1 if any check failed (every check runs regardless).
"""
from __future__ import annotations

import argparse
import csv
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optimized  # noqa: E402  (builds/loads the CPU and GPU extensions)
from optimized import gpu  # noqa: E402
import reference  # noqa: E402

OPS = torch.ops.moelab
DEV = "cuda"
ROWS: list[dict] = []


def record(op, case, check, ok, detail=""):
    ROWS.append({"op": op, "case": case, "check": check, "result": "pass" if ok else "FAIL", "detail": detail})
    print(f"  {'pass' if ok else 'FAIL'}  {op:12s} {check:9s} {case} {detail}")


def run(op, case, check, fn):
    try:
        ok, detail = fn()
        record(op, case, check, ok, detail)
    except Exception as e:  # a crash is a failure of that check, the others still run
        record(op, case, check, False, f"{type(e).__name__}: {e}"[:300])
        traceback.print_exc()


def opcheck(op, case, args):
    def fn():
        torch.library.opcheck(getattr(OPS, op).default, args)
        return True, ""
    run(op, case, "opcheck", fn)


def g(seed):
    gen = torch.Generator().manual_seed(seed)
    return gen


# ---------------------------------------------------------------------------- route
ROUTE_CASES = [
    # (E, K, method, n_group, topk_group, dtype)
    (8, 2, "softmax_topk", 1, 1, torch.float32),
    (64, 6, "topk_softmax", 1, 1, torch.bfloat16),
    (128, 8, "sigmoid_topk", 1, 1, torch.float16),
    (256, 8, "grouped_sigmoid_bias", 8, 4, torch.float32),
    (256, 8, "sigmoid_bias", 1, 1, torch.bfloat16),
    (384, 16, "sigmoid_bias", 1, 1, torch.float32),
    (512, 16, "softmax_topk", 1, 1, torch.float32),
    (896, 16, "sigmoid_bias", 1, 1, torch.float32),        # seed 004's shape (block tier)
    (1024, 32, "grouped_sigmoid_bias", 16, 4, torch.bfloat16),
    (2048, 12, "sigmoid_topk", 1, 1, torch.float32),
    (160, 1, "llama4", 1, 1, torch.float32),
]


def route_case(E, K, method, ng, tg, dtype, T=67, ties=False):
    gen = g(E * 131 + K)
    x = torch.randn(T, E, generator=gen).to(dtype)
    if ties:   # many exact ties and special values: the tie rule must hold bit for bit
        x = (torch.randint(-3, 4, (T, E), generator=gen) / 2).to(dtype)
        x[0, :5] = float("nan")
        x[1, 3] = float("inf")
        x[2, ::2] = -0.0
    bias = None
    if method in ("sigmoid_bias", "grouped_sigmoid_bias"):
        bias = (torch.randn(E, generator=gen) * 0.1).float()
    scaling = 2.5 if bias is not None else 1.0
    renorm = method in ("softmax_topk", "sigmoid_topk")
    return x, bias, dict(n_group=ng, topk_group=tg, scaling=scaling, renormalize=renorm)


def check_route():
    for E, K, method, ng, tg, dtype in ROUTE_CASES:
        for ties in (False, True):
            x, bias, kw = route_case(E, K, method, ng, tg, dtype, ties=ties)
            case = f"E={E} K={K} {method} {str(dtype)[6:]}{' ties' if ties else ''} [{gpu.route_plan(E, K)[:40]}]"
            # schema order: logits, top_k, method, bias, scaling, renormalize, n_group, topk_group
            args_gpu = (x.to(DEV), K, method, None if bias is None else bias.to(DEV), kw["scaling"],
                        kw["renormalize"], kw["n_group"], kw["topk_group"])
            if not ties:
                opcheck("route", case, args_gpu)

            def fn(x=x, bias=bias, kw=kw, args_gpu=args_gpu, K=K, method=method):
                wg, ig = OPS.route(*args_gpu)
                wc, ic = OPS.route(x, K, method, bias, kw["scaling"], kw["renormalize"], kw["n_group"],
                                   kw["topk_group"])
                wr, ir = reference.route(x, K, method, bias=bias, **kw)
                same_cpu = torch.equal(ig.cpu(), ic)
                same_ref = torch.equal(ig.cpu(), ir)
                werr = (wg.cpu() - wr).abs().nan_to_num(0).max().item() if wr.numel() else 0.0
                same_nan = torch.equal(wg.cpu().isnan(), wr.isnan())
                detail = f"ids==cpu {same_cpu} ids==ref {same_ref} max|w-w_ref| {werr:.2e} nan-pattern {same_nan}"
                # GPU keys are the reference's (f64 rounded once): ids must equal the reference's;
                # the CPU kernel may differ from both by near-tie flips (its own sigmoid), reported.
                return same_ref and same_nan and werr <= 1e-6, detail
            run("route", case, "ids", fn)


# ------------------------------------------------------------------------ permute
def check_permute():
    for T, K, E, H, align, mapped, dtype in [(1, 2, 8, 4096, 1, False, torch.bfloat16),
                                             (8, 2, 8, 4096, 1, False, torch.bfloat16),
                                             (33, 8, 64, 640, 16, True, torch.float16),
                                             (700, 8, 256, 72, 4, False, torch.float32),
                                             (5000, 2, 16, 264, 1, True, torch.bfloat16)]:
        gen = g(T + E)
        hidden = torch.randn(T, H, generator=gen).to(dtype)
        ids = torch.randint(-1, E, (T, K), generator=gen, dtype=torch.int32)
        emap, n_local = None, E
        if mapped:
            n_local = E // 2
            emap = torch.full((E,), -1, dtype=torch.int32)
            emap[torch.randperm(E, generator=gen)[:n_local]] = torch.arange(n_local, dtype=torch.int32)
        case = f"T={T} K={K} E={E} H={H} align={align}{' map' if mapped else ''} {str(dtype)[6:]}"
        dargs = (hidden.to(DEV), ids.to(DEV), E, None if emap is None else emap.to(DEV), n_local, align)
        opcheck("permute", case, dargs)

        def fn(dargs=dargs, hidden=hidden, ids=ids, E=E, emap=emap, n_local=n_local, align=align):
            got = [t.cpu() for t in OPS.permute(*dargs)]
            want = OPS.permute(hidden, ids, E, emap, n_local, align)
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            return same, "offsets/hidden/src_row/dst_pos " + ("identical" if same else "DIFFER")
        run("permute", case, "exact", fn)

        def fn_out(dargs=dargs, T=T, K=K, n_local=n_local, align=align, H=H, dtype=dtype):
            cap = T * K + n_local * (align - 1)
            bufs = (torch.empty(n_local + 1, dtype=torch.int64, device=DEV), torch.empty(cap, H, dtype=dtype, device=DEV),
                    torch.empty(cap, dtype=torch.int32, device=DEV), torch.empty(T * K, dtype=torch.int32, device=DEV),
                    torch.empty(gpu.permute_counts_numel(T * K, n_local), dtype=torch.int64, device=DEV))
            OPS.permute_out(*dargs, *bufs)
            want = OPS.permute(*dargs)
            same = all(torch.equal(a, b) for a, b in zip(bufs[:4], want))
            return same, "permute_out == permute"
        run("permute_out", case, "exact", fn_out)

        def fn_un(dargs=dargs, T=T, K=K, dtype=dtype, gen=gen, H=H):
            offsets, hout, src_row, dst_pos = OPS.permute(*dargs)
            eo = torch.randn(hout.shape, generator=gen).to(dtype)
            w = torch.rand(T, K, generator=gen)
            got = OPS.unpermute(eo.to(DEV), w.to(DEV), dst_pos).cpu()
            want = OPS.unpermute(eo, w, dst_pos.cpu())
            return torch.equal(got, want), "bit-identical to the CPU kernel"
        run("unpermute", case, "exact", fn_un)
        if T <= 33:
            offsets, hout, src_row, dst_pos = OPS.permute(*dargs)
            opcheck("unpermute", case, (hout, torch.rand(T, K, device=DEV), dst_pos))


# ---------------------------------------------------------------------------- GEMMs
def gemm_check(op, x, w, bias, out_dtype_round):
    xg, wg = x.to(DEV), w.to(DEV)
    bg = None if bias is None else bias.to(DEV)
    if op == "router_gemm":
        got = OPS.router_gemm(xg, wg).cpu()
        cpu = OPS.router_gemm(x, w)
        exact = x.double() @ w.double().T
    else:
        got = OPS.skinny_gemm(xg, wg, bg).cpu()
        cpu = OPS.skinny_gemm(x, w, bias)
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    e_gpu = (got.double() - exact).abs()
    e_cpu = (cpu.double() - exact).abs()
    ulp = exact.abs() * (2.0 ** -8 if out_dtype_round == torch.bfloat16 else 2.0 ** -11 if out_dtype_round == torch.float16 else 0)
    bound = 4 * e_cpu.max().item() + ulp.max().item() + 1e-6
    ok = e_gpu.max().item() <= bound
    # batch invariance: token 0 alone == token 0 in the batch
    alone = (OPS.router_gemm(xg[:1], wg) if op == "router_gemm" else OPS.skinny_gemm(xg[:1], wg, bg)).cpu()
    inv = torch.equal(alone[0], got[0])
    return ok and inv, f"max err gpu {e_gpu.max().item():.2e} cpu {e_cpu.max().item():.2e} bound {bound:.2e} invariant {inv}"


def check_gemms():
    for T, H, E, dtype in [(1, 3072, 256, torch.bfloat16), (7, 3072, 256, torch.bfloat16), (32, 3072, 256, torch.bfloat16),
                           (20, 1000, 37, torch.float16), (45, 64, 5, torch.float32), (3, 2047, 9, torch.bfloat16)]:
        gen = g(T * H)
        x = torch.randn(T, H, generator=gen).to(dtype)
        w = torch.randn(E, H, generator=gen) / H ** 0.5
        case = f"T={T} H={H} E={E} {str(dtype)[6:]}"
        opcheck("router_gemm", case, (x.to(DEV), w.to(DEV)))
        run("router_gemm", case, "close", lambda x=x, w=w: gemm_check("router_gemm", x, w, None, None))
    for T, K, N, dtype, with_bias in [(1, 7168, 513, torch.bfloat16, False), (4, 4096, 513, torch.bfloat16, True),
                                      (8, 2880, 33, torch.float16, True), (3, 1001, 7, torch.float32, False),
                                      (2, 6144, 129, torch.bfloat16, False)]:
        gen = g(T * K + N)
        x = torch.randn(T, K, generator=gen).to(dtype)
        w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
        b = torch.randn(N, generator=gen).to(dtype) if with_bias else None
        case = f"T={T} K={K} N={N} {str(dtype)[6:]}{' bias' if with_bias else ''} [{gpu.skinny_kernel(dtype, T, K)[:30]}]"
        opcheck("skinny_gemm", case, (x.to(DEV), w.to(DEV), None if b is None else b.to(DEV)))
        run("skinny_gemm", case, "close", lambda x=x, w=w, b=b, dtype=dtype: gemm_check("skinny_gemm", x, w, b, dtype))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    assert torch.cuda.is_available(), "no GPU visible"
    assert gpu.available(), "the moelab GPU extension did not load"
    print("gpu extension:", gpu.info(), torch.cuda.get_device_name())
    for section in (check_route, check_permute, check_gemms):
        try:
            section()
        except Exception as e:
            record(section.__name__, "-", "section", False, f"{type(e).__name__}: {e}"[:300])
            traceback.print_exc()
    with open(out / "opcheck.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=["op", "case", "check", "result", "detail"])
        wr.writeheader()
        wr.writerows(ROWS)
    failed = [r for r in ROWS if r["result"] != "pass"]
    print(f"{len(ROWS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
