"""`tokenrelay bench`: load-test any tokenrelay gateway, the way `vllm bench serve` tests
an OpenAI server.

    tokenrelay bench --target 127.0.0.1:50051 --num-requests 200 --request-rate 4 \\
        --input-len 128 --output-len 64 --goodput ttft:500 tpot:100 \\
        --result-json bench.json --plot-dir plots/
    tokenrelay bench --sweep 1 2 4 8 inf --max-concurrency 64 --plot-dir plots/
    tokenrelay bench --dataset shared-prefix --system-prompt-len 400 --input-len 16
    tokenrelay bench --dataset jsonl --dataset-path prompts.jsonl

Requests arrive as a Poisson process at --request-rate (gamma-distributed gaps with
shape --burstiness; inf = all at once), at most --max-concurrency in flight; each is
one grpc.aio stream on a shared channel. Metrics are defined in `gateway.bench_report`.

Datasets:
  random         synthetic prompts of --input-len words drawn from common English words,
                 ~1 token per word (each word is one token with its leading space in the
                 SmolLM2 / GPT-2 style BPE vocabularies; other tokenizers differ, so the
                 server-reported prompt tokens are what the report counts); EOS is ignored
                 and max_tokens = --output-len, so output lengths are exact.
  shared-prefix  chat: one common system prompt of --system-prompt-len words + a distinct
                 user message of --input-len words per request (exercises the prefix cache).
  jsonl          one request per line, {"prompt": "..."} or {"messages": [{"role": ...,
                 "content": ...}, ...]}, optional "max_tokens" (else --output-len); cycled
                 if shorter than --num-requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from gateway.bench_report import SLO_METRICS, RequestResult, compute_metrics, format_block, write_plots
from gateway.client import DEFAULT_TARGET, add_connection_args, bearer
from gateway.tls import channel_credentials
from protos.convert import build_request
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc

DATASETS = ("random", "shared-prefix", "jsonl")
# Each is one token with its leading space in SmolLM2's vocabulary (checked with its tokenizer).
WORDS = tuple("""the of and to in is was for on that with as by at from his her are this be it an not or
have one had but all were they which their there been has more when who time will would new about into
other some what only its may first years can over also after these any such most made many people city
world year state under where water house night light music river story small large great early young
old long high black white green red blue north south east west king game film book war life school
family party team group part line home town road sea land air fire stone tree field summer winter
spring autumn morning evening garden window door table paper letter number voice""".split())


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    max_tokens: int | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class BenchConfig:
    target: str = DEFAULT_TARGET
    num_requests: int = 100
    request_rates: tuple[float, ...] = (math.inf,)  # one run per rate
    burstiness: float = 1.0
    max_concurrency: int | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    system_prompt_len: int = 256
    ignore_eos: bool = False  # jsonl only: the synthetic datasets always ignore EOS
    temperature: float = 0.0
    seed: int = 0
    model: str = ""  # GenerateRequest.model ("" = the deployment's default)
    adapter: str = ""  # GenerateRequest.adapter ("" = the base model)
    slos_ms: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (99.0,)
    timeout_s: float | None = None
    result_json: str | None = None
    plot_dir: str | None = None
    is_progress_enabled: bool = True
    # TLS (implied by ca or cert) and the bearer token, as tokenrelay-client takes them
    is_tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("--num-requests must be at least 1")
        if not self.request_rates or any(not r > 0 for r in self.request_rates):
            raise ValueError("request rates must be > 0 (inf = all at once)")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}")
        if self.dataset == "jsonl" and not self.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        if min(self.input_len, self.output_len, self.system_prompt_len) < 1:
            raise ValueError("--input-len, --output-len and --system-prompt-len must be at least 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("--range-ratio must be in [0, 1)")
        if unknown := set(self.slos_ms) - set(SLO_METRICS):
            raise ValueError(f"--goodput knows {', '.join(SLO_METRICS)}, not {', '.join(sorted(unknown))}")
        if any(not 0 < p < 100 for p in self.percentiles):
            raise ValueError("--metric-percentiles must be in (0, 100)")


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n))


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    """Uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1 (vLLM's random dataset)."""
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def make_requests(config: BenchConfig, rng: np.random.Generator) -> list[BenchRequest]:
    n = config.num_requests
    if config.dataset == "jsonl":
        rows = load_jsonl(Path(str(config.dataset_path)), config.output_len, config.ignore_eos)
        return [rows[i % len(rows)] for i in range(n)]
    input_lens = _lengths(rng, config.input_len, config.range_ratio, n)
    output_lens = _lengths(rng, config.output_len, config.range_ratio, n)
    if config.dataset == "random":
        return [BenchRequest(prompt=_words(rng, i), max_tokens=o, ignore_eos=True)
                for i, o in zip(input_lens, output_lens, strict=True)]
    system = _words(rng, config.system_prompt_len)
    return [BenchRequest(messages=(("system", system), ("user", _words(rng, i))), max_tokens=o,
                         ignore_eos=True) for i, o in zip(input_lens, output_lens, strict=True)]


def load_jsonl(path: Path, default_max_tokens: int, ignore_eos: bool) -> list[BenchRequest]:
    rows: list[BenchRequest] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            max_tokens = int(row.get("max_tokens", default_max_tokens))
            if "messages" in row:
                messages = tuple((m["role"], m["content"]) for m in row["messages"])
                rows.append(BenchRequest(None, messages, max_tokens, ignore_eos))
            else:
                rows.append(BenchRequest(str(row["prompt"]), None, max_tokens, ignore_eos))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            expected = '{"prompt": ...} or {"messages": [...]}'
            raise ValueError(f"{path}:{number}: expected {expected}; {e!r}") from e
    if not rows:
        raise ValueError(f"{path} holds no requests")
    return rows


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds since the start: the first at 0, then gamma(shape=burstiness,
    scale=1/(rate*burstiness)) gaps (mean 1/rate; burstiness 1 = Poisson); rate inf = all at 0."""
    if math.isinf(rate):
        return np.zeros(n)  # (n,)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)  # (n - 1,)
    return np.concatenate([[0.0], np.cumsum(gaps)])  # (n,)


async def send_one(stub: generate_pb2_grpc.TokenRelayStub, request: BenchRequest, run_start: float,
                   config: BenchConfig) -> RequestResult:
    """One stream, timed chunk by chunk; errors become the result's status, never an exception."""
    pb = build_request(request.prompt, request.messages, max_tokens=request.max_tokens,
                       ignore_eos=request.ignore_eos or None, temperature=config.temperature,
                       model=config.model or None, adapter=config.adapter or None)
    sent = time.perf_counter()
    result = RequestResult(start_s=sent - run_start)
    try:
        async for response in stub.Generate(pb, timeout=config.timeout_s, metadata=bearer(config.token)):
            if response.HasField("chunk"):
                if response.chunk.token_ids:
                    result.chunk_times_s.append(time.perf_counter() - sent)
                    result.chunk_num_tokens.append(len(response.chunk.token_ids))
                continue
            final = response.final
            result.finish_reason = generate_pb2.FinishReason.Name(final.finish_reason).removeprefix(
                "FINISH_REASON_")
            result.error = final.error_message
            result.prompt_tokens = final.usage.prompt_tokens
            result.cached_prompt_tokens = final.usage.cached_prompt_tokens
            result.queue_time_s = final.usage.queue_time_s
    except grpc.aio.AioRpcError as e:
        result.status, result.error = e.code().name, e.details() or ""
    result.end_s = time.perf_counter() - run_start
    return result


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return contextlib.nullcontext(None)
    try:
        from tqdm import tqdm
    except ImportError as e:
        raise RuntimeError("the progress bar needs tqdm: pip install 'tokenrelay[bench]', "
                           "or pass --no-progress") from e

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)


async def run_once(stub: generate_pb2_grpc.TokenRelayStub, requests: Sequence[BenchRequest], rate: float,
                   config: BenchConfig, rng: np.random.Generator) -> tuple[list[RequestResult], float]:
    """All requests at one offered rate; returns their results and the run's duration (s)."""
    offsets = arrival_offsets(len(requests), rate, config.burstiness, rng)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    desc = "all at once" if math.isinf(rate) else f"{rate:g} req/s"
    with _progress(len(requests), desc, config.is_progress_enabled) as bar:
        start = time.perf_counter()

        async def arrive(request: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with limit or contextlib.nullcontext():
                result = await send_one(stub, request, start, config)
            if bar is not None:
                bar.update()
            return result

        results = await asyncio.gather(*(arrive(r, float(o)) for r, o in zip(requests, offsets, strict=True)))
        return list(results), time.perf_counter() - start


async def _server_info(stub: generate_pb2_grpc.TokenRelayStub, config: BenchConfig) -> dict[str, Any]:
    try:
        info = await stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=10,
                                        metadata=bearer(config.token))
    except grpc.aio.AioRpcError as e:
        raise RuntimeError(f"cannot reach a gateway at {config.target}: "
                           f"{e.code().name}: {e.details()}") from e
    # workers and gateway_id are only an admin's to see; models are everyone's
    return {"version": info.version, "gateway_id": info.gateway_id, "models": list(info.models),
            "workers": [{"worker_id": w.worker_id, "model": w.model} for w in info.workers]}


async def _measure(stub: generate_pb2_grpc.TokenRelayStub, requests: Sequence[BenchRequest], rate: float,
                   config: BenchConfig, rng: np.random.Generator) -> dict[str, Any]:
    results, duration_s = await run_once(stub, requests, rate, config, rng)
    metrics = compute_metrics(results, duration_s, slos_ms=config.slos_ms, percentiles=config.percentiles)
    metrics.update(request_rate=rate, burstiness=config.burstiness, max_concurrency=config.max_concurrency)
    print(format_block(metrics, request_rate=rate, max_concurrency=config.max_concurrency,
                       percentiles=config.percentiles), flush=True)
    return metrics


def _channel(config: BenchConfig) -> grpc.aio.Channel:
    if config.is_tls or config.ca or config.cert or config.key:
        return grpc.aio.secure_channel(config.target, channel_credentials(config.ca, config.cert, config.key))
    return grpc.aio.insecure_channel(config.target)


async def run(config: BenchConfig) -> dict[str, Any]:
    """Every configured rate in turn against config.target; prints each run's block and
    returns the result document (also written to --result-json; plots to --plot-dir)."""
    rng = np.random.default_rng(config.seed)
    async with _channel(config) as channel:
        stub = generate_pb2_grpc.TokenRelayStub(channel)
        server = await _server_info(stub, config)
        if not server["workers"]:
            print("warning: the gateway reports no workers; requests will wait in the queue", file=sys.stderr)
        # new synthetic prompts for each rate: repeats would hit the prefix cache of the run before
        runs = [await _measure(stub, make_requests(config, rng), rate, config, rng)
                for rate in config.request_rates]
    document = {"date": datetime.now().astimezone().isoformat(timespec="seconds"), "target": config.target,
                "server": server, "config": {**asdict(config), "request_rates": list(config.request_rates)},
                "runs": runs}
    if config.plot_dir:
        document["plots"] = [str(p) for p in write_plots(runs, config.percentiles, Path(config.plot_dir))]
    if config.result_json:
        Path(config.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(config.result_json).write_text(json.dumps(_jsonable(document), indent=1, allow_nan=False))
    return document


def _jsonable(value: Any) -> Any:
    """inf (the all-at-once rate) as "inf", like vLLM's result files: JSON has no Infinity."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _slo(text: str) -> tuple[str, float]:
    name, _, ms = text.partition(":")
    try:
        return name.lower(), float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected METRIC:MS like ttft:500, not {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_args(p)
    p.add_argument("--num-requests", type=int, default=100, help="requests per run (default 100)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean arrivals per second (default inf = all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no limit)")
    p.add_argument("--sweep", type=float, nargs="+", metavar="RATE",
                   help="one run per request rate (e.g. 1 2 4 inf), instead of --request-rate")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times (default 0)")
    p.add_argument("--model", default="", help="the served model to load (default: the deployment's default)")
    p.add_argument("--adapter", default="", help="a LoRA adapter of --model (default: the base model)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=DATASETS, default="random", help="default random (see below)")
    d.add_argument("--dataset-path", help="the JSONL file for --dataset jsonl")
    d.add_argument("--input-len", type=int, default=128, help="prompt (user message) words (default 128)")
    d.add_argument("--output-len", type=int, default=64, help="tokens to generate (default 64)")
    d.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in len*(1-r)..len*(1+r) (default 0 = fixed)")
    d.add_argument("--system-prompt-len", type=int, default=256, help="shared-prefix: system prompt words")
    d.add_argument("--ignore-eos", action="store_true", help="jsonl: generate max_tokens past EOS")
    d.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    r = p.add_argument_group("report")
    r.add_argument("--goodput", type=_slo, nargs="+", metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    r.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99 (default 99)")
    r.add_argument("--result-json", help="write the results (summary and per-request data) here")
    r.add_argument("--plot-dir", help="write PNG plots here (needs matplotlib)")
    r.add_argument("--timeout", type=float, help="per-request deadline in seconds (default none)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        target=args.target, num_requests=args.num_requests,
        request_rates=tuple(args.sweep) if args.sweep else (args.request_rate,),
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, dataset=args.dataset,
        dataset_path=args.dataset_path, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, system_prompt_len=args.system_prompt_len, ignore_eos=args.ignore_eos,
        temperature=args.temperature, seed=args.seed, model=args.model, adapter=args.adapter,
        slos_ms=dict(args.goodput or []),
        percentiles=tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip()),
        timeout_s=args.timeout, result_json=args.result_json, plot_dir=args.plot_dir,
        is_progress_enabled=not args.no_progress, is_tls=args.tls, ca=args.ca, cert=args.cert,
        key=args.key, token=args.token)


def bench(args: argparse.Namespace) -> int:
    """`tokenrelay bench` after parsing; failed requests are results, not an error."""
    asyncio.run(run(config_from_args(args)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenrelay bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return bench(build_parser().parse_args(argv))
    except (RuntimeError, ValueError, OSError) as e:
        print(f"tokenrelay bench: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
