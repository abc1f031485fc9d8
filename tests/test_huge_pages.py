"""Packed expert weights are advised as transparent huge pages before their first write
(csrc/cpu/fused_experts_schedule.h: advise_huge_pages; docs/fused_experts.md, "Huge pages"), by
prepack_moe_weights and by the pack cache. Checked in /proc/self/smaps: the mapping that holds
the packed bytes carries the `hg` flag (VM_HUGEPAGE, set by madvise(MADV_HUGEPAGE)). The
advice is a speed matter only (experiments/micro/huge_pages.py); results never depend on it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import optimized
from experiments import timing
from optimized import pack_cache
from optimized.tune.calibrate import random_weights

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are not available here (not Linux, or THP set to never)")


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping of this process that contains addr."""
    flags = timing.smaps_field(addr, "VmFlags:")
    assert flags is not None, f"no mapping holds {addr:#x}"
    return flags


def _middle(t: torch.Tensor) -> int:
    return t.data_ptr() + t.numel() * t.element_size() // 2


def test_prepacked_weights_are_advised_huge():
    w13, w2, s13, s2 = random_weights("fp8_block", 4, 1024, 1024, seed=0)   # 2 MiB per expert of w13
    p = optimized.prepack_moe_weights(w13, w2, "fp8_block", s13, s2)
    assert "hg" in _vm_flags(_middle(p.w13)), "prepacked w13 not advised as huge pages"
    assert "hg" in _vm_flags(_middle(p.w2))


def test_pack_cache_advises_the_experts_it_packs():
    pack_cache.clear()
    w13, w2, s13, s2 = random_weights("fp8_block", 4, 1024, 1024, seed=1)
    x = torch.randn(1, 1024).bfloat16()
    ids = torch.tensor([[2]], dtype=torch.int32)
    optimized.fused_experts(x, w13, w2, torch.ones(1, 1), ids, quant="fp8_block", w13_scale=s13, w2_scale=s2)
    p13 = pack_cache.packed_weights(w13, w2, s13, s2, "fp8_block", ids)[0]
    expert = p13[2] if p13.dim() == 2 else p13.view(4, -1)[2]
    assert "hg" in _vm_flags(_middle(expert)), "the packed expert's bytes were not advised as huge pages"
    pack_cache.clear()
