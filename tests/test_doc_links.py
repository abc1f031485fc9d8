"""The docs' links and named files exist: every relative markdown link in README.md and docs/*.md
resolves to a file or folder of the repository, and every path the README's reading path names
is there. A renamed or deleted file (a results file, a kernel header) fails here, with the doc line."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"\b((?:reference|optimized|docs|experiments|verify|tests|scripts)/[\w./-]+\.(?:py|h|cpp|md|cu|cuh))\b")


def broken_links(doc: Path, text: str) -> list[str]:
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue   # a URL or an anchor of the same page
            if not (doc.parent / target.split("#")[0]).exists():
                bad.append(f"{doc.relative_to(ROOT)}:{n}: {target}")
    return bad


def test_relative_links_resolve():
    bad = [b for doc in DOCS for b in broken_links(doc, doc.read_text())]
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def test_reading_path_names_existing_files():
    text = (ROOT / "README.md").read_text()
    sec = re.search(r"^## Reading path.*?(?=^## )", text, re.M | re.S)
    assert sec, "README has no '## Reading path' section"
    paths = PATH.findall(sec.group(0))
    assert len(paths) >= 15, f"the reading path names too few files: {paths}"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"the reading path names missing files: {missing}"


def test_a_broken_link_is_found():
    doc = ROOT / "docs" / "x.md"
    assert broken_links(doc, "see [a](performance.md) and [b](../experiments/results/none/nothing.txt)") == \
        ["docs/x.md:1: ../experiments/results/none/nothing.txt"]
    assert broken_links(doc, "[c](https://example.org/a) [d](#floors) [e](../README.md#reading-path)") == []
