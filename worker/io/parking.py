"""Requests nobody follows any more: parked, not computed, for a resume (protos/keys.py).

A request's caller went away when the channel it follows (``{p}:events:{id}``, which a
gateway SUBSCRIBEs for each call) has no subscriber: the consumer counts them (PUBSUB
NUMSUB) about once a second, and at once when a gateway sends an Abort hint. It parks
only a request nobody follows, so a second caller following the same request keeps it
running. Parking aborts the request in the engine: it leaves the batch at the
next step, and its full KV blocks stay in the prefix cache until evicted. The
lot polls NUMSUB of what it holds: a request with a listener again is handed
back to be re-admitted from its progress (the same tokens and seed, mostly
prefix-cache hits); one parked longer than the reattach grace is abandoned.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from worker.io.tracked import Tracked

POLL_INTERVAL_S = 0.1  # how soon a resume is noticed (one NUMSUB of every parked channel)
FOLLOW_CHECK_S = 1.0  # how often the callers of running requests are counted (PUBSUB NUMSUB)


def listeners(client: redis.Redis, channels: Iterable[str]) -> dict[str, int]:
    """Subscribers of each channel (PUBSUB NUMSUB); raises RedisError."""
    names = list(dict.fromkeys(channels))
    if not names:
        return {}
    reply: list[tuple[bytes | str, int]] = client.pubsub_numsub(*names)  # type: ignore[assignment]
    return {(c.decode() if isinstance(c, bytes) else c): int(n) for c, n in reply}


class FollowCheck:
    """Which running requests nobody follows: all of them every FOLLOW_CHECK_S, and at once those
    an Abort hint names (one PUBSUB NUMSUB for all)."""

    def __init__(self) -> None:
        self._next_at = 0.0

    def unfollowed(self, client: redis.Redis, running: dict[str, Tracked],
                   hints: Iterable[tuple[str, bytes]]) -> list[str]:
        """Keys of the running requests to park (none already parking); hints: (request id,
        entry id or b"") of Abort messages. Raises RedisError (the next check asks again)."""
        suspects = set()
        if time.monotonic() >= self._next_at:
            self._next_at = time.monotonic() + FOLLOW_CHECK_S
            suspects = set(running)
        for request_id, entry_id in hints:
            suspects |= {key for key, t in running.items()
                         if t.request_id == request_id and entry_id in (b"", t.entry_id)}
        suspects = {key for key in suspects if not running[key].is_parking}
        if not suspects:
            return []
        counts = listeners(client, (running[key].channel for key in suspects))
        return [key for key in suspects if counts.get(running[key].channel) == 0]


@dataclass
class _Parked:
    tracked: Tracked
    since: float  # monotonic


class ParkingLot:
    def __init__(self, grace_s: float, max_parked: int = 1024) -> None:
        self.grace_s, self.max_parked = grace_s, max_parked
        self._parked: dict[str, _Parked] = {}  # entry key -> parked attempt
        self._next_poll = 0.0

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, key: str) -> bool:
        return key in self._parked

    def keys(self) -> set[str]:
        return set(self._parked)

    def park(self, tracked: Tracked) -> bool:
        """False when the lot is full: the caller abandons the attempt instead."""
        tracked.is_parking = False
        if len(self._parked) >= self.max_parked:
            return False
        self._parked[tracked.key] = _Parked(tracked, time.monotonic())
        return True

    def take_all(self) -> list[Tracked]:
        parked, self._parked = self._parked, {}
        return [p.tracked for p in parked.values()]

    def poll(self, client: redis.Redis) -> tuple[list[Tracked], list[Tracked]]:
        """(followed again: re-admit them, past the grace: abandon them); at most every
        POLL_INTERVAL_S. Raises RedisError."""
        now = time.monotonic()
        if not self._parked or now < self._next_poll:
            return [], []
        self._next_poll = now + POLL_INTERVAL_S
        counts = listeners(client, (p.tracked.channel for p in self._parked.values()))
        resumed = [k for k, p in self._parked.items() if counts.get(p.tracked.channel, 0) > 0]
        expired = [k for k, p in self._parked.items() if k not in resumed and now - p.since > self.grace_s]
        return [self._parked.pop(k).tracked for k in resumed], [self._parked.pop(k).tracked for k in expired]
