-- A pod's bookings: requests gateways routed to it and have in flight, each with its cost in tokens
-- (kv_preflight/index/routed.py). KEYS[1]: the bookings (ZSET id -> expiry, Valkey ms); KEYS[2]: the totals
-- (HASH n, tokens, and id -> cost). Both in the pod's slot (hash tag), so this runs on a cluster as is.
-- ARGV[1]: the operation; then its arguments:
--   book ID COST TTL_MS      a new booking (an ID already booked is left as it is)
--   renew TTL_MS ID...       bookings still running: their expiry moved to now + TTL_MS (gone ones stay gone)
--   release ID...            requests done: their bookings and their costs leave the totals
-- Every operation first drops expired bookings (booked_drop.lua). Answers {n, tokens}. The keys expire
-- 2 x TTL after their last write: an idle pod whose gateways are gone keeps nothing.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op = ARGV[1]
drop_expired(KEYS[1], KEYS[2], now)

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
  for i = 2, #ARGV do
    drop(KEYS[1], KEYS[2], ARGV[i])
  end
end
if ttl then
  redis.call('PEXPIRE', KEYS[1], 2 * ttl)
  redis.call('PEXPIRE', KEYS[2], 2 * ttl)
end
local n, tokens = totals(KEYS[2])
return {n, tokens}
