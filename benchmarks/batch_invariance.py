"""How often does a seeded request's output change with its batch neighbours?

The sampler's noise depends only on (seed, step), so any divergence comes from
fp32 logits that differ in the last bits between batch shapes (different
matmul kernels / reduction orders). Runs N seeded requests on SmolLM2 alone,
then all together plus filler requests, and reports how many token sequences
differ and where the first difference falls. Target: no request diverges, sampled or greedy.
Prints a table, then one JSON line (the targets under "targets"); --record keeps it in
benchmarks/results/batch_invariance.json.

    python benchmarks/batch_invariance.py [--requests 12] [--tokens 48] [--record]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import add_record_arg, emit, target  # noqa: E402
from protos.params import SamplingParams  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.core import EngineCore  # noqa: E402
from worker.factory import native_kernels  # noqa: E402
from worker.model.llama import LlamaModel  # noqa: E402
from worker.model.loader import load_model  # noqa: E402


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            if o.token is not None:
                out[o.seq.request_id].append(o.token.token_id)
    return out


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    add_record_arg(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config, weights = load_model(None)
    # no prefix caching: the batched run must recompute the prompts, not reuse the solo run's K/V
    kernels = native_kernels(EngineConfig(), torch.device("cpu"), torch.float32)
    model = LlamaModel(config, weights, kernels=kernels)
    num_seqs, max_len = 2 * args.requests, 512 + args.tokens
    engine = EngineCore(model, num_blocks=num_seqs * -(-max_len // 16), block_size=16, max_model_len=max_len,
                        max_num_seqs=num_seqs, max_prefill_tokens=4096, eos_token_ids=frozenset(),
                        enable_prefix_caching=False)
    rng = random.Random(0)
    results = {}
    for mode, temperature in (("sampled", 0.8), ("greedy", 0.0)):
        reqs = {f"r{i}": ([rng.randrange(100, config.vocab_size) for _ in range(rng.randint(8, 256))],
                          SamplingParams(max_tokens=args.tokens, temperature=temperature, top_p=0.95,
                                         seed=1000 + i, ignore_eos=True))
                for i in range(args.requests)}
        alone = {rid: run(engine, {rid: r})[rid] for rid, r in reqs.items()}
        fillers = {f"f{i}": ([rng.randrange(100, config.vocab_size) for _ in range(rng.randint(8, 256))],
                             SamplingParams(max_tokens=args.tokens, seed=i)) for i in range(args.requests)}
        busy = run(engine, {**reqs, **fillers})
        diffs = [first_diff(alone[r], busy[r]) for r in reqs]
        diverged = [d for d in diffs if d is not None]
        results[mode] = {"requests": len(reqs), "diverged": len(diverged),
                         "diverged_fraction": len(diverged) / len(reqs),
                         "median_first_divergent_step": statistics.median(diverged) if diverged else None}
    print(f"{'mode':8} {'requests':>8} {'diverged':>8} {'median first step':>18}")
    for mode, r in results.items():
        print(f"{mode:8} {r['requests']:8} {r['diverged']:8} {str(r['median_first_divergent_step']):>18}")
    targets = {f"{mode}_diverged": target(r["diverged"], "==", 0) for mode, r in results.items()}
    emit("batch_invariance", {"tokens": args.tokens, "threads": args.threads, **results, "targets": targets},
         args)


if __name__ == "__main__":
    main()
