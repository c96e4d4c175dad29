"""Tenants cannot see or squat on each other: request ids per tenant, roles in GetServerInfo,
priority closed by default, cache scopes from the tenants file (real gateway, real Redis)."""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from gateway.auth import load_tenants
from protos.convert import build_request
from protos.keys import STREAM_DATA_FIELD, Keys, tenant_request_key
from protos.tokenrelay.v1 import generate_pb2, queue_pb2
from tests.factories import CountingEngine
from tests.service import GatewayThread, WorkerThread, stub_for, wait_until, workers_ready
from worker.config import DEFAULT_MODEL_NAME, WorkerConfig

ACME, OTHER, OPS = (secrets.token_urlsafe(24) for _ in range(3))


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


def write_tenants(path: Path, tenants: dict[str, dict[str, Any]]) -> str:
    path.write_text(json.dumps({"tenants": tenants}))
    return str(path)


@pytest.fixture
def tenants_file(tmp_path: Path) -> str:
    return write_tenants(tmp_path / "t.json", {
        "acme": {"tokens": [ACME], "max_concurrent": 4, "tokens_per_minute": 10_000},
        "other": {"tokens": [OTHER], "max_priority": None},
        "ops": {"tokens": [OPS], "admin": True}})


@pytest.fixture
def worker(redis_url: str, prefix: str) -> Iterator[WorkerThread]:
    config = WorkerConfig(redis_url=redis_url, key_prefix=prefix, worker_id=f"w-{uuid.uuid4().hex[:6]}",
                          drain_timeout_s=5.0, claim_block_ms=50)
    started = WorkerThread(CountingEngine(), config).start()
    yield started
    started.stop()


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


# -- request ids --------------------------------------------------------------------------------------

def test_another_tenants_request_id_reads_like_a_never_used_one(
        tenants_file: str, make_gateway: Callable[..., GatewayThread], worker: WorkerThread,
        redis_url: str, prefix: str) -> None:
    channel, stub = stub_for(make_gateway(auth_tokens_file=tenants_file).target)
    with channel:
        first = list(stub.Generate(build_request("hi", max_tokens=3, request_id="order-123"), timeout=10,
                                   metadata=bearer(ACME)))
        assert first[-1].final.text == "xxx" and {r.request_id for r in first} == {"order-123"}

        def resume(request_id: str) -> None:
            request = build_request("hi", max_tokens=3, request_id=request_id)
            request.resume_from_index = 1
            list(stub.Generate(request, timeout=10, metadata=bearer(OTHER)))

        taken, unused = rpc_error(lambda: resume("order-123")), rpc_error(lambda: resume("order-999"))
        assert taken.code() == unused.code() == grpc.StatusCode.NOT_FOUND
        assert taken.details() == (unused.details() or "").replace("order-999", "order-123")
        # The same id with another body is the other tenant's own request, not FAILED_PRECONDITION.
        mine = list(stub.Generate(build_request("other body", max_tokens=2, request_id="order-123"),
                                  timeout=10, metadata=bearer(OTHER)))
        assert mine[-1].final.text == "xx" and mine[-1].final.tenant == "other"
        # acme's own resend still replays its own generation.
        again = list(stub.Generate(build_request("hi", max_tokens=3, request_id="order-123"), timeout=10,
                                   metadata=bearer(ACME)))
        assert [r.SerializeToString() for r in again[:-1]] == [r.SerializeToString() for r in first[:-1]]
    keys, client = Keys(prefix), redis.Redis.from_url(redis_url)
    assert client.exists(keys.record(tenant_request_key("acme", "order-123")))
    assert client.exists(keys.record(tenant_request_key("other", "order-123")))
    assert not client.exists(keys.record("order-123"))
    client.close()


# -- roles ----------------------------------------------------------------------------------------------

def test_only_an_admin_sees_the_workers_a_tenant_sees_its_own_limits(
        tenants_file: str, make_gateway: Callable[..., GatewayThread], worker: WorkerThread) -> None:
    gateway = make_gateway(auth_tokens_file=tenants_file)
    channel, stub = stub_for(gateway.target)
    with channel:
        def info(token: str) -> generate_pb2.ServerInfo:
            return stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5, metadata=bearer(token))

        wait_until(lambda: len(info(OPS).workers) == 1, timeout=10)
        admin, tenant = info(OPS), info(ACME)
        assert admin.gateway_id == gateway.config.gateway_id and admin.tenant.is_admin
        assert admin.workers[0].worker_id.startswith(worker.config.worker_id)
        assert not tenant.workers and not tenant.gateway_id and tenant.models == admin.models != []
        assert (tenant.tenant.name, tenant.tenant.max_concurrent, tenant.tenant.tokens_per_minute,
                tenant.tenant.max_priority, tenant.tenant.is_admin) == ("acme", 4, 10_000, 0, False)
        assert not info(OTHER).tenant.HasField("max_priority")  # null in the file: no cap


def test_without_authentication_everyone_sees_everything(
        make_gateway: Callable[..., GatewayThread], worker: WorkerThread) -> None:
    channel, stub = stub_for(make_gateway().target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        info = stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)
        assert info.gateway_id and info.workers and not info.HasField("tenant")


def test_priority_is_closed_unless_the_tenants_file_opens_it(
        tenants_file: str, make_gateway: Callable[..., GatewayThread], worker: WorkerThread) -> None:
    channel, stub = stub_for(make_gateway(auth_tokens_file=tenants_file).target)
    request = build_request("hi", max_tokens=1)
    request.priority = 1
    with channel:
        error = rpc_error(lambda: list(stub.Generate(request, timeout=10, metadata=bearer(ACME))))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "max_priority of tenant 'acme' (0)" in (error.details() or "")
        assert list(stub.Generate(request, timeout=10, metadata=bearer(OTHER)))[-1].HasField("final")


# -- prefix-cache scopes ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("shares", "message"), [
    ({"a": ["b"], "b": []}, "sharing must be mutual"),
    ({"a": ["b", "c"], "b": ["a", "c"], "c": ["a"]}, "sharing must be mutual"),
    ({"a": ["zz"], "b": []}, "unknown tenant(s) 'zz'"),
    ({"a": "b", "b": []}, "share_prefix_cache must be a list"),
])
def test_one_sided_or_unknown_sharing_is_refused_at_load(tmp_path: Path, shares: dict[str, Any],
                                                         message: str) -> None:
    tenants = {name: {"tokens": [secrets.token_urlsafe(24)], "share_prefix_cache": listed}
               for name, listed in shares.items()}
    with pytest.raises(ValueError, match="share_prefix_cache|sharing|unknown") as e:
        load_tenants(write_tenants(tmp_path / "t.json", tenants))
    assert message in str(e.value)


def test_cache_scopes_follow_the_sharing_groups_and_the_salt(tmp_path: Path) -> None:
    tokens = {name: secrets.token_urlsafe(24) for name in "abcd"}
    tenants = load_tenants(write_tenants(tmp_path / "t.json", {
        "a": {"tokens": [tokens["a"]], "share_prefix_cache": ["b", "c"]},
        "b": {"tokens": [tokens["b"]], "share_prefix_cache": ["a", "c"]},
        "c": {"tokens": [tokens["c"]], "share_prefix_cache": ["a", "b"]},
        "d": {"tokens": [tokens["d"]]}}))
    scope = {name: tenants.find(token).cache_scope() for name, token in tokens.items()}  # type: ignore[union-attr]
    assert scope["a"] == scope["b"] == scope["c"] != scope["d"] != b""
    a = tenants.find(tokens["a"])
    assert a is not None and a.cache_scope("user-1") not in (a.cache_scope(), a.cache_scope("user-2"))


def test_the_queued_request_carries_the_tenant_and_its_cache_scope(
        tmp_path: Path, make_gateway: Callable[..., GatewayThread], redis_url: str, prefix: str) -> None:
    """No worker: each call waits in the stream until its deadline; what the gateway enqueued is read back."""
    path = write_tenants(tmp_path / "t.json", {"acme": {"tokens": [ACME]}, "other": {"tokens": [OTHER]}})
    channel, stub = stub_for(make_gateway(auth_tokens_file=path).target)
    calls = [(ACME, ""), (OTHER, ""), (ACME, "end-user-7")]
    with channel:
        for token, salt in calls:
            request = build_request("the same prompt", max_tokens=2)
            if salt:
                request.cache_salt = salt
            error = rpc_error(lambda r=request, t=token: list(
                stub.Generate(r, timeout=0.5, metadata=bearer(t))))
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        too_long = build_request("x")
        too_long.cache_salt = "s" * 257
        error = rpc_error(lambda: list(stub.Generate(too_long, timeout=5, metadata=bearer(ACME))))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in (error.details() or "")
    client = redis.Redis.from_url(redis_url)
    entries = client.xrange(Keys(prefix, DEFAULT_MODEL_NAME).requests)
    client.close()
    queued = [queue_pb2.QueuedRequest.FromString(fields[STREAM_DATA_FIELD]) for _, fields in entries]
    assert [q.tenant for q in queued] == ["acme", "other", "acme"]
    assert all(q.request_id.startswith(q.tenant + "/") for q in queued)
    scopes = [q.cache_scope for q in queued]
    assert len(set(scopes)) == 3 and b"" not in scopes


def test_a_tenant_gets_no_cached_tokens_for_another_tenants_prompt_unless_they_share(
        tmp_path: Path, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    """Through the API, on the real SmolLM2 worker: Usage.cached_prompt_tokens is the oracle."""
    a, b, c = (secrets.token_urlsafe(24) for _ in range(3))
    path = write_tenants(tmp_path / "t.json", {
        "a": {"tokens": [a], "share_prefix_cache": ["c"]}, "b": {"tokens": [b]},
        "c": {"tokens": [c], "share_prefix_cache": ["a"]}})
    channel, stub = stub_for(make_gateway(auth_tokens_file=path).target)
    make_worker()
    secret = f"Customer {uuid.uuid4().hex} contract: " + "the terms are confidential and binding. " * 6

    def cached(token: str, salt: str = "") -> int:
        request = build_request(secret + "Summarize.", max_tokens=1)
        if salt:
            request.cache_salt = salt
        final = list(stub.Generate(request, timeout=60, metadata=bearer(token)))[-1].final
        return final.usage.cached_prompt_tokens

    with channel:
        assert cached(a) == 0  # first sight of the prompt
        assert cached(b) == 0  # another tenant: nothing cached for it
        assert cached(a) > 16 and cached(c) > 16  # a's own, and its sharing group's
        assert cached(a, salt="end-user-2") == 0  # a salt narrows the scope within the tenant
