-- (after seq.lua and pod_write.lua) Valkey Cluster, step 1 of a batch: the pod's own step, in its slot. The
-- pod's keys share its slot; the keys every pod shares are spread over every shard, and no script may span
-- slots. So the batch's changes to those keys are kept in the pod's outbox (same slot, same atomic step as
-- the seq) and the ingester runs them on their shards (effects.lua: idempotent, so running one twice changes
-- nothing), then deletes the outbox entry. An ingester killed in between leaves the entry; whoever applies
-- the pod's next batch runs it first, and every ingester runs stale entries of its pods, so nothing is lost.
--
-- Order matters for one request key of one pod (set, then unset): so a batch whose pod has an outbox entry
-- of ANOTHER writer is not applied while that entry is young (answer "busy": its writer is about to run it)
-- and, once it is older than the takeover time, the answer is "pending": the caller runs the entry first. A
-- writer's own entries are in flight in order.
-- KEYS: the pod's meta, state log, outbox. ARGV: as apply.lua up to pod_write.lua's, then the writer
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
  local takeover = tonumber(string.match(writer, '@(%d+)$') or '2000')
  local pending = redis.call('HKEYS', outbox)
  if #pending > 0 then
    local t = now_ms()
    for _, f in ipairs(pending) do
      local w, ms = string.match(f, '^%d+|(.*)|(%d+)$')
      if w ~= writer then
        if t - tonumber(ms or '0') < takeover then return {'busy', '-1', 0, f, gen} end
        return {'pending', '-1', 0, f, gen}
      end
      own_pending = own_pending + 1
    end
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
