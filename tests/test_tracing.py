"""Traces and JSON logs (issue 10): a real OTLP/gRPC receiver in the test process (the
collector's TraceService from opentelemetry-proto) gets the spans of a real gateway and a
real worker, which share one trace."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import redis

from gateway.config import GatewayConfig
from protos.convert import build_request
from protos.keys import STREAM_DATA_FIELD, Keys
from protos.logs import JsonFormatter
from protos.tokenrelay.v1 import generate_pb2, queue_pb2
from protos.tracing import Tracing, trace_id_of
from tests.service import ROOT, GatewayThread, WorkerThread, stub_for, wait_until, workers_ready
from worker.config import DEFAULT_MODEL_NAME, WorkerConfig

# The tracing extra (in `dev`); the collector's service and messages from opentelemetry-proto.
pytest.importorskip("opentelemetry.sdk.trace")
trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
trace_service_pb2_grpc = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")
common_pb2 = pytest.importorskip("opentelemetry.proto.common.v1.common_pb2")
trace_pb2 = pytest.importorskip("opentelemetry.proto.trace.v1.trace_pb2")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
Span = trace_pb2.Span
GET_INFO = generate_pb2.GetServerInfoRequest()


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it, with the service.name of its resource."""

    def __init__(self) -> None:
        self.endpoint = ""
        self._spans: list[tuple[str, Span]] = []
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self._lock:
            for resource_spans in request.resource_spans:
                service = attributes(resource_spans.resource.attributes).get("service.name", "")
                for scope in resource_spans.scope_spans:
                    self._spans += [(service, span) for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[str, Span]]:
        with self._lock:
            return list(self._spans)


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """An OTLP/gRPC receiver; name it before the gateway and worker fixtures, so it stops
    after them and their exporters' last flush at shutdown finds it."""
    receiver = Receiver()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.endpoint = f"http://127.0.0.1:{port}"
    yield receiver
    server.stop(0)


def received(receiver: Receiver, tracings: list[Tracing], names: list[str]) -> dict[str, tuple[str, Span]]:
    """The spans of these names once each has arrived (flushing the exporters meanwhile)."""
    def arrived() -> dict[str, tuple[str, Span]] | None:
        for tracing in tracings:
            tracing.force_flush()
        by_name = {span.name: (service, span) for service, span in receiver.spans()}
        return by_name if set(names) <= set(by_name) else None
    spans: dict[str, tuple[str, Span]] = wait_until(arrived, timeout=10, interval=0.05)
    return spans


def traced_stack(make_gateway: Callable[..., GatewayThread], make_worker: Callable[..., WorkerThread],
                 receiver: Receiver) -> tuple[GatewayThread, WorkerThread, list[Tracing]]:
    gateway = make_gateway(otlp_traces_endpoint=receiver.endpoint)
    worker = make_worker(otlp_traces_endpoint=receiver.endpoint)
    assert gateway.gateway is not None
    return gateway, worker, [gateway.gateway.tracing, worker.consumer.tracing]


def call(gateway: GatewayThread, metadata: tuple[tuple[str, str], ...] = ()) -> list[Any]:
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        request = build_request("Say hi.", max_tokens=4, temperature=0.5, top_p=0.9, ignore_eos=True)
        return list(stub.Generate(request, metadata=metadata, timeout=60))


@pytest.mark.slow
def test_the_callers_trace_continues_through_the_gateway_and_the_worker(
        receiver: Receiver, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    gateway, worker, tracings = traced_stack(make_gateway, make_worker, receiver)
    responses = call(gateway, (("traceparent", TRACEPARENT),))
    request_id, final = responses[0].request_id, responses[-1].final
    spans = received(receiver, tracings, ["Generate", "enqueue", "process"])
    (server_service, server), (_, producer), (consumer_service, consumer) = (
        spans["Generate"], spans["enqueue"], spans["process"])

    assert {s.trace_id.hex() for _, s in spans.values()} == {TRACE_ID}
    assert (server_service, server.kind, server.parent_span_id.hex()) == (
        "tokenrelay-gateway", Span.SPAN_KIND_SERVER, CALLER_SPAN_ID)
    assert (producer.kind, producer.parent_span_id) == (Span.SPAN_KIND_PRODUCER, server.span_id)
    assert (consumer_service, consumer.kind, consumer.parent_span_id) == (
        "tokenrelay-worker", Span.SPAN_KIND_CONSUMER, producer.span_id)

    for span in (server, consumer):
        a = attributes(span.attributes)
        assert a["gen_ai.request.id"] == request_id
        assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) \
            == (4, 0.5, pytest.approx(0.9))
        assert a["gen_ai.usage.prompt_tokens"] == final.usage.prompt_tokens > 0
        assert a["gen_ai.usage.completion_tokens"] == final.usage.completion_tokens == 4
        assert a["gen_ai.usage.cache_read.input_tokens"] == final.usage.cached_prompt_tokens
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["gen_ai.latency.time_in_queue"] == pytest.approx(final.usage.queue_time_s)
        assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(final.usage.time_to_first_token_s)
        assert span.status.code != trace_pb2.Status.STATUS_CODE_ERROR
    assert attributes(server.attributes)["gen_ai.latency.e2e"] >= final.usage.time_to_first_token_s

    # The idle worker kept polling (XREADGROUP every claim_block_ms): no span for any of it.
    time.sleep(1.0)
    for tracing in tracings:
        tracing.force_flush()
    assert sorted(s.name for _, s in receiver.spans()) == ["Generate", "enqueue", "process"]


@pytest.mark.slow
def test_a_call_without_traceparent_starts_one_trace_for_gateway_and_worker(
        receiver: Receiver, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    gateway, _, tracings = traced_stack(make_gateway, make_worker, receiver)
    call(gateway)
    spans = received(receiver, tracings, ["Generate", "enqueue", "process"])
    server, consumer = spans["Generate"][1], spans["process"][1]
    assert server.parent_span_id == b""  # a root span
    assert consumer.trace_id == server.trace_id != b"\0" * 16
    assert consumer.parent_span_id == spans["enqueue"][1].span_id


@pytest.mark.slow
def test_each_admission_of_a_parked_then_resumed_request_is_its_own_span_in_the_callers_trace(
        receiver: Receiver, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    gateway, _, tracings = traced_stack(make_gateway, make_worker, receiver)
    request = build_request("Tell me a story.", request_id="traced-resume", max_tokens=24, seed=5,
                            ignore_eos=True)
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        first = stub.Generate(request, metadata=(("traceparent", TRACEPARENT),), timeout=60)
        [next(first) for _ in range(5)]
        first.cancel()  # nobody follows it: the worker parks it
        wait_until(lambda: stub.GetServerInfo(GET_INFO, timeout=5).workers[0].num_parked == 1, timeout=5)
        request.resume_from_index = 5
        rest = list(stub.Generate(request, timeout=60))  # re-admitted from its progress
    assert rest[-1].final.usage.completion_tokens == 24

    def both_admissions() -> list[Span] | None:
        for tracing in tracings:
            tracing.force_flush()
        spans = [s for _, s in receiver.spans() if s.name == "process"]
        return spans if len(spans) == 2 else None
    parked, finished = sorted(wait_until(both_admissions, timeout=10), key=lambda s: s.start_time_unix_nano)
    [enqueue] = [s for _, s in receiver.spans() if s.name == "enqueue" and s.trace_id.hex() == TRACE_ID]
    for span in (parked, finished):  # the resume call has a trace of its own; the request keeps the first
        assert (span.trace_id.hex(), span.parent_span_id) == (TRACE_ID, enqueue.span_id)
    assert attributes(parked.attributes)["tokenrelay.outcome"] == "parked"
    assert attributes(finished.attributes)["tokenrelay.resumed_tokens"] >= 5  # streamed before it parked
    assert attributes(finished.attributes)["gen_ai.response.finish_reasons"] == ["length"]


@pytest.mark.parametrize("is_tracing", [True, False])
def test_the_queued_request_carries_the_trace_context(
        receiver: Receiver, make_gateway: Callable[..., GatewayThread], redis_url: str, prefix: str,
        is_tracing: bool) -> None:
    """Traced: the gateway's enqueue span is the worker's parent. Untraced: the caller's own
    traceparent travels on as it came (a tracing worker still joins the caller's trace)."""
    gateway = make_gateway(otlp_traces_endpoint=receiver.endpoint if is_tracing else "")
    channel, stub = stub_for(gateway.target)
    with channel, pytest.raises(grpc.RpcError):  # no worker: the call waits in the queue until its deadline
        list(stub.Generate(build_request("Hi."), metadata=(("traceparent", TRACEPARENT),
                                                          ("tracestate", "vendor=1")), timeout=1))
    client = redis.Redis.from_url(redis_url)
    [(_, fields)] = client.xrange(Keys(prefix, DEFAULT_MODEL_NAME).requests)
    client.close()
    carried = dict(queue_pb2.QueuedRequest.FromString(fields[STREAM_DATA_FIELD]).trace_context)
    assert trace_id_of(carried) == TRACE_ID
    assert carried["tracestate"] == "vendor=1"
    if not is_tracing:
        assert carried["traceparent"] == TRACEPARENT
        return
    assert gateway.gateway is not None
    spans = received(receiver, [gateway.gateway.tracing], ["Generate", "enqueue"])
    assert carried["traceparent"] == f"00-{TRACE_ID}-{spans['enqueue'][1].span_id.hex()}-01"


def test_tracing_off_builds_no_provider_and_no_exporter() -> None:
    """No endpoint: a gateway and a worker's consumer module load, and a gateway is built,
    without OpenTelemetry's SDK tracer or its exporter being imported (so no provider and no
    exporter thread). (redis-py imports the OpenTelemetry API itself when it is installed.)"""
    code = """if True:
        import asyncio, sys, threading
        from gateway.config import GatewayConfig
        from gateway.process import Gateway
        import worker.io.consumer
        async def build():
            gateway = Gateway(GatewayConfig())
            assert not gateway.tracing.is_enabled and gateway.tracing.force_flush()
            gateway.tracing.shutdown()
        asyncio.run(build())
        sdk = ("opentelemetry.sdk.trace", "opentelemetry.exporter")
        print(sorted(m for m in sys.modules if m.startswith(sdk)),
              [t.name for t in threading.enumerate() if t.name.startswith("Otel")])
    """
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "[]"]


def test_an_endpoint_without_the_packages_fails_at_start_up(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.__main__ import config_from_args

    for name in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    endpoint = "http://127.0.0.1:4317"
    with pytest.raises(ValueError, match=r"pip install 'tokenrelay\[tracing\]'"):
        GatewayConfig(otlp_traces_endpoint=endpoint)
    with pytest.raises(ValueError, match="tracing"):
        WorkerConfig(otlp_traces_endpoint=endpoint)
    with pytest.raises(RuntimeError, match=r"pip install 'tokenrelay\[tracing\]'"):
        Tracing(endpoint, "tokenrelay-gateway", "g1")
    with pytest.raises(SystemExit):
        config_from_args(["--otlp-traces-endpoint", endpoint])
    assert "tokenrelay[tracing]" in capsys.readouterr().err


@pytest.mark.parametrize("endpoint", ["localhost:4317", "grpc://collector:4317", "http://", "http://a b:1"])
def test_an_endpoint_needs_a_scheme_and_a_host(endpoint: str) -> None:
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        GatewayConfig(otlp_traces_endpoint=endpoint)


def test_log_format_is_text_or_json() -> None:
    with pytest.raises(ValueError, match="log_format"):
        WorkerConfig(log_format="xml")


class Lines(logging.Handler):
    """What a JSON-logging process would print, one parsed line per record."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def json_lines() -> Iterator[Lines]:
    handler = Lines()
    loggers = [logging.getLogger(name) for name in ("gateway", "worker")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    yield handler
    for lg, level in zip(loggers, levels, strict=True):
        lg.removeHandler(handler)
        lg.setLevel(level)


@pytest.mark.slow
def test_json_lines_about_a_request_carry_its_request_id_worker_and_trace_id(
        receiver: Receiver, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread], json_lines: Lines) -> None:
    gateway, worker, _ = traced_stack(make_gateway, make_worker, receiver)
    request_id = call(gateway, (("traceparent", TRACEPARENT),))[0].request_id
    about = [line for line in json_lines.lines if request_id in line["message"]]
    gateway_lines = [line for line in about if line["logger"].startswith("gateway")]
    worker_lines = [line for line in about if line["logger"].startswith("worker")]
    assert gateway_lines and worker_lines
    for line in about:
        assert (line["request_id"], line["trace_id"]) == (request_id, TRACE_ID), line
        assert {"time", "level", "logger", "message"} <= set(line)
    assert {line["worker"] for line in worker_lines} == {worker.config.worker_id}


def test_gateway_process_logs_json_lines(redis_url: str, prefix: str) -> None:
    """`--log-format json` on a real `python -m gateway`: every stderr line is a JSON object
    naming the process."""
    args = [sys.executable, "-m", "gateway", "--listen", "127.0.0.1:0", "--redis-url", redis_url,
            "--key-prefix", prefix, "--gateway-id", "json-gw", "--metrics-port", "0", "--log-format", "json"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "listening" in proc.stdout.readline()
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    lines = [json.loads(line) for line in stderr.splitlines()]
    assert any("listening on port" in line["message"] for line in lines)
    assert {(line["process"], line["gateway"]) for line in lines} == {("gateway", "json-gw")}
