"""CPU throughput: tokenrelay's engine vs llama.cpp (llama-cpp-python) on the same GGUF file.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF), 2 threads per side, greedy, EOS ignored;
each side in its own subprocess (so peak RSS is per side), alternating (ours, llama.cpp, hf, ours, ...):
  * batch-1 decode tokens/s: a 32-token prompt, 128 new tokens, timed after the first;
  * prefill tokens/s of a 512-token prompt (transformers fp32 too, as a third side);
  * 16 sequences decoded together, the same 16 random 32-token prompts on both sides,
    128 new tokens each: aggregate output tokens/s from submission to the last token.
llama.cpp runs with Llama()'s defaults (flash attention off), n_batch = n_ubatch = 512,
and decodes the 16 sequences with one llama_decode call per step. Ratios are medians of
the per-run ratios ours/llama.cpp (the two sides of a run share the host's state of the
moment), the other numbers medians over --runs. Each side first runs every timed shape
once (llama.cpp's first decode of a shape is several times slower). Run it on an idle host:
llama.cpp's OpenMP threads spin at barriers, so a busy core costs it far more than it does
torch (JSON `loadavg`: the 1-minute load before the runs). Prints a table, then one JSON line.

Our side also measures, in its process after its timings, what issue 25 compares with the
machine: b1_decode_bytes_per_s (weight bytes read per token, as stored, x batch-1 tok/s) over
machine_read_bytes_per_s (a 1 GiB read with the same threads) = decode_bandwidth_fraction,
and prefill_gops (weight dot-product GOP/s of the prefill) over int16_peak_gops (the int16
dot instruction on registers, as benchmarks/kernel_limits.py) = prefill_peak_fraction; and
prefill512_vs_hf_ratio against transformers fp32. Targets (issue 25): b1_decode_ratio >= 1.8,
prefill512_ratio >= 3.0, concurrent16_ratio >= 2.0, prefill512_vs_hf_ratio >= 1.5,
decode_bandwidth_fraction >= 0.85, prefill_peak_fraction >= 0.4.

    python benchmarks/llamacpp.py [--runs 3] [--threads 2] [--quantization auto] [--install]

Needs llama-cpp-python (the `llamacpp` extra; it compiles llama.cpp, ~20-30 min on 2 cores).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import add_record_arg, emit, target  # noqa: E402
from worker.engine.config import QUANTIZATIONS  # noqa: E402 (no torch: the parent process stays light)

PROMPT_LEN = 32
NEW_TOKENS = 128
NUM_CONCURRENT = 16
PREFILL_LEN = 512
SIDES = ("ours", "llamacpp", "hf")
LLAMA_CPP = "llama-cpp-python==0.3.36"



def cmake_args() -> str:
    """Build llama.cpp for this CPU. Not -DGGML_NATIVE=ON where the CPU has AMX: -march=native
    then compiles ggml's AMX path, whose first llama_decode of more than one token segfaulted on
    the 2-core Xeon VMs (AMX_INT8 = 1 in its system info; 2026-12-02). There every other ISA this
    CPU has is named instead, and AMX left out."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    if "amx_tile" not in flags:
        return "-DGGML_NATIVE=ON"
    isa = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx_vnni": "AVX_VNNI",
           "avx512f": "AVX512", "avx512_vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
           "avx512_bf16": "AVX512_BF16"}
    on = " ".join(f"-DGGML_{name}=ON" for flag, name in isa.items() if flag in flags)
    return f"-DGGML_NATIVE=OFF {on} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"


INSTALL = f'CMAKE_ARGS="{cmake_args()}" .venv/bin/pip install "{LLAMA_CPP}"'
CPU_FLAGS = ("avx2", "avx512_vnni", "avx512_bf16", "avx_vnni")


def prompts(vocab: int, prefill_len: int, seed: int = 0) -> tuple[list[int], list[int], list[list[int]]]:
    """(32-token prompt for decode, prefill prompt, 16 prompts of 32 tokens), the same on every side."""
    rng = random.Random(seed)
    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]
    return ids(PROMPT_LEN), ids(prefill_len), [ids(PROMPT_LEN) for _ in range(NUM_CONCURRENT)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu() -> str:
    """Model name and which of CPU_FLAGS the CPU has (the first processor of /proc/cpuinfo)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields: dict[str, str] = {}
    for key, _, value in (line.partition(":") for line in info.splitlines()):
        fields.setdefault(key.strip(), value.strip())
    flags = " ".join(f for f in CPU_FLAGS if f in fields.get("flags", "").split())
    return f"{fields.get('model name', 'unknown')} ({flags or 'no avx2'})"


# -- our engine ---------------------------------------------------------------
def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.kernel_limits import machine_use
    from protos.params import SamplingParams
    from worker.engine.config import CPU_MAX_PREFILL_TOKENS, EngineConfig
    from worker.engine.core import EngineCore
    from worker.factory import build_model

    model = build_model(EngineConfig(quantization=args.quantization, num_threads=args.threads))
    summary = getattr(model, "quantization_summary", None)  # what the model runs on, where it says
    short, long, batch = prompts(model.config.vocab_size, args.prefill_len)
    new = args.new_tokens
    max_len = max(args.prefill_len + 2, PROMPT_LEN + new)
    # prefix caching off: llama.cpp recomputes every prompt, and so must we here
    block_size = EngineConfig().block_size
    engine = EngineCore(model, num_blocks=NUM_CONCURRENT * -(-max_len // block_size), block_size=block_size,
                        max_model_len=max_len, max_num_seqs=NUM_CONCURRENT,
                        max_prefill_tokens=CPU_MAX_PREFILL_TOKENS, eos_token_ids=frozenset(),
                        enable_prefix_caching=False)

    def submit(prompt_ids: list[list[int]], max_tokens: int = new) -> float:
        t0 = time.perf_counter()
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i, ids in enumerate(prompt_ids):
            engine.add_request(f"r{i}", ids, p)
        return t0

    for warm_up in ([long], batch):  # every shape timed below (first calls of a shape are slow)
        submit(warm_up, 2)
        while engine.has_unfinished():
            engine.step()
    t0 = submit([long], 1)
    while engine.has_unfinished():  # one step unless --prefill-len > max_prefill_tokens
        engine.step()
    prefill = args.prefill_len / (time.perf_counter() - t0)

    submit([short])
    engine.step()  # prefill + first token
    t1 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    decode = (new - 1) / (time.perf_counter() - t1)

    t0, n = submit(batch), 0
    while engine.has_unfinished():
        n += sum(1 for o in engine.step() if o.token is not None)
    if n != NUM_CONCURRENT * new:
        raise RuntimeError(f"ours: {n} tokens from the 16 sequences, expected {NUM_CONCURRENT * new}")
    concurrent = n / (time.perf_counter() - t0)
    return {"decode": decode, "prefill": prefill, "concurrent16": concurrent, "peak_rss_mb": peak_rss_mb(),
            "format": None if summary is None else str(summary() if callable(summary) else summary),
            **machine_use(model, decode, prefill, args.prefill_len, args.threads)}


# -- llama.cpp ----------------------------------------------------------------
class LlamaCppDecoder:
    """A llama.cpp context and one batch: decode (token, pos, seq_id, is_output) entries.
    Neither is freed: the side's process ends after the run."""

    def __init__(self, lib: Any, llm: Any, ctx: Any = None) -> None:
        self.lib, self.ctx = lib, ctx or llm.ctx
        self.n_batch, self.n_vocab = llm.context_params.n_batch, llm.n_vocab()
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode in n_batch chunks; the greedy next token of each output entry, in order."""
        out: list[int] = []
        b = self.batch
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start:start + self.n_batch]
            b.n_tokens = len(chunk)
            for i, (token, pos, seq, is_output) in enumerate(chunk):
                b.token[i], b.pos[i], b.logits[i] = token, pos, is_output
                b.n_seq_id[i], b.seq_id[i][0] = 1, seq
            if rc := self.lib.llama_decode(self.ctx, b):
                raise RuntimeError(f"llama_decode returned {rc}")
            if num_outputs := sum(e[3] for e in chunk):
                # the rows with logits, contiguous in batch order
                logits = np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx),
                                               shape=(num_outputs, self.n_vocab))
                out += logits.argmax(axis=1).tolist()  # (num_outputs,)
        return out


def prompt_entries(ids: list[int], seq: int = 0) -> list[tuple[int, int, int, bool]]:
    return [(tok, pos, seq, pos == len(ids) - 1) for pos, tok in enumerate(ids)]


def run_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp

    from worker.model.loader import default_model_path

    new, t = args.new_tokens, args.threads
    llm = llama_cpp.Llama(model_path=str(default_model_path()), n_threads=t, n_threads_batch=t,
                          n_ctx=max(args.prefill_len + 2, PROMPT_LEN + new), n_batch=512, n_ubatch=512,
                          logits_all=False, verbose=False)
    short, long, batch = prompts(llm.n_vocab(), args.prefill_len)
    one = LlamaCppDecoder(llama_cpp, llm)  # Llama's own context

    def generate(prompt_ids: list[int], n: int) -> float:
        """Greedy: prefill + first token, then n - 1 tokens; seconds of the latter."""
        one.clear()
        token = one.decode(prompt_entries(prompt_ids))[0]
        t1 = time.perf_counter()
        for pos in range(len(prompt_ids), len(prompt_ids) + n - 1):
            token = one.decode([(token, pos, 0, True)])[0]
        return time.perf_counter() - t1

    generate(long, 2)  # warm-up: llama.cpp's first decode of a batch size is several times slower
    one.clear()
    t0 = time.perf_counter()
    one.decode(prompt_entries(long))
    prefill = args.prefill_len / (time.perf_counter() - t0)
    decode = (new - 1) / generate(short, new)

    # same settings, 16 sequences; KV not unified: each sequence gets n_ctx / n_seq_max cells
    params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
    params.n_seq_max, params.n_ctx = NUM_CONCURRENT, NUM_CONCURRENT * (PROMPT_LEN + new)
    if not (ctx := llama_cpp.llama_init_from_model(llm.model, params)):
        raise RuntimeError("llama_init_from_model failed for the 16-sequence context")
    many = LlamaCppDecoder(llama_cpp, llm, ctx)

    def generate_batch(n: int) -> tuple[int, float]:
        """The 16 prompts in one decode, then one decode per step for all 16: (tokens, seconds)."""
        many.clear()
        t0 = time.perf_counter()
        tokens = many.decode([e for seq, ids in enumerate(batch) for e in prompt_entries(ids, seq)])
        num_tokens = len(tokens)
        for pos in range(PROMPT_LEN, PROMPT_LEN + n - 1):
            tokens = many.decode([(tok, pos, seq, True) for seq, tok in enumerate(tokens)])
            num_tokens += len(tokens)
        return num_tokens, time.perf_counter() - t0

    generate_batch(2)  # warm-up
    n, seconds = generate_batch(new)
    concurrent = n / seconds
    if n != NUM_CONCURRENT * new:
        raise RuntimeError(f"llama.cpp: {n} tokens from the 16 sequences, expected {NUM_CONCURRENT * new}")
    return {"decode": decode, "prefill": prefill, "concurrent16": concurrent, "peak_rss_mb": peak_rss_mb()}


# -- transformers -------------------------------------------------------------
def run_hf(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers

    from worker.model.loader import default_model_path

    torch.set_num_threads(args.threads)
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    _, long, _ = prompts(model.config.vocab_size, args.prefill_len)
    ids = torch.tensor([long])  # (1, T)

    def forward() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, logits_to_keep=1)
        return time.perf_counter() - t0

    forward()  # warm-up
    return {"prefill": args.prefill_len / forward(), "peak_rss_mb": peak_rss_mb()}


RUNNERS = {"ours": run_ours, "llamacpp": run_llamacpp, "hf": run_hf}
# issue 25's targets, each a ratio of one run's sides or a fraction of that run's measured limits
TARGETS = {"b1_decode_ratio": (">=", 1.8), "prefill512_ratio": (">=", 3.0), "concurrent16_ratio": (">=", 2.0),
           "prefill512_vs_hf_ratio": (">=", 1.5), "decode_bandwidth_fraction": (">=", 0.85),
           "prefill_peak_fraction": (">=", 0.4)}
ROWS = [("batch-1 decode tok/s", "b1_decode_tok_s", "decode", "b1_decode_ratio"),
        ("prefill {n} tok/s", "prefill512_tok_s", "prefill", "prefill512_ratio"),
        ("16 sequences tok/s", "concurrent16_tok_s", "concurrent16", "concurrent16_ratio"),
        ("peak RSS MB", "peak_rss_mb", "peak_rss_mb", None)]


def run_side(side: str, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, __file__, "--side", side, "--threads", str(args.threads), "--quantization",
           args.quantization, "--new-tokens", str(args.new_tokens), "--prefill-len", str(args.prefill_len)]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"side {side} failed (exit status {out.returncode}; -11: a segfault):\n"
                 f"{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ensure_llama_cpp(install: bool) -> None:
    if importlib.util.find_spec("llama_cpp") is not None:
        return
    if not install:
        sys.exit("llama_cpp is not installed. It compiles llama.cpp from source (~20-30 min on 2 cores):\n"
                 f"    {INSTALL}\n"
                 " or pass --install")
    env = {**os.environ, "CMAKE_ARGS": cmake_args()}
    subprocess.run([sys.executable, "-m", "pip", "install", LLAMA_CPP], env=env, check=True)


def summarize(runs: list[dict[str, dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    """Medians over runs, keyed `<metric>_<side>`; ratios are medians of per-run ours/llama.cpp."""
    out: dict[str, Any] = {}
    for _, key, field, ratio in ROWS:
        for side in args.sides:
            values = [r[side][field] for r in runs if field in r[side]]
            if values:
                out[f"{key}_{side}"] = round(statistics.median(values), 2)
        if ratio and {"ours", "llamacpp"} <= set(args.sides):
            out[ratio] = round(statistics.median(r["ours"][field] / r["llamacpp"][field] for r in runs), 3)
    if "ours" in args.sides:
        out["format_ours"] = runs[-1]["ours"]["format"]
        ours = [r["ours"] for r in runs if "b1_decode_bytes_per_s" in r["ours"]]
        for key in ("b1_decode_bytes_per_s", "machine_read_bytes_per_s", "prefill_gops", "int16_peak_gops"):
            if ours:
                out[key] = round(statistics.median(o[key] for o in ours), 2)
        if ours:  # each run's fraction of its own limits, then the median
            out["decode_bandwidth_fraction"] = round(statistics.median(
                o["b1_decode_bytes_per_s"] / o["machine_read_bytes_per_s"] for o in ours), 3)
            out["prefill_peak_fraction"] = round(statistics.median(
                o["prefill_gops"] / o["int16_peak_gops"] for o in ours), 3)
    if {"ours", "hf"} <= set(args.sides):
        out["prefill512_vs_hf_ratio"] = round(statistics.median(
            r["ours"]["prefill"] / r["hf"]["prefill"] for r in runs), 3)
    out.update(quantization=args.quantization, cpu=cpu(), loadavg=args.loadavg, runs=args.runs,
               threads=args.threads, new_tokens=args.new_tokens, prefill_len=args.prefill_len)
    return out


def print_table(med: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"ours: quantization={args.quantization}, format={med.get('format_ours')}; {med['cpu']}")
    print(f"{'metric':24} {'tokenrelay':>11} {'llama.cpp':>10} {'transformers':>13} {'ours/llama.cpp':>15}")
    def cell(key: str, width: int, spec: str = ".1f") -> str:
        return f"{med[key]:{width}{spec}}" if key in med else f"{'-':>{width}}"
    for name, key, _, ratio in ROWS:
        ratio_cell = cell(ratio, 15, ".2f") if ratio else f"{'-':>15}"
        print(f"{name.format(n=args.prefill_len):24} {cell(key + '_ours', 11)} {cell(key + '_llamacpp', 10)}"
              f" {cell(key + '_hf', 13)} {ratio_cell}")
    if "decode_bandwidth_fraction" in med:
        gb = 1e9
        print(f"ours against this machine: batch-1 decode reads {med['b1_decode_bytes_per_s'] / gb:.1f} GB/s "
              f"of {med['machine_read_bytes_per_s'] / gb:.1f} ({med['decode_bandwidth_fraction']:.3f}); "
              f"prefill {med['prefill_gops']:.1f} GOP/s of an int16 dot peak of {med['int16_peak_gops']:.0f} "
              f"({med['prefill_peak_fraction']:.3f})")
    if "prefill512_vs_hf_ratio" in med:
        print(f"prefill vs transformers fp32: {med['prefill512_vs_hf_ratio']:.2f}x")
    for name, t in med.get("targets", {}).items():
        if t["value"] is not None:
            print(f"{name} {t['value']} (target {t['target']}: {'met' if t['met'] else 'NOT MET'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="repetitions; medians are reported")
    ap.add_argument("--threads", type=int, default=2, help="threads per side")
    ap.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                    help="our side's EngineConfig.quantization (none: the fp32 path)")
    ap.add_argument("--sides", default=",".join(SIDES), help="comma-separated subset of ours,llamacpp,hf")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="per sequence (smoke runs: fewer)")
    ap.add_argument("--prefill-len", type=int, default=PREFILL_LEN, help="prefill prompt tokens")
    ap.add_argument("--install", action="store_true", help=f"run `{INSTALL}` first if llama_cpp is missing")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    add_record_arg(ap)
    args = ap.parse_args()
    if args.side:
        print(json.dumps(RUNNERS[args.side](args)))
        return
    args.sides = [s for s in args.sides.split(",") if s]
    if unknown := set(args.sides) - set(SIDES):
        ap.error(f"unknown sides: {', '.join(sorted(unknown))}")
    if args.new_tokens < 2 or min(args.prefill_len, args.runs, args.threads) < 1:
        ap.error("--new-tokens must be >= 2; --prefill-len, --runs and --threads >= 1")
    if "llamacpp" in args.sides:
        ensure_llama_cpp(args.install)
    args.loadavg, runs = round(os.getloadavg()[0], 2), []
    for i in range(args.runs):
        runs.append({side: run_side(side, args) for side in args.sides})
        print(f"run {i + 1}/{args.runs}: " + "; ".join(
            f"{side} " + ", ".join(f"{k}={v:.1f}" for k, v in r.items() if isinstance(v, float))
            for side, r in runs[-1].items()), file=sys.stderr)
    med = summarize(runs, args)
    med["targets"] = {name: target(med.get(name), op, limit) for name, (op, limit) in TARGETS.items()}
    print_table(med, args)
    is_full = (args.new_tokens, args.prefill_len, set(args.sides)) == (NEW_TOKENS, PREFILL_LEN, set(SIDES))
    emit("llamacpp", med, args, smoke=None if is_full else "smoke run: not every side, or shorter shapes")


if __name__ == "__main__":
    main()
