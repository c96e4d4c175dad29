"""The worker's Redis plumbing: connection, publisher thread, abort listener.

`Publisher` is the only writer of token events: one FIFO thread, so the events
of one request leave in order, and each round is ONE pipelined round trip (one
PUBLISH of a `TokenEventBatch` per reply channel, XACK+XDEL of finished
entries, the heartbeat when due). A failed round is resent until Redis answers
(the gateway drops duplicates by `seq`). Key names and delivery guarantees are
in `protos/keys.py`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.retry import Retry

from protos.keys import Heartbeat
from protos.redis_conn import Backoff, client_options
from protos.tokenrelay.v1 import queue_pb2
from worker.config import WorkerConfig

log = logging.getLogger(__name__)

CLOSE_FLUSH_TIMEOUT_S = 5.0  # how long a stopping worker keeps trying to publish its last events


def connect(config: WorkerConfig) -> redis.Redis:
    """A client that fails fast (no hidden retries): the loops below own the retrying."""
    return redis.Redis.from_url(config.redis_url, **client_options(Retry, config.redis_timeout_s))


@dataclass
class Outbox:
    """Events per reply channel, progress per running entry, entries to acknowledge."""

    events: dict[str, list[queue_pb2.TokenEvent]] = field(default_factory=dict)
    progress: dict[bytes, bytes] = field(default_factory=dict)  # entry id -> queue.Progress bytes
    acks: list[bytes] = field(default_factory=list)

    def add(self, channel: str, event: queue_pb2.TokenEvent) -> None:
        self.events.setdefault(channel, []).append(event)

    def ack(self, entry_id: bytes) -> None:
        self.acks.append(entry_id)
        self.progress.pop(entry_id, None)  # acknowledged: its progress is deleted, not written

    def merge(self, other: Outbox) -> None:
        for channel, events in other.events.items():
            self.events.setdefault(channel, []).extend(events)
        self.progress.update(other.progress)  # the later step knows more
        for entry_id in other.acks:
            self.ack(entry_id)

    def __bool__(self) -> bool:
        return bool(self.events or self.progress or self.acks)


class Publisher:
    """Background thread sending outboxes and heartbeats, one pipeline per round."""

    def __init__(self, client: redis.Redis, config: WorkerConfig) -> None:
        self._client, self._config, self._keys = client, config, config.keys
        self._queue: queue.Queue[Outbox | None] = queue.Queue()
        self._load: dict[str, str] = {}
        self._sent_load: dict[str, str] = {}
        self._give_up_at = float("inf")
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, outbox: Outbox) -> None:
        self._queue.put(outbox)

    def set_load(self, load: dict[str, str]) -> None:
        """The latest heartbeat fields; a change of an event field is published with the next round."""
        self._load = load

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
                self._pipeline(outbox, load if heartbeat else None, delete_heartbeat).execute()
                self._sent_load = load if heartbeat else self._sent_load
                return
            except redis.RedisError as e:
                if time.monotonic() > self._give_up_at:
                    log.error("dropping %d channels of events: Redis unreachable at shutdown (%s)",
                              len(outbox.events), e)
                    return
                delay = backoff.failed()
                log.warning("publish failed (%s); retrying in %.2fs", e, delay)
                time.sleep(delay)  # nothing else for this thread to do until Redis answers

    def _pipeline(self, outbox: Outbox, load: dict[str, str] | None, delete_heartbeat: bool) -> Any:
        pipe = self._client.pipeline(transaction=False)
        worker_id = self._config.worker_id
        for channel, events in outbox.events.items():
            pipe.publish(channel, queue_pb2.TokenEventBatch(worker_id=worker_id, events=events)
                         .SerializeToString())
        if outbox.progress:
            # After the events it describes: a resume may repeat an event (dropped by
            # seq at the gateway), never skip one.
            pipe.hset(self._keys.progress, mapping=outbox.progress)  # type: ignore[arg-type]
        if outbox.acks:
            # Acked only here, after the final event is out: see protos/keys.py.
            pipe.xack(self._keys.requests, self._keys.group, *outbox.acks)
            pipe.xdel(self._keys.requests, *outbox.acks)
            pipe.hdel(self._keys.progress, *outbox.acks)
        key = self._keys.worker(worker_id)
        if load is not None:
            fields: dict[Any, Any] = {**load, Heartbeat.HEARTBEAT_UNIX: repr(time.time())}  # (narrow stub)
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, int(self._config.heartbeat_ttl_s * 1000))
        if delete_heartbeat:
            pipe.delete(key)
        return pipe


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
