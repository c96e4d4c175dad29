"""This worker's pending entries (protos/keys.py, "Reconciliation"): what it claimed and must
account for. Dead workers' entries are not its business: a gateway's sweeper fences them and
queues their requests again (gateway/sweeper.py).

`reconcile`: entries pending under this consumer that it does not hold; those found at two
looks in a row (an XACK or XDEL lost with the last second of an AOF, or a record another
worker held when it was claimed) are taken again (worker/io/claim.py), so the claim path
resumes or acknowledges them instead of leaving their calls waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, cast

import redis

from protos.keys import STREAM_DATA_FIELD
from protos.tokenrelay.v1 import queue_pb2
from worker.config import WorkerConfig

log = logging.getLogger(__name__)


@dataclass
class Claimed:
    """A stream entry this worker just took: new (XREADGROUP), or found forgotten in its own
    pending list."""

    stream: str  # the request stream of its priority class
    entry_id: bytes
    request: queue_pb2.QueuedRequest | None  # None: unreadable

    @property
    def key(self) -> str:
        return f"{self.stream}/{self.entry_id.decode()}"


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
            forgotten.append(Claimed(stream, entry_id, request))
    return forgotten


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


def parse_entry(entry_id: bytes, fields: dict[bytes, bytes]) -> queue_pb2.QueuedRequest | None:
    try:
        return queue_pb2.QueuedRequest.FromString(fields[STREAM_DATA_FIELD])
    except Exception:  # a foreign or corrupt entry must not stop the worker
        log.error("dropping unreadable stream entry %r", entry_id)
        return None
