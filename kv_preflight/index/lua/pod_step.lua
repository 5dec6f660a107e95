-- (after seq.lua and pod_write.lua) Valkey Cluster, step 1 of a batch: the pod's own step, in its slot. The
-- pod's keys share its slot; the keys every pod shares are spread over every shard, and no script may span
-- slots. So the batch's changes to those keys are kept in the pod's outbox (same slot, same atomic step as
-- the seq) and the ingester runs them on their shards (effects.lua: idempotent, so running one twice changes
-- nothing), then deletes the outbox entry. An ingester killed in between leaves the entry; whoever applies
-- the pod's next batch runs it first, and every ingester runs stale entries of its pods, so nothing is lost.
--
-- Order matters for one request key of one pod (set, then unset): so a batch whose pod has an outbox entry
-- of ANOTHER writer is not applied while that entry is young (answer "busy": its writer is about to run it)
-- and, once it is older than the takeover time, the answer is "pending": the caller runs the old entries first
-- (one random entry is judged here: the caller's drain runs none of another writer's entries while one is young). A
-- writer's own entries are in flight in order. And while a drain holds the outbox (its lease, KEYS[4]:
-- kv_preflight/index/cluster/drain_lease.py) the answer is "busy" too: that drain may be running entries this
-- batch must come after (a quiet writer's kept entries, taken as a dead one's). Even this writer's own drain: a
-- writer drains between its batches, never beside them, so its own lease is there only if its release failed.
-- KEYS: the pod's meta, state log, outbox, drain lease. ARGV: as apply.lua up to pod_write.lua's, then the writer
-- ("<writer id>@<takeover ms>"), gap ("1": the pod's keys have a gap before or after this step, see
-- lookup_bits.lua: the lookup must not bisect the pod while this entry's changes travel), the changes
-- (msgpack, kept in the outbox).
-- Answers {status, last seq, 0, detail, generation, outbox entry or "", own entries still pending}.
local outbox = KEYS[3]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local a = read_pod_args()
local writer, gap, payload = ARGV[a.rest], ARGV[a.rest + 1], ARGV[a.rest + 2]
local own_pending = 0
do
  local by = redis.call('HGET', KEYS[4], 'by')
  if by then return {'busy', '-1', 0, 'drain: ' .. by, gen} end
end
do
  -- Every entry of an outbox is one writer's: a step adds its entry only when all those there are its own
  -- (else it answers busy or pending, below), and a drain only deletes or trims them. So one field names the
  -- writer, and a writer's own count is the hash's length: while a replica is down its entries stay, by the
  -- thousand, and a scan of them all at every step made each step cost as much as the outbox's length.
  local n = redis.call('HLEN', outbox)
  if n > 0 then
    local f = redis.call('HRANDFIELD', outbox)
    local w, ms = string.match(f, '^%d+|(.*)|(%d+)$')
    if w ~= writer then
      local takeover = tonumber(string.match(writer, '@(%d+)$') or '2000')
      if now_ms() - tonumber(ms or '0') < takeover then return {'busy', '-1', 0, f, gen} end
      return {'pending', '-1', 0, f, gen}
    end
    own_pending = n
  end
end
local stop = check_batch()
if stop then return stop end
write_pod(a, 0, nil)
local entry = ''
if payload ~= '' then
  local n = redis.call('HINCRBY', meta, 'outbox_n', 1)
  if gap == '1' then redis.call('HSET', meta, 'gap_entry', n) end
  entry = n .. '|' .. writer .. '|' .. now_ms()
  redis.call('HSET', outbox, entry, payload)
end
return {'applied', last_s, 0, '', a.newgen, entry, own_pending}
