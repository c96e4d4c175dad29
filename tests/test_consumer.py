"""The worker's consumer against real Redis and the real engine, driven through Redis
directly (no gateway): claiming, batching, parking, deadlines, draining, failover."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from gateway.config import GatewayConfig
from gateway.redis_server import EmbeddedRedis
from protos.convert import build_request, log_value
from protos.keys import STREAM_DATA_FIELD, Heartbeat, Keys, LogField, Record
from protos.tokenrelay.v1 import generate_pb2, queue_pb2
from tests import factories
from tests.factories import CountingEngine
from tests.service import SweeperThread, WorkerThread, wait_until
from worker.config import DEFAULT_MODEL_NAME, WorkerConfig
from worker.engine.outputs import Admitted
from worker.engine.text_engine import EngineStats
from worker.io.claim import claim_capacity
from worker.io.consumer import Consumer


def make_stats(running: int = 0, waiting: int = 0, max_num_seqs: int = 8, **fields: object) -> EngineStats:
    return factories.make_stats(num_running=running, num_waiting=waiting, max_num_seqs=max_num_seqs, **fields)


@pytest.mark.parametrize(("engine_stats", "expected"), [
    (make_stats(), 8), (make_stats(running=3), 5), (make_stats(running=8), 0),
    # Requests waiting for KV blocks or prefill budget: this worker is full, free slots or not.
    (make_stats(running=3, waiting=2), 0), (make_stats(running=0, waiting=1), 0),
    (make_stats(running=2, waiting=9), 0),
    # Blocks are the scheduler's to judge: a nearly full cache alone does not stop claiming.
    (make_stats(running=1, num_free_blocks=1, kv_cache_usage=0.98), 7),
])
def test_claims_free_slots_only_while_nothing_waits(engine_stats: SimpleNamespace, expected: int) -> None:
    assert claim_capacity(engine_stats) == expected


@pytest.mark.parametrize("fields", [
    {"redis_url": "http://x"}, {"worker_id": ""}, {"drain_timeout_s": -1},
    {"heartbeat_interval_s": 10, "heartbeat_ttl_s": 5}, {"claim_block_ms": 0},
    {"redis_timeout_s": 0.1, "claim_block_ms": 500},
])
def test_worker_config_rejects_bad_values(fields: dict) -> None:
    with pytest.raises(ValueError):
        WorkerConfig(**fields)


# -- through Redis ------------------------------------------------------------------------------------

class Replies:
    """A caller's side without a gateway: follow requests (their presence channels, and every
    worker's out channel for the events), collect their events."""

    def __init__(self, client: redis.Redis) -> None:
        self._pubsub = client.pubsub()
        self._followed: set[str] = set()

    def follow(self, keys: Keys, *request_ids: str) -> None:
        """Subscribe (and wait for Redis to confirm) before the requests are enqueued."""
        self._followed |= set(request_ids)
        self._pubsub.psubscribe(keys.out_pattern)
        self._pubsub.subscribe(*(keys.events(r) for r in request_ids))
        confirmed = 0
        while confirmed < len(request_ids) + 1:  # nothing is enqueued yet: only confirmations come
            message = self._pubsub.get_message(timeout=5)
            assert message is not None, "subscription not confirmed"
            confirmed += message["type"] in ("subscribe", "psubscribe")

    def __call__(self, num_requests: int, timeout: float = 60) -> dict[str, list[queue_pb2.TokenEvent]]:
        """Events per request id until `num_requests` requests ended (final or error)."""
        events: dict[str, list[queue_pb2.TokenEvent]] = {}
        num_ended, deadline = 0, time.monotonic() + timeout
        while num_ended < num_requests:
            assert time.monotonic() < deadline, f"only {num_ended} of {num_requests} requests ended"
            message = self._pubsub.get_message(timeout=0.5)
            if message is None or message["type"] != "pmessage":
                continue
            for event in queue_pb2.TokenEventBatch.FromString(message["data"]).events:
                if event.request_id not in self._followed:
                    continue
                events.setdefault(event.request_id, []).append(event)
                num_ended += event.WhichOneof("kind") != "chunk"
        return events

    def close(self) -> None:
        self._pubsub.close()


@pytest.fixture
def replies(client: redis.Redis) -> Iterator[Replies]:
    r = Replies(client)
    yield r
    r.close()


def enqueue(client: redis.Redis, keys: Keys, request_id: str, deadline_unix: float = 0.0,
            with_record: bool = False, **params: object) -> bytes:
    """XADD a request; with_record: and its record, as a gateway's ATTACH writes it."""
    request = build_request("Once upon a time", temperature=0.0, **params)
    queued = queue_pb2.QueuedRequest(request_id=request_id, request=request, result_ttl_s=60,
                                     enqueued_unix=time.time(), deadline_unix=deadline_unix)
    entry_id = client.xadd(keys.requests, {STREAM_DATA_FIELD: queued.SerializeToString()})
    if with_record:
        client.hset(keys.record(request_id), mapping={Record.DIGEST: "d", Record.ENTRY: entry_id,
                                                      Record.STREAM: keys.requests, Record.SEED: 1})
        client.expire(keys.record(request_id), 600)
    return entry_id


def kinds(events: list[queue_pb2.TokenEvent]) -> list[str]:
    return [str(e.WhichOneof("kind")) for e in events]


@pytest.mark.slow
def test_queued_requests_past_their_deadline_fail_and_unfollowed_ones_are_parked_then_abandoned(
        client: redis.Redis, prefix: str, replies: Replies,
        make_worker: Callable[..., WorkerThread]) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    replies.follow(keys, "late", "fine")
    enqueue(client, keys, "late", deadline_unix=time.time() - 1, max_tokens=4)
    enqueue(client, keys, "gone", max_tokens=4)  # its caller left while it was queued
    enqueue(client, keys, "fine", max_tokens=4)
    worker = make_worker(reattach_grace_s=1.0)
    events = replies(2)
    assert kinds(events["late"]) == ["error"]
    assert events["late"][0].error.code == queue_pb2.ERROR_CODE_DEADLINE_EXCEEDED
    assert kinds(events["fine"])[-1] == "final"
    assert [e.seq for e in events["fine"]] == list(range(len(events["fine"])))
    heartbeat = keys.worker(worker.config.consumer_name)
    # computed nothing for nobody (the heartbeat thread reports it within a beat)
    wait_until(lambda: client.hget(heartbeat, Heartbeat.NUM_PARKED) == b"1", timeout=1)
    assert not client.hexists(keys.log(worker.config.consumer_name), "gone" + LogField.PROGRESS)
    wait_until(lambda: client.xlen(keys.requests) == 0, timeout=5)  # abandoned after the grace
    assert client.hget(heartbeat, Heartbeat.NUM_PARKED) == b"0"
    assert client.hexists(keys.log(worker.config.consumer_name), "fine" + LogField.FINAL)
    assert not client.exists(keys.record("fine"))  # records are the gateways' to write


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.mark.slow
def test_each_round_is_one_script_call_for_every_request(
        private_redis: EmbeddedRedis, prefix: str, make_worker: Callable[..., WorkerThread]) -> None:
    client = redis.Redis.from_url(private_redis.url)
    keys, num_requests, max_tokens = Keys(prefix, DEFAULT_MODEL_NAME), 4, 12
    replies = Replies(client)
    replies.follow(keys, *(f"r{i}" for i in range(num_requests)))
    for i in range(num_requests):
        enqueue(client, keys, f"r{i}", max_tokens=max_tokens, ignore_eos=True)
    client.config_resetstat()
    make_worker(redis_url=private_redis.url)
    events = replies(num_requests)
    assert sum(len(e.chunk.token_ids) for evs in events.values() for e in evs) == num_requests * max_tokens
    stats = client.info("commandstats")
    calls = {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("publish", "evalsha")}
    # The 4 requests decode together: per round ONE script call, which logs every request's
    # events in one HSET and publishes them in one PUBLISH, whatever the batch size.
    num_tokens = num_requests * max_tokens
    assert calls["publish"] <= max_tokens + 4 < num_tokens, calls  # ~one per step, not per request
    assert stats["cmdstat_hset"]["calls"] <= 2 * calls["publish"] + 40, stats["cmdstat_hset"]  # + heartbeats
    consumer = next(iter(client.zrange(keys.registry, 0, -1)), None) or b""
    log = client.hkeys(keys.log(consumer.decode())) if consumer else client.hkeys(
        client.hget(keys.record("r0"), Record.LOG))
    seqs = {int(k.split(b":")[1]) for k in log if k.startswith(b"r0:") and k.split(b":")[1].isdigit()}
    assert seqs == set(range(max_tokens + 1))  # every chunk and the final, replayable
    replies.close()
    client.close()


@pytest.mark.slow
def test_stop_drains_running_requests_then_aborts_what_is_left(
        client: redis.Redis, prefix: str, replies: Replies,
        make_worker: Callable[..., WorkerThread]) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    replies.follow(keys, "short", "endless")
    enqueue(client, keys, "short", max_tokens=6, ignore_eos=True)
    # 480 tokens take 1-3 s on a 2-core CPU (SmolLM2 decodes at 140-260 tok/s there), far more than
    # the drain's 0.5 s; 6 take tens of ms. (A 5 s drain stopped holding once decode passed 100 tok/s.)
    enqueue(client, keys, "endless", max_tokens=480, ignore_eos=True)
    worker = make_worker(drain_timeout_s=0.5)
    # Both are admitted once "endless" streams (the heartbeat, a beat behind, may miss "short").
    log = keys.log(worker.config.consumer_name)
    wait_until(lambda: client.hexists(log, "endless" + LogField.PROGRESS), timeout=30)
    started = time.monotonic()
    worker.stop()
    assert time.monotonic() - started < 15
    events = replies(2, timeout=10)
    assert kinds(events["short"])[-1] == "final"
    assert events["short"][-1].final.usage.completion_tokens == 6
    assert kinds(events["endless"])[-1] == "error"
    assert events["endless"][-1].error.code == queue_pb2.ERROR_CODE_UNAVAILABLE
    assert not client.exists(keys.worker(worker.config.consumer_name))  # heartbeat removed on exit
    assert client.zscore(keys.registry, worker.config.consumer_name) == 0  # dead: a sweep removes it


class BrokenEngine:
    """An engine whose step fails: the one case not worth a real model."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []

    adapters: tuple[str, ...] = ()  # no LoRA adapters

    def add_request(self, request_id: str, *args: object, **kwargs: object) -> Admitted:
        self.request_ids.append(request_id)
        return Admitted(seed=0)

    def abort(self, request_id: str) -> None:
        pass

    def has_unfinished(self) -> bool:
        return bool(self.request_ids)

    def step(self) -> list:
        raise RuntimeError("boom")

    def stats(self) -> SimpleNamespace:
        return make_stats(running=len(self.request_ids), model_name="broken")


def test_an_engine_failure_answers_every_caller_before_the_worker_dies(
        client: redis.Redis, redis_url: str, prefix: str, replies: Replies) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    replies.follow(keys, "doomed")
    enqueue(client, keys, "doomed", max_tokens=4)
    consumer = Consumer(BrokenEngine(), WorkerConfig(redis_url=redis_url, key_prefix=prefix, worker_id="w"))
    with pytest.raises(RuntimeError, match="boom"):
        consumer.run()
    events = replies(1, timeout=10)
    assert events["doomed"][-1].error.code == queue_pb2.ERROR_CODE_INTERNAL
    assert client.xlen(keys.requests) == 0


# -- crash recovery: a dead worker's requests, queued again by a gateway's sweeper -------------------

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


@pytest.mark.slow
def test_a_dead_workers_request_is_queued_again_and_resumed_without_a_gap(
        client: redis.Redis, prefix: str, replies: Replies, smollm_engine: Any,
        make_worker: Callable[..., WorkerThread], sweeper: SweeperThread) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    ref_ids, ref_text = greedy_ids(smollm_engine, "Once upon a time", 12)
    replies.follow(keys, "r")
    entry_id = enqueue(client, keys, "r", max_tokens=12, ignore_eos=True)
    assert claim_as(client, keys, "ghost") == entry_id
    log_as(client, keys, "ghost", "r", entry_id, ref_ids[:5], seed=3)  # it streamed 5 tokens, then died
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
    ref_ids, _ = greedy_ids(smollm_engine, "Once upon a time", 10)
    replies.follow(keys, "r")
    entry_id = enqueue(client, keys, "r", max_tokens=10, ignore_eos=True)
    earlier = "fixed-id.0ld0ne"  # the consumer of the earlier run: it took it, streamed 4, died
    assert claim_as(client, keys, earlier) == entry_id
    log_as(client, keys, earlier, "r", entry_id, ref_ids[:4], seed=3)
    make_worker(worker_id="fixed-id")  # a new consumer: the earlier one is dead and swept
    events = replies(1)["r"]
    assert [e.seq for e in events] == list(range(4, 11))
    assert [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids] == ref_ids[4:]
