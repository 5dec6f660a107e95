-- Shared by apply_single.lua and effects_shard.lua: an engine key's request keys and its membership
-- hash (in the engine key's slot; the engine key goes with its last member). ``call(cmd, key, ...)``
-- runs one command alone and answers nil when it failed (each caller counts failures its own way).
local function members_key(ek) return 'kvpf:{engine:' .. ek .. '}:pods' end
-- Membership first: an unlink that runs between the two still sees this pod, so it cannot delete the
-- engine key under it. If the engine key cannot be written (a key of a foreign type), the membership
-- goes again, so no later unlink deletes that foreign key.
local function link(call, ek, member, rks)
  if call('HSET', members_key(ek), member, 1) == nil then return false end
  if #rks == 0 then return true end
  local za = {}
  for j, rk in ipairs(rks) do za[2 * j - 1], za[2 * j] = j - 1, rk end
  if call('ZADD', 'engine:' .. ek, unpack(za)) == nil then
    redis.pcall('HDEL', members_key(ek), member)
    return false
  end
  return true
end
local function unlink(call, ek, member)
  local mk = members_key(ek)
  if call('HDEL', mk, member) ~= nil and redis.call('EXISTS', mk) == 0 then call('DEL', 'engine:' .. ek) end
end
