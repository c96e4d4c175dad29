"""Prefix-cache-aware routing (protos/keys.py, "Routing"; protos/routing.py): which worker a
new request should go to.

The router scores the live workers that have room by the prefix hashes of the request that
their prefix index holds, and by their load, as Dynamo's KV router does (blocks it would
prefill, plus a share of the batch it would join), and picks the cheapest when it holds at
least MIN_OVERLAP_CHUNKS of the request's leading chunks. A request with no useful overlap
anywhere goes to the least loaded worker while it has a quarter of its slots free (else to the
shared stream: LOAD_ROUTE_MIN_FREE). Not to the shared stream always, where the first
worker to look takes it: in a burst one worker then claims most new sessions (measured with
`make bench-routing`: 4/4/4/20 requests over 4 workers), and routing keeps every later turn of
those sessions there. Only when every worker is full does a request go to the shared stream.
A worker is full (never routed to) when what it runs, what waits in its engine (for KV blocks
or prefill budget) and the calls this gateway routed to it since the last look that are still
open fill its sequence slots; the same sum over its slots is its load. Waiting requests count
as load, not as full: a worker in the middle of a long prefill step has some, and sending a
chat's next turn elsewhere then costs its whole history's prefill (`make bench-routing` on
2 cores, together with a 2 s --route-max-wait-ms: 0.65 -> 0.83 of turns 2-4's prompt tokens
cached, 2026-12-05). Routing is a preference,
never a wait on a busy worker: a routed request its worker does not claim within
--route-max-wait-ms moves to the shared stream (gateway/relay.py), and one routed by load alone
moves as soon as its worker's round says it has no room (`on_room`, `wait_claim`). Each round
a worker publishes says its room (TokenEventBatch.room), so the choice by load uses the newer of
that and the heartbeat.

Only workers of the request's model are candidates (protos/keys.py, "Models"). A request for
a LoRA adapter that only some of them have loaded goes to one of those, even when all are
busy, and stays there (`Route.is_pinned`: never moved to the shared stream, where a worker
without it could claim it).

Costs: the live workers' heartbeats are read at most every WORKERS_CACHE_S (gateway/models.py:
one round trip, shared by every call in that window), and one ROUTE script call per new
request with two or more chunks reads every candidate's index.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.models import Models, Worker
from gateway.queue import RequestQueue
from gateway.relay import Follow
from gateway.replies import FULL, CallQueue, offer
from protos.routing import prefix_hashes
from protos.tokenrelay.v1 import generate_pb2, queue_pb2

# Two chunks are ~60 tokens: less saves a prefill shorter than the wait it could cost.
MIN_OVERLAP_CHUNKS = 2
# A worker's cost is the chunks it would prefill plus LOAD_WEIGHT x (its batch's fill) x the
# request's chunks: a worker holding the whole prefix but 80% busy (0.4 n) still beats an idle
# one holding nothing (n); one 100% busy with half of it (n) ties with the idle one.
LOAD_WEIGHT = 0.5
# Between two turns a chat weighs nothing on its worker's load (it waits for its user), so new
# chats placed by load alone pile onto the workers whose chats are all reading: a request with
# no useful overlap goes to the worker with the fewest requests running, waiting or routed to it
# lately (a count that halves every RECENT_HALF_LIFE_S). `make bench-routing` (2026-12-05):
# requests per worker 26/21/17/32 by load alone.
RECENT_HALF_LIFE_S = 10.0
# A request with no useful overlap is routed by load only to a worker with at least this share
# of its slots free by this gateway's view. The view is up to ~1 s old and other gateways route
# too, so near capacity several of them send new requests to the same "least loaded" worker,
# which is then full and leaves them waiting --route-max-wait-ms: `make bench-fleet` (2
# gateways, workers at 80% of their slots, 64-token answers) measured a TTFT p99 of 1.4-2.1 s
# that way, against 0.04-0.15 s from the shared stream (2026-12-05, 2-core Xeon).
LOAD_ROUTE_MIN_FREE = 0.25


@dataclass(frozen=True)
class Route:
    """Where a new request goes: `consumer` "" = the shared stream."""

    consumer: str = ""
    num_chunks: int = 0  # the request's prefix hashes
    num_matched: int = 0  # of them, held by the chosen worker's index
    is_pinned: bool = False  # only this worker can serve it (its adapter): never moved

    @property
    def kind(self) -> str:
        """"prefix" (to the worker holding its prefix), "load" (no useful overlap anywhere: to the
        least loaded worker) or "shared" (every worker full)."""
        return "shared" if not self.consumer else "prefix" if self.num_matched else "load"

    @property
    def predicted_fraction(self) -> float:
        return self.num_matched / self.num_chunks if self.num_chunks else 0.0


SHARED = Route()


class PrefixRouter:
    def __init__(self, queue: RequestQueue, models: Models) -> None:
        self._queue, self._models = queue, models
        self._routed_since_read: Counter[str] = Counter()
        self._recent: dict[str, float] = {}  # consumer -> routes to it, decayed (_count_recent)
        self._recent_at = time.monotonic()
        # consumer -> (room, unix time) of its last round (TokenEventBatch.room), and the request
        # keys this gateway routed to it that no round of it has said it admitted yet
        self._announced: dict[str, tuple[int, float]] = {}
        self._unclaimed: dict[str, set[str]] = {}
        # consumer -> calls routed to it by load and not claimed yet -> their request key
        self._waiting: dict[str, dict[CallQueue, str]] = {}
        models.on_read.append(self._on_read)

    async def choose(self, queued: queue_pb2.QueuedRequest) -> Route:
        """The route of a new request (raises RedisError)."""
        hashes = prefix_hashes(queued.request, queued.cache_scope)
        n = len(hashes)
        workers = await self._models.of_model(queued.request.model)
        adapter = queued.request.adapter
        holders = [(c, w) for c, w in workers if adapter in w.adapters] if adapter else workers
        if holders and len(holders) < len(workers):  # only they can serve it
            return self._pinned(holders, n)
        candidates = [(c, w) for c, w in workers if self._room(c, w) > 0]
        if len(workers) < 2 or not candidates:
            # one worker: nothing to choose (and no index to read); every one full: the shared
            # stream, first come first served
            return Route(num_chunks=n)
        matched = [0] * len(candidates)
        if n >= MIN_OVERLAP_CHUNKS:
            matched = await self._queue.prefix_overlap([c for c, _ in candidates], hashes)
        _, best, num_matched = min(
            ((n - m) + LOAD_WEIGHT * max(n, 1) * self._load(c, w), i, m)
            for i, ((c, w), m) in enumerate(zip(candidates, matched, strict=True)))
        if num_matched < MIN_OVERLAP_CHUNKS:  # no useful overlap anywhere: the least loaded worker
            roomy = [(c, w) for c, w in candidates
                     if self._fresh_room(c, w) >= LOAD_ROUTE_MIN_FREE * w.max_num_seqs]
            if not roomy:
                return Route(num_chunks=n)  # near capacity the shared stream balances better
            _, best = min((w.max_num_seqs - self._fresh_room(c, w) + self._recent.get(c, 0.0), i)
                          for i, (c, w) in enumerate(roomy))
            candidates, num_matched = roomy, 0
        consumer = candidates[best][0]
        self._routed_since_read[consumer] += 1
        self._unclaimed.setdefault(consumer, set()).add(queued.request_id)
        self._count_recent(consumer)
        return Route(consumer, n, num_matched)

    def _pinned(self, holders: list[Worker], n: int) -> Route:
        """The least busy of the workers that have the request's adapter: its only possible ones."""
        _, best = min((self._busy(c, w) + self._recent.get(c, 0.0), i) for i, (c, w) in enumerate(holders))
        consumer = holders[best][0]
        self._routed_since_read[consumer] += 1
        self._count_recent(consumer)
        return Route(consumer, n, 0, is_pinned=True)

    def _count_recent(self, consumer: str) -> None:
        """Decay every worker's count of recent routes by RECENT_HALF_LIFE_S, then add one."""
        now = time.monotonic()
        decay = 0.5 ** ((now - self._recent_at) / RECENT_HALF_LIFE_S)
        self._recent = {c: n * decay for c, n in self._recent.items() if n * decay > 0.01}
        self._recent[consumer] = self._recent.get(consumer, 0.0) + 1
        self._recent_at = now

    def release(self, route: Route, request_key: str = "", calls: CallQueue | None = None) -> None:
        """A call this gateway routed ended: its request no longer weighs on its worker here (the
        next read of the heartbeats counts what still runs)."""
        if self._routed_since_read[route.consumer] > 0:
            self._routed_since_read[route.consumer] -= 1
        self.drop_unclaimed(route.consumer, request_key)
        if calls is not None:
            self._waiting.get(route.consumer, {}).pop(calls, None)

    def drop_unclaimed(self, consumer: str, request_key: str) -> None:
        """A request this gateway routed to `consumer` left its stream unclaimed (or its call
        ended): it no longer takes from that worker's room."""
        self._unclaimed.get(consumer, set()).discard(request_key)

    def wait_claim(self, route: Route, request_key: str, calls: CallQueue) -> None:
        """A call whose new request this gateway routed by load (no prefix to gain) waits for its
        worker's claim: if that worker says it has no room first, the call gets FULL and moves
        its attempt to the shared stream at once. Without it, a worker that filled up between
        two reads of its heartbeat (two gateways routing to it from ~1 s old views, or a burst)
        kept each such request for the whole --route-max-wait-ms: `make bench-fleet`'s 8 x 256
        point with 64-token answers, 2 gateways, measured a TTFT p99 of 2.1-5.5 s that way,
        2026-12-07, 2-core Zen 4."""
        if route.kind == "load":
            self._waiting.setdefault(route.consumer, {})[calls] = request_key

    def on_room(self, consumer: str, room: int, admitted: Sequence[str]) -> None:
        """A round of `consumer` (gateway/replies.py): it has `room` free sequence slots, and it
        claimed `admitted`. At room 0 (full) every call waiting on it unclaimed is told to move.
        What this gateway routed to it and it has not admitted yet still takes from that room
        (`_fresh_room`): the round counted only what it had claimed when it stepped."""
        self._announced[consumer] = (room, time.time())
        claimed = set(admitted)
        unclaimed = self._unclaimed.get(consumer)
        if unclaimed and claimed:
            unclaimed -= claimed
        waiting = self._waiting.get(consumer)
        if not waiting:
            return
        for calls in [c for c, key in waiting.items() if key in claimed]:
            del waiting[calls]
        if room == 0:
            for calls, key in waiting.items():
                offer(calls, FULL)
                if unclaimed:
                    unclaimed.discard(key)  # it moves now
            waiting.clear()

    def _fresh_room(self, consumer: str, worker: generate_pb2.WorkerInfo) -> int:
        """The worker's room by the newer of its heartbeat (written every ~0.5 s, read by this
        gateway at most every WORKERS_CACHE_S) and its last round's word (every step), less what
        this gateway routed to it since."""
        announced = self._announced.get(consumer)
        if announced is None or announced[1] < worker.heartbeat_unix:
            return self._room(consumer, worker)
        return announced[0] - len(self._unclaimed.get(consumer, ()))

    def _busy(self, consumer: str, worker: generate_pb2.WorkerInfo) -> int:
        """Requests the worker runs or has admitted, and calls this gateway routed to it since."""
        return worker.num_running + worker.num_waiting + self._routed_since_read[consumer]

    def _room(self, consumer: str, worker: generate_pb2.WorkerInfo) -> int:
        return worker.max_num_seqs - self._busy(consumer, worker)

    def _load(self, consumer: str, worker: generate_pb2.WorkerInfo) -> float:
        return min(1.0, self._busy(consumer, worker) / worker.max_num_seqs) if worker.max_num_seqs else 1.0

    def _on_read(self, by_model: dict[str, list[Worker]]) -> None:
        """Fresh heartbeats count what runs: forget the routes counted since the last read. The
        queue depth counts the model's routed streams where a model has two or more workers (with
        one, nobody is routed to: `choose`). What gone workers said of their room is forgotten
        (a call waiting on one moves after --route-max-wait-ms, or its liveness check finds it)."""
        self._routed_since_read.clear()
        live = {c for workers in by_model.values() for c, _ in workers}
        for gone in [c for c in self._announced if c not in live]:
            del self._announced[gone]
            self._unclaimed.pop(gone, None)
            self._waiting.pop(gone, None)
        self._queue.routed_streams = {
            model: tuple(s for c, _ in workers for s in self._queue.keys.routed_streams(c))
            for model, workers in by_model.items() if len(workers) > 1}


def move_unclaimed(follow: Follow, queue: RequestQueue, request: generate_pb2.GenerateRequest,
                   wait_s: float, moves: Any = None, on_moved: Callable[[], Any] | None = None) -> None:
    """An attempt in a worker's own stream that its worker has not claimed within wait_s goes to
    the shared stream (the relay calls `follow.move` then; MOVE is atomic against a claim).
    moves: the counter of moves (a prometheus Counter child), or None; on_moved: called after a
    move."""
    if not queue.is_routed(follow.stream):
        return

    async def move(routed: str, entry_id: bytes) -> tuple[bytes, str] | None:
        moved = await queue.move(routed, entry_id, request)
        if moved is not None and moves is not None:
            moves.inc()
        if moved is not None and on_moved is not None:
            on_moved()
        return moved

    follow.move, follow.move_at = move, time.monotonic() + wait_s
