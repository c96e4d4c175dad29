"""LoRA serving cost: requests spread over several adapters vs the same requests on the base model.

In one process, 2 threads, SmolLM2 (the worker's default GGUF, its Q4_1 blocks kept) or --model:
  * lora: 16 concurrent requests spread over 4 random rank-16 adapters (all seven target
    modules), on an engine with LoRA on;
  * base: the same 16 requests without an adapter, on that engine;
  * fused: the same 16 requests on an engine with LoRA off, whose steps run every layer in one
    C call (kernels/layer.c); LoRA on runs them per op (LlamaModel.enable_lora says why), so
    base vs fused is what merely enabling LoRA costs.
Greedy, EOS ignored, prefix caching off (each side computes its prompts), sides alternated
within each run. Tokens/s: output tokens over the wall time from submission to the last token;
decode tokens/s: over the steps that prefilled nothing. Target: lora at least 0.8x base.
Prints a table, then one JSON line (medians over --runs, and "targets"); --record keeps it in
benchmarks/results/lora.json (not with --quick, a smoke run).

    python benchmarks/lora.py [--runs 3] [--threads 2] [--model PATH] [--quick] [--record]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import add_record_arg, emit, target  # noqa: E402
from protos.params import SamplingParams  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.core import EngineCore  # noqa: E402
from worker.factory import build_model  # noqa: E402
from worker.model.config import ModelConfig  # noqa: E402
from worker.model.lora import TARGET_MODULES, module_shapes  # noqa: E402

NUM_REQUESTS, NUM_ADAPTERS, RANK = 16, 4, 16
SIDES = ("lora", "base", "fused")


def write_adapters(root: Path, config: ModelConfig) -> list[tuple[str, str]]:
    """NUM_ADAPTERS random PEFT folders of rank RANK over every target module."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in range(NUM_ADAPTERS):
        tensors = {}
        for i in range(config.num_layers):
            for m in TARGET_MODULES:
                rows, cols = module_shapes(config)[m]
                parent = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{i}.{parent}.{m}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, cols, generator=g) * cols ** -0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(rows, RANK, generator=g) * 0.01
        folder = root / f"adapter{n}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGET_MODULES)}))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        out.append((f"adapter{n}", str(folder)))
    return out


def engine_for(config: EngineConfig, max_len: int) -> EngineCore:
    model = build_model(config)
    return EngineCore(model, num_blocks=NUM_REQUESTS * -(-max_len // 16), block_size=16,
                      max_model_len=max_len, max_num_seqs=NUM_REQUESTS, max_prefill_tokens=512,
                      eos_token_ids=frozenset(), enable_prefix_caching=False,
                      max_adapters=NUM_ADAPTERS if config.is_lora_enabled else 0)


def run_side(engine: EngineCore, prompts: list[list[int]], adapters: list[str],
             tokens: int) -> dict[str, float]:
    """All requests at once; output tokens/s overall and over decode-only steps."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, (p, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(f"r{i}", p, params, adapter=adapter)
    num_tokens = decode_tokens = 0
    decode_s = 0.0
    while engine.has_unfinished():
        t = time.perf_counter()
        num_tokens += sum(o.token is not None for o in engine.step())
        if engine.num_step_prefill_tokens == 0:
            decode_s += time.perf_counter() - t
            decode_tokens += engine.num_step_decode_tokens
    elapsed = time.perf_counter() - start
    return {"tps": num_tokens / elapsed, "decode_tps": decode_tokens / max(decode_s, 1e-9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default SmolLM2)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--quick", action="store_true", help="1 run of 16 tokens: a smoke run, never recorded")
    add_record_arg(ap)
    args = ap.parse_args()
    runs, tokens = (1, 16) if args.quick else (args.runs, args.tokens)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    max_len = 128 + tokens
    with tempfile.TemporaryDirectory() as tmp:
        fused = engine_for(EngineConfig(model=args.model, num_threads=args.threads), max_len)
        lora = engine_for(EngineConfig(model=args.model, num_threads=args.threads, enable_lora=True), max_len)
        assert lora.adapters is not None
        for name, folder in write_adapters(Path(tmp), lora.model.config):
            lora.adapters.load(name, folder)
        vocab = lora.model.config.vocab_size
        prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 128))]
                   for _ in range(NUM_REQUESTS)]
        names = [lora.adapters.names[i % NUM_ADAPTERS] for i in range(NUM_REQUESTS)]
        results: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
        for r in range(runs):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:  # alternated: drift hits both ways
                engine, adapters = (lora, names) if side == "lora" else (
                    (lora, [""] * NUM_REQUESTS) if side == "base" else (fused, [""] * NUM_REQUESTS))
                results[side].append(run_side(engine, prompts, adapters, tokens))
    med = {side: {k: statistics.median(x[k] for x in xs) for k in ("tps", "decode_tps")}
           for side, xs in results.items()}
    print(f"{'side':6} {'tok/s':>8} {'decode tok/s':>13}   ({NUM_REQUESTS} requests, {tokens} tokens each, "
          f"{args.threads} threads, {lora.model.quantization_summary})")
    for side, m in med.items():
        print(f"{side:6} {m['tps']:8.1f} {m['decode_tps']:13.1f}")
    ratio = med["lora"]["tps"] / med["base"]["tps"]
    per_op = med["base"]["tps"] / med["fused"]["tps"]
    print(f"lora_vs_base_tps {ratio:.3f} (target >= 0.8: {'met' if ratio >= 0.8 else 'NOT MET'}); "
          f"per-op vs fused base {per_op:.3f}")
    payload = {"requests": NUM_REQUESTS, "adapters": NUM_ADAPTERS, "rank": RANK, "tokens": tokens,
               "threads": args.threads, "runs": runs, "weights": lora.model.quantization_summary,
               **{f"{side}_tps": round(m["tps"], 2) for side, m in med.items()},
               **{f"{side}_decode_tps": round(m["decode_tps"], 2) for side, m in med.items()},
               "lora_vs_base_tps": round(ratio, 3), "per_op_vs_fused_tps": round(per_op, 3),
               "targets": {"lora_vs_base_tps": target(round(ratio, 3), ">=", 0.8)}}
    emit("lora", payload, args, smoke="--quick" if args.quick else None)


if __name__ == "__main__":
    main()
