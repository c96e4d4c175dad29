"""The worker's consumer against real Redis and the real engine, driven through Redis
directly (no gateway): claiming, batching, parking, deadlines, draining (crash recovery:
tests/test_consumer_recovery.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import redis

from gateway.redis_server import EmbeddedRedis
from protos.keys import Heartbeat, Keys, LogField, Record
from protos.tokenrelay.v1 import queue_pb2
from tests import factories
from tests.consumer_factories import Replies, enqueue, kinds
from tests.service import WorkerThread, wait_until
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
