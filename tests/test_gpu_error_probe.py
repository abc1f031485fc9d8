"""scripts/gpu_error_probe.py, the per-process error cases of scripts/gpu_check.sh, run here on
the CPU extension (the same cases, device cpu): every case raises the error naming its argument
and leaves the process able to compute; a case that kills its process is reported as crashed,
with faulthandler's traceback, and does not stop the cases after it."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "scripts" / "gpu_error_probe.py"


def _run(tmp_path, *args):
    p = subprocess.run([sys.executable, str(PROBE), "--out", str(tmp_path), "--device", "cpu", *args],
                       capture_output=True, text=True, timeout=600)
    with open(tmp_path / "errors.csv", newline="") as f:
        return p, {r["case"]: r for r in csv.DictReader(f)}


def test_every_error_case_raises_by_name_on_the_cpu(tmp_path):
    p, rows = _run(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert len(rows) == 8 and all(r["result"] == "ok" for r in rows.values()), rows
    assert "'topk_ids'" in rows["status_fused_experts"]["detail"] and "'ids'" in rows["status_permute"]["detail"]


def test_a_crash_is_reported_and_the_next_case_still_runs(tmp_path):
    p, rows = _run(tmp_path, "--cases", "selftest_crash,cpu_binding")
    assert p.returncode == 1
    # killed by SIGSEGV, or (under `make sanitize`) exited by AddressSanitizer after its report
    crash = rows["selftest_crash"]
    assert crash["result"] == "crashed" and "Segmentation fault" in crash["detail"], crash
    assert rows["cpu_binding"]["result"] == "ok"
    assert "Segmentation fault" in (tmp_path / "errors.txt").read_text()   # faulthandler's report
