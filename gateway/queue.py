"""The gateway's side of the Redis contract (see protos/keys.py): enqueue,
queue depth, aborts, request liveness and worker heartbeats.

Every method raises redis's exceptions unchanged; the servicer maps them to
UNAVAILABLE. The client fails fast (no hidden retries; socket timeouts), so an
unreachable Redis costs a call at most `redis_timeout_s`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.exceptions import ResponseError

from gateway.config import GatewayConfig
from protos.keys import ABORTED_TTL_S, STREAM_DATA_FIELD, Heartbeat
from protos.redis_conn import client_options
from protos.tokenrelay.v1 import generate_pb2, queue_pb2

log = logging.getLogger(__name__)


def connect(config: GatewayConfig) -> aioredis.Redis:
    return aioredis.Redis.from_url(config.redis_url, **client_options(Retry, config.redis_timeout_s))


class EntryState(enum.Enum):
    QUEUED = "queued"  # in the stream, not claimed yet
    RUNNING = "running"  # claimed by a worker whose heartbeat is alive
    ORPHANED = "orphaned"  # claimed by a worker whose heartbeat expired (it died)
    GONE = "gone"  # not in the stream: finished, or lost with a Redis restart


class RequestQueue:
    def __init__(self, client: aioredis.Redis, config: GatewayConfig) -> None:
        self.client, self.config, self.keys = client, config, config.keys
        self._depth = 0
        self._depth_read_at = -float("inf")
        self._num_enqueued_since_read = 0
        self._depth_lock = asyncio.Lock()

    async def enqueue(self, request: queue_pb2.QueuedRequest) -> bytes:
        """XADD the request; returns its stream entry id."""
        data = request.SerializeToString()
        entry_id = await self.client.xadd(self.keys.requests, {STREAM_DATA_FIELD: data})
        self._num_enqueued_since_read += 1
        return entry_id if isinstance(entry_id, bytes) else entry_id.encode()

    async def queue_depth(self) -> int:
        """Requests waiting to be claimed, re-read at most every depth_cache_ms.

        Between reads the gateway adds its own enqueues, so a burst cannot slip
        past the limit while the cached value is stale.
        """
        max_age = self.config.depth_cache_ms / 1000
        if time.monotonic() - self._depth_read_at > max_age:
            async with self._depth_lock:  # one read serves every call waiting on it
                if time.monotonic() - self._depth_read_at > max_age:
                    self._depth, _ = await self.read_depth()
                    self._depth_read_at = time.monotonic()
                    self._num_enqueued_since_read = 0
        return self._depth + self._num_enqueued_since_read

    async def read_depth(self) -> tuple[int, int]:
        """(queued, in flight): entries not yet claimed, and claimed but unfinished.

        Finished entries are XDELed, so XLEN = queued + in flight, and in flight
        is the group's pending count (Redis 6.2 has no XINFO `lag`).
        """
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(self.keys.requests)
        pipe.xinfo_groups(self.keys.requests)
        length, groups = await pipe.execute(raise_on_error=False)
        if isinstance(length, Exception):
            raise length
        pending = 0
        if not isinstance(groups, Exception):  # no stream yet: no group either
            name = self.keys.group.encode()
            pending = next((int(g["pending"]) for g in groups if g["name"] == name), 0)
        return max(0, int(length) - pending), pending

    async def abort(self, request_id: str, reason: str, entry_id: bytes | None = None) -> None:
        """Tell running workers; with entry_id also mark the entry for a worker that claims it later."""
        message = queue_pb2.Abort(request_id=request_id, reason=reason,
                                  entry_id=entry_id or b"").SerializeToString()
        pipe = self.client.pipeline(transaction=False)
        if entry_id is not None:
            pipe.set(self.keys.aborted(request_id), entry_id, ex=ABORTED_TTL_S)
        pipe.publish(self.keys.aborts, message)
        await pipe.execute()

    async def entry_state(self, entry_id: bytes) -> EntryState:
        pipe = self.client.pipeline(transaction=False)
        pipe.xpending_range(self.keys.requests, self.keys.group, min=entry_id, max=entry_id, count=1)
        pipe.xrange(self.keys.requests, min=entry_id, max=entry_id, count=1)
        pending, present = await pipe.execute(raise_on_error=False)
        if isinstance(present, Exception):
            raise present
        if isinstance(pending, ResponseError) or not pending:  # NOGROUP: nobody claimed anything
            return EntryState.QUEUED if present else EntryState.GONE
        if isinstance(pending, Exception):
            raise pending
        consumer = pending[0]["consumer"].decode()
        is_alive = await self.client.exists(self.keys.worker(consumer))
        return EntryState.RUNNING if is_alive else EntryState.ORPHANED

    async def workers(self) -> list[generate_pb2.WorkerInfo]:
        """Live workers (their heartbeat hash has not expired)."""
        keys = [k async for k in self.client.scan_iter(match=self.keys.worker_pattern, count=100)]
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        hashes = await pipe.execute()
        return [_worker_info(h) for h in hashes if h]  # {} = expired between SCAN and HGETALL


def _worker_info(fields: dict[bytes, bytes]) -> generate_pb2.WorkerInfo:
    """A heartbeat hash -> WorkerInfo; a field the worker did not write reads as 0 or ""."""
    f = {k.decode(): v.decode() for k, v in fields.items()}
    info: dict[str, Any] = {name: f.get(name, "") for name in Heartbeat.TEXT}
    info |= {name: float(f.get(name) or 0) for name in Heartbeat.FLOAT}
    info |= {name: int(f.get(name) or 0) for name in Heartbeat.INT}
    return generate_pb2.WorkerInfo(**info)
