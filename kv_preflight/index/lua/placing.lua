-- A new prefix's placement, claimed for the fleet (kv_preflight/index/routed.py ``claim``). Gateways deciding new
-- prefixes at the same moment all read the same state (every pod equally empty, equally idle, before any of their
-- homes or bookings land) and would all pick the same pod; this script hands each such placement a pod in turn.
-- KEYS[1]: the claims (HASH prefix -> pod, and "n" -> the turn counter); KEYS[2]: when each claim lapses (ZSET
-- prefix -> Valkey ms). Both tagged {placing}: one slot, so this runs on a cluster as is.
-- ARGV[1]: the prefix (its first request key, 8 bytes); ARGV[2]: how long a claim lives (ms); ARGV[3]: n, the
-- number of pods the prefix may go to; ARGV[4..3+n]: those pods, in an order every gateway shares (by name);
-- ARGV[4+n..]: those of them equally good for it. A live claim of the prefix is answered as it stands (a burst of
-- one new prefix over N gateways goes to one pod); else the turn counter names a place in the shared order, and
-- the first equally good pod from there on is claimed and answered: gateways whose equally good pods differ a
-- little (each counts its own requests not yet written) still take different pods. Lapsed claims leave first (at
-- most 64 a call); the keys expire 2 x the claim TTL after the last write.
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
local turn = redis.call('HINCRBY', KEYS[1], 'n', 1)
local n = tonumber(ARGV[3])
local good = {}
for i = 4 + n, #ARGV do
  good[ARGV[i]] = true
end
local pod = ARGV[4 + n]
for i = 0, n - 1 do
  local candidate = ARGV[4 + (turn + i) % n]
  if good[candidate] then
    pod = candidate
    break
  end
end
redis.call('HSET', KEYS[1], ARGV[1], pod)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
redis.call('PEXPIRE', KEYS[2], 2 * ttl)
return pod
