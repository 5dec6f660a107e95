-- Valkey Cluster: one shard's part of a lookup, in one call (after parse_entry.lua and chain.lua, whose
-- ARGV it takes: n, the shard's keys packed, then the pods filter). Sent with no declared keys to the
-- node that owns them: it reads only its own keys; one that moved away (resharding, failover) fails
-- with "non local key" and is listed, for the caller to read through the cluster's routing instead.
-- Returns {foreign keys read as misses, moved key positions "i,j,..", then per pod: pod, "i:tier,..."}
-- with positions 1-based into this call's keys and the tier gpu-preferred, as the linear walk has it.
local moved = {}
local per_pod = {}
local order = {}
for i = 1, n do
  local r = redis.pcall('HKEYS', key(i))
  if type(r) == 'table' and r.err then
    if string.find(r.err, 'non local', 1, true) or string.find(r.err, 'MOVED', 1, true) or
       string.find(r.err, 'ASK', 1, true) then
      moved[#moved + 1] = i
    else
      foreign = foreign + 1
    end
  else
    for pod, tier in pairs(pods_in(r)) do
      local l = per_pod[pod]
      if l == nil then
        l = {}
        per_pod[pod] = l
        order[#order + 1] = pod
      end
      l[#l + 1] = i .. ':' .. tier
    end
  end
end
local out = {foreign, table.concat(moved, ',')}
for _, pod in ipairs(order) do
  out[#out + 1] = pod
  out[#out + 1] = table.concat(per_pod[pod], ',')
end
return out
