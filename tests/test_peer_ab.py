"""experiments/peer_ab.py (one point, ours against one peer, in one process): its loop and its
error, on a small shape with a stand-in peer (the real peers are optional, `make peers`)."""
from __future__ import annotations

import pytest

from experiments import cases_fused_experts as cfe
from experiments import peer_ab


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(cfe.SHAPES, "tiny", dict(E=4, K=2, H=64, I=32, quant="bf16", activation="silu", bias=False))

    class Peers:
        def peers(self, x, tw, ids):
            return {"stand-in": lambda: x.float().sum(), "absent": "not installed (a reason)"}
    monkeypatch.setattr(cfe.ShapeData, "peer_set", lambda self: Peers())


def test_peer_ab_prints_the_median_ratio(tiny, capsys):
    assert peer_ab.main(["--shape", "tiny", "--T", "3", "--threads", "1", "--rounds", "3", "--peer", "stand-in"]) == 0
    out = capsys.readouterr().out
    assert "tiny bf16 T=3, 1 thread(s), 3 rounds: ours" in out and "stand-in / ours" in out


def test_peer_ab_names_an_unavailable_peer(tiny, capsys):
    with pytest.raises(SystemExit):
        peer_ab.main(["--shape", "tiny", "--peer", "absent", "--rounds", "1"])
    assert "'absent' is not available for tiny: not installed (a reason)" in capsys.readouterr().err
