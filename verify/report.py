"""The summary table (terminal), the Markdown report and the JSON report of a verify run."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import List

from .runner import BIN_LABELS, RunResult


def _fmt_ratio(v) -> str:
    if v is None:
        return "exact"
    if v == float("inf"):
        return "inf"
    return f"{v:.3g}"


def _gap_summary(gaps: List[float]) -> str:
    if not gaps:
        return ""
    return f"max gap {max(gaps):.0f} ulp"


def served_summary(c) -> str:
    """What served a cell's cases (verify/provenance.py): "kernel", "kernel 9, library 3", or
    "NOT VERIFIED (fallback 5/5)" when a fallback served any of them."""
    if c.not_verified:
        return f"NOT VERIFIED (fallback {c.served.get('fallback', 0)}/{c.cases})"
    kinds = [k for k in ("kernel", "library", "empty") if c.served.get(k)]
    if len(kinds) == 1:
        return kinds[0]
    return ", ".join(f"{k} {c.served[k]}" for k in kinds) or "-"


def table_rows(res: RunResult):
    """One row per op x backend x dist (plus a bad-inputs row per op x backend)."""
    bad = {(b.op, b.backend): b for b in res.bad_inputs}
    rows = []
    seen_bad = set()
    shown_nc = set()
    for c in res.cells:
        if c.status == "not_covered":
            if (c.op, c.backend) not in shown_nc:
                shown_nc.add((c.op, c.backend))
                rows.append((c.op, c.backend, "(all)", "-", "-", "NOT COVERED", "-", "-", "-"))
            continue
        worst = _fmt_ratio(c.worst) if c.worst is not None else ("exact" if c.exact_cases else "-")
        if c.failure and c.failure.get("ratio") is None and c.worst is None:
            worst = c.failure["kind"]
        flips = f"{c.flips}" + (f" ({_gap_summary(c.flip_gaps)})" if c.flip_gaps and c.flips else "")
        b = bad.get((c.op, c.backend))
        bad_s = "-"
        if b is not None and (c.op, c.backend) not in seen_bad:
            seen_bad.add((c.op, c.backend))
            bad_s = f"{b.calls - len(b.failures)}/{b.calls} ok"
        rows.append((c.op, c.backend, c.dist, str(c.cases), str(c.failures), worst, flips, bad_s, served_summary(c)))
    for b in res.bad_inputs:   # ops whose cells did not run (--bad-inputs only)
        if (b.op, b.backend) not in seen_bad:
            rows.append((b.op, b.backend, "(bad inputs only)", "-", str(len(b.failures)), "-", "-",
                         f"{b.calls - len(b.failures)}/{b.calls} ok", "-"))
    return rows


HEADER = ("op", "backend", "distribution", "cases", "failures", "worst err/tol", "near-tie flips", "bad inputs",
          "served by")


def summary_table(res: RunResult) -> str:
    rows = [HEADER] + table_rows(res)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(v.ljust(widths[i]) for i, v in enumerate(r)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    total_cases = sum(c.cases for c in res.cells)
    total_bad = sum(b.calls for b in res.bad_inputs)
    lines.append("")
    lines.append(f"{total_cases} cases, {len([f for f in res.failures if f.get('dist') != 'bad-inputs'])} failing cells, "
                 f"{total_bad} bad-input calls ({sum(len(b.failures) for b in res.bad_inputs)} wrong), "
                 f"{sum(c.flips for c in res.cells)} near-tie flips, {sum(c.reroutes for c in res.cells)} moe_forward "
                 f"logit reroutes, {res.meta.get('seconds', 0)} s")
    passing = [c for c in res.cells if c.worst is not None and not c.failures]
    if passing:
        w = max(passing, key=lambda c: c.worst)
        lines.append(f"worst error/tolerance over passing cells: {w.worst:.3g} (pass <= 1; {w.op} {w.dist}"
                     + (f", bounded by the {w.worst_bound})" if w.worst_bound else ")"))
    if res.meta.get("optimized_import_error"):
        lines.append(f"FAILED: `import optimized` raised {res.meta['optimized_import_error'][:500]}")
    if res.not_covered:
        lines.append("NOT COVERED: " + ", ".join(res.not_covered) + "  (optimized lacks them; not counted as passing)")
    lines += _not_verified_lines(res)
    for f in res.failures:
        lines.append(f"FAILED {f['op']} {f['backend']} {f['dist']}: {f['message'][:300]}")
        if f.get("repro"):
            lines.append(f"  repro: {f['repro']}")
    return "\n".join(lines)


def _not_verified_lines(res: RunResult) -> List[str]:
    nv = res.not_verified
    if not nv:
        return []
    allowed = bool(res.meta.get("allow_fallback"))
    head = ("NOT VERIFIED (allowed by --allow-fallback, not counted as passing)" if allowed else
            "NOT VERIFIED (fails the run; --allow-fallback accepts it)")
    out = [f"{head}: {len(nv)} cells were served by a fallback, not by a moelab kernel "
           f"(the reference, or a library GEMM standing in for an unbuilt kernel), so they prove nothing:"]
    for c in nv:
        ex = c.fallback_example or {}
        out.append(f"  {c.op} {c.backend} {c.dist}: {c.served.get('fallback', 0)}/{c.cases} cases; {ex.get('why', '')[:240]}")
    return out


def _histogram(counts: List[int], width: int = 40) -> List[str]:
    m = max(counts) if counts else 0
    out = []
    for label, n in zip(BIN_LABELS, counts):
        bar = "#" * (0 if m == 0 else max(1 if n else 0, round(width * n / m)))
        out.append(f"  {label:>12} | {bar} {n}")
    return out


def markdown(res: RunResult) -> str:
    m = res.meta
    out = ["# verify report", ""]
    out.append(f"- result: **{'PASS' if res.ok else 'FAIL'}**")
    for line in _not_verified_lines(res):
        out.append(f"- **{line.strip()}**" if not line.startswith("  ") else f"  - {line.strip()}")
    out.append(f"- budget {m.get('budget_s')} s, ran {m.get('seconds')} s, seed {m.get('seed')}, "
               f"backends {', '.join(m.get('backends', []))}, torch {m.get('torch')}, threads {m.get('threads')}")
    if m.get("optimized"):
        out.append(f"- optimized: {m['optimized']}")
    if m.get("optimized_import_error"):
        out.append(f"- **optimized failed to import**: {m['optimized_import_error']}")
    if res.not_covered:
        out.append(f"- **NOT COVERED** (optimized lacks them; never counted as passing): {', '.join(res.not_covered)}")
    out += ["", "Error over tolerance (verify/tolerance.py): max over outputs of e(y) / (4 max(n(eager), n_floor) a + f), "
            "with e(y) = max(0, |y - exact| - ulp_out(y)/2) the computation error (the output's own rounding taken "
            "out), a = |x| @ |w|.T the magnitude, n(eager) the normalized error of plain PyTorch in the same "
            "precision, f the one-flip floor (fused_experts: one intermediate bf16 rounding landing on the other side of "
            "its midpoint on the largest term). A case passes at <= 1; an honest kernel sits near 1/4 (as exact as "
            "eager) where the eager term bounds it; each op's worst names the term that bounded it, and where that is "
            "the one-flip floor a ratio near 1 is one such flip, on any ISA level (verify.tolerance.BOUNDS). Route weights: "
            "8 f32 ulps + 4x eager. `exact`: bitwise (ids up to near-tie flips, permute, unpermute).", ""]
    out += ["## Summary", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in table_rows(res):
        out.append("| " + " | ".join(r) + " |")
    # error / tolerance distribution per op
    out += ["", "## Error over tolerance, per op", ""]
    per_op = defaultdict(lambda: [0] * len(BIN_LABELS))
    exact = defaultdict(int)
    worst, bound = {}, {}
    for c in res.cells:
        for i, n in enumerate(c.bins):
            per_op[c.op][i] += n
        exact[c.op] += c.exact_cases
        if c.worst is not None and c.worst >= worst.get(c.op, 0.0):
            worst[c.op], bound[c.op] = c.worst, c.worst_bound
    for op, counts in per_op.items():
        if sum(counts) == 0 and exact[op] == 0:
            continue
        out.append(f"### {op}")
        out.append("")
        if sum(counts):
            out.append(f"worst {worst.get(op, 0):.3g}" + (f" (bounded by the {bound[op]})" if bound.get(op) else "")
                       + f", margin {1 / worst[op] if worst.get(op) else float('inf'):.3g}x"
                       + (f"; {exact[op]} cases compared exactly" if exact[op] else ""))
            out += ["", "```"] + _histogram(counts) + ["```", ""]
        else:
            out.append(f"{exact[op]} cases, all compared exactly (bitwise)")
            out.append("")
    # near-tie flips
    flips = [c for c in res.cells if c.flips]
    out += ["## Near-tie flips", ""]
    if flips:
        out.append("Ids that differ from the reference where the swapped keys are within what an f32 "
                   "implementation may legitimately differ by (route: >= 4 f32 ulps, more for softmax keys far "
                   "below the row max, none for raw-logit keys; moe_forward: tokens that route's near-tie rule "
                   "moved, the gap measured on the optimized logits). Counted, never failures; exact ties never flip.")
        out += ["", "| op | backend | distribution | flips | key gaps (f32 ulps) |", "|---|---|---|---|---|"]
        for c in flips:
            gaps = sorted(c.flip_gaps)
            if gaps:
                med = gaps[len(gaps) // 2]
                top = ", ".join(f"{g:.0f}" for g in gaps[-5:][::-1])
                desc = f"median {med:.0f}, largest {top} (of {len(gaps)} recorded)"
            else:
                desc = "-"
            out.append(f"| {c.op} | {c.backend} | {c.dist} | {c.flips} | {desc} |")
        out += ["", "A gap of 0: equal keys from different inputs (not an exact tie); very large gaps: subnormal "
                "keys that an implementation may flush to zero."]
    else:
        out.append("none")
    rer = [c for c in res.cells if c.reroutes]
    if rer:
        out += ["", "moe_forward tokens rerouted by their logits (the optimized router logits, within "
                "router_gemm's rule, select other experts even under the reference routing; the output was then "
                "judged against the reference MLP with that routing): "
                + ", ".join(f"{c.dist} {c.reroutes}" for c in rer) + "."]
    # batch invariance
    from .registry import REGISTRY
    out += ["", "## Batch invariance", "",
            "A quarter of the cases also check SPEC's batch invariance bit for bit: one token alone, in its batch and "
            "inside two random batches of other tokens (2-96 tokens, across the dispatchers' crossovers), under every "
            "dispatch policy for fused_experts. `mode`: under optimized.batch_invariant_mode(True) only; `always`: "
            "also outside it (invariant by construction). docs/batch_invariance.md says which path is which.", "",
            "| op | backend | cases checked | modes | failures |", "|---|---|---|---|---|"]
    agg_bi = defaultdict(lambda: [0, 0])
    for c in res.cells:
        agg_bi[(c.op, c.backend)][0] += c.bi_checks
        agg_bi[(c.op, c.backend)][1] += int(c.first_failure_kind == "batch_invariance")
    for (op, b), (n, nf) in agg_bi.items():
        e = REGISTRY.get(op)
        if e is None or e.token_gather is None:
            continue
        how = "mode + always" if b in e.invariant_always else "mode"
        out.append(f"| {op} | {b} | {n} | {how} | {nf} |")
    # bad inputs
    out += ["", "## Bad-input fuzz", "", "| op | backend | calls | wrong | RuntimeError without the argument name |",
            "|---|---|---|---|---|"]
    for b in res.bad_inputs:
        out.append(f"| {b.op} | {b.backend} | {b.calls} | {len(b.failures)} | {b.runtime_errors_unnamed} |")
    for b in res.bad_inputs:
        for f in b.failures:
            out.append(f"- {b.op} ({b.backend}) `{f['call']}`: {f['why']}")
    # dispatch paths
    paths = [(c, p, n) for c in res.cells for p, n in c.paths.items()]
    if paths:
        out += ["", "## Kernel paths taken (optimized.dispatch.explain)", ""]
        agg = defaultdict(int)
        for c, p, n in paths:
            agg[(c.op, c.backend, p)] += n
        for (op, b, p), n in sorted(agg.items()):
            out.append(f"- {op} ({b}): {p}: {n} cases")
    # failures
    out += ["", "## Failures", ""]
    if res.failures:
        for f in res.failures:
            out.append(f"- **{f['op']} {f['backend']} {f['dist']}** ({f.get('kind')}): {f['message'][:600]}")
            if f.get("repro"):
                out.append(f"  - repro: `{f['repro']}`")
    else:
        out.append("none")
    if res.mutants:
        out += ["", "## Mutants", "", "| mutant | base | killed | by | cases | seconds |", "|---|---|---|---|---|---|"]
        for mu in res.mutants:
            out.append(f"| {mu['name']} | {mu['base']} | {'yes' if mu['killed'] else '**NO**'} | "
                       f"{mu.get('dist') or '-'} ({mu.get('kind') or '-'}) | {mu['cases']} | {mu.get('seconds')} |")
    return "\n".join(out) + "\n"


def mutant_table(muts: List[dict]) -> str:
    lines = []
    w = max((len(m["name"]) for m in muts), default=10)
    for m in muts:
        status = "killed" if m["killed"] else "SURVIVED"
        how = f"{m.get('dist')}, {m.get('kind')}" if m["killed"] else ""
        lines.append(f"{m['name']:<{w}}  {status:<8}  base={m['base']:<9}  cases={m['cases']:<4}  {how}")
    n = sum(1 for m in muts if m["killed"])
    lines.append(f"{n}/{len(muts)} mutants killed")
    return "\n".join(lines)


def write_reports(res: RunResult, path: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    Path(str(p) + ".md").write_text(markdown(res))
    Path(str(p) + ".json").write_text(json.dumps(res.to_json(), indent=1, default=str) + "\n")
