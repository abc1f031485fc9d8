"""Session-wide rules of the test suite.

The suite writes nothing into the checkout: a test that needs a file (a verify corpus, a
report, results, figures, a tune file) writes it under pytest's tmp_path. `git status` (and
the content of every path it lists) is recorded when the session starts and compared when it
ends; any difference fails the session, naming the paths. The first record is taken before
collection, so a test module that writes when imported is caught too. Outside a git checkout
there is nothing to compare against, and the report header says the check is off and why.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests import checkout_guard

_ROOT, _NO_CHECKOUT = checkout_guard.git_root(Path(__file__).resolve().parent.parent)
_before = None


def pytest_sessionstart(session):
    global _before
    if _ROOT is not None:
        _before = checkout_guard.snapshot(_ROOT)


def pytest_report_header(config):
    if _ROOT is None:
        return f"checkout guard: off: {_NO_CHECKOUT}"
    return "checkout guard: on (the session fails if it changes what `git status` lists)"


@pytest.fixture(scope="session", autouse=True)
def _checkout_stays_clean():
    if _ROOT is None:
        yield
        return
    before = _before if _before is not None else checkout_guard.snapshot(_ROOT)
    yield
    changed = checkout_guard.changes(before, checkout_guard.snapshot(_ROOT))
    if changed:
        pytest.fail("the test session changed the checkout (a test must write under tmp_path; or the files "
                    "were edited by hand while the suite ran):\n  " + "\n  ".join(changed), pytrace=False)
