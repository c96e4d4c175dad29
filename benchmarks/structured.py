"""What does structured output cost? JSON-Schema-constrained vs free decoding on SmolLM2.

Same chat prompt, same number of tokens, one warm-up request of each side first (not counted), then
sides alternating within each run:
- b1: one request of --tokens tokens, plain (ignore_eos) vs constrained to a schema that needs
  more than --tokens tokens (a list of at least 8 people), so both sides stop at LENGTH;
  tok/s = (tokens - 1) / decode seconds; overhead_b1 = plain tok/s / constrained tok/s;
- c16: --concurrency such requests at once, all plain vs all constrained; tok/s = all tokens
  over the wall time; overhead_c16 likewise; also the mask's milliseconds per step;
- compile: the one-person test schema compiled on an empty cache (p50 of --compiles), then
  again from the cache;
- validity: --requests seeded requests at temperature 1.0 constrained to the one-person
  schema; valid_fraction = the share whose text parses and validates with jsonschema.

Prints a table, then one JSON line (targets under "targets"); --record keeps it in
benchmarks/results/structured.json.

    python benchmarks/structured.py [--runs 3] [--tokens 128] [--concurrency 16] [--record]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jsonschema  # noqa: E402

from benchmarks.results import add_record_arg, emit, target  # noqa: E402
from protos.params import ChatMessage, PromptInput, ResponseFormat, SamplingParams  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.text_engine import TextEngine  # noqa: E402
from worker.factory import build_text_engine  # noqa: E402

PERSON: dict[str, Any] = {  # tests/test_structured.py's schema
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 8}},
          "required": ["people"], "additionalProperties": False}
PROMPT = PromptInput(messages=(ChatMessage("user", "Describe some people as JSON, with a name, age, role "
                                                   "and address each."),))


def run(engine: TextEngine, requests: dict[str, SamplingParams]) -> tuple[dict[str, Any], float, list[float]]:
    """(outputs by request: text, finish reason, usage), wall seconds, mask seconds per step."""
    start = time.perf_counter()
    for request_id, params in requests.items():
        engine.add_request(request_id, PROMPT, params)
    texts = {r: "" for r in requests}
    out: dict[str, Any] = {}
    masks = []
    while engine.has_unfinished():
        for o in engine.step():
            texts[o.request_id] += o.text
            if o.finished:
                out[o.request_id] = (texts[o.request_id], o.finish_reason, o.usage)
        masks.append(engine.engine.runner.mask_seconds)
    return out, time.perf_counter() - start, [m for m in masks if m > 0]


def throughput(engine: TextEngine, n: int, tokens: int, fmt: ResponseFormat | None, seed: int) -> tuple[float,
                                                                                                    list[float]]:
    params = {f"r{i}": SamplingParams(max_tokens=tokens, temperature=0.0 if n == 1 else 1.0, seed=seed + i,
                                      ignore_eos=fmt is None, response_format=fmt) for i in range(n)}
    out, wall, masks = run(engine, params)
    num_tokens = sum(u.completion_tokens for _, _, u in out.values())
    if n == 1:
        (_, _, usage), = out.values()
        return (usage.completion_tokens - 1) / usage.decode_time_s, masks
    return num_tokens / wall, masks


def compile_ms(engine: TextEngine, fmt: ResponseFormat, n: int) -> tuple[float, float]:
    """(p50 of n compilations on an empty cache, one from the cache), milliseconds."""
    grammar = engine.engine.grammar
    assert grammar is not None, "needs the structured extra (xgrammar)"
    times = []
    for _ in range(n):
        grammar._cache.clear()
        start = time.perf_counter()
        grammar.compile(fmt).result()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    grammar.compile(fmt).result()
    return statistics.median(times) * 1000, (time.perf_counter() - start) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="alternating runs of each side (median)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=20, help="sampled requests for valid_fraction")
    ap.add_argument("--compiles", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    add_record_arg(ap)
    args = ap.parse_args()
    engine = build_text_engine(EngineConfig(num_threads=args.threads, max_num_seqs=max(args.concurrency,
                                                                                         args.requests),
                                            max_model_len=1024, enable_prefix_caching=False))
    people = ResponseFormat("json_schema", text=json.dumps(PEOPLE), is_strict=True)
    person = ResponseFormat("json_schema", text=json.dumps(PERSON), is_strict=True)
    compile_p50, cached = compile_ms(engine, person, args.compiles)
    for fmt in (None, people):  # warm-up, not counted: a fresh engine's first runs were up to 15% slower
        throughput(engine, 1, args.tokens, fmt, seed=0)
    sides: dict[str, list[float]] = {k: [] for k in ("b1_plain", "b1_json", "c_plain", "c_json")}
    mask_ms: list[float] = []
    for i in range(args.runs):  # alternating, the order flipped every run
        order = [(None, "plain"), (people, "json")][:: 1 if i % 2 == 0 else -1]
        for fmt, side in order:
            sides[f"b1_{side}"].append(throughput(engine, 1, args.tokens, fmt, seed=i)[0])
        for fmt, side in order:
            tps, masks = throughput(engine, args.concurrency, args.tokens, fmt, seed=100 * i)
            sides[f"c_{side}"].append(tps)
            mask_ms += [m * 1000 for m in masks]
    tps = {k: statistics.median(v) for k, v in sides.items()}
    valid_params = {f"v{i}": SamplingParams(max_tokens=256, temperature=1.0, seed=i, response_format=person)
                    for i in range(args.requests)}
    outputs, _, _ = run(engine, valid_params)
    num_valid = sum(1 for text, _, _ in outputs.values() if _is_valid(text))
    valid = num_valid / args.requests
    overhead_b1, overhead_c = tps["b1_plain"] / tps["b1_json"], tps["c_plain"] / tps["c_json"]
    mask_p50 = statistics.median(mask_ms) if mask_ms else None
    print(f"{'measure':40} {'plain':>10} {'constrained':>12} {'overhead':>9}")
    print(f"{'1 request, tok/s':40} {tps['b1_plain']:10.1f} {tps['b1_json']:12.1f} {overhead_b1:9.3f}")
    print(f"{f'{args.concurrency} concurrent, tok/s':40} {tps['c_plain']:10.1f} {tps['c_json']:12.1f} "
          f"{overhead_c:9.3f}")
    print(f"compile {compile_p50:.2f} ms (p50 of {args.compiles}), cached {cached:.3f} ms; "
          f"mask {mask_p50 if mask_p50 is None else round(mask_p50, 3)} ms/step at {args.concurrency}; "
          f"valid {num_valid}/{args.requests}")
    emit("structured", {
        "tokens": args.tokens, "concurrency": args.concurrency, "runs": args.runs, "threads": args.threads,
        "tps": tps, "overhead_b1": overhead_b1, "overhead_c16": overhead_c, "compile_ms_p50": compile_p50,
        "cached_compile_ms": cached, "mask_ms_per_step_p50": mask_p50, "valid_fraction": valid,
        "targets": {"overhead_b1": target(overhead_b1, "<=", 1.05),
                    "overhead_c16": target(overhead_c, "<=", 1.10),
                    "valid_fraction": target(valid, "==", 1.0)},
    }, args)


def _is_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


if __name__ == "__main__":
    main()
