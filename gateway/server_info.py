"""What GetServerInfo tells a caller: an admin tenant (or anyone with authentication off)
everything; another tenant the version, the queue, the served models and its own limits,
nothing about hosts or other tenants' load (generate.proto, ServerInfo)."""

from __future__ import annotations

import importlib.metadata
import time

from gateway.auth import Tenant
from gateway.config import GatewayConfig
from gateway.queue import RequestQueue
from protos.tokenrelay.v1 import generate_pb2

SERVER_INFO_TTL_S = 0.5  # a tenant's view comes from what Redis said at most this long ago


def version() -> str:
    try:
        return importlib.metadata.version("tokenrelay")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ServerInfoView:
    """Builds ServerInfo per caller. An admin's view is read now; a tenant's is cached for
    SERVER_INFO_TTL_S for all tenants, so tenants asking often cost Redis nothing.
    Raises redis's exceptions unchanged."""

    def __init__(self, config: GatewayConfig, queue: RequestQueue) -> None:
        self.config, self.queue = config, queue
        self._cache: tuple[float, int, int, list[generate_pb2.WorkerInfo]] | None = None

    async def read(self, tenant: Tenant) -> generate_pb2.ServerInfo:
        queued, in_flight, workers = await self._state(is_fresh=tenant.is_admin)
        info = generate_pb2.ServerInfo(
            version=version(), queue_depth=queued, max_queue_depth=self.config.max_queue_depth,
            num_in_flight=in_flight, models=sorted({w.model for w in workers if w.model}))
        if tenant.is_admin:
            info.gateway_id = self.config.gateway_id
            info.workers.extend(workers)
        if tenant.name:
            info.tenant.CopyFrom(generate_pb2.TenantInfo(
                name=tenant.name, max_concurrent=tenant.max_concurrent or 0,
                tokens_per_minute=tenant.tokens_per_minute or 0, max_priority=tenant.max_priority,
                is_admin=tenant.is_admin))
        return info

    async def _state(self, *, is_fresh: bool) -> tuple[int, int, list[generate_pb2.WorkerInfo]]:
        """(queued, in flight, live workers by name)."""
        now = time.monotonic()
        cache = self._cache
        if is_fresh or cache is None or now - cache[0] > SERVER_INFO_TTL_S:
            queued, in_flight = await self.queue.read_depth()
            workers = sorted(await self.queue.workers(), key=lambda w: w.worker_id)
            cache = self._cache = (now, queued, in_flight, workers)
        _, queued, in_flight, workers = cache
        return queued, in_flight, workers
