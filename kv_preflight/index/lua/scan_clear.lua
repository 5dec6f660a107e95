-- (after changes.lua, whose put, split and with_bit it uses) One request key of a pod whose state log does not
-- read, cleared of the pod (kv_preflight/index/scan_clear.py: its entries found by a scan of the keyspace, not
-- from its log). KEYS: the request key (llm-d's HASH), its presence hash (in its slot).
-- ARGV: the pod's bit (byte, from 1, and mask; "0" "0": the pod has no number, so no bit), its sibling
-- data-parallel ranks' bitmap ("" none), "1" if an entry naming the pod is its own whatever the bits say (no
-- sibling shares its entries), then per entry field the scan found naming the pod: the field, the presence field
-- its bit is in for a prefix group other than the entry's group (``<tier>|<group>``), and for the prefix group
-- (``<tier>``).
-- An entry goes unless a sibling rank's bit is left where the pod's was (the rank's entry is its pod's, shared:
-- changes.lua's G); each entry deleted takes one from the count of the presence field its bit was in, the pod's
-- bit is cleared in every field, and a request key left with no entry loses its presence hash (changes.lua's R).
-- Answers {entries deleted, bits cleared, 1 if the key was left with no entry}.
local rk, pkey = KEYS[1], KEYS[2]
local byte, mask, family, own = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4] == '1'
local flat = call('HGETALL', pkey) or {}
local vals = {}
for i = 1, #flat - 1, 2 do
  local n, bm = split(flat[i + 1])
  vals[flat[i]] = {n, bm}
end
local function has(bm)
  return byte > 0 and byte <= #bm and bit.band(string.byte(bm, byte), mask) ~= 0
end
local used, deleted, cleared = {}, 0, 0
for i = 5, #ARGV - 2, 3 do
  local name = nil
  for _, cand in ipairs({ARGV[i + 1], ARGV[i + 2]}) do
    local v = vals[cand]
    if name == nil and v and not used[cand] and has(v[2]) then name = cand end
  end
  local keep = not own and name == nil  -- a sibling's entry where the pod has no bit
  if name then
    used[name] = true
    if family ~= '' and any_of(with_bit(vals[name][2], byte, mask, false), family) then keep = true end
  end
  if not keep and call('HDEL', rk, ARGV[i]) == 1 then
    deleted = deleted + 1
    if name then vals[name][1] = vals[name][1] - 1 end
  end
end
for name, v in pairs(vals) do
  if has(v[2]) then
    cleared = cleared + 1
    put(pkey, name, v[1], with_bit(v[2], byte, mask, false))
  end
end
local emptied = 0
if deleted > 0 and call('HLEN', rk) == 0 then
  call('DEL', pkey)
  emptied = 1
end
return {deleted, cleared, emptied}
