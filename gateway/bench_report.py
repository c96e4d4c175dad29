"""What `tokenrelay bench` measured: per-request timings -> the metrics `vllm bench serve`
reports, the printed block, and the PNG plots.

Definitions (as in vLLM's benchmark_serving):
  TTFT  send -> the first chunk that carries a token.
  TPOT  (E2EL - TTFT) / (output tokens - 1), per request with more than one output token.
  ITL   gaps between consecutive token-bearing chunks; a chunk with k tokens after a gap g
        counts as k tokens, each g / k apart.
  E2EL  send -> the end of the stream.
  goodput  successful requests per second that meet every given SLO (TTFT, TPOT, E2EL in ms).
Percentiles come from numpy (linear interpolation); an empty list reports 0, like vLLM.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = (("ttft", "TTFT", "Time to First Token"),
                   ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                   ("itl", "ITL", "Inter-token Latency"),
                   ("e2el", "E2EL", "End-to-end Latency"),
                   ("queue_time", "queue time", "Server-reported queue time"))


@dataclass
class RequestResult:
    """One request as the load tool saw it; times in seconds."""

    start_s: float = 0.0  # when it was sent, since the run began
    end_s: float = 0.0  # when its stream ended, since the run began
    status: str = "OK"  # gRPC status code name
    finish_reason: str = ""  # FinishReason name from the final message ("" without one)
    error: str = ""
    chunk_times_s: list[float] = field(default_factory=list)  # token-bearing chunks, since start_s
    chunk_num_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0  # server-reported (usage)
    cached_prompt_tokens: int = 0
    queue_time_s: float = 0.0

    @property
    def is_success(self) -> bool:
        return self.status == "OK" and self.finish_reason not in ("", "ERROR", "ABORT") and bool(
            self.chunk_times_s)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_num_tokens)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0]

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        n = self.output_tokens
        return (self.e2el_s - self.ttft_s) / (n - 1) if n > 1 else None

    @property
    def itls_s(self) -> list[float]:
        return inter_token_latencies(self.chunk_times_s, self.chunk_num_tokens)


def inter_token_latencies(chunk_times_s: Sequence[float], chunk_num_tokens: Sequence[int]) -> list[float]:
    """Gaps between token-bearing chunks, a k-token chunk's gap split into k equal parts."""
    itls: list[float] = []
    for prev, now, k in zip(chunk_times_s, chunk_times_s[1:], chunk_num_tokens[1:], strict=False):
        itls += [(now - prev) / k] * k
    return itls


def _stats(name: str, values_ms: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    values = np.asarray(values_ms if len(values_ms) else [0.0], dtype=np.float64)
    stats = {f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(np.median(values)),
             f"std_{name}_ms": float(values.std())}
    for p in percentiles:
        stats[f"p{p:g}_{name}_ms"] = float(np.percentile(values, p))
    return stats


def timeline_bin_s(duration_s: float) -> float:
    """1 s bins (vLLM's peak-throughput window) unless the run is too short for 20 of them."""
    if duration_s >= 20:
        return 1.0
    raw = max(duration_s, 1e-3) / 20
    nice = 10 ** math.floor(math.log10(raw))
    return next(m * nice for m in (1, 2, 5, 10) if m * nice >= raw)


def timeline(results: Sequence[RequestResult], duration_s: float) -> dict[str, list[float]]:
    """Output tokens/s per bin, and requests in flight after each start/end event."""
    bin_s = timeline_bin_s(duration_s)
    num_bins = max(1, math.ceil(duration_s / bin_s))
    tokens = np.zeros(num_bins)
    events: list[tuple[float, int]] = []
    for r in results:
        for t, k in zip(r.chunk_times_s, r.chunk_num_tokens, strict=True):
            tokens[min(num_bins - 1, int((r.start_s + t) / bin_s))] += k
        events += [(r.start_s, 1), (r.end_s, -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    in_flight = np.cumsum([d for _, d in events]) if events else np.zeros(0)
    return {"bin_s": [bin_s], "bin_start_s": [i * bin_s for i in range(num_bins)],
            "output_tok_s": (tokens / bin_s).tolist(), "event_s": [t for t, _ in events],
            "in_flight": [float(n) for n in in_flight]}


def is_good(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    measured_ms = {"ttft": r.ttft_s * 1e3, "tpot": (r.tpot_s or 0.0) * 1e3, "e2el": r.e2el_s * 1e3}
    return all(measured_ms[name] <= limit for name, limit in slos_ms.items())


def compute_metrics(results: Sequence[RequestResult], duration_s: float, *, slos_ms: dict[str, float],
                    percentiles: Sequence[float]) -> dict[str, Any]:
    """The run's summary (flat, named like vLLM's result JSON) plus per-request arrays."""
    ok = [r for r in results if r.is_success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    curve = timeline(results, duration_s)
    m: dict[str, Any] = {
        "duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "total_cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
        "request_throughput": len(ok) / duration_s, "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "request_goodput": (sum(is_good(r, slos_ms) for r in ok) / duration_s) if slos_ms else None,
        "max_output_tokens_per_s": max(curve["output_tok_s"]),
        "max_concurrent_requests": int(max(curve["in_flight"], default=0)),
        "status_counts": dict(Counter(r.status for r in results)),
        "finish_reason_counts": dict(Counter(r.finish_reason or "none" for r in results)),
    }
    per_metric = {"ttft": [r.ttft_s * 1e3 for r in ok],
                  "tpot": [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None],
                  "itl": [x * 1e3 for r in ok for x in r.itls_s],
                  "e2el": [r.e2el_s * 1e3 for r in ok],
                  "queue_time": [r.queue_time_s * 1e3 for r in ok]}
    for name, values in per_metric.items():
        m.update(_stats(name, values, percentiles))
    m["timeline"] = curve
    m["requests"] = {
        "start_s": [r.start_s for r in results], "status": [r.status for r in results],
        "errors": [r.error for r in results], "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts_ms": [r.ttft_s * 1e3 if r.chunk_times_s else None for r in results],
        "e2els_ms": [r.e2el_s * 1e3 for r in results],
        "itls_ms": [[x * 1e3 for x in r.itls_s] for r in results],
        "queue_times_ms": [r.queue_time_s * 1e3 for r in results]}
    return m


def format_block(m: dict[str, Any], *, request_rate: float, max_concurrency: int | None,
                 percentiles: Sequence[float]) -> str:
    """The block `vllm bench serve` prints, plus gRPC statuses and the server's queue time."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append("{:<40} {:<10}".format(label, "None" if value is None else format(value, fmt)))

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Request rate configured (RPS):", request_rate, ".2f")
    row("Maximum request concurrency:", max_concurrency)
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Cached prompt tokens (server):", m["total_cached_prompt_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    if m["request_goodput"] is not None:
        row("Request goodput (req/s):", m["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    lines.append("{s:{c}^50}".format(s="gRPC status", c="-"))
    for status, count in sorted(m["status_counts"].items()):
        row(f"{status}:", count)
    lines.append("{s:{c}^50}".format(s="Finish reason", c="-"))
    for reason, count in sorted(m["finish_reason_counts"].items()):
        row(f"{reason.lower()}:", count)
    for key, short, title in LATENCY_METRICS:
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"], ".2f")
        row(f"Median {short} (ms):", m[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            if p != 50:  # that is the median, just above
                row(f"P{p:g} {short} (ms):", m[f"p{p:g}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def rate_label(run: dict[str, Any]) -> str:
    rate = run["request_rate"]
    label = "all at once" if math.isinf(rate) else f"{rate:g} req/s"
    if run.get("max_concurrency"):
        label += f", <= {run['max_concurrency']} in flight"
    return label


def _figure(num_rows: int = 1, num_cols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """A matplotlib Figure without pyplot (no global backend state; safe in any thread)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError("--plot-dir needs matplotlib: pip install 'tokenrelay[bench]'") from e
    fig = Figure(figsize=(4.8 * num_cols + 1.6, 3.2 * num_rows + 1.0), layout="constrained")
    return fig, fig.subplots(num_rows, num_cols, squeeze=False, **kwargs)


def _plot_cdf(runs: Sequence[dict[str, Any]], key: str, xlabel: str, what: str, path: Path) -> Path:
    fig, axes = _figure()
    ax = axes[0][0]
    lows: list[float] = []
    for run in runs:
        column = run["requests"][key]
        values = np.sort([x for v in column for x in (v if isinstance(v, list) else [v]) if x is not None])
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                    label=f"{rate_label(run)} (n={len(values)})")
            lows.append(float(values[0]))
    if lows and min(lows) > 0 and max(ax.get_xlim()) / min(lows) > 50:
        from matplotlib.ticker import FuncFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 1000, not 10^3
    for q in (0.5, 0.99):
        ax.axhline(q, color="grey", linestyle=":", linewidth=0.8)
        ax.annotate(f"p{q * 100:g}", (1.0, q), xycoords=("axes fraction", "data"), fontsize=8,
                    ha="right", va="bottom", color="grey")
    ax.set(xlabel=xlabel, ylabel=f"Fraction of {what} <= x", ylim=(0, 1.02),
           title=f"CDF of {xlabel.split(' (')[0].lower()}")
    ax.grid(alpha=0.3)
    if runs:
        ax.legend(fontsize=8, loc="lower right")
    fig.savefig(path, dpi=120)
    return path


def _plot_timeline(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    fig, axes = _figure(2, 1, sharex=True)
    top, bottom = axes[0][0], axes[1][0]
    for run in runs:
        curve = run["timeline"]
        edges = [*curve["bin_start_s"], curve["bin_start_s"][-1] + curve["bin_s"][0]]
        line = top.stairs(curve["output_tok_s"], edges, label=rate_label(run))
        bottom.step([0.0, *curve["event_s"]], [0.0, *curve["in_flight"]], where="post",
                    color=line.get_edgecolor(), label=rate_label(run))
    bins = sorted({f"{run['timeline']['bin_s'][0]:g} s" for run in runs})
    top.set(ylabel="Output tokens/s", title=f"Output throughput (tokens per {', '.join(bins)} bin)")
    bottom.set(xlabel="Time since the run started (s)", ylabel="Requests in flight",
               title="Requests sent and not yet finished")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="upper right")
    fig.savefig(path, dpi=120)
    return path


def _plot_latency_vs_throughput(runs: Sequence[dict[str, Any]], percentiles: Sequence[float],
                                path: Path) -> Path:
    fig, axes = _figure(1, 3)
    tail = max(percentiles, default=None)
    x = [run["request_throughput"] for run in runs]
    for ax, (key, short) in zip(axes[0], (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL")), strict=True):
        ax.plot(x, [run[f"median_{key}_ms"] for run in runs], marker="o", label="median")
        if tail is not None:
            ax.plot(x, [run[f"p{tail:g}_{key}_ms"] for run in runs], marker="s", linestyle="--",
                    label=f"p{tail:g}")
        for xi, run in zip(x, runs, strict=True):
            ax.annotate(rate_label(run).split(",")[0], (xi, run[f"median_{key}_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(4, -10))
        ax.set(xlabel="Achieved throughput (requests/s)", ylabel=f"{short} (ms)", title=f"{short} vs load")
        ax.set_ylim(bottom=0)
        ax.margins(x=0.15)  # room for the rate labels
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Latency vs throughput across the sweep (points labelled with the offered rate)")
    fig.savefig(path, dpi=120)
    return path


def write_plots(runs: Sequence[dict[str, Any]], percentiles: Sequence[float], plot_dir: Path) -> list[Path]:
    """TTFT and ITL CDFs, output tok/s and requests in flight over time, and, for a sweep
    (more than one run), latency vs throughput. Returns the PNG paths."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = [_plot_cdf(runs, "ttfts_ms", "Time to first token (ms)", "requests", plot_dir / "ttft_cdf.png"),
             _plot_cdf(runs, "itls_ms", "Inter-token latency (ms)", "token gaps", plot_dir / "itl_cdf.png"),
             _plot_timeline(runs, plot_dir / "timeline.png")]
    if len(runs) > 1:
        paths.append(_plot_latency_vs_throughput(runs, percentiles, plot_dir / "latency_vs_throughput.png"))
    return paths
