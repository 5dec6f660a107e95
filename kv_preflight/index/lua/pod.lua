-- The pod step of applying one engine batch: the seq check and every change to the pod's own keys,
-- which share one hash tag ({<pod>}) and so one slot: atomic on a single node and on a cluster.
-- Changes to shared keys (request keys and their bitmaps, engine:<key> and its membership set) are
-- handed to the emit_* functions of the prelude: apply_single.lua runs them here and now; apply_cluster.lua
-- returns them (and keeps them in the pod's outbox) for the ingester to run on their own shards.
-- Every shared-key effect is idempotent and commutes with other pods' effects, so running one again
-- (a retry, a drain of the outbox after a crash) changes nothing, and no count lives on a shared key.
--
-- KEYS: pod meta, pod blocks, pod field ids, pod request-key refs (then the prelude's own).
-- ARGV: pod, rank, seq, ts, mode, model, engine_block_size, now, writer (the ingester's id), then
--       encode_mutations(...).
-- mode: "check" applies only the next seq; "force" also applies past a gap (gap accepted);
--       "reset" clears the pod first (engine restart), then applies; "import" applies without
--       touching the pod's seq (index import); "reset_if" clears the pod if its seq is still
--       ARGV[3] (an engine restart found by a probe). "force" and "reset" re-check here: a batch
--       at or below the persisted seq is still "dup" (another ingester got there first), or
--       "restart" for force; a reset that is no longer a restart is handled as "check".
-- Answers {status, last_seq (decimal string), foreign writes, detail}; status in
-- applied|dup|gap|restart|corrupt (the cluster prelude appends the effects).
--
-- Seqs are 64-bit engine values and Lua numbers are doubles, so seqs travel and are compared as
-- decimal strings; a seq more than 2^32 past the persisted one (or past -1 when none is) is
-- "corrupt": never applied, so a forged frame cannot move the seq and make the next real batch
-- look like an engine restart.
--
-- kvpf:{<pod>}:blocks maps "<engine key>|<tier>[|<group>]" to "<field id>[*<copies>]:<rk>,<rk>..[^<parent>]":
-- the field the block was written with (ids from kvpf:{<pod>}:fields), how many physical copies
-- the engine holds (vLLM 0.32 caches a fully cached prompt's recomputed last block as a second
-- copy under the same hash and reports each copy's eviction), and its request keys, so an
-- eviction needs no read of engine:<key> (on a cluster, another shard).
-- kvpf:{<pod>}:rks maps "<request key>|<field id>" to how many of the pod's blocks link that
-- request key with that field: two engine keys give one request key when they differ only in what
-- llm-d's keys leave out, and evicting one must not drop the entry the other still backs.
-- It also maps "<request key>|~<tier>" to how many of those field ids are on that tier: the pod's bit
-- in the request key's presence bitmap (bits.lua) is set when it leaves 0 and cleared when it comes
-- back, so the bitmaps say exactly what the entries say. The pod's bit number is meta's "num" (given by
-- the fleet-wide numbering, kv_preflight/index/index.py); without one the script answers "nonum" before any write.
--
-- Orphan keys (what lets the lookup bisect this pod, lookup_bits.lua): meta "orphan_keys" counts the
-- request keys the pod holds (a bit on any tier) whose parent (the key before it in its chain) it does
-- not hold; 0 means the pod's keys are closed under "parent", so every chain's keys it holds are a prefix
-- of that chain. A key is held while any tier holds it ("<rk>|~<tier>" above). Kept: each block's value ends
-- in "^<parent>", the request key before its first ("" for a chain's first block: rks[j]'s is rks[j - 1]),
-- read back when the block is evicted; and in the refs "<rk>|>" -> how many held keys name rk as their
-- parent. A store whose parent is not known ("?": index import of an older export) makes the count unknown
-- (the field deleted), as is a pod that held keys before the count existed (index migrate, an older writer):
-- the lookup then walks that pod, never guesses. A clear (AllBlocksCleared, engine restart, index clear)
-- makes it known again (0), as does a step that finds the refs empty (every key evicted, no "|>" left:
-- the "|>" refs are kept only while the count is known, so a key held when it went unknown leaves its own).
local meta, blocks, fkey, rkkey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local pod, rank = ARGV[1], ARGV[2]
local seq_s, ts, mode = ARGV[3], tonumber(ARGV[4]), ARGV[5]
local MAX_AHEAD = 4294967296

local function canon(s)  -- a seq string as decimal without leading zeros, or nil
  if type(s) ~= 'string' or not string.find(s, '^%d+$') then return nil end
  s = string.gsub(s, '^0+', '')
  if s == '' then return '0' end
  return s
end
local function cmp(a, b)  -- -1, 0, 1 for canonical non-negative decimal strings
  if #a ~= #b then return #a < #b and -1 or 1 end
  if a == b then return 0 end
  return a < b and -1 or 1
end
local function succ(s)  -- s + 1
  local i = #s
  while i > 0 and string.byte(s, i) == 57 do i = i - 1 end
  if i == 0 then return '1' .. string.rep('0', #s) end
  return string.sub(s, 1, i - 1) .. string.char(string.byte(s, i) + 1) .. string.rep('0', #s - i)
end
-- A block's reverse-index value -> field id, copies, request keys (a list of strings), the rest of the
-- value after ':' (kept as is when the copies change), and the parent of its first request key ("" the
-- chain root; nil when not written: a block stored without it, or before the orphan count existed).
local function parse_held(v)
  local head, list = string.match(v, '^([^:]*):?(.*)$')
  local id, n = string.match(head, '^(%d+)%*(%d+)$')
  if not id then id, n = head, 1 end
  local keys, parent = string.match(list, '^([^^]*)%^(.*)$')
  local rks = {}
  for rk in string.gmatch(keys or list, '[^,]+') do rks[#rks + 1] = rk end
  return id, tonumber(n), rks, list, parent
end

-- Our own keys (every KEYS entry) must be what we write; anything else is refused before the first write.
local function own_types_ok()
  for i = 1, #KEYS do
    local t = redis.call('TYPE', KEYS[i])
    t = type(t) == 'table' and t.ok or t
    if t ~= 'none' and t ~= 'hash' then return KEYS[i] .. ' holds a ' .. t .. ', expected a hash' end
  end
  return nil
end
local bad = own_types_ok()
if bad then return {'corrupt', '-1', 0, bad} end
local head = redis.call('HMGET', meta, 'num', 'orphan_keys', 'orphan_at', 'batches')
local num = tonumber(head[1])
if num == nil and mode ~= 'clear' and mode ~= 'reset_if' then return {'nonum', '-1', 0, ''} end
-- The orphan count at the start (nil: unknown); a pod whose refs are empty (no key held, no "|>" left from
-- before the count went unknown) has none (0), whatever it held before. "orphan_at" is the
-- pod's batch count when the count was written: a writer of an earlier build (a rolling upgrade) applies
-- batches without keeping the count, so a count that is not this batch count's is unknown, never trusted.
local orphans = tonumber(head[2])
if orphans ~= nil and head[3] ~= (head[4] or '0') then orphans = nil end
if orphans == nil and redis.call('EXISTS', rkkey) == 0 then orphans = 0 end
local orphans_known_at_start = orphans  -- (with the end's: may shards show a gap? apply_cluster.lua)

local seq = canon(seq_s)
local last_raw = redis.call('HGET', meta, 'seq:' .. rank)
local last = last_raw and canon(last_raw)
if last_raw and not last then
  -- A seq we did not write (hand edit, foreign writer): the pod's entries cannot be trusted, so
  -- it is flagged, and the seq counts as unknown: this batch is a gap from the start (replayed
  -- or force-applied by the ingester), which writes a good seq again.
  redis.call('HSET', meta, 'incomplete', 1,
             'incomplete_reason', 'corrupt seq:' .. rank .. ' in the index: ' .. string.sub(last_raw, 1, 40))
  redis.call('HINCRBY', meta, 'corrupt', 1)
end
local last_s = last or '-1'
if seq == nil then return {'corrupt', last_s, 0, 'seq ' .. string.sub(seq_s, 1, 40) .. ' is not a non-negative integer'} end

local byid, byfield, nids = nil, nil, 0
local function field_ids()
  if byid == nil then
    byid, byfield, nids = {}, {}, 0
    local all = redis.call('HGETALL', fkey)
    for i = 1, #all, 2 do
      byid[all[i]] = all[i + 1]
      byfield[all[i + 1]] = all[i]
      nids = nids + 1
    end
  end
end
-- The tier a field (an llm-d entry) names, as the lookup reads it (parse_entry.lua); nil when the
-- lookup would not count it for this pod (speculative, unparseable, another pod's name): no bit then.
local tiers = {}
local function tier_of(fld)
  local t = tiers[fld]
  if t == nil then
    local p, tier = parse(fld)
    t = (p == pod and tier) or false
    tiers[fld] = t
  end
  return t or nil
end
-- The pod's tiers (a key is held while any tier holds it: the lookup counts a pod on any tier).
local pod_tiers = nil
local function tiers_of_pod()
  if pod_tiers == nil then
    field_ids()
    pod_tiers = {}
    local seen = {}
    for _, fld in pairs(byid) do
      local t = tier_of(fld)
      if t and not seen[t] then seen[t] = true; pod_tiers[#pod_tiers + 1] = t end
    end
  end
  return pod_tiers
end
-- HMGET of rk's fields `extra` (a list) and the field `also` (if given), then whether key x is held on any
-- tier but `except`.
local function read_with_held(rk, extra, x, except, also)
  local fields, n = {}, 0
  for _, f in ipairs(extra) do n = n + 1; fields[n] = rk .. f end
  if also then n = n + 1; fields[n] = also end
  local first = n
  for _, t in ipairs(tiers_of_pod()) do
    if t ~= except then n = n + 1; fields[n] = x .. '|~' .. t end
  end
  if n == 0 then return {}, false end
  local r = redis.call('HMGET', rkkey, unpack(fields))
  local held = false
  for i = first + 1, n do if r[i] then held = true end end
  return r, held
end
local function held_elsewhere(rk, tier)
  local _, held = read_with_held(rk, {}, rk, tier)
  return held
end
-- The orphan count (header): rk became held (its parent: "" for a chain's first key, "?" unknown; parent_held:
-- the caller knows it is, having just linked it on this tier) ...
local function now_held(rk, parent, parent_held)
  if orphans == nil then return end
  if parent == '?' or parent == nil then orphans = nil; return end
  -- rk's held children: none while the count is 0 (each would be an orphan, its parent rk not held), so
  -- the common case (a closed pod growing a chain) reads nothing for them.
  local kids = orphans > 0 and {'|>'} or {}
  if parent == '' or parent_held then
    if orphans > 0 then orphans = orphans - (tonumber(redis.call('HGET', rkkey, rk .. '|>')) or 0) end
  else
    local r, held = read_with_held(rk, kids, parent, nil)
    orphans = orphans - (#kids > 0 and tonumber(r[1]) or 0) + (held and 0 or 1)
  end
  if parent ~= '' then redis.call('HINCRBY', rkkey, parent .. '|>', 1) end
end
-- ... or is no longer held (its parent from the block dropped: nil when that block did not say).
local function not_held(rk, parent)
  if orphans == nil then return end
  if parent == nil then orphans = nil; return end
  if parent == '' then
    orphans = orphans + (tonumber(redis.call('HGET', rkkey, rk .. '|>')) or 0)
    return
  end
  local r, held = read_with_held(rk, {'|>'}, parent, nil, parent .. '|>')
  orphans = orphans + (tonumber(r[1]) or 0) - (held and 0 or 1)
  if (tonumber(r[2]) or 0) <= 1 then  -- (one command either way: the usual eviction, a chain's tail)
    redis.call('HDEL', rkkey, parent .. '|>')
  else
    redis.call('HINCRBY', rkkey, parent .. '|>', -1)
  end
end
-- One more (or one fewer) of the pod's blocks links request key rk with field id `id`: its entry
-- and its bit follow the first link and the last unlink; the orphan count, the key's first tier and
-- its last (parent: the request key before rk in its chain, as now_held takes it).
local function link_rk(rk, id, fld, tier, parent, parent_held)
  if redis.call('HINCRBY', rkkey, rk .. '|' .. id, 1) == 1 then
    local flip = tier and redis.call('HINCRBY', rkkey, rk .. '|~' .. tier, 1) == 1
    if flip and orphans ~= nil and not held_elsewhere(rk, tier) then now_held(rk, parent, parent_held) end
    emit_entry(rk, fld, true, flip and tier or nil, num)
  end
end
local function unlink_rk(rk, id, fld, tier, parent)
  local f = rk .. '|' .. id
  if redis.call('HINCRBY', rkkey, f, -1) <= 0 then
    redis.call('HDEL', rkkey, f)
    local flip = false
    if tier then
      local a = rk .. '|~' .. tier
      if redis.call('HINCRBY', rkkey, a, -1) <= 0 then
        redis.call('HDEL', rkkey, a)
        flip = num ~= nil
        if orphans ~= nil and not held_elsewhere(rk, tier) then not_held(rk, parent) end
      end
    end
    emit_entry(rk, fld, false, flip and tier or nil, num)
  end
end
-- Unlink one block of the pod from the shared keys (its request keys through the refs; parent: its first
-- key's, nil when the block did not keep it).
local function drop_block(bk, id, rks, parent)
  field_ids()
  local fld = byid[id] or id  -- a value that is not an id is a field itself
  local ek = string.match(bk, '^([^|]*)')
  local tier = tier_of(fld)
  for j, rk in ipairs(rks) do unlink_rk(rk, id, fld, tier, j == 1 and parent or rks[j - 1]) end
  emit_unlink(ek, pod .. '|' .. string.sub(bk, #ek + 2))
end
-- Remove every entry of the pod (AllBlocksCleared, engine restart, index clear): O(pod's blocks).
local function clear_pod()
  field_ids()
  local all = redis.call('HGETALL', rkkey)
  for i = 1, #all, 2 do
    local rk, id = string.match(all[i], '^(.*)|([^|]*)$')
    local c = rk and string.sub(id, 1, 1)
    if c == '~' then
      if num then emit_entry(rk, nil, false, string.sub(id, 2), num) end
    elseif c == '>' then  -- the orphan count's (above): gone with the refs
    elseif rk then
      emit_entry(rk, byid[id] or id, false, nil, num)
    end
  end
  all = redis.call('HGETALL', blocks)
  local n = 0
  for i = 1, #all, 2 do
    local ek = string.match(all[i], '^([^|]*)')
    emit_unlink(ek, pod .. '|' .. string.sub(all[i], #ek + 2))
    n = n + 1
  end
  redis.call('DEL', blocks, rkkey)
  orphans = 0  -- nothing held: known again
  redis.call('HSET', meta, 'orphan_keys', 0)
  return n
end
-- Before every answer of a step that applied: the orphan count written (or deleted: unknown), and
-- whether the shards may show a layout with a gap while this step's effects travel (apply_cluster.lua).
local function done(reply)
  if orphans == nil then
    redis.call('HDEL', meta, 'orphan_keys', 'orphan_at')
  else
    redis.call('HSET', meta, 'orphan_keys', orphans, 'orphan_at', redis.call('HGET', meta, 'batches') or '0')
  end
  gaps_unsafe = orphans_known_at_start == nil or orphans_known_at_start > 0 or orphans == nil or orphans > 0
  return finish(reply)
end

if mode == 'clear' then  -- index clear: ARGV[3] is "0"
  local n = clear_pod()
  return done({'applied', tostring(n), 0, ''})
end
if mode == 'reset_if' then
  if last ~= seq then return finish({'dup', last_s, 0, ''}) end
  clear_pod()
  local fields = redis.call('HKEYS', meta)
  for _, f in ipairs(fields) do
    if string.sub(f, 1, 4) == 'seq:' or string.sub(f, 1, 3) == 'ts:' then redis.call('HDEL', meta, f) end
  end
  redis.call('HINCRBY', meta, 'restarts', 1)
  redis.call('HSET', meta, 'incomplete', 0, 'incomplete_reason', '')  -- empty, as the new engine: exact
  return done({'applied', last_s, 0, ''})
end

-- What "check" answers: nil (the next seq: apply), or dup, restart, gap or corrupt.
local verdict = nil
if mode ~= 'import' then
  if last then
    local c = cmp(seq, last)
    if c <= 0 then
      local last_ts = tonumber(redis.call('HGET', meta, 'ts:' .. rank) or '0') or 0
      if ts > last_ts then verdict = 'restart' else verdict = 'dup' end
    elseif seq ~= succ(last) then
      if tonumber(seq) - tonumber(last) > MAX_AHEAD then verdict = 'corrupt' else verdict = 'gap' end
    end
  elseif seq ~= '0' then
    if #seq > 15 or tonumber(seq) >= MAX_AHEAD then verdict = 'corrupt' else verdict = 'gap' end
  end
end
if verdict == 'corrupt' then
  redis.call('HINCRBY', meta, 'corrupt', 1)
  return {'corrupt', last_s, 0, 'seq ' .. seq .. ' is more than 2^32 past ' .. last_s}
end
if mode == 'check' and verdict then return {verdict, last_s, 0, ''} end
-- force accepts a gap, never a batch at or below the persisted seq
if mode == 'force' and (verdict == 'dup' or verdict == 'restart') then return {verdict, last_s, 0, ''} end
if mode == 'reset' and verdict ~= 'restart' then
  if verdict then return {verdict, last_s, 0, ''} end
  mode = 'check'  -- another ingester already reset and this is its next seq: apply, keep its work
end

-- Every op is checked before the first write, so a malformed argument list changes nothing.
local nf = tonumber(ARGV[10])
do
  local j = 11 + (nf or -1e9)
  if nf == nil or nf < 0 or j - 1 > #ARGV then return {'corrupt', last_s, 0, 'malformed ops'} end
  while j <= #ARGV do
    local op = ARGV[j]
    if op == 'S' or op == 'A' then
      local fi, n = tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4])
      if not fi or not n or fi < 1 or fi > nf or n < 0 or j + 5 + n > #ARGV then
        return {'corrupt', last_s, 0, 'malformed store op'}
      end
      j = j + 6 + n
    elseif op == 'R' then j = j + 3
    elseif op == 'C' then j = j + 1
    elseif op == 'I' then j = j + 2
    else return {'corrupt', last_s, 0, 'unknown op ' .. string.sub(tostring(op), 1, 20)} end
  end
  if j ~= #ARGV + 1 then return {'corrupt', last_s, 0, 'truncated ops'} end
end

if mode == 'reset' then
  clear_pod()
  redis.call('HINCRBY', meta, 'restarts', 1)
  redis.call('HSET', meta, 'incomplete', 0, 'incomplete_reason', '')  -- empty, as the new engine: exact
end
local stored, removed, cleared, reannounced = 0, 0, 0, 0
local ids = {}  -- batch field index -> id
local function id_of(fi)
  local id = ids[fi]
  if id then return id end
  field_ids()
  local fld = ARGV[10 + fi]
  id = byfield[fld]
  if id == nil then
    nids = nids + 1
    id = tostring(nids)
    redis.call('HSET', fkey, id, fld)
    byid[id], byfield[fld] = fld, id
    pod_tiers = nil  -- it may name a tier the pod had not used
  end
  ids[fi] = id
  return id
end
local flags = {}
local i = 11 + nf
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' or op == 'A' then
    -- A: a store whose event had no parent. vLLM (0.32, kv_cache_report_mode "full") re-sends
    -- BlockStored for the prefix-cache blocks a request reuses, always from block 0 with no
    -- parent (block_pool.emit_cached_block_events); a real second copy of a held hash (the
    -- recomputed last block of a fully cached prompt) comes from cache_full_blocks with its
    -- parent. So a parentless store of a hash the pod already holds is a re-announcement.
    local ek, slot, fi, n = ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
    local bk = ek .. '|' .. slot
    local rks = {}
    for j = 1, n do rks[j] = ARGV[i + 4 + j] end
    local parent = ARGV[i + 5 + n]  -- of rks[1] ("" the chain root, "?" unknown); rks[j]'s is rks[j - 1]
    if parent == '?' then orphans = nil end  -- written without its chain: the count is unknown
    local id = id_of(fi)
    -- One call in the common case (a new block); a held one is read back.
    local value = id .. ':' .. table.concat(rks, ',')
    if parent ~= '?' then value = value .. '^' .. parent end  -- kept for its eviction (the orphan count)
    if redis.call('HSETNX', blocks, bk, value) == 1 then
      local fld = ARGV[10 + fi]
      -- If the engine key is foreign (single node: found now), its request keys could never be
      -- found again on eviction, so the block is not indexed at all (the pod is flagged).
      if emit_link(ek, pod .. '|' .. slot, rks) then
        local tier = tier_of(fld)
        for j, rk in ipairs(rks) do link_rk(rk, id, fld, tier, j == 1 and parent or rks[j - 1], j > 1) end
        stored = stored + 1
      else
        redis.call('HDEL', blocks, bk)
      end
    elseif op == 'A' then
      reannounced = reannounced + 1
    else  -- another physical copy of a held hash: count it
      local hid, copies, _, list = parse_held(redis.call('HGET', blocks, bk))
      redis.call('HSET', blocks, bk, hid .. '*' .. (copies + 1) .. ':' .. list)
      stored = stored + 1
    end
    i = i + 6 + n
  elseif op == 'R' then
    local ek, slot = ARGV[i + 1], ARGV[i + 2]
    local bk = ek .. '|' .. slot
    local held = redis.call('HGET', blocks, bk)
    if held then
      local id, copies, rks, list, parent = parse_held(held)
      if copies > 1 then
        redis.call('HSET', blocks, bk, id .. (copies > 2 and ('*' .. (copies - 1)) or '') .. ':' .. list)
      else
        redis.call('HDEL', blocks, bk)
        drop_block(bk, id, rks, parent)
      end
      removed = removed + 1
    end
    i = i + 3
  elseif op == 'C' then
    clear_pod()
    redis.call('HSET', meta, 'incomplete', 0, 'incomplete_reason', '')  -- exact again from here
    flags = {}
    cleared = cleared + 1
    i = i + 1
  elseif op == 'I' then
    flags[#flags + 1] = ARGV[i + 1]
    i = i + 2
  end
end
local nforeign, first_foreign = foreign_summary()
if nforeign > 0 then
  flags[#flags + 1] = nforeign .. ' write(s) hit a key of a foreign type (' .. first_foreign .. ')'
  redis.call('HINCRBY', meta, 'foreign_keys', nforeign)
end
if #flags > 0 then
  redis.call('HSET', meta, 'incomplete', 1, 'incomplete_reason', table.concat(flags, '; '))
end
if mode == 'import' then
  redis.call('HSET', meta, 'model', ARGV[6])
else
  redis.call('HSET', meta, 'seq:' .. rank, seq, 'ts:' .. rank, ARGV[4], 'model', ARGV[6],
             'last_event_time', ARGV[8])
end
if ARGV[7] ~= '' then redis.call('HSET', meta, 'engine_block_size', ARGV[7]) end
if mode == 'force' and last and cmp(seq, succ(last)) > 0 then
  redis.call('HINCRBY', meta, 'gaps_accepted', 1)
end
redis.call('HINCRBY', meta, 'batches', 1)
if stored > 0 then redis.call('HINCRBY', meta, 'stored', stored) end
if removed > 0 then redis.call('HINCRBY', meta, 'removed', removed) end
if cleared > 0 then redis.call('HINCRBY', meta, 'cleared', cleared) end
if reannounced > 0 then redis.call('HINCRBY', meta, 'reannounced', reannounced) end
return done({'applied', last_s, nforeign, first_foreign or ''})
