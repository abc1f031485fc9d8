"""The peers report: per implementation, op and distribution, the declared-contract verdict and
the measured deviation from SPEC; every declared deviation; what bad inputs do."""
from __future__ import annotations

import json
from pathlib import Path


def _f(v, fmt="{:.3g}"):
    return "-" if v is None else fmt.format(v)


def rows(res: dict):
    out = []
    for c in res["cells"]:
        m = c["measured"]
        if c["status"] != "ran":
            out.append((c["impl"], c["op"], c["dist"], "-", "-", c["status"].upper().replace("_", " "), "-", "-", "-",
                        "-", "-", c["reason"][:120]))
            continue
        ag = "-" if "ids_order_agreement" not in m else f"{m['ids_order_agreement']:.2f} / {m['ids_set_agreement']:.2f}"
        f = c["declared_failure"]
        out.append((c["impl"], c["op"], c["dist"], str(m["cases"]), str(m["not_covered"]),
                    "pass" if c["declared_verdict"] == "pass" else "**FAIL**",
                    f"{m['spec_pass']}/{m['cases']}", _f(m["spec_worst_ratio"]), _f(m["declared_worst_ratio"]), ag,
                    _f(m.get("weight_max_rel_err"), "{:.2g}"),
                    "" if f is None else f"{f['kind']}: {f['message'][:90]}"))
    return out


HEADER = ("impl", "op", "distribution", "cases", "not covered", "declared", "SPEC pass", "SPEC worst err/tol",
          "declared worst", "ids order / set", "weight rel err", "first declared failure")


def summary_table(res: dict) -> str:
    rs = [HEADER] + [tuple(r[:11]) + (r[11][:60] if r[3] != "-" else r[11],) for r in rows(res)]   # reasons whole
    w = [max(len(r[i]) for r in rs) for i in range(len(HEADER))]
    lines = ["  ".join(v.ljust(w[i]) for i, v in enumerate(r)).rstrip() for r in rs]
    lines.insert(1, "  ".join("-" * x for x in w))
    for n, im in res["impls"].items():
        if not im["available"]:
            lines.append(f"NOT RUN {n}: {im['reason']}")
    for n, probes in res.get("bad_inputs", {}).items():
        for p in probes:
            lines.append(f"bad input {n}: {p['probe']}: {p['outcome']} ({p['detail'][:100]})")
    lines.append(f"{sum(c['measured']['cases'] for c in res['cells'])} covered cases, "
                 f"{sum(c['declared_verdict'] == 'fail' for c in res['cells'])} cells failing their declared contract, "
                 f"{res['meta'].get('seconds')} s")
    return "\n".join(lines)


def markdown(res: dict) -> str:
    m = res["meta"]
    out = ["# verify: implementations against SPEC", "",
           f"- budget {m['budget_s']} s, ran {m.get('seconds')} s, seed {m['seed']}, torch {m['torch']}, "
           f"threads {m['threads']}, implementations {', '.join(m['impls'])}",
           "- two verdicts per cell: **declared** (the adapter's declared deviations applied: ids as a set, a "
           "tolerance widened by the declared factor, ...; an undeclared difference fails, with a repro) and "
           "**SPEC** (the registry's own comparison, unchanged: pass fraction and worst error over tolerance, "
           "where <= 1 passes). Route ids: fraction of tokens whose ids equal the reference in slot order / as a "
           "set; weight rel err: max relative error of the weights of tokens with the same set.",
           "- a case the adapter refuses is counted as not covered, never as passed; an op (or a route method, a "
           "weight format) the peer's build lacks or the CPU refuses is an UNAVAILABLE row with the reason.", ""]
    out += ["## Implementations", "", "| impl | run | version | covers |", "|---|---|---|---|"]
    for n, im in res["impls"].items():
        cov = "; ".join(f"{op}: {c['text']}" for op, c in im["covers"].items()) or "-"
        gone = im.get("unavailable") or {}
        if gone:
            cov += "; **unavailable**: " + "; ".join(f"{k}: {v}" for k, v in gone.items())
        out.append(f"| {n} | {'yes' if im['available'] else 'NOT RUN: ' + str(im['reason'])} | {im['version']} | "
                   f"{cov} |")
    out += ["", "## Declared deviations from SPEC", ""]
    for n, im in res["impls"].items():
        if not im["deviations"]:
            out.append(f"- {n}: none")
        for d in im["deviations"]:
            eff = []
            if d["unordered_ids"]:
                eff.append("ids compared as a set")
            if d["tol_factor"] != 1.0:
                eff.append(f"tolerance x {d['tol_factor']:g}")
            if d["nan_rows_unjudged"]:
                eff.append("NaN rows not judged")
            used = sum(c["measured"]["deviations_used"].get(d["name"], 0) for c in res["cells"] if c["impl"] == n)
            out.append(f"- {n} `{d['name']}` ({', '.join(d['ops'])}; {', '.join(eff) or 'documentation only'}; "
                       f"applied to {used} cases): {d['text']}")
    out += ["", "## Findings per cell", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows(res):
        out.append("| " + " | ".join(x.replace("|", "/") for x in r) + " |")
    out += ["", "## Per weight format (fused_experts) and method (route), all distributions", "",
            "| impl | op | format / method | cases | declared pass | SPEC pass | SPEC worst err/tol |",
            "|---|---|---|---|---|---|---|"]
    agg = {}
    for c in res["cells"]:
        for k, v in c["measured"].get("by_kind", {}).items():
            a = agg.setdefault((c["impl"], c["op"], k), [0, 0, 0, None])
            a[0] += v["cases"]
            a[1] += v["declared_pass"]
            a[2] += v["spec_pass"]
            w = v["spec_worst_ratio"]
            if w is not None:
                a[3] = w if a[3] is None else max(a[3], w)
    for (impl, op, k), (n, dp, sp, w) in sorted(agg.items()):
        out.append(f"| {impl} | {op} | {k} | {n} | {dp}/{n} | {sp}/{n} | {_f(w)} |")
    out += ["", "## First declared failure of each cell (shrunk), with its repro", ""]
    for c in res["cells"]:
        f = c.get("declared_failure")
        if f:
            out.append(f"- **{c['impl']} {c['op']} {c['dist']}** ({f['kind']}): {f['message'][:500]}")
            out.append(f"  - repro: `{f['repro']}`")
    out += ["", "## SPEC failures by kind (measured, all covered cases)", ""]
    for c in res["cells"]:
        k = c["measured"].get("spec_fail_kinds")
        if k:
            out.append(f"- {c['impl']} {c['op']} {c['dist']}: " + ", ".join(f"{a} {b}" for a, b in k.items()))
    nc = [(c, c["measured"]["not_covered_reasons"]) for c in res["cells"] if c["measured"]["not_covered_reasons"]]
    if nc:
        out += ["", "## Cases not covered (refused by the adapter)", ""]
        for c, rs in nc:
            out.append(f"- {c['impl']} {c['op']} {c['dist']}: " + "; ".join(f"{k} ({v})" for k, v in rs.items()))
    out += ["", "## Bad inputs (raw peer ops, each in a subprocess: error / silent / crash)", "",
            "| impl | call | outcome | detail |", "|---|---|---|---|"]
    for n, probes in res.get("bad_inputs", {}).items():
        for p in probes:
            out.append(f"| {n} | {p['probe']} | {p['outcome']} | {p['detail'][:160].replace('|', '/')} |")
    return "\n".join(out) + "\n"


def write(res: dict, path: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    Path(str(p) + ".md").write_text(markdown(res))
    Path(str(p) + ".json").write_text(json.dumps(res, indent=1, default=str) + "\n")
