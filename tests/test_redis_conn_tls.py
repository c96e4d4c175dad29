"""The redis-py clients of protos/redis_conn.py over TLS (rediss://) on a real Redis 7, with the CA
given in the URL, and a gateway and a worker serving through them.

Needs a redis-server >= 7 binary built with TLS (Debian's redis-server 7.0: `.ci/run` installs it
when root); skipped, saying why, without one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from protos.convert import build_request
from protos.redis_conn import async_client, sync_client
from tests.acl_factories import (
    NO_REDIS7,
    Stack,
    TLSRedis,
    acl_with_admin,
    find_redis7,
    url,
    write_certificates,
)
from tests.service import stub_for, wait_until, workers_ready

REDIS7 = find_redis7()


@pytest.fixture
def stack() -> Iterator[Stack]:
    started = Stack()
    yield started
    started.stop()



@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    if REDIS7 is None:
        pytest.skip(NO_REDIS7)
    directory = tmp_path_factory.mktemp("tls")
    server = TLSRedis(REDIS7, write_certificates(directory), acl_with_admin(directory))
    try:
        server.start()
    except (RuntimeError, AssertionError) as e:  # a build without TLS rejects --tls-port
        server.stop()
        pytest.skip(f"this redis-server cannot serve TLS: {e}")
    yield server.tls_port, server.ca
    server.stop()


def test_redis_conn_clients_connect_over_tls_with_the_ca_from_the_url(tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis
    tls_url = url("worker", port, "rediss", f"?ssl_ca_certs={ca}")
    client = sync_client(tls_url, timeout_s=2)
    try:
        assert client.time()  # neither user may PING: it is no command of theirs
        assert client.connection_pool.connection_kwargs["ssl_ca_certs"] == str(ca)
    finally:
        client.close()

    async def time_async() -> bool:
        aclient = async_client(url("gateway", port, "rediss", f"?ssl_ca_certs={ca}"), timeout_s=2)
        try:
            return bool(await aclient.time())
        finally:
            await aclient.aclose()
    assert asyncio.run(time_async())


def test_a_client_without_the_ca_is_refused(tls_redis: tuple[int, Path]) -> None:
    port, _ = tls_redis
    client = sync_client(url("worker", port, "rediss"), timeout_s=2)
    try:
        with pytest.raises(redis.exceptions.ConnectionError, match="(?i)certificate"):
            client.time()
    finally:
        client.close()


def test_gateway_and_worker_work_over_tls(tls_redis: tuple[int, Path], stack: Stack) -> None:
    port, ca = tls_redis
    query = f"?ssl_ca_certs={ca}"
    stack.worker(url("worker", port, "rediss", query))
    gateway = stack.gateway(url("gateway", port, "rediss", query))
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        responses = list(stub.Generate(build_request("hi", max_tokens=3), timeout=20))
    assert "".join(r.chunk.text for r in responses if r.HasField("chunk")) == "xxx"
