-- Compare-and-set of one field of a hash: two ingesters acting on one pod at once (one retiring it, one
-- attaching a new engine under its id) cannot both win (kv_preflight/index/fleet_store.py replace_pod_record).
-- KEYS[1]: the hash. ARGV: field, expected value ("" stands for an absent field), new value. Answers 1 if set.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if (cur or '') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
