"""Re-claiming the requests of workers that died (see protos/keys.py, "Delivery guarantee").

Every worker calls `reclaim_dead_workers` about once a second while it has
free slots: consumers of the group whose heartbeat key expired are dead; their
entries idle longer than the heartbeat TTL are XCLAIMed together with the
progress the dead worker recorded, so the consumer can resume each stream
where it stopped. Dead consumers with nothing pending are deleted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import redis

from protos.keys import STREAM_DATA_FIELD
from protos.tokenrelay.v1 import queue_pb2
from worker.config import WorkerConfig

log = logging.getLogger(__name__)


@dataclass
class Claimed:
    """A stream entry this worker just took: new (XREADGROUP) or re-claimed from a dead worker."""

    entry_id: bytes
    request: queue_pb2.QueuedRequest | None  # None: unreadable
    num_deliveries: int = 1


def reclaim_dead_workers(client: redis.Redis, config: WorkerConfig, count: int) -> list[Claimed]:
    """Re-claim up to `count` entries of dead workers (heartbeat expired).

    XCLAIM's min-idle-time makes it safe against other workers sweeping at the
    same moment: once one of them claims an entry its idle time restarts, and
    the others' XCLAIM skips it.
    """
    keys, me = config.keys, config.worker_id
    try:
        consumers = client.xinfo_consumers(keys.requests, keys.group)
    except redis.ResponseError:  # no stream or group yet: nothing was ever claimed
        return []
    others = [c for c in consumers if _text(c["name"]) != me]
    if not others:
        return []
    pipe = client.pipeline(transaction=False)
    for c in others:
        pipe.exists(keys.worker(_text(c["name"])))
    dead = [c for c, alive in zip(others, pipe.execute(), strict=True) if not alive]
    min_idle_ms = int(config.heartbeat_ttl_s * 1000)
    claimed: list[Claimed] = []
    for c in dead:
        name = _text(c["name"])
        if int(c["pending"]) == 0:
            if int(c["idle"]) > min_idle_ms:
                client.xgroup_delconsumer(keys.requests, keys.group, name)  # tidy: nothing lost
            continue
        if len(claimed) >= count:
            continue
        live = _take_pending(client, config, name, count - len(claimed), min_idle_ms)
        claimed += live
        if live:
            log.warning("re-claimed %d requests of stopped worker %s", len(live), name)
    return claimed


def reclaim_own(client: redis.Redis, config: WorkerConfig, count: int) -> list[Claimed]:
    """At start-up: the entries still pending under this worker's own name, left by an earlier
    process with the same --worker-id that died (nobody else re-claims them: this heartbeat
    is alive again)."""
    try:
        live = _take_pending(client, config, config.worker_id, count, min_idle_ms=0)
    except redis.ResponseError:  # no stream or group yet
        return []
    if live:
        log.warning("resuming %d requests an earlier run of worker %s left unfinished", len(live),
                    config.worker_id)
    return live


def _take_pending(client: redis.Redis, config: WorkerConfig, consumer: str, count: int,
                  min_idle_ms: int) -> list[Claimed]:
    """XCLAIM up to `count` of `consumer`'s pending entries idle for min_idle_ms, to this worker."""
    keys = config.keys
    pending = client.xpending_range(keys.requests, keys.group, min="-", max="+", count=count,
                                    consumername=consumer, idle=min_idle_ms)
    if not pending:
        return []
    deliveries = {p["message_id"]: int(p["times_delivered"]) for p in pending}
    entries = client.xclaim(keys.requests, keys.group, config.worker_id, min_idle_ms, list(deliveries))
    taken = [(entry_id, fields) for entry_id, fields in cast(Any, entries) if entry_id is not None]
    gone = [entry_id for entry_id, fields in taken if not fields]  # deleted while pending
    if gone:
        client.xack(keys.requests, keys.group, *gone)
    return [Claimed(entry_id, parse_entry(entry_id, fields), deliveries.get(entry_id, 1) + 1)
            for entry_id, fields in taken if fields]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def parse_progress(data: bytes | str | None) -> queue_pb2.Progress | None:
    if data is None:
        return None  # never stepped: start from scratch
    try:
        return queue_pb2.Progress.FromString(data if isinstance(data, bytes) else data.encode())
    except Exception:
        log.error("ignoring unreadable progress; restarting the request")
        return None


def parse_entry(entry_id: bytes, fields: dict[bytes, bytes]) -> queue_pb2.QueuedRequest | None:
    try:
        return queue_pb2.QueuedRequest.FromString(fields[STREAM_DATA_FIELD])
    except Exception:  # a foreign or corrupt entry must not stop the worker
        log.error("dropping unreadable stream entry %r", entry_id)
        return None

