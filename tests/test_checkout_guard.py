"""The checkout guard (tests/checkout_guard.py, run around the session by tests/conftest.py)
sees every way a test can dirty a checkout, and nothing else."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tests import checkout_guard

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    (r / ".gitignore").write_text("ignored/\n")
    (r / "clean.txt").write_text("a\n")
    (r / "wip.txt").write_text("b\n")
    (r / "gone.txt").write_text("c\n")
    (r / "old.txt").write_text("d\n")
    _git(r, "add", ".")
    _git(r, "commit", "-q", "-m", "x")
    (r / "wip.txt").write_text("b, edited before the session\n")     # work in progress
    (r / "draft.txt").write_text("untracked before the session\n")
    return r


def test_every_kind_of_write_is_named(repo):
    before = checkout_guard.snapshot(repo)
    assert set(before) == {"wip.txt", "draft.txt"}
    (repo / "clean.txt").write_text("a, changed by a test\n")
    (repo / "wip.txt").write_text("b, edited again by a test\n")     # same `git status` line as before
    (repo / "draft.txt").write_text("rewritten\n")
    (repo / "gone.txt").unlink()
    (repo / "new" / "deep").mkdir(parents=True)
    (repo / "new" / "deep" / "out.csv").write_text("1\n")
    _git(repo, "mv", "old.txt", "moved.txt")
    changed = checkout_guard.changes(before, checkout_guard.snapshot(repo))
    named = {line.split(":", 1)[0] for line in changed}
    assert named == {"clean.txt", "wip.txt", "draft.txt", "gone.txt", "new/deep/out.csv", "moved.txt", "old.txt"}, changed
    assert any(line.startswith("clean.txt: clean -> ") for line in changed), changed
    assert any(line.startswith("new/deep/out.csv: clean -> untracked") for line in changed), changed


def test_untouched_ignored_and_restored_files_pass(repo):
    before = checkout_guard.snapshot(repo)
    (repo / "ignored").mkdir()
    (repo / "ignored" / "cache.bin").write_bytes(b"\0" * 10)         # ignored: never the checkout's business
    text = (repo / "clean.txt").read_text()
    (repo / "clean.txt").write_text("temporarily\n")
    (repo / "clean.txt").write_text(text)                            # same bytes at the end: clean
    (repo / "wip.txt").touch()                                       # a new mtime alone changes nothing
    assert checkout_guard.changes(before, checkout_guard.snapshot(repo)) == []


def test_outside_a_checkout_the_reason_is_given(tmp_path):
    root, why = checkout_guard.git_root(tmp_path)
    if root is not None:
        pytest.skip(f"the temporary folder itself lies in a git checkout ({root})")
    assert "not in a git checkout" in why
