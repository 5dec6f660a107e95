-- (after links.lua and bits.lua) Valkey Cluster: one shard's share of a run of effects (step 2 of a batch), in one call, sent with no
-- declared keys to the node that owns their keys. Every effect touches one slot and is idempotent;
-- each runs alone (pcall), so one that fails changes nothing else. A key that moved away (resharding,
-- failover) fails with "non local key": its effect is listed for the caller to send through the
-- cluster's routing. ARGV: the effects, flat, in order:
--   L <engine key> <member> <n> <rk>..   membership HSET, then ZADD of the engine block's request keys
--   U <engine key> <member>              membership HDEL; the engine key goes with its last member
--   H <rk> <field>                       HSET field ""      D <rk> <field>   HDEL field (both counted: bits.lua)
--   J <rk> <field> <tier> <n>            H, and pod n's bit on <tier> set    K ...: D, and the bit cleared
--   P <rk> <tier> <n>                    pod n's bit alone, set              Q ...: cleared
-- Returns {moved effect positions "i,j,..", foreign-typed writes, the first such error}.
local moved, foreign, first = {}, 0, ''
local function call(pos, ...)
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err then
    if string.find(r.err, 'non local', 1, true) or string.find(r.err, 'MOVED', 1, true) or
       string.find(r.err, 'ASK', 1, true) then
      moved[#moved + 1] = pos
    else
      foreign = foreign + 1
      if first == '' then first = string.sub(r.err, 1, 120) end
    end
    return nil
  end
  return r
end
local i, pos = 1, 0
while i <= #ARGV do
  local op = ARGV[i]
  pos = pos + 1
  local here = function(...) return call(pos, ...) end
  if op == 'L' then
    local n = tonumber(ARGV[i + 3])
    local rks = {}
    for j = 1, n do rks[j] = ARGV[i + 3 + j] end
    link(here, ARGV[i + 1], ARGV[i + 2], rks)
    i = i + 4 + n
  elseif op == 'U' then
    unlink(here, ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  elseif op == 'H' or op == 'D' then
    put_entry(here, ARGV[i + 1], ARGV[i + 2], op == 'H')
    i = i + 3
  elseif op == 'J' or op == 'K' then
    put_entry(here, ARGV[i + 1], ARGV[i + 2], op == 'J', ARGV[i + 3], tonumber(ARGV[i + 4]))
    i = i + 5
  else  -- 'P' or 'Q': a bit alone
    put_entry(here, ARGV[i + 1], nil, op == 'P', ARGV[i + 2], tonumber(ARGV[i + 3]))
    i = i + 4
  end
end
-- an effect listed twice (both commands of an L moved) is sent once
local seen, uniq = {}, {}
for _, p in ipairs(moved) do
  if not seen[p] then seen[p] = true; uniq[#uniq + 1] = p end
end
return {table.concat(uniq, ','), foreign, first}
