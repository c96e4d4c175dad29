"""The gateway process: the gRPC server with the TokenRelay service (gateway/server.py), its
Redis side (the reply router, the sweeper of dead workers, quota refreshes), metrics and
tracing, started and stopped together.

Also serves `grpc.health.v1` (SERVING while the reply channel is subscribed, NOT_SERVING
otherwise and during shutdown) and, with --reflection, server reflection; those two need no
token. With --tls-cert the port speaks TLS only (gateway/tls.py), and the certificate, key and
client CA are re-read on SIGHUP.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.limits import server_options
from gateway.metrics import GatewayMetrics, GrpcMetricsInterceptor, QueueGauges
from gateway.queue import RequestQueue, connect
from gateway.quotas import Quotas
from gateway.replies import DEFAULT_TICK_S, ReplyRouter
from gateway.server import TokenRelayServicer
from gateway.sweeper import Sweeper
from gateway.tls import ServerCertificates, bind
from gateway.wire import SERVICE_NAME, add_servicer
from protos.metrics import MetricsServer
from protos.redis_conn import redact_url
from protos.tracing import GATEWAY_SERVICE, Tracing

log = logging.getLogger(__name__)


class Gateway:
    """The gRPC server plus its Redis side, started and stopped together."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client = connect(config)
        self.queue = RequestQueue(self.client, config)
        self.router = ReplyRouter(self.client, config.keys, config.keys.gateway(config.gateway_id),
                                  max_backoff_s=config.max_backoff_s,
                                  max_queued_events=config.max_queued_events,
                                  tick_s=min(DEFAULT_TICK_S, config.liveness_check_s / 2),
                                  on_ready_change=self._on_ready_change, result_ttl_s=config.result_ttl_s)
        self.health = health_aio.HealthServicer()
        self.metrics_server = MetricsServer(config.metrics_port, compat_vllm=config.metrics_compat == "vllm")
        metrics, interceptors = None, []
        if self.metrics_server.is_enabled:
            metrics = GatewayMetrics(self.metrics_server.registry)
            self.router.sources.on_refused = metrics.count_refused_events
            interceptors.append(GrpcMetricsInterceptor(self.metrics_server.registry))
        self.server = grpc.aio.server(interceptors=interceptors, options=server_options(config),
                                      maximum_concurrent_rpcs=config.max_concurrent_rpcs)
        self.tracing = Tracing(config.otlp_traces_endpoint, GATEWAY_SERVICE, config.gateway_id)
        is_mtls = bool(config.tls_client_ca)
        self.auth = (Authenticator(config.auth_tokens_file, can_verify_client_certs=is_mtls)
                     if config.auth_tokens_file else None)
        self.certificates = (ServerCertificates(config.tls_cert, config.tls_key, config.tls_client_ca)
                             if config.tls_cert else None)  # reloaded on SIGHUP and when the files change
        self.quotas = None if self.auth is None else Quotas(
            self.client, config.keys, config.gateway_id, config.quota_slot_ttl_s, config.retry_pushback_ms)
        self.servicer = TokenRelayServicer(config, self.queue, self.router, metrics, self.tracing,
                                           self.auth, self.quotas)
        add_servicer(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if config.enable_reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME), self.server)
        self.port = 0
        self._health_tasks: set[asyncio.Task[None]] = set()
        self._queue_gauges: asyncio.Task[None] | None = None
        self._quota_refresh: asyncio.Task[None] | None = None
        self.sweeper = Sweeper(self.client, config, self._served_models, self._on_swept)
        self._sweeps: asyncio.Task[None] | None = None

    async def start(self, subscribe_timeout_s: float = 5.0) -> int:
        """Subscribe to the reply channel, then serve; returns the bound port.

        If Redis is down the server still starts (health NOT_SERVING, calls
        UNAVAILABLE) and keeps reconnecting.
        """
        await self._set_health(False)
        config = self.config
        self.port = bind(self.server, config.listen, self.certificates,
                         is_authenticated=self.auth is not None)
        if not await self.router.start(timeout_s=subscribe_timeout_s):
            log.warning("Redis at %s is not reachable yet; serving UNAVAILABLE until it is",
                        redact_url(self.config.redis_url))
        await self.server.start()
        self.metrics_server.start()
        if (metrics := self.servicer.metrics) is not None:
            self._queue_gauges = asyncio.create_task(metrics.read_queue(self._read_queue_gauges))
        if self.quotas is not None:
            self._quota_refresh = asyncio.create_task(self.quotas.refresh_forever())
        self._sweeps = asyncio.create_task(self.sweeper.run())
        log.info("gateway %s listening on port %d", self.config.gateway_id, self.port)
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop admitting (health NOT_SERVING), let calls finish for grace_s, close Redis."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.shutdown_grace_s if grace_s is None else grace_s)
        for task in (self._queue_gauges, self._quota_refresh, self._sweeps):
            if task is not None:
                task.cancel()
        self.metrics_server.stop()
        await self.servicer.finish_background(self.config.redis_timeout_s)
        await asyncio.to_thread(self.tracing.shutdown)  # exports the last spans: may wait on the collector
        await self.router.close()
        await self.client.aclose()

    async def _served_models(self) -> list[str]:
        return [model.name for model in await self.servicer.models.served()]

    def _on_swept(self, num_fenced: int, num_requeued: int) -> None:
        if (metrics := self.servicer.metrics) is not None:
            metrics.fenced.labels(metrics.model).inc(num_fenced)
            metrics.requeued.labels(metrics.model).inc(num_requeued)

    async def _read_queue_gauges(self) -> list[QueueGauges]:
        """Each served model's queue (gateway/metrics.py)."""
        gauges = []
        for model in await self.servicer.models.served():
            queued, in_flight, age = await self.queue.queue_gauges(model.name)
            gauges.append(QueueGauges(model.name, queued, in_flight, age, model.is_default))
        return gauges

    def reload_auth(self) -> bool:
        """Re-read the tenants file (SIGHUP); open calls keep their tenant. False: the file is
        bad (logged) and the previous one stays, or authentication is off."""
        return self.auth is not None and self.auth.reload()

    def reload_tls(self) -> bool:
        """Re-read the TLS certificate, key and client CA (SIGHUP; a change of the files is also
        seen at the next handshake): new connections get them, open ones keep theirs. False: a
        bad file (logged, the previous material stays), the same files, or no TLS."""
        return self.certificates is not None and self.certificates.reload()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    def _on_ready_change(self, is_ready: bool) -> None:
        task = asyncio.ensure_future(self._set_health(is_ready))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _set_health(self, is_serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if is_serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)
