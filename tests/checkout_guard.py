"""What the test suite may not do: leave the checkout different from how it found it.

`snapshot(root)` records every path `git status` lists (tracked changes and untracked files,
ignored ones excluded) with the hash of its content; `changes(before, after)` names each path
whose status or content differs. Hashing the content matters: a file already modified before
the session (work in progress) that a test writes again keeps the same `git status` line, so
comparing the status text alone would miss it. tests/conftest.py runs this around the session.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Optional

# --no-optional-locks: `git status` would otherwise refresh the index and take .git/index.lock,
# which can make a concurrent `git add` in the same checkout fail.
_STATUS = ["git", "--no-optional-locks", "-c", "core.quotepath=off", "status", "--porcelain=v1", "-z",
           "--untracked-files=all", "--ignored=no"]

Snapshot = dict  # path (relative, '/') -> (two-letter status, content digest)


def git_root(path: Path) -> tuple[Optional[Path], str]:
    """(the top of the git work tree holding path, "") or (None, why there is none)."""
    try:
        p = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path, capture_output=True, text=True)
    except OSError as e:
        return None, f"git cannot be run ({e})"
    if p.returncode != 0:
        return None, f"{path.name}/ is not in a git checkout ({p.stderr.strip() or 'git rev-parse failed'})"
    return Path(p.stdout.strip()), ""


def _digest(path: Path) -> str:
    if path.is_symlink():
        return "link:" + os.readlink(path)
    if path.is_dir():          # a nested repository or submodule: git lists the folder itself
        return "dir"
    try:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except FileNotFoundError:
        return "absent"


def snapshot(root: Path) -> Snapshot:
    """Every path git status lists under root, with its status and content digest."""
    out = subprocess.run(_STATUS, cwd=root, capture_output=True, check=True).stdout
    fields = out.split(b"\0")
    snap: Snapshot = {}
    i = 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if not entry:
            continue
        xy, path = entry[:2].decode(), os.fsdecode(entry[3:])
        snap[path] = (xy, _digest(root / path))
        if xy[0] in "RC":      # a rename or copy: the next field is the source path
            src = os.fsdecode(fields[i])
            i += 1
            snap[src] = (xy + " (source)", _digest(root / src))
    return snap


def _describe(state) -> str:
    if state is None:
        return "clean"
    xy, digest = state
    kind = {"??": "untracked"}.get(xy.strip(), f"status '{xy}'")
    return f"{kind}, {'deleted' if digest == 'absent' else 'content ' + digest[:12]}"


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    """One line per path whose status or content differs between the two snapshots."""
    return [f"{p}: {_describe(before.get(p))} -> {_describe(after.get(p))}"
            for p in sorted(set(before) | set(after)) if before.get(p) != after.get(p)]
