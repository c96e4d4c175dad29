"""Per-tenant quotas shared by every gateway through Redis: max_concurrent and tokens_per_minute.

One Lua script (ADMIT_SCRIPT) admits a call atomically: it drops the tenant's expired
slots, checks max_concurrent and the token bucket, and takes a slot and the tokens
together, or nothing. Times come from Redis's own clock (TIME), so gateways with skewed
clocks agree. Keys and their TTLs: protos/keys.py.

max_concurrent: a slot is a member of the tenant's sorted set scored by its expiry. The
gateway renews the slots of its open calls every slot_ttl / 3 and removes a slot when its
call ends; a gateway that crashed stops renewing, and its slots expire after slot_ttl.

tokens_per_minute: a token bucket of tokens_per_minute, refilled continuously. A call that
can start a generation reserves its stopping.max_tokens (the server default when unset) at
admission. Prompt tokens are not counted (the gateway does not tokenize; the worker does)
and unused tokens are not given back, so a tenant never gets more than tokens_per_minute
generated tokens a minute, and short answers use up the budget faster than they need. A
resume (resume_from_index > 0) only follows a generation already paid for: it takes a
slot but no tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.auth import Tenant
from gateway.errors import PUSHBACK_TRAILER, GatewayError, InvalidArgument, redis_unavailable
from protos.keys import Bucket, Keys

log = logging.getLogger(__name__)

ADMITTED, OVER_CONCURRENT, OVER_TOKENS = 0, 1, 2
BUCKET_TTL_MS = 60_000  # an untouched bucket is full after a minute: dropping it = full

# KEYS: calls zset, bucket hash. ARGV: call id, max_concurrent (0 = none), slot TTL ms,
# tokens_per_minute (0 = none), tokens to reserve. -> {status, retry ms, open calls or tokens left}
ADMIT_SCRIPT = f"""
local calls, bucket = KEYS[1], KEYS[2]
local call_id, max_calls, ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local tpm, need = tonumber(ARGV[4]), tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if max_calls > 0 then
  redis.call('ZREMRANGEBYSCORE', calls, '-inf', now)
  local open = redis.call('ZCARD', calls)
  if open >= max_calls then return {{{OVER_CONCURRENT}, 0, open}} end
end
if tpm > 0 and need > 0 then
  local b = redis.call('HMGET', bucket, '{Bucket.TOKENS}', '{Bucket.UPDATED_MS}')
  local tokens = tpm
  if b[1] then tokens = math.min(tpm, tonumber(b[1]) + (now - tonumber(b[2])) * tpm / 60000) end
  if tokens < need then
    return {{{OVER_TOKENS}, math.ceil((need - tokens) * 60000 / tpm), math.floor(tokens)}}
  end
  redis.call('HSET', bucket, '{Bucket.TOKENS}', tostring(tokens - need), '{Bucket.UPDATED_MS}', now)
  redis.call('PEXPIRE', bucket, {BUCKET_TTL_MS})
end
if max_calls > 0 then
  redis.call('ZADD', calls, now + ttl_ms, call_id)
  redis.call('PEXPIRE', calls, ttl_ms)
end
return {{{ADMITTED}, 0, 0}}
"""

# KEYS: calls zsets; ARGV: slot TTL ms, then the call id of each key. A slot that already
# expired (its gateway could not reach Redis for a whole TTL) is not taken back: XX.
REFRESH_SCRIPT = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', expiry, ARGV[i + 1])
  redis.call('PEXPIRE', key, ARGV[1])
end
return #KEYS
"""


class QuotaExceeded(GatewayError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, pushback_ms: int) -> None:
        super().__init__(f"{message}; retry in {pushback_ms} ms", ((PUSHBACK_TRAILER, str(pushback_ms)),))


@dataclass(frozen=True)
class Slot:
    """A call's place in its tenant's max_concurrent budget."""

    key: str
    call_id: str


class Quotas:
    """Admission against the tenants' shared budgets; renews this gateway's open slots."""

    def __init__(self, client: aioredis.Redis, keys: Keys, gateway_id: str, slot_ttl_s: float,
                 retry_pushback_ms: int) -> None:
        self.client, self.keys, self.gateway_id = client, keys, gateway_id
        self.slot_ttl_ms = max(1, round(slot_ttl_s * 1000))
        self.retry_pushback_ms = retry_pushback_ms
        self._admit = client.register_script(ADMIT_SCRIPT)
        self._refresh = client.register_script(REFRESH_SCRIPT)
        self._open: set[Slot] = set()

    async def admit(self, tenant: Tenant, max_tokens: int, *, reserve_tokens: bool) -> Slot | None:
        """Take a slot (if the tenant has max_concurrent) and reserve max_tokens (if it has
        tokens_per_minute and reserve_tokens); QuotaExceeded naming the limit otherwise."""
        tpm = tenant.tokens_per_minute or 0
        need = max_tokens if reserve_tokens and tpm else 0
        if need > tpm > 0:
            raise InvalidArgument(f"stopping.max_tokens ({max_tokens}) is more than the tokens_per_minute of "
                                  f"tenant {tenant.name!r} ({tpm}): the call could never be admitted")
        if not tenant.max_concurrent and not need:
            return None
        slot = Slot(self.keys.tenant_calls(tenant.name), f"{self.gateway_id}:{uuid.uuid4().hex}")
        keys = [slot.key, self.keys.tenant_tokens(tenant.name)]
        args: list[str | int] = [slot.call_id, tenant.max_concurrent or 0, self.slot_ttl_ms, tpm, need]
        try:
            status, retry_ms, value = await self._admit(keys=keys, args=args)
        except RedisError as e:
            raise redis_unavailable(e) from e
        if status == OVER_CONCURRENT:
            raise QuotaExceeded(f"tenant {tenant.name!r} is at its max_concurrent ({tenant.max_concurrent} "
                                f"calls open, {value} now)", self.retry_pushback_ms)
        if status == OVER_TOKENS:
            raise QuotaExceeded(f"tenant {tenant.name!r} is over its tokens_per_minute ({tpm}): the call "
                                f"reserves its stopping.max_tokens ({max_tokens}), {value} are left",
                                int(retry_ms))
        if not tenant.max_concurrent:
            return None
        self._open.add(slot)
        return slot

    async def release(self, slot: Slot) -> None:
        self._open.discard(slot)
        try:
            await self.client.zrem(slot.key, slot.call_id)
        except RedisError as e:  # the slot expires by itself after slot_ttl
            log.info("quota slot %s not released (it expires): %s", slot.call_id, e)

    async def refresh_forever(self) -> None:
        """Every slot_ttl / 3: renew the expiry of every slot this gateway holds, in one script."""
        while True:
            await asyncio.sleep(self.slot_ttl_ms / 3000)
            slots = list(self._open)
            if not slots:
                continue
            with contextlib.suppress(RedisError):  # the next round tries again
                await self._refresh(keys=[s.key for s in slots],
                                    args=[self.slot_ttl_ms, *(s.call_id for s in slots)])
