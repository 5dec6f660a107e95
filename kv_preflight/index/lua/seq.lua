-- Shared by apply.lua and pod_step.lua: the seq and generation checks of one batch of a pod, against its meta.
-- Seqs are 64-bit engine values and Lua numbers are doubles, so seqs travel and are compared as decimal
-- strings; a seq more than 2^32 past the persisted one (or past -1 when none is) is "corrupt": never applied,
-- so a forged frame cannot move the seq and make the next real batch look like an engine restart.
--
-- KEYS[1]: the pod's meta. ARGV: rank, seq, ts, mode, gen (the generation the batch was planned at), ...
-- mode: "check" applies only the next seq; "force" also applies past a gap (gap accepted); "reset" is a
-- restart's batch planned with the pod cleared first: it applies only while the batch is still a restart
-- ("replan" when it became the next seq: another ingester reset the pod meanwhile); "import" applies without
-- touching the seq (index import); "reset_if" clears the pod if its seq is still ARGV[2] (an engine restart
-- found by a probe); "clear" (index clear) applies with no seq check.
-- check_batch() answers nil (apply) or a reply {status, last seq, 0, detail, gen}: dup, gap, restart,
-- corrupt, replan, or stale (the pod's generation is not the plan's: the writer reloads the pod and plans again).
local meta = KEYS[1]
local rank, mode = ARGV[1], ARGV[4]
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

-- Our own keys (every KEYS entry) must be what we write; anything else is refused before the first write.
local function own_types_ok()
  for i = 1, #KEYS do
    local t = redis.call('TYPE', KEYS[i])
    t = type(t) == 'table' and t.ok or t
    if t ~= 'none' and t ~= 'hash' then return KEYS[i] .. ' holds a ' .. t .. ', expected a hash' end
  end
  return nil
end

local head = redis.call('HMGET', meta, 'seq:' .. rank, 'ts:' .. rank, 'gen', 'num')
local gen = head[3] or '0'
local seq = canon(ARGV[2])
local last = head[1] and canon(head[1])
local last_s = last or '-1'
local verdict_of_gap = false  -- force past a gap: counted

local function check_batch()
  local bad = own_types_ok()
  if bad then return {'corrupt', '-1', 0, bad, gen} end
  -- A pod with no number was forgotten (index clear --forget, retention) or lost: its writer lists and numbers
  -- it again before anything is written. (A field HMGET did not find is false here, never nil: compared with
  -- nil this never answered, and a writer still holding the old number wrote the pod's meta, state and bits
  -- under a freed number, with no registry row.)
  if not head[4] and mode ~= 'clear' and mode ~= 'reset_if' then return {'nonum', '-1', 0, '', gen} end
  if head[1] and not last then
    -- A seq we did not write (hand edit, foreign writer): the pod's entries cannot be trusted, so it is
    -- flagged, and the seq counts as unknown: this batch is a gap from the start (replayed or force-applied
    -- by the ingester), which writes a good seq again.
    redis.call('HSET', meta, 'incomplete', 1,
               'incomplete_reason', 'corrupt seq:' .. rank .. ' in the index: ' .. string.sub(head[1], 1, 40))
    redis.call('HINCRBY', meta, 'corrupt', 1)
  end
  if mode == 'clear' or mode == 'import' then
    if gen ~= ARGV[5] then return {'stale', last_s, 0, '', gen} end
    return nil
  end
  if seq == nil then return {'corrupt', last_s, 0, 'seq ' .. string.sub(ARGV[2], 1, 40) .. ' is not a non-negative integer', gen} end
  if mode == 'reset_if' then
    if last ~= seq then return {'dup', last_s, 0, '', gen} end
    if gen ~= ARGV[5] then return {'stale', last_s, 0, '', gen} end
    return nil
  end
  local verdict = nil
  if last then
    local c = cmp(seq, last)
    if c <= 0 then
      local last_ts = tonumber(head[2] or '0') or 0
      if tonumber(ARGV[3]) > last_ts then verdict = 'restart' else verdict = 'dup' end
    elseif seq ~= succ(last) then
      if tonumber(seq) - tonumber(last) > MAX_AHEAD then verdict = 'corrupt' else verdict = 'gap' end
    end
  elseif seq ~= '0' then
    if #seq > 15 or tonumber(seq) >= MAX_AHEAD then verdict = 'corrupt' else verdict = 'gap' end
  end
  if verdict == 'corrupt' then
    redis.call('HINCRBY', meta, 'corrupt', 1)
    return {'corrupt', last_s, 0, 'seq ' .. seq .. ' is more than 2^32 past ' .. last_s, gen}
  end
  if mode == 'check' and verdict then return {verdict, last_s, 0, '', gen} end
  -- force accepts a gap, never a batch at or below the persisted seq
  if mode == 'force' then
    if verdict == 'dup' or verdict == 'restart' then return {verdict, last_s, 0, '', gen} end
    verdict_of_gap = verdict == 'gap' and last ~= nil
  end
  if mode == 'reset' then
    if verdict == nil then return {'replan', last_s, 0, '', gen} end
    if verdict ~= 'restart' then return {verdict, last_s, 0, '', gen} end
  end
  if gen ~= ARGV[5] then return {'stale', last_s, 0, '', gen} end
  return nil
end
