"""benchmarks/results.py: targets next to values, and what a recorded run keeps."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import results


def test_a_target_says_whether_its_value_meets_it() -> None:
    assert results.target(0.46, "<=", 0.5) == {"value": 0.46, "target": "<= 0.5", "met": True}
    assert results.target(1.2, ">=", 2)["met"] is False
    assert results.target(True, "==", True) == {"value": True, "target": "== true", "met": True}
    assert results.target(None, "<=", 20)["met"] is None
    assert results.target(float("nan"), ">=", 1)["met"] is None
    with pytest.raises(ValueError, match="unknown target operator"):
        results.target(1, "<", 2)


def test_cpu_info_names_the_model_and_the_isa_flags() -> None:
    info = results.cpu_info("processor : 0\nmodel name : Some EPYC\nflags : fpu avx2 avx512f avx512_vnni "
                            "amx_tile\nprocessor : 1\nmodel name : other\n")
    assert info["model"] == "Some EPYC"
    assert info["isa"] == {"avx2": True, "avx512f": True, "avx512_vnni": True, "avx512_bf16": False,
                           "avx_vnni": False, "amx": True}
    assert info["cores"] >= 1


def test_the_command_is_relative_to_the_checkout() -> None:
    argv = [str(results.ROOT / "benchmarks" / "kv.py"), "--runs", "3", "--record"]
    assert results.command_line(argv) == "python benchmarks/kv.py --runs 3 --record"


def emit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record: bool, smoke: str | None = None) -> Path:
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr("sys.argv", [str(results.ROOT / "benchmarks" / "kv.py"), "--record"])
    results.emit("kv", {"x": 1, "targets": {"x": results.target(1, "==", 1)}},
                 argparse.Namespace(record=record), smoke=smoke)
    return tmp_path / "kv.json"


def test_emit_prints_the_json_line_and_records_only_when_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert not emit(tmp_path, monkeypatch, record=False).exists()
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["x"] == 1
    assert not emit(tmp_path, monkeypatch, record=True, smoke="--quick smoke run").exists()
    assert "not recorded (--quick smoke run)" in capsys.readouterr().err
    path = emit(tmp_path, monkeypatch, record=True)
    saved = json.loads(path.read_text())
    assert saved["benchmark"] == "kv" and saved["payload"]["x"] == 1
    assert saved["command"] == "python benchmarks/kv.py --record"
    assert saved["date"].endswith("+00:00") and set(saved["git"]) == {"commit", "dirty"}
    assert {"model", "isa", "cores"} <= set(saved["cpu"])
