-- A pod's homes: the prefixes routed there lately (kv_preflight/index/routed.py), by their first request key.
-- HOMES: ZSET prefix -> when last routed there (Valkey ms); HOMED: HASH prefix -> its blocks, and "sum" -> theirs
-- together, the pod's footprint. ``drop_old_homes`` takes out every prefix last routed before ``cutoff``, at most
-- 256 a call, so "sum" is the footprint of the prefixes within the window.
local function drop_old_homes(homes, homed, cutoff)
  for _, prefix in ipairs(redis.call('ZRANGEBYSCORE', homes, '-inf', '(' .. cutoff, 'LIMIT', 0, 256)) do
    local blocks = redis.call('HGET', homed, prefix)
    if blocks then
      redis.call('HINCRBY', homed, 'sum', -tonumber(blocks))
      redis.call('HDEL', homed, prefix)
    end
    redis.call('ZREM', homes, prefix)
  end
end
