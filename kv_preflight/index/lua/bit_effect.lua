-- (after bits.lua) Valkey Cluster: one effect on a request key's slot sent through the cluster's routing
-- (its key moved while a shard's run was on its way). KEYS: kvpf:{<rk>}:bits, <rk>.
-- ARGV: request key, field ("" for none), 1|0, tier ("" for none), number.
local failed = nil
local function call(...)
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err then
    failed = failed or r.err
    return nil
  end
  return r
end
local fld, tier = ARGV[2], ARGV[4]
if fld == '' then fld = nil end
if tier == '' then tier = nil end
put_entry(call, ARGV[1], fld, ARGV[3] == '1', tier, tonumber(ARGV[5]))
if failed then return redis.error_reply(failed) end
return 1
