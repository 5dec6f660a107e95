-- Shared by apply_single.lua, effects_shard.lua and bit_effect.lua: one pod's bit in a request key's
-- presence bitmap (kvpf:{<rk>}:bits, field = tier), the index the lookup reads (shared/layout.py).
-- Bit n is byte n // 8 (1-based here: n // 8 + 1), value 2^(n % 8); trailing zero bytes are trimmed
-- and an empty bitmap is deleted, so a bitmap is as long as the highest pod number holding the key.
-- Idempotent (setting a set bit, clearing a clear one, changes nothing) and it commutes with any
-- other pod's bit: so it may run again (an outbox drain) and in any order across pods.
-- A bit is set only beside the pod's entry (the request key is a hash), so a request key of a foreign
-- type stays a miss for the lookup as for llm-d's reader.
-- ``call(cmd, key, ...)`` runs one command alone and answers nil when it failed.
local function bits_key(rk) return 'kvpf:{' .. rk .. '}:bits' end
local function put_bit(call, rk, tier, num, on)
  local k = bits_key(rk)
  local s = call('HGET', k, tier)
  if s == nil then return end  -- a key of a foreign type: counted by call
  if s == false then s = '' end
  if on then  -- after the read above, which notes a key that moved away (cluster)
    local t = redis.pcall('TYPE', rk)
    if type(t) == 'table' then t = t.ok end
    if t ~= 'hash' then return end  -- its entry was not written (a key of a foreign type): no bit either
  end
  local b = math.floor(num / 8) + 1
  local m = 2 ^ (num % 8)
  local cur = 0
  if b <= #s then cur = string.byte(s, b) end
  if (bit.band(cur, m) ~= 0) == on then return end
  if #s < b then s = s .. string.rep('\0', b - #s) end
  local nb
  if on then nb = bit.bor(cur, m) else nb = bit.band(cur, 255 - m) end
  s = string.sub(s, 1, b - 1) .. string.char(nb) .. string.sub(s, b + 1)
  s = string.gsub(s, '%z+$', '')
  if s == '' then call('HDEL', k, tier) else call('HSET', k, tier, s) end
end
-- One of our entries (an llm-d PodEntry field) written or deleted, counted in the bitmap hash ("#n":
-- how many fields of the request key are ours), so the lookup knows a key holds entries someone
-- else wrote (an llm-d indexer on the same Valkey: HLEN above our count) and reads those whole.
-- Idempotent: only a field really added (HSET answers 1) or removed (HDEL answers 1) counts.
local function put_entry(call, rk, fld, on)
  if on then
    if call('HSET', rk, fld, '') == 1 then call('HINCRBY', bits_key(rk), '#n', 1) end
  elseif call('HDEL', rk, fld) == 1 then
    local c = call('HINCRBY', bits_key(rk), '#n', -1)
    if c and c <= 0 then call('HDEL', bits_key(rk), '#n') end
  end
end
