"""Crash recovery through real Redis and the real engine: a dead worker's requests, queued again by
a gateway's sweeper, resume without a gap; live workers' requests are left alone; a worker that
stops hands its requests to another live one, or takes up what its earlier run left."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from gateway.config import GatewayConfig
from protos.convert import log_value
from protos.keys import Keys, LogField, Record
from protos.tokenrelay.v1 import generate_pb2, queue_pb2
from tests.consumer_factories import Replies, enqueue, kinds
from tests.factories import CountingEngine
from tests.service import SweeperThread, WorkerThread, wait_until
from worker.config import DEFAULT_MODEL_NAME, WorkerConfig

FAST_SWEEP = {"heartbeat_interval_s": 0.1, "heartbeat_ttl_s": 0.5}  # the `sweeper` fixture's TTL


def log_as(client: redis.Redis, keys: Keys, consumer: str, request_id: str, entry_id: bytes,
           token_ids: list[int], seed: int) -> None:
    """Write what `consumer` had logged for a request (entry `entry_id`) when it died: one chunk per
    token, its progress, that it held the entry, and the record naming its log (protos/keys.py)."""
    log = keys.log(consumer)
    for i, token in enumerate(token_ids):
        chunk = generate_pb2.Chunk(index=i, token_ids=[token])
        event = queue_pb2.TokenEvent(request_id=request_id, seq=i, chunk=chunk)
        client.hset(log, LogField.event(request_id, i), log_value(event))
    progress = queue_pb2.Progress(seed=seed, first_token_unix=time.time(), worker_id=consumer)
    client.hset(log, mapping={request_id + LogField.PROGRESS: progress.SerializeToString(),
                              request_id + LogField.NEXT: len(token_ids),
                              request_id + LogField.HELD: entry_id})
    client.hset(keys.record(request_id), mapping={Record.ENTRY: entry_id, Record.LOG: log})


def claim_as(client: redis.Redis, keys: Keys, consumer: str) -> bytes:
    """Take the oldest queued entry as `consumer` (a worker that then dies: no heartbeat)."""
    with contextlib.suppress(redis.ResponseError):
        client.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    reply = client.xreadgroup(keys.group, consumer, {keys.requests: ">"}, count=1)
    return reply[0][1][0][0]


def greedy_ids(engine: Any, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    from protos.params import PromptInput, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("reference", PromptInput(prompt=prompt), params)
    ids, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.token_ids
            text += out.text
    return ids, text


def died_streaming(client: redis.Redis, keys: Keys, replies: Replies, engine: Any, consumer: str,
                   num_streamed: int, max_tokens: int) -> tuple[list[int], str]:
    """Request "r" (followed by `replies`) taken by `consumer`, which logged its first num_streamed
    greedy tokens and died; the whole answer's (ids, text) as the reference engine gives them."""
    ref_ids, ref_text = greedy_ids(engine, "Once upon a time", max_tokens)
    replies.follow(keys, "r")
    entry_id = enqueue(client, keys, "r", max_tokens=max_tokens, ignore_eos=True)
    assert claim_as(client, keys, consumer) == entry_id
    log_as(client, keys, consumer, "r", entry_id, ref_ids[:num_streamed], seed=3)
    return ref_ids, ref_text


@pytest.mark.slow
def test_a_dead_workers_request_is_queued_again_and_resumed_without_a_gap(
        client: redis.Redis, prefix: str, replies: Replies, smollm_engine: Any,
        make_worker: Callable[..., WorkerThread], sweeper: SweeperThread) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    ref_ids, ref_text = died_streaming(client, keys, replies, smollm_engine, "ghost", 5, max_tokens=12)
    worker = make_worker(**FAST_SWEEP)
    events = replies(1)["r"]
    assert [e.seq for e in events] == list(range(5, 5 + len(events)))  # continues at the next seq
    chunks = [e.chunk for e in events if e.HasField("chunk")]
    assert [c.index for c in chunks] == list(range(5, 12))
    assert [t for c in chunks for t in c.token_ids] == ref_ids[5:]
    final = events[-1].final
    assert (final.text, final.usage.completion_tokens, final.worker_id) == (
        ref_text, 12, worker.config.worker_id)
    log = keys.log(worker.config.consumer_name)
    wait_until(lambda: client.xlen(keys.requests) == 0 and client.hexists(log, "r" + LogField.FINAL),
               timeout=5)
    names = lambda: {c["name"] for c in client.xinfo_consumers(keys.requests, keys.group)}  # noqa: E731
    wait_until(lambda: b"ghost" not in names() and "ghost" not in names(), timeout=5)  # tidied up


def test_a_worker_leaving_with_an_entry_it_never_took_stays_registered_for_the_sweep(
        client: redis.Redis, prefix: str, replies: Replies,
        start_worker: Callable[..., WorkerThread], redis_url: str) -> None:
    """An XREADGROUP reached Redis and the OWN after it did not (Redis went down between them):
    the entry is pending under a worker that does not know it. That worker stopping cleanly
    must leave the registry scored dead, not removed, so a sweep queues the entry again (a
    chaos run lost a request when it left: nothing swept it)."""
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    replies.follow(keys, "r")
    enqueue(client, keys, "r", max_tokens=3)
    first_consumer = "first.abc123"
    assert claim_as(client, keys, first_consumer)  # the claim that reached Redis
    first = start_worker(CountingEngine(), worker_id="first", incarnation="abc123", reconcile_interval_s=600)
    wait_until(lambda: client.zscore(keys.registry, first_consumer), timeout=10)
    first.stop()  # it never looked at its own pending entries (reconciliation is 10 min away)
    assert client.zscore(keys.registry, first_consumer) == 0  # dead, not gone
    start_worker(CountingEngine(), **FAST_SWEEP)
    with SweeperThread(GatewayConfig(redis_url=redis_url, key_prefix=prefix, sweep_interval_s=0.1)):
        events = replies(1, timeout=15)["r"]
        assert kinds(events) == ["chunk", "chunk", "chunk", "final"]
        wait_until(lambda: client.zscore(keys.registry, first_consumer) is None, timeout=10)  # swept away


@pytest.mark.slow
def test_requests_of_live_workers_are_left_alone_and_serial_killers_are_failed(
        client: redis.Redis, prefix: str, replies: Replies,
        make_worker: Callable[..., WorkerThread], sweeper: SweeperThread) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    replies.follow(keys, "busy", "poison")
    busy = enqueue(client, keys, "busy", max_tokens=2)
    assert claim_as(client, keys, "alive") == busy
    client.zadd(keys.registry, {"alive": 0})  # alive (its heartbeat hash), only slow: however the
    client.hset(keys.worker("alive"), "heartbeat_unix", time.time())  # registry scores it
    client.pexpire(keys.worker("alive"), 60_000)
    poison = enqueue(client, keys, "poison", max_tokens=2)
    assert claim_as(client, keys, "third") == poison
    # Two workers died on it already (counted in its record, across attempts); the third
    # held it when it died.
    client.hset(keys.record("poison"), mapping={Record.DELIVERIES: 2, Record.ENTRY: poison})
    client.hset(keys.log("third"), "poison" + LogField.HELD, poison)
    make_worker(**FAST_SWEEP, max_deliveries=3)
    events = replies(1)
    assert list(events) == ["poison"]
    assert events["poison"][-1].error.code == queue_pb2.ERROR_CODE_UNAVAILABLE
    assert "3 workers stopped" in events["poison"][-1].error.message
    time.sleep(0.5)  # several sweeps later the live worker's entry is still its own
    pending = lambda: [(p["message_id"], p["consumer"])  # noqa: E731
                       for p in client.xpending_range(keys.requests, keys.group, min="-", max="+", count=10)]
    wait_until(lambda: pending() == [(busy, b"alive")], timeout=5)  # and the failed one acknowledged


@pytest.mark.slow
def test_on_shutdown_unfinished_requests_are_handed_to_another_live_worker(
        client: redis.Redis, redis_url: str, prefix: str, replies: Replies, smollm_engine: Any,
        make_worker: Callable[..., WorkerThread], sweeper: SweeperThread) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    replies.follow(keys, "long")
    enqueue(client, keys, "long", max_tokens=100, ignore_eos=True, with_record=True)
    client.zadd(keys.registry, {"other": (time.time() + 60) * 1000})  # alive: hand over, do not fail
    client.hset(keys.consumer_models, "other", keys.model)  # ... as it serves this model
    client.hset(keys.worker("other"), "heartbeat_unix", time.time())  # what the sweeper judges by
    client.pexpire(keys.worker("other"), 60_000)
    leaving = make_worker(drain_timeout_s=0.3, **FAST_SWEEP)
    log = keys.log(leaving.config.consumer_name)
    wait_until(lambda: client.hexists(log, "long" + LogField.PROGRESS), timeout=30)  # it is generating
    leaving.stop()
    pending = client.xpending_range(keys.requests, keys.group, min="-", max="+", count=10)
    assert [p["consumer"] for p in pending] == [leaving.config.consumer_name.encode()]  # not acked
    assert client.zscore(keys.registry, leaving.config.consumer_name) == 0  # dead: any sweep finds it
    client.delete(keys.worker("other"))  # it died meanwhile: the taker comes
    config = WorkerConfig(redis_url=redis_url, key_prefix=prefix, worker_id="taker", claim_block_ms=100,
                          **FAST_SWEEP)  # type: ignore[arg-type]
    taker = WorkerThread(smollm_engine, config).start()
    try:
        events = replies(1)["long"]
    finally:
        taker.stop()
    assert [e.seq for e in events] == list(range(len(events)))  # one gapless stream over two workers
    assert kinds(events)[-1] == "final"  # no error event from the worker that left
    assert events[-1].final.worker_id == "taker"
    assert events[-1].final.usage.completion_tokens == 100


@pytest.mark.slow
def test_a_worker_restarted_under_the_same_id_resumes_what_its_earlier_run_left(
        client: redis.Redis, prefix: str, replies: Replies, smollm_engine: Any,
        make_worker: Callable[..., WorkerThread], sweeper: SweeperThread) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    # the consumer of the earlier run ("fixed-id.0ld0ne") took it, streamed 4 tokens, died
    ref_ids, _ = died_streaming(client, keys, replies, smollm_engine, "fixed-id.0ld0ne", 4, max_tokens=10)
    make_worker(worker_id="fixed-id")  # a new consumer: the earlier one is dead and swept
    events = replies(1)["r"]
    assert [e.seq for e in events] == list(range(4, 11))
    assert [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids] == ref_ids[4:]
