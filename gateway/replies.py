"""The gateway's reply channel: one subscription, demultiplexed per call.

Pub/sub keeps no backlog, so the gateway subscribes to `{p}:replies:{id}` once,
waits for Redis to confirm, and only then reports ready; calls are refused
while it is not. If the subscription drops, events published meanwhile are
gone: every open call is failed with UNAVAILABLE (a retry is safe), and the
router resubscribes with backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.errors import AlreadyExists, GatewayError, Unavailable
from protos.redis_conn import Backoff
from protos.tokenrelay.v1 import queue_pb2

log = logging.getLogger(__name__)

# What a call's queue receives: worker events, or the error that ends the call.
CallItem = queue_pb2.TokenEvent | GatewayError
SUBSCRIBE_TIMEOUT_S = 5.0
MAX_ORPHANS = 4096  # remembered ids of ended calls whose events still arrive


class ReplyRouter:
    def __init__(self, client: aioredis.Redis, channel: str, *, max_backoff_s: float = 2.0,
                 on_ready_change: Callable[[bool], Any] | None = None,
                 on_orphan: Callable[[str, bytes], Any] | None = None) -> None:
        """on_orphan(request_id, entry_id): events keep coming for an attempt whose call has
        ended (say, its abort was lost while Redis was down, or the call was retried under
        the same request id); called once per attempt."""
        self._client, self.channel = client, channel
        self._max_backoff_s = max_backoff_s
        self._on_ready_change, self._on_orphan = on_ready_change, on_orphan
        self._calls: dict[str, asyncio.Queue[CallItem]] = {}
        self._entries: dict[str, bytes] = {}  # request id -> its call's stream entry, once enqueued
        # (request id, entry id) of attempts already reported, oldest first
        self._orphans: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._ready = asyncio.Event()
        self._tried = asyncio.Event()  # the first subscribe attempt ended, either way
        self._task: asyncio.Task[None] | None = None

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    async def start(self, timeout_s: float | None = None) -> bool:
        """Start subscribing; True if the first attempt was confirmed (it keeps trying after)."""
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
        self._fail_all(Unavailable("the gateway is shutting down"))

    def open(self, request_id: str) -> asyncio.Queue[CallItem]:
        """Register a call before its request is enqueued, so no event can be missed."""
        if request_id in self._calls:
            raise AlreadyExists(f"request_id {request_id!r} is already in flight on this gateway")
        calls: asyncio.Queue[CallItem] = asyncio.Queue()
        self._calls[request_id] = calls
        return calls

    def attach(self, request_id: str, entry_id: bytes) -> None:
        """The call's request is enqueued as `entry_id`: from now on the events of any other
        attempt under this request id are reported as orphans (the relay drops them too)."""
        self._entries[request_id] = entry_id

    def close_call(self, request_id: str, *, is_aborted: bool = False) -> None:
        """is_aborted: the caller sends an abort itself, so late events need no report."""
        self._calls.pop(request_id, None)
        entry_id = self._entries.pop(request_id, None)
        if is_aborted and entry_id is not None:
            self._remember_orphan((request_id, entry_id))

    def forget_orphan(self, request_id: str, entry_id: bytes) -> None:
        """Report this attempt again if more events come (its abort did not get through)."""
        self._orphans.pop((request_id, entry_id), None)

    async def _run(self) -> None:
        backoff = Backoff(self._max_backoff_s)
        while True:
            pubsub = self._client.pubsub()
            try:
                await self._subscribe(pubsub)
                backoff.reset()
                self._set_ready(True)
                self._tried.set()
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        self._dispatch(message["data"])
                raise RedisConnectionError("the subscription ended")  # listen() may end quietly on EOF
            except (RedisError, OSError, TimeoutError) as e:
                if self.is_ready:
                    log.warning("reply subscription lost: %s", e)
                self._set_ready(False)
                self._fail_all(Unavailable(f"lost the connection to the queue (Redis): {e}"))
                self._tried.set()
                await asyncio.sleep(backoff.failed())
            finally:
                await pubsub.aclose()

    async def _subscribe(self, pubsub: Any) -> None:
        await pubsub.subscribe(self.channel)
        async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
            while True:  # the confirmation is the first message on the connection
                message = await pubsub.get_message(timeout=SUBSCRIBE_TIMEOUT_S)
                if message is not None and message["type"] == "subscribe":
                    return

    def _dispatch(self, data: bytes) -> None:
        try:
            batch = queue_pb2.TokenEventBatch.FromString(data)
        except Exception:  # a foreign publisher must not kill the router
            log.error("ignoring unreadable message on %s", self.channel)
            return
        for event in batch.events:
            calls = self._calls.get(event.request_id)
            entry_id = self._entries.get(event.request_id)
            if calls is not None and entry_id in (None, event.entry_id):
                calls.put_nowait(event)  # before the entry id is known, the relay filters
            elif event.HasField("chunk"):  # the call ended (cancelled, failed) but generation goes on
                self._report_orphan(event.request_id, event.entry_id)

    def _report_orphan(self, request_id: str, entry_id: bytes) -> None:
        if self._on_orphan is None or (request_id, entry_id) in self._orphans:
            return
        self._remember_orphan((request_id, entry_id))
        self._on_orphan(request_id, entry_id)

    def _remember_orphan(self, key: tuple[str, bytes]) -> None:
        self._orphans[key] = None
        if len(self._orphans) > MAX_ORPHANS:
            self._orphans.popitem(last=False)

    def _fail_all(self, error: GatewayError) -> None:
        for calls in self._calls.values():
            calls.put_nowait(error)

    def _set_ready(self, is_ready: bool) -> None:
        if is_ready == self.is_ready:
            return
        if is_ready:
            self._ready.set()
        else:
            self._ready.clear()
        if self._on_ready_change is not None:
            self._on_ready_change(is_ready)
