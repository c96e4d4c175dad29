"""Deadlines are judged on Redis's clock: the entry id's time plus the caller's timeout."""

from __future__ import annotations

import time

from protos.keys import Keys
from protos.tokenrelay.v1 import queue_pb2
from worker.io.tracked import Tracked


def tracked_at(enqueued_ms: int, **fields: float) -> Tracked:
    request = queue_pb2.QueuedRequest(request_id="r", **fields)
    return Tracked.of(Keys("p"), "p:requests", f"{enqueued_ms}-0".encode(), request)


def test_a_timeout_counts_from_the_entry_ids_time_on_redis_clock() -> None:
    tracked = tracked_at(1_000_000, timeout_s=2.0, deadline_unix=1.0)  # a skewed gateway clock
    assert not tracked.is_past_deadline(redis_now=1_001.9)
    assert tracked.is_past_deadline(redis_now=1_002.1)


def test_without_a_timeout_an_older_gateways_deadline_applies() -> None:
    assert tracked_at(0, deadline_unix=time.time() - 1).is_past_deadline(redis_now=0)
    assert not tracked_at(0).is_past_deadline(redis_now=1e12)  # no deadline at all
