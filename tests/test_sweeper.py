"""The gateways' sweeper (gateway/sweeper.py) on real Redis: who it judges dead, what it fences,
and how a dead worker's entries go back to the queue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from gateway.config import GatewayConfig
from gateway.queue import connect
from gateway.sweeper import CONSUMER_LIST_EVERY, Sweeper
from protos.convert import build_request
from protos.keys import FENCE_MARK, ROUTE_FIELD, STREAM_DATA_FIELD, Keys, LogField, PriorityClass, Record
from protos.tokenrelay.v1 import queue_pb2
from worker.config import DEFAULT_MODEL_NAME

MODEL = DEFAULT_MODEL_NAME


class Sweeps:
    """One Sweeper on its own event loop: `sweep()` runs one sweep and returns (fenced, queued).
    Its first sweep (which lists the group's consumers) has run: a first sweep judges nobody
    for a worker heartbeat TTL (1 ms here, unless overridden)."""

    def __init__(self, redis_url: str, prefix: str, worker_heartbeat_ttl_s: float = 0.001) -> None:
        self.loop = asyncio.new_event_loop()
        config = GatewayConfig(redis_url=redis_url, key_prefix=prefix,
                               worker_heartbeat_ttl_s=worker_heartbeat_ttl_s)
        self._client = connect(config)
        self.sweeper = Sweeper(self._client, config, self._served)
        assert self.sweep() == (0, 0)
        time.sleep(worker_heartbeat_ttl_s + 0.002)

    async def _served(self) -> list[str]:
        return [MODEL]

    def sweep(self) -> tuple[int, int]:
        return self.loop.run_until_complete(self.sweeper.sweep())

    def close(self) -> None:
        self.loop.run_until_complete(self._client.aclose())
        self.loop.close()


@pytest.fixture
def sweeps(redis_url: str, prefix: str) -> Iterator[Sweeps]:
    s = Sweeps(redis_url, prefix)
    yield s
    s.close()


def alive(client: redis.Redis, keys: Keys, consumer: str) -> None:
    """What a worker's HEARTBEAT keeps: its heartbeat hash (the sweeper judges by it) and score."""
    client.hset(keys.worker(consumer), "heartbeat_unix", time.time())
    client.pexpire(keys.worker(consumer), 60_000)
    client.zadd(keys.registry, {consumer: (time.time() + 60) * 1000})
    client.hset(keys.consumer_models, consumer, keys.model)


def attach(client: redis.Redis, keys: Keys, request_id: str, stream: str = "", owner: str = "") -> bytes:
    """What the gateway's ATTACH leaves: an entry and its record; owner: a worker's OWN took it
    (HELD in its log)."""
    request = build_request("hi", max_tokens=4, seed=1)
    request.model = keys.model
    queued = queue_pb2.QueuedRequest(request_id=request_id, request=request, result_ttl_s=60)
    stream = stream or keys.requests
    fields = {STREAM_DATA_FIELD: queued.SerializeToString()}
    if stream != keys.requests:
        fields[ROUTE_FIELD] = keys.record(request_id).encode()
    entry_id = client.xadd(stream, fields)
    client.hset(keys.record(request_id), mapping={Record.DIGEST: "d", Record.ENTRY: entry_id,
                                                  Record.STREAM: stream, Record.SEED: 1})
    if owner:
        client.hset(keys.log(owner), request_id + LogField.HELD, entry_id)
    return entry_id


def claim(client: redis.Redis, keys: Keys, consumer: str, stream: str = "") -> None:
    stream = stream or keys.requests
    try:
        client.xgroup_create(stream, keys.group, id="0", mkstream=True)
    except redis.ResponseError:
        pass
    assert client.xreadgroup(keys.group, consumer, {stream: ">"}, count=1)


def queued_ids(client: redis.Redis, keys: Keys) -> list[str]:
    entries = client.xrange(keys.requests)
    return [queue_pb2.QueuedRequest.FromString(f[STREAM_DATA_FIELD]).request_id for _, f in entries]


def test_a_dead_workers_requests_go_back_to_the_queue_and_it_is_fenced(
        client: redis.Redis, prefix: str, sweeps: Sweeps) -> None:
    keys = Keys(prefix, MODEL)
    alive(client, keys, "live")
    attach(client, keys, "kept", owner="live")
    claim(client, keys, "live")
    client.zadd(keys.registry, {"live": 0, "dead": 0})  # a score makes a candidate; the hash judges
    running = attach(client, keys, "running", owner="dead")
    claim(client, keys, "dead")
    routed = keys.routed("dead", PriorityClass.NORMAL)
    attach(client, keys, "routed-running", stream=routed, owner="dead")
    claim(client, keys, "dead", routed)
    attach(client, keys, "routed-waiting", stream=routed)  # routed to it, never claimed
    assert sweeps.sweep() == (1, 3)
    assert client.smembers(keys.fenced) == {b"dead"}
    assert client.smembers(keys.fence("dead")) == {FENCE_MARK.encode()}
    assert client.zscore(keys.registry, "dead") == 0  # dead until nothing of it is left
    assert queued_ids(client, keys) == ["kept", "running", "routed-running", "routed-waiting"]
    pending = client.xpending_range(keys.requests, keys.group, min="-", max="+", count=10)
    assert [p["consumer"] for p in pending] == [b"live"]  # the live worker's entry is its own still
    assert client.xlen(routed) == 0
    fields = (Record.ENTRY, Record.STREAM, Record.LOG, Record.DELIVERIES)
    record = client.hmget(keys.record("running"), *fields)
    # it died running it: counted, and its log is the request's from now on (the next claim copies it)
    assert record[0] != running and record[1:] == [keys.requests.encode(), keys.log("dead").encode(), b"1"]
    waiting = client.hmget(keys.record("routed-waiting"), Record.STREAM, Record.LOG, Record.DELIVERIES)
    assert waiting == [keys.requests.encode(), None, None]  # nobody died running it
    assert sweeps.sweep() == (0, 0)  # the next sweep finds nothing of it left: gone from everywhere
    assert client.zscore(keys.registry, "dead") is None and client.hget(keys.consumer_models, "dead") is None
    assert not client.exists(routed)
    assert {c["name"] for c in client.xinfo_consumers(keys.requests, keys.group)} == {b"live"}
    assert client.zscore(keys.registry, "live") == 0  # a live worker is never touched: its score neither


def test_finished_stale_and_unreadable_entries_are_deleted_not_queued(
        client: redis.Redis, prefix: str, sweeps: Sweeps) -> None:
    keys = Keys(prefix, MODEL)
    attach(client, keys, "finished", owner="dead")
    client.hset(keys.log("dead"), "finished" + LogField.FINAL, 3)  # no gateway saw it finish
    attach(client, keys, "stale", owner="dead")
    client.hset(keys.record("stale"), Record.ENTRY, "99-0")  # a later attempt replaced it
    client.xadd(keys.requests, {STREAM_DATA_FIELD: b"\xff not a request"})
    for _ in range(3):
        claim(client, keys, "dead")
    client.zadd(keys.registry, {"dead": 0})
    assert sweeps.sweep() == (1, 0)
    assert client.xlen(keys.requests) == 0
    assert client.xpending(keys.requests, keys.group)["pending"] == 0
    # a resume replays it from the dead worker's log
    assert client.hget(keys.record("finished"), Record.LOG) == keys.log("dead").encode()


def test_every_tenth_sweep_looks_at_every_member_and_at_the_groups_consumers(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    """A dead worker the registry lost (an AOF without its last second), or whose score another
    worker wrote into the future, is found at the next sweep that lists them all."""
    keys = Keys(prefix, MODEL)
    sweeps = Sweeps(redis_url, prefix)  # its sweep 0 listed them: nothing to find
    try:
        client.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
        for name in ("lost", "hidden"):
            attach(client, keys, name)
            claim(client, keys, name)
        client.zadd(keys.registry, {"hidden": 1e15})
        found = [sweeps.sweep() for _ in range(CONSUMER_LIST_EVERY)]  # sweeps 1 .. 10
        assert found[-1] == (2, 2) and not any(n for n, _ in found[:-1])
    finally:
        sweeps.close()


def test_after_a_gap_in_the_sweeps_nobody_is_judged_for_a_worker_heartbeat_ttl(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    """Every heartbeat stopped with Redis (and a restart may lose the last second of them), and a
    sweep sent before a stall runs when it is back: judged at once, live workers would be fenced
    for an outage, not a death. After a failed call, and after a gap on Redis's clock, nobody is
    judged for a worker heartbeat TTL."""
    keys = Keys(prefix, MODEL)
    sweeps = Sweeps(redis_url, prefix, worker_heartbeat_ttl_s=0.5)
    try:
        attach(client, keys, "r")
        claim(client, keys, "silent")
        client.zadd(keys.registry, {"silent": 0})
        sweeps.sweeper.defer()  # as its loop does after a call failed
        assert sweeps.sweep() == (0, 0) and not client.smembers(keys.fenced)
        time.sleep(0.6)
        client.hset(keys.sweep_clock, "last", 1)  # no sweep since 1970: Redis was away
        assert sweeps.sweep() == (0, 0) and not client.smembers(keys.fenced)
        time.sleep(0.3)
        assert sweeps.sweep() == (0, 0)  # still within the TTL since the gap ended
        time.sleep(0.3)
        assert sweeps.sweep() == (1, 1)
    finally:
        sweeps.close()


def test_a_model_name_a_worker_made_up_neither_stops_the_sweep_nor_is_searched(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    keys = Keys(prefix, MODEL)
    client.hset(keys.consumer_models, mapping={"liar": "not a model/../x", "dead": MODEL})
    attach(client, keys, "r", owner="dead")
    claim(client, keys, "dead")
    client.zadd(keys.registry, {"dead": 0, "liar": 0})
    sweeps = Sweeps(redis_url, prefix)
    try:
        assert sweeps.sweep() == (1, 1)
        assert queued_ids(client, keys) == ["r"]
    finally:
        sweeps.close()
