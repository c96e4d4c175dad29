"""Gateway behaviour that needs no model: validation, health, reflection, relay rules."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from gateway.__main__ import loop_factory
from gateway.config import GatewayConfig
from gateway.errors import PUSHBACK_TRAILER, DataLoss, OutOfRange, QueueFull, Unavailable, WorkerError
from gateway.queue import Attached, EntryState, RequestQueue, connect
from gateway.redis_server import EmbeddedRedis, free_port
from gateway.relay import Follow, relay
from gateway.replies import RESYNC, TICK
from protos.convert import build_request
from protos.keys import RECORD_LEASE_S, LogField, Record
from protos.tokenrelay.v1 import generate_pb2, queue_pb2
from tests.factories import make_stats
from tests.service import GatewayProcess, GatewayThread, WorkerThread, stub_for, wait_until, workers_ready
from worker.config import WorkerConfig
from worker.engine.outputs import Admitted
from worker.engine.sim import SimConfig, SimEngine, sim_token_ids

NO_TORCH_MODULES = ["gateway.server", "gateway.process", "gateway.client", "gateway.cli", "gateway.launcher",
                    "gateway.__main__", "worker.io.consumer", "worker.config", "worker.__main__"]


def test_gateway_and_consumer_never_import_torch() -> None:
    code = ("import importlib, sys\n"
            f"for m in {NO_TORCH_MODULES!r}: importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("fields", [
    {"listen": "nohost"}, {"listen": "h:99999"}, {"redis_url": "http://x"}, {"max_queue_depth": 0},
    {"gateway_id": "a b"}, {"redis_timeout_s": 0}, {"key_prefix": ""},
])
def test_gateway_config_rejects_bad_values(fields: dict) -> None:
    with pytest.raises(ValueError):
        GatewayConfig(**fields)


def test_queue_full_error_carries_pushback_trailer() -> None:
    error = QueueFull(depth=9, limit=8, pushback_ms=250)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (PUSHBACK_TRAILER, "250") in error.trailers


def test_worker_error_codes_map_to_statuses() -> None:
    code = queue_pb2.ERROR_CODE_INVALID_ARGUMENT
    error = WorkerError(queue_pb2.RequestError(code=code, message="too long"))
    assert (error.code, str(error)) == (grpc.StatusCode.INVALID_ARGUMENT, "too long")


# -- relay rules, with a scripted call queue ---------------------------------------------------------

class FakeQueue:
    """Liveness answers in order (then RUNNING) and a request log, as RequestQueue gives them."""

    def __init__(self, states: list[EntryState] | None = None,
                 log: dict[int, queue_pb2.TokenEvent] | None = None) -> None:
        self.states, self.log = states or [], log or {}

    async def entry_state(self, entry_id: bytes, stream: str = "") -> EntryState:
        return self.states.pop(0) if self.states else EntryState.RUNNING

    async def read_log(self, request_id: str, first_seq: int = 0) -> dict[int, queue_pb2.TokenEvent]:
        """What RequestQueue.read_log gives: from first_seq on, or the final alone past the end."""
        finals = [seq for seq, e in self.log.items() if e.HasField("final") and seq < first_seq]
        return {s: e for s, e in self.log.items() if s >= first_seq or s in finals}


ENTRY = b"1-0"  # the attempt the relayed call follows


def chunk(seq: int, entry_id: bytes = ENTRY) -> queue_pb2.TokenEvent:
    return queue_pb2.TokenEvent(request_id="r", seq=seq, entry_id=entry_id,
                                chunk=generate_pb2.Chunk(index=seq, text=f"<{seq}>"))


def final(seq: int) -> queue_pb2.TokenEvent:
    return queue_pb2.TokenEvent(request_id="r", seq=seq, entry_id=ENTRY,
                                final=generate_pb2.Final(text="done"))


def error(code: int, entry_id: bytes = ENTRY) -> queue_pb2.TokenEvent:
    return queue_pb2.TokenEvent(request_id="r", entry_id=entry_id,
                                error=queue_pb2.RequestError(code=code, message="worker said no"))


def test_a_resync_does_not_cancel_the_move_of_an_unclaimed_routed_attempt() -> None:
    """A resubscription (Redis restarted) while a routed attempt waits for its worker says nothing
    of whether the worker claimed it: the move to the shared stream still happens at move_at (a
    RESYNC once cancelled it, and the call waited on a worker that had left)."""
    moved: list[tuple[str, bytes]] = []

    async def go() -> list[str]:
        calls: asyncio.Queue = asyncio.Queue()
        calls.put_nowait(RESYNC)

        async def move(stream: str, entry_id: bytes) -> tuple[bytes, str]:
            moved.append((stream, entry_id))
            calls.put_nowait(chunk(0))  # a worker of the shared stream runs it
            calls.put_nowait(final(1))
            return b"2-0", "shared"

        follow = Follow("r", ENTRY, 0, stream="routed", move=move, move_at=time.monotonic() + 0.2)
        responses = relay(follow, calls, FakeQueue(), read_log=False,  # type: ignore[arg-type]
                          liveness_check_s=1.0, max_outage_s=1.0)
        async with asyncio.timeout(5):
            return [r.chunk.text if r.HasField("chunk") else "final" async for r in responses]
    assert asyncio.run(go()) == ["<0>", "final"]
    assert moved == [("routed", ENTRY)]


def run_relay(items: list, queue: FakeQueue | None = None, *, liveness_s: float = 1.0, resume_from: int = 0,
              read_log: bool = False, next_attempt: Any = None) -> list[str]:
    async def go() -> list[str]:
        calls: asyncio.Queue = asyncio.Queue()
        for item in items:
            calls.put_nowait(item)

        async def tick() -> None:  # what ReplyRouter does for every idle call
            while True:
                await asyncio.sleep(liveness_s / 2)
                if calls.empty():
                    calls.put_nowait(TICK)

        ticker = asyncio.ensure_future(tick())
        follow = Follow("r", ENTRY, resume_from, next_attempt=next_attempt)
        responses = relay(follow, calls, queue or FakeQueue(), read_log=read_log,  # type: ignore[arg-type]
                          liveness_check_s=liveness_s, max_outage_s=1.0)
        try:
            return [r.chunk.text if r.HasField("chunk") else "final" async for r in responses]
        finally:
            ticker.cancel()
    return asyncio.run(go())


def test_relay_drops_duplicate_events() -> None:
    assert run_relay([chunk(0), chunk(1), chunk(0), chunk(1), chunk(2), final(3)]) == \
        ["<0>", "<1>", "<2>", "final"]


def test_relay_replays_the_log_then_follows_live_events_without_a_duplicate() -> None:
    log = {0: chunk(0), 1: chunk(1), 2: chunk(2)}
    assert run_relay([chunk(2), chunk(3), final(4)], FakeQueue(log=log), read_log=True) == \
        ["<0>", "<1>", "<2>", "<3>", "final"]


def test_relay_skips_the_chunks_a_resuming_caller_has() -> None:
    log = {0: chunk(0), 1: chunk(1), 2: chunk(2), 3: final(3)}
    assert run_relay([], FakeQueue(log=log), read_log=True, resume_from=2) == ["<2>", "final"]
    with pytest.raises(OutOfRange, match="past the end"):
        run_relay([], FakeQueue(log=log), read_log=True, resume_from=4)


def test_relay_fills_a_gap_from_the_log_or_fails_on_it() -> None:
    assert run_relay([chunk(0), chunk(2), final(3)], FakeQueue(log={1: chunk(1)})) == \
        ["<0>", "<1>", "<2>", "final"]
    with pytest.raises(DataLoss, match="lost token events 1..1"):
        run_relay([chunk(0), chunk(2)])


def test_relay_rereads_the_log_after_a_resubscription() -> None:
    log = {0: chunk(0), 1: chunk(1)}  # published while the gateway was not subscribed
    assert run_relay([RESYNC, chunk(2), final(3)], FakeQueue(log=log)) == ["<0>", "<1>", "<2>", "final"]


def test_relay_raises_its_attempts_error_and_ignores_other_attempts() -> None:
    other = error(queue_pb2.ERROR_CODE_INTERNAL, entry_id=b"0-1")
    with pytest.raises(WorkerError) as e:
        run_relay([chunk(0), other, chunk(1), error(queue_pb2.ERROR_CODE_INVALID_ARGUMENT)])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_an_earlier_callers_deadline_or_a_vanished_entry_starts_the_next_attempt() -> None:
    started: list[bytes] = []

    async def next_attempt(ended: bytes) -> tuple[bytes, str]:
        started.append(ended)
        return b"2-0", ""

    deadline = error(queue_pb2.ERROR_CODE_DEADLINE_EXCEEDED)
    later = queue_pb2.TokenEvent(request_id="r", seq=1, entry_id=b"2-0", chunk=generate_pb2.Chunk(index=1))
    assert run_relay([chunk(0), deadline, later, final(2)], next_attempt=next_attempt) == ["<0>", "", "final"]
    assert started == [ENTRY]
    # The entry left the stream without a final (abandoned while parked): the next attempt
    # resumes, and what it logs reaches the call.
    gone = FakeQueue([EntryState.GONE, EntryState.GONE])

    async def resume_attempt(ended: bytes) -> tuple[bytes, str]:
        started.append(ended)
        gone.log = {1: chunk(1, entry_id=b"3-0"), 2: final(2)}
        return b"3-0", ""

    relayed = run_relay([chunk(0)], gone, liveness_s=0.02, next_attempt=resume_attempt)
    assert relayed == ["<0>", "<1>", "final"]
    assert started == [ENTRY, ENTRY]


def test_relay_gives_up_after_too_many_attempts() -> None:
    async def next_attempt(ended: bytes) -> tuple[bytes, str]:
        return ended, ""

    start = time.monotonic()
    with pytest.raises(Unavailable, match="left the queue without an answer"):
        run_relay([chunk(0)], FakeQueue([EntryState.GONE] * 20), liveness_s=0.02, next_attempt=next_attempt)
    assert time.monotonic() - start < 1


def test_relay_keeps_waiting_while_queued_running_or_waiting_to_be_resumed() -> None:
    # ORPHANED: its worker died; a sweep queues it again, another worker resumes it (protos/keys.py)
    states = [EntryState.QUEUED, EntryState.RUNNING, EntryState.ORPHANED, EntryState.ORPHANED,
              EntryState.QUEUED, EntryState.GONE, EntryState.GONE]
    with pytest.raises(Unavailable, match="left the queue"):
        run_relay([], FakeQueue(states), liveness_s=0.02)


# -- a real gateway, no workers ---------------------------------------------------------------------

def test_reflection_is_off_unless_asked_for(make_gateway: Callable[..., GatewayThread]) -> None:
    channel, _ = stub_for(make_gateway().target)
    with channel, pytest.raises(grpc.RpcError) as e:
        ProtoReflectionDescriptorDatabase(channel).get_services()
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_health_and_reflection(make_gateway: Callable[..., GatewayThread]) -> None:
    gateway = make_gateway(enable_reflection=True)
    channel, _ = stub_for(gateway.target)
    with channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "tokenrelay.v1.TokenRelay" in services and "grpc.health.v1.Health" in services


def test_invalid_request_is_rejected_by_the_gateway_alone(make_gateway: Callable[..., GatewayThread]) -> None:
    channel, stub = stub_for(make_gateway().target)  # no worker: the gateway answers alone
    with channel, pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(build_request("x", top_p=2.0), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.top_p" in (e.value.details() or "")


@pytest.mark.parametrize("method", ["Generate", "GetServerInfo"])
def test_bytes_that_are_no_request_are_invalid_argument(make_gateway: Callable[..., GatewayThread],
                                                        method: str) -> None:
    channel, _ = stub_for(make_gateway().target)
    garbage = b"\xff\xff\xff\xff\x0f not a protobuf"
    with channel:
        call = (channel.unary_stream if method == "Generate" else channel.unary_unary)(
            f"/tokenrelay.v1.TokenRelay/{method}")  # no serializer: the bytes go as they are
        with pytest.raises(grpc.RpcError) as e:
            result = call(garbage, timeout=5)
            list(result) if method == "Generate" else result
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid tokenrelay.v1." in (e.value.details() or "")


def test_redis_unreachable_from_the_start_is_unavailable_not_a_hang(prefix: str) -> None:
    config = GatewayConfig(listen="127.0.0.1:0", redis_url=f"redis://127.0.0.1:{free_port()}/0",
                           key_prefix=prefix, redis_timeout_s=0.5)
    gateway = GatewayThread(config)
    gateway.start()
    try:
        channel, stub = stub_for(gateway.target)
        with channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(build_request("hi"), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - start < 1
    finally:
        gateway.stop()


def test_a_full_redis_is_resource_exhausted_naming_its_memory(prefix: str) -> None:
    """noeviction: Redis refuses the enqueue (OOM) and the caller is told so, not "unreachable"."""
    with EmbeddedRedis(maxmemory="1") as server:  # below what any Redis uses by itself
        gateway = GatewayThread(GatewayConfig(listen="127.0.0.1:0", redis_url=server.url,
                                              key_prefix=prefix, models=("m",))).start()
        try:
            channel, stub = stub_for(gateway.target)
            with channel, pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(build_request("hi"), timeout=5))
        finally:
            gateway.stop()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "maxmemory" in (e.value.details() or "")


class IdleEngine:
    """An engine with nothing to run and fixed stats: enough for a worker to heart-beat."""

    def __init__(self, **stats: object) -> None:
        self._stats = SimpleNamespace(**stats)

    adapters: tuple[str, ...] = ()  # no LoRA adapters

    def add_request(self, *args: object, **kwargs: object) -> Admitted:
        raise AssertionError("nothing is enqueued in this test")

    def abort(self, request_id: str) -> None:
        pass

    def step(self) -> list:
        return []

    def has_unfinished(self) -> bool:
        return False

    def stats(self) -> SimpleNamespace:
        return self._stats


def idle_stats(**overrides: object) -> dict[str, object]:
    # num_waiting=0: with nothing to step, a waiting request would make the claim loop spin.
    defaults = dict(model_name="tiny", weights="Q4_1 weights, avx2 kernels", num_blocks=640,
                    num_free_blocks=640, max_model_len=512)
    return dataclasses.asdict(make_stats(**(defaults | overrides)))


@contextlib.contextmanager
def gateway_with_idle_worker(make_gateway: Callable[..., GatewayThread], redis_url: str, prefix: str,
                             stats: dict[str, object]) -> Iterator[Any]:
    """A gateway's stub once a worker heart-beating these stats has joined (stopped afterwards)."""
    worker = WorkerThread(IdleEngine(**stats), WorkerConfig(redis_url=redis_url, key_prefix=prefix,
                                                             worker_id="w1", claim_block_ms=50,
                                                             served_model_name="tiny")).start()
    try:
        channel, stub = stub_for(make_gateway(models=()).target)  # "tiny" alone is served
        with channel:
            wait_until(workers_ready(stub, 1), timeout=10)
            yield stub
    finally:
        worker.stop()


def test_server_info_shows_every_heartbeat_field_of_a_worker(
        make_gateway: Callable[..., GatewayThread], redis_url: str, prefix: str) -> None:
    stats = idle_stats(num_running=3, num_free_blocks=600, kv_cache_usage=0.0625,
                       num_prefix_cache_hit_tokens=96, num_prefix_cache_query_tokens=400, num_preemptions=1,
                       num_spec_draft_tokens=50, num_spec_accepted_tokens=31)
    with gateway_with_idle_worker(make_gateway, redis_url, prefix, stats) as stub:
        info = stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5).workers[0]
    reported = generate_pb2.WorkerInfo.DESCRIPTOR.fields_by_name  # the per-step counts are not
    expected = {k: v for k, v in stats.items() if k != "model_name" and k in reported}
    assert len(expected) == 14 and {k: getattr(info, k) for k in expected} == expected
    assert (info.worker_id, info.model, info.num_finished) == ("w1", "tiny", 0)  # its --served-model-name
    assert abs(info.heartbeat_unix - time.time()) < 10


def test_max_tokens_no_live_worker_can_hold_is_refused_by_the_gateway(
        make_gateway: Callable[..., GatewayThread], redis_url: str, prefix: str) -> None:
    # the largest sequence this worker holds: min(max_model_len 512, 20 blocks x 16 = 320 tokens)
    stats = idle_stats(num_blocks=20, num_free_blocks=20)
    with gateway_with_idle_worker(make_gateway, redis_url, prefix, stats) as stub, \
            pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(build_request("hi", max_tokens=320), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = e.value.details() or ""
    assert "stopping.max_tokens (320)" in details and "holds 320 tokens" in details


def test_entry_state_follows_a_request_through_redis(redis_url: str, prefix: str) -> None:
    """queued -> claimed by a live worker -> its worker died -> finished (acked and deleted)."""
    config = GatewayConfig(listen="127.0.0.1:0", redis_url=redis_url, key_prefix=prefix)
    keys = config.keys.for_model("m")
    sync = redis.Redis.from_url(redis_url)

    async def go() -> list[EntryState]:
        client = connect(config)
        queue = RequestQueue(client, config)
        states = []
        request = queue_pb2.QueuedRequest(request_id="r", request=generate_pb2.GenerateRequest(model="m"))
        found = await queue.attach(request, "d", may_create=True)
        entry_id, stream = found.entry_id, keys.requests
        assert found.stream == stream
        sync.xgroup_create(keys.requests, keys.group, id="0")
        states.append(await queue.entry_state(entry_id, stream))
        sync.xreadgroup(keys.group, "w1", {keys.requests: ">"}, count=1)
        sync.zadd(keys.registry, {"w1": (time.time() + 60) * 1000})  # alive in the registry
        states.append(await queue.entry_state(entry_id, stream))
        assert await queue.read_depth(["m"]) == (0, 1)
        assert await queue.read_depth(["other"]) == (0, 0)
        sync.zadd(keys.registry, {"w1": (time.time() - 1) * 1000})  # its heartbeat expired
        states.append(await queue.entry_state(entry_id, stream))
        sync.xack(keys.requests, keys.group, entry_id)
        sync.xdel(keys.requests, entry_id)
        states.append(await queue.entry_state(entry_id, stream))
        await client.aclose()
        return states

    try:
        assert asyncio.run(go()) == [EntryState.QUEUED, EntryState.RUNNING, EntryState.ORPHANED,
                                     EntryState.GONE]
    finally:
        sync.close()


def test_attach_creates_finds_or_refuses_a_request_record(redis_url: str, prefix: str) -> None:
    """The ATTACH script: one generation per request id, new attempts only after one ended."""
    config = GatewayConfig(listen="127.0.0.1:0", redis_url=redis_url, key_prefix=prefix)
    keys, sync = config.keys.for_model("m"), redis.Redis.from_url(redis_url)
    queued = queue_pb2.QueuedRequest(request_id="r", request=build_request("Hi", seed=7))
    queued.request.model = "m"

    async def go() -> list[tuple[str, int | None]]:
        client = connect(config)
        queue = RequestQueue(client, config)
        seen = []
        async def attach(digest: str = "d1", **kw: Any) -> Attached:
            found = await queue.attach(queued, digest, **kw)
            seen.append((found.state, found.seed))
            return found
        assert (await attach(may_create=False)).state == "unknown"  # nothing created
        first = await attach(may_create=True)
        assert (await attach(may_create=True)).entry_id == first.entry_id  # live: the same attempt
        await attach("d2", may_create=True)  # another body under the same id
        sync.xdel(keys.requests, first.entry_id)  # the attempt ended without a final
        await attach(may_create=True)  # ended: nothing started without `expect`
        second = await attach(may_create=False, expect=first.entry_id)
        assert second.entry_id != first.entry_id and sync.xlen(keys.requests) == 1
        sync.xdel(keys.requests, second.entry_id)
        assert (await attach(may_create=False, expect=first.entry_id)).state == "ended"  # lost the race
        sync.hset(keys.record("r"), Record.LOG, keys.log("w"))  # a gateway saw w hold it (VERIFY) ...
        await attach(may_create=True)  # ... and w has not finished it: it ended
        sync.hset(keys.log("w"), "r" + LogField.FINAL, "3")
        await attach(may_create=True)
        await client.aclose()
        return seen

    try:
        assert asyncio.run(go()) == [("unknown", None), ("created", 7), ("live", 7), ("mismatch", None),
                                     ("ended", 7), ("created", 7), ("ended", 7), ("ended", 7),
                                     ("finished", None)]
        assert 0 < sync.ttl(keys.record("r")) <= RECORD_LEASE_S
    finally:
        sync.close()


# -- the event loop -----------------------------------------------------------------------------------

@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_gateway_streams_on_either_event_loop(redis_url: str, prefix: str, event_loop: str,
                                                tmp_path: Path, start_worker: Callable[..., WorkerThread],
                                                ) -> None:
    start_worker(SimEngine(SimConfig(step_ms=1.0, ms_per_token=0.0), max_num_seqs=4))
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        gateway = GatewayProcess(redis_url, prefix, "--event-loop", event_loop, "--log-level", "INFO",
                                 log=out)
    try:
        gateway.wait_serving()
        channel, stub = stub_for(gateway.target)
        with channel:
            wait_until(workers_ready(stub, 1), timeout=10)
            responses = list(stub.Generate(build_request("hi", max_tokens=8, seed=3), timeout=30))
    finally:
        gateway.proc.terminate()
        gateway.proc.wait(timeout=30)
    assert [t for r in responses[:-1] for t in r.chunk.token_ids] == sim_token_ids(3, 0, 8)
    assert f"event loop: {event_loop}" in log.read_text()


def test_the_event_loop_flag_is_checked() -> None:
    assert loop_factory("asyncio") is None
    assert loop_factory("uvloop") is not None and loop_factory("auto") is not None  # uvloop is installed
    with pytest.raises(ValueError, match="event_loop must be one of auto, uvloop, asyncio"):
        GatewayConfig(event_loop="trio")
