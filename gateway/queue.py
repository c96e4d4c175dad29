"""The gateway's side of the Redis contract (see protos/keys.py): attach to or
enqueue a request, read its log, queue depth, aborts, request liveness and
worker heartbeats.

Every method raises redis's exceptions unchanged; the servicer maps them to
UNAVAILABLE. The client fails fast (no hidden retries; socket timeouts), so an
unreachable Redis costs a call at most `redis_timeout_s`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from gateway.config import GatewayConfig
from protos.convert import event_from_log
from protos.keys import (
    RECORD_LEASE_S,
    ROUTE_FIELD,
    STREAM_DATA_FIELD,
    WORKER_KEY_MARK,
    Heartbeat,
    LogField,
    PriorityClass,
    Record,
)
from protos.redis_conn import async_client
from protos.tokenrelay.v1 import generate_pb2, queue_pb2

log = logging.getLogger(__name__)


def connect(config: GatewayConfig) -> aioredis.Redis:
    return async_client(config.redis_url, config.redis_timeout_s)


class EntryState(enum.Enum):
    QUEUED = "queued"  # in the stream, not claimed yet
    RUNNING = "running"  # claimed by a worker whose heartbeat is alive
    ORPHANED = "orphaned"  # claimed by a worker whose heartbeat expired (it died)
    GONE = "gone"  # not in the stream: finished, or lost with a Redis restart


# Atomically: find the request's record, or (may_create) create it and XADD its first
# attempt to KEYS[2] (the shared stream of its priority class, or the routed stream of the
# worker the router chose: protos/keys.py, "Routing"; a routed entry names its record, for
# MOVE); with `expect` = the entry of an attempt that ended without a final, XADD the next
# attempt (compare-and-set: two gateways never start two). The record's STREAM says where
# its current attempt is; it has finished when the log the record names holds its final
# (`LogField.FINAL`; ARGV[8] = the request's key). Results: {"mismatch"} {"unknown"} {"finished", entry}
# {"live", entry, seed, stream} {"ended", entry, seed, stream} {"created", entry, seed, stream}.
ATTACH_SCRIPT = f"""
local rec, stream = KEYS[1], KEYS[2]
local digest, data, seed, lease_ms, may_create, expect = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local f = redis.call('HMGET', rec, '{Record.DIGEST}', '{Record.ENTRY}', '{Record.LOG}', '{Record.SEED}',
                     '{Record.STREAM}')
if f[1] then
  if f[1] ~= digest then return {{'mismatch'}} end
  if f[3] and redis.call('HEXISTS', f[3], ARGV[8] .. '{LogField.FINAL}') == 1 then
    return {{'finished', f[2]}}
  end
  local at = f[5] or stream
  if f[2] and #redis.call('XRANGE', at, f[2], f[2]) > 0 then return {{'live', f[2], f[4], at}} end
  if expect == '' or expect ~= (f[2] or '') then return {{'ended', f[2] or '', f[4], at}} end
  seed = f[4]
elseif may_create ~= '1' then
  return {{'unknown'}}
end
local id
if ARGV[7] == '1' then
  id = redis.call('XADD', stream, '*', '{STREAM_DATA_FIELD.decode()}', data, '{ROUTE_FIELD.decode()}', rec)
else
  id = redis.call('XADD', stream, '*', '{STREAM_DATA_FIELD.decode()}', data)
end
redis.call('HSET', rec, '{Record.DIGEST}', digest, '{Record.ENTRY}', id, '{Record.STREAM}', stream,
           '{Record.SEED}', seed)
redis.call('PEXPIRE', rec, lease_ms)
return {{'created', id, seed, stream}}
"""

# MOVE: KEYS = a routed stream, the shared stream of its class; ARGV = group, entry. A routed
# entry nobody claimed goes to the shared stream and its record follows (compare-and-set on the
# record's entry and stream), in one script: either a worker's XREADGROUP delivered it first
# (it stays, pending under that worker) or it is deleted here before any worker sees it. An
# entry whose record has moved on to a later attempt is stale: deleted, nothing added. Returns
# the new entry id, or nil.
MOVE_SCRIPT = f"""
local from, to, group, id = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local found = redis.call('XRANGE', from, id, id)
if #found == 0 then return nil end
local ok, pending = pcall(redis.call, 'XPENDING', from, group, id, id, 1)
if ok and #pending > 0 then return nil end
local data, rec = nil, nil
local fields = found[1][2]
for k = 1, #fields, 2 do
  if fields[k] == '{STREAM_DATA_FIELD.decode()}' then data = fields[k + 1] end
  if fields[k] == '{ROUTE_FIELD.decode()}' then rec = fields[k + 1] end
end
redis.call('XDEL', from, id)
if not data or not rec then return nil end
local f = redis.call('HMGET', rec, '{Record.ENTRY}', '{Record.STREAM}')
if f[1] ~= id or f[2] ~= from then return nil end
local moved = redis.call('XADD', to, '*', '{STREAM_DATA_FIELD.decode()}', data)
redis.call('HSET', rec, '{Record.ENTRY}', moved, '{Record.STREAM}', to)
return moved
"""

# ROUTE: for each worker in ARGV (after the hashes: ARGV[1] = how many hashes), how many of
# the request's leading prefix hashes its index (KEYS[i], `Keys.prefixes`) holds: one call
# for every live worker, the hashes sent once.
ROUTE_SCRIPT = """
local n = tonumber(ARGV[1])
local hashes = {}
for i = 1, n do hashes[i] = ARGV[i + 1] end
local reply = {}
for w, key in ipairs(KEYS) do
  local found = 0
  if n > 0 then
    for _, score in ipairs(redis.call('ZMSCORE', key, unpack(hashes))) do
      if not score then break end
      found = found + 1
    end
  end
  reply[w] = found
end
return reply
"""


# What waits in the workers' own streams is counted in the queue depth at most this late: an
# entry stays there at most --route-max-wait-ms anyway (then it moves to a shared stream).
ROUTED_DEPTH_CACHE_S = 1.0
MAX_LOG_READ = 2048  # events per READ_LOG call (Lua's unpack() takes a few thousand values)

# The request's logged events from seq ARGV[2] on (at most ARGV[3]), from the log hash its
# record names (protos/keys.py): one round trip whose cost is what it returns, never the
# whole log. Returns {seq of the first value, values...}; a missing event reads as false (a
# gap). A caller asking past the end of a finished request gets the final alone.
READ_LOG_SCRIPT = f"""
local rid, first, most = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local log = redis.call('HGET', KEYS[1], '{Record.LOG}')
if not log then return {{first}} end
local final = redis.call('HGET', log, rid .. '{LogField.FINAL}')
if final and tonumber(final) < first then
  return {{tonumber(final), redis.call('HGET', log, rid .. ':' .. final)}}
end
local n = tonumber(redis.call('HGET', log, rid .. '{LogField.NEXT}') or '0')
local last = math.min(n - 1, first + most - 1)
if last < first then return {{first}} end
local names = {{}}
for s = first, last do names[#names + 1] = rid .. ':' .. s end
local reply = redis.call('HMGET', log, unpack(names))
table.insert(reply, 1, first)
return reply
"""

# Live workers in one round trip: the registry's members (consumer names) whose expiry
# (Redis ms) is ahead, each with its heartbeat hash. No SCAN: the registry is one sorted set.
LIVE_WORKERS_SCRIPT = f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local reply = {{}}
for _, name in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')) do
  reply[#reply + 1] = {{name, redis.call('HGETALL', ARGV[1] .. '{WORKER_KEY_MARK}' .. name)}}
end
return reply
"""

# Where an attempt is: 'queued', 'running' (its consumer alive in the registry), 'orphaned'
# (its consumer's heartbeat expired) or 'gone'. KEYS: stream, registry; ARGV: group, entry.
ENTRY_STATE_SCRIPT = """
local present = #redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2]) > 0
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if not ok or #pending == 0 then
  if present then return 'queued' else return 'gone' end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = redis.call('ZSCORE', KEYS[2], pending[1][2])
if score and tonumber(score) > now then return 'running' end
return 'orphaned'
"""


@dataclass(frozen=True)
class _StreamDepth:
    name: str
    queued: int
    pending: int
    last_delivered: bytes  # b"": no group yet


@dataclass
class _Depth:
    """One model's queue depth as last read, and this gateway's enqueues since."""

    queued: int = 0
    read_at: float = -float("inf")
    num_enqueued_since_read: int = 0
    routed: int = 0  # of it, in the routed streams of the model's workers
    routed_read_at: float = -float("inf")
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True)
class Attached:
    """What ATTACH_SCRIPT found or did (see its comment)."""

    state: str
    entry_id: bytes = b""
    seed: int | None = None
    stream: str = ""  # where the attempt is (the record's STREAM)


class RequestQueue:
    def __init__(self, client: aioredis.Redis, config: GatewayConfig) -> None:
        self.client, self.config, self.keys = client, config, config.keys
        self._depths: dict[str, _Depth] = {}  # per model (protos/keys.py, "Models")
        self._attach = client.register_script(ATTACH_SCRIPT)
        self._read_log = client.register_script(READ_LOG_SCRIPT)
        self._live_workers = client.register_script(LIVE_WORKERS_SCRIPT)
        self._entry_state = client.register_script(ENTRY_STATE_SCRIPT)
        # The live workers' routed streams by model, as the router last saw them: queue depth
        # counts them, read at most every ROUTED_DEPTH_CACHE_S (3 per worker: at 16 workers,
        # ~100 commands).
        self.routed_streams: dict[str, tuple[str, ...]] = {}
        self._move = client.register_script(MOVE_SCRIPT)
        self._route = client.register_script(ROUTE_SCRIPT)

    async def attach(self, request: queue_pb2.QueuedRequest, digest: str, *, may_create: bool,
                     expect: bytes = b"", routed_to: str = "") -> Attached:
        """Run ATTACH_SCRIPT for `request` (its seed is used only if the record is new); a new
        attempt goes to the routed stream of consumer `routed_to`, or ("") the shared one."""
        priority_class = PriorityClass.of(request.request.priority)
        stream = (self.keys.routed(routed_to, priority_class) if routed_to
                  else self.keys.for_model(request.request.model).requests_of(priority_class))
        seed, lease_ms = str(request.request.sampling.seed), int(RECORD_LEASE_S * 1000)
        args: list[bytes | str | int] = [digest, request.SerializeToString(), seed, lease_ms,
                                         "1" if may_create else "0", expect, "1" if routed_to else "0",
                                         request.request_id]
        reply = await self._attach(keys=[self.keys.record(request.request_id), stream], args=args)
        state = reply[0].decode()
        if state == "created":
            self._depth_of(request.request.model).num_enqueued_since_read += 1
        entry_id = reply[1] if len(reply) > 1 else b""
        return Attached(state, entry_id, int(reply[2]) if len(reply) > 2 and reply[2] else None,
                        reply[3].decode() if len(reply) > 3 else "")

    async def move(self, routed: str, entry_id: bytes, request: generate_pb2.GenerateRequest
                   ) -> tuple[bytes, str] | None:
        """MOVE a routed entry no worker claimed to its model's shared stream of its class: the new
        entry and that stream, or None (a worker has it already, or it is gone)."""
        shared = self.stream_of(request)
        moved = await self._move(keys=[routed, shared], args=[self.keys.group, entry_id])
        return (moved, shared) if moved else None

    async def prefix_overlap(self, consumers: list[str], hashes: list[bytes]) -> list[int]:
        """Per consumer, how many of `hashes` (in order, from the first) its prefix index holds."""
        if not consumers:
            return []
        keys = [self.keys.prefixes(c) for c in consumers]
        return [int(n) for n in await self._route(keys=keys, args=[len(hashes), *hashes])]

    async def read_log(self, request_id: str, first_seq: int = 0) -> dict[int, queue_pb2.TokenEvent]:
        """seq -> event of what the request's log holds from first_seq on (chunks and the final),
        read MAX_LOG_READ at a time."""
        events: dict[int, queue_pb2.TokenEvent] = {}
        while True:
            start, *values = await self._read_log(keys=[self.keys.record(request_id)],
                                                  args=[request_id, first_seq, MAX_LOG_READ])
            for offset, value in enumerate(values):
                if value:
                    events[int(start) + offset] = event_from_log(value)
            if len(values) < MAX_LOG_READ:
                return events
            first_seq += MAX_LOG_READ

    def _depth_of(self, model: str) -> _Depth:
        if model not in self._depths:
            self._depths[model] = _Depth()
        return self._depths[model]

    async def queue_depth(self, model: str) -> int:
        """Requests of `model` waiting to be claimed, re-read at most every depth_cache_ms.

        Between reads the gateway adds its own enqueues, so a burst cannot slip
        past the limit while the cached value is stale.
        """
        d, max_age = self._depth_of(model), self.config.depth_cache_ms / 1000
        if time.monotonic() - d.read_at > max_age:
            async with d.lock:  # one read serves every call waiting on it
                if time.monotonic() - d.read_at > max_age:
                    if time.monotonic() - d.routed_read_at > ROUTED_DEPTH_CACHE_S:
                        d.routed = await self._queued_in(self.routed_streams.get(model, ()))
                        d.routed_read_at = time.monotonic()
                    d.queued = await self._queued_in(self.keys.for_model(model).request_streams) + d.routed
                    d.read_at = time.monotonic()
                    d.num_enqueued_since_read = 0
        return d.queued + d.num_enqueued_since_read

    async def _queued_in(self, streams: tuple[str, ...]) -> int:
        return sum(s.queued for s in await self._read_streams(streams))

    def is_routed(self, stream: str) -> bool:
        """A worker's own stream (protos/keys.py, "Routing"), not a shared one."""
        return stream.startswith(self.keys.routed_mark)

    def stream_of(self, request: generate_pb2.GenerateRequest) -> str:
        """The request stream of the request's model and priority class (protos/keys.py)."""
        return self.keys.for_model(request.model).requests_of(PriorityClass.of(request.priority))

    async def read_depth(self, models: list[str]) -> tuple[int, int]:
        """(queued, in flight) summed over the models and priority classes: entries not yet
        claimed, and claimed but unfinished."""
        queued = in_flight = 0
        for model in models:
            gauges = await self.queue_gauges(model, with_age=False)
            queued, in_flight = queued + gauges[0], in_flight + gauges[1]
        return queued, in_flight

    async def queue_gauges(self, model: str, *, with_age: bool = True) -> tuple[int, int, float]:
        """(queued, in flight, age in seconds of the oldest request not claimed yet in a shared
        stream) of one model, for the metrics; a stream's oldest waiting entry is the first after
        the group's last-delivered id."""
        shared = self.keys.for_model(model).request_streams
        streams = await self._read_streams(shared + self.routed_streams.get(model, ()))
        age = 0.0
        if with_age:
            pipe = self.client.pipeline(transaction=False)
            for s in streams[:len(shared)]:  # a routed entry waits --route-max-wait-ms at most
                after = b"(" + s.last_delivered if s.last_delivered else b"-"
                pipe.xrange(s.name, min=after, max="+", count=1)
            oldest: list[Any] = [reply[0] for reply in await pipe.execute() if reply]
            # An entry id is "<unix ms>-<seq>".
            first_ms = min((int(entry[0].split(b"-")[0]) for entry in oldest), default=None)
            age = max(0.0, time.time() - first_ms / 1000) if first_ms is not None else 0.0
        return sum(s.queued for s in streams), sum(s.pending for s in streams), age

    async def _read_streams(self, streams: tuple[str, ...]) -> list[_StreamDepth]:
        """Per request stream: finished entries are XDELed, so XLEN = queued + in flight, and in
        flight is the group's pending count (Redis 6.2 has no XINFO `lag`)."""
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
        replies = await pipe.execute(raise_on_error=False)
        depths = []
        name = self.keys.group.encode()
        for stream, length, groups in zip(streams, replies[::2], replies[1::2], strict=True):
            if isinstance(length, Exception):
                raise length
            group = None if isinstance(groups, Exception) else next(  # no stream yet: no group either
                (g for g in groups if g["name"] == name), None)
            pending = int(group["pending"]) if group else 0
            depths.append(_StreamDepth(stream, max(0, int(length) - pending), pending,
                                       group["last-delivered-id"] if group else b""))
        return depths

    async def abort(self, request_id: str, reason: str, entry_id: bytes) -> None:
        """Hint the worker holding the attempt that its caller left (it parks it if nobody else
        follows the request; a queued one is parked when claimed)."""
        message = queue_pb2.Abort(request_id=request_id, reason=reason, entry_id=entry_id)
        await self.client.publish(self.keys.aborts, message.SerializeToString())

    async def entry_state(self, entry_id: bytes, stream: str) -> EntryState:
        """Where the attempt is, in `stream`."""
        state = await self._entry_state(keys=[stream, self.keys.registry], args=[self.keys.group, entry_id])
        return EntryState(state.decode())

    async def workers(self) -> list[generate_pb2.WorkerInfo]:
        """Live workers: the registry's, with their heartbeat hashes (one round trip)."""
        return [info for _, info in await self.consumers()]

    async def consumers(self) -> list[tuple[str, generate_pb2.WorkerInfo]]:
        """Live workers by consumer name (protos/keys.py: a worker process), in one round trip."""
        found = await self._live_workers(keys=[self.keys.registry], args=[self.keys.prefix])
        return [(name.decode(), _worker_info(h)) for name, h in found if h]  # [] = expired meanwhile


def _worker_info(flat: list[bytes]) -> generate_pb2.WorkerInfo:
    """A heartbeat hash (HGETALL's flat reply) -> WorkerInfo; a field the worker did not write
    reads as 0 or ""."""
    f = {k.decode(): v.decode() for k, v in zip(flat[::2], flat[1::2], strict=True)}
    info: dict[str, Any] = {name: f.get(name, "") for name in Heartbeat.TEXT}
    info |= {name: [v for v in f.get(name, "").split(",") if v] for name in Heartbeat.LIST}
    info |= {name: float(f.get(name) or 0) for name in Heartbeat.FLOAT}
    info |= {name: int(f.get(name) or 0) for name in Heartbeat.INT}
    queried = info[Heartbeat.NUM_PREFIX_CACHE_QUERY_TOKENS]
    info["prefix_cache_hit_rate"] = info[Heartbeat.NUM_PREFIX_CACHE_HIT_TOKENS] / queried if queried else 0.0
    return generate_pb2.WorkerInfo(**info)
