"""Build the torch-free CPU kernel driver (tests/cpu_driver.cpp) for aarch64 with the cross
compiler and run it under qemu-aarch64-static, and build the same driver natively (the x86
portable level) to produce the expected outputs. tests/test_aarch64.py holds the checks.

An aarch64 build holds the levels optimized/_build.py gives aarch64 (ARM_ISA_LEVELS: the
portable level and NEON, chosen at run time from the hwcaps, capped by MOELAB_ISA); each kernel
is one translation unit per level, generated as _build.py generates the extension's. Builds go
to <MOELAB_BUILD_DIR or build/>/cross-<arch>[-<plant>]-<hash>/, the hash covering every source
the driver includes, the flags and the compiler's version, so an edit rebuilds and an unchanged
tree reuses the binary. A plant (a -D macro that puts a deliberate bug into the NEON level) is
built apart, as tests/gpu_emu.py builds its planted variants.

-ffp-contract=off on aarch64: GCC's default there (fast, in GNU mode) would fuse a separate
multiply and add into one FMA wherever it finds them, which x86's portable level (no FMA) never
does; the kernels' own FMAs are explicit (vfmaq_f32, __builtin_fmaf) and stay fused.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "optimized" / "csrc"
DRIVER = Path(__file__).resolve().parent / "cpu_driver.cpp"
CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64-static"
# The NEON level's negative controls: (the macro, the kernels whose NEON unit gets it). A
# planted build recompiles only those units and reuses the clean build's other objects.
PLANTS = {
    "NEON_NARROW": ("MOELAB_PLANT_NEON_NARROW", {"fused_experts", "permute"}),   # vec.h: bf16 ties round away
    "NEON_FP8_TABLE": ("MOELAB_PLANT_NEON_FP8_TABLE", {"fused_experts"}),        # fp8 subnormal codes misread
    "NEON_MX_ZERO": ("MOELAB_PLANT_NEON_MX_ZERO", {"fused_experts"}),            # mxfp4 zeros get the exponent
}
FLAGS = ["-std=c++17", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror", "-Wno-unknown-pragmas",
         "-fno-strict-aliasing"]


def _load_build_module():
    """optimized/_build.py without importing the package (which would build the x86 extension)."""
    spec = importlib.util.spec_from_file_location("moelab_build_rules", ROOT / "optimized" / "_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BUILD = _load_build_module()


def missing_tools() -> str:
    """'' when the cross compiler and qemu are on PATH, else what is missing (a skip reason)."""
    lacking = [t for t in (CROSS_CXX, QEMU) if shutil.which(t) is None]
    if not lacking:
        return ""
    return (f"{' and '.join(lacking)} not on PATH (Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu "
            f"qemu-user-static; .ci/run installs them)")


def kernels() -> list[Path]:
    return sorted((CSRC / "cpu").glob("*_kernel.h"))


def _sources_digest() -> bytes:
    h = hashlib.sha256()
    for p in sorted((CSRC / "cpu").glob("*")) + sorted((CSRC / "common").glob("*")) + [DRIVER, Path(__file__)]:
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.digest()


def _compiler_version(cxx: str) -> bytes:
    return subprocess.run([cxx, "--version"], capture_output=True, check=True).stdout


def _base(arch: str) -> tuple[str, list[str], dict[str, dict[str, int]]]:
    """(compiler, flags, levels) of a driver build for arch ('aarch64' or 'host')."""
    if arch == "aarch64":
        return CROSS_CXX, FLAGS + ["-ffp-contract=off", "-static"], BUILD.ARM_ISA_LEVELS
    # The expected side: the host's portable level only (the x86 level the others match).
    return os.environ.get("CXX", "g++"), FLAGS + ["-DMOELAB_DRIVER_PORTABLE"], {"scalar": {"MOELAB_ISA_LEVEL": 0}}


def build_dir(arch: str, plant: str = "") -> Path:
    cxx, flags, levels = _base(arch)
    h = hashlib.sha256(_sources_digest() + repr((flags, levels, plant)).encode() + _compiler_version(cxx))
    base = Path(os.environ.get("MOELAB_BUILD_DIR", ROOT / "build"))
    return base / f"cross-{arch}{'-' + plant.lower() if plant else ''}-{h.hexdigest()[:16]}"


def _compile(cmd: list[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    return "" if p.returncode == 0 else f"$ {' '.join(cmd)}\n{p.stderr}"


def build(arch: str, plant: str = "") -> Path:
    """The driver binary for arch, built unless a build of the same sources exists."""
    out = build_dir(arch, plant)
    exe = out / "cpu_driver"
    if exe.exists():
        return exe
    cxx, flags, levels = _base(arch)
    clean = build(arch).parent / "gen" if plant else None
    gen = out / "gen"
    gen.mkdir(parents=True, exist_ok=True)
    units = []
    for k in kernels():
        op = k.name[: -len("_kernel.h")]
        for isa, macros in levels.items():
            f = gen / f"{op}_{isa}.cpp"
            f.write_text(BUILD.wrapper_text(k, macros))
            planted = bool(plant) and isa == "neon" and op in PLANTS[plant][1]
            units.append((f, [f"-D{PLANTS[plant][0]}"] if planted else [], planted))
    cmds, objs = [], []
    for f, extra, planted in units + [(DRIVER, [], False), (CSRC / "cpu" / "isa.cpp", [], False)]:
        o = gen / (f.stem + ".o")
        objs.append(str(o))
        if clean is not None and not planted:
            shutil.copyfile(clean / o.name, o)
            continue
        cmds.append([cxx, *flags, *extra, "-c", str(f), "-o", str(o)])
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as ex:
        errors = [e for e in ex.map(_compile, cmds) if e]
    if errors:
        raise RuntimeError("cross build failed:\n" + "\n".join(errors))
    tmp = out / "cpu_driver.tmp"
    link = subprocess.run([cxx, *flags, *objs, "-o", str(tmp)], capture_output=True, text=True)
    if link.returncode:
        raise RuntimeError(f"link failed:\n{link.stderr}")
    tmp.replace(exe)   # atomic: a concurrent session never runs a half-written binary
    return exe


def run(exe: Path, case_dir: Path, arch: str, level: str | None = None) -> str:
    """Runs the driver on a case; returns the level it reports. level caps it (MOELAB_ISA)."""
    env = dict(os.environ)
    env.pop("MOELAB_ISA", None)
    if level:
        env["MOELAB_ISA"] = level
    cmd = [QEMU, str(exe), str(case_dir)] if arch == "aarch64" else [str(exe), str(case_dir)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if p.returncode:
        raise RuntimeError(f"driver failed ({p.returncode}) on {case_dir.name}: {p.stderr.strip()}")
    return p.stdout.split()[-1]


def check_bindings() -> str:
    """The torch bindings (csrc/torch/*.cpp) compiled for aarch64 against the installed torch's
    headers (the same on every architecture), syntax and types only: nothing x86 in them, and
    the kernels' aarch64 declarations (isa_dispatch.h) are what they call. No link: that needs
    torch's aarch64 libraries. '' when clean, else the compiler's messages. A clean result is
    remembered under the build folder, keyed like the driver's builds."""
    from torch.utils import cpp_extension
    import torch

    incs = [f"-I{p}" for p in cpp_extension.include_paths()]
    srcs = sorted((CSRC / "torch").glob("*.cpp"))
    h = hashlib.sha256(_sources_digest() + torch.__version__.encode() + _compiler_version(CROSS_CXX))
    for p in srcs + sorted((CSRC / "torch").glob("*.h")):
        h.update(p.read_bytes())
    stamp = Path(os.environ.get("MOELAB_BUILD_DIR", ROOT / "build")) / f"cross-bindings-{h.hexdigest()[:16]}.ok"
    if stamp.exists():
        return ""
    # C++20: the standard the pinned torch's headers require (optimized/_build.py lets torch choose).
    cmds = [[CROSS_CXX, "-std=c++20", "-fsyntax-only", "-Wall", "-Werror", "-Wno-unknown-pragmas", *incs, str(s)]
            for s in srcs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as ex:
        errors = [e for e in ex.map(_compile, cmds) if e]
    if errors:
        return "\n".join(errors)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text("ok\n")
    return ""
