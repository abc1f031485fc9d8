"""The experiment notebooks run: every notebook executes headless in tiny mode (seconds, small
shapes, one round) and produces its figures and a verdict row for each of its claims; the
report covers every claim of papers/claims.toml; GPU results placed under results/ show up
beside the CPU ones. Also the verdict rule and the machine-stamped CSVs, which need no
notebook machinery.

The notebook run needs the `notebooks` extra (jupyter, nbclient, ipykernel, seaborn,
pandas), which `make setup` installs; without it those tests skip and say so.
"""
from __future__ import annotations

import csv
import importlib.util
import re
from pathlib import Path

import pytest

from experiments import nb, timing

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.stem for p in (ROOT / "experiments").glob("0*.ipynb"))
EXTRA = ("nbclient", "nbformat", "ipykernel", "seaborn", "pandas", "matplotlib")
MISSING = [m for m in EXTRA if importlib.util.find_spec(m) is None]
needs_extra = pytest.mark.skipif(bool(MISSING), reason=f"the notebooks extra is not installed (missing "
                                                        f"{', '.join(MISSING)}): pip install -e '.[notebooks]' "
                                                        f"(make setup does)")

# A GPU result as scripts/gpu_check.sh writes it (experiments/gpu_bench.py's columns and case names).
FAKE_GPU = [
    ("router_gemm", "T=1 H=3072 E=256 bf16", "moelab fused cast", 5.0),
    ("router_gemm", "T=1 H=3072 E=256 bf16", "before: cast kernel + GEMM (2 launches)", 9.0),
    ("router_gemm", "T=8 H=3072 E=256 bf16", "moelab fused cast", 6.0),
    ("router_gemm", "T=8 H=3072 E=256 bf16", "before: cast kernel + GEMM (2 launches)", 10.0),
    ("skinny_gemm", "T=1 K=7168 N=513 bf16", "moelab skinny_t1", 4.0),
    ("skinny_gemm", "T=1 K=7168 N=513 bf16", "before: F.linear", 8.0),
    ("route", "E=896 K=16 T=512 sigmoid_bias", "moelab lanes [row 3: block tier]", 12.0),
    ("route", "E=896 K=16 T=512 sigmoid_bias", "before: warp 0 alone (route_variant serial)", 20.0),
    ("route", "E=896 K=16 T=512 sigmoid_bias", "eager torch.topk chain (not seed 004's pair)", 36.0),
    ("permute", "T=1 E=8 K=2 H=4096 bf16", "moelab scratch (eager)", 20.0),
    ("permute", "T=1 E=8 K=2 H=4096 bf16", "before: allocating (eager)", 25.0),
]


def test_notebooks_are_built_from_their_sources():
    pytest.importorskip("nbformat", reason="the notebooks extra is not installed")
    from experiments import build_notebooks
    assert build_notebooks.main(["--check"]) == 0, "run python -m experiments.build_notebooks"
    assert NOTEBOOKS == sorted(p.stem for p in (ROOT / "experiments" / "notebooks").glob("0*.py"))


def test_committed_notebooks_have_no_outputs():
    nbformat = pytest.importorskip("nbformat", reason="the notebooks extra is not installed")
    for name in NOTEBOOKS:
        book = nbformat.read(ROOT / "experiments" / f"{name}.ipynb", as_version=4)
        for cell in book.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{name}: outputs not stripped"


def test_every_claim_has_a_notebook():
    for c in nb.all_claims():
        target = c.get("reproduce") or c.get("see")
        assert target and Path(target).stem in NOTEBOOKS, c["id"]


@pytest.mark.parametrize("measured, lo, hi, expected", [
    (1.10, 1.0866, None, "reproduced"),      # at least half the claimed gain
    (1.05, 1.0866, None, "reproduced"),      # 1.05 >= 1.0433
    (1.03, 1.0866, None, "partly"),          # a gain, below half
    (1.01, 1.0866, None, "not"),
    (0.90, 1.59, None, "not"),
    (1.30, 1.59, None, "reproduced"),        # 1.30 >= 1.295
    (1.25, 1.59, None, "partly"),
    (5.0, 1.665, None, "reproduced"),        # far above the claim still holds
    (0.99, 1.00, 1.28, "reproduced"),        # "0-28 %": not slower
    (0.95, 1.00, 1.28, "not"),
    (1.04, 0.9783, 1.0324, "reproduced"),    # a claim of no effect
    (1.08, 0.9783, 1.0324, "partly"),
    (1.60, 0.9783, 1.0324, "not"),
    (float("nan"), 1.2, None, "not measured"),
])
def test_verdict_rule(measured, lo, hi, expected):
    assert nb.judge(measured, lo, hi) == expected


def test_write_csv_stamps_every_row(tmp_path):
    path = timing.write_csv("t", [{"a": 1}, {"b": 2}], root=tmp_path, mode="tiny")
    assert path.parent.name == timing.machine_id() and path.parent.parent == tmp_path
    rows = list(csv.DictReader(open(path)))
    assert len(rows) == 2
    for r in rows:
        for key in ("machine_id", "cpu", "isa", "threads", "torch", "cores", "load", "mode"):
            assert r[key], key
        assert r["mode"] == "tiny"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """All notebooks in tiny mode into a temporary folder, with a fake GPU result present."""
    out = tmp_path_factory.mktemp("nb")
    gpu = out / "results" / "fake-gpu"
    gpu.mkdir(parents=True)
    with open(gpu / "gpu_bench.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["op", "case", "impl", "median_us", "p10_us", "p90_us", "floor_us", "note"])
        for op, case, impl, us in FAKE_GPU:
            w.writerow([op, case, impl, us, us * 0.9, us * 1.1, 1.0, ""])
    (gpu / "gpu_env.csv").write_text("gpu,Fake GPU 9000\ntorch,0\n")
    from experiments import run_notebooks
    status = run_notebooks.main(["--mode", "tiny", "--out", str(out), "--timeout", "600"])
    return out, status


@needs_extra
def test_every_notebook_runs_in_tiny_mode(tiny_run):
    out, status = tiny_run
    report = (timing.results_dir(out / "results") / "REPORT.md").read_text()
    assert status == 0, report[report.find("## Runs"):]
    for name in NOTEBOOKS:
        assert (out / "executed" / f"{name}.ipynb").exists(), name


@needs_extra
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_writes_figures_and_verdicts(tiny_run, name):
    out, _ = tiny_run
    figs = list((timing.results_dir(out / "results") / "figures").glob(f"{name[:3]}_*.png"))
    assert figs, f"{name} saved no figure"
    assert all(p.stat().st_size > 10_000 for p in figs), "a figure is nearly empty"
    path = timing.results_dir(out / "results") / f"{name}_verdicts.csv"
    rows = list(csv.DictReader(open(path)))
    assert rows, f"{name} wrote no verdict row"
    ids = {r["claim_id"] for r in rows}
    assert {c["id"] for c in nb.claims(name)} <= ids
    for r in rows:
        assert r["verdict"] and r["measured"] and r["mode"] == "tiny" and r["machine_id"] == timing.machine_id()
    assert (timing.results_dir(out / "results") / f"{name}.csv").exists(), f"{name} wrote no results table"


@needs_extra
def test_report_covers_every_claim(tiny_run):
    out, _ = tiny_run
    report = (timing.results_dir(out / "results") / "REPORT.md").read_text()
    for c in nb.all_claims():
        line = next((ln for ln in report.splitlines() if ln.startswith(f"| `{c['id']}` |")), None)
        assert line is not None, c["id"]
        assert "MISSING" not in line, line
    assert "## End-to-end MoE layer" in report
    assert "fake-gpu" in report
    for name in NOTEBOOKS:
        assert f"figures/{name[:3]}_" in report


@needs_extra
def test_report_index_lists_each_machine(tiny_run, tmp_path):
    """The run's machine report is linked from <out>/REPORT.md; another machine's report (a
    folder of its own) stays and is listed too, so runs on two CPUs never replace each other."""
    out, _ = tiny_run
    index = (out / "REPORT.md").read_text()
    mid = timing.machine_id()
    assert f"[{mid}](results/{mid}/REPORT.md)" in index and "tiny" in index
    other = tmp_path / "results" / "other-cpu-avx2"
    other.mkdir(parents=True)
    (other / "REPORT.md").write_text("# x\n\nGenerated by `make experiments` (`python -m experiments.run_notebooks "
                                     "--mode quick`) on 2026-01-02.\n\nSummary: 3 reproduced (of 3 claims).\n")
    from experiments import run_notebooks
    text = run_notebooks.write_index(tmp_path).read_text()
    assert "| [other-cpu-avx2](results/other-cpu-avx2/REPORT.md) | 2026-01-02 | quick | 3 reproduced (of 3 claims). |" in text


@needs_extra
def test_gpu_results_appear_beside_cpu(tiny_run):
    out, _ = tiny_run
    rows = {r["claim_id"]: r for name in NOTEBOOKS
            for r in csv.DictReader(open(timing.results_dir(out / "results") / f"{name}_verdicts.csv"))}
    assert "Fake GPU 9000" in rows["001-kernel-count"]["gpu"]
    assert "1.67x" in rows["004-896-16-512"]["gpu"]            # warp 0 alone 20 / lanes 12 (not the eager 36)
    assert "2.00x" in rows["002-gate-gemm-100-steps"]["gpu"]   # 8 / 4
    assert "1.250x" in rows["003-batch-1"]["gpu"]              # 25 / 20
    assert (timing.results_dir(out / "results") / "figures" / "001_router_gemm_gpu.png").exists()


@needs_extra
def test_gpu_seed_claims_are_judged_on_the_gpu(tiny_run):
    """A claim of a GPU seed with a figure in a GPU results folder gets a row judged on it
    (`<claim>@<folder>`), and REPORT.md takes that verdict, the CPU one beside it as the analogue."""
    out, _ = tiny_run
    res = timing.results_dir(out / "results")
    rows = {r["claim_id"]: r for name in NOTEBOOKS for r in csv.DictReader(open(res / f"{name}_verdicts.csv"))}
    expect = {"001-kernel-count": 2, "002-gate-gemm-100-steps": 2.0, "003-batch-1": 1.25,   # 2 launches; 8/4; 25/20
              "004-896-16-512": 1.6667, "004-other-shapes": 1.6667, "004-typical-heavy": 1.6667}   # 20/12
    for cid, ratio in expect.items():
        r = rows[f"{cid}@fake-gpu"]
        assert float(r["measured_ratio"]) == pytest.approx(ratio, abs=1e-3), cid
        assert r["verdict"] == "reproduced" and "Fake GPU 9000" in r["measured"], (cid, r)
    assert not any(k.startswith("003-batch-8@") for k in rows)      # the GPU bench has no batch 8
    report = (res / "REPORT.md").read_text()
    assert "## Claims judged on a GPU" in report
    line = next(ln for ln in report.splitlines() if ln.startswith("| `004-896-16-512` |"))
    assert "**reproduced** on fake-gpu (CPU analogue: " in line
    assert "| `004-896-16-512` | fake-gpu |" in report
    assert "004-896-16-512@fake-gpu" not in report                  # not among the "other rows"


def test_gpu_verdict_row_judges_by_the_claim():
    r = nb.gpu_verdict_row("004-896-16-512", "gpu-x", "GPU X", "1.00x", 1.0,
                           nb.judge(1.0, nb.claim("004-896-16-512")["ratio"]), "why")
    assert r["claim_id"] == "004-896-16-512@gpu-x" and r["verdict"] == "not" and r["measured"] == "1.00x on GPU X"
    assert nb.gpu_claim_id(r["claim_id"]) == ("004-896-16-512", "gpu-x") and nb.gpu_claim_id("004-896-16-512") is None


def _verdict_rule_for_pairs(rows, where):
    """reproduced / partly / not, or "unstable (a..b)" where whole runs disagree among those
    (run_notebooks.combine_runs), only on a claim whose pair matches the seed's in mechanism;
    "analogue (<ratio>x)" on every other claim row and on every extra row (another pair)."""
    claims = {c["id"]: c for c in nb.all_claims()}
    seeds = {c["seed"] for c in claims.values()}
    for r in rows:
        c = claims.get(r["claim_id"].partition("@")[0])     # <claim>@<GPU folder>: the claim judged on a GPU
        v = r["verdict"]
        if c is None and r["claim_id"][:3] not in seeds:
            continue      # a row of no seed (005's end-to-end layer): no seed's pair to match
        if c is None or c.get("same_mechanism") is False:
            assert v.startswith("analogue (") and v.endswith("x)"), (where, r["claim_id"], v)
        elif v in ("reproduced", "partly", "not") or re.fullmatch(r"unstable \((\?|[-0-9.e]+\.\.[-0-9.e]+)\)", v):
            assert c.get("same_mechanism") is True, (where, r["claim_id"], v)
        else:
            assert v in ("not measurable", "not measured"), (where, r["claim_id"], v)


def test_committed_verdicts_follow_the_pair_rule():
    paths = sorted((ROOT / "experiments" / "results").glob("*/0*_verdicts.csv"))
    assert paths, "no committed verdicts"
    for path in paths:
        _verdict_rule_for_pairs(list(csv.DictReader(open(path))), path.name)


def test_verdict_row_turns_another_pair_into_an_analogue(monkeypatch):
    claim = dict(nb.claim("004-896-16-512"))
    monkeypatch.setattr(nb, "claim", lambda cid: dict(claim, same_mechanism=False))
    assert nb.verdict_row("004-896-16-512", "x", 19.8, "reproduced", "w")["verdict"] == "analogue (19.8x)"
    monkeypatch.setattr(nb, "claim", lambda cid: dict(claim, same_mechanism=True))
    assert nb.verdict_row("004-896-16-512", "x", 1.2, "partly", "w")["verdict"] == "partly"
    assert nb.analogue_row("004-x/eager", "004-896-16-512", "m", 3.14159, "w")["verdict"] == "analogue (3.14x)"


@needs_extra
def test_tiny_run_verdicts_follow_the_pair_rule(tiny_run):
    out, _ = tiny_run
    rows = [r for name in NOTEBOOKS
            for r in csv.DictReader(open(timing.results_dir(out / "results") / f"{name}_verdicts.csv"))]
    _verdict_rule_for_pairs(rows, "tiny run")
    eager = [r for r in rows if r["claim_id"] == "004-896-16-512/eager-chain"]
    assert len(eager) == 1 and eager[0]["verdict"].startswith("analogue (")


def test_peer_results_read_one_canonical_file_per_machine(tmp_path, monkeypatch):
    """nb.peer_results reads each machine's PEER_RUN file only (one run set of one commit): rows
    of other ops and files beside it (older or partial runs) never reach a notebook."""
    pytest.importorskip("pandas")
    cols = ["op", "shape", "threads", "impl", "speedup", "ours_vs"]

    def write(path, rows):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(cols)
            w.writerows(rows)

    res = tmp_path / "experiments" / "results"
    write(res / "m1" / nb.PEER_RUN, [["fe", "A", 2, "moelab", 5.0, ""], ["fe", "A", 2, "peer", 5.0, 1.04],
                                     ["other", "A", 2, "peer", 1.0, 7.0]])
    write(res / "m1" / "bench_peers_fe_points-A.csv", [["fe", "A", 2, "peer", 5.5, 1.15]])
    write(res / "m2" / nb.PEER_RUN, [["fe", "B", 1, "peer", 3.0, 0.9]])
    monkeypatch.setattr(nb, "ROOT", tmp_path)
    t = nb.peer_results("fe")
    got = {(r.machine, r.shape, r.impl): r.vs_ours for r in t.itertuples()}
    assert got == {("m1", "A", "eager (this notebook's baseline)"): 5.0, ("m1", "A", "peer"): 1.04,
                   ("m2", "B", "peer"): 0.9}
    monkeypatch.setattr(nb, "ROOT", tmp_path / "nowhere")
    assert nb.peer_results("fe").empty


def test_combine_runs_keeps_agreeing_verdicts_and_marks_straddling_ones_unstable():
    from experiments.run_notebooks import combine_runs

    def row(cid, ratio, verdict):
        return {"claim_id": cid, "measured_ratio": str(ratio), "verdict": verdict, "why": "w", "measured": f"{ratio}x"}

    runs = [[row("a", 1.70, "reproduced"), row("b", 1.04, "partly"), row("c", 2.0, "analogue (2x)")],
            [row("a", 1.66, "reproduced"), row("b", 0.99, "not"), row("c", 3.0, "analogue (3x)")],
            [row("a", 1.69, "reproduced"), row("b", 1.42, "partly"), row("c", 2.5, "analogue (2.5x)")]]
    got = {r["claim_id"]: r for r in combine_runs(runs)}
    assert got["a"]["verdict"] == "reproduced" and got["a"]["runs"] == 3 and got["a"]["measured"] == "1.69x"
    assert got["a"]["run_ratios"] == "1.7 1.66 1.69"
    assert got["b"]["verdict"] == "unstable (0.99..1.42)"
    assert got["b"]["why"].startswith("the 3 runs disagree (partly, not, partly)")
    assert got["c"]["verdict"] == "analogue (2.5x)"
    # one run: the verdict is that run's
    assert combine_runs([[row("a", 0.9, "not")]])[0]["verdict"] == "not"
