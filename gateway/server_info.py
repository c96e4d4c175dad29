"""What GetServerInfo tells a caller: an admin tenant (or anyone with authentication off)
everything; another tenant the version, the queue, the served models and its own limits,
nothing about hosts or other tenants' load (generate.proto, ServerInfo)."""

from __future__ import annotations

import importlib.metadata
import time

from gateway.auth import Tenant
from gateway.config import GatewayConfig
from gateway.models import Models
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

    def __init__(self, config: GatewayConfig, queue: RequestQueue, models: Models) -> None:
        self.config, self.queue, self.models = config, queue, models
        self._cache: _State | None = None
        self._read_at = -float("inf")

    async def read(self, tenant: Tenant) -> generate_pb2.ServerInfo:
        queued, in_flight, workers, served = await self._state(is_fresh=tenant.is_admin)
        info = generate_pb2.ServerInfo(
            version=version(), queue_depth=queued, max_queue_depth=self.config.max_queue_depth,
            num_in_flight=in_flight, models=[m.name for m in served], served=served)
        if tenant.is_admin:
            info.gateway_id = self.config.gateway_id
            info.workers.extend(workers)
        if tenant.name:
            info.tenant.CopyFrom(generate_pb2.TenantInfo(
                name=tenant.name, max_concurrent=tenant.max_concurrent or 0,
                tokens_per_minute=tenant.tokens_per_minute or 0, max_priority=tenant.max_priority,
                is_admin=tenant.is_admin))
        return info

    async def _state(self, *, is_fresh: bool) -> _State:
        """(queued, in flight, live workers by name, served models), over every served model."""
        now = time.monotonic()
        if is_fresh or self._cache is None or now - self._read_at > SERVER_INFO_TTL_S:
            # an admin's view is read now, and refreshes the catalogue every call then sees
            served = await self.models.served(max_age_s=0 if is_fresh else SERVER_INFO_TTL_S)
            queued, in_flight = await self.queue.read_depth([m.name for m in served])
            workers = sorted((w for _, w in await self.models.live(max_age_s=SERVER_INFO_TTL_S)),
                             key=lambda w: w.worker_id)
            self._cache, self._read_at = (queued, in_flight, workers, served), now
        return self._cache


_State = tuple[int, int, list[generate_pb2.WorkerInfo], list[generate_pb2.ServedModel]]
