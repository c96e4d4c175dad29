"""The wire contract: generated stubs, request validation, conversions, key names."""

from __future__ import annotations

import math
import re
import tomllib

import pytest
import redis
import redis.asyncio as aioredis
import redis.asyncio.retry
import redis.retry

from protos import gen
from protos.convert import (
    build_request,
    check_request_id,
    chunk_to_pb,
    finish_reason_from_pb,
    finish_reason_to_pb,
    params_from_pb,
    usage_from_pb,
    usage_to_pb,
)
from protos.keys import Heartbeat, Keys, check_model_name, check_name, default_instance_id
from protos.params import FinishReason, Logprobs, SamplingParams, TokenLogprob, Usage
from protos.redis_conn import Backoff, check_redis_url, client_options
from protos.tokenrelay.v1 import generate_pb2


def test_generated_stubs_match_the_protos() -> None:
    assert gen.drift() == []


def test_the_runtime_lower_bounds_are_the_versions_the_committed_stubs_require() -> None:
    """Each stub refuses to import on an older protobuf or grpcio than it was generated for."""
    project = tomllib.loads((gen.ROOT / "pyproject.toml").read_text())["project"]
    bounds = dict(re.fullmatch(r"([\w-]+)>=([\d.]+)", d).groups()  # type: ignore[union-attr]
                  for d in project["dependencies"] if d.startswith(("protobuf>=", "grpcio>=")))
    for stub in sorted(gen.PROTO_DIR.glob("*_pb2.py")):
        assert f"# Protobuf Python Version: {bounds['protobuf']}\n" in stub.read_text(), stub.name
    for stub in sorted(gen.PROTO_DIR.glob("*_pb2_grpc.py")):
        assert f"GRPC_GENERATED_VERSION = '{bounds['grpcio']}'\n" in stub.read_text(), stub.name


def test_unset_fields_take_the_documented_defaults() -> None:
    prompt, params = params_from_pb(build_request("Hello"))
    assert prompt.prompt == "Hello"
    assert params == SamplingParams()


def test_set_fields_are_copied_including_zero_values() -> None:
    req = build_request(messages=[("system", "Be brief."), ("user", "Hi")], temperature=0.0, top_k=0,
                        max_tokens=5, seed=0, stop=["\n"], stop_token_ids=[7], ignore_eos=True,
                        logprobs=True, top_logprobs=2, truncate_prompt=True)
    prompt, params = params_from_pb(req)
    assert [(m.role, m.content) for m in prompt.messages or ()] == [("system", "Be brief."), ("user", "Hi")]
    assert params == SamplingParams(max_tokens=5, temperature=0.0, seed=0, stop=("\n",), stop_token_ids=(7,),
                                    ignore_eos=True, logprobs=True, top_logprobs=2, truncate_prompt=True)


@pytest.mark.parametrize(("request_kwargs", "field"), [
    ({"prompt": ""}, "prompt"),
    ({}, "input"),
    ({"messages": []}, "chat.messages"),
    ({"messages": [("robot", "hi")]}, "chat.messages[0].role"),
    ({"prompt": "x", "max_tokens": -1}, "stopping.max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "stopping.max_tokens"),
    ({"prompt": "x", "temperature": math.nan}, "sampling.temperature"),
    ({"prompt": "x", "temperature": -0.5}, "sampling.temperature"),
    ({"prompt": "x", "top_p": 0.0}, "sampling.top_p"),
    ({"prompt": "x", "top_p": 1.5}, "sampling.top_p"),
    ({"prompt": "x", "top_k": -3}, "sampling.top_k"),
    ({"prompt": "x", "repetition_penalty": 0.0}, "sampling.repetition_penalty"),
    ({"prompt": "x", "stop": [""]}, "stopping.stop"),
    ({"prompt": "x", "top_logprobs": 50}, "top_logprobs"),
])
def test_invalid_requests_name_the_field(request_kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError) as e:
        params_from_pb(build_request(**request_kwargs))
    assert str(e.value).startswith(field), str(e.value)


@pytest.mark.parametrize("seed", [0, 2**63 - 1, 2**63, 2**64 - 1])
def test_every_uint64_seed_is_accepted(seed: int) -> None:
    _, params = params_from_pb(build_request("hi", seed=seed))
    assert params.seed == seed


@pytest.mark.parametrize("request_id", ["", "a b", "x" * 129, "é", "a/b"])
def test_bad_request_ids_are_rejected(request_id: str) -> None:
    with pytest.raises(ValueError, match="request_id"):
        check_request_id(request_id)


def test_good_request_id() -> None:
    check_request_id("req-1.2:3_ABC")


def test_build_request_rejects_unknown_parameters() -> None:
    with pytest.raises(TypeError, match="max_token"):
        build_request("x", max_token=3)


def test_usage_and_finish_reason_round_trip() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=5, queue_time_s=0.5, time_to_first_token_s=0.75,
                  decode_time_s=1.25, seed=42, truncated_prompt_tokens=1)
    assert usage_from_pb(usage_to_pb(usage)) == usage
    for reason in FinishReason:
        assert finish_reason_from_pb(finish_reason_to_pb(reason)) is reason
    assert finish_reason_from_pb(generate_pb2.FINISH_REASON_UNSPECIFIED) is None


def test_chunk_carries_logprobs() -> None:
    lp = Logprobs(TokenLogprob(5, -0.25, "a"), [TokenLogprob(5, -0.25, "a"), TokenLogprob(6, -2.0, "b")])
    chunk = chunk_to_pb(3, [5], "a", [lp])
    assert (chunk.index, list(chunk.token_ids), chunk.text) == (3, [5], "a")
    assert chunk.logprobs[0].chosen.token_id == 5
    assert [t.token_id for t in chunk.logprobs[0].top] == [5, 6]


def test_keys_share_one_prefix() -> None:
    keys = Keys("p", "m")
    names = [keys.requests, keys.group, keys.aborts, keys.events("r"), keys.record("r"), keys.gateway("g"),
             keys.worker("w"), keys.consumer_models, keys.adapters("m"), keys.control("m")]
    assert all(n.startswith("p:") for n in names)
    assert len(set(names)) == len(names)
    with pytest.raises(ValueError):
        Keys("has space")


def test_each_model_has_its_own_request_streams() -> None:
    a, b = Keys("p", "org/model-a"), Keys("p").for_model("b")
    assert a.requests == "p:model:org/model-a:requests"
    assert not set(a.request_streams) & set(b.request_streams)
    assert all(s.startswith(a.model_mark) for s in a.request_streams + b.request_streams)
    assert len(set(a.request_streams)) == 3
    with pytest.raises(ValueError, match="use Keys.for_model"):
        _ = Keys("p").requests  # a gateway's base Keys names no stream: every request has a model


@pytest.mark.parametrize("name", ["", "has space", "a:b", "a*", "x" * 129])
def test_model_names_that_cannot_name_streams_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=r"model must be 1-128 characters of \[A-Za-z0-9._/-\]"):
        check_model_name("model", name)


def test_heartbeat_fields_are_the_worker_info_fields() -> None:
    """The worker writes and the gateway reads exactly the fields GetServerInfo documents."""
    fields = Heartbeat.TEXT + Heartbeat.LIST + Heartbeat.INT + Heartbeat.FLOAT
    assert len(set(fields)) == len(fields)
    derived = {"prefix_cache_hit_rate"}  # the gateway computes it from two of them
    assert set(fields) | derived == set(generate_pb2.WorkerInfo.DESCRIPTOR.fields_by_name)
    float_fields = {f.name for f in generate_pb2.WorkerInfo.DESCRIPTOR.fields if f.type == f.TYPE_DOUBLE}
    assert float_fields == set(Heartbeat.FLOAT) | derived


def test_instance_ids_are_unique_names() -> None:
    ids = {default_instance_id() for _ in range(50)}
    assert len(ids) == 50
    for name in ids:
        check_name("id", name)
    with pytest.raises(ValueError, match="id must be non-empty"):
        check_name("id", "")


@pytest.mark.parametrize("url", ["redis://h:1/0", "rediss://:pw@h:1/2", "unix:///tmp/r.sock"])
def test_redis_urls_redis_py_connects_with(url: str) -> None:
    check_redis_url(url)


@pytest.mark.parametrize("url", ["http://h:1", "h:6379", ""])
def test_other_redis_urls_are_rejected(url: str) -> None:
    with pytest.raises(ValueError, match="redis_url must start with"):
        check_redis_url(url)


def test_backoff_doubles_from_50ms_to_its_cap_and_resets() -> None:
    backoff = Backoff(max_s=0.3)
    assert [backoff.failed() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    backoff.reset()
    assert backoff.failed() == 0.05


@pytest.mark.parametrize("client_type", [redis.Redis, aioredis.Redis])
def test_clients_fail_fast_without_hidden_retries(client_type: type) -> None:
    retry_type = redis.retry.Retry if client_type is redis.Redis else redis.asyncio.retry.Retry
    client = client_type.from_url("redis://127.0.0.1:1/0", **client_options(retry_type, timeout_s=5.0))
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (5.0, 2.0)
    assert kwargs["retry"].get_retries() == 0 and kwargs["protocol"] == 2
