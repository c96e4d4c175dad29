"""Speculative decoding (--speculative ngram) vs plain decoding on SmolLM2, default quantization.

One engine in one process; the sides alternate request by request (plain/spec for each
prompt, spec/plain in the next run), so both see the same machine state: on the noisy 2-core
hosts, alternating whole workloads let the ratio swing by +-10% between runs. Greedy, EOS
ignored, chat template:
  * batch 1, repetitive: "repeat the following list" / "rewrite this code with a small
    change", prompts of >= 300 tokens: decode tokens/s (Usage.decode_time_s) and acceptance;
  * batch 1, open-ended: chat questions;
  * 16 concurrent requests (repetitive and open mixed): aggregate output tokens/s, wall clock.
The output is the same on both sides (checked: exit 1 after the JSON line otherwise). Targets:
batch-1 repetitive >= 1.5x plain, open-ended and 16 concurrent >= 0.95x (speculation must not
cost more than it saves where it cannot help), same output. Prints a table, then one JSON line
(medians over --runs, the targets under "targets"); --record keeps it in
benchmarks/results/speculative.json.

    python benchmarks/speculative.py [--runs 3] [--max-tokens 128] [--k 4] [--threads 2] [--record]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import add_record_arg, emit, target  # noqa: E402

FRUITS = ["apple", "banana", "cherry", "date", "elderberry", "fig", "grape", "honeydew", "kiwi", "lemon",
          "mango", "nectarine", "orange", "papaya", "quince", "raspberry", "strawberry", "tangerine"]
CODE = '''def load_orders(path):
    """Read orders from a CSV file and return them as dictionaries."""
    orders = []
    with open(path) as f:
        header = f.readline().strip().split(",")
        for line in f:
            fields = line.strip().split(",")
            order = dict(zip(header, fields))
            order["quantity"] = int(order["quantity"])
            order["price"] = float(order["price"])
            orders.append(order)
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["quantity"] * order["price"]
        totals[customer] = totals.get(customer, 0.0) + amount
    return totals


def top_customers(orders, n=5):
    totals = total_by_customer(orders)
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    return ranked[:n]


def main():
    orders = load_orders("orders.csv")
    for customer, total in top_customers(orders):
        print(f"{customer}: {total:.2f}")


if __name__ == "__main__":
    main()
'''
REPETITIVE = [
    "Repeat the following list exactly, one item per line:\n\n"
    + "\n".join(f"{i + 1}. {FRUITS[i % len(FRUITS)]} (box {i * 7 % 13}, shelf {i % 5})" for i in range(36)),
    "Rewrite this code with a small change: rename the function total_by_customer to "
    f"totals_per_customer. Output the whole file.\n\n```python\n{CODE}```",
    "Rewrite this code with a small change: print the top 3 customers instead of the top 5. "
    f"Output the whole file.\n\n```python\n{CODE}```",
]
OPEN = [
    "What are the main benefits of regular exercise?",
    "Explain how a rainbow forms, in simple words.",
    "Write a short story about a lighthouse keeper.",
]


def run_batch(engine: Any, prompts: list[str], max_tokens: int) -> tuple[float, list[Any], list[list[int]]]:
    """Run prompts together; (wall seconds, final usages, token ids per prompt)."""
    from protos.params import ChatMessage, PromptInput, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, text in enumerate(prompts):
        engine.add_request(f"q{i}", PromptInput(messages=(ChatMessage("user", text),)), params)
    usages: dict[str, Any] = {}
    ids: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            ids[o.request_id] += o.token_ids
            if o.finished:
                usages[o.request_id] = o.usage
    wall = time.perf_counter() - start
    return wall, [usages[f"q{i}"] for i in range(len(prompts))], [ids[f"q{i}"] for i in range(len(prompts))]


def decode_rate(usages: list[Any]) -> float:
    return sum(u.completion_tokens - 1 for u in usages) / sum(u.decode_time_s for u in usages)


def measure(engine: Any, k: int, max_tokens: int, run: int) -> dict[bool, dict[str, Any]]:
    """One run of every workload on both sides, alternating request by request."""
    from worker.engine.spec_policy import SpeculationPolicy

    order = (False, True) if run % 2 == 0 else (True, False)
    out: dict[bool, dict[str, Any]] = {side: {"rep": [], "open": [], "ids": []} for side in order}

    def one(side: bool, prompts: list[str]) -> tuple[float, list[Any]]:
        engine.engine.spec = SpeculationPolicy(k) if side else None
        wall, usages, ids = run_batch(engine, prompts, max_tokens)
        out[side]["ids"] += ids
        return wall, usages

    for key, prompts in (("rep", REPETITIVE), ("open", OPEN)):
        for prompt in prompts:
            for side in order:
                out[side][key] += one(side, [prompt])[1]
    mixed = [REPETITIVE[i % 3] if i % 2 else OPEN[i % 3] for i in range(16)]
    for side in order:
        wall16, usages16 = one(side, mixed)
        r = out[side]
        r["c16_tps"] = sum(u.completion_tokens for u in usages16) / wall16
        r["rep_tps"], r["open_tps"] = decode_rate(r["rep"]), decode_rate(r["open"])
        r["drafts"] = sum(u.num_draft_tokens for u in r["rep"])
        r["accepted"] = sum(u.num_accepted_tokens for u in r["rep"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--threads", type=int, default=2)
    add_record_arg(ap)
    args = ap.parse_args()

    import torch

    from worker.engine.config import EngineConfig
    from worker.factory import build_text_engine

    torch.set_num_threads(args.threads)
    config = EngineConfig(max_num_seqs=16, max_model_len=1024, num_threads=args.threads)
    engine = build_text_engine(config)
    prompt_lens = [len(engine.tokenizer.encode(p)) for p in REPETITIVE]
    assert min(prompt_lens) >= 300, prompt_lens
    run_batch(engine, OPEN[:1], 8)  # warm-up: first-call costs stay out of the first side
    results: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for run in range(args.runs):
        for side, result in measure(engine, args.k, args.max_tokens, run).items():
            results[side].append(result)
    same = all(a["ids"] == b["ids"] for a, b in zip(results[False], results[True], strict=True))

    def med(side: bool, key: str) -> float:
        return statistics.median(r[key] for r in results[side])

    accepted = sum(r["accepted"] for r in results[True])
    drafts = sum(r["drafts"] for r in results[True])
    summary = {
        "b1_repetitive_speedup": round(med(True, "rep_tps") / med(False, "rep_tps"), 3),
        "b1_open_speedup": round(med(True, "open_tps") / med(False, "open_tps"), 3),
        "acceptance_rate_repetitive": round(accepted / drafts, 3) if drafts else 0.0,
        "concurrent16_speedup": round(med(True, "c16_tps") / med(False, "c16_tps"), 3),
        **{f"{key}_{side}": round(med(is_spec, key), 2) for key in ("rep_tps", "open_tps", "c16_tps")
           for side, is_spec in (("plain", False), ("ngram", True))},
        "same_output": same, "k": args.k, "max_tokens": args.max_tokens, "runs": args.runs,
        "threads": args.threads, "weights": str(engine.weights),
    }
    summary["targets"] = {"b1_repetitive_speedup": target(summary["b1_repetitive_speedup"], ">=", 1.5),
                          "b1_open_speedup": target(summary["b1_open_speedup"], ">=", 0.95),
                          "concurrent16_speedup": target(summary["concurrent16_speedup"], ">=", 0.95),
                          "same_output": target(same, "==", True)}
    print(f"SmolLM2 {engine.weights}; k={args.k}, {args.max_tokens} new tokens, {args.runs} runs, "
          f"{args.threads} threads; repetitive prompts of {prompt_lens} tokens; same output: {same}")
    print(f"{'workload':<28}{'plain tok/s':>14}{'ngram tok/s':>14}{'speedup':>10}")
    for name, key, speedup in (("batch 1, repetitive", "rep_tps", "b1_repetitive_speedup"),
                               ("batch 1, open-ended", "open_tps", "b1_open_speedup"),
                               ("16 concurrent (aggregate)", "c16_tps", "concurrent16_speedup")):
        print(f"{name:<28}{med(False, key):>14.1f}{med(True, key):>14.1f}{summary[speedup]:>10.2f}")
    print(f"acceptance (repetitive): {accepted}/{drafts} proposed tokens")
    for key in ("rep_tps", "open_tps", "c16_tps"):  # the spread behind the medians
        print(f"  {key} per run, plain/spec: " + ", ".join(
            f"{a[key]:.1f}/{b[key]:.1f}" for a, b in zip(results[False], results[True], strict=True)))
    emit("speculative", summary, args)
    if not same:
        raise SystemExit("speculative output differs from plain decoding")


if __name__ == "__main__":
    main()
