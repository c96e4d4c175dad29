"""Gateway behaviour that needs no model: validation, health, reflection, the queue's records and
entry states, the event loop flag (the relay's rules: tests/test_relay.py)."""

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
from gateway.errors import PUSHBACK_TRAILER, QueueFull, WorkerError
from gateway.queue import Attached, EntryState, RequestQueue, connect
from gateway.redis_server import EmbeddedRedis, free_port
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
