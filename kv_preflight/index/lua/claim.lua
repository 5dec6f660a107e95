-- A writer takes a pod's outbox entries before running them (kv_preflight/index/cluster/writes.py ``drain``): each
-- renamed to it with Valkey's time now, so every other writer sees them young and waits ("busy",
-- lua/pod_step.lua) while this one runs them within its window; two drains, or a drain and a clearing, never
-- run the same entries at once (the second's changes could land after the first had run them, deleted them and
-- cleared the pod). All or nothing: every entry of the outbox (an outbox holds one writer's entries), and only
-- if it holds exactly those now.
-- KEYS[1]: the pod's outbox. ARGV[1]: the writer ("<writer id>@<takeover ms>"), then the fields.
-- Answers {Valkey ms, the new fields in ARGV's order}, or {} when the outbox changed.
local outbox = KEYS[1]
if redis.call('HLEN', outbox) ~= #ARGV - 1 then return {} end
for i = 2, #ARGV do
  if redis.call('HEXISTS', outbox, ARGV[i]) == 0 then return {} end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {tostring(now)}
for i = 2, #ARGV do
  local n = string.match(ARGV[i], '^(%d+)|')
  local new = n .. '|' .. ARGV[1] .. '|' .. now
  if new ~= ARGV[i] then
    local v = redis.call('HGET', outbox, ARGV[i])
    redis.call('HDEL', outbox, ARGV[i])
    redis.call('HSET', outbox, new, v)
  end
  out[#out + 1] = new
end
return out
