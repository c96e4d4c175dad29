"""End to end over real gRPC and real Redis with the real engine and the default model.

client -> gateway -> Redis stream -> worker (TextEngine, SmolLM2) -> Redis pub/sub -> gateway -> client
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from protos.convert import build_request, finish_reason_to_pb
from protos.params import ChatMessage, PromptInput, SamplingParams
from protos.tokenrelay.v1 import generate_pb2
from tests.conftest import TEST_MAX_MODEL_LEN, TEST_MAX_NUM_SEQS
from tests.service import GatewayThread, WorkerProcess, WorkerThread, stub_for, wait_until, workers_ready
from worker.engine.outputs import RequestOutput

pytestmark = pytest.mark.slow

CHAT = [("system", "You are a helpful assistant."), ("user", "What is the capital of France?")]


def run_in_process(engine: Any, prompt: PromptInput, params: SamplingParams) -> list[RequestOutput]:
    """The engine's own outputs for one request, no Redis or gRPC involved."""
    request_id = f"ref-{uuid.uuid4().hex[:6]}"
    engine.add_request(request_id, prompt, params)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def check_stream(responses: list[generate_pb2.GenerateResponse]) -> tuple[list[int], generate_pb2.Final]:
    """The stream's invariants; returns (token ids, final)."""
    *chunks, last = responses
    assert all(r.HasField("chunk") for r in chunks) and last.HasField("final")
    assert len({r.request_id for r in responses}) == 1
    assert [r.chunk.index for r in chunks] == list(range(len(chunks)))
    assert "".join(r.chunk.text for r in chunks) == last.final.text
    token_ids = [t for r in chunks for t in r.chunk.token_ids]
    assert last.final.usage.completion_tokens == len(token_ids)
    return token_ids, last.final


def test_chat_stream_matches_the_in_process_engine(
        smollm_engine: Any, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    prompt = PromptInput(messages=tuple(ChatMessage(r, c) for r, c in CHAT))
    reference = run_in_process(smollm_engine, prompt, SamplingParams(max_tokens=16, temperature=0.0))
    ref_final = reference[-1]
    assert ref_final.usage is not None and ref_final.finish_reason is not None

    gateway, worker = make_gateway(), make_worker()
    channel, stub = stub_for(gateway.target)
    with channel:
        request = build_request(messages=CHAT, max_tokens=16, temperature=0.0)
        responses = list(stub.Generate(request, timeout=120))
    token_ids, final = check_stream(responses)
    assert token_ids == [t for o in reference for t in o.token_ids]
    assert final.text == "".join(o.text for o in reference)
    assert "Paris" in final.text
    assert final.finish_reason == finish_reason_to_pb(ref_final.finish_reason)
    assert final.usage.prompt_tokens == ref_final.usage.prompt_tokens
    assert final.usage.time_to_first_token_s > 0
    assert final.worker_id == worker.config.worker_id


def test_32_concurrent_streams_over_two_workers(
        redis_url: str, prefix: str, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    gateway = make_gateway()
    process = WorkerProcess(redis_url, prefix, "process-worker", "--max-num-seqs", str(TEST_MAX_NUM_SEQS),
                            "--max-model-len", str(TEST_MAX_MODEL_LEN), "--num-threads", "1")
    try:
        thread = make_worker()
        channel, stub = stub_for(gateway.target)
        with channel:
            wait_until(workers_ready(stub, 2), timeout=180, interval=0.2)

            def one(i: int) -> list[generate_pb2.GenerateResponse]:
                request = build_request(f"Count from {i} to {i + 5}:", max_tokens=8, temperature=0.0,
                                        request_id=f"req-{i}")
                return list(stub.Generate(request, timeout=180))

            with ThreadPoolExecutor(32) as pool:
                results = list(pool.map(one, range(32)))
        served_by = set()
        for i, responses in enumerate(results):
            token_ids, final = check_stream(responses)
            assert responses[0].request_id == f"req-{i}"
            assert 1 <= len(token_ids) <= 8 and final.text
            served_by.add(final.worker_id)
        assert served_by == {thread.config.worker_id, "process-worker"}
    finally:
        assert process.stop() == 0, "the worker process did not drain and exit cleanly on SIGTERM"


def test_a_killed_worker_loses_no_request_and_its_stream_goes_on_without_a_gap(
        redis_url: str, prefix: str, smollm_engine: Any, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    prompt = PromptInput(messages=tuple(ChatMessage(r, c) for r, c in CHAT))
    params = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    reference = run_in_process(smollm_engine, prompt, SamplingParams(**params))  # type: ignore[arg-type]
    gateway = make_gateway(worker_heartbeat_ttl_s=1)  # as the doomed worker's
    doomed = WorkerProcess(redis_url, prefix, "doomed", "--max-num-seqs", "2", "--max-model-len",
                           str(TEST_MAX_MODEL_LEN), "--num-threads", "1", "--heartbeat-ttl", "1")
    try:
        channel, stub = stub_for(gateway.target)
        with channel:
            wait_until(workers_ready(stub, 1), timeout=180, interval=0.2)
            stream = stub.Generate(build_request(messages=CHAT, **params), timeout=180)
            responses = [next(stream) for _ in range(6)]
            doomed.proc.kill()  # SIGKILL mid-stream: no drain, no goodbye
            doomed.proc.wait()
            rescuer = make_worker(heartbeat_ttl_s=1.0, heartbeat_interval_s=0.2)
            responses += list(stream)
    finally:
        doomed.stop()
    token_ids, final = check_stream(responses)  # indices 0, 1, 2, ... with no gap or repeat
    assert token_ids == [t for o in reference for t in o.token_ids]
    assert final.text == "".join(o.text for o in reference)
    assert final.worker_id == rescuer.config.worker_id
    assert final.usage.completion_tokens == 40


INVALID = [  # (request, words the status message must contain)
    (build_request(""), ["prompt"]),
    (build_request("Hi", max_tokens=-5), ["max_tokens"]),
    (build_request("Hi", temperature=float("nan")), ["temperature", "nan"]),
    (build_request("Hi", top_p=0.0), ["top_p"]),
    (build_request("Hi", top_p=1.5), ["top_p"]),
    (build_request(messages=[("wizard", "Hi")]), ["role", "wizard"]),
    (build_request("Hi", request_id="no spaces allowed"), ["request_id"]),
    (build_request("word " * (TEST_MAX_MODEL_LEN + 50), max_tokens=8), ["prompt", "context"]),  # worker-side
    (build_request("Hi", max_tokens=TEST_MAX_MODEL_LEN + 1), ["max_tokens", "context"]),  # gateway-side
]


def test_invalid_inputs_are_rejected_and_the_service_keeps_serving(
        make_gateway: Callable[..., GatewayThread], make_worker: Callable[..., WorkerThread]) -> None:
    gateway, _ = make_gateway(), make_worker()
    channel, stub = stub_for(gateway.target)
    with channel:
        for request, words in INVALID:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            for word in words:
                assert word in (e.value.details() or ""), (word, e.value.details())
        request = build_request("The sky is", max_tokens=4, temperature=0.0)
        responses = list(stub.Generate(request, timeout=60))
    check_stream(responses)
