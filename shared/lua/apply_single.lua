-- Prelude of pod.lua on a single node: every key is local, so the shared-key effects run here,
-- inside the same atomic script. Keys we do not own (request keys, engine:<key> and its
-- membership set) are written with redis.pcall: a key of a foreign type (someone's LIST at
-- engine:123) fails that one command, never the script, so a batch is never left half applied and
-- a retry never counts anything twice. Failures are counted and reported (pod flagged).
-- KEYS: pod meta, blocks, field ids, request-key refs.
local foreign = {n = 0, first = nil}
local function shared_call(cmd, key, ...)
  local r = redis.pcall(cmd, key, ...)
  if type(r) == 'table' and r.err then
    foreign.n = foreign.n + 1
    if foreign.first == nil then foreign.first = key .. ': ' .. string.sub(r.err, 1, 120) end
    return nil
  end
  return r
end
local function foreign_summary() return foreign.n, foreign.first end
local function members_key(ek) return 'kvpf:{engine:' .. ek .. '}:pods' end
-- The engine key with its request keys, and the pod's block in its membership set (the engine
-- key goes with its last member). Membership first: an unlink that runs between the two still
-- sees this pod, so it cannot delete the engine key under it.
local function emit_link(ek, member, rks)
  if shared_call('HSET', members_key(ek), member, 1) == nil then return false end
  if #rks == 0 then return true end
  local za = {}
  for j, rk in ipairs(rks) do za[2 * j - 1], za[2 * j] = j - 1, rk end
  if shared_call('ZADD', 'engine:' .. ek, unpack(za)) == nil then
    redis.pcall('HDEL', members_key(ek), member)
    return false
  end
  return true
end
local function emit_unlink(ek, member)
  local mk = members_key(ek)
  if shared_call('HDEL', mk, member) ~= nil and redis.call('EXISTS', mk) == 0 then
    shared_call('DEL', 'engine:' .. ek)
  end
end
local function emit_set(rk, fld) shared_call('HSET', rk, fld, '') end
local function emit_unset(rk, fld) shared_call('HDEL', rk, fld) end
local function finish(reply) return reply end
