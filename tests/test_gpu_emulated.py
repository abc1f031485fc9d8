"""The GPU kernels' logic, tested on the CPU: csrc/gpu/*.cu (and csrc/hip/skinny_wave64.hip),
unchanged, built against the SIMT emulator of csrc/gpu/emu (tests/gpu_emu.py) with 32-lane warps
(the CUDA branch of portability.h) and 64-lane wavefronts (the HIP branch).

What this proves: the kernels' index logic, tie rules, reductions, tier table, tails, strides and
argument checks are right for both warp widths, bit for bit where the contract is exact, and
that they keep the hardware rules the emulator checks at every access (shared-memory races and
uninitialised reads, natural alignment, collectives at one call site; tests/test_gpu_emu_rules.py
has each rule's negative control). What it cannot prove: real-GPU memory ordering beyond those
rules, timing, and the vendor compilers' code generation (the compile check and
scripts/gpu_check.sh cover those where a GPU is lent).

fused_experts runs on a third build as well, 32-lane warps with the sm_80+ branch on: the tiled
path's tensor-core code with mma.sync m16n8k16 and cvt.rn.bf16.f32 emulated from the PTX ISA
(emu.h); on a GPU scripts/gpu_opcheck.py checks it against the hardware.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import reference
from reference.validate import NORM_EPS_DEFAULT, RENORMALIZE_DEFAULT, check_route

from . import gpu_emu

METHODS = ["softmax_topk", "topk_softmax", "sigmoid_topk", "sigmoid_bias", "grouped_sigmoid_bias", "llama4",
           "grouped_softmax", "softmax_bias"]   # index = the kernels' method code
BIASED = ("sigmoid_bias", "grouped_sigmoid_bias", "softmax_bias")
GROUPED = ("grouped_sigmoid_bias", "grouped_softmax")
WARPS = [32, 64]


@pytest.fixture(scope="module", params=WARPS, ids=lambda w: f"warp{w}")
def emu(request):
    """The emulated kernels: 32 (CUDA, SIMT branch), 64 (HIP), or "32mma" (CUDA with the sm_80+
    tensor-core branch, the fused_experts tests' third build through FE_BUILDS)."""
    if request.param == "32mma":
        return gpu_emu.load(32, mma=True)
    return gpu_emu.load(request.param)


# The fused_experts checks that reach the tensor-core branch or the bf16 conversion (the tiled
# path's bits, NaN codes) run on all three builds: the tiled path's two CUDA branches and HIP's.
# The rest (strides, the small path's batch invariance, workspace) run at 32 and 64 lanes.
FE_BUILDS = pytest.mark.parametrize("emu", [32, "32mma", 64], indirect=True, ids=lambda w: f"warp{w}")


def _route_inputs(T, E, K, method, dtype, seed, special):
    g = torch.Generator().manual_seed(seed)
    if special:      # exact ties, NaN, +-inf, -0.0: the total order must hold bit for bit
        x = (torch.randint(-4, 5, (T, E), generator=g) / 4).float()
        x[0, 1:4] = float("nan")
        x[1, E // 2] = float("inf")
        x[2, ::3] = -0.0
        x[3, :] = float("-inf")
        x[4, :] = 0.0
    else:
        x = torch.randn(T, E, generator=g) * 3
    x = x.to(dtype)
    bias = None
    if method in BIASED:
        scale = 0.01 if method == "softmax_bias" else 0.2     # p is small: a bias of p's size
        bias = (torch.randint(-2, 3, (E,), generator=g) / 8).float() if special else torch.randn(E, generator=g) * scale
    return x, bias


ROUTE_SHAPES = [  # (E, K, n_group, topk_group): every row of the tier table on both widths
    (6, 3, 2, 1), (32, 4, 4, 2), (64, 8, 8, 3), (96, 5, 4, 2), (200, 8, 8, 4), (256, 32, 8, 4),
    (384, 12, 4, 2), (512, 8, 8, 4), (512, 16, 8, 4), (896, 16, 4, 2), (1024, 9, 32, 8), (1536, 32, 1, 1),
    (2048, 20, 1, 1),
]


def _route_variants(method):
    """SPEC 6 arguments per method: the defaults, renormalize flipped from the default with a
    scaling, and (methods with one) norm_eps small and large enough to change the weights."""
    out = [{}]
    if method != "llama4":
        out.append(dict(renormalize=not RENORMALIZE_DEFAULT[method], scaling=2.5))
    else:
        out.append(dict(renormalize=False, scaling=0.5))
    if method in NORM_EPS_DEFAULT:
        out += [dict(renormalize=True, norm_eps=1e-6, scaling=0.5), dict(renormalize=True, norm_eps=0.75)]
    return out


@pytest.mark.parametrize("E,K,ng,tg", ROUTE_SHAPES)
@pytest.mark.parametrize("special", [False, True], ids=["random", "ties"])
def test_route_matches_reference_bit_for_bit(emu, E, K, ng, tg, special):
    T = 7
    for mi, method in enumerate(METHODS):
        if method == "llama4" and K != 1:
            k = 1
        else:
            k = K
        if method in GROUPED and (E > 1024 or ng == 1 or E % ng or E // ng < 2 or k > tg * (E // ng)):
            continue
        ngr, tgr = (ng, tg) if method in GROUPED else (1, 1)
        dtype = [torch.float32, torch.bfloat16, torch.float16][(E + mi) % 3]
        x, bias = _route_inputs(T, E, k, method, dtype, E * 7 + mi, special)
        for kw in _route_variants(method):
            scaling = kw.get("scaling", 1.0)
            # the launcher takes renormalize and norm_eps resolved, as the torch binding passes them
            renorm, eps = check_route(x, k, method, bias, ngr, tgr, scaling, kw.get("renormalize"), kw.get("norm_eps"))
            st, w, ids = emu.route(x, k, mi, bias, ngr, tgr, scaling, renorm, eps)
            assert st == 0
            wr, ir = reference.route(x, k, method, bias=bias, n_group=ngr, topk_group=tgr, **kw)
            assert torch.equal(ids, ir), (method, kw, ids, ir)
            assert torch.equal(w.isnan(), wr.isnan()), (method, kw, w, wr)
            assert torch.allclose(w, wr, rtol=2e-7, atol=0, equal_nan=True), (method, kw, (w - wr).abs().max())


# Seed 004's before/after pair on the GPU: selection 1 (kSelectSerial, warp 0 alone scans every
# expert while the other warps wait) against selection 0 (the tier table: warp tier, or the
# lane-owned block path), same inputs, same bits. Shapes: seed 004's (896, 16) and its grid
# region (E 512..1024, K 9..16), the warp tier's sizes, and the limits (E 2048, K 32, K = E).
SERIAL_SHAPES = [(896, 16, 4, 2), (512, 9, 8, 4), (1024, 16, 32, 8), (768, 12, 4, 2), (64, 8, 8, 3),
                 (200, 5, 8, 4), (2048, 32, 1, 1), (16, 16, 2, 1)]


@pytest.mark.parametrize("E,K,ng,tg", SERIAL_SHAPES)
@pytest.mark.parametrize("special", [False, True], ids=["random", "ties"])
def test_route_serial_selection_equals_lanes_bit_for_bit(emu, E, K, ng, tg, special):
    T = 5
    ran = 0
    for mi, method in enumerate(METHODS):
        k = 1 if method == "llama4" else K
        if method in GROUPED and (E > 1024 or ng == 1 or E % ng or E // ng < 2 or k > tg * (E // ng)):
            continue
        ngr, tgr = (ng, tg) if method in GROUPED else (1, 1)
        dtype = [torch.float32, torch.bfloat16, torch.float16][(E + mi) % 3]
        x, bias = _route_inputs(T, E, k, method, dtype, E * 11 + mi, special)
        renorm, eps = check_route(x, k, method, bias, ngr, tgr, 1.0, None, None)
        st0, w0, i0 = emu.route(x, k, mi, bias, ngr, tgr, 1.0, renorm, eps, selection=0)
        st1, w1, i1 = emu.route(x, k, mi, bias, ngr, tgr, 1.0, renorm, eps, selection=1)
        assert st0 == 0 and st1 == 0, (method, st0, st1)
        assert torch.equal(i1, i0), (method, i1, i0)
        # bit for bit, NaN payloads included (both write the same f32 operations' results)
        assert torch.equal(w1.view(torch.int32), w0.view(torch.int32)), (method, w1, w0)
        ran += 1
    assert ran >= 6


def test_route_serial_selection_rejects_unknown_selection(emu):
    x = torch.randn(3, 64)
    assert emu.route(x, 4, 0, None, 1, 1, 1.0, False, 0.0, selection=2)[0] < 0
    assert emu.route(x, 4, 0, None, 1, 1, 1.0, False, 0.0, selection=-1)[0] < 0


def test_route_strided_rows_and_plan(emu):
    x = torch.randn(5, 300)[:, 10:266]          # rows 300 apart
    st, w, ids = emu.route(x, 8, 2, None, 1, 1, 1.0, False, 1e-20)
    wr, ir = reference.route(x.contiguous(), 8, "sigmoid_topk")
    assert st == 0 and torch.equal(ids, ir) and torch.equal(w, wr)
    W = emu.warp_size()
    assert emu.route_plan(896, 16)[2] is True                  # seed 004's shape: block tier
    assert emu.route_plan(W, 4)[2] is False and emu.route_plan(W, 4)[3] == 1
    assert emu.route_plan(4096, 8)[0] != 0                     # outside the table


def test_route_launcher_rejects_bad_arguments(emu):
    x = torch.randn(3, 64)
    assert emu.route(x, 33, 0, None, 1, 1, 1.0, False, 0.0)[0] < 0     # K > 32
    assert emu.route(x, 2, 5, None, 1, 1, 1.0, False, 0.0)[0] < 0      # llama4 with K != 1
    assert emu.route(x, 1, 5, None, 1, 1, 1.0, True, 0.0)[0] < 0       # llama4 renormalized
    assert emu.route(x, 2, 3, None, 1, 1, 1.0, False, 0.0)[0] < 0      # sigmoid_bias without bias
    assert emu.route(x, 2, 7, None, 1, 1, 1.0, True, 1e-12)[0] < 0     # softmax_bias without bias
    assert emu.route(x, 4, 4, torch.zeros(64), 5, 2, 1.0, False, 0.0)[0] < 0   # 64 % 5 != 0
    assert emu.route(x, 4, 6, None, 5, 2, 1.0, False, 0.0)[0] < 0      # grouped_softmax, 64 % 5 != 0
    assert emu.route(x, 9, 6, None, 8, 1, 1.0, False, 0.0)[0] < 0      # grouped_softmax, K > 1 * 8
    assert emu.route(x, 2, 8, None, 1, 1, 1.0, False, 0.0)[0] < 0      # no method 8
    assert emu.route(x, 2, 2, None, 1, 1, 1.0, True, -1.0)[0] < 0      # norm_eps < 0
    assert emu.route(x, 2, 2, None, 1, 1, 1.0, True, float("nan"))[0] < 0
    assert emu.route(torch.randn(0, 64), 4, 0, None, 1, 1, 1.0, False, 0.0)[0] == 0


# ------------------------------------------------------------------------- permute
PERMUTE_CASES = [  # (T, K, E, H, align, mapped, dtype, ids dtype)
    (0, 2, 8, 16, 4, False, torch.bfloat16, torch.int32),
    (1, 2, 8, 64, 1, False, torch.bfloat16, torch.int32),
    (9, 4, 16, 40, 8, True, torch.float16, torch.int64),
    (33, 8, 64, 24, 1, False, torch.float32, torch.int32),
    (130, 3, 300, 13, 3, True, torch.bfloat16, torch.int64),   # odd H: 2-byte copies
    (600, 8, 40, 8, 16, False, torch.float16, torch.int32),    # R = 4800 > 4096: multi-block path
]


@pytest.mark.parametrize("T,K,E,H,align,mapped,dtype,idt", PERMUTE_CASES)
def test_permute_matches_reference(emu, T, K, E, H, align, mapped, dtype, idt):
    g = torch.Generator().manual_seed(T * 31 + E)
    hidden = torch.randn(T, H + 3, generator=g).to(dtype)[:, 1:H + 1]      # strided rows
    ids = torch.randint(-1, E, (T, K), generator=g).to(idt)
    if T > 3:
        ids[3] = ids[2]                                                   # repeated experts
    emap, n_local = None, E
    if mapped:
        n_local = max(1, E // 2)
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[torch.randperm(E, generator=g)[:n_local]] = torch.arange(n_local, dtype=torch.int32)
    st, offsets, out, src_row, dst_pos, status = emu.permute(hidden, ids, E, emap, n_local, align, -1)
    assert st == 0 and status[0].item() == 0
    ref = reference.permute(hidden, ids, E, expert_map=emap, n_local_experts=n_local if mapped else None, align=align)
    assert torch.equal(offsets, ref.offsets)
    assert torch.equal(src_row, ref.src_row)
    assert torch.equal(dst_pos, ref.dst_pos)
    assert torch.equal(out, ref.hidden)
    # unpermute back, bit for bit (f32 mul then add, j ascending)
    w = torch.rand(T, K, generator=g)
    eo = torch.randn(out.shape, generator=g).to(dtype)
    st, got, flag = emu.unpermute(eo, w, dst_pos)
    assert st == 0 and flag == 0
    assert torch.equal(got, reference.unpermute(eo, w, dst_pos))


def test_permute_workspace_is_monotone_and_checked(emu):
    words = [emu.workspace_words(r, 64) for r in range(0, 20000, 97)]
    assert all(a <= b for a, b in zip(words, words[1:]))
    hidden, ids = torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int32)
    need = emu.workspace_words(8, 4)
    assert emu.permute(hidden, ids, 4, None, 4, 1, need - 1)[0] < 0      # too small: refused
    assert emu.permute(hidden, ids, 4, None, 4, 1, need)[0] == 0


def test_permute_reports_bad_ids_and_map_without_writing_outside(emu):
    hidden = torch.randn(5, 8)
    ids = torch.tensor([[0, 1], [2, 9], [1, 1], [-1, 0], [3, 3]], dtype=torch.int32)
    st, offsets, out, src_row, dst_pos, status = emu.permute(hidden, ids, 4, None, 4, 1, -1)
    assert st == 0 and status[0].item() == 1 and status[2].item() == 9      # code 1, value 9
    assert dst_pos[3].item() == -1 and (src_row < 10).all()
    emap = torch.tensor([0, 7, 1, -1], dtype=torch.int32)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    st, *_, status = emu.permute(torch.randn(2, 8), ids, 4, emap, 2, 1, -1)
    assert status[0].item() == 2 and status[2].item() == 7


def test_unpermute_flags_out_of_range_positions(emu):
    eo, w = torch.randn(4, 16), torch.rand(2, 2)
    st, out, flag = emu.unpermute(eo, w, torch.tensor([0, 4, -1, 3], dtype=torch.int32))
    assert st == 0 and flag == 1 and not out.isnan().any()


# --------------------------------------------------------------------------- GEMMs
# Accuracy: the CPU kernels' tests' bounds, tight enough that SPEC's 2^-10 error in one output
# column fails (test_gemm_checks_catch_one_column_off_by_2_pow_minus_10 proves it on emulated
# outputs): router_gemm 2 sqrt(H) u32 (|x| @ |w|.T) (tests/test_router_gemm_optimized.py),
# skinny_gemm u32 (2 sqrt(K) + 2) (|x| @ |w|.T + |b|) plus half an ulp of the output dtype
# (tests/test_gate_gemm_optimized.py: assert_close, which also holds the result to the
# reference's). Plus small-integer inputs, whose products and sums are exact in f32: the result
# must then be the exact integer (rounded once to the output dtype), bit for bit.
def router_gemm_within(out, x, w) -> bool:
    from tests.test_router_gemm_optimized import bound
    return bool(((out.double() - x.double() @ w.double().T).abs() <= bound(x, w)).all())


def skinny_close(out, x, w, b, what=""):
    from tests.test_gate_gemm_optimized import assert_close
    with one_thread():
        assert_close(out, x, w, b, what)


def small_integers(shape, g, lo=-4, hi=4):
    return torch.randint(lo, hi + 1, shape, generator=g)


@pytest.mark.parametrize("H,E,dtype,strided", [(3072, 256, torch.bfloat16, False), (200, 7, torch.float16, True),
                                               (61, 5, torch.float32, False), (1031, 33, torch.bfloat16, True)])
def test_router_gemm_accuracy_and_batch_invariance(emu, H, E, dtype, strided):
    g = torch.Generator().manual_seed(H + E)
    T = 40                                                   # > 16: three token chunks on grid.y
    xb = torch.randn(T, H + 8, generator=g).to(dtype)
    x = xb[:, 8:] if strided else xb[:, :H].contiguous()
    w = torch.randn(E, H, generator=g) / H ** 0.5
    st, out = emu.router_gemm(x, w)
    assert st == 0 and not out.isnan().any()
    assert router_gemm_within(out, x, w)
    # a token's output: the same bits alone, in any bucket (1, 2, 4, 8, 16) and position
    for n in (1, 2, 3, 5, 9, 17, 32, 40):
        st, part = emu.router_gemm(x[:n], w)
        assert st == 0 and torch.equal(part, out[:n]), n
    st, last = emu.router_gemm(x[T - 1:], w)
    assert torch.equal(last[0], out[T - 1])


@pytest.mark.parametrize("H,E,dtype,strided", [(77, 13, torch.bfloat16, False), (1031, 33, torch.float16, True),
                                               (3072, 20, torch.float32, False), (8, 3, torch.bfloat16, True)])
def test_router_gemm_small_integers_exact(emu, H, E, dtype, strided):
    """|x|, |w| <= 4: every product and partial sum is an integer below 2^24, exact in f32 in any
    order, so any missed, doubled or misplaced term shows as a wrong integer."""
    g = torch.Generator().manual_seed(7 * H + E)
    T = 37                                                   # token chunks of 16, 16 and 5
    xi = small_integers((T, H + 3), g)
    x = xi.to(dtype)[:, 3:] if strided else xi[:, :H].to(dtype).contiguous()
    wi = small_integers((E, H), g)
    want = (xi[:, 3:] if strided else xi[:, :H]) @ wi.T
    assert want.abs().max() > 16                             # not a vacuous all-small result
    for n in (T, 1, 16, 17):
        st, out = emu.router_gemm(x[:n], wi.float())
        assert st == 0 and torch.equal(out, want[:n].float()), n


@pytest.mark.parametrize("K,N,dtype,bias,strided", [(7168, 513, torch.bfloat16, False, False),
                                                    (4096, 13, torch.bfloat16, True, True),
                                                    (1000, 9, torch.float16, True, False),
                                                    (333, 5, torch.float32, False, True),
                                                    (8, 3, torch.bfloat16, True, False)])
def test_skinny_gemm_matches_reference(emu, K, N, dtype, bias, strided):
    g = torch.Generator().manual_seed(K + N)
    T = 8
    xb = torch.randn(T, K + 8, generator=g).to(dtype)
    x = xb[:, 8:] if strided else xb[:, :K].contiguous()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    variants = [False] + ([True] if emu.has_wave64 else [])
    for wave64 in variants:
        st, out = emu.skinny_gemm(x, w, b, wave64, 3)
        if wave64 and (dtype == torch.float32 or 8 * K * 2 > 64 * 1024):
            # bf16/f16 with 8 rows of x fitting in LDS only (decided from K, never T, so a row takes
            # the same kernel in any batch): the binding falls back to the portable kernel
            assert st == -2 and emu.skinny_gemm(x[:1], w, b, wave64, 3)[0] == -2
            continue
        assert st == 0 and not out.isnan().any()
        skinny_close(out, x, w, b, f"skinny_gemm wave64={wave64}")
        for n in (1, 2, 3, 5):                                # batch invariant
            if n > x.shape[0]:
                break
            st, part = emu.skinny_gemm(x[:n], w, b, wave64, 3)
            assert torch.equal(part, out[:n]), (n, wave64)


@pytest.mark.parametrize("K,N,dtype,strided", [(67, 37, torch.bfloat16, False), (4099, 9, torch.float16, True),
                                               (333, 5, torch.float32, False), (8, 3, torch.bfloat16, True)])
def test_skinny_gemm_small_integers_exact(emu, K, N, dtype, strided):
    """Small integers (|x|, |w| <= 3, |b| <= 5): the f32 accumulation is exact, so the output is
    the exact integer rounded once to the dtype, bit for bit, on both kernels (portable, wave64)."""
    g = torch.Generator().manual_seed(3 * K + N)
    T = 8
    xi = small_integers((T, K + 8), g, -3, 3)
    x = xi.to(dtype)[:, 8:] if strided else xi[:, :K].to(dtype).contiguous()
    wi, bi = small_integers((N, K), g, -3, 3), small_integers((N,), g, -5, 5)
    want = ((xi[:, 8:] if strided else xi[:, :K]) @ wi.T + bi).double().to(dtype)
    assert want.float().abs().max() > 16
    ran = 0
    for wave64 in [False] + ([True] if emu.has_wave64 else []):
        st, out = emu.skinny_gemm(x, wi.to(dtype), bi.to(dtype), wave64, 3)
        if st == -2:                                          # wave64: x does not fit in LDS (see above)
            assert wave64
            continue
        assert st == 0 and torch.equal(out, want), wave64
        ran += 1
    assert ran >= 1


def test_gemm_checks_catch_one_column_off_by_2_pow_minus_10(emu):
    """Negative controls: the emulated kernels' own outputs pass the checks above, and the same
    outputs with one column scaled by 1 + 2^-10 fail them (SPEC's tolerance model). f32 outputs
    (router_gemm, skinny f32) and f16 (its rounding, 2^-11 relative at most, is finer than the
    error). A bf16 output rounds at 2^-9 relative, coarser than the error, so a column error
    there shows only statistically, before rounding: tests/test_gate_gemm_optimized.py
    (test_tolerance_catches_column_error) proves that for the same assert_close."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(8, 3072, generator=g).bfloat16(), torch.randn(256, 3072, generator=g) / 3072 ** 0.5
    st, out = emu.router_gemm(x, w)
    assert st == 0 and router_gemm_within(out, x, w)
    for col in (0, 17, 255):
        bad = out.clone()
        bad[:, col] *= 1 + 2.0 ** -10
        assert not router_gemm_within(bad, x, w), col
    for K, N, dtype in ((333, 5, torch.float32), (1000, 9, torch.float16), (4096, 13, torch.float32)):
        x = torch.randn(8, K, generator=g).to(dtype)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
        b = torch.randn(N, generator=g).to(dtype)
        st, out = emu.skinny_gemm(x, w, b, False, 3)
        assert st == 0
        skinny_close(out, x, w, b, "honest")
        for col in (0, N // 2, N - 1):
            bad = out.double()
            bad[:, col] *= 1 + 2.0 ** -10
            with pytest.raises(AssertionError):
                skinny_close(bad.to(dtype), x, w, b, f"column {col} off by 2^-10 ({K}, {N}, {dtype})")


def test_gemm_launchers_reject_bad_arguments(emu):
    x, w = torch.randn(9, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)
    assert emu.skinny_gemm(x, w, None, False, 1)[0] < 0         # T > 8
    assert emu.skinny_gemm(x[:0], w, None, False, 1)[0] == 0
    assert emu.router_gemm(torch.randn(0, 16), torch.randn(4, 16))[0] == 0


# -------------------------------------------------------------------- fused_experts
# Three emulated builds: warp32 and warp64 take the tiled path's SIMT branch (HIP's, and CUDA
# before sm_80); warp32mma takes the CUDA sm_80+ branch, mma.sync m16n8k16 with the PTX ISA's
# fragment layouts, emulated (emu.h) with its 16 products added k ascending, one fmaf each: the
# SIMT branch's order, so every check below holds bit for bit on all three builds, and a wrong
# fragment layout in the kernel fails them. (Real tensor cores add in their own order: on a GPU
# the tiled path equals the CPU within tolerance, not bitwise; docs/gpu.md.)
# Arithmetic that is the same on the CPU kernel and here, hence compared bit for bit:
#   - the dequantized weights (fp8: bf16(f32(e4m3) * scale); bf16 and mxfp4 exact), the
#     activation (the CPU's f32 formulas, Cephes exp), the bias add, the combine (f32, j
#     ascending, product then add) and every bf16 rounding point;
#   - the tiled SIMT path's K reduction (one fmaf per k, ascending): the CPU's order at its
#     scalar, avx2 and avx512 levels. The small-m path splits K across lanes (its own fixed
#     order), so it equals the CPU only where every sum is exact (small-integer inputs).
# Inputs with a large cancelling pair of activations make the K order visible in the bf16
# outputs, so those checks can fail.
FE_QUANT = {"bf16": 0, "fp8_block": 1, "mxfp4": 2}
FE_SMALL, FE_TILED, FE_PER_BLOCK = 0, 1, 2


def fe_run(emu, x, w13, w2, tw, ids, kw, policy, m_cross=0, ws=-1):
    E, I = w13.shape[0], w13.shape[1] // 2
    act = {"silu": 0, "swiglu_oai": 1}[kw["activation"]]
    return emu.fused_experts(x, w13, w2, tw, ids, FE_QUANT[kw["quant"]], kw.get("w13_scale"), kw.get("w2_scale"),
                             kw.get("w13_bias"), kw.get("w2_bias"), act, kw.get("alpha", 1.702), kw.get("limit", 7.0),
                             policy, m_cross, E, I, ws,
                             weighted_input=kw.get("apply_router_weight_on_input", False))


def fe_ok(emu, *args, **kw):
    st, out, _ = fe_run(emu, *args, **kw)
    assert st == 0
    return out


@contextlib.contextmanager
def one_thread():
    """Tiny CPU-side tensors (references, tolerances, the CPU kernel): one torch thread. On a
    shared 2-core machine the thread pool's fork/join costs ~100x the work (the CPU kernel's
    result does not depend on the thread count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def fe_cpu(x, w13, w2, tw, ids, kw, level="scalar"):
    import optimized
    from tests import levels   # loads the CPU extension: only the tests that compare with it
    with levels.capped(level), one_thread():
        return optimized.fused_experts(x, w13, w2, tw, ids, **kw)


def cpu_levels(*names):
    """The named CPU levels this process can run (tests/levels.py), in order."""
    from tests import levels
    return [level for level in names if levels.available(level)]


def same_bits(a, b):
    """Bit-identical bf16 tensors, any NaN equal to any NaN (hardware NaN payloads differ)."""
    nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return a.shape == b.shape and bool(((a.view(torch.int16) == b.view(torch.int16)) | nan).all())


def fe_checker(x, w13, w2, tw, ids, kw):
    """tests/test_fused_experts_optimized.reference_check, with the reference outputs and the
    tolerance computed once per case (they cost far more than an emulated call): check(out)."""
    from tests.test_fused_experts_optimized import allowed_error, check_close, check_rarely_differs, kernel_weights
    q = kw["quant"]
    with one_thread():
        ref = reference.fused_experts(x, w13, w2, tw, ids, **kw)
        W13r, W13k = kernel_weights(q, w13, kw.get("w13_scale"))
        W2r, W2k = kernel_weights(q, w2, kw.get("w2_scale"))
        allowed = allowed_error(x, tw, ids, kw, W13k, W2k, W13r, W2r)
        if q == "fp8_block":        # tight: the same function with the kernel's bf16 weights
            kb = dict(kw, quant="bf16", w13_scale=None, w2_scale=None)
            ref_b = reference.fused_experts(x, W13k.bfloat16(), W2k.bfloat16(), tw, ids, **kb)
            allowed_b = allowed_error(x, tw, ids, kw, W13k, W2k, W13k, W2k)

    def check(out):
        with one_thread():
            check_close(out, ref, allowed, f"{q} vs reference")
            if q != "fp8_block":
                check_rarely_differs(out, ref, f"{q} vs reference")
            else:
                check_close(out, ref_b, allowed_b, "fp8 vs bf16(W) reference")
                check_rarely_differs(out, ref_b, "fp8 vs bf16(W) reference")
    return check


def fe_cancelling(quant, act, E=3, H=64, I=32, T=7, K=2, seed=21, S=2.0 ** 18):
    """make_case's data, plus activations +S at k = 0 and -S at k = 40 against equal weights
    there: the big products cancel exactly, and what the sum keeps of the 39 terms between
    depends on the order of the additions (k = 0 and 40 lie in different 16-byte chunks)."""
    from tests.test_fused_experts_optimized import make_case
    x, w13, w2, tw, ids, kw = make_case(quant, act, E, H, I, T, K, seed=seed, hot=True)
    w13 = w13.clone()
    if quant == "mxfp4":
        kw = dict(kw, w13_scale=kw["w13_scale"].clone())
        w13[:, :, 20] = (w13[:, :, 20] & 0xF0) | (w13[:, :, 0] & 0x0F)   # code of k = 40 := code of k = 0
        kw["w13_scale"][:, :, 1] = kw["w13_scale"][:, :, 0]
    else:
        w13[:, :, 40] = w13[:, :, 0]
    x = x.clone()
    sign = torch.where(torch.arange(T) % 2 == 0, 1.0, -1.0)
    x[:, 0] = (S * sign).bfloat16()
    x[:, 40] = (-S * sign).bfloat16()
    return x, w13, w2, tw, ids, kw


@FE_BUILDS
@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_fused_experts_matches_reference(emu, quant, act):
    """Both paths and a per-block mix against reference.fused_experts, with the CPU tests'
    tolerance (tests/test_fused_experts_optimized.py: reference_check); biases f32 (w13) and
    bf16 (w2); ~10% of the slots dropped; T = 0, 1 and an odd T with a hot expert."""
    from tests.test_fused_experts_optimized import make_case
    E, H, I, K = 3, 64, 32, 2
    x, w13, w2, tw, ids, kw = make_case(quant, act, E, H, I, 0, K, seed=1)
    st, out, _ = fe_run(emu, x, w13, w2, tw, ids, kw, FE_SMALL)
    assert st == 0 and out.shape == (0, H)
    for T, runs in ((1, [(FE_SMALL, 0), (FE_TILED, 0)]), (7, [(FE_SMALL, 0), (FE_TILED, 0), (FE_PER_BLOCK, 4)])):
        x, w13, w2, tw, ids, kw = make_case(quant, act, E, H, I, T, K, seed=T + 3, hot=True)
        cpu = fe_cpu(x, w13, w2, tw, ids, kw)
        check = fe_checker(x, w13, w2, tw, ids, kw)
        for policy, m_cross in runs:
            out = fe_ok(emu, x, w13, w2, tw, ids, kw, policy, m_cross)
            assert not out.isnan().any()
            check(out)
            if policy == FE_TILED:
                assert same_bits(out, cpu), "tiled SIMT path differs from the CPU kernel (scalar level)"


@FE_BUILDS
@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "mxfp4"])
def test_fused_experts_tiled_pipeline(emu, quant):
    """The tiled path's stage ring wraps (GEMM1 K = 352: 11 k steps through 3 stages; GEMM2 K =
    160: 5), its column tiles end inside N (2I = 320 and H = 352: the last 128-column tile
    holds 64 and 96 columns, so whole warps' columns are past N), and its expert blocks take
    all four 16-row slices, three of them (40-row blocks) and two units (an 80-row block: 64
    rows, then 16). Bit for bit with the CPU kernel at its scalar level (the
    SIMT order; the emulated MMA adds in it too) and within the reference's tolerance."""
    from tests.test_fused_experts_optimized import make_case
    E, H, I, T, K = 3, 352, 160, 80, 2
    x, w13, w2, tw, ids, kw = make_case(quant, "silu", E, H, I, T, K, seed=21)
    ids = torch.stack([torch.zeros(T), torch.where(torch.arange(T) < 40, 1, 2)], 1).to(torch.int32)
    out = fe_ok(emu, x, w13, w2, tw, ids, kw, FE_TILED)
    assert same_bits(out, fe_cpu(x, w13, w2, tw, ids, kw))
    fe_checker(x, w13, w2, tw, ids, kw)(out)


@pytest.mark.parametrize("quant", ["bf16", "fp8_block"])
def test_fused_experts_odd_sizes_and_strides(emu, quant):
    """H, I off every chunk width (scalar loads, zero k tails), N not a multiple of the column
    tiles, 128-blocks of fp8 scales cut short, strided x / weights / ids; and the scalar-load
    variant gives the vector variant's bits (same chunks, same order)."""
    from tests.test_fused_experts_optimized import make_case
    x, w13, w2, tw, ids, kw = make_case(quant, "swiglu_oai", 2, 133, 21, 5, 2, seed=8)
    xs = torch.zeros(5, 140, dtype=torch.bfloat16)[:, 3:136]
    xs.copy_(x)
    tws, idss = torch.zeros(2, 5).T, torch.zeros(2, 5, dtype=torch.int32).T
    tws.copy_(tw)
    idss.copy_(ids)
    cpu = fe_cpu(x, w13, w2, tw, ids, kw)
    check = fe_checker(x, w13, w2, tw, ids, kw)
    for policy in (FE_SMALL, FE_TILED):
        out = fe_ok(emu, xs, w13, w2, tws, idss, kw, policy)
        check(out)
        if policy == FE_TILED:
            assert same_bits(out, cpu)
    # vector vs scalar loads: x rows at an odd offset force the scalar variant of GEMM1
    x, w13, w2, tw, ids, kw = make_case(quant, "silu", 2, 64, 32, 3, 2, seed=9)
    xo = torch.zeros(3, 66, dtype=torch.bfloat16)[:, 1:65]
    xo.copy_(x)
    for policy in (FE_SMALL, FE_TILED):
        assert same_bits(fe_ok(emu, xo, w13, w2, tw, ids, kw, policy), fe_ok(emu, x, w13, w2, tw, ids, kw, policy))


def exact_sum_weights(quant, E, H, I, g, signed):
    """(w13, w13_scale, w2, w2_scale) of `quant` whose sums are exact in any order: small-integer
    W13 (power-of-two scales) and one nonzero per W2 row, of magnitude 1 or 2 (either sign when
    `signed`)."""
    onehot = torch.zeros(E, H, I)
    mag = torch.randint(1, 3, (E, H), generator=g).float()
    if signed:
        mag = mag * torch.where(torch.rand(E, H, generator=g) < 0.5, -1.0, 1.0)
    onehot[:, torch.arange(H), torch.arange(H) % I] = mag
    if quant == "bf16":
        return torch.randint(-2, 3, (E, 2 * I, H), generator=g).bfloat16(), None, onehot.bfloat16(), None
    if quant == "fp8_block":
        w13 = torch.randint(-4, 5, (E, 2 * I, H), generator=g).float().to(torch.float8_e4m3fn)
        s13 = torch.exp2(torch.randint(-2, 2, (E, 1, 1), generator=g).float())
        return w13, s13, onehot.to(torch.float8_e4m3fn), torch.full((E, 1, 1), 0.5)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(125, 128, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8)
    c2 = torch.zeros(E, H, I, dtype=torch.uint8)
    for v, c in {1.0: 2, 2.0: 4, -1.0: 10, -2.0: 12}.items():     # e2m1 codes
        c2[onehot == v] = c
    return w13, s13, c2[:, :, 0::2] | (c2[:, :, 1::2] << 4), torch.full((E, H, I // 32), 127, dtype=torch.uint8)


@FE_BUILDS
@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "mxfp4"])
def test_fused_experts_bitwise_with_the_cpu_kernel(emu, quant):
    """(1) Order-sensitive inputs (fe_cancelling): the tiled SIMT path equals the CPU kernel at
    its fma levels bit for bit, and the small-m path (another K order) does not - so the
    comparison sees the order. (2) Exact sums (small integers, one nonzero per W2 row): every
    sum is exact in any order, so both paths equal the CPU at every ISA level, including
    avx512_bf16: the weight dequantization, activation, bias and combine agree bit for bit."""
    x, w13, w2, tw, ids, kw = fe_cancelling(quant, "silu")
    tiled = fe_ok(emu, x, w13, w2, tw, ids, kw, FE_TILED)
    small = fe_ok(emu, x, w13, w2, tw, ids, kw, FE_SMALL)
    for level in cpu_levels("scalar", "avx2", "avx512"):
        assert same_bits(tiled, fe_cpu(x, w13, w2, tw, ids, kw, level)), level
    assert not same_bits(small, tiled), "inputs not order-sensitive: the check could not fail"

    E, H, I, T, K = 3, 64, 32, 6, 2
    g = torch.Generator().manual_seed(77)
    x = torch.randint(-3, 4, (T, H), generator=g).bfloat16()
    w13, s13, w2, s2 = exact_sum_weights(quant, E, H, I, g, signed=True)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, K, generator=g)
    for act in ("silu", "swiglu_oai"):
        kw = dict(quant=quant, w13_scale=s13, w2_scale=s2, activation=act,
                  w13_bias=torch.randint(-8, 9, (E, 2 * I), generator=g) / 8.0,
                  w2_bias=(torch.randint(-8, 9, (E, H), generator=g) / 4.0).bfloat16())
        small = fe_ok(emu, x, w13, w2, tw, ids, kw, FE_SMALL)
        tiled = fe_ok(emu, x, w13, w2, tw, ids, kw, FE_TILED)
        assert not small.isnan().any() and (small != 0).float().mean() > 0.5
        for level in cpu_levels("scalar", "avx2", "avx512", "avx512_bf16"):
            cpu = fe_cpu(x, w13, w2, tw, ids, kw, level)
            assert same_bits(small, cpu) and same_bits(tiled, cpu), (act, level)


@pytest.mark.parametrize("weighted_input", [False, True])
def test_fused_experts_small_path_is_batch_invariant(emu, weighted_input):
    """A token's output is the same bits alone (T = 1: 1 row per unit) or in batches of 2, 3, 5
    and 7 (2, 4 and 8 rows per unit) or shuffled, on order-sensitive inputs, with and without
    apply_router_weight_on_input; the tiled path's bits differ there, which is why
    batch-invariant mode keeps every block on the small path."""
    x, w13, w2, tw, ids, kw = fe_cancelling("fp8_block", "swiglu_oai", T=7)
    if weighted_input:
        from tests.test_fused_experts_optimized import spread_weights, weighted
        tw, kw = spread_weights(tw), weighted(kw)
    full = fe_ok(emu, x, w13, w2, tw, ids, kw, FE_SMALL)
    for t in (0, 3, 6):
        one = fe_ok(emu, x[t:t + 1], w13, w2, tw[t:t + 1], ids[t:t + 1], kw, FE_SMALL)
        assert same_bits(one[0], full[t]), t
    for n in (2, 3, 5):
        assert same_bits(fe_ok(emu, x[:n], w13, w2, tw[:n], ids[:n], kw, FE_SMALL), full[:n]), n
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(2))
    assert same_bits(fe_ok(emu, x[perm], w13, w2, tw[perm], ids[perm], kw, FE_SMALL), full[perm])
    if not weighted_input:
        assert not same_bits(fe_ok(emu, x, w13, w2, tw, ids, kw, FE_TILED), full)


@FE_BUILDS
def test_fused_experts_special_weights_and_dropped_rows(emu):
    """fp8 NaN codes and a scale of 2^121, mxfp4 scale bytes 0, 1, 253 and 255 (NaN) decode as
    the CPU's exact decoder does (bitwise, NaN-aware); dropped slots are skipped, a fully
    dropped token is an exact zero row, and every output element is written (no poison left)."""
    from tests.test_fused_experts_optimized import make_case, make_weights
    E, H, I, K, T = 4, 128, 64, 2, 6
    w13, w2, s13, s2 = (t.clone() for t in make_weights("fp8_block", E, H, I))
    s13[0, 0, 0] = 2.0 ** 121
    w13.view(torch.uint8)[0, :128, :128] &= 0x80                    # +-0 codes under the huge scale
    w13.view(torch.uint8)[1, 3, 7] = 0x7F                           # NaN
    x, _, _, tw, ids, kw = make_case("fp8_block", "silu", E, H, I, T, K, seed=4)
    ids[2] = -1
    kw.update(w13_scale=s13, w2_scale=s2)
    cpu = fe_cpu(x, w13, w2, tw, ids, kw)
    for policy in (FE_SMALL, FE_TILED):
        out = fe_ok(emu, x, w13, w2, tw, ids, kw, policy)
        uses1 = (ids == 1).any(1)
        assert torch.equal(out.isnan(), cpu.isnan()) and out[uses1].isnan().all()
        assert not out[~uses1].isnan().any() and torch.equal(out[2], torch.zeros(H, dtype=torch.bfloat16))
        if policy == FE_TILED:
            assert same_bits(out, cpu)

    w13, w2, s13, s2 = (t.clone() for t in make_weights("mxfp4", E, H, I))
    s13[0, :5, 0] = 0
    s13[0, 5:9, 1] = 1
    s13[2, :3, 2] = 253
    w13[2, :3, 32:48] &= 0x11
    s2[1, 4, 0] = 255
    x, _, _, tw, ids, kw = make_case("mxfp4", "silu", E, H, I, T, K, seed=4)
    x = (x.float() * 2.0 ** -100).bfloat16()
    kw.update(w13_scale=s13, w2_scale=s2)
    cpu = fe_cpu(x, w13, w2, tw, ids, kw)
    out = fe_ok(emu, x, w13, w2, tw, ids, kw, FE_TILED)
    assert same_bits(out, cpu) and out[(ids == 1).any(1), 4].isnan().all()

    none = torch.full_like(ids, -1)
    for policy in (FE_SMALL, FE_TILED):
        st, out, status = fe_run(emu, x, w13, w2, tw, none, kw, policy)
        assert st == 0 and status[0].item() == 0 and torch.equal(out, torch.zeros(T, H, dtype=torch.bfloat16))


def test_fused_experts_fp8_scale_edges(emu):
    """fp8 weights decode with one multiply by scale * 2^120 where that is exact (|scale| < 2^8)
    and no code of the 8 is NaN, else with the exact decoder's two: both give the CPU's weights
    at the boundary (scales just below and at 2^8, subnormal, negative, zero) and with a NaN code
    beside fast ones (tiled SIMT path, bitwise with the CPU's scalar level, NaN-aware). A fast
    range reaching 2^8 (scale * 2^120 = inf) or no NaN test fails it."""
    from tests.test_fused_experts_optimized import make_case, make_weights
    E, H, I, K, T = 4, 256, 128, 2, 8
    w13, w2, s13, s2 = (t.clone() for t in make_weights("fp8_block", E, H, I))
    edges = torch.tensor([255.99, 256.0, 2.0 ** -140, -3.0, 0.0, 2.0 ** -126, 255.0, 1e-3])
    s13.view(-1)[:8] = edges
    s13.view(-1)[8:16] = edges.flip(0)
    s2.view(-1)[:8] = edges.roll(3) * 1e-2
    w13.view(torch.uint8)[1, 5, 9] = 0xFF                           # NaN beside 7 fast codes
    x, _, _, tw, ids, kw = make_case("fp8_block", "silu", E, H, I, T, K, seed=5)
    ids[:, 0] = torch.arange(T, dtype=torch.int32) % E               # every expert routed
    ids[:, 1] = (ids[:, 0] + 1) % E
    kw.update(w13_scale=s13, w2_scale=s2)
    cpu = fe_cpu(x, w13, w2, tw, ids, kw)
    out = fe_ok(emu, x, w13, w2, tw, ids, kw, FE_TILED)
    assert same_bits(out, cpu)
    assert out.isnan().any() and not out.isnan().all() and out.float().nan_to_num().abs().max() > 0


def test_fused_experts_launcher_checks(emu):
    """Bad sizes, codes and workspaces are refused before any launch (negative status); an id
    outside [-1, E) is reported in the status words (code 1, the value), its slot skipped."""
    from tests.test_fused_experts_optimized import make_case
    x, w13, w2, tw, ids, kw = make_case("bf16", "silu", 3, 64, 32, 4, 2, seed=1)
    need = emu.fused_experts_workspace_bytes(4, 2, 3, 64, 32)
    assert need > 0 and emu.fused_experts_workspace_bytes(8, 2, 3, 64, 32) > need
    assert fe_run(emu, x, w13, w2, tw, ids, kw, FE_SMALL, ws=need - 1)[0] < 0
    assert fe_run(emu, x, w13, w2, tw, ids, kw, FE_SMALL, ws=need)[0] == 0
    assert fe_run(emu, x, w13, w2, tw, ids, kw, 3)[0] < 0                                  # policy
    assert fe_run(emu, x, w13, w2, tw, ids, dict(kw, activation="silu"), FE_SMALL)[0] == 0
    E, I = 3, 32
    base = [x, w13, w2, tw, ids, 0, None, None, None, None, 0, 1.702, 7.0, 0, 0, E, I, -1]
    for i, v in ((5, 3), (10, 2), (15, 0), (16, 0), (5, 1)):                 # quant, act, E, I, fp8 without scales
        a = list(base)
        a[i] = v
        assert emu.fused_experts(*a)[0] < 0, (i, v)
    u8 = torch.uint8
    a = [x[:, :48].contiguous(), torch.zeros(3, 64, 24, dtype=u8), torch.zeros(3, 48, 16, dtype=u8), tw, ids, 2,
         torch.full((3, 64, 1), 127, dtype=u8), torch.full((3, 48, 1), 127, dtype=u8), None, None, 0, 1.0, 7.0, 0, 0,
         3, 32, -1]
    assert emu.fused_experts(*a)[0] < 0                                       # mxfp4 with H % 32 != 0
    bad = ids.clone()
    bad[1, 1] = 3
    st, out, status = fe_run(emu, x, w13, w2, tw, bad, kw, FE_SMALL)
    assert st == 0 and status[0].item() == 1 and status[2].item() == 3 and not out.isnan().any()


# ------------------------------------------- fused_experts: apply_router_weight_on_input
# SPEC 6: fe_gather_weighted writes GEMM1's rows bf16(x * bf16(w)) (in y's region), fe_combine
# sums unweighted. The gathered rows are the CPU kernel's bit for bit, so every comparison above
# holds with the flag too.
@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_fused_experts_weighted_input_matches_reference(emu, quant, act):
    """Both paths and a per-block mix against reference.fused_experts with the flag (the CPU
    tests' bound), the tiled SIMT path equal to the CPU kernel bit for bit, the result not the
    unflagged one; an x with rows at an odd offset (the launcher's scalar x loads) gives the
    same bits (the gathered rows are aligned either way); T = 0 is valid."""
    from tests.test_fused_experts_optimized import make_case, spread_weights, weighted
    E, H, I, K = 3, 64, 32, 2
    x, w13, w2, tw, ids, kw = make_case(quant, act, E, H, I, 0, K, seed=1)
    st, out, _ = fe_run(emu, x, w13, w2, tw, ids, weighted(kw), FE_SMALL)
    assert st == 0 and out.shape == (0, H)
    for T, runs in ((1, [(FE_SMALL, 0), (FE_TILED, 0)]), (7, [(FE_SMALL, 0), (FE_TILED, 0), (FE_PER_BLOCK, 4)])):
        x, w13, w2, tw, ids, kw = make_case(quant, act, E, H, I, T, K, seed=T + 13, hot=True)
        tw = spread_weights(tw)
        kwf = weighted(kw)
        cpu = fe_cpu(x, w13, w2, tw, ids, kwf)
        check = fe_checker(x, w13, w2, tw, ids, kwf)
        xo = torch.zeros(T, H + 2, dtype=torch.bfloat16)[:, 1:H + 1]
        xo.copy_(x)
        for policy, m_cross in runs:
            out = fe_ok(emu, x, w13, w2, tw, ids, kwf, policy, m_cross)
            assert not out.isnan().any()
            check(out)
            assert not same_bits(out, fe_ok(emu, x, w13, w2, tw, ids, kw, policy, m_cross))
            assert same_bits(fe_ok(emu, xo, w13, w2, tw, ids, kwf, policy, m_cross), out)
            if policy == FE_TILED:
                assert same_bits(out, cpu), "tiled SIMT path differs from the CPU kernel (scalar level)"


@FE_BUILDS
@pytest.mark.parametrize("quant", ["bf16", "fp8_block", "mxfp4"])
def test_fused_experts_weighted_input_bitwise_with_the_cpu_kernel(emu, quant):
    """Exact sums with the flag: small-integer x, weights in {+-1/4, +-1/2, +-1, +-2} (the scaled
    inputs stay small dyadic numbers), small-integer W13 and one nonzero per W2 row: both paths
    equal the CPU kernel at every ISA level, avx512_bf16 included, and the unflagged call on
    x * w with weights 1 (K = 1)."""
    E, H, I, T = 3, 64, 32, 6
    g = torch.Generator().manual_seed(78)
    x = torch.randint(-3, 4, (T, H), generator=g).bfloat16()
    w13, s13, w2, s2 = exact_sum_weights(quant, E, H, I, g, signed=False)
    for K in (1, 2):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
        tw = torch.exp2(torch.randint(-2, 2, (T, K), generator=g).float()) * \
            torch.where(torch.rand(T, K, generator=g) < 0.5, -1.0, 1.0)
        for act in ("silu", "swiglu_oai"):
            kw = dict(quant=quant, w13_scale=s13, w2_scale=s2, activation=act, apply_router_weight_on_input=True,
                      w13_bias=torch.randint(-8, 9, (E, 2 * I), generator=g) / 8.0,
                      w2_bias=(torch.randint(-8, 9, (E, H), generator=g) / 4.0).bfloat16())
            small = fe_ok(emu, x, w13, w2, tw, ids, kw, FE_SMALL)
            tiled = fe_ok(emu, x, w13, w2, tw, ids, kw, FE_TILED)
            assert not small.isnan().any() and (small != 0).float().mean() > 0.5
            for level in cpu_levels("scalar", "avx2", "avx512", "avx512_bf16"):
                cpu = fe_cpu(x, w13, w2, tw, ids, kw, level)
                assert same_bits(small, cpu) and same_bits(tiled, cpu), (K, act, level)
            if K == 1:
                plain = dict(kw, apply_router_weight_on_input=False)
                xw = (x.float() * tw).bfloat16()
                assert same_bits(fe_ok(emu, xw, w13, w2, torch.ones(T, 1), ids, plain, FE_SMALL), small)


def test_fused_experts_weighted_input_workspace_unchanged(emu):
    """The weighted rows live in y's region: the workspace size does not depend on the flag, and
    exactly that size is enough (the launcher refuses one byte less)."""
    from tests.test_fused_experts_optimized import make_case, weighted
    for H, I in ((64, 32), (40, 24)):   # H % 8 == 0 and not (the gathered rows are padded to 8)
        x, w13, w2, tw, ids, kw = make_case("bf16", "silu", 3, H, I, 5, 2, seed=3)
        need = emu.fused_experts_workspace_bytes(5, 2, 3, H, I)
        assert fe_run(emu, x, w13, w2, tw, ids, weighted(kw), FE_TILED, ws=need - 1)[0] < 0
        st, out, _ = fe_run(emu, x, w13, w2, tw, ids, weighted(kw), FE_TILED, ws=need)
        assert st == 0 and same_bits(out, fe_cpu(x, w13, w2, tw, ids, weighted(kw)))
