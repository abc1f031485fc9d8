"""Every kernel-choice policy of `optimized`, in one readable place.

A policy is data: a threshold with the reason for it and the measurement behind it.
`explain(op, *args)` says which kernel a call takes and why; experiments and tests read it.

Batch invariance (SPEC general rules): a path is *invariant* when each output element's
reduction order is fixed independently of T and of the other tokens. Our own CPU kernels
are invariant by construction. A vendor/library GEMM (F.linear through oneDNN/MKL) may
change its blocking with T, so in batch-invariant mode every dispatcher avoids it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

_batch_invariant = False


def set_batch_invariant(enabled: bool) -> None:
    """Make every dispatcher choose batch-invariant kernels (see the module docstring)."""
    global _batch_invariant
    _batch_invariant = bool(enabled)


def batch_invariant() -> bool:
    return _batch_invariant


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True):
    previous = _batch_invariant
    set_batch_invariant(enabled)
    try:
        yield
    finally:
        set_batch_invariant(previous)


@dataclass(frozen=True)
class Decision:
    op: str
    kernel: str
    reason: str

    def __str__(self) -> str:
        return f"{self.op}: {self.kernel} ({self.reason})"


# ---------------------------------------------------------------- router_gemm
# The fused-cast kernel streams the f32 weight once for all tokens; its cost is flat in T
# until the FLOPs dominate. Beyond ROUTER_GEMM_MAX_T a library GEMM over an f32 copy of x
# is faster (measured: experiments/bench.py, router_gemm rows).
ROUTER_GEMM_MAX_T = 32


def router_gemm_decision(x, weight) -> Decision:
    T = x.shape[0]
    if x.device.type != "cpu":
        return Decision("router_gemm", "library", f"no moelab kernel for device {x.device.type}")
    if T <= ROUTER_GEMM_MAX_T:
        return Decision("router_gemm", "moelab", f"T = {T} <= {ROUTER_GEMM_MAX_T}: fused-cast kernel")
    if _batch_invariant:
        return Decision("router_gemm", "moelab", "batch-invariant mode: library GEMM avoided")
    return Decision("router_gemm", "library", f"T = {T} > {ROUTER_GEMM_MAX_T}: F.linear(x.float(), w)")


# ---------------------------------------------------------- permute / unpermute
# One kernel each, no crossover: the counting sort + row copies (and the no-FMA gather back)
# win at every T on the CPU (experiments/cases_permute.py). Other devices have no moelab
# kernel yet and run the reference. Both kernels are exact, hence batch invariant.
_PERMUTE_CPU = Decision("permute", "moelab", "counting sort + parallel row copies (exact)")
_UNPERMUTE_CPU = Decision("unpermute", "moelab", "f32 weighted gather, j ascending, no FMA (exact)")


def permute_decision(hidden, ids, n_experts, **_) -> Decision:
    if hidden.device.type != "cpu":
        return Decision("permute", "reference", f"no moelab kernel for device {hidden.device.type}")
    return _PERMUTE_CPU


def unpermute_decision(expert_out, weights, dst_pos) -> Decision:
    if expert_out.device.type != "cpu":
        return Decision("unpermute", "reference", f"no moelab kernel for device {expert_out.device.type}")
    return _UNPERMUTE_CPU


_EXPLAINERS = {"router_gemm": router_gemm_decision, "permute": permute_decision,
               "unpermute": unpermute_decision}


def explain(op: str, *args, **kwargs) -> Decision:
    """Which kernel `optimized.<op>(*args, **kwargs)` would run, and why."""
    if op not in _EXPLAINERS:
        raise ValueError(f"explain: argument 'op' must be one of {', '.join(sorted(_EXPLAINERS))}; got {op!r}")
    return _EXPLAINERS[op](*args, **kwargs)


# ---------------------------------------------------------------- fused_experts
# Two micro-kernels per expert block of m rows (docs/fused_experts.md): `tiny` decodes the
# weight tile in registers for every chunk of <= 4 rows; `blocked` decodes it once into a
# bf16 buffer and reuses it for all rows. Both give bit-identical results (same bf16 weight
# bits, same reduction order), so every policy is batch invariant and only speed differs.
#
#   tiny / blocked: every block takes that kernel.
#   global:    the old rule of seed 000 (vLLM before PR 50949): one choice for all blocks
#              from avg_m = max(1, T*K // E): blocked iff avg_m > 4 (`M > 4`).
#   per_block: the same crossover applied to each block's own m (PR 50949): blocked iff
#              m > 4. Our two kernels handle every tile width with the same code (the last
#              tile of N may be narrower), so the width never forces a kernel, unlike vLLM's
#              tinygemm/brgemm pair: the per-block choice reduces to m.
#   auto:      per_block with m_cross (blocked iff m >= m_cross) calibrated on this machine by
#              `python -m optimized.tune` (stored outside the repository, see tune_file()).
#              Without a tune file: FUSED_EXPERTS_DEFAULT_M_CROSS, what `optimized.tune
#              --clock cpu` measured on the development machine (AMD EPYC Zen 5, cold
#              weights; tiny/blocked ms at m = 1, 4, 5, 8, 16):
#                fp8   0.25/0.26 0.29/0.28 0.42/0.30 0.47/0.36 0.89/0.50  -> 4-5 (tiny decodes
#                      the tile again for every 4 rows; equal below: memory-bound)
#                mxfp4 0.58/1.22 0.71/1.08 1.06/1.12 1.33/1.47 2.49/2.21  -> 10 (9 instructions
#                      per 64 weights: re-decoding is cheaper than the buffer round trip)
#                bf16  0.51/0.43 0.52/0.45 0.54/0.48 0.57/0.52 0.76/0.71  -> 1 (blocked reads
#                      the packed weights directly; its 6-row kernel wins at every m)
FUSED_EXPERTS_GLOBAL_MAX_TINY_M = 4
FUSED_EXPERTS_DEFAULT_M_CROSS = {"bf16": 1, "fp8_block": 5, "mxfp4": 10}
_FE_POLICY_CODES = {"tiny": 0, "blocked": 1, "per_block": 2}   # FePolicy in csrc/cpu/fused_experts.h
_tuned: dict | None = None
_tuned_from = ""


def _machine_slug() -> str:
    model = "unknown-cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    slug = "".join(c if c.isalnum() else "-" for c in model.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    import os
    return f"{slug[:40]}-{os.cpu_count()}cpu"


def tune_file():
    """Where `python -m optimized.tune` stores this machine's crossovers:
    $MOELAB_CACHE_DIR (default ~/.cache/moelab)/tune-<cpu>.json."""
    import os
    from pathlib import Path
    root = os.environ.get("MOELAB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moelab")
    return Path(root) / f"tune-{_machine_slug()}.json"


def reload_tuning() -> None:
    """Forget the cached tune file (after `python -m optimized.tune` wrote a new one)."""
    global _tuned
    _tuned = None


def fused_experts_m_cross(quant: str) -> tuple[int, str]:
    """(m_cross, where it came from) of policy `auto` for a weight format."""
    global _tuned
    if _tuned is None:
        import torch
        if torch.compiler.is_compiling():   # no file reads while tracing (the file is read at import)
            return FUSED_EXPERTS_DEFAULT_M_CROSS[quant], "default (tune file not read while compiling)"
        import json
        global _tuned_from
        _tuned = {}
        _tuned_from = tune_file().name
        try:
            data = json.loads(tune_file().read_text())
            for q, v in data.get("fused_experts", {}).get("m_cross", {}).items():
                if isinstance(v, int) and 1 <= v <= 1 << 20:
                    _tuned[q] = v
        except (OSError, ValueError, AttributeError):
            _tuned = {}
    if quant in _tuned:
        return _tuned[quant], f"tuned ({_tuned_from})"
    return FUSED_EXPERTS_DEFAULT_M_CROSS[quant], "default (no tune file)"


def fused_experts_plan(T: int, K: int, E: int, quant: str, dispatch: str) -> tuple[int, int, str]:
    """The C++ op's (policy code, m_cross) for a call and a one-line reason. Uses shapes
    only (no data), so the op stays traceable."""
    if dispatch in ("tiny", "blocked"):
        return _FE_POLICY_CODES[dispatch], 0, f"dispatch='{dispatch}': every block"
    if dispatch == "global":
        avg_m = max(1, T * K // E)
        kernel = "blocked" if avg_m > FUSED_EXPERTS_GLOBAL_MAX_TINY_M else "tiny"
        return (_FE_POLICY_CODES[kernel], 0,
                f"global: avg_m = max(1, T*K // E) = {avg_m} "
                f"{'>' if kernel == 'blocked' else '<='} {FUSED_EXPERTS_GLOBAL_MAX_TINY_M}: {kernel} for every block")
    if dispatch == "per_block":
        m = FUSED_EXPERTS_GLOBAL_MAX_TINY_M + 1
        return _FE_POLICY_CODES["per_block"], m, f"per_block: blocked iff m > {m - 1} (the old crossover, per block)"
    m, src = fused_experts_m_cross(quant)
    return _FE_POLICY_CODES["per_block"], m, f"auto: per_block, blocked iff m >= {m} ({src})"


@dataclass(frozen=True)
class FusedExpertsDecision(Decision):
    policy: str = "auto"
    m_cross: int = 0
    blocks: tuple = ()   # (("tiny", n), ("blocked", n)): expert blocks per kernel

    @property
    def counts(self) -> dict:
        return dict(self.blocks)

    def __str__(self) -> str:
        c = self.counts
        return (f"{self.op}: {self.kernel} ({c.get('tiny', 0)} tiny, {c.get('blocked', 0)} blocked "
                f"blocks; {self.reason})")


def fused_experts_decision(x, w13, w2, topk_weights, topk_ids, *, quant, dispatch="auto", **_) -> FusedExpertsDecision:
    """Which kernel each expert block of `optimized.fused_experts(...)` takes, with counts.
    Reads topk_ids (the block sizes); the call itself does not."""
    import torch
    T, K = topk_ids.shape
    E = w13.E if hasattr(w13, "E") else w13.shape[0]
    code, m_cross, reason = fused_experts_plan(T, K, E, quant, dispatch)
    ids = topk_ids.reshape(-1).to(torch.int64)
    sizes = torch.bincount(ids[ids >= 0], minlength=E) if ids.numel() else torch.zeros(E, dtype=torch.int64)
    sizes = sizes[sizes > 0]
    if code == 0:
        n_blocked = 0
    elif code == 1:
        n_blocked = int(sizes.numel())
    else:
        n_blocked = int((sizes >= m_cross).sum())
    n_tiny = int(sizes.numel()) - n_blocked
    kernel = "none" if sizes.numel() == 0 else "tiny" if n_blocked == 0 else "blocked" if n_tiny == 0 else "mixed"
    return FusedExpertsDecision("fused_experts", kernel, reason, policy=dispatch, m_cross=m_cross,
                                blocks=(("tiny", n_tiny), ("blocked", n_blocked)))


_EXPLAINERS["fused_experts"] = fused_experts_decision
