"""Re-claiming the requests of workers that died, and reconciling this worker's own pending list
(protos/keys.py, "Fencing" and "Reconciliation").

`reclaim_dead_workers`: the registry's expired members, and at every CONSUMER_LIST_EVERY-th
sweep the group's consumers too (XINFO CONSUMERS, one call per priority stream), go to the
RECLAIM script, which skips those alive in the registry and, atomically, fences the
others and XCLAIMs their entries: a zombie that wakes up later finds every write refused.
`reconcile`: entries pending under this consumer that it does not hold; those found at two
looks in a row (an XACK or XDEL lost with the last second of an AOF) are taken again
(worker/io/claim.py), so the claim path resumes or acknowledges them instead of leaving their
calls waiting.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, cast

import redis

from protos.keys import RECORD_LEASE_S, STREAM_DATA_FIELD
from protos.tokenrelay.v1 import queue_pb2
from worker.config import WorkerConfig
from worker.io.scripts import RECLAIM

log = logging.getLogger(__name__)

# Every worker sweeps about once a second. A dead consumer is in the registry (its heartbeat
# registered it before its first claim; RECLAIM scores it 0 and keeps it while anything of it is
# left), so the registry finds it. Only a consumer the registry lost (Redis came back without the
# last second of its AOF) needs the group's consumer lists: read at every 10th sweep, they were
# 3 of the 4 commands of a sweep (8 workers: 24 XINFO a second, 0.008 commands per token at
# bench-fleet's 8 x 256 point).
CONSUMER_LIST_EVERY = 10


@dataclass
class Claimed:
    """A stream entry this worker just took: new (XREADGROUP), re-claimed from a dead worker, or
    found forgotten in its own pending list."""

    stream: str  # the request stream of its priority class
    entry_id: bytes
    request: queue_pb2.QueuedRequest | None  # None: unreadable
    num_deliveries: int = 1

    @property
    def key(self) -> str:
        return f"{self.stream}/{self.entry_id.decode()}"


def reclaim_dead_workers(client: redis.Redis, config: WorkerConfig, count: int,
                         list_consumers: bool = True) -> list[Claimed]:
    """Fence every consumer that is not alive in the registry (the registry's expired members, and
    with list_consumers the group's consumers too) and take up to `count` of their entries, the
    highest priority class first."""
    keys, me = config.keys, config.consumer_name
    pipe = client.pipeline(transaction=False)
    if list_consumers:
        for stream in keys.request_streams:
            pipe.xinfo_consumers(stream, keys.group)
    # The registry's expired members: a worker that only ever claimed from its own routed streams
    # is a consumer of no shared stream. By this clock, a second late: RECLAIM judges each
    # candidate again on Redis's clock, so a skewed clock finds the dead later, never a live
    # worker dead.
    pipe.zrangebyscore(keys.registry, "-inf", int(time.time() * 1000) - 1000)
    names: set[str] = set()
    *replies, expired = pipe.execute(raise_on_error=False)
    for reply in replies:
        if not isinstance(reply, Exception):  # no stream or group yet: nothing was ever claimed there
            names |= {_text(c["name"]) for c in reply}
    names |= {_text(n) for n in cast(list[bytes], expired)}
    names.discard(me)
    if not names:
        return []
    script = client.register_script(RECLAIM)
    args: list[Any] = [keys.group, me, int(RECORD_LEASE_S * 1000), max(count, 0), keys.prefix, keys.model,
                       *keys.request_streams, "--", *sorted(names)]
    *claimed, idle = cast(list[Any], script(keys=[keys.registry, keys.fenced, keys.consumer_models],
                                            args=args))
    for name in idle:  # fenced and with nothing pending: tidy the group
        for stream in keys.request_streams:
            try:
                client.xgroup_delconsumer(stream, keys.group, _text(name))
            except redis.ResponseError:
                continue
    entries = [Claimed(_text(stream), entry_id, _parse(entry_id, data), int(deliveries) + 1)
               for stream, entry_id, data, deliveries in claimed]
    if entries:
        log.warning("re-claimed %d requests of stopped workers", len(entries))
    return entries


def reconcile(client: redis.Redis, config: WorkerConfig, held: Collection[str], count: int) -> list[Claimed]:
    """Up to `count` entries pending under this consumer, delivered a while ago, that it does not
    hold (`held`: Claimed.key of what it runs or parks). An entry whose XACK is on its way is
    among them too: the caller takes only those it saw at its previous look as well."""
    keys, me = config.keys, config.consumer_name
    min_idle_ms = int(config.reconcile_interval_s * 1000)  # idle = since the entry's last delivery
    forgotten: list[Claimed] = []
    limit = max(count, 1) + len(held)
    for stream in keys.claim_streams(me):
        try:
            pending = client.xpending_range(stream, keys.group, min="-", max="+", count=limit,
                                            consumername=me, idle=min_idle_ms)
        except redis.ResponseError:
            continue
        for p in pending:
            entry_id = cast(bytes, p["message_id"])
            if len(forgotten) >= count or Claimed(stream, entry_id, None).key in held:
                continue
            found = cast(list[Any], client.xrange(stream, min=entry_id, max=entry_id, count=1))
            if not found:  # deleted while pending: nothing to run
                client.xack(stream, keys.group, entry_id)
                continue
            fields = found[0][1]
            request = parse_entry(entry_id, fields)
            forgotten.append(Claimed(stream, entry_id, request, int(p["times_delivered"])))
    return forgotten


def has_pending(client: redis.Redis, config: WorkerConfig) -> bool:
    """Whether an entry is still pending under this consumer, in any stream it claims from: a
    claim whose OWN never reached Redis (it went down between the XREADGROUP and the script)
    leaves one its worker does not know of. A worker that stops then leaves the registry scored
    dead, not removed, so the next sweep re-claims it (removed, nothing would ever sweep its
    routed streams: a chaos run lost a request so). Unknown (Redis down): True."""
    keys, me = config.keys, config.consumer_name
    try:
        for stream in keys.claim_streams(me):
            with contextlib.suppress(redis.ResponseError):  # no stream or group: nothing there
                if client.xpending_range(stream, keys.group, min="-", max="+", count=1, consumername=me):
                    log.warning("leaving entries pending under %s (claimed, never taken): the next sweep "
                                "re-claims them", me)
                    return True
    except redis.RedisError:
        return True
    return False


def other_workers_alive(client: redis.Redis, config: WorkerConfig) -> bool:
    """Another consumer of this worker's model in the registry with a heartbeat in the future
    (Redis's clock): one that can resume what this worker hands over."""
    keys, mine = config.keys, config.consumer_name.encode()
    try:
        seconds, micros = client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        alive = [n for n in cast(list[bytes], client.zrangebyscore(keys.registry, now_ms, "+inf"))
                 if n != mine]
        models = cast(list[bytes | None], client.hmget(keys.consumer_models, alive)) if alive else []
    except redis.RedisError:
        return False
    return any(model == keys.model.encode() for model in models)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parse(entry_id: bytes, data: bytes) -> queue_pb2.QueuedRequest | None:
    return parse_entry(entry_id, {STREAM_DATA_FIELD: data}) if data else parse_entry(entry_id, {})


def parse_entry(entry_id: bytes, fields: dict[bytes, bytes]) -> queue_pb2.QueuedRequest | None:
    try:
        return queue_pb2.QueuedRequest.FromString(fields[STREAM_DATA_FIELD])
    except Exception:  # a foreign or corrupt entry must not stop the worker
        log.error("dropping unreadable stream entry %r", entry_id)
        return None
