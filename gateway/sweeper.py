"""The sweeper: every gateway finds dead workers, fences them and puts their requests back in the
queue (protos/keys.py, "Fencing").

It runs in the gateways, not in the workers, because workers load model files and compiled
code and so deserve the least trust: a worker that could fence others and XCLAIM their
entries could take over any request and stream forged tokens for it. With the sweep here a
worker user needs neither XCLAIM nor a write to any other worker's keys (deploy/redis).

A worker is dead when its heartbeat hash ``{p}:worker:{consumer}`` has expired. That hash is
written only by its own HEARTBEAT, and a per-worker Redis user can write no other's, so
another worker cannot get a live worker judged dead. The registry only names the
candidates: every member at every sweep (one ZRANGE; a registry holds one member per worker
process), and at every CONSUMER_LIST_EVERY-th sweep the consumers of the served models'
request streams too (XINFO CONSUMERS): one the registry lost with the last second of an AOF.

SWEEP_SCRIPT judges the candidates and, for each dead one that still holds something (entries
pending under it in a request stream, or anything in its routed streams), fences it and lists
those entries; a dead one holding nothing leaves the registry and the group. The gateway
parses each entry (its record and its model's stream need the QueuedRequest) and
REQUEUE_SCRIPT moves it to the tail of the shared stream of its model and class: the record
follows (compare-and-set on its entry, as MOVE), a record the dead worker owned is released
and its `deliveries` counted, and the old entry is acknowledged and deleted, all in one
script, so the entry is either still the dead worker's or queued once. The first worker with
room then claims it like any other and resumes it from its log (the OWN script). Like a
migration in Dynamo, a re-queued request waits behind what is queued before it.
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
    PriorityClass,
    Record,
)
from protos.tokenrelay.v1 import queue_pb2

log = logging.getLogger(__name__)

# The group's consumer lists cost one XINFO per request stream: 3 per model, so they are read
# at every 10th sweep only (a consumer the registry lost is rare: an AOF without its last second).
CONSUMER_LIST_EVERY = 10
MAX_ENTRIES = 256  # per stream and dead worker in one sweep; the rest wait for the next
SLOW_SWEEP_S = 1.0  # a registry read slower than this: Redis was stalled, heartbeats too

_DATA = STREAM_DATA_FIELD.decode()

# KEYS: registry, fenced set, consumer-models. ARGV: group, fence TTL ms, key prefix, MAX_ENTRIES,
# the served models' request streams, '--', the candidates. Returns {name, {stream, entry id,
# data or ''}...} per dead consumer that holds something (fenced now); the others are alive,
# or dead with nothing left (removed from the registry and the group).
SWEEP_SCRIPT = f"""
local registry, fenced, models = KEYS[1], KEYS[2], KEYS[3]
local group, fence_ttl, prefix, most = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local shared, i = {{}}, 5
while ARGV[i] ~= '--' do shared[#shared + 1] = ARGV[i]; i = i + 1 end
local classes = {{{", ".join(repr(c.name.lower()) for c in CLAIM_ORDER)}}}
local reply = {{}}
for j = i + 1, #ARGV do
  local name = ARGV[j]
  if redis.call('EXISTS', prefix .. '{WORKER_KEY_MARK}' .. name) == 0 then
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
      redis.call('SADD', prefix .. ':revoked:' .. name, '{FENCE_MARK}')
      redis.call('PEXPIRE', prefix .. ':revoked:' .. name, fence_ttl)
      -- Dead (score 0) until nothing of it is left: later sweeps find it here.
      redis.call('ZADD', registry, 0, name)
      reply[#reply + 1] = {{name, held}}
    end
  end
end
return reply
"""

# ARGV: group, then per entry: the dead consumer, its stream, entry id, 'r' (a routed stream of
# that consumer: its entries are all the dead one's) or 'p' (a shared stream: only while
# pending under it), the shared stream it goes to, its record key ('' = unreadable: deleted).
# Returns how many entries were queued again.
REQUEUE_SCRIPT = f"""
local group, queued = ARGV[1], 0
for i = 2, #ARGV, 6 do
  local name, from, id, kind = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local to, rec = ARGV[i + 4], ARGV[i + 5]
  local ok, pending = pcall(redis.call, 'XPENDING', from, group, id, id, 1)
  local holder = ok and pending[1] and pending[1][2]
  if holder == name or (kind == 'r' and not holder) then
    local found = redis.call('XRANGE', from, id, id)
    if found[1] and rec ~= '' then
      local data = ''
      for k = 1, #found[1][2], 2 do
        if found[1][2][k] == '{_DATA}' then data = found[1][2][k + 1] end
      end
      local f = redis.call('HMGET', rec, '{Record.ENTRY}', '{Record.FINAL}', '{Record.OWNER}')
      -- No record (a Redis that lost it): queued again all the same; the claimant makes do.
      if not f[1] or (f[1] == id and not f[2]) then
        local new = redis.call('XADD', to, '*', '{_DATA}', data)
        queued = queued + 1
        if f[1] then
          redis.call('HSET', rec, '{Record.ENTRY}', new, '{Record.STREAM}', to)
          if f[3] == name then  -- it died holding the request: released, and counted
            redis.call('HSET', rec, '{Record.OWNER}', '')
            redis.call('HINCRBY', rec, '{Record.DELIVERIES}', 1)
          end
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
        self._not_before = 0.0

    async def run(self) -> None:
        """Sweep until cancelled."""
        while True:
            await asyncio.sleep(max(self.config.sweep_interval_s, self._not_before - time.monotonic()))
            try:
                await self.sweep()
            except RedisError as e:
                log.warning("sweep failed (%s); the next waits a worker heartbeat TTL", e)
                self.defer()

    def defer(self) -> None:
        """Redis failed or stalled: sweep no sooner than a worker heartbeat TTL from now. Every
        worker's heartbeat stopped with it, and once Redis is back they renew within an
        interval: a sweep before then would fence live workers for an outage, not a death."""
        self._not_before = max(self._not_before, time.monotonic() + self.config.worker_heartbeat_ttl_s)

    async def sweep(self) -> tuple[int, int]:
        """One sweep: (consumers fenced, entries queued again). Raises RedisError."""
        if time.monotonic() < self._not_before:
            return 0, 0
        keys = self.keys
        streams = [s for m in await self._models() for s in keys.for_model(m).request_streams]
        list_consumers = self._num_sweeps % CONSUMER_LIST_EVERY == 0
        self._num_sweeps += 1
        started = time.monotonic()
        pipe = self.client.pipeline(transaction=False)
        pipe.zrange(keys.registry, 0, -1)
        if list_consumers:
            for stream in streams:
                pipe.xinfo_consumers(stream, keys.group)
        registry, *lists = await pipe.execute(raise_on_error=False)
        if isinstance(registry, Exception):
            raise registry
        if time.monotonic() - started > SLOW_SWEEP_S:
            self.defer()
            return 0, 0
        names = {_text(n) for n in registry}
        for reply in lists:
            if not isinstance(reply, Exception):  # no stream or group yet: nobody ever claimed there
                names |= {_text(c["name"]) for c in reply}
        if not names:
            return 0, 0
        dead = await self._sweep(keys=[keys.registry, keys.fenced, keys.consumer_models],
                                 args=[keys.group, int(RECORD_LEASE_S * 1000), keys.prefix, MAX_ENTRIES,
                                       *streams, "--", *sorted(names)])
        args: list[Any] = [keys.group]
        for name, held in cast(list[Any], dead):
            consumer = _text(name)
            routed = set(keys.routed_streams(consumer))
            for stream, entry_id, data in held:
                is_routed = _text(stream) in routed
                to, record = self._destination(entry_id, data, None if is_routed else _text(stream))
                args += [consumer, stream, entry_id, "r" if is_routed else "p", to, record]
        queued = int(await self._requeue(args=args)) if len(args) > 1 else 0
        if dead:
            log.warning("fenced %d dead workers (%s); %d of their requests queued again", len(dead),
                        ", ".join(_text(n) for n, _ in dead), queued)
        if self._on_swept is not None:
            self._on_swept(len(dead), queued)
        return len(dead), queued

    async def _models(self) -> list[str]:
        """The served models and every model a worker heart-beats (a dead worker's among them)."""
        heartbeats = cast(list[bytes], await self.client.hvals(self.keys.consumer_models))
        return sorted({*await self._served(), *(_text(m) for m in heartbeats)})

    def _destination(self, entry_id: bytes, data: bytes, shared: str | None) -> tuple[str, str]:
        """(the shared stream the entry goes to, its record). shared: the one it is pending in;
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
        return shared, self.keys.record(queued.request_id)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
