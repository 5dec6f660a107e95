-- (after seq.lua) Shared by apply.lua and pod_step.lua: the pod's own writes once a batch applies: its state
-- log entry, its seq and generation, the writer's meta fields, counters and flags.
-- ARGV from 9: state field ("" none), state value (a snapshot's first chunk), chunks ("0": a log entry; n >= 1:
-- a snapshot in n chunks, which replaces the log), the generation this makes, then n meta fields and their
-- values ("" deletes one), then n counters and their increments, then n flags (MarkIncomplete reasons),
-- clear_flags ("1": a clear made the pod exact again), then a snapshot's other chunks; what follows is the
-- caller's (read_pod_args answers where it starts).
-- A snapshot comes in chunks (fields "s", "s:1", ...; kv_preflight/index/writer.py cuts them to fill the
-- allocator's 8 KB size class) cut by the writer, not here: every byte a script copies into a Lua string costs
-- Lua's collector more than the copy.
local function read_pod_args()
  local a = {newgen = ARGV[12], meta_set = {}, meta_del = {}, counters = {}, flags = {}, chunks = {}}
  local i = 13
  local n = tonumber(ARGV[i]); i = i + 1
  for _ = 1, n do
    if ARGV[i + 1] == '' then a.meta_del[#a.meta_del + 1] = ARGV[i] else
      a.meta_set[#a.meta_set + 1] = ARGV[i]; a.meta_set[#a.meta_set + 1] = ARGV[i + 1] end
    i = i + 2
  end
  n = tonumber(ARGV[i]); i = i + 1
  for _ = 1, n do a.counters[#a.counters + 1] = {ARGV[i], ARGV[i + 1]}; i = i + 2 end
  n = tonumber(ARGV[i]); i = i + 1
  for _ = 1, n do a.flags[#a.flags + 1] = ARGV[i]; i = i + 1 end
  a.clear_flags = ARGV[i] == '1'
  i = i + 1
  for _ = 2, tonumber(ARGV[11]) do a.chunks[#a.chunks + 1] = ARGV[i]; i = i + 1 end
  a.rest = i
  return a
end
-- foreign_n, foreign_first: writes that hit a key of a foreign type (single node), flagged here.
local function write_pod(a, foreign_n, foreign_first)
  local state = KEYS[2]
  if ARGV[9] ~= '' then
    if ARGV[11] ~= '0' then redis.call('DEL', state) end
    redis.call('HSET', state, ARGV[9], ARGV[10])
    for j, chunk in ipairs(a.chunks) do redis.call('HSET', state, ARGV[9] .. ':' .. j, chunk) end
  end
  local clear_flags = a.clear_flags
  if mode == 'reset' or mode == 'reset_if' then
    if mode == 'reset_if' then
      local fields = redis.call('HKEYS', meta)
      for _, f in ipairs(fields) do
        if string.sub(f, 1, 4) == 'seq:' or string.sub(f, 1, 3) == 'ts:' then redis.call('HDEL', meta, f) end
      end
    end
    redis.call('HINCRBY', meta, 'restarts', 1)
    clear_flags = true  -- empty, as the new engine: exact
  end
  if clear_flags then redis.call('HSET', meta, 'incomplete', 0, 'incomplete_reason', '') end
  local flags = a.flags
  if foreign_n > 0 then
    flags[#flags + 1] = foreign_n .. ' write(s) hit a key of a foreign type (' .. foreign_first .. ')'
    redis.call('HINCRBY', meta, 'foreign_keys', foreign_n)
  end
  if #flags > 0 then redis.call('HSET', meta, 'incomplete', 1, 'incomplete_reason', table.concat(flags, '; ')) end
  if mode == 'import' or mode == 'clear' or mode == 'reset_if' then
    redis.call('HSET', meta, 'gen', a.newgen)
  else
    redis.call('HSET', meta, 'seq:' .. rank, seq, 'ts:' .. rank, ARGV[3], 'last_event_time', ARGV[6], 'gen', a.newgen)
  end
  if ARGV[7] ~= '' then redis.call('HSET', meta, 'model', ARGV[7]) end
  if ARGV[8] ~= '' then redis.call('HSET', meta, 'engine_block_size', ARGV[8]) end
  if verdict_of_gap then redis.call('HINCRBY', meta, 'gaps_accepted', 1) end
  local batches = redis.call('HINCRBY', meta, 'batches', 1)
  for _, c in ipairs(a.counters) do redis.call('HINCRBY', meta, c[1], c[2]) end
  -- the orphan count is stamped with the batch count it was written at: a writer that does not keep it
  -- leaves a stamp that no longer matches, and readers take the count as unknown
  local set, del = a.meta_set, a.meta_del
  for j = 1, #set, 2 do
    if set[j] == 'orphan_keys' then set[#set + 1] = 'orphan_at'; set[#set + 1] = batches end
  end
  for _, f in ipairs(del) do
    if f == 'orphan_keys' then del[#del + 1] = 'orphan_at'; break end
  end
  if #set > 0 then redis.call('HSET', meta, unpack(set)) end
  if #del > 0 then redis.call('HDEL', meta, unpack(del)) end
end
