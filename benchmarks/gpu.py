"""The GPU worker on one GPU: parity with transformers, decode and prefill speed, and how close
decode comes to the HBM roofline. One prepared script for a lent GPU machine (`make bench-gpu`;
under 8 minutes on an H100/H200). It has NOT run on a GPU yet; `--smoke` runs the same code on
tiny shapes on CPU (tests/test_bench_gpu.py), so it is known to run, not known to be fast.

  1. parity: SmolLM2 (the bundled GGUF, dequantized) in bf16 on the device, ours against
     transformers on the same weights: greedy tokens of 4 prompts x 32 tokens must agree, up to
     the first step whose two top logits are within bf16 noise (0.05), where the two may part;
  2. a random Llama with the shape of an 8B model (32 layers, 4096 hidden, 32/8 heads, 14336
     ffn, 128256 vocab) in bf16: decode tok/s at batch 1, 16, 64 and 256 (128-token prompts,
     64 steps), each with and without CUDA graphs, and each decode's share of the HBM roofline
     (weights + the K/V it reads, per step, over the step time, against the device's peak);
  3. 2,048-token prefill tok/s on the 8B shape;
  4. the sampler's race fused into one compiled kernel against the eager race, 256 rows of the
     8B vocabulary: tokens that differ (expected 0) and ms per call.
Prints a table, then one JSON line; --record keeps it in benchmarks/results/gpu.json.

    python benchmarks/gpu.py [--record] [--smoke] [--batches 1,16,64,256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.results import add_record_arg, emit  # noqa: E402
from protos.params import SamplingParams  # noqa: E402
from worker.engine.core import EngineCore  # noqa: E402
from worker.engine.sampling import fused_exponential_race, sample_exponential_race  # noqa: E402
from worker.model.config import ModelConfig  # noqa: E402
from worker.model.llama import LlamaModel  # noqa: E402

# peak HBM bytes/s by device name (vendor datasheets: H100 SXM 3.35 TB/s, H200 4.8 TB/s, ...)
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}
EIGHT_B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
)
BLOCK = 16


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, attention: str) -> LlamaModel:
    """Random weights made on the device (16 GB at the 8B shape: never through the host)."""
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=g)

    c, H, K, D, F = (
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
    )
    weights: dict[str, Any] = {
        "model.embed_tokens.weight": w(config.vocab_size, c),
        "lm_head.weight": w(config.vocab_size, c),
        "model.norm.weight": torch.ones(c, dtype=dtype, device=device),
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(c, dtype=dtype, device=device),
            p + "post_attention_layernorm.weight": torch.ones(c, dtype=dtype, device=device),
            p + "self_attn.q_proj.weight": w(H * D, c),
            p + "self_attn.k_proj.weight": w(K * D, c),
            p + "self_attn.v_proj.weight": w(K * D, c),
            p + "self_attn.o_proj.weight": w(c, H * D),
            p + "mlp.gate_proj.weight": w(F, c),
            p + "mlp.up_proj.weight": w(F, c),
            p + "mlp.down_proj.weight": w(c, F),
        }
    return LlamaModel(config, weights, dtype=dtype, device=device, attention=attention)


def weight_bytes(model: LlamaModel) -> int:
    """What one decode step reads of the weights: every matmul weight and the head."""
    c = model.config
    per_layer = (
        (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size
        + c.hidden_size * c.num_heads * c.head_dim
        + 3 * c.hidden_size * c.intermediate_size
    )
    return (c.num_layers * per_layer + c.vocab_size * c.hidden_size) * model.dtype.itemsize


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_run(model: LlamaModel, batch: int, prompt_len: int, steps: int, graphs: bool) -> dict[str, float]:
    """tok/s of `steps` decode-only steps of `batch` sequences, and the step's roofline share."""
    max_len = prompt_len + steps + 2
    engine = EngineCore(
        model,
        num_blocks=batch * -(-max_len // BLOCK),
        block_size=BLOCK,
        max_model_len=max_len,
        max_num_seqs=batch,
        max_prefill_tokens=batch * prompt_len,
        eos_token_ids=frozenset(),
        enable_prefix_caching=False,
        static_decode=graphs,
        cuda_graphs=graphs and model.device.type == "cuda",
    )
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"r{i}", [(7 * i + j) % (model.config.vocab_size - 1) + 1 for j in range(prompt_len)], params
        )
    engine.step()  # every prompt, and the first token
    engine.step()  # a warm-up decode
    sync(model.device)
    start, n = time.perf_counter(), 0
    while engine.has_unfinished():
        n += sum(1 for o in engine.step() if o.token is not None)
    sync(model.device)
    seconds = time.perf_counter() - start
    c = model.config
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize
    mean_context = prompt_len + 1 + (steps - 1) / 2
    step_bytes = weight_bytes(model) + batch * mean_context * kv_per_token
    step_s = seconds / max(n / batch, 1)
    return {"tok_s": n / seconds, "step_ms": step_s * 1000, "bytes_per_s": step_bytes / step_s}


def sampler_run(device: torch.device, rows: int, vocab: int) -> dict[str, Any]:
    """The fused race (one compiled kernel) against the eager one on the same probabilities:
    tokens that differ (expected 0) and each one's time per call."""
    gen = torch.Generator(device).manual_seed(0)
    probs = torch.rand(rows, vocab, device=device, generator=gen)  # (B, V)
    seeds = torch.randint(0, 2**62, (rows,), device=device, generator=gen)  # (B,)
    steps = torch.arange(rows, device=device)  # (B,)
    fused = fused_exponential_race()
    mismatches = int((fused(probs, seeds, steps) != sample_exponential_race(probs, seeds, steps)).sum())

    def ms(race: Any) -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(10):
            race(probs, seeds, steps)
        sync(device)
        return (time.perf_counter() - start) * 100

    return {"sampler_rows": rows, "sampler_vocab": vocab, "sampler_mismatches": mismatches,
            "sampler_eager_ms": ms(sample_exponential_race), "sampler_fused_ms": ms(fused)}


def prefill_run(model: LlamaModel, num_tokens: int) -> float:
    engine = EngineCore(
        model,
        num_blocks=-(-(num_tokens + 2) // BLOCK),
        block_size=BLOCK,
        max_model_len=num_tokens + 2,
        max_num_seqs=1,
        max_prefill_tokens=num_tokens,
        eos_token_ids=frozenset(),
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for r in range(3):  # the first is a warm-up
        engine.add_request(
            f"p{r}", [(3 * j + r) % (model.config.vocab_size - 1) + 1 for j in range(num_tokens)], params
        )
        sync(model.device)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync(model.device)
        times.append(time.perf_counter() - start)
    return num_tokens / statistics.median(times[1:])


def parity(model: LlamaModel, hf: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Greedy tokens of ours and transformers on the same weights and device: agreement counted
    up to the first step where they differ, excusing steps whose top two logits are within `tie`
    (bf16 noise decides those)."""
    device, tie = model.device, 0.05 if model.dtype != torch.float32 else 1e-4
    agreed = total = 0
    for p, prompt in enumerate(prompts):
        engine = EngineCore(
            model,
            num_blocks=-(-(len(prompt) + new_tokens + 1) // BLOCK),
            block_size=BLOCK,
            max_model_len=len(prompt) + new_tokens + 1,
            max_num_seqs=1,
            max_prefill_tokens=len(prompt),
            eos_token_ids=frozenset(),
        )
        engine.add_request(
            f"q{p}", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        )
        ours = []
        while engine.has_unfinished():
            ours += [o.token.token_id for o in engine.step() if o.token is not None]
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        theirs = out.sequences[0, len(prompt) :].tolist()
        top2 = [torch.topk(step_logits[0].float(), 2).values for step_logits in out.logits]
        for j, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            total += 1
            if a == b or float(top2[j][0] - top2[j][1]) < tie:
                agreed += 1
                if a != b:
                    break  # the continuations differ from here on: nothing more to compare
            else:
                break
    return {"parity_tokens_compared": total, "parity_tokens_agreed": agreed, "parity_ok": agreed == total}


def smollm2_parity(device: torch.device, dtype: torch.dtype, new_tokens: int) -> dict[str, Any]:
    import transformers

    from worker.model.loader import load_model

    config, weights = load_model(None, dtype=torch.float32)
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=0,
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.load_state_dict(weights, strict=False)
    if config.tie_word_embeddings:
        hf.tie_weights()
    hf = hf.to(device, dtype)
    ours = LlamaModel(config, {k: v.to(device) for k, v in weights.items()}, dtype=dtype, device=device)
    prompts = [[1, 504, 3458, 282, 4649, 314] + list(range(100 + 17 * p, 140 + 17 * p)) for p in range(4)]
    return parity(ours, hf, prompts, new_tokens)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks that the script runs")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,16,64,256)")
    p.add_argument("--attention-backend", default="auto", help="auto, torch or flashinfer")
    p.add_argument("--peak-bandwidth", type=float, help="HBM bytes/s (default: by device name)")
    add_record_arg(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print(
            "no CUDA device here (torch.cuda.is_available() is False): --smoke checks the script on CPU",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    batches = [int(b) for b in (args.batches or ("1,2" if smoke else "1,16,64,256")).split(",")]
    name = "CPU (smoke)" if smoke else torch.cuda.get_device_name(device)
    peak = args.peak_bandwidth or next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "device": name,
        "dtype": str(dtype).removeprefix("torch."),
        "peak_bytes_per_s": peak,
    }
    try:
        result |= smollm2_parity(device, dtype, 4 if smoke else 32)
    except Exception as e:  # the rest still runs: its numbers do not depend on transformers
        result["parity_error"] = f"{type(e).__name__}: {e}"
    model = random_model(TINY if smoke else EIGHT_B, dtype, device, args.attention_backend)
    result["attention_backend"] = model.attention.name
    result["model_shape"] = "tiny" if smoke else "8B (Llama-3 shape, random bf16)"
    rows = []
    for batch in batches:
        for graphs in (False, True):
            r = decode_run(
                model, batch, prompt_len=16 if smoke else 128, steps=4 if smoke else 64, graphs=graphs
            )
            r["roofline_fraction"] = r["bytes_per_s"] / peak if peak else None
            # on CPU (--smoke) the static steps run eagerly: no graph is captured
            rows.append({"batch": batch, "cuda_graphs": graphs and not smoke, "static_steps": graphs, **r})
            print(
                f"decode batch {batch:4d} graphs {'on ' if graphs else 'off'}: {r['tok_s']:10.1f} tok/s, "
                f"{r['step_ms']:7.2f} ms/step, {r['bytes_per_s'] / 1e9:8.1f} GB/s",
                file=sys.stderr,
            )
    result["decode"] = rows
    result["prefill_tokens"] = 32 if smoke else 2048
    result["prefill_tok_s"] = prefill_run(model, result["prefill_tokens"])
    result |= sampler_run(device, 8 if smoke else 256, (TINY if smoke else EIGHT_B).vocab_size)
    print(f"sampler {result['sampler_rows']} x {result['sampler_vocab']}: eager "
          f"{result['sampler_eager_ms']:.2f} ms, fused {result['sampler_fused_ms']:.2f} ms, "
          f"{result['sampler_mismatches']} tokens differ", file=sys.stderr)
    result["seconds"] = time.perf_counter() - started
    print(f"{'batch':>6} {'static':>6} {'tok/s':>10} {'ms/step':>8} {'roofline':>8}")
    for r in rows:
        frac = f"{r['roofline_fraction']:.2f}" if r["roofline_fraction"] is not None else "-"
        print(
            f"{r['batch']:>6} {str(r['static_steps']):>6} {r['tok_s']:>10.1f} {r['step_ms']:>8.2f} {frac:>8}"
        )
    print(
        f"prefill {result['prefill_tokens']} tokens: {result['prefill_tok_s']:.0f} tok/s; parity "
        f"{result.get('parity_tokens_agreed')}/{result.get('parity_tokens_compared')} "
        f"{result.get('parity_error', '')}"
    )
    emit("gpu", result, args, smoke="--smoke run on CPU" if smoke else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
