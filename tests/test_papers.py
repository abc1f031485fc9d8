"""papers/: claims.toml is well-formed data and agrees with itself, the seed notes exist, and every
figure of SPEC.md's "Figures the seeds report" table is recorded.

Rounding rule used throughout: a number printed with d decimals stands for anything within one
unit of its last digit (10**-d). One unit, not half, because the sources mix rounding and
truncation (975.9 / 611.7 = 1.5954 is printed as 1.59). Measured inputs (before, after) carry
half a unit of their last digit, propagated through the formula by evaluating its corners.
"""
from __future__ import annotations

import itertools
import math
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAPERS = ROOT / "papers"
CLAIMS_PATH = PAPERS / "claims.toml"

SEEDS = ("000", "001", "002", "003", "004")
NOTES = {
    "000": "000_cpu_moe_dynamic_dispatch.md",
    "001": "001_fused_fp32_router_gemm.md",
    "002": "002_rocm_shared_expert_gate_skinny_gemm.md",
    "003": "003_permute_scratch.md",
    "004": "004_lane_owned_topk_routing.md",
}
SOURCES = {
    "000": "vllm-project/vllm#50949",
    "001": "vllm-project/vllm#38445",
    "002": "vllm-project/vllm#54185",
    "003": "vllm-project/vllm#43014",
    "004": "flashinfer-ai/flashinfer#4152",
}
REQUIRED = ("seed", "id", "provenance", "metric", "reported", "hardware", "setting", "method", "source")
STRING_KEYS = REQUIRED + ("better", "ratio_source", "reproduce", "not_measurable", "fidelity",
                          "counterpart", "see", "notes", "seed_pair", "our_pair")
BOOL_KEYS = ("same_mechanism",)
NUMBER_KEYS = ("before", "after", "ratio", "change_pct", "gain_pct", "value")
RANGE_KEYS = ("ratio_range", "gain_pct_range")
KNOWN_KEYS = set(STRING_KEYS) | set(NUMBER_KEYS) | set(RANGE_KEYS) | set(BOOL_KEYS) | {"params"}
NOTEBOOK = re.compile(r"^experiments/00[0-9]_[a-z0-9_]+\.ipynb$")

# SPEC.md's table of reported figures, each as (seed, number, where it must appear).
# "figure": in a measured field (before, after, ratio, change_pct, gain_pct, value, or a range);
#           a percentage may also appear as a factor (ratio 1.28 <-> 28%).
# "param":  in a claim's params table (concurrency, shapes, batch, ...).
SPEC_FIGURES = [
    # 000: geomean 1.0866x over 27 points; Qwen3-Coder-30B-A3B FP8 ~1.10x;
    #      GPT-OSS-20B TP=4 611.7 -> 975.9 output tok/s (1.59x) at concurrency 32
    ("000", 1.0866, "figure"), ("000", 27, "param"), ("000", 1.10, "figure"),
    ("000", 4, "param"), ("000", 611.7, "figure"), ("000", 975.9, "figure"),
    ("000", 1.59, "figure"), ("000", 32, "param"),
    # 001: +32.2% throughput, -29.0% TTFT, -25.2% TPOT at concurrency 2; kernels 3 -> 1;
    #      GB200, H=3072, E=256, M<=32
    ("001", 32.2, "figure"), ("001", 29.0, "figure"), ("001", 25.2, "figure"),
    ("001", 2, "param"), ("001", 3, "figure"), ("001", 1, "figure"),
    ("001", 3072, "param"), ("001", 256, "param"), ("001", 32, "param"),
    # 002: 110.6 -> 55.6 ms per 100 decode steps (~2x); +3.5% throughput at concurrency 4;
    #      N = 512+1
    ("002", 110.6, "figure"), ("002", 55.6, "figure"), ("002", 100, "param"),
    ("002", 2, "figure"), ("002", 3.5, "figure"), ("002", 4, "param"),
    ("002", 512, "param"), ("002", 1, "param"),
    # 003: 14.44% at batch 1, 10.13% at batch 8, neutral from batch 32
    ("003", 14.44, "figure"), ("003", 1, "param"), ("003", 10.13, "figure"),
    ("003", 8, "param"), ("003", 32, "param"),
    # 004: 896 experts / top-16 / 512 tokens: 20.473 -> 12.296 us (1.665x, +66.51%);
    #      most other shapes 0-28%
    ("004", 896, "param"), ("004", 16, "param"), ("004", 512, "param"),
    ("004", 20.473, "figure"), ("004", 12.296, "figure"), ("004", 1.665, "figure"),
    ("004", 66.51, "figure"), ("004", 0, "figure"), ("004", 28, "figure"),
]


# --------------------------------------------------------------------------------- helpers
def load_claims() -> list[dict]:
    with open(CLAIMS_PATH, "rb") as f:
        data = tomllib.load(f)
    assert set(data) == {"claim"}, f"claims.toml: only [[claim]] tables expected, got {sorted(data)}"
    return data["claim"]


CLAIMS = load_claims()


def decimals(x: float | int) -> int:
    """Digits after the decimal point as written (Python's repr round-trips TOML's text)."""
    if isinstance(x, int):
        return 0
    text = repr(float(x))
    assert "e" not in text.lower(), f"unexpected exponent notation: {text}"
    return len(text.split(".")[1]) if "." in text else 0


def unit(x: float | int) -> float:
    return 10.0 ** -decimals(x)


def spread(f, *args: float) -> tuple[float, float]:
    """f at the stated values, and its largest deviation over the corners args +- half a unit."""
    centre = f(*args)
    corners = itertools.product(*[(a - unit(a) / 2, a + unit(a) / 2) for a in args])
    return centre, max(abs(f(*c) - centre) for c in corners)


def improvement(better: str, before: float, after: float) -> float:
    return after / before if better == "higher" else before / after


def close(reported: float, expected: float, slack: float) -> bool:
    return abs(reported - expected) <= unit(reported) + slack + 1e-12


def ids(claim: dict) -> str:
    return claim.get("id", "?")


def numbers_in(claim: dict, where: str) -> list[tuple[str, float]]:
    out = []
    if where == "param":
        for v in claim.get("params", {}).values():
            out.append(("param", v))
        return out
    for k in NUMBER_KEYS:
        if k in claim:
            out.append((k, claim[k]))
    for k in RANGE_KEYS:
        for v in claim.get(k, []):
            out.append((k, v))
    return out


def matches(spec_number: float, key: str, value: float) -> bool:
    d = decimals(spec_number)
    if round(abs(value), d) == spec_number:
        return True
    if key in ("ratio", "ratio_range"):   # a percentage recorded as a factor: 1.28 <-> 28
        return round(abs(value - 1.0) * 100.0, d) == spec_number
    return False


# --------------------------------------------------------------------------------- structure
def test_claims_parse_and_are_nonempty():
    assert len(CLAIMS) >= len(SEEDS)


@pytest.mark.parametrize("claim", CLAIMS, ids=ids)
def test_claim_has_required_keys_and_types(claim):
    missing = [k for k in REQUIRED if k not in claim]
    assert not missing, f"{ids(claim)}: missing {missing}"
    unknown = set(claim) - KNOWN_KEYS
    assert not unknown, f"{ids(claim)}: unknown keys {sorted(unknown)}"
    for k in STRING_KEYS:
        if k in claim:
            assert isinstance(claim[k], str) and claim[k].strip(), f"{ids(claim)}: {k} must be a non-empty string"
    for k in NUMBER_KEYS:
        if k in claim:
            assert isinstance(claim[k], (int, float)) and not isinstance(claim[k], bool), f"{ids(claim)}: {k}"
            assert math.isfinite(claim[k]), f"{ids(claim)}: {k} not finite"
    for k in BOOL_KEYS:
        if k in claim:
            assert isinstance(claim[k], bool), f"{ids(claim)}: {k} must be true or false"
    for k in RANGE_KEYS:
        if k in claim:
            lo_hi = claim[k]
            assert isinstance(lo_hi, list) and len(lo_hi) == 2, f"{ids(claim)}: {k} must be [lo, hi]"
            assert lo_hi[0] <= lo_hi[1], f"{ids(claim)}: {k} has lo > hi"
    if "params" in claim:
        assert isinstance(claim["params"], dict) and claim["params"], f"{ids(claim)}: params"
        for k, v in claim["params"].items():
            assert isinstance(v, (int, float)) and not isinstance(v, bool), f"{ids(claim)}: params.{k}"


@pytest.mark.parametrize("claim", CLAIMS, ids=ids)
def test_claim_vocabulary(claim):
    assert claim["seed"] in SEEDS, f"{ids(claim)}: seed {claim['seed']!r}"
    assert claim["id"].startswith(claim["seed"] + "-"), f"{ids(claim)}: id should start with its seed"
    assert re.fullmatch(r"[0-9]{3}-[a-z0-9-]+", claim["id"]), f"{ids(claim)}: id not a slug"
    assert claim["provenance"] in ("seed", "pr", "spec")
    assert claim["source"] == SOURCES[claim["seed"]], f"{ids(claim)}: source should be the seed's PR"


@pytest.mark.parametrize("claim", CLAIMS, ids=ids)
def test_claim_states_what_it_measures(claim):
    has = [k for k in ("ratio", "ratio_range", "value") if k in claim]
    assert len(has) == 1, f"{ids(claim)}: exactly one of ratio / ratio_range / value, got {has}"
    if "value" in claim:
        return
    assert claim.get("better") in ("higher", "lower"), f"{ids(claim)}: better"
    assert claim.get("ratio_source") in ("reported", "computed"), f"{ids(claim)}: ratio_source"
    if "ratio" in claim:
        assert claim["ratio"] > 0
    if ("before" in claim) != ("after" in claim):
        pytest.fail(f"{ids(claim)}: before and after come together")


@pytest.mark.parametrize("claim", CLAIMS, ids=ids)
def test_claim_is_reproduced_or_says_why_not(claim):
    has_rep, has_not = "reproduce" in claim, "not_measurable" in claim
    assert has_rep != has_not, f"{ids(claim)}: exactly one of reproduce / not_measurable"
    if has_rep:
        assert NOTEBOOK.match(claim["reproduce"]), f"{ids(claim)}: reproduce {claim['reproduce']!r}"
        assert claim["reproduce"].startswith(f"experiments/{claim['seed']}_"), \
            f"{ids(claim)}: notebook of another seed"
        assert claim.get("fidelity") in ("direct", "analogue"), f"{ids(claim)}: fidelity"
        assert "counterpart" in claim, f"{ids(claim)}: counterpart"
    else:
        assert "fidelity" not in claim and "counterpart" not in claim, f"{ids(claim)}: nothing measured"
        assert len(claim["not_measurable"]) >= 20, f"{ids(claim)}: give a real reason"
        if "see" in claim:
            assert NOTEBOOK.match(claim["see"]), f"{ids(claim)}: see {claim['see']!r}"


@pytest.mark.parametrize("claim", CLAIMS, ids=ids)
def test_claim_names_both_pairs(claim):
    """Every claim says what the seed compared and what we compare, each as '<before> -> <after>';
    a measured claim says whether the two pairs differ in the same thing (same_mechanism)."""
    for key in ("seed_pair", "our_pair"):
        assert key in claim, f"{ids(claim)}: missing {key}"
    assert " -> " in claim["seed_pair"], f"{ids(claim)}: seed_pair is '<before> -> <after>'"
    if "reproduce" in claim:
        assert " -> " in claim["our_pair"], f"{ids(claim)}: our_pair is '<before> -> <after>'"
        assert isinstance(claim.get("same_mechanism"), bool), f"{ids(claim)}: same_mechanism true/false"
    else:
        assert "same_mechanism" not in claim, f"{ids(claim)}: nothing measured, no mechanism to match"
        assert claim["our_pair"].startswith("none measured"), f"{ids(claim)}: our_pair"


def test_seed_004_pair_is_the_selection_pair():
    """Issue 17: 004 is judged on the before/after selection kernels, not on the eager chain."""
    for c in CLAIMS:
        if c["seed"] == "004":
            assert "serial" in c["our_pair"] and "lanes" in c["our_pair"], c["id"]
            assert "warp 0" in c["seed_pair"], c["id"]


def test_ids_are_unique():
    seen = [c["id"] for c in CLAIMS]
    dupes = sorted({i for i in seen if seen.count(i) > 1})
    assert not dupes, f"duplicate claim ids: {dupes}"


@pytest.mark.parametrize("seed", SEEDS)
def test_every_seed_has_claims_and_a_note_citing_its_pr(seed):
    assert any(c["seed"] == seed for c in CLAIMS), f"no claim for seed {seed}"
    note = PAPERS / NOTES[seed]
    assert note.is_file(), f"missing note {note.name}"
    text = note.read_text(encoding="utf-8")
    assert SOURCES[seed] in text, f"{note.name} does not cite {SOURCES[seed]}"
    for section in ("## The change", "## What was measured", "## What is not said",
                    "## How moelab reproduces it"):
        assert section in text, f"{note.name}: missing section {section!r}"


def test_references_cover_the_formats_and_routing():
    text = (PAPERS / "references.md").read_text(encoding="utf-8")
    for needle in ("Microscaling", "E8M0", "E2M1", "floor", "clip", "FP8 Formats for Deep Learning",
                   "448", "E5M2", "DeepSeek-V3", "topk_group", "1.702", "7.0", "Qwen3-30B-A3B",
                   "MiniMax-M2"):
        assert needle in text, f"references.md lacks {needle!r}"


def test_papers_hold_no_machine_paths():
    for path in PAPERS.iterdir():
        text = path.read_text(encoding="utf-8")
        for bad in ("/" + d + "/" for d in ("work", "tmp", "home")):
            assert bad not in text, f"{path.name} contains a machine path ({bad})"


# --------------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize("claim", [c for c in CLAIMS if "ratio" in c and "before" in c], ids=ids)
def test_ratio_agrees_with_before_after(claim):
    b, a, r = claim["before"], claim["after"], claim["ratio"]
    expected, slack = spread(lambda b, a: improvement(claim["better"], b, a), b, a)
    assert close(r, expected, slack), f"{ids(claim)}: ratio {r} but before/after give {expected:.5f}"


@pytest.mark.parametrize("claim", [c for c in CLAIMS if "change_pct" in c and "before" in c], ids=ids)
def test_change_pct_agrees_with_before_after(claim):
    b, a, p = claim["before"], claim["after"], claim["change_pct"]
    expected, slack = spread(lambda b, a: (a - b) / b * 100.0, b, a)
    assert close(p, expected, slack), f"{ids(claim)}: change_pct {p} but before/after give {expected:.4f}"


@pytest.mark.parametrize("claim", [c for c in CLAIMS if "change_pct" in c and "ratio" in c], ids=ids)
def test_ratio_agrees_with_change_pct(claim):
    r, p = claim["ratio"], claim["change_pct"]
    if claim["better"] == "higher":
        f = lambda p: 1.0 + p / 100.0
    else:
        f = lambda p: 1.0 / (1.0 + p / 100.0)
    expected, slack = spread(f, p)
    assert close(r, expected, slack), f"{ids(claim)}: ratio {r} but change_pct gives {expected:.5f}"


@pytest.mark.parametrize("claim", [c for c in CLAIMS if "gain_pct" in c], ids=ids)
def test_gain_pct_agrees_with_ratio(claim):
    # gain = speedup - 1 (FlashInfer's convention); compare on the ratio scale
    g, r = claim["gain_pct"], claim["ratio"]
    expected, slack = spread(lambda g: 1.0 + g / 100.0, g)
    assert close(r, expected, slack), f"{ids(claim)}: gain_pct {g}% but ratio {r}"


@pytest.mark.parametrize("claim", [c for c in CLAIMS if "gain_pct_range" in c], ids=ids)
def test_gain_pct_range_agrees_with_ratio_range(claim):
    for g, r in zip(claim["gain_pct_range"], claim["ratio_range"]):
        expected, slack = spread(lambda g: 1.0 + g / 100.0, g)
        assert close(r, expected, slack), f"{ids(claim)}: gain {g}% vs ratio {r}"


def test_improvement_direction_matches_sign_of_change():
    for c in CLAIMS:
        if "ratio" in c and "change_pct" in c and c["change_pct"] != 0:
            improved = (c["change_pct"] > 0) == (c["better"] == "higher")
            assert improved == (c["ratio"] > 1), f"{ids(c)}: ratio {c['ratio']} vs change {c['change_pct']}%"


# --------------------------------------------------------------------------------- SPEC coverage
@pytest.mark.parametrize("seed,number,where", SPEC_FIGURES,
                         ids=[f"{s}:{n}:{w}" for s, n, w in SPEC_FIGURES])
def test_spec_figure_is_recorded(seed, number, where):
    found = [(c["id"], k, v) for c in CLAIMS if c["seed"] == seed
             for k, v in numbers_in(c, where) if matches(number, k, v)]
    assert found, f"SPEC figure {number} ({where}) of seed {seed} is not in claims.toml"


def test_spec_headline_pairs_are_in_one_claim():
    """Before/after pairs from SPEC's table must sit together in one claim, not by coincidence."""
    pairs = {"000": (611.7, 975.9), "002": (110.6, 55.6), "004": (20.473, 12.296), "001": (3, 1)}
    for seed, (b, a) in pairs.items():
        assert any(c["seed"] == seed and c.get("before") == b and c.get("after") == a for c in CLAIMS), \
            f"seed {seed}: no claim with before={b}, after={a}"
