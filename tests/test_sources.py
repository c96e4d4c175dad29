"""gateway/sources.py through the reply router, on real Redis: a request's events are relayed
only from the worker that holds its entry (or whose log its record names: a gateway's check)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gateway.sources import Sources
from protos.keys import Keys, Record
from protos.tokenrelay.v1 import queue_pb2
from tests.test_replies import event, router


def test_a_calls_events_come_only_from_the_worker_that_holds_its_entry(redis_url: str, prefix: str) -> None:
    """w1 claimed "r" (its entry is pending under w1; the record names no log yet): its events are
    taken, and the record then names w1's log. w2 publishes events for "r" too (a misbehaving
    worker): refused. The sweeper queues "r" again and w3 claims the new entry: its events are
    taken, and the late event of w1 is not."""
    keys = Keys(prefix, "m")

    async def go() -> tuple[list[int], list[int], list[bytes | None]]:
        client = aioredis.Redis.from_url(redis_url)
        replies = router(client, keys)
        refused: list[int] = []
        replies.sources.on_refused = refused.append
        assert await replies.start(timeout_s=5)
        calls = await replies.follow("r")
        await client.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)

        async def claim(worker: str) -> None:  # what ATTACH (or REQUEUE) and a worker's XREADGROUP leave
            entry_id = await client.xadd(keys.requests, {"data": b"r"})
            record = {Record.ENTRY: entry_id, Record.STREAM: keys.requests}
            await client.hset(keys.record("r"), mapping=record)
            await client.xreadgroup(keys.group, worker, {keys.requests: ">"}, count=1)

        async def publish(worker: str, *events: queue_pb2.TokenEvent) -> None:
            batch = queue_pb2.TokenEventBatch(events=list(events))
            await client.publish(keys.out(worker), batch.SerializeToString())

        await claim("w1")
        other = queue_pb2.TokenEvent(request_id="x")  # a request this gateway does not follow
        await publish("w1", event(0), other)
        await publish("w2", event(1))
        got = [(await asyncio.wait_for(calls.get(), 5)).seq]
        logs = [await client.hget(keys.record("r"), Record.LOG)]
        await claim("w3")
        await publish("w3", event(1))
        got.append((await asyncio.wait_for(calls.get(), 5)).seq)
        logs.append(await client.hget(keys.record("r"), Record.LOG))
        await publish("w1", event(2))
        await publish("w2", event(2))  # refused a moment ago: dropped without running VERIFY
        await publish("w3", event(3))
        got.append((await asyncio.wait_for(calls.get(), 5)).seq)
        replies.unfollow("r", calls)
        await replies.close()
        await client.aclose()
        return got, refused, logs
    got, refused, logs = asyncio.run(go())
    assert got == [0, 1, 3]
    assert sum(refused) == 3  # w2's two events and w1's late one
    assert logs == [keys.log("w1").encode(), keys.log("w3").encode()]


def test_a_workers_admission_notice_checks_the_record_before_the_first_token(redis_url: str,
                                                                            prefix: str) -> None:
    """A round that admits "r" says so (TokenEventBatch.admitted): the router reads the record
    then, so the first token needs no read (here the record is gone by then: it is taken all
    the same, from the worker that was checked)."""
    keys = Keys(prefix)

    async def go() -> int:
        client = aioredis.Redis.from_url(redis_url)
        replies = router(client, keys)
        assert await replies.start(timeout_s=5)
        calls = await replies.follow("r")
        await client.hset(keys.record("r"), Record.LOG, keys.log("w1"))
        notice = queue_pb2.TokenEventBatch(admitted=["r", "not-followed"])
        await client.publish(keys.out("w1"), notice.SerializeToString())
        for _ in range(100):
            await asyncio.sleep(0.01)
            if "r" in replies.sources.known:  # the check is done
                break
        await client.delete(keys.record("r"))
        await client.publish(keys.out("w1"), queue_pb2.TokenEventBatch(events=[event(0)]).SerializeToString())
        seq = (await asyncio.wait_for(calls.get(), 5)).seq
        replies.unfollow("r", calls)
        await replies.close()
        await client.aclose()
        return seq
    assert asyncio.run(go()) == 0


def test_a_relayed_final_shortens_its_record_to_the_result_ttl_never_lengthens_it(redis_url: str,
                                                                                  prefix: str) -> None:
    """SHORTEN: a record lives the result TTL from its final on, one script call for the finals
    relayed together; a later final (a replay's, say) must not keep it beyond the worker's log,
    which drops the request's fields after the result TTL."""
    keys = Keys(prefix)

    async def go() -> list[int]:
        client = aioredis.Redis.from_url(redis_url)
        sources = Sources(client, keys, lambda event: None, max_held=4, result_ttl_s=300)
        for request_id, lease_s in (("r", 3600), ("short", 60)):
            await client.hset(keys.record(request_id), Record.DIGEST, "d")
            await client.expire(keys.record(request_id), lease_s)
        for request_id in ("r", "short", "gone"):  # "gone" expired meanwhile: not created again
            sources.finished(request_id)
        await asyncio.gather(*sources.tasks)
        ttls = [await client.ttl(keys.record(r)) for r in ("r", "short", "gone")]
        await client.aclose()
        return ttls

    r, short, gone = asyncio.run(go())
    assert 290 < r <= 300 and 50 < short <= 60 and gone == -2
