"""Taking entries off the request streams (worker/io/claim.py): the order of the streams, the
cost of a poll that finds nothing, and never more than the worker's room; on a real Redis."""

from __future__ import annotations

import redis

from protos.keys import Keys, PriorityClass
from protos.tokenrelay.v1 import queue_pb2
from worker.config import DEFAULT_MODEL_NAME as MODEL
from worker.config import WorkerConfig
from worker.io.claim import Claimer


def test_a_workers_own_stream_comes_before_the_shared_one_of_its_class_never_before_a_higher_class(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    keys = Keys(prefix, MODEL)
    config = WorkerConfig(redis_url=redis_url, key_prefix=prefix, worker_id="w")
    me = config.consumer_name
    high, normal, low = PriorityClass.HIGH, PriorityClass.NORMAL, PriorityClass.LOW
    assert keys.claim_streams(me) == (keys.routed(me, high), keys.requests_of(high), keys.routed(me, normal),
                                      keys.requests, keys.routed(me, low), keys.requests_of(low))
    for stream, name in ((keys.requests, "shared-normal"), (keys.routed(me, normal), "own-normal"),
                         (keys.requests_of(high), "shared-high")):
        client.xadd(stream, {b"data": queue_pb2.QueuedRequest(request_id=name).SerializeToString()})
    claimer = Claimer(client, config)
    order = [c.request.request_id for _ in range(3) for c in claimer.take(1, is_idle=False) if c.request]
    assert order == ["shared-high", "own-normal", "shared-normal"]


def xreadgroup_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0))


def test_a_poll_with_room_for_every_stream_is_one_command_when_empty_and_keeps_the_class_order(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    keys = Keys(prefix, MODEL)
    config = WorkerConfig(redis_url=redis_url, key_prefix=prefix, worker_id="w")
    claimer = Claimer(client, config)
    room = len(keys.claim_streams(config.consumer_name)) + 2
    claimer.take(room, is_idle=False)  # creates the groups; sweep and reconcile run now, not later
    before = xreadgroup_calls(client)
    assert claimer.take(room, is_idle=False) == []
    assert xreadgroup_calls(client) - before == 1
    for stream, names in ((keys.requests_of(PriorityClass.LOW), ["low-1", "low-2"]),
                          (keys.requests, ["normal-1"]),
                          (keys.requests_of(PriorityClass.HIGH), ["high-1", "high-2", "high-3"])):
        for name in names:
            client.xadd(stream, {b"data": queue_pb2.QueuedRequest(request_id=name).SerializeToString()})
    taken = [c.request.request_id for c in claimer.take(room, is_idle=False) if c.request]
    assert taken == ["high-1", "high-2", "high-3", "normal-1", "low-1", "low-2"]
    assert claimer.take(room, is_idle=False) == []


def test_a_poll_never_claims_more_than_its_room_when_both_streams_of_a_class_hold_entries(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    """XREADGROUP's COUNT is per stream: one read of a class's two streams took up to twice the
    room, and what was claimed beyond it waited in the engine for a whole answer to end."""
    keys = Keys(prefix, MODEL)
    config = WorkerConfig(redis_url=redis_url, key_prefix=prefix, worker_id="w")
    me = config.consumer_name
    claimer = Claimer(client, config)
    num_streams = len(keys.claim_streams(me))
    claimer.take(num_streams, is_idle=False)  # creates the groups; sweep and reconcile run now
    for stream, name in ((keys.routed(me, PriorityClass.NORMAL), "own"), (keys.requests, "shared")):
        for n in range(num_streams + 2):
            queued = queue_pb2.QueuedRequest(request_id=f"{name}-{n}")
            client.xadd(stream, {b"data": queued.SerializeToString()})
    # a first look takes one entry of each stream, as far as the room goes; then the streams it
    # found something in are read further, in claim order
    for room, expected in ((2, ["own-0", "shared-0"]),  # less room than streams
                           (num_streams + 1, [f"own-{n}" for n in range(1, num_streams + 1)] + ["shared-1"])):
        taken = [c.request.request_id for c in claimer.take(room, is_idle=False) if c.request]
        assert taken == expected
    pending = [client.xpending(s, keys.group)["pending"] for s in (keys.routed(me, PriorityClass.NORMAL),
                                                                    keys.requests)]
    assert pending == [num_streams + 1, 2]
