-- Remove every entry of one pod; with ARGV[2] == '1' also forget its metadata.
-- KEYS: pod meta, pod blocks, pod field ids, pod request-key refs, pods registry.
-- ARGV: pod, forget.
local n = clear_pod(KEYS[2], KEYS[3], KEYS[4])
if ARGV[2] == '1' then
  redis.call('DEL', KEYS[1], KEYS[3])
  redis.call('HDEL', KEYS[5], ARGV[1])
end
return n
