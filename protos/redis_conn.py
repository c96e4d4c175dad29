"""How the gateway (redis.asyncio) and the worker (redis) connect to Redis.

Both sides want the same client: one that fails fast and never retries behind
the caller's back, because each side owns its retrying (the gateway answers
UNAVAILABLE, the worker's loops back off with `Backoff` and try again). Each
side's `connect()` is `sync_client` / `async_client`, which take every URL form
`check_redis_url` accepts:

- `redis://`, `rediss://`, `unix://`: one Redis server, as redis-py's `from_url` reads them.
- `redis+sentinel://[[username]:password@]host1[:port1][,host2[:port2],...]/SERVICE_NAME[/DB]`:
  the master that the listed Sentinels currently name for SERVICE_NAME (the name
  in their `sentinel monitor` line). Ports default to 26379, DB to 0; username
  and password (percent-encoded) authenticate to the Redis servers, while the
  sentinels are asked without a password. No query options. Example:
  `redis+sentinel://:s3cret@sentinel-0:26379,sentinel-1:26379/tokenrelay/0`.

A sentinel client follows a failover: a command that fails on the old master
raises (ConnectionError, no retry, as with one server), and the next connection
asks the sentinels for the master again (redis-py's SentinelConnectionPool).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.retry
import redis.sentinel
from redis.backoff import AbstractBackoff, NoBackoff

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SENTINEL_SCHEME = "redis+sentinel://"
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://", SENTINEL_SCHEME)
DEFAULT_SENTINEL_PORT = 26379
# Connecting takes a round trip, not a blocking read: no need to wait as long as a command may.
MAX_CONNECT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed `redis+sentinel://` URL (see the module docstring for its form)."""

    hosts: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelUrl:
        """ValueError naming what is wrong unless `url` is a well-formed sentinel URL."""
        shown = redact_url(url)  # error messages never show the password
        if not url.startswith(SENTINEL_SCHEME):
            raise ValueError(f"a sentinel URL must start with {SENTINEL_SCHEME}, got {shown!r}")
        rest = url.removeprefix(SENTINEL_SCHEME)
        if "?" in rest or "#" in rest:
            raise ValueError(f"a sentinel URL takes no query options or fragment, got {shown!r}")
        netloc, _, path = rest.partition("/")
        userinfo, _, host_list = netloc.rpartition("@")
        username, _, password = userinfo.partition(":")
        service_name, _, db = path.partition("/")
        if not service_name:
            raise ValueError(f"a sentinel URL needs a service name: .../SERVICE_NAME[/DB], got {shown!r}")
        if db and not db.isdigit():
            raise ValueError(f"the DB of a sentinel URL must be a number >= 0, got {db!r} in {shown!r}")
        return cls(hosts=tuple(_host_port(h, url) for h in host_list.split(",")),
                   service_name=unquote(service_name), db=int(db or 0),
                   username=unquote(username) or None, password=unquote(password) or None)


def _host_port(address: str, url: str) -> tuple[str, int]:
    """'host', 'host:port' or '[ipv6]:port' -> (host, port)."""
    shown = redact_url(url)
    if address.startswith("["):
        host, _, port = address[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = address.partition(":")
    if not host:
        raise ValueError(f"a sentinel URL needs host[:port] for every sentinel, got {shown!r}")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"sentinel port must be 1..65535, got {port!r} in {shown!r}")
    return host, int(port or DEFAULT_SENTINEL_PORT)


_USERINFO_PASSWORD = re.compile(r"(?P<head>^[A-Za-z][A-Za-z0-9+.-]*://[^:@/?#]*):[^@/?#]*@")
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)[^&#]*", re.IGNORECASE)


def text(value: str | bytes) -> str:
    """A reply's value as text: clients made without decode_responses answer bytes."""
    return value.decode() if isinstance(value, bytes) else value


def redact_url(url: str) -> str:
    """`url` with its password (userinfo or ?password=) replaced by ***: the only form of a
    Redis URL that may be logged or put in an error message."""
    return _QUERY_PASSWORD.sub(r"\g<head>***", _USERINFO_PASSWORD.sub(r"\g<head>:***@", url))


def check_redis_url(url: str) -> None:
    """ValueError unless `url` has a scheme redis-py connects with (and, for sentinels, parses).
    The messages show the URL without its password."""
    if not url.startswith(REDIS_URL_SCHEMES):
        raise ValueError(f"redis_url must start with one of {', '.join(REDIS_URL_SCHEMES)}, "
                         f"got {redact_url(url)!r}")
    if url.startswith(SENTINEL_SCHEME):
        SentinelUrl.parse(url)


# CLIENT SETINFO's library name and version, given: left to it, redis-py 8 looked its version
# up in the installed packages for every new connection (~0.4 ms, 14 us given), which a gateway
# opening connections under a burst of calls paid each time (py-spy, bench-fleet's shedding
# test, 2026-12-03). Older redis-py looked it up once, and has no DriverInfo.
try:
    from redis.driver_info import DriverInfo
    _DRIVER_OPTIONS: dict[str, Any] = {"driver_info": DriverInfo(lib_version=redis.__version__)}
except ImportError:
    _DRIVER_OPTIONS = {}


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
            "retry": retry_type(NoBackoff(), 0), **_DRIVER_OPTIONS}


def _sentinel_args(url: str, retry_type: Callable[[AbstractBackoff, int], Any],
                   timeout_s: float) -> tuple[SentinelUrl, dict[str, Any]]:
    """The parsed URL and the keyword arguments of `Sentinel(...)` for a fail-fast client."""
    parsed = SentinelUrl.parse(url)
    # A sentinel answers from memory, so asking one is a round trip: the connect bound
    # fits, and an unreachable sentinel costs at most that before the next one is asked.
    sentinel_kwargs = client_options(retry_type, min(MAX_CONNECT_TIMEOUT_S, timeout_s))
    master_kwargs = {**client_options(retry_type, timeout_s), "db": parsed.db,
                     "username": parsed.username, "password": parsed.password}
    return parsed, {"sentinels": list(parsed.hosts), "sentinel_kwargs": sentinel_kwargs, **master_kwargs}


class _SentinelMaster(redis.Redis):
    """A `master_for` client that also closes its connections to the sentinels."""

    sentinel_manager: redis.sentinel.Sentinel | None = None

    def close(self) -> None:
        super().close()
        if self.sentinel_manager is not None:
            self.sentinel_manager.close()


class _AsyncSentinelMaster(redis.asyncio.Redis):
    """A `master_for` client that also closes its connections to the sentinels."""

    sentinel_manager: redis.asyncio.sentinel.Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel_manager is not None:
            await self.sentinel_manager.aclose()


def sync_client(url: str, timeout_s: float) -> redis.Redis:
    """A fail-fast `redis.Redis` (see `client_options`) for any URL `check_redis_url` accepts."""
    if not url.startswith(SENTINEL_SCHEME):
        return redis.Redis.from_url(url, **client_options(redis.retry.Retry, timeout_s))
    parsed, kwargs = _sentinel_args(url, redis.retry.Retry, timeout_s)
    sentinel = redis.sentinel.Sentinel(**kwargs)
    client: _SentinelMaster = sentinel.master_for(parsed.service_name, redis_class=_SentinelMaster)
    client.sentinel_manager = sentinel
    return client


# Connections of a gateway's pool. redis-py's asyncio pool holds 100 and then raises "Too many
# connections" at once: 512 streams opening together on one gateway failed 13 of them
# (benchmarks/fleet.py). A blocking pool makes a call wait for a free connection instead,
# at most the command timeout.
MAX_ASYNC_CONNECTIONS = 256


def async_client(url: str, timeout_s: float) -> redis.asyncio.Redis:
    """A fail-fast `redis.asyncio.Redis` (see `client_options`) for any URL `check_redis_url` accepts."""
    if not url.startswith(SENTINEL_SCHEME):
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=MAX_ASYNC_CONNECTIONS, timeout=timeout_s,
            **client_options(redis.asyncio.retry.Retry, timeout_s))
        return redis.asyncio.Redis.from_pool(pool)
    parsed, kwargs = _sentinel_args(url, redis.asyncio.retry.Retry, timeout_s)
    sentinel = redis.asyncio.sentinel.Sentinel(**kwargs)
    client: _AsyncSentinelMaster = sentinel.master_for(parsed.service_name, redis_class=_AsyncSentinelMaster)
    client.sentinel_manager = sentinel
    return client


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
