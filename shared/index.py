"""The Valkey index: the one module that knows key names, field encodings and scripts.

Layout (llm-d-kv-cache v0.9+ Redis index, so an llm-d scheduler shares it):

  <request key, decimal>     HASH  field = PodEntry (JSON in Go field order, or v0.8 ``pod@tier``), value ""
  engine:<engine key>        ZSET  member = request key (decimal), score = position within the engine block

Ours, all HASHes under ``kvpf:`` because llm-d's Clear() runs HKEYS on every key
that does not start with ``engine:``:

  kvpf:pods                  HASH  pod -> model
  kvpf:pod:<pod>             HASH  model, engine_block_size, seq:<rank>, ts:<rank>, last_event_time,
                                   incomplete, incomplete_reason, stored, removed, cleared, orphans
  kvpf:blocks:<pod>          HASH  "<engine key>|<tier>[|<group>]" -> id of the PodEntry field written; the per-pod
                                   reverse index that makes BlockRemoved and AllBlocksCleared cost O(pod's blocks)
                                   (|<group> for a KV-cache group other than 0: a hybrid model's groups
                                   store and evict the same hash each)
  kvpf:fields:<pod>          HASH  id -> PodEntry field (a pod writes one or a few distinct fields)
  kvpf:counters              HASH  fleet-wide counters (decode errors, replays, ...)

Batches are applied by one script that first checks the batch's seq against the
persisted seq of (pod, dp rank), so several ingesters on one engine converge on
exactly one application of every batch (see docs/operations.md).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError, ResponseError

from shared.keys import pack_keys
from shared.resp import FastConnection

ENGINE_PREFIX = "engine:"
OUR_PREFIX = "kvpf:"
PODS_KEY = OUR_PREFIX + "pods"
COUNTERS_KEY = OUR_PREFIX + "counters"
DEFAULT_TIER = "gpu"


def request_key_name(request_key: int) -> str:
    return str(request_key)


def engine_key_name(engine_key: int) -> str:
    return ENGINE_PREFIX + str(engine_key)


def pod_meta_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}pod:{pod_id}"


def pod_blocks_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}blocks:{pod_id}"


def pod_fields_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}fields:{pod_id}"


# ---------------------------------------------------------------- PodEntry


class PodEntry(msgspec.Struct, frozen=True):
    """llm-d's PodEntry; field order is Go's, which the JSON encoding must keep byte for byte."""

    PodIdentifier: str
    DeviceTier: str = DEFAULT_TIER
    Speculative: bool = False
    HasGroup: bool = False
    GroupIdx: int = 0


_entry_json = msgspec.json.Encoder()
_entry_decoder = msgspec.json.Decoder(PodEntry)


def tier_of(medium: str | None) -> str:
    return medium.lower() if medium else DEFAULT_TIER


def make_entry(pod_id: str, medium: str | None, group_idx: int | None) -> PodEntry:
    return PodEntry(
        PodIdentifier=pod_id,
        DeviceTier=tier_of(medium),
        HasGroup=group_idx is not None,
        GroupIdx=group_idx or 0,
    )


def encode_entry(entry: PodEntry, entry_format: str = "json") -> str:
    if entry_format == "v08":
        return f"{entry.PodIdentifier}@{entry.DeviceTier}" + ("[speculative]" if entry.Speculative else "")
    return _entry_json.encode(entry).decode()


def parse_entry(field_value: str | bytes) -> PodEntry | None:
    """Either form llm-d has written; None for a field no llm-d version would write."""
    text = field_value.decode("utf-8", "replace") if isinstance(field_value, bytes) else field_value
    if text.startswith("{"):
        try:
            return _entry_decoder.decode(text)
        except msgspec.DecodeError:
            return None
    pod, sep, tier = text.partition("@")
    if not sep or not pod:
        return None
    speculative = False
    bracket = tier.find("[")
    if bracket != -1:
        speculative = "speculative" in tier[bracket:]
        tier = tier[:bracket]
    return PodEntry(PodIdentifier=pod, DeviceTier=tier or DEFAULT_TIER, Speculative=speculative)


# ---------------------------------------------------------------- mutations


class StoreBlock(msgspec.Struct, frozen=True):
    engine_key: int
    tier: str
    entry_field: str
    request_keys: tuple[int, ...]
    group: int = 0  # the engine's KV-cache group (hybrid models hold one hash once per group)


class RemoveBlock(msgspec.Struct, frozen=True):
    engine_key: int
    tier: str
    group: int = 0


def block_slot(tier: str, group: int | None) -> str:
    """The reverse-index key suffix of a block: its tier, and its KV-cache group when not 0."""
    return f"{tier}|{group}" if group else tier


class ClearPod(msgspec.Struct, frozen=True):
    pass


class MarkIncomplete(msgspec.Struct, frozen=True):
    """Flag the pod incomplete in the same script that applies the batch (so a batch applied
    whose reply was lost, then answered "dup" on retry, still leaves its flag)."""

    reason: str


Mutation = StoreBlock | RemoveBlock | ClearPod | MarkIncomplete


def encode_mutations(mutations: Iterable[Mutation]) -> list[str | int]:
    """Flat script arguments: ``nf field..`` (the batch's distinct PodEntry fields, each sent
    once), then ops ``S ek tier fi n rk..`` (fi: 1-based into the fields) / ``R ek tier`` / ``C``
    / ``I reason``."""
    fields: dict[str, int] = {}
    ops: list[str | int] = []
    for m in mutations:
        if isinstance(m, StoreBlock):
            fi = fields.get(m.entry_field)
            if fi is None:
                fi = fields[m.entry_field] = len(fields) + 1
            ops += ["S", m.engine_key, block_slot(m.tier, m.group), fi, len(m.request_keys), *m.request_keys]
        elif isinstance(m, RemoveBlock):
            ops += ["R", m.engine_key, block_slot(m.tier, m.group)]
        elif isinstance(m, MarkIncomplete):
            ops += ["I", m.reason]
        else:
            ops.append("C")
    return [len(fields), *fields, *ops]


# Shared Lua. kvpf:blocks:<pod> maps "<engine key>|<tier>[|<group>]" to a small id of the PodEntry
# field written for that block, and kvpf:fields:<pod> maps id -> field: a pod writes one or
# a few distinct fields, so the reverse index holds a digit or two per block instead of a
# ~95-byte JSON copy. A value that is not all digits is a field itself (written before ids).
_LUA_FIELDS = """
local function field_ids(fields_key)
  local byid, byfield, n = {}, {}, 0
  local all = redis.call('HGETALL', fields_key)
  for i = 1, #all, 2 do
    byid[all[i]] = all[i + 1]
    byfield[all[i + 1]] = all[i]
    n = n + 1
  end
  return byid, byfield, n
end
local function is_id(v)
  return string.find(v, '^%d+$') ~= nil
end
-- vLLM (0.32) can hold one hash in two physical blocks (a fully cached prompt recomputes its
-- last block and caches the copy) and reports each copy's store and eviction; so a value
-- "<id>*<n>" counts n copies, and only the last eviction removes the entry.
local function copies(v)
  local id, n = string.match(v, '^(%d+)%*(%d+)$')
  if id then return id, tonumber(n) end
  return v, 1
end
-- Drop one pod field from an engine block's request keys; the engine key goes with its last holder.
local function unlink(ek, fld)
  local ekey = 'engine:' .. ek
  local rks = redis.call('ZRANGE', ekey, 0, -1)
  if fld then
    for _, rk in ipairs(rks) do redis.call('HDEL', rk, fld) end
  end
  if #rks == 0 or redis.call('EXISTS', unpack(rks)) == 0 then redis.call('DEL', ekey) end
end
-- Remove every entry of one pod, via its reverse index (O(pod's blocks)).
local function clear_pod(blocks_key, fields_key)
  local byid = nil
  local n = 0
  local all = redis.call('HGETALL', blocks_key)
  for i = 1, #all, 2 do
    local fld = copies(all[i + 1])
    if is_id(fld) then
      if byid == nil then byid = field_ids(fields_key) end
      fld = byid[fld]
    end
    unlink(string.match(all[i], '^([^|]*)'), fld)
    n = n + 1
  end
  redis.call('DEL', blocks_key)
  return n
end
"""

# KEYS: none (keys are derived inside; single-node or single-shard Valkey).
# ARGV: pod, rank, seq, ts, mode, model, engine_block_size, now, then encode_mutations(...).
# mode: "check" applies only the next seq; "force" also applies past a gap (gap accepted);
#       "reset" clears the pod first (engine restart), then applies; "import" applies
#       without touching the pod's seq (index import). "force" and "reset" re-check inside
#       the script: a batch at or below the persisted seq is still "dup" (another ingester
#       got there first), or "restart" for force; a reset that is no longer a restart (another
#       ingester reset and moved on) is handled as "check".
# Returns {status, last_seq}; status in applied|dup|gap|restart.
_LUA_APPLY = _LUA_FIELDS + """
local pod, rank = ARGV[1], ARGV[2]
local seq, ts, mode = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local meta = 'kvpf:pod:' .. pod
local blocks = 'kvpf:blocks:' .. pod
local fkey = 'kvpf:fields:' .. pod
local last = redis.call('HGET', meta, 'seq:' .. rank)
local last_n = -1
if last then last_n = tonumber(last) end
if mode == 'reset_if' then
  -- Engine restart found by probing its replay socket: clear the pod, but only if no other
  -- ingester has applied anything since the probe read the seq (else it is not stale).
  if last_n ~= seq then return {'dup', last_n} end
  clear_pod(blocks, fkey)
  local fields = redis.call('HKEYS', meta)
  for _, f in ipairs(fields) do
    if string.sub(f, 1, 4) == 'seq:' or string.sub(f, 1, 3) == 'ts:' then redis.call('HDEL', meta, f) end
  end
  redis.call('HINCRBY', meta, 'restarts', 1)
  -- the pod is empty now, as the new engine is: exact again
  redis.call('HSET', meta, 'incomplete', 0, 'incomplete_reason', '')
  return {'applied', last_n}
end
-- What "check" answers: nil (the next seq: apply), or dup, restart or gap.
local verdict = nil
if mode ~= 'import' then
  if last then
    if seq <= last_n then
      local last_ts = tonumber(redis.call('HGET', meta, 'ts:' .. rank) or '0')
      if ts > last_ts then verdict = 'restart' else verdict = 'dup' end
    elseif seq > last_n + 1 then
      verdict = 'gap'
    end
  elseif seq > 0 then
    verdict = 'gap'
  end
end
if mode == 'check' and verdict then return {verdict, last_n} end
-- force accepts a gap, never a batch at or below the persisted seq
if mode == 'force' and (verdict == 'dup' or verdict == 'restart') then return {verdict, last_n} end
if mode == 'reset' and verdict ~= 'restart' then
  if verdict then return {verdict, last_n} end
  mode = 'check'  -- another ingester already reset and this is its next seq: apply, keep its work
end
if mode == 'reset' then
  clear_pod(blocks, fkey)
  redis.call('HINCRBY', meta, 'restarts', 1)
  redis.call('HSET', meta, 'incomplete', 0, 'incomplete_reason', '')  -- empty, as the new engine: exact
end
local stored, removed, cleared = 0, 0, 0
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
local i = 10 + nf
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' then
    local ek, tier, fi, n = ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
    local fld = ARGV[9 + fi]
    local bk = ek .. '|' .. tier
    if redis.call('HSETNX', blocks, bk, id_of(fi)) == 0 then  -- rare: another copy of the hash
      local _, n_held = copies(redis.call('HGET', blocks, bk))
      redis.call('HSET', blocks, bk, id_of(fi) .. '*' .. (n_held + 1))
    end
    local za = {}
    for j = 1, n do
      local rk = ARGV[i + 4 + j]
      za[2 * j - 1], za[2 * j] = j - 1, rk
      redis.call('HSET', rk, fld, '')
    end
    if n > 0 then redis.call('ZADD', 'engine:' .. ek, unpack(za)) end
    stored = stored + 1
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
      unlink(ek, fld)
      removed = removed + 1
    end
    i = i + 3
  elseif op == 'C' then
    clear_pod(blocks, fkey)
    redis.call('HSET', meta, 'incomplete', 0, 'incomplete_reason', '')  -- exact again from here
    cleared = cleared + 1
    i = i + 1
  elseif op == 'I' then
    redis.call('HSET', meta, 'incomplete', 1, 'incomplete_reason', ARGV[i + 1])
    i = i + 2
  else
    return redis.error_reply('unknown op ' .. tostring(op))
  end
end
if mode == 'import' then
  redis.call('HSET', meta, 'model', ARGV[6])
else
  redis.call('HSET', meta, 'seq:' .. rank, seq, 'ts:' .. rank, ARGV[4], 'model', ARGV[6],
             'last_event_time', ARGV[8])
end
if ARGV[7] ~= '' then redis.call('HSET', meta, 'engine_block_size', ARGV[7]) end
if mode == 'force' and last and seq > last_n + 1 then
  redis.call('HINCRBY', meta, 'gaps_accepted', 1)
end
redis.call('HINCRBY', meta, 'batches', 1)
if stored > 0 then redis.call('HINCRBY', meta, 'stored', stored) end
if removed > 0 then redis.call('HINCRBY', meta, 'removed', removed) end
if cleared > 0 then redis.call('HINCRBY', meta, 'cleared', cleared) end
redis.call('HSET', 'kvpf:pods', pod, ARGV[6])
return {'applied', last_n}
"""

_LUA_CLEAR = _LUA_FIELDS + """
local n = clear_pod('kvpf:blocks:' .. ARGV[1], 'kvpf:fields:' .. ARGV[1])
if ARGV[2] == '1' then
  redis.call('DEL', 'kvpf:pod:' .. ARGV[1], 'kvpf:fields:' .. ARGV[1])
  redis.call('HDEL', 'kvpf:pods', ARGV[1])
end
return n
"""

# Shared Lua: a PodEntry field -> pod, tier; nil for speculative or unparseable entries.
# Speculative entries (written by llm-d's scheduler before the engine confirms) are
# not cache, so they never count.
_LUA_PARSE_ENTRY = """
local function parse(f)
  if string.sub(f, 1, 1) == '{' then
    if string.find(f, '"Speculative":true', 1, true) then return nil end
    local pod = string.match(f, '"PodIdentifier":"(.-)"')
    if pod and string.find(pod, '\\\\', 1, true) then
      local ok, obj = pcall(cjson.decode, f)
      if not ok then return nil end
      return obj.PodIdentifier, obj.DeviceTier or 'gpu'
    end
    return pod, string.match(f, '"DeviceTier":"(.-)"') or 'gpu'
  end
  local pod, tier = string.match(f, '^([^@]*)@([^%[]*)')
  if not pod or pod == '' then return nil end
  if string.find(f, '[speculative]', 1, true) then return nil end
  if tier == '' then tier = 'gpu' end
  return pod, tier
end
"""

# Shared by both lookup scripts: their arguments, key i of the chain, and each distinct field
# parsed once into {pod, tier}, or false (speculative, unparseable, or filtered out).
_LUA_CHAIN = _LUA_PARSE_ENTRY + """
local n = tonumber(ARGV[1])
local chain = ARGV[2]
local filter = nil
if #ARGV > 2 then
  filter = {}
  for i = 3, #ARGV do filter[ARGV[i]] = true end
end
local function key(i)
  return string.match(string.sub(chain, i * 20 - 19, i * 20), '%d+')
end
local parsed = {}
local function entry(f)
  local e = parsed[f]
  if e == nil then
    local pod, tier = parse(f)
    if pod and (filter == nil or filter[pod]) then e = {pod, tier} else e = false end
    parsed[f] = e
  end
  return e
end
"""

# ARGV: n, the chain packed by shared.keys.pack_keys (key i at bytes 20(i-1)+1 .. 20i, decimal,
# right-aligned: one argument instead of n), then pod ids to consider (none = all). Keys are
# derived inside the script, like the apply script's: single-node or single-shard Valkey
# (Valkey Cluster: lookup mode "pipeline").
#
# A pod's blocks of one chain form a prefix of it: the engine only reuses a block after
# every block before it, evicts the tail of a chain before its head (vLLM frees a request's
# blocks last-first), and the ingester writes and removes whole engine blocks. So rather than
# read every key, the script reads the first key's pods, gallops (keys 2, 4, 8, ... read whole
# with HKEYS, shared by all pods), then bisects each pod alone with a small HMGET of the fields
# it is known by, then checks where each stops that no field it was not yet known by holds the
# next key (HLEN against the pods known to be there; HKEYS only if they differ). O(pods x log(chain))
# small reads instead of one HKEYS per key. A pod counts at a key through any of its fields
# (tiers, groups), gpu preferred for the tier, as in the linear walk, which this equals whenever
# every pod's blocks form a prefix.
# Returns {pod, blocks, tier, ...}.
_LUA_LOOKUP = _LUA_CHAIN + """
local full = {}    -- key index -> pod -> tier, read whole (HKEYS)
local known = {}   -- pod -> its fields seen so far, in order; kset: the same as a set
local kset = {}
local probed = {}  -- pod -> key index -> tier or false, read through its known fields (HMGET)
-- Every wanted pod holding key i (pod -> tier, gpu preferred), through any field; learns fields.
local function at(i)
  local present = full[i]
  if present then return present end
  present = {}
  for _, f in ipairs(redis.call('HKEYS', key(i))) do
    local e = entry(f)
    if e then
      local pod, tier = e[1], e[2]
      if present[pod] == nil or tier == 'gpu' then present[pod] = tier end
      local ks = kset[pod]
      if ks == nil then
        ks = {}
        kset[pod], known[pod] = ks, {}
      end
      if not ks[f] then
        ks[f] = true
        local kl = known[pod]
        kl[#kl + 1] = f
        probed[pod] = nil  -- answers read without this field may be wrong now
      end
    end
  end
  full[i] = present
  return present
end
-- The pod's tier at key i through the fields it is known by, or false: one small HMGET.
local function held(i, pod)
  local f = full[i]
  if f then return f[pod] or false end
  local memo = probed[pod]
  if memo == nil then
    memo = {}
    probed[pod] = memo
  end
  local t = memo[i]
  if t ~= nil then return t end
  local fl = known[pod]
  local r = redis.call('HMGET', key(i), unpack(fl))
  t = false
  for j = 1, #r do
    if r[j] then
      local ft = parsed[fl[j]][2]
      if t == false or ft == 'gpu' then t = ft end
    end
  end
  memo[i] = t
  return t
end
local pods, lo, hi = {}, {}, {}
for pod, _ in pairs(at(1)) do
  pods[#pods + 1] = pod
  lo[pod], hi[pod] = 1, n + 1
end
if #pods == 0 then return {} end
-- Gallop together: keys 2, 4, 8, ... read whole once, shared by every pod still holding.
local going, i = pods, 1
while #going > 0 and i < n do
  local nxt = math.min(i * 2, n)
  local present = at(nxt)
  local still = {}
  for _, pod in ipairs(going) do
    if present[pod] then
      lo[pod] = nxt
      still[#still + 1] = pod
    else
      hi[pod] = nxt
    end
  end
  going, i = still, nxt
end
-- Then each pod alone, bisecting with the fields it is known by.
local function bisect(pod, l, h)
  while h - l > 1 do
    local mid = math.floor((l + h) / 2)
    if held(mid, pod) then l = mid else h = mid end
  end
  return l
end
for _, pod in ipairs(pods) do lo[pod] = bisect(pod, lo[pod], hi[pod]) end
-- Where a pod stops (key h = lo + 1), a field it is not known by could still hold h. Longest
-- first: if h has exactly as many fields as the pods known to hold it (longer prefixes, at least
-- one field each), none is left for this pod; else read h whole, and go on if it holds the pod.
table.sort(pods, function(a, b) return lo[a] > lo[b] end)
local out = {}
for _, pod in ipairs(pods) do
  while lo[pod] < n do
    local h = lo[pod] + 1
    local again
    if full[h] then
      again = full[h][pod] ~= nil
    else
      local c = redis.call('HLEN', key(h))
      local m = 0
      for _, q in ipairs(pods) do
        if q ~= pod and lo[q] >= h then m = m + 1 end
      end
      again = c ~= 0 and c ~= m and at(h)[pod] ~= nil
    end
    if not again then break end
    local l, hh = h, n + 1
    while l < n do
      local nxt = math.min(l * 2, n)
      if held(nxt, pod) then l = nxt else hh = nxt; break end
    end
    lo[pod] = bisect(pod, l, hh)
  end
  local l = lo[pod]
  local t = held(l, pod)
  if t ~= 'gpu' then t = at(l)[pod] end  -- no gpu field known there: the exact rule needs them all
  out[#out + 1] = pod
  out[#out + 1] = l
  out[#out + 1] = t
end
return out
"""

# The exact linear walk (mode "linear"): one HKEYS per key, keeping the pods that hold every
# key so far, early stop when none is left; each distinct field is parsed once. Same ARGV.
# It is what the pipeline path computes in Python, and what the benchmark checks the galloping
# script against.
_LUA_LOOKUP_LINEAR = _LUA_CHAIN + """
local alive, counts, tiers = nil, {}, {}
for i = 1, n do
  local present = {}
  for _, f in ipairs(redis.call('HKEYS', key(i))) do
    local e = entry(f)
    if e then
      local pod, tier = e[1], e[2]
      if present[pod] == nil or tier == 'gpu' then present[pod] = tier end
    end
  end
  if alive == nil then
    alive = present
  else
    for pod, _ in pairs(alive) do
      if present[pod] == nil then alive[pod] = nil end
    end
  end
  local any = false
  for pod, _ in pairs(alive) do
    counts[pod] = i
    tiers[pod] = present[pod]
    any = true
  end
  if not any then break end
end
local out = {}
for pod, c in pairs(counts) do
  out[#out + 1] = pod
  out[#out + 1] = c
  out[#out + 1] = tiers[pod]
end
return out
"""


def _apply_args(pod_id: str, rank: int, seq: int, ts: float, model: str, engine_block_size: int | None,
                mutations: Sequence[Mutation], mode: str) -> list[Any]:
    return [pod_id, rank, seq, repr(ts), mode, model, "" if engine_block_size is None else engine_block_size,
            repr(time.time()), *encode_mutations(mutations)]


def _apply_result(reply: Sequence[Any]) -> "ApplyResult":
    status, last = reply
    return ApplyResult(status.decode() if isinstance(status, bytes) else status, int(last))


@dataclass(frozen=True)
class ApplyResult:
    status: str  # applied | dup | gap | restart
    last_seq: int


@dataclass(frozen=True)
class PodMatch:
    pod_id: str
    blocks: int  # consecutive request-key blocks from the start of the chain
    tier: str


@dataclass
class PodInfo:
    pod_id: str
    model: str
    engine_block_size: int | None
    seqs: dict[str, int]
    last_event_time: float | None
    incomplete: bool
    incomplete_reason: str
    blocks: int
    counters: dict[str, int] = field(default_factory=dict)


def longest_prefix(fields_per_key: Sequence[Sequence[str | bytes]], pods: Iterable[str] | None = None) -> list[PodMatch]:
    """Pure twin of the lookup script, for the pipeline path (Valkey Cluster) and tests."""
    wanted = set(pods) if pods else None
    alive: dict[str, str] | None = None
    counts: dict[str, int] = {}
    tiers: dict[str, str] = {}
    for i, fields in enumerate(fields_per_key, start=1):
        present: dict[str, str] = {}
        for f in fields:
            entry = parse_entry(f)
            if entry is None or entry.Speculative:
                continue
            if wanted is not None and entry.PodIdentifier not in wanted:
                continue
            if entry.PodIdentifier not in present or entry.DeviceTier == DEFAULT_TIER:
                present[entry.PodIdentifier] = entry.DeviceTier
        alive = present if alive is None else {p: t for p, t in present.items() if p in alive}
        if not alive:
            break
        for pod in alive:
            counts[pod] = i
            tiers[pod] = alive[pod]
    return [PodMatch(p, n, tiers[p]) for p, n in counts.items()]


def parse_lookup_reply(flat: Sequence[Any]) -> list[PodMatch]:
    out = []
    for i in range(0, len(flat), 3):
        pod, n, tier = flat[i], flat[i + 1], flat[i + 2]
        out.append(PodMatch(pod.decode() if isinstance(pod, bytes) else pod, int(n),
                            tier.decode() if isinstance(tier, bytes) else tier))
    return out


class Index:
    """Async access to the index. Every call is bounded by the client's socket timeout."""

    def __init__(self, client: aioredis.Redis, entry_format: str = "json", fast: FastConnection | None = None):
        self.client = client
        self.entry_format = entry_format
        self.fast = fast  # the lookup's lean connection (from_url gives one for redis:// and unix://)
        self._apply = client.register_script(_LUA_APPLY)
        self._lookup = client.register_script(_LUA_LOOKUP)
        self._lookup_linear = client.register_script(_LUA_LOOKUP_LINEAR)
        self._clear = client.register_script(_LUA_CLEAR)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 1.0, entry_format: str = "json") -> "Index":
        client = aioredis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=0,
            retry_on_timeout=False,
        )
        return cls(client, entry_format, FastConnection.from_url(url, timeout_s=timeout_s))

    async def close(self) -> None:
        if self.fast is not None:
            await self.fast.close()
        await self.client.aclose()

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    def entry_field(self, pod_id: str, medium: str | None, group_idx: int | None) -> str:
        return encode_entry(make_entry(pod_id, medium, group_idx), self.entry_format)

    # ---- write path

    async def apply_batch(
        self,
        *,
        pod_id: str,
        rank: int,
        seq: int,
        ts: float,
        model: str,
        engine_block_size: int | None,
        mutations: Sequence[Mutation],
        mode: str = "check",
    ) -> ApplyResult:
        args = _apply_args(pod_id, rank, seq, ts, model, engine_block_size, mutations, mode)
        return _apply_result(await self._apply(keys=[], args=args))

    async def apply_batches(self, batches: Sequence[dict[str, Any]]) -> list[ApplyResult]:
        """Several ``apply_batch`` calls (same keyword arguments each) in one round trip, in order.

        Each still runs its own seq check, so the results are what one-by-one calls would give
        when every batch applies; a batch behind one that did not (gap, restart) gets "gap" or
        "restart" itself and the caller re-applies it after recovering.
        """
        return await (await self.send_batches(batches))

    async def send_batches(self, batches: Sequence[dict[str, Any]]) -> "asyncio.Future[list[ApplyResult]]":
        """``apply_batches`` in two steps: the commands are written now, the results come from
        the returned future, so the caller can prepare the next batches while Valkey runs these.
        Commands written later on this Index run after these (one connection). Without the
        lean connection (TLS) the batches run before this returns."""
        args = [_apply_args(b["pod_id"], b["rank"], b["seq"], b["ts"], b["model"], b["engine_block_size"],
                            b["mutations"], b.get("mode", "check")) for b in batches]
        if self.fast is not None:
            replies = await self.fast.evalsha_send(self._apply.sha, self._apply.script, args)

            async def results() -> list[ApplyResult]:
                return [_apply_result(r) for r in await replies]

            return asyncio.ensure_future(results())
        async with self.client.pipeline(transaction=False) as pipe:
            for a in args:
                pipe.evalsha(self._apply.sha, 0, *a)
            try:
                out = await pipe.execute()
            except NoScriptError:
                await self.client.script_load(_LUA_APPLY)
                return await self.send_batches(batches)
        done: asyncio.Future[list[ApplyResult]] = asyncio.get_running_loop().create_future()
        done.set_result([_apply_result(r) for r in out])
        return done

    async def resolve_engine_keys(self, engine_keys: Iterable[int], pod_id: str | None = None) -> dict[int, int]:
        """Engine key -> its last request key (the one a child block chains from), one round trip.

        Engines of different models with the same hash seed give the same tokens the same engine
        key (vLLM's block hash has no model in it), so ``engine:<key>`` can hold several models'
        request keys at the last position. Then the one ``pod_id`` holds wins (a child's parent is
        in its own pod's cache); if that does not single one out, the key stays unresolved (an
        orphan) rather than chaining from another model's key.
        """
        eks = list(dict.fromkeys(engine_keys))
        if not eks:
            return {}
        async with self.client.pipeline(transaction=False) as pipe:
            for ek in eks:
                pipe.zrevrange(engine_key_name(ek), 0, 1, withscores=True)
            replies = await pipe.execute()
        out: dict[int, int] = {}
        tied: list[tuple[int, float]] = []
        for ek, r in zip(eks, replies):
            if len(r) == 1 or (len(r) > 1 and r[0][1] != r[1][1]):
                out[ek] = int(r[0][0])
            elif r:
                tied.append((ek, r[0][1]))
        if tied and pod_id is not None:
            async with self.client.pipeline(transaction=False) as pipe:
                for ek, top in tied:
                    pipe.zrangebyscore(engine_key_name(ek), top, top)
                candidates = await pipe.execute()
            async with self.client.pipeline(transaction=False) as pipe:
                for rks in candidates:
                    for rk in rks:
                        pipe.hkeys(rk)
                fields = iter(await pipe.execute())
            for (ek, _), rks in zip(tied, candidates):
                mine = []
                for rk in rks:
                    entries = (parse_entry(f) for f in next(fields))
                    if any(e is not None and e.PodIdentifier == pod_id for e in entries):
                        mine.append(int(rk))
                if len(mine) == 1:
                    out[ek] = mine[0]
        return out

    async def import_blocks(self, pod_id: str, model: str, engine_block_size: int | None,
                            stores: Sequence[StoreBlock]) -> None:
        """Write exported entries back; the pod's seq is left alone (the next live batch decides)."""
        await self.apply_batch(pod_id=pod_id, rank=0, seq=0, ts=0.0, model=model,
                               engine_block_size=engine_block_size, mutations=stores, mode="import")

    async def export_blocks(self, pod_id: str, batch: int = 1000):
        """Yield every StoreBlock a pod holds, read with HSCAN so a large pod never blocks Valkey."""
        ids = {k: v.decode() for k, v in (await self.client.hgetall(pod_fields_key(pod_id))).items()}
        cursor = 0
        while True:
            cursor, chunk = await self.client.hscan(pod_blocks_key(pod_id), cursor, count=batch)
            items = list(chunk.items())
            async with self.client.pipeline(transaction=False) as pipe:
                for bk, _ in items:
                    pipe.zrange(engine_key_name(int(bk.split(b"|", 1)[0])), 0, -1)
                rks = await pipe.execute() if items else []
            for (bk, held), keys in zip(items, rks):
                ek, _, slot = bk.decode().partition("|")
                tier, _, group = slot.partition("|")
                fld, star, n = held.partition(b"*")
                block = StoreBlock(int(ek), tier, ids.get(fld) or fld.decode(), tuple(int(k) for k in keys),
                                   int(group) if group.isdigit() else 0)
                for _ in range(int(n) if star and n.isdigit() else 1):  # one per physical copy
                    yield block
            if cursor == 0:
                return

    async def memory_usage(self) -> int | None:
        try:
            info = await self.client.info("memory")
            return int(info.get("used_memory", 0))
        except RedisError:
            return None

    async def reset_if_seq(self, pod_id: str, rank: int, expected_last: int) -> bool:
        """Clear a restarted engine's pod, unless its seq moved on since ``expected_last`` was read."""
        result = await self.apply_batch(pod_id=pod_id, rank=rank, seq=expected_last, ts=0.0, model="",
                                        engine_block_size=None, mutations=(), mode="reset_if")
        return result.status == "applied"

    async def clear_pod(self, pod_id: str, *, forget: bool = False) -> int:
        """Remove every entry of a pod; ``forget`` also drops its metadata. Returns blocks removed."""
        return int(await self._clear(keys=[], args=[pod_id, "1" if forget else "0"]))

    async def mark_incomplete(self, pod_id: str, reason: str) -> None:
        await self.client.hset(pod_meta_key(pod_id), mapping={"incomplete": 1, "incomplete_reason": reason})

    async def mark_complete(self, pod_id: str) -> None:
        await self.client.hset(pod_meta_key(pod_id), mapping={"incomplete": 0, "incomplete_reason": ""})

    async def count(self, name: str, n: int = 1, *, pod_id: str | None = None) -> None:
        key = pod_meta_key(pod_id) if pod_id else COUNTERS_KEY
        await self.client.hincrby(key, name, n)

    # ---- read path

    async def lookup(self, request_keys: Sequence[int], pods: Sequence[str] | None = None, *, mode: str = "script") -> list[PodMatch]:
        """Per pod, how many leading blocks of the chain it holds. One round trip in every mode.

        ``script``: galloping search in one EVALSHA (a pod's blocks form a prefix of the chain);
        ``linear``: the exact walk in one EVALSHA; ``pipeline``: pipelined HKEYS (Valkey Cluster).
        """
        if not request_keys:
            return []
        if mode == "pipeline":
            return longest_prefix(await self.fields_per_key(request_keys, stop_at_gap=False), pods)
        script = self._lookup_linear if mode == "linear" else self._lookup
        args = [len(request_keys), pack_keys(request_keys), *(pods or ())]
        if self.fast is not None:
            return parse_lookup_reply(await self.fast.evalsha(script.sha, script.script, args))
        return parse_lookup_reply(await script(keys=[], args=args))

    async def fields_per_key(self, request_keys: Sequence[int], *, stop_at_gap: bool = True) -> list[list[bytes]]:
        """llm-d's Lookup: pipelined HKEYS; with ``stop_at_gap`` trimmed at the first empty key."""
        async with self.client.pipeline(transaction=False) as pipe:
            for k in request_keys:
                pipe.hkeys(request_key_name(k))
            replies = await pipe.execute()
        if stop_at_gap:
            for i, r in enumerate(replies):
                if not r:
                    return replies[:i]
        return replies

    async def pod_ids(self) -> dict[str, str]:
        raw = await self.client.hgetall(PODS_KEY)
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def pod_info(self, pod_id: str) -> PodInfo:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(pod_meta_key(pod_id))
            pipe.hlen(pod_blocks_key(pod_id))
            meta_raw, blocks = await pipe.execute()
        meta = {k.decode(): v.decode() for k, v in meta_raw.items()}
        seqs = {k[4:]: int(v) for k, v in meta.items() if k.startswith("seq:")}
        counters = {
            k: int(v) for k, v in meta.items()
            if k in ("batches", "stored", "removed", "cleared", "orphans", "restarts", "gaps_accepted", "replays")
        }
        ebs = meta.get("engine_block_size")
        let = meta.get("last_event_time")
        return PodInfo(
            pod_id=pod_id,
            model=meta.get("model", ""),
            engine_block_size=int(ebs) if ebs else None,
            seqs=seqs,
            last_event_time=float(let) if let else None,
            incomplete=meta.get("incomplete") == "1",
            incomplete_reason=meta.get("incomplete_reason", ""),
            blocks=int(blocks),
            counters=counters,
        )

    async def pods(self) -> list[PodInfo]:
        return [await self.pod_info(p) for p in sorted(await self.pod_ids())]

    async def counters(self) -> dict[str, int]:
        raw = await self.client.hgetall(COUNTERS_KEY)
        return {k.decode(): int(v) for k, v in raw.items()}

    async def key_count(self) -> int:
        return int(await self.client.dbsize())


__all__ = [
    "ApplyResult", "ClearPod", "Index", "MarkIncomplete", "Mutation", "PodEntry", "PodInfo", "PodMatch", "RedisError",
    "RemoveBlock", "ResponseError", "StoreBlock", "block_slot", "encode_entry", "engine_key_name", "longest_prefix",
    "make_entry", "parse_entry", "pod_blocks_key", "pod_fields_key", "pod_meta_key", "request_key_name", "tier_of",
]
