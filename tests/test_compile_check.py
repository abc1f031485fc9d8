"""The GPU sources compile for every target, with no spill in a hot kernel (make compile-check).

Runs scripts/compile_check.py for each device compiler that is installed: nvcc (sm_80, sm_90a)
and hipcc (gfx90a, gfx940). Where a compiler is absent, its test is skipped with that reason;
CI installs both (.ci/run), so there the tests always run.
"""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compile_check.py"


def _tool(name: str, homes: tuple[str, ...], fallback: str) -> str | None:
    if shutil.which(name):
        return shutil.which(name)
    for var in homes:
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / name).exists():
            return str(Path(home) / "bin" / name)
    return fallback if Path(fallback).exists() else None


COMPILERS = {
    "nvcc": _tool("nvcc", ("CUDA_HOME", "CUDA_PATH"), "/usr/local/cuda/bin/nvcc"),
    "hipcc": _tool("hipcc", ("ROCM_HOME", "ROCM_PATH"), "/opt/rocm/bin/hipcc"),
}
TARGETS = {"nvcc": ("sm_80", "sm_90a"), "hipcc": ("gfx90a", "gfx940")}


@pytest.mark.parametrize("tool", ["nvcc", "hipcc"])
def test_gpu_sources_compile_without_spills(tool, tmp_path):
    if COMPILERS[tool] is None:
        pytest.skip(f"{tool} is not installed here (CI installs it: .ci/run)")
    out = tmp_path / "compile-check"
    p = subprocess.run([sys.executable, str(SCRIPT), "--only", tool, "--out", str(out)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-6000:]
    rows = list(csv.DictReader(open(out / "summary.csv")))
    sources = {r["source"] for r in rows}
    # Every kernel source reported kernels for every target (a silently empty report would pass).
    expected = {p.name for p in (ROOT / "optimized/csrc/gpu").glob("*.cu") if p.name != "common.cu"}
    if tool == "hipcc":
        expected |= {p.name for p in (ROOT / "optimized/csrc/hip").glob("*.hip")}
    assert expected <= sources, (expected - sources, p.stdout[-3000:])
    for arch in TARGETS[tool]:
        assert any(r["arch"] == arch for r in rows), f"no kernel reports for {arch}"
        assert (out / f"{'ptxas' if tool == 'nvcc' else 'amdgpu'}-route-{arch}.txt").exists()
    assert all(int(r["spill"]) == 0 for r in rows if r["hot"] == "1")
    # The decode budget held (the script fails otherwise) and was not vacuous: every decode
    # kernel family reported on every target, with its occupancy (NVIDIA: at its block size).
    cc = _cc()
    decode = [r for r in rows if cc.budget_for(r["kernel"]) is not None]
    for arch in TARGETS[tool]:
        fams = {cc.budget_for(r["kernel"]).pattern for r in decode if r["arch"] == arch}
        want = {b.pattern for b in cc.DECODE_BUDGETS}
        assert fams == want, (arch, want - fams)
    for r in decode:
        assert r["within_budget"] == "1" and r["occupancy"] != "", r
        assert int(r["registers"]) <= int(r["budget_regs"])
        if tool == "nvcc":
            assert int(r["threads"]) > 0 and int(r["blocks_or_waves"]) >= int(r["budget_blocks_or_waves"]), r


def _cc():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import compile_check as cc
    finally:
        sys.path.pop(0)
    return cc


def test_compile_check_fails_on_a_spill(tmp_path):
    """The parser sees spills: a fabricated ptxas report with a spill is flagged."""
    cc = _cc()
    report = tmp_path / "ptxas-x-sm_80.txt"
    report.write_text("ptxas info    : Compiling entry function '_Z3hotv' for 'sm_80'\n"
                      "ptxas info    : Function properties for _Z3hotv\n"
                      "    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
                      "ptxas info    : Used 255 registers, used 0 barriers\n")
    job = cc.Job("nvcc", Path("x.cu"), "sm_80", report, tmp_path / "x.cubin")
    rows = cc.parse_ptxas(job)
    assert len(rows) == 1 and rows[0].spill_bytes == 8 and rows[0].registers == 255 and rows[0].hot
    amd = tmp_path / "amdgpu-x-gfx90a.txt"
    amd.write_text("x.cu:1:1: remark: Function Name: _Z3hotv [-Rpass-analysis=kernel-resource-usage]\n"
                   "x.cu:1:1: remark:     VGPRs: 256 [-Rpass-analysis=kernel-resource-usage]\n"
                   "x.cu:1:1: remark:     ScratchSize [bytes/lane]: 64 [-Rpass-analysis=kernel-resource-usage]\n"
                   "x.cu:1:1: remark:     SGPRs Spill: 3 [-Rpass-analysis=kernel-resource-usage]\n"
                   "x.cu:1:1: remark:     VGPRs Spill: 12 [-Rpass-analysis=kernel-resource-usage]\n")
    rows = cc.parse_amdgpu(cc.Job("hipcc", Path("x.cu"), "gfx90a", amd, tmp_path / "x.o"))
    assert len(rows) == 1 and rows[0].spill_bytes == 12 and rows[0].sgpr_spill == 3 and rows[0].stack_bytes == 64


def test_gpu_bindings_parse_against_torch_headers(tmp_path):
    """The CUDA-key bindings (csrc/torch_gpu/*.cpp) only build with a CUDA torch, which CI
    lacks; so each is at least parsed (g++ -fsyntax-only) against the installed torch's
    headers and the CUDA toolkit's, which catches a binding left behind by a change to the
    shared checks (csrc/torch/checks.h) or the launcher API (csrc/gpu/launch.h). The CPU build
    of torch ships c10/cuda without its generated cuda_cmake_macros.h: an empty one stands in."""
    if COMPILERS["nvcc"] is None:
        pytest.skip("nvcc is not installed here, so neither are the CUDA headers (CI installs both)")
    import re
    from torch.utils import cpp_extension
    (tmp_path / "e.cu").write_text("")
    dry = subprocess.run([COMPILERS["nvcc"], "--dryrun", "-c", str(tmp_path / "e.cu")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120).stdout
    cuda_inc = [m for m in re.findall(r'INCLUDES="-I([^"]+)"', dry) if (Path(m) / "cuda_runtime.h").exists()]
    assert cuda_inc, f"nvcc --dryrun names no include folder with cuda_runtime.h:\n{dry[-1500:]}"
    shim = tmp_path / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n")
    incs = [f"-I{tmp_path}"] + [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{cuda_inc[0]}"]
    sources = sorted((ROOT / "optimized/csrc/torch_gpu").glob("*.cpp"))
    assert len(sources) >= 6

    # Both standards: the build takes torch's (optimized/_build.py: C++20 with torch 2.13, C++17
    # with older ones).
    def parse(job):
        src, std = job
        p = subprocess.run(["g++", f"-std={std}", "-fsyntax-only", *incs, str(src)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=600)
        return None if p.returncode == 0 else f"{src.name} ({std}):\n{p.stdout[-2000:]}"
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        bad = [b for b in pool.map(parse, [(s, std) for s in sources for std in ("c++17", "c++20")]) if b]
    assert not bad, "\n".join(bad)


def test_gpu_check_script_parses_and_fits_its_time_limit():
    """scripts/gpu_check.sh cannot run here (no GPU); it must at least parse, keep its step
    limits within the 9 minutes its header states (a lent H200's session budget is 15, start-up
    included), and run compute-sanitizer's memcheck, racecheck, initcheck and synccheck or say
    plainly that it did not."""
    import re
    script = ROOT / "scripts" / "gpu_check.sh"
    p = subprocess.run(["bash", "-n", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.returncode == 0, p.stdout
    text = script.read_text()
    limits = {m.group(1): int(m.group(2)) for m in re.finditer(r"run_step (\w+) (\d+) ", text)}
    tools = ("memcheck", "racecheck", "initcheck", "synccheck")
    assert {"build", "errors", "opcheck", "verify", "bad_inputs", "bench", *tools} <= set(limits), limits
    # the differential runs and the sanitizers do not start with the bad-input fuzz: a crash there
    # (the first H200 run) must not take their results with it; the bad inputs run per op apart
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert code.count("--bad-inputs none") == 5 and "--bad-inputs only" in code
    assert sum(limits.values()) <= 540, limits
    # the header's arithmetic is the script's: "180 + 75 + ... s = 9 minutes"
    header = re.search(r"time limit \(([\d +\n#]+) s = (\d+) minutes", text)
    assert header, "the header states the step limits and their total"
    stated = [int(v) for v in re.findall(r"\d+", header.group(1))]
    assert sorted(stated) == sorted(limits.values()) and sum(stated) <= 60 * int(header.group(2)), (stated, limits)
    for tool in tools:
        assert f"--tool {tool}" in text and "--error-exitcode" in text
    assert "NOT RUN" in text


def test_occupancy_model():
    """Theoretical occupancy as the CUDA occupancy calculator computes it, on known points."""
    cc = _cc()
    occ = cc.nv_occupancy
    # router_gemm<32> before issue 15: 242 registers x 128 threads -> 2 blocks (8 warps, 12.5%)
    assert occ("sm_90a", 242, 1280, 128)[:3] == (2, 8, 0.125)
    assert occ("sm_90a", 128, 1280, 128)[:3] == (4, 16, 0.25) and occ("sm_80", 128, 0, 128).limiter == "registers"
    assert occ("sm_90a", 168, 0, 128).blocks == 3 and occ("sm_90a", 169, 0, 128).blocks == 2   # 8-register steps
    assert occ("sm_90a", 32, 0, 128)[:4] == (16, 64, 1.0, "warps")
    assert occ("sm_90a", 16, 0, 32).blocks == 32 and occ("sm_90a", 16, 0, 32).limiter == "blocks"
    # shared memory: 100 KB + 1 KB reserved per block; 164 KB (sm_80) holds one, 228 KB (sm_90) two
    assert occ("sm_80", 32, 100 * 1024, 256)[:1] == (1,) and occ("sm_80", 32, 100 * 1024, 256).limiter == "shared memory"
    assert occ("sm_90a", 32, 100 * 1024, 256).blocks == 2
    assert occ("sm_90a", 255, 0, 1024).blocks == 0        # 255 x 1024 registers do not fit one SM


def _decode_rows(cc, tmp_path, regs, maxntid="128, 1, 1"):
    name = "_ZN6moelab3gpu18router_gemm_kernelILi32EEEvv"
    report = tmp_path / "ptxas-router_gemm-sm_90a.txt"
    report.write_text(f"ptxas info    : Compiling entry function '{name}' for 'sm_90a'\n"
                      f"ptxas info    : Function properties for {name}\n"
                      "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
                      f"ptxas info    : Used {regs} registers, used 1 barriers, 1280 bytes smem\n")
    ptx = tmp_path / "router_gemm.ptx"
    ptx.write_text(f".visible .entry {name}(\n)\n" + (f".maxntid {maxntid}\n" if maxntid else "") + "{\n ret;\n}\n")
    job = cc.Job("nvcc", Path("router_gemm.cu"), "sm_90a", report, tmp_path / "x.cubin")
    rows = cc.parse_ptxas(job, cc.ptx_block_sizes(ptx))
    return rows, {name: "void moelab::gpu::router_gemm_kernel<32>()"}


def test_decode_budget_fails_a_kernel_over_it(tmp_path):
    """Negative control of the budget: router_gemm<32> as ptxas reported it before this budget
    (242 registers, 2 blocks per SM) fails; at 128 registers it passes; a decode kernel whose
    block size the PTX does not state fails (its occupancy cannot be checked); a kernel that is
    not a decode kernel has no budget; AMD: a decode kernel at 3 waves per SIMD fails."""
    cc = _cc()
    rows, names = _decode_rows(cc, tmp_path, 242)
    assert rows[0].threads == 128 and rows[0].blocks == 2 and rows[0].occupancy == 0.125
    problems = cc.budget_problems(rows, names)
    assert any("242 registers > 128" in p for p in problems) and any("2 blocks per SM < 4" in p for p in problems)
    rows, names = _decode_rows(cc, tmp_path, 128)
    assert cc.budget_problems(rows, names) == [] and rows[0].blocks == 4
    rows, names = _decode_rows(cc, tmp_path, 100, maxntid=None)
    assert any("without __launch_bounds__" in p for p in cc.budget_problems(rows, names))
    rows, _ = _decode_rows(cc, tmp_path, 242)
    assert cc.budget_problems(rows, {rows[0].kernel: "void moelab::gpu::fe_tiled<2, true>()"}) == []
    # the unaligned small-m variant has its own, stated budget
    assert cc.budget_for("void moelab::gpu::fe_small<2, 8, false>(FeGemm)").min_blocks == 2
    assert cc.budget_for("void moelab::gpu::fe_small<2, 8, true>(FeGemm)").max_regs == 128
    amd = tmp_path / "amdgpu-router_gemm-gfx90a.txt"
    fn = "_ZN6moelab3gpu18router_gemm_kernelILi16EEEvv"
    amd.write_text(f"x.cu:1:1: remark: Function Name: {fn} [-Rpass-analysis=kernel-resource-usage]\n"
                   "x.cu:1:1: remark:     VGPRs: 150 [-Rpass-analysis=kernel-resource-usage]\n"
                   "x.cu:1:1: remark:     AGPRs: 4 [-Rpass-analysis=kernel-resource-usage]\n"
                   "x.cu:1:1: remark:     Occupancy [waves/SIMD]: 3 [-Rpass-analysis=kernel-resource-usage]\n"
                   "x.cu:1:1: remark:     LDS Size [bytes/block]: 512 [-Rpass-analysis=kernel-resource-usage]\n")
    (row,) = cc.parse_amdgpu(cc.Job("hipcc", Path("router_gemm.cu"), "gfx90a", amd, tmp_path / "x.o"))
    assert row.registers == 154 and row.blocks == 3 and row.occupancy == 3 / 8 and row.smem == 512
    problems = cc.budget_problems([row], {fn: "void moelab::gpu::router_gemm_kernel<16>()"})
    assert any("154 registers > 128" in p for p in problems) and any("3 waves per SIMD < 4" in p for p in problems)
    # fe_small's aligned variant on CDNA: its stated AMD budget, 3 waves (<= 168 VGPRs)
    assert cc.budget_problems([row], {fn: "void moelab::gpu::fe_small<2, 8, true>(FeGemm)"}) == []
