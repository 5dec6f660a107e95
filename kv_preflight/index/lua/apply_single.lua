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
-- (after links.lua and bits.lua)
local function emit_link(ek, member, rks) return link(shared_call, ek, member, rks) end
local function emit_unlink(ek, member) unlink(shared_call, ek, member) end
-- an entry written (on) or deleted, and (tier given) the pod's bit there set or cleared with it
local function emit_entry(rk, fld, on, tier, num) put_entry(shared_call, rk, fld, on, tier, num) end
local gaps_unsafe = false  -- (pod.lua sets it; one script applies everything here: nothing travels)
local function finish(reply) return reply end
