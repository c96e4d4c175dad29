"""The sweeper: every gateway finds dead workers, fences them and puts their requests back in the
queue (protos/keys.py, "Fencing").

It runs in the gateways, not in the workers, because workers load model files and compiled
code and so deserve the least trust: a worker that could fence others and XCLAIM their
entries could take over any request and stream forged tokens for it. With the sweep here a
worker user needs neither XCLAIM nor a write to any other worker's keys (deploy/redis).

A worker is dead when its heartbeat hash ``{p}:worker:{consumer}`` has expired. That hash is
written only by its own HEARTBEAT, and a per-worker Redis user can write no other's, so
another worker cannot get a live worker judged dead. The registry only names the
candidates: its members past their expiry (the score HEARTBEAT sets with the hash's TTL), and
at every CONSUMER_LIST_EVERY-th sweep every member (a worker that wrote another's score into
the future cannot hide it for longer) and the consumers of the known models' request streams
(XINFO CONSUMERS: one the registry lost with the last second of an AOF). A sweep is one script
call of ~6 commands; every tenth adds the consumer lists (one XINFO per stream) and the known
models. (An EXISTS of every member at every sweep was 0.011 Redis commands per token at
bench-fleet's 16 workers x 1,024 streams with 2 gateways, more than the sweeps it replaced.)

Every heartbeat stops while Redis is down or stalled, and a restart from the AOF may lose the
last second of them: right after, live workers look dead. So a sweep judges nobody for a
worker heartbeat TTL (--worker-heartbeat-ttl) after its own call failed, and, since a script
sent before a stall runs when Redis comes back whatever the client's timeout said, SWEEP_SCRIPT
itself keeps the time of the last sweep by any gateway on Redis's clock (``{p}:sweep-clock``)
and waits the same after a gap of more than STALL_S beyond the sweep interval. (A chaos run
fenced a live worker when the clock alone guarded a restart: Redis was down 1.7 s, and the
gap, 3 s, was within the 2 s then allowed.)

SWEEP_SCRIPT judges the candidates and, for each dead one that still holds something (entries
pending under it in a request stream, or anything in its routed streams), fences it and lists
those entries; a dead one holding nothing leaves the registry and the group. The gateway
parses each entry (its record and its model's stream need the QueuedRequest) and
REQUEUE_SCRIPT moves it to the tail of the shared stream of its model and class: the record
follows (compare-and-set on its entry, as MOVE) and names the dead worker's log when it had
taken the request (its `deliveries` counted; a final logged there: finished, not queued again),
and the old entry is acknowledged and deleted, all in one script, so the entry is either still
the dead worker's or queued once. The first worker with room then claims it like any other and
resumes it from its log (the OWN script). Like a migration in Dynamo, a re-queued request waits
behind what is queued before it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from protos.keys import (
    CLAIM_ORDER,
    FENCE_MARK,
    RECORD_LEASE_S,
    STREAM_DATA_FIELD,
    WORKER_KEY_MARK,
    Keys,
    LogField,
    PriorityClass,
    Record,
    check_model_name,
)
from protos.redis_conn import text
from protos.tokenrelay.v1 import queue_pb2

log = logging.getLogger(__name__)

# The group's consumer lists cost one XINFO per request stream: 3 per model, so they are read
# at every 10th sweep only (a consumer the registry lost is rare: an AOF without its last second).
CONSUMER_LIST_EVERY = 10
MAX_ENTRIES = 256  # per stream and dead worker in one sweep; the rest wait for the next
# No sweep by any gateway for this long more than the sweep interval: Redis was down or
# stalled (or every gateway was away), and the heartbeats with it.
STALL_S = 0.5  # a late sweep (a busy event loop) only delays failover by one TTL
# How each class's stream name ends (CLAIM_ORDER), after "{p}:model:{m}:requests".
_SUFFIXES = [s.removeprefix(Keys("p", "m").requests) for s in Keys("p", "m").request_streams]

_DATA = STREAM_DATA_FIELD.decode()

# KEYS: registry, fenced set, consumer-models, sweep clock. ARGV: group, fence TTL ms, key
# prefix, MAX_ENTRIES, stall ms, worker heartbeat TTL ms, '1' (every registry member is a
# candidate) or '0' (those past their expiry), the known models' request streams, '--', more
# candidates (the group's consumers). A dead one's own model's streams (consumer-models) are
# searched with the known ones. Returns {{'wait'}} while heartbeats may not have been renewed
# since a stall, else {name, {stream, entry id, data or ''}...} per dead consumer that holds
# something (fenced now); the others are alive, or dead with nothing left (removed from the
# registry and the group).
SWEEP_SCRIPT = f"""
local registry, fenced, models, clock = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, fence_ttl, prefix, most = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local f = redis.call('HMGET', clock, 'last', 'since')
local since = tonumber(f[2] or '0')
if now - tonumber(f[1] or '0') > tonumber(ARGV[5]) then since = now end
redis.call('HSET', clock, 'last', now, 'since', since)
if now - since < tonumber(ARGV[6]) then return {{{{'wait'}}}} end
local known, i = {{}}, 8
while ARGV[i] ~= '--' do known[ARGV[i]] = true; i = i + 1 end
local names
if ARGV[7] == '1' then
  names = redis.call('ZRANGE', registry, 0, -1)
else
  names = redis.call('ZRANGEBYSCORE', registry, '-inf', now)
end
local seen = {{}}
for _, name in ipairs(names) do seen[name] = true end
for j = i + 1, #ARGV do
  if not seen[ARGV[j]] then seen[ARGV[j]] = true; names[#names + 1] = ARGV[j] end
end
local classes = {{{", ".join(repr(c.name.lower()) for c in CLAIM_ORDER)}}}
local suffixes = {{{", ".join(repr(x) for x in _SUFFIXES)}}}
local reply = {{}}
for _, name in ipairs(names) do
  if redis.call('EXISTS', prefix .. '{WORKER_KEY_MARK}' .. name) == 0 then
    local shared, listed = {{}}, {{}}
    for stream in pairs(known) do shared[#shared + 1] = stream; listed[stream] = true end
    local model = redis.call('HGET', models, name)
    for _, suffix in ipairs(model and suffixes or {{}}) do
      local stream = prefix .. ':model:' .. model .. ':requests' .. suffix
      if not listed[stream] then shared[#shared + 1] = stream; listed[stream] = true end
    end
    local held = {{}}
    for _, stream in ipairs(shared) do
      local ok, pending = pcall(redis.call, 'XPENDING', stream, group, '-', '+', most, name)
      if ok then
        for _, p in ipairs(pending) do
          local found = redis.call('XRANGE', stream, p[1], p[1])
          local data = ''
          if found[1] then
            for k = 1, #found[1][2], 2 do
              if found[1][2][k] == '{_DATA}' then data = found[1][2][k + 1] end
            end
          end
          held[#held + 1] = {{stream, p[1], data}}
        end
      end
    end
    local routed = {{}}
    for _, cls in ipairs(classes) do
      local stream = prefix .. ':routed:' .. cls .. ':' .. name
      routed[#routed + 1] = stream
      -- Pending under it or never delivered: all of it is this worker's.
      for _, e in ipairs(redis.call('XRANGE', stream, '-', '+', 'COUNT', most)) do
        local data = ''
        for k = 1, #e[2], 2 do
          if e[2][k] == '{_DATA}' then data = e[2][k + 1] end
        end
        held[#held + 1] = {{stream, e[1], data}}
      end
    end
    if #held == 0 then
      redis.call('ZREM', registry, name)
      redis.call('HDEL', models, name)
      for _, stream in ipairs(routed) do redis.call('DEL', stream) end
      for _, stream in ipairs(shared) do pcall(redis.call, 'XGROUP', 'DELCONSUMER', stream, group, name) end
    else
      redis.call('SADD', fenced, name)
      redis.call('PEXPIRE', fenced, fence_ttl)
      redis.call('SADD', prefix .. ':fence:' .. name, '{FENCE_MARK}')
      redis.call('PEXPIRE', prefix .. ':fence:' .. name, fence_ttl)
      -- Dead (score 0) until nothing of it is left: later sweeps find it here.
      redis.call('ZADD', registry, 0, name)
      reply[#reply + 1] = {{name, held}}
    end
  end
end
return reply
"""

# ARGV: group, key prefix, then per entry: the dead consumer, its stream, entry id, 'r' (a routed
# stream of that consumer: its entries are all the dead one's) or 'p' (a shared stream: only while
# pending under it), the shared stream it goes to, its record key and request key ('' =
# unreadable: deleted). What the dead worker logged for an entry it held (HELD = the entry: the
# pending list says it was delivered to it, and only it writes its log) is the request's log
# from now on: the record names it, so the next claimant resumes from there, and a final there
# means finished (the entry is only deleted). Returns how many entries were queued again.
REQUEUE_SCRIPT = f"""
local group, prefix, queued = ARGV[1], ARGV[2], 0
for i = 3, #ARGV, 7 do
  local name, from, id, kind = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local to, rec, rid = ARGV[i + 4], ARGV[i + 5], ARGV[i + 6]
  local ok, pending = pcall(redis.call, 'XPENDING', from, group, id, id, 1)
  local holder = ok and pending[1] and pending[1][2]
  if holder == name or (kind == 'r' and not holder) then
    local found = redis.call('XRANGE', from, id, id)
    if found[1] and rec ~= '' then
      local data = ''
      for k = 1, #found[1][2], 2 do
        if found[1][2][k] == '{_DATA}' then data = found[1][2][k + 1] end
      end
      local entry = redis.call('HGET', rec, '{Record.ENTRY}')
      local log = prefix .. ':log:' .. name
      local h = {{false, false}}
      if holder == name then
        h = redis.call('HMGET', log, rid .. '{LogField.HELD}', rid .. '{LogField.FINAL}')
      end
      local took = h[1] == id and entry == id
      if took then redis.call('HSET', rec, '{Record.LOG}', log) end
      -- No record (a Redis that lost it): queued again all the same; the claimant makes do.
      if not entry or (entry == id and not (took and h[2])) then
        local new = redis.call('XADD', to, '*', '{_DATA}', data)
        queued = queued + 1
        if entry then
          redis.call('HSET', rec, '{Record.ENTRY}', new, '{Record.STREAM}', to)
          if took then redis.call('HINCRBY', rec, '{Record.DELIVERIES}', 1) end  -- it died holding it
        end
      end
    end
    if holder then redis.call('XACK', from, group, id) end
    redis.call('XDEL', from, id)
  end
end
return queued
"""


class Sweeper:
    """Sweeps every sweep_interval_s (see the module's docstring). served: the names of the
    models this gateway serves (their request streams are searched for a dead worker's entries,
    with those of every model a worker heart-beats)."""

    def __init__(self, client: aioredis.Redis, config: GatewayConfig,
                 served: Callable[[], Awaitable[list[str]]],
                 on_swept: Callable[[int, int], None] | None = None) -> None:
        self.client, self.config, self.keys = client, config, config.keys
        self._served = served
        self._on_swept = on_swept  # (consumers fenced, entries queued again), for the metrics
        self._sweep = client.register_script(SWEEP_SCRIPT)
        self._requeue = client.register_script(REQUEUE_SCRIPT)
        self._num_sweeps = 0
        self._not_before = 0.0  # monotonic: no judging before, after a failed call
        self._streams: list[str] = []  # the known models' request streams, read every tenth sweep

    async def run(self) -> None:
        """Sweep until cancelled; a failed sweep is logged and the next one tries again."""
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                await self.sweep()
            except RedisError as e:
                log.warning("sweep failed (%s); the next judges nobody for a worker heartbeat TTL", e)
                self.defer()
            except Exception:  # a bug, or something a worker wrote: the next sweep must still run
                log.exception("sweep failed")

    def defer(self) -> None:
        """Redis failed: judge nobody for a worker heartbeat TTL (every heartbeat failed too)."""
        self._not_before = time.monotonic() + self.config.worker_heartbeat_ttl_s

    async def sweep(self) -> tuple[int, int]:
        """One sweep: (consumers fenced, entries queued again). Raises RedisError."""
        if time.monotonic() < self._not_before:
            return 0, 0
        keys = self.keys
        names: set[str] = set()
        is_full = self._num_sweeps % CONSUMER_LIST_EVERY == 0
        if is_full:
            self._streams = [s for m in await self._models() for s in keys.for_model(m).request_streams]
            pipe = self.client.pipeline(transaction=False)
            for stream in self._streams:
                pipe.xinfo_consumers(stream, keys.group)
            for reply in await pipe.execute(raise_on_error=False):
                if not isinstance(reply, Exception):  # no stream or group yet: nobody claimed there
                    names |= {text(c["name"]) for c in reply}
        self._num_sweeps += 1
        interval_ms = int(self.config.sweep_interval_s * 1000)
        dead = cast(list[Any], await self._sweep(
            keys=[keys.registry, keys.fenced, keys.consumer_models, keys.sweep_clock],
            args=[keys.group, int(RECORD_LEASE_S * 1000), keys.prefix, MAX_ENTRIES,
                  interval_ms + int(STALL_S * 1000), int(self.config.worker_heartbeat_ttl_s * 1000),
                  "1" if is_full else "0", *self._streams, "--", *sorted(names)]))
        if dead and dead[0] == [b"wait"]:
            return 0, 0
        args: list[Any] = [keys.group, keys.prefix]
        for name, held in dead:
            consumer = text(name)
            routed = set(keys.routed_streams(consumer))
            for stream, entry_id, data in held:
                is_routed = text(stream) in routed
                to, request_key = self._destination(entry_id, data, None if is_routed else text(stream))
                record = keys.record(request_key) if request_key else ""
                args += [consumer, stream, entry_id, "r" if is_routed else "p", to, record, request_key]
        queued = int(await self._requeue(args=args)) if len(args) > 2 else 0
        if dead:
            log.warning("fenced %d dead workers (%s); %d of their requests queued again", len(dead),
                        ", ".join(text(n) for n, _ in dead), queued)
        if self._on_swept is not None:
            self._on_swept(len(dead), queued)
        return len(dead), queued

    async def _models(self) -> list[str]:
        """The served models and every model a worker heart-beats (a name that is not a model's,
        which only a misbehaving worker writes, is left out)."""
        heartbeats = {text(m) for m in cast(list[bytes], await self.client.hvals(self.keys.consumer_models))}
        models = set(await self._served())
        for model in heartbeats - models:
            try:
                check_model_name("model", model)
                models.add(model)
            except ValueError:
                log.error("a worker heart-beats a model named %r: not searched", model)
        return sorted(models)

    def _destination(self, entry_id: bytes, data: bytes, shared: str | None) -> tuple[str, str]:
        """(the shared stream the entry goes to, its request's key). shared: the one it is pending in;
        None for a routed entry, which goes to that of its model and class. ('', '') when the
        entry cannot be read: it is deleted, as a worker acknowledges what it cannot parse."""
        try:  # a foreign or corrupt entry must not stop the sweep
            queued = queue_pb2.QueuedRequest.FromString(data)
            if not queued.request_id:
                raise ValueError("no request id")
            request = queued.request
            if shared is None:
                shared = self.keys.for_model(request.model).requests_of(PriorityClass.of(request.priority))
        except Exception:
            log.error("deleting an unreadable stream entry %r of a dead worker", entry_id)
            return "", ""
        return shared, queued.request_id
