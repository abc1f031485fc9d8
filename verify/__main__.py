"""python -m verify: differential fuzzing of optimized against reference.

    python -m verify [--ops route,permute,...] [--backends cpu,cuda] [--dists uniform,hot_expert,...]
                     [--budget SECONDS] [--seed N] [--report PATH] [--mutants] [--repro JSON]

Exit status: 0 when nothing failed, 1 on any failure (or a surviving mutant), 2 on bad usage.
"""
from __future__ import annotations

import argparse
import json
import sys

from .distributions import ROUTING_DISTS
from .registry import REGISTRY
from .runner import CORPUS, RunResult, available_backends, run, run_case, run_mutants


def _csv(choices, what):
    def parse(s: str):
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {what}: {', '.join(bad) or '(empty)'}; "
                                             f"choose from {', '.join(choices)}")
        return items
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verify", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=_csv(tuple(REGISTRY), "op"), default=None,
                   help=f"comma-separated ops (default: all: {','.join(REGISTRY)})")
    p.add_argument("--backends", type=_csv(("cpu", "cuda"), "backend"), default=None,
                   help="comma-separated backends (default: cpu, plus cuda when available)")
    p.add_argument("--dists", type=_csv(ROUTING_DISTS, "distribution"), default=None,
                   help=f"comma-separated distributions (default: all: {','.join(ROUTING_DISTS)})")
    p.add_argument("--budget", type=float, default=600.0, help="seconds for the whole run (default 600)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the run (default 0)")
    p.add_argument("--report", metavar="PATH", default=None, help="write PATH.md and PATH.json")
    p.add_argument("--mutants", action="store_true", help="run the mutants instead; exit 1 if any survives")
    p.add_argument("--repro", metavar="JSON", default=None, help="run one case structure (as printed on failure)")
    p.add_argument("--no-corpus", action="store_true", help="do not append failures to verify/corpus/failures.jsonl")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.budget <= 0:
        p.error("--budget must be positive")
    backends = a.backends or available_backends()
    missing = [b for b in backends if b not in available_backends()]
    if missing:
        p.error(f"backend(s) not available on this machine: {', '.join(missing)}")

    if a.repro is not None:
        try:
            structure = json.loads(a.repro)
            entry = REGISTRY[structure["op"]]
        except (ValueError, KeyError, TypeError) as e:
            p.error(f"--repro needs the JSON structure of a case (with 'op'): {e}")
        r = run_case(entry, structure)
        print(json.dumps(r.to_json(), indent=1))
        print("PASS" if r.ok else f"FAIL ({r.kind})")
        return 0 if r.ok else 1

    ops = a.ops or list(REGISTRY)
    if a.mutants:
        from .report import mutant_table
        muts = run_mutants(a.budget, a.seed, ops, backend="cpu", progress=not a.quiet)
        print(mutant_table(muts))
        if a.report:
            from .report import write_reports
            write_reports(RunResult([], [], [], [], {"budget_s": a.budget, "seed": a.seed, "mode": "mutants"},
                                    mutants=muts), a.report)
        return 0 if all(m["killed"] for m in muts) else 1

    res = run(ops, backends, a.dists, a.budget, a.seed, corpus=None if a.no_corpus else CORPUS,
              progress=not a.quiet)
    from .report import summary_table, write_reports
    print(summary_table(res))
    if a.report:
        write_reports(res, a.report)
        print(f"reports: {a.report}.md, {a.report}.json")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
