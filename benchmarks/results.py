"""What every benchmark's JSON line carries, and where a recorded run is kept.

A benchmark states its targets next to its numbers (`target(value, "<=", 0.5)` gives
{"value": 0.46, "target": "<= 0.5", "met": true}; met is null when the value was not
measured), prints its payload as the last line of stdout (`emit`), and, with `--record`
(what `make bench-*` passes), writes it to benchmarks/results/<name>.json with the run's
provenance: UTC date, git commit and whether the tree was dirty, CPU model and ISA flags,
core count and the exact command line. docs/gen.py renders those files into
docs/performance.md; a smoke run (fleet's --quick) is never recorded, so the docs cannot
show a smoke number as a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
# /proc/cpuinfo flag -> the name recorded; amx is any of amx_tile/amx_int8/amx_bf16
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx")
OPS = {"<=": lambda v, lim: v <= lim, ">=": lambda v, lim: v >= lim, "==": lambda v, lim: v == lim}


def target(value: Any, op: str, limit: float | bool) -> dict[str, Any]:
    """One target next to its value: met is None when the value was not measured."""
    if op not in OPS:
        raise ValueError(f"unknown target operator {op!r}: one of {', '.join(OPS)}")
    limit_text = str(limit).lower() if isinstance(limit, bool) else f"{limit:g}"
    is_measured = value is not None and not (isinstance(value, float) and math.isnan(value))
    return {"value": value, "target": f"{op} {limit_text}",
            "met": bool(OPS[op](value, limit)) if is_measured else None}


def add_record_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", action="store_true",
                        help="also write the JSON line, with date, commit, CPU and command, to "
                             "benchmarks/results/<name>.json (make bench-* passes it)")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """Model name and ISA flags of the first processor in /proc/cpuinfo, and the cores this
    process may run on."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    fields: dict[str, str] = {}
    for key, _, value in (line.partition(":") for line in cpuinfo.splitlines()):
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    isa = {name: (any(f.startswith("amx_") for f in flags) if name == "amx" else name in flags)
           for name in ISA_FLAGS}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": fields.get("model name") or platform.processor() or "unknown", "isa": isa,
            "cores": cores}


def git_info() -> dict[str, Any]:
    """The commit checked out and whether tracked files differ from it (None outside git)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed from the repository root: `python benchmarks/x.py ARGS`."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path("?")
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *argv[1:]])


def make_record(name: str, payload: dict[str, Any], argv: list[str] | None = None) -> dict[str, Any]:
    return {"benchmark": name, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "git": git_info(), "cpu": cpu_info(), "command": command_line(argv), "payload": payload}


def write_record(record: dict[str, Any], results_dir: Path | None = None) -> Path:
    results_dir = results_dir or RESULTS_DIR
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{record['benchmark']}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def emit(name: str, payload: dict[str, Any], args: argparse.Namespace, *, smoke: str | None = None) -> None:
    """Print the JSON line (last on stdout); with --record also keep it, unless `smoke` says
    why this run is not a measurement."""
    print(json.dumps(payload), flush=True)
    if not getattr(args, "record", False):
        return
    if smoke:
        print(f"not recorded ({smoke}): benchmarks/results/{name}.json left as it was", file=sys.stderr)
        return
    path = write_record(make_record(name, payload))
    print(f"recorded: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}", file=sys.stderr)
