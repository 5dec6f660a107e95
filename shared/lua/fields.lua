-- Shared by apply.lua and clear.lua (prepended to each; Lua scripts cannot include).
--
-- kvpf:blocks:<pod> maps "<engine key>|<tier>[|<group>]" to a small id of the PodEntry field
-- written for that block, and kvpf:fields:<pod> maps id -> field: a pod writes one or a few
-- distinct fields, so the reverse index holds a digit or two per block instead of a ~95-byte
-- JSON copy. A value that is not all digits is a field itself (written before ids).
--
-- Keys we do not own (request keys, engine:<key>) are written with redis.pcall: a key of a
-- foreign type (someone's LIST at engine:123) fails that one command, never the script, so a
-- batch is never left half applied and a retry never counts anything twice. Each such failure
-- is remembered in `foreign` and reported by the caller (pod flagged, counter).
local foreign = {n = 0, first = nil}
local function note_foreign(key, err)
  foreign.n = foreign.n + 1
  if foreign.first == nil then
    local msg = type(err) == 'table' and err.err or tostring(err)
    foreign.first = key .. ': ' .. string.sub(msg or '?', 1, 120)
  end
end
local function shared_call(cmd, key, ...)
  local r = redis.pcall(cmd, key, ...)
  if type(r) == 'table' and r.err then
    note_foreign(key, r)
    return nil
  end
  return r
end
local function field_ids(fields_key)
  local byid, byfield, n = {}, {}, 0
  local all = redis.call('HGETALL', fields_key)
  for i = 1, #all, 2 do
    byid[all[i]] = all[i + 1]
    byfield[all[i + 1]] = all[i]
    n = n + 1
  end
  return byid, byfield, n
end
local function is_id(v)
  return string.find(v, '^%d+$') ~= nil
end
-- vLLM (0.32) can hold one hash in two physical blocks (a fully cached prompt recomputes its
-- last block and caches the copy) and reports each copy's store and eviction; so a value
-- "<id>*<n>" counts n copies, and only the last eviction removes the entry.
local function copies(v)
  local id, n = string.match(v, '^(%d+)%*(%d+)$')
  if id then return id, tonumber(n) end
  return v, 1
end
-- kvpf:rkref:<pod>: "<request key>|<field>" -> how many MORE of the pod's engine blocks map to
-- that request key with that field than the first. Two engine keys give one request key when
-- they differ only in what llm-d's key leaves out (vLLM's cache_salt), or when an engine block
-- does not end on a request-key boundary. Evicting one of them must not drop the entry the
-- other still backs. Absent (the common case) costs one EXISTS per script.
local rkref_exists = nil
local function rkref_held(rkref, rk, fld)
  if rkref_exists == nil then rkref_exists = redis.call('EXISTS', rkref) == 1 end
  if not rkref_exists then return false end
  local f = rk .. '|' .. fld
  local v = redis.call('HGET', rkref, f)
  if not v then return false end
  local n = tonumber(v)
  if n and n > 1 then redis.call('HSET', rkref, f, n - 1) else redis.call('HDEL', rkref, f) end
  return true
end
local function rkref_add(rkref, rk, fld)
  redis.call('HINCRBY', rkref, rk .. '|' .. fld, 1)
  rkref_exists = true
end
-- Drop one pod field from an engine block's request keys; the engine key goes with its last holder.
local function unlink(ek, fld, rkref)
  local ekey = 'engine:' .. ek
  local rks = shared_call('ZRANGE', ekey, 0, -1)
  if rks == nil then return false end  -- foreign type: its request keys cannot be found
  if fld then
    for _, rk in ipairs(rks) do
      if not rkref_held(rkref, rk, fld) then shared_call('HDEL', rk, fld) end
    end
  end
  if #rks == 0 then
    redis.call('DEL', ekey)
  else
    local n = redis.pcall('EXISTS', unpack(rks))
    if n == 0 then redis.call('DEL', ekey) end
  end
  return true
end
-- Remove every entry of one pod, via its reverse index (O(pod's blocks)).
local function clear_pod(blocks_key, fields_key, rkref)
  local byid = nil
  local n = 0
  redis.call('DEL', rkref)
  rkref_exists = false
  local all = redis.call('HGETALL', blocks_key)
  for i = 1, #all, 2 do
    local fld = copies(all[i + 1])
    if is_id(fld) then
      if byid == nil then byid = field_ids(fields_key) end
      fld = byid[fld]
    end
    unlink(string.match(all[i], '^([^|]*)'), fld, rkref)
    n = n + 1
  end
  redis.call('DEL', blocks_key)
  return n
end
-- Our own per-pod keys must be what we write; anything else is refused before the first write.
local function own_types_ok(keys)
  for k, want in pairs(keys) do
    local t = redis.call('TYPE', k)
    t = type(t) == 'table' and t.ok or t
    if t ~= 'none' and t ~= want then return k .. ' holds a ' .. t .. ', expected a ' .. want end
  end
  return nil
end
