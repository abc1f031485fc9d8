"""The GPU emulator's hardware rules (optimized/csrc/gpu/emu/emu.h, docs/gpu.md) and the coverage
of the kernels' large-shape loops and tiers.

Rules: each has a negative control (optimized/csrc/gpu/emu/rule_controls.cpp), a tiny kernel
that breaks the rule when planted and keeps it otherwise: the plant must fail the launch with
the rule's message and the clean variant must pass, at both warp widths. The real kernels run
under the same rules in tests/test_gpu_emulated.py, so a kernel that broke one would fail there.

Coverage: emulated cases that reach what tiny shapes never do, each reach checked rather than
hoped for: the grid-stride loops (the launchers' grid caps lowered to 2 blocks through the
emulator, so every such loop iterates; the launch log shows the capped grids, and the results
must equal the uncapped ones bit for bit), more than 1024 local experts in permute (fused and
multi-block paths), more than 256 experts in fused_experts' plan, and tiled units with m > 64
(each such case puts rows where only the second loop iteration or unit can compute them, so a
skipped iteration leaves the output's NaN poison and fails the comparison).
"""
from __future__ import annotations

import pytest
import torch

import reference

from . import gpu_emu

WARPS = [32, 64]
RULES = pytest.mark.skipif(gpu_emu.SANITIZE, reason="the sanitized (ASan) emulator build has no access hooks: "
                           "ThreadSanitizer's instrumentation, which carries them, cannot be combined with ASan")


@pytest.fixture(scope="module", params=WARPS, ids=lambda w: f"warp{w}")
def emu(request):
    return gpu_emu.load(request.param)


@pytest.fixture(scope="module")
def emu_mma():
    return gpu_emu.load(32, mma=True)


# ------------------------------------------------------------------------- rule controls
@RULES
def test_builds_say_what_they_check(emu, emu_mma):
    assert emu.rules and emu_mma.rules
    assert not emu.has_mma and emu_mma.has_mma and emu_mma.warp_size() == 32


@RULES
def test_race_write_after_read_across_a_collective(emu):
    assert (emu.control_war(0) == 10 if emu.warp_size() == 32 else emu.control_war(0) == 3).all()
    with pytest.raises(RuntimeError, match=r"shared-memory race \(write after read\)"):
        emu.control_war(1)


@RULES
def test_cp_async_lands_at_its_wait(emu):
    """cp.async (32-lane builds: the CUDA sm_80+ branch): the data lands at the issuing thread's
    wait; reading it before the wait, reading another thread's copy with no barrier after the
    waits, waiting for fewer groups than were read, or exiting with copies pending fails. On
    the 64-lane (HIP) build cp_async16 is a plain copy: the correct kernel gives the same data."""
    t = torch.arange(128)
    want = (4 * t).float() + (4 * (128 + (t + 1) % 128) + 1).float()   # own first word + neighbour's second
    assert torch.equal(emu.control_cp_async(0), want)
    if emu.warp_size() != 32:
        return
    with pytest.raises(RuntimeError, match=r"load of a cp\.async destination .* before thread \d+'s cp\.async wait"):
        emu.control_cp_async(1)
    with pytest.raises(RuntimeError, match=r"shared-memory race \(read after write\)|load of a cp\.async destination"):
        emu.control_cp_async(2)
    with pytest.raises(RuntimeError, match=r"exited with cp\.async copies it never waited for"):
        emu.control_cp_async(3)
    with pytest.raises(RuntimeError, match=r"load of a cp\.async destination"):
        emu.control_cp_async(4)


@RULES
def test_race_shuffle_does_not_order_a_warp(emu):
    """A write, a shuffle, a read by another lane: a race unless warp_sync sits between them
    (CUDA: __syncwarp; HIP: the wave barrier between its release and acquire fences)."""
    out = emu.control_warp_order(0)
    assert out[1].item() == 42 and out[0].item() == 0
    with pytest.raises(RuntimeError, match=r"shared-memory race \(read after write\)"):
        emu.control_warp_order(1)
    if emu.warp_size() == 64:   # the fences are modelled: a bare wave barrier does not order
        with pytest.raises(RuntimeError, match=r"shared-memory race \(read after write\)"):
            emu.control_warp_order(2)


@RULES
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_uninitialised_shared_memory_at_every_block_start(emu, dynamic):
    """Two blocks; with the plant the second leaves one element unwritten, which on a GPU would
    hold whatever the previous block left: the read must fail, in static and dynamic memory."""
    out = emu.control_uninit(dynamic, 0)
    assert torch.equal(out[0], torch.arange(128).roll(1).float()) and torch.equal(out[1], out[0])
    kind = "dynamic" if dynamic else "static"
    with pytest.raises(RuntimeError, match=f"read of uninitialised {kind} shared memory"):
        emu.control_uninit(dynamic, 1)


@RULES
@pytest.mark.parametrize("shared", [False, True], ids=["global", "shared"])
def test_vector_accesses_are_naturally_aligned(emu, shared):
    assert emu.control_vector_load(16, 16, shared) == 5 and emu.control_vector_load(8, 8, shared) == 3
    for off, size in ((4, 16), (8, 16), (4, 8)):
        with pytest.raises(RuntimeError, match=f"misaligned {size}-byte vector load"):
            emu.control_vector_load(off, size, shared)


@RULES
def test_collectives_are_matched_by_call_site(emu):
    W = emu.warp_size()
    assert torch.equal(emu.control_divergent(0), torch.arange(2 * W, dtype=torch.int32) ^ 1)
    with pytest.raises(RuntimeError, match="different collectives .*another call site"):
        emu.control_divergent(1)
    with pytest.raises(RuntimeError, match="different __syncthreads"):
        emu.control_divergent(2)


def test_blocks_do_not_run_in_index_order(emu):
    """Block b reads block b-1's store in the same launch: right only if blocks ran 0, 1, ...
    The emulator runs them in a shuffled order, so such a kernel gives wrong results."""
    assert not torch.equal(emu.control_chain(16), torch.arange(1, 17, dtype=torch.int32))


# ---------------------------------------------------------------------- tensor cores
def test_mma_fragment_layout_and_its_plants(emu_mma, emu):
    """The emulated mma.sync m16n8k16 with fragments loaded as the PTX ISA lays them out gives
    A . W^T exactly (small integers); a swapped A register pair or swapped B ownership does not.
    The SIMT builds have no tensor-core branch (the control says so by returning None)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-8, 9, (16, 16), generator=g).bfloat16()
    w = torch.randint(-8, 9, (8, 16), generator=g).bfloat16()
    want = a.float() @ w.float().T
    assert torch.equal(emu_mma.control_mma(a.view(torch.int16), w.view(torch.int16), 0), want)
    for plant in (1, 2):
        assert not torch.equal(emu_mma.control_mma(a.view(torch.int16), w.view(torch.int16), plant), want), plant
    assert emu.control_mma(a.view(torch.int16), w.view(torch.int16), 0) is None


LDMATRIX_ROWS = torch.arange(1, 257, dtype=torch.int32).to(torch.int16).view(32, 8)


def test_ldmatrix_fragment_layout_and_its_plants(emu_mma, emu):
    """ldmatrix.x4 as the PTX ISA defines it: lane l hands in row l % 8 of matrix l / 8, lane t
    receives in register i the elements (row t / 4, columns 2 (t % 4), +1) of matrix i, the
    lower column in the low half. A row address off 16 bytes (plant 2) fails in every build. The
    SIMT builds have no ldmatrix (None)."""
    rows = LDMATRIX_ROWS
    got = emu_mma.control_ldmatrix(rows, 0)
    v = rows.to(torch.int64) & 0xFFFF
    want = torch.empty(32, 4, dtype=torch.int64)
    for t in range(32):
        for i in range(4):
            r, c = 8 * i + t // 4, 2 * (t % 4)
            want[t, i] = v[r, c] | (v[r, c + 1] << 16)
    assert torch.equal(got.to(torch.int64) & 0xFFFFFFFF, want)
    with pytest.raises(RuntimeError, match="misaligned"):
        emu_mma.control_ldmatrix(rows, 2)
    assert emu.control_ldmatrix(rows, 0) is None


@RULES
def test_ldmatrix_reads_obey_the_shared_memory_rules(emu_mma):
    """ldmatrix's row reads are shared-memory reads: without the barrier after another warp's
    stores (plant 1) the read is a race or an uninitialised read, and a global address (plant 3)
    fails. Both verdicts need the shared ranges that only the rule-checking build records."""
    with pytest.raises(RuntimeError, match=r"shared-memory race \(read after write\)|read of uninitialised static shared memory"):
        emu_mma.control_ldmatrix(LDMATRIX_ROWS, 1)
    with pytest.raises(RuntimeError, match="ldmatrix from .* not shared memory"):
        emu_mma.control_ldmatrix(LDMATRIX_ROWS, 3)


def test_hardware_bf16_rounding(emu_mma, emu):
    """round_bf16 is cvt.rn.bf16.f32 in the MMA build (NaN -> the canonical 0x7fff), the integer
    rounding elsewhere (the NaN's payload kept, quieted); both round to nearest even."""
    x = torch.tensor([float("nan"), 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -0.0, 3.0e38, 1e-40, float("-inf")])
    want = x.bfloat16().float()
    for m, nan_bits in ((emu_mma, 0x7FFF0000), (emu, 0x7FC00000)):
        y = m.round_bf16(x)
        assert torch.equal(y[1:].view(torch.int32), want[1:].view(torch.int32))
        assert y[:1].view(torch.int32).item() == nan_bits


# -------------------------------------------------------------------------- coverage
def _log(m):
    """The launch log as [name, gx, gy, gz, bx, by, bz] (names of templates have spaces)."""
    out = []
    for line in m.launch_log():
        name, *dims = line.rsplit(" ", 6)
        out.append([name.strip("()").split("<")[0], *map(int, dims)])
    return out


class capped:
    """The launchers' grid caps lowered to n blocks per dimension while inside."""

    def __init__(self, m, n):
        self.m, self.n = m, n

    def __enter__(self):
        self.hits = self.m.grid_cap_hits()
        self.m.clear_launch_log()
        self.m.set_grid_cap(self.n)
        return self

    def __exit__(self, *exc):
        self.m.set_grid_cap(0)
        self.capped = self.m.grid_cap_hits() - self.hits
        self.log = _log(self.m)


def _same(a, b):
    nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return a.shape == b.shape and bool(((a.view(torch.int16) == b.view(torch.int16)) | nan).all())


def _fe_loads(include_mma=True):
    return [32, 64] + (["32mma"] if include_mma else [])


def _load(key):
    return gpu_emu.load(32, mma=True) if key == "32mma" else gpu_emu.load(key)


@pytest.mark.parametrize("key", _fe_loads(), ids=lambda k: f"warp{k}")
@pytest.mark.parametrize("weighted_input", [False, True])
def test_grid_stride_loops_of_fused_experts(key, weighted_input):
    """Every fused_experts grid-stride loop (GEMM work items, activation, weighted gather and
    combine rows) iterates with 2-block grids, and gives the uncapped bits."""
    from tests.test_fused_experts_optimized import make_case, spread_weights, weighted
    from tests.test_gpu_emulated import FE_PER_BLOCK, fe_ok
    m = _load(key)
    x, w13, w2, tw, ids, kw = make_case("fp8_block", "silu", 4, 64, 32, 9, 2, seed=5)
    if weighted_input:
        tw, kw = spread_weights(tw), weighted(kw)
    want = fe_ok(m, x, w13, w2, tw, ids, kw, FE_PER_BLOCK, 5)
    with capped(m, 2) as c:
        got = fe_ok(m, x, w13, w2, tw, ids, kw, FE_PER_BLOCK, 5)
    assert _same(got, want)
    names = {line[0] for line in c.log if line[1] <= 2 and line[2] <= 2}
    need = {"fe_small", "fe_tiled", "fe_act", "fe_combine"} | ({"fe_gather_weighted"} if weighted_input else set())
    assert need <= names, (need, c.log)
    assert c.capped >= 6


@pytest.mark.parametrize("T,H,dtype", [(9, 40, torch.bfloat16), (9, 6, torch.float16)])
def test_grid_stride_loops_of_permute_and_unpermute(emu, T, H, dtype):
    """permute's row copy and unpermute with 2-block grids (both copy units: 16-byte rows and
    2-byte ones), against the reference and the uncapped bits."""
    g = torch.Generator().manual_seed(T + H)
    K, E = 3, 5
    hidden = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.randint(-1, E, (T, K), generator=g, dtype=torch.int32)
    full = emu.permute(hidden, ids, E, None, E, 2, -1)
    with capped(emu, 2) as c:
        st, offsets, out, src_row, dst_pos, status = emu.permute(hidden, ids, E, None, E, 2, -1)
    assert st == 0 and status[0].item() == 0
    assert all(torch.equal(a, b) for a, b in zip(full[1:], (offsets, out, src_row, dst_pos)))
    assert torch.equal(out, reference.permute(hidden, ids, E, align=2).hidden)
    assert any(line[0] == "permute_rows" and line[2] == 2 for line in c.log), c.log
    w = torch.rand(T, K, generator=g)
    eo = torch.randn(out.shape[0], H, generator=g).to(dtype)
    st, want, _ = emu.unpermute(eo, w, dst_pos)
    with capped(emu, 2) as c:
        st2, got, _ = emu.unpermute(eo, w, dst_pos)
    assert st == st2 == 0 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert any(line[0] == "unpermute_kernel" and line[2] == 2 for line in c.log), c.log
    assert torch.equal(got, reference.unpermute(eo, w, dst_pos))


@pytest.mark.parametrize("R_rows", [600, 4400], ids=["fused", "multi_block"])
def test_permute_more_than_1024_local_experts(emu, R_rows):
    """1100 local experts (the scans' loops over experts take two steps of 1024 and three of
    512), on the single-block plan (R <= 4096) and the multi-block one; ids mostly above 1024,
    so their offsets come from the second step. Exact against the reference."""
    E, K, H = 1100, 4, 8
    T = R_rows // K
    g = torch.Generator().manual_seed(R_rows)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.where(torch.rand(T, K, generator=g) < 0.8, torch.randint(1024, E, (T, K), generator=g),
                      torch.randint(-1, E, (T, K), generator=g)).to(torch.int32)
    emu.clear_launch_log()
    st, offsets, out, src_row, dst_pos, status = emu.permute(hidden, ids, E, None, E, 1, -1)
    assert st == 0 and status[0].item() == 0
    names = [line[0] for line in _log(emu)]
    assert ("permute_scan" in names) == (R_rows > 4096), names
    counts = torch.bincount(ids[ids >= 0].long(), minlength=E)
    assert torch.equal(offsets, torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    flat = ids.flatten().long()
    order = torch.argsort(torch.where(flat >= 0, flat, E), stable=True)[:int(counts.sum())]
    assert torch.equal(src_row[:order.numel()].long(), order)
    assert torch.equal(out[:order.numel()], hidden[order // K])


@pytest.mark.parametrize("key", _fe_loads(), ids=lambda k: f"warp{k}")
def test_fused_experts_more_than_256_experts_and_tiled_m_over_64(key):
    """E = 300 (fe_plan's loop over experts takes two steps of 256; the routed experts are
    >= 256, planned in the second) and one expert with 100 rows on the tiled path (two units of
    64 rows, the second partial): bit for bit the CPU kernel's scalar level (the tiled path's
    order, also in the MMA build, whose emulated instruction adds k ascending)."""
    from tests.test_fused_experts_optimized import make_case
    from tests.test_gpu_emulated import FE_SMALL, FE_TILED, fe_cpu, fe_ok
    m = _load(key)
    E, H, I, K = 300, 64, 32, 2
    x, w13, w2, tw, _, kw = make_case("bf16", "silu", E, H, I, 100, K, seed=8)
    g = torch.Generator().manual_seed(9)
    ids = torch.stack([torch.full((100,), 299, dtype=torch.int32),
                       torch.randint(256, 299, (100,), generator=g, dtype=torch.int32)], 1)
    cpu = fe_cpu(x, w13, w2, tw, ids, kw)
    tiled = fe_ok(m, x, w13, w2, tw, ids, kw, FE_TILED)
    assert _same(tiled, cpu) and not tiled.isnan().any()
    small = fe_ok(m, x[:5], w13, w2, tw[:5], ids[:5], kw, FE_SMALL)
    assert not small.isnan().any()
    torch.testing.assert_close(small.float(), cpu[:5].float(), rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.skipif(gpu_emu.SANITIZE, reason="checked by the normal build; under ASan the plant variant would be "
                    "a whole second sanitized build of every kernel for the same verdict")
def test_planted_fragment_layout_in_fused_experts_fails():
    """fused_experts built with MOELAB_PLANT_MMA_LAYOUT (A's fragment registers 1 and 2 swapped
    in fe_tiled's tensor-core branch, fused_experts.cu) must fail the tiled path's bitwise check
    that the unplanted MMA build passes (tests/test_gpu_emulated.py); its small path, which has
    no MMA, still passes."""
    from tests.test_fused_experts_optimized import make_case
    from tests.test_gpu_emulated import FE_SMALL, FE_TILED, fe_cpu, fe_ok
    planted = gpu_emu.load(32, mma=True, plant="MMA_LAYOUT")
    clean = gpu_emu.load(32, mma=True)
    x, w13, w2, tw, ids, kw = make_case("bf16", "silu", 3, 64, 32, 7, 2, seed=11)
    cpu = fe_cpu(x, w13, w2, tw, ids, kw)
    assert _same(fe_ok(clean, x, w13, w2, tw, ids, kw, FE_TILED), cpu)
    assert not _same(fe_ok(planted, x, w13, w2, tw, ids, kw, FE_TILED), cpu)
    torch.testing.assert_close(fe_ok(planted, x, w13, w2, tw, ids, kw, FE_SMALL).float(), cpu.float(),
                               rtol=2 ** -6, atol=2 ** -6)
