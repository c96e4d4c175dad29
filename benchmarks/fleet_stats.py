"""The pure half of benchmarks/fleet.py: the token checker, the counter deltas, percentiles,
the per-point row, the headline figures, the targets and the table. No processes, no I/O
(tests/test_bench_fleet.py checks it on hand-made numbers).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.results import target

TokenIds = Callable[[int, int, int], list[int]]  # (seed, start, count) -> ids, as sim_token_ids
TokenText = Callable[[int], str]  # token id -> its text, as sim_text


@dataclass
class StreamCheck:
    """Checks one request's chunks against the tokens the sim engine must produce.

    Chunk `index` is the chunk's position in the stream (generate.proto); the tokens are
    numbered by their position over all chunks. A chunk index seen before counts its
    tokens as duplicated; a gap in the indices counts the missing chunks' tokens as lost
    (one token per chunk, as the sim engine emits one token per step); ids or text that
    differ from `token_ids(seed, position, n)` count as mismatched. `finish` counts the
    tokens a finished request still owed as lost.
    """

    seed: int
    token_ids: TokenIds
    token_text: TokenText | None = None
    next_index: int = 0
    num_tokens: int = 0  # tokens received in order, = the next token's position
    num_lost: int = 0
    num_duplicated: int = 0
    num_mismatched: int = 0

    def feed(self, index: int, ids: Sequence[int], text: str | None = None) -> None:
        if index < self.next_index:
            self.num_duplicated += max(1, len(ids))
            return
        if index > self.next_index:  # chunks next_index..index-1 never came
            self.num_lost += index - self.next_index
            self.num_tokens += index - self.next_index
        self.next_index = index + 1
        expected = self.token_ids(self.seed, self.num_tokens, len(ids))
        self.num_mismatched += sum(a != b for a, b in zip(ids, expected, strict=True))
        if text is not None and self.token_text is not None and ids:
            if text != "".join(self.token_text(t) for t in expected) and list(ids) == expected:
                self.num_mismatched += len(ids)  # right ids, wrong text
        self.num_tokens += len(ids)

    def finish(self, num_completion_tokens: int) -> None:
        """The request ended (its Final came) and says it generated this many tokens."""
        self.num_lost += max(0, num_completion_tokens - self.num_tokens)


@dataclass
class Errors:
    lost: int = 0
    duplicated: int = 0
    mismatched: int = 0

    def add(self, check: StreamCheck) -> None:
        self.lost += check.num_lost
        self.duplicated += check.num_duplicated
        self.mismatched += check.num_mismatched

    @property
    def total(self) -> int:
        return self.lost + self.duplicated + self.mismatched


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def redis_counters(info: dict[str, Any]) -> dict[str, float]:
    """The INFO fields the bench uses, from redis-py's parsed `INFO all`."""
    commandstats = sum(int(v["calls"]) for k, v in info.items()
                       if k.startswith("cmdstat_") and isinstance(v, dict) and k != "cmdstat_info")
    return {
        "cpu_s": float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        + float(info.get("used_cpu_sys_children", 0)) + float(info.get("used_cpu_user_children", 0)),
        "net_input_bytes": float(info["total_net_input_bytes"]),
        "aof_bytes": float(info.get("aof_current_size", 0)),
        "aof_rewrites": float(info.get("aof_rewrites", 0)),
        "commands": float(info["total_commands_processed"]),
        "calls": float(commandstats),
    }


def command_calls(info: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(calls, usec) per command (scripts' inner commands included; a script's usec includes
    theirs) from `INFO all`'s commandstats."""
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in info.items()
            if k.startswith("cmdstat_") and isinstance(v, dict)}


def print_command_calls(start: dict[str, tuple[int, int]], end: dict[str, tuple[int, int]],
                        num_tokens: int) -> None:
    """--commands: each command's calls per token and Redis CPU ms per 1k tokens over the
    window, most frequent first."""
    delta = {k: (n - start.get(k, (0, 0))[0], us - start.get(k, (0, 0))[1])
             for k, (n, us) in end.items() if n > start.get(k, (0, 0))[0]}
    top = sorted(delta.items(), key=lambda kv: -kv[1][0])
    per = max(num_tokens, 1)
    print("  calls per token (ms per 1k tokens): "
          + ", ".join(f"{k} {n / per:.4f} ({us / per:.3f})" for k, (n, us) in top), file=sys.stderr)


def cpu_busy(start: Sequence[int], end: Sequence[int]) -> float:
    """Share of CPU time not idle between two /proc/stat 'cpu' lines (user nice system idle
    iowait irq softirq steal ...)."""
    delta = [b - a for a, b in zip(start, end, strict=False)]
    total = sum(delta[:8])
    idle = delta[3] + (delta[4] if len(delta) > 4 else 0)
    return (total - idle) / total if total > 0 else 0.0


@dataclass
class PointResult:
    """What one sweep point measured over its window (deltas of counters taken at its ends)."""

    num_workers: int
    num_streams: int
    output_len: int
    step_ms: float
    window_s: float
    num_tokens: int = 0
    redis: dict[str, float] = field(default_factory=dict)  # redis_counters deltas
    gateway_cpu_s: float = 0.0
    worker_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    machine_busy: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    errors: Errors = field(default_factory=Errors)
    num_open_at_start: int = 0
    num_refused: int = 0  # calls that ended with a gRPC error during the point
    error: str | None = None  # the point crashed: which process, its last log lines

    def row(self) -> dict[str, Any]:
        """The per-point dict of the JSON line and the table."""
        n, r, step_s = self.num_tokens, self.redis, self.step_ms / 1000

        def per_token(x: float, scale: float = 1.0) -> float | None:
            return scale * x / n if n else None

        def per_1k(x: float) -> float | None:
            return per_token(x, 1000.0)

        def ms(v: float | None) -> float | None:
            return None if v is None else 1000 * v

        itl = [g - step_s for g in self.gaps_s]
        ttft = [t - step_s for t in self.ttfts_s]
        is_aof_valid = bool(r) and r.get("aof_rewrites", 0) == 0
        return {
            "workers": self.num_workers, "streams": self.num_streams, "output_len": self.output_len,
            "step_ms": round(self.step_ms, 3), "window_s": round(self.window_s, 3), "tokens": n,
            "tokens_per_s": n / self.window_s if self.window_s and self.error is None else None,
            "offered_tokens_per_s": self.num_streams / step_s if step_s else None,
            "redis_cpu_s_per_1k_tokens": per_1k(r["cpu_s"]) if r else None,
            "redis_bytes_per_token": per_token(r["net_input_bytes"]) if r else None,
            "aof_bytes_per_token": per_token(r["aof_bytes"]) if is_aof_valid else None,
            "redis_cmds_per_token": per_token(r["commands"]) if r else None,
            "redis_calls_per_token": per_token(r["calls"]) if r else None,
            "gateway_cpu_s_per_1k_tokens": per_1k(self.gateway_cpu_s),
            "worker_cpu_s_per_1k_tokens": per_1k(self.worker_cpu_s),
            "client_cpu_s_per_1k_tokens": per_1k(self.client_cpu_s),
            "added_itl_p50_ms": ms(percentile(itl, 0.5)), "added_itl_p99_ms": ms(percentile(itl, 0.99)),
            "num_gaps": len(itl),
            "ttft_overhead_p50_ms": ms(percentile(ttft, 0.5)),
            "ttft_overhead_p99_ms": ms(percentile(ttft, 0.99)), "num_ttfts": len(ttft),
            "lost": self.errors.lost, "duplicated": self.errors.duplicated,
            "mismatched": self.errors.mismatched, "refused_calls": self.num_refused,
            "open_streams_at_start": self.num_open_at_start,
            "machine_busy": self.machine_busy if self.error is None else None,
            "error": self.error,
        }


def _find(rows: list[dict[str, Any]], streams: int, output_len: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["streams"] == streams and r["output_len"] == output_len
                 and r["error"] is None), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary figures: 'large' is the largest S run (1024 in the full sweep), 'small'
    the smallest (64), 'mid' 256 if run, else the middle one; 'long'/'short' the longest and
    shortest output lengths (4096 / 64). The issue frames its JSON at 4,096-token outputs,
    so redis_cmds_per_token is read at ('mid', 'long'); at 64-token outputs a request's fixed
    ~27 commands (ATTACH, claim, OWN, the final's XACK and XDEL, the call's SUBSCRIBE, ...)
    dominate, and that figure is printed beside it as redis_cmds_per_token_short_output, with
    no target. added_itl_p99_ms (at 'large') is the worse of the output lengths; growths and
    the ratio are None when the run has only one size or one length."""
    ok = [r for r in rows if r["error"] is None]
    sizes = sorted({r["streams"] for r in ok})
    lens = sorted({r["output_len"] for r in ok})
    if not sizes:
        return {"headline_points": None}
    large, small = sizes[-1], sizes[0]
    mid = 256 if 256 in sizes else sizes[len(sizes) // 2]
    long_len, short_len = lens[-1], lens[0]
    # a ratio of a point to itself says nothing: None when only one size or length ran
    is_two_sizes, is_two_lens = large != small, long_len != short_len

    def get(streams: int, output_len: int, key: str) -> float | None:
        point = _find(ok, streams, output_len)
        return None if point is None else point[key]

    return {
        "headline_points": {"large_streams": large, "small_streams": small, "mid_streams": mid,
                            "long_output": long_len, "short_output": short_len},
        "redis_bytes_per_token": get(large, short_len, "redis_bytes_per_token"),
        "bytes_per_token_ratio_4096_vs_64": _ratio(get(large, long_len, "redis_bytes_per_token"),
                                                   get(large, short_len, "redis_bytes_per_token"))
        if is_two_lens else None,
        "gateway_cpu_s_per_1k_tokens": get(large, long_len, "gateway_cpu_s_per_1k_tokens"),
        "redis_cpu_s_per_1k_tokens": get(large, long_len, "redis_cpu_s_per_1k_tokens"),
        "gateway_cpu_growth_64_to_1024": _ratio(get(large, long_len, "gateway_cpu_s_per_1k_tokens"),
                                                get(small, long_len, "gateway_cpu_s_per_1k_tokens"))
        if is_two_sizes else None,
        "redis_cpu_growth_64_to_1024": _ratio(get(large, long_len, "redis_cpu_s_per_1k_tokens"),
                                              get(small, long_len, "redis_cpu_s_per_1k_tokens"))
        if is_two_sizes else None,
        "added_itl_p99_ms": max((r["added_itl_p99_ms"] for r in ok if r["streams"] == large
                                 and r["added_itl_p99_ms"] is not None), default=None),
        "redis_cmds_per_token": get(mid, long_len, "redis_cmds_per_token"),
        "redis_cmds_per_token_short_output": get(mid, short_len, "redis_cmds_per_token"),
    }


# name -> (operator, limit)
TARGETS: dict[str, tuple[str, float]] = {
    "redis_bytes_per_token": ("<=", 250),
    "bytes_per_token_ratio_4096_vs_64": ("<=", 1.5),
    "gateway_cpu_growth_64_to_1024": ("<=", 1.3),
    "redis_cpu_growth_64_to_1024": ("<=", 1.3),
    "gateway_cpu_s_per_1k_tokens": ("<=", 0.05),
    "redis_cpu_s_per_1k_tokens": ("<=", 0.01),
    "added_itl_p99_ms": ("<=", 20),
    "redis_cmds_per_token": ("<=", 0.2),
    "reject_p99_ms": ("<=", 20),
    "lost": ("==", 0),
    "duplicated": ("==", 0),
    "mismatched": ("==", 0),
}


def evaluate_targets(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target's value, limit and verdict, as benchmarks/results.target (met None: not
    measured in this run)."""
    return {name: target(summary.get(name), op, limit) for name, (op, limit) in TARGETS.items()}


COLUMNS = (  # (header, row key, format)
    ("W", "workers", "d"), ("S", "streams", "d"), ("len", "output_len", "d"), ("step", "step_ms", ".0f"),
    ("tok/s", "tokens_per_s", ".0f"), ("offered", "offered_tokens_per_s", ".0f"),
    ("rds s/1k", "redis_cpu_s_per_1k_tokens", ".4f"), ("rds B/t", "redis_bytes_per_token", ".0f"),
    ("aof B/t", "aof_bytes_per_token", ".0f"), ("cmd/t", "redis_cmds_per_token", ".3f"),
    ("call/t", "redis_calls_per_token", ".3f"), ("gw s/1k", "gateway_cpu_s_per_1k_tokens", ".4f"),
    ("wk s/1k", "worker_cpu_s_per_1k_tokens", ".4f"), ("cl s/1k", "client_cpu_s_per_1k_tokens", ".4f"),
    ("itl50", "added_itl_p50_ms", ".1f"), ("itl99", "added_itl_p99_ms", ".1f"),
    ("ttft50", "ttft_overhead_p50_ms", ".1f"), ("ttft99", "ttft_overhead_p99_ms", ".1f"),
    ("lost", "lost", "d"), ("dup", "duplicated", "d"), ("bad", "mismatched", "d"),
    ("busy", "machine_busy", ".0%"),
)


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per point; '-' for what was not measured, 'CRASHED' rows say why below."""
    cells = [[h for h, _, _ in COLUMNS]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else format(r[k], f) for _, k, f in COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines += [f"CRASHED W={r['workers']} S={r['streams']} len={r['output_len']}: {r['error']}"
              for r in rows if r.get("error")]
    return "\n".join(lines)
