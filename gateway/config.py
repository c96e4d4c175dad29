"""Gateway process configuration: one frozen object built once in `gateway.__main__`."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from protos.keys import DEFAULT_PREFIX, Keys

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")


def default_gateway_id() -> str:
    """Unique per process (it names the reply channel): host-pid-random."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class GatewayConfig:
    # host:port the gRPC server binds; port 0 = any free port.
    listen: str = DEFAULT_LISTEN
    redis_url: str = DEFAULT_REDIS_URL
    key_prefix: str = DEFAULT_PREFIX
    gateway_id: str = field(default_factory=default_gateway_id)
    # Requests waiting in the queue (not yet claimed by a worker) beyond which
    # new calls get RESOURCE_EXHAUSTED instead of joining the queue.
    max_queue_depth: int = 256
    # Sent as the `grpc-retry-pushback-ms` trailer with RESOURCE_EXHAUSTED.
    retry_pushback_ms: int = 1000
    # The queue depth is re-read from Redis at most this often; in between the
    # gateway adds what it enqueued itself.
    depth_cache_ms: float = 5.0
    # Socket timeout of every Redis command: Redis unreachable -> UNAVAILABLE
    # after at most this long.
    redis_timeout_s: float = 2.0
    # A call that got no event for this long checks its request is still queued
    # or held by a live worker; a dead worker or a lost entry ends the call
    # with UNAVAILABLE. Healthy long generations stream events and never wait.
    liveness_check_s: float = 5.0
    # On SIGTERM, in-flight calls get this long to finish.
    shutdown_grace_s: float = 10.0
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        Keys(self.key_prefix)  # validates the prefix
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        if not self.redis_url.startswith(REDIS_URL_SCHEMES):
            raise ValueError(f"redis_url must start with one of {', '.join(REDIS_URL_SCHEMES)}, "
                             f"got {self.redis_url!r}")
        if not self.gateway_id or any(c.isspace() for c in self.gateway_id):
            raise ValueError(f"gateway_id must be non-empty without spaces, got {self.gateway_id!r}")
        for name in ("max_queue_depth", "retry_pushback_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.depth_cache_ms < 0:
            raise ValueError(f"depth_cache_ms must be >= 0, got {self.depth_cache_ms}")
        for name in ("redis_timeout_s", "liveness_check_s", "max_backoff_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")

    @property
    def keys(self) -> Keys:
        return Keys(self.key_prefix)
