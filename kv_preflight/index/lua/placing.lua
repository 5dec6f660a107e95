-- A new prefix's placement, claimed for the fleet (kv_preflight/index/routed.py ``claim``). Gateways deciding new
-- prefixes at the same moment all read the same state (every pod equally empty, equally idle, before any of their
-- homes or bookings land) and would all pick the same pod; this script hands them the equally good pods the
-- least recently claimed first, so a burst of distinct new prefixes spreads over them even where each gateway's
-- set of equally good pods differs a little (each counts its own requests not yet written).
-- KEYS[1]: the claims (HASH prefix -> pod); KEYS[2]: when each claim lapses (ZSET prefix -> Valkey ms); KEYS[3]:
-- when each pod was last claimed (ZSET pod -> Valkey ms). All tagged {placing}: one slot, so this runs on a
-- cluster as is.
-- ARGV[1]: the prefix (its first request key, 8 bytes); ARGV[2]: how long a claim lives (ms); ARGV[3..]: the pods
-- equally good for it, in an order every gateway shares (by name: the first of those never claimed goes first).
-- A live claim of the prefix is answered as it stands (a burst of one new prefix over N gateways goes to one pod);
-- else the equally good pod claimed least lately is claimed and answered. Lapsed claims leave first (at most 64 a
-- call); the keys expire 2 x the claim TTL after the last write.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local lapsed = redis.call('ZRANGE', KEYS[2], '-inf', now, 'BYSCORE', 'LIMIT', 0, 64)
if #lapsed > 0 then
  redis.call('HDEL', KEYS[1], unpack(lapsed))
  redis.call('ZREM', KEYS[2], unpack(lapsed))
end
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held then
  return held
end
local pod, oldest = nil, nil
for i = 3, #ARGV do
  local at = tonumber(redis.call('ZSCORE', KEYS[3], ARGV[i]) or '-1')
  if oldest == nil or at < oldest then
    pod, oldest = ARGV[i], at
  end
end
redis.call('HSET', KEYS[1], ARGV[1], pod)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
local newest = redis.call('ZREVRANGE', KEYS[3], 0, 0, 'WITHSCORES')[2]
redis.call('ZADD', KEYS[3], math.max(now, tonumber(newest or '0') + 1), pod)  -- after the last, even in its ms
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
redis.call('PEXPIRE', KEYS[2], 2 * ttl)
redis.call('PEXPIRE', KEYS[3], 2 * ttl)
return pod
