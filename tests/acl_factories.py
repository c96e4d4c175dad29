"""Helpers of tests/test_redis_acl.py: a Redis 7 binary, deploy/redis/users.acl plus a test-only
admin, URLs of its users, what ACL LOG recorded, a stack of gateways and workers, the refusals
each user must get (DENIED, SCRIPT_DENIED), and the TLS certificates of the rediss:// tests."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import redis

from gateway.config import GatewayConfig
from gateway.redis_acl import worker_user_line
from gateway.redis_server import EmbeddedRedis, free_port
from protos.keys import FENCE_MARK, STREAM_DATA_FIELD, Keys, PriorityClass, Record
from protos.tokenrelay.v1 import generate_pb2, queue_pb2
from tests.factories import CountingEngine
from tests.service import GatewayThread, WorkerThread
from worker.config import DEFAULT_MODEL_NAME, WorkerConfig
from worker.engine.sim import SimConfig, SimEngine, sim_text, sim_token_ids

ROOT = Path(__file__).resolve().parents[1]
USERS_ACL = ROOT / "deploy" / "redis" / "users.acl"
PREFIX = "tokenrelay"  # the ACL's patterns are for the default prefix
KEYS = Keys(PREFIX, DEFAULT_MODEL_NAME)  # the test workers' model
ADMIN = ("admin", "test-admin-password")  # test-only: set up and inspect the server
# Test-only users of one worker each (gateway/redis_acl.py): worker id -> (user, password).
OWN_USERS = {worker_id: (f"worker-{worker_id}", f"test-{worker_id}-password")
             for worker_id in ("wa", "wb", "dead")}
_PASSWORD = re.compile(r"^user (\S+) .*?>(\S+)", re.MULTILINE)
# A refusal: NOPERM for a command sent by the client, "The user executing the script can't
# run this command / publish to the channel / access ... the keys" for a call inside a script.
REFUSED = r"(?i)noperm|no permissions|can't (run|publish|access|subscribe)"
NO_REDIS7 = "needs redis-server >= 7 (apt-get install redis-server; .ci/run does it as root)"


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


def url(user: str, port: int, scheme: str = "redis", query: str = "") -> str:
    passwords = {ADMIN[0]: ADMIN[1], **dict(OWN_USERS.values()), **acl_passwords()}
    return f"{scheme}://{user}:{passwords[user]}@127.0.0.1:{port}/0{query}"


def acl_with_admin(tmp: Path) -> Path:
    """users.acl unchanged, plus a test admin user and the per-worker users of OWN_USERS."""
    own = [worker_user_line(user, PREFIX, worker_id, f">{password}")
           for worker_id, (user, password) in OWN_USERS.items()]
    path = tmp / "users.acl"
    admin = f"user {ADMIN[0]} on >{ADMIN[1]} ~* &* +@all"
    path.write_text(USERS_ACL.read_text() + "\n".join([admin, *own]) + "\n")
    return path


def refusals(admin: redis.Redis) -> list[dict[str, Any]]:
    """What ACL LOG recorded, less what redis-py tolerates: CLIENT SETINFO (sent on connect, its
    refusal ignored) and failed AUTH (the tests' wrong-password probes)."""
    return [e for e in admin.acl_log() if e["reason"] != "auth" and e["object"] != "client|setinfo"]


def snapshot(admin: redis.Redis) -> dict[bytes, tuple[bytes | None, bool]]:
    """Every key's value (DUMP) and whether it has a TTL: a refused command changes neither."""
    return {k: (admin.dump(k), admin.pttl(k) >= 0) for k in admin.keys("*")}


def sim_engine(step_ms: float = 1.0) -> SimEngine:
    return SimEngine(SimConfig(step_ms=step_ms, ms_per_token=0.0), max_num_seqs=8)


def sim_chunk(request_id: str, seed: int, seq: int) -> queue_pb2.TokenEvent:
    """Chunk `seq` of a request as the simulated engine generates it, logged by a worker."""
    (token,) = sim_token_ids(seed, seq, 1)
    return queue_pb2.TokenEvent(request_id=request_id, seq=seq, chunk=generate_pb2.Chunk(
        index=seq, token_ids=[token], text=sim_text(token)))


def enqueue(admin: redis.Redis, request_id: str, consumer: str = "", seed: int = 5, stream: str = "",
            max_tokens: int = 0) -> bytes:
    """What a gateway's ATTACH writes (an entry in `stream`, default the NORMAL shared one, and its
    record), then, with `consumer`, that consumer's XREADGROUP of it."""
    request = generate_pb2.GenerateRequest(request_id=request_id, prompt="hi", model=KEYS.model)
    request.sampling.seed = seed
    if max_tokens:
        request.stopping.max_tokens = max_tokens
    queued = queue_pb2.QueuedRequest(request_id=request_id, request=request, result_ttl_s=60)
    stream = stream or KEYS.requests
    entry_id = admin.xadd(stream, {STREAM_DATA_FIELD: queued.SerializeToString()})
    admin.hset(KEYS.record(request_id), mapping={Record.DIGEST: "d", Record.ENTRY: entry_id,
                                                 Record.STREAM: stream, Record.SEED: seed})
    if consumer:
        with contextlib.suppress(redis.ResponseError):  # BUSYGROUP
            admin.xgroup_create(KEYS.requests, KEYS.group, id="0")
        admin.xreadgroup(KEYS.group, consumer, {KEYS.requests: ">"}, count=1)
    return entry_id


class Stack:
    """Gateways and workers started on given Redis URLs; stop() stops them all, last first."""

    def __init__(self) -> None:
        self._started: list[Any] = []

    def gateway(self, redis_url: str, **overrides: Any) -> GatewayThread:
        fields = {"models": (KEYS.model,), **overrides}  # queued for before the test's worker is up
        config = GatewayConfig(listen="127.0.0.1:0", redis_url=redis_url, key_prefix=PREFIX, **fields)
        return self._add(GatewayThread(config).start())

    def worker(self, redis_url: str, engine: Any = None, **overrides: Any) -> WorkerThread:
        fields = {"drain_timeout_s": 5.0, "claim_block_ms": 100, "worker_id": f"w-{uuid.uuid4().hex[:6]}",
                  **overrides}
        config = WorkerConfig(redis_url=redis_url, key_prefix=PREFIX, **fields)
        return self._add(WorkerThread(engine or CountingEngine(), config).start())

    def _add(self, service: Any) -> Any:
        self._started.append(service)
        return service

    def stop(self) -> None:
        while self._started:
            self._started.pop().stop()


def resumed_at(request: generate_pb2.GenerateRequest, index: int) -> generate_pb2.GenerateRequest:
    again = generate_pb2.GenerateRequest()
    again.CopyFrom(request)
    again.resume_from_index = index
    return again


def tokens_of(responses: list[generate_pb2.GenerateResponse]) -> list[int]:
    assert responses[-1].HasField("final"), responses[-1]
    return [t for r in responses[:-1] for t in r.chunk.token_ids]



# -- what each user is refused -------------------------------------------------------------------

REQUEST_KEY, WORKER = "acme/order-1", "w.1"  # what the `deployed` Redis of the tests holds
R, RID, W = KEYS.requests, REQUEST_KEY, WORKER
ROUTED = KEYS.routed(WORKER, PriorityClass.NORMAL)
# Commands outside each user's rights: each must be refused with NOPERM and change nothing.
WORKER_DENIED = [
    # A worker may not delete, trim or expire a request stream, nor enqueue, nor drop the group ...
    ("DEL", R), ("DEL", KEYS.requests_of(PriorityClass.HIGH)), ("UNLINK", R), ("XTRIM", R, "MAXLEN", "0"),
    ("PEXPIRE", R, "1"), ("XADD", R, "*", "data", "x"), ("XGROUP", "DESTROY", R, KEYS.group),
    ("XADD", ROUTED, "*", "data", "x"), ("PEXPIRE", ROUTED, "1"), ("DEL", ROUTED),
    # ... nor take over, fence or tidy away another worker: the gateways' sweeper does that ...
    ("XCLAIM", R, KEYS.group, "w.2", "0", "0-1"), ("XAUTOCLAIM", R, KEYS.group, "w.2", "0", "0"),
    ("XGROUP", "DELCONSUMER", R, KEYS.group, W), ("XINFO", "CONSUMERS", R, KEYS.group),
    ("SADD", KEYS.fence(W), FENCE_MARK), ("SREM", KEYS.fence(W), "other"), ("SADD", KEYS.fenced, W),
    ("ZREM", KEYS.registry, W), ("HDEL", KEYS.consumer_models, W),
    # ... nor DEL anything but heartbeat hashes (logs and the registry: HSET, HDEL, ZREM) ...
    ("DEL", KEYS.record(RID)), ("DEL", KEYS.log(W)), ("DEL", KEYS.registry),
    # ... nor write a request record (only gateways do: it could point one at a log it forged) ...
    ("HSET", KEYS.record(RID), "log", KEYS.log("w.2")), ("HSETNX", KEYS.record(RID), "log", "x"),
    ("HINCRBY", KEYS.record(RID), "deliveries", "9"), ("PEXPIRE", KEYS.record(RID), "1"),
    ("HDEL", KEYS.record(RID), "entry"),
    # ... nor load adapters of its own accord (operators write that hash) ...
    ("HSET", KEYS.adapters(KEYS.model), "evil", "/tmp/evil"), ("DEL", KEYS.consumer_models),
    # ... nor touch the tenants' quota keys, even to read them ...
    ("HSET", KEYS.tenant_tokens("acme"), "tokens", "1000000"), ("ZADD", KEYS.tenant_calls("acme"), "0", "x"),
    ("ZREM", KEYS.tenant_calls("acme"), "x"), ("HMGET", KEYS.tenant_tokens("acme"), "tokens"),
    # ... nor publish but on out channels (no aborts, no events, no gateway channels) ...
    ("PUBLISH", KEYS.aborts, "x"), ("PUBLISH", KEYS.events(RID), "x"), ("PUBLISH", KEYS.gateway("g"), "x"),
    ("PUBLISH", "other:events", "x"),
    # ... nor subscribe but to the aborts channel ...
    ("SUBSCRIBE", KEYS.out(W)), ("PSUBSCRIBE", KEYS.out_pattern), ("SUBSCRIBE", KEYS.events(RID)),
    # ... nor send anything its code never sends.
    ("EVAL", "return 1", "0"), ("SET", KEYS.worker(W), "x"), ("HSET", "other:record", "f", "v"),
    ("CLIENT", "SETNAME", "w2"), ("PING",), ("FLUSHALL",), ("KEYS", "*"), ("SCAN", "0"), ("SCRIPT", "FLUSH"),
]
GATEWAY_DENIED = [
    # Nothing its code never sends (INCRBY, EXPIRE, EVAL and EXISTS were allowed once; EXISTS is
    # now, on heartbeat hashes only: the sweeper judges by them) ...
    ("INCRBY", KEYS.tenant_calls("acme"), "1"), ("INCRBY", "tokenrelay:quota:acme", "1"),
    ("EXPIRE", KEYS.record(RID), "60"), ("EVAL", "return 1", "0"), ("EXISTS", KEYS.record(RID)),
    ("CLIENT", "SETNAME", "g"), ("PING",), ("SCRIPT", "EXISTS", "0" * 40), ("SCRIPT", "FLUSH"),
    ("CONFIG", "GET", "*"), ("KEYS", "*"), ("HGETALL", KEYS.record(RID)), ("HGETALL", "other:request:1"),
    # ... no worker's rights (its sweeper acknowledges, re-queues and fences; it forges nothing):
    # no stream deleted, no log, heartbeat, prefix index or served model written, no claim ...
    ("DEL", R), ("XGROUP", "DESTROY", R, KEYS.group), ("XCLAIM", R, KEYS.group, "g", "0", "0-1"),
    ("XREADGROUP", "GROUP", KEYS.group, "g", "STREAMS", R, ">"), ("HSET", KEYS.log(W), f"{RID}:0", "x"),
    ("HSET", KEYS.worker(W), "model", "x"), ("DEL", KEYS.worker(W)), ("PEXPIRE", KEYS.worker(W), "1"),
    ("ZADD", KEYS.prefixes(W), "1", "x"), ("HSET", KEYS.consumer_models, W, "other-model"),
    # ... and no forged tokens: it publishes only aborts, and subscribes only to its own channels.
    ("PUBLISH", KEYS.out(W), "x"), ("PUBLISH", KEYS.events(RID), "x"), ("SUBSCRIBE", KEYS.aborts),
    ("SUBSCRIBE", KEYS.out(W)), ("PSUBSCRIBE", f"{PREFIX}:*"), ("SUBSCRIBE", "other:events:1"),
]
# A worker with its own user (gateway/redis_acl.py), OWN_USERS["wa"], on the keys of consumer W,
# another worker's: it may not write its heartbeat, log, prefix index or fence set, nor
# publish on its out channel (it may read W's log, which a claim of W's request copies, and
# W's fence mark).
OWN_WORKER_DENIED = [
    ("HSET", KEYS.worker(W), "model", "x"), ("DEL", KEYS.worker(W)), ("PEXPIRE", KEYS.worker(W), "1"),
    ("HSET", KEYS.log(W), f"{RID}:1", "x"), ("HDEL", KEYS.log(W), f"{RID}:0"), ("PEXPIRE", KEYS.log(W), "1"),
    ("PUBLISH", KEYS.out(W), "x"), ("ZADD", KEYS.prefixes(W), "1", "x"),
    ("SREM", KEYS.fence(W), "other"), ("SMEMBERS", KEYS.fence(W)),
    ("HSET", KEYS.worker("wa"), "model", "x"),  # not one of wa's consumers either: no incarnation
    *WORKER_DENIED,  # and all a shared worker user is refused
]
DENIED = ([("worker", c) for c in WORKER_DENIED] + [("gateway", c) for c in GATEWAY_DENIED] + [
    (OWN_USERS["wa"][0], c) for c in OWN_WORKER_DENIED] + [
    ("autoscaler", ("XADD", R, "*", "data", "x")), ("autoscaler", ("XLEN", "tokenrelay:other")),
    ("autoscaler", ("HGETALL", KEYS.record("1"))), ("autoscaler", ("SUBSCRIBE", KEYS.aborts)),
    ("default", ("GET", R)), ("default", ("XLEN", R))])
# (user, a script it loads itself): Redis checks every call inside against the user's rights.
SCRIPT_DENIED = [
    (OWN_USERS["wa"][0], f"return redis.call('PUBLISH', '{KEYS.out(W)}', 'x')"),
    (OWN_USERS["wa"][0], f"return redis.call('HSET', '{KEYS.log(W)}', '{RID}:1', 'x')"),
    (OWN_USERS["wa"][0], f"return redis.call('HSET', '{KEYS.worker(W)}', 'model', 'x')"),
    ("worker", f"return redis.call('DEL', '{R}')"),
    ("worker", f"return redis.call('PUBLISH', '{KEYS.aborts}', 'x')"),
    ("worker", f"return redis.call('HSET', '{KEYS.tenant_tokens('acme')}', 'tokens', '1e9')"),
    ("worker", f"return redis.call('XADD', '{R}', '*', 'data', 'x')"),
    ("worker", f"return redis.call('HSET', '{KEYS.record(RID)}', 'log', '{KEYS.log(W)}')"),
    ("gateway", f"return redis.call('DEL', '{R}')"),
    ("gateway", f"return redis.call('INCRBY', '{KEYS.tenant_calls('acme')}', 1)"),
    ("gateway", f"return redis.call('PUBLISH', '{KEYS.out(W)}', 'x')"),
    ("gateway", f"return redis.call('HSET', '{KEYS.log(W)}', '{RID}:0', 'x')"),
]


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

    def _is_ready(self) -> bool:
        try:
            with tls_client(self.tls_port, self.ca) as client:
                return bool(client.ping())
        except redis.exceptions.ConnectionError:
            return False


def tls_client(port: int, ca: Path) -> redis.Redis:
    """The default user (PING only) over TLS."""
    return redis.Redis.from_url(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}")
