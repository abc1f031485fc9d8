"""What the experiment notebooks share: mode, claims, figures, results, verdicts, GPU results.

The notebooks (sources in experiments/notebooks/*.py, built into experiments/0*.ipynb by
`python -m experiments.build_notebooks`; run by `python -m experiments.run_notebooks`) each
reproduce one seed's claims on this machine. They read from the environment:

    MOELAB_NB_MODE     tiny | quick | full  (default quick; FULL=1 also selects full)
                       tiny: seconds, smallest shapes, 1 round (the test; numbers meaningless)
    MOELAB_NB_OUT      folder for results/ (default: experiments/); a run writes its tables,
                       verdicts and figures into results/<machine>/ (figures/ there)
    MOELAB_NB_THREADS  torch threads (default: torch's default, the physical cores; 1 in tiny)

Verdict rule (`judge`), the same for every claim that is a speed ratio (> 1 = better):
  * a claimed gain (the claimed ratio, or the low end of a claimed range, above 1.035):
    reproduced  if the measured ratio reaches at least half the claimed gain
                (measured >= 1 + (claimed - 1) / 2),
    partly      if it is a gain (> 1.02) but smaller than that,
    not         otherwise (no gain, or a loss);
  * a claimed range that starts at or below 1 ("0-28 %"): reproduced if not slower
    (measured >= 0.98), else not;
  * a claim of no effect (the whole range within 1 +- 0.035): reproduced if within +-5 %,
    partly within +-10 %, not otherwise.
A measured gain far above the claimed one still counts as reproduced; the why column says
what differs (other hardware, other baseline).
Only where the pairs match in mechanism: a claim whose pair (papers/claims.toml `our_pair`)
differs from the seed's (`seed_pair`) in something other than the seed's change
(`same_mechanism = false`), and any extra row on another pair (`analogue_row`), gets
"analogue (<measured ratio>x)" instead (`verdict_row` applies this; a verdict on another pair
says nothing about the seed's).
A claim whose seed measured a GPU (001-004) is also judged, by the same rule, on each GPU
results folder's figure where one exists (`gpu_verdict_row`: row `<claim>@<folder>`); REPORT.md
takes that verdict for the claim and keeps the CPU row beside it, labelled CPU analogue.
"""
from __future__ import annotations

import csv
import math
import os
import statistics
import time
import tomllib
from pathlib import Path

import torch

from . import timing

ROOT = Path(__file__).resolve().parent.parent
MODES = ("tiny", "quick", "full")
VERDICT_FIELDS = ("claim_id", "seed", "claimed", "claimed_ratio", "measured", "measured_ratio",
                  "verdict", "why", "gpu")


def mode() -> str:
    m = os.environ.get("MOELAB_NB_MODE") or ("full" if os.environ.get("FULL") not in (None, "", "0") else "quick")
    if m not in MODES:
        raise ValueError(f"MOELAB_NB_MODE must be one of {', '.join(MODES)}; got {m!r}")
    return m


def pick(tiny, quick, full):
    """The value for the current mode."""
    return {"tiny": tiny, "quick": quick, "full": full}[mode()]


def out_root() -> Path:
    return Path(os.environ.get("MOELAB_NB_OUT") or ROOT / "experiments")


def figures_dir() -> Path:
    """results/<machine>/figures: each machine's figures beside its tables and REPORT.md."""
    return timing.results_dir(results_root()) / "figures"


def results_root() -> Path:
    return out_root() / "results"


# ----------------------------------------------------------------------------- setup
def setup(notebook: str) -> dict:
    """Threads, plotting style, and a printed stamp of where and how this run measures."""
    import seaborn as sns
    threads = os.environ.get("MOELAB_NB_THREADS") or ("1" if mode() == "tiny" else None)
    note = ""
    if threads:   # tiny mode: one thread (fast and steady; its numbers are not used)
        torch.set_num_threads(int(threads))
    elif parallel_stalls():
        note = (f" [parallel regions on {torch.get_num_threads()} threads stall here (another process holds a "
                f"core, so every region waits a scheduler slice): measuring on 1 thread; set MOELAB_NB_THREADS "
                f"to force a count]")
        torch.set_num_threads(1)
    sns.set_theme(style="whitegrid", context="notebook")
    m = timing.machine()
    bw = read_bandwidth()
    stamp = {"notebook": notebook, "mode": mode(), "machine_id": timing.machine_id(), **m,
             "read_GBps": round(bw / 1e9, 1)}
    print(f"{notebook}: mode {mode()}; {m['cpu']}, {m['cores']} cores, ISA {m['isa']}, "
          f"{m['threads']} threads, torch {m['torch']}; read bandwidth {bw / 1e9:.1f} GB/s; "
          f"load average {m['load']}" + (" (the machine is shared: numbers measured under load)"
                                         if under_load() else "") + note)
    stamp["threads_note"] = note.strip(" []")
    return stamp


def read_bandwidth() -> float:
    if mode() == "tiny":   # not used for verdicts in tiny mode; keep it fast
        x = torch.ones(8 << 20)
        t = timing.compare({"sum": lambda: x.sum()}, rounds=1, min_time=0.01)["sum"].median
        return x.numel() * 4 / t
    return timing.read_bandwidth()


def compare_with_probe(impls: dict, rounds: int, min_time: float, bw: float):
    """timing.compare of `impls` with the read probe timed in the same interleaved rounds:
    (their timings, the floor bandwidth: the faster of `bw` and the probe's fastest pass in
    those rounds). This machine's memory bandwidth changes regime within a run, so a floor
    measured once at a notebook's start can sit below a later round's rate; timed beside the
    row, the floor holds in whatever phase the rounds saw (as experiments.bench's rows)."""
    probe, pbytes = timing.read_probe(pick(8 << 20, 256 << 20, 256 << 20))
    t = timing.compare({**impls, "read probe": probe}, rounds=rounds, min_time=min_time)
    p = t.pop("read probe")
    return t, max(bw, pbytes / min(p.times))


def parallel_stalls() -> bool:
    """True if a short parallel op on all threads is > 3x slower than on one thread (median of
    25 calls, any of 3 tries): on a shared machine where another process holds a core, every
    parallel region waits for a descheduled thread (4-8 ms here), which makes multi-thread
    timings meaningless."""
    n = torch.get_num_threads()
    if n < 2:
        return False
    x = torch.ones(1 << 20)

    def med(threads):
        torch.set_num_threads(threads)
        x.mul_(1.0)
        ts = []
        for _ in range(25):
            t = time.perf_counter()
            x.mul_(1.0)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    try:
        return any(med(n) > 3 * med(1) for _ in range(3))
    finally:
        torch.set_num_threads(n)


def under_load() -> bool:
    try:
        return os.getloadavg()[0] > 1.25 * (os.cpu_count() or 1)
    except OSError:
        return False


# ---------------------------------------------------------------------------- claims
def all_claims() -> list[dict]:
    with open(ROOT / "papers" / "claims.toml", "rb") as f:
        return tomllib.load(f)["claim"]


def claims(notebook: str) -> list[dict]:
    """The claims this notebook measures (reproduce) or relates to (see: not measurable)."""
    path = f"experiments/{notebook}.ipynb"
    return [c for c in all_claims() if path in (c.get("reproduce"), c.get("see"))]


def claim(cid: str) -> dict:
    for c in all_claims():
        if c["id"] == cid:
            return c
    raise KeyError(cid)


def claims_frame(notebook: str):
    import pandas as pd
    rows = []
    for c in claims(notebook):
        rows.append({"id": c["id"], "reported": c["reported"], "claimed ratio": claimed_ratio_text(c),
                     "hardware": c["hardware"],
                     "here": c.get("counterpart") or f"not measurable: {c.get('not_measurable')}"})
    return pd.DataFrame(rows)


def claimed_range(c: dict) -> tuple[float, float] | None:
    if "ratio_range" in c:
        return tuple(c["ratio_range"])
    if "ratio" in c:
        return c["ratio"], c["ratio"]
    return None


def claimed_ratio_text(c: dict) -> str:
    r = claimed_range(c)
    if r is None:
        return f"value {c.get('value')}"
    return f"{r[0]:.3g}x" if r[0] == r[1] else f"{r[0]:.3g}..{r[1]:.3g}x"


# --------------------------------------------------------------------------- verdicts
def judge(measured: float, lo: float, hi: float | None = None) -> str:
    """reproduced / partly / not for a measured speed ratio against a claimed one (module doc)."""
    hi = lo if hi is None else hi
    if not (measured == measured):   # NaN
        return "not measured"
    if lo >= 0.965 and hi <= 1.035:
        d = abs(measured - 1)
        return "reproduced" if d <= 0.05 else "partly" if d <= 0.10 else "not"
    if lo <= 1.0 + 1e-9:
        return "reproduced" if measured >= 0.98 else "not"
    if measured >= 1 + (lo - 1) / 2:
        return "reproduced"
    return "partly" if measured > 1.02 else "not"


def analogue_verdict(measured_ratio: float) -> str:
    return f"analogue ({float(measured_ratio):.3g}x)"


def verdict_row(cid: str, measured: str, measured_ratio: float | None, verdict: str, why: str,
                gpu: str = "") -> dict:
    """One claim's row. A reproduced / partly / not verdict on a claim whose pair is not the
    seed's mechanism (same_mechanism false) becomes analogue_verdict(measured_ratio)."""
    c = claim(cid)
    if verdict in ("reproduced", "partly", "not") and c.get("same_mechanism") is not True:
        verdict = analogue_verdict(measured_ratio)
    return {"claim_id": cid, "seed": c["seed"], "claimed": c["reported"],
            "claimed_ratio": claimed_ratio_text(c), "measured": measured,
            "measured_ratio": "" if measured_ratio is None else round(float(measured_ratio), 4),
            "verdict": verdict, "why": why, "gpu": gpu}


def analogue_row(row_id: str, cid: str, measured: str, measured_ratio: float, why: str, gpu: str = "") -> dict:
    """An extra row on another pair than the claim's (e.g. 004's fused kernel vs the eager chain):
    labelled `row_id` (not a claim id, so REPORT.md lists it apart), verdict analogue (ratio)."""
    c = claim(cid)
    return {"claim_id": row_id, "seed": c["seed"], "claimed": c["reported"],
            "claimed_ratio": claimed_ratio_text(c), "measured": measured,
            "measured_ratio": round(float(measured_ratio), 4), "verdict": analogue_verdict(measured_ratio),
            "why": why, "gpu": gpu}


def gpu_verdict_row(cid: str, machine: str, gpu: str, measured: str, measured_ratio: float | None,
                    verdict: str, why: str) -> dict:
    """Claim `cid` judged on the GPU figure of results folder `machine` (GPU model `gpu`): the
    row `<cid>@<machine>`, which REPORT.md lists as the claim's GPU verdict."""
    row = verdict_row(cid, f"{measured} on {gpu}", measured_ratio, verdict, why)
    row["claim_id"] = f"{cid}@{machine}"
    return row


def gpu_claim_id(row_id: str) -> tuple[str, str] | None:
    """(claim id, GPU results folder) of a gpu_verdict_row's id, else None."""
    cid, sep, machine = row_id.partition("@")
    return (cid, machine) if sep else None


def not_measurable_row(cid: str, related: str = "") -> dict:
    c = claim(cid)
    return verdict_row(cid, related or "-", None, "not measurable", c["not_measurable"])


def write_verdicts(notebook: str, rows: list[dict]):
    """results/<machine>/<notebook>_verdicts.csv (collected by the runner into REPORT.md);
    returns the table for display. Every claim of this notebook must have a row."""
    import pandas as pd
    missing = {c["id"] for c in claims(notebook)} - {r["claim_id"] for r in rows}
    assert not missing, f"no verdict row for {sorted(missing)}"
    timing.write_csv(f"{notebook}_verdicts", [{k: r.get(k, "") for k in VERDICT_FIELDS} for r in rows],
                     root=results_root(), mode=mode())
    return pd.DataFrame(rows)[["claim_id", "claimed_ratio", "measured", "verdict", "why"]]


def write_results(name: str, frame) -> Path:
    """One measurement table as results/<machine>/<name>.csv, machine-stamped."""
    return timing.write_csv(name, frame.to_dict("records"), root=results_root(), mode=mode())


def save_figure(fig, name: str) -> Path:
    path = figures_dir() / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def log_ticks(ax, values, axis: str = "x") -> None:
    """A log axis labelled with the measured values as plain numbers (1, 2, 4, ... not 10^0)."""
    import matplotlib.ticker as mt
    getattr(ax, f"set_{axis}scale")("log")
    a = getattr(ax, f"{axis}axis")
    a.set_major_locator(mt.FixedLocator(sorted(set(values))))
    a.set_major_formatter(mt.FixedFormatter([f"{v:g}" for v in sorted(set(values))]))
    a.set_minor_locator(mt.NullLocator())


def geomean(values) -> float:
    v = [float(a) for a in values]
    return math.exp(sum(math.log(a) for a in v) / len(v)) if v else float("nan")


def spread_text(med: float, lo: float, hi: float) -> str:
    return f"{med:.3g}x ({lo:.3g}..{hi:.3g})"


# ------------------------------------------------------------------------ GPU results
def gpu_results(op: str | None = None):
    """Rows of every results/*/gpu_bench.csv (scripts/gpu_check.sh with OUT=experiments/
    results/<name>), with the folder as `machine` and the GPU name from gpu_env.csv.
    Empty frame (and a printed note) when there are none."""
    import pandas as pd
    frames = []
    for path in sorted(results_root().glob("*/gpu_bench.csv")):
        df = pd.read_csv(path)
        df["machine"] = path.parent.name
        env = path.parent / "gpu_env.csv"
        gpu = "?"
        if env.exists():
            with open(env) as f:
                gpu = dict(r for r in csv.reader(f) if len(r) == 2).get("gpu", "?")
        df["gpu"] = gpu
        frames.append(df)
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=["op", "case", "impl", "median_us", "p10_us", "p90_us", "floor_us", "note", "machine", "gpu"])
    if op is not None:
        df = df[df["op"] == op]
    if df.empty:
        print(f"No GPU results for {op or 'any op'}: no {results_root().name}/*/gpu_bench.csv "
              f"(none has been measured yet; on a GPU machine run "
              f"`OUT=experiments/results/<name> bash scripts/gpu_check.sh`). CPU results only.")
    return df


# The committed peer bench the notebooks show: per machine, the canonical output of
# `make bench PEERS=1 PEER_OPS=route,router_gemm,fused_experts` at the quick grid (three whole
# runs per thread count of one commit; experiments/bench.py save_name). One file, so every figure
# of a notebook comes from one run set of one commit.
PEER_RUN = "bench_peers_quick.csv"


def peer_results(op: str):
    """The committed peer bench rows of `op` (experiments/results/*/PEER_RUN, every machine that
    has one), as `peer_table` frames them. The peers (vLLM CPU, zentorch) are optional installs,
    so a notebook shows these committed measurements rather than timing the peers itself. Read
    from the repository's results even when this run writes elsewhere (MOELAB_NB_OUT). Empty
    frame (and a printed note) when there are none."""
    import pandas as pd
    frames = []
    for path in sorted((ROOT / "experiments" / "results").glob(f"*/{PEER_RUN}")):
        df = pd.read_csv(path)
        df = df[df["op"] == op].copy()
        if len(df):
            df["machine"], df["file"] = path.parent.name, path.name
            frames.append(df)
    if not frames:
        print(f"No committed peer runs for {op} (experiments/results/*/{PEER_RUN}; "
              f"`make peers` then `make bench PEERS=1` makes them).")
        return pd.DataFrame(columns=["machine", "file", "threads", "shape", "impl", "vs_ours"])
    df = pd.concat(frames, ignore_index=True)
    print(f"Committed peer runs of {op}: " + ", ".join(sorted({f"{m}/{f}" for m, f in zip(df['machine'], df['file'])})))
    return peer_table(df)


def peer_table(df):
    """One row per (machine, file, threads, point, implementation) with `vs_ours`, that
    implementation's time over ours (> 1: ours faster): each peer's ours_vs, and for the eager
    baseline of the same rounds its speedup, so the peers sit beside the eager way."""
    import pandas as pd
    keep = ["machine", "file", "threads", "shape"]
    peers = df[(df["impl"] != "moelab") & df["ours_vs"].notna()]
    peers = peers.assign(vs_ours=peers["ours_vs"].astype(float))[keep + ["impl", "vs_ours"]]
    eager = df[df["impl"] == "moelab"].assign(impl="eager (this notebook's baseline)")
    eager = eager.assign(vs_ours=eager["speedup"].astype(float))[keep + ["impl", "vs_ours"]]
    return pd.concat([eager, peers], ignore_index=True)


def peer_figure(table, title: str):
    """Horizontal bars of vs_ours per point and implementation (log scale: the eager way is several
    times slower, the peers near parity), one panel per thread count; the bar is the median over
    the committed runs, the line their min..max, the dashed line parity. Points without a peer
    (the standard-layout rows) are left out."""
    import seaborn as sns
    with_peer = set(table.loc[~table["impl"].str.startswith("eager"), "shape"])
    t = table[table["shape"].isin(with_peer)]
    g = sns.catplot(t, y="shape", x="vs_ours", hue="impl", col="threads", kind="bar", estimator="median",
                    errorbar=("pi", 100), orient="h", height=0.45 * max(4, len(with_peer)) + 1.5, aspect=1.1)
    for ax in g.axes.flat:
        ax.set_xscale("log")
        ax.axvline(1.0, color="k", ls="--", lw=1)
    g.set_axis_labels("their time / ours (log; > 1: ours faster)", "")
    g.figure.suptitle(title, y=1.02)
    return g.figure


def show_peers(op: str, title: str, name: str):
    """The notebooks' "Against the peers" cell: `op`'s committed peer runs (peer_results) as a
    table (median vs_ours per thread count and point) and as peer_figure, saved as
    `<name>_peers`; nothing but peer_results' note when there are none. Returns the frame."""
    import matplotlib.pyplot as plt
    from IPython.display import display
    peers = peer_results(op)
    if len(peers):
        display(peers.pivot_table(index=["threads", "shape"], columns="impl", values="vs_ours",
                                  aggfunc="median").round(2))
        save_figure(peer_figure(peers, title), f"{name}_peers")
        plt.show()
    return peers


def gpu_speedups(op: str, ours: str, before: str):
    """Per GPU machine and case: median us of the impl starting with `ours` and of the one
    starting with `before`, and before/ours."""
    import pandas as pd
    df = gpu_results(op)
    rows = []
    for (machine, gpu, case), g in df.groupby(["machine", "gpu", "case"], sort=False):
        a = g[g["impl"].str.startswith(ours)]
        b = g[g["impl"].str.startswith(before)]
        if len(a) and len(b):
            o, p = float(a["median_us"].iloc[0]), float(b["median_us"].iloc[0])
            rows.append({"machine": machine, "gpu": gpu, "case": case, "ours_us": o, "before_us": p,
                         "speedup": p / o})
    return pd.DataFrame(rows, columns=["machine", "gpu", "case", "ours_us", "before_us", "speedup"])
