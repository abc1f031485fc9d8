"""`python -m experiments.build_notebooks [--check]`: experiments/notebooks/*.py -> experiments/*.ipynb.

The notebooks are written as Python files in the percent format (reviewable diffs): a line
`# %%` starts a code cell, `# %% [markdown]` a markdown cell whose lines are comments
(`# ` is stripped). The built .ipynb files are committed without outputs; the executed
copies are made by `make experiments` (experiments/executed/). --check exits 1 if a
committed .ipynb differs from its source (tests/test_notebooks.py runs it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "notebooks"


def cells(text: str) -> list:
    out, kind, lines = [], None, []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in body.split("\n"))
            out.append(nbformat.v4.new_markdown_cell(body))
        elif body:
            out.append(nbformat.v4.new_code_cell(body))

    for line in text.split("\n"):
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    return out


def build(src: Path):
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    nb.cells = cells(src.read_text())
    for i, c in enumerate(nb.cells):   # stable ids: diffs stay small
        c.id = f"{src.stem[:3]}-{i:02d}"
    return nb


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.build_notebooks", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only check that the .ipynb files are up to date")
    a = p.parse_args(argv)
    stale = []
    for src in sorted(SOURCES.glob("0*.py")):
        dst = HERE / f"{src.stem}.ipynb"
        text = nbformat.writes(build(src)) + "\n"
        if dst.exists() and dst.read_text() == text:
            continue
        if a.check:
            stale.append(dst.name)
        else:
            dst.write_text(text)
            print(f"wrote {dst.relative_to(HERE.parent)}")
    if stale:
        print(f"out of date (run python -m experiments.build_notebooks): {', '.join(stale)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
