"""The GPU kernels' logic, tested on the CPU: csrc/gpu/*.cu (and csrc/hip/skinny_wave64.hip),
unchanged, built against the SIMT emulator of csrc/gpu/emu (tests/gpu_emu.py) with 32-lane warps
(the CUDA branch of portability.h) and 64-lane wavefronts (the HIP branch).

What this proves: the kernels' index logic, tie rules, reductions, tier table, tails, strides and
argument checks are right for both warp widths, bit for bit where the contract is exact. What it
cannot prove: real-GPU memory ordering, timing, and the vendor compilers' code generation (the
compile check and scripts/gpu_check.sh cover those where a GPU is lent).
"""
from __future__ import annotations

import pytest
import torch

import reference

from . import gpu_emu

METHODS = ["softmax_topk", "topk_softmax", "sigmoid_topk", "sigmoid_bias", "grouped_sigmoid_bias", "llama4"]
WARPS = [32, 64]


@pytest.fixture(scope="module", params=WARPS, ids=lambda w: f"warp{w}")
def emu(request):
    return gpu_emu.load(request.param)


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
    if method in ("sigmoid_bias", "grouped_sigmoid_bias"):
        bias = (torch.randint(-2, 3, (E,), generator=g) / 8).float() if special else torch.randn(E, generator=g) * 0.2
    return x, bias


ROUTE_SHAPES = [  # (E, K, n_group, topk_group): every row of the tier table on both widths
    (6, 3, 2, 1), (32, 4, 4, 2), (64, 8, 8, 3), (96, 5, 4, 2), (200, 8, 8, 4), (256, 32, 8, 4),
    (384, 12, 4, 2), (512, 8, 8, 4), (512, 16, 8, 4), (896, 16, 4, 2), (1024, 9, 32, 8), (1536, 32, 1, 1),
    (2048, 20, 1, 1),
]


@pytest.mark.parametrize("E,K,ng,tg", ROUTE_SHAPES)
@pytest.mark.parametrize("special", [False, True], ids=["random", "ties"])
def test_route_matches_reference_bit_for_bit(emu, E, K, ng, tg, special):
    T = 7
    for mi, method in enumerate(METHODS):
        if method == "llama4" and K != 1:
            k = 1
        else:
            k = K
        if method == "grouped_sigmoid_bias" and (E > 1024 or ng == 1 or E % ng or E // ng < 2 or k > tg * (E // ng)):
            continue
        ngr, tgr = (ng, tg) if method == "grouped_sigmoid_bias" else (1, 1)
        dtype = [torch.float32, torch.bfloat16, torch.float16][(E + mi) % 3]
        x, bias = _route_inputs(T, E, k, method, dtype, E * 7 + mi, special)
        scaling = 2.5 if bias is not None else 1.0
        for renorm in ([False, True] if method in ("softmax_topk", "sigmoid_topk") else [False]):
            st, w, ids = emu.route(x, k, mi, bias, ngr, tgr, scaling, renorm)
            assert st == 0
            wr, ir = reference.route(x, k, method, bias=bias, n_group=ngr, topk_group=tgr, scaling=scaling,
                                     renormalize=renorm)
            assert torch.equal(ids, ir), (method, renorm, ids, ir)
            assert torch.equal(w.isnan(), wr.isnan()), (method, w, wr)
            assert torch.allclose(w, wr, rtol=2e-7, atol=0, equal_nan=True), (method, (w - wr).abs().max())


def test_route_strided_rows_and_plan(emu):
    x = torch.randn(5, 300)[:, 10:266]          # rows 300 apart
    st, w, ids = emu.route(x, 8, 2, None, 1, 1, 1.0, False)
    wr, ir = reference.route(x.contiguous(), 8, "sigmoid_topk")
    assert st == 0 and torch.equal(ids, ir) and torch.equal(w, wr)
    W = emu.warp_size()
    assert emu.route_plan(896, 16)[2] is True                  # seed 004's shape: block tier
    assert emu.route_plan(W, 4)[2] is False and emu.route_plan(W, 4)[3] == 1
    assert emu.route_plan(4096, 8)[0] != 0                     # outside the table


def test_route_launcher_rejects_bad_arguments(emu):
    x = torch.randn(3, 64)
    assert emu.route(x, 33, 0, None, 1, 1, 1.0, False)[0] < 0     # K > 32
    assert emu.route(x, 2, 5, None, 1, 1, 1.0, False)[0] < 0      # llama4 with K != 1
    assert emu.route(x, 2, 3, None, 1, 1, 1.0, False)[0] < 0      # sigmoid_bias without bias
    assert emu.route(x, 4, 4, torch.zeros(64), 5, 2, 1.0, False)[0] < 0   # 64 % 5 != 0
    assert emu.route(torch.randn(0, 64), 4, 0, None, 1, 1, 1.0, False)[0] == 0


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
@pytest.mark.parametrize("H,E,dtype,strided", [(3072, 256, torch.bfloat16, False), (200, 7, torch.float16, True),
                                               (61, 5, torch.float32, False), (1031, 33, torch.bfloat16, True)])
def test_router_gemm_accuracy_and_batch_invariance(emu, H, E, dtype, strided):
    g = torch.Generator().manual_seed(H + E)
    T = 40                                                   # > 32: two token chunks on grid.y
    xb = torch.randn(T, H + 8, generator=g).to(dtype)
    x = xb[:, 8:] if strided else xb[:, :H].contiguous()
    w = torch.randn(E, H, generator=g) / H ** 0.5
    st, out = emu.router_gemm(x, w)
    assert st == 0 and not out.isnan().any()
    exact = x.double() @ w.double().T
    bound = 2 * H * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)   # gamma_H-style, with margin
    assert ((out.double() - exact).abs() <= bound + 1e-30).all()
    # a token's output: the same bits alone, in any bucket (1, 2, 4, 8, 16, 32) and position
    for n in (1, 2, 3, 5, 9, 17, 32, 40):
        st, part = emu.router_gemm(x[:n], w)
        assert st == 0 and torch.equal(part, out[:n]), n
    st, last = emu.router_gemm(x[T - 1:], w)
    assert torch.equal(last[0], out[T - 1])


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
        exact = x.double() @ w.double().T + (b.double() if bias else 0)
        ref = reference.skinny_gemm(x, w, b)
        acc_bound = 2 * K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
        out_ulp = exact.abs() * {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[dtype]
        assert ((out.double() - exact).abs() <= acc_bound + out_ulp + 1e-30).all()
        assert (out.double() - ref.double()).abs().max() <= (acc_bound + 2 * out_ulp).max()
        for n in (1, 2, 3, 5):                                # batch invariant
            if n > x.shape[0]:
                break
            st, part = emu.skinny_gemm(x[:n], w, b, wave64, 3)
            assert torch.equal(part, out[:n]), (n, wave64)


def test_gemm_launchers_reject_bad_arguments(emu):
    x, w = torch.randn(9, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)
    assert emu.skinny_gemm(x, w, None, False, 1)[0] < 0         # T > 8
    assert emu.skinny_gemm(x[:0], w, None, False, 1)[0] == 0
    assert emu.router_gemm(torch.randn(0, 16), torch.randn(4, 16))[0] == 0
