#!/usr/bin/env python3
"""Compile every moelab GPU source for every target, without a GPU, and check the registers.

    python scripts/compile_check.py [--out build/compile-check] [--only nvcc|hipcc] [--allow-missing]

Targets (DESIGN.md): nvcc for sm_80 and sm_90a; hipcc (HIP_PLATFORM=amd) for gfx90a and
gfx940. Only the device code is compiled (nvcc -cubin, hipcc --cuda-device-only), one job per
(source, target), in parallel. The kernels are torch-free, so no GPU build of torch is needed.

Reports, written to --out:
  ptxas-<source>-<arch>.txt     nvcc's -Xptxas -v output (registers, spills, stack, static smem)
  amdgpu-<source>-<arch>.txt    clang's kernel-resource-usage remarks (VGPRs, AGPRs, spills,
                                scratch, LDS, occupancy in waves per SIMD)
  summary.csv                   one row per (kernel, target): registers, spill bytes,
                                stack/scratch, block size, static shared memory, theoretical
                                occupancy, and the decode budget with its verdict
The check FAILS on a compile error, on a missing compiler (unless --allow-missing), on any
spill to memory in a hot kernel (nvcc "bytes spill stores" > 0, or AMD "VGPRs Spill" > 0), and
on a decode kernel over its occupancy budget (DECODE_BUDGETS below, docs/gpu.md). Every
kernel is hot unless listed in COLD below with its reason. Reported, not failed: AMD "SGPRs
Spill" (scalar registers spill into VGPR lanes with v_writelane, no memory traffic), and stack
frames / scratch without spills (private arrays).

Occupancy. NVIDIA: ptxas gives registers per thread and static shared memory per block; the
block size is the kernel's __launch_bounds__ (PTX .maxntid, read from the PTX that nvcc keeps:
every moelab kernel is launched at exactly its launch bound, a rule of the sources); the
theoretical occupancy (resident warps per SM / 64) follows from the SM limits of each arch
(NV_LIMITS: registers allocated per warp in units of 256 out of 4 x 16K, shared memory in
units of 128 bytes plus 1 KB reserved per block, at most 32 blocks and 64 warps). Dynamic
shared memory is not known at compile time; no NVIDIA kernel here uses any. AMD: the compiler
reports the occupancy (waves per SIMD, of 8 on gfx90a / gfx940) from VGPRs + AGPRs, SGPRs, LDS
and the flat work-group size that __launch_bounds__ sets.
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
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "optimized" / "csrc"
NV_ARCHS = ("sm_80", "sm_90a")
AMD_ARCHS = ("gfx90a", "gfx940")
# Kernels allowed to spill (substring of the mangled name -> reason). None today.
COLD: dict[str, str] = {}


@dataclass(frozen=True)
class SmLimits:
    """What bounds resident blocks on one SM (the CUDA occupancy calculator's quantities)."""
    smem_per_sm: int               # bytes of shared memory a kernel's blocks can share (max carveout)
    max_warps: int = 64
    max_blocks: int = 32
    regs_per_sm: int = 65536
    sub_partitions: int = 4        # the register file is split in 4; a warp lives in one
    reg_unit: int = 256            # registers are allocated per warp in units of 256
    max_regs_per_thread: int = 255
    smem_unit: int = 128
    smem_reserved_per_block: int = 1024   # the runtime's reserved shared memory per block (sm_80+)


NV_LIMITS = {"sm_80": SmLimits(smem_per_sm=164 * 1024), "sm_90a": SmLimits(smem_per_sm=228 * 1024)}
AMD_MAX_WAVES_PER_SIMD = {"gfx90a": 8, "gfx940": 8}


@dataclass(frozen=True)
class Budget:
    pattern: str       # regex on the demangled kernel name
    max_regs: int      # registers per thread (AMD: VGPRs + AGPRs per lane)
    min_blocks: int    # NVIDIA: resident blocks per SM at the kernel's block size; AMD: waves per SIMD
    why: str
    amd: tuple[int, int] | None = None   # (max_regs, min waves per SIMD) on AMD, where they differ

    def limits(self, tool: str) -> tuple[int, int]:
        return self.amd if tool == "hipcc" and self.amd else (self.max_regs, self.min_blocks)


# The decode kernels: bandwidth-bound weight streams whose speed comes from loads in flight,
# hence from resident warps (docs/gpu.md, Occupancy). All are 4-warp blocks (128 threads on
# CUDA, 256 on CDNA), so <= 128 registers means >= 4 blocks (16 warps, 25%) per SM on sm_80 /
# sm_90a, and >= 4 waves per SIMD on CDNA. The sources ask for it with __launch_bounds__
# (kDecodeMinBlocks, optimized/csrc/gpu/portability.h).
DECODE_BUDGETS = (
    Budget(r"router_gemm_kernel<", 128, 4, "router GEMV (seed 001): streams the f32 router weight"),
    Budget(r"skinny_gemm_kernel<", 128, 4, "skinny GEMM (seed 002): streams the gate weight"),
    Budget(r"fe_small<[^>]*, true>", 128, 4, "fused_experts small-m path, 16-byte loads: streams expert weights "
                                             "(CDNA: 8-row units spill VGPRs at 128, so 3 waves, <= 168)", amd=(168, 3)),
    Budget(r"fe_small<[^>]*, false>", 255, 2, "fused_experts small-m path for rows that are not 16-byte aligned "
                                              "(byte loads with masks; spills at 128, and at 168 on sm_80)"),
)


def budget_for(kernel: str) -> Budget | None:
    """The decode budget of a kernel (demangled name), or None when it has none."""
    return next((b for b in DECODE_BUDGETS if re.search(b.pattern, kernel)), None)


class Occupancy(NamedTuple):
    blocks: int        # resident blocks per SM
    warps: int         # resident warps per SM
    fraction: float    # warps / max_warps
    limiter: str       # what bounds it: registers, shared memory, warps, blocks


def nv_occupancy(arch: str, regs: int, smem: int, threads: int) -> Occupancy:
    """Theoretical occupancy of a kernel on one SM of `arch` (regs per thread, static + dynamic
    shared memory per block, threads per block), as the CUDA occupancy calculator computes it."""
    lim = NV_LIMITS[arch]
    warps_per_block = -(-threads // 32)
    if regs > lim.max_regs_per_thread or warps_per_block > lim.max_warps:
        return Occupancy(0, 0, 0.0, "registers" if regs > lim.max_regs_per_thread else "warps")
    caps = {"warps": lim.max_warps // warps_per_block, "blocks": lim.max_blocks}
    if regs > 0:
        regs_per_warp = -(-regs * 32 // lim.reg_unit) * lim.reg_unit
        warps_by_regs = (lim.regs_per_sm // lim.sub_partitions // regs_per_warp) * lim.sub_partitions
        caps["registers"] = warps_by_regs // warps_per_block
    if smem > 0:
        per_block = -(-(smem + lim.smem_reserved_per_block) // lim.smem_unit) * lim.smem_unit
        caps["shared memory"] = lim.smem_per_sm // per_block
    limiter = min(caps, key=lambda k: caps[k])
    blocks = caps[limiter]
    return Occupancy(blocks, blocks * warps_per_block, blocks * warps_per_block / lim.max_warps, limiter)


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
    threads: int = -1     # block size (NVIDIA: __launch_bounds__ from the PTX; -1 unknown)
    smem: int = 0         # static shared memory / LDS bytes per block
    occupancy: float = -1.0   # NVIDIA: resident warps / 64; AMD: waves per SIMD / 8; -1 unknown
    blocks: int = -1      # NVIDIA: resident blocks per SM; AMD: waves per SIMD (the compiler's)
    limiter: str = ""     # what bounds the occupancy (NVIDIA)


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
    if job.tool == "nvcc":   # -keep: the PTX, for each kernel's .maxntid (its block size)
        keep = keep_dir(job)
        keep.mkdir(parents=True, exist_ok=True)
        return [nvcc, "-std=c++17", "-O3", f"-arch={job.arch}", "-cubin", "-Xptxas", "-v", "-keep",
                "-keep-dir", str(keep), "-o", str(job.obj), str(job.src)], env
    env["HIP_PLATFORM"] = "amd"
    return [hipcc, "-x", "hip", "-std=c++17", "-O3", f"--offload-arch={job.arch}", "--cuda-device-only",
            "-c", "-o", str(job.obj), str(job.src), "-Rpass-analysis=kernel-resource-usage"], env


def keep_dir(job: Job) -> Path:
    return job.obj.parent / f"{job.src.stem}.{job.arch}.keep"


def run(job: Job, nvcc: str | None, hipcc: str | None) -> tuple[Job, int, float]:
    cmd, env = command(job, nvcc, hipcc)
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job.report.write_text(f"$ {' '.join(cmd)}\n{p.stdout}")
    if job.tool == "nvcc":   # keep the PTX only (the preprocessed sources are large)
        for f in keep_dir(job).glob("*"):
            if f.suffix != ".ptx":
                f.unlink()
    return job, p.returncode, time.monotonic() - t0


def ptx_block_sizes(ptx: Path) -> dict[str, int]:
    """Threads per block of each entry that declares __launch_bounds__ (.maxntid x, y, z)."""
    if not ptx.exists():
        return {}
    out, cur = {}, None
    for line in ptx.read_text().splitlines():
        m = re.match(r"(?:\.(?:visible|weak|extern)\s+)*\.entry\s+([\w$]+)", line.strip())
        if m:
            cur = m.group(1)
            continue
        m = re.match(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", line.strip())
        if m and cur:
            out[cur] = int(m.group(1)) * int(m.group(2)) * int(m.group(3))
        if line.strip().startswith("{"):
            cur = None
    return out


def demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    p = subprocess.run([cxxfilt], input="\n".join(names), stdout=subprocess.PIPE, text=True)
    out = p.stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def parse_ptxas(job: Job, block_sizes: dict[str, int] | None = None) -> list[Row]:
    """Rows from ptxas -v; block_sizes (kernel -> threads, default: from the kept PTX) give
    each kernel's theoretical occupancy."""
    if block_sizes is None:
        block_sizes = ptx_block_sizes(keep_dir(job) / f"{job.src.stem}.ptx")
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
            regs = int(m.group(1))
            sm = re.search(r"(\d+) bytes smem", line)
            smem = int(sm.group(1)) if sm else 0
            threads = block_sizes.get(cur, -1)
            row = Row("nvcc", job.src.name, job.arch, cur, regs, spill, stack, not any(k in cur for k in COLD),
                      threads=threads, smem=smem)
            if threads > 0 and job.arch in NV_LIMITS:
                occ = nv_occupancy(job.arch, regs, smem, threads)
                row.occupancy, row.blocks, row.limiter = occ.fraction, occ.blocks, occ.limiter
            rows.append(row)
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
        m = re.search(r"remark:\s+([A-Za-z ]+?)(?: \[[\w/]+\])?: (\d+) \[", line)   # "Name [unit]: N ["
        if m and cur:
            vals[m.group(1).strip()] = int(m.group(2))
    if cur:
        rows.append(_amd_row(job, cur, vals))
    return rows


def _amd_row(job: Job, name: str, v: dict) -> Row:
    # registers: VGPRs + AGPRs (gfx90a / gfx940 share one 512-entry file per lane between them)
    regs = v.get("VGPRs", -1) + (v.get("AGPRs", 0) if "VGPRs" in v else 0)
    waves = v.get("Occupancy", -1)
    occ = waves / AMD_MAX_WAVES_PER_SIMD[job.arch] if waves >= 0 and job.arch in AMD_MAX_WAVES_PER_SIMD else -1.0
    return Row("hipcc", job.src.name, job.arch, name, regs, v.get("VGPRs Spill", 0),
               v.get("ScratchSize", 0), not any(k in name for k in COLD), v.get("SGPRs Spill", 0),
               smem=v.get("LDS Size", 0), occupancy=occ, blocks=waves)


def budget_problems(rows: list[Row], names: dict[str, str] | None = None) -> list[str]:
    """Decode kernels over their budget (DECODE_BUDGETS): too many registers, too few resident
    blocks (NVIDIA) / waves per SIMD (AMD), or an NVIDIA block size the PTX does not state."""
    names = names or {}
    out = []
    for r in rows:
        name = names.get(r.kernel, r.kernel)
        b = budget_for(name)
        if b is None:
            continue
        where = f"({r.tool} {r.arch}) {name}"
        max_regs, min_blocks = b.limits(r.tool)
        if r.registers > max_regs:
            out.append(f"decode kernel over budget {where}: {r.registers} registers > {max_regs}")
        if r.tool == "nvcc" and r.threads <= 0:
            out.append(f"decode kernel without __launch_bounds__ {where}: block size unknown, occupancy unchecked")
        elif r.blocks < min_blocks:
            unit = "blocks per SM" if r.tool == "nvcc" else "waves per SIMD"
            out.append(f"decode kernel under its occupancy budget {where}: {r.blocks} {unit} < {min_blocks}"
                       + (f" (limited by {r.limiter})" if r.limiter else ""))
    return out


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
                    "sgpr_spill", "threads", "smem_bytes", "blocks_or_waves", "occupancy", "occupancy_limiter",
                    "budget_regs", "budget_blocks_or_waves", "within_budget"])
        for r in rows:
            name = names.get(r.kernel, r.kernel)
            b = budget_for(name)
            ok = "" if b is None else int(not budget_problems([r], names))
            w.writerow([r.tool, r.source, r.arch, name, r.registers, r.spill_bytes, r.stack_bytes, int(r.hot),
                        r.sgpr_spill, r.threads, r.smem, r.blocks, f"{r.occupancy:.3f}" if r.occupancy >= 0 else "",
                        r.limiter, "" if b is None else b.limits(r.tool)[0], "" if b is None else b.limits(r.tool)[1],
                        ok])
    for r in rows:
        if r.spill_bytes > 0 and r.hot:
            problems.append(f"spill in hot kernel ({r.tool} {r.arch}): {names.get(r.kernel, r.kernel)} "
                            f"{r.spill_bytes} bytes")
    problems += budget_problems(rows, names)
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
    # The decode budget, per kernel family and target: the worst instance.
    fam: dict[tuple, Row] = {}
    for r in rows:
        b = budget_for(names.get(r.kernel, r.kernel))
        if b is not None:
            key = (b.pattern, r.tool, r.arch)
            if key not in fam or (r.registers, -r.blocks) > (fam[key].registers, -fam[key].blocks):
                fam[key] = r
    if fam:
        print("\n  decode budget (worst instance per kernel family and target; NVIDIA: blocks per SM and occupancy"
              " at its block size; AMD: waves per SIMD)")
        for (pat, tool, arch), r in sorted(fam.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
            b = budget_for(names.get(r.kernel, r.kernel))
            occ = f"{r.occupancy:5.1%}" if r.occupancy >= 0 else "  ?  "
            mr, mb = b.limits(tool)
            print(f"  {tool:5s} {arch:7s} {pat:26s} regs {r.registers:3d} (<= {mr})  blocks/waves "
                  f"{r.blocks:2d} (>= {mb})  occupancy {occ}  threads {r.threads}")
    if problems:
        print("\ncompile-check FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("\ncompile-check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
