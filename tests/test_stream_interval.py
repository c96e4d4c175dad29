"""GenerateRequest.stream_interval: chunks of several tokens (vLLM's --stream-interval), over a real
gateway, a worker on the simulated engine and Redis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from gateway.config import GatewayConfig
from protos.convert import build_request
from protos.params import SamplingParams
from protos.tokenrelay.v1 import generate_pb2
from tests.service import GatewayThread, WorkerThread, stub_for, wait_until, workers_ready
from worker.engine.sim import SimConfig, SimEngine, sim_token_ids

MAX_INTERVAL = 256


Responses = list[generate_pb2.GenerateResponse]


def stream(make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
           request: generate_pb2.GenerateRequest, **gateway: Any) -> Responses:
    start_worker(SimEngine(SimConfig(step_ms=1.0, ms_per_token=0.0), max_num_seqs=4))
    return call(make_gateway(**gateway), request)


def call(gateway: GatewayThread, request: generate_pb2.GenerateRequest) -> Responses:
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        return list(stub.Generate(request, timeout=30))


@pytest.mark.parametrize(("interval", "sizes"), [(None, [1] * 10), (1, [1] * 10), (4, [1, 4, 4, 1]),
                                                 (3, [1, 3, 3, 3]), (64, [1, 9])])
def test_chunks_hold_interval_tokens_after_the_first_and_the_rest_before_the_final(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        interval: int | None, sizes: list[int]) -> None:
    """The first token comes alone (the time to the first token is not delayed), then a chunk
    each time `interval` tokens are ready, and what is left with the end: the same tokens, in
    fewer messages, indexed 0, 1, 2, ... as always."""
    responses = stream(make_gateway, start_worker,
                       build_request("hi", max_tokens=10, seed=3, stream_interval=interval))
    chunks = [r.chunk for r in responses[:-1]]
    assert [len(c.token_ids) for c in chunks] == sizes
    assert [c.index for c in chunks] == list(range(len(sizes)))
    assert [t for c in chunks for t in c.token_ids] == sim_token_ids(3, 0, 10)
    final = responses[-1].final
    assert final.usage.completion_tokens == 10 and final.text == "".join(c.text for c in chunks)


def test_a_resumed_stream_continues_from_the_chunks_the_caller_has(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread]) -> None:
    request = build_request("hi", max_tokens=10, seed=3, stream_interval=4, request_id="resumed")
    first = stream(make_gateway, start_worker, request)
    request.resume_from_index = 2  # the caller has the first two chunks (5 tokens)
    again = call(make_gateway(), request)
    assert [r.chunk.index for r in again[:-1]] == [2, 3]
    assert [t for r in again[:-1] for t in r.chunk.token_ids] == sim_token_ids(3, 5, 5)
    assert again[-1].final.text == first[-1].final.text


@pytest.mark.parametrize("interval", [MAX_INTERVAL + 1, 100_000])
def test_an_interval_past_the_limit_is_invalid_argument_naming_it(
        make_gateway: Callable[..., GatewayThread], interval: int) -> None:
    gateway = make_gateway()
    channel, stub = stub_for(gateway.target)
    with channel, pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(build_request("hi", max_tokens=4, stream_interval=interval), timeout=10))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"stream_interval must be in [0, {MAX_INTERVAL}], got {interval}" in (raised.value.details() or "")


def test_a_gateways_default_applies_to_requests_without_one_and_a_resend_elsewhere_attaches(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread]) -> None:
    """--default-stream-interval (vLLM's server-wide stream interval) for requests that set none;
    an explicit one wins. The caller's body stays as sent, so a resume through a gateway without
    the default attaches to the same generation."""
    request = build_request("hi", max_tokens=10, seed=3, request_id="defaulted")
    first = stream(make_gateway, start_worker, request, default_stream_interval=4)
    assert [len(r.chunk.token_ids) for r in first[:-1]] == [1, 4, 4, 1]
    explicit = call(make_gateway(default_stream_interval=4),
                    build_request("hi", max_tokens=4, stream_interval=1))
    assert [len(r.chunk.token_ids) for r in explicit[:-1]] == [1, 1, 1, 1]
    request.resume_from_index = 1
    again = call(make_gateway(), request)  # no default here: not FAILED_PRECONDITION
    assert [r.chunk.index for r in again[:-1]] == [1, 2, 3]
    assert [t for r in again[:-1] for t in r.chunk.token_ids] == sim_token_ids(3, 1, 9)


def test_the_default_is_checked() -> None:
    with pytest.raises(ValueError, match=r"default_stream_interval must be in \[0, 256\], got 300"):
        GatewayConfig(default_stream_interval=300)


def test_the_interval_is_a_sampling_params_field_with_its_limit() -> None:
    assert SamplingParams().stream_interval == 1
    assert SamplingParams(stream_interval=0).stream_interval == 1  # unset on the wire: every token
    with pytest.raises(ValueError, match=r"stream_interval must be in \[0, 256\], got -1"):
        SamplingParams(stream_interval=-1)


def test_logprobs_stay_one_per_token_in_chunks_of_several(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread]) -> None:
    responses = stream(make_gateway, start_worker,
                       build_request("hi", max_tokens=7, seed=5, stream_interval=3, top_logprobs=2))
    chunks = [r.chunk for r in responses[:-1]]
    assert [len(c.token_ids) for c in chunks] == [1, 3, 3]
    for c in chunks:
        assert [lp.chosen.token_id for lp in c.logprobs] == list(c.token_ids)
        assert all(len(lp.top) == 2 for lp in c.logprobs)
