"""The CPU ISA levels a test may run the kernels at, and how a test caps the level.

The ceiling is the level this process started at: what the CPU runs (cpuid), capped by
MOELAB_ISA when it is set. So `MOELAB_ISA=avx2 make test` on an AVX-512 CPU runs what an
AVX2-only CPU runs, and a test of a level above the ceiling skips, saying why. Every test that
caps the level puts it back to the ceiling (never to the top level, which would lift the
MOELAB_ISA cap for the rest of the session).
"""
from __future__ import annotations

import contextlib
import platform

import pytest

import optimized

# The levels this build has, lowest first (optimized/_build.py): x86 compiles four, aarch64 the
# portable level and NEON, any other machine the portable level alone. A test of a level this
# architecture has not skips (require), saying so.
X86_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16")
LEVELS = {"x86_64": X86_LEVELS, "amd64": X86_LEVELS, "aarch64": ("scalar", "neon"),
          "arm64": ("scalar", "neon")}.get(platform.machine().lower(), ("scalar",))
CEILING = optimized.backend_info()["active"]   # read before any test caps the level


def available(level: str) -> bool:
    return level in LEVELS and LEVELS.index(level) <= LEVELS.index(CEILING)


def below_ceiling() -> tuple[str, ...]:
    """The levels this process can run, lowest first."""
    return tuple(level for level in LEVELS if available(level))


def clamp(level: str) -> str:
    """`level`, or the ceiling where the process cannot run it (a level of another architecture
    clamps to the ceiling too: the highest this process runs)."""
    if level not in LEVELS:
        return CEILING
    return LEVELS[min(LEVELS.index(level), LEVELS.index(CEILING))]


def require(level: str) -> None:
    if level not in LEVELS:
        pytest.skip(f"needs the {level} level; this build ({platform.machine()}) has {', '.join(LEVELS)}")
    if not available(level):
        why = "MOELAB_ISA caps it" if optimized.backend_info()["detected"] != CEILING else "this CPU lacks it"
        pytest.skip(f"needs the {level} level; this process runs at most {CEILING} ({why})")


def restore() -> None:
    optimized.set_isa(CEILING)


@contextlib.contextmanager
def capped(level: str):
    """Run the body with the kernels capped at `level` (skips where the level is not available)."""
    require(level)
    optimized.set_isa(level)
    try:
        yield level
    finally:
        restore()
