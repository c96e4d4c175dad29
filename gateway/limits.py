"""What one gateway accepts, so its memory stays bounded whatever callers send.

Two layers, both from GatewayConfig:
- `server_options`: the grpc.aio server's own limits (message size, keepalive enforcement,
  connection age). grpc enforces them in C before a handler runs: an oversized message is
  RESOURCE_EXHAUSTED, a client that pings too often is sent GOAWAY (too_many_pings).
- `RequestLimits.check`: caps on a parsed GenerateRequest, checked before anything reaches
  Redis, so one call cannot put megabytes into the queue, the request record and every
  worker's tokenizer. A refusal is INVALID_ARGUMENT naming the field, the limit and its flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.errors import InvalidArgument
from protos.params import MAX_STOP_STRINGS
from protos.tokenrelay.v1 import generate_pb2

MIB = 1024 * 1024
MAX_CACHE_SALT_CHARS = 256  # GenerateRequest.cache_salt (generate.proto)
# The server drops a connection whose keepalive ping it sent is not acknowledged this long.
KEEPALIVE_TIMEOUT_MS = 20_000
# Pings closer together than --min-client-ping-interval-s tolerated before GOAWAY (grpc's default).
MAX_PING_STRIKES = 2


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one GenerateRequest; each field is the gateway flag of the same name."""

    # UTF-8 bytes of the prompt: the text prompt, or the sum of the chat messages' contents.
    max_prompt_bytes: int = 256 * 1024
    max_messages: int = 256
    # Never above the contract's MAX_STOP_STRINGS: the worker refuses more whatever this says.
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_token_ids: int = 64

    def __post_init__(self) -> None:
        for name in ("max_prompt_bytes", "max_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_stop_strings <= MAX_STOP_STRINGS:
            raise ValueError(f"max_stop_strings must be in [0, {MAX_STOP_STRINGS}] (the workers accept "
                             f"at most {MAX_STOP_STRINGS}), got {self.max_stop_strings}")
        if self.max_stop_token_ids < 0:
            raise ValueError(f"max_stop_token_ids must be >= 0, got {self.max_stop_token_ids}")

    def check(self, request: generate_pb2.GenerateRequest) -> None:
        """InvalidArgument naming the field, the limit and its flag, for the first cap exceeded.
        A chat's message count comes before its byte size, which walks every message."""
        if request.WhichOneof("input") == "chat":
            messages = request.chat.messages
            _check("chat.messages", len(messages), "has {} messages", self.max_messages, "--max-messages")
            field, unit = "chat.messages", "is {} bytes of content"
            num_bytes = sum(len(m.content.encode()) for m in messages)
        else:
            field, unit, num_bytes = "prompt", "is {} bytes", len(request.prompt.encode())
        _check(field, num_bytes, unit, self.max_prompt_bytes, "--max-prompt-bytes")
        stopping = request.stopping
        _check("stopping.stop", len(stopping.stop), "has {} strings", self.max_stop_strings,
               "--max-stop-strings")
        _check("stopping.stop_token_ids", len(stopping.stop_token_ids), "has {} ids", self.max_stop_token_ids,
               "--max-stop-token-ids")
        if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:  # it travels in every attempt's entry
            raise InvalidArgument(f"cache_salt is {len(request.cache_salt)} characters; the limit is "
                                  f"{MAX_CACHE_SALT_CHARS}")


def _check(field: str, value: int, size: str, limit: int, flag: str) -> None:
    """size: how value reads after the field, e.g. "is {} bytes"."""
    if value > limit:
        raise InvalidArgument(f"{field} {size.format(value)}; the limit is {limit} ({flag})")


class TransportLimits(Protocol):
    """What server_options reads of a GatewayConfig (named here: config.py imports this module)."""

    @property
    def max_receive_message_bytes(self) -> int: ...
    @property
    def min_client_ping_interval_s(self) -> float: ...
    @property
    def keepalive_time_s(self) -> float: ...
    @property
    def max_connection_age_s(self) -> float: ...
    @property
    def max_connection_age_grace_s(self) -> float: ...


def server_options(config: TransportLimits) -> list[tuple[str, int]]:
    """The grpc.aio server options of these limits (grpc's defaults are 4 MiB messages and a
    5-minute minimum between client pings, stricter than the clients others run)."""
    options = [
        ("grpc.max_receive_message_length", config.max_receive_message_bytes),
        # Clients may keep idle connections alive with pings, at most one per interval;
        # a client pinging faster gets MAX_PING_STRIKES warnings, then GOAWAY.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(config.min_client_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        # The server pings idle connections itself, so a vanished client (a NAT or load
        # balancer that dropped the flow) frees its calls within keepalive time + timeout.
        ("grpc.keepalive_time_ms", _ms(config.keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ]
    if config.max_connection_age_s > 0:
        # GOAWAY after the age (grpc adds +-10% jitter): clients reconnect, so an L4 load
        # balancer spreads them over new gateways. Calls open then get the grace to finish.
        options += [("grpc.max_connection_age_ms", _ms(config.max_connection_age_s)),
                    ("grpc.max_connection_age_grace_ms", _ms(config.max_connection_age_grace_s))]
    return options


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
