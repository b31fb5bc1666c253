"""The Lua scripts of the Redis backends: each decision is one script, run atomically by Redis.

Every script touches the keys of ONE job only, all under the job's hash tag, so that on a Redis
Cluster it runs on the one node that owns the job (no ``CROSSSLOT``). Times are the server's
(``TIME``), never an instance's: ``now`` below is the node's clock in milliseconds.

Numbers travel as decimal strings (``'%.0f'``): Lua numbers are doubles, exact for every slot
and epoch millisecond, but ``tostring`` would print large ones in exponent notation.

A run in ``<job>:runs`` (field: the slot in ms) is a JSON object of strings: ``state``
(``running`` or ``handover``), ``token``, ``run_id``, ``instance_id``, ``attempt``,
``reason``, ``started`` (ms, the scheduler's clock, for the history) and ``expires`` (ms, the
server's clock). A run that ends is deleted: the fences in ``<job>:job`` keep its slot claimed.

A claim (``CLAIM``, ``ACQUIRE``) that would win, and a take-over (``COMMIT_TAKE_OVER``) that
would restart a run, first pass the eviction guard (``_GUARD``), in the same atomic step.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE",
    "CLAIM",
    "CLOCKED",
    "COMMIT_TAKE_OVER",
    "FLEET_MEMORY",
    "FLEET_SWAP",
    "RECORD",
    "RELEASE",
    "RENEW",
    "SCAN_RUNS",
]

# Every script that reads the clock takes one more first argument, removed here: a store time
# in ms that replaces ``TIME`` ('' in production: the conformance suite's protocol check drives
# the clock virtually through it).
_NOW = """
local store_time = table.remove(ARGV, 1)
local function now_ms()
  if store_time ~= '' then return tonumber(store_time) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function num(value)
  return string.format('%.0f', value)
end
"""

# The eviction guard. A claim rests on keys being there: a claim key, a fence, a live lease. Only
# eviction makes Redis drop such a key before its time (besides a restart without an append-only
# file, or a hand), and Redis evicts only under a maxmemory-policy other than noeviction, and
# counts every key it evicts (evicted_keys in INFO stats; since the server started or CONFIG
# RESETSTAT). So, read in the same atomic step as the decision (no eviction can come between):
# * an evicting policy refuses the decision, and nothing is written: {'evicting', policy};
# * otherwise the count must be what it was at the job's record (KEYS: <job>:evictions, a hash:
#   count, and since: when, on the server's clock, a decision first saw that count) since
#   before `start`, the earliest time a key this decision rests on can have been written: no
#   key of the job was evicted since then. A count not seen before (a policy that was evicting,
#   and is noeviction again) is noted as seen now: decisions resting on keys written before
#   are refused {'evicted', count, since}; slots of later times pass. A record made while the
#   count is 0 says "since ever" (0): nothing was ever evicted.
# INFO refused (an ACL, a renamed command) leaves the decision unguarded, as a start that
# could not read the policy warned. The record carries no TTL: an evicting policy other than
# allkeys-* cannot evict it, and evicting it moves the count.
_GUARD = """
local function info_field(section, name)
  local info = redis.pcall('INFO', section)
  if type(info) ~= 'string' then return nil end
  local at = string.find(info, '\\n' .. name .. ':', 1, true)
  if not at then return nil end
  return string.match(info, '^[%w%-]+', at + #name + 2)
end
local function eviction_guard(record, start, now)
  local policy = info_field('memory', 'maxmemory_policy')
  if policy and policy ~= 'noeviction' then return {'evicting', policy} end
  local count = info_field('stats', 'evicted_keys')
  if not count then return nil end
  local seen = redis.call('HMGET', record, 'count', 'since')
  local since = tonumber(seen[2])
  if seen[1] ~= count then
    since = now
    if not seen[1] and count == '0' then since = 0 end
    redis.call('HSET', record, 'count', count, 'since', num(since))
  end
  if since <= start then return nil end
  return {'evicted', count, num(since)}
end
"""

#: KEYS: the claim, the job's evictions record. ARGV: the claim's value, its memory (ms), the
#: earliest time (ms) a claim of the slot can have been made. Returns {'won'}, {'lost'} (the
#: key was there) or the guard's refusal (``_GUARD``): ``SET NX PX`` behind the guard, which
#: only a claim that would win pays for.
CLAIM = (
    _NOW
    + _GUARD
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'lost'} end
local refused = eviction_guard(KEYS[2], tonumber(ARGV[3]), now_ms())
if refused then return refused end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {'won'}
"""
)

# Newest first; trimmed to the size, then (with a cutoff) from the oldest end while the oldest
# started before the cutoff; the whole list expires history_ttl after its last write, when
# every record in it is older than that. An entry is "<started_ms>:<RunRecord JSON>".
_PUSH = """
local function push(key, entry, size, cutoff, ttl)
  redis.call('LPUSH', key, entry)
  redis.call('LTRIM', key, 0, tonumber(size) - 1)
  if cutoff ~= '' then
    local oldest = tonumber(cutoff)
    while true do
      local tail = redis.call('LINDEX', key, -1)
      if not tail then break end
      local started = tonumber(string.match(tail, '^(%-?%d+):'))
      if started and started >= oldest then break end
      redis.call('RPOP', key)
    end
  end
  if ttl ~= '' then
    redis.call('PEXPIRE', key, ttl)
  end
end
"""

#: KEYS: history. ARGV: entry, history_size, cutoff ms or '', history_ttl ms or ''.
RECORD = (
    _PUSH
    + """
push(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
return 1
"""
)

#: KEYS: job, runs, evictions. ARGV: slot, reason, allow ('1': overlap allowed), ttl ms, max
#: skew ms, token, run_id, instance_id, started ms. Returns {status, now}: status 'granted',
#: 'overlap', 'not-acquired' or 'skew' (the slot is further ahead of the server's clock than the
#: skew); or, instead of a grant, the guard's refusal (``_GUARD``: a fence of the slot was
#: written from the slot less the skew on, and a live lease that overlap rests on within the
#: last ttl, as its runner notices an evicted lease at its next renewal).
#: Mirrors MemoryBackend.acquire: the fence of the reason (manual runs have their own), a
#: catch-up only for a job claimed before, a slot whose run is still there, overlap.
ACQUIRE = (
    _NOW
    + _GUARD
    + """
local now = now_ms()
local slot = tonumber(ARGV[1])
if slot > now + tonumber(ARGV[5]) then
  return {'skew', num(now)}
end
local reason = ARGV[2]
local field = 'fence'
if reason == 'manual' then field = 'manual' end
local fence = redis.call('HGET', KEYS[1], field)
if fence and slot <= tonumber(fence) then
  return {'not-acquired', num(now)}
end
if reason == 'catch-up' and not fence then
  return {'not-acquired', num(now)}
end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  return {'not-acquired', num(now)}
end
if ARGV[3] ~= '1' then
  local runs = redis.call('HVALS', KEYS[2])
  for i = 1, #runs do
    local run = cjson.decode(runs[i])
    if run.state == 'running' and tonumber(run.expires) > now then
      return {'overlap', num(now)}
    end
  end
end
local start = math.min(slot - tonumber(ARGV[5]), now - tonumber(ARGV[4]))
local refused = eviction_guard(KEYS[3], start, now)
if refused then return refused end
redis.call('HSET', KEYS[1], field, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode({
  state = 'running', token = ARGV[6], run_id = ARGV[7], instance_id = ARGV[8],
  attempt = '1', reason = reason, started = ARGV[9], expires = num(now + tonumber(ARGV[4]))
}))
return {'granted', num(now)}
"""
)

#: KEYS: runs. ARGV: slot, token, ttl ms. 1 when renewed; 0 when expired or another token's.
RENEW = (
    _NOW
    + """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local run = cjson.decode(raw)
local now = now_ms()
if run.token ~= ARGV[2] or run.state ~= 'running' or tonumber(run.expires) <= now then
  return 0
end
run.expires = num(now + tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(run))
return 1
"""
)

#: KEYS: runs (, history). ARGV: slot, token, handover ('1') (, the run's history entry,
#: history_size, cutoff ms or '', history_ttl ms or ''). A stale token touches nothing. A
#: finished run is deleted; a handed-over one stays, expired now, for take_over; with a history
#: key, the run's record is pushed in the same step.
RELEASE = (
    _NOW
    + _PUSH
    + """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local run = cjson.decode(raw)
if run.token ~= ARGV[2] then return 0 end
if ARGV[3] == '1' then
  run.state = 'handover'
  run.expires = num(now_ms())
  redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(run))
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
if KEYS[2] then
  push(KEYS[2], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
end
return 1
"""
)

#: KEYS: job, runs. Returns {now, fence or '', manual fence or '', slot, run, slot, run...}:
#: every run of the job. Read-only: the take-over is decided by the caller with the lease
#: protocol (``_lease.decide``) and committed by COMMIT_TAKE_OVER.
SCAN_RUNS = (
    _NOW
    + """
local out = {num(now_ms()), redis.call('HGET', KEYS[1], 'fence') or '',
  redis.call('HGET', KEYS[1], 'manual') or ''}
local runs = redis.call('HGETALL', KEYS[2])
for i = 1, #runs do out[#out + 1] = runs[i] end
return out
"""
)

#: KEYS: job, runs, history, evictions. ARGV: the fence and manual fence SCAN_RUNS saw ('' for
#: none), ttl ms, history_size, cutoff ms or '', history_ttl ms or '', overlap skip ('1' or
#: '0'), then 8 per dead run: slot, its token, the new token ('' drops the run), run_id,
#: instance_id, attempt, started ms, the interrupted record's history entry ('' for none).
#: Returns {'ok', the slots committed...}, or the guard's refusal (``_GUARD``, over the last
#: ttl: a live lease the overlap check rests on) when a run would be restarted.
#:
#: Optimistic: nothing is written if a fence moved since the scan (the decision whether a slot
#: is still the latest may be wrong), or, with overlap skip, if a restart would overlap a run
#: that is live now; and a run is only re-granted or dropped if it still holds the token seen
#: and is still dead. A re-grant changes the token and a drop deletes the run, so each dead run
#: is taken over, and its lost attempt recorded, by exactly one caller, in the same atomic step.
COMMIT_TAKE_OVER = (
    _NOW
    + _PUSH
    + _GUARD
    + """
local fence = redis.call('HGET', KEYS[1], 'fence') or ''
local manual = redis.call('HGET', KEYS[1], 'manual') or ''
if fence ~= ARGV[1] or manual ~= ARGV[2] then return {'ok'} end
local now = now_ms()
local ttl = tonumber(ARGV[3])
local restarting = {}
for i = 8, #ARGV, 8 do
  if ARGV[i + 2] ~= '' then restarting[ARGV[i]] = true end
end
if ARGV[7] == '1' then
  local runs = redis.call('HGETALL', KEYS[2])
  for i = 1, #runs, 2 do
    local run = cjson.decode(runs[i + 1])
    if next(restarting) and not restarting[runs[i]] and run.state == 'running'
        and tonumber(run.expires) > now then
      return {'ok'}
    end
  end
end
if next(restarting) then
  local refused = eviction_guard(KEYS[4], now - ttl, now)
  if refused then return refused end
end
local done = {'ok'}
for i = 8, #ARGV, 8 do
  local slot = ARGV[i]
  local raw = redis.call('HGET', KEYS[2], slot)
  if raw then
    local run = cjson.decode(raw)
    local dead = run.state == 'handover' or tonumber(run.expires) <= now
    if run.token == ARGV[i + 1] and dead then
      if ARGV[i + 2] ~= '' then
        redis.call('HSET', KEYS[2], slot, cjson.encode({
          state = 'running', token = ARGV[i + 2], run_id = ARGV[i + 3],
          instance_id = ARGV[i + 4], attempt = ARGV[i + 5], reason = 'retry',
          started = ARGV[i + 6], expires = num(now + ttl)
        }))
      else
        redis.call('HDEL', KEYS[2], slot)
      end
      if ARGV[i + 7] ~= '' then
        push(KEYS[3], ARGV[i + 7], ARGV[4], ARGV[5], ARGV[6])
      end
      done[#done + 1] = slot
    end
  end
end
return done
"""
)

#: The scripts whose first argument is the store time override (see ``_NOW``).
CLOCKED = frozenset(
    ("ACQUIRE", "CLAIM", "RENEW", "RELEASE", "SCAN_RUNS", "COMMIT_TAKE_OVER", "FLEET_MEMORY")
)

#: KEYS: the fleet's slot memory record (a hash). ARGV: this instance's slot_ttl ms, the
#: clock skew ms. Makes the record (``created_ms``: now) when there is none, or raises its memory
#: to this slot_ttl when that is longer, noting the raise as {at, from} in ``raises`` (those
#: that can no longer limit a claim dropped: see ``_slotmemory.FleetMemory.raised``). Never lowers
#: it. Returns {memory, raises, created, the memory before ('0': no record)}.
FLEET_MEMORY = (
    _NOW
    + """
local now = now_ms()
local wanted = tonumber(ARGV[1])
local skew = tonumber(ARGV[2])
local memory = tonumber(redis.call('HGET', KEYS[1], 'memory_ms') or '0')
local before = memory
local raises = cjson.decode(redis.call('HGET', KEYS[1], 'raises') or '[]')
local created = redis.call('HGET', KEYS[1], 'created_ms')
if memory == 0 then
  created = num(now)
  raises = {}
  memory = wanted
  redis.call('HSET', KEYS[1], 'memory_ms', num(memory), 'raises', '[]', 'created_ms', created)
elseif wanted > memory then
  local kept = {}
  for i = 1, #raises do
    if tonumber(raises[i][1]) + skew + tonumber(raises[i][2]) > now then
      kept[#kept + 1] = raises[i]
    end
  end
  kept[#kept + 1] = {num(now), num(memory)}
  raises = kept
  memory = wanted
  redis.call('HSET', KEYS[1], 'memory_ms', num(memory), 'raises', cjson.encode(raises))
end
return {num(memory), cjson.encode(raises), created or '0', num(before)}
"""
)

#: KEYS: a hash of the fleet's records (``_fleet``). ARGV: the field, the value it must hold
#: ('' for none), the new value. Compare-and-set: 1 when written, 0 when it held another.
FLEET_SWAP = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held == false then held = '' end
if held ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""
