"""Tracing: OpenTelemetry spans over OTLP/gRPC, one W3C trace from the caller to the worker.

Where the trace travels:

    caller's gRPC metadata `traceparent` / `tracestate` (or none: a new trace)
      -> gateway: SERVER span `Generate` around the whole call
         -> PRODUCER span `enqueue` around the attach (the XADD, gateway/queue.py);
            its context is injected into `QueuedRequest.trace_context` (queue.proto)
      -> Redis stream
      -> worker: CONSUMER span `process` from admission to its final (or error, park,
         hand-over), its parent the PRODUCER span. Each admission is its own span: a
         request resumed after parking, or failed over to another worker, adds one to
         the same trace.

Spans are per request, never per Redis command: the idle XREADGROUP poll, heartbeats
and publishes create none. Attributes use vLLM's `gen_ai.*` names (`GenAI`).

Off by default. Without an endpoint nothing of OpenTelemetry is imported, no provider
and no exporter thread exist, and the sides skip every span call (`is_enabled`); the
OpenTelemetry packages are an optional extra (`pip install 'tokenrelay[tracing]'`).

One `Tracing` per component, each with its own `TracerProvider`, never the global
one: the tests run a gateway and workers in one process, and each keeps its own
resource (service.name, service.instance.id) and flushes and shuts down only its own
exporter. Nothing in tokenrelay uses the global OpenTelemetry API, so nothing misses it.

The endpoint comes from the process's config (`--otlp-traces-endpoint`, whose default
is $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). The SDK reads the other standard variables
once, when the provider is built at start-up: OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES (they win over the defaults tokenrelay-gateway /
tokenrelay-worker), OTEL_TRACES_SAMPLER(_ARG), OTEL_EXPORTER_OTLP_TRACES_HEADERS /
_TIMEOUT / _COMPRESSION / _CERTIFICATE, OTEL_BSP_* (the batch processor).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlparse

from protos.params import FinishReason, SamplingParams, Usage

GATEWAY_SERVICE = "tokenrelay-gateway"
WORKER_SERVICE = "tokenrelay-worker"
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
MISSING_OTEL = ("--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter: "
                "pip install 'tokenrelay[tracing]'")
_REQUIRED_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
# version-traceid-parentid-flags (W3C Trace Context); an all-zero trace id is invalid.
_TRACEPARENT_RE = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


class GenAI:
    """Span attribute names: vLLM's (vllm/tracing.py), OpenTelemetry's gen_ai semantic
    conventions where those have one (cached tokens, finish reasons)."""

    REQUEST_ID = "gen_ai.request.id"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # prefix-cache hits
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_E2E = "gen_ai.latency.e2e"


def request_attributes(request_id: str, params: SamplingParams) -> dict[str, Any]:
    return {GenAI.REQUEST_ID: request_id, GenAI.REQUEST_MAX_TOKENS: params.max_tokens,
            GenAI.REQUEST_TEMPERATURE: params.temperature, GenAI.REQUEST_TOP_P: params.top_p}


def usage_attributes(usage: Usage | None, finish_reason: FinishReason | None) -> dict[str, Any]:
    """What a final reports. Times are seconds from the enqueue (as in `Usage`)."""
    attributes: dict[str, Any] = {}
    if finish_reason is not None:
        attributes[GenAI.RESPONSE_FINISH_REASONS] = (finish_reason.name.lower(),)
    if usage is not None:
        attributes |= {
            GenAI.USAGE_PROMPT_TOKENS: usage.prompt_tokens,
            GenAI.USAGE_COMPLETION_TOKENS: usage.completion_tokens,
            GenAI.USAGE_CACHED_TOKENS: usage.cached_prompt_tokens,
            GenAI.LATENCY_TIME_IN_QUEUE: usage.queue_time_s,
            GenAI.LATENCY_TIME_TO_FIRST_TOKEN: usage.time_to_first_token_s,
            GenAI.LATENCY_TIME_IN_MODEL_DECODE: usage.decode_time_s,
        }
    return attributes


def check_otlp_endpoint(endpoint: str) -> None:
    """ValueError unless `endpoint` is "" (off) or an http(s):// URL, and, when set, the
    OpenTelemetry packages are installed (found, not imported)."""
    if not endpoint:
        return
    if not endpoint.startswith(("http://", "https://")) or not urlparse(endpoint).netloc or \
            any(c.isspace() for c in endpoint):
        raise ValueError("otlp_traces_endpoint must be http://host:port (plaintext) or https://host:port "
                         f"(TLS), got {endpoint!r}")
    missing = [name for name in _REQUIRED_MODULES if not _is_installed(name)]
    if missing:
        raise ValueError(f"{MISSING_OTEL} ({', '.join(missing)} not found)")


def _is_installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or blocked in sys.modules
        return False


def trace_id_of(carrier: Mapping[str, str]) -> str:
    """The trace id (32 hex digits) of a W3C traceparent, "" without a valid one. Plain
    string parsing: logs name the caller's trace with tracing off too."""
    match = _TRACEPARENT_RE.fullmatch(carrier.get(TRACEPARENT, "").strip())
    return match.group(1) if match and match.group(1) != "0" * 32 else ""


def carrier_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """traceparent and tracestate of a gRPC call's metadata (gRPC lower-cases the keys)."""
    return {k: v for k, v in metadata or () if k in (TRACEPARENT, TRACESTATE) and isinstance(v, str)}


class Tracing:
    """One component's tracer; `endpoint` "" = off (see the module docstring)."""

    def __init__(self, endpoint: str = "", service_name: str = "", instance_id: str = "") -> None:
        self.endpoint = endpoint
        self._provider: Any = None
        self._tracer: Any = None
        self._trace: Any = None  # opentelemetry.trace, once imported
        self._new_context: Any = None  # opentelemetry.context.Context: an empty context
        self._propagator: Any = None
        if endpoint:
            self._start(service_name, instance_id)

    def _start(self, service_name: str, instance_id: str) -> None:
        try:  # lazily: an optional extra, imported only when tracing is on
            from opentelemetry import context, trace
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import (
                SERVICE_INSTANCE_ID,
                SERVICE_NAME,
                OTELResourceDetector,
                Resource,
            )
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise RuntimeError(f"{MISSING_OTEL} ({e})") from e
        from_env = OTELResourceDetector().detect().attributes  # OTEL_SERVICE_NAME etc. win
        resource = Resource.create({SERVICE_NAME: service_name, SERVICE_INSTANCE_ID: instance_id, **from_env})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.endpoint)))
        self._tracer = self._provider.get_tracer("tokenrelay")
        self._trace, self._new_context = trace, context.Context
        self._propagator = TraceContextTextMapPropagator()  # W3C, whatever OTEL_PROPAGATORS says

    @property
    def is_enabled(self) -> bool:
        return self._tracer is not None

    def start_span(self, name: str, kind: str, *, carrier: Mapping[str, str] | None = None,
                   parent: Any = None, attributes: Mapping[str, Any] | None = None) -> Any:
        """A started span; end it with `.end()`. kind: "server", "producer", "consumer"...
        Its parent: `parent` (a span of this Tracing), else the trace a W3C `carrier`
        names, else none (a new trace). Only call it when `is_enabled`."""
        # Always from an empty context: tokenrelay never makes a span current, so nothing
        # ambient can become a parent by accident.
        if parent is not None:
            ctx = self._trace.set_span_in_context(parent, self._new_context())
        else:
            ctx = self._propagator.extract(carrier or {}, context=self._new_context())
        return self._tracer.start_span(name, context=ctx, kind=self._trace.SpanKind[kind.upper()],
                                       attributes=attributes)

    def inject(self, span: Any) -> dict[str, str]:
        """The W3C carrier (traceparent, tracestate) naming `span` as the parent."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span, self._new_context()))
        return carrier

    def set_error(self, span: Any, description: str) -> None:
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, description))

    @staticmethod
    def trace_id(span: Any) -> str:
        """The span's trace id as 32 hex digits (as in a traceparent)."""
        return format(span.get_span_context().trace_id, "032x")

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export every ended span now; False if that took longer than timeout_s."""
        return self._provider is None or bool(self._provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        """Export what is left and stop the exporter (blocks up to its export timeout)."""
        provider, self._provider = self._provider, None  # spans started later are dropped
        if provider is not None:
            provider.shutdown()
