"""One attempt at a request that this worker claimed: what it streamed and where to."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from protos.keys import Keys
from protos.params import Logprobs
from protos.tokenrelay.v1 import queue_pb2

DEFAULT_RESULT_TTL_S = 300.0  # for entries of gateways that did not say (QueuedRequest.result_ttl_s)


@dataclass
class Tracked:
    """The engine knows it by `key`, stream and entry id (an id is unique in its stream only):
    one attempt per entry."""

    request: queue_pb2.QueuedRequest
    stream: str  # the request stream of its priority class
    entry_id: bytes
    channel: str  # the request's event channel
    record_key: str  # the request's record
    seq: int = 0  # of the next event; also the next chunk's index (chunks come before the final)
    text_parts: list[str] = field(default_factory=list)
    # What another worker or attempt needs to resume it besides the logged chunks (protos/keys.py).
    record: queue_pb2.Progress = field(default_factory=queue_pb2.Progress)
    # Every token so far, in memory only (the log holds them in its chunks): a resume's prefix.
    token_ids: list[int] = field(default_factory=list)
    # Set when the worker aborted it (deadline, shutdown): replaces the final event.
    error: tuple[queue_pb2.ErrorCode, str] | None = None
    # Aborted at shutdown for another worker to resume: no final event, no XACK.
    is_handed_off: bool = False
    # Aborted because nobody follows it: parked, not finished (worker/io/parking.py).
    is_parking: bool = False
    # The CONSUMER span of this admission (worker/io/tracing.py); None with tracing off.
    span: Any = None
    # Generated but not yet in a chunk (GenerateRequest.stream_interval): token ids, text, logprobs.
    held_ids: list[int] = field(default_factory=list)
    held_text: list[str] = field(default_factory=list)
    held_logprobs: list[Logprobs] | None = None

    @classmethod
    def of(cls, keys: Keys, stream: str, entry_id: bytes, request: queue_pb2.QueuedRequest,
           progress: queue_pb2.Progress | None = None,
           chunks: list[queue_pb2.TokenEvent] | None = None) -> Tracked:
        """chunks: the request's logged chunks, in seq order (a resume continues after them)."""
        tracked = cls(request, stream, entry_id, keys.events(request.request_id),
                      keys.record(request.request_id))
        if progress is not None:  # continue where the last worker's events stopped
            chunks = chunks or []
            tracked.record = progress
            tracked.seq = len(chunks)
            tracked.token_ids = [t for c in chunks for t in c.chunk.token_ids]
        return tracked

    def again(self) -> Tracked:
        """The same attempt, re-admitted after parking: it continues after what it streamed."""
        return Tracked(self.request, self.stream, self.entry_id, self.channel, self.record_key, self.seq,
                       record=self.record, token_ids=self.token_ids)

    @property
    def key(self) -> str:
        return f"{self.stream}/{self.entry_id.decode()}"

    def is_past_deadline(self, redis_now: float) -> bool:
        """redis_now: Redis's unix time (worker/io/redis_io.py estimates it from the heartbeat)."""
        if self.request.timeout_s:
            enqueued = int(self.entry_id.split(b"-")[0]) / 1000  # Redis's clock at the XADD
            return redis_now > enqueued + self.request.timeout_s
        return bool(self.request.deadline_unix) and time.time() > self.request.deadline_unix

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def result_ttl_ms(self) -> int:
        return int((self.request.result_ttl_s or DEFAULT_RESULT_TTL_S) * 1000)

    def event(self, **kind: Any) -> queue_pb2.TokenEvent:
        """The next event (a chunk or the final) of the request's stream. It carries no entry id:
        only errors are judged by attempt, and a chunk is logged and sent for every token."""
        self.seq += 1
        return queue_pb2.TokenEvent(request_id=self.request_id, seq=self.seq - 1, **kind)

    def error_event(self, code: queue_pb2.ErrorCode, message: str) -> queue_pb2.TokenEvent:
        """An error ends this attempt only, so it takes no seq: a later attempt continues at it."""
        error = queue_pb2.RequestError(code=code, message=message)
        return queue_pb2.TokenEvent(request_id=self.request_id, seq=self.seq, entry_id=self.entry_id,
                                    error=error)

    def progress(self) -> bytes:
        return self.record.SerializeToString()

    def hold(self, token_ids: list[int], text: str, logprobs: list[Logprobs] | None) -> None:
        """A step's new tokens, until the next chunk takes them."""
        self.held_ids += token_ids
        self.held_text.append(text)
        if logprobs is not None:
            self.held_logprobs = (self.held_logprobs or []) + logprobs

    def is_chunk_due(self, is_ending: bool) -> bool:
        """Whether what is held goes out now: the first token at once (the time to the first
        token is not delayed), then a chunk each time stream_interval tokens are held, and the
        rest when the attempt ends."""
        interval = max(1, self.request.request.stream_interval)  # 0 (unset) = every step
        return bool(self.held_ids or self.held_text) and (
            is_ending or not self.record.first_token_unix or len(self.held_ids) >= interval)

    def take_held(self) -> tuple[list[int], str, list[Logprobs] | None]:
        held = self.held_ids, "".join(self.held_text), self.held_logprobs
        self.held_ids, self.held_text, self.held_logprobs = [], [], None
        return held
