-- The fleet-wide pod numbering (one slot, {nums}): a pod's number is the bit it owns in every
-- request key's presence bitmap (bits.lua). KEYS: byname, byid, free, next (kv_preflight/index/layout.py).
-- ARGV[1] "give": numbers for the pods ARGV[4], ARGV[6], ..., each followed by the number its meta holds ("" if
-- none). A pod gets its existing number; else, in a numbering created after one was lost (created with a
-- floor above 0), the one its meta holds if it is from the lost numbering (below that floor) and no other pod
-- has it: the pod's own record survived, and its bits in every bitmap are under that number; else the lowest
-- number freed at least ARGV[2] ms ago; else a new one, never below ARGV[3] (the high-water mark's copies on
-- other shards: numbers given before the numbering was lost, whose bits may still stand). Answers the
-- numbers in order, then the next new number (for the copies).
-- ARGV[1] "free": the numbers of the pods ARGV[3..] are freed (a forgotten pod's bits are all clear).
local byname, byid, free, nextk = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
if ARGV[1] == 'free' then
  for i = 3, #ARGV do
    local n = redis.call('HGET', byname, ARGV[i])
    if n then
      redis.call('HDEL', byname, ARGV[i])
      if redis.call('HGET', byid, n) == ARGV[i] then redis.call('HDEL', byid, n) end
      redis.call('HSET', free, n, now)
      out[#out + 1] = n
    end
  end
  return out
end
-- The numbering's epoch: set once, when the numbering is created, so a reader holding names of an
-- earlier numbering (the index flushed under it: numbers restart at 0) sees it and reads them again.
if redis.call('HSETNX', nextk, 'epoch', t[1] .. '.' .. t[2]) == 1 then
  -- created: numbers below the floor were given by a numbering that was lost, and only a pod whose meta
  -- holds one may have it again (a numbering that was never lost adopts nothing: a freed number waits)
  redis.call('HSET', nextk, 'adopt_below', ARGV[3])
end
local adopt_below = tonumber(redis.call('HGET', nextk, 'adopt_below') or '0')
local reuse = tonumber(ARGV[2])
local function raise_next(at_least)
  if at_least > tonumber(redis.call('HGET', nextk, 'next') or '0') then
    redis.call('HSET', nextk, 'next', at_least)
  end
end
raise_next(tonumber(ARGV[3]))
-- first the pods whose meta holds a number of the lost numbering no pod has: theirs again (a number as this
-- script writes one: decimal digits, no sign, no leading zero, at most 9 of them)
for i = 4, #ARGV, 2 do
  local pod, held = ARGV[i], ARGV[i + 1]
  if adopt_below > 0 and #held <= 9 and held:match('^%d+$') and (held == '0' or held:sub(1, 1) ~= '0')
      and tonumber(held) < adopt_below and not redis.call('HGET', byname, pod) then
    local h = tonumber(held)
    if not redis.call('HGET', byid, held) and redis.call('HEXISTS', free, held) == 0 then
      redis.call('HSET', byname, pod, held)
      redis.call('HSET', byid, held, pod)
      raise_next(h + 1)
    end
  end
end
local spare = nil  -- reusable numbers, highest first (taken from the end)
for i = 4, #ARGV, 2 do
  local pod = ARGV[i]
  local n = redis.call('HGET', byname, pod)
  if not n then
    if spare == nil then
      spare = {}
      local all = redis.call('HGETALL', free)
      for j = 1, #all, 2 do
        if now - tonumber(all[j + 1]) >= reuse then spare[#spare + 1] = tonumber(all[j]) end
      end
      table.sort(spare, function(a, b) return a > b end)
    end
    if #spare > 0 then
      n = tostring(spare[#spare])
      spare[#spare] = nil
      redis.call('HDEL', free, n)
    else
      n = tostring(redis.call('HINCRBY', nextk, 'next', 1) - 1)
    end
    redis.call('HSET', byname, pod, n)
    redis.call('HSET', byid, n, pod)
  end
  out[#out + 1] = n
end
out[#out + 1] = redis.call('HGET', nextk, 'next') or '0'
return out
