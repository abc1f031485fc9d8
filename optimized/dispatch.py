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

import torch

from . import gpu, pack_cache, tune

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
        return gpu_decision("router_gemm", x, weight)
    if T <= ROUTER_GEMM_MAX_T:
        return Decision("router_gemm", "moelab", f"T = {T} <= {ROUTER_GEMM_MAX_T}: fused-cast kernel")
    if _batch_invariant:
        return Decision("router_gemm", "moelab", "batch-invariant mode: library GEMM avoided")
    return Decision("router_gemm", "library", f"T = {T} > {ROUTER_GEMM_MAX_T}: F.linear(x.float(), w)")


# ---------------------------------------------------------------------------- route
# One CPU kernel for every method and size (csrc/cpu/route_kernel.h), no library path, so
# route is batch invariant in every mode. The only policy is threading: a parallel task gets
# at least ROUTE_GRAIN_ELEMS // E tokens (>= 1), i.e. ~16K expert keys, ~8 us of work at
# ~0.5 ns per key, so the thread pool's fork/join (a few us here, and far more when the 2
# cores are shared with other processes, as the bench machine often is) is amortized;
# smaller batches (decode, T <= 64 at E = 256, T <= 18 at E = 896) run on the calling
# thread. Measured: experiments/cases_route.py. Kept in sync with grain_tokens() in
# csrc/torch/route.cpp.
ROUTE_GRAIN_ELEMS = 16384


def has_kernel(op: str, device_type: str) -> bool:
    """Whether the moelab op `op` has a kernel registered for a device type (cpu, cuda, meta)."""
    key = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


def route_decision(logits, top_k, method, **kwargs) -> Decision:
    dev = logits.device.type
    if dev == "cuda":
        return gpu_decision("route", logits, top_k, method, **kwargs)
    if dev != "cpu":
        if has_kernel("moelab::route", dev):
            return Decision("route", "moelab", f"the registered {dev} kernel of moelab::route")
        return Decision("route", "reference", f"no moelab route kernel for device {dev}")
    T, E = logits.shape
    grain = max(1, ROUTE_GRAIN_ELEMS // max(E, 1))
    tasks = "1 task (calling thread)" if T < grain else f"tasks of >= {grain} tokens"
    return Decision("route", "moelab", f"{method}, T = {T}, E = {E}, K = {top_k}: {tasks}")


# ---------------------------------------------------------- permute / unpermute
# One kernel each, no crossover: the counting sort + row copies (and the no-FMA gather back)
# win at every T on the CPU (experiments/cases_permute.py). Other devices have no moelab
# kernel yet and run the reference. Both kernels are exact, hence batch invariant.
_PERMUTE_CPU = Decision("permute", "moelab", "counting sort + parallel row copies (exact)")
_UNPERMUTE_CPU = Decision("unpermute", "moelab", "f32 weighted gather, j ascending, no FMA (exact)")


def permute_decision(hidden, ids, n_experts, **_) -> Decision:
    if hidden.is_cpu:   # first: a decode step's question, and the cheapest test
        return _PERMUTE_CPU
    if hidden.device.type == "cuda":
        return gpu_decision("permute", hidden, ids, n_experts)
    return Decision("permute", "reference", f"no moelab kernel for device {hidden.device.type}")


def unpermute_decision(expert_out, weights, dst_pos) -> Decision:
    if expert_out.is_cpu:
        return _UNPERMUTE_CPU
    if expert_out.device.type == "cuda":
        return gpu_decision("unpermute", expert_out, weights, dst_pos)
    return Decision("unpermute", "reference", f"no moelab kernel for device {expert_out.device.type}")



# ----------------------------------------------------------- unquantized_gemm (skinny vs library)
# skinny_gemm streams the weight once for all T <= 8 tokens (a memory-bound decode GEMM);
# F.linear (oneDNN/MKL) is tuned for large T. SKINNY_MAX_T is the kernel's contract limit.
# Measured crossover (`python -m experiments.cases_skinny_gemm`: the raw op vs F.linear,
# weights rotating through cold copies, calls alternated one by one, 2 threads, AMD EPYC with
# AVX-512 BF16, torch 2.13; median of per-call ratios):
#   bf16: skinny faster at every T <= 8, weights 1 KiB .. 16 MiB (by the least at T = 8);
#   f16:  about even at T = 1 (F.linear has a good f16 GEMV), skinny faster at T = 2..8;
#   f32:  skinny faster from 256 KiB of weight on; at T = 1 with <= 128 KiB, F.linear (MKL
#         SGEMV) is ~0.3 us faster: SKINNY_F32_T1_MIN_BYTES.
# Above T = 8 the library GEMM runs, except in batch-invariant mode, where the batch goes
# through skinny_gemm in chunks of SKINNY_MAX_T rows (each row's reduction order stays fixed;
# the weight is then read once per chunk, ceil(T/8) reads instead of one). In batch-invariant
# mode the f32 T = 1 exception is off too: a row alone must equal the row inside a batch.
SKINNY_MAX_T = 8
SKINNY_DTYPES = ("bfloat16", "float16", "float32")
SKINNY_F32_T1_MIN_BYTES = 256 << 10
_SKINNY_TORCH_DTYPES = frozenset(getattr(torch, name) for name in SKINNY_DTYPES)


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def unquantized_gemm_kernel(x, weight) -> str:
    """The kernel optimized.unquantized_gemm runs (the hot path: no reason string on CPU;
    on a CUDA/ROCm device the GPU policy below decides)."""
    if x.device.type == "cuda":
        return gpu_decision("unquantized_gemm", x, weight).kernel
    if x.device.type != "cpu" or x.dtype not in _SKINNY_TORCH_DTYPES:
        return "library"
    T = x.shape[0]
    if T <= SKINNY_MAX_T:
        if (T == 1 and x.dtype == torch.float32 and not _batch_invariant
                and weight.numel() * 4 < SKINNY_F32_T1_MIN_BYTES):
            return "library"
        return "skinny"
    return "skinny_chunked" if _batch_invariant else "library"


def unquantized_gemm_decision(x, weight, bias=None) -> Decision:
    """skinny (T <= 8, CPU, bf16/f16/f32), skinny_chunked (T > 8 in batch-invariant mode),
    or library (F.linear: other devices, T > 8, f32 T = 1 small weights; not batch invariant)."""
    op = "unquantized_gemm"
    T = x.shape[0]
    if x.device.type == "cuda":
        return gpu_decision(op, x, weight, bias)
    kernel = unquantized_gemm_kernel(x, weight)
    lib = "F.linear (library GEMM; NOT batch invariant, its blocking may change with T; " \
          "set_batch_invariant(True) avoids it)"
    if x.device.type != "cpu":
        return Decision(op, kernel, f"no moelab kernel for device {x.device.type}: F.linear")
    if _dtype_name(x) not in SKINNY_DTYPES:
        return Decision(op, kernel, f"skinny_gemm does not take {_dtype_name(x)}: F.linear")
    if kernel == "skinny":
        mode = ", batch-invariant mode" if _batch_invariant else ""
        return Decision(op, kernel, f"T = {T} <= {SKINNY_MAX_T}{mode}: skinny_gemm streams the weight once "
                                    f"for all tokens, faster than F.linear here (measured: "
                                    f"experiments/cases_skinny_gemm.crossover); batch invariant")
    if kernel == "skinny_chunked":
        return Decision(op, kernel, f"T = {T} > {SKINNY_MAX_T} in batch-invariant mode: skinny_gemm "
                                    f"over {-(-T // SKINNY_MAX_T)} chunks of <= {SKINNY_MAX_T} rows "
                                    f"(invariant; reads the weight once per chunk)")
    if T <= SKINNY_MAX_T:
        return Decision(op, kernel, f"T = 1, float32, weight {weight.numel() * 4} bytes < "
                                    f"{SKINNY_F32_T1_MIN_BYTES}: MKL's SGEMV beats skinny_gemm by ~0.3 us; {lib}")
    return Decision(op, kernel, f"T = {T} > {SKINNY_MAX_T}: {lib}")


_EXPLAINERS = {"router_gemm": router_gemm_decision, "route": route_decision,
               "permute": permute_decision, "unpermute": unpermute_decision,
               "unquantized_gemm": unquantized_gemm_decision}


def explain(op: str, *args, **kwargs) -> Decision:
    """Which kernel `optimized.<op>(*args, **kwargs)` would run, and why."""
    if op in _GPU_POLICIES and _on_gpu(args):
        return gpu_decision(op, *args, **kwargs)
    if op not in _EXPLAINERS:
        raise ValueError(f"explain: argument 'op' must be one of {', '.join(sorted(_EXPLAINERS))}; got {op!r}")
    return _EXPLAINERS[op](*args, **kwargs)


# ------------------------------------------------------------------ GPU (CUDA and ROCm)
# What each op does with tensors on a CUDA or ROCm device (torch calls both "cuda"); each
# op's decision function above delegates here. The moelab GPU kernels (csrc/gpu, csrc/hip)
# are used when the moelab_gpu extension is loaded (a CUDA/ROCm torch with nvcc/hipcc);
# otherwise the op's own fallback runs (reference, or F.linear for the GEMMs). The crossovers
# below were set before any GPU run; scripts/gpu_check.sh measures them. One H200 run so far
# (its gpu_bench output; CUDA graphs, one shape per op):
#   router_gemm: the fused cast faster than cast + GEMM at every T measured, 1..32, so the
#     limit of 32 stands;
#   skinny_gemm: faster than F.linear at T = 1, 2, 4 (K = 4096 and 7168) and at T = 8 for
#     K = 4096, slower at T = 8 for K = 7168: the limit of 8 is kept until T = 5..7 and more
#     shapes are measured;
#   fused_experts: see GPU_FUSED_EXPERTS_M_CROSS.
# One run of one shape per op is a lead, not a tuning: the values stay marked as such.
GPU_ROUTER_GEMM_MAX_T = 32     # one fused-cast launch (16-token chunks on grid.y) up to here
GPU_SKINNY_MAX_T = 8           # skinny_gemm's contract limit (F.linear beyond)
GPU_MEASURED = "set before a GPU run; one H200 run so far (scripts/gpu_check.sh)"


def _on_gpu(args) -> bool:
    for a in args:
        if hasattr(a, "device"):
            return a.device.type == "cuda"
    return False


def _gpu_platform() -> str:
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def _gpu_loaded() -> bool:
    return gpu.available()


def _gpu_router_gemm(x, weight) -> Decision:
    op, T = "router_gemm", x.shape[0]
    if not _gpu_loaded():
        return Decision(op, "library", "moelab GPU extension not built: F.linear(x.float(), w)")
    if T <= GPU_ROUTER_GEMM_MAX_T:
        return Decision(op, "moelab", f"T = {T} <= {GPU_ROUTER_GEMM_MAX_T}: fused-cast GPU kernel (16-byte bf16 "
                                      f"loads widened in registers, one launch; {GPU_MEASURED})")
    if _batch_invariant:
        return Decision(op, "moelab", "batch-invariant mode: fused-cast GPU kernel (16-token chunks on grid.y)")
    return Decision(op, "library", f"T = {T} > {GPU_ROUTER_GEMM_MAX_T}: F.linear(x.float(), w) (cuBLAS / "
                                   f"hipBLASLt; not batch invariant)")


def _gpu_unquantized_gemm(x, weight, bias=None) -> Decision:
    op, T, platform = "unquantized_gemm", x.shape[0], _gpu_platform()
    blas = "hipBLASLt/Tensile" if platform == "rocm" else "cuBLAS"
    if not _gpu_loaded():
        return Decision(op, "library", f"moelab GPU extension not built: F.linear ({blas})")
    if str(x.dtype) not in ("torch.bfloat16", "torch.float16", "torch.float32"):
        return Decision(op, "library", f"skinny_gemm does not take {x.dtype}: F.linear ({blas})")
    if T <= GPU_SKINNY_MAX_T:
        kernel = gpu.skinny_kernel(x.dtype, T, x.shape[1])
        return Decision(op, "skinny", f"{platform}, T = {T} <= {GPU_SKINNY_MAX_T}: {kernel} ({GPU_MEASURED})")
    if _batch_invariant:
        return Decision(op, "skinny_chunked", f"{platform}, T = {T} > {GPU_SKINNY_MAX_T} in batch-invariant mode: "
                                              f"skinny_gemm over chunks of {GPU_SKINNY_MAX_T} rows")
    return Decision(op, "library", f"{platform}, T = {T} > {GPU_SKINNY_MAX_T}: F.linear ({blas}; not batch invariant)")


def _gpu_route(logits, top_k, method=None, **kwargs) -> Decision:
    op = "route"
    if not _gpu_loaded():   # optimized.route then runs the reference
        return Decision(op, "reference", "moelab GPU extension not built: the reference implementation")
    return Decision(op, "moelab", f"GPU kernel, E = {logits.shape[1]}, K = {top_k}: "
                                  f"{gpu.route_plan(logits.shape[1], top_k)}")


def _gpu_permute(hidden, ids, *args, **kwargs) -> Decision:
    if not _gpu_loaded():
        return Decision("permute", "reference", "moelab GPU extension not built: the reference implementation")
    T, K = ids.shape[0], ids.shape[1]
    path = "1 fused planning block + 1 row-copy launch" if T * K <= 4096 else "3 planning launches + 1 row copy"
    return Decision("permute", "moelab", f"GPU stable counting sort, T*K = {T * K}: {path}")


def _gpu_unpermute(expert_out, weights, dst_pos) -> Decision:
    if not _gpu_loaded():
        return Decision("unpermute", "reference", "moelab GPU extension not built: the reference implementation")
    return Decision("unpermute", "moelab", "GPU weighted gather (f32, j ascending, no FMA; bit-identical)")


_GPU_POLICIES = {
    "router_gemm": _gpu_router_gemm,
    "unquantized_gemm": _gpu_unquantized_gemm,
    "route": _gpu_route,
    "permute": _gpu_permute,
    "unpermute": _gpu_unpermute,
}


def gpu_decision(op: str, *args, **kwargs) -> Decision:
    """The GPU policy of `op` (tensors on a CUDA/ROCm device): which kernel, and why."""
    return _GPU_POLICIES[op](*args, **kwargs)

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
#              `python -m optimized.tune` (stored outside the repository, see
#              optimized.tune.tune_file()), per ISA level and thread count: the kernels of
#              each level are different code, so a crossover is only used at the level it
#              was measured at. Without a tune entry for the level: the level's row of
#              FUSED_EXPERTS_DEFAULT_M_CROSS; a level with no row (nothing measured there)
#              takes per_block's m > 4.
#   Each row is what the tuner's measurement and rule chose at that level with cold weights
#              (`python -m experiments.micro tune_crossover`, under MOELAB_ISA=<level> for a
#              level below the CPU's); docs/fused_experts.md ("Dispatch") names each row's
#              machine, runs and results file. The kernels' balance differs between cores, not
#              only between levels, so `python -m optimized.tune` on the machine that runs the
#              model beats any row here.
FUSED_EXPERTS_GLOBAL_MAX_TINY_M = 4
FUSED_EXPERTS_DEFAULT_M_CROSS = {
    "avx512_bf16": {"bf16": 1, "fp8_block": 16, "mxfp4": 4},
    "avx512": {"bf16": 1, "fp8_block": 5, "mxfp4": 4},
    "avx2": {"bf16": 1, "fp8_block": 1, "mxfp4": 1},
}
_FE_POLICY_CODES = {"tiny": 0, "blocked": 1, "per_block": 2}   # FePolicy in csrc/cpu/fused_experts.h
_PER_BLOCK_M_CROSS = FUSED_EXPERTS_GLOBAL_MAX_TINY_M + 1


def default_m_cross(level: str, quant: str) -> tuple[int, str]:
    """auto's m_cross for a weight format at an ISA level with no tune entry, and its source."""
    table = FUSED_EXPERTS_DEFAULT_M_CROSS.get(level)
    if table is None:
        return (_PER_BLOCK_M_CROSS, f"default: nothing measured at level {level}, per_block's "
                                    f"m > {FUSED_EXPERTS_GLOBAL_MAX_TINY_M}")
    return table[quant], f"default for level {level}"


def _m_cross(level: str, threads: int, quant: str) -> tuple[int, str]:
    tuned, src = tune.entry("fused_experts", level, threads)
    if quant in tuned:
        return tuned[quant], src
    m, default = default_m_cross(level, quant)
    return m, f"{default} ({f'the tune entry has no {quant}' if tuned else src})"


_m_cross_memo: dict = {"generation": -1}   # (level, threads, quant) -> answer, per tune.generation


@torch._dynamo.assume_constant_result
def fused_experts_m_cross(quant: str) -> tuple[int, str]:
    """(m_cross, where it came from) of policy `auto` for a weight format, at the ISA level the
    kernels run at now and this process's torch thread count: the tune file's entry for that
    level (optimized.tune.entry; read on the first call), else the level's default. Answers
    are kept (a decode call cannot afford to rebuild them) until optimized.tune says they may
    have changed. Under torch.compile the call runs once while tracing and its answer is a
    constant of the graph (so the file is never read inside a compiled region)."""
    key = (tune.active_level(), torch.get_num_threads(), quant)
    memo = _m_cross_memo
    if memo["generation"] != tune.generation:
        memo.clear()
        memo["generation"] = tune.generation
    got = memo.get(key)
    if got is None:
        got = memo[key] = _m_cross(*key)
    return got


def reload_tuning() -> None:
    """Read the tune file again on the next decision (optimized.tune.reload)."""
    tune.reload()


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
    # CPU weight handling: "prepacked" (a PackedMoEWeights), "cached" (standard layout through
    # optimized.pack_cache: `packs` experts packed by this call, 0 = all reused) or "unpacked"
    # (standard layout, every routed tile repacked in scratch; `packs` = -1); "" on the GPU.
    packing: str = ""
    packs: int = -1
    packing_reason: str = ""

    @property
    def counts(self) -> dict:
        return dict(self.blocks)

    def __str__(self) -> str:
        c = self.counts
        return (f"{self.op}: {self.kernel} ({c.get('tiny', 0)} tiny, {c.get('blocked', 0)} blocked "
                f"blocks; {self.reason})" + (f"; {self.packing_reason}" if self.packing_reason else ""))


def fused_experts_decision(x, w13, w2, topk_weights, topk_ids, *, quant, dispatch="auto", w13_scale=None,
                           w2_scale=None, **_) -> FusedExpertsDecision:
    """Which kernel each expert block of `optimized.fused_experts(...)` takes, with counts, and
    how the call gets its packed weights: prepacked, the pack cache (how many experts it would
    pack now; 0 = reuses the cache) or the unpacked path. Reads topk_ids (the block sizes);
    the call itself does not. Packs and allocates nothing."""
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
    if hasattr(w13, "E"):
        packing, packs, why = "prepacked", 0, "prepacked weights (PackedMoEWeights): nothing to pack"
    elif ids.numel() == 0:
        packing, packs, why = "unpacked", -1, "no rows: nothing runs"
    else:
        why, packs = pack_cache.explain(w13, w2, w13_scale, w2_scale, quant, topk_ids)
        packing = "unpacked" if packs < 0 else "cached"
    return FusedExpertsDecision("fused_experts", kernel, reason, policy=dispatch, m_cross=m_cross,
                                blocks=(("tiny", n_tiny), ("blocked", n_blocked)), packing=packing, packs=packs,
                                packing_reason=why)


_EXPLAINERS["fused_experts"] = fused_experts_decision


# ------------------------------------------------------------ fused_experts on the GPU
# csrc/gpu/fused_experts.cu runs, per expert block of m rows, one of two paths (the CPU's
# names and policy codes, so both bindings take the same numbers):
#   tiny    = the small-m path: a block of 4 warps streams 4 weight rows, dequantizes them in
#             registers and applies them to a unit of <= 8 rows (1, 2, 4 or 8 from T); K is
#             split across the lanes in a fixed order, independent of T and m.
#   blocked = the tiled path: a 64x64 weight tile dequantized once into shared memory as
#             bf16, reused by up to 64 rows: tensor cores (mma.sync m16n8k16) on CUDA sm_80+,
#             a SIMT register tile on ROCm (and in the CPU emulator).
# Policies as on the CPU: tiny / blocked (every block), global (one choice from avg_m),
# per_block (blocked iff m > 4), auto (per_block with GPU_FUSED_EXPERTS_M_CROSS).
# Batch invariance: a tensor core adds its products in an order the hardware fixes, and a
# block's path follows its m, which depends on the batch; so in batch-invariant mode every
# block takes the small-m path, whatever `dispatch` says (its order depends on K only).
# The crossover: a block of m <= 8 rows is one small-path unit (one pass over the weights),
# beyond that the small path re-reads the expert's weights (from L2) for every 8 rows while
# the tiled path reads them once per 64 rows; experiments/gpu_bench.py times both policies on
# an all-to-one routing. The one H200 run (Qwen3-30B-A3B fp8, scripts/gpu_check.sh)
# puts it between m = 16 and 32 (the tiled path's time nearly flat in m, the small path's
# growing with it), so "tiled iff m >= 16" costs a few percent at m = 16 only.
GPU_FUSED_EXPERTS_M_CROSS = {"bf16": 16, "fp8_block": 16, "mxfp4": 16}


def fused_experts_gpu_plan(T: int, K: int, E: int, quant: str, dispatch: str) -> tuple[int, int, str]:
    """The CUDA/ROCm op's (policy code, m_cross) for a call and a one-line reason (shapes only)."""
    if _batch_invariant:
        return (_FE_POLICY_CODES["tiny"], 0,
                f"batch-invariant mode: every block on the small-m path (dispatch='{dispatch}' overridden; "
                f"the tensor-core path's accumulation order is the hardware's)")
    if dispatch != "auto":
        code, m_cross, reason = fused_experts_plan(T, K, E, quant, dispatch)
        return code, m_cross, reason
    m = GPU_FUSED_EXPERTS_M_CROSS[quant]
    return _FE_POLICY_CODES["per_block"], m, f"auto: per_block, tiled iff m >= {m} ({GPU_MEASURED})"


def _gpu_fused_experts(x, w13, w2, topk_weights, topk_ids, *, quant, dispatch="auto", **_) -> Decision:
    op = "fused_experts"
    if not _gpu_loaded():
        return Decision(op, "reference", "moelab GPU extension not built: the reference implementation")
    T, K = topk_ids.shape
    E = w13.shape[0]
    code, m_cross, reason = fused_experts_gpu_plan(T, K, E, quant, dispatch)
    tiled = ("mma.sync m16n8k16 tensor cores (CUDA sm_80+)" if _gpu_platform() == "cuda"
             else "SIMT register tiles (ROCm)")
    how = (f"tiny = small-m path (warp-streamed weights dequantized in registers, units of <= 8 rows, "
           f"batch invariant); blocked = tiled path (64x64 bf16 weight tile in shared memory, {tiled})")
    sizes = None
    if isinstance(topk_ids, torch.Tensor):
        ids = topk_ids.reshape(-1).to("cpu", torch.int64)
        ids = ids[(ids >= 0) & (ids < E)]
        sizes = torch.bincount(ids, minlength=E) if ids.numel() else torch.zeros(E, dtype=torch.int64)
        sizes = sizes[sizes > 0]
    if sizes is None:
        return FusedExpertsDecision(op, {0: "tiny", 1: "blocked", 2: "per_block"}[code], f"{reason}; {how}",
                                    policy=dispatch, m_cross=m_cross)
    n_blocked = 0 if code == 0 else int(sizes.numel()) if code == 1 else int((sizes >= m_cross).sum())
    n_tiny = int(sizes.numel()) - n_blocked
    kernel = "none" if sizes.numel() == 0 else "tiny" if n_blocked == 0 else "blocked" if n_tiny == 0 else "mixed"
    return FusedExpertsDecision(op, kernel, f"{reason}; {how}", policy=dispatch, m_cross=m_cross,
                                blocks=(("tiny", n_tiny), ("blocked", n_blocked)))


_GPU_POLICIES["fused_experts"] = _gpu_fused_experts
