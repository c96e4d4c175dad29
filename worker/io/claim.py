"""Taking entries off the request stream for one worker (protos/keys.py, "Requests").

In order: entries pending under this worker that it forgot (reconciliation, every
reconcile_interval_s), then new entries (XREADGROUP ">", never more than its room) stream by
stream, the highest priority class first, a lower class only while capacity is left, and within
a class this worker's own stream (what gateways routed to it: protos/keys.py, "Routing") before
the shared one, where a dead worker's requests come back (gateway/sweeper.py). Only an idle
worker that found nothing blocks, on every stream at once (one entry of each at most:
XREADGROUP's COUNT is per stream; the read that wakes it returns the stream that woke it), then
claims what keeps arriving in a burst. Then, for all of them in one round trip, the OWN script
reads their records and copies their logs into this worker's (progress, events so far, the entry
it holds), PUBSUB NUMSUB says how many callers follow them,
and their prefix hashes go into this worker's prefix index.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from protos.convert import event_from_log
from protos.keys import PREFIX_INDEX_TTL_S
from protos.redis_conn import text
from protos.routing import CHUNK_CHARS, prefix_hashes
from protos.tokenrelay.v1 import queue_pb2
from worker.config import WorkerConfig
from worker.io.pending import Claimed, parse_entry, reconcile
from worker.io.scripts import OWN

log = logging.getLogger(__name__)

# A prefix-index entry stands for CHUNK_CHARS characters, ~4 characters a token in English:
# the index keeps about as many entries as the KV cache holds chunks, so what it forgets is
# about what the cache evicted (least recently claimed first, as the cache is LRU).
CHARS_PER_TOKEN = 4
MIN_INDEX_SIZE = 256


def claim_capacity(stats: Any) -> int:
    """Requests to claim now (stats: the engine's `EngineStats`).

    None while the engine has waiting requests: they wait for KV-cache blocks or
    prefill budget, so this worker is full whatever its free sequence slots say,
    and a request claimed now would only wait here while another worker could
    run it. Otherwise the free sequence slots. KV blocks are not counted ahead:
    how many a request needs depends on its prefix-cache hits and on how long it
    generates, so the scheduler decides, and what it cannot fit waits, which
    stops claiming.
    """
    if stats.num_waiting:
        return 0
    return max(0, stats.max_num_seqs - stats.num_running)


@dataclass
class Owned:
    """What the OWN script found for a claimed entry (worker/io/scripts.py)."""

    # "own" (run it), "stale" or "finished" (acknowledge and drop it), "busy" (another live
    # worker holds the request: leave it pending)
    state: str
    num_deliveries: int  # takeovers from owners that died holding it, over every attempt
    progress: queue_pb2.Progress | None = None  # None: never admitted (start from scratch)
    chunks: list[queue_pb2.TokenEvent] = field(default_factory=list)  # logged, in seq order


class Claimer:
    def __init__(self, client: redis.Redis, config: WorkerConfig) -> None:
        self.client, self.config = client, config
        self._has_group = False
        self._next_reconcile_at = time.monotonic() + config.reconcile_interval_s
        self._suspects: set[str] = set()  # Claimed.key pending here but not held, at the last look
        self._own = client.register_script(OWN)
        # The order of claims: per class (highest first) this worker's own stream, then the shared one.
        self._streams = config.keys.claim_streams(config.consumer_name)
        self._order = {name: i for i, name in enumerate(self._streams)}

    def take(self, count: int, *, is_idle: bool, max_block_ms: int | None = None,
             held: Collection[str] = ()) -> list[Claimed]:
        """Up to `count` entries; blocks up to claim_block_ms (or max_block_ms) only when idle.
        held: Claimed.key of what this worker runs or parks. Raises RedisError."""
        entries: list[Claimed] = []
        if time.monotonic() >= self._next_reconcile_at and count > 0:
            self._next_reconcile_at = time.monotonic() + self.config.reconcile_interval_s
            # Forgotten = seen pending and not held at two looks in a row: an entry whose XACK is
            # still on its way (it left `held` a moment ago) is gone by the next look.
            candidates = reconcile(self.client, self.config, held, count)
            forgotten = [c for c in candidates if c.key in self._suspects]
            self._suspects = {c.key for c in candidates}
            if forgotten:
                log.warning("%d entries are pending under this worker that it forgot; taking them again",
                            len(forgotten))
            entries += forgotten
        if count > len(entries):
            entries += self._read(count - len(entries))
        if is_idle and not entries:
            block_ms = min(self.config.claim_block_ms, max_block_ms or self.config.claim_block_ms)
            entries = self._wait(block_ms)
        if is_idle and entries:
            entries += self._read_burst(count - len(entries))
        return entries

    def own(self, entries: list[Claimed],
            num_cached_tokens: int = 0) -> tuple[dict[str, Owned], dict[str, int]]:
        """Per claimed request, in one round trip: what OWN found (by Claimed.key), and how
        many callers follow it (by event channel); their prefix hashes join the prefix index,
        kept to about what a KV cache of num_cached_tokens holds."""
        readable = [(c.key, c.request) for c in entries if c.request is not None]
        if not readable:
            return {}, {}
        keys = self.config.keys
        args: list[Any] = [self.config.consumer_name, keys.prefix]
        for c in entries:
            if c.request is not None:
                args += [c.request.request_id, keys.record(c.request.request_id), c.entry_id]
        pipe = self.client.pipeline(transaction=False)
        self._own(keys=[keys.log(self.config.consumer_name)], args=args, client=pipe)
        pipe.pubsub_numsub(*(keys.events(qr.request_id) for _, qr in readable))
        self._index(pipe, [qr for _, qr in readable], num_cached_tokens)
        found, counts = pipe.execute()[:2]
        owned = {key: _owned(item) for (key, _), item in zip(readable, cast(list[Any], found), strict=True)}
        followed = {(c.decode() if isinstance(c, bytes) else c): int(n) for c, n in counts}
        return owned, followed

    def _index(self, pipe: Any, requests: list[queue_pb2.QueuedRequest], num_cached_tokens: int) -> None:
        """Queue the prefix index's update on `pipe`: ZADD scored by this worker's clock (only the
        order of its own claims matters), trim to the most recent, renew the TTL."""
        hashes = {h: 0 for qr in requests for h in prefix_hashes(qr.request, qr.cache_scope)}
        if not hashes:
            return
        now_ms = int(time.time() * 1000)
        key = self.config.keys.prefixes(self.config.consumer_name)
        size = max(MIN_INDEX_SIZE, num_cached_tokens * CHARS_PER_TOKEN // CHUNK_CHARS)
        pipe.zadd(key, dict.fromkeys(hashes, now_ms))
        pipe.zremrangebyrank(key, 0, -size - 1)
        pipe.pexpire(key, PREFIX_INDEX_TTL_S * 1000)

    def _read(self, count: int) -> list[Claimed]:
        """Up to `count` new entries without blocking, the highest priority class first and within
        a class this worker's own stream (what gateways routed here) before the shared one.

        Never more than `count`: XREADGROUP's COUNT is per stream, and an entry claimed beyond
        the free slots waits in the engine until a running request finishes. One read over a
        class's two streams took up to twice the room: `make bench-fleet`'s 8 x 256 point with
        64-token answers then kept requests ~5.5 s (one whole answer) before their first token
        while other workers had room (2026-12-07, 2-core Zen 4).

        So a first look takes at most one entry of each stream: one XREADGROUP (COUNT 1) over as
        many streams as there is room for, in claim order, the next ones while room is left. Then
        the streams it found something in are read further, each alone, in claim order. A busy
        worker polls every step, almost always in vain, and with room for every stream that poll
        is one command, not one per stream or class (bench-fleet at 8 workers x 32 streams: 3
        XREADGROUPs per step were a third of the Redis commands per token)."""
        entries: list[Claimed] = []
        found: set[str] = set()
        i = 0
        while i < len(self._streams) and len(entries) < count:
            probe = self._streams[i:i + count - len(entries)]
            i += len(probe)
            got = self._xreadgroup(dict.fromkeys(probe, ">"), 1, block_ms=None)
            entries += got
            found |= {c.stream for c in got}
        for stream in self._streams:
            if len(entries) >= count:
                break
            if stream in found:
                entries += self._xreadgroup({stream: ">"}, count - len(entries), block_ms=None)
        return sorted(entries, key=lambda c: self._order[c.stream])  # stable: each stream's order kept

    def _wait(self, block_ms: int) -> list[Claimed]:
        """Block until an entry arrives in any class's stream (or block_ms passed)."""
        return self._xreadgroup({stream: ">" for stream in self._streams}, 1, block_ms)

    def _xreadgroup(self, streams: dict[str, str], count: int, block_ms: int | None) -> list[Claimed]:
        if not self._has_group:
            self._create_groups()
        keys = self.config.keys
        try:
            reply = self.client.xreadgroup(keys.group, self.config.consumer_name, cast(Any, streams),
                                           count=count, block=block_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._has_group = False  # Redis restarted without our group: recreate it next round
            return []
        by_stream: list[tuple[Any, list[tuple[bytes, dict[bytes, bytes]]]]] = cast(Any, reply) or []
        by_stream = sorted(by_stream, key=lambda s: self._order.get(text(s[0]), len(self._order)))
        return [Claimed(text(stream), entry_id, parse_entry(entry_id, fields))
                for stream, entries in by_stream for entry_id, fields in entries]

    def _read_burst(self, count: int) -> list[Claimed]:
        """After an idle wake-up: claim what keeps arriving every claim_coalesce_ms, so a burst
        is prefilled in one step rather than its first request alone."""
        entries: list[Claimed] = []
        while count > len(entries) and self.config.claim_coalesce_ms > 0:
            time.sleep(self.config.claim_coalesce_ms / 1000)  # a one-off pause, not a poll loop
            more = self._read(count - len(entries))
            if not more:
                break
            entries += more
        return entries

    def _create_groups(self) -> None:
        keys = self.config.keys
        for stream in self._streams:
            try:
                # Id 0, not $: requests added before the group existed must be served too.
                self.client.xgroup_create(stream, keys.group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        self._has_group = True


def _owned(item: list[Any]) -> Owned:
    state, deliveries, progress, *chunks = item
    if not all(chunks):  # Redis lost part of the log (it came back empty, say): start over, same seed
        return Owned(text(state), int(deliveries))
    return Owned(text(state), int(deliveries),
                 queue_pb2.Progress.FromString(progress) if progress else None,
                 [event_from_log(c) for c in chunks])
