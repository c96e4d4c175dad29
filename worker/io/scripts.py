"""The worker's Lua scripts: every write it makes for a request is fenced in the same round trip.

Ownership (protos/keys.py, "Fencing"): a worker process is one consumer of the group, named
``{worker_id}.{incarnation}``. It is alive while its heartbeat hash exists (HEARTBEAT renews it
and its registry score). A gateway's sweeper that finds a consumer dead fences it (the mark in
its fence set) and queues its entries again (gateway/sweeper.py): workers never write
another worker's keys, nor take over another's entries, and write no request record (only
gateways do). What a worker says about a request is in its own log hash: OWN copies the request's
log from the log its record names and marks the entry it holds (HELD), never writing another
worker's; a request another worker holds, unfenced, is left to it (an entry delivered twice after
an AOF loss). Every round of a worker is one STEP script that first checks the fence: a fenced
worker writes nothing. Scripts run atomically, so a round is either entirely before the fence
(and the new owner resumes after everything it published) or refused.

Why scripts and not a pipeline: the check and the writes must be one atomic step, and one
EVALSHA per round replaces one HSET and one PUBLISH per request (bench-e2e measured 2.1
commands per token with the per-request pipeline; see benchmarks/fleet.py).
"""

from __future__ import annotations

from protos.keys import FENCE_MARK, LogField, Record

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
#   LOG    request_id, first seq, k, k events (each framed as a one-event TokenEventBatch)
#                                                    logged as {request_id}:{seq}, then published
#   PROG   request_id, Progress bytes
#   ADMIT  request_id, prompt tokens, notice        the count into this worker's log, and the framed
#                                                    notice (TokenEventBatch.admitted) published
#   PUB    framed event                              published only (errors; the round's room)
#   END    request_id (or ''), record key (or ''), final seq (or ''), stream, entry id
#   DROP   log field names whose results expired
# Returns {'fenced'} (nothing was written: a sweeper judged this worker dead) or {'ok', stream,
# entry, ...}: the entries of ended attempts left pending because no gateway has seen this worker
# hold them yet (their record does not name this log). gateway/sources.py VERIFY judges that from
# the pending list, which an XACK would empty: it would refuse a final or an error published with
# the XACK. The worker ends them again in a later round (record '': acknowledged all the same).
# Why the worker frames the events: per event the script then appends a string to the message
# where it built a varint and a field in Lua, and it filters nothing per request (measured on a
# 2-core EPYC, 64 requests a round: 368 -> ~270 us per call, Redis CPU 8.2 -> ~6 us per token).
# Field names stay built here: sent whole they cost ~40 more bytes per token for no CPU saved.
STEP = _LIB + f"""
local prefix, me = ARGV[1], ARGV[2]
local group = prefix .. ':workers'
local log, out = prefix .. ':log:' .. me, prefix .. ':out:' .. me
if redis.call('SISMEMBER', prefix .. ':fence:' .. me, '{FENCE_MARK}') == 1 then return {{'fenced'}} end
local flat, msg, left = {{}}, {{}}, {{'ok'}}
local i = 3
local n = tonumber(ARGV[i]); i = i + 1
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
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  flat[#flat + 1] = ARGV[i] .. '{LogField.PROMPT}'; flat[#flat + 1] = ARGV[i + 1]
  msg[#msg + 1] = ARGV[i + 2]
  i = i + 3
end
n = tonumber(ARGV[i])
for j = i + 1, i + n do msg[#msg + 1] = ARGV[j] end
i = i + 1 + n
n = tonumber(ARGV[i]); i = i + 1
local ended = {{}}
for _ = 1, n do
  local rid, rec, final, stream, entry = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  i = i + 5
  if final ~= '' then
    flat[#flat + 1] = rid .. '{LogField.FINAL}'; flat[#flat + 1] = final
  elseif rid ~= '' then
    redis.call('HDEL', log, rid .. '{LogField.HELD}')
  end
  if rec == '' or redis.call('HGET', rec, '{Record.LOG}') == log then
    ended[#ended + 1] = {{stream, entry}}
  else
    left[#left + 1] = stream; left[#left + 1] = entry
  end
end
if #flat > 0 then hset_all(log, flat) end
for _, e in ipairs(ended) do
  redis.call('XACK', e[1], group, e[2])
  redis.call('XDEL', e[1], e[2])
end
n = tonumber(ARGV[i]); i = i + 1
if n > 0 then hdel_all(log, {{unpack(ARGV, i, i + n - 1)}}) end
if #msg > 0 then redis.call('PUBLISH', out, table.concat(msg)) end
return left
"""

# Take the records of claimed entries. KEYS: own log hash. ARGV: consumer name, key prefix,
# then (request_id, record key, entry id) per entry. Per entry it returns
#   {state, deliveries, progress or false, events...}
# state: 'own' (run it; events = its logged chunks, in seq order, for a resume),
# 'stale' (the record names another attempt: acknowledge and drop), 'finished' (its final is
# logged: acknowledge and drop), 'busy' (another worker holds the request and is not fenced: an
# entry delivered again after an AOF loss; left pending, looked at again by reconciliation).
# The request's log is the one its record names (gateways write records: a log a gateway saw
# hold the request), or this worker's own when it names none. The claim writes only this
# worker's log: the copied events and HELD (the entry). deliveries counts takeovers from owners
# that died holding the request, across every attempt (the sweeper counts them).
OWN = _LIB + f"""
local mine, me, prefix = KEYS[1], ARGV[1], ARGV[2]
local log_mark = prefix .. ':log:'
local reply = {{}}
for i = 3, #ARGV, 3 do
  local rid, rec, entry = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local f = redis.call('HMGET', rec, '{Record.ENTRY}', '{Record.LOG}', '{Record.DELIVERIES}')
  local deliveries = tonumber(f[3] or '0')
  local from = f[2] or mine
  local other = from ~= mine
  local h = redis.call('HMGET', from, rid .. '{LogField.HELD}', rid .. '{LogField.FINAL}',
                       rid .. '{LogField.NEXT}')
  if f[1] and f[1] ~= entry then
    reply[#reply + 1] = {{'stale', deliveries, false}}
  elseif h[2] then
    reply[#reply + 1] = {{'finished', deliveries, false}}
  elseif other and h[1] and redis.call('SISMEMBER', prefix .. ':fence:' .. string.sub(from, #log_mark + 1),
                                       '{FENCE_MARK}') == 0 then
    reply[#reply + 1] = {{'busy', deliveries, false}}
  else
    local nxt = tonumber(h[3] or '0')
    local names = {{}}
    for s = 0, nxt - 1 do names[#names + 1] = rid .. ':' .. s end
    names[#names + 1] = rid .. '{LogField.PROGRESS}'
    names[#names + 1] = rid .. '{LogField.NEXT}'
    local values = redis.call('HMGET', from, unpack(names))
    local flat = {{rid .. '{LogField.HELD}', entry}}
    if other then
      for j, name in ipairs(names) do
        if values[j] then flat[#flat + 1] = name; flat[#flat + 1] = values[j] end
      end
    end
    hset_all(mine, flat)
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
