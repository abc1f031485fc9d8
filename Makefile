# moelab: `make verify` (main job) and `make test` (test suite) work from nothing.
#
#   TORCH=torch==2.13.0   what `make setup` installs into .venv (the CPU build by default;
#                          a bare `torch` would pull a multi-GB CUDA build)
#   TORCH=keep            reuse the torch of the Python that creates the venv (GPU users)
#
# `make experiments` runs every notebook in experiments/ headless (quick grids, ~20 min on
# 2 cores; FULL=1 for the full grids) and writes experiments/REPORT.md, figures/, results/.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
BUDGET  ?= 600

.PHONY: setup build test verify bench experiments compile-check clean

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

bench: setup
	$(VPY) -m experiments.bench

# The notebooks extra (jupyter, nbclient, ipykernel, seaborn, pandas) is part of `make setup`
# (tests/test_notebooks.py runs every notebook in tiny mode); ~25 s to install from nothing.
experiments: setup
	$(VPY) -m experiments.run_notebooks $(if $(filter-out 0,$(FULL)),--mode full,)

# Every GPU source through nvcc (sm_80, sm_90a) and hipcc (gfx90a, gfx940), device code only,
# in parallel; ptxas/AMDGPU register and spill reports in build/compile-check/. No GPU needed,
# no torch needed. A spill in a hot kernel fails. (tests/test_compile_check.py runs it too.)
compile-check:
	$(PY) scripts/compile_check.py --out build/compile-check

clean:
	rm -rf build reports .pytest_cache .hypothesis
