"""EmbeddedRedis keeps an AOF: streams, consumer groups and hashes survive a restart or a kill."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.redis_server import LOG_NAME, EmbeddedRedis, PortInUse

STREAM, GROUP, CONSUMER, HASH = "s", "g", "worker-1", "h"


def client_for(server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=5)


def write_sample(server: EmbeddedRedis) -> str:
    """A stream entry claimed by a consumer (pending, not acked) and a hash; the entry's id."""
    with client_for(server) as r:
        entry_id = str(r.xadd(STREAM, {"prompt": "hi"}))
        r.xgroup_create(STREAM, GROUP, id="0")
        r.xreadgroup(GROUP, CONSUMER, {STREAM: ">"}, count=1)
        r.hset(HASH, mapping={"state": "running", "num_tokens": "3"})
        return entry_id


def assert_sample(server: EmbeddedRedis, entry_id: str) -> None:
    with client_for(server) as r:
        assert [entry[0] for entry in r.xrange(STREAM)] == [entry_id]
        pending = r.xpending_range(STREAM, GROUP, min="-", max="+", count=10)
        assert [(p["message_id"], p["consumer"]) for p in pending] == [(entry_id, CONSUMER)]
        assert r.hgetall(HASH) == {"state": "running", "num_tokens": "3"}


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as s:
        yield s


def test_append_only_file_fsynced_every_second(server: EmbeddedRedis) -> None:
    with client_for(server) as r:
        assert r.config_get("appendonly") == {"appendonly": "yes"}
        assert r.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert r.config_get("save") == {"save": ""}


def test_memory_is_bounded_and_never_evicted(server: EmbeddedRedis) -> None:
    with client_for(server) as r:
        assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert int(r.config_get("maxmemory")["maxmemory"]) == 1024**3  # DEFAULT_MAXMEMORY, 1gb


def test_a_full_redis_refuses_writes_instead_of_evicting() -> None:
    with EmbeddedRedis(maxmemory="1") as server, client_for(server) as r:  # below any Redis's own use
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            r.set("k", "v")
        assert r.ping()  # reads and pings still work


def test_stream_group_and_hash_survive_restart_on_the_same_port(server: EmbeddedRedis) -> None:
    entry_id = write_sample(server)
    port = server.port
    server.restart()
    assert server.is_running and server.port == port
    assert_sample(server, entry_id)


def wait_until_in_the_aof(server: EmbeddedRedis, timeout_s: float = 10.0) -> None:
    """Until Redis has written its AOF buffer to the file. An acknowledged write normally is
    there before the reply, but while a background fsync is slow (a loaded disk), everysec
    postpones the write for up to 2 s, and a SIGKILL then loses it: Redis's documented last
    second, which this test must not mistake for a replay bug (it failed so under load)."""
    deadline = time.monotonic() + timeout_s
    with client_for(server) as r:
        while int(r.info("persistence").get("aof_buffer_length", 0)) > 0:
            assert time.monotonic() < deadline, "Redis kept its AOF buffer unwritten for 10 s"
            time.sleep(0.05)


def test_writes_in_the_aof_survive_a_kill(server: EmbeddedRedis) -> None:
    entry_id = write_sample(server)
    wait_until_in_the_aof(server)
    server.kill()
    assert not server.is_running
    server.start()
    assert_sample(server, entry_id)


def test_stop_discards_a_temp_dir(server: EmbeddedRedis) -> None:
    write_sample(server)
    server.stop()
    server.start()
    with client_for(server) as r:
        assert r.dbsize() == 0


def test_a_data_dir_outlives_the_server(tmp_path: Path) -> None:
    with EmbeddedRedis(data_dir=tmp_path) as first:
        entry_id = write_sample(first)
    assert (tmp_path / "appendonly.aof").stat().st_size > 0
    with EmbeddedRedis(data_dir=tmp_path) as second:
        assert_sample(second, entry_id)


def _listen_on(port: int) -> socket.socket:
    """Someone else's listener on `port`, as when another process takes it after free_port()."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_chosen_port_taken_before_the_bind_is_replaced_by_another() -> None:
    server = EmbeddedRedis()
    taken = server.port
    with _listen_on(taken):
        try:
            server.start()
            assert server.port != taken
            with client_for(server) as r:
                assert r.ping()
        finally:
            server.stop()


def test_a_named_port_in_use_fails_with_what_redis_said(tmp_path: Path) -> None:
    with _listen_on(0) as other:
        port = other.getsockname()[1]
        server = EmbeddedRedis(port, data_dir=tmp_path)
        with pytest.raises(PortInUse, match=f"(?s)port {port} exited with 1: .*Address already in use"):
            server.start()
        assert not server.is_running
        assert "Address already in use" in (tmp_path / LOG_NAME).read_text()
