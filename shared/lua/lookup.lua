-- ARGV: n, the chain packed by shared.keys.pack_keys (key i at bytes 20(i-1)+1 .. 20i, decimal,
-- right-aligned: one argument instead of n), then pod ids to consider (none = all). Keys are
-- derived inside the script, like the apply script's: single-node or single-shard Valkey
-- (Valkey Cluster: lookup mode "pipeline").
--
-- A pod's blocks of one chain form a prefix of it: the engine only reuses a block after
-- every block before it, evicts the tail of a chain before its head (vLLM frees a request's
-- blocks last-first), and the ingester writes and removes whole engine blocks. So rather than
-- read every key, the script reads the first key's pods, gallops (keys 2, 4, 8, ... read whole
-- with HKEYS, shared by all pods), then bisects each pod alone with a small HMGET of the fields
-- it is known by, then checks where each stops that no field it was not yet known by holds the
-- next key (HLEN against the pods known to be there; HKEYS only if they differ). O(pods x log(chain))
-- small reads instead of one HKEYS per key. A pod counts at a key through any of its fields
-- (tiers, groups), gpu preferred for the tier, as in the linear walk, which this equals whenever
-- every pod's blocks form a prefix.
-- Returns {foreign keys read, pod, blocks, tier, ...}.
local full = {}    -- key index -> pod -> tier, read whole (HKEYS)
local known = {}   -- pod -> its fields seen so far, in order; kset: the same as a set
local kset = {}
local probed = {}  -- pod -> key index -> tier or false, read through its known fields (HMGET)
-- Every wanted pod holding key i (pod -> tier, gpu preferred), through any field; learns fields.
local function at(i)
  local present = full[i]
  if present then return present end
  present = {}
  for _, f in ipairs(read('HKEYS', key(i))) do
    local e = entry(f)
    if e then
      local pod, tier = e[1], e[2]
      if present[pod] == nil or tier == 'gpu' then present[pod] = tier end
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
  return present
end
-- The pod's tier at key i through the fields it is known by, or false: one small HMGET.
local function held(i, pod)
  local f = full[i]
  if f then return f[pod] or false end
  local memo = probed[pod]
  if memo == nil then
    memo = {}
    probed[pod] = memo
  end
  local t = memo[i]
  if t ~= nil then return t end
  local fl = known[pod]
  local r = read('HMGET', key(i), unpack(fl))
  t = false
  for j = 1, #r do
    if r[j] then
      local ft = parsed[fl[j]][2]
      if t == false or ft == 'gpu' then t = ft end
    end
  end
  memo[i] = t
  return t
end
local pods, lo, hi = {}, {}, {}
for pod, _ in pairs(at(1)) do
  pods[#pods + 1] = pod
  lo[pod], hi[pod] = 1, n + 1
end
if #pods == 0 then return {foreign} end
-- Gallop together: keys 2, 4, 8, ... read whole once, shared by every pod still holding.
local going, i = pods, 1
while #going > 0 and i < n do
  local nxt = math.min(i * 2, n)
  local present = at(nxt)
  local still = {}
  for _, pod in ipairs(going) do
    if present[pod] then
      lo[pod] = nxt
      still[#still + 1] = pod
    else
      hi[pod] = nxt
    end
  end
  going, i = still, nxt
end
-- Then each pod alone, bisecting with the fields it is known by.
local function bisect(pod, l, h)
  while h - l > 1 do
    local mid = math.floor((l + h) / 2)
    if held(mid, pod) then l = mid else h = mid end
  end
  return l
end
for _, pod in ipairs(pods) do lo[pod] = bisect(pod, lo[pod], hi[pod]) end
-- Where a pod stops (key h = lo + 1), a field it is not known by could still hold h. Longest
-- first: if h has exactly as many fields as the pods known to hold it (longer prefixes, at least
-- one field each), none is left for this pod; else read h whole, and go on if it holds the pod.
table.sort(pods, function(a, b) return lo[a] > lo[b] end)
local out = {foreign}
for _, pod in ipairs(pods) do
  while lo[pod] < n do
    local h = lo[pod] + 1
    local again
    if full[h] then
      again = full[h][pod] ~= nil
    else
      local c = read('HLEN', key(h))
      local m = 0
      for _, q in ipairs(pods) do
        if q ~= pod and lo[q] >= h then m = m + 1 end
      end
      again = c ~= 0 and c ~= m and at(h)[pod] ~= nil
    end
    if not again then break end
    local l, hh = h, n + 1
    while l < n do
      local nxt = math.min(l * 2, n)
      if held(nxt, pod) then l = nxt else hh = nxt; break end
    end
    lo[pod] = bisect(pod, l, hh)
  end
  local l = lo[pod]
  local t = held(l, pod)
  if t ~= 'gpu' then t = at(l)[pod] end  -- no gpu field known there: the exact rule needs them all
  out[#out + 1] = pod
  out[#out + 1] = l
  out[#out + 1] = t
end
return out
