"""`python -m experiments.bench [--ops route,permute,...] [--quick] [--repeat N] [--csv PATH]`

Times each optimized op against the eager-PyTorch way a user would write it, side by side in
one run (experiments.timing.compare), and prints one table: median time of each, the
speedup (median of per-round ratios, with its min..max), the achieved GB/s and the fraction
of the row's own memory floor, measured in the same run. Each row says which floor it uses
(`floor_kind`, the column's suffix in the table):
  cache  the bytes fit in the last-level cache, and the repeated calls of a benchmark keep the
         inputs resident: the floor is timing.cache_bandwidth(bytes), the faster of a sum and a
         copy over a working set of that size (at least 1 MiB), measured in the same run;
  dram   the bytes exceed the last-level cache, or the case is `cold` (its inputs rotate through
         copies larger than the cache, timing.Rotating, so every call reads them from memory,
         whatever their size): the floor is the fastest of timing.read_bandwidth(),
         the same probe's fastest pass timed in the row's own interleaved rounds (this machine's
         2-thread bandwidth switches between ~35 and ~60 GB/s within a run, so a floor measured
         only at the start let rows read 139-149% of it), and, for a case that is not cold,
         timing.cache_bandwidth(bytes) (just above the cache size part of the working set still
         stays resident between calls, for the kernel as for the probe). read_bandwidth is
         the streaming-read probe moelab::read_stream over 256 MiB in transparent huge pages (the
         best over its streams per thread and prefetch distances): the most a read-only stream
         gets here. The header also prints the old probe, a torch f32 sum over 4 KiB pages,
         which our fp8 decode kernel outran (115% of it).
A dram row also gets `probe_frac` ("of probe" in the table): its GB/s over the probe's GB/s in
the same round, the median over the rounds. The floor above is the fastest probe pass of the
whole run (the start-of-run probe and every row's own probe passes, set on every dram row once
the table is done, so a row timed before the fast phase showed up does not keep the slow
phase's floor), and a row timed in the slow phase reads a small fraction of it; probe_frac
compares each round with its own phase, and is what a "fraction of the read
bandwidth" target (`bw_target`, the level's: fp8 decode >= 80% at 2 threads at AVX-512, fp8 and
mxfp4 >= 70% at avx2) is judged on. It can
pass 100% by a little where some of a row's bytes are still in the cache from an earlier call.
A DRAM floor on cache-resident inputs is no floor (earlier runs printed 106-316% of it for
skinny_gemm and permute); tests/test_bench_floors.py holds every committed row to <= 100% of its own.

--peers adds the kernels CPU users actually run (vLLM's CPU backend, zentorch; `make peers`,
experiments/peers.py) as columns of the points that have one, timed in the same interleaved
rounds: the peer's time, ours/peer (median of per-round ratios, min..max) and the peer's GB/s
and fraction of the row's floor. A point a peer cannot take says why (an op the peer's build
for this ISA lacks included). --threads 1,2 runs the table once per thread count.

Under MOELAB_ISA=avx2 or avx512 (a proxy for a CPU of that level) the run restarts with torch's
ATen, MKL and oneDNN capped at the same level (timing.cap_libraries), and vLLM loads its library
of that level (_C_AVX2, _C_AVX512): both sides of every ratio run that level's instructions.
zentorch cannot be capped, so a capped run has no zentorch column.

--repeat N runs the whole table N times (each with its own bandwidth measurement) and adds a
summary: per point, the median of the N runs' speedups, their min..max, and in how many runs
the target was met. On a shared machine the memory bandwidth itself moves between runs (we
have seen 43 to 65 GB/s within minutes), and a weight-streaming kernel gains more from it
than a library call at half the floor does, so one run is not a verdict.

--summarize A.csv B.csv ... prints that summary from the CSVs of separate runs (one whole run
per process: `make bench PEERS=1` runs three that way, so no run inherits another's memory
or allocator state), per thread count.

Cases live in experiments/cases_<op>.py; each module defines `cases(quick) -> list[Case]`.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import io
import pkgutil
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import timing


@dataclass
class Case:
    op: str
    shape: str                      # a readable description of the point
    eager: Callable[[], object]     # the way a user would write it in PyTorch
    ours: Callable[[], object]      # optimized
    nbytes: int                     # bytes the op must move at least (its memory floor)
    target: float | None = None     # the speed target (ratio), if any
    # peers (experiments/peers.py), built only with --peers: name -> callable, or why not
    peers: Callable[[], dict] | None = None
    peer_target: float | None = None  # the target for ours/peer, if any
    cold: bool = False              # inputs rotate through copies larger than the cache (dram floor)
    bw_target: float | None = None  # the target for probe_frac (fraction of the read bandwidth)


def discover() -> dict[str, Callable[[bool], list[Case]]]:
    import experiments
    found = {}
    for m in pkgutil.iter_modules(experiments.__path__):
        if m.name.startswith("cases_"):
            mod = importlib.import_module(f"experiments.{m.name}")
            if hasattr(mod, "cases"):   # (cases_parallel.py serves its notebook only)
                found[m.name[len("cases_"):]] = mod.cases
    return found


def floor_of(nbytes: int, cold: bool = False) -> tuple[str, float]:
    """(floor_kind, bytes/s) of a row moving nbytes per call (module docstring)."""
    if cold:
        return "dram", timing.read_bandwidth()
    if nbytes > timing.llc_bytes():
        return "dram", max(timing.read_bandwidth(), timing.cache_bandwidth(nbytes))
    return "cache", timing.cache_bandwidth(nbytes)


def probe_frac(nbytes: int, times: list[float], pbytes: int, ptimes: list[float]) -> float:
    """Median over the rounds of (nbytes / time) / (pbytes / probe time) in the same round."""
    return statistics.median((nbytes / t) / (pbytes / p) for t, p in zip(times, ptimes))


def point_matches(pattern: str, name: str) -> bool:
    """--points: `pattern` occurs in `name`; with a trailing '$', at the end of `name`."""
    return name.endswith(pattern[:-1]) if pattern.endswith("$") else pattern in name


def run(ops: list[str], quick: bool, rounds: int, peers: bool = False, points: list[str] | None = None) -> list[dict]:
    timing._read_bw.clear()                 # measured anew for every run
    timing._probe.clear()
    timing._read_bw_sum.clear()
    timing._cache_bw.clear()
    bw = timing.read_bandwidth()
    fastest = bw                            # the fastest dram probe pass of the run so far
    rows = []
    for op in ops:
        for case in discover()[op](quick):
            if points and not any(point_matches(m, case.shape) for m in points):
                continue
            # The previous case's peer callables hold that shape's peer weight copies: drop them
            # before this case may build another shape's (cases_fused_experts keeps one shape's
            # data at a time; a full --peers run at --threads 1,2 in one process was killed for
            # memory on the 24 GB machine in its second pass while these were still held).
            found = runnable = t = None
            found = case.peers() if peers and case.peers else {}
            runnable = {f"peer:{k}": v for k, v in found.items() if callable(v)}
            kind, fbw = floor_of(case.nbytes, case.cold)
            probe, pbytes = {}, 0
            if kind == "dram":   # the probe in the row's own rounds too: the same bandwidth phase
                fn, pbytes = timing.read_probe()
                probe = {"probe": fn}
            t = timing.compare({"eager": case.eager, "ours": case.ours, **runnable, **probe}, rounds=rounds)
            if probe:
                fastest = max(fastest, pbytes / min(t["probe"].times))
                fbw = max(fbw, fastest)

            def pfrac(name):
                return probe_frac(case.nbytes, t[name].times, pbytes, t["probe"].times) if probe else None
            sp, lo, hi = timing.ratio(t["eager"], t["ours"])
            ours = t["ours"].median
            pcols = []
            for name, v in found.items():
                if not callable(v):
                    pcols.append({"peer": name, "why_not": v})
                    continue
                tp = t[f"peer:{name}"]
                r, rlo, rhi = timing.ratio(tp, t["ours"])
                pcols.append({"peer": name, "us": tp.median * 1e6, "ours_vs": r, "ours_vs_min": rlo,
                              "ours_vs_max": rhi, "GBps": case.nbytes / tp.median / 1e9,
                              "floor_frac": case.nbytes / tp.median / fbw, "probe_frac": pfrac(f"peer:{name}"),
                              "target": case.peer_target})
            rows.append({
                "op": case.op, "shape": case.shape,
                "eager_us": t["eager"].median * 1e6, "ours_us": ours * 1e6,
                "ours_iqr_us": t["ours"].iqr * 1e6,
                "speedup": sp, "speedup_min": lo, "speedup_max": hi,
                "target": case.target, "GBps": case.nbytes / ours / 1e9,
                "floor_kind": kind, "floor_GBps": fbw / 1e9, "floor_frac": case.nbytes / ours / fbw,
                "probe_frac": pfrac("ours"), "bw_target": case.bw_target,
                "read_GBps": bw / 1e9, "threads": torch.get_num_threads(), "peers": pcols,
            })
    for r in rows:   # every dram row against the fastest probe pass of the whole run
        if r["floor_kind"] == "dram" and fastest / 1e9 > r["floor_GBps"]:
            scale = r["floor_GBps"] * 1e9 / fastest
            r["floor_GBps"] = fastest / 1e9
            r["floor_frac"] *= scale
            for pc in r["peers"]:
                if "floor_frac" in pc:
                    pc["floor_frac"] *= scale
    return rows


def print_summary(runs: list[list[dict]], file=None) -> None:
    """Per point over the runs: median speedup, min..max of the runs' speedups, target met."""
    file = file or sys.stdout   # (looked up per call, so a redirected stdout gets it)
    n = len(runs)
    bws = [r[0]["read_GBps"] for r in runs if r]
    print(f"\n# {n} runs; read bandwidth per run: {', '.join(f'{b:.1f}' for b in bws)} GB/s", file=file)
    print(f"# {runs[0][0]['threads'] if runs and runs[0] else '?'} thread(s); ours/peer rows: median of the runs' "
          f"ratios (> 1: ours faster)", file=file)
    hdr = f"{'op':<14}{'point':<34}{'speedup median':>16}{'runs min..max':>16}{'target':>8}{'met':>8}"
    print(hdr, file=file)
    print("-" * len(hdr), file=file)
    for i, r0 in enumerate(runs[0]):
        sp = [run[i]["speedup"] for run in runs]
        tgt = r0["target"]
        met = "" if tgt is None else f"{sum(v >= tgt for v in sp)}/{n}"
        print(f"{r0['op']:<14}{r0['shape']:<34}{statistics.median(sp):>15.2f}x"
              f"{f'{min(sp):.2f}..{max(sp):.2f}':>16}{'' if tgt is None else f'{tgt:g}':>8}{met:>8}", file=file)
        pf = [run[i].get("probe_frac") for run in runs]
        if all(v is not None for v in pf):
            bt = r0.get("bw_target")
            bmet = "" if bt is None else f"{sum(v >= bt for v in pf)}/{n}"
            print(f"{'':<14}  {'of the read probe, same rounds':<32}{statistics.median(pf):>15.0%} "
                  f"{f'{min(pf):.0%}..{max(pf):.0%}':>16}{'' if bt is None else f'{bt:.0%}':>8}{bmet:>8}", file=file)
        for j, pc in enumerate(r0.get("peers", ())):
            if "why_not" in pc:
                continue
            vs = [run[i]["peers"][j]["ours_vs"] for run in runs]
            pt = pc["target"]
            pmet = "" if pt is None else f"{sum(v >= pt for v in vs)}/{n}"
            print(f"{'':<14}  vs {pc['peer']:<28}{statistics.median(vs):>15.2f}x"
                  f"{f'{min(vs):.2f}..{max(vs):.2f}':>16}{'' if pt is None else f'{pt:g}':>8}{pmet:>8}", file=file)


def _of_probe(frac: float | None, target: float | None = None) -> str:
    """The table's "of probe" cell: the fraction, and against a bw_target ok / MISS."""
    if frac is None:
        return ""
    mark = "" if target is None else (" ok " if frac >= target else " MISS ") + f"{target:.0%}"
    return f"{frac:>10.0%}{mark}"


def print_table(rows: list[dict], file=None) -> None:
    file = file or sys.stdout
    m = timing.machine()
    print(f"# {m['cpu']}, ISA {m['isa']}, {m['threads']} threads, torch {m['torch']}; "
          f"read bandwidth {timing.read_bandwidth() / 1e9:.1f} GB/s (moelab::read_stream, 256 MiB in huge pages, "
          f"best of {len(timing.STREAMS) * len(timing.PREFETCH)} stream/prefetch settings; a torch f32 sum over 4 KiB pages: "
          f"{timing.read_bandwidth_torch_sum() / 1e9:.1f} GB/s; same run); floor = the row's own: dram "
          f"(the read bandwidth) or cache (inputs resident, the cache bandwidth at that size, same run); of probe = "
          f"GB/s over the read probe's in the same round (dram rows; median over the rounds)", file=file)
    hdr = (f"{'op':<14}{'point':<34}{'eager us':>10}{'ours us':>10}{'speedup (min..max)':>22}{'target':>8}"
           f"{'GB/s':>8}{'floor GB/s':>12}{'of floor':>10}{'of probe':>10}")
    print(hdr, file=file)
    print("-" * len(hdr), file=file)
    for r in rows:
        tgt = "" if r["target"] is None else (("ok " if r["speedup"] >= r["target"] else "MISS ")
                                               + f"{r['target']:g}")
        spd = f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}..{r['speedup_max']:.2f})"
        print(f"{r['op']:<14}{r['shape']:<34}{r['eager_us']:>10.1f}{r['ours_us']:>10.1f}{spd:>22}"
              f"{tgt:>8}{r['GBps']:>8.1f}{r['floor_GBps']:>7.1f} {r['floor_kind']:<4}{r['floor_frac']:>10.0%}"
              f"{_of_probe(r['probe_frac'], r.get('bw_target'))}", file=file)
        for pc in r.get("peers", ()):
            if "why_not" in pc:
                print(f"{'':<14}  vs {pc['peer']:<28} not run: {pc['why_not']}", file=file)
                continue
            pt = "" if pc["target"] is None else (("ok " if pc["ours_vs"] >= pc["target"] else "MISS ")
                                                   + f"{pc['target']:g}")
            vs = f"{pc['ours_vs']:.2f}x ({pc['ours_vs_min']:.2f}..{pc['ours_vs_max']:.2f})"
            print(f"{'':<14}  vs {pc['peer']:<28}{pc['us']:>10.1f}{vs:>22}{pt:>8}{pc['GBps']:>8.1f}"
                  f"{'':>12}{pc['floor_frac']:>10.0%}{_of_probe(pc.get('probe_frac'))}", file=file)


def flat_rows(rows: list[dict]) -> list[dict]:
    """CSV rows: one per (point, implementation): ours, then each peer, with the ratio ours/peer."""
    out = []
    for r in rows:
        base = {k: v for k, v in r.items() if k != "peers"}
        out.append({**base, "impl": "moelab", "impl_us": r["ours_us"], "ours_vs": "", "ours_vs_min": "",
                    "ours_vs_max": "", "impl_GBps": r["GBps"], "impl_floor_frac": r["floor_frac"],
                    "impl_probe_frac": r.get("probe_frac"), "why_not": "",
                    "peer_target": ""})
        for pc in r.get("peers", ()):
            out.append({**base, "impl": pc["peer"], "impl_us": pc.get("us", ""), "ours_vs": pc.get("ours_vs", ""),
                        "ours_vs_min": pc.get("ours_vs_min", ""), "ours_vs_max": pc.get("ours_vs_max", ""),
                        "impl_GBps": pc.get("GBps", ""), "impl_floor_frac": pc.get("floor_frac", ""),
                        "impl_probe_frac": pc.get("probe_frac"),
                        "why_not": pc.get("why_not", ""), "peer_target": pc.get("target", "") or ""})
    return out


def _num(v: str):
    return None if v in ("", "None") else float(v)


def runs_from_csv(paths: list[str]) -> dict[int, list[list[dict]]]:
    """The nested rows of print_summary, per thread count, from CSVs that flat_rows wrote: one
    run per (file, run index); a peer's row follows its point's moelab row."""
    out: dict[int, list[list[dict]]] = {}
    for path in paths:
        with open(path, newline="") as f:
            flat = list(csv.DictReader(f))
        runs: dict[tuple[int, str], list[dict]] = {}
        for r in flat:
            key = (int(r["threads"]), r.get("run") or "0")
            rows = runs.setdefault(key, [])
            if r["impl"] == "moelab":
                rows.append({"op": r["op"], "shape": r["shape"], "speedup": float(r["speedup"]),
                             "target": _num(r["target"]), "read_GBps": float(r["read_GBps"]),
                             "probe_frac": _num(r.get("probe_frac", "")), "bw_target": _num(r.get("bw_target", "")),
                             "threads": int(r["threads"]), "peers": []})
            elif r["why_not"]:
                rows[-1]["peers"].append({"peer": r["impl"], "why_not": r["why_not"]})
            else:
                rows[-1]["peers"].append({"peer": r["impl"], "ours_vs": float(r["ours_vs"]),
                                          "target": _num(r.get("peer_target", ""))})
        for (threads, _), rows in sorted(runs.items()):
            out.setdefault(threads, []).append(rows)
    # a CSV written before the peer_target column: take the target from another run's row
    known = {(r["op"], r["shape"], pc["peer"]): pc["target"] for runs in out.values() for rows in runs
             for r in rows for pc in r["peers"] if pc.get("target") is not None}
    for runs in out.values():
        for rows in runs:
            for r in rows:
                for pc in r["peers"]:
                    if "why_not" not in pc and pc["target"] is None:
                        pc["target"] = known.get((r["op"], r["shape"], pc["peer"]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer rounds and points")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--threads", default="2", help="torch threads; a comma-separated list runs the table per count")
    p.add_argument("--peers", action="store_true", help="add vLLM CPU and zentorch columns (make peers)")
    p.add_argument("--points", default=None,
                   help="comma-separated substrings: time only the points whose name contains one "
                        "(e.g. 'prefill gpt-oss,T=16'; a trailing '$' anchors at the name's end: "
                        "'bf16 T=1$' is T = 1 alone, not T = 16 or 128); default: all points of the ops")
    p.add_argument("--repeat", type=int, default=1, help="run the table N times and summarize")
    p.add_argument("--csv", default=None, help="also write the rows (of every run) to this CSV file")
    p.add_argument("--save", action="store_true",
                   help="also write the output, with its provenance, to experiments/results/<machine>/"
                        "<name>.txt and .csv, the name fixed by the arguments (save_name): a rerun "
                        "replaces it")
    p.add_argument("--summarize", nargs="+", metavar="CSV", default=None,
                   help="print the summary over the runs in these CSVs (of separate processes), then exit")
    a = p.parse_args(argv)
    if a.summarize:
        out = io.StringIO()
        with contextlib.redirect_stdout(_Tee(sys.stdout, out)):
            for threads, runs in sorted(runs_from_csv(a.summarize).items()):
                print_summary(runs)
        if a.save:
            _save_summary(a, out.getvalue())
        return 0
    try:
        thread_counts = [int(t) for t in a.threads.split(",")]
    except ValueError:
        p.error(f"--threads: comma-separated integers expected, got {a.threads!r}")
    known = discover()
    ops = a.ops.split(",") if a.ops else sorted(known)
    bad = [o for o in ops if o not in known]
    if bad:
        p.error(f"unknown op(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
    points = [m for m in a.points.split(",") if m] if a.points else None
    if points:
        names = [c.shape for o in ops for c in known[o](a.quick)]
        if not any(point_matches(m, n) for m in points for n in names):
            p.error(f"--points {a.points!r} matches no point of {', '.join(ops)}")
    header = timing.provenance("python -m experiments.bench " + shlex.join(argv if argv is not None else sys.argv[1:]))
    out = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, out)):
        all_rows = _run_tables(a, ops, points, thread_counts)
    if a.csv:
        _write_csv(a.csv, flat_rows(all_rows))
    if a.save:
        path = timing.save_result(save_name(a), header, out.getvalue(), flat_rows(all_rows))
        print(f"saved {path}")
    return 0


def _run_tables(a, ops, points, thread_counts) -> list[dict]:
    if a.peers:
        from . import peers
        print(f"# peers: {peers.versions()}")
    all_rows = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        runs = []
        for k in range(max(1, a.repeat)):
            rows = run(ops, a.quick, a.rounds or (3 if a.quick else 7), peers=a.peers, points=points)
            for r in rows:
                r["run"] = k
            if a.repeat > 1:
                print(f"\n## run {k + 1} of {a.repeat}, {threads} thread(s)")
            print_table(rows)
            runs.append(rows)
        if a.repeat > 1:
            print_summary(runs)
        all_rows += [r for rows in runs for r in rows]
    return all_rows


def _write_csv(path, flat: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(flat[0]))
        w.writeheader()
        w.writerows(flat)


# The ops that have peers (experiments/peers.py): `--peers` over all of them is the peer bench.
PEER_OPS = ("fused_experts", "route", "router_gemm")


def save_name(a) -> str:
    """The canonical result name of a bench invocation: `bench`, plus `_peers`, the ops (unless
    all, or with --peers all that have peers), the points and `_quick` when given: the same
    arguments always name the same file (thread counts and repeats are recorded inside it).
    `make bench` writes bench.txt, `make bench PEERS=1` bench_peers.txt."""
    ops = sorted(a.ops.split(",")) if a.ops else []
    if a.peers and tuple(ops) == PEER_OPS:
        ops = []
    parts = ["bench"] + (["peers"] if a.peers else []) + ops
    if a.points:
        slug = "-".join("".join(c if c.isalnum() else " " for c in a.points).split())
        parts.append("points-" + slug[:48].rstrip("-"))
    if a.quick:
        parts.append("quick")
    return "_".join(parts)


def _save_summary(a, text: str) -> None:
    """--summarize --save: the summary over separate processes' runs (make bench PEERS=1, which
    passes the runs' own --peers / --ops / --points, so the name is theirs), then each run's
    table (the .txt beside its CSV); every run's rows in the CSV, with the file they came from."""
    header = timing.provenance("python -m experiments.bench " + shlex.join(sys.argv[1:]))
    rows = []
    for path in a.summarize:
        with open(path, newline="") as f:
            rows += [dict(r, run_file=Path(path).name) for r in csv.DictReader(f)]
    tables = ""
    for path in a.summarize:
        txt = Path(path).with_suffix(".txt")
        if txt.exists():
            tables += f"\n## {txt.name}\n" + txt.read_text()
    print(f"saved {timing.save_result(save_name(a), header, text + tables, rows)}")


class _Tee:
    """Writes to several streams at once (print to the terminal and keep a copy to save)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self):
        for st in self.streams:
            st.flush()


if __name__ == "__main__":
    timing.cap_libraries()   # under MOELAB_ISA=avx2 / avx512 torch's baselines run that level too
    sys.exit(main())
