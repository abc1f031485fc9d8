"""Build and load the moelab CPU extension (torch.utils.cpp_extension + ninja).

Sources:
  csrc/torch/*.cpp        thin bindings: schemas, argument checks, at::parallel_for
  csrc/cpu/*.cpp          torch-free helpers (ISA detection)
  csrc/cpu/<op>_kernel.h  torch-free kernels, each compiled once per ISA level through a
                          generated one-line wrapper (build/cpu/gen/<op>_<isa>.cpp); the
                          binding picks the level at run time from cpuid (isa_dispatch.h).
                          On aarch64: the portable and NEON levels (hwcaps; ISA_LEVELS).
No -march=native: the build runs on any x86-64 (or aarch64), the ISA is chosen when the op runs.

ninja rebuilds only what changed, so `make build` (or importing `optimized`) after an edit
is quick, and a no-op when nothing changed. MOELAB_BUILD_DIR overrides the build folder (default:
build/ beside the package).

Fast calls: a small Python module, moelab_fastcall (csrc/python/fastcall.cpp, pybind11), built
and imported after the CPU extension in its own folder (fastcall/ beside cpu/). It binds the ops a
decode step calls with their C++ types, so the wrappers skip torch.ops' per-argument parsing
(optimized/fastcall.py); it holds no kernel and is never sanitized.

GPU: a second extension, moelab_gpu (csrc/gpu/*.cu torch-free kernels, csrc/torch_gpu/*.cpp
bindings that register the CUDA implementations of the same ops; on ROCm also csrc/hip/*.hip),
is built and loaded after the CPU one ONLY when the installed torch is a CUDA or ROCm build
(torch.version.cuda / torch.version.hip) and its device compiler exists (nvcc under
CUDA_HOME, hipcc under ROCM_HOME). Otherwise nothing about the CPU build changes.
MOELAB_NO_GPU=1 skips it; TORCH_CUDA_ARCH_LIST / PYTORCH_ROCM_ARCH choose the targets
(default: the GPUs present).

Sanitized build (`make sanitize`, scripts/sanitize.py): MOELAB_SANITIZE=1 builds the same
sources with AddressSanitizer + UndefinedBehaviorSanitizer (SANITIZE_FLAGS, -O1, on compile and
link) as a separate extension, moelab_cpu_sanitize, in its own folder (cpu-sanitize/ beside
cpu/), so a sanitized and a normal build are never mixed. Only that build also compiles
csrc/testing/*.cpp: deliberate bugs in a `moelab_test` namespace, the negative controls that
prove the sanitizers report (tests/test_sanitize.py). backend_info() then has
"sanitize": "address,undefined". The process must run with the sanitizer runtime preloaded
(LD_PRELOAD of the compiler's libasan and libubsan); scripts/sanitize.py sets that up.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

PKG = Path(__file__).resolve().parent
CSRC = PKG / "csrc"
# Each level's wrapper defines these macros before including the kernel (isa_begin.h): the
# four x86 levels on x86-64; on aarch64 the portable level and NEON (MOELAB_ISA_LEVEL is the
# x86 level, 0 there); elsewhere the portable level only. No build sees another architecture's
# code.
X86_ISA_LEVELS = {"scalar": {"MOELAB_ISA_LEVEL": 0}, "avx2": {"MOELAB_ISA_LEVEL": 1},
                  "avx512": {"MOELAB_ISA_LEVEL": 2}, "avx512bf16": {"MOELAB_ISA_LEVEL": 3}}
ARM_ISA_LEVELS = {"scalar": {"MOELAB_ISA_LEVEL": 0}, "neon": {"MOELAB_ISA_LEVEL": 0, "MOELAB_ISA_NEON": 1}}


def isa_levels(machine: str | None = None) -> dict[str, dict[str, int]]:
    m = (machine or platform.machine()).lower()
    if m in ("x86_64", "amd64", "i386", "i686"):
        return X86_ISA_LEVELS
    if m in ("aarch64", "arm64"):
        return ARM_ISA_LEVELS
    return {"scalar": {"MOELAB_ISA_LEVEL": 0}}


ISA_LEVELS = isa_levels()
SANITIZE = os.environ.get("MOELAB_SANITIZE", "0") not in ("", "0")
SANITIZERS = "address,undefined"
# -O1: the kernels' vector code still runs at a usable speed (verify and the tests finish in
# minutes), and the reports keep accurate line numbers; no recovery: the first report kills.
# -g1 (line tables: function, file and line in every frame of a report) instead of full -g,
# which compiles slower for no better report (measured here: route_avx512 60 s vs 35 s, the
# whole build 317 s vs 238 s).
SANITIZE_FLAGS = [f"-fsanitize={SANITIZERS}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g1"]
# GCC 12 flags its own intrinsic headers (the `__Y = __Y` idiom of _mm512_undefined_*) as
# uninitialized once the sanitizers instrument them: thousands of lines of false positives.
# The normal build keeps these warnings for our code.
_SANITIZE_QUIET = ["-Wno-maybe-uninitialized", "-Wno-uninitialized"]
NAME = "moelab_cpu_sanitize" if SANITIZE else "moelab_cpu"


def build_dir() -> Path:
    return Path(os.environ.get("MOELAB_BUILD_DIR", PKG.parent / "build")) / ("cpu-sanitize" if SANITIZE else "cpu")


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def wrapper_text(kernel: Path, macros: dict[str, int]) -> str:
    """One level's translation unit of a kernel: its macros, then the kernel header."""
    defs = "".join(f"#define {k} {v}\n" for k, v in macros.items())
    return f'// generated by optimized/_build.py\n{defs}#include "{kernel.as_posix()}"\n'


def _isa_wrappers(out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for kernel in sorted((CSRC / "cpu").glob("*_kernel.h")):
        op = kernel.name[: -len("_kernel.h")]
        for isa, macros in ISA_LEVELS.items():
            f = out / f"{op}_{isa}.cpp"
            _write_if_changed(f, wrapper_text(kernel, macros))
            files.append(str(f))
    return files


def sources(bdir: Path) -> list[str]:
    subs = ("torch", "cpu") + (("testing",) if SANITIZE else ())   # the controls: sanitized build only
    hand = sorted(str(p) for sub in subs for p in (CSRC / sub).glob("*.cpp"))
    return hand + _isa_wrappers(bdir / "gen")


def _sanitizer_runtime_loaded() -> bool:
    """True when libasan is in this process (preloaded, as it must be for a sanitized build)."""
    try:
        return "libasan" in Path("/proc/self/maps").read_text()
    except OSError:     # no /proc: let the loader say what is wrong
        return True


_loaded = False


def load(verbose: bool = False) -> None:
    """Build if needed and load the extension, registering torch.ops.moelab.*."""
    global _loaded
    if _loaded:
        return
    from torch.utils import cpp_extension

    bdir = build_dir()
    bdir.mkdir(parents=True, exist_ok=True)
    # No -std: torch.utils.cpp_extension passes the standard the installed torch's headers need
    # (C++20 with the torch 2.13 this project pins, C++17 with older ones; newer headers refuse
    # C++17, and a -std of ours would come later on the command line and override it). Our
    # sources build as both.
    cflags = ["-O3", "-fopenmp", "-Wall", "-Wno-unknown-pragmas", "-fno-strict-aliasing"]
    if ISA_LEVELS is not X86_ISA_LEVELS:
        # GCC contracts a separate multiply and add into an FMA by default where the target
        # always has one (aarch64), which x86's portable level never does: the kernels' FMAs
        # are explicit, so this keeps every level's bits those of the x86 levels.
        cflags.append("-ffp-contract=off")
    ldflags = ["-fopenmp"]
    preload = None
    if SANITIZE:
        if not _sanitizer_runtime_loaded():
            raise ImportError("MOELAB_SANITIZE=1: the AddressSanitizer runtime is not loaded in this "
                              "process; run through `make sanitize` / scripts/sanitize.py, which preload "
                              "the compiler's libasan and libubsan (LD_PRELOAD)")
        cflags = ["-O1", "-DMOELAB_SANITIZE=1"] + SANITIZE_FLAGS + cflags[1:] + _SANITIZE_QUIET
        ldflags = SANITIZE_FLAGS + ldflags
        # The compiler and ninja need not run under the sanitizer runtime: build without the
        # preload (this process keeps it: it was loaded at exec).
        preload = os.environ.pop("LD_PRELOAD", None)
    try:
        cpp_extension.load(
            name=NAME,
            sources=sources(bdir),
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=str(bdir),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    _loaded = True
    load_fastcall(verbose)
    # The sanitized build covers the CPU extension only (a CUDA runtime under ASan needs its own
    # settings); the GPU extension stays out of sanitized processes.
    if os.environ.get("MOELAB_NO_GPU") != "1" and not SANITIZE:
        load_gpu(verbose)


# ------------------------------------------------------------------------------ fast calls
FASTCALL_NAME = "moelab_fastcall"
_fastcall = None


def load_fastcall(verbose: bool = False):
    """Build (if needed) and import moelab_fastcall; the CPU extension must be loaded first
    (the module looks the ops up when imported). Returns the module."""
    global _fastcall
    if _fastcall is None:
        from torch.utils import cpp_extension

        bdir = build_dir().parent / "fastcall"
        bdir.mkdir(parents=True, exist_ok=True)
        preload = os.environ.pop("LD_PRELOAD", None) if SANITIZE else None   # as load()
        try:
            _fastcall = cpp_extension.load(name=FASTCALL_NAME, sources=[str(CSRC / "python" / "fastcall.cpp")],
                                           extra_cflags=["-O2"], build_directory=str(bdir),
                                           is_python_module=True, verbose=verbose)
        finally:
            if preload is not None:
                os.environ["LD_PRELOAD"] = preload
    return _fastcall


# ------------------------------------------------------------------------------------ GPU
GPU_NAME = "moelab_gpu"
_gpu_loaded = False


def gpu_toolchain() -> str | None:
    """'cuda' or 'rocm' when torch is such a build and its device compiler is installed."""
    import torch
    from torch.utils import cpp_extension

    if getattr(torch.version, "cuda", None) and cpp_extension.CUDA_HOME:
        if (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").exists():
            return "cuda"
    if getattr(torch.version, "hip", None) and getattr(cpp_extension, "ROCM_HOME", None):
        if (Path(cpp_extension.ROCM_HOME) / "bin" / "hipcc").exists():
            return "rocm"
    return None


def gpu_sources(toolchain: str) -> list[str]:
    files = sorted(CSRC.glob("gpu/*.cu")) + sorted(CSRC.glob("torch_gpu/*.cpp"))
    if toolchain == "rocm":
        files += sorted(CSRC.glob("hip/*.hip"))
    return [str(p) for p in files]


def load_gpu(verbose: bool = False) -> bool:
    """Build (if needed) and load moelab_gpu when the toolchain is there; True if loaded."""
    global _gpu_loaded
    if _gpu_loaded:
        return True
    toolchain = gpu_toolchain()
    if toolchain is None:
        return False
    from torch.utils import cpp_extension

    bdir = build_dir().parent / "gpu"
    bdir.mkdir(parents=True, exist_ok=True)
    # No fast-math: the kernels rely on IEEE f32/f64 (exact keys, no-FMA sums, subnormals).
    cpp_extension.load(
        name=GPU_NAME,
        sources=gpu_sources(toolchain),
        extra_cflags=["-O3"],      # the C++ standard: torch's choice, as for the CPU extension
        extra_cuda_cflags=["-O3"] + (["-lineinfo"] if toolchain == "cuda" else []),
        build_directory=str(bdir),
        is_python_module=False,
        verbose=verbose,
    )
    _gpu_loaded = True
    return True

