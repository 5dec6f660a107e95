-- A field of a hash raised to a value if below it (absent: set): a high-water mark that writers racing each
-- other only ever raise (kv_preflight/index/numbering.py, the numbering's copies). KEYS[1]: the hash. ARGV: the
-- field, the value (an integer). Answers the field's value after.
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '')
local v = tonumber(ARGV[2])
if cur == nil or v > cur then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return ARGV[2]
end
return tostring(cur)
