"""The requests one worker holds, and what each step writes for them.

A claimed request is running (in the engine) or parked (its caller left: nothing computes it
until a caller follows it again, or the grace ends). `HeldRequests` admits requests into the
engine, turns the engine's outputs into chunks and finals, and ends attempts; every write goes
into the round's `Outbox`, which the consumer hands to the publisher thread once a step
(worker/io/consumer.py). The loop, claiming and Redis I/O stay in the consumer; this module
decides what happens to each request.
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import Any, Protocol

from protos.convert import chunk_to_pb, finish_reason_to_pb, params_from_pb, usage_to_pb
from protos.keys import LogField
from protos.params import FinishReason, PromptInput, SamplingParams
from protos.tokenrelay.v1 import generate_pb2, queue_pb2
from worker.config import WorkerConfig
from worker.engine.outputs import Admitted, RequestOutput, Resume
from worker.io.metrics import WorkerMetrics
from worker.io.parking import ParkingLot
from worker.io.redis_io import Heartbeat, Outbox
from worker.io.tracing import RequestSpans
from worker.io.tracked import Tracked

log = logging.getLogger(__name__)

ErrorCode = queue_pb2.ErrorCode


class TextEngineProtocol(Protocol):
    """What the worker's Redis side needs from `worker.engine.text_engine.TextEngine`."""

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams, *,
                    arrival_time: float | None = None, resume: Resume | None = None,
                    cache_scope: bytes = b"", adapter: str = "") -> Admitted: ...
    @property
    def adapters(self) -> tuple[str, ...]: ...
    def load_adapter(self, name: str, path: str) -> None: ...
    def unload_adapter(self, name: str) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> Any: ...


class HeldRequests:
    """Running and parked requests by entry key, and the writes of the round being built."""

    def __init__(self, engine: TextEngineProtocol, config: WorkerConfig, spans: RequestSpans,
                 heartbeat: Heartbeat, metrics: WorkerMetrics | None) -> None:
        self._engine, self._config, self._spans = engine, config, spans
        self._heartbeat, self._metrics = heartbeat, metrics
        self.running: dict[str, Tracked] = {}
        self.parked = ParkingLot(config.reattach_grace_s, config.max_parked)
        self.outbox = Outbox()
        self._expiring: list[tuple[float, list[str]]] = []  # heap: (monotonic, log fields of a result)
        self.num_finished = 0

    def take_outbox(self) -> Outbox:
        """The round's writes; the next round starts empty."""
        outbox, self.outbox = self.outbox, Outbox()
        return outbox

    def admit(self, tracked: Tracked) -> None:
        """Run a request this worker owns: new, resumed from its logged chunks, or unparked."""
        qr = tracked.request
        self._spans.admitted(tracked)
        if tracked.is_past_deadline(self._heartbeat.redis_now()):
            return self.reject(tracked, ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED,
                               "the deadline passed while the request was queued")
        if tracked.key in self.running or tracked.key in self.parked:  # this worker holds it already
            log.error("entry %s of request %s claimed twice; ignoring the second claim", tracked.key,
                      qr.request_id, extra=self._spans.log_fields(tracked))
            return self._spans.left(tracked, "claimed twice")
        progress = tracked.record if tracked.record.worker_id else None
        resume = None if progress is None else Resume(tuple(tracked.token_ids), progress.seed,
                                                      progress.first_token_unix)
        adapter = qr.request.adapter
        if adapter and adapter not in self._engine.adapters:  # unloaded since the gateway looked
            return self.reject(tracked, ErrorCode.ERROR_CODE_NOT_FOUND,
                               f"adapter {adapter!r} is not loaded on worker {self._config.worker_id} "
                               f"(model {self._config.model_name}; loaded: "
                               f"{', '.join(self._engine.adapters) or 'none'})")
        try:
            prompt, params = params_from_pb(qr.request)
            admitted = self._engine.add_request(tracked.key, prompt, params,
                                                arrival_time=qr.enqueued_unix or None, resume=resume,
                                                cache_scope=qr.cache_scope, adapter=adapter)
        except ValueError as e:  # bad field, or prompt + max_tokens longer than the context
            return self.reject(tracked, ErrorCode.ERROR_CODE_INVALID_ARGUMENT, str(e))
        except Exception as e:
            log.exception("add_request failed for %s", qr.request_id, extra=self._spans.log_fields(tracked))
            return self.reject(tracked, ErrorCode.ERROR_CODE_INTERNAL, f"worker error: {e}")
        if (tracked.record.seed, tracked.record.worker_id) != (admitted.seed, self._config.worker_id):
            tracked.record.seed, tracked.record.worker_id = admitted.seed, self._config.worker_id
            self.outbox.progress[qr.request_id] = tracked.progress()
        # billed once the worker knows it, even if the caller leaves; the gateways check this worker now
        self.outbox.admitted[qr.request_id] = admitted.num_prompt_tokens
        if admitted.text:
            tracked.text_parts.append(admitted.text)
        self._heartbeat.log_ttl_ms = max(self._heartbeat.log_ttl_ms, tracked.result_ttl_ms)
        self.running[tracked.key] = tracked
        log.debug("request %s: running entry %s", qr.request_id, tracked.key,
                  extra=self._spans.log_fields(tracked))

    def reject(self, tracked: Tracked, code: queue_pb2.ErrorCode, message: str) -> None:
        self._spans.failed(tracked, code, message)
        self.outbox.publish(tracked.error_event(code, message))
        self.end(tracked)

    def park(self, tracked: Tracked) -> None:
        if not self.parked.park(tracked):
            log.warning("request %s: %d requests parked already (--max-parked); abandoned",
                        tracked.request_id, len(self.parked), extra=self._spans.log_fields(tracked))
            self.end(tracked)

    def end(self, tracked: Tracked, final_seq: int | None = None) -> None:
        """The attempt ended: release and acknowledge it; its log goes after the result TTL."""
        self.outbox.end(tracked.request_id, tracked.record_key, tracked.stream, tracked.entry_id, final_seq)
        fields = LogField.all_of(tracked.request_id, tracked.seq)
        heapq.heappush(self._expiring, (time.monotonic() + tracked.result_ttl_ms / 1000, fields))

    def expire(self, now: float) -> None:
        """Drop the logs of results older than their TTL (monotonic `now`) in this round."""
        while self._expiring and self._expiring[0][0] <= now:
            self.outbox.drops += heapq.heappop(self._expiring)[1]

    def emit(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs: chunks when due (stream_interval), finals, and what ended."""
        for out in outputs:
            tracked = self.running.get(out.request_id)
            if tracked is None:
                continue
            if not tracked.is_handed_off:  # (a handed-off request's new owner writes its chunks)
                if out.token_ids or out.text:
                    tracked.hold(out.token_ids, out.text, out.logprobs)
                if tracked.is_chunk_due(is_ending=out.finished):
                    self._log_chunk(tracked)
            if out.finished:
                self._finish(out, tracked)

    def _log_chunk(self, tracked: Tracked) -> None:
        """What the request generated since its last chunk, as its next chunk (stream_interval:
        tokens held until a chunk is due; unlogged ones die with the worker and are generated
        again by the next attempt, which resumes after the logged chunks)."""
        token_ids, text, logprobs = tracked.take_held()
        chunk = chunk_to_pb(tracked.seq, token_ids, text, logprobs)
        tracked.text_parts.append(text)
        tracked.token_ids.extend(token_ids)
        if not tracked.record.first_token_unix:
            tracked.record.first_token_unix = time.time()
            self.outbox.progress[tracked.request_id] = tracked.progress()
        self.outbox.log(tracked.event(chunk=chunk))

    def _finish(self, out: RequestOutput, tracked: Tracked) -> None:
        del self.running[out.request_id]
        if out.finish_reason is FinishReason.ABORT:
            if tracked.is_handed_off:
                return self._spans.left(tracked, "handed over")
            if tracked.is_parking:
                self._spans.left(tracked, "parked")
                return self.park(tracked)
        self.num_finished += 1
        if tracked.error is not None and out.finish_reason is FinishReason.ABORT:
            code, message = tracked.error
            return self.reject(tracked, code, message)
        if out.is_invalid_request:  # its format does not compile: a status, like a bad field
            return self.reject(tracked, ErrorCode.ERROR_CODE_INVALID_ARGUMENT, out.error or "invalid format")
        assert out.finish_reason is not None
        final = generate_pb2.Final(finish_reason=finish_reason_to_pb(out.finish_reason),
                                   text="".join(tracked.text_parts), error_message=out.error or "",
                                   worker_id=self._config.worker_id)
        if out.usage is not None:
            final.usage.CopyFrom(usage_to_pb(out.usage))
            if self._metrics is not None:
                self._metrics.observe_finished(out.usage)
        self._spans.finished(tracked, out)
        event = tracked.event(final=final)
        self.outbox.log(event)
        self.end(tracked, final_seq=event.seq)
