"""The gateway's reply router on real Redis: subscriptions that cannot leak, queues that stay bounded."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from gateway.replies import RESYNC, TICK, ReplyRouter, offer
from protos.keys import Keys
from protos.tokenrelay.v1 import queue_pb2


def event(seq: int) -> queue_pb2.TokenEvent:
    return queue_pb2.TokenEvent(request_id="r", seq=seq)


def test_a_flooded_call_keeps_a_bounded_queue_and_is_told_to_resync() -> None:
    async def go() -> list[Any]:
        queue: asyncio.Queue = asyncio.Queue(8)
        for seq in range(1000):  # a worker far faster than the caller reads
            offer(queue, event(seq))
            assert queue.qsize() <= 8
        return [queue.get_nowait() for _ in range(queue.qsize())]
    items = asyncio.run(go())
    assert items[0] is RESYNC  # the relay re-reads the log from where it is
    assert [e.seq for e in items[1:]] == list(range(1000 - len(items) + 1, 1000))


def router(client: aioredis.Redis, keys: Keys) -> ReplyRouter:
    return ReplyRouter(client, keys, keys.gateway("g"), max_queued_events=16)


def test_a_call_cancelled_mid_subscribe_leaves_no_subscription(redis_url: str, prefix: str) -> None:
    """Redis confirms the SUBSCRIBE after 1 s; the call is cancelled at 0.3 s: nothing stays
    registered, and the channel's subscriber count returns to 0 (else the worker would never
    park the request)."""
    keys = Keys(prefix)

    async def go() -> tuple[int, int]:
        client = aioredis.Redis.from_url(redis_url)
        replies = router(client, keys)
        assert await replies.start(timeout_s=5)
        on_message = replies._on_message
        loop = asyncio.get_running_loop()

        def slow_confirmations(message: dict[str, Any]) -> None:
            if message["type"] == "subscribe":
                loop.call_later(1.0, on_message, message)
            else:
                on_message(message)
        replies._on_message = slow_confirmations  # type: ignore[method-assign]
        task = asyncio.create_task(replies.follow("r"))
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        num_calls = replies.num_calls
        count = -1
        for _ in range(50):
            count = dict(await client.pubsub_numsub(keys.events("r")))[keys.events("r").encode()]
            if count == 0:
                break
            await asyncio.sleep(0.05)
        await replies.close()
        await client.aclose()
        return num_calls, count
    assert asyncio.run(go()) == (0, 0)


def test_only_an_idle_call_gets_ticks(redis_url: str, prefix: str) -> None:
    """TICK is the relay's clock for its liveness checks (gateway/relay.py): one per tick_s into
    a call offered nothing since the last tick whose queue is empty; none piled up behind
    events, and none at all for a call whose events keep coming."""
    keys = Keys(prefix)

    async def go() -> tuple[list[Any], list[Any], list[Any]]:
        client = aioredis.Redis.from_url(redis_url)
        replies = ReplyRouter(client, keys, keys.gateway("g"), tick_s=0.05)
        try:
            assert await replies.start(timeout_s=5)
            idle, busy, streaming = (await replies.follow("idle"), await replies.follow("busy"),
                                     await replies.follow("streaming"))
            offer(busy, event(0))
            read: list[Any] = []
            for seq in range(30):  # an event every 0.01 s, read at once
                offer(streaming, event(seq))
                await asyncio.sleep(0.01)
                read += [streaming.get_nowait() for _ in range(streaming.qsize())]
            return ([idle.get_nowait() for _ in range(idle.qsize())],
                    [busy.get_nowait() for _ in range(busy.qsize())], read)
        finally:
            await replies.close()
            await client.aclose()
    idle, busy, streaming = asyncio.run(go())
    assert idle == [TICK]  # the relay reads it and waits again; here nobody read it
    assert [getattr(item, "seq", None) for item in busy] == [0]
    assert [getattr(item, "seq", None) for item in streaming] == list(range(30))
