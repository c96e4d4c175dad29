"""benchmarks/gpu.py runs: its --smoke mode takes the GPU run's code path on tiny shapes on CPU
(SmolLM2 parity with transformers, decode with and without static steps, prefill), so the script
a lent GPU machine runs is known to work; its numbers here mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_bench_runs_its_whole_path_on_cpu_with_smoke() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "parity_error" not in result and result["parity_ok"] and result["parity_tokens_compared"] == 16
    assert [(r["batch"], r["static_steps"]) for r in result["decode"]] == [(1, False), (1, True), (2, False),
                                                                            (2, True)]
    assert all(r["tok_s"] > 0 and r["cuda_graphs"] is False for r in result["decode"])
    assert result["prefill_tok_s"] > 0 and result["attention_backend"] == "torch"
    assert result["sampler_mismatches"] == 0 and result["sampler_fused_ms"] > 0


def test_without_a_gpu_the_full_run_says_so() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py")], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2 and "no CUDA device here" in done.stderr
