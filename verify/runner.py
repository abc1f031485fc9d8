"""The runner: hypothesis draws case structures, tensors come from the seed, failures shrink.

For every (op, backend, distribution) cell the runner gives hypothesis a slice of the time
budget. Hypothesis draws a structure (sizes, dtypes, options, seed: a small JSON dict),
`OpInfo.make_case` builds the tensors from it on the CPU, the reference computes the truth,
the optimized function (looked up by name now) runs on the backend's device, and the entry's
comparison decides. A failing structure is shrunk by hypothesis to the smallest failing one
(fewer tokens, smaller sizes, seed 0 ...), printed as a one-line repro command and appended
to the corpus (verify/corpus/failures.jsonl), which the test suite replays.

Hypothesis has no time budget of its own, so the runner calls a `@given` test repeatedly in
small chunks (max_examples per chunk) until the cell's slice is spent; shrinking gets its
own limit, after which unseen candidates are treated as passing and every result is
memoized so hypothesis's final replay of the minimal case is deterministic.

Also here: the bad-input fuzz (malformed calls that must raise a clear error), the
batch-invariance property (a token's outputs, bit for bit, alone, in the batch and inside
random batches of other tokens, under every dispatch variant; see `_batch_invariance`) and
the mutant runs.
"""
from __future__ import annotations

import datetime as _dt
import json
import random
import sys
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

from .provenance import FALLBACK, KernelWatch, classify, device_kernels_loaded
from .registry import (REGISTRY, CaseResult, Ctx, OpInfo, import_optimized, reference_output, to_cpu,
                       to_device)

CORPUS = Path(__file__).resolve().parent / "corpus" / "failures.jsonl"
RATIO_BINS = (2.0 ** -10, 2.0 ** -8, 2.0 ** -6, 2.0 ** -4, 2.0 ** -2, 0.5, 1.0)
BIN_LABELS = ("<2^-10", "2^-10..2^-8", "2^-8..2^-6", "2^-6..2^-4", "2^-4..1/4", "1/4..1/2", "1/2..1", ">1")


def available_backends() -> List[str]:
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


def device_of(backend: str) -> torch.device:
    return torch.device("cuda:0" if backend == "cuda" else "cpu")


def repro_command(structure: dict) -> str:
    js = json.dumps(structure, sort_keys=True, separators=(",", ":"))
    return f"python -m verify --repro '{js}'"


# ============================================================================ one case
def _poison_allocator(device: torch.device, nbytes: int) -> None:
    """Leave NaN bytes where the next allocation of about this size is likely to land, so an
    output element a kernel forgets to write shows up as NaN (effective with the CUDA
    caching allocator and for small CPU blocks)."""
    n = max(256, min(nbytes, 64 << 20) // 4 + 64)
    t = torch.full((n,), float("nan"), device=device)
    del t


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _tensors(obj) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _short_exc(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


# Batch sizes for the random batches: around the dispatchers' crossovers (skinny GEMM up to 8
# tokens, router_gemm up to 32, fused_experts' tiny/blocked by block size) and past them.
_BI_SIZES = ((2, 8), (9, 33), (34, 96))


def _bi_batches(T: int, t: int, rng: random.Random, max_tokens: Optional[int]):
    """(label, rows, position of token t): t alone, the case's own batch, and two random
    batches of random other tokens of the case (repeats allowed) with t at a random place."""
    out = [("alone", [t], 0)]
    if max_tokens is None or T <= max_tokens:
        out.append((f"the batch of {T}", list(range(T)), t))
    for lo, hi in rng.sample(_BI_SIZES, 2):
        hi = min(hi, max_tokens or hi)
        if lo > hi:
            lo = 2
        B = rng.randint(lo, hi)
        rows = [rng.randrange(T) for _ in range(B)]
        p = rng.randrange(B)
        rows[p] = t
        out.append((f"a random batch of {B}", rows, p))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _batch_invariance(entry: OpInfo, fn: Callable, case, device, ops):
    """SPEC's batch invariance, bit for bit: one token's outputs alone, in the case's batch,
    and inside random batches of random other tokens; under every dispatch variant the op
    has (fused_experts: each policy). Checked under optimized.batch_invariant_mode(True) for
    every op, and also outside it on the backends where the op is invariant by construction
    (entry.invariant_always; docs/batch_invariance.md). Returns a failure, True when the
    property held, None when it does not apply (no token axis, T = 0)."""
    mode = getattr(ops, "batch_invariant_mode", None) if ops is not None else None
    T = case.structure.get("T", 0)
    if mode is None or entry.token_gather is None or T < 1:
        return None
    rng = random.Random(f"bi/{case.structure.get('seed', 0)}")
    t = rng.randrange(T)
    batches = _bi_batches(T, t, rng, entry.max_tokens)
    variants = entry.variants(case) if entry.variants is not None else [("", case)]
    backend = case.structure.get("backend", "cpu")
    modes = (True, False) if backend in entry.invariant_always else (True,)
    for on in modes:
        first = None
        with mode(on):
            for k, (vlabel, vcase) in enumerate(variants):
                # the other variants: alone and one random batch (the first covers the rest)
                for blabel, rows, pos in (batches if k == 0 else batches[:1] + batches[-1:]):
                    out = _tensors(to_cpu(entry.run(fn, entry.token_gather(vcase, rows), device)))
                    row = [o[pos:pos + 1] for o in out]
                    where = f"{blabel}" + (f", {vlabel}" if vlabel else "")
                    if first is None:
                        first, first_where = row, where
                        continue
                    for i, (a, b) in enumerate(zip(first, row)):
                        if a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
                            return CaseResult(
                                False, "batch_invariance",
                                message=f"output {i} of token {t} differs between {first_where} and {where} "
                                        f"(batch_invariant_mode({on})): {a.reshape(-1)[:6].tolist()} vs "
                                        f"{b.reshape(-1)[:6].tolist()}")
    return True


def run_case(entry: OpInfo, structure: dict, fn: Optional[Callable] = None, ops=None) -> CaseResult:
    """Build, run and judge one case. fn: the function under test (default: the optimized one).
    The result's `served` says what ran (verify/provenance.py): a moelab kernel, the library
    GEMM the dispatcher chose, nothing (empty outputs) or a fallback (not a verification)."""
    ops = ops if ops is not None else import_optimized()
    device = device_of(structure.get("backend", "cpu"))
    try:
        case = entry.make_case(structure)
        ref = reference_output(entry, case)
    except Exception as e:
        return CaseResult(False, "verify_error", message=f"building the case or the reference failed: {_short_exc(e)}")
    if fn is None:
        fn = entry.optimized(ops)
        if fn is None:
            return CaseResult(False, "not_available", message=f"optimized.{entry.opt_name} does not exist")
    _poison_allocator(device, _nbytes(ref))
    watch = KernelWatch(device.type)
    try:
        with watch:
            out = entry.run(fn, case, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out = to_cpu(out)
    except Exception as e:
        return CaseResult(False, "exception", message=f"the call raised {_short_exc(e)}")
    try:
        res = entry.compare(out, ref, case, Ctx(device, ops))
    except Exception as e:
        return CaseResult(False, "verify_error", message=f"comparison failed on this output: {_short_exc(e)}")
    backend = structure.get("backend", "cpu")
    res.served = classify(watch.kernels, res.path, out, backend, device_kernels_loaded(ops, backend))
    if res.ok and structure.get("bi"):
        try:
            bi = _batch_invariance(entry, fn, case, device, ops)
        except Exception as e:
            bi = CaseResult(False, "exception", message=f"batch-invariance call raised {_short_exc(e)}")
        if isinstance(bi, CaseResult):
            bi.ratio = res.ratio
            return bi
        res.bi_checked = bi is True
    return res


# ============================================================================ one cell
@dataclass
class CellStats:
    op: str
    backend: str
    dist: str
    cases: int = 0
    failures: int = 0
    exact_cases: int = 0
    bins: List[int] = field(default_factory=lambda: [0] * len(BIN_LABELS))
    worst: Optional[float] = None
    worst_structure: Optional[dict] = None
    worst_bound: str = ""              # the tolerance term at the worst case's worst element
    flips: int = 0
    flip_gaps: List[float] = field(default_factory=list)
    bi_checks: int = 0                 # cases whose batch-invariance property was checked
    reroutes: int = 0                  # moe_forward tokens rerouted by a tolerated logit error
    paths: Counter = field(default_factory=Counter)
    served: Counter = field(default_factory=Counter)   # kernel / library / empty / fallback: cases
    fallback_example: Optional[dict] = None            # a case a fallback served (structure, why)
    seconds: float = 0.0
    failure: Optional[dict] = None     # the minimal failing case
    status: str = "ran"                # ran | not_covered
    first_failure_kind: Optional[str] = None

    def add(self, r: CaseResult, structure: dict) -> None:
        self.cases += 1
        if r.ratio is None:
            self.exact_cases += 1
        else:
            v = r.ratio
            i = next((k for k, edge in enumerate(RATIO_BINS) if v <= edge), len(RATIO_BINS))
            if v == 1.0:
                i = len(RATIO_BINS) - 1
            self.bins[i] += 1
            if self.worst is None or v > self.worst:
                self.worst, self.worst_structure, self.worst_bound = v, structure, r.bound
        self.flips += r.flips
        self.bi_checks += int(r.bi_checked)
        self.reroutes += r.reroutes
        self.flip_gaps.extend(r.flip_gaps[: max(0, 200 - len(self.flip_gaps))])
        if r.path:
            self.paths[r.path.split(" (")[0]] += 1
        if r.served is not None:
            self.served[r.served.impl] += 1
            if r.served.impl == FALLBACK and self.fallback_example is None:
                self.fallback_example = {"structure": structure, "why": r.served.detail,
                                         "repro": repro_command(structure)}

    @property
    def not_verified(self) -> bool:
        """Some case of the cell was served by a fallback (verify/provenance.py): whatever it
        passed, the cell says nothing about the kernels."""
        return self.served.get(FALLBACK, 0) > 0

    def to_json(self) -> dict:
        return {"op": self.op, "backend": self.backend, "dist": self.dist, "status": self.status,
                "cases": self.cases, "failures": self.failures, "exact_cases": self.exact_cases,
                "ratio_histogram": dict(zip(BIN_LABELS, self.bins)), "worst_ratio": self.worst,
                "worst_structure": self.worst_structure, "worst_bound": self.worst_bound, "near_tie_flips": self.flips,
                "flip_gaps_ulps": self.flip_gaps, "batch_invariance_checks": self.bi_checks,
                "logit_reroutes": self.reroutes,
                "paths": dict(self.paths), "served": dict(self.served), "verified": not self.not_verified,
                "fallback_example": self.fallback_example, "seconds": round(self.seconds, 2),
                "failure": self.failure}


class _CaseFailed(Exception):
    pass


@contextmanager
def _no_local_constants():
    """Hypothesis mixes into its draws (about one in twenty) the literal constants of every
    module of this project the process has imported (its "local constants", rescanned whenever
    sys.modules grows). The cases of a cell would then depend on what else the process ran: the
    full test suite drew other cases than a single test with the same seed. Within this context
    the local set is empty, so a cell's cases are a function of its seed and arguments alone;
    hypothesis's built-in constants (0, -1, the float edge cases ...) stay. Private API,
    checked by tests/test_verify.py; where a hypothesis release lacks it, every cell reports a
    verify error (it is never skipped silently)."""
    from hypothesis.internal.conjecture import providers as prov
    saved = prov._get_local_constants
    empty = prov.Constants()
    prov._get_local_constants = lambda: empty
    prov.CONSTANTS_CACHE.cache.clear()
    try:
        yield
    finally:
        prov._get_local_constants = saved
        prov.CONSTANTS_CACHE.cache.clear()


def structure_strategy(entry: OpInfo, backend: str, dist: str, fixed: Optional[dict] = None):
    fixed = dict(fixed or {})

    @st.composite
    def strat(draw):
        s = {"op": entry.name, "backend": backend, "dist": dist}
        s.update(entry.draw(draw, dist, fixed))
        return s
    return strat()


def run_cell(entry: OpInfo, backend: str, dist: str, budget_s: float, seed: int = 0, *,
             fn: Optional[Callable] = None, fixed: Optional[dict] = None, shrink: bool = True,
             shrink_budget_s: float = 30.0, chunk: int = 6, min_cases: int = 1, ops=None,
             on_case: Optional[Callable[[CellStats], None]] = None) -> CellStats:
    """Run one (op, backend, dist) cell for about budget_s seconds (at least min_cases
    cases); stop at the first failure, shrink it, and record the minimal case."""
    stats = CellStats(entry.name, backend, dist)
    t0 = time.monotonic()
    t_end = t0 + budget_s
    state = {"hard_end": t_end, "last_fail": None}
    seen: Dict[str, CaseResult] = {}
    rng = random.Random(f"{seed}/{entry.name}/{backend}/{dist}/{sorted((fixed or {}).items())}")
    strategy = structure_strategy(entry, backend, dist, fixed)

    def test(structure):
        key = json.dumps(structure, sort_keys=True)
        r = seen.get(key)
        if r is None:
            if stats.cases >= min_cases and time.monotonic() > state["hard_end"]:
                return                      # out of time: unseen candidates count as passing
            r = run_case(entry, structure, fn, ops)
            seen[key] = r
            stats.add(r, structure)
            if on_case:
                on_case(stats)
        if not r.ok:
            if state["last_fail"] is None:
                state["hard_end"] = time.monotonic() + (shrink_budget_s if shrink else 0.0)
            state["last_fail"] = (structure, r)
            raise _CaseFailed(r.message)

    phases = [Phase.generate] + ([Phase.shrink] if shrink else [])
    cfg = settings(max_examples=chunk, deadline=None, database=None, phases=phases, derandomize=False,
                   suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                   verbosity=Verbosity.quiet, print_blob=False)
    while True:
        if stats.cases >= min_cases and time.monotonic() >= t_end:
            break
        before = stats.cases
        runner = hyp_seed(rng.getrandbits(63))(cfg(given(strategy)(test)))
        try:
            with _no_local_constants():
                runner()
        except _CaseFailed:
            pass
        except Exception as e:      # hypothesis trouble (flaky, unsatisfiable): report, never hide
            if state["last_fail"] is None:
                state["last_fail"] = ({"op": entry.name, "backend": backend, "dist": dist},
                                      CaseResult(False, "verify_error", message=f"hypothesis: {_short_exc(e)}"))
        if state["last_fail"] is not None:
            structure, r = state["last_fail"]
            stats.failures = 1
            stats.first_failure_kind = r.kind
            stats.failure = {"structure": structure, "kind": r.kind, "message": r.message,
                             "ratio": r.ratio, "repro": repro_command(structure)}
            break
        if stats.cases == before and time.monotonic() >= t_end:
            break
    stats.seconds = time.monotonic() - t0
    return stats


# ============================================================================ bad inputs
@dataclass
class BadInputStats:
    op: str
    backend: str
    calls: int = 0
    failures: List[dict] = field(default_factory=list)
    runtime_errors_unnamed: int = 0

    def to_json(self) -> dict:
        return {"op": self.op, "backend": self.backend, "calls": self.calls, "failures": self.failures,
                "runtime_errors_without_argument_name": self.runtime_errors_unnamed}


def _mutate(spec, rng: random.Random):
    """One random malformed variant of spec's valid call: (description, overrides, names)."""
    tensor_names = [n for n, v in spec.params.items() if isinstance(v, torch.Tensor) and n in spec.rules]
    all_tensor_names = tuple(n for n, v in spec.params.items() if isinstance(v, torch.Tensor))
    name = rng.choice(tensor_names)
    t = spec.params[name]
    rule = spec.rules[name]
    kinds = ["rank"]
    if rule.bad_dtypes:
        kinds.append("dtype")
    if not rule.device_ref:
        kinds.append("device")
    if rule.dims:
        kinds.append("shape")
    if rule.contiguous and t.numel() > 1 and t.dim() >= 1:
        kinds.append("contiguity")
    if rule.index and t.numel():
        kinds.append("index")
    kind = rng.choice(kinds)
    desc, overrides, names = _mutate_kind(kind, name, t, rule, rng, all_tensor_names)
    return desc, overrides, names + rule.aliases


def _mutate_kind(kind, name, t, rule, rng, all_tensor_names):
    if kind == "rank":
        new = t.unsqueeze(rng.randrange(t.dim() + 1)) if rng.random() < 0.7 or t.dim() == 0 else t.reshape(-1)
        if new.dim() == t.dim():
            new = t.unsqueeze(0)
        return f"{name}: rank {t.dim()} -> {new.dim()}", {name: new}, (name,)
    if kind == "dtype":
        dt = rng.choice(rule.bad_dtypes)
        return f"{name}: dtype {t.dtype} -> {dt}", {name: t.to(dt)}, (name,)
    if kind == "device":
        return f"{name}: on the meta device", {name: t.to("meta")}, (name,) + all_tensor_names
    if kind == "shape":
        d = rng.choice(rule.dims)
        n = t.shape[d]
        if n > 1 and rng.random() < 0.5:
            new = t.narrow(d, 0, n - 1).contiguous()
        else:
            pad = list(t.shape)
            pad[d] = 1
            new = torch.cat([t, torch.zeros(pad, dtype=t.dtype, device=t.device)], dim=d)
        return f"{name}: dim {d} size {n} -> {new.shape[d]}", {name: new}, (name,) + rule.dim_names
    if kind == "contiguity":
        return f"{name}: not contiguous", {name: torch.stack([t, t], dim=-1)[..., 0]}, (name,)
    lo, hi = rule.index
    new = t.clone()
    flat = new.view(-1)
    flat[rng.randrange(flat.numel())] = hi if rng.random() < 0.6 else lo - 1 - rng.randrange(3)
    return f"{name}: an index out of [{lo}, {hi})", {name: new}, (name,)


def _bad_call_outcome(entry: OpInfo, fn, spec, overrides, names) -> Optional[str]:
    """None when the call failed the right way; otherwise why it is a failure."""
    args, kwargs = spec.build(overrides)
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        msg = str(e)
        if not any(f"'{n}'" in msg or f" {n} " in f" {msg} " for n in names):
            return f"ValueError does not name the argument ({' or '.join(names[:3])}): {msg[:300]}"
        if not any(op in msg for op in entry.error_ops):
            return f"ValueError does not name the op ({entry.name}): {msg[:300]}"
        return None
    except RuntimeError as e:
        if not any(f"'{n}'" in str(e) or f" {n} " in f" {e} " for n in names):
            return "unnamed"
        return None
    except Exception as e:
        return f"raised {type(e).__name__} instead of ValueError/RuntimeError: {str(e)[:300]}"
    return "succeeded silently (no error)"


def bad_input_fuzz(entry: OpInfo, backend: str, seed: int = 0, n_random: int = 40, fn=None,
                   ops=None) -> BadInputStats:
    """The entry's explicit error inputs plus n_random random malformations of a valid call."""
    stats = BadInputStats(entry.name, backend)
    fn = fn or entry.optimized(ops)
    if fn is None:
        return stats
    device = device_of(backend)
    spec = entry.error_spec(seed)
    spec.params = to_device(spec.params, device)
    spec.explicit = [(d, to_device(o, device) if not any(isinstance(v, torch.Tensor) and v.device.type == "meta"
                                                       for v in o.values()) else o, n)
                     for d, o, n in spec.explicit]
    rng = random.Random(f"bad/{seed}/{entry.name}/{backend}")
    calls = list(spec.explicit) + [_mutate(spec, rng) for _ in range(n_random)]
    for desc, overrides, names in calls:
        stats.calls += 1
        why = _bad_call_outcome(entry, fn, spec, overrides, names)
        if why == "unnamed":            # a RuntimeError that names no argument: allowed, counted
            stats.runtime_errors_unnamed += 1
        elif why is not None:
            stats.failures.append({"call": desc, "why": why})
    return stats


# ============================================================================ corpus
def load_corpus(path: Path = CORPUS) -> List[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(json.loads(line))
    return out


def append_corpus(structure: dict, result: dict, path: Path = CORPUS) -> bool:
    """Save a failing case (once per structure). Returns True when it was new."""
    key = json.dumps(structure, sort_keys=True)
    for e in load_corpus(path):
        if json.dumps(e["structure"], sort_keys=True) == key:
            return False
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"structure": structure, "kind": result.get("kind"), "message": (result.get("message") or "")[:500],
             "found": _dt.date.today().isoformat()}
    with path.open("a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
    return True


# ============================================================================ a full run
class Progress:
    """A one-line progress display on stderr (updated in place on a terminal)."""

    def __init__(self, total_s: float, enabled: bool = True, stream=None):
        self.total = max(total_s, 1e-9)
        self.t0 = time.monotonic()
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.last = 0.0

    def update(self, label: str, cases: int, failures: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self.last < (0.2 if self.tty else 15.0):
            return
        self.last = now
        el = now - self.t0
        frac = min(1.0, el / self.total)
        bar = "#" * int(frac * 24) + "-" * (24 - int(frac * 24))
        line = f"verify [{bar}] {el:5.0f}/{self.total:.0f}s  {label:<40.40} cases {cases:6d}  failures {failures}"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class RunResult:
    cells: List[CellStats]
    bad_inputs: List[BadInputStats]
    not_covered: List[str]
    failures: List[dict]
    meta: dict
    mutants: List[dict] = field(default_factory=list)

    @property
    def not_verified(self) -> List[CellStats]:
        """Cells a fallback served (never passing unless the run allowed it: --allow-fallback)."""
        return [c for c in self.cells if c.not_verified]

    @property
    def ok(self) -> bool:
        return not self.failures and not any(b.failures for b in self.bad_inputs) and \
            all(m.get("killed") for m in self.mutants) and not self.meta.get("optimized_import_error") and \
            (not self.not_verified or bool(self.meta.get("allow_fallback")))

    def to_json(self) -> dict:
        return {"meta": self.meta, "ok": self.ok, "not_covered": self.not_covered,
                "not_verified": [f"{c.op} {c.backend} {c.dist}" for c in self.not_verified],
                "cells": [c.to_json() for c in self.cells], "bad_inputs": [b.to_json() for b in self.bad_inputs],
                "failures": self.failures, "mutants": self.mutants}


BAD_INPUT_MODES = ("all", "none", "only")


def run(ops_names: Sequence[str], backends: Sequence[str], dists: Optional[Sequence[str]], budget_s: float,
        seed: int = 0, corpus: Optional[Path] = None, progress: bool = True, bad_random: int = 40,
        shrink_budget_s: Optional[float] = None, ops=None, allow_fallback: bool = False,
        bad_inputs: str = "all") -> RunResult:
    """The main job: every requested op x backend x distribution within budget_s seconds.
    corpus: the JSON-lines file each failing structure is appended to (None: none; the CLI
    passes CORPUS, the committed regression corpus, so a library call or a test writes nothing
    unless it names a file).
    ops: the namespace under test (default: the `optimized` package). A cell served by a
    fallback (verify/provenance.py) is NOT VERIFIED and fails the run unless allow_fallback.
    bad_inputs: "all" (the bad-input fuzz first, then the cells), "none" (cells only) or
    "only" (the bad-input fuzz alone). A crash in the bad-input fuzz kills the process, and
    with it every cell's result: scripts/gpu_check.sh runs the two apart, each op's bad inputs
    in a process of its own, so one crash is reported as that op's and hides nothing else."""
    if bad_inputs not in BAD_INPUT_MODES:
        raise ValueError(f"verify.run: argument 'bad_inputs' must be one of {', '.join(BAD_INPUT_MODES)}, "
                         f"got {bad_inputs!r}")
    ops_mod = ops if ops is not None else import_optimized()
    t_start = time.monotonic()
    meta = {"budget_s": budget_s, "seed": seed, "backends": list(backends), "torch": torch.__version__,
            "started": _dt.datetime.now().isoformat(timespec="seconds"), "threads": torch.get_num_threads(),
            "allow_fallback": bool(allow_fallback), "bad_inputs": bad_inputs,
            "device_kernels_loaded": {b: device_kernels_loaded(ops_mod, b) for b in backends}}
    try:
        meta["optimized"] = ops_mod.backend_info() if ops_mod is not None else None
    except Exception:
        meta["optimized"] = None
    from .registry import optimized_import_error
    meta["optimized_import_error"] = optimized_import_error() if ops is None else None
    entries = [REGISTRY[n] for n in ops_names]
    not_covered = [e.name for e in entries if e.optimized(ops_mod) is None]
    covered = [e for e in entries if e.name not in not_covered]
    cells = []
    for e in covered:
        for b in backends:
            for d in e.dists:
                if (dists is None or d in dists) and bad_inputs != "only":
                    cells.append((e, b, d))
    prog = Progress(budget_s, progress)
    # bad-input fuzz first: cheap, and a crash here is the most serious finding
    bad_stats = []
    for e in covered if bad_inputs != "none" else ():
        for b in backends:
            prog.update(f"{e.name} {b} bad inputs", 0, 0, force=True)
            bad_stats.append(bad_input_fuzz(e, b, seed, bad_random, ops=ops_mod))
    # Each op gets a fixed share of what is left (by weight), spread over its own cells as
    # they run: a slow case overruns only its own op's share, never starves a later op.
    total_weight = sum(e.weight * len(backends) for e in covered if any(c[0] is e for c in cells))
    left0 = max(0.0, budget_s - (time.monotonic() - t_start))
    op_end: Dict[str, float] = {}
    t_cursor = time.monotonic()
    for e in covered:
        n = sum(1 for c in cells if c[0] is e)
        if n:
            t_cursor += left0 * e.weight * len(backends) / max(total_weight, 1e-9)
            op_end[e.name] = t_cursor
    cells_left = Counter(c[0].name for c in cells)
    shrink_s = shrink_budget_s if shrink_budget_s is not None else max(5.0, min(60.0, budget_s / 10))
    results: List[CellStats] = []
    failures: List[dict] = []
    total_cases = [0]
    for e, b, d in cells:
        slice_s = max(0.0, op_end[e.name] - time.monotonic()) / cells_left[e.name]
        cells_left[e.name] -= 1
        label = f"{e.name} {b} {d}"
        base = total_cases[0]

        def on_case(st_, label=label, base=base):
            prog.update(label, base + st_.cases, len(failures))
        stats = run_cell(e, b, d, slice_s, seed, shrink_budget_s=shrink_s, ops=ops_mod, on_case=on_case)
        total_cases[0] += stats.cases
        results.append(stats)
        if stats.not_verified and prog.enabled:
            sys.stderr.write(f"\nNOT VERIFIED {label}: a fallback served {stats.served[FALLBACK]} of {stats.cases} "
                             f"cases ({stats.fallback_example['why'][:300]})\n")
        if stats.failure:
            f = dict(stats.failure, op=e.name, backend=b, dist=d)
            failures.append(f)
            if corpus is not None and stats.failure["kind"] not in ("verify_error",):
                append_corpus(stats.failure["structure"], stats.failure, corpus)
            prog.update(label, total_cases[0], len(failures), force=True)
            if prog.enabled:
                sys.stderr.write(f"\nFAIL {label}: {stats.failure['message'][:400]}\n  repro: {stats.failure['repro']}\n")
    for e in entries:
        if e.name in not_covered:
            for b in backends:
                for d in e.dists:
                    if dists is None or d in dists:
                        results.append(CellStats(e.name, b, d, status="not_covered"))
    for bs in bad_stats:
        for f in bs.failures:
            failures.append({"op": bs.op, "backend": bs.backend, "dist": "bad-inputs", "kind": "bad_input",
                             "message": f"{f['call']}: {f['why']}", "structure": None, "repro": None})
    prog.done()
    meta["seconds"] = round(time.monotonic() - t_start, 1)
    return RunResult(results, bad_stats, not_covered, failures, meta)


# ============================================================================ mutants
def run_mutants(budget_s: float, seed: int = 0, ops_names: Optional[Sequence[str]] = None,
                backend: str = "cpu", progress: bool = True, ops=None) -> List[dict]:
    """Run every mutant against its op with the normal machinery; a mutant is killed when
    the checker reports a failure. Returns one record per mutant."""
    from .mutants import all_mutants
    ops_mod = ops if ops is not None else import_optimized()
    muts = [m for m in all_mutants() if ops_names is None or m.op in ops_names]
    prog = Progress(budget_s, progress)
    t_start = time.monotonic()
    out = []
    for i, m in enumerate(muts):
        entry = REGISTRY[m.op]
        base_fn = entry.optimized(ops_mod)
        base = "optimized"
        if base_fn is None:
            base_fn, base = entry.reference, "reference"
        fn = m.wrap(base_fn)
        left = budget_s - (time.monotonic() - t_start)
        mbudget = max(1.0, left / (len(muts) - i))
        dists = [d for d in (m.dists or entry.dists) if d in entry.dists]
        t0 = time.monotonic()
        rec = {"name": m.name, "op": m.op, "description": m.description, "base": base, "killed": False,
               "cases": 0, "kind": None, "dist": None, "message": ""}
        k = 0
        while time.monotonic() - t0 < mbudget or k < len(dists):
            d = dists[k % len(dists)]
            k += 1
            prog.update(f"mutant {m.name}", rec["cases"], 0)
            per = max(0.3, min(mbudget / max(1, len(dists)), mbudget - (time.monotonic() - t0)))
            stats = run_cell(entry, backend, d, per, seed + k, fn=fn, fixed=m.fixed, shrink=False, ops=ops_mod)
            rec["cases"] += stats.cases
            if stats.failure:
                rec.update(killed=True, kind=stats.failure["kind"], dist=d, message=stats.failure["message"][:300],
                           repro=stats.failure["repro"])
                break
            if k >= 50 * max(1, len(dists)):
                break
        rec["seconds"] = round(time.monotonic() - t0, 2)
        out.append(rec)
    prog.done()
    return out
