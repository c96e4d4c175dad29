"""The gateway's spans of one Generate call (protos/tracing.py has the setup and the trace's path).

SERVER `Generate` around the whole call, its parent the caller's `traceparent` (or a new
trace); PRODUCER `enqueue` around the attach (the XADD), whose context goes into
`QueuedRequest.trace_context` for the worker to continue. With tracing off a call costs
one scan of its metadata: the caller's traceparent/tracestate travel on as they came,
so a worker that traces still joins the caller's trace, and the logs name it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from gateway.errors import GatewayError
from protos.convert import finish_reason_from_pb, usage_from_pb
from protos.params import SamplingParams
from protos.tokenrelay.v1 import generate_pb2, queue_pb2
from protos.tracing import GenAI, Tracing, carrier_of, request_attributes, trace_id_of, usage_attributes

GRPC_STATUS_CODE = "rpc.grpc.status_code"


class CallTrace:
    def __init__(self, tracing: Tracing, metadata: Iterable[tuple[str, str | bytes]] | None,
                 service: str) -> None:
        self._tracing = tracing
        self._incoming = carrier_of(metadata)
        self._span: Any = None
        if tracing.is_enabled:
            self._span = tracing.start_span("Generate", "server", carrier=self._incoming, attributes={
                "rpc.system": "grpc", "rpc.service": service, "rpc.method": "Generate"})
        # What the logs name: this call's trace, or with tracing off the caller's.
        self.trace_id = tracing.trace_id(self._span) if self._span else trace_id_of(self._incoming)

    def describe(self, request_id: str, params: SamplingParams) -> None:
        if self._span is not None:
            self._span.set_attributes(request_attributes(request_id, params))

    @contextmanager
    def enqueue(self, queued: queue_pb2.QueuedRequest) -> Iterator[None]:
        """Around the attach: a PRODUCER span whose context `queued` carries to the worker."""
        if self._span is None:
            queued.trace_context.update(self._incoming)
            yield
            return
        span = self._tracing.start_span("enqueue", "producer", parent=self._span, attributes={
            GenAI.REQUEST_ID: queued.request_id, "messaging.system": "redis",
            "messaging.operation.type": "send"})
        queued.trace_context.update(self._tracing.inject(span))
        try:
            yield
        except GatewayError as e:
            self._tracing.set_error(span, f"{e.code.name}: {e}")
            raise
        finally:
            span.end()

    def observe(self, responses: AsyncIterator[generate_pb2.GenerateResponse],
                ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The call's responses, ending the SERVER span with the final's attributes or the
        error; the same iterator, untouched, with tracing off."""
        return responses if self._span is None else self._observe(responses)

    async def _observe(self, responses: AsyncIterator[generate_pb2.GenerateResponse],
                       ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        span, started = self._span, time.monotonic()
        try:
            async for response in responses:
                if response.HasField("final"):
                    final = response.final
                    span.set_attributes(usage_attributes(
                        usage_from_pb(final.usage) if final.HasField("usage") else None,
                        finish_reason_from_pb(final.finish_reason)))
                    span.set_attributes({GenAI.LATENCY_E2E: time.monotonic() - started, GRPC_STATUS_CODE: 0,
                                         "tokenrelay.worker_id": final.worker_id})
                yield response
        except GatewayError as e:
            span.set_attribute(GRPC_STATUS_CODE, e.code.value[0])
            self._tracing.set_error(span, f"{e.code.name}: {e}")
            raise
        except asyncio.CancelledError:  # the caller went away (or its deadline passed): not our error
            span.set_attribute("tokenrelay.cancelled", True)
            raise
        finally:
            span.end()
