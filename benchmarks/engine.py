"""Engine throughput: tokenrelay's engine vs transformers on the same SmolLM2 weights.

Each side runs in its own subprocess (so peak RSS is per side), 2 threads,
fp32, greedy, 128 new tokens, EOS ignored:
  * batch-1 decode tokens/s and prefill tokens/s of a 512-token prompt;
  * 16 concurrent requests with prompts of 16–512 tokens: aggregate output
    tokens/s (wall clock from submission to the last token), against
    transformers on the same 16 prompts as one left-padded static batch and
    one at a time.
Targets (each a ratio of two sides of the same run): decode, prefill and the 16
concurrent requests (against the static batch) at least as fast as transformers.
Prints a table, then one JSON line (medians over --runs, and "targets"); --record
keeps it in benchmarks/results/engine.json.

    python benchmarks/engine.py [--runs 3] [--threads 2] [--record]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import add_record_arg, emit, target  # noqa: E402

NEW_TOKENS = 128
NUM_CONCURRENT = 16
PREFILL_LEN = 512


def prompts(vocab: int, seed: int = 0) -> tuple[list[int], list[int], list[list[int]]]:
    """(short prompt for decode, 512-token prompt, 16 mixed-length prompts)."""
    rng = random.Random(seed)
    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]
    lengths = [rng.randint(16, 512) for _ in range(NUM_CONCURRENT)]
    return ids(16), ids(PREFILL_LEN), [ids(n) for n in lengths]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- our engine ---------------------------------------------------------------
def run_ours() -> dict[str, float]:
    import torch

    from protos.params import SamplingParams
    from worker.engine.config import CPU_MAX_PREFILL_TOKENS, EngineConfig
    from worker.engine.core import EngineCore
    from worker.factory import native_kernels
    from worker.model.llama import LlamaModel
    from worker.model.loader import load_model
    from worker.model.memory import weights_loading

    with weights_loading():
        config, weights = load_model(None)
        model = LlamaModel(config, weights, kernels=native_kernels(EngineConfig(), torch.device("cpu"),
                                                                  torch.float32))
        del weights
    short, long, mixed = prompts(config.vocab_size)
    max_len = PREFILL_LEN + NEW_TOKENS
    # the worker's default prefill budget (prompts of the 16-request run take several
    # steps, next to the decodes); prefix caching off: transformers recomputes every
    # prompt, and so must we here
    block_size = EngineConfig().block_size
    engine = EngineCore(model, num_blocks=NUM_CONCURRENT * -(-max_len // block_size), block_size=block_size,
                        max_model_len=max_len, max_num_seqs=NUM_CONCURRENT,
                        max_prefill_tokens=CPU_MAX_PREFILL_TOKENS, eos_token_ids=frozenset(),
                        enable_prefix_caching=False)

    def submit(batch: list[list[int]], max_tokens: int = NEW_TOKENS) -> float:
        t0 = time.perf_counter()
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i, ids in enumerate(batch):
            engine.add_request(f"r{i}", ids, p)
        return t0

    submit([short], 4)
    while engine.has_unfinished():  # warm-up
        engine.step()
    t0 = submit([long], 1)
    engine.step()
    prefill = PREFILL_LEN / (time.perf_counter() - t0)

    submit([short])
    engine.step()  # prefill + first token
    t1 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    decode = (NEW_TOKENS - 1) / (time.perf_counter() - t1)

    t0 = submit(mixed)
    n = 0
    while engine.has_unfinished():
        n += sum(1 for o in engine.step() if o.token is not None)
    assert n == NUM_CONCURRENT * NEW_TOKENS, n
    concurrent = n / (time.perf_counter() - t0)
    return {"decode_tps_b1": decode, "prefill_tps": prefill, "concurrent16_tps": concurrent,
            "peak_rss_mb": peak_rss_mb()}


# -- transformers -------------------------------------------------------------
def run_hf() -> dict[str, float]:
    import torch
    import transformers

    from worker.model.loader import load_model

    config, weights = load_model(None)
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.load_state_dict(weights, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    del weights
    short, long, mixed = prompts(config.vocab_size)

    def generate(batch: list[list[int]], n: int) -> float:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
        return time.perf_counter() - t0

    generate([short], 4)  # warm-up
    prefill = PREFILL_LEN / generate([long], 1)
    t1 = generate([short], 1)
    decode = (NEW_TOKENS - 1) / (generate([short], NEW_TOKENS) - t1)
    static = NUM_CONCURRENT * NEW_TOKENS / generate(mixed, NEW_TOKENS)
    sequential = NUM_CONCURRENT * NEW_TOKENS / sum(generate([p], NEW_TOKENS) for p in mixed)
    return {"hf_decode_tps_b1": decode, "hf_prefill_tps": prefill, "hf_static16_tps": static,
            "hf_sequential_tps": sequential, "hf_peak_rss_mb": peak_rss_mb()}


def run_side(side: str, threads: int) -> dict[str, float]:
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, __file__, "--side", side, "--threads", str(threads)],
                         cwd=root, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="repetitions; medians are reported")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per side")
    ap.add_argument("--side", choices=("ours", "hf"), help=argparse.SUPPRESS)
    add_record_arg(ap)
    args = ap.parse_args()
    if args.side:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(run_ours() if args.side == "ours" else run_hf()))
        return
    runs = []
    for i in range(args.runs):
        r = {**run_side("ours", args.threads), **run_side("hf", args.threads)}
        runs.append(r)
        print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k}={v:.1f}" for k, v in r.items()), file=sys.stderr)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    med["decode_ratio"] = med["decode_tps_b1"] / med["hf_decode_tps_b1"]
    med["prefill_ratio"] = med["prefill_tps"] / med["hf_prefill_tps"]
    med["concurrent_vs_static"] = med["concurrent16_tps"] / med["hf_static16_tps"]
    med["concurrent_vs_sequential"] = med["concurrent16_tps"] / med["hf_sequential_tps"]
    # per run too: both sides of a run share the host's state of the moment
    med["concurrent_vs_sequential_median_of_runs"] = statistics.median(
        r["concurrent16_tps"] / r["hf_sequential_tps"] for r in runs)
    med["runs"] = args.runs
    rows = [("batch-1 decode tok/s", "decode_tps_b1", "hf_decode_tps_b1"),
            ("prefill 512 tok/s", "prefill_tps", "hf_prefill_tps"),
            ("16 concurrent tok/s (hf: static batch)", "concurrent16_tps", "hf_static16_tps"),
            ("16 concurrent tok/s (hf: one at a time)", "concurrent16_tps", "hf_sequential_tps"),
            ("peak RSS MB", "peak_rss_mb", "hf_peak_rss_mb")]
    print(f"{'metric':42} {'tokenrelay':>11} {'transformers':>13} {'ratio':>7}")
    for name, a, b in rows:
        print(f"{name:42} {med[a]:11.1f} {med[b]:13.1f} {med[a] / med[b]:7.2f}")
    payload: dict[str, object] = {k: round(v, 2) for k, v in med.items()}
    payload["targets"] = {k: target(payload[k], ">=", 1.0)
                          for k in ("decode_ratio", "prefill_ratio", "concurrent_vs_static")}
    emit("engine", payload, args)


if __name__ == "__main__":
    main()
