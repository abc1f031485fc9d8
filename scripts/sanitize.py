"""`make sanitize`: the CPU extension and the emulated GPU kernels under AddressSanitizer +
UndefinedBehaviorSanitizer.

Three steps, each timed, the first failure stops the run (exit status 1):
  1. build  MOELAB_SANITIZE=1: optimized/_build.py builds moelab_cpu_sanitize (the same
            sources plus the negative controls of csrc/testing/, -O1 -g
            -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
            into build/cpu-sanitize/, apart from the normal build/cpu/.
  2. tests  the test suite (pytest), minus the few tests listed in DESELECT (each with its
            reason); every test that calls moelab_cpu runs. tests/test_gpu_emulated.py runs
            too: under MOELAB_SANITIZE=1, tests/gpu_emu.py builds the CUDA/HIP sources for the
            SIMT emulator with the same sanitizer flags, into build/gpu-emu{32,64}-sanitize/.
  3. verify a short differential fuzzing run (python -m verify --budget N).

Every step runs in a Python process with the compiler's sanitizer runtimes preloaded
(LD_PRELOAD: libasan first, then libubsan, found with `$CXX -print-file-name`, never a fixed
path) and options that make any report fatal: ASAN_OPTIONS detect_leaks=0 (CPython leaks by
design at exit), halt_on_error=1, abort_on_error=1; UBSAN_OPTIONS halt_on_error=1,
print_stacktrace=1. A sanitizer report therefore kills pytest or verify with the report on
stderr, and the step fails.

tests/test_sanitize.py imports this file for `sanitizer_env()`, so the negative controls run
under exactly this environment.

    python scripts/sanitize.py [--budget 60] [--skip-tests] [--skip-verify] [-- PYTEST ARGS]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ASAN_OPTIONS = "detect_leaks=0:halt_on_error=1:abort_on_error=1"
UBSAN_OPTIONS = "halt_on_error=1:print_stacktrace=1"

# Tests that cannot run meaningfully in a sanitized process (pytest node-id prefixes), each
# with its reason. None of them calls moelab_cpu (the CPU extension); every test that does runs.
_NB = ("runs every experiment notebook in Jupyter kernels, separate processes started by "
       "jupyter_client (minutes each under the preload); the notebooks only call public ops that "
       "the op tests cover")
DESELECT = [
    ("tests/test_notebooks.py::test_every_notebook_runs_in_tiny_mode", _NB),
    ("tests/test_notebooks.py::test_notebook_writes_figures_and_verdicts", _NB),
    ("tests/test_notebooks.py::test_report_covers_every_claim", _NB),
    ("tests/test_notebooks.py::test_gpu_results_appear_beside_cpu", _NB),
    ("tests/test_notebooks.py::test_gpu_seed_claims_are_judged_on_the_gpu", _NB),
    ("tests/test_compile_check.py::test_gpu_sources_compile_without_spills",
     "nvcc/hipcc device compilation of the GPU sources: no moelab_cpu code runs (make compile-check "
     "and make test cover it)"),
]


def cxx() -> str:
    """The C++ compiler torch.utils.cpp_extension builds with ($CXX, default c++)."""
    return os.environ.get("CXX", "c++")


def runtimes() -> tuple[list[str], str | None]:
    """(paths of libasan and libubsan, None) or ([], what is missing)."""
    found = []
    for lib in ("libasan.so", "libubsan.so"):
        try:
            out = subprocess.run([cxx(), f"-print-file-name={lib}"], capture_output=True, text=True,
                                 timeout=60).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            return [], f"the C++ compiler '{cxx()}' cannot be run ({e})"
        # The compiler echoes the bare name back when it has no such runtime.
        if not out or not os.path.isabs(out) or not os.path.exists(out):
            return [], (f"the C++ compiler '{cxx()}' has no {lib} (`{cxx()} -print-file-name={lib}` "
                        f"printed '{out}'); install the sanitizer runtimes (Debian: libasan8 libubsan1, "
                        f"which gcc/g++ pull in)")
        found.append(os.path.realpath(out))
    return found, None


def sanitizer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a sanitized process: preload, fatal options, MOELAB_SANITIZE=1."""
    libs, missing = runtimes()
    if missing:
        raise RuntimeError(missing)
    env = dict(os.environ if base is None else base)
    preload = [*libs, *(p for p in env.get("LD_PRELOAD", "").split(":") if p and p not in libs)]
    env.update({
        "LD_PRELOAD": ":".join(preload),      # libasan must come first in the process
        "ASAN_OPTIONS": ASAN_OPTIONS,
        "UBSAN_OPTIONS": UBSAN_OPTIONS,
        "MOELAB_SANITIZE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    })
    return env


def _step(name: str, cmd: list[str], env: dict[str, str], times: dict[str, float]) -> bool:
    print(f"== sanitize: {name}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    times[name] = time.monotonic() - t0
    print(f"== sanitize: {name}: exit {rc} in {times[name]:.0f} s", flush=True)
    return rc == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=60, help="seconds of python -m verify (default 60)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-verify", action="store_true")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    libs, missing = runtimes()
    if missing:
        print(f"sanitize: {missing}", file=sys.stderr)
        return 2
    env = sanitizer_env()
    print(f"sanitize: LD_PRELOAD={env['LD_PRELOAD']}\n          ASAN_OPTIONS={ASAN_OPTIONS}\n"
          f"          UBSAN_OPTIONS={UBSAN_OPTIONS}", flush=True)
    py = sys.executable
    times: dict[str, float] = {}
    ok = _step("build", [py, "-c", "import optimized; print('moelab sanitized CPU extension:', "
                                   "optimized.backend_info())"], env, times)
    if ok and not args.skip_tests:
        deselect = []
        for node, reason in DESELECT:
            print(f"   deselected {node}: {reason}")
            deselect += ["--deselect", node]
        ok = _step("tests", [py, "-m", "pytest", "-q", *deselect, *args.pytest_args], env, times)
    if ok and not args.skip_verify:
        ok = _step("verify", [py, "-m", "verify", "--budget", f"{args.budget:g}", "--no-corpus", "--quiet",
                              "--report", "reports/sanitize/verify"], env, times)
    print("sanitize: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()) + (" -- OK" if ok else " -- FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
