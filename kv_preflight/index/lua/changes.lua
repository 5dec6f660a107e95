-- Shared by apply.lua (a single node: a batch's changes run in its script) and effects.lua (a Valkey Cluster:
-- each shard runs its share): the changes a pod's plan makes to keys every pod shares (kv_preflight/index/
-- pod_state.py plans them, kv_preflight/index/changes.py encodes them; every key name arrives as an argument).
-- The common changes are one command each and no string work here (this script's own work, not Valkey's
-- commands, was most of a batch's cost); the rare ones keep the general form.
--
--   E rk field              the pod's llm-d entry written (HSET rk field "")
--   e rk field              ... deleted (HDEL); the key is then checked for X below
--   B pkey name mine        the pod's bit set in the presence hash pkey, field name (value "<n>:<bitmap>", n
--                           the entries the bits stand for): "mine" is the value with the pod's bit alone,
--                           "1:" then the bitmap, so the first holder writes it whole (HSETNX) and a later
--                           one sets its bit (n + 1). Sent with E when the entry and the bit come and go
--                           together (an entry per bit: llm-d's JSON entries name the group).
--   b pkey name mine        the pod's bit cleared (n - 1); the field goes when no bit and no count is left
--                           (the hash, with its last field). Both are idempotent: n moves only with the bit.
--   F field name mine       sets the field, bit name ("": none) and own value the S and R ops below use (a
--                           batch's blocks mostly share them: each is sent once, not per block)
--   S n (rk pkey ek_key)*n  n blocks of one request key stored: per block E and B with those, and (ek_key
--                           not "") z; a batch's stores come in runs (one op name and dispatch per run)
--   R n (rk pkey ek_key)*n  ... let go of: e; if the key holds no entry any more, its presence hash goes
--                           and (ek_key not "") x's ZREM; if it still does, b
--   K rk pkey field entry name bitdelta byte mask   the general form, for an entry and a bit that do not
--        move together (an entry two groups share, a bit moved to another name): the entry written (entry
--        1) or deleted (-1) and the bit set (bitdelta 1) or cleared (-1), n following the entry's HSET/HDEL.
--   Z ek_key n rk..         engine:<ek> gains the block's request keys at positions 0..n-1 (ZADD)
--   X ek_key n rk..         the pod let go of the block: its request keys leave engine:<ek> if none of them
--                           holds an entry any more (llm-d's pruning rule: HLEN of each is 0)
--   z ek_key rk, x ek_key rk   the same for a block of one request key (an engine block of 16 tokens)
--   G sibs                  the bitmap of the pod's sibling data-parallel ranks (kv_preflight/index/rank_pods.py) for the
--                           K ops after it ("" again: none): the ranks of one pod share its llm-d entry, so a rank
--                           letting go of a key deletes the entry only when no sibling's bit is left there, and
--                           a rank storing one counts it in n only when it wrote it (HSET said new). A pod with
--                           siblings sends its changes in K form only (no S, R, E/B pairs).
--   q rk j                  (a cluster shard) whether the key holds no entry at this point: j is listed in
--                           `probes` if so (the X at position j of the run runs if all its keys were)
--   s n (rk pkey)*n, r n (rk pkey)*n   (a cluster shard) S and R with no engine key (a shard's engine keys
--                           are plain commands after this round): no empty third argument per block. r also
--                           lists, in `emptied`, the position of each block that left its key with no entry,
--                           which answers the probe of a drop beside it (its q is not sent)
-- Writes to keys we do not own go through pcall: a key of a foreign type (someone's LIST at a request key)
-- fails that one command, never the script, so a batch is never left half applied and a retry counts nothing
-- twice; failures are counted (foreign.n) and the first is kept. A key that moved away (cluster: resharding,
-- failover) fails with "non local key": its op is listed in `moved` for the caller to send through the
-- cluster's routing (effects.lua). A refusal that says the server's state, not the key's (OOM at maxmemory under
-- noeviction, MISCONF, NOREPLICAS, READONLY), ends the script with that error: Valkey refuses those only
-- before a script's first write, so nothing was changed, and the caller retries it as it retries any
-- transient error (counted as a foreign key, it left the pod flagged and its changes unmade). So does a cluster
-- down in this node's view (a master starting, or cut off from the others), ended as CLUSTERDOWN: its state cannot
-- change during a script, and while it is down every command that names a key is refused, so none was written.
local foreign = {n = 0, first = nil}
local moved = {}
local empty = {}    -- request key -> true once it holds no entry (for X), false when it still does
local probes = {}  -- q ops that found their key empty (their j)
local emptied = {}  -- r blocks that left their key empty (their op position)
local op_at = 0     -- the position of the op running (for `moved`; each block of an S or R run counts)
local sibs = ''     -- G: the sibling ranks' bits for the K ops that follow
-- Globals cost a table lookup at every use; the loop below runs a few of these per block, so they are locals.
local pcall_, type_, argv = redis.pcall, type, ARGV
local server_states = {OOM = true, MISCONF = true, NOREPLICAS = true, READONLY = true}
local function failed(r, key)  -- a command's error reply: a moved key or a foreign-typed one (returns nil)
  if server_states[string.match(r.err, '^%u+')] then error(r) end
  if string.find(r.err, 'cluster is down', 1, true) then  -- "ERR Script attempted to execute a command while..."
    error({err = 'CLUSTERDOWN ' .. string.gsub(r.err, '^ERR ', '')})
  end
  if string.find(r.err, 'non local', 1, true) or string.find(r.err, 'MOVED', 1, true) or
     string.find(r.err, 'ASK', 1, true) then
    moved[#moved + 1] = op_at
  else
    foreign.n = foreign.n + 1
    if foreign.first == nil then foreign.first = key .. ': ' .. string.sub(r.err, 1, 120) end
  end
  return nil
end
-- A reply that is not the usual 0 or 1, checked: itself, or nil for an error (failed). The loops below call
-- redis.pcall themselves and come here only then: a Lua function call and a type() per command were a tenth
-- of a batch's cost in Valkey (scripts/callgrind).
local function ok(r, key)
  if type_(r) == 'table' and r.err then return failed(r, key) end
  return r
end
local function call(cmd, key, ...)
  local r = pcall_(cmd, key, ...)
  if type_(r) == 'table' and r.err then return failed(r, key) end
  return r
end
-- the same with a fixed count of arguments (no vararg frame to build)
local function call2(cmd, key, a)
  local r = pcall_(cmd, key, a)
  if type_(r) == 'table' and r.err then return failed(r, key) end
  return r
end
local function with_bit(s, b, m, on)
  local cur = 0
  if b <= #s then cur = string.byte(s, b) end
  if (bit.band(cur, m) ~= 0) == on then return s end
  if #s < b then s = s .. string.rep('\0', b - #s) end
  local nb
  if on then nb = bit.bor(cur, m) else nb = bit.band(cur, 255 - m) end
  s = string.sub(s, 1, b - 1) .. string.char(nb) .. string.sub(s, b + 1)
  if not on then s = (string.gsub(s, '%z+$', '')) end
  return s
end
local function split(v)  -- "<n>:<bitmap>" -> n, bitmap
  if type(v) ~= 'string' then return 0, '' end
  local c = string.find(v, ':', 1, true)
  if not c then return 0, '' end
  return tonumber(string.sub(v, 1, c - 1)) or 0, string.sub(v, c + 1)
end
local function put(pkey, name, n, bm)
  if bm == '' and n <= 0 then call('HDEL', pkey, name) else call('HSET', pkey, name, n .. ':' .. bm) end
end
-- The bit of "mine" (byte b, mask m) set or cleared in a field another pod's bit is in too (v: its value).
local function bit_change(pkey, name, mine, on, v)
  local b = #mine - 2
  local m = string.byte(mine, #mine)
  local n, bm = split(v)
  local nb = with_bit(bm, b, m, on)
  if nb == bm then return end  -- already so (a change run twice): n stays
  if on then n = n + 1 else n = n - 1 end
  put(pkey, name, n, nb)
end
-- Whether bitmap bm has any bit of mask set (a sibling rank still holds the key).
local function any_of(bm, mask)
  for i = 1, math.min(#bm, #mask) do
    if bit.band(string.byte(bm, i), string.byte(mask, i)) ~= 0 then return true end
  end
  return false
end
local function key_change(rk, pkey, fld, entry, bitname, bitdelta, b, m)
  local added = 0
  local n, bm, read = 0, '', false
  if entry == '-1' and sibs ~= '' and bitname ~= '' then
    -- a data-parallel rank lets go: the pod's llm-d entry stays while a sibling rank's bit is left here
    n, bm = split(call('HGET', pkey, bitname))
    read = true
    if bitdelta ~= '0' then bm = with_bit(bm, tonumber(b), tonumber(m), bitdelta == '1') end
    if any_of(bm, sibs) then entry = '0' end
  end
  if entry == '1' then
    empty[rk] = false
    local r = call('HSET', rk, fld, '')
    if r == nil then return end  -- a foreign-typed request key: no entry, so no bit either
    added = r
  elseif entry == '-1' then
    local r = call('HDEL', rk, fld)
    if r ~= nil then added = -r end
    empty[rk] = nil
  end
  if bitdelta == '0' and added == 0 then return end
  if not read then
    n, bm = split(call('HGET', pkey, bitname))
    if bitdelta ~= '0' then bm = with_bit(bm, tonumber(b), tonumber(m), bitdelta == '1') end
  end
  put(pkey, bitname, n + added, bm)
end
local function engine_add(ek_key, i, n)  -- the request keys at ARGV[i + 1 .. i + n]
  local za = {}
  for j = 1, n do za[2 * j - 1], za[2 * j] = j - 1, ARGV[i + j] end
  call('ZADD', ek_key, unpack(za))
end
-- Whether the request key holds no entry, asked after a block's entry left it (a run's R or r block), and
-- remembered for the engine-key ops and probes after it.
local function hlen_is_0(rk)
  local r = pcall_('HLEN', rk)
  if r ~= 0 and r ~= 1 then r = ok(r, rk) end
  local e = r == 0
  empty[rk] = e
  return e
end
local function is_empty(rk)
  local e = empty[rk]
  if e == nil then e = hlen_is_0(rk) end
  return e
end
local function engine_drop(ek_key, rks)
  for _, rk in ipairs(rks) do
    if not is_empty(rk) then return end
  end
  call('ZREM', ek_key, unpack(rks))
end
-- Runs the ops in ARGV from position i; returns nothing (foreign, moved, empty and probes say what happened).
local function run_changes(i)
  local n_args = #argv
  local fld, name, mine = '', '', ''
  while i <= n_args do
    local op = argv[i]
    op_at = op_at + 1
    if op == 'S' or op == 's' then  -- a run of stores: S blocks (rk, pkey, ek_key), s blocks (rk, pkey)
      local j, step = i + 2, (op == 'S') and 3 or 2
      op_at = op_at - 1  -- each block is an op of its own for `moved`
      for _ = 1, tonumber(argv[i + 1]) do
        op_at = op_at + 1
        local rk = argv[j]
        -- holds an entry now (an x later in the run asks HLEN: rare, and the truth); only a key already
        -- there is cleared: Lua 5.1 inserts a key it is told to set to nil, and a batch's stores would grow the
        -- table one key each
        if empty[rk] ~= nil then empty[rk] = nil end
        local r = pcall_('HSET', rk, fld, '')
        if r ~= 1 and r ~= 0 then r = ok(r, rk) end
        if r ~= nil and name ~= '' then
          local pkey = argv[j + 1]
          r = pcall_('HSETNX', pkey, name, mine)
          if r == 0 then bit_change(pkey, name, mine, true, call2('HGET', pkey, name))
          elseif r ~= 1 then ok(r, pkey) end
        end
        if step == 3 then
          local ek_key = argv[j + 2]
          if ek_key ~= '' then
            r = pcall_('ZADD', ek_key, 0, rk)
            if r ~= 1 and r ~= 0 then ok(r, ek_key) end
          end
        end
        j = j + step
      end
      i = j
    elseif op == 'R' or op == 'r' then  -- a run of removals, the same; an r block that empties its key is listed
      local j, step = i + 2, (op == 'R') and 3 or 2
      op_at = op_at - 1
      for _ = 1, tonumber(argv[i + 1]) do
        op_at = op_at + 1
        local rk, pkey = argv[j], argv[j + 1]
        local r = pcall_('HDEL', rk, fld)
        if r ~= 1 and r ~= 0 then ok(r, rk) end
        if hlen_is_0(rk) then
          if name ~= '' then
            r = pcall_('DEL', pkey)
            if r ~= 1 and r ~= 0 then ok(r, pkey) end
          end
          if step == 2 then
            emptied[#emptied + 1] = op_at
          else
            local ek_key = argv[j + 2]
            if ek_key ~= '' then
              r = pcall_('ZREM', ek_key, rk)
              if r ~= 1 and r ~= 0 then ok(r, ek_key) end
            end
          end
        elseif name ~= '' then
          local v = call2('HGET', pkey, name)
          if v == mine then call2('HDEL', pkey, name) elseif v then bit_change(pkey, name, mine, false, v) end
        end
        j = j + step
      end
      i = j
    elseif op == 'F' then
      fld, name, mine = argv[i + 1], argv[i + 2], argv[i + 3]
      i = i + 4
    elseif op == 'E' then
      empty[argv[i + 1]] = false
      call('HSET', argv[i + 1], argv[i + 2], '')
      i = i + 3
    elseif op == 'e' then
      local rk = argv[i + 1]
      call('HDEL', rk, argv[i + 2])
      empty[rk] = nil
      i = i + 3
    elseif op == 'B' then
      local pkey, name, mine = argv[i + 1], argv[i + 2], argv[i + 3]
      if call('HSETNX', pkey, name, mine) == 0 then bit_change(pkey, name, mine, true, call('HGET', pkey, name)) end
      i = i + 4
    elseif op == 'b' then
      local pkey, name, mine = argv[i + 1], argv[i + 2], argv[i + 3]
      local v = call('HGET', pkey, name)
      if v == mine then call('HDEL', pkey, name) elseif v then bit_change(pkey, name, mine, false, v) end
      i = i + 4
    elseif op == 'G' then
      sibs = argv[i + 1]
      i = i + 2
    elseif op == 'q' then
      if is_empty(argv[i + 1]) then probes[#probes + 1] = argv[i + 2] end
      i = i + 3
    elseif op == 'z' then
      call('ZADD', argv[i + 1], 0, argv[i + 2])
      i = i + 3
    elseif op == 'x' then
      local rk = argv[i + 2]
      if is_empty(rk) then call('ZREM', argv[i + 1], rk) end
      i = i + 3
    elseif op == 'K' then
      key_change(argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4], argv[i + 5], argv[i + 6], argv[i + 7],
                 argv[i + 8])
      i = i + 9
    elseif op == 'Z' then
      local n = tonumber(argv[i + 2])
      engine_add(argv[i + 1], i + 2, n)
      i = i + 3 + n
    else
      local n = tonumber(argv[i + 2])
      local rks = {}
      for j = 1, n do rks[j] = argv[i + 2 + j] end
      engine_drop(argv[i + 1], rks)
      i = i + 3 + n
    end
  end
end
