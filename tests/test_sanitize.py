"""`make sanitize` can fail: negative controls for the AddressSanitizer + UBSan build.

The sanitized extension (MOELAB_SANITIZE=1, optimized/_build.py) alone contains three
deliberate bugs, ops of the `moelab_test` namespace (optimized/csrc/testing/
sanitizer_controls.cpp): a read one element past a tensor's end, a signed 32-bit overflow
and a misaligned int32 load. Each runs here in a subprocess with the environment of
scripts/sanitize.py (runtimes preloaded, every report fatal), which must die with the
sanitizer's report naming the bug; the same ops with harmless arguments must succeed, so the
failures come from the bugs and not from the setup.

The emulated GPU kernels (tests/gpu_emu.py) have controls of their own, built only into the
sanitized emulator (optimized/csrc/gpu/emu/sanitizer_controls.cpp): a kernel that reads one
float past its dynamic shared memory, one past a static __shared__ array, and a 32-bit index
product that overflows; and a real kernel (route, through its launcher) given a bias one
element short. Each must die with the report, through the fiber's frames.

The first test builds the sanitized extension into build/cpu-sanitize/ (minutes from nothing,
once; ninja makes every later build a no-op). The tests skip only when the C++ compiler has no
sanitizer runtimes (libasan, libubsan), and say which is missing.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("moelab_sanitize_script", ROOT / "scripts" / "sanitize.py")
sanitize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sanitize)

_, MISSING = sanitize.runtimes()
needs_runtimes = pytest.mark.skipif(MISSING is not None, reason=f"no sanitizer runtimes: {MISSING}")


def _run(code: str, env: dict[str, str] | None = None, timeout: float = 3600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=sanitize.sanitizer_env() if env is None else env)


@pytest.fixture(scope="module")
def sanitized():
    """Build (if needed) and load the sanitized extension once; its backend_info()."""
    p = _run("import json, optimized; print(json.dumps(optimized.backend_info()))")
    assert p.returncode == 0, p.stderr[-6000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_runtimes
def test_sanitized_build_is_separate_and_says_so(sanitized):
    assert sanitized["sanitize"] == "address,undefined"
    p = _run("from optimized import _build; print(_build.NAME, _build.build_dir().name)")
    assert p.returncode == 0 and p.stdout.split() == ["moelab_cpu_sanitize", "cpu-sanitize"], p.stderr[-3000:]


@needs_runtimes
def test_controls_pass_with_harmless_arguments(sanitized):
    p = _run("import torch, optimized; t = torch.ops.moelab_test\n"
             "print(t.int32_add(2, 3), t.load_int32_at(torch.tensor([1, 0, 0, 0, 7, 0, 0, 0], dtype=torch.uint8), 4))")
    assert p.returncode == 0, p.stderr[-6000:]
    assert p.stdout.split() == ["5", "7"]


@needs_runtimes
def test_asan_reports_heap_buffer_overflow(sanitized):
    p = _run("import torch, optimized; print(torch.ops.moelab_test.oob_read(torch.ones(5)))")
    assert p.returncode != 0, "the out-of-bounds read was not caught:\n" + p.stdout + p.stderr[-3000:]
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in p.stderr, p.stderr[-6000:]
    assert "READ of size 4" in p.stderr and "in oob_read" in p.stderr and "sanitizer_controls.cpp" in p.stderr, \
        p.stderr[-6000:]


@needs_runtimes
def test_ubsan_reports_signed_overflow(sanitized):
    p = _run("import torch, optimized; print(torch.ops.moelab_test.int32_add(2**31 - 1, 1))")
    assert p.returncode != 0, "the signed overflow was not caught:\n" + p.stdout + p.stderr[-3000:]
    assert "runtime error: signed integer overflow: 2147483647 + 1" in p.stderr, p.stderr[-6000:]
    assert "sanitizer_controls.cpp" in p.stderr, p.stderr[-6000:]


@needs_runtimes
def test_ubsan_reports_misaligned_load(sanitized):
    p = _run("import torch, optimized\n"
             "print(torch.ops.moelab_test.load_int32_at(torch.zeros(16, dtype=torch.uint8), 1))")
    assert p.returncode != 0, "the misaligned load was not caught:\n" + p.stdout + p.stderr[-3000:]
    assert "runtime error: load of misaligned address" in p.stderr, p.stderr[-6000:]


@needs_runtimes
def test_sanitized_build_refuses_to_load_without_the_runtime(sanitized):
    env = sanitize.sanitizer_env()
    env.pop("LD_PRELOAD")
    p = _run("import optimized", env=env, timeout=600)
    assert p.returncode != 0 and "AddressSanitizer runtime is not loaded" in p.stderr, p.stderr[-3000:]


def test_normal_build_has_no_controls(monkeypatch, tmp_path):
    import torch

    import optimized  # noqa: F401  (this process's build, loaded before SANITIZE is patched)
    from optimized import _build
    if not _build.SANITIZE:
        assert not hasattr(torch.ops.moelab_test, "oob_read")
    monkeypatch.setattr(_build, "SANITIZE", False)
    assert not any("testing" in Path(s).parts for s in _build.sources(tmp_path))
    monkeypatch.setattr(_build, "SANITIZE", True)
    assert any(Path(s).name == "sanitizer_controls.cpp" for s in _build.sources(tmp_path))


# ------------------------------------------------ the emulated GPU kernels (tests/gpu_emu.py)
_EMU = "import torch\nfrom tests import gpu_emu\nm = gpu_emu.load(32)\n"


@pytest.fixture(scope="module")
def sanitized_emu():
    """Build (if needed) the sanitized 32-lane emulator once, in build/gpu-emu32-sanitize/."""
    p = _run(_EMU + "print(m.__file__)")
    assert p.returncode == 0, p.stderr[-6000:]
    assert Path(p.stdout.strip().splitlines()[-1]).parent.name == "gpu-emu32-sanitize", p.stdout


@needs_runtimes
def test_emulated_controls_pass_with_harmless_arguments(sanitized_emu):
    p = _run(_EMU + "print(m.control_dynamic_smem_read(torch.arange(10.), 9), m.control_static_smem_read(63), "
                    "m.control_int_index(1000, 1000))\n"
                    "x = torch.randn(3, 64)\n"
                    "print(m.route(x, 4, 3, torch.randn(64), 1, 1, 1.0, True, 1e-20)[0])")
    assert p.returncode == 0, p.stderr[-6000:]
    assert p.stdout.split() == ["9.0", "63.0", "1000000", "0"], p.stdout


def _fiber_frames(stderr: str) -> bool:
    """The report's stack runs through the emulator's fiber entry (ASan unwound the fiber stack)."""
    return any(" in entry " in line and "emu.cpp" in line for line in stderr.splitlines())


@needs_runtimes
def test_asan_reports_emulated_kernel_reading_past_an_input(sanitized_emu):
    # route's launcher takes bias as a bare pointer: a bias of E - 1 floats cannot be detected there,
    # and the kernel reads bias[E - 1], 4 bytes past the tensor.
    p = _run(_EMU + "x = torch.randn(3, 64)\nprint(m.route(x, 4, 3, torch.randn(63), 1, 1, 1.0, True, 1e-20))")
    assert p.returncode != 0, "the kernel's out-of-bounds read was not caught:\n" + p.stdout + p.stderr[-3000:]
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in p.stderr and "READ of size 4" in p.stderr, \
        p.stderr[-6000:]
    assert "0 bytes to the right of 252-byte region" in p.stderr, p.stderr[-6000:]
    summary = [line for line in p.stderr.splitlines() if line.startswith("SUMMARY:")]
    assert summary and "route.cu" in summary[0], p.stderr[-6000:]
    assert _fiber_frames(p.stderr), p.stderr[-6000:]


@needs_runtimes
def test_asan_reports_dynamic_shared_memory_overflow(sanitized_emu):
    p = _run(_EMU + "print(m.control_dynamic_smem_read(torch.arange(10.), 10))")
    assert p.returncode != 0, "the shared-memory overflow was not caught:\n" + p.stdout + p.stderr[-3000:]
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in p.stderr, p.stderr[-6000:]
    # exactly the launch's 10 floats: the read of element 10 is the first byte past them
    assert "0 bytes to the right of 40-byte region" in p.stderr, p.stderr[-6000:]
    assert "in dynamic_smem_read_kernel" in p.stderr and _fiber_frames(p.stderr), p.stderr[-6000:]


@needs_runtimes
def test_ubsan_reports_static_shared_array_overflow(sanitized_emu):
    p = _run(_EMU + "print(m.control_static_smem_read(64))")
    assert p.returncode != 0, "the static shared-array overflow was not caught:\n" + p.stdout + p.stderr[-3000:]
    assert "runtime error: index 64 out of bounds for type 'float [64]'" in p.stderr, p.stderr[-6000:]
    assert "in static_smem_read_kernel" in p.stderr, p.stderr[-6000:]


@needs_runtimes
def test_ubsan_reports_emulated_kernel_index_overflow(sanitized_emu):
    p = _run(_EMU + "print(m.control_int_index(65536, 32768))")
    assert p.returncode != 0, "the signed overflow was not caught:\n" + p.stdout + p.stderr[-3000:]
    assert "runtime error: signed integer overflow" in p.stderr and "cannot be represented in type 'int'" in p.stderr, \
        p.stderr[-6000:]
    assert "in int_index_kernel" in p.stderr, p.stderr[-6000:]


def test_normal_emulator_build_has_no_controls(monkeypatch, tmp_path):
    from . import gpu_emu
    monkeypatch.setattr(gpu_emu, "SANITIZE", False)
    assert not any(Path(s).name == "sanitizer_controls.cpp" for s in gpu_emu.sources(32, tmp_path))
    normal = gpu_emu.build_dir(32)
    monkeypatch.setattr(gpu_emu, "SANITIZE", True)
    assert any(Path(s).name == "sanitizer_controls.cpp" for s in gpu_emu.sources(32, tmp_path))
    assert gpu_emu.build_dir(32) != normal and gpu_emu.build_dir(32).name == "gpu-emu32-sanitize"
