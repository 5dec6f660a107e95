-- A routed prompt's request keys on the pod it was sent to (kv_preflight/index/routed.py), in a ZSET of the pod's
-- slot: member = a request key as 8 bytes big-endian, score = (Valkey ms - EPOCH) + (n - i) / (n + 1) for the
-- key at position i of the n written: every key at least its descendants' score (a prompt's chain is written
-- whole, from its first key, and a later write only raises scores: ZADD GT), so the live keys of any chain are a
-- prefix of it, which the read bisects (routed_read.lua), and trimming the lowest scores takes a chain's tail
-- first.
-- KEYS[1]: the ZSET. ARGV: mode, EPOCH (ms), the keys (8 bytes each, one string), then by mode:
--   speculative TTL_MS MAX    score = the entry's expiry: live until then (the engine's events confirm the
--                             blocks meanwhile); expired ones dropped, at most MAX kept; the key expires 2 x TTL
--                             after its last write
--   approximate CAP IDLE_MS   score = the last use: at most CAP kept, the least recently used first out (the
--                             engine's KV capacity in blocks); the key expires IDLE_MS after its last write
-- Answers how many entries the ZSET holds.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[2])
local mode, blob = ARGV[1], ARGV[3]
local n = math.floor(#blob / 8)
local base, cap, expire
if mode == 'speculative' then
  base, cap, expire = now + tonumber(ARGV[4]), tonumber(ARGV[5]), 2 * tonumber(ARGV[4])
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
else
  base, cap, expire = now, tonumber(ARGV[4]), tonumber(ARGV[5])
end
local args = {}
for i = 0, n - 1 do
  args[#args + 1] = base + (n - i) / (n + 1)
  args[#args + 1] = string.sub(blob, 8 * i + 1, 8 * i + 8)
  if #args >= 2000 or i == n - 1 then
    redis.call('ZADD', KEYS[1], 'GT', unpack(args))
    args = {}
  end
end
local count = redis.call('ZCARD', KEYS[1])
if count > cap then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, count - cap - 1)
  count = cap
end
redis.call('PEXPIRE', KEYS[1], expire)
return count
