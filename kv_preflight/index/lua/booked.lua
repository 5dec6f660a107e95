-- A pod's bookings: requests gateways routed to it and have in flight, each with its cost in tokens
-- (kv_preflight/index/routed.py). KEYS[1]: the bookings (ZSET id -> expiry, Valkey ms); KEYS[2]: the totals
-- (HASH n, tokens, and id -> cost). Both in the pod's slot (hash tag), so this runs on a cluster as is.
-- ARGV[1]: the operation; then its arguments:
--   book ID COST TTL_MS      a new booking (an ID already booked is left as it is)
--   renew TTL_MS ID...       bookings still running: their expiry moved to now + TTL_MS (gone ones stay gone)
--   release ID               a request done: its booking and its cost leave the totals
--   read                     the totals {n, tokens}
-- Every operation first drops expired bookings (a gateway that died), at most 256 a call, so the totals are
-- those of live bookings. Answers {n, tokens}. The keys expire 2 x TTL after their last write: an idle pod
-- whose gateways are gone keeps nothing.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op = ARGV[1]

local function drop(id)
  local cost = redis.call('HGET', KEYS[2], id)
  if redis.call('ZREM', KEYS[1], id) == 1 and cost then
    redis.call('HINCRBY', KEYS[2], 'n', -1)
    redis.call('HINCRBY', KEYS[2], 'tokens', -tonumber(cost))
  end
  redis.call('HDEL', KEYS[2], id)
end

for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 256)) do
  drop(id)
end

local ttl = nil
if op == 'book' then
  ttl = tonumber(ARGV[4])
  if redis.call('ZADD', KEYS[1], 'NX', now + ttl, ARGV[2]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
    redis.call('HINCRBY', KEYS[2], 'n', 1)
    redis.call('HINCRBY', KEYS[2], 'tokens', tonumber(ARGV[3]))
  end
elseif op == 'renew' then
  ttl = tonumber(ARGV[2])
  for i = 3, #ARGV do
    redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i])
  end
elseif op == 'release' then
  drop(ARGV[2])
end
if ttl then
  redis.call('PEXPIRE', KEYS[1], 2 * ttl)
  redis.call('PEXPIRE', KEYS[2], 2 * ttl)
end
local n, tokens = redis.call('HGET', KEYS[2], 'n'), redis.call('HGET', KEYS[2], 'tokens')
return {tonumber(n or '0'), tonumber(tokens or '0')}
