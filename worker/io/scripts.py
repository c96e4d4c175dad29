"""The worker's Lua scripts: every write it makes for a request is fenced in the same round trip.

Ownership (protos/keys.py, "Fencing"): a worker process is one consumer of the group, named
``{worker_id}.{incarnation}``. It is alive while its score in the registry (a sorted set,
expiry in Redis-clock ms) is in the future. A sweeper that finds a consumer dead fences it
(RECLAIM: adds it to the fenced set and scores it 0 in the registry) and XCLAIMs its entries
in the same script. A claim takes a request's record (OWN: sets ``owner``, copies the
request's log into the claimant's log hash, never writing another worker's, and names the
request in the previous owner's revoked set when that owner had not released it). Every
round of a worker is one STEP script that first checks both: a fenced worker writes nothing,
and the requests revoked from it are left out of the round. Scripts run atomically, so a
round is either entirely before a re-claim (and the new owner resumes after everything it
published) or refused.

Why scripts and not a pipeline: the check and the writes must be one atomic step, and one
EVALSHA per round replaces one HSET and one PUBLISH per request (bench-e2e measured 2.1
commands per token with the per-request pipeline; see benchmarks/fleet.py).
"""

from __future__ import annotations

from protos.keys import (
    CLAIM_ORDER,
    FENCE_MARK,
    RECORD_LEASE_S,
    STREAM_DATA_FIELD,
    LogField,
    Record,
)

# Lua helpers shared by the scripts: HSET/HDEL of long argument lists in slices (Lua's unpack()
# is limited to a few thousand values), and Redis's clock.
_LIB = """
local function hset_all(key, flat)
  for s = 1, #flat, 1000 do
    redis.call('HSET', key, unpack(flat, s, math.min(s + 999, #flat)))
  end
end
local function hdel_all(key, names)
  for s = 1, #names, 1000 do
    redis.call('HDEL', key, unpack(names, s, math.min(s + 999, #names)))
  end
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# One round of one worker. No KEYS: its keys derive from ARGV's prefix and consumer name
# (protos/keys.py), so a round's fixed cost is ~100 bytes, not ~300 (at batch 1 the fixed part
# was half of what Redis received per token). ARGV: key prefix, consumer name, then sections,
# each a count followed by its items:
#   REOWN  request_id                                (a resent round: see below)
#   KNOWN  revoked request ids the worker already knows of (it left them out of this round)
#   LOG    request_id, first seq, k, k events (each framed as a one-event TokenEventBatch)
#                                                    logged as {request_id}:{seq}, then published
#   PROG   request_id, Progress bytes
#   ADMIT  request_id, prompt tokens, notice        the count into its record while this worker owns
#                                                    it, and the framed notice (TokenEventBatch.admitted)
#                                                    published with the round
#   PUB    framed event                              published only (errors; the round's room)
#   END    request_id (or ''), record key (or ''), final seq (or ''), ttl ms, stream, entry id
#   DROP   log field names whose results expired
#   FORGET revoked request ids this worker has dropped
# Returns {'fenced'}, {'revoked', ids...} (nothing was written: revocations the worker does not
# know yet; it leaves those requests out and sends the round again) or {'ok'}.
# Why the worker frames the events: per event the script then appends a string to the message
# where it built a varint and a field in Lua, and it filters nothing per request (measured on a
# 2-core EPYC, 64 requests a round: 368 -> ~270 us per call, Redis CPU 8.2 -> ~6 us per token).
# Field names stay built here: sent whole they cost ~40 more bytes per token for no CPU saved.
STEP = _LIB + f"""
local prefix, me = ARGV[1], ARGV[2]
local revoked, group = prefix .. ':revoked:' .. me, prefix .. ':workers'
local log, out = prefix .. ':log:' .. me, prefix .. ':out:' .. me
-- One read per round checks both: '{FENCE_MARK}' (this consumer is fenced) and the request ids
-- taken over from it, kept until the worker confirms it dropped them (FORGET), so a reply lost
-- on the way cannot let a later round write for them.
local lost = redis.call('SMEMBERS', revoked)
local i = 3
local n = tonumber(ARGV[i])
local reown_at = i + 1
i = i + 1 + n
n = tonumber(ARGV[i])
if #lost > 0 then
  local known = {{}}
  for j = i + 1, i + n do known[ARGV[j]] = true end
  local new = {{'revoked'}}
  for _, r in ipairs(lost) do
    if r == '{FENCE_MARK}' then return {{'fenced'}} end
    if not known[r] then new[#new + 1] = r end
  end
  if #new > 1 then return new end
end
i = i + 1 + n
-- REOWN: a round resent after a failure may land in a Redis that came back empty; its
-- requests' records then name no log, and a gateway could not find what this round logs.
for j = reown_at, reown_at + tonumber(ARGV[3]) - 1 do
  local rec = prefix .. ':request:' .. ARGV[j]
  if redis.call('HSETNX', rec, '{Record.LOG}', log) == 1 then
    redis.call('HSET', rec, '{Record.OWNER}', me)
    redis.call('PEXPIRE', rec, {int(RECORD_LEASE_S * 1000)})
  end
end
local flat, msg = {{}}, {{}}
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local rid, first, k = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  i = i + 3
  for j = 0, k - 1 do
    flat[#flat + 1] = rid .. ':' .. (first + j); flat[#flat + 1] = ARGV[i + j]
    msg[#msg + 1] = ARGV[i + j]
  end
  flat[#flat + 1] = rid .. '{LogField.NEXT}'; flat[#flat + 1] = first + k
  i = i + k
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  flat[#flat + 1] = ARGV[i] .. '{LogField.PROGRESS}'; flat[#flat + 1] = ARGV[i + 1]
  i = i + 2
end
if #flat > 0 then hset_all(log, flat) end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local rec = prefix .. ':request:' .. ARGV[i]
  if redis.call('HGET', rec, '{Record.OWNER}') == me then
    redis.call('HSET', rec, '{Record.PROMPT_TOKENS}', ARGV[i + 1])
    msg[#msg + 1] = ARGV[i + 2]
  end
  i = i + 3
end
n = tonumber(ARGV[i])
for j = i + 1, i + n do msg[#msg + 1] = ARGV[j] end
i = i + 1 + n
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local rid, rec, final, ttl = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local stream, entry = ARGV[i + 4], ARGV[i + 5]
  i = i + 6
  if rec ~= '' then
    if redis.call('HGET', rec, '{Record.OWNER}') == me then
      if final ~= '' then
        redis.call('HSET', rec, '{Record.FINAL}', final, '{Record.OWNER}', '')
      else
        redis.call('HSET', rec, '{Record.OWNER}', '')
      end
    elseif final ~= '' then
      redis.call('HSET', rec, '{Record.FINAL}', final)
    end
    redis.call('PEXPIRE', rec, ttl)
  end
  redis.call('XACK', stream, group, entry)
  redis.call('XDEL', stream, entry)
end
n = tonumber(ARGV[i]); i = i + 1
if n > 0 then hdel_all(log, {{unpack(ARGV, i, i + n - 1)}}) end
i = i + n
n = tonumber(ARGV[i]); i = i + 1
if n > 0 then redis.call('SREM', revoked, unpack(ARGV, i, i + n - 1)) end
if #msg > 0 then redis.call('PUBLISH', out, table.concat(msg)) end
return {{'ok'}}
"""

# Take the records of claimed entries. KEYS: own log hash. ARGV: consumer name, key prefix,
# then (request_id, record key, entry id) per entry. Per entry it returns
#   {state, deliveries, progress or false, events...}
# state: 'own' (run it; events = its logged chunks, in seq order, for a resume),
# 'stale' (the record names another attempt: acknowledge and drop), 'finished' (its final is
# logged: acknowledge and drop). deliveries counts takeovers from an owner that never
# released the request (it died holding it), across every attempt of the request id.
OWN = _LIB + f"""
local mine, me, prefix = KEYS[1], ARGV[1], ARGV[2]
local reply = {{}}
for i = 3, #ARGV, 3 do
  local rid, rec, entry = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local f = redis.call('HMGET', rec, '{Record.ENTRY}', '{Record.OWNER}', '{Record.LOG}', '{Record.FINAL}',
                       '{Record.DELIVERIES}')
  local deliveries = tonumber(f[5] or '0')
  if f[1] and f[1] ~= entry then
    reply[#reply + 1] = {{'stale', deliveries, false}}
  elseif f[4] then
    reply[#reply + 1] = {{'finished', deliveries, false}}
  else
    local owner, from = f[2] or '', f[3]
    if owner ~= '' and owner ~= me then
      deliveries = redis.call('HINCRBY', rec, '{Record.DELIVERIES}', 1)
      local revoked = prefix .. ':revoked:' .. owner
      redis.call('SADD', revoked, rid)
      redis.call('PEXPIRE', revoked, 86400000)
    end
    local names = {{}}
    local nxt = 0
    if from then nxt = tonumber(redis.call('HGET', from, rid .. '{LogField.NEXT}') or '0') end
    for s = 0, nxt - 1 do names[#names + 1] = rid .. ':' .. s end
    names[#names + 1] = rid .. '{LogField.PROGRESS}'
    names[#names + 1] = rid .. '{LogField.NEXT}'
    local values = {{}}
    if from then values = redis.call('HMGET', from, unpack(names)) end
    if from and from ~= mine and nxt > 0 then
      local flat = {{}}
      for j, name in ipairs(names) do
        if values[j] then flat[#flat + 1] = name; flat[#flat + 1] = values[j] end
      end
      if #flat > 0 then hset_all(mine, flat) end
    elseif from and from ~= mine and values[nxt + 1] then
      redis.call('HSET', mine, names[nxt + 1], values[nxt + 1])
    end
    redis.call('HSET', rec, '{Record.OWNER}', me, '{Record.LOG}', mine)
    local item = {{'own', deliveries, values[nxt + 1] or false}}
    for s = 1, nxt do item[#item + 1] = values[s] or '' end
    reply[#reply + 1] = item
  end
end
return reply
"""

# Fence dead consumers and XCLAIM their pending entries. KEYS: registry, fenced set.
# ARGV: group, claimant, fence TTL ms, count, key prefix, then the streams, '--', then the
# consumers to check. A consumer whose registry score is in the future is alive and skipped;
# the others are fenced (their heartbeat hash is left to expire: a worker writes no other
# worker's heartbeat, and only the registry says who is alive) and up to `count` of their entries
# claimed. Returns {stream, entry id, data or '', deliveries} per entry and, last, the fenced
# names that had nothing left pending (the caller removes them from the group).
# RECLAIM: ARGV = group, me, fence ttl, count, prefix, the shared streams (CLAIM_ORDER), "--",
# the consumer names. A dead consumer's own routed streams (protos/keys.py, "Routing") are
# swept with the shared ones: their pending entries XCLAIMed (under whichever dead consumer they
# are: an earlier sweeper may have died too), then the entries nobody claimed yet read with
# XREADGROUP, as the dead worker would have, while count lasts (what is left waits for the next
# sweep, or is moved to the shared stream by the gateway following it after its wait). A
# consumer with nothing pending whose routed streams are empty has them deleted, leaves the
# registry and counts as idle; until then it stays in the registry with score 0 (dead).
RECLAIM = _LIB + f"""
local function data_of(fields)
  for k = 1, #fields, 2 do
    if fields[k] == '{STREAM_DATA_FIELD.decode()}' then return fields[k + 1] end
  end
  return ''
end
local registry, fenced, models = KEYS[1], KEYS[2], KEYS[3]
local group, me, fence_ttl, count, prefix = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local my_model = ARGV[6]
local shared, consumers, i = {{}}, {{}}, 7
while ARGV[i] ~= '--' do shared[#shared + 1] = ARGV[i]; i = i + 1 end
for j = i + 1, #ARGV do consumers[#consumers + 1] = ARGV[j] end
local classes = {{{", ".join(repr(c.name.lower()) for c in CLAIM_ORDER)}}}
local now = now_ms()
local reply, idle = {{}}, {{}}
for _, name in ipairs(consumers) do
  local score = redis.call('ZSCORE', registry, name)
  -- Another model's worker is its own model's sweepers' to re-claim: its routed streams hold
  -- requests of that model. Unknown (a Redis that lost the hash): judged by its shared entries.
  local model = redis.call('HGET', models, name)
  if name ~= me and (not score or tonumber(score) <= now) and (not model or model == my_model) then
    redis.call('SADD', fenced, name)
    redis.call('PEXPIRE', fenced, fence_ttl)
    redis.call('SADD', prefix .. ':revoked:' .. name, '{FENCE_MARK}')
    redis.call('PEXPIRE', prefix .. ':revoked:' .. name, fence_ttl)
    -- Dead (score 0) until nothing of it is left: the registry names it to the next sweeps even
    -- where it never had an entry delivered from a shared stream (XINFO CONSUMERS lists only those).
    redis.call('ZADD', registry, 0, name)
    local routed, streams = {{}}, {{}}
    for c, cls in ipairs(classes) do
      routed[c] = prefix .. ':routed:' .. cls .. ':' .. name
      streams[#streams + 1] = routed[c]
      streams[#streams + 1] = shared[c]
    end
    local left = 0
    for s, stream in ipairs(streams) do
      -- A routed stream's entries may be pending under an earlier sweeper (that died too).
      local ok, pending
      if s % 2 == 1 then
        ok, pending = pcall(redis.call, 'XPENDING', stream, group, '-', '+', 1000)
      else
        ok, pending = pcall(redis.call, 'XPENDING', stream, group, '-', '+', math.max(count, 1), name)
      end
      if ok then
        for _, p in ipairs(pending) do
          local holder = redis.call('ZSCORE', registry, p[2])
          if p[2] == name or (p[2] ~= me and not (holder and tonumber(holder) > now)) then
            left = left + 1
            if count > 0 then
              local e = redis.call('XCLAIM', stream, group, me, 0, p[1])[1]
              if e and e[2] then
                reply[#reply + 1] = {{stream, p[1], data_of(e[2]), p[4]}}
                count = count - 1
              else
                redis.call('XACK', stream, group, p[1])
              end
              left = left - 1
            end
          end
        end
      end
    end
    local queued = 0
    for _, stream in ipairs(routed) do
      if count > 0 then  -- what nobody claimed yet: this sweeper takes it, as the dead one would have
        local ok, found = pcall(redis.call, 'XREADGROUP', 'GROUP', group, me, 'COUNT', count,
                                'STREAMS', stream, '>')
        if ok and found then
          for _, e in ipairs(found[1][2]) do
            reply[#reply + 1] = {{stream, e[1], data_of(e[2]), 0}}
            count = count - 1
          end
        end
      end
      queued = queued + redis.call('XLEN', stream)
    end
    if left + queued == 0 then
      for _, stream in ipairs(routed) do redis.call('DEL', stream) end
    end
    left = left + queued
    if left == 0 then
      redis.call('ZREM', registry, name)
      redis.call('HDEL', models, name)
      idle[#idle + 1] = name
    end
  end
end
reply[#reply + 1] = idle
return reply
"""


HEARTBEAT = _LIB + f"""
local registry, revoked, beat, log, models = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local me, ttl, log_ttl, model = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
if redis.call('SISMEMBER', revoked, '{FENCE_MARK}') == 1 then return 0 end
local now = now_ms()
-- ZADD answers 1 only for a new member: this worker's first beat, or a Redis that came back
-- without it. The model and the log's TTL are written then (RECLAIM removes the model with the
-- member), and the log's TTL also when the worker asks (ARGV[5] = '1': every few seconds), so a
-- steady beat costs two commands fewer (bench-fleet --commands).
local new = redis.call('ZADD', registry, now + ttl, me) == 1
if new then redis.call('HSET', models, me, model) end
if new or ARGV[5] == '1' then redis.call('PEXPIRE', log, log_ttl) end
if #ARGV > 5 then redis.call('HSET', beat, unpack(ARGV, 6, #ARGV)) end
redis.call('PEXPIRE', beat, ttl)
return now
"""
