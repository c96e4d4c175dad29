"""benchmarks/kernel_limits.py: a --quick run (SmolLM2, ~15 s) prints its table and ends with the
JSON line of every figure the issue asks for and its targets; no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"machine_read_bytes_per_s", "decode_kernels", "b1_step_ms", "b1_forward_ms", "b1_host_overhead_ms",
        "b1_decode_bytes_per_s", "decode_bandwidth_fraction", "prefill_gops", "int8_peak_gops",
        "int16_dot_gops", "int16_peak_gops", "prefill_peak_fraction", "prefill_int8_gemm_fraction"}
TARGETS = {"decode_bandwidth_fraction", "prefill_peak_fraction", "b1_host_overhead_ms"}


@pytest.mark.slow
def test_quick_run_prints_the_table_and_ends_with_the_json() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "kernel_limits.py"), "--quick"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert any(line.split()[:2] == ["kernel", "rows"] for line in lines)
    assert any(line.startswith("decode_layers ") for line in lines)
    assert any("NOT MET" in line or "met)" in line for line in lines)
    summary = json.loads(lines[-1])
    assert KEYS <= set(summary) and summary["quick"] is True
    assert {(k["kernel"], k["rows"]) for k in summary["decode_kernels"]} == {
        ("decode_layers", 1), ("lm_head", 1), ("decode_layers", 16), ("lm_head", 16)}
    assert set(summary["targets"]) == TARGETS
    for t in summary["targets"].values():
        assert {"value", "target", "met"} <= set(t) and t["met"] in (True, False)
