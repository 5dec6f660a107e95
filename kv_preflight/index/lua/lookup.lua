-- The lookup (after parse_entry.lua and chain.lua, whose ARGV it takes): per pod, how many leading
-- keys of the chain it holds. A single node runs it on the whole chain; each shard of a Valkey
-- Cluster on the keys it owns, in chain order (kv_preflight/index/cluster.py merges the shards'
-- answers: a pod's prefix ends at the first key any shard lacks it on).
--
-- A pod's blocks of one chain form a prefix of it: the engine only reuses a block after every
-- block before it, evicts the tail of a chain before its head (vLLM frees a request's blocks
-- last-first), and the ingester writes and removes whole engine blocks. So rather than read every
-- key whole (one HKEYS per key: pods x keys fields, 256,000 at 1,000 pods and 4K tokens):
--
-- 1. Walk exactly (HKEYS per key, as the linear walk) while the fields read stay within `budget`;
--    key 1 always, which names the pods that can match at all and their fields.
-- 2. Bisect every pod still holding at once, in rounds: pods whose interval has the same middle
--    key share one HMGET of their known fields there. About pods x log2(keys) field probes
--    in log2(keys) rounds of at most 2^round calls, whatever the pods' lengths.
-- 3. Where a pod stops (key h, the first it was not found on), a field it was not known by could
--    still hold h (fields differ per key: tiers, groups, entry forms). Every pod known to reach h
--    holds at least one field there, so if HLEN(h) equals their number, none is left for this pod;
--    else h is read whole (once, for every pod stopping there), and a pod found on it searches on.
--
-- A pod counts at a key through any of its fields, its tier there gpu-preferred, as in the linear
-- walk, which this equals whenever every pod's blocks form a prefix (and, below the budget,
-- always). Returns {foreign keys read, "1" if a key had moved away (cluster) else "", then per
-- pod: pod, keys held, tier}.
local full = {}    -- key index -> pod -> tier, read whole (HKEYS)
local nfields = {} -- key index -> fields read there whole
local known = {}   -- pod -> its fields seen so far, in order; kset: the same as a set
local kset = {}
local probed = {}  -- pod -> key index -> tier or false, read through its known fields (HMGET)
local dead = {}    -- key index -> true: of a foreign type, or moved away (read once, counted once)
local function rd(cmd, i, ...)
  if dead[i] then
    if cmd == 'HLEN' then return 0 end
    return {}
  end
  local f0, m0 = foreign, moved
  local r = read(cmd, key(i), ...)
  if foreign ~= f0 or moved ~= m0 then dead[i] = true end
  return r
end
local function at(i)
  local present = full[i]
  if present then return present end
  present = {}
  local fields = rd('HKEYS', i)
  for _, f in ipairs(fields) do
    local e = entry(f)
    if e then
      local pod, tier = e[1], e[2]
      if better(tier, present[pod]) then present[pod] = tier end
      local ks = kset[pod]
      if ks == nil then
        ks = {}
        kset[pod], known[pod] = ks, {}
      end
      if not ks[f] then
        ks[f] = true
        local kl = known[pod]
        kl[#kl + 1] = f
        probed[pod] = nil  -- answers read without this field may be wrong now
      end
    end
  end
  full[i] = present
  nfields[i] = #fields
  return present
end
-- Several pods at key i through the fields each is known by: pod -> tier (gpu preferred), for
-- those found. One HMGET (a few for very many fields: Lua's unpack has a stack limit).
local function probe(i, group)
  local hits = {}
  local f = full[i]
  if f then
    for _, pod in ipairs(group) do hits[pod] = f[pod] end
    return hits
  end
  local fl = {}
  for _, pod in ipairs(group) do
    for _, fld in ipairs(known[pod]) do fl[#fl + 1] = fld end
  end
  for s = 1, #fl, 4000 do
    local e = math.min(s + 3999, #fl)
    local r = rd('HMGET', i, unpack(fl, s, e))
    for j = 1, #r do
      if r[j] then
        local p = parsed[fl[s + j - 1]]
        local pod, tier = p[1], p[2]
        if better(tier, hits[pod]) then hits[pod] = tier end
      end
    end
  end
  return hits
end
-- One pod at key i through its known fields, or false: a small HMGET, remembered.
local function held(i, pod)
  local f = full[i]
  if f then return f[pod] or false end
  local memo = probed[pod]
  if memo == nil then
    memo = {}
    probed[pod] = memo
  end
  local t = memo[i]
  if t == nil then
    t = probe(i, {pod})[pod] or false
    memo[i] = t
  end
  return t
end

local lo, hi, tier = {}, {}, {}
local pods = {}
for pod, t in pairs(at(1)) do
  pods[#pods + 1] = pod
  lo[pod], tier[pod] = 1, t
end
-- 1. The exact walk, while cheap.
local going, i, spent = pods, 1, nfields[1]
while #going > 0 and i < n and spent <= budget do
  i = i + 1
  local present = at(i)
  spent = spent + nfields[i]
  local still = {}
  for _, pod in ipairs(going) do
    local t = present[pod]
    if t then
      lo[pod], tier[pod] = i, t
      still[#still + 1] = pod
    end
  end
  going = still
end
-- 2. Every pod still holding at key i, bisected on (i, n] together. Pods sharing an interval sit
-- side by side in `order` (a segment); a probe splits its segment in place, misses first.
local order, fl = {}, {}
for j, pod in ipairs(going) do order[j] = pod end
local segs = {}
if #order > 0 and i < n then segs[1] = {1, #order, i, n + 1} end
while #segs > 0 do
  local nxt = {}
  for _, sg in ipairs(segs) do
    local s, e, l, h = sg[1], sg[2], sg[3], sg[4]
    local mid = math.floor((l + h) / 2)
    local f = full[mid]
    if f == nil and e - s >= 7 and rd('HLEN', mid) <= 3 * (e - s + 1) then
      -- Fewer fields there than three per pod probing: reading the key whole is cheaper (HKEYS costs
      -- a third of HMGET per field here) and answers every later probe of it too.
      f = at(mid)
    end
    local hit = {}
    if f then
      for k = s, e do hit[k] = f[order[k]] end
    else
      -- one HMGET of every known field of the segment's pods (a few for very many: unpack's limit)
      local nf, owner = 0, {}
      for k = s, e do
        for _, fld in ipairs(known[order[k]]) do
          nf = nf + 1
          fl[nf], owner[nf] = fld, k
        end
      end
      for a = 1, nf, 4000 do
        local b = math.min(a + 3999, nf)
        local r = rd('HMGET', mid, unpack(fl, a, b))
        for j = 1, #r do
          if r[j] then
            local k, t = owner[a + j - 1], parsed[fl[a + j - 1]][2]
            if hit[k] == nil or t == 'gpu' then hit[k] = t end
          end
        end
      end
    end
    local left, right = {}, {}
    for k = s, e do
      local pod = order[k]
      local t = hit[k]
      if t then
        lo[pod], tier[pod] = mid, t
        right[#right + 1] = pod
      else
        left[#left + 1] = pod
      end
    end
    for j, pod in ipairs(left) do order[s + j - 1] = pod end
    for j, pod in ipairs(right) do order[s + #left + j - 1] = pod end
    if #left > 0 and mid - l > 1 then nxt[#nxt + 1] = {s, s + #left - 1, l, mid} end
    if #right > 0 and h - mid > 1 then nxt[#nxt + 1] = {s + #left, e, mid, h} end
  end
  segs = nxt
end
-- 3. Where each pod stops: a field it was not known by? ge[h]: pods known to reach key h.
local ge, count = {}, {}
for _, pod in ipairs(pods) do count[lo[pod]] = (count[lo[pod]] or 0) + 1 end
local acc = 0
for h = n, 1, -1 do
  acc = acc + (count[h] or 0)
  ge[h] = acc
end
local hlen = {}
local function bisect(pod, l, h)
  while h - l > 1 do
    local mid = math.floor((l + h) / 2)
    if held(mid, pod) then l = mid else h = mid end
  end
  return l
end
for _, pod in ipairs(pods) do
  while lo[pod] < n do
    local h = lo[pod] + 1
    local again
    if full[h] then
      again = full[h][pod] ~= nil
    else
      local c = hlen[h]
      if c == nil then
        c = rd('HLEN', h)
        hlen[h] = c
      end
      -- (ge was counted before any pod searched on: a lower bound, so a match is still proof)
      again = c ~= 0 and c ~= ge[h] and at(h)[pod] ~= nil
    end
    if not again then break end
    local l, hh = h, n + 1
    while l < n do
      local nxt = math.min(l * 2, n)
      if held(nxt, pod) then l = nxt else hh = nxt; break end
    end
    lo[pod] = bisect(pod, l, hh)
    tier[pod] = held(lo[pod], pod)
  end
end
local out = {foreign, moved and '1' or ''}
for _, pod in ipairs(pods) do
  local l = lo[pod]
  local t = tier[pod]
  if full[l] then
    t = full[l][pod]
  elseif t ~= 'gpu' then
    t = at(l)[pod]  -- no gpu field known there: the exact rule needs them all
  end
  out[#out + 1] = pod
  out[#out + 1] = l
  out[#out + 1] = t
end
return out
