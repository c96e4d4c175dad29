"""GenerateRequest.response_format <-> `ResponseFormat`, and the checks that are cheap without a
grammar compiler (no torch, no xgrammar: the gateway runs them before enqueueing).

A JSON Schema must parse and be valid against its meta-schema (`jsonschema`); a regex must
compile with Python's `re`. What only the compiler can tell (a schema feature xgrammar does
not support, a grammar's syntax) the worker reports, as INVALID_ARGUMENT too.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from protos.params import MAX_SCHEMA_DEPTH, MAX_SCHEMA_PROPERTIES, ResponseFormat
from protos.tokenrelay.v1 import generate_pb2


def response_format_from_pb(req: generate_pb2.GenerateRequest) -> ResponseFormat | None:
    """None when the request has no response_format (free text). Raises ValueError naming the field."""
    if not req.HasField("response_format"):
        return None
    pb = req.response_format
    kind = pb.WhichOneof("format")
    if kind is None:
        raise ValueError("response_format: one of json_schema, json_object, regex, grammar or choice "
                         "must be set")
    if kind == "json_schema":
        fmt = ResponseFormat(kind, text=pb.json_schema.schema, is_strict=pb.json_schema.strict)
    elif kind == "choice":
        fmt = ResponseFormat(kind, choices=tuple(pb.choice.choices))
    elif kind == "json_object":
        fmt = ResponseFormat(kind)
    else:
        fmt = ResponseFormat(kind, text=getattr(pb, kind))
    check_response_format(fmt)
    return fmt


def response_format_to_pb(fmt: ResponseFormat) -> generate_pb2.ResponseFormat:
    pb = generate_pb2.ResponseFormat()
    if fmt.kind == "json_schema":
        pb.json_schema.schema = fmt.text
        if fmt.is_strict:
            pb.json_schema.strict = True
    elif fmt.kind == "json_object":
        pb.json_object.SetInParent()
    elif fmt.kind == "choice":
        pb.choice.choices.extend(fmt.choices)
    else:
        setattr(pb, fmt.kind, fmt.text)
    return pb


def check_response_format(fmt: ResponseFormat) -> None:
    """ValueError naming the field when the schema or regex is malformed (cached: the worker
    checks every claimed request again, and a service sends the same schema over and over)."""
    if fmt.kind == "json_schema":
        _check_json_schema(fmt.text)
    elif fmt.kind == "regex":
        _check_regex(fmt.text)


@lru_cache(maxsize=256)
def _check_json_schema(text: str) -> None:
    import jsonschema  # ~50 ms to import: only once a schema arrives

    path = "response_format.json_schema.schema"
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"{path} must be a JSON object (or true/false), got {type(schema).__name__}")
    depth, num_properties = _shape(schema)
    if depth > MAX_SCHEMA_DEPTH:  # the meta-schema check recurses ~8 frames a level
        raise ValueError(f"{path} nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
    if num_properties > MAX_SCHEMA_PROPERTIES:  # the worker's compile time grows with them
        raise ValueError(f"{path} has {num_properties} object properties; "
                         f"the limit is {MAX_SCHEMA_PROPERTIES}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the root"
        raise ValueError(f"{path} is not a valid JSON Schema at {where}: {e.message}") from None
    except RecursionError:
        raise ValueError(f"{path} is nested too deeply") from None


def _shape(value: object) -> tuple[int, int]:
    """(levels of JSON objects and arrays, entries of every `properties` object) of a schema;
    iterative: the value may be deeper than Python's stack."""
    depth, num_properties, stack = 0, 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict) and isinstance(item.get("properties"), dict):
            num_properties += len(item["properties"])
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in children)
    return depth, num_properties


@lru_cache(maxsize=256)
def _check_regex(text: str) -> None:
    try:
        re.compile(text)
    except (re.error, RecursionError, OverflowError) as e:
        raise ValueError(f"response_format.regex does not compile: {e}") from None
