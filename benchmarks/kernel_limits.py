"""The CPU kernels against this machine's limits (issue 25): read bandwidth, int16 dot peak.

In one process, --threads torch threads, SmolLM2 (the worker's default GGUF, its Q4_1 blocks
kept, the LM head Q8_0) or --model, every time a median of repeated timings after a warm-up:
  * machine read bandwidth: the best of repeated torch `.sum()` (1 GiB read) and `.copy_()`
    (1 GiB read + 1 GiB written, counted as 2 GiB) of a 1 GiB float32 tensor;
  * batch-1 decode kernels, each alone: the fused layers' C call (LlamaModel.decode_layers,
    kernels/layer.c) and the LM head (model.linear(x, model.lm_head)) at 1 and 16 rows, with
    the weight bytes each reads as stored (QuantWeight qs + d + m, all layers' wqkv, wo,
    w_gate_up, w_down; the head's) over its time, and that as a fraction of the read bandwidth;
  * the batch-1 engine step: EngineCore.step() of one decoding request, and inside the same
    steps the model forward (timed by wrapping model.forward); host overhead per step = step -
    forward (scheduler, batch building, sampler, bookkeeping), the median over steps;
  * prefill: one 512-token prompt through model.forward. Weight dot-product ops = 2 x (the
    layers' weight parameters x 512 tokens + the head's parameters x 1 row: only the last
    token gets logits); GOP/s over its time, against the machine's int16 dot peak, the
    instruction our kernels multiply with (issue 25's yardstick): the best, over the ISAs this
    CPU has, of independent vpdpwssd (zmm for AVX-512 VNNI, ymm for AVX-VNNI) or vpmaddwd +
    vpaddd (AVX2) on registers, on --threads threads (kernels/quant.c quant_int16_peak). For
    context, also against `torch._int_mm` (oneDNN's int8 GEMM, VNNI or AMX, s8 x s8 -> s32,
    at SmolLM2's matmul shapes with 512 rows), and the C linear kernel alone at 512 rows per
    layer weight.
Targets: decode_bandwidth_fraction >= 0.85, prefill_peak_fraction >= 0.4, b1_host_overhead_ms
<= 0.3. Prints a table, then one JSON line; --record keeps it in benchmarks/results/kernel_limits.json
(not with --quick, a smoke run).

    python benchmarks/kernel_limits.py [--threads 2] [--model PATH] [--quick] [--record]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import add_record_arg, emit, target  # noqa: E402
from protos.params import SamplingParams  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.core import EngineCore  # noqa: E402
from worker.engine.input_batch import BatchBuilder  # noqa: E402
from worker.factory import build_model  # noqa: E402
from worker.model.llama import ForwardBatch, KVCache, LlamaModel  # noqa: E402
from worker.model.quant import QuantWeight  # noqa: E402

GiB = 2**30
BLOCK_SIZE = 16
DECODE_CONTEXT = 64  # tokens each decode row attends over in the kernel timings
PREFILL_TOKENS = 512
INT8_SHAPES = ((576, 576), (576, 1536), (1536, 576))  # (K, N) of SmolLM2's matmuls, 512 rows
PEAK_ITERS = 2_000_000  # rounds of 12 dot instructions: ~0.1-0.3 s a run
TARGETS = {"decode_bandwidth_fraction": (">=", 0.85), "prefill_peak_fraction": (">=", 0.4),
           "b1_host_overhead_ms": ("<=", 0.3)}


@dataclass(frozen=True)
class Repeats:
    bandwidth: int
    decode: int
    steps: int
    prefill: int
    int8: int
    int16: int


FULL = Repeats(bandwidth=10, decode=200, steps=300, prefill=5, int8=20, int16=5)
QUICK = Repeats(bandwidth=2, decode=5, steps=10, prefill=1, int8=2, int16=2)


def median_s(fn: Callable[[], Any], repeats: int, warmup: int = 2,
             before: Callable[[], Any] | None = None) -> float:
    """Median seconds of fn() after `warmup` calls; `before` runs untimed ahead of each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def best_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    return min(median_s(fn, 1, warmup=0) for _ in range(repeats))


def read_bandwidth(src: torch.Tensor, repeats: int) -> dict[str, float]:
    """Bytes/s of a streaming read (sum) and of a copy (read + write) of `src`, best of `repeats`."""
    nbytes = src.numel() * src.element_size()
    dst = torch.empty_like(src)
    sum_bps = nbytes / best_s(src.sum, repeats)
    copy_bps = 2 * nbytes / best_s(lambda: dst.copy_(src), repeats)
    return {"sum_read_bytes_per_s": sum_bps, "copy_bytes_per_s": copy_bps,
            "machine_read_bytes_per_s": max(sum_bps, copy_bps)}


def llc_bytes() -> int | None:
    """The last-level cache this CPU reports (sysfs), None where it says nothing."""
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    if not caches:
        return None
    size = caches[-1].read_text().strip()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)


def weight_bytes(model: LlamaModel) -> tuple[int, int]:
    """Bytes the fused layers and the head read per forward, as stored (qs + d + m)."""
    layers = [w for layer in model.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    if not all(isinstance(w, QuantWeight) for w in [*layers, model.lm_head]):
        raise SystemExit("kernel_limits.py measures the C kernels: every matmul weight must be quantized")
    return sum(w.nbytes for w in layers), model.lm_head.nbytes


def weight_params(model: LlamaModel) -> tuple[int, int]:
    layers = [w for layer in model.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    return sum(w.shape[0] * w.shape[1] for w in layers), model.lm_head.shape[0] * model.lm_head.shape[1]


def decode_batch(rows: int, context: int, first_token: int = 100) -> ForwardBatch:
    """`rows` sequences, each decoding its token at position context - 1 over its own blocks."""
    batch = BatchBuilder(BLOCK_SIZE, torch.device("cpu"))
    per_seq = -(-context // BLOCK_SIZE)
    for s in range(rows):
        batch.add(list(range(s * per_seq, (s + 1) * per_seq)), [first_token + s], context - 1, 1)
    return batch.build(num_prefills=0)


def decode_kernels(model: LlamaModel, rows: int, repeats: int, flush: Callable[[], Any]) -> dict[str, float]:
    """Seconds of the fused layers' C call and of the LM head, each alone, at `rows` rows: warm
    (back to back, the weights may stay in the last-level cache) and cold (`flush` before each)."""
    assert model.decode_layers is not None, "weight_bytes checked the weights are quantized"
    cfg = model.config
    cache = KVCache(cfg, rows * -(-DECODE_CONTEXT // BLOCK_SIZE), BLOCK_SIZE, torch.float32, model.device)
    b = decode_batch(rows, DECODE_CONTEXT)
    x0 = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(0))  # (B, C)
    x = x0.clone()  # (B, C): updated in place by every call, so reset before each

    def layers() -> None:
        x.copy_(x0)
        model.decode_layers(x, b.positions, b.slot_mapping, b.block_tables, b.context_lens,  # type: ignore[misc]
                            cache.k, cache.v)

    h = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(1))  # (B, C)
    def head() -> None:
        model.linear(h, model.lm_head)

    cold = max(repeats // 4, 3)
    with torch.inference_mode():
        return {"layers_s": median_s(layers, repeats), "head_s": median_s(head, repeats),
                "layers_cold_s": median_s(layers, cold, before=flush),
                "head_cold_s": median_s(head, cold, before=flush)}


def engine_steps(model: LlamaModel, steps: int) -> dict[str, float]:
    """One request decoding alone: medians of the step, of the forward inside it, and of the
    difference, over the steps that prefill nothing (the first 5 are a warm-up)."""
    max_len = 32 + steps + 8
    engine = EngineCore(model, num_blocks=-(-max_len // BLOCK_SIZE), block_size=BLOCK_SIZE,
                        max_model_len=max_len, max_num_seqs=1, max_prefill_tokens=512,
                        eos_token_ids=frozenset(), enable_prefix_caching=False)
    forward_s: list[float] = []
    original = model.forward

    def timed_forward(batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        start = time.perf_counter()
        out = original(batch, cache)
        forward_s.append(time.perf_counter() - start)
        return out

    model.forward = timed_forward  # type: ignore[method-assign]
    try:
        engine.add_request("b1", list(range(100, 132)), SamplingParams(max_tokens=steps + 6, temperature=0.0,
                                                                        ignore_eos=True))
        step_s, fwd_s = [], []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            if engine.num_step_prefill_tokens == 0:
                step_s.append(elapsed)
                fwd_s.append(forward_s[-1])
    finally:
        del model.forward
    pairs = list(zip(step_s, fwd_s, strict=True))[5:]
    return {"step_s": statistics.median(s for s, _ in pairs),
            "forward_s": statistics.median(f for _, f in pairs),
            "overhead_s": statistics.median(s - f for s, f in pairs), "steps": len(pairs)}


def prefill(model: LlamaModel, repeats: int) -> float:
    """Seconds of one PREFILL_TOKENS-token prompt through model.forward (logits of its last token)."""
    per_seq = -(-PREFILL_TOKENS // BLOCK_SIZE)
    cache = KVCache(model.config, per_seq, BLOCK_SIZE, torch.float32, model.device)
    batch = BatchBuilder(BLOCK_SIZE, model.device)
    ids = [100 + (i * 7919) % 40000 for i in range(PREFILL_TOKENS)]
    batch.add(list(range(per_seq)), ids, 0, 1)
    fb = batch.build(num_prefills=1)
    return median_s(lambda: model.forward(fb, cache), repeats, warmup=1)


def prefill_linears(model: LlamaModel, repeats: int) -> dict[str, float]:
    """GOP/s of the C linear kernel alone at PREFILL_TOKENS rows, per weight of layer 0."""
    layer, out = model.layers[0], {}
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        w = getattr(layer, name)
        n, c = w.shape
        x = torch.randn(PREFILL_TOKENS, c, generator=torch.Generator().manual_seed(2))  # (T, C)
        with torch.inference_mode():
            out[f"{name}_{n}x{c}"] = 2 * PREFILL_TOKENS * n * c / median_s(lambda: model.linear(x, w),  # noqa: B023
                                                                          repeats) / 1e9
    return out


def int16_peak(model: LlamaModel, threads: int, repeats: int) -> dict[str, float]:
    """GOP/s of the int16 dot instruction on registers, per SIMD ISA this CPU has (best of
    `repeats` runs of PEAK_ITERS rounds on `threads` threads)."""
    quant = model.linear.quant
    if quant is None:
        return {}
    out = {}
    for isa in quant.supported_isas:
        if isa in ("scalar", "amx"):  # amx multiplies int8 tiles: no int16 instruction to time
            continue
        quant.int16_peak_macs(isa, PEAK_ITERS // 10, threads)  # warm-up: clocks up
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            macs = quant.int16_peak_macs(isa, PEAK_ITERS, threads)
            best = max(best, 2 * macs / (time.perf_counter() - start) / 1e9)
        out[isa] = best
    return out


def int8_peak(repeats: int) -> dict[str, float]:
    """GOP/s of torch._int_mm (oneDNN int8 GEMM) at (512, K) x (K, N), per shape."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for k, n in INT8_SHAPES:
        a = torch.randint(-127, 128, (PREFILL_TOKENS, k), dtype=torch.int8, generator=g)  # (T, K)
        b = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)  # (K, N)
        out[f"{PREFILL_TOKENS}x{k}x{n}"] = 2 * PREFILL_TOKENS * k * n / median_s(lambda: torch._int_mm(a, b),  # noqa: B023
                                                                                 repeats, warmup=3) / 1e9
    return out


def machine_use(model: LlamaModel, decode_tok_s: float, prefill_tok_s: float, prefill_len: int,
                threads: int) -> dict[str, float]:
    """For a run that timed the engine (benchmarks/llamacpp.py), measured right after it in the
    same process: the weight bytes a batch-1 decode at decode_tok_s reads per second (layers
    and LM head as stored) and a 1 GiB streaming read, the prefill's weight dot-product GOP/s
    and the int16 dot peak, both measured as this benchmark measures them."""
    layer_bytes, head_bytes = weight_bytes(model)
    layer_params, head_params = weight_params(model)
    src = torch.ones(GiB // 4, dtype=torch.float32)  # (2^28,)
    read = read_bandwidth(src, 5)["machine_read_bytes_per_s"]
    del src
    peak = max(int16_peak(model, threads, 3).values(), default=float("nan"))
    prefill_ops = 2 * (layer_params * prefill_len + head_params)  # only the last token gets logits
    return {"b1_decode_bytes_per_s": (layer_bytes + head_bytes) * decode_tok_s,
            "machine_read_bytes_per_s": read,
            "prefill_gops": prefill_ops * prefill_tok_s / prefill_len / 1e9, "int16_peak_gops": peak}


def kernel_row(kernel: str, rows: int, nbytes: int, warm_s: float, cold_s: float,
               read: float) -> dict[str, Any]:
    return {"kernel": kernel, "rows": rows, "weight_bytes": nbytes,
            "ms": round(warm_s * 1e3, 4), "bytes_per_s": round(nbytes / warm_s),
            "bandwidth_fraction": round(nbytes / warm_s / read, 3),
            "cold_ms": round(cold_s * 1e3, 4), "cold_bytes_per_s": round(nbytes / cold_s),
            "cold_bandwidth_fraction": round(nbytes / cold_s / read, 3)}


def measure(model: LlamaModel, reps: Repeats) -> dict[str, Any]:
    src = torch.ones(GiB // 4, dtype=torch.float32)  # (2^28,): 1 GiB, also what evicts the weights
    bw = read_bandwidth(src, reps.bandwidth)
    layer_bytes, head_bytes = weight_bytes(model)
    decode = {rows: decode_kernels(model, rows, reps.decode if rows == 1 else max(reps.decode // 4, 3),
                                   flush=src.sum) for rows in (1, 16)}
    del src
    step = engine_steps(model, reps.steps)
    prefill_s = prefill(model, reps.prefill)
    layer_params, head_params = weight_params(model)
    prefill_ops = 2 * (layer_params * PREFILL_TOKENS + head_params)
    peak = int8_peak(reps.int8)
    dot_peak = int16_peak(model, torch.get_num_threads(), reps.int16)
    best_dot = max(dot_peak.values(), default=float("nan"))
    linears = prefill_linears(model, reps.int8)
    read = bw["machine_read_bytes_per_s"]
    kernels = [kernel_row(kernel, rows, nbytes, d[f"{key}_s"], d[f"{key}_cold_s"], read)
               for rows, d in decode.items()
               for kernel, key, nbytes in (("decode_layers", "layers", layer_bytes),
                                           ("lm_head", "head", head_bytes))]
    b1_decode = (layer_bytes + head_bytes) / step["forward_s"]
    gops = prefill_ops / prefill_s / 1e9
    return {
        **{k: round(v) for k, v in bw.items()}, "llc_bytes": llc_bytes(),
        "layers_weight_bytes": layer_bytes, "head_weight_bytes": head_bytes, "decode_kernels": kernels,
        "b1_step_ms": round(step["step_s"] * 1e3, 4), "b1_forward_ms": round(step["forward_s"] * 1e3, 4),
        "b1_host_overhead_ms": round(step["overhead_s"] * 1e3, 4), "b1_steps_timed": step["steps"],
        "b1_decode_bytes_per_s": round(b1_decode), "decode_bandwidth_fraction": round(b1_decode / read, 3),
        "prefill_tokens": PREFILL_TOKENS, "prefill_ms": round(prefill_s * 1e3, 2),
        "prefill_tok_per_s": round(PREFILL_TOKENS / prefill_s, 1),
        "prefill_weight_ops": prefill_ops, "prefill_gops": round(gops, 2),
        "prefill_linear_gops": {k: round(v, 2) for k, v in linears.items()},
        "int8_mm_gops": {k: round(v, 1) for k, v in peak.items()},
        "int8_peak_gops": round(max(peak.values()), 1),
        "prefill_int8_gemm_fraction": round(gops / max(peak.values()), 3),
        "int16_dot_gops": {k: round(v, 1) for k, v in dot_peak.items()},
        "int16_peak_gops": round(best_dot, 1),
        "prefill_peak_fraction": round(gops / best_dot, 3),
    }


def print_table(m: dict[str, Any], args: argparse.Namespace, weights: str) -> None:
    gb = 1e9
    print(f"kernels ({args.threads} threads, {weights}); GB = 1e9 bytes")
    print(f"machine read {m['machine_read_bytes_per_s'] / gb:.1f} GB/s "
          f"(sum {m['sum_read_bytes_per_s'] / gb:.1f}, copy read+write {m['copy_bytes_per_s'] / gb:.1f})")
    llc = f"{m['llc_bytes'] / 2**20:.0f} MiB" if m["llc_bytes"] else "unknown"
    print(f"each kernel alone; warm: back to back (weights may stay in the {llc} last-level cache), "
          f"cold: after reading 1 GiB")
    print(f"{'kernel':14} {'rows':>4} {'weight MB':>9} | {'warm ms':>8} {'GB/s':>6} {'of bw':>6} | "
          f"{'cold ms':>8} {'GB/s':>6} {'of bw':>6}")
    for k in m["decode_kernels"]:
        print(f"{k['kernel']:14} {k['rows']:4d} {k['weight_bytes'] / 1e6:9.1f} | {k['ms']:8.3f} "
              f"{k['bytes_per_s'] / gb:6.1f} {k['bandwidth_fraction']:6.3f} | {k['cold_ms']:8.3f} "
              f"{k['cold_bytes_per_s'] / gb:6.1f} {k['cold_bandwidth_fraction']:6.3f}")
    print(f"batch-1 engine step {m['b1_step_ms']:.3f} ms = forward {m['b1_forward_ms']:.3f} ms + host "
          f"{m['b1_host_overhead_ms']:.3f} ms (medians of {m['b1_steps_timed']} steps); forward reads "
          f"{m['b1_decode_bytes_per_s'] / gb:.1f} GB/s = {m['decode_bandwidth_fraction']:.3f} of read bw")
    print(f"prefill {m['prefill_tokens']} tokens {m['prefill_ms']:.1f} ms "
          f"({m['prefill_tok_per_s']:.0f} tok/s): "
          f"{m['prefill_weight_ops'] / 1e9:.1f} GOP of weight dot products (2 x layer params x "
          f"{m['prefill_tokens']} + 2 x head params x 1) = {m['prefill_gops']:.1f} GOP/s")
    print("C linear alone at 512 rows, GOP/s: "
          + ", ".join(f"{k} {v:.1f}" for k, v in m["prefill_linear_gops"].items()))
    print("int16 dot peak (the instruction our kernels multiply with, on registers), GOP/s: "
          + ", ".join(f"{k} {v:.0f}" for k, v in m["int16_dot_gops"].items())
          + f"; prefill at {m['prefill_peak_fraction']:.3f} of the best")
    print("for context, int8 GEMM (torch._int_mm = oneDNN, VNNI or AMX, s8 x s8 -> s32), GOP/s: "
          + ", ".join(f"{k} {v:.0f}" for k, v in m["int8_mm_gops"].items())
          + f"; prefill at {m['prefill_int8_gemm_fraction']:.3f} of the best")
    for name, (op, limit) in TARGETS.items():
        t = target(m[name], op, limit)
        print(f"{name} {m[name]} (target {t['target']}: {'met' if t['met'] else 'NOT MET'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="GGUF file (default SmolLM2's Q4_1); its weights must stay quantized")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="few repeats: a smoke run, never recorded")
    add_record_arg(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(EngineConfig(model=args.model, num_threads=args.threads))
    m = measure(model, QUICK if args.quick else FULL)
    print_table(m, args, model.quantization_summary)
    payload = {"threads": args.threads, "weights": model.quantization_summary, "quick": args.quick, **m,
               "targets": {name: target(m[name], op, limit) for name, (op, limit) in TARGETS.items()}}
    emit("kernel_limits", payload, args, smoke="--quick" if args.quick else None)


if __name__ == "__main__":
    main()
