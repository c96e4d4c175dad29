"""`tokenrelay-worker` / `python -m worker`: load the model, serve the Redis queue.

Every flag has an environment variable (shown in --help); flags win. SIGTERM
or Ctrl-C: stop claiming, finish running requests (up to --drain-timeout),
exit 0. A second signal exits at once.

`--engine sim` serves the queue with a simulated engine instead (worker/engine/sim.py):
no model, no torch, deterministic tokens, and a step time of --sim-step-ms plus
--sim-ms-per-token per token computed, with --max-num-seqs streams batched. It is for
capacity planning and for testing routing, failover and autoscaling without GPUs
(llm-d ships a vLLM simulator for the same reason): N sim workers behave like N GPU
workers of that rate towards Redis, the gateways and the metrics.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING

from protos.keys import DEFAULT_PREFIX, default_instance_id
from protos.logs import configure
from protos.metrics import DEFAULT_WORKER_PORT
from protos.observability import add_observability_args
from protos.redis_conn import DEFAULT_REDIS_URL
from worker.config import WorkerConfig
from worker.engine.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    ENGINE_KINDS,
    QUANTIZATIONS,
    SPECULATIVE,
    EngineConfig,
    SimConfig,
)

if TYPE_CHECKING:
    from worker.io.held import TextEngineProtocol


def _env(name: str, default: object = None) -> str | None:
    """A string default: argparse converts it with the flag's type, so bad values get a clean error."""
    value = os.environ.get(name)
    return value if value is not None else (None if default is None else str(default))


def _adapter_pair(text: str) -> tuple[str, str]:
    """NAME=PATH -> (name, path); argparse reports the error."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, not {text!r}")
    return name, path


class _AdapterFlags(argparse.Action):
    """--adapter, repeatable: the first one replaces the environment's default (a string)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        try:
            pair = _adapter_pair(str(values))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        current = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*(current if isinstance(current, list) else []), pair])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenrelay-worker",
        description="tokenrelay worker: takes requests from the Redis queue, generates with the model and "
                    "streams the tokens back to the gateway. Run several for more throughput.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--redis-url", default=_env("REDIS_URL", DEFAULT_REDIS_URL),
                   help="Redis holding the queue (redis://, rediss://, unix://) [env REDIS_URL]")
    p.add_argument("--key-prefix", default=_env("TOKENRELAY_KEY_PREFIX", DEFAULT_PREFIX),
                   help="prefix of every Redis key; must match the gateway's [env TOKENRELAY_KEY_PREFIX]")
    p.add_argument("--worker-id", default=_env("TOKENRELAY_WORKER_ID"),
                   help="unique name (Redis consumer name, Final.worker_id); default host-pid-random "
                        "[env TOKENRELAY_WORKER_ID]")
    p.add_argument("--engine", choices=ENGINE_KINDS, default=_env("TOKENRELAY_ENGINE", "model"),
                   help="model generates with --model; sim simulates an engine (no model, no torch): "
                        "deterministic tokens at the --sim-* step time, --max-num-seqs streams batched "
                        "[env TOKENRELAY_ENGINE]")
    p.add_argument("--sim-step-ms", type=float, default=_env("TOKENRELAY_SIM_STEP_MS", 20),
                   help="--engine sim: milliseconds every engine step takes [env TOKENRELAY_SIM_STEP_MS]")
    p.add_argument("--sim-ms-per-token", type=float, default=_env("TOKENRELAY_SIM_MS_PER_TOKEN", 0.05),
                   help="--engine sim: milliseconds a step takes more per token it computes (decode rows + "
                        "prompt tokens prefilled) [env TOKENRELAY_SIM_MS_PER_TOKEN]")
    p.add_argument("--sim-salt", default=_env("TOKENRELAY_SIM_SALT", ""),
                   help="--engine sim: mixed into every token id; workers with different salts emit "
                        "different tokens for one request [env TOKENRELAY_SIM_SALT]")
    p.add_argument("--model", default=_env("TOKENRELAY_MODEL"),
                   help="GGUF file or Hugging Face folder; default: the bundled SmolLM2-135M-Instruct "
                        "[env TOKENRELAY_MODEL]")
    p.add_argument("--served-model-name", default=_env("TOKENRELAY_SERVED_MODEL_NAME", ""),
                   help="the name requests address this model by (GenerateRequest.model) and whose "
                        "streams this worker claims; default: the model file's name, "
                        "SmolLM2-135M-Instruct for the bundled one, sim for --engine sim "
                        "[env TOKENRELAY_SERVED_MODEL_NAME]")
    p.add_argument("--device", default=_env("TOKENRELAY_DEVICE", "cpu"),
                   help="cpu, cuda, cuda:1, ... [env TOKENRELAY_DEVICE]")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   default=_env("TOKENRELAY_ATTENTION_BACKEND", "auto"),
                   help="auto: cpu with the C kernels, flashinfer on CUDA when installed, else torch "
                        "[env TOKENRELAY_ATTENTION_BACKEND]")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=_env("TOKENRELAY_GPU_MEMORY_UTILIZATION", 0.9),
                   help="CUDA: the share of the GPU's memory for weights, the worst step and the KV cache "
                        "[env TOKENRELAY_GPU_MEMORY_UTILIZATION]")
    p.add_argument("--dtype", choices=DTYPES, default=_env("TOKENRELAY_DTYPE", "float32"),
                   help="weight/activation dtype (use float32 on CPU) [env TOKENRELAY_DTYPE]")
    p.add_argument("--max-num-seqs", type=int, default=_env("TOKENRELAY_MAX_NUM_SEQS", 128),
                   help="most requests batched together; KV memory is taken per block as they grow, not "
                        "reserved per request [env TOKENRELAY_MAX_NUM_SEQS]")
    p.add_argument("--max-model-len", type=int, default=_env("TOKENRELAY_MAX_MODEL_LEN"),
                   help="tokens per sequence (prompt + output); default min(context, 2048) "
                        "[env TOKENRELAY_MAX_MODEL_LEN]")
    p.add_argument("--kv-cache-memory-mb", type=int, default=_env("TOKENRELAY_KV_CACHE_MEMORY_MB"),
                   help="size of the KV block pool, allocated once at start-up; default: on CPU 10%% of "
                        "physical RAM, on CUDA 90%% of the memory free after a warm-up forward (never more "
                        "than max-num-seqs full sequences need) [env TOKENRELAY_KV_CACHE_MEMORY_MB]")
    p.add_argument("--block-size", type=int, default=_env("TOKENRELAY_BLOCK_SIZE", 16),
                   help="tokens per KV-cache block [env TOKENRELAY_BLOCK_SIZE]")
    p.add_argument("--kv-cache-dtype", choices=DTYPES, default=_env("TOKENRELAY_KV_CACHE_DTYPE"),
                   help="K/V storage dtype; default the model's; float16/bfloat16 halve the cache, on CPU "
                        "too [env TOKENRELAY_KV_CACHE_DTYPE]")
    p.add_argument("--max-prefill-tokens", type=int, default=_env("TOKENRELAY_MAX_PREFILL_TOKENS"),
                   help="prompt tokens computed per engine step; longer prompts are prefilled in chunks "
                        "over several steps while running streams keep decoding; default 512 on CPU, "
                        "the step's token budget on CUDA [env TOKENRELAY_MAX_PREFILL_TOKENS]")
    p.add_argument("--max-num-batched-tokens", type=int, default=_env("TOKENRELAY_MAX_NUM_BATCHED_TOKENS"),
                   help="all tokens one engine step computes: decodes (and their speculative proposals) "
                        "first, prompt chunks in what is left; default none on CPU, 8192 on CUDA "
                        "[env TOKENRELAY_MAX_NUM_BATCHED_TOKENS]")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_env("TOKENRELAY_PREFIX_CACHING", "1") not in ("0", "false", "no"),
                   help="share the KV blocks of a common prompt prefix between requests, running or "
                        "finished (shared system prompts, the next turn of a chat) "
                        "[env TOKENRELAY_PREFIX_CACHING=0 to disable]")
    graphs = _env("TOKENRELAY_CUDA_GRAPHS")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                   default=None if graphs is None else graphs not in ("0", "false", "no"),
                   help="CUDA: capture decode steps as CUDA graphs per batch-size bucket at start-up "
                        "(default on for CUDA, except with LoRA) "
                        "[env TOKENRELAY_CUDA_GRAPHS]")
    p.add_argument("--native-kernels", action=argparse.BooleanOptionalAction,
                   default=_env("TOKENRELAY_NATIVE_KERNELS", "1") not in ("0", "false", "no"),
                   help="on CPU fp32, run decode attention and RMSNorm in C kernels built on first use "
                        "with the machine's compiler (falls back to torch when there is none) "
                        "[env TOKENRELAY_NATIVE_KERNELS=0 to disable]")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=_env("TOKENRELAY_QUANTIZATION", "auto"),
                   help="linear weights on CPU: auto runs a GGUF's own Q4_0/Q4_1/Q8_0 blocks in C kernels "
                        "(other GGUF types become Q8_0; safetensors stay float); q8_0/q4_0 quantize any "
                        "model at load; none dequantizes to --dtype [env TOKENRELAY_QUANTIZATION]")
    p.add_argument("--speculative", choices=SPECULATIVE, default=_env("TOKENRELAY_SPECULATIVE", "none"),
                   help="speculative decoding: ngram proposes the tokens that followed the latest earlier "
                        "occurrence of the last 1-4 tokens, draft has --draft-model draft them; both are "
                        "verified in the running batch and the output is the same as without "
                        "[env TOKENRELAY_SPECULATIVE]")
    p.add_argument("--num-speculative-tokens", type=int, default=_env("TOKENRELAY_NUM_SPECULATIVE_TOKENS", 4),
                   help="proposals verified per step and sequence [env TOKENRELAY_NUM_SPECULATIVE_TOKENS]")
    p.add_argument("--draft-model", default=_env("TOKENRELAY_DRAFT_MODEL"),
                   help="for --speculative draft: a smaller model with the same tokenizer (GGUF file or "
                        "Hugging Face folder), run in this worker with its own KV cache "
                        "[env TOKENRELAY_DRAFT_MODEL]")
    lora = p.add_argument_group("LoRA adapters (docs/models.md)")
    lora.add_argument("--adapter", action=_AdapterFlags, metavar="NAME=PATH",
                      default=_env("TOKENRELAY_ADAPTERS"),
                      help="serve the PEFT LoRA folder PATH as adapter NAME (GenerateRequest.adapter); "
                           "repeatable; the flags replace the variable's [env TOKENRELAY_ADAPTERS, "
                           "comma-separated NAME=PATH]")
    lora.add_argument("--enable-lora", action=argparse.BooleanOptionalAction,
                      default=_env("TOKENRELAY_ENABLE_LORA", "0") not in ("0", "false", "no"),
                      help="accept adapters loaded at run time (tokenrelay adapter load) even with no "
                           "--adapter; with LoRA on every step runs per op, without the fused CPU layer "
                           "kernel (benchmarks/lora.py measures what that costs) "
                           "[env TOKENRELAY_ENABLE_LORA]")
    lora.add_argument("--max-adapters", type=int, default=_env("TOKENRELAY_MAX_ADAPTERS", 4),
                      help="most distinct adapters in one engine step (vLLM's --max-loras); requests of "
                           "another wait [env TOKENRELAY_MAX_ADAPTERS]")
    lora.add_argument("--max-lora-rank", type=int, default=_env("TOKENRELAY_MAX_LORA_RANK", 64),
                      help="adapters of a larger rank are refused [env TOKENRELAY_MAX_LORA_RANK]")
    p.add_argument("--num-threads", type=int, default=_env("TOKENRELAY_NUM_THREADS"),
                   help="torch CPU threads; default torch's choice [env TOKENRELAY_NUM_THREADS]")
    p.add_argument("--drain-timeout", type=float, default=_env("TOKENRELAY_DRAIN_TIMEOUT_S", 30),
                   help="seconds running requests get to finish on SIGTERM; what is left then is handed to "
                        "another live worker (resumed without a gap), or failed with UNAVAILABLE if there "
                        "is none [env TOKENRELAY_DRAIN_TIMEOUT_S]")
    p.add_argument("--heartbeat-ttl", type=float, default=_env("TOKENRELAY_HEARTBEAT_TTL_S", 5),
                   help="seconds without a heartbeat after which this worker counts as dead and other "
                        "workers resume its requests; use the same value on every worker "
                        "[env TOKENRELAY_HEARTBEAT_TTL_S]")
    p.add_argument("--max-deliveries", type=int, default=_env("TOKENRELAY_MAX_DELIVERIES", 3),
                   help="a request whose workers died this many times fails with UNAVAILABLE instead of "
                        "being resumed again [env TOKENRELAY_MAX_DELIVERIES]")
    p.add_argument("--reconcile-interval", type=float, default=_env("TOKENRELAY_RECONCILE_INTERVAL_S", 5),
                   help="seconds between two comparisons of this worker's pending entries with what it runs "
                        "(an acknowledgement lost with the last second of an AOF is repaired) "
                        "[env TOKENRELAY_RECONCILE_INTERVAL_S]")
    p.add_argument("--max-parked", type=int, default=_env("TOKENRELAY_MAX_PARKED", 1024),
                   help="parked requests (nobody follows them) held at most; beyond it a park abandons the "
                        "attempt at once, its progress kept for a later resume [env TOKENRELAY_MAX_PARKED]")
    p.add_argument("--reattach-grace", type=float, default=_env("TOKENRELAY_REATTACH_GRACE_S", 10),
                   help="seconds a request nobody follows any more (caller gone, gateway died) stays parked, "
                        "its KV cached, for a resume through any gateway; then it is abandoned "
                        "[env TOKENRELAY_REATTACH_GRACE_S]")
    p.add_argument("--log-level", default=_env("TOKENRELAY_LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING or ERROR [env TOKENRELAY_LOG_LEVEL]")
    add_observability_args(p, default_metrics_port=DEFAULT_WORKER_PORT,
                           metrics_port_note=" (several workers on one host need one port each)")
    return p


def config_from_args(argv: list[str] | None = None) -> tuple[WorkerConfig, str]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if not isinstance(args.adapter, list):  # no --adapter: the environment's (a string) or none
            args.adapter = [_adapter_pair(pair) for pair in (args.adapter or "").split(",") if pair]
        engine = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                              kv_cache_memory_mb=args.kv_cache_memory_mb, block_size=args.block_size,
                              kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
                              gpu_memory_utilization=args.gpu_memory_utilization,
                              cuda_graphs=args.cuda_graphs,
                              max_prefill_tokens=args.max_prefill_tokens,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              num_threads=args.num_threads,
                              enable_prefix_caching=args.prefix_caching,
                              enable_native_kernels=args.native_kernels, quantization=args.quantization,
                              speculative=args.speculative,
                              num_speculative_tokens=args.num_speculative_tokens,
                              draft_model=args.draft_model, adapters=tuple(args.adapter),
                              enable_lora=args.enable_lora, max_adapters=args.max_adapters,
                              max_lora_rank=args.max_lora_rank)
        sim = SimConfig(step_ms=args.sim_step_ms, ms_per_token=args.sim_ms_per_token, salt=args.sim_salt)
        config = WorkerConfig(engine=engine, engine_kind=args.engine, sim=sim,
                              redis_url=args.redis_url, key_prefix=args.key_prefix,
                              served_model_name=args.served_model_name,
                              worker_id=args.worker_id or default_instance_id(),
                              drain_timeout_s=args.drain_timeout, heartbeat_ttl_s=args.heartbeat_ttl,
                              heartbeat_interval_s=min(0.5, args.heartbeat_ttl / 5),
                              max_deliveries=args.max_deliveries, reattach_grace_s=args.reattach_grace,
                              max_parked=args.max_parked, reconcile_interval_s=args.reconcile_interval,
                              metrics_port=args.metrics_port, metrics_compat=args.metrics_compat,
                              otlp_traces_endpoint=args.otlp_traces_endpoint, log_format=args.log_format)
    except (ValueError, argparse.ArgumentTypeError) as e:
        parser.error(str(e))
    return config, args.log_level


def _build_engine(config: WorkerConfig) -> TextEngineProtocol:
    if config.engine_kind == "sim":
        from worker.engine.sim import SimEngine

        return SimEngine.from_config(config.sim, config.engine)
    from worker.factory import build_text_engine  # torch: only for a model, once the flags are good

    return build_text_engine(config.engine)


def main(argv: list[str] | None = None) -> int:
    config, log_level = config_from_args(argv)
    configure(log_level, config.log_format, "worker", worker=config.worker_id)
    from worker.io.consumer import Consumer

    try:
        engine = _build_engine(config)
    except ValueError as e:  # a model that cannot run as configured (a draft's tokenizer, ...): say why
        print(f"tokenrelay-worker: error: {e}", file=sys.stderr)
        return 2
    consumer = Consumer(engine, config)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if consumer.is_stopping:
            os._exit(1)  # second Ctrl-C: the user does not want to wait for the drain
        logging.getLogger(__name__).info("signal %d: draining (up to %.0fs)", signum, config.drain_timeout_s)
        consumer.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, lambda signum, frame: consumer.reload_adapters())
    consumer.run()
    if consumer.is_fenced:  # like Kafka's ProducerFencedException: this process may not write again
        print("tokenrelay-worker: fenced: a gateway judged this worker dead while it was unreachable and "
              "queued its requests again; exiting so a fresh process (a new consumer) takes its place",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
