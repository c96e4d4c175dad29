"""Streams that survive: resume by request_id on any gateway, idempotent resends, parked
requests, a gateway SIGKILL and Redis restarts (issue 13), over real Redis and gRPC."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
import redis

from gateway.redis_server import EmbeddedRedis
from protos.convert import build_request
from protos.keys import Keys
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc
from tests.service import GatewayProcess, GatewayThread, WorkerThread, stub_for, wait_until, workers_ready
from worker.config import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow

Responses = list[generate_pb2.GenerateResponse]


def story(request_id: str, max_tokens: int = 40, **overrides: object) -> generate_pb2.GenerateRequest:
    params = {"max_tokens": max_tokens, "temperature": 0.8, "seed": 11, "ignore_eos": True, **overrides}
    return build_request("Tell me a story about a lighthouse.", request_id=request_id, **params)


def resumed(request: generate_pb2.GenerateRequest, k: int) -> generate_pb2.GenerateRequest:
    again = generate_pb2.GenerateRequest()
    again.CopyFrom(request)
    again.resume_from_index = k
    return again


def chunks(responses: Responses) -> list[generate_pb2.Chunk]:
    return [r.chunk for r in responses if r.HasField("chunk")]


def first_chunks(target: str, request: generate_pb2.GenerateRequest, n: int) -> Responses:
    """The first n responses of a call, then the connection breaks (the client cancels)."""
    with grpc.insecure_channel(target) as channel:
        call = generate_pb2_grpc.TokenRelayStub(channel).Generate(request, timeout=120)
        first = [next(call) for _ in range(n)]
        call.cancel()
    return first


def generate(target: str, request: generate_pb2.GenerateRequest) -> Responses:
    with grpc.insecure_channel(target) as channel:
        return list(generate_pb2_grpc.TokenRelayStub(channel).Generate(request, timeout=120))


def info(stub: generate_pb2_grpc.TokenRelayStub) -> generate_pb2.WorkerInfo:
    return stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5).workers[0]


def assert_same_stream(first: Responses, rest: Responses, reference: Responses) -> None:
    """first + rest is the reference stream: every chunk once, in order, the same tokens."""
    got = chunks(first) + chunks(rest)
    assert [c.index for c in got] == list(range(len(chunks(reference))))
    assert [list(c.token_ids) for c in got] == [list(c.token_ids) for c in chunks(reference)]
    assert rest[-1].final.text == reference[-1].final.text == "".join(c.text for c in got)
    assert rest[-1].final.usage.seed == reference[-1].final.usage.seed


@pytest.fixture
def reference(make_gateway: Callable[..., GatewayThread],
              make_worker: Callable[..., WorkerThread]) -> tuple[GatewayThread, WorkerThread, Responses]:
    """A gateway, a worker, and the fault-free answer to story("reference")."""
    gateway, worker = make_gateway(), make_worker(reattach_grace_s=30)
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        return gateway, worker, list(stub.Generate(story("reference"), timeout=120))


def test_a_broken_stream_resumes_at_chunk_k_on_the_same_or_another_gateway(
        reference: tuple[GatewayThread, WorkerThread, Responses],
        make_gateway: Callable[..., GatewayThread]) -> None:
    gateway, worker, ref = reference
    other = make_gateway()
    channel, stub = stub_for(gateway.target)
    for target, request_id in ((gateway.target, "same-gateway"), (other.target, "other-gateway")):
        request = story(request_id)
        first = first_chunks(gateway.target, request, 25)
        wait_until(lambda: info(stub).num_parked == 1, timeout=5)  # nobody follows it: parked
        hits_before = info(stub).num_prefix_cache_hit_tokens
        rest = generate(target, resumed(request, 25))
        assert_same_stream(first, rest, ref)
        assert rest[0].chunk.index == 25
        assert info(stub).num_parked == 0
        # Re-admitted from its cached blocks (prompt + 25 tokens: 2 full blocks), not
        # computed again from scratch; the heartbeat carries the count within a second.
        hit = lambda before=hits_before: info(stub).num_prefix_cache_hit_tokens - before >= 32  # noqa: E731
        wait_until(hit, timeout=2)
    channel.close()


def test_a_cancel_then_an_immediate_resend_streams_the_whole_answer_once(
        reference: tuple[GatewayThread, WorkerThread, Responses]) -> None:
    gateway, _, ref = reference
    request = story("retried-call")
    channel, stub = stub_for(gateway.target)
    with channel:
        call = stub.Generate(request, timeout=120)
        seen = [next(call) for _ in range(5)]
        call.cancel()
        again = list(stub.Generate(request, timeout=120))  # no resume_from_index: from chunk 0
    assert [c.text for c in chunks(again)[:5]] == [r.chunk.text for r in seen]
    assert_same_stream([], again, ref)


def test_a_finished_request_is_answered_again_without_generating(
        reference: tuple[GatewayThread, WorkerThread, Responses],
        make_gateway: Callable[..., GatewayThread]) -> None:
    gateway, worker, ref = reference
    channel, stub = stub_for(make_gateway().target)
    with channel:
        # the reference's finish reaches the heartbeat with the worker's next round: wait for it
        finished_before = wait_until(lambda: info(stub).num_finished, timeout=5)
        again = list(stub.Generate(story("reference"), timeout=30))
        tail = list(stub.Generate(resumed(story("reference"), 30), timeout=30))
        assert info(stub).num_finished == finished_before  # replayed from the record
    assert again == ref
    assert [c.index for c in chunks(tail)] == list(range(30, 40)) and tail[-1] == ref[-1]
    with channel, pytest.raises(grpc.RpcError) as e:
        list(stub_for(gateway.target)[1].Generate(resumed(story("reference"), 41), timeout=30))
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_another_body_under_a_known_id_and_an_unknown_id_to_resume_are_refused(
        reference: tuple[GatewayThread, WorkerThread, Responses]) -> None:
    gateway, _, _ = reference
    channel, stub = stub_for(gateway.target)
    with channel:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(story("reference", max_tokens=5), timeout=10))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "another body" in (e.value.details() or "")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(resumed(story("never-sent"), 3), timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "not known" in (e.value.details() or "")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(resumed(build_request("no id", max_tokens=3), 3), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_request_parked_past_the_grace_is_abandoned_and_a_later_resume_continues_it(
        make_gateway: Callable[..., GatewayThread], make_worker: Callable[..., WorkerThread]) -> None:
    gateway, _ = make_gateway(), make_worker(reattach_grace_s=0.5)
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        ref = list(stub.Generate(story("ref2", max_tokens=24), timeout=120))
        request = story("abandoned", max_tokens=24)
        call = stub.Generate(request, timeout=120)
        first = [next(call) for _ in range(6)]
        call.cancel()
        wait_until(lambda: info(stub).num_parked == 1, timeout=15)  # a loaded CI host is slow
        wait_until(lambda: info(stub).num_parked == 0 and info(stub).num_running == 0, timeout=5)
        rest = list(stub.Generate(resumed(request, 6), timeout=120))  # a new attempt from its progress
    assert_same_stream(first, rest, ref)


def test_a_stream_resumes_through_another_gateway_after_its_gateway_is_killed(
        redis_url: str, prefix: str, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread], monkeypatch: pytest.MonkeyPatch) -> None:
    # Callers counted every 50 ms, not every second: on a fast host the remaining ~50 tokens
    # took less than a second, and the request finished before the worker noticed it was orphaned.
    monkeypatch.setattr("worker.io.parking.FOLLOW_CHECK_S", 0.05)
    survivor, _ = make_gateway(), make_worker()
    doomed = GatewayProcess(redis_url, prefix).wait_serving()
    channel, stub = stub_for(survivor.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        ref = list(stub.Generate(story("ref3", max_tokens=60), timeout=120))
        request = story("orphan", max_tokens=60)
        with grpc.insecure_channel(doomed.target) as doomed_channel:
            call = generate_pb2_grpc.TokenRelayStub(doomed_channel).Generate(request, timeout=120)
            first = [next(call) for _ in range(8)]
            doomed.kill()  # SIGKILL: no abort hint; the worker's next PUBLISH reaches nobody
            with pytest.raises(grpc.RpcError):
                list(call)
        wait_until(lambda: info(stub).num_parked == 1, timeout=15)
        rest = list(stub.Generate(resumed(request, len(first)), timeout=120))
    assert_same_stream(first, rest, ref)


@pytest.fixture
def aof_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A Redis of the test's own with its AOF in a directory that outlives a restart."""
    with EmbeddedRedis(data_dir=tmp_path_factory.mktemp("aof")) as server:
        yield server


def test_in_flight_calls_resume_across_a_redis_restart_with_aof(
        aof_redis: EmbeddedRedis, prefix: str, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    gateway = make_gateway(redis_url=aof_redis.url, redis_timeout_s=1.0)
    make_worker(redis_url=aof_redis.url, max_backoff_s=0.2)
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        ref = list(stub.Generate(story("ref4", max_tokens=80), timeout=120))
        call = stub.Generate(story("through-restart", max_tokens=80), timeout=120)
        first = [next(call) for _ in range(5)]
        aof_redis.restart()  # the AOF is fsynced every second; the call waits for Redis
        rest = list(call)
    assert_same_stream(first, rest, ref)
    client = redis.Redis.from_url(aof_redis.url)
    try:
        assert client.xlen(Keys(prefix, DEFAULT_MODEL_NAME).requests) == 0
    finally:
        client.close()


def test_a_resend_while_the_request_is_still_queued_attaches_to_it(
        redis_url: str, prefix: str, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    first_gateway, second_gateway = make_gateway(), make_gateway()
    request = story("queued", max_tokens=8)
    with grpc.insecure_channel(first_gateway.target) as channel:
        call = generate_pb2_grpc.TokenRelayStub(channel).Generate(request, timeout=120)
        client = redis.Redis.from_url(redis_url)
        try:
            stream = Keys(prefix, DEFAULT_MODEL_NAME).requests
            wait_until(lambda: client.xlen(stream) == 1, timeout=5)  # no worker yet
            call.cancel()
            with grpc.insecure_channel(second_gateway.target) as other:
                resend = generate_pb2_grpc.TokenRelayStub(other).Generate(request, timeout=120)
                make_worker()
                answer = list(resend)
            assert client.xlen(Keys(prefix, DEFAULT_MODEL_NAME).requests) == 0
        finally:
            client.close()
    assert [c.index for c in chunks(answer)] == list(range(8)) and answer[-1].HasField("final")
