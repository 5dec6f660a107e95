-- What was routed to pods, read beside a lookup (kv_preflight/index/routed.py), each pod in its own slot.
-- KEYS: per pod six (kv_preflight/index/layout.py pod_routed_keys): its bookings and their totals
-- (booked_drop.lua), its speculative keys, its approximate keys (routed_chain.lua), its homes and their blocks
-- (homes_drop.lua). One pod a call on a Valkey Cluster (a script's keys share a slot); every pod in one call on a
-- single node, so the prompt's keys go once, not once per pod (64 pods: 128 KB a decision). ARGV: EPOCH (ms), the
-- prompt's request keys (8 bytes each, one string; may be empty), the homes' window (ms).
-- Answers, per pod in KEYS' order, six numbers {booked requests, booked tokens, speculative blocks, approximate
-- blocks, footprint, homed}: the live bookings' totals (expired ones dropped first); how many of the prompt's first
-- keys each ZSET holds live (a speculative key is live until its score, an approximate one while it is kept),
-- bisected: the live keys of a chain are a prefix of it (routed_chain.lua), so log2(n) probes find where it ends;
-- and the blocks of the prefixes homed there within the window, this prompt's own prefix aside (it does not crowd
-- itself out); and how many ms ago this prompt's prefix was last homed there (-1: not within the window), so a
-- prefix one gateway just placed is pending there for every gateway.
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local blob = ARGV[2]
local n = math.floor(#blob / 8)
local now = ms - tonumber(ARGV[1])
local window = tonumber(ARGV[3])

local function held(key, live)
  if n == 0 or redis.call('EXISTS', key) == 0 then
    return 0
  end
  local lo, hi = 0, n
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local score = redis.call('ZSCORE', key, string.sub(blob, 8 * (mid - 1) + 1, 8 * mid))
    if score and live(tonumber(score)) then
      lo = mid
    else
      hi = mid - 1
    end
  end
  return lo
end

local function speculative_live(score) return score > now end
local function kept(score) return true end

local out = {}
for p = 0, math.floor(#KEYS / 6) - 1 do
  local k = 6 * p
  drop_expired(KEYS[k + 1], KEYS[k + 2], ms)
  local n_booked, tokens = totals(KEYS[k + 2])
  local speculative = held(KEYS[k + 3], speculative_live)
  local approximate = held(KEYS[k + 4], kept)
  local footprint, homed = 0, -1
  if window > 0 and redis.call('EXISTS', KEYS[k + 6]) == 1 then
    drop_old_homes(KEYS[k + 5], KEYS[k + 6], ms - window)
    footprint = tonumber(redis.call('HGET', KEYS[k + 6], 'sum') or '0')
    if n > 0 then
      footprint = footprint - tonumber(redis.call('HGET', KEYS[k + 6], string.sub(blob, 1, 8)) or '0')
      local at = redis.call('ZSCORE', KEYS[k + 5], string.sub(blob, 1, 8))
      if at then homed = math.max(0, ms - tonumber(at)) end
    end
  end
  out[#out + 1] = n_booked
  out[#out + 1] = tokens
  out[#out + 1] = speculative
  out[#out + 1] = approximate
  out[#out + 1] = footprint
  out[#out + 1] = homed
end
return out
