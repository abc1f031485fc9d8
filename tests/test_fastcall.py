"""optimized.fastcall: the ops bound with their C++ types (csrc/python/fastcall.cpp).

The fast bindings must be torch.ops under another calling convention: the same bits, the same
errors, and the wrappers may take them only where torch.ops would behave the same (eager mode,
plain tensors). torch.compile(fullgraph=True) of each wrapper is in the op's own test file
(it fails if a wrapper hands Dynamo the pybind11 call).
"""
from __future__ import annotations

import sys

import pytest
import torch

import optimized
from optimized import PermuteScratch, fastcall

BOUND = ("route", "router_gemm", "skinny_gemm", "permute", "permute_out", "unpermute")


def _module(name):
    """The wrapper's module (optimized.route etc. name the functions, which shadow them)."""
    return sys.modules[f"optimized.{name}"]


def _scratch(d):
    return PermuteScratch(d["T"], d["K"], d["E"], d["H"], torch.bfloat16, "cpu")


def _inputs():
    g = torch.Generator().manual_seed(5)
    T, E, K, H, N = 5, 64, 4, 256, 96
    logits = torch.randn(T, E, generator=g).bfloat16()
    bias = torch.randn(E, generator=g)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    return dict(T=T, E=E, K=K, H=H, logits=logits, bias=bias, x=x, ids=ids,
                rw=torch.randn(E, H, generator=g), sw=torch.randn(N, H, generator=g).bfloat16(),
                tw=torch.rand(T, K, generator=g))


def test_every_binding_is_the_op():
    """Each fast binding returns torch.ops' bits for the same arguments."""
    d = _inputs()
    ops = torch.ops.moelab
    assert sorted(n for n in dir(fastcall.ops) if not n.startswith("_")) == sorted(BOUND)
    for args in [(d["logits"], d["K"], "sigmoid_bias", d["bias"], 2.0, None, 1, 1, None),
                 (d["logits"], d["K"], "grouped_sigmoid_bias", d["bias"], 1.0, True, 8, 2, 1e-6),
                 (d["logits"], d["K"], "softmax_topk", None, 1.0, False, 1, 1, None)]:
        for a, b in zip(fastcall.ops.route(*args), ops.route.default(*args)):
            assert torch.equal(a, b)
    assert torch.equal(fastcall.ops.router_gemm(d["x"], d["rw"]), ops.router_gemm.default(d["x"], d["rw"]))
    assert torch.equal(fastcall.ops.skinny_gemm(d["x"], d["sw"], None), ops.skinny_gemm.default(d["x"], d["sw"], None))
    pargs = (d["x"], d["ids"], d["E"], None, d["E"], 1)
    fast_p, op_p = fastcall.ops.permute(*pargs), ops.permute.default(*pargs)
    for a, b in zip(fast_p, op_p):
        assert torch.equal(a, b)
    y = torch.randn(op_p[1].shape[0], d["H"]).bfloat16()
    assert torch.equal(fastcall.ops.unpermute(y, d["tw"], op_p[3]), ops.unpermute.default(y, d["tw"], op_p[3]))
    out, buffers = _scratch(d).views(d["T"])
    fastcall.ops.permute_out(*pargs, *buffers)
    for a, b in zip(out, op_p):
        assert torch.equal(a, b)


def test_errors_are_the_ops():
    """A refused call raises torch.ops' RuntimeError, word for word (the kernels' checks)."""
    d = _inputs()
    cases = [("route", (d["logits"], 0, "sigmoid_bias", d["bias"], 1.0, None, 1, 1, None)),
             ("route", (d["logits"], d["K"], "no_such_method", None, 1.0, None, 1, 1, None)),
             ("router_gemm", (d["x"], d["rw"][:, :8])),
             ("unpermute", (d["x"], d["tw"], torch.zeros(3, dtype=torch.int32)))]
    for name, args in cases:
        with pytest.raises(RuntimeError) as fast_err:
            getattr(fastcall.ops, name)(*args)
        with pytest.raises(RuntimeError) as op_err:
            getattr(torch.ops.moelab, name).default(*args)
        assert str(fast_err.value) == str(op_err.value) and f"moelab::{name}" in str(op_err.value)


class _Recorder:
    """Stands in for fastcall.ops in a wrapper's module: records which binding was called."""

    def __init__(self):
        self.called = []

    def __getattr__(self, name):
        def call(*args):
            self.called.append(name)
            return getattr(fastcall.ops, name)(*args)
        return call


@pytest.mark.parametrize("module, call, name", [
    ("route", lambda d: optimized.route(d["logits"], d["K"], "sigmoid_bias", bias=d["bias"]), "route"),
    ("router_gemm", lambda d: optimized.router_gemm(d["x"], d["rw"]), "router_gemm"),
    ("gate_gemm", lambda d: optimized.skinny_gemm(d["x"], d["sw"]), "skinny_gemm"),
    ("permute", lambda d: optimized.permute(d["x"], d["ids"], d["E"]), "permute"),
    ("permute", lambda d: optimized.permute(d["x"], d["ids"], d["E"], scratch=_scratch(d)), "permute_out"),
    ("permute", lambda d: optimized.unpermute(torch.randn(d["T"] * d["K"], d["H"]).bfloat16(), d["tw"],
                                              torch.arange(d["T"] * d["K"], dtype=torch.int32)), "unpermute"),
])
def test_wrappers_take_the_fast_binding_in_eager_mode(monkeypatch, module, call, name):
    rec = _Recorder()
    monkeypatch.setattr(_module(module), "fast", rec)
    call(_inputs())
    assert rec.called == [name]


class _Hooked(torch.Tensor):
    """A tensor subclass whose __torch_function__ sees every torch function and op it meets."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_subclass_tensors_get_their_hook_through_torch_ops(monkeypatch):
    """A subclass with its own __torch_function__ must see the op, as it does through torch.ops:
    the wrappers leave the fast binding (which would skip the hook) to plain tensors."""
    d = _inputs()
    rec = _Recorder()
    monkeypatch.setattr(_module("route"), "fast", rec)
    _Hooked.seen = []
    w, ids = optimized.route(d["logits"].as_subclass(_Hooked), d["K"], "sigmoid_bias", bias=d["bias"])
    assert rec.called == [] and torch.ops.moelab.route.default in _Hooked.seen
    w0, i0 = optimized.route(d["logits"], d["K"], "sigmoid_bias", bias=d["bias"])
    assert torch.equal(ids.as_subclass(torch.Tensor), i0) and torch.equal(w.as_subclass(torch.Tensor), w0)


def test_fake_tensors_and_profiler_see_the_op():
    """Through the dispatcher like torch.ops: the profiler records moelab::route, and under a
    FakeTensorMode the fake kernel answers (shapes only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    d = _inputs()
    args = (d["logits"], d["K"], "sigmoid_bias", d["bias"], 1.0, None, 1, 1, None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fastcall.ops.route(*args)
    assert any(e.name == "moelab::route" for e in prof.events())
    with FakeTensorMode() as mode:
        fake = (mode.from_tensor(d["logits"]), d["K"], "sigmoid_bias", mode.from_tensor(d["bias"]), 1.0, None, 1, 1,
                None)
        w, ids = fastcall.ops.route(*fake)
    assert w.shape == (d["T"], d["K"]) and ids.dtype == torch.int32


def test_direct_is_the_one_rule():
    """fastcall.direct: plain tensors, Parameters and absent optionals take the binding; a
    __torch_function__ subclass in any position does not."""
    t = torch.ones(2, 2)
    p = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
    h = t.as_subclass(_Hooked)
    assert fastcall.direct(t) and fastcall.direct(t, p) and fastcall.direct(t, None, p)
    assert not fastcall.direct(h) and not fastcall.direct(t, h) and not fastcall.direct(t, None, h)
