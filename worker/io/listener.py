"""The worker's subscriptions: the abort channel every worker hears (queue.Abort hints) and its
model's control channel (a message: re-read the adapters hash, worker/io/adapters.py)."""

from __future__ import annotations

import logging
import threading
from collections import deque

import redis

from protos.redis_conn import Backoff
from protos.tokenrelay.v1 import queue_pb2
from worker.config import WorkerConfig

log = logging.getLogger(__name__)


class AbortListener:
    """Background thread collecting (request id, entry id) pairs from the abort channel, and
    noting any message on the model's control channel (`adapters_changed`: re-read the adapters
    hash, worker/io/adapters.py); set at each (re)subscription too, as messages sent while
    unsubscribed are lost."""

    def __init__(self, client: redis.Redis, config: WorkerConfig) -> None:
        self._client, self._config = client, config
        self._ids: deque[tuple[str, bytes]] = deque()
        self.adapters_changed = threading.Event()
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
                keys = self._config.keys
                control = keys.control(keys.model).encode()
                pubsub.subscribe(keys.aborts, control)
                self.adapters_changed.set()
                backoff.reset()
                while not self._closed.is_set():
                    message = pubsub.get_message(timeout=0.2)
                    if message is not None and message["type"] == "message":
                        if message["channel"] == control:
                            self.adapters_changed.set()
                        else:
                            self._on_message(message["data"])
            except redis.RedisError as e:
                # Aborts sent meanwhile are missed; queued ones are still caught by
                # the {p}:aborted key when claimed, running ones run to max_tokens.
                log.warning("abort subscription lost (%s); resubscribing", e)
                self._closed.wait(backoff.failed())
            finally:
                pubsub.close()
