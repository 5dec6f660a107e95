-- Valkey Cluster: the one drain that may run a pod's outbox entries now (kv_preflight/index/cluster/drain_lease.py).
-- KEYS[1]: the pod's drain key (a HASH: "by" -> the holder, "<writer>#<token>"; its TTL is the lease's); KEYS[2]:
-- the pod's outbox. ARGV: "take", "renew" or "release"; the holder; the lease in ms. Answers 1 when done, 0 when
-- another drain holds the lease (take) or this one no longer does (renew, release: it lapsed, and maybe another
-- took it), -1 when the outbox is empty (take: nothing to drain, and no lease written: every ingester's chores look
-- at each of its pods every second, and a lease taken for nothing would hold the pod's other writers' steps).
local key, op, holder, ms = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local by = redis.call('HGET', key, 'by')
if op == 'take' then
  if by and by ~= holder then return 0 end
  if redis.call('HLEN', KEYS[2]) == 0 then return -1 end
  redis.call('HSET', key, 'by', holder)
  redis.call('PEXPIRE', key, ms)
  return 1
end
if by ~= holder then return 0 end
if op == 'renew' then
  redis.call('PEXPIRE', key, ms)
else
  redis.call('DEL', key)
end
return 1
