"""Request priorities: one stream per class, claimed highest first, shed lowest first, preempted
lowest first. A real Redis and real gRPC; engines are tiny fakes (the tokens do not matter)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import redis

from protos.convert import build_request
from protos.keys import Keys, PriorityClass
from protos.params import FinishReason, SamplingParams
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc
from tests.factories import make_stats
from tests.service import GatewayThread, WorkerThread, stub_for, wait_until, workers_ready
from tests.test_scheduler import make_scheduler, run
from worker.config import DEFAULT_MODEL_NAME
from worker.engine.outputs import Admitted, RequestOutput
from worker.engine.sequence import Sequence
from worker.engine.stopping import StoppingCriteria
from worker.engine.text_engine import EngineStats

HIGH, NORMAL, LOW = 5, 0, -3  # GenerateRequest.priority of each class


class SlowEngine:
    """Runs up to max_num_seqs requests, each `num_tokens` one-token steps of `step_s`."""

    def __init__(self, max_num_seqs: int = 1, num_tokens: int = 3, step_s: float = 0.03) -> None:
        self.max_num_seqs, self.num_tokens, self.step_s = max_num_seqs, num_tokens, step_s
        self.left: dict[str, int] = {}  # request key -> tokens still to generate
        self.aborted: set[str] = set()
        self.admitted: list[int] = []  # the priority of each admitted request, in order
        self._lock = threading.Lock()

    adapters: tuple[str, ...] = ()  # no LoRA adapters

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, **kwargs: Any) -> Admitted:
        with self._lock:
            self.left[request_id] = self.num_tokens
            self.admitted.append(params.priority)
        return Admitted(seed=0)

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        outputs = []
        for key in list(self.left):
            if key in self.aborted:
                del self.left[key]
                outputs.append(RequestOutput(key, finish_reason=FinishReason.ABORT))
                continue
            self.left[key] -= 1
            reason = FinishReason.LENGTH if self.left[key] == 0 else None
            if reason is not None:
                del self.left[key]
            outputs.append(RequestOutput(key, token_ids=[7], text="x", finish_reason=reason))
        return outputs

    def stats(self) -> EngineStats:
        return make_stats(model_name="slow", num_running=len(self.left), max_num_seqs=self.max_num_seqs,
                          max_model_len=512)


def request(priority: int, request_id: str = "") -> generate_pb2.GenerateRequest:
    return build_request("hi", request_id=request_id, max_tokens=3, priority=priority)


def server_info(stub: generate_pb2_grpc.TokenRelayStub) -> generate_pb2.ServerInfo:
    return stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)


def timed_call(stub: generate_pb2_grpc.TokenRelayStub, req: generate_pb2.GenerateRequest,
               ttfts: dict[str, float]) -> threading.Thread:
    """Stream `req` on a thread; ttfts[request_id] = seconds until its first chunk."""
    def go() -> None:
        sent = time.monotonic()
        for response in stub.Generate(req, timeout=60):
            if response.HasField("chunk") and req.request_id not in ttfts:
                ttfts[req.request_id] = time.monotonic() - sent
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def test_a_high_priority_request_is_claimed_before_the_queued_low_ones(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread]) -> None:
    engine = SlowEngine(max_num_seqs=1, num_tokens=3, step_s=0.05)  # ~0.15 s per request
    channel, stub = stub_for(make_gateway().target)
    start_worker(engine, claim_block_ms=50, claim_coalesce_ms=0)
    num_lows = 10
    ttfts: dict[str, float] = {}
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        calls = [timed_call(stub, request(LOW, f"low-{i}"), ttfts) for i in range(num_lows)]
        wait_until(lambda: server_info(stub).queue_depth >= num_lows - 2, timeout=10)  # a backlog
        calls.append(timed_call(stub, request(HIGH, "high"), ttfts))
        for call in calls:
            call.join(60)
    assert len(ttfts) == num_lows + 1
    # Claimed as soon as the running low request ended: at most one low one ran in between.
    assert engine.admitted.index(HIGH) <= 2, engine.admitted
    lows = [t for key, t in ttfts.items() if key.startswith("low-")]
    assert ttfts["high"] < statistics.median(lows) / 2, (ttfts["high"], sorted(lows))


def test_at_overload_the_low_class_is_refused_first_and_high_still_gets_in(
        make_gateway: Callable[..., GatewayThread]) -> None:
    """max_queue_depth 4: low calls are refused from 2 waiting, normal from 4, high from 6. No
    worker, so everything admitted stays queued."""
    gateway = make_gateway(max_queue_depth=4, depth_cache_ms=0, retry_pushback_ms=250)
    channel, stub = stub_for(gateway.target)
    open_calls: list[Any] = []

    def send(priority: int) -> str:
        """'queued' or the status the call ended with at once."""
        depth = server_info(stub).queue_depth
        call = stub.Generate(request(priority), timeout=30)
        open_calls.append(call)
        try:
            wait_until(lambda: call.done() or server_info(stub).queue_depth > depth, timeout=5)
        except AssertionError:
            return "stuck"
        if not call.done():
            return "queued"
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        if e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert ("grpc-retry-pushback-ms", "250") in (e.value.trailing_metadata() or ())
        return e.value.code().name

    with channel:
        outcomes = [(p, send(p)) for p in (LOW, LOW, LOW, NORMAL, NORMAL, LOW, NORMAL, HIGH, HIGH, HIGH)]
        info = server_info(stub)
        for call in open_calls:
            call.cancel()
    refused = "RESOURCE_EXHAUSTED"
    assert outcomes == [(LOW, "queued"), (LOW, "queued"), (LOW, refused), (NORMAL, "queued"),
                        (NORMAL, "queued"), (LOW, refused), (NORMAL, refused), (HIGH, "queued"),
                        (HIGH, "queued"), (HIGH, refused)]
    assert (info.queue_depth, info.max_queue_depth) == (6, 4)  # summed over the classes


def test_each_class_has_its_own_stream_of_the_model(
        make_gateway: Callable[..., GatewayThread], redis_url: str, prefix: str) -> None:
    keys, client = Keys(prefix, DEFAULT_MODEL_NAME), redis.Redis.from_url(redis_url)
    normal = f"{prefix}:model:{DEFAULT_MODEL_NAME}:requests"
    assert keys.request_streams == (f"{normal}:high", normal, f"{normal}:low")
    assert [PriorityClass.of(p) for p in (HIGH, 1, NORMAL, -1, LOW)] == \
        [PriorityClass.HIGH, PriorityClass.HIGH, PriorityClass.NORMAL, PriorityClass.LOW, PriorityClass.LOW]
    channel, stub = stub_for(make_gateway().target)
    calls = []
    with channel:
        for priority in (HIGH, LOW, LOW, NORMAL):
            calls.append(stub.Generate(request(priority), timeout=30))
        wait_until(lambda: server_info(stub).queue_depth == 4, timeout=5)
        lengths = [client.xlen(stream) for stream in keys.request_streams]
        for call in calls:
            call.cancel()
    assert lengths == [1, 1, 2]


def test_a_dead_workers_high_priority_entry_is_re_claimed_and_finished(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        redis_url: str, prefix: str) -> None:
    keys, client = Keys(prefix, DEFAULT_MODEL_NAME), redis.Redis.from_url(redis_url)
    high = keys.requests_of(PriorityClass.HIGH)
    channel, stub = stub_for(make_gateway(liveness_check_s=0.5, worker_heartbeat_ttl_s=0.5).target)
    with channel:
        responses: list[generate_pb2.GenerateResponse] = []
        caller = threading.Thread(target=lambda: responses.extend(stub.Generate(request(HIGH, "urgent"),
                                                                                timeout=30)), daemon=True)
        caller.start()
        wait_until(lambda: client.xlen(high) == 1, timeout=5)
        for stream in keys.request_streams:
            client.xgroup_create(stream, keys.group, id="0", mkstream=True)
        # A worker claimed it and died at once: registered (its first heartbeat does that before
        # its first claim), its heartbeat hash expired.
        client.zadd(keys.registry, {"ghost": 0})
        assert client.xreadgroup(keys.group, "ghost", {high: ">"}, count=1)
        engine = SlowEngine(num_tokens=4, step_s=0.01)
        start_worker(engine, claim_block_ms=50, claim_coalesce_ms=0, heartbeat_interval_s=0.1,
                     heartbeat_ttl_s=0.5)
        caller.join(20)
    assert [r.chunk.index for r in responses if r.HasField("chunk")] == [0, 1, 2, 3]
    assert responses[-1].final.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert engine.admitted == [HIGH]
    wait_until(lambda: client.xlen(high) == 0, timeout=5)  # acknowledged and deleted after its final
    assert client.xpending(high, keys.group)["pending"] == 0


def make_seq(request_id: str, prompt: list[int], priority: int) -> Sequence:
    params = SamplingParams(max_tokens=64, priority=priority)
    return Sequence(request_id, prompt, params, seed=0, stopping=StoppingCriteria(params, frozenset(), 64))


def test_out_of_blocks_the_scheduler_preempts_the_lowest_priority_first() -> None:
    s = make_scheduler(num_blocks=9, block_size=4)
    for i, (name, priority) in enumerate((("old-low", LOW), ("mid", NORMAL), ("new-high", HIGH))):
        s.add(make_seq(name, list(range(10 * i, 10 * i + 8)), priority))  # 2 blocks each
    run(s, s.schedule())  # all three prefilled: 9 tokens each, a 3rd block at the next step
    for _ in range(4):  # 9..12 tokens fit in 3 blocks, which take the last free ones
        out = s.schedule()
        assert not out.preempted
        run(s, out)
    out = s.schedule()  # 13 tokens: each needs a 4th block, and none is free
    # The newest (new-high) would go first without priorities; the lowest goes instead.
    assert [q.request_id for q in out.preempted] == ["old-low"]
    assert [q.request_id for q in out.decodes] == ["mid", "new-high"]
    assert s.waiting[0].request_id == "old-low"


def test_among_equal_priorities_the_newest_is_preempted() -> None:
    s = make_scheduler(num_blocks=9, block_size=4)
    for i, (name, priority) in enumerate((("old-low", LOW), ("mid-low", LOW), ("new-high", HIGH))):
        s.add(make_seq(name, list(range(10 * i, 10 * i + 8)), priority))
    run(s, s.schedule())
    for _ in range(4):
        run(s, s.schedule())
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["mid-low"]
    assert [q.request_id for q in out.decodes] == ["old-low", "new-high"]
