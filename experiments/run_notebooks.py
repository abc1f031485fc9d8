"""`python -m experiments.run_notebooks [--mode tiny|quick|full] [--runs N] [--only 000,003] [--out DIR]`

Runs every experiment notebook (experiments/0*.ipynb) headless with nbclient, in the mode
given (quick by default; `make experiments FULL=1` passes --mode full), saves the executed
copies to <out>/executed/, and writes the machine's report, <out>/results/<machine>/REPORT.md:
every claim of papers/claims.toml with the figure measured here and its verdict (collected
from the <notebook>_verdicts.csv files the notebooks write beside it), the end-to-end layer
table, the figures (figures/ beside it), and how long each notebook took. Each machine (CPU and
ISA level: timing.machine_id) keeps its own report, so a run on another CPU never replaces
one; <out>/REPORT.md is the index of every machine's report. <out> defaults to experiments/.
Exit status 1 if a notebook failed (the others still run, and the report says which failed).

A verdict rests on N whole runs (--runs, 3 by default; 1 in tiny mode): the notebooks run N
times, each run in its own process per notebook, the first N - 1 into a scratch folder, the
last into <out>, so every table and figure comes from one run of one commit. A claim keeps its
verdict only when all N runs agree; where their ratios straddle a threshold it is
"unstable (a..b)" (combine_runs). A verdict one rerun flips is not a finding.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def notebooks(only: list[str] | None = None) -> list[Path]:
    found = sorted(HERE.glob("0*.ipynb"))
    if only:
        found = [p for p in found if any(p.stem.startswith(o) for o in only)]
    return found


def execute(path: Path, mode: str, out: Path, timeout: int) -> dict:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    os.environ["MOELAB_NB_MODE"] = mode
    os.environ["MOELAB_NB_OUT"] = str(out)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}})
    load0 = _load()
    t0 = time.perf_counter()
    status, error = "ok", ""
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()   # no terminal colours in the report
        status, error = "failed", text.splitlines()[-1][:300] if text else type(exc).__name__
    seconds = time.perf_counter() - t0
    dst = out / "executed" / path.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dst)
    return {"notebook": path.stem, "status": status, "seconds": seconds, "error": error,
            "load": max(load0, _load())}


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


# ---------------------------------------------------------------------------- report
def _read_rows(folder: Path, suffix: str) -> dict[str, list[dict]]:
    out = {}
    for p in sorted(folder.glob(f"*{suffix}.csv")):
        with open(p, newline="") as f:
            out[p.name[: -len(suffix) - 4]] = list(csv.DictReader(f))
    return out


def _kind(verdict: str) -> str:
    return "analogue" if verdict.startswith("analogue") else verdict


def combine_runs(runs: list[list[dict]]) -> list[dict]:
    """One verdict row per claim over whole runs (each a list of a notebook's verdict rows, the
    last run last): the last run's row, with `runs` (how many runs measured it), `run_ratios`
    (each run's measured_ratio) and the verdict all runs agree on, or `unstable (min..max)` of
    their ratios when they disagree. Analogue verdicts agree when all runs are analogues; their
    combined ratio is the median of the runs'."""
    by_claim: dict[str, list[dict]] = {}
    for rows in runs:
        for r in rows:
            by_claim.setdefault(r["claim_id"], []).append(r)
    out = []
    for cid, rs in by_claim.items():
        last = dict(rs[-1])
        ratios = [float(r["measured_ratio"]) for r in rs if r.get("measured_ratio") not in ("", None)]
        kinds = {_kind(r["verdict"]) for r in rs}
        last["runs"] = len(rs)
        last["run_ratios"] = " ".join(f"{x:.4g}" for x in ratios)
        if len(kinds) > 1:
            span = f"{min(ratios):.3g}..{max(ratios):.3g}" if ratios else "?"
            last["verdict"] = f"unstable ({span})"
            last["why"] = (f"the {len(rs)} runs disagree ({', '.join(r['verdict'] for r in rs)}); "
                           + last.get("why", ""))
        elif kinds == {"analogue"} and ratios:
            last["verdict"] = f"analogue ({statistics.median(ratios):.3g}x)"
        out.append(last)
    return out


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def report(out: Path, mode: str, runs: list[dict], note: str = "", n_runs: int = 1) -> Path:
    from . import nb, timing
    m = timing.machine()
    res = timing.results_dir(out / "results")
    verdicts = _read_rows(res, "_verdicts")
    by_id = {r["claim_id"]: r for rows in verdicts.values() for r in rows}
    on_gpu: dict[str, list[tuple[str, dict]]] = {}   # claim -> (GPU folder, its row judged there)
    for rid in sorted(by_id):
        if (key := nb.gpu_claim_id(rid)) is not None:
            on_gpu.setdefault(key[0], []).append((key[1], by_id[rid]))
    claims = nb.all_claims()
    for r in runs:
        r["threads"] = ",".join(sorted({v.get("threads", "?") for v in verdicts.get(r["notebook"], [])})) or "?"
    threads_used = ", ".join(sorted({r["threads"] for r in runs if r["threads"] != "?"}))
    loaded = any(r["load"] > 1.25 * (os.cpu_count() or 1) for r in runs)
    lines = [
        "# Experiments: the seeds' claims measured on this machine",
        "",
        f"Generated by `make experiments` (`python -m experiments.run_notebooks --mode {mode}`) on "
        f"{datetime.date.today().isoformat()}. Machine `{timing.machine_id()}`: {m['cpu']}, {m['cores']} cores, "
        f"ISA level {m['isa']}, torch {m['torch']}" + (f", GPU {m['gpu']}" if "gpu" in m else ", no GPU")
        + f"; torch threads used: {threads_used or '?'} (per notebook in the Runs table).",
        "",
    ]
    if note or os.environ.get("MOELAB_NB_THREADS"):
        lines += [f"Threads: {note or 'MOELAB_NB_THREADS=' + os.environ['MOELAB_NB_THREADS'] + ' was set for this run'}"
                  f". With 2 threads on a shared 2-core machine every parallel region waits a scheduler slice "
                  f"(4-8 ms) for a descheduled thread, which makes multi-thread timings meaningless; one thread "
                  f"is slower in absolute terms but its ratios are sound.", ""]
    if loaded:
        lines += [f"**Measured under load**: the machine was shared while these numbers were taken (1-minute "
                  f"load average up to {max(r['load'] for r in runs):.1f} on {os.cpu_count()} cores). Ratios are "
                  f"measured side by side in interleaved rounds, which cancels most of the disturbance, but "
                  f"absolute times and spreads are inflated; rerun `make experiments` on a quiet machine for "
                  f"clean numbers.", ""]
    lines += [
        "Every figure below is a speed ratio (> 1 = the claimed change is faster) measured side by side "
        "in one run on this machine (median of per-round ratios, min..max over rounds in brackets) "
        "unless the row says otherwise. The seeds measured GPUs (001-004) or a different CPU and "
        "whole serving runs (000); our measurements are the kernel-level CPU analogues named in "
        "papers/claims.toml (`counterpart`), so a verdict says whether the *mechanism* gives the "
        "claimed kind of gain here, not whether the seed's number is right. Where a GPU results folder "
        "holds the figure of a GPU seed's claim, the claim is judged on it (its verdict cell names the "
        "folder, and the table \"Claims judged on a GPU\" has the row), and the CPU figure stays beside it "
        "as the CPU analogue.",
        "",
        "Verdict rule: " + " ".join(nb.__doc__.split("Verdict rule (`judge`), the same for every claim that is a "
                                               "speed ratio (> 1 = better):")[1].split()),
        "",
        f"Each verdict rests on {n_runs} whole run(s) of every notebook (the `runs` column: how many, and "
        f"each run's ratio): a claim keeps its verdict only when every run agrees, and is **unstable "
        f"(a..b)** where the runs' ratios straddle a threshold. Tables and figures are the last run's.",
        "",
    ]
    counts: dict[str, int] = {}
    seen: dict[str, str] = {}
    lines += ["## Claims", "",
              "Each row names the seed's pair and ours (papers/claims.toml `seed_pair` / `our_pair`, "
              "before -> after).", "",
              "| claim | reported (source) | seed's pair | our pair | claimed | measured here (last run) | "
              "runs: ratios | verdict | why |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in claims:
        r = by_id.get(c["id"])
        if r is None:
            nbname = (c.get("reproduce") or c.get("see") or "?").split("/")[-1]
            if "not_measurable" in c:
                r = {"claimed_ratio": nb.claimed_ratio_text(c), "measured": "-", "verdict": "not measurable",
                     "why": c["not_measurable"] + f" (and {nbname} did not run)"}
            else:
                r = {"claimed_ratio": nb.claimed_ratio_text(c), "measured": "MISSING", "verdict": "not measured",
                     "why": f"{nbname} did not produce this row (failed or not run)"}
        # A claim judged on several GPU folders counts the first one's verdict (by folder name).
        judged = on_gpu[c["id"]][0][1]["verdict"] if c["id"] in on_gpu else r["verdict"]
        kind = "unstable" if judged.startswith("unstable") else _kind(judged)
        counts[kind] = counts.get(kind, 0) + 1
        seen[c["id"]] = kind
        gpu = f" GPU: {r['gpu']}" if r.get("gpu") else ""
        verdict = f"**{r['verdict']}**"
        if c["id"] in on_gpu:
            verdict = ("; ".join(f"**{g['verdict']}** on {folder}" for folder, g in on_gpu[c["id"]])
                       + f" (CPU analogue: {r['verdict']})")
        lines.append(f"| `{c['id']}` | {_cell(c['reported'])} | {_cell(c.get('seed_pair', '?'))} | "
                     f"{_cell(c.get('our_pair', '?'))} | {_cell(r['claimed_ratio'])} | "
                     f"{_cell(r['measured'])}{_cell(gpu)} | {r.get('runs', 1)}: {_cell(r.get('run_ratios', ''))} | "
                     f"{verdict} | {_cell(r['why'])} |")
    lines += ["", "Summary: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1]))
              + f" (of {len(claims)} claims).", ""]
    lines += ["Which claims held, per seed (counts of verdicts):", "",
              "| seed | reproduced | partly | not | unstable | analogue | not measurable | not measured |",
              "|---|---|---|---|---|---|---|---|"]
    for seed in sorted({c["seed"] for c in claims}):
        vs = [seen[c["id"]] for c in claims if c["seed"] == seed]
        lines.append(f"| {seed} | " + " | ".join(str(vs.count(v)) for v in
                                                 ("reproduced", "partly", "not", "unstable", "analogue",
                                                  "not measurable", "not measured")) + " |")
    lines.append("")
    if on_gpu:
        lines += ["## Claims judged on a GPU", "",
                  "Claims of the seeds that measured GPUs, judged by the same rule on a GPU results folder's "
                  "figures (scripts/gpu_check.sh's bench, `results/<folder>/gpu_bench.csv`); the claims table "
                  "counts these verdicts.", "",
                  "| claim | GPU results folder | claimed | measured on the GPU | verdict | why |",
                  "|---|---|---|---|---|---|"]
        for cid, rows in on_gpu.items():
            for folder, g in rows:
                lines.append(f"| `{cid}` | {folder} | {_cell(g['claimed_ratio'])} | "
                             f"{_cell(g['measured'])} | **{g['verdict']}** | {_cell(g['why'])} |")
        lines.append("")
    extra = [r for nbname, rows in verdicts.items() if nbname != "005_moe_layer"   # 005: its own table below
             for r in rows if r["claim_id"] not in {c["id"] for c in claims} and not nb.gpu_claim_id(r["claim_id"])]
    layer = _read_rows(res, "")
    if "005_moe_layer" in layer:
        lines += ["## End-to-end MoE layer (no seed claim)", "",
                  "`reference.moe_forward` (float64, exact-then-rounded; a correctness oracle, not a "
                  "competitor) vs the same function with `ops` = our kernels (router_gemm, route, "
                  "fused_experts with prepacked weights), and an eager bf16 PyTorch layer (F.linear "
                  "router, softmax + topk, a loop over the routed experts with pre-dequantized bf16 "
                  "weights). Times in ms per layer call; speedups are the eager (or reference) time over ours.",
                  "",
                  "| shape | phase | T | reference ms | eager bf16 ms | ours ms | ours vs eager | ours vs reference | "
                  "max rel. error ours / eager |", "|---|---|---|---|---|---|---|---|---|"]
        for r in layer["005_moe_layer"]:
            lines.append(f"| {r['shape']} | {r['phase']} | {r['T']} | {float(r['reference_ms']):.1f} | "
                         f"{float(r['eager_ms']):.2f} | {float(r['ours_ms']):.2f} | "
                         f"{float(r['speedup_vs_eager']):.2f}x | {float(r['speedup_vs_reference']):.0f}x | "
                         f"{float(r['err_ours']):.2g} / {float(r['err_eager']):.2g} |")
        lines.append("")
    if extra:
        lines += ["Other rows the notebooks reported:", "", "| row | measured | verdict | why |", "|---|---|---|---|"]
        lines += [f"| `{r['claim_id']}` | {_cell(r['measured'])} | {r['verdict']} | {_cell(r['why'])} |" for r in extra]
        lines.append("")
    gpu_dirs = sorted(p.parent.name for p in (out / "results").glob("*/gpu_bench.csv"))
    lines += ["## GPU results", "",
              (f"GPU measurements present (shown beside the CPU ones in the notebooks): {', '.join(gpu_dirs)}."
               if gpu_dirs else "None yet: no `results/*/gpu_bench.csv` (scripts/gpu_check.sh with "
                                "OUT=experiments/results/<name> on a GPU machine writes one; the notebooks then "
                                "show it beside the CPU numbers)."), ""]
    lines += ["## Figures", ""]
    for run in runs:
        figs = sorted((res / "figures").glob(f"{run['notebook'][:3]}_*.png"))
        if figs:
            lines.append(f"### {run['notebook']}")
            lines.append("")
            lines += [f"![{p.stem}](figures/{p.name})" for p in figs]
            lines.append("")
    lines += ["## Runs", "", "| notebook | status | seconds | torch threads | load average (max) | error |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['notebook']} | {r['status']} | {r['seconds']:.0f} | {r['threads']} | {r['load']:.1f} | "
              f"{_cell(r['error'])} |" for r in runs]
    lines += ["", f"Total {sum(r['seconds'] for r in runs) / 60:.1f} min in mode {mode}. Executed notebooks: "
              f"`executed/` under the run's output folder (not committed; `make experiments` writes them). "
              f"Measurement tables: the `*.csv` files beside this report, every row stamped with the machine.", ""]
    path = res / "REPORT.md"
    path.write_text("\n".join(lines))
    write_index(out)
    return path


def write_index(out: Path) -> Path:
    """<out>/REPORT.md: one row per machine that has a report (results/*/REPORT.md), with the
    line that says when and how it was made and its verdict summary, linked to the report."""
    rows = []
    for rep in sorted((out / "results").glob("*/REPORT.md")):
        text = rep.read_text().splitlines()
        made = next((ln for ln in text if ln.startswith("Generated by")), "")
        date = re.search(r"on (\d{4}-\d{2}-\d{2})", made)
        mode = re.search(r"--mode (\w+)", made)
        summary = next((ln[len("Summary: "):] for ln in text if ln.startswith("Summary: ")), "")
        rows.append(f"| [{rep.parent.name}](results/{rep.parent.name}/REPORT.md) | "
                    f"{date.group(1) if date else '?'} | {mode.group(1) if mode else '?'} | {_cell(summary)} |")
    lines = ["# Experiments: the seeds' claims, one report per machine", "",
             "`make experiments` runs every notebook (experiments/0*.ipynb) on this machine and writes its "
             "report into the machine's results folder (`results/<machine>/REPORT.md`, its figures in "
             "`figures/` beside it); a machine is the CPU and its ISA level (`experiments.timing.machine_id`), "
             "so an AVX2 CPU's verdicts never replace an AVX-512 one's. This index is rewritten by every run.", "",
             "| machine | made | mode | verdicts |", "|---|---|---|---|", *rows, ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


def _combine_verdicts(out: Path, earlier: list[Path], names: list[str]) -> None:
    """Rewrite the last run's <notebook>_verdicts.csv of each notebook run (`names`) with
    combine_runs over the earlier runs' files of the same notebook (a notebook that failed in a
    run has fewer runs)."""
    from . import timing
    res = timing.results_dir(out / "results")
    for path in [res / f"{n}_verdicts.csv" for n in names if (res / f"{n}_verdicts.csv").exists()]:
        runs = []
        for folder in earlier + [out]:
            p = timing.results_dir(folder / "results") / path.name
            if p.exists():
                with open(p, newline="") as f:
                    runs.append(list(csv.DictReader(f)))
        rows = combine_runs(runs)
        names = list(dict.fromkeys(k for r in rows for k in r))
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=names, restval="")
            w.writeheader()
            w.writerows(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.run_notebooks", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("tiny", "quick", "full"), default=os.environ.get("MOELAB_NB_MODE", "quick"))
    p.add_argument("--only", default=None, help="comma-separated notebook prefixes (e.g. 000,003)")
    p.add_argument("--out", default=None, help="folder for executed/, figures/, results/, REPORT.md "
                                               "(default: experiments/)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    p.add_argument("--runs", type=int, default=None,
                   help="whole runs each verdict rests on (default 3; 1 in tiny mode)")
    a = p.parse_args(argv)
    out = Path(a.out).resolve() if a.out else HERE
    note = ""
    if not os.environ.get("MOELAB_NB_THREADS") and a.mode != "tiny":
        from . import nb
        if nb.parallel_stalls():   # decide once for the whole run, so every notebook uses the same count
            os.environ["MOELAB_NB_THREADS"] = "1"
            note = ("parallel regions on all threads stalled at the start of this run (another process held a "
                    "core), so every notebook measured on 1 thread")
            print(note, flush=True)
    n_runs = a.runs or (1 if a.mode == "tiny" else 3)
    paths = notebooks(a.only.split(",") if a.only else None)
    earlier: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="moelab-nb-runs-") as scratch:
        for k in range(1, n_runs + 1):
            dst = out if k == n_runs else Path(scratch) / f"run{k}"
            runs = []
            for path in paths:
                print(f"[{time.strftime('%H:%M:%S')}] run {k} of {n_runs}: {path.stem} ({a.mode}) ...", flush=True)
                r = execute(path, a.mode, dst, a.timeout)
                print(f"    {r['status']} in {r['seconds']:.0f} s" + (f": {r['error']}" if r["error"] else ""),
                      flush=True)
                runs.append(r)
            if k < n_runs:
                earlier.append(dst)
        _combine_verdicts(out, earlier, [p.stem for p in paths])
    rep = report(out, a.mode, runs, note, n_runs)
    print(f"wrote {rep}")
    return 0 if all(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    from . import timing
    timing.cap_libraries()   # under MOELAB_ISA=avx2 / avx512 torch's baselines run that level too
    sys.exit(main())
