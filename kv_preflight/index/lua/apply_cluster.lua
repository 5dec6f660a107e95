-- Prelude of pod.lua on Valkey Cluster: the pod's keys share its slot, the shared keys are spread
-- over every shard, and no script may span slots. So the effects on shared keys are collected,
-- kept in the pod's outbox (same slot, same atomic step as the seq), and returned; the ingester
-- runs them on their shards (idempotent commands, pipelined per shard), then deletes the outbox
-- entry. An ingester killed in between leaves the entry; whoever applies the pod's next batch
-- runs it first (again: idempotent), so nothing is lost and nothing is counted twice.
--
-- Order matters for one request key of one pod (set, then unset): so a batch whose pod has an
-- outbox entry of ANOTHER writer is not applied while that entry is young (answer "busy": its
-- writer is about to run it) and, once it is older than the takeover time, the answer is
-- "pending": the caller runs the entry first. A writer's own entries are in flight in order.
-- KEYS: pod meta, blocks, field ids, request-key refs, outbox. ARGV[9]: "<writer id>@<takeover ms>".
local effects = {}
local function foreign_summary() return 0, nil end
local function emit_link(ek, member, rks)
  effects[#effects + 1] = 'L'
  effects[#effects + 1] = ek
  effects[#effects + 1] = member
  effects[#effects + 1] = #rks
  for _, rk in ipairs(rks) do effects[#effects + 1] = rk end
  return true
end
local function emit_unlink(ek, member)
  effects[#effects + 1] = 'U'
  effects[#effects + 1] = ek
  effects[#effects + 1] = member
end
-- An entry written (H) or deleted (D), with the pod's bit on `tier` set (J) or cleared (K) beside it;
-- a bit alone cleared (Q: a clear's per-tier link counts). kv_preflight/index/lua/effects_shard.lua runs them.
local function emit_entry(rk, fld, on, tier, num)
  local op
  if fld == nil then op = 'Q'
  elseif tier == nil then op = on and 'H' or 'D'
  else op = on and 'J' or 'K' end
  effects[#effects + 1] = op
  effects[#effects + 1] = rk
  if fld ~= nil then effects[#effects + 1] = fld end
  if tier ~= nil then
    effects[#effects + 1] = tier
    effects[#effects + 1] = num
  end
end
local outbox = KEYS[5]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Entries are "<n>|<writer>|<ms>" -> msgpack list of effects. own_pending: this writer's entries
-- still there (not yet confirmed replicated); the caller acks a new entry only when there are none.
local own_pending = 0
do
  local writer = ARGV[9]
  local takeover = tonumber(string.match(writer, '@(%d+)$') or '2000')
  local pending = redis.call('HKEYS', outbox)
  if #pending > 0 then
    local t = now_ms()
    for _, f in ipairs(pending) do
      local w, ms = string.match(f, '^%d+|(.*)|(%d+)$')
      if w ~= writer then
        if t - tonumber(ms or '0') < takeover then return {'busy', '-1', 0, f} end
        return {'pending', '-1', 0, f}
      end
      own_pending = own_pending + 1
    end
  end
end
-- pod.lua sets gaps_unsafe when the pod's keys had a gap (orphan keys, or their count unknown) before or
-- after this step: while this entry's effects travel, a shard may show either version, so the lookup
-- must not bisect the pod until the entry is gone. meta "gap_entry" names the last such entry.
local gaps_unsafe = false
local function finish(reply)
  if #effects == 0 then return reply end
  local n = redis.call('HINCRBY', KEYS[1], 'outbox_n', 1)
  if gaps_unsafe then redis.call('HSET', KEYS[1], 'gap_entry', n) end
  local f = n .. '|' .. ARGV[9] .. '|' .. now_ms()
  local payload = cmsgpack.pack(effects)
  redis.call('HSET', outbox, f, payload)
  reply[#reply + 1] = f
  reply[#reply + 1] = payload
  reply[#reply + 1] = own_pending
  return reply
end
