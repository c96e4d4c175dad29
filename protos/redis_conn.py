"""How the gateway (redis.asyncio) and the worker (redis) connect to Redis.

Both sides want the same client: one that fails fast and never retries behind
the caller's back, because each side owns its retrying (the gateway answers
UNAVAILABLE, the worker's loops back off with `Backoff` and try again). Each
side keeps a one-line `connect()` that passes `client_options` to its own
client class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.backoff import AbstractBackoff, NoBackoff

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")
# Connecting takes a round trip, not a blocking read: no need to wait as long as a command may.
MAX_CONNECT_TIMEOUT_S = 2.0


def check_redis_url(url: str) -> None:
    """ValueError unless `url` has a scheme redis-py connects with."""
    if not url.startswith(REDIS_URL_SCHEMES):
        raise ValueError(f"redis_url must start with one of {', '.join(REDIS_URL_SCHEMES)}, got {url!r}")


def client_options(retry_type: Callable[[AbstractBackoff, int], Any], timeout_s: float) -> dict[str, Any]:
    """Keyword arguments of `Redis.from_url` for a fail-fast client.

    retry_type: `redis.retry.Retry` for the sync client, `redis.asyncio.retry.Retry`
    for the asyncio one; it is built with 0 retries (redis-py retries 3 times
    by default, which would hide an outage for seconds).
    timeout_s: the socket timeout of every command (a blocking read must fit in it);
    connecting gives up after at most MAX_CONNECT_TIMEOUT_S.
    protocol=2: RESP2 replies, the shapes both sides parse, from any Redis version.
    """
    return {"protocol": 2, "socket_timeout": timeout_s,
            "socket_connect_timeout": min(MAX_CONNECT_TIMEOUT_S, timeout_s),
            "retry": retry_type(NoBackoff(), 0)}


class Backoff:
    """Reconnect delay after consecutive failures: 50 ms, doubling, at most max_s."""

    FIRST_DELAY_S = 0.05

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self.delay = 0.0

    def failed(self) -> float:
        """Seconds to wait before the next attempt."""
        self.delay = min(self.max_s, max(self.FIRST_DELAY_S, self.delay * 2))
        return self.delay

    def reset(self) -> None:
        """An attempt succeeded: the next failure waits FIRST_DELAY_S again."""
        self.delay = 0.0
