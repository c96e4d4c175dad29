"""A fleet on one machine: G gateways and W simulated workers on one Redis, S streams.

Every part is its own process over loopback: one Redis (gateway/redis_server.py, AOF
fsynced every second as the product runs, or $REDIS_URL), G `python -m gateway`, W
`python -m worker --engine sim`, and this process as the grpc.aio load generator, which
keeps S streams open (round-robin over the gateways; a finished request is followed at
once by a new one) and checks every token against `sim_token_ids(seed, i, 1)`.

Sweep points (W, S) = (2, 64), (8, 256), (16, 1024), each with 64- and 4096-token
outputs. A point warms up until all S streams have their first token, then measures
over a fixed window (a 2-core machine cannot finish 1024 x 4096 tokens), then cancels
what is open. The sim step time is chosen per point so the offered load is one budget
(step_ms = 1000 * S / --token-budget): every point offers the same tokens/s, so a cost
per 1,000 tokens that grows with S is a cost of the number of streams. Measured over
the window only (INFO and /proc read at its two ends):

  tokens/s; Redis CPU s per 1k tokens (INFO cpu, children included: an AOF rewrite);
  Redis bytes in per token (total_net_input_bytes) and AOF growth per token; Redis
  commands per token (total_commands_processed) and calls per token (commandstats,
  which also counts commands run inside scripts); gateway, worker and load-generator
  CPU s per 1k tokens (/proc/<pid>/stat); added inter-token latency (gap between
  chunks minus the step time) and TTFT overhead (send -> first chunk minus one step)
  p50/p99; lost, duplicated and mismatched tokens (over the whole point); machine busy
  (/proc/stat). All processes share the machine's cores: compare points within one run.

Then a shedding test: one more gateway with --max-queue-depth 16 on a key prefix no
worker serves; 16 calls fill its queue, then 500 calls at once are refused
(RESOURCE_EXHAUSTED) and each refusal's latency is measured.

Prints a table, "TARGETS FAILED: ..." if any target fails, and one JSON line last (the
targets under "targets"); writes a PNG (gateway and Redis CPU per 1k tokens against S).
--record keeps the JSON line in benchmarks/results/fleet.json, except after --quick: a
smoke run is never recorded. Exit status 0 even when a target
fails; 1 on lost/duplicated/mismatched tokens, 2 when a process crashed.

    python benchmarks/fleet.py [--quick] [--points 2x64,8x256] [--output-lens 64,4096]
        [--window-s 15] [--warmup-s 5] [--token-budget 3000] [--gateways 2] [--plot PATH] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import redis  # noqa: E402

from benchmarks.fleet_floor import grpc_floor  # noqa: E402
from benchmarks.fleet_load import Load  # noqa: E402
from benchmarks.fleet_procs import ChildDied, Fleet  # noqa: E402
from benchmarks.fleet_report import print_report, rounded  # noqa: E402
from benchmarks.fleet_shed import shedding_test  # noqa: E402
from benchmarks.fleet_stats import (  # noqa: E402
    PointResult,
    command_calls,
    cpu_busy,
    evaluate_targets,
    headline,
    print_command_calls,
    redis_counters,
)
from benchmarks.results import add_record_arg, emit  # noqa: E402
from gateway.redis_server import EmbeddedRedis  # noqa: E402
from protos.tokenrelay.v1 import generate_pb2_grpc  # noqa: E402

FULL_POINTS = ((2, 64), (8, 256), (16, 1024))
FULL_OUTPUT_LENS = (64, 4096)
QUICK_POINTS, QUICK_OUTPUT_LENS = ((1, 16), (2, 32)), (16, 256)
SHED_BURST = 500
MAX_WARMUP_S = 90.0  # all S streams must have their first token by then
CANCEL_TIMEOUT_S = 15.0


def proc_stat_cpu() -> list[int]:
    """The aggregate 'cpu' line of /proc/stat (jiffies)."""
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def snapshot(client: redis.Redis, fleet: Fleet) -> dict[str, Any]:
    times = os.times()
    info = client.info("all")
    return {"redis": redis_counters(info), "calls": command_calls(info),
            "gateways": fleet.cpu_s(fleet.gateways),
            "workers": fleet.cpu_s(fleet.workers), "client": times.user + times.system,
            "stat": proc_stat_cpu(), "t": time.perf_counter()}


async def watch(fleet: Fleet, seconds: float, until: Any = None) -> None:
    """Sleep `seconds` (or until `until()` after them, at most MAX_WARMUP_S), checking the
    children every 0.25 s: ChildDied names the one that exited."""
    start = time.monotonic()
    while True:
        fleet.check()
        elapsed = time.monotonic() - start
        if elapsed >= seconds and (until is None or until() or elapsed >= MAX_WARMUP_S):
            return
        await asyncio.sleep(0.25)


async def drive(fleet: Fleet, client: redis.Redis, result: PointResult, args: argparse.Namespace,
                seed_base: int) -> None:
    channels = [grpc.aio.insecure_channel(t) for t in fleet.targets]
    stubs = [generate_pb2_grpc.TokenRelayStub(c) for c in channels]
    call_timeout = MAX_WARMUP_S + args.window_s + 60
    load = Load(stubs, result.num_streams, result.output_len, seed_base, call_timeout, args.stream_interval)
    tasks = [asyncio.ensure_future(load.slot(i)) for i in range(result.num_streams)]
    try:
        await watch(fleet, args.warmup_s, until=lambda: len(load.opened) == result.num_streams)
        result.num_open_at_start = len(load.opened)
        load.window_start = time.perf_counter()
        load.is_measuring = True
        start = snapshot(client, fleet)
        await watch(fleet, args.window_s)
        load.is_measuring = False
        end = snapshot(client, fleet)
    finally:
        load.is_stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=CANCEL_TIMEOUT_S)
        for channel in channels:
            await channel.close()
        result.errors = load.errors  # checked up to a crash, too
    if failed := [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]:
        raise RuntimeError(f"{len(failed)} load-generator streams failed") from failed[0]
    if result.num_open_at_start < result.num_streams:
        print(f"  only {result.num_open_at_start} of {result.num_streams} streams had a token after "
              f"{MAX_WARMUP_S:.0f} s of warm-up", file=sys.stderr)
    result.window_s = end["t"] - start["t"]
    result.num_tokens = load.num_tokens
    result.redis = {k: end["redis"][k] - start["redis"][k] for k in start["redis"]}
    result.redis["commands"] -= 1  # the INFO that took the first reading
    result.gateway_cpu_s = end["gateways"] - start["gateways"]
    result.worker_cpu_s = end["workers"] - start["workers"]
    result.client_cpu_s = end["client"] - start["client"]
    result.machine_busy = cpu_busy(start["stat"], end["stat"])
    result.gaps_s, result.ttfts_s = load.gaps_s, load.ttfts_s
    result.num_refused = load.num_refused
    if args.commands:
        print_command_calls(start["calls"], end["calls"], load.num_tokens)
    if load.num_refused:
        print(f"  {load.num_refused} calls failed, the last: {load.last_refusal}", file=sys.stderr)


def reset_redis(client: redis.Redis) -> None:
    """Our own Redis only: empty it and compact the AOF, so no rewrite lands in a window."""
    client.flushall()
    client.bgrewriteaof()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not int(client.info("persistence").get("aof_rewrite_in_progress", 0)):
            return
        time.sleep(0.1)


def run_point(redis_url: str, client: redis.Redis, is_own_redis: bool, num_workers: int,
              num_streams: int, output_len: int, args: argparse.Namespace, log_dir: Path,
              number: int) -> PointResult:
    step_ms = 1000 * num_streams / args.token_budget
    result = PointResult(num_workers, num_streams, output_len, step_ms, args.window_s)
    if is_own_redis:
        reset_redis(client)
    prefix = f"fleet-{number}-{uuid.uuid4().hex[:6]}"
    max_model_len = max(args.output_lens) + 64
    fleet = Fleet(redis_url, prefix, log_dir / prefix, num_gateways=args.gateways,
                  num_workers=num_workers, max_num_seqs=math.ceil(1.25 * num_streams / num_workers),
                  max_queue_depth=2 * num_streams + 16, step_ms=step_ms, max_model_len=max_model_len)
    print(f"point W={num_workers} S={num_streams} len={output_len} step={step_ms:.1f} ms ...",
          file=sys.stderr)
    try:
        fleet.start(timeout_s=60 + 3 * num_workers)
        asyncio.run(drive(fleet, client, result, args, seed_base=number << 48))
    except ChildDied as e:
        result.error = str(e)
        print(f"  CRASHED: {e}", file=sys.stderr)
    finally:
        fleet.stop()
    return result


def parse_points(text: str) -> list[tuple[int, int]]:
    try:
        points = [(int(w), int(s)) for w, s in (p.split("x") for p in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"points are WxS,WxS,...: {text!r}") from None
    if any(w < 1 or s < 1 for w, s in points):
        raise argparse.ArgumentTypeError("W and S must be at least 1")
    return points


def parse_lens(text: str) -> list[int]:
    lens = [int(x) for x in text.split(",")]
    if any(n < 1 for n in lens):
        raise argparse.ArgumentTypeError("output lengths must be at least 1")
    return lens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke test: points 1x16 and 2x32, outputs 16 and 256, 1 s warm-up, 2 s windows, "
                        "burst 100")
    p.add_argument("--points", type=parse_points, help="WxS,... (default 2x64,8x256,16x1024)")
    p.add_argument("--output-lens", type=parse_lens, help="tokens per request, e.g. 64,4096")
    p.add_argument("--window-s", type=float, help="measuring window per point (default 15)")
    p.add_argument("--warmup-s", type=float,
                   help="at least this long, and until all S streams have their first token (default 5)")
    p.add_argument("--token-budget", type=float, default=3000,
                   help="tokens/s offered at every point: step_ms = 1000 * S / budget")
    p.add_argument("--gateways", type=int, default=2, help="gateway processes G (streams round-robin)")
    p.add_argument("--shed-burst", type=int, help=f"calls fired at the full queue (default {SHED_BURST})")
    p.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "fleet.png", help="PNG to write")
    p.add_argument("--commands", action="store_true",
                   help="print each Redis command's calls per token over each window (to stderr)")
    p.add_argument("--keep-logs", action="store_true", help="keep the children's logs (kept on a crash)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="tokens per chunk (GenerateRequest.stream_interval); > 1: the costs of fewer "
                        "messages, no ITL, not recorded (the headline is 1 token a chunk)")
    add_record_arg(p)
    args = p.parse_args(argv)
    quick = args.quick
    args.points = args.points or list(QUICK_POINTS if quick else FULL_POINTS)
    args.output_lens = args.output_lens or list(QUICK_OUTPUT_LENS if quick else FULL_OUTPUT_LENS)
    args.window_s = args.window_s if args.window_s is not None else (2.0 if quick else 15.0)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else (1.0 if quick else 5.0)
    args.shed_burst = args.shed_burst or (100 if quick else SHED_BURST)
    if args.window_s <= 0 or args.token_budget <= 0 or args.gateways < 1:
        p.error("--window-s, --token-budget and --gateways must be positive")
    return args


def summarize(rows: list[dict[str, Any]], shed: dict[str, Any], floor: dict[str, Any],
              args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {"points": rows, **headline(rows),
                               "reject_p50_ms": shed.get("reject_p50_ms"),
                               "reject_p99_ms": shed.get("reject_p99_ms"), "shedding": shed,
                               "grpc_floor": floor}
    floor_cpu, gateway_cpu = floor.get("cpu_s_per_1k_messages"), summary.get("gateway_cpu_s_per_1k_tokens")
    summary["grpc_floor_cpu_s_per_1k_messages"] = floor_cpu
    summary["gateway_cpu_over_grpc_floor"] = (gateway_cpu / floor_cpu if floor_cpu and gateway_cpu is not None
                                              else None)
    for key in ("lost", "duplicated", "mismatched"):
        summary[key] = sum(r[key] for r in rows)
    summary["machine"] = (f"{platform.machine()} {os.cpu_count()} CPUs, {platform.system()} "
                          f"{platform.release()}; every process shares these cores: compare points "
                          "within one run")
    summary["cpu_model"] = cpu_model()
    summary["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    summary["config"] = {"gateways": args.gateways, "token_budget": args.token_budget,
                         "window_s": args.window_s, "warmup_s": args.warmup_s, "quick": args.quick,
                         "stream_interval": args.stream_interval,
                         "redis": "REDIS_URL" if os.environ.get("REDIS_URL") else "embedded, AOF everysec"}
    summary["targets"] = evaluate_targets(summary)
    return summary


def measure_floor(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """The gRPC floor (benchmarks/fleet_floor.py) at the largest point's streams and token rate."""
    num_workers, num_streams = max(args.points, key=lambda p: p[1])
    try:
        return grpc_floor(log_dir, num_streams, num_workers, 1000 * num_streams / args.token_budget,
                          warmup_s=args.warmup_s, window_s=args.window_s)
    except (ChildDied, grpc.RpcError) as e:
        print(f"  gRPC floor CRASHED: {e}", file=sys.stderr)
        return {"error": str(e)}


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM (and SIGINT, even if ignored when started) stop the children


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    log_dir = Path(tempfile.mkdtemp(prefix="tokenrelay-fleet-"))
    external = os.environ.get("REDIS_URL")
    server = None if external else EmbeddedRedis()
    rows: list[dict[str, Any]] = []
    try:
        redis_url = external or server.start()  # type: ignore[union-attr]
        client = redis.Redis.from_url(redis_url, socket_timeout=30)
        number = 0
        for num_workers, num_streams in args.points:
            for output_len in args.output_lens:
                number += 1
                rows.append(run_point(redis_url, client, server is not None, num_workers, num_streams,
                                      output_len, args, log_dir, number).row())
        floor = measure_floor(args, log_dir)
        try:
            shed = shedding_test(redis_url, log_dir, args.shed_burst)
        except (ChildDied, RuntimeError, grpc.RpcError) as e:
            print(f"  shedding test CRASHED: {e}", file=sys.stderr)
            shed = {"error": str(e), "outcomes": {}, "reject_p50_ms": None, "reject_p99_ms": None}
        client.close()
    except KeyboardInterrupt:
        shutil.rmtree(log_dir, ignore_errors=True)
        raise
    finally:
        if server is not None:
            server.stop()
    summary = summarize(rows, shed, floor, args)
    print_report(rows, summary, shed, floor, args.plot)
    is_crashed = any(r["error"] for r in rows) or bool(shed.get("error"))
    if is_crashed or args.keep_logs:
        print(f"logs: {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    failed = [k for k, t in summary["targets"].items() if t["met"] is False]
    unmeasured = [k for k, t in summary["targets"].items() if t["met"] is None]
    if unmeasured:
        print(f"TARGETS NOT MEASURED: {', '.join(unmeasured)}")
    if failed:
        print(f"TARGETS FAILED: {', '.join(failed)}")
    smoke = ("--quick smoke run" if args.quick else
             f"--stream-interval {args.stream_interval} run" if args.stream_interval > 1 else None)
    emit("fleet", rounded(summary), args, smoke=smoke)
    if is_crashed:
        return 2
    return 1 if summary["lost"] or summary["duplicated"] or summary["mismatched"] else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: every process this bench started is stopped", file=sys.stderr)
        sys.exit(130)
