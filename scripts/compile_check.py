#!/usr/bin/env python3
"""Compile every moelab GPU source for every target, without a GPU, and check the registers.

    python scripts/compile_check.py [--out build/compile-check] [--only nvcc|hipcc] [--allow-missing]

Targets (DESIGN.md): nvcc for sm_80 and sm_90a; hipcc (HIP_PLATFORM=amd) for gfx90a and
gfx940. Only the device code is compiled (nvcc -cubin, hipcc --cuda-device-only), one job per
(source, target), in parallel. The kernels are torch-free, so no GPU build of torch is needed.

Reports, written to --out:
  ptxas-<source>-<arch>.txt     nvcc's -Xptxas -v output (registers, spills, stack)
  amdgpu-<source>-<arch>.txt    clang's kernel-resource-usage remarks (VGPRs, spills, scratch)
  summary.csv                   one row per (kernel, target): registers, spill bytes, stack/scratch
The check FAILS on a compile error, on a missing compiler (unless --allow-missing), and on
any spill to memory in a hot kernel: nvcc "bytes spill stores" > 0, or AMD "VGPRs Spill" > 0.
Every kernel is hot unless listed in COLD below with its reason. Reported, not failed: AMD
"SGPRs Spill" (scalar registers spill into VGPR lanes with v_writelane, no memory traffic),
and stack frames / scratch without spills (private arrays).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "optimized" / "csrc"
NV_ARCHS = ("sm_80", "sm_90a")
AMD_ARCHS = ("gfx90a", "gfx940")
# Kernels allowed to spill (substring of the mangled name -> reason). None today.
COLD: dict[str, str] = {}


@dataclass
class Job:
    tool: str          # nvcc | hipcc
    src: Path
    arch: str
    report: Path
    obj: Path


@dataclass
class Row:
    tool: str
    source: str
    arch: str
    kernel: str
    registers: int
    spill_bytes: int   # nvcc: spill stores (bytes); AMD: VGPRs spilled to scratch (count)
    stack_bytes: int   # nvcc: stack frame; AMD: scratch bytes per lane
    hot: bool
    sgpr_spill: int = 0   # AMD only: SGPRs spilled into VGPR lanes


def find_tool(name: str, env_homes: tuple[str, ...], fallbacks: tuple[str, ...]) -> str | None:
    path = shutil.which(name)
    if path:
        return path
    for var in env_homes:
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / name).exists():
            return str(Path(home) / "bin" / name)
    for fb in fallbacks:
        if Path(fb).exists():
            return fb
    return None


def jobs_for(nvcc: str | None, hipcc: str | None, out: Path) -> list[Job]:
    jobs = []
    cu = sorted((CSRC / "gpu").glob("*.cu"))
    hip = sorted((CSRC / "hip").glob("*.hip"))
    if nvcc:
        for src in cu:
            for arch in NV_ARCHS:
                jobs.append(Job("nvcc", src, arch, out / f"ptxas-{src.stem}-{arch}.txt", out / "obj" / f"{src.stem}.{arch}.cubin"))
    if hipcc:
        for src in cu + hip:
            for arch in AMD_ARCHS:
                jobs.append(Job("hipcc", src, arch, out / f"amdgpu-{src.stem}-{arch}.txt", out / "obj" / f"{src.stem}.{arch}.o"))
    return jobs


def command(job: Job, nvcc: str | None, hipcc: str | None) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if job.tool == "nvcc":
        return [nvcc, "-std=c++17", "-O3", f"-arch={job.arch}", "-cubin", "-Xptxas", "-v",
                "-o", str(job.obj), str(job.src)], env
    env["HIP_PLATFORM"] = "amd"
    return [hipcc, "-x", "hip", "-std=c++17", "-O3", f"--offload-arch={job.arch}", "--cuda-device-only",
            "-c", "-o", str(job.obj), str(job.src), "-Rpass-analysis=kernel-resource-usage"], env


def run(job: Job, nvcc: str | None, hipcc: str | None) -> tuple[Job, int, float]:
    cmd, env = command(job, nvcc, hipcc)
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job.report.write_text(f"$ {' '.join(cmd)}\n{p.stdout}")
    return job, p.returncode, time.monotonic() - t0


def demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    p = subprocess.run([cxxfilt], input="\n".join(names), stdout=subprocess.PIPE, text=True)
    out = p.stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def parse_ptxas(job: Job) -> list[Row]:
    rows, cur = [], None
    stack = spill = 0
    for line in job.report.read_text().splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(\w+)'", line)
        if m:
            cur, stack, spill = m.group(1), 0, 0
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur:
            stack, spill = int(m.group(1)), int(m.group(2))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            rows.append(Row("nvcc", job.src.name, job.arch, cur, int(m.group(1)), spill, stack,
                            not any(k in cur for k in COLD)))
            cur = None
    return rows


def parse_amdgpu(job: Job) -> list[Row]:
    rows, cur, vals = [], None, {}
    for line in job.report.read_text().splitlines():
        m = re.search(r"remark:\s+Function Name: (\S+)", line)
        if m:
            if cur:
                rows.append(_amd_row(job, cur, vals))
            cur, vals = m.group(1), {}
            continue
        m = re.search(r"remark:\s+([A-Za-z ]+?)(?: \[bytes/lane\])?: (\d+) \[", line)
        if m and cur:
            vals[m.group(1).strip()] = int(m.group(2))
    if cur:
        rows.append(_amd_row(job, cur, vals))
    return rows


def _amd_row(job: Job, name: str, v: dict) -> Row:
    return Row("hipcc", job.src.name, job.arch, name, v.get("VGPRs", -1), v.get("VGPRs Spill", 0),
               v.get("ScratchSize", 0), not any(k in name for k in COLD), v.get("SGPRs Spill", 0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "compile-check"))
    ap.add_argument("--only", choices=("nvcc", "hipcc"))
    ap.add_argument("--allow-missing", action="store_true", help="skip (not fail) a missing compiler")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args(argv)
    out = Path(args.out)
    (out / "obj").mkdir(parents=True, exist_ok=True)

    nvcc = None if args.only == "hipcc" else find_tool("nvcc", ("CUDA_HOME", "CUDA_PATH"), ("/usr/local/cuda/bin/nvcc",))
    hipcc = None if args.only == "nvcc" else find_tool("hipcc", ("ROCM_HOME", "ROCM_PATH"), ("/opt/rocm/bin/hipcc",))
    problems = []
    for name, tool in (("nvcc", nvcc), ("hipcc", hipcc)):
        if tool is None and args.only in (None, name):
            msg = f"{name} not found (PATH, {'CUDA_HOME' if name == 'nvcc' else 'ROCM_HOME'})"
            print(("skipped: " if args.allow_missing else "FAIL: ") + msg)
            if not args.allow_missing:
                problems.append(msg)

    jobs = jobs_for(nvcc, hipcc, out)
    t0 = time.monotonic()
    rows: list[Row] = []
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for job, rc, secs in pool.map(lambda j: run(j, nvcc, hipcc), jobs):
            status = "ok" if rc == 0 else f"FAILED (rc {rc}, see {job.report})"
            print(f"  {job.tool:5s} {job.arch:7s} {job.src.relative_to(CSRC)}: {status}, {secs:.1f} s")
            if rc != 0:
                problems.append(f"{job.tool} {job.arch} {job.src.name} does not compile")
                print("\n".join(job.report.read_text().splitlines()[-15:]))
                continue
            rows += parse_ptxas(job) if job.tool == "nvcc" else parse_amdgpu(job)
    wall = time.monotonic() - t0

    names = demangle(sorted({r.kernel for r in rows}))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tool", "source", "arch", "kernel", "registers", "spill", "stack_or_scratch_bytes", "hot",
                    "sgpr_spill"])
        for r in rows:
            w.writerow([r.tool, r.source, r.arch, names.get(r.kernel, r.kernel), r.registers, r.spill_bytes,
                        r.stack_bytes, int(r.hot), r.sgpr_spill])
    for r in rows:
        if r.spill_bytes > 0 and r.hot:
            problems.append(f"spill in hot kernel ({r.tool} {r.arch}): {names.get(r.kernel, r.kernel)} "
                            f"{r.spill_bytes} bytes")
    # Per source and target: the most registers and the total spills.
    print(f"\n{len(jobs)} compilations in {wall:.1f} s ({args.jobs} parallel); {len(rows)} kernel reports "
          f"-> {out / 'summary.csv'}")
    agg: dict[tuple, list] = {}
    for r in rows:
        a = agg.setdefault((r.tool, r.source, r.arch), [0, 0, 0, 0, 0])
        a[0] += 1
        a[1] = max(a[1], r.registers)
        a[2] += r.spill_bytes
        a[3] = max(a[3], r.stack_bytes)
        a[4] += r.sgpr_spill
    print(f"  {'tool':5s} {'source':22s} {'arch':7s} kernels  max-regs  spills  max-stack/scratch  sgpr-spills")
    for (tool, src, arch), (n, regs, sp, st, sg) in sorted(agg.items()):
        print(f"  {tool:5s} {src:22s} {arch:7s} {n:7d}  {regs:8d}  {sp:6d}  {st:17d}  {sg:11d}")
    if problems:
        print("\ncompile-check FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("\ncompile-check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
