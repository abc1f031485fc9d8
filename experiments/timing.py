"""A small benchmark library: side-by-side timing, floors, and a machine stamp.

These machines are shared and noisy, so speeds are compared as ratios measured side by
side in one run: `compare` runs the candidates interleaved, round after round, and reports
per candidate the median time with its spread (IQR) and, against the first candidate (the
baseline), the median of the per-round ratios. Each round times every candidate with
torch.utils.benchmark (which warms up first) for at least `min_time` seconds; with
`cuda=True` it times with CUDA events around back-to-back calls instead (the host returns
before the GPU finishes, so wall-clock timers would measure the launch only).

Every result is stamped with where it was measured (`machine()`: CPU model, ISA level in use,
threads, torch, load average; GPU, CUDA and driver when a GPU is there) and `write_csv` puts
rows under experiments/results/<machine_id()>/ with that stamp in every row.
"""
from __future__ import annotations

import csv
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.utils.benchmark as tb


@dataclass
class Timing:
    name: str
    times: list[float] = field(default_factory=list)   # seconds per call, one per round

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def iqr(self) -> float:
        if len(self.times) < 2:
            return 0.0
        q = statistics.quantiles(self.times, n=4)
        return q[2] - q[0]


def _time_once(fn: Callable[[], object], min_time: float) -> float:
    m = tb.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return m.blocked_autorange(min_run_time=min_time).median


def _time_once_cuda(fn: Callable[[], object], min_time: float) -> float:
    """Seconds per call on the current CUDA stream: CUDA events around n back-to-back calls,
    n doubled until the n calls take at least min_time."""
    n = 1
    while True:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        t = a.elapsed_time(b) / 1e3
        if t >= min_time or n >= 1 << 16:
            return t / n
        n *= 2


def compare(candidates: dict[str, Callable[[], object]], *, rounds: int = 5,
            min_time: float = 0.05, cuda: bool = False) -> dict[str, Timing]:
    """Interleaved timing of several callables doing the same work; the first is the baseline.
    cuda=True: the callables launch GPU work; time it with CUDA events."""
    out = {name: Timing(name) for name in candidates}
    for fn in candidates.values():   # warm caches, JIT, allocator
        fn()
    if cuda:
        torch.cuda.synchronize()
    once = _time_once_cuda if cuda else _time_once
    for _ in range(rounds):
        for name, fn in candidates.items():
            out[name].times.append(once(fn, min_time))
    return out


def ratio(base: Timing, other: Timing) -> tuple[float, float, float]:
    """Speedup of `other` over `base`: (median, min, max) of the per-round ratios."""
    r = [b / o for b, o in zip(base.times, other.times)]
    return statistics.median(r), min(r), max(r)


# ------------------------------------------------------------------- the DRAM read floor
_HUGE = 2 << 20                      # a transparent huge page (x86-64)
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15
STREAMS = (1, 2, 4, 8, 16)           # read_stream's streams per thread that read_bandwidth tries,
PREFETCH = (0, 16)                   # each without and with a software prefetch (blocks ahead)


def stream_buffer(nbytes: int, huge: bool = True, fill: int = 1) -> torch.Tensor:
    """A contiguous uint8 tensor of nbytes whose 2 MiB-aligned body is advised before its first
    write as transparent huge pages (huge=True: madvise MADV_HUGEPAGE, as the packed expert
    weights are) or as 4 KiB pages (MADV_NOHUGEPAGE), then filled with `fill`. The advice is
    only advice (Linux; a no-op elsewhere or where THP is off): `huge_page_bytes` says what the
    kernel gave."""
    raw = torch.empty(int(nbytes) + _HUGE, dtype=torch.uint8)
    p = raw.data_ptr()
    a = (p + _HUGE - 1) // _HUGE * _HUGE
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise(a, (int(nbytes) + _HUGE - 1) // _HUGE * _HUGE,
                         _MADV_HUGEPAGE if huge else _MADV_NOHUGEPAGE)
        except (OSError, AttributeError):
            pass
    buf = raw[a - p: a - p + int(nbytes)]
    buf.fill_(fill)
    return buf


def smaps_field(addr: int, field: str) -> list[str] | None:
    """The values of `field` (e.g. "AnonHugePages:", "VmFlags:") of the mapping of this process
    that holds addr, from /proc/self/smaps; None where there is no such mapping or file."""
    try:
        inside = False
        for line in open("/proc/self/smaps"):
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field:
                return line.split()[1:]
    except (OSError, ValueError):
        pass
    return None


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping holding t's middle byte that are backed by transparent huge pages
    (AnonHugePages in /proc/self/smaps); -1 where that cannot be read."""
    kb = smaps_field(t.data_ptr() + t.numel() * t.element_size() // 2, "AnonHugePages:")
    return int(kb[0]) << 10 if kb else -1


def read_stream_timings(buf: torch.Tensor, streams=STREAMS, prefetch=PREFETCH, rounds: int = 3,
                        min_time: float = 0.05) -> dict[tuple[int, int], Timing]:
    """Per (streams per thread S, prefetch distance in blocks): the time of one
    moelab::read_stream pass over buf on this run's threads (interleaved rounds, `compare`).
    One call is checked first against the buffer's byte sum (torch), so a probe that skipped
    bytes would raise rather than time."""
    import optimized   # noqa: F401  (builds and loads the extension: registers torch.ops.moelab)
    op = torch.ops.moelab.read_stream
    want = int(buf.sum(dtype=torch.int64))
    got = op(buf, 1, 0)
    if got != want:
        raise RuntimeError(f"moelab::read_stream read {got}, the buffer sums to {want}")
    return compare({(s, d): (lambda s=s, d=d: op(buf, s, d)) for d in prefetch for s in streams},
                   rounds=rounds, min_time=min_time)


_read_bw: dict[tuple[int, int], float] = {}
_probe: dict[tuple[int, int], tuple] = {}   # (nbytes, threads) -> (buffer, best (S, prefetch))
_read_bw_sum: dict[tuple[int, int], float] = {}


def read_bandwidth(nbytes: int = 256 << 20, rounds: int = 3, min_time: float = 0.05) -> float:
    """The DRAM read floor in bytes/s on this run's threads: the most a read-only stream gets
    on this machine. Measured with moelab::read_stream (csrc/torch/bench_probe.cpp), a probe
    that only reads: 64-byte vector loads over a buffer of nbytes (far above the last-level
    cache) in transparent huge pages (where the packed weights live), split across the torch
    threads and, per thread, over S interleaved streams so each core keeps many misses in flight,
    with and without a software prefetch ahead of each stream. The best over S in STREAMS, the
    prefetch distances in PREFETCH and the interleaved rounds: the fastest pass, not a median,
    because this shared machine's bandwidth changes regime within a run (2 threads: 35 to 66
    GB/s, results/amd-epyc-zen-5-2c-avx512_bf16/read_bandwidth.txt), and a floor must hold in the fast phase too.
    No kernel that must read those bytes can read them faster, so a bench row's fraction of it
    is at most 1 up to noise.
    (The earlier probe, a torch f32 sum over 4 KiB pages, is `read_bandwidth_torch_sum`: our
    fp8 decode kernel read 115% of it.) Memoized per (nbytes, threads) for the run;
    experiments.bench clears it before each table."""
    key = (int(nbytes), torch.get_num_threads())
    if key not in _read_bw:
        buf = stream_buffer(nbytes, huge=True)
        t = read_stream_timings(buf, rounds=rounds, min_time=min_time)
        best = min(t, key=lambda k: min(t[k].times))
        _read_bw[key] = nbytes / min(t[best].times)
        _probe[key] = (buf, best)
    return _read_bw[key]


def read_probe(nbytes: int = 256 << 20) -> tuple[Callable[[], object], int]:
    """(one pass of this run's best read_bandwidth setting, the bytes it reads): for timing the
    probe in the same interleaved rounds as a benchmark row, so a row and its floor see the same
    phase of a machine whose bandwidth changes regime within a run (experiments.bench)."""
    read_bandwidth(nbytes)
    buf, (s, d) = _probe[(int(nbytes), torch.get_num_threads())]
    op = torch.ops.moelab.read_stream
    return (lambda: op(buf, s, d)), int(nbytes)


def read_bandwidth_torch_sum(nbytes: int = 256 << 20) -> float:
    """The old read-bandwidth probe, kept for comparison: bytes/s of a torch f32 sum over
    nbytes in ordinary (4 KiB) pages on this run's threads, median of 3 rounds. Not a floor:
    torch's sum reads slower than a kernel streaming huge pages (see read_bandwidth)."""
    key = (int(nbytes), torch.get_num_threads())
    if key not in _read_bw_sum:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        t = compare({"sum": lambda: x.sum()}, rounds=3, min_time=0.2)["sum"].median
        _read_bw_sum[key] = nbytes / t
    return _read_bw_sum[key]


def llc_bytes() -> int:
    """Size of the largest CPU cache (the last level), from sysfs; 32 MiB where it cannot be read."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or (32 << 20)


_cache_bw: dict[int, float] = {}


def cache_bandwidth(nbytes: int) -> float:
    """Bytes/s over a working set that stays in the caches, on this run's threads: the faster of
    an f32 sum over a buffer of `size` bytes (bytes read) and a copy between two buffers of size/2
    (bytes read + written), size = max(nbytes, 1 MiB) (below 1 MiB the call overhead, not the
    cache, would decide). The fastest pass of interleaved rounds, as the read probe takes its
    fastest (a floor is what the machine can do, so a median of a noisy machine's passes is
    not one); memoized per size for the run. A
    benchmark row's floor at its own working-set size: whatever of it stays resident between
    calls stays resident here too (also just above the last-level cache, where part of it does)."""
    size = max(int(nbytes), 1 << 20)
    size -= size % 8
    if size not in _cache_bw:
        x = torch.ones(size // 4, dtype=torch.float32)
        a, b = torch.ones(size // 8, dtype=torch.float32), torch.empty(size // 8, dtype=torch.float32)
        t = compare({"sum": lambda: x.sum(), "copy": lambda: b.copy_(a)}, rounds=3, min_time=0.05)
        _cache_bw[size] = max(size / min(t["sum"].times), size / min(t["copy"].times))
    return _cache_bw[size]


# Core names of the (vendor, family) -> model ranges whose CPUs a hypervisor often reports under a
# generic model name ("AMD EPYC", "Intel(R) Xeon(R) Processor"): Zen 2 and Zen 3 EPYCs would
# otherwise share a results folder.
_CORES = {
    ("AuthenticAMD", 0x17): [(0x00, 0x2f, "Zen"), (0x30, 0xff, "Zen 2")],
    ("AuthenticAMD", 0x19): [(0x00, 0x0f, "Zen 3"), (0x10, 0x1f, "Zen 4"), (0x20, 0x5f, "Zen 3"),
                             (0x60, 0x7f, "Zen 4"), (0xa0, 0xaf, "Zen 4")],
    ("AuthenticAMD", 0x1a): [(0x00, 0xff, "Zen 5")],
    ("GenuineIntel", 6): [(0x55, 0x55, "Skylake-SP"), (0x6a, 0x6c, "Ice Lake-SP"),
                          (0x8f, 0x8f, "Sapphire Rapids"), (0xcf, 0xcf, "Emerald Rapids"),
                          (0xad, 0xae, "Granite Rapids")],
}


def core_name(vendor: str, family: int, model: int) -> str:
    """The core of a CPU from its cpuid vendor, family and model, e.g. `Zen 3`, or `family F
    model M` when the table above does not know it."""
    for lo, hi, name in _CORES.get((vendor, family), []):
        if lo <= model <= hi:
            return name
    return f"family {family} model {model}"


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name; a name with no model number in it (a hypervisor's generic one)
    gets its core in parentheses, e.g. `AMD EPYC (Zen 3)`."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return platform.processor() or "unknown"
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break   # the first processor's block is enough
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or "unknown"
    if any(c.isdigit() for c in name):
        return name
    try:
        core = core_name(fields.get("vendor_id", ""), int(fields["cpu family"]), int(fields["model"]))
    except (KeyError, ValueError):
        return name
    return f"{name} ({core})"


# MOELAB_ISA caps our kernels' level; a capped run stands in for a CPU of that level only if the
# baselines and peers run that level too. ATen's vectorized kernels, MKL's sgemm and oneDNN
# (torch's bf16 matmul, vLLM's onednn_mm) each choose their code once, when they load, from these
# variables, so a capped run sets them before anything loads (cap_libraries).
LIBRARY_CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
}


def cap_libraries() -> None:
    """Under MOELAB_ISA=avx2 or avx512, restart this process (same command line) with the
    LIBRARY_CAPS variables that are not set yet, so torch, MKL and oneDNN run that level like
    our kernels. Variables already set are kept; on a CPU of that level the caps change nothing.
    Called by the entry points (`if __name__ == "__main__"`), before any work: torch has read
    ATEN_CPU_CAPABILITY at import, and a main() called in-process (by a test) must not restart."""
    want = LIBRARY_CAPS.get(os.environ.get("MOELAB_ISA", "").strip().lower(), {})
    missing = {k: v for k, v in want.items() if k not in os.environ}
    if missing:
        sys.stdout.flush()
        os.execve(sys.executable, sys.orig_argv, {**os.environ, **missing})


def library_caps() -> str:
    """The LIBRARY_CAPS variables in effect, for the stamps: 'ATEN_CPU_CAPABILITY=avx2 ...' or ''."""
    names = sorted({k for caps in LIBRARY_CAPS.values() for k in caps})
    return " ".join(f"{k}={os.environ[k]}" for k in names if k in os.environ)


def machine() -> dict[str, str]:
    """Where a result was measured: CPU model, ISA used, threads, torch version, the 1-minute
    load average now (above `cores` the machine was shared while measuring), and the GPU,
    its CUDA/HIP version and driver when torch sees one."""
    caps = library_caps()
    info = {"cpu": cpu_name(), "threads": str(torch.get_num_threads()),
            "torch": torch.__version__ + (f" ({caps})" if caps else ""), "cores": str(os.cpu_count())}
    try:
        import optimized
        info["isa"] = optimized.backend_info().get("active", "?")
    except Exception as exc:  # the extension may be unavailable; say so
        info["isa"] = f"unavailable ({type(exc).__name__})"
    try:
        info["load"] = f"{os.getloadavg()[0]:.1f}"
    except OSError:
        info["load"] = "?"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda or f"hip {getattr(torch.version, 'hip', '')}"
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip() or "?"
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "?"
    return info


def machine_id() -> str:
    """A short folder-friendly name of this machine and the ISA level the kernels run at,
    for results/<machine>/: CPU model (cpu_name), core count and level, e.g.
    `amd-epyc-zen-3-2c-avx2`; a level capped below the CPU's (MOELAB_ISA) says so, e.g.
    `amd-epyc-zen-5-2c-avx2-capped`, so results of
    two CPUs, or of two levels of one CPU, never share a folder. The threads a result used
    are in its stamp."""
    m = machine()
    cpu = "".join(c if c.isalnum() else "-" for c in m["cpu"]).strip("-").lower()
    while "--" in cpu:
        cpu = cpu.replace("--", "-")
    return f"{cpu[:40]}-{m['cores']}c-{isa_tag()}"


def isa_tag() -> str:
    """The active ISA level, with `-capped` when MOELAB_ISA (or set_isa) holds it below what
    the CPU runs; `noext` when the extension cannot be loaded."""
    try:
        import optimized
        info = optimized.backend_info()
    except Exception:  # the extension may be unavailable; results still get a folder
        return "noext"
    return info["active"] + ("-capped" if info["active"] != info["detected"] else "")


def results_dir(root: str | os.PathLike | None = None) -> Path:
    """<root>/<machine_id()>: root is $MOELAB_RESULTS_DIR, else experiments/results."""
    root = root or os.environ.get("MOELAB_RESULTS_DIR") or Path(__file__).resolve().parent / "results"
    return Path(root) / machine_id()


def write_csv(name: str, rows: list[dict], root: str | os.PathLike | None = None,
              **extra: str) -> Path:
    """Write rows to results_dir(root)/<name>.csv, each row stamped with machine_id, the
    machine() fields and `extra` (e.g. mode=...). Returns the path."""
    stamp = {"machine_id": machine_id(), **machine(), **extra}
    path = results_dir(root) / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**r, **stamp} for r in rows]
    names = list(dict.fromkeys(k for r in rows for k in r)) or list(stamp)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names, restval="")
        w.writeheader()
        w.writerows(rows)
    return path


def commit() -> str:
    """The checkout's commit (short hash), with `+dirty` when tracked files differ from it:
    a result of uncommitted code says so. `unknown` outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def provenance(command: str) -> str:
    """The lines a canonical result file opens with: the command that regenerates it, the
    commit, the UTC time, the machine (CPU, cores, ISA detected / active, torch) and the load
    average at the start (above the core count the machine was shared while measuring).
    Threads and the read bandwidth are per table, in each table's own header."""
    import datetime
    m = machine()
    try:
        import optimized
        info = optimized.backend_info()
        isa = f"{info['active']} (CPU: {info['detected']})"
    except Exception as exc:  # the extension may be unavailable; say so
        isa = f"unavailable ({type(exc).__name__})"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if os.environ.get("MOELAB_ISA"):   # a capped run is rerun capped
        command = f"MOELAB_ISA={os.environ['MOELAB_ISA']} {command}"
    return (f"# command: {command}\n# commit: {commit()}\n# date: {now}\n"
            f"# machine: {m['cpu']}, {m['cores']} cores, ISA {isa}, torch {m['torch']}\n"
            f"# load average at start: {m['load']}\n")


def save_result(name: str, header: str, text: str, rows: list[dict] | None = None,
                root: str | os.PathLike | None = None) -> Path:
    """Write the canonical output of one benchmark: results_dir(root)/<name>.txt (`header`,
    provenance() taken when the run started, then `text`) and, given `rows`, <name>.csv beside it. The same command writes the same
    name, so a rerun replaces the file: one output per benchmark and machine, its history in
    git. Returns the .txt path."""
    folder = results_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.txt"
    path.write_text(header + text)
    if rows:
        names = list(dict.fromkeys(k for r in rows for k in r))
        with open(folder / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=names, restval="")
            w.writeheader()
            w.writerows(rows)
    return path


class Rotating:
    """Cycles through copies of an op's arguments so each call reads cold memory.

    Decode kernels are judged against DRAM bandwidth: in a real model every layer has its
    own weights, so they do not sit in the cache between calls. Timing one small weight in a
    loop measures the cache instead (a pitfall DESIGN.md names). `Rotating(make, nbytes)`
    builds enough copies (make() each) that together they exceed `cold_bytes`, and at least
    `min_copies` (more copies average over where each one happens to sit in memory).
    `cold_bytes` defaults to twice the last-level cache and at least 384 MiB: a fixed count
    of copies is not enough, a 300 MB L3 holds 64 copies of a 3 MB gate weight. `max_copies`
    only bounds the Python objects for weights of a few KB.
    """

    def __init__(self, make: Callable[[], object], nbytes: int, cold_bytes: int | None = None,
                 max_copies: int = 4096, min_copies: int = 2):
        if cold_bytes is None:
            cold_bytes = max(384 << 20, 2 * llc_bytes())
        n = max(min_copies, min(max_copies, -(-cold_bytes // max(nbytes, 1))))
        self.items = [make() for _ in range(n)]
        self.i = 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]
