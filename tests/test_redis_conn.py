"""Redis URLs, and the fail-fast clients built from them: one server, or the master Sentinel names."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

from protos.redis_conn import SentinelUrl, async_client, check_redis_url, sync_client
from tests.sentinel import SentinelCluster

T = TypeVar("T")
MAX_FAILED_COMMANDS = 5  # after a failover, before the client has found the new master


@pytest.mark.parametrize("url", [
    "redis://h:1/0", "rediss://:pw@h:1/2", "unix:///tmp/r.sock",
    "redis+sentinel://h:26379/mymaster", "redis+sentinel://:pw@a:1,b:2,c/mymaster/3",
    "redis+sentinel://[::1]:26379/mymaster/", "redis+sentinel://user:pw@h/mymaster",
])
def test_urls_that_are_accepted(url: str) -> None:
    check_redis_url(url)


@pytest.mark.parametrize(("url", "problem"), [
    ("http://h:1", "must start with"),
    ("h:6379", "must start with"),
    ("", "must start with"),
    ("sentinel://h:26379/mymaster", "must start with"),
    ("redis+sentinel://h:26379", "needs a service name"),
    ("redis+sentinel://h:26379/", "needs a service name"),
    ("redis+sentinel:///mymaster", "needs host"),
    ("redis+sentinel://a:1,,b:2/mymaster", "needs host"),
    ("redis+sentinel://h:port/mymaster", "port must be"),
    ("redis+sentinel://h:70000/mymaster", "port must be"),
    ("redis+sentinel://h/mymaster/zero", "DB .* must be a number"),
    ("redis+sentinel://h/mymaster?db=1", "no query options"),
])
def test_urls_that_are_rejected_name_the_problem(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_redis_url(url)


def test_sentinel_url_parts() -> None:
    parsed = SentinelUrl.parse("redis+sentinel://:p%40ss@s0:26380,s1,[::1]:5/tokenrelay/2")
    assert parsed == SentinelUrl(hosts=(("s0", 26380), ("s1", 26379), ("::1", 5)),
                                 service_name="tokenrelay", db=2, username=None, password="p@ss")
    assert SentinelUrl.parse("redis+sentinel://u:pw@h/m").username == "u"


@pytest.mark.parametrize("make_client", [sync_client, async_client])
def test_sentinel_clients_fail_fast_without_hidden_retries(make_client: Callable[[str, float], Any]) -> None:
    client = make_client("redis+sentinel://:pw@127.0.0.1:1/tokenrelay/4", 5.0)
    master = client.connection_pool.connection_kwargs
    assert (master["socket_timeout"], master["socket_connect_timeout"]) == (5.0, 2.0)
    assert master["retry"].get_retries() == 0 and master["protocol"] == 2
    assert (master["db"], master["password"]) == (4, "pw")
    for sentinel in client.sentinel_manager.sentinels:
        kwargs = sentinel.connection_pool.connection_kwargs
        assert kwargs["retry"].get_retries() == 0 and kwargs["socket_timeout"] == 2.0
        assert kwargs["password"] is None  # sentinels are asked without the servers' password


def test_no_sentinel_answering_fails_at_once() -> None:
    client = sync_client("redis+sentinel://127.0.0.1:1,127.0.0.1:2/tokenrelay", 5.0)
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError, match="No master found"):
        client.ping()
    assert time.monotonic() - start < 1.0
    client.close()


def test_sync_client_for_one_server(redis_url: str, prefix: str) -> None:
    with sync_client(redis_url, 5.0) as client:
        client.set(f"{prefix}:k", "v")
        assert client.get(f"{prefix}:k") == b"v"


def test_async_client_for_one_server(redis_url: str, prefix: str) -> None:
    async def roundtrip() -> Any:
        client = async_client(redis_url, 5.0)
        try:
            await client.set(f"{prefix}:k", "v")
            return await client.get(f"{prefix}:k")
        finally:
            await client.aclose()

    assert asyncio.run(roundtrip()) == b"v"


@pytest.fixture(scope="module")
def cluster() -> Iterator[SentinelCluster]:
    """Shared by the tests that leave the primary alone; the failover test has its own."""
    with SentinelCluster() as c:
        yield c


def served_by(client: redis.Redis) -> int:
    """The port of the server that answered `client`."""
    return port_of(client.config_get("port"))


def port_of(config: Any) -> int:
    """The port in a CONFIG GET port reply."""
    return int(config["port"])


def test_sync_sentinel_client_writes_to_the_primary_and_subscribes(cluster: SentinelCluster) -> None:
    with sync_client(cluster.url, 5.0) as client:
        assert served_by(client) == cluster.primary_port
        client.set("sync-key", "v")
        assert client.wait(1, 2000) == 1  # reached the replica: written on the primary
        pubsub = client.pubsub()
        pubsub.subscribe("news")
        assert pubsub.get_message(timeout=2)["type"] == "subscribe"
        assert client.publish("news", "hello") == 1
        assert pubsub.get_message(timeout=2)["data"] == b"hello"
        pubsub.close()


def test_async_sentinel_client_writes_to_the_primary_and_subscribes(cluster: SentinelCluster) -> None:
    async def check() -> None:
        client = async_client(cluster.url, 5.0)
        try:
            assert port_of(await client.config_get("port")) == cluster.primary_port
            await client.set("async-key", "v")
            assert await client.wait(1, 2000) == 1
            pubsub = client.pubsub()
            await pubsub.subscribe("news")
            assert (await pubsub.get_message(timeout=2))["type"] == "subscribe"
            assert await client.publish("news", "hello") == 1
            assert (await pubsub.get_message(timeout=2))["data"] == b"hello"
            await pubsub.aclose()
        finally:
            await client.aclose()

    asyncio.run(check())


def retry_until_master(command: Callable[[], T]) -> tuple[T, int]:
    """`command`'s result once it succeeds, and how many attempts failed before."""
    for failures in range(MAX_FAILED_COMMANDS):
        try:
            return command(), failures
        except redis.ConnectionError:
            time.sleep(0.2)
    return command(), MAX_FAILED_COMMANDS


async def async_retry_until_master(command: Callable[[], Awaitable[T]]) -> tuple[T, int]:
    for failures in range(MAX_FAILED_COMMANDS):
        try:
            return await command(), failures
        except redis.ConnectionError:
            await asyncio.sleep(0.2)
    return await command(), MAX_FAILED_COMMANDS


def test_clients_follow_a_failover_and_find_the_replicated_data() -> None:
    with SentinelCluster() as cluster:
        asyncio.run(_failover(cluster))


async def _failover(cluster: SentinelCluster) -> None:
    """Both clients are made, and connected, before the primary dies; the loop only drives the async one."""
    sync, aclient = sync_client(cluster.url, 2.0), async_client(cluster.url, 2.0)
    try:
        entry_id = sync.xadd("requests", {"prompt": "hi"})
        await aclient.hset("state", mapping={"phase": "before"})
        assert sync.wait(1, 2000) == 1  # the replica has both before the primary dies
        old_port = cluster.primary_port
        cluster.kill_primary()
        start = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            sync.ping()  # fails fast while the dead primary is still the one named
        with pytest.raises(redis.ConnectionError):
            await aclient.ping()
        assert time.monotonic() - start < 1.0

        new_port = cluster.wait_for_failover(timeout_s=15)
        assert new_port != old_port
        assert retry_until_master(lambda: served_by(sync))[0] == new_port
        config, _ = await async_retry_until_master(lambda: aclient.config_get("port"))
        assert port_of(config) == new_port
        assert [e[0] for e in sync.xrange("requests") or []] == [entry_id]
        assert await aclient.hgetall("state") == {b"phase": b"before"}
        await aclient.set("after", "written")  # the new primary takes writes
        assert sync.get("after") == b"written"
    finally:
        sync.close()
        await aclient.aclose()


def test_the_testcontainers_fixture_falls_through_at_once_without_docker(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tests.conftest import _testcontainers_redis

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    start = time.monotonic()
    with _testcontainers_redis() as container_url:
        assert container_url is None
    assert time.monotonic() - start < 3
