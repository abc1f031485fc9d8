"""Every measured figure a doc quotes is in a committed results file that the doc cites.

No measurement runs here: the docs are parsed and compared with files under
experiments/results/. Checked: docs/performance.md (whole file), README.md's "Real model
families" section (its measured-speedup table, from bench_models_quick.txt) docs/gpu.md's
"GPU status" section, and the GPU run's summary beside its files (experiments/results/nvidia-h200/RUN.md).

The rule:
  1. Blocks. A doc is cut into blocks: a paragraph (lines up to a blank line) or one table
     row. A block's sources are the files under experiments/results/ it links to
     (`[name](../experiments/results/...)`); a block without such a link takes those of the
     nearest earlier block of the same `##` section that has one, else those of the doc's
     preamble (the text before the first `##`). A figure in a block with no source fails.
  2. Figures. A figure is a number with a unit -- `x` (ratio), `%`, `GB/s`, `GFLOP/s`, `us`,
     `ms` -- or a bare decimal with 3 or more decimals (a geomean such as `1.115`). The unit
     carries over a list or range: `95 / 84 / 85%`, `38.4, 47.9 GB/s`, `47-49%`, and the
     `(min..max)` after a figure (`3.36x (3.34..3.39)`: three figures, all `x`).
  3. Not measurements, so not checked: a target (a figure after `>=`, `<=`, `>`, `<`); an
     integer ratio (`2x`, `5x`: targets and orders, the bench prints measured ratios with
     decimals); an estimate or a derived value, written after `~` (`~6 us`, `~98%`); sizes
     (`NAME=value`, `T = 16`, `8 KiB`, `32 MiB`, `4.2 MB`: no checked unit), counts, thread
     counts and dates (no unit). Markdown link targets and inline code are ignored.
  4. Match. A figure printed with d decimals matches a number of a cited file printed with
     at least d decimals (a CSV: full precision) that rounds to it at d decimals; a `%`
     figure matches a `%` of a text file or a fraction (0.95 -> 95%) of a CSV, an `x` figure
     no `%` number.
     A figure found in none of the block's cited files fails the test, with the doc line.
"""
from __future__ import annotations

import csv
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "experiments/results/"

UNIT = r"(?:x|%|\s?GB/s|\s?GFLOP/s|\s?us|\s?ms)"
NUM = r"\d+(?:\.\d+)?"
# A group: numbers joined by list/range separators, then one unit; optionally a (min..max).
GROUP = re.compile(
    rf"(?P<pre>(?:>=|<=|>|<|~|≥|≤)\s*)?"
    rf"(?<![\w.=])(?P<nums>{NUM}(?:(?:\s*/\s*|,\s*|\.\.|-|\s+to\s+|\s+or\s+){NUM})*)"
    rf"(?P<unit>{UNIT})(?![\w/])"
    rf"(?:\s*\((?P<lo>{NUM})\.\.(?P<hi>{NUM}))?")
BARE = re.compile(r"(?P<pre>(?:>=|<=|>|<|~|≥|≤)\s*)?(?<![\w.=])(?P<num>\d+\.\d{3,})(?!\w|\.\d)")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
LINK = re.compile(r"\]\(([^)]*)\)")


def figures(text: str) -> list[tuple[str, str]]:
    """(number as printed, unit) of each checked figure in `text` (rules 2 and 3)."""
    text = DATE.sub(" ", re.sub(r"`[^`]*`", " ", LINK.sub("]", text)))
    out, spans = [], []
    for m in GROUP.finditer(text):
        spans.append(m.span())
        if m.group("pre"):
            continue
        unit = m.group("unit").strip()
        nums = re.findall(NUM, m.group("nums")) + [g for g in (m.group("lo"), m.group("hi")) if g]
        if unit == "x" and all("." not in n for n in nums):
            continue
        out += [(n, unit) for n in nums]
    for m in BARE.finditer(text):
        if not m.group("pre") and not any(a <= m.start() < b for a, b in spans):
            out.append((m.group("num"), ""))
    return out


def blocks(md: str):
    """(first line number, text, cited result files) per block (rule 1)."""
    lines = md.splitlines()
    raw, cur, start = [], [], 0
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("|"):
            if cur:
                raw.append((start, "\n".join(cur)))
                cur = []
            if not re.match(r"^\s*\|[\s|:-]+\|\s*$", line):
                raw.append((i, line))
        elif not line.strip():
            if cur:
                raw.append((start, "\n".join(cur)))
                cur = []
        else:
            if not cur:
                start = i
            cur.append(line)
    if cur:
        raw.append((start, "\n".join(cur)))
    preamble, section, out = [], [], []
    in_preamble = True
    for n, text in raw:
        if text.startswith("## "):
            in_preamble, section = False, []
        cites = [c for c in LINK.findall(text) if RESULTS in c]
        cites = [c[c.index(RESULTS):] for c in cites]
        if cites:
            section = cites
            if in_preamble:
                preamble = cites
        out.append((n, text, cites or section or preamble))
    return out


def _file_numbers(rel: str) -> tuple[list[tuple[float, str, int]], bool]:
    """(value, kind, decimals) of every number in a committed results file; kind is the
    character after it in a text file ('%', 'x') or ''; decimals as printed (a CSV's full
    precision counts as any); and whether it is a CSV."""
    path = ROOT / rel
    assert path.is_file(), f"cited file {rel} is not in the repository"
    body = path.read_text()
    if path.suffix == ".csv":
        vals = []
        for row in csv.reader(io.StringIO(body)):
            for cell in row:
                try:
                    vals.append((float(cell), "", 99))
                except ValueError:
                    vals += [(float(v), "", 99) for v in re.findall(NUM, cell)]
        return vals, True
    return [(float(m.group(1)), m.group(2) or "", len(m.group(1).partition(".")[2]))
            for m in re.finditer(rf"({NUM})(%|x)?", body)], False


def _matches(num: str, unit: str, rel: str) -> bool:
    d = len(num.split(".")[1]) if "." in num else 0
    want = float(num)
    vals, is_csv = _file_numbers(rel)
    for v, kind, dec in vals:
        if dec < d:          # printed with fewer decimals than the doc quotes: not a source
            continue
        if unit == "%":
            if kind == "%" and round(v, d) == want:
                return True
            if is_csv and 0 < v < 10 and round(v * 100, d) == want:
                return True
        elif unit == "x":
            if kind in ("x", "") and round(v, d) == want:
                return True
        elif kind == "" and round(v, d) == want:
            return True
    return False


def check(md: str, where: str = "doc") -> list[str]:
    """Every failure (rule 4) as 'where:line: figure not in files: text'."""
    bad = []
    for n, text, cites in blocks(md):
        for num, unit in figures(text):
            line = next((ln for ln in text.splitlines() if num in ln), text.splitlines()[0])
            if not cites:
                bad.append(f"{where}:{n}: {num}{unit} cites no file under {RESULTS}: {line.strip()}")
            elif not any(_matches(num, unit, c) for c in cites):
                bad.append(f"{where}:{n}: {num}{unit} is in none of {', '.join(cites)}: {line.strip()}")
    return bad


def _section(md: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}.*?(?=^## |\Z)", md, re.M | re.S)
    assert m, f"section '{title}' not found"
    return m.group(0)


def test_performance_md():
    bad = check((ROOT / "docs/performance.md").read_text(), "docs/performance.md")
    assert not bad, "figures without a committed source:\n" + "\n".join(bad)


def test_readme_models_table():
    sec = _section((ROOT / "README.md").read_text(), "Real model families")
    assert "bench_models_quick.txt" in sec
    # README links are relative to the repository root; the rule is the same.
    bad = check(sec, "README.md")
    assert not bad, "figures without a committed source:\n" + "\n".join(bad)
    assert len([f for _, t, _ in blocks(sec) for f in figures(t)]) >= 18, "the table's figures were not parsed"


def test_gpu_md_status_and_the_run_summary():
    sec = _section((ROOT / "docs/gpu.md").read_text(), "GPU status")
    bad = check(sec, "docs/gpu.md")
    assert not bad, "figures without a committed source:\n" + "\n".join(bad)
    assert len([f for _, t, _ in blocks(sec) for f in figures(t)]) >= 5, "the section's figures were not parsed"
    # the run's own summary beside its files: its figures are in those files (links relative to it)
    rel = "experiments/results/nvidia-h200/"
    run = (ROOT / rel / "RUN.md").read_text().replace("](gpu_", f"](../{rel}gpu_")
    bad = check(run, rel + "RUN.md")
    assert not bad, "figures without a committed source:\n" + "\n".join(bad)
    assert len([f for _, t, _ in blocks(run) for f in figures(t)]) >= 15, "the summary's figures were not parsed"


# ---------------------------------------------------------------- the test of the test
SRC = "[bench_models_quick.txt](experiments/results/amd-epyc-zen-5-2c-avx512_bf16/bench_models_quick.txt)"


def test_figure_parsing():
    f = figures("3.36x (3.34..3.39) at E=256; 95 / 84 / 85% of it; 38.4, 47.9 GB/s; geomean 1.115; "
                "target >= 2x, >= 60%, T = 16, H=3072, 8 KiB, ~6 us, 2026-11-29, 0.5 ms")
    assert f == [("3.36", "x"), ("3.34", "x"), ("3.39", "x"), ("95", "%"), ("84", "%"), ("85", "%"),
                 ("38.4", "GB/s"), ("47.9", "GB/s"), ("0.5", "ms"), ("1.115", "")]


@pytest.mark.parametrize("doc", [
    f"Measured ({SRC}): decode 2.35x.",                       # invented ratio
    f"Measured ({SRC}): bandwidth 34.0 GB/s.",                 # 33.6 printed at one more decimal
    f"Measured ({SRC}):\n\n| a | 1.48x (1.47..1.58) |",        # invented max, table row
    "No source: 1.48x.",                                       # no cited file
    f"Measured ({SRC}): geomean 1.115.",                       # bare geomean not in the file
    f"Measured ({SRC}): 1.480x.",                              # more decimals than the file prints
])
def test_invented_figure_fails(doc):
    assert check(doc), doc


@pytest.mark.parametrize("doc", [
    f"Measured ({SRC}): 1.48x (1.47..1.51), read bandwidth 33.6, 35.9 GB/s; 34-36 GB/s.",
    f"Measured ({SRC}):\n\n| a | 1.79x (1.74..1.84) |",       # the row takes the paragraph's source
    f"Measured ({SRC}): 1.5x; a target >= 9.99x, ~7.77x estimated, 5x.",
])
def test_real_figure_passes(doc):
    assert check(doc) == [], check(doc)
