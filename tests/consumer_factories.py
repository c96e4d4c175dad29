"""Redis-side helpers of the consumer tests: a caller without a gateway (`Replies`), and entries
enqueued as a gateway would."""

from __future__ import annotations

import time

import redis

from protos.convert import build_request
from protos.keys import STREAM_DATA_FIELD, Keys, Record
from protos.tokenrelay.v1 import queue_pb2


class Replies:
    """A caller's side without a gateway: follow requests (their presence channels, and every
    worker's out channel for the events), collect their events."""

    def __init__(self, client: redis.Redis) -> None:
        self._pubsub = client.pubsub()
        self._followed: set[str] = set()

    def follow(self, keys: Keys, *request_ids: str) -> None:
        """Subscribe (and wait for Redis to confirm) before the requests are enqueued."""
        self._followed |= set(request_ids)
        self._pubsub.psubscribe(keys.out_pattern)
        self._pubsub.subscribe(*(keys.events(r) for r in request_ids))
        confirmed = 0
        while confirmed < len(request_ids) + 1:  # nothing is enqueued yet: only confirmations come
            message = self._pubsub.get_message(timeout=5)
            assert message is not None, "subscription not confirmed"
            confirmed += message["type"] in ("subscribe", "psubscribe")

    def __call__(self, num_requests: int, timeout: float = 60) -> dict[str, list[queue_pb2.TokenEvent]]:
        """Events per request id until `num_requests` requests ended (final or error)."""
        events: dict[str, list[queue_pb2.TokenEvent]] = {}
        num_ended, deadline = 0, time.monotonic() + timeout
        while num_ended < num_requests:
            assert time.monotonic() < deadline, f"only {num_ended} of {num_requests} requests ended"
            message = self._pubsub.get_message(timeout=0.5)
            if message is None or message["type"] != "pmessage":
                continue
            for event in queue_pb2.TokenEventBatch.FromString(message["data"]).events:
                if event.request_id not in self._followed:
                    continue
                events.setdefault(event.request_id, []).append(event)
                num_ended += event.WhichOneof("kind") != "chunk"
        return events

    def close(self) -> None:
        self._pubsub.close()


def enqueue(client: redis.Redis, keys: Keys, request_id: str, deadline_unix: float = 0.0,
            with_record: bool = False, **params: object) -> bytes:
    """XADD a request; with_record: and its record, as a gateway's ATTACH writes it."""
    request = build_request("Once upon a time", temperature=0.0, **params)
    queued = queue_pb2.QueuedRequest(request_id=request_id, request=request, result_ttl_s=60,
                                     enqueued_unix=time.time(), deadline_unix=deadline_unix)
    entry_id = client.xadd(keys.requests, {STREAM_DATA_FIELD: queued.SerializeToString()})
    if with_record:
        client.hset(keys.record(request_id), mapping={Record.DIGEST: "d", Record.ENTRY: entry_id,
                                                      Record.STREAM: keys.requests, Record.SEED: 1})
        client.expire(keys.record(request_id), 600)
    return entry_id


def kinds(events: list[queue_pb2.TokenEvent]) -> list[str]:
    return [str(e.WhichOneof("kind")) for e in events]
