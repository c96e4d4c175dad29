"""The gRPC edge of the gateway: how request bytes become messages (a malformed one reaches the
handler, which answers INVALID_ARGUMENT naming the message, instead of grpc's UNKNOWN), and what
names a request's body (its digest: a resend with the same body attaches to its generation)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message

from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["TokenRelay"].full_name


@dataclass(frozen=True)
class MalformedRequest:
    """Request bytes that do not parse as the method's message (grpc would answer UNKNOWN)."""

    error: str


def _parse_or_report(message: type[Message]) -> Callable[[bytes], Message | MalformedRequest]:
    def parse(data: bytes) -> Message | MalformedRequest:
        try:
            return message.FromString(data)
        except DecodeError as e:
            return MalformedRequest(f"the request is not a valid {message.DESCRIPTOR.full_name}: {e}")
    return parse


def add_servicer(servicer: generate_pb2_grpc.TokenRelayServicer, server: grpc.aio.Server) -> None:
    """generate_pb2_grpc's registration, but undecodable bytes reach the handler as a
    MalformedRequest, so the caller gets INVALID_ARGUMENT naming the message."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_parse_or_report(generate_pb2.GenerateRequest),
            response_serializer=generate_pb2.GenerateResponse.SerializeToString),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo, request_deserializer=_parse_or_report(generate_pb2.GetServerInfoRequest),
            response_serializer=generate_pb2.ServerInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def request_digest(request: generate_pb2.GenerateRequest, tenant: str = "") -> str:
    """What names a request's body: the same digest = the same request (request_id and
    resume_from_index left out), so a resend attaches to its generation. Request keys are
    per tenant already (protos/keys.py); the tenant in the digest is a second wall."""
    body = generate_pb2.GenerateRequest()
    body.CopyFrom(request)
    body.ClearField("request_id")
    body.ClearField("resume_from_index")
    digest = hashlib.sha256(body.SerializeToString(deterministic=True))
    if tenant:
        digest.update(b"\0tenant:" + tenant.encode())
    return digest.hexdigest()
