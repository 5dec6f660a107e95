-- A pod cleared by a scan of the keyspace (kv_preflight/index/scan_clear.py), its own keys: KEYS the pod's meta,
-- its state log. ARGV[1] "claim": the pod flagged (ARGV[3], the reason) and its generation moved to one of the
-- scan's own (ARGV[2], the token after "<n>:"), so a writer holding a plan made before goes back to the log,
-- which does not read, and its batch is refused: answers the generation. "release": the log deleted, if the
-- generation is still the scan's (ARGV[2], the whole generation): answers 1, else 0 (another writer moved the pod).
local meta, state = KEYS[1], KEYS[2]
if ARGV[1] == 'claim' then
  local gen = redis.call('HGET', meta, 'gen') or '0'
  local n = tonumber(string.match(gen, '^(%d+)')) or 0
  local new = (n + 1) .. ':' .. ARGV[2]
  redis.call('HSET', meta, 'gen', new, 'incomplete', 1, 'incomplete_reason', ARGV[3])
  return new
end
if redis.call('HGET', meta, 'gen') ~= ARGV[2] then return 0 end
redis.call('DEL', state)
return 1
