-- Shared by apply_single.lua, effects_shard.lua and bit_effect.lua: one of a pod's llm-d entries on a
-- request key, and the pod's bit in the key's bitmap hash kvpf:{<rk>}:bits (field = tier -> bitmap;
-- "#n" -> how many of the key's fields are ours), the index the lookup reads (kv_preflight/index/layout.py).
-- Bit n is byte n // 8 (1-based here: n // 8 + 1), value 2^(n % 8); trailing zero bytes are trimmed
-- and an empty bitmap is deleted, so a bitmap is as long as the highest pod number holding the key.
--
-- put_entry(call, rk, fld, on, tier, num): writes (on) or deletes the entry `fld` (nil: none), counts it
-- in "#n" if that really added or removed a field (HSET/HDEL answer 1), and sets (on) or clears the pod's
-- bit on `tier` (nil: leave the bits). The count and the bit change in one HSET of the bitmap hash. A bit
-- is set only beside an entry written (a request key of a foreign type fails the HSET: no entry, no bit),
-- so such a key stays a miss for the lookup as for llm-d's reader. Idempotent (again: nothing changes)
-- and it commutes with any other pod's: it may run again (an outbox drain) and in any order across pods.
-- ``call(cmd, key, ...)`` runs one command alone and answers nil when it failed.
local function bits_key(rk) return 'kvpf:{' .. rk .. '}:bits' end
local function with_bit(s, num, on)
  local b = math.floor(num / 8) + 1
  local m = 2 ^ (num % 8)
  local cur = 0
  if b <= #s then cur = string.byte(s, b) end
  if (bit.band(cur, m) ~= 0) == on then return s end
  if #s < b then s = s .. string.rep('\0', b - #s) end
  local nb
  if on then nb = bit.bor(cur, m) else nb = bit.band(cur, 255 - m) end
  s = string.sub(s, 1, b - 1) .. string.char(nb) .. string.sub(s, b + 1)
  return (string.gsub(s, '%z+$', ''))
end
local function put_entry(call, rk, fld, on, tier, num)
  local added = 0
  if fld then
    local r
    if on then r = call('HSET', rk, fld, '') else r = call('HDEL', rk, fld) end
    if r == nil then return end  -- a key of a foreign type (counted by call), or moved away (cluster)
    if on then added = r else added = -r end
  elseif on then  -- a bit alone, set: only beside an entry
    local t = redis.pcall('TYPE', rk)
    if type(t) == 'table' then t = t.ok end
    if t ~= 'hash' then return end
  end
  if added == 0 and not tier then return end
  local k = bits_key(rk)
  local cur = call('HMGET', k, tier or '#n', '#n')
  if cur == nil then return end
  local set, del = {}, {}
  if tier then
    local before = cur[1] or ''
    local s = with_bit(before, num, on)
    if s ~= before then
      if s == '' then del[#del + 1] = tier else set[#set + 1] = tier; set[#set + 1] = s end
    end
  end
  if added ~= 0 then
    local n = (tonumber(cur[2]) or 0) + added
    if n <= 0 then del[#del + 1] = '#n' else set[#set + 1] = '#n'; set[#set + 1] = n end
  end
  if #set > 0 then call('HSET', k, unpack(set)) end
  if #del > 0 then call('HDEL', k, unpack(del)) end
end
