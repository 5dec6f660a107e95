-- Apply one engine batch for one (pod, data-parallel rank), after checking its seq.
--
-- KEYS: pod meta, pod blocks (reverse index), pod field ids, pod request-key refs, pods registry,
--       fleet counters
--       (names built by shared/layout.py; request keys and engine:<key> are derived here).
-- ARGV: pod, rank, seq, ts, mode, model, engine_block_size, now, then encode_mutations(...).
-- mode: "check" applies only the next seq; "force" also applies past a gap (gap accepted);
--       "reset" clears the pod first (engine restart), then applies; "import" applies without
--       touching the pod's seq (index import); "reset_if" clears the pod if its seq is still
--       ARGV[3] (an engine restart found by a probe). "force" and "reset" re-check here: a batch
--       at or below the persisted seq is still "dup" (another ingester got there first), or
--       "restart" for force; a reset that is no longer a restart is handled as "check".
-- Returns {status, last_seq (decimal string), foreign writes, detail}; status in
-- applied|dup|gap|restart|corrupt.
--
-- Seqs are 64-bit engine values and Lua numbers are doubles, so seqs travel and are compared as
-- decimal strings; a seq more than 2^32 past the persisted one (or past -1 when none is) is
-- "corrupt": never applied, so a forged frame cannot move the seq and make the next real batch
-- look like an engine restart.
local meta, blocks, fkey, rkref, pods_key, counters = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
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
local function ahead(a, b)  -- a - b for canonical a > b, exact below 2^53, else a large double
  return tonumber(a) - tonumber(b)
end
local function succ(s)  -- s + 1
  local i = #s
  while i > 0 and string.byte(s, i) == 57 do i = i - 1 end
  if i == 0 then return '1' .. string.rep('0', #s) end
  return string.sub(s, 1, i - 1) .. string.char(string.byte(s, i) + 1) .. string.rep('0', #s - i)
end

local bad = own_types_ok({[meta] = 'hash', [blocks] = 'hash', [fkey] = 'hash', [rkref] = 'hash', [pods_key] = 'hash'})
if bad then return {'corrupt', '-1', 0, bad} end

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

if mode == 'reset_if' then
  if last ~= seq then return {'dup', last_s, 0, ''} end
  clear_pod(blocks, fkey, rkref)
  local fields = redis.call('HKEYS', meta)
  for _, f in ipairs(fields) do
    if string.sub(f, 1, 4) == 'seq:' or string.sub(f, 1, 3) == 'ts:' then redis.call('HDEL', meta, f) end
  end
  redis.call('HINCRBY', meta, 'restarts', 1)
  redis.call('HSET', meta, 'incomplete', 0, 'incomplete_reason', '')  -- empty, as the new engine: exact
  return {'applied', last_s, 0, ''}
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
      if ahead(seq, last) > MAX_AHEAD then verdict = 'corrupt' else verdict = 'gap' end
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
if mode == 'reset' then
  clear_pod(blocks, fkey, rkref)
  redis.call('HINCRBY', meta, 'restarts', 1)
  redis.call('HSET', meta, 'incomplete', 0, 'incomplete_reason', '')  -- empty, as the new engine: exact
end
local stored, removed, cleared, reannounced = 0, 0, 0, 0
local nf = tonumber(ARGV[9])
local byid, byfield, nids = nil, nil, 0
local ids = {}  -- batch field index -> id
local function id_of(fi)
  local id = ids[fi]
  if id then return id end
  if byid == nil then byid, byfield, nids = field_ids(fkey) end
  local fld = ARGV[9 + fi]
  id = byfield[fld]
  if id == nil then
    nids = nids + 1
    id = tostring(nids)
    redis.call('HSET', fkey, id, fld)
    byid[id], byfield[fld] = fld, id
  end
  ids[fi] = id
  return id
end
-- Every op is checked before the first write, so a malformed argument list changes nothing.
do
  local j = 10 + (nf or -1e9)
  if nf == nil or nf < 0 or j - 1 > #ARGV then return {'corrupt', last_s, 0, 'malformed ops'} end
  while j <= #ARGV do
    local op = ARGV[j]
    if op == 'S' or op == 'A' then
      local fi, n = tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4])
      if not fi or not n or fi < 1 or fi > nf or n < 0 or j + 4 + n > #ARGV then
        return {'corrupt', last_s, 0, 'malformed store op'}
      end
      j = j + 5 + n
    elseif op == 'R' then j = j + 3
    elseif op == 'C' then j = j + 1
    elseif op == 'I' then j = j + 2
    else return {'corrupt', last_s, 0, 'unknown op ' .. string.sub(tostring(op), 1, 20)} end
  end
  if j ~= #ARGV + 1 then return {'corrupt', last_s, 0, 'truncated ops'} end
end
local flags = {}
local i = 10 + nf
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' or op == 'A' then
    -- A: a store whose event had no parent. vLLM (0.32, kv_cache_report_mode "full") re-sends
    -- BlockStored for the prefix-cache blocks a request reuses, always from block 0 with no
    -- parent (block_pool.emit_cached_block_events); a real second copy of a held hash (the
    -- recomputed last block of a fully cached prompt) comes from cache_full_blocks with its
    -- parent. So a parentless store of a hash the pod already holds is a re-announcement.
    local ek, tier, fi, n = ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
    local fld = ARGV[9 + fi]
    local bk = ek .. '|' .. tier
    local held = redis.call('HGET', blocks, bk)
    if held and op == 'A' then
      reannounced = reannounced + 1
    elseif held then  -- another physical copy of a held hash: count it
      local _, n_held = copies(held)
      redis.call('HSET', blocks, bk, id_of(fi) .. '*' .. (n_held + 1))
      stored = stored + 1
    else
      local za = {}
      for j = 1, n do za[2 * j - 1], za[2 * j] = j - 1, ARGV[i + 4 + j] end
      -- The engine key first: if it is foreign, its request keys could never be found again
      -- on eviction, so the block is not indexed at all (the pod is flagged below).
      if n == 0 or shared_call('ZADD', 'engine:' .. ek, unpack(za)) ~= nil then
        redis.call('HSET', blocks, bk, id_of(fi))
        for j = 1, n do
          local rk = ARGV[i + 4 + j]
          if shared_call('HSET', rk, fld, '') == 0 then rkref_add(rkref, rk, fld) end
        end
        stored = stored + 1
      end
    end
    i = i + 5 + n
  elseif op == 'R' then
    local ek, tier = ARGV[i + 1], ARGV[i + 2]
    local bk = ek .. '|' .. tier
    local held = redis.call('HGET', blocks, bk)
    local fld, n_held = nil, 0
    if held then fld, n_held = copies(held) end
    if n_held > 1 then
      redis.call('HSET', blocks, bk, fld .. (n_held > 2 and ('*' .. (n_held - 1)) or ''))
      removed = removed + 1
    elseif fld then
      redis.call('HDEL', blocks, bk)
      if is_id(fld) then
        if byid == nil then byid, byfield, nids = field_ids(fkey) end
        fld = byid[fld]
      end
      unlink(ek, fld, rkref)
      removed = removed + 1
    end
    i = i + 3
  elseif op == 'C' then
    clear_pod(blocks, fkey, rkref)
    redis.call('HSET', meta, 'incomplete', 0, 'incomplete_reason', '')  -- exact again from here
    flags = {}
    cleared = cleared + 1
    i = i + 1
  elseif op == 'I' then
    flags[#flags + 1] = ARGV[i + 1]
    i = i + 2
  end
end
if foreign.n > 0 then
  flags[#flags + 1] = foreign.n .. ' write(s) hit a key of a foreign type (' .. foreign.first .. ')'
  redis.call('HINCRBY', meta, 'foreign_keys', foreign.n)
  redis.call('HINCRBY', counters, 'foreign_keys', foreign.n)
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
redis.call('HSET', pods_key, pod, ARGV[6])
return {'applied', last_s, foreign.n, foreign.first or ''}
