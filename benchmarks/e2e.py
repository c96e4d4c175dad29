"""End-to-end overhead: the engine in-process vs the same workload through
gateway + Redis + one worker, in one run.

Workload: 16 concurrent requests, 128 new tokens each (EOS ignored), greedy.
  * in-process: a TextEngine in this process, all 16 added at once, stepped to the end;
  * end to end: a private Redis, `python -m gateway` and `python -m worker` as
    child processes, 16 concurrent grpc.aio streams from this process.
  * gRPC floor: the same 16-call burst from the same client against a no-op
    grpc.aio server (one chunk back at once, no Redis, no model), so the part of
    the added first-token time that is Python gRPC itself is measured, not guessed.
Reports aggregate output tokens/s for both and their ratio (target >= 0.9),
time to first token p50/p99 (target: end to end adds <= 10 ms at p50), Redis
commands per generated token from `INFO commandstats` (target <= 0.5) and the
gateway's peak RSS (target <= 150 MB: it must not load torch). Prints a table,
then one JSON line (medians over --runs, the targets under "targets"); --record
keeps it in benchmarks/results/e2e.json.

The two sides alternate run by run (in-process, end to end, in-process, ...)
so that drift of a shared host hits both alike.

    python benchmarks/e2e.py [--runs 7] [--threads 2] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import redis  # noqa: E402

from benchmarks import results as bench  # noqa: E402
from gateway.__main__ import loop_factory  # noqa: E402
from gateway.redis_server import EmbeddedRedis, free_port  # noqa: E402
from protos.convert import build_request  # noqa: E402
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402

NUM_CONCURRENT = 16
NEW_TOKENS = 128

def prompts(tag: str) -> list[str]:
    """16 prompts that share no cacheable prefix with each other or with other runs' (the
    prefix cache would otherwise skip most of the prefill from the second run on)."""
    return [f"[{tag}/{i}] Story number {i}. Once upon a time, in a land far away, there lived"
            for i in range(NUM_CONCURRENT)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- in-process ---------------------------------------------------------------------------------------

def inproc_runner(threads: int, max_model_len: int) -> Callable[[str], dict[str, float]]:
    """A warmed-up in-process engine; the returned function runs the workload once."""
    from protos.params import PromptInput, SamplingParams
    from worker.engine.config import EngineConfig
    from worker.factory import build_text_engine

    engine = build_text_engine(EngineConfig(max_num_seqs=NUM_CONCURRENT, num_threads=threads,
                                            max_model_len=max_model_len))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def once(tag: str, batch: list[str]) -> dict[str, float]:
        start = time.perf_counter()
        first: dict[str, float] = {}
        num_tokens = 0
        for i, prompt in enumerate(batch):
            engine.add_request(f"{tag}-{i}", PromptInput(prompt=prompt), params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.token_ids:
                    first.setdefault(out.request_id, time.perf_counter() - start)
                    num_tokens += len(out.token_ids)
        return summary(num_tokens, time.perf_counter() - start, list(first.values()))

    once("warmup", prompts("wi")[:2])
    return lambda tag: once(tag, prompts(f"i{tag}"))


def summary(num_tokens: int, wall_s: float, ttfts_s: list[float]) -> dict[str, float]:
    return {"tokens": num_tokens, "tps": num_tokens / wall_s, "ttft_p50_ms": percentile(ttfts_s, 0.5) * 1000,
            "ttft_p99_ms": percentile(ttfts_s, 0.99) * 1000}


# -- end to end ---------------------------------------------------------------------------------------

async def stream_one(stub: Any, prompt: str) -> tuple[float, int, Any]:
    """(TTFT seen by the client, tokens, the worker's Usage)."""
    request = build_request(prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ttft, num_tokens, usage = 0.0, 0, None
    async for response in stub.Generate(request, timeout=600):
        if response.HasField("chunk") and response.chunk.token_ids:
            ttft = ttft or time.perf_counter() - start
            num_tokens += len(response.chunk.token_ids)
        elif response.HasField("final"):
            usage = response.final.usage
    return ttft, num_tokens, usage


async def run_streams(target: str, prompts: list[str]) -> dict[str, float]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.TokenRelayStub(channel)
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(stub, p) for p in prompts))
        wall = time.perf_counter() - start
    report = summary(sum(n for _, n, _ in results), wall, [t for t, _, _ in results])
    report["ttft_p50_ms_worker"] = percentile([u.time_to_first_token_s for _, _, u in results], 0.5) * 1000
    report["queue_p50_ms_worker"] = percentile([u.queue_time_s for _, _, u in results], 0.5) * 1000
    # admitted -> first token: the prefill step itself, to hold against the in-process TTFT
    report["step_p50_ms_worker"] = percentile([u.time_to_first_token_s - u.queue_time_s
                                               for _, _, u in results], 0.5) * 1000
    return report


class NoopServicer(generate_pb2_grpc.TokenRelayServicer):
    """Answers Generate with one chunk and a final message at once: the transport alone."""

    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
        yield generate_pb2.GenerateResponse(chunk=generate_pb2.Chunk(index=0, token_ids=[1], text="x"))
        yield generate_pb2.GenerateResponse(final=generate_pb2.Final(usage=generate_pb2.Usage()))

    async def GetServerInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        return generate_pb2.ServerInfo(workers=[generate_pb2.WorkerInfo()])


async def serve_noop(target: str) -> None:
    server = grpc.aio.server()
    generate_pb2_grpc.add_TokenRelayServicer_to_server(NoopServicer(), server)
    server.add_insecure_port(target)
    await server.start()
    await server.wait_for_termination()


def wait_for_worker(target: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.TokenRelayStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=1).workers:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)  # the worker is loading its model
    raise TimeoutError("the worker did not come up")


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the process's resident-set high-water mark."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def commands_since_reset(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_config"))


def run_both(threads: int, max_model_len: int, runs: int
             ) -> tuple[list[dict[str, float]], list[dict[str, float]], float]:
    """Alternate in-process and end-to-end runs, so host drift hits both sides alike."""
    inproc_once = inproc_runner(threads, max_model_len)
    with EmbeddedRedis() as server:
        target, noop_target = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        common = ["--redis-url", server.url, "--log-level", "WARNING"]
        noop = subprocess.Popen([sys.executable, __file__, "--noop-server", noop_target], cwd=ROOT)
        gateway = subprocess.Popen([sys.executable, "-m", "gateway", "--listen", target, *common], cwd=ROOT)
        worker = subprocess.Popen([sys.executable, "-m", "worker", "--max-num-seqs", str(NUM_CONCURRENT),
                                   "--num-threads", str(threads), "--max-model-len", str(max_model_len),
                                   *common], cwd=ROOT)
        client = redis.Redis.from_url(server.url)
        try:
            wait_for_worker(target)
            wait_for_worker(noop_target)
            asyncio.run(run_streams(target, prompts("we")[:2]))
            inproc, e2e = [], []
            for r in range(runs):
                inproc.append(inproc_once(str(r)))
                client.config_resetstat()
                result = asyncio.run(run_streams(target, prompts(f"e{r}")))
                result["redis_cmds_per_token"] = commands_since_reset(client) / result["tokens"]
                result["grpc_floor_ttft_p50_ms"] = statistics.median(
                    asyncio.run(run_streams(noop_target, prompts("floor")))["ttft_p50_ms"] for _ in range(5))
                e2e.append(result)
                print(f"run {r + 1}/{runs}: in-process {inproc[-1]['tps']:.1f} tok/s, TTFT p50 "
                      f"{inproc[-1]['ttft_p50_ms']:.0f} ms; end to end {result['tps']:.1f} tok/s, TTFT p50 "
                      f"{result['ttft_p50_ms']:.0f} ms", file=sys.stderr)
            return inproc, e2e, peak_rss_mb(gateway.pid)
        finally:
            client.close()
            for proc in (worker, gateway, noop):
                proc.terminate()
                proc.wait(60)


def median(results: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noop-server", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=7, help="measured runs per side (medians are reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    parser.add_argument("--max-model-len", type=int, default=512,
                        help="KV cache tokens per sequence, both sides (the prompts + 128 tokens fit in 512)")
    bench.add_record_arg(parser)
    args = parser.parse_args()
    if args.noop_server:
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:  # the gateway's event loop
            runner.run(serve_noop(args.noop_server))
        return 0

    inproc, e2e, gateway_rss = run_both(args.threads, args.max_model_len, args.runs)
    report = {
        "inproc_tps": median(inproc, "tps"), "e2e_tps": median(e2e, "tps"),
        "ratio": median(e2e, "tps") / median(inproc, "tps"),
        "ttft_p50_ms_inproc": median(inproc, "ttft_p50_ms"),
        "ttft_p99_ms_inproc": median(inproc, "ttft_p99_ms"),
        "ttft_p50_ms_e2e": median(e2e, "ttft_p50_ms"), "ttft_p99_ms_e2e": median(e2e, "ttft_p99_ms"),
        # Enqueue -> first token as the worker measured it (Usage.time_to_first_token_s).
        "ttft_p50_ms_e2e_worker": median(e2e, "ttft_p50_ms_worker"),
        "queue_p50_ms_e2e_worker": median(e2e, "queue_p50_ms_worker"),  # enqueue -> admitted
        "step_p50_ms_e2e_worker": median(e2e, "step_p50_ms_worker"),  # admitted -> first token
        # TTFT p50 is one prefill step, which alone varies by +-10% on a shared host: also
        # give the paired per-run difference, and the part spent outside the worker
        # (gRPC + gateway + XADD before, PUBLISH + relay after).
        "ttft_p50_added_ms": statistics.median(e["ttft_p50_ms"] - i["ttft_p50_ms"]
                                               for e, i in zip(e2e, inproc, strict=True)),
        "outside_worker_p50_ms": statistics.median(e["ttft_p50_ms"] - e["ttft_p50_ms_worker"] for e in e2e),
        # the same client's 16-call burst against a no-op grpc.aio server: Python gRPC's share
        "grpc_floor_ttft_p50_ms": median(e2e, "grpc_floor_ttft_p50_ms"),
        "redis_cmds_per_token": median(e2e, "redis_cmds_per_token"), "gateway_peak_rss_mb": gateway_rss,
        "num_concurrent": NUM_CONCURRENT, "new_tokens": NEW_TOKENS, "runs": args.runs,
        "threads": args.threads, "max_model_len": args.max_model_len,
    }
    nan = float("nan")
    rows = [("aggregate tokens/s", report["inproc_tps"], report["e2e_tps"], ">= 0.9x in-process"),
            ("TTFT p50 (ms)", report["ttft_p50_ms_inproc"], report["ttft_p50_ms_e2e"], "<= in-process + 10"),
            ("TTFT p99 (ms)", report["ttft_p99_ms_inproc"], report["ttft_p99_ms_e2e"], ""),
            ("  p50 worker-side (ms)", float("nan"), report["ttft_p50_ms_e2e_worker"], "from enqueue"),
            ("  p50 queued (ms)", float("nan"), report["queue_p50_ms_e2e_worker"], "enqueue -> admitted"),
            ("  p50 prefill step (ms)", report["ttft_p50_ms_inproc"], report["step_p50_ms_e2e_worker"],
             "admitted -> first token"),
            ("  p50 outside worker (ms)", nan, report["outside_worker_p50_ms"], "client - worker-side"),
            ("TTFT p50 added (ms)", nan, report["ttft_p50_added_ms"], "median of per-run e2e - inproc"),
            ("  of which gRPC floor", nan, report["grpc_floor_ttft_p50_ms"], "no-op server, same burst")]
    print(f"{'':22}{'in-process':>12}{'end to end':>12}  target")
    for name, a, b, target in rows:
        print(f"{name:22}{a:12.1f}{b:12.1f}  {target}")
    print(f"{'ratio e2e / inproc':22}{report['ratio']:24.3f}  >= 0.9")
    print(f"{'Redis cmds / token':22}{report['redis_cmds_per_token']:24.3f}  <= 0.5")
    print(f"{'gateway peak RSS (MB)':22}{gateway_rss:24.1f}  <= 150")
    payload: dict[str, object] = {k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()}
    payload["targets"] = {"ratio": bench.target(payload["ratio"], ">=", 0.9),
                          "ttft_p50_added_ms": bench.target(payload["ttft_p50_added_ms"], "<=", 10),
                          "redis_cmds_per_token": bench.target(payload["redis_cmds_per_token"], "<=", 0.5),
                          "gateway_peak_rss_mb": bench.target(payload["gateway_peak_rss_mb"], "<=", 150)}
    bench.emit("e2e", payload, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
