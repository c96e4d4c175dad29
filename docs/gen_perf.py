"""docs/performance.md and README.md's headline block from benchmarks/results/*.json.

The template (docs/performance.in.md) is hand-written prose with two directives, each on a
line of its own: `<!-- results: NAME -->` becomes the provenance, targets and figures of
benchmarks/results/NAME.json (or "not recorded yet"), `<!-- headline -->` the headline table.
Nothing here measures or invents a number: a figure is in a results file or it is not shown.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docs.markdown import anchors

RESULTS_DIRECTIVE = re.compile(r"^<!-- results: ([a-z0-9_]+) -->$", re.MULTILINE)
HEADLINE_DIRECTIVE = "<!-- headline -->"
BEGIN, END = "<!-- BEGIN generated: headline -->", "<!-- END generated: headline -->"
RECORD_KEYS = ("benchmark", "date", "git", "cpu", "command", "payload")
Record = dict[str, Any]


def make_target(name: str) -> str:
    return "make bench-" + name.replace("_", "-")


def load_results(results_dir: Path) -> dict[str, Record]:
    """Every results file, by benchmark name; ValueError naming a file that does not parse."""
    out = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        missing = [k for k in RECORD_KEYS if k not in record] if isinstance(record, dict) else RECORD_KEYS
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)}: not a results file of benchmarks/results.py")
        if record["benchmark"] != path.stem:
            raise ValueError(f"{path}: holds benchmark {record['benchmark']!r}")
        out[path.stem] = record
    return out


def fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, list) and all(not isinstance(v, dict | list) for v in value):
        return ", ".join(fmt(v) for v in value)
    return str(value)


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def verdict(met: bool | None) -> str:
    return "met" if met else ("not measured" if met is None else "**NOT MET**")


def cpu_text(cpu: dict[str, Any]) -> str:
    isa = [name for name, present in cpu.get("isa", {}).items() if present]
    return f"{cpu.get('model', 'unknown')} ({', '.join(isa) or 'no AVX2'})"


def commit_text(git: dict[str, Any]) -> str:
    commit = git.get("commit")
    if not commit:
        return "unknown"
    return f"`{commit[:10]}`" + (" + uncommitted changes" if git.get("dirty") else "")


def provenance(name: str, record: Record) -> list[str]:
    return ["| recorded (UTC) | CPU | cores | commit | command | file |", "|---|---|---|---|---|---|",
            f"| {record['date']} | {cell(cpu_text(record['cpu']))} | {record['cpu'].get('cores', '?')} "
            f"| {commit_text(record['git'])} | `{record['command']}` | "
            f"[{name}.json](../benchmarks/results/{name}.json) |"]


Tables = list[tuple[str, list[dict[str, Any]]]]


def flatten(payload: dict[str, Any], prefix: str = "") -> tuple[list[tuple[str, Any]], Tables]:
    """(scalar figures by dotted key, lists of objects by key); the targets are left out."""
    scalars: list[tuple[str, Any]] = []
    tables: Tables = []
    for key, value in payload.items():
        if not prefix and key == "targets":
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            more_scalars, more_tables = flatten(value, name + ".")
            scalars += more_scalars
            tables += more_tables
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables.append((name, value))
        else:
            scalars.append((name, value))
    return scalars, tables


def figures(payload: dict[str, Any]) -> list[str]:
    scalars, tables = flatten(payload)
    lines = ["<details><summary>Every figure of this run</summary>", "", "| figure | value |", "|---|---|"]
    lines += [f"| `{key}` | {cell(fmt(value))} |" for key, value in scalars]
    for key, rows in tables:
        columns = list(dict.fromkeys(k for row in rows for k, v in row.items()
                                     if not isinstance(v, dict | list)))
        lines += ["", f"`{key}`:", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(fmt(row.get(c))) for c in columns) + " |" for row in rows]
    return [*lines, "", "</details>"]


def render_results(name: str, record: Record | None) -> str:
    if record is None:
        return f"_Not recorded yet: run `{make_target(name)}`._"
    payload = record["payload"]
    lines = provenance(name, record) + ["", "| target | value | limit | verdict |", "|---|---|---|---|"]
    for metric, t in payload.get("targets", {}).items():
        lines.append(f"| `{metric}` | {cell(fmt(t['value']))} | {cell(t['target'])} | {verdict(t['met'])} |")
    return "\n".join([*lines, "", *figures(payload)])


@dataclass(frozen=True)
class Headline:
    """One headline row: a figure of one results file against its reference in the same run."""

    label: str
    benchmark: str
    value: str
    reference: str | None = None  # payload key of the other side
    reference_label: str = ""
    ratio: str | None = None  # payload key of the ratio; else value / reference


HEADLINES = (
    Headline("batch-1 decode tok/s, fp32 engine vs transformers", "engine", "decode_tps_b1",
             "hf_decode_tps_b1", "transformers fp32", "decode_ratio"),
    Headline("batch-1 decode tok/s vs llama.cpp, same Q4_1 GGUF", "llamacpp", "b1_decode_tok_s_ours",
             "b1_decode_tok_s_llamacpp", "llama.cpp", "b1_decode_ratio"),
    Headline("512-token prefill tok/s vs llama.cpp", "llamacpp", "prefill512_tok_s_ours",
             "prefill512_tok_s_llamacpp", "llama.cpp", "prefill512_ratio"),
    Headline("512-token prefill tok/s vs transformers", "llamacpp", "prefill512_tok_s_ours",
             "prefill512_tok_s_hf", "transformers fp32"),
    Headline("16 concurrent requests tok/s, fp32 engine", "engine", "concurrent16_tps", "hf_static16_tps",
             "transformers static batch", "concurrent_vs_static"),
    Headline("16 sequences tok/s vs llama.cpp", "llamacpp", "concurrent16_tok_s_ours",
             "concurrent16_tok_s_llamacpp", "llama.cpp", "concurrent16_ratio"),
    Headline("48 chats in a 512 MB KV pool: peak running", "kv", "max_running", "slot_design_running",
             "one 2048-token slot each"),
    Headline("48 chats, one system prompt: output tok/s", "kv", "tps_48", "tps_48_no_cache",
             "prefix caching off", "tps_ratio"),
    Headline("speculative ngram, batch 1, repetitive: tok/s", "speculative", "rep_tps_ngram", "rep_tps_plain",
             "plain decoding", "b1_repetitive_speedup"),
    Headline("gateway + Redis + worker, 16 streams: tok/s", "e2e", "e2e_tps", "inproc_tps",
             "engine in-process", "ratio"),
    Headline("Redis commands per generated token (16 streams)", "e2e", "redis_cmds_per_token"),
    Headline("24 chats on 4 workers, prefix routing: cached share of turns 2-4 prompts", "routing",
             "hit_fraction_prefix", "hit_fraction_none", "--routing none"),
    Headline("24 chats on 4 workers, prefix routing: TTFT p50 ms of turns 2-4", "routing",
             "ttft_p50_ms_prefix", "ttft_p50_ms_none", "--routing none", "ttft_p50_prefix_over_none"),
    Headline("16 requests over 4 LoRA adapters: tok/s", "lora", "lora_tps", "base_tps",
             "same requests, base model, LoRA on", "lora_vs_base_tps"),
    Headline("fleet: gateway CPU s per 1k tokens (largest S)", "fleet", "gateway_cpu_s_per_1k_tokens",
             "grpc_floor_cpu_s_per_1k_messages", "no-op grpc.aio server, 1 message a token",
             "gateway_cpu_over_grpc_floor"),
    Headline("fleet: Redis CPU s per 1k tokens (largest S)", "fleet", "redis_cpu_s_per_1k_tokens"),
)


def section_anchors(template: str) -> dict[str, str]:
    """Benchmark name -> the anchor of the section its results directive is in."""
    out = {}
    for match in RESULTS_DIRECTIVE.finditer(template):
        before = anchors(template[:match.start()])
        out[match.group(1)] = before[-1] if before else ""
    return out


def headline_row(h: Headline, record: Record | None, link: str) -> str:
    label = f"[{h.label}]({link})"
    if record is None:
        return f"| {label} | not recorded yet: run `{make_target(h.benchmark)}` | | | | | | |"
    p = record["payload"]
    value = p.get(h.value)
    ref = p.get(h.reference) if h.reference else None
    ratio = p[h.ratio] if h.ratio in p else (value / ref if isinstance(value, int | float) and ref else None)
    t = p.get("targets", {}).get(h.ratio or "") or p.get("targets", {}).get(h.value)
    target = f"{cell(t['target'])}: {verdict(t['met'])}" if t else ""
    reference = f"{h.reference_label} {fmt(ref)}" if h.reference else ""
    ratio_text = f"{fmt(ratio)}×" if ratio is not None else ""
    return (f"| {label} | {fmt(value)} | {reference} | {ratio_text} | {target} | {record['date'][:10]} "
            f"| {cell(cpu_text(record['cpu']))}, {record['cpu'].get('cores', '?')} cores "
            f"| `{record['command']}` |")


def render_headline(results: dict[str, Record], anchor_of: dict[str, str], page: str) -> str:
    lines = ["| | tokenrelay | reference, same run | ratio | target | recorded | CPU | command |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [headline_row(h, results.get(h.benchmark), f"{page}#{anchor_of.get(h.benchmark, '')}")
              for h in HEADLINES]
    return "\n".join(lines)


def render_performance(template: str, results: dict[str, Record]) -> str:
    anchor_of = section_anchors(template)
    text = RESULTS_DIRECTIVE.sub(lambda m: render_results(m.group(1), results.get(m.group(1))), template)
    text = text.replace(HEADLINE_DIRECTIVE, render_headline(results, anchor_of, ""))
    note = ("<!-- Generated by `make docs` from docs/performance.in.md and benchmarks/results/*.json "
            "(`make bench-*` writes those): edit the template, not this file. -->\n\n")
    return note + text


def update_readme(readme: str, results: dict[str, Record], template: str | None = None) -> str:
    """README.md with its headline block regenerated; unchanged when it has no markers."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        return readme
    if template is None:
        template = (Path(__file__).parent / "performance.in.md").read_text()
    block = render_headline(results, section_anchors(template), "docs/performance.md")
    return readme[:start + len(BEGIN)] + "\n" + block + "\n" + readme[end:]
