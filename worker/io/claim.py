"""Taking entries off the request stream for one worker (protos/keys.py, "Requests").

In order: what an earlier run under this worker's id left pending (once, at start-up),
the entries of dead workers (a sweep about every sweep_interval_s), then new entries
(XREADGROUP ">") stream by stream, the highest priority class first, a lower class only
while capacity is left. Only an idle worker that found nothing blocks, on every stream
at once (one entry of each at most: XREADGROUP's COUNT is per stream), then claims what
keeps arriving in a burst. Then, for all of them in one round trip, the progress in
their records and how many callers follow them.
"""

from __future__ import annotations

import time
from typing import Any, cast

import redis

from protos.keys import Record
from protos.tokenrelay.v1 import queue_pb2
from worker.config import WorkerConfig
from worker.io.reclaim import Claimed, parse_entry, parse_progress, reclaim_dead_workers, reclaim_own


class Claimer:
    def __init__(self, client: redis.Redis, config: WorkerConfig) -> None:
        self.client, self.config = client, config
        self._has_group = False
        self._took_own_pending = False  # what an earlier run under this worker id left pending
        self._next_sweep_at = 0.0

    def take(self, count: int, *, is_idle: bool, max_block_ms: int | None = None) -> list[Claimed]:
        """Up to `count` entries; blocks up to claim_block_ms (or max_block_ms) only when idle.
        Raises RedisError."""
        entries: list[Claimed] = []
        if not self._took_own_pending:
            entries = reclaim_own(self.client, self.config, count)
            self._took_own_pending = len(entries) < count  # else more next round
        elif time.monotonic() >= self._next_sweep_at:
            self._next_sweep_at = time.monotonic() + self.config.sweep_interval_s
            entries = reclaim_dead_workers(self.client, self.config, count)
        if count > len(entries):
            entries += self._read(count - len(entries))
        if is_idle and not entries:
            block_ms = min(self.config.claim_block_ms, max_block_ms or self.config.claim_block_ms)
            entries = self._wait(block_ms)
        if is_idle and entries:
            entries += self._read_burst(count - len(entries))
        return entries

    def inspect(self, entries: list[Claimed]) -> tuple[dict[tuple[str, bytes], queue_pb2.Progress],
                                                       dict[str, int]]:
        """Per claimed request, in one round trip: the progress in its record (a new attempt, or
        a dead worker's entry, resumes from it; by (stream, entry id)) and how many callers
        follow it."""
        readable = [((c.stream, c.entry_id), c.request) for c in entries if c.request is not None]
        if not readable:
            return {}, {}
        pipe = self.client.pipeline(transaction=False)
        for _, qr in readable:
            pipe.hget(self.config.keys.record(qr.request_id), Record.PROGRESS)
        channels = [self.config.keys.events(qr.request_id) for _, qr in readable]
        pipe.pubsub_numsub(*channels)
        *records, counts = pipe.execute()
        progress = {key: p for (key, _), data in zip(readable, records, strict=True)
                    if (p := parse_progress(data)) is not None}
        followed = {(c.decode() if isinstance(c, bytes) else c): int(n) for c, n in counts}
        return progress, followed

    def _read(self, count: int) -> list[Claimed]:
        """Up to `count` new entries without blocking, the highest priority class first."""
        entries: list[Claimed] = []
        for stream in self.config.keys.request_streams:
            if len(entries) >= count:
                break
            entries += self._xreadgroup({stream: ">"}, count - len(entries), block_ms=None)
        return entries

    def _wait(self, block_ms: int) -> list[Claimed]:
        """Block until an entry arrives in any class's stream (or block_ms passed)."""
        return self._xreadgroup({stream: ">" for stream in self.config.keys.request_streams}, 1, block_ms)

    def _xreadgroup(self, streams: dict[str, str], count: int, block_ms: int | None) -> list[Claimed]:
        if not self._has_group:
            self._create_groups()
        keys = self.config.keys
        try:
            reply = self.client.xreadgroup(keys.group, self.config.worker_id, cast(Any, streams),
                                           count=count, block=block_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._has_group = False  # Redis restarted without our group: recreate it next round
            return []
        by_stream: list[tuple[Any, list[tuple[bytes, dict[bytes, bytes]]]]] = cast(Any, reply) or []
        order = {name: i for i, name in enumerate(keys.request_streams)}
        by_stream = sorted(by_stream, key=lambda s: order.get(_text(s[0]), len(order)))
        return [Claimed(_text(stream), entry_id, parse_entry(entry_id, fields))
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
        for stream in keys.request_streams:
            try:
                # Id 0, not $: requests added before the group existed must be served too.
                self.client.xgroup_create(stream, keys.group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        self._has_group = True


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
