#!/usr/bin/env bash
# One command for a lent GPU machine (torch + CUDA, nvcc, no downloads), repo copied there:
#
#   OUT=/some/folder bash scripts/gpu_check.sh
#
# 1. environment (GPU, driver, torch, CUDA)        -> $OUT/env.txt
# 2. build the CPU and the CUDA extension           (import optimized; moelab_gpu must load)
# 3. the errors the bindings raise, one process per case (scripts/gpu_error_probe.py): on the
#    first H200 run (experiments/results/nvidia-h200/) the first error raised by the GPU bindings
#    killed the process with a host segmentation fault; a crash is reported per case, with
#    faulthandler's Python traceback and cuda-gdb's native backtrace
#                                                   -> $OUT/errors.csv, errors.txt
# 4. torch.library.opcheck of every op on CUDA, and each GPU kernel against the CPU kernel
#    (fused_experts: both paths, every format, exact-sum bit identity, batch invariance)
#                                                   -> $OUT/opcheck.csv (written row by row)
# 5. python -m verify --backends cuda --budget 36 --bad-inputs none
#                                                   -> $OUT/verify.{md,json}
# 5b. verify's bad-input fuzz, each op in a process of its own (a crash is that op's finding
#    and hides nothing else)                        -> $OUT/bad/<op>.{md,json}
# 5c. the GPU peers through their adapters (verify/peers: vllm-cuda, flashinfer, sgl-kernel),
#    each reported as not run when its package is absent (this machine downloads nothing);
#    a peer failing its declared contract is a finding, not a failed step
#                                                   -> $OUT/peers.{md,json}
# 6. timings vs the eager-PyTorch way and the seeds' "before" paths, CUDA graphs, with the
#    measured copy bandwidth and launch cost as floors (fused_experts: decode weight-read
#    bandwidth vs the copy bandwidth, the path crossover, one prefill point)
#                                                   -> $OUT/gpu_bench.csv, gpu_env.csv
# 7. compute-sanitizer over short verify runs of the GPU ops (valid inputs: --bad-inputs none):
#    memcheck (out-of-bounds and misaligned accesses, errors of CUDA calls), racecheck
#    (shared-memory hazards), initcheck (reads of device memory nothing wrote) and synccheck
#    (barriers and warp syncs not reached by every thread they name); where the machine has no
#    compute-sanitizer the log and $OUT/sanitizer.txt say so plainly
#                                -> $OUT/memcheck/, $OUT/racecheck/, $OUT/initcheck/, $OUT/synccheck/
# Everything is logged to $OUT/gpu_check.log. Each step has its own time limit (105 + 90 + 40 +
# 50 + 55 + 25 + 55 + 45 + 25 + 25 + 25 s = 9 minutes at most on an H200: build, errors, opcheck,
# verify, bad inputs, peers, bench, memcheck, racecheck, initcheck, synccheck; the first H200 run
# took 48 s to build, 15 s for opcheck, 21 s for peers, 38 s for the bench, 134 s in all); a
# failing step is recorded and the next one still runs; the exit status is non-zero if any step
# failed.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MOELAB_BUILD_DIR="${MOELAB_BUILD_DIR:-$PWD/build}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# Build for the GPU that is here (e.g. "9.0" on an H200), not for every architecture.
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  TORCH_CUDA_ARCH_LIST=$($PY -c "import torch; c = torch.cuda.get_device_capability(); print(f'{c[0]}.{c[1]}')")
  export TORCH_CUDA_ARCH_LIST
fi

failed=()
start=$(date +%s)
step() { echo; echo "== [$(date +%T), +$(( $(date +%s) - start )) s] $*"; }
run_step() {   # run_step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  step "$name (limit ${secs} s)"
  if timeout --kill-after=10 "$secs" "$@"; then echo "-- $name: ok"; else
    local rc=$?
    if (( rc == 124 || rc == 137 )); then echo "-- $name: FAILED: ran past its ${secs} s limit"
    else echo "-- $name: FAILED (exit $rc)"; fi
    failed+=("$name"); fi
}

step "environment"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "nvidia-smi: n/a"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip, 'device', torch.cuda.get_device_name())"
  nvcc --version 2>/dev/null | tail -1 || true
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
  git log -1 --format='commit %H %s' 2>/dev/null || true
} | tee "$OUT/env.txt"

run_step build 105 $PY -c "
import time; t = time.time()
import optimized
from optimized import gpu
assert gpu.available(), 'moelab_gpu did not load (torch.version.cuda/hip and nvcc/hipcc required)'
print('built and loaded in %.0f s:' % (time.time() - t), optimized.backend_info(), gpu.info())"

if [[ " ${failed[*]-} " == *" build "* ]]; then
  echo "build failed: nothing else can run"; exit 1
fi
run_step errors 90 $PY scripts/gpu_error_probe.py --out "$OUT"
run_step opcheck 40 $PY scripts/gpu_opcheck.py --out "$OUT"
run_step verify 50 $PY -m verify --backends cuda --budget 36 --bad-inputs none --report "$OUT/verify"
# each op's bad-input fuzz in its own process; the step fails if any op fails or crashes
run_step bad_inputs 55 bash -c 'set -o pipefail; rc=0; mkdir -p "$0/bad"
  for op in route permute unpermute router_gemm skinny_gemm fused_experts; do
    "$1" -m verify --ops $op --backends cuda --bad-inputs only --budget 5 --no-corpus --quiet \
      --report "$0/bad/$op" | tail -3 || { echo "bad inputs of $op: FAILED (exit $?)"; rc=1; }
  done; exit $rc' "$OUT" "$PY"
# exit 1 = some peer fails its declared contract (a finding, in the report); 2 or a crash = a failed step
run_step peers 25 bash -c "$PY -m verify --impl moelab,vllm-cuda,flashinfer,sgl-kernel --backends cuda \
  --ops route,fused_experts --budget 12 --quiet --report '$OUT/peers'; rc=\$?; (( rc <= 1 ))"
run_step bench 55 $PY -m experiments.gpu_bench --out "$OUT"

# compute-sanitizer: every kernel launch of a short verify run is instrumented; any error
# report fails the step (--error-exitcode). Short budgets: instrumented kernels run 10-100x
# slower, and torch's own start-up under the tool takes a while.
SAN=$(command -v compute-sanitizer || true)
[[ -z "$SAN" && -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/compute-sanitizer" ]] && SAN="$CUDA_HOME/bin/compute-sanitizer"
[[ -z "$SAN" && -x /usr/local/cuda/bin/compute-sanitizer ]] && SAN=/usr/local/cuda/bin/compute-sanitizer
if [[ -n "$SAN" ]] && $PY -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
  echo "compute-sanitizer: $SAN ($("$SAN" --version 2>/dev/null | tail -1))" | tee "$OUT/sanitizer.txt"
  run_step memcheck 45 "$SAN" --tool memcheck --error-exitcode 9 --print-limit 20 \
    $PY -m verify --backends cuda --budget 12 --no-corpus --quiet \
    --bad-inputs none --ops route,permute,unpermute,router_gemm,skinny_gemm,fused_experts --report "$OUT/memcheck/verify"
  run_step racecheck 25 "$SAN" --tool racecheck --error-exitcode 9 --print-limit 20 \
    $PY -m verify --backends cuda --budget 6 --no-corpus --quiet \
    --bad-inputs none --ops route,permute,fused_experts --report "$OUT/racecheck/verify"
  # initcheck: a kernel reading a workspace or output word that nothing wrote (verify poisons
  # fresh allocations with NaN, so this is about memory the call itself should have filled).
  run_step initcheck 25 "$SAN" --tool initcheck --error-exitcode 9 --print-limit 20 \
    $PY -m verify --backends cuda --budget 5 --no-corpus --quiet \
    --bad-inputs none --ops route,permute,unpermute,router_gemm,skinny_gemm,fused_experts --report "$OUT/initcheck/verify"
  # synccheck: __syncthreads / warp syncs in divergent code, or with masks naming absent lanes.
  run_step synccheck 25 "$SAN" --tool synccheck --error-exitcode 9 --print-limit 20 \
    $PY -m verify --backends cuda --budget 5 --no-corpus --quiet \
    --bad-inputs none --ops route,permute,router_gemm,skinny_gemm,fused_experts --report "$OUT/synccheck/verify"
else
  echo "compute-sanitizer: NOT RUN: no compute-sanitizer on this machine (PATH, CUDA_HOME/bin) or not a" \
       "CUDA build of torch (ROCm has no equivalent here); memcheck, racecheck, initcheck and synccheck" \
       "were not checked" \
    | tee "$OUT/sanitizer.txt"
fi

step "done in $(( $(date +%s) - start )) s"
if (( ${#failed[@]} )); then echo "FAILED steps: ${failed[*]}"; exit 1; fi
echo "all steps passed"
