"""The gateway's pub/sub connection: every worker's rounds in, each call's events out.

Workers publish one `TokenEventBatch` per round on their out channel ``{p}:out:{consumer}``
(protos/keys.py); the router PSUBSCRIBEs ``{p}:out:*`` once, for the life of the connection,
and hands each event to the calls of this gateway that follow its request, by request id.
So a call needs no subscription of its own to receive: it registers locally, then reads the
request's log, and every event is either in that log or arrives after (the worker's STEP
script logs a round before it publishes it, atomically). A call still SUBSCRIBEs its
request's channel ``{p}:events:{id}``, which carries nothing: its subscriber count tells the
worker whether anyone follows the request (PUBSUB NUMSUB), so an unfollowed one is parked.
Several calls of this gateway may follow one request (a client resumed before the gateway
noticed its old call was gone): each gets every event.

An event is relayed only from the out channel of the worker that holds the request's entry
(gateway/sources.py): the round that admits a request announces it, so that worker is known
before its first token; an event from any other worker is held while it is checked, then
relayed or dropped.

Each call's queue is bounded (`max_queued_events`): a call that reads slower than its
request generates loses what is queued, and gets `RESYNC` instead, so its relay re-reads
what it missed from the log; memory stays bounded whatever a worker sends.

If the connection drops, calls are not failed: the router reconnects with backoff,
subscribes again, and then puts `RESYNC` into each call's queue, so the relay re-reads what
it missed from the log. New calls are refused while it is down (`is_ready`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.errors import GatewayError, Unavailable
from gateway.sources import Sources
from protos.keys import Keys
from protos.redis_conn import Backoff
from protos.tokenrelay.v1 import queue_pb2

log = logging.getLogger(__name__)


class Resync:
    """Queued after a resubscription or an overflow: events may have been missed."""


class Tick:
    """Queued into every idle call's queue each `tick_s`: the call's clock for its liveness checks.
    One timer for the gateway, not a timeout per awaited event: at 1,024 streams a per-event
    asyncio.timeout was ~6% of the gateway's CPU (py-spy, fleet bench, 2026-12-03)."""


class Full:
    """Queued into a call whose attempt waits, unclaimed, in the own stream of a worker that just
    said it has no room (TokenEventBatch.room = 0; gateway/routing.py): move it now, not after
    --route-max-wait-ms."""


RESYNC: Final = Resync()
TICK: Final = Tick()
FULL: Final = Full()
# What a call's queue receives: worker events, RESYNC, TICK, FULL, or the error that ends the call.
CallItem = queue_pb2.TokenEvent | Resync | Tick | Full | GatewayError
SUBSCRIBE_TIMEOUT_S = 5.0
DEFAULT_MAX_QUEUED_EVENTS = 1024
DEFAULT_TICK_S = 1.0


class CallQueue(asyncio.Queue[CallItem]):
    """One call's items. is_heard: something was offered since the ticker's last look, so the
    call is not idle and needs no TICK (a streaming call is never woken for nothing)."""

    is_heard = False


def offer(queue: asyncio.Queue[CallItem], item: CallItem) -> None:
    """Queue `item`; a full queue is emptied first and told to RESYNC (the log has its events;
    the queue's maxsize is >= 2)."""
    if isinstance(queue, CallQueue):
        queue.is_heard = True
    if queue.full():
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(RESYNC)
        if isinstance(item, Resync):
            return
    queue.put_nowait(item)


class ReplyRouter:
    def __init__(self, client: aioredis.Redis, keys: Keys, home: str, *,
                 max_backoff_s: float = 2.0, max_queued_events: int = DEFAULT_MAX_QUEUED_EVENTS,
                 tick_s: float = DEFAULT_TICK_S, on_ready_change: Callable[[bool], Any] | None = None,
                 result_ttl_s: float | None = None) -> None:
        """home: the gateway's own channel (`Keys.gateway`); tick_s: how often an idle call gets
        TICK; result_ttl_s: a relayed final shortens its record to it (None: left alone). Calls
        follow a request's presence channel (`Keys.events`); events come from every worker's out
        channel (`Keys.out_pattern`)."""
        self._client, self._keys, self._home = client, keys, home
        self._channel_of, self._out_pattern = keys.events, keys.out_pattern
        self._out_mark = keys.out("")  # an out channel's name is this + the worker's consumer name
        self._max_backoff_s = max_backoff_s
        self._max_queued = max(2, max_queued_events)
        self._tick_s = tick_s
        self._on_ready_change = on_ready_change
        self._calls: dict[str, list[CallQueue]] = {}  # request id -> its followers
        self.sources = Sources(client, keys, self._deliver, self._max_queued, result_ttl_s)
        self._confirmed: dict[str, asyncio.Future[None]] = {}  # channel -> its SUBSCRIBE confirmation
        self._pubsub: Any = None
        self._ready = asyncio.Event()
        self._tried = asyncio.Event()  # the first connection attempt ended, either way
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        # Called with (consumer, room, admitted request ids) for each round that says its room.
        self.on_room: Callable[[str, int, Sequence[str]], Any] | None = None

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    @property
    def num_calls(self) -> int:
        return sum(len(calls) for calls in self._calls.values())

    async def start(self, timeout_s: float | None = None) -> bool:
        """Start the connection; True if the first attempt succeeded (it keeps trying after)."""
        self._task = asyncio.create_task(self._run(), name="reply-router")
        self._ticker = asyncio.create_task(self._tick_forever(), name="reply-ticker")
        with contextlib.suppress(TimeoutError):  # asyncio.timeout: a cancel is never swallowed
            async with asyncio.timeout(timeout_s):
                await self._tried.wait()
        return self.is_ready

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._ticker, *self.sources.tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for calls in self._calls.values():
            for queue in calls:
                offer(queue, Unavailable("the gateway is shutting down; resume on another gateway"))

    async def follow(self, request_id: str) -> CallQueue:
        """Deliver the request's events to a new queue, and SUBSCRIBE its presence channel (returns
        once Redis confirmed, so a worker claiming it next counts this call). If this raises or is
        cancelled, nothing stays registered."""
        channel = self._channel_of(request_id)
        queue = CallQueue(self._max_queued)
        self._calls.setdefault(request_id, []).append(queue)
        try:
            if self._pubsub is None:
                raise RedisConnectionError("not connected")
            if channel not in self._confirmed:  # else another call of this gateway follows it
                self._confirmed[channel] = asyncio.get_running_loop().create_future()
                await self._pubsub.subscribe(channel)
            # wait_for would cancel the shared future for every call waiting on it.
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await asyncio.shield(self._confirmed[channel])
        except (RedisError, OSError, TimeoutError) as e:
            self.unfollow(request_id, queue)
            raise Unavailable(f"could not subscribe to the request's events (Redis): {e}") from None
        except BaseException:  # cancelled mid-subscribe: leave nothing behind (no leaked follower)
            self.unfollow(request_id, queue)
            raise
        return queue

    def unfollow(self, request_id: str, queue: asyncio.Queue[CallItem]) -> None:
        calls = self._calls.get(request_id, [])
        if queue in calls:
            calls.remove(queue)
        if calls:
            return
        channel = self._channel_of(request_id)
        self._calls.pop(request_id, None)
        self._confirmed.pop(channel, None)
        self.sources.forget(request_id)
        if self._pubsub is not None and self.is_ready:
            task = asyncio.ensure_future(self._unsubscribe(request_id, channel))
            # A lost UNSUBSCRIBE ends with the connection; a cancelled one with the gateway.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _unsubscribe(self, request_id: str, channel: str) -> None:
        if request_id not in self._calls:  # nobody followed it again meanwhile
            await self._pubsub.unsubscribe(channel)

    async def _tick_forever(self) -> None:
        """Each tick_s, TICK into every call queue that was offered nothing since the last tick
        and is empty (else it is read anyway): at 1,024 streams a TICK into every queue each
        second woke 1,024 relays in one burst, ahead of the tokens arriving meanwhile."""
        while True:
            await asyncio.sleep(self._tick_s)
            for calls in self._calls.values():
                for queue in calls:
                    if queue.is_heard:
                        queue.is_heard = False
                    elif queue.empty():
                        queue.put_nowait(TICK)

    async def _run(self) -> None:
        backoff = Backoff(self._max_backoff_s)
        while True:
            pubsub = self._client.pubsub()
            try:
                await self._connect(pubsub)
                backoff.reset()
                self._set_ready(True)
                self._tried.set()
                async for message in pubsub.listen():
                    self._on_message(message)
                raise RedisConnectionError("the subscription ended")  # listen() may end quietly on EOF
            except (RedisError, OSError, TimeoutError) as e:
                if self.is_ready:
                    log.warning("event subscription lost: %s; reconnecting", e)
                self._pubsub = None
                self._set_ready(False)
                for channel, future in list(self._confirmed.items()):
                    if future.done():  # confirmed on the lost connection: confirm again after
                        self._confirmed[channel] = asyncio.get_running_loop().create_future()
                self._tried.set()
                await asyncio.sleep(backoff.failed())
            finally:
                await pubsub.aclose()

    async def _connect(self, pubsub: Any) -> None:
        """PSUBSCRIBE the workers' out channels, SUBSCRIBE the gateway's own channel (it keeps the
        connection subscribed, so a drop is noticed with no call open) and again every
        followed request's channel."""
        channels = [self._channel_of(request_id) for request_id in self._calls]
        for channel in channels:
            self._confirmed.setdefault(channel, asyncio.get_running_loop().create_future())
        self._confirmed[self._home] = asyncio.get_running_loop().create_future()
        self._confirmed[self._out_pattern] = asyncio.get_running_loop().create_future()
        await pubsub.psubscribe(self._out_pattern)
        await pubsub.subscribe(self._home, *channels)
        async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
            while not all(f.done() for f in self._confirmed.values()):
                message = await pubsub.get_message(timeout=SUBSCRIBE_TIMEOUT_S)
                if message is not None:
                    self._on_message(message)
        self._pubsub = pubsub
        for calls in self._calls.values():
            for queue in calls:
                offer(queue, RESYNC)

    def _on_message(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "pmessage":
            self._dispatch(message["channel"], message["data"])
        elif kind in ("subscribe", "psubscribe"):
            channel = message["channel"]
            channel = channel.decode() if isinstance(channel, bytes) else channel
            future = self._confirmed.get(channel)
            if future is not None and not future.done():
                future.set_result(None)

    def _dispatch(self, channel: bytes | str, data: bytes) -> None:
        try:
            batch = queue_pb2.TokenEventBatch.FromString(data)
        except Exception:  # a foreign publisher must not kill the router
            log.error("ignoring unreadable message on %r", channel)
            return
        calls, sources = self._calls, self.sources
        name = channel.decode(errors="replace") if isinstance(channel, bytes) else channel
        consumer = name[len(self._out_mark):]
        for request_id in batch.admitted:  # a worker took it: check its record before its first token
            if request_id in calls and sources.known.get(request_id) != consumer:
                sources.check(request_id, consumer)
        if self.on_room is not None and batch.HasField("room"):
            self.on_room(consumer, batch.room, batch.admitted)
        for event in batch.events:
            queues = calls.get(event.request_id)
            if not queues:
                continue
            if sources.known.get(event.request_id) == consumer:
                for queue in queues:
                    offer(queue, event)
                if event.HasField("final"):
                    sources.finished(event.request_id)
            else:
                sources.check(event.request_id, consumer, event)

    def _deliver(self, event: queue_pb2.TokenEvent) -> None:
        for queue in self._calls.get(event.request_id, ()):
            offer(queue, event)

    def _set_ready(self, is_ready: bool) -> None:
        if is_ready == self.is_ready:
            return
        if is_ready:
            self._ready.set()
        else:
            self._ready.clear()
        if self._on_ready_change is not None:
            self._on_ready_change(is_ready)
