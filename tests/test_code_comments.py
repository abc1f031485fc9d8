"""Comments under optimized/ say why, not what happened (issue 33, item 3).

A kernel's comments keep the algorithm, the data layout, the reduction order and the floors;
the history of a design (which variant lost to which, by how much, in which run) belongs in
the op's doc, docs/<op>.md, "Design alternatives", next to the command that measures it. So no
source file under optimized/ (C++, CUDA, HIP, Python; comments, docstrings and strings alike)
holds:
  - a date: 2026-12-04, or a month with a year (December 2026, Dec 2026);
  - a load average (`load average`, `loadavg`): a run's circumstances, not a reason;
  - a results file: a path under experiments/results/ or results/<folder>/, or a file name
    ending in .txt / .csv (bench_peers.txt, fe_steal.txt): results change with every run;
  - a measured A/B ratio: a decimal ratio with an `x` (1.045x, 1.6-1.7x, 0.97x) or a
    bracketed min..max of decimals ([0.89..1.04]). An integer order of magnitude (`2x`, `4x`)
    and `x` in shapes, hex and names (`4 x 6`, 0x7f, 16x16) are not ratios;
  - a measured A/B pair of times or rates: two figures set against each other with `vs` or
    `against`, the second with a unit (46 us vs 57 us, 13.30 vs 14.79 us, 9.1 against 7.2 GB/s).
    A floor or an estimate (`~14 / 7 us`, `1.26 ms at 30 GB/s`) is not a pair.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".h", ".cpp", ".cu", ".cuh", ".hip", ".py")

_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|"
          r"Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_DEC = r"\d+\.\d+"
RULES = {
    "date": re.compile(r"\b20\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"),
    "month-year date": re.compile(rf"\b{_MONTH}\.?,?\s+(?:\d{{1,2}},?\s+)?20\d\d\b"),
    "load average": re.compile(r"load\s*av(?:erage|g)|loadavg", re.IGNORECASE),
    "results file": re.compile(r"(?:\bexperiments/)?\bresults/[\w.-]+|\b[\w-]+\.(?:txt|csv)\b"),
    "A/B ratio": re.compile(rf"(?<![\w.])(?:{_DEC}|\d+)\s*(?:-|\.\.)\s*{_DEC}x\b|(?<![\w.]){_DEC}x\b"
                            rf"|\[\s*{_DEC}\s*\.\.\s*{_DEC}\s*\]"),
    "A/B times": re.compile(r"(?<![\w.~])\d+(?:\.\d+)?\s*(?:us|ms|ns|GB/s)?\s+(?:vs\.?|against)\s+"
                            r"\d+(?:\.\d+)?\s*(?:us|ms|ns|GB/s)\b"),
}


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line number, rule, matched text) of every line of `text` that breaks a rule."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for rule, rx in RULES.items():
            m = rx.search(line)
            if m:
                out.append((n, rule, m.group(0)))
    return out


def sources() -> list[Path]:
    return sorted(p for p in (ROOT / "optimized").rglob("*")
                  if p.suffix in SUFFIXES and p.is_file() and "__pycache__" not in p.parts)


# ----------------------------------------------------------------------- the detector itself
@pytest.mark.parametrize("line, rule", [
    ("// measured 2026-12-02 on the shared machine", "date"),
    ("# run of December 2026, quiet", "month-year date"),
    ("// (Dec 2026: the first tile)", "month-year date"),
    ("// load average 1.0-1.6 during the rounds", "load average"),
    ("# /proc/loadavg said 0.3", "load average"),
    ("// (experiments/results/amd-epyc-zen-5-2c-avx512_bf16/bench_peers.txt)", "results file"),
    ("// results/amd-epyc-zen-5-2c-avx512_bf16/huge_pages.txt", "results file"),
    ("// the A/B is in fe_steal.txt", "results file"),
    ("# see gpu_bench.csv", "results file"),
    ("// OLMoE bf16 T = 512 1.045x / 1.051x (1 / 2 threads)", "A/B ratio"),
    ("// (1.6-1.7x faster in L2)", "A/B ratio"),
    ("// two threads: 1.016-1.074x, one thread 0.964-0.996x", "A/B ratio"),
    ("// kept: T = 1 0.98 [0.89..1.04], T = 4 0.92 [0.73..1.24]", "A/B ratio"),
    ("# still 1.2x slower at H = 3088", "A/B ratio"),
    ("// one thread, 8 KB rows: 46 us vs 57 us for the vector loop", "A/B times"),
    ("#     5.63 us at T = 1, 13.30 vs 14.79 us at T = 32), so the limit stands", "A/B times"),
    ("// 9.1 against 7.2 GB/s on two threads", "A/B times"),
])
def test_detector_flags_a_planted_line(line, rule):
    assert rule in {r for _, r, _ in findings(line)}, (line, findings(line))


@pytest.mark.parametrize("line", [
    "// a 4 x 6 tile is 24 FMAs per 6 weight and 4 x loads",
    "  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);",
    "// a 16x16 block of 2x unrolled pairs; 4x the bytes of fp8",
    "// magnitude in [2^-47, 2^40) (bf16 bits & 0x7fff in [0x2800, 0x537f])",
    "    return _mm512_roundscale_ps(_mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)),",
    "# floors at ~30-55 GB/s, ~420 GFLOP/s bf16; 8 experts x 4.72 MB = 37.7 MB -> 1.26 ms",
    "// k in [2^-120, 2^119); e8m0 scale bytes in [95, 159]",
    "p.add_argument('--csv', help='also write the rows to this CSV file')",
    "// the results of one call never depend on the thread count",
    "// docs/fused_experts.md, \"Design alternatives\"",
])
def test_detector_passes_a_legitimate_line(line):
    assert findings(line) == [], findings(line)


def test_detector_reports_the_line_number():
    text = "first line\n// fine\n// 1.042x on two threads (fe_micro_buf_strides.txt)\n"
    got = findings(text)
    assert {(n, r) for n, r, _ in got} == {(3, "A/B ratio"), (3, "results file")}


def test_the_scan_covers_every_kind_of_source():
    kinds = {p.suffix for p in sources()}
    assert {".h", ".cpp", ".py", ".cu"} <= kinds, kinds
    assert any(p.name == "fused_experts_kernel.h" for p in sources())


# --------------------------------------------------------------------------------- the rule
def test_no_diary_in_optimized_sources():
    bad = []
    for p in sources():
        for n, rule, hit in findings(p.read_text(encoding="utf-8", errors="replace")):
            bad.append(f"{p.relative_to(ROOT)}:{n}: {rule}: {hit!r}")
    assert not bad, ("comments under optimized/ explain why; move run history and A/B results to the op's "
                     "doc, \"Design alternatives\":\n  " + "\n  ".join(bad))
