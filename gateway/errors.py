"""Gateway failures and the gRPC status each one becomes."""

from __future__ import annotations

import grpc
from redis.exceptions import OutOfMemoryError

from protos.tokenrelay.v1 import queue_pb2

PUSHBACK_TRAILER = "grpc-retry-pushback-ms"

_ErrorCode = queue_pb2.ErrorCode
# Worker-reported error codes (queue.proto) -> gRPC status codes.
WORKER_ERROR_STATUS = {
    _ErrorCode.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    _ErrorCode.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    _ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    _ErrorCode.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
    _ErrorCode.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    _ErrorCode.ERROR_CODE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
}


class GatewayError(Exception):
    """Ends a call with `code` and this message (plus optional trailers)."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.trailers = trailers


class InvalidArgument(GatewayError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(GatewayError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(GatewayError):
    code = grpc.StatusCode.NOT_FOUND


class OutOfRange(GatewayError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unavailable(GatewayError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(GatewayError):
    """Redis lost acknowledged events: the stream cannot continue, and a retry cannot help."""

    code = grpc.StatusCode.DATA_LOSS


class RedisOutOfMemory(GatewayError):
    """Redis is at its maxmemory and, with noeviction, refuses writes. Nothing was written (Redis
    refuses a script at its first write), so the same call later is safe; until memory is freed
    (results expire, or an operator raises maxmemory) every new call gets this."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class QueueFull(GatewayError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, depth: int, limit: int, pushback_ms: int) -> None:
        super().__init__(f"the queue is full ({depth} requests waiting, limit {limit}); "
                         f"retry in {pushback_ms} ms", ((PUSHBACK_TRAILER, str(pushback_ms)),))


class WorkerError(GatewayError):
    """An error event from the worker, carrying the worker's status code."""

    def __init__(self, error: queue_pb2.RequestError) -> None:
        super().__init__(error.message or "the worker failed the request")
        self.code = WORKER_ERROR_STATUS.get(error.code, grpc.StatusCode.INTERNAL)


def redis_unavailable(e: BaseException) -> GatewayError:
    """The status of a failed Redis command: out of memory, or (anything else) unreachable."""
    if is_out_of_memory(e):
        return RedisOutOfMemory(f"the queue (Redis) is full: it is at its maxmemory and refuses writes "
                                f"({e}); retry later")
    return Unavailable(f"the queue (Redis) is unreachable: {e}")


def is_out_of_memory(e: BaseException) -> bool:
    """Redis's OOM reply; from inside a Lua script, Redis 6 wraps it in a script error."""
    return isinstance(e, OutOfMemoryError) or "OOM command not allowed" in str(e)
