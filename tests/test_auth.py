"""Bearer tokens and tenants: the file's checks, a real gateway's answers, SIGHUP reloads."""

from __future__ import annotations

import json
import re
import secrets
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from gateway.auth import Authenticator, Unauthenticated, load_tenants
from gateway.client import TokenRelayClient
from gateway.redis_server import free_port
from gateway.tls import is_loopback
from protos.convert import build_request
from protos.keys import Keys
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc
from tests.factories import CountingEngine
from tests.service import GatewayProcess, GatewayThread, WorkerThread, scrape_samples, stub_for, wait_until
from worker.config import DEFAULT_MODEL_NAME, WorkerConfig


def new_token() -> str:
    return secrets.token_urlsafe(24)


def write_tenants(path: Path, tenants: dict[str, dict[str, Any]]) -> str:
    path.write_text(json.dumps({"tenants": tenants}))
    return str(path)


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
def counting_worker(redis_url: str, prefix: str) -> Iterator[WorkerThread]:
    config = WorkerConfig(redis_url=redis_url, key_prefix=prefix, worker_id=f"w-{uuid.uuid4().hex[:6]}",
                          drain_timeout_s=5.0, claim_block_ms=50)
    worker = WorkerThread(CountingEngine(), config).start()
    yield worker
    worker.stop()


# -- the tenants file -----------------------------------------------------------------------------------

TOKEN = "t" * 16


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "is not valid JSON"),
    ('{"tenants": {}, "extra": 1}', "must be one object"),
    ('["tenants"]', "must be one object"),
    ('{"tenants": {}}', "no tenants"),
    (json.dumps({"tenants": {"a b": {"tokens": [TOKEN]}}}), "tenant name 'a b'"),
    (json.dumps({"tenants": {"a": {"tokens": [TOKEN], "max_concurent": 1}}}),
     "unknown key(s) 'max_concurent'"),
    (json.dumps({"tenants": {"a": {"max_concurrent": 1}}}), '"tokens" must be a non-empty list'),
    (json.dumps({"tenants": {"a": {"tokens": []}}}), '"tokens" must be a non-empty list'),
    (json.dumps({"tenants": {"a": {"tokens": ["short"]}}}), "tokens[0] must be a string of at least 16"),
    (json.dumps({"tenants": {"a": {"tokens": [TOKEN], "max_concurrent": 0}}}), "max_concurrent must be >= 1"),
    (json.dumps({"tenants": {"a": {"tokens": [TOKEN], "tokens_per_minute": -5}}}),
     "tokens_per_minute must be >= 1"),
    (json.dumps({"tenants": {"a": {"tokens": [TOKEN], "max_concurrent": True}}}),
     "max_concurrent must be an integer"),
    (json.dumps({"tenants": {"a": {"tokens": [TOKEN], "max_priority": "high"}}}),
     "max_priority must be an integer"),
    (json.dumps({"tenants": {"a": {"tokens": [TOKEN]}, "b": {"tokens": ["u" * 16, TOKEN]}}}),
     "tenant 'b' tokens[1] is also a token of tenant 'a'"),
])
def test_a_bad_tenants_file_is_refused_naming_the_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(content)
    with pytest.raises(ValueError) as e:
        load_tenants(str(path))
    assert message in str(e.value) and TOKEN not in str(e.value)


def test_tokens_name_their_tenant_with_its_limits(tmp_path: Path) -> None:
    a, b = new_token(), new_token()
    path = write_tenants(tmp_path / "t.json", {
        "acme": {"tokens": [a, "x" * 20], "max_concurrent": 2, "tokens_per_minute": 1000, "max_priority": -1},
        "free": {"tokens": [b]}})
    auth = Authenticator(path)
    acme = auth.authenticate(bearer(a))
    limits = (acme.max_concurrent, acme.tokens_per_minute, acme.max_priority)
    assert (acme.name, limits) == ("acme", (2, 1000, -1))
    assert auth.authenticate([("authorization", "bearer " + "x" * 20)]).name == "acme"  # scheme: any case
    assert auth.authenticate(bearer(b)) == load_tenants(path).find(b)
    for metadata in ([], bearer(a + "x"), [("authorization", a)], [*bearer(a), *bearer(b)]):
        with pytest.raises(Unauthenticated):
            auth.authenticate(metadata)


def test_an_unreadable_tenants_file_is_a_clean_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.__main__ import config_from_args

    bad = tmp_path / "t.json"
    bad.write_text('{"tenants": {"a": {"tokens": ["short"]}}}')
    for path, message in ((str(tmp_path / "missing.json"), "cannot be read"), (str(bad), "tokens[0]")):
        with pytest.raises(SystemExit) as exit_:
            config_from_args(["--auth-tokens-file", path])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


# -- a real gateway ---------------------------------------------------------------------------------------

def test_calls_need_a_known_token_but_health_and_reflection_stay_open(
        tmp_path: Path, make_gateway: Callable[..., GatewayThread]) -> None:
    token = new_token()
    gateway = make_gateway(auth_tokens_file=write_tenants(tmp_path / "t.json", {"acme": {"tokens": [token]}}),
                           enable_reflection=True)
    channel, stub = stub_for(gateway.target)
    with channel:
        for metadata in ((), bearer(new_token())):
            with pytest.raises(grpc.RpcError) as e:
                stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(build_request("hi"), timeout=5, metadata=metadata))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization" in (e.value.details() or "") or "not valid" in (e.value.details() or "")
        info = stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5, metadata=bearer(token))
        assert info.tenant.name == "acme"
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert "tokenrelay.v1.TokenRelay" in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_priority_above_the_tenants_max_is_permission_denied(
        tmp_path: Path, make_gateway: Callable[..., GatewayThread]) -> None:
    token = new_token()
    path = write_tenants(tmp_path / "t.json", {"acme": {"tokens": [token], "max_priority": 2}})
    channel, stub = stub_for(make_gateway(auth_tokens_file=path).target)
    request = build_request("hi")
    request.priority = 3
    with channel, pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=5, metadata=bearer(token)))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "priority 3 is above the max_priority of tenant 'acme' (2)" in (e.value.details() or "")


def test_the_final_names_the_tenant_and_a_request_id_belongs_to_its_tenant(
        tmp_path: Path, make_gateway: Callable[..., GatewayThread], counting_worker: WorkerThread) -> None:
    a, b = new_token(), new_token()
    path = write_tenants(tmp_path / "t.json", {"acme": {"tokens": [a], "max_priority": 5},
                                               "other": {"tokens": [b]}})
    metrics_port = free_port()
    gateway = make_gateway(auth_tokens_file=path, metrics_port=metrics_port)
    request = build_request("hi", max_tokens=3, request_id="shared-id")
    request.priority = 5
    with TokenRelayClient(gateway.target, token=a) as client:
        responses = list(client.stub.Generate(request, timeout=10, metadata=client.metadata))
    assert responses[-1].final.tenant == "acme" and responses[-1].final.text == "xxx"
    request.priority = 0  # "other" has the default max_priority, 0
    with TokenRelayClient(gateway.target, token=b) as client:  # its own "shared-id": a request of its own
        responses = list(client.stub.Generate(request, timeout=10, metadata=client.metadata))
    assert responses[-1].final.tenant == "other" and responses[-1].request_id == "shared-id"
    with grpc.insecure_channel(gateway.target) as channel, pytest.raises(grpc.RpcError):
        list(generate_pb2_grpc.TokenRelayStub(channel).Generate(request, timeout=10))
    samples = scrape_samples(metrics_port)
    counts = {(s.name, s.labels.get("tenant"), s.labels.get("reason")): s.value for s in samples}
    assert counts[("tokenrelay_request_success_total", "acme", None)] == 1
    assert counts[("tokenrelay_request_success_total", "other", None)] == 1
    assert counts[("tokenrelay_requests_rejected_total", "", "unauthenticated")] == 1
    assert not any(s.name.startswith("tokenrelay_e2e") and "tenant" in s.labels for s in samples)


@pytest.mark.parametrize(("listen", "expected"), [
    ("127.0.0.1:1", True), ("localhost:1", True), ("[::1]:1", True), ("0.0.0.0:1", False),
    ("10.0.0.5:1", False), ("gateway.internal:1", False),
])
def test_only_loopback_listeners_go_without_the_unauthenticated_warning(listen: str, expected: bool) -> None:
    assert is_loopback(listen) is expected


def test_sighup_reloads_the_tenants_file_without_dropping_calls(tmp_path: Path, redis_url: str,
                                                                 prefix: str) -> None:
    old, new = new_token(), new_token()
    path = tmp_path / "t.json"
    write_tenants(path, {"acme": {"tokens": [old]}})
    gateway = GatewayProcess(redis_url, prefix, "--auth-tokens-file", str(path)).wait_serving()
    channel, stub = stub_for(gateway.target)

    def status(token: str) -> grpc.StatusCode:
        try:
            stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5, metadata=bearer(token))
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    try:
        # a call open across the reloads (no worker: it waits in the queue until its deadline)
        open_call = stub.Generate(build_request("hi"), timeout=4, metadata=bearer(old))
        ended: list[grpc.StatusCode] = []
        reader = threading.Thread(target=lambda: ended.append(_code_of(open_call)))
        reader.start()
        queued = redis.Redis.from_url(redis_url)
        stream = Keys(prefix, DEFAULT_MODEL_NAME).requests
        wait_until(lambda: queued.xlen(stream) == 1, timeout=10)  # admitted: in the queue
        queued.close()
        write_tenants(path, {"acme": {"tokens": [new]}})
        gateway.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: status(new) == grpc.StatusCode.OK, timeout=10)
        assert status(old) == grpc.StatusCode.UNAUTHENTICATED
        path.write_text("{broken")
        gateway.proc.send_signal(signal.SIGHUP)
        assert status(new) == grpc.StatusCode.OK and gateway.proc.poll() is None  # the old file stays
        reader.join(10)
        assert ended == [grpc.StatusCode.DEADLINE_EXCEEDED]  # not cancelled by the reloads
    finally:
        channel.close()
        gateway.kill()


def _code_of(call: Any) -> grpc.StatusCode:
    try:
        list(call)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK




# -- client certificates (the real mTLS calls are in tests/test_tls.py) -------------------------------------

def peer(cn: str = "", dns: tuple[str, ...] = (), uris: tuple[str, ...] = (),
         transport: bytes = b"ssl") -> dict[str, list[bytes]]:
    """An auth context as gRPC gives it for a verified client certificate."""
    context = {"transport_security_type": [transport], "peer_dns": [d.encode() for d in dns],
               "peer_uri": [u.encode() for u in uris]}
    return {**context, "x509_common_name": [cn.encode()]} if cn else context


@pytest.mark.parametrize(("tenants", "message"), [
    ({"a": {"client_identities": ["CN=x"]}, "b": {"client_identities": ["DNS:y", "CN=x"]}},
     "tenant 'b' client_identities[1] 'CN=x' is also bound to tenant 'a'"),
    ({"a": {"client_identities": ["spiffe://corp/s"]}, "b": {"client_identities": ["URI:spiffe://corp/s"]}},
     "'URI:spiffe://corp/s' is also bound to tenant 'a'"),
    ({"a": {"client_identities": ["DNS:Svc.Corp"]}, "b": {"client_identities": ["DNS:svc.corp"]}},
     "'DNS:svc.corp' is also bound to tenant 'a'"),
    ({"a": {"client_identities": []}}, 'or "client_identities" a non-empty list'),
    ({"a": {"tokens": [], "client_identities": []}}, '"tokens" must be a non-empty list'),
    ({"a": {"client_identities": "CN=x"}}, '"tokens" must be a non-empty list'),
    ({"a": {"client_identities": [3]}}, "client_identities must be a list of strings"),
    ({"a": {"client_identities": ["svc-a"]}}, "client_identities[0] 'svc-a' is not CN=<common name>, DNS:"),
    ({"a": {"client_identities": ["CN="]}}, "client_identities[0] 'CN=' is not"),
    ({"a": {"client_identities": ["CN= x"]}}, "client_identities[0] 'CN= x' is not"),
    ({"a": {"client_identities": ["cn=x"]}}, "client_identities[0] 'cn=x' is not"),
])
def test_bad_client_identities_are_refused_naming_the_problem(
        tmp_path: Path, tenants: dict[str, dict[str, Any]], message: str) -> None:
    with pytest.raises(ValueError) as e:
        load_tenants(write_tenants(tmp_path / "t.json", tenants), can_verify_client_certs=True)
    assert message in str(e.value)


def test_client_identities_need_a_gateway_that_verifies_client_certificates(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    write_tenants(path, {"acme": {"client_identities": ["CN=svc-a"]}})
    with pytest.raises(ValueError, match="has client_identities, but the gateway has no --tls-client-ca"):
        load_tenants(str(path))
    write_tenants(path, {"acme": {"tokens": [TOKEN]}})
    auth = Authenticator(str(path))
    write_tenants(path, {"acme": {"tokens": [TOKEN], "client_identities": ["CN=svc-a"]}})
    assert not auth.reload()  # on SIGHUP too: the old file stays
    assert auth.authenticate(bearer(TOKEN), peer("svc-a")).name == "acme"


def test_a_client_certificate_names_its_tenant(tmp_path: Path) -> None:
    token = new_token()
    path = write_tenants(tmp_path / "t.json", {
        "acme": {"client_identities": ["CN=svc-a", "DNS:Svc-A.corp"]},
        "mesh": {"client_identities": ["spiffe://corp/ns/a/sa/b"], "tokens": [token]},
        "tok": {"tokens": [TOKEN]}})
    auth = Authenticator(path, can_verify_client_certs=True)
    assert len(auth.tenants) == 3
    assert auth.authenticate([], peer("svc-a")).name == "acme"
    assert auth.authenticate([], peer("x", dns=("svc-a.CORP",))).name == "acme"
    assert auth.authenticate(None, peer(uris=("https://x", "spiffe://corp/ns/a/sa/b"))).name == "mesh"
    assert auth.authenticate(bearer(token), peer(uris=("spiffe://corp/ns/a/sa/b",))).name == "mesh"
    assert auth.authenticate(bearer(TOKEN), peer("stranger")).name == "tok"
    refused = [
        ([], peer("stranger"), "the client certificate (CN=stranger) is bound to no tenant"),
        ([], peer("svc-a", transport=b"insecure"), "no authorization metadata and no client certificate"),
        ([], None, "no authorization metadata and no client certificate"),
        (bearer(TOKEN), peer("svc-a"), "bound to tenant 'acme' but the bearer token names tenant 'tok'"),
        (bearer(new_token()), peer("svc-a"), "the bearer token is not valid"),
        ([], peer("svc-a", uris=("spiffe://corp/ns/a/sa/b",)), "bound to more than one tenant"),
    ]
    for metadata, context, message in refused:
        with pytest.raises(Unauthenticated, match=re.escape(message)):
            auth.authenticate(metadata, context)
    without_mtls = Authenticator(write_tenants(tmp_path / "t2.json", {"tok": {"tokens": [TOKEN]}}))
    with pytest.raises(Unauthenticated, match="send 'authorization: Bearer <token>'$"):
        without_mtls.authenticate([], peer("svc-a"))
