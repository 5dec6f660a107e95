-- Shared by apply.lua (a single node: a batch's changes run in its script) and effects.lua (a Valkey Cluster:
-- each shard runs its share): the changes a pod's plan makes to keys every pod shares (kv_preflight/index/
-- pod_state.py plans them, the backends encode them; every key name arrives as an argument).
--
--   K rk pkey field entry bitname bitdelta byte mask   one request key of the pod: its llm-d entry
--        written (entry 1: HSET rk field "") or deleted (-1: HDEL), and its bit in the presence hash pkey
--        (field bitname, value "<n>:<bitmap>") set (bitdelta 1) or cleared (-1), n following the entry.
--        byte (1-based) and mask say where the pod's bit is. A deleted
--        entry that leaves the request key without any entry (someone else's included) takes the presence
--        hash with it, and the key counts as empty for the X below.
--   Z ek_key n rk..         engine:<ek> gains the block's request keys at positions 0..n-1 (ZADD)
--   X ek_key n rk..         the pod let go of the block: its request keys leave engine:<ek> if none of them
--                           holds an entry any more (llm-d's pruning rule: HLEN of each is 0)
-- Writes to keys we do not own go through pcall: a key of a foreign type (someone's LIST at a request key)
-- fails that one command, never the script, so a batch is never left half applied and a retry counts nothing
-- twice; failures are counted (foreign.n) and the first is kept. A key that moved away (cluster: resharding,
-- failover) fails with "non local key": its op is listed in `moved` for the caller to send through the
-- cluster's routing (effects.lua).
local foreign = {n = 0, first = nil}
local moved = {}
local empty = {}  -- request key -> true once it holds no entry (for X), false when it still does
local op_at = 0   -- the position of the op running (for `moved`)
local function call(cmd, key, ...)
  local r = redis.pcall(cmd, key, ...)
  if type(r) == 'table' and r.err then
    if string.find(r.err, 'non local', 1, true) or string.find(r.err, 'MOVED', 1, true) or
       string.find(r.err, 'ASK', 1, true) then
      moved[#moved + 1] = op_at
    else
      foreign.n = foreign.n + 1
      if foreign.first == nil then foreign.first = key .. ': ' .. string.sub(r.err, 1, 120) end
    end
    return nil
  end
  return r
end
local function with_bit(s, b, m, on)
  local cur = 0
  if b <= #s then cur = string.byte(s, b) end
  if (bit.band(cur, m) ~= 0) == on then return s end
  if #s < b then s = s .. string.rep('\0', b - #s) end
  local nb
  if on then nb = bit.bor(cur, m) else nb = bit.band(cur, 255 - m) end
  s = string.sub(s, 1, b - 1) .. string.char(nb) .. string.sub(s, b + 1)
  if not on then s = (string.gsub(s, '%z+$', '')) end
  return s
end
local function key_change(rk, pkey, fld, entry, bitname, bitdelta, b, m)
  local added = 0
  if entry == '1' then
    local r = call('HSET', rk, fld, '')
    if r == nil then return end  -- a foreign-typed request key: no entry, so no bit either
    added = r
  elseif entry == '-1' then
    local r = call('HDEL', rk, fld)
    if r ~= nil then added = -r end
    local len = call('HLEN', rk)
    if len == 0 then  -- nobody holds the key any more: its presence goes whole
      empty[rk] = true
      call('DEL', pkey)
      return
    end
    empty[rk] = false
  end
  if bitdelta == '0' and added == 0 then return end
  if bitdelta == '1' then  -- the first holder on this tier and group writes the field whole (one call)
    local mine = string.rep('\0', tonumber(b) - 1) .. string.char(tonumber(m))
    if call('HSETNX', pkey, bitname, added .. ':' .. mine) == 1 then return end
  end
  local v = call('HGET', pkey, bitname)
  local n, bm = 0, ''
  if type(v) == 'string' then
    local c = string.find(v, ':', 1, true)
    if c then n, bm = tonumber(string.sub(v, 1, c - 1)) or 0, string.sub(v, c + 1) end
  end
  if bitdelta ~= '0' then bm = with_bit(bm, tonumber(b), tonumber(m), bitdelta == '1') end
  n = n + added
  if bm == '' and n <= 0 then call('HDEL', pkey, bitname) else call('HSET', pkey, bitname, n .. ':' .. bm) end
end
local function engine_add(ek_key, rks)
  local za = {}
  for j, rk in ipairs(rks) do za[2 * j - 1], za[2 * j] = j - 1, rk end
  call('ZADD', ek_key, unpack(za))
end
local function engine_drop(ek_key, rks)
  for _, rk in ipairs(rks) do
    local e = empty[rk]
    if e == nil then e = call('HLEN', rk) == 0 end
    if not e then return end
  end
  call('ZREM', ek_key, unpack(rks))
end
-- Runs the ops in ARGV from position i; returns nothing (foreign, moved and empty say what happened).
local function run_changes(i)
  while i <= #ARGV do
    local op = ARGV[i]
    op_at = op_at + 1
    if op == 'K' then
      key_change(ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7],
                 ARGV[i + 8])
      i = i + 9
    else
      local n = tonumber(ARGV[i + 2])
      local rks = {}
      for j = 1, n do rks[j] = ARGV[i + 2 + j] end
      if op == 'Z' then engine_add(ARGV[i + 1], rks) else engine_drop(ARGV[i + 1], rks) end
      i = i + 3 + n
    end
  end
end
