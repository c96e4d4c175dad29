"""Protobuf <-> plain-Python conversions, used at the edges by gateway and worker.

`params_from_pb` is the single validation point for a `GenerateRequest`: the
gateway calls it to answer INVALID_ARGUMENT before enqueueing, the worker calls
it again on what it claims. Error messages name the proto field
(``stopping.max_tokens``, ``chat.messages[2].role``, ...).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any, cast

from protos.params import (
    ChatMessage,
    FinishReason,
    Logprobs,
    PromptInput,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from protos.response_format import response_format_from_pb, response_format_to_pb
from protos.tokenrelay.v1 import generate_pb2, queue_pb2

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")

# SamplingParams fields by the proto message that holds them.
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed")
_STOPPING_FIELDS = ("max_tokens", "ignore_eos")
_TOP_LEVEL_FIELDS = ("logprobs", "top_logprobs", "truncate_prompt", "priority", "stream_interval")
_ROUTING_FIELDS = ("model", "adapter")  # which weights run it: the gateway's and the worker's, not sampling
_FIELD_PATHS = {
    **{f: f"sampling.{f}" for f in _SAMPLING_FIELDS},
    **{f: f"stopping.{f}" for f in (*_STOPPING_FIELDS, "stop", "stop_token_ids")},
}


def check_request_id(request_id: str) -> None:
    """Raise ValueError unless request_id is 1..128 characters of [A-Za-z0-9._:-]."""
    if not REQUEST_ID_RE.fullmatch(request_id):
        raise ValueError(f"request_id must be 1..128 characters of [A-Za-z0-9._:-], got {request_id!r}")


def params_from_pb(req: generate_pb2.GenerateRequest) -> tuple[PromptInput, SamplingParams]:
    """Validate a request; unset optional fields take the dataclass defaults.

    Raises ValueError whose message starts with the offending field's path.
    """
    prompt = _prompt_from_pb(req)
    kwargs: dict[str, Any] = {}
    _copy_set_fields(req.sampling, _SAMPLING_FIELDS, kwargs)
    _copy_set_fields(req.stopping, _STOPPING_FIELDS, kwargs)
    _copy_set_fields(req, _TOP_LEVEL_FIELDS, kwargs)
    kwargs["stop"] = tuple(req.stopping.stop)
    kwargs["stop_token_ids"] = tuple(req.stopping.stop_token_ids)
    try:
        kwargs["response_format"] = response_format_from_pb(req)
        return prompt, SamplingParams(**kwargs)
    except ValueError as e:
        raise ValueError(_with_field_path(str(e))) from None


def _copy_set_fields(msg: Any, names: Iterable[str], out: dict[str, Any]) -> None:
    for name in names:
        if msg.HasField(name):
            out[name] = getattr(msg, name)


def _with_field_path(message: str) -> str:
    """'max_tokens must be ...' -> 'stopping.max_tokens must be ...'."""
    field = message.split(" ", 1)[0]
    path = _FIELD_PATHS.get(field)
    return path + message[len(field):] if path else message


def _prompt_from_pb(req: generate_pb2.GenerateRequest) -> PromptInput:
    kind = req.WhichOneof("input")
    if kind is None:
        raise ValueError("input: one of prompt or chat must be set")
    if kind == "prompt":
        if not req.prompt:
            raise ValueError("prompt must not be empty")
        return PromptInput(prompt=req.prompt)
    if not req.chat.messages:
        raise ValueError("chat.messages must not be empty")
    messages = []
    for i, m in enumerate(req.chat.messages):
        try:
            messages.append(ChatMessage(role=m.role, content=m.content))
        except ValueError as e:
            raise ValueError(f"chat.messages[{i}].role" + str(e).removeprefix("messages.role")) from None
    return PromptInput(messages=tuple(messages))


def usage_to_pb(usage: Usage) -> generate_pb2.Usage:
    return generate_pb2.Usage(**dataclasses.asdict(usage))  # field names are the same on both sides


def usage_from_pb(pb: generate_pb2.Usage) -> Usage:
    return Usage(**{f.name: getattr(pb, f.name) for f in dataclasses.fields(Usage)})


def finish_reason_to_pb(reason: FinishReason) -> generate_pb2.FinishReason:
    """The `generate_pb2.FinishReason` value (the enums share their numbers)."""
    return cast(generate_pb2.FinishReason, generate_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}"))


def finish_reason_from_pb(value: int) -> FinishReason | None:
    """None for FINISH_REASON_UNSPECIFIED."""
    return FinishReason(value) if value else None


def _token_logprob_to_pb(t: TokenLogprob) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob, text=t.text)


def logprobs_to_pb(logprobs: Iterable[Logprobs]) -> list[generate_pb2.Logprobs]:
    return [
        generate_pb2.Logprobs(chosen=_token_logprob_to_pb(lp.chosen),
                              top=[_token_logprob_to_pb(t) for t in lp.top])
        for lp in logprobs
    ]


def chunk_to_pb(index: int, token_ids: list[int], text: str,
                logprobs: list[Logprobs] | None = None) -> generate_pb2.Chunk:
    return generate_pb2.Chunk(index=index, token_ids=token_ids, text=text,
                              logprobs=logprobs_to_pb(logprobs or ()))


_EVENTS_TAG = b"\x12"  # TokenEventBatch.events: field 2, length-delimited
_ADMITTED_TAG = b"\x1a"  # TokenEventBatch.admitted: field 3, length-delimited


def _framed(tag: bytes, data: bytes) -> bytes:
    """A length-delimited field: tag, varint length, data."""
    size, prefix = len(data), bytearray(tag)
    while size >= 0x80:
        prefix.append(size & 0x7F | 0x80)
        size >>= 7
    prefix.append(size)
    return bytes(prefix) + data


def admitted_value(request_id: str) -> bytes:
    """TokenEventBatch.admitted = [request_id] as bytes: a worker's round appends it to the
    events it publishes (protos/keys.py), like a logged event."""
    return _framed(_ADMITTED_TAG, request_id.encode())


def room_value(room: int) -> bytes:
    """TokenEventBatch.room = room as bytes: appended to a round's published events (a later
    value in the concatenation wins, so a merged backlog says the latest room)."""
    return queue_pb2.TokenEventBatch(room=room).SerializeToString()


def log_value(event: queue_pb2.TokenEvent) -> bytes:
    """The event as a worker log stores it (protos/keys.py): framed as a one-event
    TokenEventBatch, so a round's published batch is the concatenation of its events' values."""
    return _framed(_EVENTS_TAG, event.SerializeToString())


def event_from_log(value: bytes) -> queue_pb2.TokenEvent:
    """The event of a worker log's value (`log_value`)."""
    return queue_pb2.TokenEventBatch.FromString(value).events[0]


def build_request(prompt: str | None = None, messages: Iterable[tuple[str, str]] | None = None,
                  *, request_id: str = "", **params: Any) -> generate_pb2.GenerateRequest:
    """A GenerateRequest from keyword parameters named like `SamplingParams` fields.

    Unknown names raise TypeError; None values are left unset (= server default).
    `response_format` takes a `protos.params.ResponseFormat`.
    """
    req = generate_pb2.GenerateRequest(request_id=request_id)
    if prompt is not None:
        req.prompt = prompt
    if messages is not None:
        req.chat.SetInParent()  # selects chat even for an empty list (which then fails validation)
        req.chat.messages.extend(generate_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    for name, value in params.items():
        if value is None:
            continue
        if name in _SAMPLING_FIELDS:
            setattr(req.sampling, name, value)
        elif name in _STOPPING_FIELDS:
            setattr(req.stopping, name, value)
        elif name in ("stop", "stop_token_ids"):
            getattr(req.stopping, name).extend(value)
        elif name in _TOP_LEVEL_FIELDS or name in _ROUTING_FIELDS:
            setattr(req, name, value)
        elif name == "response_format":
            req.response_format.CopyFrom(response_format_to_pb(value))
        else:
            raise TypeError(f"unknown generation parameter {name!r}")
    return req
