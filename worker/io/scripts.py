"""The worker's Lua scripts: every write it makes for a request is fenced in the same round trip.

Ownership (protos/keys.py, "Fencing"): a worker process is one consumer of the group, named
``{worker_id}.{incarnation}``. It is alive while its heartbeat hash exists (HEARTBEAT renews it
and its registry score). A gateway's sweeper that finds a consumer dead fences it (the mark in
its fence set) and queues its entries again (gateway/sweeper.py): workers never write
another worker's keys, nor take over another's entries. A claim takes a request's record (OWN:
sets ``owner``, copies the request's log into the claimant's log hash, never writing another
worker's) only when its owner released it or was fenced; a record a live owner holds (an entry
delivered twice after an AOF loss) is left to it. Every round of a worker is one STEP script
that first checks the fence: a fenced worker writes nothing. Scripts run atomically, so a
round is either entirely before the fence (and the new owner resumes after everything it
published) or refused.

Why scripts and not a pipeline: the check and the writes must be one atomic step, and one
EVALSHA per round replaces one HSET and one PUBLISH per request (bench-e2e measured 2.1
commands per token with the per-request pipeline; see benchmarks/fleet.py).
"""

from __future__ import annotations

from protos.keys import FENCE_MARK, RECORD_LEASE_S, LogField, Record

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
#   LOG    request_id, first seq, k, k events (each framed as a one-event TokenEventBatch)
#                                                    logged as {request_id}:{seq}, then published
#   PROG   request_id, Progress bytes
#   ADMIT  request_id, prompt tokens, notice        the count into its record while this worker owns
#                                                    it, and the framed notice (TokenEventBatch.admitted)
#                                                    published with the round
#   PUB    framed event                              published only (errors; the round's room)
#   END    request_id (or ''), record key (or ''), final seq (or ''), ttl ms, stream, entry id
#   DROP   log field names whose results expired
# Returns {'fenced'} (nothing was written: a sweeper judged this worker dead) or {'ok'}.
# Why the worker frames the events: per event the script then appends a string to the message
# where it built a varint and a field in Lua, and it filters nothing per request (measured on a
# 2-core EPYC, 64 requests a round: 368 -> ~270 us per call, Redis CPU 8.2 -> ~6 us per token).
# Field names stay built here: sent whole they cost ~40 more bytes per token for no CPU saved.
STEP = _LIB + f"""
local prefix, me = ARGV[1], ARGV[2]
local group = prefix .. ':workers'
local log, out = prefix .. ':log:' .. me, prefix .. ':out:' .. me
if redis.call('SISMEMBER', prefix .. ':fence:' .. me, '{FENCE_MARK}') == 1 then return {{'fenced'}} end
local i = 3
local n = tonumber(ARGV[i])
local reown_at = i + 1
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
if #msg > 0 then redis.call('PUBLISH', out, table.concat(msg)) end
return {{'ok'}}
"""

# Take the records of claimed entries. KEYS: own log hash. ARGV: consumer name, key prefix,
# then (request_id, record key, entry id) per entry. Per entry it returns
#   {state, deliveries, progress or false, events...}
# state: 'own' (run it; events = its logged chunks, in seq order, for a resume),
# 'stale' (the record names another attempt: acknowledge and drop), 'finished' (its final is
# logged: acknowledge and drop), 'busy' (another worker holds the record and is not fenced: an
# entry delivered again after an AOF loss; left pending, looked at again by reconciliation).
# deliveries counts takeovers from owners that died holding the request, across every attempt
# of the request id (the sweeper counts those it queues again; OWN a fenced owner's record).
OWN = _LIB + f"""
local mine, me, prefix = KEYS[1], ARGV[1], ARGV[2]
local reply = {{}}
for i = 3, #ARGV, 3 do
  local rid, rec, entry = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local f = redis.call('HMGET', rec, '{Record.ENTRY}', '{Record.OWNER}', '{Record.LOG}', '{Record.FINAL}',
                       '{Record.DELIVERIES}')
  local deliveries = tonumber(f[5] or '0')
  local owner, from = f[2] or '', f[3]
  local held = owner ~= '' and owner ~= me
  if f[1] and f[1] ~= entry then
    reply[#reply + 1] = {{'stale', deliveries, false}}
  elseif f[4] then
    reply[#reply + 1] = {{'finished', deliveries, false}}
  elseif held and redis.call('SISMEMBER', prefix .. ':fence:' .. owner, '{FENCE_MARK}') == 0 then
    reply[#reply + 1] = {{'busy', deliveries, false}}
  else
    if held then deliveries = redis.call('HINCRBY', rec, '{Record.DELIVERIES}', 1) end
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

HEARTBEAT = _LIB + f"""
local registry, fence, beat, log, models = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local me, ttl, log_ttl, model = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
if redis.call('SISMEMBER', fence, '{FENCE_MARK}') == 1 then return 0 end
local now = now_ms()
-- ZADD answers 1 only for a new member: this worker's first beat, or a Redis that came back
-- without it. The model and the log's TTL are written then (a sweeper removes the model with the
-- member), and the log's TTL also when the worker asks (ARGV[5] = '1': every few seconds), so a
-- steady beat costs two commands fewer (bench-fleet --commands).
local new = redis.call('ZADD', registry, now + ttl, me) == 1
if new then redis.call('HSET', models, me, model) end
if new or ARGV[5] == '1' then redis.call('PEXPIRE', log, log_ttl) end
if #ARGV > 5 then redis.call('HSET', beat, unpack(ARGV, 6, #ARGV)) end
redis.call('PEXPIRE', beat, ttl)
return now
"""
