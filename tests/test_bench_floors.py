"""Floors that mean floors (issue 17): every committed results row that states a fraction of a
floor is at or below 100% of its own floor, and every experiments.bench row names the floor it
uses (dram, or cache: the bandwidth of a working set of the row's size, measured in the same
run). A row above its floor means the floor was not one (a DRAM floor on cache-resident
inputs printed 106-316% before), so the check fails rather than the number being reported."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from experiments import bench, timing

RESULTS = Path(__file__).resolve().parent.parent / "experiments" / "results"
CSVS = sorted(RESULTS.glob("*/*.csv"))


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("path", CSVS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_committed_row_exceeds_its_floor(path):
    rows = _rows(path)
    cols = [c for c in (rows[0] if rows else {}) if c.endswith("floor_frac")]
    for i, r in enumerate(rows):
        for c in cols:
            if r[c] not in ("", None):
                assert float(r[c]) <= 1.0, f"{path.name} row {i} ({r.get('shape') or r.get('case')}): {c} = {r[c]}"


@pytest.mark.parametrize("path", CSVS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_bench_rows_name_their_floor(path):
    rows = _rows(path)
    if not rows or not {"read_GBps", "GBps", "floor_frac"} <= set(rows[0]):
        return   # not an experiments.bench table with a floor column
    for i, r in enumerate(rows):
        assert r.get("floor_kind") in ("dram", "cache"), f"{path.name} row {i}: floor_kind {r.get('floor_kind')!r}"
        if "floor_GBps" in r:
            got = float(r["GBps"]) / float(r["floor_GBps"])
            assert abs(got - float(r["floor_frac"])) <= 1e-6 * max(1.0, got), (path.name, i)


def test_at_least_one_bench_table_states_floors():
    assert any({"floor_kind", "floor_frac"} <= set((_rows(p) or [{}])[0]) for p in CSVS if "bench" in p.name)


def test_floor_of_picks_the_floor_by_size(monkeypatch):
    monkeypatch.setattr(timing, "llc_bytes", lambda: 4 << 20)
    monkeypatch.setattr(timing, "read_bandwidth", lambda nbytes=0: 30e9)
    seen = []
    monkeypatch.setattr(timing, "cache_bandwidth", lambda n: seen.append(n) or (200e9 if n <= 4 << 20 else 25e9))
    assert bench.floor_of(2 << 20) == ("cache", 200e9)
    assert bench.floor_of(64 << 20) == ("dram", 30e9)           # the larger of read and same-size probe
    assert seen == [2 << 20, 64 << 20]
    assert bench.floor_of(2 << 20, cold=True) == ("dram", 30e9)  # rotating copies: memory, whatever the size
    assert seen == [2 << 20, 64 << 20]


def test_cache_bandwidth_is_measured_and_memoized():
    import torch
    prev = torch.get_num_threads()
    torch.set_num_threads(1)      # a shared 2-core machine stalls parallel regions for ms
    try:
        timing._cache_bw.clear()
        bw = timing.cache_bandwidth(1 << 16)        # below 1 MiB: measured at 1 MiB
        assert bw > 1e9 and list(timing._cache_bw) == [1 << 20]
        assert timing.cache_bandwidth(1 << 18) == bw
        assert timing.llc_bytes() >= 1 << 20
    finally:
        torch.set_num_threads(prev)
        timing._cache_bw.clear()
