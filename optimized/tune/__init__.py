"""optimized.tune: the tune file, this machine's measured crossovers, read on first use.

`python -m optimized.tune` (optimized/tune/calibrate.py) times the kernels a crossover chooses
between and stores what it found in tune_file(), outside the repository: it describes the
machine, not the code. optimized.dispatch asks `entry()` for what was measured at the ISA
level and thread count of a decision. Nothing is read at import: the file is read when the
first decision needs it and then kept; `reload()` forgets it (after a new tune run).

Layout: {"fused_experts": {"by_level": {LEVEL: {KEY: {"m_cross": {quant: m}, ...}}}}}.
LEVEL is the ISA level the run's kernels ran at (optimized.backend_info()["active"]; a run
capped by MOELAB_ISA is filed under the cap): each level is its own code with its own tiles
and decoders, so a crossover measured at one level is never used at another. KEY is
"threads=N" (wall clock on N threads) or "cpu" (one thread's CPU time, which does not depend
on the thread count). Entries of the earlier layouts, which did not record the level, are not
used (a tune run rewrites the file in this layout).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

__all__ = ["tune_file", "active_level", "entry", "store", "reload"]

_file: Optional[tuple[dict, str]] = None    # (parsed file, "" or why it is not usable), once read
_level: Optional[str] = None                # the active ISA level, once asked
_entries: dict = {}                         # (section, level, threads) -> entry()'s answer
generation = 0                              # bumped whenever an answer may have changed (memos key on it)


def _machine_slug() -> str:
    model = "unknown-cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    slug = "".join(c if c.isalnum() else "-" for c in model.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return f"{slug[:40]}-{os.cpu_count()}cpu"


def tune_file() -> Path:
    """Where `python -m optimized.tune` stores this machine's crossovers:
    $MOELAB_CACHE_DIR (default ~/.cache/moelab)/tune-<cpu>.json."""
    root = os.environ.get("MOELAB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moelab")
    return Path(root) / f"tune-{_machine_slug()}.json"


def active_level() -> str:
    """The ISA level the CPU kernels run at now. Kept after the first call (a decision cannot
    afford the op call each time); optimized.set_isa forgets it, so does reload()."""
    global _level
    if _level is None:
        _level = dict(item.split(":", 1) for item in torch.ops.moelab.backend_info())["active"]
    return _level


def level_changed() -> None:
    """Forget the ISA level and the answers chosen by it (the file stays read)."""
    global _level, generation
    _level = None
    _entries.clear()
    generation += 1


def reload() -> None:
    """Forget the file and the level: the next decision reads both again."""
    global _file
    _file = None
    level_changed()


def _read() -> tuple[dict, str]:
    global _file
    if _file is None:
        path = tune_file()
        try:
            data = json.loads(path.read_text())
            _file = (data, "") if isinstance(data, dict) else ({}, f"{path.name} is not a JSON object")
        except FileNotFoundError:
            _file = ({}, "no tune file")
        except (OSError, ValueError) as e:
            _file = ({}, f"{path.name} unreadable: {type(e).__name__}")
    return _file


def _threads_of(key: str) -> int:
    return int(key[8:]) if key.startswith("threads=") and key[8:].isdigit() else 1 << 30


def _choose(section: str, level: str, threads: int) -> tuple[dict, str]:
    data, why = _read()
    if why:
        return {}, why
    name = tune_file().name
    levels = data.get(section, {}).get("by_level") if isinstance(data.get(section), dict) else None
    entries = levels.get(level) if isinstance(levels, dict) else None
    if not isinstance(entries, dict):
        return {}, f"{name} has no {section} entry measured at level {level}"
    keys = [k for k, v in entries.items() if isinstance(v, dict) and isinstance(v.get("m_cross"), dict)]
    if not keys:
        return {}, f"{name} has no usable {section} entry at level {level}"
    key = (f"threads={threads}" if f"threads={threads}" in keys else "cpu" if "cpu" in keys
           else min(keys, key=lambda k: abs(_threads_of(k) - threads)))
    tuned = {q: v for q, v in entries[key]["m_cross"].items() if type(v) is int and 1 <= v <= 1 << 20}
    how = "one thread's CPU time" if key == "cpu" else f"{_threads_of(key)} threads"
    note = "" if key in (f"threads={threads}", "cpu") else f", this process has {threads}"
    return tuned, f"tuned at {level} ({name}, {how}{note})"


def entry(section: str, level: str, threads: int) -> tuple[dict, str]:
    """(values, source) measured for `section` at ISA `level`, for a process on `threads` threads:
    the entry of that thread count, else the CPU-time one, else the one of the nearest thread
    count (the source says so); ({}, why there is none) otherwise. Answers are kept per
    (section, level, threads) until reload()."""
    k = (section, level, threads)
    got = _entries.get(k)
    if got is None:
        got = _entries[k] = _choose(section, level, threads)
    return got


def store(section: str, level: str, key: str, result: dict) -> Path:
    """Put one measurement into the tune file under (section, level, key), keeping every other
    entry of this layout; values of `result["m_cross"]` not measured now keep their earlier
    value in the same entry. Returns the file's path; the next decision reads it again."""
    path = tune_file()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data = data if isinstance(data, dict) else {}
    sec = data.get(section) if isinstance(data.get(section), dict) else {}
    levels = sec.get("by_level") if isinstance(sec.get("by_level"), dict) else {}
    entries = levels.get(level) if isinstance(levels.get(level), dict) else {}
    old = entries.get(key, {}).get("m_cross", {}) if isinstance(entries.get(key), dict) else {}
    entries[key] = {**result, "m_cross": {**old, **result.get("m_cross", {})}}
    levels[level] = entries
    data[section] = {"by_level": levels}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    reload()
    return path
