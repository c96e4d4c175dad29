"""Prefix-cache-aware routing (protos/routing.py, gateway/routing.py, protos/keys.py "Routing"):
the hashes, the router's choice, and whole paths on a real Redis and a real gRPC gateway with
worker threads (a counting engine: which worker serves a turn is what matters here)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import redis

from gateway.auth import ANONYMOUS
from gateway.config import GatewayConfig
from gateway.models import Models
from gateway.queue import RequestQueue, connect
from gateway.routing import MIN_OVERLAP_CHUNKS, PrefixRouter
from protos.convert import build_request
from protos.keys import Keys, PriorityClass, Record
from protos.routing import CHUNK_CHARS, prefix_hashes
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc, queue_pb2
from tests.factories import CountingEngine
from tests.service import GatewayThread, WorkerProcess, WorkerThread, stub_for, wait_until, workers_ready
from worker.config import DEFAULT_MODEL_NAME as MODEL
from worker.engine.sim import SimConfig, SimEngine, sim_token_ids

SYSTEM = "You are the support assistant of shop number {n}. " * 12  # ~600 characters: 4+ chunks
SCOPE = ANONYMOUS.cache_scope()  # what the gateway gives requests with authentication off


def chat(*contents: str) -> generate_pb2.GenerateRequest:
    """A chat whose messages alternate system, user, assistant, user, ..."""
    roles = ["system"] + ["user", "assistant"] * len(contents)
    request = build_request("x", max_tokens=3)
    request.ClearField("prompt")
    request.chat.messages.extend(generate_pb2.ChatMessage(role=r, content=c) for r, c in zip(roles, contents,
                                                                                             strict=False))
    return request


def session(n: int, turns: int) -> list[generate_pb2.GenerateRequest]:
    """Turn t: the system prompt, t user messages and the t - 1 answers before them."""
    contents = [SYSTEM.format(n=n)]
    requests = []
    for t in range(turns):
        contents.append(f"question {t} of session {n}")
        requests.append(chat(*contents))
        contents.append("x" * 3)  # CountingEngine answers "xxx"
    return requests


# -- the hashes -----------------------------------------------------------------------------------

def test_a_chats_next_turn_starts_with_the_hashes_of_the_turn_before() -> None:
    first, second = session(1, 2)
    h1, h2 = prefix_hashes(first, SCOPE), prefix_hashes(second, SCOPE)
    assert len(h1) >= 4 and len(h2) >= len(h1)
    assert h2[:len(h1)] == h1  # chained: equal up to the end of the shorter text's last whole chunk
    other = prefix_hashes(session(2, 1)[0], SCOPE)
    assert not set(other) & set(h1)  # another system prompt differs from its first chunk on


def test_hashes_are_keyed_by_the_cache_scope_and_short_prompts_have_none() -> None:
    request = session(1, 1)[0]
    assert not set(prefix_hashes(request, SCOPE + b"-b")) & set(prefix_hashes(request, SCOPE))
    adapted = generate_pb2.GenerateRequest()
    adapted.CopyFrom(request)
    adapted.adapter = "fr"  # cached blocks are per adapter too
    assert len(prefix_hashes(adapted, SCOPE)) == len(prefix_hashes(request, SCOPE)) > 0
    assert not set(prefix_hashes(adapted, SCOPE)) & set(prefix_hashes(request, SCOPE))
    assert prefix_hashes(build_request("y" * (CHUNK_CHARS - 1)), SCOPE) == []
    assert len(prefix_hashes(build_request("y" * (3 * CHUNK_CHARS + 5)), SCOPE)) == 3


# -- the router's choice --------------------------------------------------------------------------

def register(client: redis.Redis, keys: Keys, consumer: str, *, ttl_ms: int = 60_000, **load: int) -> None:
    """A live worker as the registry and its heartbeat show it (no process behind it)."""
    seconds, micros = client.time()
    client.zadd(keys.registry, {consumer: int(seconds) * 1000 + int(micros) // 1000 + ttl_ms})
    fields = {"worker_id": consumer, "model": keys.model, "max_num_seqs": 4, "num_running": 0,
              "num_waiting": 0} | load
    client.hset(keys.worker(consumer), mapping={k: str(v) for k, v in fields.items()})
    client.pexpire(keys.worker(consumer), ttl_ms)  # as HEARTBEAT: the sweeper judges by this hash


def index(client: redis.Redis, keys: Keys, consumer: str, request: generate_pb2.GenerateRequest,
          num_chunks: int | None = None) -> None:
    """`consumer`'s prefix index holds the first num_chunks (all) of the request's hashes."""
    hashes = prefix_hashes(request, SCOPE)[:num_chunks]
    client.zadd(keys.prefixes(consumer), dict.fromkeys(hashes, 1))


def routes(redis_url: str, prefix: str, request: generate_pb2.GenerateRequest,
           steps: list[str | tuple[str, int, list[str]]]) -> list[str]:
    """Run `steps` on one gateway's router: a string routes `request` under that request id (the
    worker chosen is returned, "" = the shared stream), (consumer, room, admitted) is a round of
    that worker as the reply router passes it on."""
    async def go() -> list[str]:
        config = GatewayConfig(redis_url=redis_url, key_prefix=prefix)
        aio = connect(config)
        try:
            queue = RequestQueue(aio, config)
            router = PrefixRouter(queue, Models(queue, config))
            request.model = MODEL
            chosen = []
            for step in steps:
                if isinstance(step, tuple):
                    router.on_room(*step)
                    continue
                queued = queue_pb2.QueuedRequest(request_id=step, request=request, cache_scope=SCOPE)
                chosen.append((await router.choose(queued)).consumer)
            return chosen
        finally:
            await aio.aclose()
    return asyncio.run(go())


def choose(redis_url: str, prefix: str, request: generate_pb2.GenerateRequest) -> str:
    return routes(redis_url, prefix, request, [""])[0]


def test_the_router_prefers_the_overlap_weighs_load_and_skips_full_and_dead_workers(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    keys = Keys(prefix, MODEL)
    request = session(1, 1)[0]
    register(client, keys, "a", num_running=2)
    register(client, keys, "b")
    assert choose(redis_url, prefix, request) == "b"  # nobody holds it: the least loaded worker
    register(client, keys, "a")
    index(client, keys, "b", request)
    index(client, keys, "a", request, num_chunks=MIN_OVERLAP_CHUNKS - 1)
    assert choose(redis_url, prefix, request) == "b"
    index(client, keys, "a", request)  # both hold all of it: the less loaded one
    register(client, keys, "b", num_running=3)
    assert choose(redis_url, prefix, request) == "a"
    register(client, keys, "a", num_running=1, num_waiting=3)  # full: running and waiting fill its slots
    assert choose(redis_url, prefix, request) == "b"
    register(client, keys, "a", num_waiting=1)  # waiting requests are load, not full
    register(client, keys, "b", num_running=3)
    assert choose(redis_url, prefix, request) == "a"
    register(client, keys, "a", num_waiting=4)
    register(client, keys, "b", num_running=4)
    assert choose(redis_url, prefix, request) == ""  # every worker full: the shared stream
    register(client, keys, "a")
    register(client, keys, "b")
    register(client, keys, "c")
    client.zadd(keys.registry, {"a": 0})  # its heartbeat expired
    assert choose(redis_url, prefix, request) == "b"
    client.zadd(keys.registry, {"c": 0})
    assert choose(redis_url, prefix, request) == ""  # one live worker: nothing to choose


def test_a_worker_that_says_it_has_no_room_is_not_routed_to_by_load_until_it_says_it_has(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    keys = Keys(prefix, MODEL)
    register(client, keys, "a")
    register(client, keys, "b", num_running=1)
    request = build_request("short: no prefix to gain", max_tokens=3)
    # a's round is newer than its heartbeat (no room); then b's too: nobody, the shared stream
    steps: list[str | tuple[str, int, list[str]]] = ["", ("a", 0, []), "", ("b", 0, []), "", ("a", 4, []), ""]
    assert routes(redis_url, prefix, request, steps) == ["a", "b", "", "a"]


def test_what_a_gateway_routed_and_the_worker_has_not_admitted_yet_takes_from_its_rounds_room(
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    """A round counts what its worker had claimed when it stepped; requests routed to it since
    are still on their way, so they count against the room it said until it admits them."""
    keys = Keys(prefix, MODEL)
    register(client, keys, "a", max_num_seqs=8)
    register(client, keys, "b", max_num_seqs=8, num_running=2)
    request = build_request("short: no prefix to gain", max_tokens=3)
    steps: list[str | tuple[str, int, list[str]]] = [
        ("a", 8, []), "r0", "r1", "r2", "r3",
        ("a", 8, []),  # a round from before it claimed any of them
        "r4",
        ("a", 5, ["r0", "r1", "r3"]),  # it took three of them
        "r5"]
    # By load: the fewest taken slots plus the routes of the last seconds (`_recent`), a first
    # on a tie. r0-r3 go a, a, b, a; then a's round from before it claimed them (8 free) still
    # has r0, r1 and r3 on their way: 3 + 3 against b's 4, so r4 goes to b (counting them from
    # the round on, a would score 0 + 3 and take it). Once a says it admitted them, 3 + 3 ties
    # b's 4 + 2 and a takes r5.
    assert routes(redis_url, prefix, request, steps) == ["a", "a", "b", "a", "b", "a"]


# -- whole paths ----------------------------------------------------------------------------------

def generate(stub: generate_pb2_grpc.TokenRelayStub,
             request: generate_pb2.GenerateRequest) -> list[generate_pb2.GenerateResponse]:
    return list(stub.Generate(request, timeout=30))


def served_by(responses: list[generate_pb2.GenerateResponse]) -> str:
    assert [r.chunk.index for r in responses if r.HasField("chunk")] == [0, 1, 2]
    return responses[-1].final.worker_id


def test_a_sessions_next_turns_go_to_the_worker_that_served_its_first(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix, MODEL)
    channel, stub = stub_for(make_gateway().target)
    workers = {w.config.worker_id: w for w in (start_worker(CountingEngine(), claim_block_ms=20)
                                               for _ in range(2))}
    sessions = [session(n, 3) for n in range(6)]
    for n, turns in enumerate(sessions):
        for t, turn in enumerate(turns):
            turn.request_id = f"s{n}-t{t}"
    with channel:
        wait_until(workers_ready(stub, 2), timeout=10)
        firsts = [served_by(generate(stub, turns[0])) for turns in sessions]
        for turns, first in zip(sessions, firsts, strict=True):
            for turn in turns[1:]:
                assert served_by(generate(stub, turn)) == first
    assert set(firsts) <= set(workers)
    for turns, first in zip(sessions, firsts, strict=True):  # routed: each turn in its worker's stream
        own = keys.routed(workers[first].config.consumer_name, PriorityClass.NORMAL).encode()
        assert [client.hget(keys.record(turn.request_id), Record.STREAM) for turn in turns[1:]] == [own, own]


def test_routing_none_leaves_every_request_to_the_shared_stream(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix, MODEL)
    worker = start_worker(CountingEngine(), claim_block_ms=20)
    register(client, keys, "bystander")  # routing chooses among two or more workers
    request = session(1, 1)[0]
    index(client, keys, worker.config.consumer_name, request)
    for routing, expected in (("none", keys.requests),
                              ("prefix", keys.routed(worker.config.consumer_name, PriorityClass.NORMAL))):
        channel, stub = stub_for(make_gateway(routing=routing).target)
        with channel:
            wait_until(workers_ready(stub, 2), timeout=10)
            request.request_id = f"turn-{routing}"
            served_by(generate(stub, request))
        assert client.hget(keys.record(request.request_id), Record.STREAM) == expected.encode()


def test_a_routed_request_its_worker_does_not_claim_moves_to_the_shared_stream_within_the_wait(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        client: redis.Redis, prefix: str) -> None:
    """"stuck" looks live and holds the prefix, but never claims (a hung process): after the
    wait the request moves to the shared stream and the real worker serves it."""
    keys = Keys(prefix, MODEL)
    request = session(1, 1)[0]
    register(client, keys, "stuck")
    index(client, keys, "stuck", request)
    wait_s = 0.3
    channel, stub = stub_for(make_gateway(route_max_wait_ms=wait_s * 1000).target)
    worker = start_worker(CountingEngine(), claim_block_ms=20)
    with channel:
        wait_until(workers_ready(stub, 2), timeout=10)
        request.request_id = "moved"
        started = time.monotonic()
        assert served_by(generate(stub, request)) == worker.config.worker_id
        took = time.monotonic() - started
    assert wait_s <= took < wait_s + 5  # it was routed to "stuck" first, and moved after the wait
    assert client.hget(keys.record("moved"), Record.STREAM) == keys.requests.encode()
    assert client.xlen(keys.routed("stuck", PriorityClass.NORMAL)) == 0


def test_a_request_routed_by_load_moves_at_once_when_its_worker_says_it_has_no_room(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        client: redis.Redis, prefix: str) -> None:
    """"full" is the least loaded by its heartbeat, so a request with no prefix to gain is routed
    to it; its next round says it has no room (TokenEventBatch.room = 0): the call moves the
    request to the shared stream then, not after --route-max-wait-ms."""
    keys = Keys(prefix, MODEL)
    register(client, keys, "full")
    register(client, keys, "bystander", num_running=2)
    wait_s = 20.0
    channel, stub = stub_for(make_gateway(route_max_wait_ms=wait_s * 1000).target)
    request = build_request("no prefix to gain", max_tokens=3, request_id="load")
    request.model = MODEL
    with channel, ThreadPoolExecutor(1) as pool:
        wait_until(workers_ready(stub, 2), timeout=10)
        started = time.monotonic()
        call = pool.submit(generate, stub, request)
        wait_until(lambda: client.xlen(keys.routed("full", PriorityClass.NORMAL)) == 1, timeout=10)
        worker = start_worker(CountingEngine(), claim_block_ms=20)  # reads only the shared stream
        client.publish(keys.out("full"), queue_pb2.TokenEventBatch(room=0).SerializeToString())
        assert served_by(call.result(timeout=wait_s / 2)) == worker.config.worker_id
    assert time.monotonic() - started < wait_s / 2
    assert client.hget(keys.record("load"), Record.STREAM) == keys.requests.encode()


def test_a_dead_workers_routed_requests_are_served_by_another_with_nothing_lost(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        client: redis.Redis, prefix: str) -> None:
    """"ghost" is routed three requests, claims one and dies. The wait is a minute, so only the
    sweeper that fences it can help: it queues all three again in the shared stream; all three
    callers get every chunk, and ghost's streams are deleted."""
    keys = Keys(prefix, MODEL)
    turns = [session(n, 1)[0] for n in range(3)]
    register(client, keys, "ghost", ttl_ms=1500)
    register(client, keys, "bystander")  # routing chooses among two or more workers
    for turn in turns:
        index(client, keys, "ghost", turn)
    ghost_stream = keys.routed("ghost", PriorityClass.NORMAL)
    for stream in (ghost_stream, *keys.request_streams):
        client.xgroup_create(stream, keys.group, id="0", mkstream=True)
    gateway = make_gateway(route_max_wait_ms=60_000, liveness_check_s=0.5, worker_heartbeat_ttl_s=1)
    channel, stub = stub_for(gateway.target)
    results: dict[str, list[generate_pb2.GenerateResponse]] = {}
    with channel:
        def call(turn: generate_pb2.GenerateRequest) -> None:
            results[turn.request_id] = generate(stub, turn)

        callers = []
        for i, turn in enumerate(turns):
            turn.request_id = f"routed-{i}"
            callers.append(threading.Thread(target=call, args=(turn,), daemon=True))
            callers[-1].start()
        wait_until(lambda: client.xlen(ghost_stream) == 3, timeout=10)
        assert client.xreadgroup(keys.group, "ghost", {ghost_stream: ">", keys.requests: ">"}, count=1)
        worker = start_worker(CountingEngine(), claim_block_ms=20)
        for caller in callers:
            caller.join(30)
    assert sorted(results) == ["routed-0", "routed-1", "routed-2"]
    assert {served_by(r) for r in results.values()} == {worker.config.worker_id}
    wait_until(lambda: not client.exists(ghost_stream), timeout=5)


def test_a_killed_workers_routed_requests_still_queued_on_its_stream_are_served_by_another(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        client: redis.Redis, redis_url: str, prefix: str) -> None:
    """A real worker process serves a session's first turn, so the next turns are routed to it;
    it stops (SIGSTOP: its heartbeat still looks alive) while they queue on its stream, and is
    then SIGKILLed. Another worker's sweep takes them: every caller gets every token, exactly
    the simulated engine's, and the dead worker's streams are deleted."""
    keys = Keys(prefix, MODEL)
    sim = ["--engine", "sim", "--sim-step-ms", "5", "--heartbeat-ttl", "1", "--max-num-seqs", "8",
           "--served-model-name", MODEL]  # the in-process workers' model
    doomed = WorkerProcess(redis_url, prefix, "doomed", *sim)
    register(client, keys, "bystander", num_running=4)  # full: every turn goes to "doomed"
    gateway = make_gateway(route_max_wait_ms=60_000, liveness_check_s=0.5, worker_heartbeat_ttl_s=1)
    channel, stub = stub_for(gateway.target)
    turns = session(1, 4)
    for t, turn in enumerate(turns):
        turn.request_id, turn.sampling.seed, turn.stopping.max_tokens = f"turn-{t}", t, 5
    results: dict[str, list[generate_pb2.GenerateResponse]] = {}
    try:
        with channel:
            wait_until(workers_ready(stub, 2), timeout=60)
            results["turn-0"] = generate(stub, turns[0])
            os.kill(doomed.proc.pid, signal.SIGSTOP)

            def call(turn: generate_pb2.GenerateRequest) -> None:
                results[turn.request_id] = generate(stub, turn)

            callers = [threading.Thread(target=call, args=(turn,), daemon=True) for turn in turns[1:]]
            for caller in callers:
                caller.start()
            doomed_stream = keys.routed(f"doomed.{consumer_suffix(client, keys)}", PriorityClass.NORMAL)
            wait_until(lambda: client.xlen(doomed_stream) == 3, timeout=10)  # routed to it, not claimed
            os.kill(doomed.proc.pid, signal.SIGKILL)
            start_worker(SimEngine(SimConfig(step_ms=1, ms_per_token=0), max_num_seqs=8), claim_block_ms=20,
                         heartbeat_ttl_s=1.0)
            for caller in callers:
                caller.join(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()
    assert sorted(results) == [f"turn-{t}" for t in range(4)]
    for t in range(4):
        responses = results[f"turn-{t}"]
        assert [tok for r in responses[:-1] for tok in r.chunk.token_ids] == sim_token_ids(t, 0, 5)
        assert responses[-1].HasField("final")
    wait_until(lambda: not client.exists(doomed_stream), timeout=10)


def consumer_suffix(client: redis.Redis, keys: Keys) -> str:
    """The incarnation of the one worker process "doomed" in the registry."""
    (name,) = [n.decode() for n in client.zrange(keys.registry, 0, -1) if n.startswith(b"doomed.")]
    return name.split(".", 1)[1]
