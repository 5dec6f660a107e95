-- Shared by both lookup scripts (after parse_entry.lua): their arguments (n, the chain packed by
-- kv_preflight.keys.chain.pack_keys, the exact-walk budget, then the pods filter), key i of the chain, each
-- distinct field parsed once into {pod, tier}, or false (speculative, unparseable, or filtered
-- out), and reads that treat a key of a foreign type as empty (a miss), counted in `foreign` and
-- returned first in the reply, never an error. On a cluster node, a key that moved away
-- (resharding, failover: "non local key") reads as empty too and sets `moved`, for the caller to
-- read this call's keys through the cluster's routing instead.
local n = tonumber(ARGV[1])
local chain = ARGV[2]
local budget = tonumber(ARGV[3]) or 0
local filter = nil
if #ARGV > 3 then
  filter = {}
  for i = 4, #ARGV do filter[ARGV[i]] = true end
end
local function key(i)
  return string.match(string.sub(chain, i * 20 - 19, i * 20), '%d+')
end
local parsed = {}
local function entry(f)
  local e = parsed[f]
  if e == nil then
    local pod, tier = parse(f)
    if pod and (filter == nil or filter[pod]) then e = {pod, tier} else e = false end
    parsed[f] = e
  end
  return e
end
-- A pod's tier at a key where it has several: gpu, else the first by name (entries.better_tier).
local function better(t, cur)
  if cur == nil then return true end
  if cur == 'gpu' then return false end
  return t == 'gpu' or t < cur
end
-- The wanted pods among one key's fields: pod -> tier (gpu preferred, as the linear walk has it).
local function pods_in(fields)
  local present = {}
  for _, f in ipairs(fields) do
    local e = entry(f)
    if e then
      local pod, tier = e[1], e[2]
      if better(tier, present[pod]) then present[pod] = tier end
    end
  end
  return present
end
local foreign = 0
local moved = false
local function read(cmd, k, ...)
  local r = redis.pcall(cmd, k, ...)
  if type(r) == 'table' and r.err then
    if string.find(r.err, 'non local', 1, true) or string.find(r.err, 'MOVED', 1, true) or
       string.find(r.err, 'ASK', 1, true) then
      moved = true
    else
      foreign = foreign + 1
    end
    if cmd == 'HLEN' then return 0 end
    return {}
  end
  return r
end
