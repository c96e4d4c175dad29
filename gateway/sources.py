"""Which worker may stream a request: the one that holds its current entry.

Only gateways write request records (workers may not: deploy/redis). The round of a worker that
admits a request announces it (`TokenEventBatch.admitted`, before the prefill). The reply router
(gateway/replies.py) asks `Sources` about every event: an event of the request's known worker is
relayed at once; the first event (or announcement) of another worker is held while VERIFY runs
(one script call for every check asked together), then relayed, or dropped and counted
(`on_refused`). VERIFY accepts the worker whose log the record names, or one that holds the
record's entry in the stream's pending list, which only a claim (XREADGROUP) writes and no
worker can move; the record then names that worker's log (`Record.LOG`), so a resume on any
gateway reads the log of a worker it may trust. A finished attempt's entry stays pending until
its record names its worker's log (worker/io/scripts.py STEP), so a final is never refused for
being quick. So a worker that may publish only on its own out channel (a per-worker Redis
user) cannot put tokens into a stream it does not run, nor point a record at a log it wrote,
and a late event of an owner that was taken over is not relayed (the log it was copied into
fills any gap).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from protos.keys import Keys, Record
from protos.tokenrelay.v1 import queue_pb2

log = logging.getLogger(__name__)

# Per check: ARGV = record key, the worker's log key, its consumer name. ARGV[1] = the group.
# Returns 1 (it may stream the request) or 0 per check.
VERIFY_SCRIPT = f"""
local group = ARGV[1]
local reply = {{}}
for i = 2, #ARGV, 3 do
  local rec, log, consumer = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local f = redis.call('HMGET', rec, '{Record.LOG}', '{Record.ENTRY}', '{Record.STREAM}')
  local ok = 0
  if f[1] == log then
    ok = 1
  elseif f[2] and f[3] then
    local found, pending = pcall(redis.call, 'XPENDING', f[3], group, f[2], f[2], 1)
    if found and pending[1] and pending[1][2] == consumer then
      redis.call('HSET', rec, '{Record.LOG}', log)
      ok = 1
    end
  end
  reply[#reply + 1] = ok
end
return reply
"""

# A finished request's record lives its result TTL (ARGV[1], ms) from the final on: shortened from
# the creation lease, never lengthened (a record must not outlive the worker's log, which drops
# the request's fields after the result TTL). KEYS: the records of the finals relayed together.
SHORTEN_SCRIPT = """
for _, rec in ipairs(KEYS) do
  if redis.call('PTTL', rec) > tonumber(ARGV[1]) then redis.call('PEXPIRE', rec, ARGV[1]) end
end
"""

# After a worker was refused for a request, its further events for that request are dropped this
# long without reading the record again (a misbehaving worker cannot make every gateway read
# Redis once per event it publishes).
REFUSED_FOR_S = 1.0


class Sources:
    """deliver(event): hand a checked event to the request's calls; max_held: events held per
    (request, worker) while its check runs (beyond: dropped, the relay fills the gap from the log);
    result_ttl_s: what `finished` shortens a record to (None: nothing)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, deliver: Callable[[queue_pb2.TokenEvent], None],
                 max_held: int, result_ttl_s: float | None = None) -> None:
        self._client, self._keys, self._deliver, self._max_held = client, keys, deliver, max_held
        self._verify = client.register_script(VERIFY_SCRIPT)
        self._shorten = client.register_script(SHORTEN_SCRIPT)
        self._result_ttl_ms = 0 if result_ttl_s is None else max(1, int(result_ttl_s * 1000))  # 0: none
        self._finished: list[str] = []  # records to shorten in the next call
        self.known: dict[str, str] = {}  # request id -> the consumer VERIFY accepted
        self._held: dict[str, dict[str, list[queue_pb2.TokenEvent]]] = {}  # while a check runs
        self._refused: dict[str, dict[str, float]] = {}  # request id -> consumer -> until (monotonic)
        self._asked: list[tuple[str, str]] = []  # (request id, consumer) for the next VERIFY call
        self.tasks: set[asyncio.Task[None]] = set()
        self.on_refused: Callable[[int], Any] | None = None  # called with each count of events dropped

    def check(self, request_id: str, consumer: str, event: queue_pb2.TokenEvent | None = None) -> None:
        """An event (or an announcement, event None) from a worker not known to run the request:
        hold it while the record is read, or drop it if that worker was refused a moment ago."""
        held = self._held.setdefault(request_id, {}).get(consumer)
        if held is not None:
            if event is not None and len(held) < self._max_held:
                held.append(event)
            return
        if time.monotonic() < self._refused.get(request_id, {}).get(consumer, 0.0):
            if event is not None:
                self._count_refused(1)
            return
        self._held[request_id][consumer] = [] if event is None else [event]
        self._asked.append((request_id, consumer))
        if len(self._asked) == 1:  # the checks asked until the task runs join its call
            self._spawn(self._check_asked())

    def finished(self, request_id: str) -> None:
        """A checked worker's final reached the request's calls: its record lives the result TTL
        from now (at most). The finals relayed until the task runs share one script call (a burst
        of requests ends together)."""
        if not self._result_ttl_ms:
            return
        self._finished.append(self._keys.record(request_id))
        if len(self._finished) == 1:
            self._spawn(self._shorten_finished())

    async def _shorten_finished(self) -> None:
        await asyncio.sleep(0)
        records, self._finished = self._finished, []
        try:
            await self._shorten(keys=records, args=[self._result_ttl_ms])
        except RedisError as e:  # they keep their creation lease (RECORD_LEASE_S) instead
            log.warning("could not shorten %d finished requests' records to the result TTL: %s",
                        len(records), e)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def forget(self, request_id: str) -> None:
        """Nobody on this gateway follows the request any more."""
        self.known.pop(request_id, None)
        self._held.pop(request_id, None)
        self._refused.pop(request_id, None)

    async def _check_asked(self) -> None:
        """One round trip for every check asked since the last: a burst of requests starts
        together (bench-e2e, 16 streams: one HMGET each added ~5 ms to the first token)."""
        await asyncio.sleep(0)  # let the pub/sub reader dispatch what it already received
        asked, self._asked = self._asked, []
        args: list[str] = [self._keys.group]
        for request_id, consumer in asked:
            args += [self._keys.record(request_id), self._keys.log(consumer), consumer]
        try:
            found: list[Any] = await self._verify(args=args)
        except RedisError:
            found = [0] * len(asked)  # as refused: the relay re-reads the log after a gap or a resync
        for (request_id, consumer), ok in zip(asked, found, strict=True):
            self._checked(request_id, consumer, bool(ok))

    def _checked(self, request_id: str, consumer: str, ok: bool) -> None:
        if request_id not in self._held:  # forgotten meanwhile: nobody follows it any more
            return
        held = self._held[request_id].pop(consumer, [])
        if ok:
            self.known[request_id] = consumer
            self._refused.get(request_id, {}).pop(consumer, None)
            for event in held:
                self._deliver(event)
                if event.HasField("final"):
                    self.finished(request_id)
            return
        self._refused.setdefault(request_id, {})[consumer] = time.monotonic() + REFUSED_FOR_S
        if not held:  # an announcement alone (a takeover raced it): nothing was dropped
            return
        log.warning("request %s: refused worker %s (%d events dropped): it does not hold the request's "
                    "current entry", request_id, consumer, len(held))
        self._count_refused(len(held))

    def _count_refused(self, num_events: int) -> None:
        if self.on_refused is not None:
            self.on_refused(num_events)
