"""The CPU ISA levels a test may run the kernels at, and how a test caps the level.

The ceiling is the level this process started at: what the CPU runs (cpuid), capped by
MOELAB_ISA when it is set. So `MOELAB_ISA=avx2 make test` on an AVX-512 CPU runs what an
AVX2-only CPU runs, and a test of a level above the ceiling skips, saying why. Every test that
caps the level puts it back to the ceiling (never to the top level, which would lift the
MOELAB_ISA cap for the rest of the session).
"""
from __future__ import annotations

import contextlib

import pytest

import optimized

LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16")
CEILING = optimized.backend_info()["active"]   # read before any test caps the level


def available(level: str) -> bool:
    return LEVELS.index(level) <= LEVELS.index(CEILING)


def below_ceiling() -> tuple[str, ...]:
    """The levels this process can run, lowest first."""
    return tuple(level for level in LEVELS if available(level))


def clamp(level: str) -> str:
    return LEVELS[min(LEVELS.index(level), LEVELS.index(CEILING))]


def require(level: str) -> None:
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
