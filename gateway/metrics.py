"""The gateway's Prometheus metrics (protos/metrics.py has the endpoint and the buckets).

Per call: time to first token, the gaps between chunks, end-to-end latency and the
worker-reported queue time, token counts, and how the call ended; calls refused before
they got an answer are counted by reason. The counters carry the call's `tenant`
(--auth-tokens-file; empty when authentication is off), the histograms do not (a label
per tenant would multiply their buckets). Queue gauges are read from Redis by a
background task once a second, never by a scrape. The `grpc_server_*` family comes from
`GrpcMetricsInterceptor`, with the names and labels of go-grpc-prometheus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import RedisError

from gateway.errors import (
    FailedPrecondition,
    GatewayError,
    InvalidArgument,
    NotFound,
    OutOfRange,
    QueueFull,
    Unavailable,
    WorkerError,
)
from gateway.quotas import QuotaExceeded
from gateway.routing import Route
from protos.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from protos.tokenrelay.v1 import generate_pb2

RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0)

log = logging.getLogger(__name__)

QUEUE_READ_INTERVAL_S = 1.0
UNKNOWN_MODEL = "unknown"
_FINISH_REASONS = {v.number: v.name.removeprefix("FINISH_REASON_").lower()
                   for v in generate_pb2.FinishReason.DESCRIPTOR.values}


def rejection_reason(error: GatewayError) -> str:
    """The `reason` label of a call refused or failed before its final."""
    if isinstance(error, QueueFull):
        return "queue_full"
    if isinstance(error, QuotaExceeded):
        return "quota"
    if isinstance(error, InvalidArgument | FailedPrecondition | NotFound | OutOfRange):
        return "invalid"
    if isinstance(error, WorkerError) and error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "deadline"
    if isinstance(error, WorkerError):
        return "worker_" + error.code.name.lower()
    if isinstance(error, Unavailable):
        return "unavailable"
    return error.code.name.lower()


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        m = ["model"]
        # The default model (the one a request without `model` runs), read with the queue gauges:
        # the label of what happens before a call's model is known (a refused call).
        self.model = UNKNOWN_MODEL

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tokenrelay_{name}", doc, m, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"tokenrelay_{name}", doc, [*m, "tenant", *labels], registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenrelay_{name}", doc, m, registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time from the call to its first chunk.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two chunks of a call.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from the call to its final.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time a request waited in the queue "
                                    "(worker-reported).", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of answered calls.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for answered calls.")
        self.success = counter("request_success", "Calls answered with a final, by finish reason.",
                               "finished_reason")
        self.rejected = counter("requests_rejected", "Calls that ended with an error, by reason.", "reason")
        self.inflight = gauge("requests_inflight", "Calls open on this gateway.")
        self.queue_depth = gauge("queue_depth", "Requests in the queue not claimed by a worker yet.")
        self.queue_pending = gauge("queue_pending", "Requests claimed by workers and not finished.")
        self.routed = counter("routed_requests", "New requests by route: prefix (to the worker holding "
                              "their prefix), load (to the least loaded worker), shared (all full).", "route")
        self.route_moves = counter("route_moves", "Routed requests moved to the shared stream: their worker "
                                   "had not claimed them within --route-max-wait-ms, or, routed "
                                   "by load, it said it was full first.")
        # The two side by side show whether the workers' prefix indexes are stale: a routed request
        # predicted to match 90% of its prompt that finds 10% cached was a wasted preference.
        self.route_predicted = histogram(
            "route_predicted_overlap_ratio",
            "Routed requests: share of the prompt's prefix chunks the chosen worker's index held.",
            RATIO_BUCKETS)
        self.route_cached = histogram("route_cached_prompt_ratio", "Routed requests: cached_prompt_tokens / "
                                      "prompt_tokens the worker reported.", RATIO_BUCKETS)
        # Not by tenant: the router drops them before any call sees them; model is the default's.
        self.refused_events = Counter(
            "tokenrelay_refused_worker_events", "Token events a worker published for a request it does "
            "not hold: dropped (a worker taken over, or a misbehaving one).",
            m, registry=registry)
        self.refused_events.labels(self.model)  # exported at 0 from the start: an alert reads it
        # Not by tenant; model is the default's (a sweep covers every model).
        self.fenced = Counter("tokenrelay_workers_fenced", "Dead workers this gateway's sweeps fenced.",
                              m, registry=registry)
        self.requeued = Counter("tokenrelay_requests_requeued", "Requests of dead workers this gateway's "
                                "sweeps queued again (another worker resumes them).", m, registry=registry)
        for swept in (self.fenced, self.requeued):
            swept.labels(self.model)  # exported at 0 from the start: the dashboard reads them
        self.queue_oldest_age = gauge("queue_oldest_waiting_age_seconds",
                                      "Age of the oldest request not claimed yet (0 when none waits).")

    async def observe(self, responses: AsyncIterator[generate_pb2.GenerateResponse],
                      time_remaining: Callable[[], float | None], tenant: str = "",
                      call: CallModel | None = None) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Pass a call's responses through, timing them under the call's model (`call`, known once
        the call resolved it; before, the default model); count how it ended (a cancel by the
        caller is no rejection; a cancel because the call's deadline passed is)."""
        call = call or CallModel()
        start, last = time.monotonic(), None
        inflight = self.inflight.labels(call.name or self.model)  # the same series up and down
        inflight.inc()
        try:
            async for response in responses:
                now, model = time.monotonic(), call.name or self.model
                if response.HasField("chunk"):
                    if last is None:
                        self.ttft.labels(model).observe(now - start)
                    else:
                        self.itl.labels(model).observe(now - last)
                    last = now
                else:
                    self._observe_final(model, tenant, response.final, now - start)
                yield response
        except GatewayError as e:
            self.count_rejected(tenant, e, call.name)
            raise
        except asyncio.CancelledError:
            remaining = time_remaining()
            if remaining is not None and remaining <= 0:
                self.rejected.labels(call.name or self.model, tenant, "deadline").inc()
            raise
        finally:
            inflight.dec()

    def observe_route(self, model: str, route: Route, usage: generate_pb2.Usage) -> None:
        """A created request's final: how its route's prediction compares with what was cached."""
        if route.kind == "prefix" and usage.prompt_tokens:
            self.route_predicted.labels(model).observe(route.predicted_fraction)
            self.route_cached.labels(model).observe(usage.cached_prompt_tokens / usage.prompt_tokens)

    def count_refused_events(self, num_events: int) -> None:
        self.refused_events.labels(self.model).inc(num_events)

    def count_rejected(self, tenant: str, error: GatewayError, model: str = "") -> None:
        self.rejected.labels(model or self.model, tenant, rejection_reason(error)).inc()

    def _observe_final(self, model: str, tenant: str, final: generate_pb2.Final, e2e_s: float) -> None:
        self.e2e.labels(model).observe(e2e_s)
        self.queue_time.labels(model).observe(final.usage.queue_time_s)
        self.prompt_tokens.labels(model, tenant).inc(final.usage.prompt_tokens)
        self.generation_tokens.labels(model, tenant).inc(final.usage.completion_tokens)
        reason = _FINISH_REASONS.get(final.finish_reason, "unspecified")
        self.success.labels(model, tenant, reason).inc()

    async def read_queue(self, read: Callable[[], Awaitable[list[QueueGauges]]]) -> None:
        """Forever: every QUEUE_READ_INTERVAL_S, set each served model's queue gauges from read()."""
        while True:
            try:
                models = await read()
            except RedisError as e:
                log.debug("queue gauges not refreshed: %s", e)
            else:
                for g in models:
                    if g.is_default:
                        self.model = g.model
                    self.queue_depth.labels(g.model).set(g.queued)
                    self.queue_pending.labels(g.model).set(g.in_flight)
                    self.queue_oldest_age.labels(g.model).set(g.oldest_age_s)
                    for routed in (self.route_predicted, self.route_cached):  # zero series before any route
                        routed.labels(g.model)
            await asyncio.sleep(QUEUE_READ_INTERVAL_S)


@dataclass
class CallModel:
    """The model a call runs, once the gateway resolved it ("" before: the default's label)."""

    name: str = ""


@dataclass(frozen=True)
class QueueGauges:
    """One served model's queue, as the gauges show it."""

    model: str
    queued: int
    in_flight: int
    oldest_age_s: float
    is_default: bool


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """grpc_server_started_total / handled_total{grpc_code} / msg_sent_total / msg_received_total."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]

        def counter(name: str, doc: str, *more: str) -> Counter:
            return Counter(f"grpc_server_{name}", doc, [*labels, *more], registry=registry)

        self.started = counter("started", "RPCs started on the server.")
        self.handled = counter("handled", "RPCs completed on the server, by status code.", "grpc_code")
        self.sent = counter("msg_sent", "Stream messages sent by the server.")
        self.received = counter("msg_received", "Stream messages received by the server.")

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        service, _, method = details.method.lstrip("/").rpartition("/")  # type: ignore[attr-defined]
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, ("server_stream", service, method)),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, ("unary", service, method)),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler  # streaming requests: none in this API

    def _wrap_stream(self, behavior: Any, labels: tuple[str, str, str]) -> Any:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with self._counted(labels, context):
                async for response in behavior(request, context):
                    self.sent.labels(*labels).inc()
                    yield response
        return wrapped

    def _wrap_unary(self, behavior: Any, labels: tuple[str, str, str]) -> Any:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self._counted(labels, context):
                response = await behavior(request, context)
                self.sent.labels(*labels).inc()
                return response
        return wrapped

    @contextlib.contextmanager
    def _counted(self, labels: tuple[str, str, str], context: grpc.aio.ServicerContext) -> Iterator[None]:
        """started and received on entry; handled with the call's status code on exit."""
        self.started.labels(*labels).inc()
        self.received.labels(*labels).inc()
        code = grpc.StatusCode.OK
        try:
            yield
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except BaseException:
            code = _code_of(context, grpc.StatusCode.UNKNOWN)
            raise
        finally:
            self.handled.labels(*labels, _code_of(context, code).name).inc()


def _code_of(context: grpc.aio.ServicerContext, default: grpc.StatusCode) -> grpc.StatusCode:
    """The code the handler set (context.abort sets it before raising), else `default`."""
    code = context.code()
    if code is None:
        return default
    if isinstance(code, grpc.StatusCode):
        return code
    return next((c for c in grpc.StatusCode if c.value[0] == code), default)
