-- Shared by both lookup scripts (after parse_entry.lua): their arguments, key i of the chain,
-- each distinct field parsed once into {pod, tier}, or false (speculative, unparseable, or
-- filtered out), and reads that treat a key of a foreign type as empty (a miss), counted in
-- `foreign` and returned first in the reply, never an error.
local n = tonumber(ARGV[1])
local chain = ARGV[2]
local filter = nil
if #ARGV > 2 then
  filter = {}
  for i = 3, #ARGV do filter[ARGV[i]] = true end
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
-- The wanted pods among one key's fields: pod -> tier (gpu preferred, as the linear walk has it).
local function pods_in(fields)
  local present = {}
  for _, f in ipairs(fields) do
    local e = entry(f)
    if e then
      local pod, tier = e[1], e[2]
      if present[pod] == nil or tier == 'gpu' then present[pod] = tier end
    end
  end
  return present
end
local foreign = 0
local function read(cmd, k, ...)
  local r = redis.pcall(cmd, k, ...)
  if type(r) == 'table' and r.err then
    foreign = foreign + 1
    if cmd == 'HLEN' then return 0 end
    return {}
  end
  return r
end
