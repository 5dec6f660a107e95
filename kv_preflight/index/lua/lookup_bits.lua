-- The lookup (layout 4): per pod, how many leading keys of the chain it holds, from the keys' presence hashes
-- (kvpf:{<rk>}, kv_preflight/index/layout.py: per tier a bitmap of pod numbers, value "<n>:<bitmap>"). A
-- pod's bit in field "<tier>" says it holds the key in its prefix group (full attention; the only group of a
-- plain model), which is what a prefix is walked over here; fields "<tier>|<group>" (a hybrid model's other
-- KV cache groups) are sent back where every key's bitmaps are, and otherwise read by the caller, which
-- applies the engine's rule for them (kv_preflight/engines/hit_rules.py). A single node runs it on the whole
-- chain; each shard of a Valkey Cluster on the keys it owns, in chain order (same arguments).
--
-- Every key read is checked against its llm-d hash: of a foreign type, it is a miss (counted); with
-- fields that are not exactly ours (its HLEN differs from the sum of our counts "<n>": an llm-d indexer on the
-- same Valkey wrote or deleted entries), the answer is "whole", and the caller walks llm-d's entries instead.
-- The pods holding key 1 decide how:
--   * pods x log2(keys) >= keys (a prefix many pods hold): every key's bitmaps are returned, to the first
--     key nobody holds, and the caller ANDs them (kv_preflight/index/presence.py): exact on any layout, a plain
--     read of keys x pods / 8 bytes;
--   * else (few pods, a long chain): every pod is bisected here at once through its bit in the bitmaps
--     of the keys probed (pods sharing an interval share the read of its middle key), about
--     pods x log2(keys) bit tests and at most that many keys read: equal to the walk whenever each pod's
--     keys form a prefix of the chain (the engine reuses a block only after every block before it and
--     evicts a chain's tail first; writers change whole engine blocks). A pod is bisected only when that
--     is known: its orphan count (pod meta "orphan_keys", kv_preflight/index/pod_state.py) is 0. Any other pod
--     is walked key by key to the first key it lacks (the linear walk, over the bitmaps), so the answer
--     equals the linear mode's on any layout.
--     ARGV[2] says who knows the counts: "local" (a single node: the pods' meta is read here, named through
--     kvpf:{nums}:byid); "" (a cluster shard: every pod bisected, the caller reads the pods' meta on their
--     own shards); "w:<n>,<n>.." (a cluster shard, again: these pods are walked, the others bisected).
-- A key of a foreign type reads as empty (a miss), counted; a key that moved away (cluster: resharding,
-- failover) reads as empty and sets `moved`, for the caller to read this call's keys through the
-- cluster's routing instead. ARGV: n, how, the presence key's prefix and suffix (around a request key), the
-- numbering's keys (byid, next), the pod meta key's prefix and suffix (around a pod), then the chain's n keys,
-- each as its decimal string.
-- Reply: {foreign keys read, 1 if a key had moved away else 0, kind, the numbering's epoch ("" where
-- {nums} is not on this node), pods walked rather than bisected, ...}:
--   kind 0: then per key read, two elements: its tier and bitmap (one field), its fields flat and ""
--           ({field, bitmap, ...}: several), or "" and "" (nobody);
--   kind 1: then per pod: number, keys held, tier at the last (a pod walked with "w:" whose tier changes
--           along its keys here: its runs instead, {tier, keys held through it, tier, ..., keys held});
--   kind 2: "whole" (nothing more).
-- (A key of a foreign type at key 1: kind 1 with no pod.)
local PRE, SUF = ARGV[3], ARGV[4]
local BYID, NEXT = ARGV[5], ARGV[6]
local MPRE, MSUF = ARGV[7], ARGV[8]
local FIRST = 8  -- ARGV[FIRST + i] is the chain's key i
local epoch = redis.pcall('HGET', NEXT, 'epoch')
if type(epoch) ~= 'string' then epoch = '' end
local n = tonumber(ARGV[1])
local foreign, moved = 0, 0
local function key(i)  -- each key its own argument
  return ARGV[FIRST + i]
end
-- A presence value "<n>:<bitmap>" as n, bitmap.
local function split(v)
  local c = string.find(v, ':', 1, true)
  if not c then return 0, '' end
  return tonumber(string.sub(v, 1, c - 1)) or 0, string.sub(v, c + 1)
end
local function failed(err)  -- a key that moved away (cluster) or of a foreign type
  if string.find(err, 'non local', 1, true) or string.find(err, 'MOVED', 1, true) or
     string.find(err, 'ASK', 1, true) then
    moved = 1
  else
    foreign = foreign + 1
  end
end
local function read(cmd, k)
  local r = redis.pcall(cmd, k)
  if type(r) == 'table' and r.err then
    failed(r.err)
    return nil
  end
  return r
end
local flats = {}  -- key index -> its presence hash, flat, values stripped of their counts
local tiers = {}  -- key index -> tier -> bitmap (the prefix group's fields only)
local whole = false  -- a key read holds entries that are not exactly ours
-- A presence hash read flat: its values stripped of their counts (in place), the prefix group's fields as
-- tier -> bitmap, and how many entries its counts say are ours.
local function parse(flat)
  local ours, b = 0, {}
  for j = 1, #flat, 2 do
    local n, bm = split(flat[j + 1])
    ours = ours + n
    flat[j + 1] = bm
    if not string.find(flat[j], '|', 1, true) then b[flat[j]] = bm end
  end
  return ours, b
end
-- A key's bitmaps. Its llm-d hash is checked too: of a foreign type, it is a miss (counted); with more or
-- fewer fields than our counts say (an llm-d indexer on the same Valkey wrote or deleted entries), the
-- bitmaps do not say everything, and the caller walks llm-d's entries instead.
local function at(i)
  local b = tiers[i]
  if b == nil then
    local k = key(i)
    local flat = read('HGETALL', PRE .. k .. SUF) or {}
    local ours
    ours, b = parse(flat)
    local len = read('HLEN', k)
    if len == nil then
      flat, b = {}, {}
    elseif len ~= ours then
      whole = true
    end
    flats[i], tiers[i] = flat, b
  end
  return b
end
-- A pod's tier at a key (gpu, else the first by name: entries.better_tier), or nil if it lacks it.
local function tier_of(b, num)
  local byte, m = math.floor(num / 8) + 1, 2 ^ (num % 8)
  local best = nil
  for t, s in pairs(b) do
    if byte <= #s and bit.band(string.byte(s, byte), m) ~= 0 then
      if best == nil or t == 'gpu' or (best ~= 'gpu' and t < best) then best = t end
    end
  end
  return best
end

local b1 = at(1)
if moved == 1 then return {foreign, 1, 1, epoch, 0} end
if whole then return {foreign, 0, 2, epoch, 0} end
-- The pods at key 1 (every pod that can match), by number. Only as many as decide the way: once there are
-- enough for the many-pods answer (pods x rounds >= keys), the rest are not listed (a fleet-wide prefix
-- has a thousand, and listing them was a loop of a thousand bit tests on every shard).
local rounds = 1
while 2 ^ rounds < n do rounds = rounds + 1 end
local enough = math.ceil(n / rounds)
local pods, seen = {}, {}
for _, s in pairs(b1) do
  for byte = 1, #s do
    local v = string.byte(s, byte)
    if v ~= 0 then
      for k = 0, 7 do
        if bit.band(v, 2 ^ k) ~= 0 then
          local num = (byte - 1) * 8 + k
          if not seen[num] then
            seen[num] = true
            pods[#pods + 1] = num
          end
        end
      end
    end
    if #pods >= enough then break end
  end
  if #pods >= enough then break end
end
if #pods == 0 then return {foreign, 0, 1, epoch, 0} end
if #pods * rounds >= n then
  -- Many pods: every key's bitmaps, to the first key nobody holds; the caller walks them exactly.
  -- Each key as two strings where it has one field (its name, its bitmap): Valkey turns flat strings into a
  -- reply for less than a nested table per key (-15 % of this script at 1,000 pods). A key with several
  -- fields (tiers, a hybrid model's groups) sends them flat and "", a key nobody holds "" and "".
  -- Keys are read here straight, one HGETALL and one HLEN each, with nothing kept per key (at()'s tables
  -- are for the bisection's random access): the loop is most of this script's time (-15 %).
  local out = {foreign, 0, 0, epoch, 0}
  local m = 5
  for i = 1, n do
    local flat = flats[i]
    if flat == nil then  -- keys after the first, read here straight (at()'s per-key table is not needed)
      local k = key(i)
      flat = redis.pcall('HGETALL', PRE .. k .. SUF)
      if flat.err then failed(flat.err); flat = {} end
      local len = redis.pcall('HLEN', k)
      if type(len) == 'table' then
        failed(len.err)
        flat = {}
      elseif len ~= parse(flat) then
        return {foreign, moved, 2, epoch, 0}
      end
    end
    local name, bits = '', ''
    if #flat == 2 then name, bits = flat[1], flat[2] elseif #flat > 2 then name = flat end
    out[m + 1], out[m + 2], m = name, bits, m + 2
    if #flat == 0 and moved == 0 and i > 1 then break end  -- nobody holds it: every prefix ended
  end
  out[1], out[2] = foreign, moved
  return out
end
-- Few pods. Those whose keys are not known to be closed under "parent" (see above) are walked.
local walk, walked = {}, 0
local how = ARGV[2] or ''
if how == 'local' then
  for _, num in ipairs(pods) do
    local name = redis.pcall('HGET', BYID, tostring(num))
    local m = type(name) == 'string' and redis.pcall('HMGET', MPRE .. name .. MSUF, 'orphan_keys',
                                                       'orphan_at', 'batches')
    -- bisected only with no orphan key, counted at the pod's last batch (pod.lua); else walked
    if type(m) ~= 'table' or m.err or m[1] ~= '0' or m[2] ~= (m[3] or '0') then walk[num] = true end
  end
elseif string.sub(how, 1, 2) == 'w:' then
  for d in string.gmatch(string.sub(how, 3), '%d+') do walk[tonumber(d)] = true end
end
local lo, tier = {}, {}
local order = {}
-- A cluster shard walking a pod sends its tier runs where its tier changes along the keys walked
-- ({tier, keys held through it, tier, ...}): the caller may need its tier at a key before its last here
-- (where another shard cut its prefix), and this way knows it without reading that key again.
local runs = {}
local with_runs = string.sub(how, 1, 2) == 'w:'
for _, num in ipairs(pods) do
  lo[num], tier[num] = 1, tier_of(b1, num)
  if walk[num] then
    local i = 1
    local r = {tier[num]}
    while i < n do
      local t = tier_of(at(i + 1), num)
      if t == nil then break end
      if t ~= tier[num] then r[#r + 1] = i; r[#r + 1] = t end
      i, tier[num] = i + 1, t
    end
    lo[num] = i
    if with_runs and #r > 1 then r[#r + 1] = i; runs[num] = r end
    walked = walked + 1
  else
    order[#order + 1] = num
  end
end
-- The others are bisected all at once. Pods sharing an interval sit side by side in `order` (a segment
-- {first, last, held, missing}); a probe splits its segment in place, misses first.
local segs = {}
if n > 1 and #order > 0 then segs[1] = {1, #order, 1, n + 1} end
while #segs > 0 do
  local nxt = {}
  for _, sg in ipairs(segs) do
    local s, e, l, h = sg[1], sg[2], sg[3], sg[4]
    local mid = math.floor((l + h) / 2)
    local b = at(mid)
    local miss, hit = {}, {}
    for j = s, e do
      local num = order[j]
      local t = tier_of(b, num)
      if t then
        lo[num], tier[num] = mid, t
        hit[#hit + 1] = num
      else
        miss[#miss + 1] = num
      end
    end
    local j = s
    for _, num in ipairs(miss) do order[j] = num; j = j + 1 end
    for _, num in ipairs(hit) do order[j] = num; j = j + 1 end
    if #miss > 0 and mid - l > 1 then nxt[#nxt + 1] = {s, s + #miss - 1, l, mid} end
    if #hit > 0 and h - mid > 1 then nxt[#nxt + 1] = {s + #miss, e, mid, h} end
  end
  segs = nxt
end
if whole then return {foreign, moved, 2, epoch, 0} end
local out = {foreign, moved, 1, epoch, walked}
for _, num in ipairs(pods) do
  out[#out + 1] = num
  out[#out + 1] = lo[num]
  out[#out + 1] = runs[num] or tier[num] or 'gpu'
end
return out
