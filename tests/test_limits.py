"""gateway/limits.py: the gateway's gRPC transport limits and request caps, through a real
gateway on loopback gRPC and a real Redis; nothing refused may reach the request streams."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import redis

from gateway.__main__ import config_from_args
from gateway.config import GatewayConfig
from gateway.errors import InvalidArgument
from gateway.limits import RequestLimits, server_options
from protos.convert import build_request
from protos.keys import Keys
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc
from tests.service import GatewayThread, stub_for, wait_until
from worker.config import DEFAULT_MODEL_NAME

MIB = 1024 * 1024


@pytest.fixture
def num_enqueued(redis_url: str, prefix: str) -> Iterator[Callable[[], int]]:
    """Entries on this test's request streams (every priority class)."""
    client = redis.Redis.from_url(redis_url)
    yield lambda: sum(int(client.xlen(stream)) for stream in Keys(prefix, DEFAULT_MODEL_NAME).request_streams)
    client.close()


def refusal(stub: generate_pb2_grpc.TokenRelayStub, request: generate_pb2.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=5))
    return e.value


def prompt_of_message_size(num_bytes: int) -> generate_pb2.GenerateRequest:
    """A GenerateRequest whose serialized size is num_bytes (field tag + varint length + prompt)."""
    request = build_request("x" * num_bytes)
    request.prompt = "x" * (2 * num_bytes - request.ByteSize())  # the same length varint at these sizes
    assert request.ByteSize() == num_bytes
    return request


# -- configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"max_receive_message_bytes": 0}, {"max_concurrent_rpcs": 0}, {"min_client_ping_interval_s": 0},
    {"keepalive_time_s": 0}, {"max_connection_age_s": -1}, {"max_connection_age_grace_s": -1},
    {"max_prompt_bytes": 0}, {"max_messages": 0}, {"max_stop_strings": 17}, {"max_stop_strings": -1},
    {"max_stop_token_ids": -1}, {"max_prompt_bytes": 2 * MIB},  # above max_receive_message_bytes
])
def test_gateway_config_rejects_bad_limits(fields: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        GatewayConfig(**fields)


def test_every_limit_has_a_flag_and_an_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults, _ = config_from_args([])
    assert (defaults.max_receive_message_bytes, defaults.max_concurrent_rpcs, defaults.max_prompt_bytes,
            defaults.max_messages, defaults.max_stop_strings, defaults.max_stop_token_ids) == \
        (MIB, 4096, 256 * 1024, 256, 16, 64)
    assert (defaults.min_client_ping_interval_s, defaults.keepalive_time_s, defaults.max_connection_age_s,
            defaults.max_connection_age_grace_s) == (10, 60, 0, 30)
    monkeypatch.setenv("TOKENRELAY_MAX_PROMPT_BYTES", "1000")
    monkeypatch.setenv("TOKENRELAY_MAX_CONNECTION_AGE_S", "300")
    config, _ = config_from_args(["--max-receive-message-bytes", "2000", "--max-concurrent-rpcs", "8",
                                  "--min-client-ping-interval-s", "5", "--keepalive-time-s", "30",
                                  "--max-connection-age-grace-s", "60", "--max-messages", "4",
                                  "--max-stop-strings", "2", "--max-stop-token-ids", "3"])
    assert (config.max_receive_message_bytes, config.max_concurrent_rpcs, config.min_client_ping_interval_s,
            config.keepalive_time_s, config.max_connection_age_s, config.max_connection_age_grace_s) == \
        (2000, 8, 5, 30, 300, 60)
    assert config.request_limits == RequestLimits(max_prompt_bytes=1000, max_messages=4, max_stop_strings=2,
                                                  max_stop_token_ids=3)


def test_server_options_state_every_transport_limit() -> None:
    options = dict(server_options(GatewayConfig()))
    assert options == {"grpc.max_receive_message_length": MIB, "grpc.keepalive_permit_without_calls": 1,
                       "grpc.http2.min_ping_interval_without_data_ms": 10_000,
                       "grpc.http2.max_ping_strikes": 2, "grpc.keepalive_time_ms": 60_000,
                       "grpc.keepalive_timeout_ms": 20_000}  # connection age 0: grpc's own "never"
    aged = dict(server_options(GatewayConfig(max_connection_age_s=300, max_connection_age_grace_s=45)))
    assert (aged["grpc.max_connection_age_ms"], aged["grpc.max_connection_age_grace_ms"]) == (300_000, 45_000)


@pytest.mark.parametrize(("request_", "message"), [
    (build_request("é" * 6), "prompt is 12 bytes; the limit is 10 (--max-prompt-bytes)"),  # UTF-8, not chars
    (build_request(messages=[("user", "hello"), ("assistant", "world!")]),
     "chat.messages is 11 bytes of content; the limit is 10 (--max-prompt-bytes)"),
    (build_request(messages=[("user", "a")] * 3),
     "chat.messages has 3 messages; the limit is 2 (--max-messages)"),
    (build_request("hi", stop=["a", "b", "c"]),
     "stopping.stop has 3 strings; the limit is 2 (--max-stop-strings)"),
    (build_request("hi", stop_token_ids=[1, 2, 3]),
     "stopping.stop_token_ids has 3 ids; the limit is 2 (--max-stop-token-ids)"),
])
def test_request_limits_name_the_field_the_limit_and_the_flag(request_: generate_pb2.GenerateRequest,
                                                              message: str) -> None:
    limits = RequestLimits(max_prompt_bytes=10, max_messages=2, max_stop_strings=2, max_stop_token_ids=2)
    with pytest.raises(InvalidArgument) as e:
        limits.check(request_)
    assert str(e.value) == message


def test_request_limits_accept_a_request_at_every_limit() -> None:
    limits = RequestLimits(max_prompt_bytes=10, max_messages=2, max_stop_strings=2, max_stop_token_ids=2)
    limits.check(build_request("é" * 5, stop=["a", "b"], stop_token_ids=[1, 2]))
    limits.check(build_request(messages=[("user", "hello"), ("assistant", "world")]))


# -- request caps, through a real gateway -----------------------------------------------------------

@pytest.mark.parametrize(("request_", "message"), [
    (build_request("x" * 300_000), "prompt is 300000 bytes; the limit is 262144 (--max-prompt-bytes)"),
    (build_request(messages=[("user", "x" * 1024)] * 257),
     "chat.messages has 257 messages; the limit is 256 (--max-messages)"),
    (build_request(messages=[("user", "x" * 200_000), ("user", "y" * 100_000)]),
     "chat.messages is 300000 bytes of content; the limit is 262144 (--max-prompt-bytes)"),
    (build_request("hi", stop_token_ids=range(65)),
     "stopping.stop_token_ids has 65 ids; the limit is 64 (--max-stop-token-ids)"),
    (build_request("hi", stop=[f"s{i}" for i in range(17)]),
     "stopping.stop has 17 strings; the limit is 16 (--max-stop-strings)"),
], ids=["prompt-bytes", "messages", "chat-bytes", "stop-token-ids", "stop-strings"])
def test_a_request_over_a_cap_is_invalid_argument_and_never_enqueued(
        make_gateway: Callable[..., GatewayThread], num_enqueued: Callable[[], int],
        request_: generate_pb2.GenerateRequest, message: str) -> None:
    channel, stub = stub_for(make_gateway().target)  # the defaults; no worker: the gateway answers alone
    with channel:
        error = refusal(stub, request_)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (error.details() or "")
    assert num_enqueued() == 0


# -- gRPC transport limits --------------------------------------------------------------------------

def test_a_message_over_max_receive_message_bytes_is_resource_exhausted_from_grpc(
        make_gateway: Callable[..., GatewayThread], num_enqueued: Callable[[], int]) -> None:
    channel, stub = stub_for(make_gateway().target)
    with channel:
        error = refusal(stub, prompt_of_message_size(MIB + 1))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # grpc's, not UNKNOWN or INTERNAL
        # exactly the limit passes grpc and reaches the gateway's own caps
        error = refusal(stub, prompt_of_message_size(MIB))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-prompt-bytes" in error.details()
        assert stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5).gateway_id  # still serving
    assert num_enqueued() == 0


def test_a_request_within_the_limits_is_enqueued(make_gateway: Callable[..., GatewayThread],
                                                 num_enqueued: Callable[[], int]) -> None:
    gateway = make_gateway(max_receive_message_bytes=4096, max_prompt_bytes=4096)
    channel, stub = stub_for(gateway.target)
    with channel:
        assert refusal(stub, prompt_of_message_size(4097)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # no worker: the normal request waits in the queue until its deadline
        assert refusal(stub, build_request("x" * 4000)).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert num_enqueued() == 1


def test_calls_beyond_max_concurrent_rpcs_are_resource_exhausted(
        make_gateway: Callable[..., GatewayThread], num_enqueued: Callable[[], int]) -> None:
    channel, stub = stub_for(make_gateway(max_concurrent_rpcs=1).target)
    info = generate_pb2.GetServerInfoRequest()
    with channel:
        held = stub.Generate(build_request("hi"), timeout=30)  # no worker: it stays open, queued
        wait_until(num_enqueued, timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            stub.GetServerInfo(info, timeout=5)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held.cancel()
        wait_until(lambda: _answers(stub, info), timeout=5)  # the slot is free again


def _answers(stub: generate_pb2_grpc.TokenRelayStub, info: generate_pb2.GetServerInfoRequest) -> bool:
    try:
        return bool(stub.GetServerInfo(info, timeout=2).gateway_id)
    except grpc.RpcError:
        return False


# Keepalive pings as often as grpc's client sends them (once a second, whatever keepalive_time_ms
# asks for), on a silent call too (max_pings_without_data 0): a strike at each against 10 s.
ABUSIVE_CLIENT = [("grpc.keepalive_time_ms", 100), ("grpc.keepalive_permit_without_calls", 1),
                  ("grpc.http2.max_pings_without_data", 0)]


def held_call(target: str, timeout: float, options: list[tuple[str, int]] | None = None
              ) -> tuple[grpc.StatusCode, float]:
    """Open a Generate no worker answers and wait for its end: (its status, seconds it lasted)."""
    start = time.monotonic()
    with grpc.insecure_channel(target, options=options) as channel:
        stub = generate_pb2_grpc.TokenRelayStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(build_request("hi"), timeout=timeout))
    return e.value.code(), time.monotonic() - start


@pytest.mark.parametrize(("interval_s", "expected"), [(10, grpc.StatusCode.UNAVAILABLE),
                                                      (0.5, grpc.StatusCode.DEADLINE_EXCEEDED)])
def test_a_client_pinging_faster_than_min_client_ping_interval_is_sent_away(
        make_gateway: Callable[..., GatewayThread], interval_s: float, expected: grpc.StatusCode) -> None:
    gateway = make_gateway(min_client_ping_interval_s=interval_s)
    code, seconds = held_call(gateway.target, timeout=5, options=ABUSIVE_CLIENT)
    # 10 s: the third early ping (~3 s in) gets GOAWAY too_many_pings, which ends the call (resumable);
    # 0.5 s: the same pings are allowed and the call lives to its deadline
    assert code == expected
    if expected == grpc.StatusCode.UNAVAILABLE:
        assert seconds < 4.9


def test_max_connection_age_lets_a_call_finish_within_the_grace_and_cuts_it_after(
        make_gateway: Callable[..., GatewayThread]) -> None:
    graceful = make_gateway(max_connection_age_s=0.2, max_connection_age_grace_s=10)
    code, seconds = held_call(graceful.target, timeout=2)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and seconds >= 1.9  # GOAWAY, but not cut
    strict = make_gateway(max_connection_age_s=0.2, max_connection_age_grace_s=0.3)
    code, seconds = held_call(strict.target, timeout=10)
    assert code == grpc.StatusCode.UNAVAILABLE and seconds < 5  # resumable
