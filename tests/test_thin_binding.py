"""fused_experts' algorithm is torch-free and its binding is thin (issue 33, item 4).

The pipeline, the work items, the work-stealing run and the packing with its huge-page advice
live in optimized/csrc/cpu/fused_experts_schedule.h, which compiles with no torch header on the
include path (a Pool of plain loops stands in for at::parallel_for), and is compiled once, not
per ISA level (its name does not end in _kernel.h, which _build.py compiles per level). The
binding, optimized/csrc/torch/fused_experts.cpp, keeps checks, allocation and the thread pool.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCHEDULE = ROOT / "optimized/csrc/cpu/fused_experts_schedule.h"
BINDING = ROOT / "optimized/csrc/torch/fused_experts.cpp"

# A serial Pool: what the schedule asks of its caller, and nothing from torch.
DRIVER = r"""
#include "optimized/csrc/cpu/fused_experts_schedule.h"
#include <vector>
struct SerialPool {
  int64_t threads() const { return 1; }
  template <class F> void parallel_for(int64_t b, int64_t e, int64_t, const F& f) const { if (e > b) f(b, e); }
  template <class F> void parallel_for_scratch(int64_t b, int64_t e, int64_t bytes, const F& f) const {
    std::vector<uint8_t> s(size_t(bytes) + 64);
    if (e > b) f(b, e, s.data());
  }
};
void instantiate() {
  namespace fs = moelab::cpu::fe_schedule;
  SerialPool pool;
  fs::Call c{};
  fs::Plan plan;
  fs::run(c, plan, nullptr, nullptr, false, pool);
  fs::pack_experts(0, nullptr, nullptr, nullptr, 1, 1, 1, std::vector<int64_t>{}, nullptr, nullptr, nullptr,
                   nullptr, pool);
}
"""


def test_schedule_is_not_compiled_per_isa_level():
    assert SCHEDULE.exists()
    assert not SCHEDULE.name.endswith("_kernel.h")


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_schedule_compiles_without_torch(tmp_path):
    src = tmp_path / "driver.cpp"
    src.write_text(DRIVER)
    # -nostdinc++ is not used: the standard library is fine, torch is what must not be needed.
    # The include path is the repository root only, so an ATen/torch include would fail here.
    p = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", f"-I{ROOT}", str(src)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    code = "\n".join(line.split("//")[0] for line in SCHEDULE.read_text().splitlines())
    assert not re.search(r'#\s*include\s*[<"](?:ATen|torch|c10)/', code)
    for torch_name in ("at::", "c10::", "torch::"):
        assert torch_name not in code, torch_name


def test_binding_holds_no_scheduling():
    text = BINDING.read_text()
    # the scheduler, the work items, the pipeline's kernels and the huge-page policy are the schedule's
    for name in ("BandLeft", "make_items", "compare_exchange", "madvise", "MADV_HUGEPAGE",
                 "fused_experts_gemm", "unpermute_tokens", "permute_rows", "fused_experts_act"):
        assert name not in text, f"{name} belongs in {SCHEDULE.name}, not in the binding"
    assert "fe_schedule::run(" in text and "at::parallel_for" in text
