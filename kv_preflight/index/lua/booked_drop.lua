-- A pod's bookings (lua/booked.lua): BOOKINGS (ZSET id -> expiry, Valkey ms) and TOTALS (HASH n, tokens, id ->
-- cost), passed in (a read runs these for several pods at once: routed_read.lua). ``drop`` takes one booking out
-- of both; ``drop_expired`` every booking whose expiry has passed, at most 256 a call (a gateway that died leaves
-- them), so the totals are the live ones'.
local function drop(bookings, totals_key, id)
  local cost = redis.call('HGET', totals_key, id)
  if redis.call('ZREM', bookings, id) == 1 and cost then
    redis.call('HINCRBY', totals_key, 'n', -1)
    redis.call('HINCRBY', totals_key, 'tokens', -tonumber(cost))
  end
  redis.call('HDEL', totals_key, id)
end

local function drop_expired(bookings, totals_key, now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', bookings, '-inf', now, 'LIMIT', 0, 256)) do
    drop(bookings, totals_key, id)
  end
end

local function totals(totals_key)
  local n, tokens = redis.call('HGET', totals_key, 'n'), redis.call('HGET', totals_key, 'tokens')
  return tonumber(n or '0'), tonumber(tokens or '0')
end
