"""The TokenRelay service: validate -> admit (gateway/admission.py) -> enqueue -> relay the
worker's tokens. With --auth-tokens-file every call is authenticated (gateway/auth.py) and
admitted against its tenant's quotas (gateway/quotas.py). The process around it (the gRPC
server, health, reflection, TLS, the sweeper and the metrics) is gateway/process.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass

import grpc
from redis.exceptions import RedisError

from gateway.admission import Admission
from gateway.auth import ANONYMOUS, Authenticator, Tenant
from gateway.config import GatewayConfig
from gateway.errors import (
    FailedPrecondition,
    GatewayError,
    InvalidArgument,
    NotFound,
    QueueFull,
    Unavailable,
    WorkerError,
    redis_unavailable,
)
from gateway.metrics import CallModel, GatewayMetrics
from gateway.models import Models
from gateway.queue import Attached, RequestQueue
from gateway.quotas import Quotas
from gateway.relay import Follow, relay
from gateway.replies import ReplyRouter
from gateway.routing import SHARED, PrefixRouter, Route, move_unclaimed
from gateway.server_info import ServerInfoView
from gateway.tracing import CallTrace
from gateway.wire import SERVICE_NAME, MalformedRequest, request_digest
from protos.convert import check_request_id, params_from_pb
from protos.keys import PriorityClass, tenant_request_key
from protos.logs import bind_request
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc, queue_pb2
from protos.tracing import Tracing

log = logging.getLogger(__name__)

MAX_ATTACH_RACES = 3  # new attempts started by other gateways in a row before giving up


@dataclass
class UsedTokens:
    """What a call is charged against its tenant's tokens_per_minute when it ends: the tokens
    it was sent, and the prompt of the request it attached to unless paid (gateway/quotas.py)."""

    num_tokens: int = 0
    request_key: str = ""  # set once the call attached to the request


class TokenRelayServicer(generate_pb2_grpc.TokenRelayServicer):
    """Authentication happens here, not in a server interceptor: the rest of the call needs
    the tenant (priority cap, quotas, Final.tenant, log lines, metric labels), which an
    interceptor could only pass on through a contextvar or rewritten metadata; health and
    reflection are other servicers, so they stay open without a list of exempt methods."""

    def __init__(self, config: GatewayConfig, queue: RequestQueue, router: ReplyRouter,
                 metrics: GatewayMetrics | None = None, tracing: Tracing | None = None,
                 auth: Authenticator | None = None, quotas: Quotas | None = None) -> None:
        self.config, self.queue, self.router, self.metrics = config, queue, router, metrics
        self.tracing = tracing or Tracing()
        self.auth, self.quotas = auth, quotas
        self.limits = config.request_limits
        self.models = Models(queue, config)
        self.admission = Admission(queue, router, self.models, metrics, quotas)
        self._background: set[asyncio.Task[None]] = set()
        self.server_info = ServerInfoView(config, queue, self.models)
        self.prefix_router = PrefixRouter(queue, self.models) if config.routing == "prefix" else None
        if self.prefix_router is not None:
            router.on_room = self.prefix_router.on_room

    async def Generate(self, request: generate_pb2.GenerateRequest | MalformedRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        call = CallTrace(self.tracing, context.invocation_metadata(), SERVICE_NAME)
        try:
            tenant = self._authenticate(context)
        except GatewayError as e:
            if self.metrics is not None:
                self.metrics.count_rejected("", e)
            await context.abort(e.code, str(e), trailing_metadata=e.trailers)
        model = CallModel()
        responses = self._generate(request, context, call, tenant, model)
        if self.metrics is not None:
            responses = self.metrics.observe(responses, context.time_remaining, tenant.name, model)
        responses = call.observe(responses)
        try:
            async for response in responses:
                yield response
        except GatewayError as e:
            await context.abort(e.code, str(e), trailing_metadata=e.trailers)

    def _authenticate(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The call's tenant, by its bearer token and/or its verified client certificate."""
        if self.auth is None:
            return ANONYMOUS
        return self.auth.authenticate(context.invocation_metadata(), context.auth_context())

    async def _generate(self, request: generate_pb2.GenerateRequest | MalformedRequest,
                        context: grpc.aio.ServicerContext, call: CallTrace, tenant: Tenant,
                        model: CallModel) -> AsyncIterator[generate_pb2.GenerateResponse]:
        if isinstance(request, MalformedRequest):
            raise InvalidArgument(request.error)
        request_id = request.request_id or uuid.uuid4().hex
        # this call's task: its log lines name the request and the tenant
        bind_request(request_id, trace_id=call.trace_id, tenant=tenant.name)
        resume_from = request.resume_from_index
        self.limits.check(request)  # before the prompt is parsed, let alone enqueued
        try:
            check_request_id(request_id)
            _, params = params_from_pb(request)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        call.describe(request_id, params)
        if resume_from and not request.request_id:
            raise InvalidArgument("resume_from_index needs the request_id of the stream to resume")
        try:  # the body names the model it ran, so a resend without one attaches to the same request
            request.model = model.name = await self.models.resolve(request)
        except RedisError as e:
            raise redis_unavailable(e) from e
        max_depth = self.config.max_queue_depth_of(PriorityClass.of(request.priority))
        depth, slot = await self.admission.admit(
            tenant, request.model, request.priority, params.max_tokens, is_resume=bool(resume_from),
            shed_above=None if request.request_id else max_depth, pushback_ms=self.config.retry_pushback_ms)
        used = UsedTokens()
        try:
            async for response in self._follow(request, request_id, context, call, tenant, depth, used):
                yield response
        finally:
            if slot is not None:
                self._in_background(self.admission.release(slot, used.num_tokens, used.request_key))

    async def _follow(self, request: generate_pb2.GenerateRequest, request_id: str,
                      context: grpc.aio.ServicerContext, call: CallTrace, tenant: Tenant,
                      depth: int, used: UsedTokens) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Attach to (or enqueue) the request and relay its events to the caller, counting in
        `used` what the tenant is charged for (gateway/quotas.py)."""
        resume_from = request.resume_from_index
        follow: Follow | None = None
        route = SHARED
        is_done = False
        key = tenant_request_key(tenant.name, request_id)  # what Redis knows it by: protos/keys.py
        calls = await self.router.follow(key)  # before anything is read or enqueued: protos/keys.py
        try:
            queued = self._queued(key, request, context, tenant)
            with call.enqueue(queued):
                digest = request_digest(request, tenant.name)
                follow, is_new, route = await self._attach(queued, digest, depth, resume_from, request_id)
                used.request_key = key
            if is_new and follow.move_at is not None and self.prefix_router is not None:
                self.prefix_router.wait_claim(route, key, calls)
            log.debug("request %s: %s entry %s", request_id, "enqueued" if is_new else "following",
                      follow.entry_id.decode())
            follow.time_remaining = context.time_remaining
            liveness_s, outage_s = self.config.liveness_check_s, self.config.max_redis_outage_s
            async for response in relay(follow, calls, self.queue, read_log=not is_new,
                                        liveness_check_s=liveness_s, max_outage_s=outage_s):
                is_done = response.HasField("final")
                if is_done:
                    response.final.tenant = tenant.name
                    if is_new and self.metrics is not None:
                        self.metrics.observe_route(request.model, route, response.final.usage)
                else:
                    used.num_tokens += len(response.chunk.token_ids)
                yield response
        except WorkerError:
            is_done = True  # the worker reported and dropped the attempt itself
            raise
        finally:
            self.router.unfollow(key, calls)
            if route.consumer and self.prefix_router is not None:
                self.prefix_router.release(route, key, calls)
            if follow is not None and not is_done:
                # Cancelled, disconnected, deadline passed or failed here: the worker parks it.
                self.abort_later(key, "the caller went away", follow.entry_id)

    async def _attach(self, queued: queue_pb2.QueuedRequest, digest: str, depth: int,
                      resume_from: int, request_id: str) -> tuple[Follow, bool, Route]:
        """The attempt to follow, whether this call created the request (nothing logged yet), and
        where a request it created went. request_id: the caller's (queued.request_id is its
        tenant-scoped key)."""
        max_depth = self.config.max_queue_depth_of(PriorityClass.of(queued.request.priority))
        may_create = depth < max_depth and not resume_from
        route = SHARED
        try:
            if may_create and self.prefix_router is not None:
                route = await self.prefix_router.choose(queued)
            found = await self.queue.attach(queued, digest, may_create=may_create, routed_to=route.consumer)
            is_new = found.state == "created"
            if found.state == "ended":  # the last attempt ended without an answer: start the next
                found = await self._next_attempt(queued, digest, found)
        except RedisError as e:
            raise redis_unavailable(e) from e
        if found.state == "mismatch":
            raise FailedPrecondition(f"request_id {request_id!r} belongs to a request with another body; "
                                     "resend that request unchanged to resume it, or use a new request_id")
        if found.state == "unknown" and resume_from:
            raise NotFound(f"request_id {request_id!r} is not known, so resume_from_index ({resume_from}) "
                           "has nothing to resume: it was never sent, or it ended more than the "
                           f"gateway's result TTL ({self.config.result_ttl_s:g} s) ago")
        if found.state == "unknown":
            raise QueueFull(depth, max_depth, self.config.retry_pushback_ms)
        if found.seed is not None:  # every attempt samples with the record's seed
            queued.request.sampling.seed = found.seed

        async def next_attempt(ended: bytes) -> tuple[bytes, str] | None:
            again = await self._next_attempt(queued, digest, Attached("ended", ended), may_create=True)
            if again.state == "mismatch":
                raise FailedPrecondition(f"request_id {request_id!r} was taken by another request body")
            return (again.entry_id, again.stream) if again.state in ("created", "live") else None

        follow = Follow(queued.request_id, found.entry_id, resume_from, found.stream or
                        self.queue.stream_of(queued.request), next_attempt=next_attempt, caller_id=request_id)
        metrics, wait_s = self.metrics, self.config.route_max_wait_ms / 1000
        model = queued.request.model
        moves = metrics.route_moves.labels(model, queued.tenant) if metrics else None
        router, key = self.prefix_router, queued.request_id
        on_moved = (lambda: router.drop_unclaimed(route.consumer, key)) if router and route.consumer else None
        if not route.is_pinned:  # only its worker has the adapter: it waits there
            move_unclaimed(follow, self.queue, queued.request, wait_s, moves, on_moved)
        if is_new and metrics is not None:
            metrics.routed.labels(model, queued.tenant, route.kind).inc()
        return follow, is_new, route

    async def _next_attempt(self, queued: queue_pb2.QueuedRequest, digest: str, found: Attached, *,
                            may_create: bool = False) -> Attached:
        """XADD the next attempt after `found.entry_id` ended (another gateway may have already).
        may_create: also when the record is gone (Redis lost it under a running call)."""
        for _ in range(MAX_ATTACH_RACES):
            if found.seed is not None:
                queued.request.sampling.seed = found.seed
            found = await self.queue.attach(queued, digest, may_create=may_create, expect=found.entry_id)
            if found.state != "ended":
                return found
        raise Unavailable(f"request {queued.request.request_id}: attempts keep ending without an answer; "
                          "retry")

    def _queued(self, key: str, request: generate_pb2.GenerateRequest,
                context: grpc.aio.ServicerContext, tenant: Tenant) -> queue_pb2.QueuedRequest:
        """key: the request's tenant-scoped key (protos/keys.py), its request_id from here on."""
        now = time.time()
        remaining = context.time_remaining()
        queued = queue_pb2.QueuedRequest(
            request_id=key, request=request, enqueued_unix=now,
            deadline_unix=now + remaining if remaining is not None else 0.0,
            timeout_s=remaining if remaining is not None else 0.0,
            gateway_id=self.config.gateway_id, result_ttl_s=self.config.result_ttl_s,
            tenant=tenant.name, cache_scope=tenant.cache_scope(request.cache_salt))
        queued.request.request_id = key
        queued.request.ClearField("resume_from_index")
        if not queued.request.sampling.HasField("seed"):  # used only if this call creates the request
            queued.request.sampling.seed = secrets.randbits(64)
        if not queued.request.HasField("stream_interval") and self.config.default_stream_interval:
            # the queued copy only: the caller's body (its digest) stays as sent, so a resend through a
            # gateway with another default attaches to this generation
            queued.request.stream_interval = self.config.default_stream_interval
        return queued

    async def GetServerInfo(self, request: generate_pb2.GetServerInfoRequest | MalformedRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> generate_pb2.ServerInfo:
        """The caller's view (gateway/server_info.py)."""
        try:
            tenant = self._authenticate(context)
        except GatewayError as e:
            await context.abort(e.code, str(e))
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        try:
            return await self.server_info.read(tenant)
        except RedisError as e:
            error = redis_unavailable(e)
        await context.abort(error.code, str(error))
        raise error  # abort() raises already; this tells the type checker

    def abort_later(self, request_id: str, reason: str, entry_id: bytes) -> None:
        """Publish an abort without blocking (the caller may be a cancelled task)."""
        self._in_background(self._abort(request_id, reason, entry_id))

    async def finish_background(self, timeout_s: float) -> None:
        """Let the aborts and quota settlements of ended calls reach Redis (at shutdown)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)

    def _in_background(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, request_id: str, reason: str, entry_id: bytes) -> None:
        try:
            await self.queue.abort(request_id, reason, entry_id)
        except RedisError as e:  # only a hint: the worker's next PUBLISH reaches nobody either
            log.info("abort hint for %s not delivered: %s", request_id, e)
