"""Prefix-cache-aware routing: chat sessions on 4 workers, --routing prefix vs none, 1 worker as the ceiling.

Every part is its own process over loopback, as deployed: a private Redis
(gateway/redis_server.py), one `python -m gateway` and --workers (4) `python -m worker`
on the bundled SmolLM2-135M (1 torch thread each, prefix caching on, a KV pool of
--kv-cache-memory-mb (256) each). This process plays --sessions (24) chat sessions of
--turns (4) through grpc.aio, at most --concurrency (8) sessions at once (a session's turns
one after the other, --think-ms (1,000 x 0.5..1.5) apart as a user reads the answer, so the
sessions interleave in time):
  * each session has its own ~300-token document as the system message (seeded sentences,
    distinct from the first tokens on);
  * each turn adds a ~40-token user message, after the previous turn's answer (the text of
    its stream) as the assistant message: the chat-messages form of GenerateRequest;
  * greedy, --max-tokens (20) tokens at most.

Configurations, each on a fresh gateway, fresh workers (cold prefix caches) and its own key
prefix, after a few short warm-up requests:
  * prefix: `--routing prefix` (the gateway sends a turn to the worker holding its prefix);
  * none:   `--routing none` (every worker pulls from the shared stream, as before routing);
  * single_worker: 1 worker with --workers x the KV pool (the same total budget), once: the
    hit fraction a cache that sees every session can reach.
prefix and none alternate, --runs (2) each; the figures are medians over runs.

Per configuration, over turns 2.. (the ones that can find their history cached):
  hit fraction = sum of Final.usage.cached_prompt_tokens / sum of usage.prompt_tokens;
  TTFT p50 = call sent -> first chunk, as this client sees it;
  load imbalance = most / fewest requests served per worker (Final.worker_id), all turns.
Targets: hit_fraction_prefix >= 0.9 x hit_fraction_single_worker; ttft_p50_ms_prefix <=
0.6 x ttft_p50_ms_none; load_imbalance_prefix <= 1.5. Prints a table, a NOT MET line per
failed target, then one JSON line (targets under "targets"); --record keeps it in
benchmarks/results/routing.json, except after --quick (a smoke run) or a crash. Exit status
0 even when a target fails; 1 when a request failed, 2 when a process crashed. All processes
share the machine's cores: compare within one run.

    python benchmarks/routing.py [--quick] [--runs 2] [--sessions 24] [--turns 4] [--max-tokens 20]
        [--concurrency 8] [--workers 4] [--kv-cache-memory-mb 256] [--route-max-wait-ms MS] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from benchmarks.fleet_procs import Child, ChildDied, ChildGroup  # noqa: E402
from benchmarks.results import add_record_arg, emit, target  # noqa: E402
from benchmarks.routing_chat import Turn, play_session, warm_up  # noqa: E402
from gateway.redis_server import EmbeddedRedis, free_port  # noqa: E402
from protos.tokenrelay.v1 import generate_pb2_grpc  # noqa: E402

START_TIMEOUT_S = 300.0  # W model workers loading at once on 2 cores
TARGET_HIT_VS_SINGLE, TARGET_TTFT_VS_NONE, TARGET_IMBALANCE = 0.9, 0.6, 1.5
QUICK = {"sessions": 8, "turns": 2, "max_tokens": 8, "runs": 1}
DEFAULTS = {"sessions": 24, "turns": 4, "max_tokens": 20, "runs": 2}
NAMES = ("prefix", "none", "single_worker")  # the configurations, in the table's order


# -- the sessions, on one configuration's processes ----------------------------------------------

async def play(group: ChildGroup, args: argparse.Namespace) -> tuple[list[Turn], float]:
    """Warm-up, then every session, at most --concurrency at once; ChildDied if a process exits."""
    sessions = asyncio.Semaphore(args.concurrency)

    async def bounded(stub: Any, session: int) -> list[Turn]:
        async with sessions:
            return await play_session(stub, session, args.turns, args.max_tokens, args.think_ms / 1000)

    async with grpc.aio.insecure_channel(group.targets[0]) as channel:
        stub = generate_pb2_grpc.TokenRelayStub(channel)
        await asyncio.gather(*(warm_up(stub, i) for i in range(2 * len(group.workers))))
        start = time.perf_counter()
        everything = asyncio.gather(*(bounded(stub, s) for s in range(args.sessions)))
        try:
            while not everything.done():
                group.check()
                await asyncio.wait([everything], timeout=0.5)
        finally:
            everything.cancel()
        wall_s = time.perf_counter() - start
    return [t for session in everything.result() for t in session], wall_s


# -- one configuration on its own processes -------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    name: str  # prefix, none, single_worker
    routing: str  # the gateway's --routing
    num_workers: int
    kv_cache_memory_mb: int  # per worker


@dataclass
class Run:
    setup: Setup
    worker_ids: list[str]
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = float("nan")
    crash: str = ""

    def later(self) -> list[Turn]:
        return [t for t in self.turns if t.turn > 0 and not t.error]

    def hit_fraction(self) -> float | None:
        prompt = sum(t.prompt_tokens for t in self.later())
        return sum(t.cached_prompt_tokens for t in self.later()) / prompt if prompt else None

    def ttft_p50_ms(self, first_turn: bool = False) -> float | None:
        turns = [t for t in self.turns
                 if not t.error and not math.isnan(t.ttft_s) and (t.turn == 0) == first_turn]
        return statistics.median(t.ttft_s for t in turns) * 1000 if turns else None

    def served(self) -> list[int]:
        """Requests each worker served, in worker order (0 for one that served none)."""
        counts = Counter(t.worker_id for t in self.turns if not t.error)
        return [counts[w] for w in self.worker_ids]

    def load_imbalance(self) -> float | None:
        served = self.served()
        if not sum(served):
            return None
        return max(served) / min(served) if min(served) else float("inf")

    def errors(self) -> list[str]:
        return [f"session {t.session} turn {t.turn + 1}: {t.error}" for t in self.turns if t.error]


def make_group(redis_url: str, prefix: str, setup: Setup, args: argparse.Namespace,
               log_dir: Path) -> ChildGroup:
    """One gateway and setup.num_workers model workers."""
    common = ["--redis-url", redis_url, "--key-prefix", prefix, "--metrics-port", "0",
              "--log-level", "WARNING"]
    routing = ["--routing", setup.routing]
    if setup.routing == "prefix" and args.route_max_wait_ms is not None:
        routing += ["--route-max-wait-ms", str(args.route_max_wait_ms)]
    target = f"127.0.0.1:{free_port()}"
    gateway = Child("gateway", ["-m", "gateway", "--listen", target, "--shutdown-grace", "1", *routing,
                                *common], log_dir / f"{prefix}-gateway.log")
    workers = [Child(f"worker-{i}", ["-m", "worker", "--num-threads", "1", "--kv-cache-memory-mb",
                                     str(setup.kv_cache_memory_mb), "--drain-timeout", "1",
                                     "--reattach-grace", "1", "--worker-id", f"{prefix}-w{i}", *common],
                     log_dir / f"{prefix}-worker-{i}.log")
               for i in range(setup.num_workers)]
    return ChildGroup([gateway], [target], workers)


def run_setup(redis_url: str, setup: Setup, args: argparse.Namespace, log_dir: Path, number: int) -> Run:
    prefix = f"routing-{number}-{setup.name}"
    group = make_group(redis_url, prefix, setup, args, log_dir)
    run = Run(setup, [f"{prefix}-w{i}" for i in range(setup.num_workers)])
    try:
        started = time.monotonic()
        group.start(START_TIMEOUT_S)
        print(f"{setup.name}: serving after {time.monotonic() - started:.0f} s", file=sys.stderr)
        run.turns, run.wall_s = asyncio.run(play(group, args))
    except ChildDied as e:
        run.crash = str(e)
        print(f"  CRASHED: {e}", file=sys.stderr)
    finally:
        group.stop()
    hit, ttft = run.hit_fraction(), run.ttft_p50_ms()
    print(f"{setup.name} ({setup.num_workers} workers): {run.wall_s:.1f} s, hit fraction "
          f"{'-' if hit is None else f'{hit:.3f}'}, TTFT p50 {'-' if ttft is None else f'{ttft:.0f}'} ms, "
          f"served {'/'.join(map(str, run.served()))}", file=sys.stderr)
    return run


# -- report ----------------------------------------------------------------------------------------------

def median_of(runs: list[Run], value: Callable[[Run], float | None]) -> float | None:
    """The median over the runs that did not crash."""
    values = [v for v in (value(r) for r in runs if not r.crash) if v is not None]
    return statistics.median(values) if values else None


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def answers_identical(runs: list[Run]) -> bool:
    """Greedy answers per (session, turn) equal in every run: routing must not change an answer."""
    answers = [{(t.session, t.turn): t.text for t in r.turns if not t.error} for r in runs if not r.crash]
    return all(a == answers[0] for a in answers[1:])


def summarize(runs: dict[str, list[Run]], args: argparse.Namespace) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    per_run: dict[str, list[Any]] = {}
    for name, rs in runs.items():
        payload[f"hit_fraction_{name}"] = rounded(median_of(rs, Run.hit_fraction))
        payload[f"ttft_p50_ms_{name}"] = rounded(median_of(rs, Run.ttft_p50_ms), 1)
        payload[f"ttft_p50_ms_first_turn_{name}"] = rounded(median_of(rs, lambda r: r.ttft_p50_ms(True)), 1)
        payload[f"load_imbalance_{name}"] = rounded(median_of(rs, Run.load_imbalance), 3)
        payload[f"wall_s_{name}"] = rounded(median_of(rs, lambda r: r.wall_s), 1)
        per_run[f"hit_fraction_{name}"] = [rounded(r.hit_fraction()) for r in rs]
        per_run[f"ttft_p50_ms_{name}"] = [rounded(r.ttft_p50_ms(), 1) for r in rs]
        per_run[f"served_{name}"] = ["/".join(map(str, r.served())) for r in rs]
    hit, single = payload["hit_fraction_prefix"], payload["hit_fraction_single_worker"]
    ttft, ttft_none = payload["ttft_p50_ms_prefix"], payload["ttft_p50_ms_none"]
    every = [r for rs in runs.values() for r in rs]
    first = [t.prompt_tokens for r in every for t in r.turns if t.turn == 0 and not t.error]
    last = [t.prompt_tokens for r in every for t in r.turns if t.turn == args.turns - 1 and not t.error]
    payload |= {
        "hit_fraction_prefix_over_single_worker": rounded(ratio(hit, single), 3),
        "ttft_p50_prefix_over_none": rounded(ratio(ttft, ttft_none), 3),
        "prompt_tokens_first_turn_mean": rounded(statistics.mean(first) if first else None, 1),
        "prompt_tokens_last_turn_mean": rounded(statistics.mean(last) if last else None, 1),
        "answers_identical": answers_identical(every),
        "failed_requests": sum(len(r.errors()) for r in every),
        "crashed": [r.crash for r in every if r.crash],
        "route_max_wait_ms": args.route_max_wait_ms,
        "sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens,
        "concurrency": args.concurrency, "think_ms": args.think_ms, "workers": args.workers,
        "threads_per_worker": 1,
        "kv_cache_memory_mb_per_worker": args.kv_cache_memory_mb, "runs": args.runs, "quick": args.quick,
        "per_run": per_run,
    }
    nan = float("nan")  # the limit when its reference side was not measured (the target: met null)
    payload["targets"] = {
        "hit_fraction_prefix": target(hit if single is not None else None, ">=",
                                      nan if single is None else round(TARGET_HIT_VS_SINGLE * single, 4)),
        "ttft_p50_ms_prefix": target(ttft if ttft_none is not None else None, "<=",
                                     nan if ttft_none is None else round(TARGET_TTFT_VS_NONE * ttft_none, 1)),
        "load_imbalance_prefix": target(payload["load_imbalance_prefix"], "<=", TARGET_IMBALANCE),
    }
    return payload


def print_table(p: dict[str, Any]) -> None:
    def cell(value: Any, spec: str = ".3f") -> str:
        return "-" if value is None else (f"{value:{spec}}" if isinstance(value, float) else str(value))

    def row(label: str, key: str, note: str = "", spec: str = ".3f") -> None:
        values = (p.get(f"{key}_{name}") for name in NAMES)
        print(f"{label:30}" + "".join(f"{cell(v, spec):>14}" for v in values) + f"  {note}")

    def verdict(name: str) -> str:
        t = p["targets"][name]
        return f"{t['target']}: {'met' if t['met'] else ('not measured' if t['met'] is None else 'NOT MET')}"

    later = "turn 2" if p["turns"] == 2 else f"turns 2-{p['turns']}"
    print(f"{'':30}{'prefix':>14}{'none':>14}{'1 worker':>14}  target")
    row(f"hit fraction, {later}", "hit_fraction",
        f"{TARGET_HIT_VS_SINGLE} x 1 worker, {verdict('hit_fraction_prefix')}")
    row(f"TTFT p50 ms, {later}", "ttft_p50_ms",
        f"{TARGET_TTFT_VS_NONE} x none, {verdict('ttft_p50_ms_prefix')}", ".0f")
    row("TTFT p50 ms, turn 1", "ttft_p50_ms_first_turn", spec=".0f")
    print(f"{'requests per worker (run 1)':30}" + "".join(
        f"{(p['per_run'][f'served_{name}'] or ['-'])[0]:>14}" for name in NAMES))
    row("load imbalance (most/fewest)", "load_imbalance", verdict("load_imbalance_prefix"), ".2f")
    row("wall s", "wall_s", spec=".1f")
    first = cell(p["prompt_tokens_first_turn_mean"], ".0f")
    last = cell(p["prompt_tokens_last_turn_mean"], ".0f")
    print(f"prompt tokens: turn 1 {first}, turn {p['turns']} {last} (means); {p['sessions']} sessions x "
          f"{p['turns']} turns, <= {p['max_tokens']} tokens, {p['concurrency']} at once; {p['runs']} run(s) "
          "per side, medians")
    print("greedy answers: " + ("identical in every configuration" if p["answers_identical"]
                                else "DIFFER between configurations (prompts of later turns differ too)"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {QUICK['sessions']} sessions of {QUICK['turns']} turns, "
                         f"{QUICK['max_tokens']} tokens, 1 run per side; never recorded")
    ap.add_argument("--runs", type=int,
                    help=f"runs of prefix and of none, alternating (default {DEFAULTS['runs']})")
    ap.add_argument("--sessions", type=int, help=f"chat sessions (default {DEFAULTS['sessions']})")
    ap.add_argument("--turns", type=int, help=f"turns per session (default {DEFAULTS['turns']})")
    ap.add_argument("--max-tokens", type=int,
                    help=f"greedy tokens per answer (default {DEFAULTS['max_tokens']})")
    ap.add_argument("--concurrency", type=int, default=8, help="sessions playing at once")
    # Back to back (0), the worker that just answered a session is often the first to look at
    # the queue when its next turn arrives, so --routing none keeps ~70% of the hits by luck
    # (2026-12-05, 2-core Xeon); a user reading the answer first is what spreads turns over
    # the workers in a real deployment.
    ap.add_argument("--think-ms", type=float, default=1000.0,
                    help="a user's pause between an answer and the next question (x 0.5..1.5)")
    ap.add_argument("--workers", type=int, default=4, help="workers of prefix and none (1 thread each)")
    ap.add_argument("--kv-cache-memory-mb", type=int, default=256,
                    help="KV pool per worker; the single worker gets --workers times as much")
    ap.add_argument("--route-max-wait-ms", type=int,
                    help="passed to the gateway with --routing prefix (default: the gateway's)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the children's logs (kept on a crash)")
    add_record_arg(ap)
    args = ap.parse_args(argv)
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else default)
    if min(args.runs, args.sessions, args.max_tokens, args.concurrency, args.workers,
           args.kv_cache_memory_mb) < 1:
        ap.error("--runs, --sessions, --max-tokens, --concurrency, --workers and --kv-cache-memory-mb "
                 "must be >= 1")
    if args.turns < 2:
        ap.error("--turns must be >= 2: the figures are over turns 2 and later")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the children as Ctrl-C does
    multi = {name: Setup(name, name, args.workers, args.kv_cache_memory_mb) for name in ("prefix", "none")}
    single = Setup("single_worker", "none", 1, args.workers * args.kv_cache_memory_mb)
    runs: dict[str, list[Run]] = {name: [] for name in NAMES}
    log_dir = Path(tempfile.mkdtemp(prefix="tokenrelay-routing-"))
    with EmbeddedRedis() as redis_server:
        for i in range(args.runs):
            for name in ("prefix", "none") if i % 2 == 0 else ("none", "prefix"):
                runs[name].append(run_setup(redis_server.url, multi[name], args, log_dir, i))
        runs["single_worker"].append(run_setup(redis_server.url, single, args, log_dir, 0))
    payload = summarize(runs, args)
    print_table(payload)
    for name, t in payload["targets"].items():
        if t["met"] is False:
            print(f"NOT MET: {name} = {t['value']} (target {t['target']})")
        elif t["met"] is None:
            print(f"NOT MEASURED: {name} (target {t['target']})")
    errors = [e for rs in runs.values() for r in rs for e in r.errors()]
    for error in errors[:10]:
        print(f"FAILED: {error}", file=sys.stderr)
    if payload["crashed"] or args.keep_logs:
        print(f"logs: {log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    smoke = "--quick smoke run" if args.quick else "a process crashed" if payload["crashed"] else None
    emit("routing", payload, args, smoke=smoke)
    return 2 if payload["crashed"] else 1 if errors else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: every process this bench started is stopped", file=sys.stderr)
        sys.exit(130)
