"""Chaos harness (`make chaos`): 2 gateways, 3 workers and Redis with AOF, killed and
restarted at random while clients stream seeded requests and resume on any error.

    python -m tests.chaos --minutes N [--seed S] [--json-out PATH] [--keep-logs]

A fault-free reference of the seeded requests comes first. Then, for N minutes, client
threads stream those bodies round-robin under fresh request_ids with `resumable_stream`
over both gateways, and every 2-6 s the fault loop SIGKILLs or SIGTERMs a worker or a
gateway, or SIGKILLs Redis (its AOF keeps what it acknowledged); what it stopped starts
again 1-3 s after it exited. Kinds come in shuffled rounds of all five, so each happens
within the first five faults. At most one worker and one gateway are down at a time
(down = not ready again yet), so a resume has somewhere to go; a restarted worker gets a
new worker id, as a process with the default host-pid-random id would. Then no more
faults: what is down comes back, in-flight streams get a bounded drain, and everything
stops (SIGTERM, then SIGKILL; Redis last), also on errors and Ctrl-C.

Prints a table, then as the last line one JSON object; exits 0 when lost,
duplicated_tokens, gaps and mismatches are all 0. Children log at INFO, one file per
process slot, in a temp dir that is kept (and named) when the run fails or --keep-logs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gateway.client import resumable_stream
from protos.convert import build_request
from protos.tokenrelay.v1 import generate_pb2
from tests.chaos_stack import STOP_TIMEOUT_S, Stack
from tests.service import stub_for

PROMPTS = ("a lighthouse", "a dragon who collects teacups", "the first snow", "a robot gardener",
           "a lost key", "the moon's day off", "a bakery at midnight", "two rival chess clubs",
           "a river that flows uphill", "an owl who cannot sleep", "a train to nowhere", "a tiny volcano")
FAULT_KINDS = ("worker_sigkill", "worker_sigterm", "gateway_sigkill", "gateway_sigterm", "redis_restart")
FAMILIES = {"worker": FAULT_KINDS[:2], "gateway": FAULT_KINDS[2:4], "redis": FAULT_KINDS[4:]}
BAD_COUNTS = ("lost", "duplicated_tokens", "gaps", "mismatches")  # all must be 0
TICK_S = 0.2  # how often the fault loop looks at its processes


@dataclass(frozen=True)
class ChaosConfig:
    minutes: float = 5.0
    seed: int = 0
    num_gateways: int = 2
    num_workers: int = 3
    num_clients: int = 4
    num_prompts: int = 12
    max_tokens: int = 24
    fault_interval_s: tuple[float, float] = (2.0, 6.0)
    restart_delay_s: tuple[float, float] = (1.0, 3.0)
    max_attempts: int = 60
    retry_delay_s: float = 0.25
    attempt_timeout_s: float = 20.0  # one try of a stream; then it resumes
    drain_s: float = 60.0  # in-flight streams get this long after the chaos phase
    ready_timeout_s: float = 180.0
    keep_logs: bool = False
    # GenerateRequest.stream_interval: > 1 streams chunks of several tokens, whose boundaries after
    # a resume need not be the reference's: the tokens are then compared in order, not by chunk
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.minutes <= 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if not 0 < self.num_prompts <= len(PROMPTS):
            raise ValueError(f"num_prompts must be in 1..{len(PROMPTS)}, got {self.num_prompts}")
        for name in ("num_gateways", "num_workers", "num_clients", "max_tokens", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def request(self, i: int, request_id: str) -> generate_pb2.GenerateRequest:
        return build_request(f"Tell me a story about {PROMPTS[i]}.", request_id=request_id,
                             max_tokens=self.max_tokens, temperature=0.8, seed=self.seed * 1000 + i,
                             ignore_eos=True, stream_interval=self.stream_interval)


class FaultInjector:
    """On the main thread: one fault every fault_interval_s; starts again what it stopped."""

    def __init__(self, stack: Stack, config: ChaosConfig, timeline: list[str], t0: float) -> None:
        self.stack, self.config, self.timeline, self.t0 = stack, config, timeline, t0
        self.rng = random.Random(config.seed)
        self.faults: Counter[str] = Counter()
        self.num_unexpected_exits = 0  # a child that exited without being told to
        self.round: list[str] = []
        self.redis_restart_at: float | None = None

    def log(self, what: str) -> None:
        self.timeline.append(f"{time.monotonic() - self.t0:7.2f}s {what}")

    def run(self, until: float) -> None:
        next_fault = time.monotonic() + self.rng.uniform(*self.config.fault_interval_s)
        while (now := time.monotonic()) < until:
            self.tick(now)
            if now >= next_fault:
                delay = self.config.fault_interval_s if self.inject() else (0.5, 0.5)
                next_fault = now + self.rng.uniform(*delay)
            time.sleep(TICK_S)

    def recover(self, timeout_s: float) -> bool:
        """No more faults: bring everything up again; False if it was not within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while (now := time.monotonic()) < deadline:
            self.tick(now)
            if self.redis_restart_at is None and all(c.state == "up" for c in self.stack.children):
                return True
            time.sleep(TICK_S)
        return False

    def is_down(self, family: str) -> bool:
        if family == "redis":
            return self.redis_restart_at is not None
        return any(c.state != "up" for c in self.stack.children if c.family == family)

    def inject(self) -> bool:
        """The first kind left in this round whose family has nothing down; False if none can go."""
        self.round = self.round or self.rng.sample(FAULT_KINDS, len(FAULT_KINDS))
        kind = next((k for k in self.round if not self.is_down(k.partition("_")[0])), None)
        if kind is None:
            return False
        self.round.remove(kind)
        self.faults[kind] += 1
        family, _, how = kind.partition("_")
        if family == "redis":
            self.stack.redis.kill()
            self.redis_restart_at = time.monotonic() + self.rng.uniform(*self.config.restart_delay_s)
            self.log("SIGKILL redis")
        else:
            victim = self.rng.choice([c for c in self.stack.children if c.family == family])
            victim.send(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
            self.log(f"{how.upper()} {victim.instance_id}")
        return True

    def tick(self, now: float) -> None:
        if self.redis_restart_at is not None and now >= self.redis_restart_at:
            self.stack.redis.start()
            self.redis_restart_at = None
            self.log("redis started")
        for c in self.stack.children:
            if c.state != "down" and c.exited():
                if c.state != "stopping":
                    self.num_unexpected_exits += 1
                    self.log(f"UNEXPECTED: {c.instance_id} exited by itself while {c.state}")
                self.log(f"{c.instance_id} exited ({c.proc and c.proc.returncode})")
                c.state, c.restart_at = "down", now + self.rng.uniform(*self.config.restart_delay_s)
            elif c.state == "stopping" and now > c.stop_deadline:
                self.log(f"{c.instance_id} still running {STOP_TIMEOUT_S:.0f}s after the signal: SIGKILL")
                c.send(signal.SIGKILL)
            elif c.state == "down" and now >= c.restart_at:
                c.start()
                self.log(f"start {c.instance_id}")
            elif c.state == "starting" and self.stack.is_ready(c):
                c.state = "up"
                self.log(f"{c.instance_id} ready")


@dataclass
class Stream:
    """What one client saw of one request."""

    request_id: str
    prompt_index: int
    started_s: float
    chunks: list[tuple[int, list[int], str]] = field(default_factory=list)  # (index, token_ids, text)
    final_text: str | None = None
    error: str | None = None  # how it ended without its final
    resumed_after: list[str] = field(default_factory=list)  # the error before each resume
    stalls: list[float] = field(default_factory=list)  # seconds before each response
    ended_s: float | None = None


class GiveUp(Exception):
    """Raised from on_resume once the drain is over: no more tries."""


class Clients:
    """num_clients threads, each streaming one request after the other until told to stop."""

    def __init__(self, stack: Stack, config: ChaosConfig, t0: float) -> None:
        self.stack, self.config, self.t0 = stack, config, t0
        self.streams: list[Stream] = []
        self.is_stopping = threading.Event()  # no new streams
        self.deadline = float("inf")  # streams unfinished by then give up at their next resume
        self._next = itertools.count()
        self._threads = [threading.Thread(target=self._loop, name=f"client-{i}", daemon=True)
                         for i in range(config.num_clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, deadline: float) -> None:
        self.deadline = deadline
        for t in self._threads:  # a try in flight at the deadline may still take its attempt timeout
            t.join(max(0.0, deadline - time.monotonic()) + self.config.attempt_timeout_s + 5)

    def _loop(self) -> None:
        while not self.is_stopping.is_set():
            n = next(self._next)
            stream = Stream(f"{self.stack.keys.prefix}-{n}", n % self.config.num_prompts,
                            time.monotonic() - self.t0)
            self.streams.append(stream)
            self._stream(stream)

    def _stream(self, stream: Stream) -> None:
        def on_resume(k: int, e: grpc.RpcError) -> None:
            stream.resumed_after.append(f"{e.code().name} at chunk {k}: {e.details()}")
            if time.monotonic() > self.deadline:
                raise GiveUp(f"unfinished after the drain ({self.config.drain_s:.0f}s)")

        request = self.config.request(stream.prompt_index, stream.request_id)
        last = time.monotonic()
        try:
            cfg = self.config
            for response in resumable_stream(self.stack.targets, request, max_attempts=cfg.max_attempts,
                                             retry_delay_s=cfg.retry_delay_s,
                                             attempt_timeout_s=cfg.attempt_timeout_s, on_resume=on_resume):
                now = time.monotonic()
                stream.stalls.append(now - last)
                last = now
                if response.HasField("chunk"):
                    c = response.chunk
                    stream.chunks.append((c.index, list(c.token_ids), c.text))
                else:
                    stream.final_text = response.final.text
        except grpc.RpcError as e:
            stream.error = f"{e.code().name}: {e.details()}"
        except GiveUp as e:
            stream.error = str(e)
        finally:
            stream.ended_s = round(time.monotonic() - self.t0, 1)


Reference = list[tuple[list[list[int]], str]]  # per prompt: each chunk's token ids, the final text


def make_reference(stack: Stack, config: ChaosConfig) -> Reference:
    def one(i: int) -> tuple[list[list[int]], str]:
        channel, stub = stub_for(stack.targets[i % len(stack.targets)])
        with channel:
            responses = list(stub.Generate(config.request(i, f"{stack.keys.prefix}-ref-{i}"), timeout=120))
        chunks = [r.chunk for r in responses if r.HasField("chunk")]
        if [c.index for c in chunks] != list(range(len(chunks))) or not responses[-1].HasField("final"):
            raise RuntimeError(f"the fault-free reference of prompt {i} is broken: {responses}")
        return [list(c.token_ids) for c in chunks], responses[-1].final.text

    with ThreadPoolExecutor(config.num_clients) as pool:
        return list(pool.map(one, range(config.num_prompts)))


def check(stream: Stream, reference: Reference, by_chunk: bool = True) -> dict[str, int]:
    """Duplicated tokens, gaps and mismatches (0 or 1) of one stream against its reference:
    chunk by chunk, or (by_chunk False: chunks of several tokens) its tokens in order."""
    want_ids, want_text = reference[stream.prompt_index]
    seen: set[int] = set()
    duplicated = gaps = wrong = 0
    expected = 0  # the next index
    got: list[int] = []
    for index, token_ids, _ in stream.chunks:
        if index in seen:
            duplicated += len(token_ids)
            continue
        seen.add(index)
        gaps += index != expected
        expected = max(expected, index + 1)
        got += token_ids
        wrong += by_chunk and (index >= len(want_ids) or token_ids != want_ids[index])
    want = [t for ids in want_ids for t in ids]
    wrong += not by_chunk and got != want[:len(got)]
    if stream.final_text is not None:
        # the final came before the last chunks
        gaps += expected < len(want_ids) if by_chunk else len(got) < len(want)
        wrong += stream.final_text != want_text or "".join(t for _, _, t in stream.chunks) != want_text
    return {"duplicated_tokens": duplicated, "gaps": gaps, "mismatches": int(wrong > 0)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values) or [0.0]
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def summarize(streams: list[Stream], reference: Reference, injector: FaultInjector,
              config: ChaosConfig) -> tuple[dict[str, Any], list[str]]:
    """The JSON report, and a line for every stream that went wrong."""
    totals: Counter[str] = Counter()
    failures: list[str] = []
    for s in streams:
        counts = check(s, reference, by_chunk=config.stream_interval == 1)
        totals.update(counts)
        is_done = s.final_text is not None and s.error is None
        totals["completed" if is_done else "lost"] += 1
        if not is_done or any(counts.values()):
            failures.append(f"{s.request_id} (prompt {s.prompt_index}, t={s.started_s:.1f}..{s.ended_s}s): "
                            f"{counts}, indexes {[c[0] for c in s.chunks]}, "
                            f"final {s.final_text is not None}, error {s.error}, "
                            f"resumed after {s.resumed_after}")
    stalls = [x for s in streams for x in s.stalls]
    report = {"requests": len(streams), "completed": totals["completed"], "lost": totals["lost"],
              "duplicated_tokens": totals["duplicated_tokens"], "gaps": totals["gaps"],
              "mismatches": totals["mismatches"], "resumes": sum(len(s.resumed_after) for s in streams),
              "stall_p50_s": percentile(stalls, 0.5), "stall_p99_s": percentile(stalls, 0.99),
              "stall_max_s": percentile(stalls, 1.0), "faults": {k: injector.faults[k] for k in FAULT_KINDS},
              "unexpected_exits": injector.num_unexpected_exits, "minutes": config.minutes,
              "seed": config.seed, "stream_interval": config.stream_interval}
    return report, failures


def run_chaos(config: ChaosConfig, work_dir: Path) -> tuple[dict[str, Any], list[str], list[str]]:
    """The whole run: (report, failed streams, timeline). Stops everything it started."""
    stack = Stack(config.num_gateways, config.num_workers, work_dir)
    timeline, started = [], time.monotonic()
    try:
        stack.start(config.ready_timeout_s)
        reference = make_reference(stack, config)
        t0 = time.monotonic()
        timeline.append(f"ready and reference done after {t0 - started:.1f}s; chaos starts at t=0")
        injector = FaultInjector(stack, config, timeline, t0)
        clients = Clients(stack, config, t0)
        clients.start()
        injector.run(until=t0 + config.minutes * 60)
        clients.is_stopping.set()
        injector.log("chaos over: no more faults or new streams")
        drain_deadline = time.monotonic() + config.drain_s
        if not injector.recover(config.drain_s):
            injector.log("not everything came back up")
        clients.join(drain_deadline)
        injector.log("drained")
        report, failures = summarize(list(clients.streams), reference, injector, config)
        return report, failures, timeline
    finally:
        stack.stop()
        (work_dir / "timeline.txt").write_text("".join(f"{line}\n" for line in timeline))


def print_table(report: dict[str, Any], failures: list[str], timeline: list[str]) -> None:
    print(f"chaos: {report['minutes']} min, seed {report['seed']}")
    for name in ("requests", "completed", *BAD_COUNTS, "resumes", "unexpected_exits"):
        print(f"  {name:<20} {report[name]}")
    print(f"  {'stall p50/p99/max':<20} {report['stall_p50_s']} / {report['stall_p99_s']} / "
          f"{report['stall_max_s']} s")
    print(f"  {'faults':<20} {', '.join(f'{k} {v}' for k, v in report['faults'].items())}")
    if failures or report["unexpected_exits"]:
        print("failed streams:", *failures[:20], "timeline:", *timeline, sep="\n  ")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0, help="length of the chaos phase (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seeds the fault schedule and the sampling")
    p.add_argument("--json-out", type=Path, help="also write the JSON line here")
    p.add_argument("--keep-logs", action="store_true", help="keep the logs of a clean run too")
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per chunk (default 1)")
    args = p.parse_args(argv)
    config = ChaosConfig(minutes=args.minutes, seed=args.seed, keep_logs=args.keep_logs,
                         stream_interval=args.stream_interval)
    work_dir = Path(tempfile.mkdtemp(prefix="tokenrelay-chaos-"))
    signal.signal(signal.SIGTERM, _interrupt)  # so the finally blocks stop the children
    try:
        report, failures, timeline = run_chaos(config, work_dir)
        print_table(report, failures, timeline)
    except Exception as e:  # the harness broke (a child never started, ...): still one JSON line
        traceback.print_exc()
        report = {"error": f"{type(e).__name__}: {e}", "minutes": config.minutes, "seed": config.seed}
    is_ok = "error" not in report and not any(report[k] for k in BAD_COUNTS)
    if is_ok and not config.keep_logs:
        shutil.rmtree(work_dir, ignore_errors=True)
    else:
        print(f"logs in {work_dir}")
    line = json.dumps(report)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line, flush=True)
    return 0 if is_ok else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
