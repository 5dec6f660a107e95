-- A prefix homed on a pod (kv_preflight/index/routed.py): routed there now, ``blocks`` long. KEYS[1]: the pod's
-- homes (ZSET prefix -> last routed, Valkey ms), KEYS[2]: their blocks and "sum" (homes_drop.lua). ARGV: the
-- prefix (its first request key, 8 bytes), its blocks, the window (ms). Prefixes older than the window leave
-- first; the keys expire 2 x the window after their last write. Answers the pod's footprint ("sum").
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[3])
drop_old_homes(KEYS[1], KEYS[2], now - window)
local old = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local blocks = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], blocks)
local sum = redis.call('HINCRBY', KEYS[2], 'sum', blocks - old)
redis.call('PEXPIRE', KEYS[1], 2 * window)
redis.call('PEXPIRE', KEYS[2], 2 * window)
return sum
