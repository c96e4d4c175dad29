"""benchmarks/fleet.py's report: the table, the gRPC floor, the shedding burst and the plot."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.fleet_stats import format_table


def print_report(rows: list[dict[str, Any]], summary: dict[str, Any], shed: dict[str, Any],
                 floor: dict[str, Any], plot: Path) -> None:
    """Everything above the JSON line but the targets."""
    print(format_table(rows))
    if floor.get("cpu_s_per_1k_messages") is not None:
        print(f"gRPC floor: a no-op grpc.aio server streaming one message per token to {floor['streams']} "
              f"calls costs {floor['cpu_s_per_1k_messages']:.4f} CPU s per 1k messages; the gateway "
              f"{summary['gateway_cpu_over_grpc_floor']:.2f}x that (tokenrelay sends one message per token)")
    if shed.get("error"):
        print(f"CRASHED shedding test: {shed['error']}")
    elif shed["reject_p99_ms"] is not None:
        print(f"shedding, {shed['burst']} calls at once at a full queue: {shed['outcomes']}; refused in "
              f"p50 {shed['reject_p50_ms']:.1f} ms, p99 {shed['reject_p99_ms']:.1f} ms (no-op gRPC server, "
              f"same burst: p50 {shed['floor_reject_p50_ms']:.1f}, p99 {shed['floor_reject_p99_ms']:.1f})")
    else:
        print(f"shedding: {shed['outcomes']}, nothing refused")
    if summary.get("redis_cmds_per_token_short_output") is not None:
        print(f"Redis commands per token at S = {summary['headline_points']['mid_streams']}: "
              f"{summary['redis_cmds_per_token']:.3f} with the longest outputs (the target's frame), "
              f"{summary['redis_cmds_per_token_short_output']:.3f} with the shortest (no target: a request's "
              "fixed ~27 commands dominate)")
    if write_plot(rows, plot, summary.get("grpc_floor_cpu_s_per_1k_messages")):
        print(f"plot: {plot}")
    print(f"machine busy is all of this machine's CPUs ({os.cpu_count()}): every process shares them, "
          "so compare points within one run")


def write_plot(rows: list[dict[str, Any]], path: Path, floor_cpu: float | None = None) -> bool:
    """Gateway and Redis CPU per 1k tokens against S; floor_cpu: the gRPC floor (CPU s per 1k
    messages), drawn across the gateway's panel."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "gateway_cpu_s_per_1k_tokens", "gateway CPU s / 1k tokens"),
                           (axes[1], "redis_cpu_s_per_1k_tokens", "Redis CPU s / 1k tokens")):
        for output_len in sorted({r["output_len"] for r in rows}):
            points = sorted((r["streams"], r[key]) for r in rows
                            if r["output_len"] == output_len and r[key] is not None)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=f"{output_len}-token outputs")
        if key.startswith("gateway") and floor_cpu is not None:
            ax.axhline(floor_cpu, linestyle="--", color="grey",
                       label="gRPC floor: no-op grpc.aio server, largest S")
        ax.legend(loc="lower left")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams S")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
    fig.suptitle("tokenrelay fleet: cost per 1,000 tokens at one offered load (compare within a run)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value
