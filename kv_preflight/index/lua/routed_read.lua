-- What was routed to one pod, read beside a lookup (kv_preflight/index/routed.py), in the pod's slot.
-- KEYS: the pod's bookings and their totals (booked_drop.lua), its speculative keys, its approximate keys
-- (routed_chain.lua), its homes and their blocks (homes_drop.lua). ARGV: EPOCH (ms), the prompt's request keys
-- (8 bytes each, one string; may be empty), the homes' window (ms).
-- Answers {booked requests, booked tokens, speculative blocks, approximate blocks, footprint, homed}: the live
-- bookings' totals (expired ones dropped first); how many of the prompt's first keys each ZSET holds live (a
-- speculative key is live until its score, an approximate one while it is kept), bisected: the live keys of a
-- chain are a prefix of it (routed_chain.lua), so log2(n) probes find where it ends; and the blocks of the
-- prefixes homed there within the window, this prompt's own prefix aside (it does not crowd itself out); and how
-- many ms ago this prompt's prefix was last homed there (-1: not within the window), so a prefix one gateway
-- just placed is pending there for every gateway.
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
drop_expired(ms)
local n_booked, tokens = totals()
local blob = ARGV[2]
local n = math.floor(#blob / 8)
local now = ms - tonumber(ARGV[1])

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

local speculative = held(KEYS[3], function(score) return score > now end)
local approximate = held(KEYS[4], function(score) return true end)
local footprint, homed = 0, -1
local window = tonumber(ARGV[3])
if window > 0 and redis.call('EXISTS', KEYS[6]) == 1 then
  drop_old_homes(KEYS[5], KEYS[6], ms - window)
  footprint = tonumber(redis.call('HGET', KEYS[6], 'sum') or '0')
  if n > 0 then
    footprint = footprint - tonumber(redis.call('HGET', KEYS[6], string.sub(blob, 1, 8)) or '0')
    local at = redis.call('ZSCORE', KEYS[5], string.sub(blob, 1, 8))
    if at then homed = math.max(0, ms - tonumber(at)) end
  end
end
return {n_booked, tokens, speculative, approximate, footprint, homed}
