"""Re-claiming the requests of workers that died (see protos/keys.py, "Delivery guarantee").

Every worker calls `reclaim_dead_workers` about once a second while it has
free slots: consumers of the group (on every request stream, the highest priority
class first) whose heartbeat key expired are dead; their
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

    stream: str  # the request stream of its priority class
    entry_id: bytes
    request: queue_pb2.QueuedRequest | None  # None: unreadable
    num_deliveries: int = 1


def reclaim_dead_workers(client: redis.Redis, config: WorkerConfig, count: int) -> list[Claimed]:
    """Re-claim up to `count` entries of dead workers (heartbeat expired), the highest
    priority class first.

    XCLAIM's min-idle-time makes it safe against other workers sweeping at the
    same moment: once one of them claims an entry its idle time restarts, and
    the others' XCLAIM skips it.
    """
    keys, me = config.keys, config.worker_id
    consumers: list[tuple[str, Any]] = []  # (stream, consumer) in claim order
    for stream in keys.request_streams:
        try:
            consumers += [(stream, c) for c in client.xinfo_consumers(stream, keys.group)
                          if _text(c["name"]) != me]
        except redis.ResponseError:  # no stream or group yet: nothing was ever claimed there
            continue
    if not consumers:
        return []
    names = sorted({_text(c["name"]) for _, c in consumers})
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(keys.worker(name))
    alive = {name for name, is_alive in zip(names, pipe.execute(), strict=True) if is_alive}
    min_idle_ms = int(config.heartbeat_ttl_s * 1000)
    claimed: list[Claimed] = []
    for stream, c in consumers:
        name = _text(c["name"])
        if name in alive:
            continue
        if int(c["pending"]) == 0:
            if int(c["idle"]) > min_idle_ms:
                client.xgroup_delconsumer(stream, keys.group, name)  # tidy: nothing lost
            continue
        if len(claimed) >= count:
            continue
        live = _take_pending(client, config, stream, name, count - len(claimed), min_idle_ms)
        claimed += live
        if live:
            log.warning("re-claimed %d requests of stopped worker %s from %s", len(live), name, stream)
    return claimed


def reclaim_own(client: redis.Redis, config: WorkerConfig, count: int) -> list[Claimed]:
    """At start-up: the entries still pending under this worker's own name, left by an earlier
    process with the same --worker-id that died (nobody else re-claims them: this heartbeat
    is alive again), the highest priority class first."""
    live: list[Claimed] = []
    for stream in config.keys.request_streams:
        if len(live) >= count:
            break
        try:
            live += _take_pending(client, config, stream, config.worker_id, count - len(live), min_idle_ms=0)
        except redis.ResponseError:  # no stream or group yet
            continue
    if live:
        log.warning("resuming %d requests an earlier run of worker %s left unfinished", len(live),
                    config.worker_id)
    return live


def _take_pending(client: redis.Redis, config: WorkerConfig, stream: str, consumer: str, count: int,
                  min_idle_ms: int) -> list[Claimed]:
    """XCLAIM up to `count` of `consumer`'s pending entries in `stream` idle for min_idle_ms,
    to this worker."""
    group = config.keys.group
    pending = client.xpending_range(stream, group, min="-", max="+", count=count,
                                    consumername=consumer, idle=min_idle_ms)
    if not pending:
        return []
    deliveries = {p["message_id"]: int(p["times_delivered"]) for p in pending}
    entries = client.xclaim(stream, group, config.worker_id, min_idle_ms, list(deliveries))
    taken = [(entry_id, fields) for entry_id, fields in cast(Any, entries) if entry_id is not None]
    gone = [entry_id for entry_id, fields in taken if not fields]  # deleted while pending
    if gone:
        client.xack(stream, group, *gone)
    return [Claimed(stream, entry_id, parse_entry(entry_id, fields), deliveries.get(entry_id, 1) + 1)
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

