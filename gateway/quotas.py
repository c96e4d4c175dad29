"""Per-tenant quotas shared by every gateway through Redis: max_concurrent and tokens_per_minute.

One Lua script (ADMIT_SCRIPT) admits a call atomically: it drops the tenant's expired
slots, checks max_concurrent and the token bucket, and takes a slot and the tokens
together, or nothing; another (SETTLE_SCRIPT) ends the call: it frees the slot and settles
the tokens. Times come from Redis's own clock (TIME), so gateways with skewed clocks
agree. Keys and their TTLs: protos/keys.py.

max_concurrent: a slot is a member of the tenant's sorted set scored by its expiry. The
gateway renews the slots of its open calls every slot_ttl / 3 and removes a slot when its
call ends; a gateway that crashed stops renewing, and its slots expire after slot_ttl.

tokens_per_minute: a token bucket of tokens_per_minute, refilled continuously. Tokens are
reserved at admission and settled at the end, when the call is charged what it used:
- a call that can start a generation reserves its stopping.max_tokens (the server default
  when unset); a resume (resume_from_index > 0) reserves 1, so a tenant that is out of
  tokens cannot replay either;
- at its end a call is charged the tokens it was sent (every chunk's token ids, a replay
  of the log included: a replay costs what it returns), plus the generation's prompt
  tokens if no call was charged for them yet. The worker counts them (the gateway does not
  tokenize) and writes them into its log when it admits the request (`LogField.PROMPT`,
  read from the log the request's record names, which a gateway checked: gateway/sources.py);
  SETTLE charges them once per generation (`Record.PROMPT_BILLED`),
  to the first call of the tenant that ends after that: the caller that left before its
  first token pays its prompt as well as the one that waited for the final;
- the difference is given back, or taken: a prompt longer than the unused max_tokens puts
  the bucket below zero, and the tenant's next calls wait until it refilled.
Not charged: the prompt of a request whose every call ended before a worker admitted it
(a worker computes nothing for a request nobody follows: it parks it), and what a gateway
that died mid-call had reserved is neither charged nor given back (it stays spent).
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
from protos.keys import Bucket, Keys, LogField, Record

log = logging.getLogger(__name__)

ADMITTED, OVER_CONCURRENT, OVER_TOKENS = 0, 1, 2
RESUME_TOKENS = 1  # what a resume reserves: it needs a bucket that is not empty

# Lua: `tokens` = the bucket KEYS[2] refilled up to now (tpm, now defined before); store(t)
# writes it back with a TTL of the time it takes to be full again (dropping a full bucket
# = full), so a bucket in debt is not forgotten early.
_BUCKET_LUA = f"""
local b = redis.call('HMGET', KEYS[2], '{Bucket.TOKENS}', '{Bucket.UPDATED_MS}')
local tokens = tpm
if b[1] then tokens = math.min(tpm, tonumber(b[1]) + (now - tonumber(b[2])) * tpm / 60000) end
local function store(t)
  redis.call('HSET', KEYS[2], '{Bucket.TOKENS}', tostring(t), '{Bucket.UPDATED_MS}', now)
  redis.call('PEXPIRE', KEYS[2], math.max(1, math.ceil((tpm - t) * 60000 / tpm)) + 1000)
end
"""
_NOW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: calls zset, bucket hash. ARGV: call id, max_concurrent (0 = none), slot TTL ms,
# tokens_per_minute (0 = none), tokens to reserve. -> {status, retry ms, open calls or tokens left}
ADMIT_SCRIPT = f"""
local calls = KEYS[1]
local call_id, max_calls, ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local tpm, need = tonumber(ARGV[4]), tonumber(ARGV[5])
{_NOW_LUA}
if max_calls > 0 then
  redis.call('ZREMRANGEBYSCORE', calls, '-inf', now)
  local open = redis.call('ZCARD', calls)
  if open >= max_calls then return {{{OVER_CONCURRENT}, 0, open}} end
end
if tpm > 0 and need > 0 then
  {_BUCKET_LUA}
  if tokens < need then
    return {{{OVER_TOKENS}, math.ceil((need - tokens) * 60000 / tpm), math.floor(tokens)}}
  end
  store(tokens - need)
end
if max_calls > 0 then
  redis.call('ZADD', calls, now + ttl_ms, call_id)
  redis.call('PEXPIRE', calls, ttl_ms)
end
return {{{ADMITTED}, 0, 0}}
"""

# KEYS: calls zset, bucket hash, and the request's record if the call attached to one. ARGV:
# call id ("" = no slot), tokens_per_minute (0 = none), tokens to give back (negative: to
# take), the request's key. Frees the slot, takes the prompt tokens the record's log holds if
# nobody paid them yet (read first: a record that expired is not created again), and settles
# the bucket, which may go below zero. -> tokens in the bucket after (0 without a bucket)
SETTLE_SCRIPT = f"""
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[1], ARGV[1]) end
local tpm, back = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and KEYS[3] then
  local log = redis.call('HGET', KEYS[3], '{Record.LOG}')
  local prompt = log and redis.call('HGET', log, ARGV[4] .. '{LogField.PROMPT}')
  if prompt and redis.call('HSETNX', KEYS[3], '{Record.PROMPT_BILLED}', '1') == 1 then
    back = back - tonumber(prompt)
  end
end
if tpm == 0 or back == 0 then return 0 end
{_NOW_LUA}
{_BUCKET_LUA}
tokens = math.min(tpm, tokens + back)
store(tokens)
return math.floor(tokens)
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
    """A call's place in its tenant's budgets: its max_concurrent slot (call_id "" = none)
    and the tokens it reserved from tokens_per_minute (tpm 0 = no bucket)."""

    key: str
    call_id: str
    bucket: str = ""
    tpm: int = 0
    reserved: int = 0


class Quotas:
    """Admission against the tenants' shared budgets; renews this gateway's open slots."""

    def __init__(self, client: aioredis.Redis, keys: Keys, gateway_id: str, slot_ttl_s: float,
                 retry_pushback_ms: int) -> None:
        self.client, self.keys, self.gateway_id = client, keys, gateway_id
        self.slot_ttl_ms = max(1, round(slot_ttl_s * 1000))
        self.retry_pushback_ms = retry_pushback_ms
        self._admit = client.register_script(ADMIT_SCRIPT)
        self._settle = client.register_script(SETTLE_SCRIPT)
        self._refresh = client.register_script(REFRESH_SCRIPT)
        self._open: set[Slot] = set()

    async def admit(self, tenant: Tenant, max_tokens: int, *, is_resume: bool) -> Slot | None:
        """Take a slot (if the tenant has max_concurrent) and reserve tokens (if it has
        tokens_per_minute: max_tokens, or RESUME_TOKENS for a resume); QuotaExceeded naming
        the limit otherwise. None: nothing to settle."""
        tpm = tenant.tokens_per_minute or 0
        need = 0 if not tpm else RESUME_TOKENS if is_resume else max_tokens
        if need > tpm > 0:
            raise InvalidArgument(f"stopping.max_tokens ({max_tokens}) is more than the tokens_per_minute of "
                                  f"tenant {tenant.name!r} ({tpm}): the call could never be admitted")
        if not tenant.max_concurrent and not need:
            return None
        call_id = f"{self.gateway_id}:{uuid.uuid4().hex}" if tenant.max_concurrent else ""
        slot = Slot(self.keys.tenant_calls(tenant.name), call_id, self.keys.tenant_tokens(tenant.name),
                    tpm, need)
        args: list[str | int] = [call_id, tenant.max_concurrent or 0, self.slot_ttl_ms, tpm, need]
        try:
            status, retry_ms, value = await self._admit(keys=[slot.key, slot.bucket], args=args)
        except RedisError as e:
            raise redis_unavailable(e) from e
        if status == OVER_CONCURRENT:
            raise QuotaExceeded(f"tenant {tenant.name!r} is at its max_concurrent ({tenant.max_concurrent} "
                                f"calls open, {value} now)", self.retry_pushback_ms)
        if status == OVER_TOKENS:
            what = (f"a resume reserves {RESUME_TOKENS}" if is_resume
                    else f"the call reserves its stopping.max_tokens ({max_tokens})")
            raise QuotaExceeded(f"tenant {tenant.name!r} is over its tokens_per_minute ({tpm}): {what}, "
                                f"{value} are left", int(retry_ms))
        if call_id:
            self._open.add(slot)
        return slot

    async def release(self, slot: Slot, used_tokens: int = 0, request_key: str = "") -> None:
        """End the call: free its slot, and charge it used_tokens of its reservation (the rest
        goes back; more than it reserved is taken), plus the prompt of request_key's
        generation (the request it attached to, "" = none) unless a call paid it already."""
        self._open.discard(slot)
        keys = [slot.key, slot.bucket, *([self.keys.record(request_key)] if request_key else [])]
        try:
            await self._settle(keys=keys,
                               args=[slot.call_id, slot.tpm, slot.reserved - used_tokens, request_key])
        except RedisError as e:  # the slot expires by itself after slot_ttl; the tokens stay spent
            log.info("quota slot %s not settled (it expires): %s", slot.call_id, e)

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
