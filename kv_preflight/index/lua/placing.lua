-- A new prefix's placement, claimed for the fleet (kv_preflight/index/routed.py ``claim``). Gateways deciding new
-- prefixes at the same moment all read the same state (the same footprints, before any of their homes land) and
-- would all pick the same pod; this script counts what was placed within the last moment besides.
-- KEYS[1]: the claims (HASH prefix -> pod); KEYS[2]: when each claim lapses (ZSET prefix -> Valkey ms); KEYS[3]:
-- the placements of the last moment (ZSET prefix (8 bytes) .. blocks (10 digits) .. pod -> Valkey ms); KEYS[4]:
-- when each pod was last claimed (ZSET pod -> Valkey ms). All tagged {placing}: one slot, so this runs on a
-- cluster as is.
-- ARGV[1]: the prefix (its first request key, 8 bytes); ARGV[2]: how long a claim lives (ms); ARGV[3]: how long a
-- placement counts besides the caller's footprints (ms: until every gateway's reads see its home); ARGV[4]: the
-- prefix's blocks; ARGV[5..]: pod, footprint (blocks of other prefixes homed there, as the caller read them), for
-- each pod the prefix may go to, in the caller's order of preference.
-- A live claim of the prefix is answered as it stands (a burst of one new prefix over N gateways goes to one pod).
-- Else the pod with the fewest blocks, its footprint plus the placements of the last moment there, is claimed and
-- answered; ties to the pod claimed least lately, then the caller's order. Lapsed claims leave first (at most 64
-- a call); the keys expire 2 x the claim TTL after the last write.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, moment, blocks = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local lapsed = redis.call('ZRANGE', KEYS[2], '-inf', now, 'BYSCORE', 'LIMIT', 0, 64)
if #lapsed > 0 then
  redis.call('HDEL', KEYS[1], unpack(lapsed))
  redis.call('ZREM', KEYS[2], unpack(lapsed))
end
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held then
  return held
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - moment)
local extra = {}
for _, m in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
  local pod = string.sub(m, 19)
  extra[pod] = (extra[pod] or 0) + tonumber(string.sub(m, 9, 18))
end
local pod, best = nil, nil
for i = 5, #ARGV - 1, 2 do
  local p = ARGV[i]
  local key = {tonumber(ARGV[i + 1]) + (extra[p] or 0), tonumber(redis.call('ZSCORE', KEYS[4], p) or '-1')}
  if best == nil or key[1] < best[1] or (key[1] == best[1] and key[2] < best[2]) then
    pod, best = p, key
  end
end
redis.call('HSET', KEYS[1], ARGV[1], pod)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('ZADD', KEYS[3], now, ARGV[1] .. string.format('%010d', blocks) .. pod)
local newest = redis.call('ZREVRANGE', KEYS[4], 0, 0, 'WITHSCORES')[2]
redis.call('ZADD', KEYS[4], math.max(now, tonumber(newest or '0') + 1), pod)  -- after the last, even in its ms
for i = 1, 4 do
  redis.call('PEXPIRE', KEYS[i], 2 * math.max(ttl, moment))
end
return pod
