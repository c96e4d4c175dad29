"""The gateway's pub/sub connection: one per gateway, one channel per followed request.

A call follows a request by SUBSCRIBing to its channel ``{p}:events:{id}`` and
waiting for Redis to confirm before it reads the request's log or enqueues
anything (protos/keys.py), so no event can fall between the two. Several calls
of this gateway may follow one request (a client resumed before the gateway
noticed its old call was gone): each gets every event.

If the connection drops, calls are not failed: the router reconnects with
backoff, subscribes again to every followed channel, and then puts `RESYNC`
into each call's queue, so the relay re-reads what it missed from the log. New
calls are refused while it is down (`is_ready`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.errors import GatewayError, Unavailable
from protos.redis_conn import Backoff
from protos.tokenrelay.v1 import queue_pb2

log = logging.getLogger(__name__)


class Resync:
    """Queued after a resubscription: events may have been published meanwhile."""


RESYNC: Final = Resync()
# What a call's queue receives: worker events, RESYNC, or the error that ends the call.
CallItem = queue_pb2.TokenEvent | Resync | GatewayError
SUBSCRIBE_TIMEOUT_S = 5.0


class ReplyRouter:
    def __init__(self, client: aioredis.Redis, home: str, channel_of: Callable[[str], str], *,
                 max_backoff_s: float = 2.0, on_ready_change: Callable[[bool], Any] | None = None) -> None:
        """home: the gateway's own channel (`Keys.gateway`); channel_of(request_id): the
        request's event channel (`Keys.events`)."""
        self._client, self._home, self._channel_of = client, home, channel_of
        self._max_backoff_s = max_backoff_s
        self._on_ready_change = on_ready_change
        self._calls: dict[str, list[asyncio.Queue[CallItem]]] = {}  # channel -> its followers
        self._confirmed: dict[str, asyncio.Future[None]] = {}  # channel -> its SUBSCRIBE confirmation
        self._pubsub: Any = None
        self._ready = asyncio.Event()
        self._tried = asyncio.Event()  # the first connection attempt ended, either way
        self._task: asyncio.Task[None] | None = None

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    @property
    def num_calls(self) -> int:
        return sum(len(calls) for calls in self._calls.values())

    async def start(self, timeout_s: float | None = None) -> bool:
        """Start the connection; True if the first attempt succeeded (it keeps trying after)."""
        self._task = asyncio.create_task(self._run(), name="reply-router")
        try:
            await asyncio.wait_for(self._tried.wait(), timeout_s)
        except TimeoutError:
            pass
        return self.is_ready

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for calls in self._calls.values():
            for queue in calls:
                queue.put_nowait(Unavailable("the gateway is shutting down; resume on another gateway"))

    async def follow(self, request_id: str) -> asyncio.Queue[CallItem]:
        """Subscribe this call to the request's events; returns once Redis confirmed."""
        channel = self._channel_of(request_id)
        queue: asyncio.Queue[CallItem] = asyncio.Queue()
        self._calls.setdefault(channel, []).append(queue)
        try:
            if self._pubsub is None:
                raise RedisConnectionError("not connected")
            if channel not in self._confirmed:  # else another call of this gateway follows it
                self._confirmed[channel] = asyncio.get_running_loop().create_future()
                await self._pubsub.subscribe(channel)
            await asyncio.wait_for(asyncio.shield(self._confirmed[channel]), SUBSCRIBE_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as e:
            self.unfollow(request_id, queue)
            raise Unavailable(f"could not subscribe to the request's events (Redis): {e}") from None
        return queue

    def unfollow(self, request_id: str, queue: asyncio.Queue[CallItem]) -> None:
        channel = self._channel_of(request_id)
        calls = self._calls.get(channel, [])
        if queue in calls:
            calls.remove(queue)
        if calls:
            return
        self._calls.pop(channel, None)
        self._confirmed.pop(channel, None)
        if self._pubsub is not None and self.is_ready:
            task = asyncio.ensure_future(self._unsubscribe(channel))
            # A lost UNSUBSCRIBE ends with the connection; a cancelled one with the gateway.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _unsubscribe(self, channel: str) -> None:
        if channel not in self._calls:  # nobody followed it again meanwhile
            await self._pubsub.unsubscribe(channel)

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
        """Subscribe to the gateway's own channel (it keeps the connection subscribed, so a
        drop is noticed with no call open) and again to every followed channel."""
        channels = list(self._calls)
        for channel in channels:
            self._confirmed.setdefault(channel, asyncio.get_running_loop().create_future())
        self._confirmed[self._home] = asyncio.get_running_loop().create_future()
        await pubsub.subscribe(self._home, *channels)
        async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
            while not all(f.done() for f in self._confirmed.values()):
                message = await pubsub.get_message(timeout=SUBSCRIBE_TIMEOUT_S)
                if message is not None:
                    self._on_message(message)
        self._pubsub = pubsub
        for channel in channels:
            for queue in self._calls.get(channel, []):
                queue.put_nowait(RESYNC)

    def _on_message(self, message: dict[str, Any]) -> None:
        channel = message["channel"]
        channel = channel.decode() if isinstance(channel, bytes) else channel
        if message["type"] == "subscribe":
            future = self._confirmed.get(channel)
            if future is not None and not future.done():
                future.set_result(None)
        elif message["type"] == "message":
            self._dispatch(channel, message["data"])

    def _dispatch(self, channel: str, data: bytes) -> None:
        try:
            batch = queue_pb2.TokenEventBatch.FromString(data)
        except Exception:  # a foreign publisher must not kill the router
            log.error("ignoring unreadable message on %s", channel)
            return
        for queue in self._calls.get(channel, []):
            for event in batch.events:
                queue.put_nowait(event)

    def _set_ready(self, is_ready: bool) -> None:
        if is_ready == self.is_ready:
            return
        if is_ready:
            self._ready.set()
        else:
            self._ready.clear()
        if self._on_ready_change is not None:
            self._on_ready_change(is_ready)
