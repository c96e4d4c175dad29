"""Fencing and reconciliation on real Redis: the scripts of worker/io/scripts.py, then whole
workers (the simulated engine) with a zombie and a lost XACK. The sweeper that fences dead
workers is the gateways' (tests/test_sweeper.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from gateway.wire import request_digest
from protos.convert import build_request, event_from_log
from protos.keys import FENCE_MARK, STREAM_DATA_FIELD, Keys, LogField, Record
from protos.tokenrelay.v1 import generate_pb2, queue_pb2
from tests.service import GatewayThread, WorkerProcess, WorkerThread, stub_for, wait_until, workers_ready
from worker.config import DEFAULT_MODEL_NAME, WorkerConfig
from worker.engine.sim import SimConfig, SimEngine, sim_token_ids
from worker.io.pending import reconcile
from worker.io.redis_io import LOG_RENEW_S, Heartbeat, Outbox
from worker.io.scripts import OWN, STEP


def chunk_event(request_id: str, seq: int, token: int = 7) -> queue_pb2.TokenEvent:
    return queue_pb2.TokenEvent(request_id=request_id, seq=seq,
                                chunk=generate_pb2.Chunk(index=seq, token_ids=[token]))


def step(client: redis.Redis, keys: Keys, consumer: str, outbox: Outbox) -> list[str]:
    script = client.register_script(STEP)
    reply = script(args=outbox.args(keys.prefix, consumer))
    return [r.decode() for r in reply]


def own(client: redis.Redis, keys: Keys, consumer: str, request_id: str, entry_id: bytes) -> list:
    script = client.register_script(OWN)
    return script(keys=[keys.log(consumer)], args=[consumer, keys.prefix, request_id, keys.record(request_id),
                                                   entry_id])[0]


def enqueue(client: redis.Redis, keys: Keys, request_id: str, **params: object) -> bytes:
    request = build_request("Once upon a time", temperature=0.0, seed=5, **params)
    queued = queue_pb2.QueuedRequest(request_id=request_id, request=request, result_ttl_s=60)
    entry_id = client.xadd(keys.requests, {STREAM_DATA_FIELD: queued.SerializeToString()})
    client.hset(keys.record(request_id), mapping={Record.DIGEST: "d", Record.ENTRY: entry_id})
    return entry_id


# -- the scripts ----------------------------------------------------------------------------------

def test_a_fenced_consumer_writes_nothing(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    outbox = Outbox()
    outbox.log(chunk_event("r", 0))
    client.sadd(keys.fence("zombie"), FENCE_MARK)  # what a sweeper leaves for a consumer it fenced
    assert step(client, keys, "zombie", outbox) == ["fenced"]
    assert not client.exists(keys.log("zombie"))
    assert step(client, keys, "live", outbox) == ["ok"]
    assert client.hget(keys.log("live"), "r" + LogField.NEXT) == b"1"


def test_a_claim_takes_a_request_only_from_a_fenced_holder_and_copies_its_log(client: redis.Redis,
                                                                              prefix: str) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    entry_id = enqueue(client, keys, "r")
    assert own(client, keys, "a", "r", entry_id)[0] == b"own"
    assert client.hget(keys.log("a"), "r" + LogField.HELD) == entry_id
    first = Outbox()
    for seq in range(3):
        first.log(chunk_event("r", seq))
    first.progress["r"] = queue_pb2.Progress(seed=5, worker_id="a").SerializeToString()
    assert step(client, keys, "a", first) == ["ok"]
    client.hset(keys.record("r"), Record.LOG, keys.log("a"))  # a gateway saw a hold it (VERIFY)
    # b is handed r's entry while a still runs it (an entry delivered twice after an AOF loss): a
    # keeps it, and nothing of b's is written
    assert own(client, keys, "b", "r", entry_id)[:2] == [b"busy", 0]
    assert not client.exists(keys.log("b"))
    client.sadd(keys.fence("a"), FENCE_MARK)  # then a sweeper fences a
    state, deliveries, progress, *chunks = own(client, keys, "b", "r", entry_id)
    assert (state, deliveries, queue_pb2.Progress.FromString(progress).seed) == (b"own", 0, 5)
    assert [event_from_log(c).seq for c in chunks] == [0, 1, 2]
    assert client.hget(keys.record("r"), Record.LOG) == keys.log("a").encode()  # workers write no record
    assert client.hget(keys.log("b"), "r" + LogField.NEXT) == b"3"
    assert client.hget(keys.log("a"), "r" + LogField.NEXT) == b"3"  # a copy: b writes no log of a's
    late = Outbox()
    late.log(chunk_event("r", 3, token=99))
    assert step(client, keys, "a", late) == ["fenced"]
    assert client.hget(keys.log("b"), "r" + LogField.NEXT) == b"3"  # nothing of a's spliced in


def test_an_admission_goes_into_the_workers_log_and_is_announced(client: redis.Redis, prefix: str) -> None:
    """What the gateway bills a tenant for its prompt (gateway/quotas.py SETTLE), from the log
    the record names; the worker writes no record."""
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    entry_id = enqueue(client, keys, "r")
    assert own(client, keys, "a", "r", entry_id)[0] == b"own"
    outbox = Outbox()
    outbox.admitted.update({"r": 40, "gone": 7})  # "gone": its record expired (or was never made)
    pubsub = client.pubsub()
    pubsub.psubscribe(keys.out_pattern)
    assert pubsub.get_message(timeout=5)["type"] == "psubscribe"
    record = client.hgetall(keys.record("r"))
    assert step(client, keys, "a", outbox) == ["ok"]
    assert client.hget(keys.log("a"), "r" + LogField.PROMPT) == b"40"
    assert client.hgetall(keys.record("r")) == record
    assert not client.exists(keys.record("gone"))
    message = pubsub.get_message(timeout=5)  # the gateways hear of the admission: they check a now
    assert message["channel"] == keys.out("a").encode()
    assert list(queue_pb2.TokenEventBatch.FromString(message["data"]).admitted) == ["r", "gone"]
    pubsub.close()


def test_an_ended_attempt_stays_pending_until_a_gateway_saw_its_worker_hold_it(
        client: redis.Redis, prefix: str) -> None:
    """Else the XACK would empty the pending list that VERIFY judges by, and the final or error
    published with it would be refused (gateway/sources.py)."""
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    client.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    entries = {rid: enqueue(client, keys, rid) for rid in ("seen", "unseen", "failed")}
    client.xreadgroup(keys.group, "a", {keys.requests: ">"}, count=3)
    for rid, entry_id in entries.items():
        assert own(client, keys, "a", rid, entry_id)[0] == b"own"
    client.hset(keys.record("seen"), Record.LOG, keys.log("a"))
    outbox = Outbox()
    for rid in ("seen", "unseen"):
        outbox.log(chunk_event(rid, 0))
        outbox.end(rid, keys.record(rid), keys.requests, entries[rid], final_seq=0)
    outbox.end("failed", keys.record("failed"), keys.requests, entries["failed"])  # an error, no final
    assert step(client, keys, "a", outbox) == ["ok", keys.requests, entries["unseen"].decode(),
                                               keys.requests, entries["failed"].decode()]
    pending = {p["message_id"] for p in client.xpending_range(keys.requests, keys.group, "-", "+", 10)}
    assert pending == {entries["unseen"], entries["failed"]}
    assert client.hmget(keys.log("a"), ["unseen" + LogField.FINAL, "unseen" + LogField.HELD,
                                        "failed" + LogField.HELD]) == [b"0", entries["unseen"], None]
    again = Outbox()  # the worker's next round: a gateway saw "unseen"; nobody came for "failed"
    client.hset(keys.record("unseen"), Record.LOG, keys.log("a"))
    again.end("unseen", keys.record("unseen"), keys.requests, entries["unseen"], final_seq=0)
    again.end("failed", "", keys.requests, entries["failed"])
    assert step(client, keys, "a", again) == ["ok"]
    assert client.xlen(keys.requests) == 0


def test_a_round_says_the_workers_room_with_what_it_publishes_and_never_alone(
        client: redis.Redis, prefix: str) -> None:
    """TokenEventBatch.room: what gateways route by and move waiting calls on (gateway/routing.py)."""
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    pubsub = client.pubsub()
    pubsub.psubscribe(keys.out_pattern)
    assert pubsub.get_message(timeout=5)["type"] == "psubscribe"
    quiet = Outbox(progress={"r": b""}, room=3)  # logs nothing, publishes nothing
    assert step(client, keys, "a", quiet) == ["ok"]
    first, later = Outbox(room=5), Outbox(room=0)
    first.log(chunk_event("r", 0))
    later.log(chunk_event("r", 1))
    first.merge(later)  # a backlog sent as one round says the latest room
    assert step(client, keys, "a", first) == ["ok"]
    message = pubsub.get_message(timeout=5)
    batch = queue_pb2.TokenEventBatch.FromString(message["data"])
    assert [e.seq for e in batch.events] == [0, 1]
    assert batch.HasField("room") and batch.room == 0
    assert pubsub.get_message(timeout=0.2) is None  # the quiet round published nothing
    pubsub.close()


def test_own_acknowledges_finished_and_stale_attempts(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    entry_id = enqueue(client, keys, "done")
    client.hset(keys.record("done"), Record.LOG, keys.log("z"))
    client.hset(keys.log("z"), "done" + LogField.FINAL, 4)
    assert own(client, keys, "a", "done", entry_id)[0] == b"finished"
    old = enqueue(client, keys, "old")
    client.hset(keys.record("old"), Record.ENTRY, "99-0")  # a later attempt replaced it
    assert own(client, keys, "a", "old", old)[0] == b"stale"


def test_reconcile_finds_pending_entries_the_worker_forgot(client: redis.Redis, redis_url: str,
                                                           prefix: str) -> None:
    config = WorkerConfig(redis_url=redis_url, key_prefix=prefix, worker_id="w", reconcile_interval_s=0.2)
    keys = config.keys
    client.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    for request_id in ("held", "forgotten"):
        enqueue(client, keys, request_id)
    taken = client.xreadgroup(keys.group, config.consumer_name, {keys.requests: ">"}, count=2)[0][1]
    held = {f"{keys.requests}/{taken[0][0].decode()}"}
    assert reconcile(client, config, held, 10) == []  # delivered too recently
    time.sleep(0.3)
    found = reconcile(client, config, held, 10)
    assert [(c.entry_id, c.request.request_id) for c in found if c.request] == [(taken[1][0], "forgotten")]


# -- whole workers ----------------------------------------------------------------------------------

def sim_worker(start_worker: Callable[..., WorkerThread], **overrides: object) -> WorkerThread:
    engine = SimEngine(SimConfig(step_ms=1.0, ms_per_token=0.0), max_num_seqs=16)
    return start_worker(engine, **overrides)


def test_an_xack_lost_with_the_aof_neither_hangs_a_call_nor_runs_it_twice(
        client: redis.Redis, prefix: str, start_worker: Callable[..., WorkerThread],
        make_gateway: Callable[..., GatewayThread]) -> None:
    keys = Keys(prefix, DEFAULT_MODEL_NAME)
    worker = sim_worker(start_worker, reconcile_interval_s=0.2)
    channel, stub = stub_for(make_gateway().target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        done = build_request("hi", max_tokens=8, seed=11, request_id="done")
        first = list(stub.Generate(done, timeout=30))
        # Redis came back from an AOF without its last second: "done"'s XACK and XDEL are lost,
        # and "lost" was claimed by this worker just before, without it ever hearing of it.
        for request_id, request in (("done", done), ("lost", build_request("hi", max_tokens=8, seed=12,
                                                                            request_id="lost"))):
            request.model = keys.model  # as the gateway fills it in before the digest
            queued = queue_pb2.QueuedRequest(request_id=request_id, request=request, result_ttl_s=60)
            entry_id = client.xadd(keys.requests, {STREAM_DATA_FIELD: queued.SerializeToString()})
            client.hset(keys.record(request_id), mapping={Record.DIGEST: request_digest(request),
                                                         Record.ENTRY: entry_id, Record.SEED: 12,
                                                         Record.STREAM: keys.requests})
            client.xreadgroup(keys.group, worker.config.consumer_name, {keys.requests: ">"}, count=1)
        lost = list(stub.Generate(build_request("hi", max_tokens=8, seed=12, request_id="lost"), timeout=30))
        wait_until(lambda: client.xlen(keys.requests) == 0, timeout=10)  # both reconciled
        assert worker.consumer.num_finished == 2  # "done" was not run again
        again = list(stub.Generate(done, timeout=30))  # answered from the record
    assert again == first
    assert [t for r in first[:-1] for t in r.chunk.token_ids] == sim_token_ids(11, 0, 8)
    assert [t for r in lost[:-1] for t in r.chunk.token_ids] == sim_token_ids(12, 0, 8)


@pytest.mark.slow
def test_a_zombie_worker_is_fenced_and_no_stream_is_spliced(
        client: redis.Redis, redis_url: str, prefix: str, make_gateway: Callable[..., GatewayThread]) -> None:
    """SIGSTOP one of two workers for longer than the heartbeat TTL while 8 seeded streams run:
    a gateway fences it and queues its streams again, the other worker resumes them; when the
    zombie wakes its writes are refused and it exits. Each worker salts its tokens, so a stream
    spliced from two generations would show."""
    sim = ["--engine", "sim", "--sim-step-ms", "20", "--heartbeat-ttl", "1", "--max-num-seqs", "8"]
    workers = {salt: WorkerProcess(redis_url, prefix, f"w{salt}", *sim, "--sim-salt", salt) for salt in "ab"}
    gateway = make_gateway(liveness_check_s=0.5, models=("sim",), worker_heartbeat_ttl_s=1)  # as the workers'
    channel, stub = stub_for(gateway.target)
    num_tokens = 120  # 2.4 s of decoding at 20 ms a step
    try:
        wait_until(workers_ready(stub, 2), timeout=60)

        def call(i: int) -> list[generate_pb2.GenerateResponse]:
            request = build_request("hi", max_tokens=num_tokens, seed=i, request_id=f"z{i}", ignore_eos=True)
            return list(stub.Generate(request, timeout=60))

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(call, i) for i in range(8)]
            time.sleep(0.8)
            zombie = workers["a"].proc
            os.kill(zombie.pid, signal.SIGSTOP)
            time.sleep(3.0)  # > heartbeat TTL + a sweep: worker b fenced it and took its streams
            keys = Keys(prefix, "sim")
            names = {n.decode() for n in client.smembers(keys.fenced)}
            zombie_log = keys.log(next(n for n in names if n.startswith("wa.")))
            logged = client.hgetall(zombie_log)  # what the taker copied from (OWN writes no other log)
            os.kill(zombie.pid, signal.SIGCONT)
            results = [f.result() for f in futures]
        assert zombie.wait(20) == 3  # it found itself fenced and exited
        # The zombie wrote nothing after it was fenced: not one field of its log changed.
        assert logged and client.hgetall(zombie_log) == logged
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(workers["a"].proc.pid, signal.SIGCONT)
        for w in workers.values():
            with contextlib.suppress(Exception):
                w.stop()
        channel.close()
    took_over = 0
    for i, responses in enumerate(results):
        chunks, final = [r.chunk for r in responses[:-1]], responses[-1].final
        assert [c.index for c in chunks] == list(range(num_tokens)), i  # none lost, none twice
        ids = [t for c in chunks for t in c.token_ids]
        a, b = sim_token_ids(i, 0, num_tokens, "a"), sim_token_ids(i, 0, num_tokens, "b")
        # One generation: a prefix from one worker, then the rest from the worker that took it
        # over; a splice would interleave them.
        first, rest = (a, b) if ids[0] == a[0] else (b, a)
        cut = next((k for k in range(num_tokens) if ids[k] != first[k]), num_tokens)
        assert ids[cut:] == rest[cut:], i
        took_over += cut < num_tokens
        assert final.text == "".join(c.text for c in chunks), i  # the log agrees with what was streamed
    assert took_over >= 1  # the zombie held some streams


def test_a_steady_heartbeat_writes_the_model_and_the_logs_ttl_only_when_needed(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    config = WorkerConfig(redis_url=redis_url, key_prefix=prefix, worker_id="w")
    keys, me = config.keys, config.consumer_name
    heartbeat = Heartbeat(client, config)
    heartbeat.log_ttl_ms = 60_000
    client.hset(keys.log(me), "x", "1")
    assert heartbeat.beat()  # the first: the model, the log's TTL
    assert client.hget(keys.consumer_models, me) == keys.model.encode()
    assert 60_000 < client.pttl(keys.log(me)) <= 60_000 + 5_000 + LOG_RENEW_S * 1000
    client.hdel(keys.consumer_models, me)
    client.persist(keys.log(me))
    assert heartbeat.beat()  # steady: neither is written again ...
    assert client.hget(keys.consumer_models, me) is None and client.pttl(keys.log(me)) == -1
    heartbeat.log_ttl_ms = 120_000
    assert heartbeat.beat()  # ... but a longer result TTL renews the log's at once
    assert client.pttl(keys.log(me)) > 120_000
    client.persist(keys.log(me))
    client.zrem(keys.registry, me)  # a Redis that came back without this worker
    assert heartbeat.beat()
    assert client.hget(keys.consumer_models, me) == keys.model.encode()
    assert client.pttl(keys.log(me)) > 120_000
    heartbeat.close()  # leaving: in the registry, dead, until a sweep finds nothing of it left
    assert client.zscore(keys.registry, me) == 0 and client.hget(keys.consumer_models, me)
    assert not client.exists(keys.worker(me))
