"""What happens when things go wrong: cancellation, overload, Redis going away."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import PUSHBACK_TRAILER
from gateway.redis_server import EmbeddedRedis
from protos.convert import build_request
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc
from tests.service import GatewayThread, WorkerThread, stub_for, wait_until, workers_ready

pytestmark = pytest.mark.slow


def server_info(stub: generate_pb2_grpc.TokenRelayStub) -> generate_pb2.ServerInfo:
    return stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)


def long_request(**overrides: object) -> generate_pb2.GenerateRequest:
    params = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True, **overrides}
    return build_request("Tell me a very long story about a dragon.", **params)


def test_client_cancel_frees_the_worker_slot_within_a_second(
        make_gateway: Callable[..., GatewayThread], make_worker: Callable[..., WorkerThread]) -> None:
    gateway, worker = make_gateway(), make_worker()
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        stream = stub.Generate(long_request(), timeout=120)
        next(stream), next(stream)  # generating
        wait_until(lambda: server_info(stub).workers[0].num_running == 1, timeout=5)
        stream.cancel()
        cancelled_at = time.monotonic()
        info = wait_until(lambda: (i := server_info(stub).workers[0]).num_running == 0 and i, timeout=1.0)
        # Parked for a resume; its blocks are free again (its cached prefix counts as free).
        assert info.num_parked == 1
        assert info.kv_cache_usage == 0 and info.num_free_blocks == info.num_blocks > 0
        assert time.monotonic() - cancelled_at < 1.0
        assert not worker.consumer.engine.has_unfinished()


def test_a_retry_under_the_id_of_a_cancelled_call_streams_only_its_own_tokens(
        make_gateway: Callable[..., GatewayThread], make_worker: Callable[..., WorkerThread]) -> None:
    """Cancel after 5 chunks and send the same request again at once: the retry attaches to the
    same generation and streams it from chunk 0, without a gap or a duplicate."""
    gateway, _ = make_gateway(), make_worker()
    channel, stub = stub_for(gateway.target)
    request = long_request(max_tokens=40, request_id="retried-call")
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        first = stub.Generate(request, timeout=120)
        seen = [next(first) for _ in range(5)]
        first.cancel()
        retry = list(stub.Generate(request, timeout=120))
    chunks = [r.chunk for r in retry if r.HasField("chunk")]
    assert [c.index for c in chunks] == list(range(len(chunks)))  # no gap, nothing of the first attempt
    assert [c.text for c in chunks[:5]] == [r.chunk.text for r in seen]  # greedy: the same beginning
    final = retry[-1].final
    assert final.usage.completion_tokens == 40 and final.text == "".join(c.text for c in chunks)


def test_deadline_passed_mid_stream_aborts_the_request(
        make_gateway: Callable[..., GatewayThread], make_worker: Callable[..., WorkerThread]) -> None:
    gateway, _ = make_gateway(), make_worker()
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(long_request(), timeout=1.5))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: server_info(stub).workers[0].num_running == 0, timeout=2)


def test_queue_over_the_limit_is_shed_with_pushback_while_admitted_requests_complete(
        make_gateway: Callable[..., GatewayThread], make_worker: Callable[..., WorkerThread]) -> None:
    gateway = make_gateway(max_queue_depth=2, retry_pushback_ms=250)
    channel, stub = stub_for(gateway.target)
    with channel:
        # No worker yet, so the two admitted requests stay queued.
        admitted = [stub.Generate(build_request(f"Say {i}.", max_tokens=4, temperature=0.0), timeout=120)
                    for i in range(2)]
        wait_until(lambda: server_info(stub).queue_depth == 2, timeout=5)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(build_request("One too many.", max_tokens=4), timeout=10))
        assert time.monotonic() - start < 0.5
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (PUSHBACK_TRAILER, "250") in tuple(e.value.trailing_metadata() or ())
        make_worker()
        for call in admitted:
            assert list(call)[-1].HasField("final")
        assert server_info(stub).queue_depth == 0


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    """A Redis of the test's own, since the test stops it; requested first, so torn down last."""
    with EmbeddedRedis() as server:
        yield server


def test_a_redis_outage_fails_new_calls_fast_while_in_flight_ones_wait_and_finish(
        private_redis: EmbeddedRedis, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    """Redis comes back EMPTY (no AOF data): the in-flight call's request is enqueued again
    with the same seed, so the call still gets every token once; new calls during the outage
    get UNAVAILABLE at once; nothing needs a restart."""
    gateway = make_gateway(redis_url=private_redis.url, redis_timeout_s=1.0, liveness_check_s=0.5)
    make_worker(redis_url=private_redis.url, max_backoff_s=0.2)
    channel, stub = stub_for(gateway.target)
    health = health_pb2_grpc.HealthStub(channel)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        reference = list(stub.Generate(long_request(max_tokens=60), timeout=120))
        in_flight = stub.Generate(long_request(max_tokens=60), timeout=120)
        first = [next(in_flight) for _ in range(3)]

        private_redis.stop()
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(build_request("Hi", max_tokens=4), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 2.0
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING

        private_redis.start()  # same port, empty: the stream, group and records are gone
        rest = list(in_flight)
        assert [r.chunk.token_ids for r in first + rest[:-1]] == [r.chunk.token_ids for r in reference[:-1]]
        assert rest[-1].final.text == reference[-1].final.text
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert list(stub.Generate(build_request("Hi", max_tokens=4), timeout=30))[-1].HasField("final")


def test_an_in_flight_call_gives_up_when_redis_stays_away(
        private_redis: EmbeddedRedis, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    gateway = make_gateway(redis_url=private_redis.url, redis_timeout_s=0.5, liveness_check_s=0.3,
                           max_redis_outage_s=1.0)
    make_worker(redis_url=private_redis.url, max_backoff_s=0.2)
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        in_flight = stub.Generate(long_request(), timeout=120)
        next(in_flight)
        private_redis.stop()
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(in_flight)  # must not hang: it waits max_redis_outage_s, not forever
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 5.0
