"""The worker's Redis plumbing: connection, publisher thread, abort listener.

`Publisher` is the only writer of token events: one FIFO thread, so the events
of one request leave in order, and each round is ONE pipelined round trip (per
request one HSET of its logged events and progress into its record, XACK+XDEL
of finished entries, per request one PUBLISH of a `TokenEventBatch` on its
channel, the heartbeat when due). A failed round is resent until Redis answers
(the gateway drops duplicates by `seq`). Key names and delivery guarantees are
in `protos/keys.py`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from protos.keys import Heartbeat, Record
from protos.redis_conn import Backoff, sync_client
from protos.tokenrelay.v1 import queue_pb2
from worker.config import WorkerConfig

log = logging.getLogger(__name__)

CLOSE_FLUSH_TIMEOUT_S = 5.0  # how long a stopping worker keeps trying to publish its last events


def connect(config: WorkerConfig) -> redis.Redis:
    """A client that fails fast (no hidden retries): the loops below own the retrying."""
    return sync_client(config.redis_url, config.redis_timeout_s)


@dataclass
class Outbox:
    """One round's writes: per request its record's new fields (logged events, progress) and
    its events to publish, entries to acknowledge, records whose TTL to shorten."""

    events: dict[str, list[queue_pb2.TokenEvent]] = field(default_factory=dict)  # channel -> events
    records: dict[str, dict[str, bytes]] = field(default_factory=dict)  # record key -> fields to set
    acks: dict[str, list[bytes]] = field(default_factory=dict)  # request stream -> entry ids
    expires: dict[str, int] = field(default_factory=dict)  # record key -> TTL in ms

    def add(self, channel: str, event: queue_pb2.TokenEvent) -> None:
        self.events.setdefault(channel, []).append(event)

    def log(self, record: str, event: queue_pb2.TokenEvent, progress: bytes | None) -> None:
        """Log the event in the request's record (with the progress after it)."""
        fields = self.records.setdefault(record, {})
        fields[Record.event(event.seq)] = event.SerializeToString()
        if progress is not None:
            fields[Record.PROGRESS] = progress
        if event.HasField("final"):
            fields[Record.FINAL] = str(event.seq).encode()

    def ack(self, stream: str, entry_id: bytes) -> None:
        self.acks.setdefault(stream, []).append(entry_id)

    def end(self, stream: str, entry_id: bytes, record: str, ttl_ms: int) -> None:
        """The attempt ended: acknowledge its entry, keep its record for ttl_ms."""
        self.ack(stream, entry_id)
        self.expires[record] = ttl_ms

    def merge(self, other: Outbox) -> None:
        for channel, events in other.events.items():
            self.events.setdefault(channel, []).extend(events)
        for record, fields in other.records.items():
            self.records.setdefault(record, {}).update(fields)  # the later progress knows more
        for stream, entry_ids in other.acks.items():
            self.acks.setdefault(stream, []).extend(entry_ids)
        self.expires.update(other.expires)

    def __bool__(self) -> bool:
        return bool(self.events or self.records or self.acks or self.expires)


class Publisher:
    """Background thread sending outboxes and heartbeats, one pipeline per round.

    `unheard()` returns the channels whose PUBLISH reached no subscriber since the last
    call: nobody follows those requests any more (the consumer parks them).
    """

    def __init__(self, client: redis.Redis, config: WorkerConfig,
                 on_error: Callable[[], None] | None = None) -> None:
        """on_error: called (on this thread) for every failed round."""
        self._client, self._config, self._keys = client, config, config.keys
        self._on_error = on_error
        self._queue: queue.Queue[Outbox | None] = queue.Queue()
        self._load: dict[str, str] = {}
        self._sent_load: dict[str, str] = {}
        self._give_up_at = float("inf")
        self._unheard: deque[str] = deque()
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, outbox: Outbox) -> None:
        self._queue.put(outbox)

    def set_load(self, load: dict[str, str]) -> None:
        """The latest heartbeat fields; a change of an event field is published with the next round."""
        self._load = load

    def unheard(self) -> set[str]:
        channels = set()
        while self._unheard:
            channels.add(self._unheard.popleft())
        return channels

    def close(self) -> None:
        """Send what is queued (trying for at most CLOSE_FLUSH_TIMEOUT_S), drop the heartbeat."""
        self._give_up_at = time.monotonic() + CLOSE_FLUSH_TIMEOUT_S
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        next_heartbeat = 0.0
        closing = False
        while not closing:
            timeout = max(0.0, next_heartbeat - time.monotonic())
            try:
                first = self._queue.get(timeout=timeout)
            except queue.Empty:
                first = Outbox()
            outbox, closing = self._collect(first)
            changed = any(self._load.get(k) != self._sent_load.get(k) for k in Heartbeat.EVENTS)
            heartbeat = time.monotonic() >= next_heartbeat or changed
            self._send(outbox, heartbeat=heartbeat and not closing, delete_heartbeat=closing)
            if heartbeat:
                next_heartbeat = time.monotonic() + self._config.heartbeat_interval_s

    def _collect(self, first: Outbox | None) -> tuple[Outbox, bool]:
        """Merge everything already queued, so a backlog goes out as one pipeline."""
        outbox, closing = Outbox(), first is None
        if first is not None:
            outbox.merge(first)
        while not closing:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                closing = True
            else:
                outbox.merge(item)
        return outbox, closing

    def _send(self, outbox: Outbox, *, heartbeat: bool, delete_heartbeat: bool) -> None:
        backoff = Backoff(self._config.max_backoff_s)
        load = self._load
        while True:
            try:
                pipe, first_publish = self._pipeline(outbox, load if heartbeat else None, delete_heartbeat)
                # A command Redis refuses (XACK after a restart lost the group) must not hold
                # back the rest: only connection errors raise here and are retried.
                replies = pipe.execute(raise_on_error=False)
                self._sent_load = load if heartbeat else self._sent_load
                break
            except redis.RedisError as e:
                if self._on_error is not None:
                    self._on_error()
                if time.monotonic() > self._give_up_at:
                    log.error("dropping %d channels of events: Redis unreachable at shutdown (%s)",
                              len(outbox.events), e)
                    return
                delay = backoff.failed()
                log.warning("publish failed (%s); retrying in %.2fs", e, delay)
                time.sleep(delay)  # nothing else for this thread to do until Redis answers
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                log.warning("Redis refused a command of the publish pipeline: %s", reply)
        receivers = replies[first_publish:first_publish + len(outbox.events)]  # one PUBLISH per channel
        self._unheard.extend(ch for ch, n in zip(outbox.events, receivers, strict=True) if n == 0)

    def _pipeline(self, outbox: Outbox, load: dict[str, str] | None,
                  delete_heartbeat: bool) -> tuple[Any, int]:
        """Records (log + progress), then acknowledgements, then PUBLISHes, then the heartbeat:
        an event is in the record before anyone hears of it, and an entry leaves the stream
        only after its final is logged (protos/keys.py). Returns the pipeline and the index
        of its first PUBLISH."""
        pipe = self._client.pipeline(transaction=False)
        for record, logged in outbox.records.items():
            pipe.hset(record, mapping=logged)  # type: ignore[arg-type]  # (narrow stub)
        for stream, entry_ids in outbox.acks.items():
            pipe.xack(stream, self._keys.group, *entry_ids)
            pipe.xdel(stream, *entry_ids)
        for record, ttl_ms in outbox.expires.items():
            pipe.pexpire(record, ttl_ms)
        worker_id = self._config.worker_id
        first_publish = len(pipe.command_stack)
        for channel, events in outbox.events.items():
            pipe.publish(channel, queue_pb2.TokenEventBatch(worker_id=worker_id, events=events)
                         .SerializeToString())
        key = self._keys.worker(worker_id)
        if load is not None:
            beat: dict[Any, Any] = {**load, Heartbeat.HEARTBEAT_UNIX: repr(time.time())}  # (narrow stub)
            pipe.hset(key, mapping=beat)
            pipe.pexpire(key, int(self._config.heartbeat_ttl_s * 1000))
        if delete_heartbeat:
            pipe.delete(key)
        return pipe, first_publish


class AbortListener:
    """Background thread collecting (request id, entry id) pairs from the abort channel."""

    def __init__(self, client: redis.Redis, config: WorkerConfig) -> None:
        self._client, self._config = client, config
        self._ids: deque[tuple[str, bytes]] = deque()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aborts", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join()

    def drain(self) -> list[tuple[str, bytes]]:
        """(request id, entry id) of the attempts aborted since the last call; an empty
        entry id means every attempt of that request id."""
        ids = []
        while self._ids:
            ids.append(self._ids.popleft())
        return ids

    def _on_message(self, data: bytes) -> None:
        try:
            abort = queue_pb2.Abort.FromString(data)
            self._ids.append((abort.request_id, abort.entry_id))
        except Exception:  # a foreign publisher must not kill the listener
            log.error("ignoring unreadable message on the abort channel")

    def _run(self) -> None:
        backoff = Backoff(self._config.max_backoff_s)
        while not self._closed.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self._config.keys.aborts)
                backoff.reset()
                while not self._closed.is_set():
                    message = pubsub.get_message(timeout=0.2)
                    if message is not None and message["type"] == "message":
                        self._on_message(message["data"])
            except redis.RedisError as e:
                # Aborts sent meanwhile are missed; queued ones are still caught by
                # the {p}:aborted key when claimed, running ones run to max_tokens.
                log.warning("abort subscription lost (%s); resubscribing", e)
                self._closed.wait(backoff.failed())
            finally:
                pubsub.close()
