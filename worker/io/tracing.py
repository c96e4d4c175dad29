"""The worker's span of each attempt it admits (protos/tracing.py has the setup and the trace's path).

A CONSUMER span `process` from admission to the attempt's end on this worker: its
final, an error, parked (nobody follows it), handed over at shutdown. Its parent is
the gateway's enqueue span, named by `QueuedRequest.trace_context`; a re-admission
(after parking, or by another worker) is a new span in the same trace. Claiming
creates no span: an XREADGROUP that finds nothing costs nothing. With tracing off
every method returns at once (`Tracked.span` stays None).
"""

from __future__ import annotations

from typing import Any

from protos.convert import params_from_pb
from protos.logs import request_fields
from protos.tokenrelay.v1 import queue_pb2
from protos.tracing import GenAI, Tracing, request_attributes, trace_id_of, usage_attributes
from worker.engine.outputs import RequestOutput
from worker.io.tracked import Tracked


class RequestSpans:
    def __init__(self, tracing: Tracing, worker_id: str) -> None:
        self.tracing, self.worker_id = tracing, worker_id

    def admitted(self, tracked: Tracked) -> None:
        if not self.tracing.is_enabled:
            return
        qr = tracked.request
        attributes: dict[str, Any] = {
            GenAI.REQUEST_ID: qr.request_id, "messaging.system": "redis",
            "messaging.operation.type": "process", "messaging.destination.name": tracked.stream,
            "messaging.message.id": tracked.entry_id.decode(), "tokenrelay.worker_id": self.worker_id,
            "tokenrelay.resumed_tokens": len(tracked.token_ids)}
        try:
            attributes |= request_attributes(qr.request_id, params_from_pb(qr.request)[1])
        except ValueError:
            pass  # the admission refuses it, and says why in the span's status
        tracked.span = self.tracing.start_span("process", "consumer", carrier=qr.trace_context,
                                               attributes=attributes)

    def finished(self, tracked: Tracked, out: RequestOutput) -> None:
        """Its final: usage and finish reason (an engine error also as the span's status)."""
        if (span := _take(tracked)) is None:
            return
        span.set_attributes(usage_attributes(out.usage, out.finish_reason))
        if out.error:
            self.tracing.set_error(span, out.error)
        span.end()

    def failed(self, tracked: Tracked, code: queue_pb2.ErrorCode, message: str) -> None:
        if (span := _take(tracked)) is not None:
            self.tracing.set_error(span, f"{queue_pb2.ErrorCode.Name(code)}: {message}")
            span.end()

    def left(self, tracked: Tracked, outcome: str) -> None:
        """It left this worker unfinished: "parked", "handed over", ..."""
        if (span := _take(tracked)) is not None:
            span.set_attribute("tokenrelay.outcome", outcome)
            span.end()

    def log_fields(self, tracked: Tracked) -> dict[str, str]:
        """The `extra=` of a log line about `tracked` (protos/logs.py)."""
        trace_id = (self.tracing.trace_id(tracked.span) if tracked.span is not None
                    else trace_id_of(tracked.request.trace_context))
        return request_fields(tracked.request_id, worker=self.worker_id, trace_id=trace_id)


def _take(tracked: Tracked) -> Any:
    """Its span, once: whoever ends it first clears it."""
    span, tracked.span = tracked.span, None
    return span
