#!/usr/bin/env python3
"""Errors raised from the kernels' bindings, each case in a process of its own.

    python scripts/gpu_error_probe.py --out DIR [--device cuda|cpu]   (scripts/gpu_check.sh runs it)

Why a process per case. The first H200 run (experiments/results/nvidia-h200/gpu_check.log)
passed every correctness check of every GPU kernel, then died of a segmentation fault at the
first error the GPU bindings raised: a bad expert id in fused_experts (gpu_opcheck) and in
permute (verify's bad inputs), and again in the four compute-sanitizer runs, which start with
the same bad inputs. compute-sanitizer reported no device error before the crash, so the fault
is on the host. One case per process tells which errors survive and which kill the process,
with Python's faulthandler traceback, and (CUDA, where cuda-gdb exists) the native backtrace
of a rerun under cuda-gdb.

Cases (each expects a RuntimeError naming the argument, then checks that a valid call on the
same device still gives the CPU kernel's result):
  torch_builtin        an ATen error (view of a wrong size): is any C++ exception safe here?
  cpu_binding          moelab's CPU extension: route with top_k = 0
  check_router_gemm    moelab's GPU extension, an argument check before any launch (weight dtype)
  check_fused_experts  the same in fused_experts (quant 'int4')
  check_packed         fused_experts with packed = True: the GPU takes the standard layout only
  status_fused_experts an expert id the kernel finds out of range (status word read back)
  status_permute       the same in permute
  status_unpermute     a dst_pos out of range in unpermute

DIR/errors.csv: case, result (ok / wrong / crashed / timeout), return code, detail.
DIR/errors.txt: every case's output; for a crash, the faulthandler traceback and the native
backtrace. Exit status 1 if any case is not ok.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------ the cases (child side)
def _cases(dev):
    import torch

    ops = torch.ops.moelab
    g = torch.Generator().manual_seed(0)
    E, K, H, I, T = 4, 2, 64, 32, 3
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 8).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / 8).bfloat16()
    tw = torch.rand(T, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    bad_ids = ids.clone()
    bad_ids[1, 1] = E
    wr = torch.randn(8, H, generator=g)

    def fe(ids_, quant="bf16", packed=False):
        d = lambda t: t.to(dev)  # noqa: E731
        return ops.fused_experts(d(x), d(w13), d(w2), d(tw), d(ids_), quant, packed, E, I, None, None, None, None,
                                 None, None, "silu", 1.702, 7.0, 0, 4, False)

    def healthy():
        """A valid call on the device after the error: the CPU kernel's result."""
        got = ops.router_gemm(x.to(dev), wr.to(dev)).cpu()
        want = ops.router_gemm(x, wr)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), "router_gemm after the error differs from the CPU"

    hid = torch.randn(T, H, generator=g).bfloat16()
    return {
        "torch_builtin": (None, lambda: torch.empty(2, device=dev).view(3), healthy),
        "cpu_binding": ("top_k", lambda: ops.route(torch.randn(2, 8), 0, "softmax_topk"), healthy),
        "check_router_gemm": ("weight", lambda: ops.router_gemm(x.to(dev), wr.to(dev).double()), healthy),
        "check_fused_experts": ("quant", lambda: fe(ids, "int4"), healthy),
        # the GPU takes the standard layout only and refuses `packed`; the CPU takes packed
        # tensors there and refuses these standard ones by the weight's name
        "check_packed": ("packed" if dev != "cpu" else "w13", lambda: fe(ids, packed=True), healthy),
        "status_fused_experts": ("topk_ids", lambda: fe(bad_ids), healthy),
        "status_permute": ("ids", lambda: ops.permute(hid.to(dev), bad_ids.to(dev), E, None, E, 1), healthy),
        "status_unpermute": ("dst_pos", lambda: ops.unpermute(
            torch.randn(T * K, H).bfloat16().to(dev), tw.to(dev), torch.full((T * K,), T * K, dtype=torch.int32,
                                                                               device=dev)), healthy),
        # not in CASES: the probe's own test (tests/test_compile_check.py) that a crash is caught
        "selftest_crash": (None, lambda: __import__("ctypes").string_at(0), healthy),
    }


def child(case: str, dev: str) -> int:
    sys.path.insert(0, str(ROOT))
    import optimized  # noqa: F401  (builds / loads the extensions)

    arg, call, after = _cases(dev)[case]
    print(f"{case} on {dev}: calling", flush=True)
    try:
        call()
    except RuntimeError as e:
        msg = str(e).splitlines()[0][:300]
        if arg is not None and f"'{arg}'" not in msg:
            print(f"WRONG: the error does not name '{arg}': {msg}", flush=True)
            return 1
        print(f"raised: {msg}", flush=True)
    else:
        print("WRONG: no error", flush=True)
        return 1
    after()
    print("OK: the error was raised and a valid call afterwards gives the CPU kernel's result", flush=True)
    return 0


# ------------------------------------------------------------------------ the parent
def native_backtrace(case: str, dev: str, timeout: float) -> str:
    """The crash again under cuda-gdb (host frames), or why not."""
    gdb = shutil.which("cuda-gdb") or ("/usr/local/cuda/bin/cuda-gdb" if Path("/usr/local/cuda/bin/cuda-gdb").exists()
                                       else None)
    if gdb is None:
        return "no cuda-gdb on this machine: no native backtrace"
    cmd = [gdb, "-q", "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 40",
           "--args", sys.executable, "-X", "faulthandler", __file__, "--case", case, "--device", dev]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = f"cuda-gdb ran past {timeout:.0f} s\n{e.stdout or ''}"
    lines = [ln for ln in out.splitlines() if not ln.startswith("[New Thread") and "[Thread debugging" not in ln]
    return "\n".join(lines[-80:])


CASES = ("torch_builtin", "cpu_binding", "check_router_gemm", "check_fused_experts", "check_packed",
         "status_fused_experts", "status_permute", "status_unpermute")


FIELDS = ["case", "device", "result", "rc", "detail"]


def environment() -> str:
    """What a crash in C++ error handling may depend on: the interpreter's build (a
    BOLT-optimized or frame-pointer-less CPython has broken glibc backtrace(), which every
    c10::Error constructor calls, for others: python-build-standalone issue 991), and torch's."""
    import platform
    import sysconfig
    lines = [f"python: {sys.executable} {sys.version.split()[0]} ({platform.python_compiler()})"]
    args = sysconfig.get_config_var("CONFIG_ARGS") or ""
    lines.append("python configure: " + " ".join(a for a in args.split() if any(
        k in a for k in ("bolt", "frame-pointer", "optimizations", "lto", "shared"))) or "(none of interest)")
    lines.append("python CFLAGS: " + " ".join(f for f in (sysconfig.get_config_var("CFLAGS") or "").split()
                                             if "frame" in f or "unwind" in f or f.startswith("-O")))
    try:
        import torch
        import re
        cfg = torch.__config__.show()
        comp = re.search(r"CXX_COMPILER=([^,]+)", cfg)
        std = sorted(set(re.findall(r"-std=\S+", cfg)))
        lines.append(f"torch {torch.__version__}: built by {comp.group(1) if comp else '?'}, "
                     f"standard flags {' '.join(std) or '(none listed)'}")
    except Exception as e:   # the probe's own report must not die of it
        lines.append(f"torch: {type(e).__name__}: {e}")
    return "\n".join(lines) + "\n\n"


def parent(out: Path, dev: str, timeout: float, backtrace: bool, cases=CASES, max_backtraces: int = 1) -> int:
    """Every case in its own process; a crash on the GPU is rerun under cuda-gdb (the first
    max_backtraces crashes only: the step has a time limit, and one backtrace usually tells).
    Both files are written case by case, so a step stopped at its limit keeps what it found."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    csv_path, log_path = out / "errors.csv", out / "errors.txt"
    with open(csv_path, "w", newline="") as f:
        csv.DictWriter(f, fieldnames=FIELDS).writeheader()
    log_path.write_text(environment())
    traced = 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for case in cases:
        cmd = [sys.executable, "-X", "faulthandler", __file__, "--case", case, "--device", dev]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = None, f"ran past {timeout:.0f} s\n{e.stdout or ''}{e.stderr or ''}"
        # A fatal signal ends the child with it, or (a process under AddressSanitizer, as in
        # `make sanitize`) with the sanitizer's exit code after its report: faulthandler's line
        # tells either way.
        fatal = next((ln.strip() for ln in text.splitlines() if ln.startswith("Fatal Python error:")), None)
        if rc is None:
            result, detail = "timeout", f"ran past {timeout:.0f} s"
        elif rc < 0 or rc >= 128:
            sig = -rc if rc < 0 else rc - 128
            result, detail = "crashed", f"killed by signal {sig}" + (f" ({fatal})" if fatal else "")
        elif fatal:
            result, detail = "crashed", f"{fatal} (exit {rc})"
        elif rc == 0:
            result, detail = "ok", next((ln for ln in text.splitlines() if ln.startswith("raised:")), "")
        else:
            result = "wrong"
            detail = next((ln for ln in text.splitlines() if ln.startswith("WRONG")), text.strip().splitlines()[-1:])
        print(f"  {result:8s} {case:22s} {str(detail)[:200]}", flush=True)
        row = {"case": case, "device": dev, "result": result, "rc": rc, "detail": str(detail)[:300]}
        rows.append(row)
        with open(csv_path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=FIELDS).writerow(row)
        with open(log_path, "a") as f:
            f.write(f"===== {case} on {dev}: {result} (rc {rc})\n{text.rstrip()}\n\n")
            if result == "crashed" and backtrace and dev != "cpu" and traced < max_backtraces:
                traced += 1
                f.flush()
                f.write(f"----- native backtrace of {case} (cuda-gdb)\n{native_backtrace(case, dev, 2 * timeout)}\n\n")
    bad = [r["case"] for r in rows if r["result"] != "ok"]
    print(f"{len(rows) - len(bad)} of {len(rows)} error cases ok" + (f"; not ok: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="folder for errors.csv and errors.txt (the parent run)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--case", help=argparse.SUPPRESS)          # the child run: one case
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases (default: all)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case (default 30)")
    ap.add_argument("--no-backtrace", action="store_true", help="no cuda-gdb rerun of a crashed case")
    a = ap.parse_args()
    if a.case:
        return child(a.case, a.device)
    if not a.out:
        ap.error("--out is required")
    return parent(Path(a.out), a.device, a.timeout, not a.no_backtrace, a.cases.split(","))


if __name__ == "__main__":
    sys.exit(main())
