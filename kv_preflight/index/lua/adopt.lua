-- A writer takes over the entries of a pod's outbox that it ran but no replica has confirmed yet (their writer
-- is gone or stalled, and a replica is down): they are renamed to it, so its own pod steps see its own entries
-- and go on (with another writer's name there, each step answered "pending", ran them all again and stalled the
-- pod for as long as the replica stayed down). All or nothing: every entry of the outbox (an outbox holds one
-- writer's entries), and only if it holds exactly those now.
-- KEYS[1]: the pod's outbox. ARGV: pairs (field, new field). Answers 1 when renamed, 0 when the outbox changed.
local outbox = KEYS[1]
if redis.call('HLEN', outbox) ~= #ARGV / 2 then return 0 end
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', outbox, ARGV[i]) == 0 then return 0 end
end
for i = 1, #ARGV, 2 do
  if ARGV[i] ~= ARGV[i + 1] then
    local v = redis.call('HGET', outbox, ARGV[i])
    redis.call('HDEL', outbox, ARGV[i])
    redis.call('HSET', outbox, ARGV[i + 1], v)
  end
end
return 1
