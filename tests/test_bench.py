"""experiments.bench's peer columns (`make bench PEERS=1`), with fake cases and fake peers: the
machinery must time every runnable peer in the same rounds, compute ours/peer the right way
round, report a peer that cannot run with its reason (never as a time), and write one CSV row
per implementation. The real peers are exercised by the bench itself (they are optional)."""
from __future__ import annotations

import csv
import io
import sys
import time
from pathlib import Path

import pytest
import torch

from experiments import bench, timing
from experiments.bench import Case


def _sleeper(seconds):
    # a sleep, not a busy loop: on a loaded machine a busy loop's wall time grows with every
    # preemption, a sleep's only by the wake-up latency
    return lambda: time.sleep(seconds)


@pytest.fixture
def fake_cases(monkeypatch):
    cases = [Case("fake", "point A", _sleeper(4e-3), _sleeper(2e-3), nbytes=10 ** 6, target=1.5,
                  peers=lambda: {"slow peer": _sleeper(8e-3), "absent peer": "not installed (make peers)"},
                  peer_target=2.0),
             Case("fake", "point B (no peers)", _sleeper(1e-3), _sleeper(1e-3), nbytes=10 ** 6)]
    monkeypatch.setattr(bench, "discover", lambda: {"fake": lambda quick: cases})
    monkeypatch.setattr(timing, "read_bandwidth", lambda nbytes=0: 1e10)
    monkeypatch.setattr(timing, "read_bandwidth_torch_sum", lambda nbytes=0: 0.8e10)
    return cases


def test_peer_columns(fake_cases):
    rows = bench.run(["fake"], quick=True, rounds=3, peers=True)
    a, b = rows
    assert b["peers"] == []
    slow, absent = a["peers"]
    assert absent == {"peer": "absent peer", "why_not": "not installed (make peers)"}
    assert slow["peer"] == "slow peer"
    # ours takes 2 ms, the peer 8 ms: ours/peer ~ 4 (> 1 means ours is faster; the wake-up
    # latency of a loaded machine only pulls it towards 1)
    assert 1.5 < slow["ours_vs"] < 8.0, slow   # the inverse ratio would be ~0.25
    assert slow["ours_vs_min"] <= slow["ours_vs"] <= slow["ours_vs_max"]
    assert slow["GBps"] == pytest.approx(1e6 / (slow["us"] * 1e-6) / 1e9)
    buf = io.StringIO()
    bench.print_table(rows, file=buf)
    out = buf.getvalue()
    # the header names the dram floor's probe and prints the old torch-sum figure beside it
    assert "read bandwidth 10.0 GB/s (moelab::read_stream" in out and "4 KiB pages: 8.0 GB/s" in out, out
    assert "vs slow peer" in out and "ok 2" in out
    assert "vs absent peer" in out and "not run: not installed (make peers)" in out


def test_dram_floor_includes_the_probe_timed_in_the_rows_rounds(fake_cases, monkeypatch):
    """A dram row's floor is also the read probe timed in the row's own interleaved rounds (the
    2-thread bandwidth switches regime within a run); a cache row does not run the probe."""
    calls = []

    def probe():
        calls.append(1)
        time.sleep(1e-3)

    monkeypatch.setattr(timing, "llc_bytes", lambda: 2 * 10 ** 6)
    monkeypatch.setattr(timing, "cache_bandwidth", lambda nbytes: 1e9)
    monkeypatch.setattr(timing, "read_probe", lambda nbytes=0: (probe, 10 ** 9))   # ~1e12 B/s: wins
    fake_cases[0].nbytes = 10 ** 7                                               # above the "LLC": dram
    a, b = bench.run(["fake"], quick=True, rounds=2, peers=False)
    assert a["floor_kind"] == "dram" and b["floor_kind"] == "cache"
    assert calls and a["floor_GBps"] > 10.0 * 5            # the probe's pass, not read_bandwidth's 10 GB/s
    assert a["floor_GBps"] <= 1e3 + 1e-9                    # at most 10^9 B per 1 ms
    n = len(calls)
    fake_cases[0].nbytes = 10 ** 6                          # both rows cache-resident: no probe
    bench.run(["fake"], quick=True, rounds=2, peers=False)
    assert len(calls) == n


def test_dram_floor_is_the_fastest_probe_pass_of_the_whole_run(fake_cases, monkeypatch):
    """A dram row timed in a slow phase gets the floor of a faster probe pass timed later in the
    run (the 2-thread bandwidth switches phase within a run); its peers' fractions follow. The
    probe here reads 1 MB in 2 ms while point A's rows run and in 0.5 ms during point B's."""
    phase = {"probe_s": 2e-3}

    def setting(probe_s, fn):
        def call():
            phase["probe_s"] = probe_s
            fn()
        return call

    a, b = fake_cases
    a.eager, a.ours = setting(2e-3, a.eager), setting(2e-3, a.ours)
    b.eager, b.ours = setting(0.5e-3, b.eager), setting(0.5e-3, b.ours)
    for c in fake_cases:
        c.cold = True
    monkeypatch.setattr(timing, "read_bandwidth", lambda nbytes=0: 1e8)   # the start-of-run probe
    monkeypatch.setattr(timing, "read_probe", lambda nbytes=0: (lambda: time.sleep(phase["probe_s"]), 10 ** 6))
    ra, rb = bench.run(["fake"], quick=True, rounds=3, peers=True)
    assert ra["floor_GBps"] == rb["floor_GBps"] and 1.0 < ra["floor_GBps"] <= 2.0, (ra, rb)
    assert ra["floor_frac"] == pytest.approx(1e6 / (ra["ours_us"] * 1e-6) / (ra["floor_GBps"] * 1e9))
    slow = ra["peers"][0]
    assert slow["floor_frac"] == pytest.approx(1e6 / (slow["us"] * 1e-6) / (ra["floor_GBps"] * 1e9))


def test_cold_case_gets_the_dram_floor_and_probe_frac(fake_cases, monkeypatch):
    """A cold case (inputs rotating through copies larger than the cache) is judged against the
    read bandwidth whatever its size, never the cache's; its probe_frac compares each round with
    the probe timed in that same round (ours 2 ms vs a probe of the same bytes taking 1 ms:
    ~50%, whichever phase the rounds ran in), and a bw_target is judged on it."""
    monkeypatch.setattr(timing, "llc_bytes", lambda: 2 * 10 ** 6)
    monkeypatch.setattr(timing, "cache_bandwidth", lambda nbytes: 1e12)   # would win if used
    monkeypatch.setattr(timing, "read_probe", lambda nbytes=0: (_sleeper(1e-3), 10 ** 6))
    a, b = fake_cases
    a.cold, a.bw_target = True, 0.8
    ra, rb = bench.run(["fake"], quick=True, rounds=3, peers=True)
    assert ra["floor_kind"] == "dram" and ra["floor_GBps"] == pytest.approx(10.0)   # read_bandwidth, not the cache
    assert rb["floor_kind"] == "cache" and rb["probe_frac"] is None    # no probe for cache rows
    assert 0.15 < ra["probe_frac"] < 0.8, ra                           # ~0.5 (sleep jitter only lowers it)
    slow = ra["peers"][0]
    assert 0.03 < slow["probe_frac"] < ra["probe_frac"], slow          # the peer takes 8 ms: ~0.125
    buf = io.StringIO()
    bench.print_table([ra, rb], file=buf)
    line = next(s for s in buf.getvalue().splitlines() if s.startswith("fake") and "point A" in s)
    assert "MISS 80%" in line, line


def test_summary_judges_bw_target_on_probe_frac(tmp_path, capsys):
    base = {"op": "fake", "shape": "point A", "target": "", "read_GBps": 30.0, "threads": 2, "run": 0,
            "impl": "moelab", "ours_vs": "", "why_not": "", "peer_target": "", "bw_target": 0.8}
    paths = []
    for k, pf in enumerate((0.85, 0.7, 0.9)):
        paths.append(tmp_path / f"r{k}.csv")
        with open(paths[-1], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*base, "speedup", "probe_frac"])
            w.writeheader()
            w.writerow({**base, "speedup": 1.0, "probe_frac": pf})
    assert bench.main(["--summarize", *map(str, paths)]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if "of the read probe" in s)
    assert "85%" in line and "70%..90%" in line and "80%" in line and "2/3" in line, line


def test_without_peers_flag_peers_are_not_built(fake_cases):
    built = []
    fake_cases[0].peers = lambda: built.append(1) or {}
    bench.run(["fake"], quick=True, rounds=1, peers=False)
    assert built == []


def test_csv_one_row_per_implementation(fake_cases, tmp_path, capsys):
    path = tmp_path / "b.csv"
    assert bench.main(["--ops", "fake", "--quick", "--rounds", "2", "--threads", "1", "--peers",
                       "--csv", str(path)]) == 0
    rows = list(csv.DictReader(open(path)))
    impls = [(r["shape"], r["impl"]) for r in rows]
    assert impls == [("point A", "moelab"), ("point A", "slow peer"), ("point A", "absent peer"),
                     ("point B (no peers)", "moelab")]
    assert rows[2]["why_not"] and rows[2]["impl_us"] == ""
    assert float(rows[1]["ours_vs"]) > 1.0


def _write_run(path, speedups, vs):
    """A CSV as flat_rows writes it for one whole run of point A (one peer) at 1 thread."""
    base = {"op": "fake", "shape": "point A", "target": 1.5, "read_GBps": 30.0, "threads": 1, "run": 0}
    rows = [{**base, "speedup": speedups, "impl": "moelab", "ours_vs": "", "why_not": "", "peer_target": ""},
            {**base, "speedup": speedups, "impl": "slow peer", "ours_vs": vs, "why_not": "", "peer_target": 2.0},
            {**base, "speedup": speedups, "impl": "absent peer", "ours_vs": "", "why_not": "not installed",
             "peer_target": ""}]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_summarize_separate_runs(tmp_path, capsys):
    """`make bench PEERS=1` runs each whole run in its own process and summarizes their CSVs:
    the median over the runs and how many met each target, for ours/eager and ours/peer."""
    paths = []
    for k, (sp, vs) in enumerate(((1.2, 2.5), (1.8, 1.9), (1.6, 2.2))):
        paths.append(tmp_path / f"run{k}.csv")
        _write_run(paths[-1], sp, vs)
    runs = bench.runs_from_csv([str(p) for p in paths])
    assert list(runs) == [1] and len(runs[1]) == 3
    assert bench.main(["--summarize", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    line_ours = next(s for s in out.splitlines() if s.startswith("fake"))
    line_peer = next(s for s in out.splitlines() if "vs slow peer" in s)
    assert "1.60x" in line_ours and "1.20..1.80" in line_ours and "2/3" in line_ours, line_ours
    assert "2.20x" in line_peer and "1.90..2.50" in line_peer and "2/3" in line_peer, line_peer
    assert "absent peer" not in out


def test_csv_round_trips_into_the_summary(fake_cases, tmp_path, capsys):
    """The CSV that main writes is what --summarize reads (peer targets included)."""
    paths = [tmp_path / "a.csv", tmp_path / "b.csv"]
    for p in paths:
        assert bench.main(["--ops", "fake", "--quick", "--rounds", "2", "--threads", "1", "--peers",
                           "--csv", str(p)]) == 0
    runs = bench.runs_from_csv([str(p) for p in paths])
    point_a = runs[1][0][0]
    assert point_a["shape"] == "point A" and point_a["target"] == 1.5
    assert [pc["peer"] for pc in point_a["peers"]] == ["slow peer", "absent peer"]
    assert point_a["peers"][0]["target"] == 2.0 and point_a["peers"][0]["ours_vs"] > 1.0


def test_bad_threads_argument(fake_cases):
    with pytest.raises(SystemExit):
        bench.main(["--ops", "fake", "--threads", "one"])


def test_discover_lists_every_bench_module():
    """Every experiments/cases_*.py with a cases() is a bench op (and a module without one, such
    as the parallel notebook's, does not break `make bench`)."""
    found = bench.discover()
    assert {"route", "router_gemm", "fused_experts", "permute", "skinny_gemm", "models"} <= set(found)
    assert all(callable(f) for f in found.values())


@pytest.mark.parametrize("name", ["olmoe-1b-7b", "qwen3-30b-a3b", "gpt-oss-20b"])
def test_real_peers_compute_the_same_layer(name, monkeypatch):
    """The bench's peer columns call the peers with the conversions written out in
    experiments/peers.py; a wrong layout would time a different computation. Each peer's output
    on a small instance of the shape (8 experts) must match ours to bf16 accuracy (their
    documented deviations are bf16-rounding ones: verify/peers)."""
    import torch
    from experiments import peers
    from experiments.cases_fused_experts import SHAPES, routing
    from optimized.tune.calibrate import random_weights
    import optimized
    if isinstance(peers.vllm(), str):
        pytest.skip(peers.vllm())
    s = dict(SHAPES[name], E=8)
    E, K, H, I, q = s["E"], min(s["K"], 4), s["H"], s["I"], s["quant"]
    g = torch.Generator().manual_seed(7)
    b13 = torch.randn(E, 2 * I, generator=g) * 0.1 if s["bias"] else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if s["bias"] else None
    # two rotating copies (the bench makes enough to exceed the caches), both the same weights
    monkeypatch.setattr(peers, "Rotating", lambda make, nbytes: timing.Rotating(make, nbytes, max_copies=2))
    P = peers.FusedExpertsPeers(s, [100] * 2, (b13, b2))
    tw, ids = routing("uniform", 4, E, K)
    x = torch.randn(4, H, generator=g).bfloat16()
    w13, w2, s13, s2 = random_weights(q, E, H, I, seed=100)
    ours = optimized.fused_experts(x, w13, w2, tw, ids, quant=q, w13_scale=s13, w2_scale=s2, w13_bias=b13,
                                   w2_bias=b2, activation=s["activation"]).float()
    ran, why_not = 0, []
    for peer, fn in P.peers(x, tw, ids).items():
        if isinstance(fn, str):
            why_not.append(f"{peer}: {fn}")
            continue
        rel = float((fn().float() - ours).norm() / ours.norm())
        assert rel < 2e-2, (peer, rel)
        ran += 1
    if not ran:   # e.g. vLLM's AVX2 library has no fp8 / mxfp4 MoE op
        pytest.skip("no peer runs this shape at this level: " + "; ".join(why_not))


def test_points_filter_times_only_the_matching_points(fake_cases, capsys):
    rows = bench.run(["fake"], quick=True, rounds=2, peers=False, points=["no peers"])
    assert [r["shape"] for r in rows] == ["point B (no peers)"]
    rows = bench.run(["fake"], quick=True, rounds=2, peers=False, points=["zzz", "point A"])
    assert [r["shape"] for r in rows] == ["point A"]
    with pytest.raises(SystemExit):   # a filter that matches nothing is an error, not an empty table
        bench.main(["--ops", "fake", "--quick", "--points", "nothing like this"])
    assert "--points 'nothing like this' matches no point of fake" in capsys.readouterr().err


def test_points_dollar_anchors_at_the_end_of_the_name():
    assert bench.point_matches("bf16 T=1$", "decode olmoe-1b-7b bf16 T=1")
    assert not bench.point_matches("bf16 T=1$", "decode olmoe-1b-7b bf16 T=16")
    assert not bench.point_matches("bf16 T=1$", "decode olmoe-1b-7b bf16 T=1 standard layout (cached)")
    assert bench.point_matches("bf16 T=1", "decode olmoe-1b-7b bf16 T=128")


def test_machine_id_names_the_isa_level():
    """Results of two ISA levels never share a folder: the id ends in the active level, and a
    level capped below the CPU's says so."""
    import optimized
    from tests import levels
    info = optimized.backend_info()
    top = info["active"] + ("-capped" if info["active"] != info["detected"] else "")
    assert timing.machine_id().endswith(f"-{top}")
    if info["detected"] != "scalar":
        with levels.capped("scalar"):
            assert timing.machine_id().endswith("-scalar-capped")
            assert timing.results_dir("r").name == timing.machine_id()
    assert timing.machine_id().endswith(f"-{top}")


def test_a_capped_run_caps_torch_mkl_and_onednn_too():
    """Under MOELAB_ISA=avx2 a benchmark restarts itself with ATen, MKL and oneDNN capped at
    AVX2, so its baselines run what an AVX2 CPU runs (torch reports the capability it chose); a
    variable the user set is kept, and without MOELAB_ISA nothing is set."""
    import os
    import subprocess
    root = Path(__file__).resolve().parents[1]
    code = ("from experiments import timing; timing.cap_libraries(); import os, torch; "
            "print(torch.backends.cpu.get_cpu_capability(), os.environ.get('MKL_ENABLE_INSTRUCTIONS'), "
            "os.environ.get('ONEDNN_MAX_CPU_ISA'), '|', timing.library_caps())")
    base = {k: v for k, v in os.environ.items() if k not in ("MOELAB_ISA", *timing.LIBRARY_CAPS["avx2"])}

    def run(**env):
        done = subprocess.run([sys.executable, "-c", code], cwd=root, env={**base, **env},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    out = run(MOELAB_ISA="avx2")
    assert out[:3] == ["AVX2", "AVX2", "AVX2"]
    assert "ATEN_CPU_CAPABILITY=avx2" in out and "ONEDNN_MAX_CPU_ISA=AVX2" in out
    assert run(MOELAB_ISA="avx2", ONEDNN_MAX_CPU_ISA="SSE41")[:3] == ["AVX2", "AVX2", "SSE41"]
    assert run()[1:] == ["None", "None", "|"]


def test_vllm_loads_the_library_of_the_capped_level(tmp_path, monkeypatch):
    """vLLM's platform picks _C / _C_AVX512 / _C_AVX2 from torch.cpu's AVX-512 checks while
    vllm._custom_ops imports; under our cap those checks answer for the capped level, so the
    peer runs the build a CPU of that level gets (and keeps: vLLM imports its kernels again as
    its modules load). A fake vllm records what it was told."""
    from tests import levels
    from verify.peers import vllm_cpu
    if not levels.available("avx2"):
        pytest.skip(f"this CPU runs {levels.CEILING}: no x86 vector level to cap at")
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = 'fake'\n")
    (pkg / "_custom_ops.py").write_text(
        "import torch\nSEEN = (torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for check in ("_is_avx512_supported", "_is_avx512_bf16_supported"):   # put back after the test
        monkeypatch.setattr(torch.cpu, check, getattr(torch.cpu, check))

    def vllm_modules():
        return [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
    for name in vllm_modules():             # a real vLLM imported earlier comes back at teardown
        monkeypatch.delitem(sys.modules, name)
    try:
        for level, want in (("avx2", (False, False)), ("avx512", (True, False))):
            if not levels.available(level):
                continue
            with levels.capped(level):
                v, vops, lib = vllm_cpu.import_vllm()
            assert v.__version__ == "fake" and vops.SEEN == want, level
            for name in vllm_modules():
                del sys.modules[name]
    finally:   # no fake vllm may outlive the test: later tests would take it for the real one
        for name in vllm_modules():
            del sys.modules[name]


def test_provenance_names_the_cap_in_the_command(monkeypatch):
    """A capped run's file says how to rerun it capped."""
    monkeypatch.delenv("MOELAB_ISA", raising=False)
    assert timing.provenance("python -m x").splitlines()[0] == "# command: python -m x"
    monkeypatch.setenv("MOELAB_ISA", "avx2")
    assert timing.provenance("python -m x").splitlines()[0] == "# command: MOELAB_ISA=avx2 python -m x"


def test_zentorch_gets_no_column_in_a_capped_run():
    """ZenDNN picks its code from the CPU alone: under a cap the bench says so instead of timing
    an AVX-512 peer against our AVX2 kernels."""
    from experiments import peers
    from tests import levels
    if levels.CEILING == "scalar":
        pytest.skip("the CPU runs the portable level only: nothing to cap")
    peers.zentorch.cache_clear()
    try:
        with levels.capped("scalar"):
            why = peers.zentorch()
        assert isinstance(why, str) and "cannot be capped" in why
    finally:
        peers.zentorch.cache_clear()


def test_cpu_name_adds_the_core_to_a_generic_model_name():
    """A hypervisor's generic model name gets the core from cpuid's family and model, so a Zen 2
    and a Zen 3 EPYC write different results folders; a name with a model number stays."""
    def info(name, vendor, family, model):
        return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
                f"model name\t: {name}\n\nprocessor\t: 1\nmodel name\t: other\n")
    assert timing.cpu_name(info("AMD EPYC", "AuthenticAMD", 23, 49)) == "AMD EPYC (Zen 2)"
    assert timing.cpu_name(info("AMD EPYC", "AuthenticAMD", 25, 1)) == "AMD EPYC (Zen 3)"
    assert timing.cpu_name(info("AMD EPYC", "AuthenticAMD", 26, 2)) == "AMD EPYC (Zen 5)"
    assert timing.cpu_name(info("Intel(R) Xeon(R) Processor", "GenuineIntel", 6, 143)) == \
        "Intel(R) Xeon(R) Processor (Sapphire Rapids)"
    assert timing.cpu_name(info("AMD EPYC", "AuthenticAMD", 99, 7)) == "AMD EPYC (family 99 model 7)"
    assert timing.cpu_name(info("AMD EPYC 9B45 128-Core Processor", "AuthenticAMD", 26, 2)) == \
        "AMD EPYC 9B45 128-Core Processor"


def test_rotating_copies_exceed_twice_the_last_level_cache(monkeypatch):
    """Cold rows rotate through copies that together exceed twice the LLC (and 384 MiB): a
    300 MB L3 must not hold them all (a fixed cap of 64 copies of a 3 MB weight did)."""
    made = []

    def make():
        made.append(1)
        return len(made)

    monkeypatch.setattr(timing, "llc_bytes", lambda: 300 << 20)
    r = timing.Rotating(make, 3 << 20)
    assert len(r.items) * (3 << 20) >= 2 * (300 << 20) and len(r.items) == 200
    monkeypatch.setattr(timing, "llc_bytes", lambda: 16 << 20)
    assert len(timing.Rotating(make, 3 << 20).items) == 128                 # 384 MiB / 3 MiB
    assert len(timing.Rotating(make, 1 << 30).items) == 2                   # at least min_copies
    assert len(timing.Rotating(make, 16, max_copies=8).items) == 8          # bounded for tiny weights


def test_prefill_baseline_is_the_faster_dense_dtype_without_native_bf16(monkeypatch):
    """Prefill's dense baseline: bf16 on a CPU with native bf16; elsewhere whichever of bf16
    and f32 runs faster (torch's bf16 GEMM is a slow fallback there, issue 32)."""
    from experiments import cases_fused_experts as cfe
    delay = {torch.bfloat16: 2e-3, torch.float32: 1e-3}
    monkeypatch.setattr(cfe, "prefill_dense", lambda name, rows, dtype=torch.bfloat16: _sleeper(delay[dtype]))
    monkeypatch.setattr(cfe, "native_bf16", lambda: False)
    assert cfe.prefill_baseline_dtype("qwen3-30b-a3b", 8) == torch.float32
    delay = {torch.bfloat16: 1e-3, torch.float32: 2e-3}
    assert cfe.prefill_baseline_dtype("qwen3-30b-a3b", 8) == torch.bfloat16
    delay = {torch.bfloat16: 2e-3, torch.float32: 1e-3}
    monkeypatch.setattr(cfe, "native_bf16", lambda: True)                  # not timed: bf16
    assert cfe.prefill_baseline_dtype("qwen3-30b-a3b", 8) == torch.bfloat16


def test_fused_experts_targets_follow_the_level(monkeypatch):
    """The bench judges a level by its own issue's targets: at avx2 fp8 and mxfp4 decode against
    70% of the probe at any thread count and bf16 prefill against 1.5x vLLM; at AVX-512 fp8
    decode against 80% on two threads only and bf16 prefill against 1.0x."""
    from experiments import cases_fused_experts as cfe
    monkeypatch.setattr(cfe, "prefill_baseline_dtype", lambda name, rows: torch.float32)   # no timing
    monkeypatch.setattr(cfe, "eager_weight_dtype", lambda name: torch.bfloat16)

    def targets():
        cases = {c.shape: c for c in cfe.cases(quick=False)}
        return (cases["decode qwen3-30b-a3b fp8_block T=1"].bw_target, cases["decode gpt-oss-20b mxfp4 T=1"].bw_target,
                cases["prefill olmoe-1b-7b bf16 T=512"].peer_target)

    monkeypatch.setattr(cfe, "avx2_level", lambda: True)
    assert targets() == (0.7, 0.7, 1.5)
    monkeypatch.setattr(cfe, "avx2_level", lambda: False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert targets() == (0.8, None, 1.0)
        torch.set_num_threads(1)
        assert targets() == (None, None, 1.0)
    finally:
        torch.set_num_threads(threads)


def test_decode_eager_is_f32_where_that_is_faster(monkeypatch):
    """Without native bf16 the decode baseline holds its weights in whichever of bf16 and f32
    runs the GEMVs faster (timed), says so in the point's name, and computes the same layer."""
    from types import SimpleNamespace
    from experiments import cases_fused_experts as cfe
    monkeypatch.setitem(cfe.SHAPES, "tiny", dict(E=4, K=2, H=64, I=32, quant="bf16", activation="silu", bias=True))
    delay = {}
    monkeypatch.setattr(cfe.timing, "compare", lambda cands, **kw: {k: SimpleNamespace(median=delay[k]) for k in cands})
    cfe.eager_weight_dtype.cache_clear()
    try:
        monkeypatch.setattr(cfe, "native_bf16", lambda: False)
        delay.update(bf16=2.0, f32=1.0)
        assert cfe.eager_weight_dtype("tiny") == torch.float32
        d32 = cfe.ShapeData("tiny", eager=True)
        cfe.eager_weight_dtype.cache_clear()
        delay.update(bf16=1.0, f32=2.0)
        assert cfe.eager_weight_dtype("tiny") == torch.bfloat16
        d16 = cfe.ShapeData("tiny", eager=True)
        assert d32.eager.items[0][0].dtype == torch.float32 and d16.eager.items[0][0].dtype == torch.bfloat16
        assert torch.equal(d32.eager.items[0][0].bfloat16(), d16.eager.items[0][0])   # the same bf16 values
        tw, ids = cfe.routing("uniform", 3, 4, 2)
        x = torch.randn(3, 64).bfloat16()
        a, b = d32.eager_call(x, tw, ids).float(), d16.eager_call(x, tw, ids).float()
        assert float((a - b).norm() / b.norm()) < 2e-2
        cfe.eager_weight_dtype.cache_clear()
        monkeypatch.setattr(cfe, "native_bf16", lambda: True)
        delay.clear()                                       # native bf16: nothing is timed
        assert cfe.eager_weight_dtype("tiny") == torch.bfloat16
    finally:
        cfe.eager_weight_dtype.cache_clear()
    monkeypatch.setattr(cfe, "eager_weight_dtype", lambda name: torch.float32)
    names = [c.shape for c in cfe.cases(quick=True) if c.shape.startswith("decode qwen3-30b-a3b fp8_block T=1 ")
             or c.shape == "decode qwen3-30b-a3b fp8_block T=1"]
    assert names == ["decode qwen3-30b-a3b fp8_block T=1 (eager f32)",
                     "decode qwen3-30b-a3b fp8_block T=1 standard layout (cached) (eager f32)"]


def test_prefill_dense_runs_the_shapes_gemms_in_the_dtype_asked():
    from experiments import cases_fused_experts as cfe
    h, y = cfe.prefill_dense("qwen3-30b-a3b", 3, torch.float32)()
    assert h.dtype == y.dtype == torch.float32 and h.shape == (3, 2 * 768) and y.shape == (3, 2048)
    assert cfe.prefill_dense("qwen3-30b-a3b", 3)()[0].dtype == torch.bfloat16
