"""The Lua scripts of the Redis solution cache (``redis_backend``): each runs atomically, so a
record, its index entries, the LRU order and the byte count never disagree.

Keys, with the prefix ``sigprop:``: ``sol:{key}`` (the record's hash), ``index`` and
``index:method:{m}`` / ``index:activation:{a}`` (key by creation time), ``lru`` (key by last use:
creation or last hit), ``bytes`` (the sum of the records' ``size`` fields). Eviction reaches the
indexes of the records it removes by name, so these scripts assume one Redis, not a cluster.

Writes that Redis may refuse (OOM under ``maxmemory`` + ``noeviction``, READONLY on a replica) are
``redis.pcall``'d on the hit path: a hit is served even when its counter cannot be written.
"""

# KEYS: sol, lru. ARGV: key, now. -> {answer, digest, note}; note: '' | 'refused' | 'repaired' |
# 'unreadable' (the key holds something other than a hash).
_HIT = """
local function count_hit()
  local n = redis.pcall('hincrby', KEYS[1], 'hits', 1)
  if type(n) == 'table' and n.err then
    if string.find(n.err, 'not an integer', 1, true) or string.find(n.err, 'overflow', 1, true) then
      redis.pcall('hset', KEYS[1], 'hits', '1')  -- a damaged counter restarts rather than failing the hit
      return 'repaired'
    end
    return 'refused'
  end
  redis.pcall('zadd', KEYS[2], 'XX', ARGV[2], ARGV[1])
  return ''
end
"""

GET_ANSWER = (
    _HIT
    + """
local a = redis.pcall('hmget', KEYS[1], 'answer', 'digest')
if a.err then return {false, false, 'unreadable'} end
if not a[1] then return {false, false, ''} end
return {a[1], a[2], count_hit()}
"""
)

# KEYS: sol, lru. ARGV: key, now, '1' to count a hit. -> {flat hgetall, note}
GET_ALL = (
    _HIT
    + """
local t = redis.call('type', KEYS[1]).ok
if t ~= 'hash' then return {{}, t == 'none' and '' or 'unreadable'} end
local note = ''
if ARGV[3] == '1' then note = count_hit() end
return {redis.call('hgetall', KEYS[1]), note}
"""
)

# Hit counts written in a batch (``hot.HotAnswers.flush``): records deleted meanwhile are skipped,
# never re-created, and so are records stored again since (another creation time). KEYS: lru, then
# sol:{key} of each counted key. ARGV: per key: key, hits, time of the last hit, the record's
# creation time as read. -> how many counts Redis refused (full, read-only)
COUNT_HITS = """
local refused = 0
for i = 2, #KEYS do
  local j = (i - 2) * 4
  if redis.call('type', KEYS[i]).ok == 'hash' and redis.call('hget', KEYS[i], 'created') == ARGV[j + 4] then
    local n = redis.pcall('hincrby', KEYS[i], 'hits', ARGV[j + 2])
    local ok = not (type(n) == 'table' and n.err)
    if not ok and (string.find(n.err, 'not an integer', 1, true) or string.find(n.err, 'overflow', 1, true)) then
      ok = not redis.pcall('hset', KEYS[i], 'hits', ARGV[j + 2]).err  -- a damaged counter restarts
    end
    if ok then redis.pcall('zadd', KEYS[1], 'XX', ARGV[j + 3], ARGV[j + 1]) else refused = refused + 1 end
  end
end
return refused
"""

# Removes one record with its index entries and its bytes. ARGV: prefix, key. -> 1 if it existed
_DROP = """
local function drop(prefix, key)
  local k = prefix .. 'sol:' .. key
  local h = {false, false, false}
  if redis.call('type', k).ok == 'hash' then h = redis.call('hmget', k, 'method', 'activation', 'size') end
  local n = redis.call('del', k)
  redis.call('zrem', prefix .. 'index', key)
  redis.call('zrem', prefix .. 'lru', key)
  if h[1] then redis.call('zrem', prefix .. 'index:method:' .. h[1], key) end
  if h[2] then redis.call('zrem', prefix .. 'index:activation:' .. h[2], key) end
  local size = tonumber(h[3]) or 0
  if size ~= 0 then redis.call('incrby', prefix .. 'bytes', -size) end
  return n
end
"""

DELETE = _DROP + "return drop(ARGV[1], ARGV[2])"

# KEYS: sol, index, index:method:m, index:activation:a, lru, bytes.
# ARGV: prefix, key, created, size, max entries (0: none), max bytes (0: none), max evictions, then
# the record's field/value pairs. Writes the record (its first write is the one OOM refuses, so a
# refused put changes nothing), then evicts the least recently used others while over a bound.
# -> the number evicted
PUT = (
    _DROP
    + """
local t = redis.call('type', KEYS[1]).ok
local old = 0
if t == 'hash' then old = tonumber(redis.call('hget', KEYS[1], 'size')) or 0 end
local fields = {}
for i = 8, #ARGV do fields[#fields + 1] = ARGV[i] end
if t ~= 'hash' and t ~= 'none' then redis.call('del', KEYS[1]) end  -- a damaged entry of another type
redis.call('hset', KEYS[1], unpack(fields))
for i = 2, 5 do redis.call('zadd', KEYS[i], ARGV[3], ARGV[2]) end
local bytes = redis.call('incrby', KEYS[6], tonumber(ARGV[4]) - old)
local maxn, maxb, cap = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local evicted = 0
while evicted < cap and ((maxn > 0 and redis.call('zcard', KEYS[2]) > maxn) or (maxb > 0 and bytes > maxb)) do
  local victim = redis.call('zrange', KEYS[5], 0, 0)[1]
  if not victim or victim == ARGV[2] then
    -- only this record is left in the LRU order: the byte count drifted (keys removed by hand);
    -- it restarts from what is known to be stored
    if redis.call('zcard', KEYS[5]) <= 1 then redis.call('set', KEYS[6], ARGV[4]) end
    break
  end
  drop(ARGV[1], victim)
  bytes = tonumber(redis.call('get', KEYS[6])) or 0
  evicted = evicted + 1
end
return evicted
"""
)

# Once per Redis: records stored before the LRU order and the byte count existed get a size and an
# LRU entry (their creation time). HSETNX makes it safe to run twice or beside new puts.
# KEYS: index, lru, bytes. ARGV: prefix, start, count. -> rows read
BACKFILL = """
local rows = redis.call('zrange', KEYS[1], ARGV[2], tonumber(ARGV[2]) + tonumber(ARGV[3]) - 1, 'WITHSCORES')
for i = 1, #rows, 2 do
  local k = ARGV[1] .. 'sol:' .. rows[i]
  if redis.call('type', k).ok == 'hash' then
    local s = redis.call('hstrlen', k, 'answer') + redis.call('hstrlen', k, 'request') + redis.call('hstrlen', k, 'ids')
    if redis.call('hsetnx', k, 'size', s) == 1 then redis.call('incrby', KEYS[3], s) end
    redis.call('zadd', KEYS[2], 'NX', rows[i + 1], rows[i])
  end
end
return #rows / 2
"""

# Validation retention. KEYS: the validations index. ARGV: cutoff time (0: no age bound), max
# records (0: none), record prefix, per-solution index prefix, most removed per call. Only final
# validations (finished, failed, cancelled) are removed: an accepted job is never lost. -> removed
TRIM_VALIDATIONS = """
local victims = {}
local cap = tonumber(ARGV[5])
if tonumber(ARGV[1]) > 0 then
  victims = redis.call('zrangebyscore', KEYS[1], '-inf', '(' .. ARGV[1], 'LIMIT', 0, cap)
end
local over = tonumber(ARGV[2]) > 0 and redis.call('zcard', KEYS[1]) - tonumber(ARGV[2]) or 0
if over > 0 then
  for _, v in ipairs(redis.call('zrange', KEYS[1], 0, math.min(over, cap) - 1)) do victims[#victims + 1] = v end
end
local n = 0
for _, vid in ipairs(victims) do
  local h = redis.pcall('hmget', ARGV[3] .. vid, 'status', 'key')
  if h.err then
    redis.call('zrem', KEYS[1], vid)
  elseif h[1] == 'finished' or h[1] == 'failed' or h[1] == 'cancelled' then
    redis.call('del', ARGV[3] .. vid)
    redis.call('zrem', KEYS[1], vid)
    if h[2] then redis.call('zrem', ARGV[4] .. h[2], vid) end
    n = n + 1
  end
end
return n
"""
