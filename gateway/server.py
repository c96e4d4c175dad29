"""The gRPC gateway: validate -> shed load -> enqueue -> relay the worker's tokens.

Also serves `grpc.health.v1` (SERVING while the reply channel is subscribed,
NOT_SERVING otherwise and during shutdown) and server reflection.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.errors import (
    GatewayError,
    InvalidArgument,
    QueueFull,
    Unavailable,
    WorkerError,
    redis_unavailable,
)
from gateway.queue import RequestQueue, connect
from gateway.relay import relay
from gateway.replies import ReplyRouter
from protos.convert import check_request_id, params_from_pb
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc, queue_pb2

log = logging.getLogger(__name__)

WORKER_LIMITS_TTL_S = 1.0  # how long the largest sequence the live workers can hold is remembered

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["TokenRelay"].full_name


def _version() -> str:
    try:
        return importlib.metadata.version("tokenrelay")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


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


def add_servicer(servicer: TokenRelayServicer, server: grpc.aio.Server) -> None:
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


class TokenRelayServicer(generate_pb2_grpc.TokenRelayServicer):
    def __init__(self, config: GatewayConfig, queue: RequestQueue, router: ReplyRouter) -> None:
        self.config, self.queue, self.router = config, queue, router
        self._background: set[asyncio.Task[None]] = set()
        self._max_sequence_tokens: int | None = None  # None: no live worker known
        self._limits_read_at = float("-inf")

    async def Generate(self, request: generate_pb2.GenerateRequest | MalformedRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            if isinstance(request, MalformedRequest):
                raise InvalidArgument(request.error)
            async for response in self._generate(request, context):
                yield response
        except GatewayError as e:
            await context.abort(e.code, str(e), trailing_metadata=e.trailers)

    async def _generate(self, request: generate_pb2.GenerateRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        try:
            check_request_id(request_id)
            _, params = params_from_pb(request)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        await self._admit()
        await self._check_fits(params.max_tokens)
        calls = self.router.open(request_id)  # before XADD: no event can come before we listen
        entry_id: bytes | None = None
        is_done = False
        try:
            entry_id = await self._enqueue(request_id, request, context)
            self.router.attach(request_id, entry_id)
            liveness_s = self.config.liveness_check_s
            async for response in relay(request_id, entry_id, calls, self.queue, liveness_s):
                is_done = response.HasField("final")
                yield response
        except WorkerError:
            is_done = True  # the worker reported and dropped the request itself
            raise
        finally:
            is_aborted = entry_id is not None and not is_done
            self.router.close_call(request_id, is_aborted=is_aborted)
            if is_aborted:
                # Cancelled by the client, deadline passed, or failed here: free the worker's KV blocks.
                self.abort_later(request_id, "cancelled", entry_id)

    async def _admit(self) -> None:
        """Refuse work that cannot be answered or served in time."""
        if not self.router.is_ready:
            raise Unavailable("the gateway is not connected to the queue (Redis); retry later")
        try:
            depth = await self.queue.queue_depth()
        except RedisError as e:
            raise redis_unavailable(e) from e
        if depth >= self.config.max_queue_depth:
            raise QueueFull(depth, self.config.max_queue_depth, self.config.retry_pushback_ms)

    async def _check_fits(self, max_tokens: int) -> None:
        """Refuse what no live worker could ever hold: max_tokens plus a one-token prompt beyond
        every worker's largest sequence (max_model_len, or its whole KV cache). Prompt lengths
        are only known once tokenized, so the worker checks prompt + max_tokens itself."""
        now = time.monotonic()
        if now - self._limits_read_at > WORKER_LIMITS_TTL_S:
            self._limits_read_at = now
            try:
                workers = await self.queue.workers()
            except RedisError:
                return  # _admit has just reached Redis; a blip here only skips the check
            limits = [min(w.max_model_len, w.num_blocks * w.block_size) for w in workers
                      if w.max_model_len and w.num_blocks and w.block_size]
            self._max_sequence_tokens = max(limits) if limits else None
        limit = self._max_sequence_tokens
        if limit is not None and max_tokens + 1 > limit:
            raise InvalidArgument(f"stopping.max_tokens ({max_tokens}) leaves no room for a prompt in the "
                                  f"context of any live worker: the largest holds {limit} tokens "
                                  "(its max_model_len or its whole KV cache)")

    async def _enqueue(self, request_id: str, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> bytes:
        now = time.time()
        remaining = context.time_remaining()
        queued = queue_pb2.QueuedRequest(
            request_id=request_id, reply_channel=self.router.channel, request=request,
            enqueued_unix=now, deadline_unix=now + remaining if remaining is not None else 0.0,
            gateway_id=self.config.gateway_id)
        try:
            return await self.queue.enqueue(queued)
        except RedisError as e:
            raise redis_unavailable(e) from e

    async def GetServerInfo(self, request: generate_pb2.GetServerInfoRequest | MalformedRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> generate_pb2.ServerInfo:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        try:
            queued, in_flight = await self.queue.read_depth()
            workers = await self.queue.workers()
        except RedisError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(redis_unavailable(e)))
        workers.sort(key=lambda w: w.worker_id)
        return generate_pb2.ServerInfo(
            version=_version(), gateway_id=self.config.gateway_id, queue_depth=queued,
            max_queue_depth=self.config.max_queue_depth, num_in_flight=in_flight, workers=workers)

    def abort_later(self, request_id: str, reason: str, entry_id: bytes | None = None) -> None:
        """Publish an abort without blocking (the caller may be a cancelled task)."""
        task = asyncio.ensure_future(self._abort(request_id, reason, entry_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, request_id: str, reason: str, entry_id: bytes | None) -> None:
        try:
            await self.queue.abort(request_id, reason, entry_id)
        except RedisError as e:
            log.warning("abort of %s not delivered: %s", request_id, e)
            if entry_id is not None:
                self.router.forget_orphan(request_id, entry_id)  # retried if its events show up later


class Gateway:
    """The gRPC server plus its Redis side, started and stopped together."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client = connect(config)
        self.queue = RequestQueue(self.client, config)
        self.router = ReplyRouter(self.client, config.keys.replies(config.gateway_id),
                                  max_backoff_s=config.max_backoff_s, on_ready_change=self._on_ready_change,
                                  on_orphan=self._on_orphan)
        self.health = health_aio.HealthServicer()
        self.server = grpc.aio.server()
        self.servicer = TokenRelayServicer(config, self.queue, self.router)
        add_servicer(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        self.port = 0
        self._health_tasks: set[asyncio.Task[None]] = set()

    async def start(self, subscribe_timeout_s: float = 5.0) -> int:
        """Subscribe to the reply channel, then serve; returns the bound port.

        If Redis is down the server still starts (health NOT_SERVING, calls
        UNAVAILABLE) and keeps reconnecting.
        """
        await self._set_health(False)
        self.port = self.server.add_insecure_port(self.config.listen)
        if not self.port:
            raise OSError(f"cannot listen on {self.config.listen}")
        if not await self.router.start(timeout_s=subscribe_timeout_s):
            log.warning("Redis at %s is not reachable yet; serving UNAVAILABLE until it is",
                        self.config.redis_url)
        await self.server.start()
        log.info("gateway %s listening on port %d", self.config.gateway_id, self.port)
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop admitting (health NOT_SERVING), let calls finish for grace_s, close Redis."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.shutdown_grace_s if grace_s is None else grace_s)
        await self.router.close()
        await self.client.aclose()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    def _on_orphan(self, request_id: str, entry_id: bytes) -> None:
        self.servicer.abort_later(request_id, "nobody is waiting for this attempt any more", entry_id or None)

    def _on_ready_change(self, is_ready: bool) -> None:
        task = asyncio.ensure_future(self._set_health(is_ready))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _set_health(self, is_serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if is_serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)
