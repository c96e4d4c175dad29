"""The wire contract: generated stubs, request validation, conversions, key names."""

from __future__ import annotations

import math

import pytest

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
from protos.keys import Keys
from protos.params import FinishReason, Logprobs, SamplingParams, TokenLogprob, Usage
from protos.tokenrelay.v1 import generate_pb2


def test_generated_stubs_match_the_protos() -> None:
    assert gen.drift() == []


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
    keys = Keys("p")
    names = [keys.requests, keys.group, keys.aborts, keys.replies("g"), keys.aborted("r"), keys.worker("w")]
    assert all(n.startswith("p:") for n in names)
    assert len(set(names)) == len(names)
    with pytest.raises(ValueError):
        Keys("has space")
