"""Admission of a Generate call, before anything is enqueued: the tenant's priority cap,
what no live worker could hold, the gateway's view of the queue depth, and the tenant's
quotas (gateway/quotas.py). The queue-depth limit itself is applied by the ATTACH script's
may_create (gateway/server.py): a resend of a known request is never shed. A call without a
request_id cannot be a resend: over the limit it is refused here, from the cached depth,
before any other Redis round trip (no quota script, no SUBSCRIBE, no ATTACH), so shedding
stays cheap however loaded the gateway is.
"""

from __future__ import annotations

from redis.exceptions import RedisError

from gateway.auth import Tenant
from gateway.errors import InvalidArgument, QueueFull, Unavailable, redis_unavailable
from gateway.metrics import GatewayMetrics
from gateway.models import Models
from gateway.queue import RequestQueue
from gateway.quotas import Quotas, Slot
from gateway.replies import ReplyRouter


class Admission:
    """Checks each call in order; the first that fails ends it (GatewayError)."""

    def __init__(self, queue: RequestQueue, router: ReplyRouter, models: Models,
                 metrics: GatewayMetrics | None = None, quotas: Quotas | None = None) -> None:
        self.queue, self.router, self.models = queue, router, models
        self.metrics, self.quotas = metrics, quotas

    async def admit(self, tenant: Tenant, model: str, priority: int, max_tokens: int, *, is_resume: bool,
                    shed_above: int | None = None, pushback_ms: int = 1000) -> tuple[int, Slot | None]:
        """(the model's queue depth, the tenant's quota slot to release when the call ends, if
        any). shed_above: refuse at once (QueueFull) when the depth reached it (a call that cannot
        be a resend of a known request)."""
        tenant.check_priority(priority)
        depth = await self.queue_depth(model)
        if shed_above is not None and depth >= shed_above:
            raise QueueFull(depth, shed_above, pushback_ms)
        await self.check_fits(model, max_tokens)
        slot = None
        if self.quotas is not None:
            slot = await self.quotas.admit(tenant, max_tokens, is_resume=is_resume)
        return depth, slot

    async def release(self, slot: Slot, used_tokens: int, request_key: str) -> None:
        """The call ended having used used_tokens, attached to request_key's generation ("" =
        none): gateway/quotas.py says what counts."""
        if self.quotas is not None:
            await self.quotas.release(slot, used_tokens, request_key)

    async def queue_depth(self, model: str) -> int:
        """Requests of `model` waiting in the queue; UNAVAILABLE if the gateway cannot reach Redis."""
        if not self.router.is_ready:
            raise Unavailable("the gateway is not connected to the queue (Redis); retry later")
        try:
            return await self.queue.queue_depth(model)
        except RedisError as e:
            raise redis_unavailable(e) from e

    async def check_fits(self, model: str, max_tokens: int) -> None:
        """Refuse what no live worker of the model could ever hold: max_tokens plus a one-token
        prompt beyond every such worker's largest sequence (max_model_len, or its whole KV cache).
        Prompt lengths are only known once tokenized, so the worker checks prompt + max_tokens
        itself. The heartbeats are the model catalogue's (read at most every 0.5 s)."""
        try:
            workers = await self.models.of_model(model)
        except RedisError:
            return  # queue_depth has just reached Redis; a blip here only skips the check
        limits = [min(w.max_model_len, w.num_blocks * w.block_size) for _, w in workers
                  if w.max_model_len and w.num_blocks and w.block_size]
        limit = max(limits) if limits else None
        if limit is not None and max_tokens + 1 > limit:
            raise InvalidArgument(f"stopping.max_tokens ({max_tokens}) leaves no room for a prompt in the "
                                  f"context of any live worker of model {model!r}: the largest holds {limit} "
                                  "tokens (its max_model_len or its whole KV cache)")
