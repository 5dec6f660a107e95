-- A pod's bookings (lua/booked.lua): KEYS[1] the bookings (ZSET id -> expiry, Valkey ms), KEYS[2] their totals
-- (HASH n, tokens, id -> cost). ``drop`` takes one booking out of both; ``drop_expired`` every booking whose
-- expiry has passed, at most 256 a call (a gateway that died leaves them), so the totals are the live ones'.
local function drop(id)
  local cost = redis.call('HGET', KEYS[2], id)
  if redis.call('ZREM', KEYS[1], id) == 1 and cost then
    redis.call('HINCRBY', KEYS[2], 'n', -1)
    redis.call('HINCRBY', KEYS[2], 'tokens', -tonumber(cost))
  end
  redis.call('HDEL', KEYS[2], id)
end

local function drop_expired(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 256)) do
    drop(id)
  end
end

local function totals()
  local n, tokens = redis.call('HGET', KEYS[2], 'n'), redis.call('HGET', KEYS[2], 'tokens')
  return tonumber(n or '0'), tonumber(tokens or '0')
end
