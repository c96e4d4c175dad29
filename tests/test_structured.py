"""Structured output on SmolLM2, through real gRPC and Redis where the service is involved: JSON
Schema, regex, choice and GBNF outputs follow their formats; a permissive grammar, speculation and
a worker kill change no token; bad formats are INVALID_ARGUMENT from the gateway or the worker."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from protos.convert import build_request  # noqa: E402
from protos.params import MAX_SCHEMA_PROPERTIES, ChatMessage, PromptInput, ResponseFormat, SamplingParams  # noqa: E402
from protos.response_format import MAX_SCHEMA_DEPTH, _shape, check_response_format  # noqa: E402
from protos.tokenrelay.v1 import generate_pb2  # noqa: E402
from tests.conftest import TEST_MAX_MODEL_LEN  # noqa: E402
from tests.service import GatewayThread, WorkerProcess, WorkerThread, stub_for, wait_until, workers_ready  # noqa: E402
from tests.test_e2e import check_stream, run_in_process  # noqa: E402
from tests.test_speculative_text import AlwaysK  # noqa: E402

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
CITIES = ("Paris", "London", "Berlin")
ASK = [("user", "Describe a person as a JSON object with a name, age, role and address.")]


def person_format() -> ResponseFormat:
    return ResponseFormat("json_schema", text=json.dumps(PERSON), is_strict=True)


def test_20_sampled_requests_over_grpc_all_validate_against_the_schema(
        make_gateway: Callable[..., GatewayThread], make_worker: Callable[..., WorkerThread]) -> None:
    gateway, _ = make_gateway(), make_worker()
    channel, stub = stub_for(gateway.target)

    def one(seed: int) -> list[generate_pb2.GenerateResponse]:
        request = build_request(messages=ASK, max_tokens=200, temperature=1.0, seed=seed,
                                response_format=person_format())
        return list(stub.Generate(request, timeout=300))

    with channel, ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    for responses in results:
        _, final = check_stream(responses)
        assert final.finish_reason == generate_pb2.FINISH_REASON_EOS, final.text
        jsonschema.validate(json.loads(final.text), PERSON)
        assert final.usage.is_constrained
    assert len({check_stream(r)[1].text for r in results}) > 10  # sampled: not one answer 20 times


def test_regex_choice_and_a_gbnf_grammar_over_grpc(
        make_gateway: Callable[..., GatewayThread], make_worker: Callable[..., WorkerThread]) -> None:
    gbnf = 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9] | [1-9] [0-9]'
    plate, numbers, sampled = r"[A-Z]{2}-[0-9]{4}", r"\[[0-9]{1,2}(,[0-9]{1,2})*\]", (1.0,) * 3
    question = "What is the capital of France?"
    as_json = 'Answer with a JSON object {"capital": ...}: what is the capital of France?'
    cases = [  # (format, the check of its text, temperatures, question)
        (ResponseFormat("regex", text=plate), re.compile(plate).fullmatch, sampled, question),
        (ResponseFormat("choice", choices=CITIES), set(CITIES).__contains__, sampled, question),
        (ResponseFormat("grammar", text=gbnf), re.compile(numbers).fullmatch, sampled, question),
        # greedy, and asked for JSON: a 135M model may otherwise spend 64 tokens on one object
        (ResponseFormat("json_object"), lambda t: json.loads(t) == {"capital": "Paris"}, (0.0,), as_json),
    ]
    gateway, _ = make_gateway(), make_worker()
    channel, stub = stub_for(gateway.target)
    with channel:
        for fmt, check, temperatures, text in cases:
            for seed, temperature in enumerate(temperatures):
                request = build_request(messages=[("user", text)], max_tokens=64,
                                        temperature=temperature, seed=seed, response_format=fmt)
                _, final = check_stream(list(stub.Generate(request, timeout=120)))
                assert final.finish_reason == generate_pb2.FINISH_REASON_EOS, (fmt, final)
                assert check(final.text), (fmt, final.text)


RF = generate_pb2.ResponseFormat
INVALID = [  # (format, words the status message must contain): the gateway's checks, then the worker's
    (RF(json_schema=RF.JsonSchema(schema='{"type": "objekt"}')), ["json_schema.schema", "objekt"]),
    (RF(json_schema=RF.JsonSchema(schema="{not json")), ["json_schema.schema", "not valid JSON"]),
    (RF(regex="([a-z]"), ["regex", "does not compile"]),
    (RF(choice=RF.Choice(choices=["yes", ""])), ["choice.choices", "empty"]),
    (RF(grammar="x" * 70_000), ["grammar", "65536"]),
    (RF(), ["response_format", "one of"]),
    (RF(grammar='root ::= "a" |'), ["grammar", "does not compile", "EBNF"]),
    (RF(grammar='start ::= "a"'), ["grammar", "does not compile", "root"]),
    (RF(regex="(?<=a)b"), ["regex", "does not compile", "Lookbehind"]),
    (RF(json_schema=RF.JsonSchema(schema='{"$ref": "#/$defs/missing"}')), ["json_schema.schema", "missing"]),
]


def test_bad_formats_are_invalid_argument_from_the_gateway_or_the_worker(
        make_gateway: Callable[..., GatewayThread], make_worker: Callable[..., WorkerThread]) -> None:
    gateway, _ = make_gateway(), make_worker()
    channel, stub = stub_for(gateway.target)
    with channel:
        for fmt, words in INVALID:
            request = build_request("Hi", max_tokens=4)
            request.response_format.CopyFrom(fmt)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            for word in words:
                assert word in (e.value.details() or ""), (word, e.value.details())
        _, final = check_stream(list(stub.Generate(build_request("The sky is", max_tokens=4), timeout=60)))
        assert not final.usage.is_constrained  # the worker keeps serving


def test_a_permissive_grammar_changes_no_greedy_token(smollm_engine: Any) -> None:
    prompt = PromptInput(prompt="The three primary colours are")
    plain = run_in_process(smollm_engine, prompt, SamplingParams(max_tokens=24, temperature=0.0))
    permissive = ResponseFormat("regex", text=r"[\s\S]*")
    constrained = run_in_process(smollm_engine, prompt, SamplingParams(max_tokens=24, temperature=0.0,
                                                                       response_format=permissive))
    assert [t for o in constrained for t in o.token_ids] == [t for o in plain for t in o.token_ids]


def test_constrained_speculation_gives_the_tokens_of_constrained_decoding(smollm_engine: Any) -> None:
    example = json.dumps({"name": "Ada", "age": 36, "role": "admin",
                          "address": {"city": "London", "zip": "12345"}})
    prompt = PromptInput(prompt=f"Copy this JSON exactly.\n{example}\n{example}\n")
    results = []
    for spec in (None, AlwaysK(4)):
        smollm_engine.engine.spec = spec
        try:
            for seed, temperature in ((0, 0.0), (1, 1.0)):
                params = SamplingParams(max_tokens=80, temperature=temperature, seed=seed,
                                        response_format=person_format())
                results.append(run_in_process(smollm_engine, prompt, params))
        finally:
            smollm_engine.engine.spec = None
    tokens = [[t for o in run for t in o.token_ids] for run in results]
    assert tokens[2:] == tokens[:2]
    usage = results[2][-1].usage
    assert usage is not None and 0 < usage.num_accepted_tokens <= usage.num_draft_tokens


def test_a_schema_of_1000_properties_is_refused_naming_the_limit_and_one_at_the_limit_compiles(
        smollm_engine: Any) -> None:
    """The documented bound (docs/api.md, MAX_SCHEMA_PROPERTIES): compile time grows with the
    properties (~8 ms each here), so a 1,000-property schema is refused before any compiler sees
    it, and one at the limit compiles (on the compiler's thread; no speed is asserted here)."""
    def wide(n: int) -> ResponseFormat:
        schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
                  "required": [f"p{i}" for i in range(n)]}
        return ResponseFormat("json_schema", text=json.dumps(schema))

    with pytest.raises(ValueError, match=f"has 1000 object properties; the limit is {MAX_SCHEMA_PROPERTIES}"):
        check_response_format(wide(1000))
    at_limit = wide(MAX_SCHEMA_PROPERTIES)
    check_response_format(at_limit)
    assert smollm_engine.engine.grammar.compile(at_limit).result(timeout=120) is not None


def test_a_schema_nested_past_the_limit_is_refused_naming_it_and_one_at_the_limit_compiles(
        smollm_engine: Any) -> None:
    """Deep nesting: refused before any compiler (or the meta-schema check, which recurses ~8
    frames a level) sees it; a schema nested exactly MAX_SCHEMA_DEPTH levels compiles."""
    def deep(levels: int) -> ResponseFormat:
        schema: dict[str, Any] = {"type": "integer"}
        for _ in range(levels - 1):  # each object adds a level of properties
            schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
        return ResponseFormat("json_schema", text=json.dumps(schema))

    def nesting(fmt: ResponseFormat) -> int:
        return _shape(json.loads(fmt.text))[0]

    levels = next(n for n in range(1, 4 * MAX_SCHEMA_DEPTH) if nesting(deep(n + 1)) > MAX_SCHEMA_DEPTH)
    at_limit = deep(levels)
    too_deep = deep(levels + 1)
    with pytest.raises(ValueError, match=f"levels deep; the limit is {MAX_SCHEMA_DEPTH}"):
        check_response_format(too_deep)
    check_response_format(at_limit)
    assert smollm_engine.engine.grammar.compile(at_limit).result(timeout=120) is not None


def test_a_constrained_request_resumes_exactly_after_its_worker_is_killed(
        redis_url: str, prefix: str, smollm_engine: Any, make_gateway: Callable[..., GatewayThread],
        make_worker: Callable[..., WorkerThread]) -> None:
    params: dict[str, Any] = {"max_tokens": 80, "temperature": 1.0, "seed": 7,
                              "response_format": person_format()}
    prompt = PromptInput(messages=tuple(ChatMessage(r, c) for r, c in ASK))
    reference = run_in_process(smollm_engine, prompt, SamplingParams(**params))
    gateway = make_gateway()
    doomed = WorkerProcess(redis_url, prefix, "doomed", "--max-num-seqs", "2", "--max-model-len",
                           str(TEST_MAX_MODEL_LEN), "--num-threads", "1", "--heartbeat-ttl", "1")
    try:
        channel, stub = stub_for(gateway.target)
        with channel:
            wait_until(workers_ready(stub, 1), timeout=180, interval=0.2)
            stream = stub.Generate(build_request(messages=ASK, **params), timeout=180)
            responses = [next(stream) for _ in range(6)]
            doomed.proc.kill()  # SIGKILL mid-stream: the rescuer rebuilds the matcher from the chunks
            doomed.proc.wait()
            rescuer = make_worker(heartbeat_ttl_s=1.0, heartbeat_interval_s=0.2)
            responses += list(stream)
    finally:
        doomed.stop()
    token_ids, final = check_stream(responses)
    assert token_ids == [t for o in reference for t in o.token_ids]
    assert final.worker_id == rescuer.config.worker_id
    jsonschema.validate(json.loads(final.text), PERSON)

