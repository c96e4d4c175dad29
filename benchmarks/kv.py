"""Paged KV cache with prefix sharing: how many chats fit, and what sharing saves.

Workload: --requests (48) chats arrive together (a burst, as the worker adds them
after claiming them), each = one shared 400-token system prompt (ChatML: a system
turn of real English text, tokenized with the model's tokenizer and cut to fit, then
the user turn's header) + a distinct ~30-token question (its own first word, then the
assistant turn's header) + --new-tokens (48) greedy tokens, EOS ignored. Token ids go
straight into one EngineCore per run (no Redis, no gRPC): SmolLM2-135M in fp32 on
CPU with the C kernels, a KV pool of 512 MB (as `--kv-cache-memory-mb 512`), blocks
of 16 tokens, max_num_seqs 128, the worker's default max_prefill_tokens,
max_model_len 2048. Two configurations, run alternately, medians over --runs:

  * shared:   prefix caching on, the system prompt's blocks are computed once;
  * no_cache: prefix caching off, every request computes its whole prompt.

Targets (shared):
  * max_running >= 40 chats at once in the 512 MB pool, where one full-length
    (2048-token) reservation per request would fit 5 (slot_design_running);
  * prompt tokens computed / distinct prompt tokens <= 1.2: distinct = the nodes
    of the prompts' trie, here 400 + the questions' lengths (minus a few shared
    leading tokens), what an ideal prefix cache would compute;
  * aggregate output tok/s >= 2x no_cache.

It fails (exit 1, after the table and the JSON line) unless every request got
exactly --new-tokens tokens and the greedy outputs of both configurations are
identical token for token: prefix caching must not change an answer.

Every metric is compared within the same run. With --threads 2 on a 2-core host
another busy process makes the two OpenMP threads wait on each other at every op
(steps measured 5-7x slower than with one thread); time it on a quiet machine.

The JSON line carries these targets as "targets"; --record keeps it in
benchmarks/results/kv.json.

    python benchmarks/kv.py [--runs 3] [--requests 48] [--new-tokens 48] [--threads 2] [--record]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import add_record_arg, emit, target  # noqa: E402
from protos.params import SamplingParams  # noqa: E402
from worker.engine.config import CPU_MAX_PREFILL_TOKENS, EngineConfig  # noqa: E402
from worker.engine.core import EngineCore  # noqa: E402
from worker.engine.scheduler import Scheduler, SchedulerOutput  # noqa: E402
from worker.factory import native_kernels, plan_kv_cache  # noqa: E402
from worker.model.config import ModelConfig  # noqa: E402
from worker.model.llama import KVCache, LlamaModel  # noqa: E402
from worker.model.loader import default_model_path, load_model  # noqa: E402
from worker.model.memory import weights_loading  # noqa: E402
from worker.text.tokenizer import Tokenizer  # noqa: E402

BUDGET_MB = 512
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 128
SYSTEM_TOKENS = 400
QUESTION_TOKENS = 32  # text tokens at most, then 6 of ChatML: ~30 in all
Trie = dict[int, "Trie"]
CONFIGS = {"shared": True, "no_cache": False}  # name -> enable_prefix_caching

SYSTEM_TEXT = (
    "You are a patient and knowledgeable assistant for a public library. Visitors ask about "
    "history, science, geography, literature and everyday practical matters. Answer in plain "
    "English, in short paragraphs, and keep each answer to the point. When a question is "
    "ambiguous, say which reading you chose before you answer it. When you are not sure of a "
    "fact, say so instead of guessing, and suggest where in the library the visitor could check "
    "it: the reference desk, the encyclopedias on the second floor, the periodicals room or the "
    "local history collection in the basement. Do not invent titles, authors, dates or page "
    "numbers. Prefer examples that a curious twelve-year-old could follow, but do not talk down "
    "to anyone. If a visitor asks for medical, legal or financial advice, give general "
    "information only and recommend a qualified professional. Be kind to people who are "
    "frustrated or in a hurry, and thank them for their patience when a question takes a while. "
    "The library opens at nine in the morning and closes at eight in the evening on weekdays, "
    "and at five on Saturdays; it is closed on Sundays and public holidays. Members may borrow "
    "up to twelve books at a time for three weeks, renew them twice online or at the desk, and "
    "reserve books that are out on loan. Study rooms can be booked for two hours a day. Printing "
    "costs ten cents a page, and the public computers need a library card to log in. "
)
# One topic per request, each with its own first word, so that past the system prompt
# the questions share (almost) no leading tokens: what is distinct is 400 + their lengths.
TOPICS = ("Aqueducts", "Bees", "Comets", "Dinosaurs", "Earthquakes", "Fossils", "Glaciers", "Hurricanes",
          "Icebergs", "Jellyfish", "Kites", "Lighthouses", "Mushrooms", "Nebulae", "Octopuses", "Penguins",
          "Quasars", "Rainbows", "Satellites", "Tornadoes", "Umbrellas", "Volcanoes", "Windmills", "X-rays",
          "Yeast", "Zebras", "Bridges", "Clocks", "Deserts", "Eclipses", "Fireflies", "Geysers",
          "Hieroglyphs", "Igloos", "Jet streams", "Kangaroos", "Lasers", "Magnets", "Northern lights",
          "Orchids", "Pyramids", "Quicksand", "Rockets", "Sundials", "Telescopes", "Unicorn myths",
          "Vaccines", "Whales")
ASPECTS = ("how did people first learn about {t}, and why did it matter so much to them at the time?",
           "what is the most surprising fact about {t} that most visitors to a library have never heard?",
           "which three kinds of books would you suggest to a beginner who wants to understand {t}?",
           "can you explain {t} in a few plain sentences, as you would to a student in a hurry?")


def system_prompt_ids(tokenizer: Tokenizer, n: int = SYSTEM_TOKENS) -> list[int]:
    """Exactly n tokens of ChatML: the system turn (its text repeated or cut to fit), then the
    header of the user turn, so that every question starts with its own words."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    head, body = encode("<|im_start|>system\n"), encode(SYSTEM_TEXT)
    tail = encode("<|im_end|>\n<|im_start|>user\n")
    while len(head) + len(body) + len(tail) < n:
        body = body + body
    return head + body[:n - len(head) - len(tail)] + tail


def question_ids(tokenizer: Tokenizer, i: int) -> list[int]:
    """Question i and the assistant turn's header: distinct text for every i (a visitor
    number past the 48 topics)."""
    topic = TOPICS[i % len(TOPICS)]
    text = f"{topic}: " + ASPECTS[i % len(ASPECTS)].format(t=topic.lower())
    if i >= len(TOPICS):
        text += f" (visitor {i})"
    ids = tokenizer.encode(text, add_special_tokens=False)[:QUESTION_TOKENS]
    return ids + tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def num_distinct_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens at distinct (prefix, token) positions: the nodes of the prompts' trie,
    i.e. what an ideal prefix cache would compute."""
    root: Trie = {}
    n = 0
    for ids in prompts:
        node = root
        for t in ids:
            if t not in node:
                node[t] = {}
                n += 1
            node = node[t]
    return n


class CountingScheduler(Scheduler):
    """The engine's scheduler, counting the prompt tokens it schedules for prefill
    (recomputation after a preemption included)."""

    num_prefill_tokens = 0

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        self.num_prefill_tokens += sum(c.num_tokens for c in out.prefills)
        return out


@dataclass
class RunResult:
    wall_s: float
    max_running: int
    prompt_computed: int  # prefill chunk tokens the scheduler scheduled
    prompt_missed: int  # prompt tokens looked up minus prefix hits (KV manager statistics)
    preemptions: int
    ttft_ms: list[float] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)

    def tps(self) -> float:
        return sum(map(len, self.outputs.values())) / self.wall_s


def new_engine(model: LlamaModel, num_blocks: int, enable_prefix_caching: bool) -> EngineCore:
    engine = EngineCore(model, num_blocks=num_blocks, block_size=EngineConfig().block_size,
                        max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                        max_prefill_tokens=CPU_MAX_PREFILL_TOKENS,
                        eos_token_ids=frozenset(),  # every request ignores EOS
                        enable_prefix_caching=enable_prefix_caching)
    # the same scheduler, counting; swapped in before any request (only `step` uses it)
    engine.scheduler = CountingScheduler(engine.kv, MAX_NUM_SEQS, CPU_MAX_PREFILL_TOKENS)
    return engine


def run_once(engine: EngineCore, prompts: list[list[int]], new_tokens: int) -> RunResult:
    """All prompts added at once, stepped until done; wall time from the burst to the last token."""
    scheduler = engine.scheduler
    if not isinstance(scheduler, CountingScheduler):
        raise TypeError("run_once needs an engine from new_engine()")
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, seed=0)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    ttft: dict[str, float] = {}
    max_running = 0
    t0 = time.perf_counter()
    for rid, ids in zip(outputs, prompts, strict=True):
        engine.add_request(rid, ids, params)
    while engine.has_unfinished():
        step_outputs = engine.step()
        now = time.perf_counter()
        max_running = max(max_running, scheduler.num_running)
        for o in step_outputs:
            if o.token is not None:
                outputs[o.seq.request_id].append(o.token.token_id)
                ttft.setdefault(o.seq.request_id, (now - t0) * 1000)
    wall = time.perf_counter() - t0
    kv = engine.kv
    return RunResult(wall, max_running, scheduler.num_prefill_tokens,
                     kv.num_prefix_query_tokens - kv.num_prefix_hit_tokens, scheduler.num_preemptions,
                     sorted(ttft.values()), outputs)


def load(threads: int) -> tuple[ModelConfig, LlamaModel, Tokenizer]:
    torch.set_num_threads(threads)
    path = default_model_path()
    cpu = torch.device("cpu")
    with weights_loading():
        config, weights = load_model(path, dtype=torch.float32)
        model = LlamaModel(config, weights, dtype=torch.float32, device=cpu,
                           kernels=native_kernels(EngineConfig(), cpu, torch.float32))
        del weights
    return config, model, Tokenizer.load(path)


def median(values: list[float]) -> float:
    return statistics.median(values)


def check(results: dict[str, list[RunResult]], num_requests: int, new_tokens: int) -> list[str]:
    """What went wrong: wrong token counts, outputs that differ between runs or configurations."""
    failures = []
    reference = results["shared"][0].outputs
    for name, runs in results.items():
        for i, r in enumerate(runs):
            wrong = {rid: len(ids) for rid, ids in r.outputs.items() if len(ids) != new_tokens}
            if len(r.outputs) != num_requests or wrong:
                failures.append(f"{name} run {i + 1}: requests with other than {new_tokens} tokens: {wrong}")
            differ = sorted(rid for rid in reference if r.outputs.get(rid) != reference[rid])
            if differ:
                first = differ[0]
                a, b = reference[first], r.outputs.get(first, [])
                at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                          min(len(a), len(b)))
                failures.append(f"{name} run {i + 1}: greedy outputs differ from shared run 1 for "
                                f"{len(differ)}/{num_requests} requests (first: {first}, token {at})")
            if r.preemptions == 0 and r.prompt_computed != r.prompt_missed:
                failures.append(f"{name} run {i + 1}: scheduled {r.prompt_computed} prompt tokens, but the "
                                f"KV manager counted {r.prompt_missed} misses")
    return failures


def summarize(results: dict[str, list[RunResult]], config: ModelConfig, num_blocks: int, new_tokens: int,
              distinct: int, num_prompt_tokens: int) -> dict[str, object]:
    block_bytes = KVCache.bytes_per_block(config, EngineConfig().block_size, torch.float32)
    bytes_per_token = block_bytes // EngineConfig().block_size
    per_run: dict[str, list[float]] = {}
    for name, runs in results.items():
        per_run[f"max_running_{name}"] = [r.max_running for r in runs]
        per_run[f"prompt_computed_{name}"] = [r.prompt_computed for r in runs]
        per_run[f"ttft_p50_ms_{name}"] = [round(median(r.ttft_ms), 1) for r in runs]
        per_run[f"ttft_max_ms_{name}"] = [round(max(r.ttft_ms), 1) for r in runs]
        per_run[f"tps_{name}"] = [round(r.tps(), 2) for r in runs]
        per_run[f"wall_s_{name}"] = [round(r.wall_s, 2) for r in runs]
        per_run[f"preemptions_{name}"] = [r.preemptions for r in runs]
    med = {k: median(v) for k, v in per_run.items()}
    return {
        "budget_mb": BUDGET_MB, "num_blocks": num_blocks, "requests": len(results["shared"][0].outputs),
        "new_tokens": new_tokens,
        "max_running": med["max_running_shared"], "max_running_no_cache": med["max_running_no_cache"],
        "slot_design_running": BUDGET_MB * 2**20 // (MAX_MODEL_LEN * bytes_per_token),
        "prompt_tokens": num_prompt_tokens, "distinct_prompt_tokens": distinct,
        "prompt_computed_shared": med["prompt_computed_shared"],
        "prompt_computed_no_cache": med["prompt_computed_no_cache"],
        "shared_prefix_computed_ratio": round(med["prompt_computed_shared"] / distinct, 3),
        "ttft_p50_ms_shared": med["ttft_p50_ms_shared"], "ttft_p50_ms_no_cache": med["ttft_p50_ms_no_cache"],
        "ttft_max_ms_shared": med["ttft_max_ms_shared"], "ttft_max_ms_no_cache": med["ttft_max_ms_no_cache"],
        "ttft_p50_speedup": round(med["ttft_p50_ms_no_cache"] / med["ttft_p50_ms_shared"], 2),
        "ttft_max_speedup": round(med["ttft_max_ms_no_cache"] / med["ttft_max_ms_shared"], 2),
        "tps_48": med["tps_shared"], "tps_48_no_cache": med["tps_no_cache"],
        "tps_ratio": round(med["tps_shared"] / med["tps_no_cache"], 2),
        "tps_ratio_median_of_runs": round(median([a / b for a, b in zip(per_run["tps_shared"],
                                                                         per_run["tps_no_cache"],
                                                                         strict=True)]), 2),
        "wall_s_shared": med["wall_s_shared"], "wall_s_no_cache": med["wall_s_no_cache"],
        "preemptions_shared": med["preemptions_shared"], "preemptions_no_cache": med["preemptions_no_cache"],
        "runs": len(results["shared"]), "per_run": per_run,
    }


def print_table(s: dict[str, object]) -> None:
    def row(name: str, shared: object, no_cache: object, note: str) -> None:
        print(f"{name:34} {shared!s:>10} {no_cache!s:>10}  {note}")

    row("metric", "shared", "no_cache", "ratio / target")
    row("peak running requests", s["max_running"], s["max_running_no_cache"],
        f">= 40 (slot design: {s['slot_design_running']})")
    row("prompt tokens computed", s["prompt_computed_shared"], s["prompt_computed_no_cache"],
        f"{s['shared_prefix_computed_ratio']} x the {s['distinct_prompt_tokens']} distinct (<= 1.2)")
    row("TTFT p50 ms", s["ttft_p50_ms_shared"], s["ttft_p50_ms_no_cache"],
        f"{s['ttft_p50_speedup']} x faster")
    row("TTFT max ms", s["ttft_max_ms_shared"], s["ttft_max_ms_no_cache"],
        f"{s['ttft_max_speedup']} x faster")
    row("output tok/s", s["tps_48"], s["tps_48_no_cache"], f"{s['tps_ratio']} (>= 2)")
    row("wall s", s["wall_s_shared"], s["wall_s_no_cache"], "")
    burst = f"{s['requests']}x{s['new_tokens']}"
    row("requests x new tokens", burst, burst, "ok: exact counts, same outputs" if s["is_correct"]
        else "FAILED: see below")
    row("preemptions", s["preemptions_shared"], s["preemptions_no_cache"], "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs of each configuration, alternating; medians")
    ap.add_argument("--requests", type=int, default=48, help="chats in the burst")
    ap.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per chat (EOS ignored)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    add_record_arg(ap)
    args = ap.parse_args()
    if min(args.runs, args.requests, args.new_tokens, args.threads) < 1:
        ap.error("--runs, --requests, --new-tokens and --threads must be >= 1")
    config, model, tokenizer = load(args.threads)
    system = system_prompt_ids(tokenizer)
    prompts = [system + question_ids(tokenizer, i) for i in range(args.requests)]
    plan = plan_kv_cache(EngineConfig(kv_cache_memory_mb=BUDGET_MB, max_model_len=MAX_MODEL_LEN),
                         config, torch.device("cpu"))
    run_once(new_engine(model, 64, False), prompts[:2], 4)  # warm-up: kernels, allocator, oneDNN
    results: dict[str, list[RunResult]] = {name: [] for name in CONFIGS}
    for i in range(args.runs):
        for name, enable_prefix_caching in CONFIGS.items():
            r = run_once(new_engine(model, plan.num_blocks, enable_prefix_caching), prompts, args.new_tokens)
            results[name].append(r)
            print(f"run {i + 1}/{args.runs} {name}: {r.wall_s:.1f} s, {r.tps():.1f} tok/s, peak running "
                  f"{r.max_running}, {r.prompt_computed} prompt tokens computed, {r.preemptions} preemptions",
                  file=sys.stderr)
    distinct = num_distinct_tokens(prompts)
    summary = summarize(results, config, plan.num_blocks, args.new_tokens, distinct, sum(map(len, prompts)))
    failures = check(results, args.requests, args.new_tokens)
    summary["is_correct"] = not failures
    summary["targets"] = {"max_running": target(summary["max_running"], ">=", 40),
                          "shared_prefix_computed_ratio": target(summary["shared_prefix_computed_ratio"],
                                                                 "<=", 1.2),
                          "tps_ratio": target(summary["tps_ratio"], ">=", 2),
                          "is_correct": target(summary["is_correct"], "==", True)}
    print_table(summary)
    emit("kv", summary, args)
    if failures:
        for f in failures:
            print(f"FAIL: {f}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
