-- (after bits.lua) Valkey Cluster: one effect on a request key's slot sent through the cluster's routing
-- (its key moved while a shard's run was on its way). KEYS: kvpf:{<rk>}:bits, <rk>.
-- ARGV: "bit", request key, tier, number, 1|0; or "entry", request key, field, 1|0.
local failed = nil
local function call(...)
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err then
    failed = failed or r.err
    return nil
  end
  return r
end
if ARGV[1] == 'bit' then
  put_bit(call, ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5] == '1')
else
  put_entry(call, ARGV[2], ARGV[3], ARGV[4] == '1')
end
if failed then return redis.error_reply(failed) end
return 1
