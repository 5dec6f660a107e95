-- Flag a pod incomplete, unless it was rebuilt whole in the epoch given: every ingester that notices one loss of
-- Valkey's data flags its pods and rebuilds them, and one that noticed after another had rebuilt a pod flagged it
-- again, with nothing left to clear the flag (kv_preflight/ingester/ingester.py check_epoch).
-- KEYS[1]: the pod's meta. ARGV: the reason, the epoch ("": flag whatever the pod's rebuilt_epoch). Answers 1 if set.
if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], 'rebuilt_epoch') == ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'incomplete', 1, 'incomplete_reason', ARGV[1])
return 1
