"""The aarch64 build of the CPU kernels, run under qemu-aarch64-static against the x86 build.

tests/cross_cpu.py builds tests/cpu_driver.cpp twice: for aarch64 (the portable and NEON
levels, the level chosen at run time from the hwcaps) with the cross compiler, and natively at
the x86 portable level. Every case here writes its inputs as raw files, runs the x86 driver
for the expected outputs, then the aarch64 one at each level (NEON by default under qemu,
MOELAB_ISA=scalar for the portable level) and compares:
  - bit for bit where the kernels promise the same bits at every level (route: ids and
    weights; permute / unpermute; fused_experts' GEMM passes with every decoder, its
    activation, gather and bf16 rounding; read_stream's byte sum);
  - within the GEMM tolerance of tests/test_gate_gemm_optimized.py (f64 truth, error bound
    u32 * (2 sqrt(K) + 2) * |x| . |w| plus half an ulp of the output dtype) for router_gemm
    and skinny_gemm, whose lane count sets their reduction order.
qemu checks correctness only: no timing here is meaningful (docs/arm.md).
The planted bugs (cross_cpu.PLANTS, one NEON kernel each) must make a comparison fail.
"""
from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests import cross_cpu

needs_tools = pytest.mark.skipif(bool(cross_cpu.missing_tools()), reason=cross_cpu.missing_tools() or "tools present")

U32 = 2.0 ** -24
FMT = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}


def raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t.numpy().tobytes()


class Case:
    """floats: the outputs holding floating-point values, with their dtype (their NaNs compare
    as NaNs, every other bit exactly)."""

    def __init__(self, name: str, params: dict, inputs: dict[str, torch.Tensor], outputs: list[str],
                 check: str = "exact", floats: dict[str, torch.dtype] | None = None):
        self.name, self.params, self.inputs, self.outputs, self.check = name, params, inputs, outputs, check
        self.floats = floats or {}

    def write(self, root: Path) -> Path:
        d = root / self.name
        d.mkdir(parents=True, exist_ok=True)
        (d / "case.txt").write_text("".join(f"{k} {v}\n" for k, v in self.params.items()))
        for k, v in self.inputs.items():
            (d / f"{k}.bin").write_bytes(raw(v))
        return d


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def route_cases() -> list[Case]:
    cases = []
    T = 9
    specs = [  # method, E, K, n_group, topk_group, renormalize, has_bias, scaling
        (0, 64, 8, 1, 1, 1, 0, 1.0), (1, 96, 4, 1, 1, 0, 0, 1.0), (2, 64, 8, 1, 1, 1, 0, 2.5),
        (3, 256, 8, 1, 1, 1, 1, 2.5), (4, 256, 8, 8, 4, 1, 1, 1.0), (5, 16, 1, 1, 1, 0, 0, 1.0),
        (6, 64, 6, 4, 2, 1, 0, 1.0), (7, 70, 5, 1, 1, 1, 1, 1.0), (2, 130, 32, 1, 1, 0, 0, 1.0),
    ]
    for i, (m, E, K, ng, tg, rn, hb, sc) in enumerate(specs):
        for fmt in (0, 1, 2):
            g = _gen(100 * i + fmt)
            x = (torch.randn(T, E, generator=g) * 3).to(FMT[fmt])
            x[1, 3] = x[1, 5]                   # a tie: the lower index ranks first
            if m in (0, 1, 5):
                x[2, 7] = float("nan")          # NaN keys rank above +inf
            inputs = {"logits": x}
            bfmt = fmt % 2
            if hb:
                inputs["bias"] = (torch.randn(E, generator=g) * 0.1).to(FMT[bfmt])
            params = dict(op="route", T=T, E=E, K=K, method=m, n_group=ng, topk_group=tg, scaling=sc,
                          renormalize=rn, norm_eps=1e-20, fmt=fmt, has_bias=hb, bias_fmt=bfmt)
            cases.append(Case(f"route_m{m}_E{E}_K{K}_f{fmt}", params, inputs, ["weights", "ids"],
                              floats={"weights": torch.float32}))
    return cases


def permute_cases() -> list[Case]:
    cases = []
    g = _gen(7)
    T, K, ne, nl, align = 7, 3, 8, 5, 4
    ids = torch.randint(-1, ne, (T, K), generator=g, dtype=torch.int32)
    emap = torch.tensor([0, -1, 1, 2, -1, 3, 4, 1], dtype=torch.int32)
    for has_map, rb in ((0, 40), (1, 4100), (1, 266)):   # small rows, a row past the memcpy switch
        nloc = nl if has_map else ne
        hidden = torch.randint(0, 256, (T, rb), generator=g, dtype=torch.uint8)
        params = dict(op="permute", T=T, K=K, n_experts=ne, n_local=nloc, align=align, row_bytes=rb, has_map=has_map)
        inputs = {"ids": ids, "hidden": hidden, "map": emap}
        cases.append(Case(f"permute_map{has_map}_rb{rb}", params, inputs,
                          ["status", "offsets", "src_row", "dst_pos", "rows"]))
    for fmt in (0, 1, 2):
        for H in (37, 64):
            T, K, rows = 5, 3, 12
            eo = torch.randn(rows, H, generator=g).to(FMT[fmt])
            w = torch.rand(T, K, generator=g)
            pos = torch.randint(-1, rows, (T, K), generator=g, dtype=torch.int32)
            cases.append(Case(f"unpermute_f{fmt}_H{H}", dict(op="unpermute", T=T, K=K, H=H, fmt=fmt),
                              {"expert_out": eo, "w": w, "dst_pos": pos}, ["out"], floats={"out": FMT[fmt]}))
    return cases


def gemm_cases() -> list[Case]:
    cases = []
    for fmt in (0, 1, 2):
        g = _gen(300 + fmt)
        T, H, E = 5, 67, 9
        x = torch.randn(T, H, generator=g).to(FMT[fmt])
        w = torch.randn(E, H, generator=g)
        cases.append(Case(f"router_gemm_f{fmt}", dict(op="router_gemm", T=T, H=H, E=E, fmt=fmt), {"x": x, "w": w},
                          ["out"], check="router_gemm"))
        T, K, N = 3, 70, 11
        x = torch.randn(T, K, generator=g).to(FMT[fmt])
        w = torch.randn(N, K, generator=g).to(FMT[fmt])
        b = torch.randn(N, generator=g).to(FMT[fmt])
        cases.append(Case(f"skinny_gemm_f{fmt}", dict(op="skinny_gemm", T=T, K=K, N=N, fmt=fmt, has_bias=1),
                          {"x": x, "w": w, "bias": b}, ["out"], check="skinny_gemm"))
    return cases


def fe_cases() -> list[Case]:
    """fused_experts' GEMM passes: bf16, fp8 block (with the scales that take the exact decoder:
    0, tiny, huge) and mxfp4 (scale bytes inside and outside the fast range), standard and
    packed layouts, every policy, experts of 0, 1, 5 and 9 rows, N with a partial tile."""
    cases = []
    counts = [1, 0, 5, 9]
    E = len(counts)
    offsets = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int64)
    rows = int(offsets[-1])
    for q, K, N in ((0, 131, 72), (1, 300, 72), (1, 256, 144), (2, 256, 96)):
        g = _gen(1000 * q + K)
        lda = 2 * ((K + 1) // 2)
        a = torch.zeros(rows, lda, dtype=torch.bfloat16)
        a[:, :K] = torch.randn(rows, K, generator=g).to(torch.bfloat16)
        if q == 0:
            w, scale = torch.randn(E, N, K, generator=g).to(torch.bfloat16), None
        elif q == 1:
            codes = torch.randint(0, 256, (E, N, K), generator=g, dtype=torch.uint8)
            codes[codes == 0x7F] = 0x7E
            codes[codes == 0xFF] = 0xFE
            w = codes
            nbn, nbk = (N + 127) // 128, (K + 127) // 128
            scale = torch.ldexp(torch.rand(E, nbn, nbk, generator=g) + 0.5,
                                torch.randint(-12, 0, (E, nbn, nbk), generator=g))
            scale[0, 0, 0] = 0.0                 # an all-zero block: the exact decoder
            scale[2, 0, -1] = 2.0 ** -125        # below the table's range
            scale[3, -1, 0] = 2.0 ** 119         # above it (the block's codes kept small: finite sums)
            codes[3, -128:, :128] &= 0x8F
            if N > 128:
                codes[3, 130, 5] = 0x7F          # a NaN code: the tile takes the exact decoder
        else:
            w = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
            scale = torch.randint(112, 142, (E, N, K // 32), generator=g, dtype=torch.uint8)
            scale[2, 70, 3] = 60                 # outside [95, 159]: that tile decodes exactly
        inputs = {"a": a, "w": w, "offsets": offsets}
        if scale is not None:
            inputs["scale"] = scale
        for packed in (0, 1):
            for out_bf16 in (0, 1):
                for policy, m_cross in ((0, 1), (1, 1), (2, 4)):
                    if out_bf16 and policy != 2:
                        continue
                    params = dict(op="fe_gemm", quant=q, E=E, N=N, K=K, lda=lda, packed=packed, out_bf16=out_bf16,
                                  policy=policy, m_cross=m_cross)
                    cases.append(Case(f"fe_q{q}_K{K}_N{N}_p{packed}_o{out_bf16}_pol{policy}", params, inputs, ["out"],
                                      floats={"out": torch.bfloat16 if out_bf16 else torch.float32}))
    g = _gen(5)
    for act in (0, 1):
        P, I = 3, 37
        h = (torch.randn(P, 2 * I, generator=g) * 4).to(torch.bfloat16)
        h[0, 1] = float("nan")
        cases.append(Case(f"fe_act{act}", dict(op="fe_act", P=P, I=I, lda=I + 1, act=act, alpha=1.702, limit=7.0),
                          {"h": h}, ["a"], floats={"a": torch.bfloat16}))
    src = torch.randn(4 * 9 + 3, generator=g) * 100
    # ties (halfway between two bf16 values, both parities), NaN, infinities, a subnormal
    src[:6] = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, float("nan"), float("inf"), -float("inf"), 1e-40])
    cases.append(Case("fe_to_bf16", dict(op="fe_to_bf16"), {"src": src}, ["dst"], floats={"dst": torch.bfloat16}))
    T, K, H = 3, 2, 37
    cases.append(Case("fe_gather", dict(op="fe_gather", T=T, K=K, H=H, ldg=H + 1),
                      {"x": torch.randn(T, H, generator=g).to(torch.bfloat16), "w": torch.rand(T, K, generator=g)},
                      ["xg"], floats={"xg": torch.bfloat16}))
    cases.append(Case("read_stream", dict(op="read_stream", streams=3, prefetch=2),
                      {"bytes": torch.randint(0, 256, (64 * 37 + 13,), generator=g, dtype=torch.uint8)}, ["sum"]))
    return cases


def all_cases() -> list[Case]:
    return route_cases() + permute_cases() + gemm_cases() + fe_cases()


def _gemm_ok(case: Case, out: bytes) -> str:
    """'' when every element is within the GEMM tolerance of the f64 truth, else the first miss."""
    p = case.params
    if case.check == "router_gemm":
        x, w, b = case.inputs["x"].double(), case.inputs["w"].double(), None
        dt = torch.float32
    else:
        x, w, b = (case.inputs[k].double() for k in ("x", "w", "bias"))
        dt = FMT[p["fmt"]]
    exact, mag = x @ w.T, x.abs() @ w.abs().T
    if b is not None:
        exact, mag = exact + b, mag + b.abs()
    K = x.shape[1]
    tol = U32 * (2 * math.sqrt(K) + 2) * mag + (K + 1) * 2.0 ** -126
    if dt != torch.float32:   # the output's own rounding: half an ulp at the value's binade
        bits = {torch.bfloat16: 8, torch.float16: 11}[dt]
        _, e = torch.frexp(exact.abs() + tol)
        tol = tol + torch.ldexp(torch.ones_like(tol), e - 1 - bits)
    got = torch.frombuffer(bytearray(out), dtype=torch.int16 if dt != torch.float32 else torch.float32)
    got = (got.view(dt) if dt != torch.float32 else got).double().reshape(exact.shape)
    bad = ~((got - exact).abs() <= tol)
    if bad.any():
        i = tuple(int(v) for v in bad.nonzero()[0])
        return f"{int(bad.sum())} elements over tolerance; first {i}: got {got[i].item()!r}, exact {exact[i].item()!r}"
    return ""


@pytest.fixture(scope="module")
def drivers():
    return cross_cpu.build("host"), cross_cpu.build("aarch64")


@pytest.fixture(scope="module")
def expected(drivers, tmp_path_factory):
    """Every case written and run through the x86 driver: {name: (case, dir, {output: bytes})}."""
    host, _ = drivers
    root = tmp_path_factory.mktemp("aarch64_cases")
    out = {}
    for c in all_cases():
        d = c.write(root)
        assert cross_cpu.run(host, d, "host") == "scalar"
        out[c.name] = (c, d, {o: (d / f"{o}.out").read_bytes() for o in c.outputs})
    return out


def same_bits(got: bytes, want: bytes, dtype: torch.dtype | None) -> bool:
    """Bit equality, except that a NaN matches any NaN: the sign and payload of a NaN an
    invalid operation makes are the hardware's (x86: 0xffc00000, Arm: 0x7fc00000), which SPEC
    does not fix. A NaN must still be where x86 has one."""
    if dtype is None or len(got) != len(want):
        return got == want
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    g, w = (torch.frombuffer(bytearray(b), dtype=ints) for b in (got, want))
    gn, wn = g.view(dtype).isnan(), w.view(dtype).isnan()
    return bool(torch.equal(gn, wn) and torch.equal(g[~gn], w[~wn]))


def compare(exe: Path, expected: dict, level: str | None, names=None) -> list[str]:
    """Runs the aarch64 driver on the cases; the list of mismatches (empty: all match)."""
    bad = []
    for name, (c, d, want) in expected.items():
        if names is not None and not any(re.fullmatch(n, name) for n in names):
            continue
        got_level = cross_cpu.run(exe, d, "aarch64", level)
        assert got_level == (level or "neon"), (name, got_level)
        for o in c.outputs:
            got = (d / f"{o}.out").read_bytes()
            if c.check == "exact":
                if not same_bits(got, want[o], c.floats.get(o)):
                    bad.append(f"{name}/{o}: not bit-identical to the x86 portable level")
            else:
                why = _gemm_ok(c, got)
                if why:
                    bad.append(f"{name}/{o}: {why}")
    return bad


@pytest.mark.parametrize("level", ["neon", "scalar"])
@needs_tools
def test_aarch64_level_matches_x86(drivers, expected, level):
    _, arm = drivers
    bad = compare(arm, expected, None if level == "neon" else "scalar")
    assert not bad, "\n".join(bad[:20])


@needs_tools
def test_x86_expected_side_is_within_gemm_tolerance(expected):
    """The tolerance compare is not vacuous: the x86 outputs it is applied to pass it too."""
    for c, _, want in expected.values():
        if c.check != "exact":
            assert _gemm_ok(c, want["out"]) == "", c.name


@needs_tools
def test_policies_are_batch_invariant_on_neon(drivers, expected):
    """fused_experts at NEON: tiny, blocked and per-block policies give the same bits."""
    _, arm = drivers
    groups: dict[str, set] = {}
    for name, (c, d, _) in expected.items():
        if c.params.get("op") == "fe_gemm" and c.params["out_bf16"] == 0:
            cross_cpu.run(arm, d, "aarch64")
            groups.setdefault(name.rsplit("_pol", 1)[0], set()).add((d / "out.out").read_bytes())
    assert groups and all(len(v) == 1 for v in groups.values())


@needs_tools
@pytest.mark.parametrize("plant,cases", [
    ("NEON_NARROW", [r"fe_to_bf16", r"unpermute_f1_.*"]),
    ("NEON_FP8_TABLE", [r"fe_q1_K300_N72_p1_o0_pol0"]),
    ("NEON_MX_ZERO", [r"fe_q2_.*_p1_o0_pol0"]),
])
def test_planted_neon_bug_is_caught(expected, plant, cases):
    exe = cross_cpu.build("aarch64", plant)
    bad = compare(exe, expected, None, cases)
    assert bad, f"{plant}: the planted bug went unnoticed"


@needs_tools
def test_every_kernel_cross_compiles_without_x86_headers(tmp_path):
    """Each *_kernel.h at each aarch64 level: -Wall -Wextra -Werror clean, and its preprocessed
    text names no x86 header, target pragma or intrinsic."""
    for k in cross_cpu.kernels():
        for isa, macros in cross_cpu.BUILD.ARM_ISA_LEVELS.items():
            src = tmp_path / f"{k.stem}_{isa}.cpp"
            src.write_text(cross_cpu.BUILD.wrapper_text(k, macros))
            pre = subprocess.run([cross_cpu.CROSS_CXX, *cross_cpu.FLAGS, "-E", str(src)], capture_output=True, text=True)
            assert pre.returncode == 0, pre.stderr
            for bad in ("immintrin.h", "x86intrin", "_mm_", "_mm256_", "_mm512_", "__m128", "__m256", "__m512"):
                assert bad not in pre.stdout, (k.name, isa, bad)
            x86_target = re.search(r'#pragma GCC target\s*\(\s*"[^"]*(avx|sse|fma|bmi|f16c|popcnt)', pre.stdout)
            assert x86_target is None, (k.name, isa, x86_target and x86_target.group(0))
            assert f"moelab::cpu::{isa}" in pre.stdout, (k.name, isa, "the level's namespace is missing")
            assert ("arm_neon.h" in pre.stdout) == (isa == "neon"), (k.name, isa)
    # The objects themselves are compiled (with -Werror) by the driver build.
    assert cross_cpu.build("aarch64").exists()


def test_build_levels_per_machine():
    """x86 keeps its four levels and wrappers byte for byte; aarch64 gets the portable level and
    NEON; another architecture the portable level only."""
    b = cross_cpu.BUILD
    assert list(b.isa_levels("x86_64")) == ["scalar", "avx2", "avx512", "avx512bf16"]
    assert [m["MOELAB_ISA_LEVEL"] for m in b.isa_levels("x86_64").values()] == [0, 1, 2, 3]
    k = cross_cpu.kernels()[0]
    assert b.wrapper_text(k, b.isa_levels("x86_64")["avx2"]) == \
        f'// generated by optimized/_build.py\n#define MOELAB_ISA_LEVEL 1\n#include "{k.as_posix()}"\n'
    assert b.isa_levels("aarch64") == {"scalar": {"MOELAB_ISA_LEVEL": 0},
                                       "neon": {"MOELAB_ISA_LEVEL": 0, "MOELAB_ISA_NEON": 1}}
    assert b.isa_levels("arm64") == b.isa_levels("aarch64")
    assert b.isa_levels("riscv64") == {"scalar": {"MOELAB_ISA_LEVEL": 0}}


@needs_tools
def test_bindings_cross_compile_for_aarch64():
    """The torch bindings compile for aarch64 (-Wall -Werror, syntax and types) against torch's
    headers: with the kernels, the whole extension's C++ needs nothing x86."""
    errors = cross_cpu.check_bindings()
    assert errors == "", errors[:4000]
