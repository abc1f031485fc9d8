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


def test_compile_check_fails_on_a_spill(tmp_path):
    """The parser sees spills: a fabricated ptxas report with a spill is flagged."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import compile_check as cc
    finally:
        sys.path.pop(0)
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
    bad = []
    for src in sources:
        p = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", *incs, str(src)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=600)
        if p.returncode != 0:
            bad.append(f"{src.name}:\n{p.stdout[-2000:]}")
    assert not bad, "\n".join(bad)


def test_gpu_check_script_parses_and_fits_its_time_limit():
    """scripts/gpu_check.sh cannot run here (no GPU); it must at least parse, keep its step
    limits within the 8 minutes a lent H200 gives it, and run compute-sanitizer's memcheck and
    racecheck or say plainly that it did not."""
    import re
    script = ROOT / "scripts" / "gpu_check.sh"
    p = subprocess.run(["bash", "-n", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.returncode == 0, p.stdout
    text = script.read_text()
    limits = {m.group(1): int(m.group(2)) for m in re.finditer(r"run_step (\w+) (\d+) ", text)}
    assert {"build", "opcheck", "verify", "bench", "memcheck", "racecheck"} <= set(limits), limits
    assert sum(limits.values()) <= 480, limits
    assert "--tool memcheck" in text and "--tool racecheck" in text and "NOT RUN" in text
