"""How the `optimized` package is put together: its modules import each other without a cycle,
no function imports a module of the package (the way a cycle is usually hidden), and importing
it reads no tune file (optimized.tune reads it when a decision first needs it)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "optimized"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py")) if "csrc" not in p.parts}


def _targets(node, module: str, is_pkg: bool, known) -> set[str]:
    """The package's modules an import statement needs initialized: `import X` needs X;
    `from X import y` needs X.y where y is a submodule, else X (whose __init__ defines y)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            src = ".".join(base + ([node.module] if node.module else []))
        else:
            src = node.module or ""
        names = [f"{src}.{a.name}" if f"{src}.{a.name}" in known else src for a in node.names]
    out = set()
    for n in names:
        while n and n not in known:        # an outside module (torch, reference): not in the graph
            n = n.rpartition(".")[0] if "." in n else ""
        if n:
            out.add(n)
    return out


class _Imports(ast.NodeVisitor):
    """Imports run when the module is imported (module level, also inside if / try / class
    bodies) apart from those inside functions."""

    def __init__(self):
        self.top, self.in_functions, self._depth = [], [], 0

    def _function(self, node):
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _import(self, node):
        (self.in_functions if self._depth else self.top).append(node)

    visit_Import = visit_ImportFrom = _import


def _graph():
    mods = _modules()
    graph, inner = {}, {}
    for name, path in mods.items():
        v = _Imports()
        v.visit(ast.parse(path.read_text(), str(path)))
        is_pkg = path.name == "__init__.py"
        graph[name] = set().union(*(_targets(n, name, is_pkg, mods) for n in v.top)) - {name}
        inner[name] = [(n.lineno, t) for n in v.in_functions for t in _targets(n, name, is_pkg, mods)]
    return graph, inner


def _cycle(graph) -> list[str]:
    """One import cycle of the graph as a list of modules, or []."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_the_package_has_no_import_cycle():
    graph, _ = _graph()
    assert {"optimized", "optimized.dispatch", "optimized.tune", "optimized.fused_experts"} <= set(graph)
    assert "optimized.dispatch" in graph["optimized.fused_experts"], "the graph misses plain imports"
    assert "optimized.tune" in graph["optimized.dispatch"], "the graph misses relative imports"
    cycle = _cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    graph, _ = _graph()
    assert not _cycle(graph)
    graph = {**graph, "optimized.tune": graph["optimized.tune"] | {"optimized.fused_experts"}}
    cycle = _cycle(graph)
    assert cycle and cycle[0] == cycle[-1] and "optimized.tune" in cycle, cycle


def test_no_function_imports_a_module_of_the_package():
    """An import inside a function runs at call time; inside the package it would only be there
    to hide a cycle (optional heavy dependencies, imported lazily, are outside the package)."""
    _, inner = _graph()
    found = [f"{m}:{line} imports {t}" for m, hits in inner.items() for line, t in hits]
    assert not found, "\n".join(found)


def test_importing_optimized_reads_no_tune_file(tmp_path):
    """A malformed tune file in MOELAB_CACHE_DIR: `import optimized` opens nothing there; the
    first fused_experts decision that needs the crossover reads it (once) and falls back to the
    level's default, saying why."""
    code = r"""
import json, os, sys
cache = os.environ["MOELAB_CACHE_DIR"]
opened = []
sys.addaudithook(lambda ev, args: opened.append(str(args[0])) if ev == "open" and str(args[0]).startswith(cache) else None)
import optimized
from optimized import dispatch, tune
at_import = list(opened)
dispatch.fused_experts_plan(4, 2, 8, "bf16", "tiny")          # needs no crossover
before_auto = list(opened)
m, src = dispatch.fused_experts_m_cross("bf16")
dispatch.fused_experts_plan(4, 2, 8, "fp8_block", "auto")
print(json.dumps({"at_import": at_import, "before_auto": before_auto, "after": opened, "src": src,
                  "file": str(tune.tune_file()), "level": optimized.backend_info()["active"], "m": m,
                  "default": dispatch.default_m_cross(optimized.backend_info()["active"], "bf16")[0]}))
"""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = dict(os.environ, MOELAB_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    probe = subprocess.run([sys.executable, "-c", "from optimized import tune; print(tune.tune_file())"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert probe.returncode == 0, probe.stderr[-3000:]
    Path(probe.stdout.strip().splitlines()[-1]).write_text("{ this is not json")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["at_import"] == [] and r["before_auto"] == [], r
    assert r["after"] == [r["file"]], r                            # read once, for the first decision
    assert r["m"] == r["default"] and "unreadable" in r["src"], r
