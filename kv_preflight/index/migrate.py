"""``kv-preflight index migrate``: an index of layout 1 (kv-preflight 0.1), 2 or 3 to layout 4.

Request keys and ``engine:<key>`` are llm-d's and do not change, so an llm-d scheduler reading the index sees
nothing happen. What changes is ours (kv_preflight/index/layout.py):

1. Each pod's blocks, read from its old reverse index (layouts 2 and 3: ``kvpf:{<pod>}:blocks`` and
   ``:fields``, the request keys and, in layout 3, each block's parent in the value; layout 1:
   ``kvpf:blocks:<pod>`` and ``kvpf:fields:<pod>``, the request keys read from ``engine:<key>``), become its
   state (kv_preflight/index/pod_state.py), planned with the KV cache groups its meta names (a hybrid pod's
   prefix group decides its presence fields), written as a snapshot in ``kvpf:{<pod>}:state``, with its meta
   (generation, blocks, orphan count: unknown where the old layout kept no parents). Written whole, so a pod
   migrated twice is the same.
2. Every presence hash is rebuilt from the pods' states: the old ones (``kvpf:{<rk>}:bits``) and any new one
   a previous, interrupted run left are deleted first, then each pod adds its bits and entry counts.
3. The old per-pod keys, the engine keys' membership hashes (``kvpf:{engine:<key>}:pods``) and layout 1's
   keys are deleted, and the layout version is set to 4.

Each step can run again, so an interrupted migrate is simply run again. Stop the ingesters first (an
ingester of another layout refuses to start, and stops writing, on an index of this one); the engines'
replay buffers cover what they publish meanwhile (docs/operations.md, "Upgrading").
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kv_preflight.index.entries import CHAIN_ROOT, StoreBlock, parse_entry, text
from kv_preflight.index.numbering import give_numbers
from kv_preflight.index.layout import (LAYOUT_KEY, LAYOUT_VERSION, PODS_KEY, V1_PODS_KEY, engine_key_name,
                                       is_presence_key, pod_meta_key, pod_state_key, presence_key, v1_pod_blocks_key,
                                       v1_pod_fields_key, v1_pod_meta_key, v3_bits_key, v3_members_key,
                                       v3_pod_keys)
from kv_preflight.index.pod_meta import parse_groups
from kv_preflight.index.pod_log import encode_snapshot
from kv_preflight.index.pod_state import KeyChange, PodState

Progress = Callable[[str, int], None]

# One pod's bit and entry count added to a presence hash (migration only: the presence hashes were emptied
# first). KEYS: the presence hash. ARGV: field, byte (1-based), mask, entries.
_ADD_BIT = """
local v = redis.call('HGET', KEYS[1], ARGV[1]) or '0:'
local c = string.find(v, ':', 1, true)
local n, s = tonumber(string.sub(v, 1, c - 1)) or 0, string.sub(v, c + 1)
local b, m = tonumber(ARGV[2]), tonumber(ARGV[3])
if m > 0 then
  if #s < b then s = s .. string.rep('\\0', b - #s) end
  s = string.sub(s, 1, b - 1) .. string.char(bit.bor(string.byte(s, b), m)) .. string.sub(s, b + 1)
end
redis.call('HSET', KEYS[1], ARGV[1], (n + tonumber(ARGV[4])) .. ':' .. s)
return 1
"""


def parse_v3_block(bk: str, held: str, fields: dict[str, str]) -> tuple[StoreBlock, int]:
    """A layout-2/3 reverse-index entry (``<ek>|<tier>[|<group>]`` -> ``<id>[*<n>]:<rk>,..[^<parent>]``) as the
    StoreBlock that recreates it and its copies (pure)."""
    ek, _, slot = bk.partition("|")
    tier, _, group = slot.partition("|")
    head, _, rest = held.partition(":")
    rks, caret, parent = rest.partition("^")
    fid, star, n = head.partition("*")
    return (StoreBlock(int(ek), tier, fields.get(fid, fid), tuple(int(k) for k in rks.split(",") if k),
                       int(group) if group.isdigit() else 0, False,
                       (int(parent) if parent else CHAIN_ROOT) if caret else None),
            int(n) if star and n.isdigit() else 1)


async def migrate(client, *, chunk: int = 500, progress: Progress | None = None) -> dict[str, int]:
    """Move an index of layout 1, 2 or 3 to layout 4; returns counts. ``client`` is a redis-py asyncio client
    (single node or cluster)."""
    done = {"pods": 0, "blocks": 0, "keys": 0}
    found = await client.hget(LAYOUT_KEY, "version")
    if found is not None and text(found) == LAYOUT_VERSION:
        # already this layout: step 2 would delete every live presence hash and rebuild none (no pod has an old
        # reverse index to read), so every lookup would miss
        return done
    pods = {text(k): text(v) for k, v in (await client.hgetall(PODS_KEY)).items()}
    v1 = {text(k): text(v) for k, v in (await client.hgetall(V1_PODS_KEY)).items()}
    states: dict[str, PodState] = {}
    for pod in sorted(set(pods) | set(v1)):
        state = await _read_pod(client, pod, pod in v1 and pod not in pods, chunk)
        if state is None:
            continue
        states[pod] = state
        done["blocks"] += len(state)
        if progress:
            progress(pod, done["blocks"])
    nums = await give_numbers(client, sorted(states)) if states else {}
    for pod, state in states.items():
        await _write_pod(client, pod, state, v1.get(pod) or pods.get(pod, ""))
        done["pods"] += 1
    # 2. presence, rebuilt whole
    await _delete_matching(client, (v3_bits_key("*"), "kvpf:{*}:p"), chunk)  # layout 3's, an early 4's
    await _delete_matching(client, ("kvpf:{*}",), chunk, only=is_presence_key)  # a migrate cut short's
    add = client.register_script(_ADD_BIT)
    await client.script_load(_ADD_BIT)
    keys_seen: set[int] = set()
    for pod, state in states.items():
        num = nums[pod]
        pending: list[tuple[str, list[Any]]] = []
        for c in PodState(state.groups, state.engine_block_size, pod).plan(list(state.stores())).changes:
            if isinstance(c, KeyChange) and (c.bit_delta > 0 or c.entry > 0):
                pending.append((presence_key(c.rk), [c.bit, num // 8 + 1 if c.bit_delta > 0 else 0,
                                                     (1 << num % 8) if c.bit_delta > 0 else 0, max(c.entry, 0)]))
                keys_seen.add(c.rk)
        for i in range(0, len(pending), chunk):
            async with client.pipeline(transaction=False) as pipe:
                for key, args in pending[i:i + chunk]:
                    pipe.execute_command("EVALSHA", add.sha, 1, key, *args)
                await pipe.execute()
        if progress:
            progress("presence", len(keys_seen))
    done["keys"] = len(keys_seen)
    # 3. what the old layouts kept
    await _delete_matching(client, (v3_members_key("*"),), chunk)
    for pod in states:
        await client.delete(*v3_pod_keys(pod))
        await client.delete(v1_pod_meta_key(pod), v1_pod_fields_key(pod), v1_pod_blocks_key(pod))
    if v1:
        await client.delete(V1_PODS_KEY)
    await client.hset(LAYOUT_KEY, "version", LAYOUT_VERSION)
    return done


async def _read_pod(client, pod: str, layout1: bool, chunk: int) -> PodState | None:
    """A pod's blocks from its old reverse index, as its state; None when it has none to read (migrated)."""
    if layout1:
        blocks_key, fields_key = v1_pod_blocks_key(pod), v1_pod_fields_key(pod)
    else:
        blocks_key, fields_key, _ = v3_pod_keys(pod)
    if not await client.exists(blocks_key) and not await client.exists(v1_pod_meta_key(pod)):
        return None
    fields = {text(k): text(v) for k, v in (await client.hgetall(fields_key)).items()}
    meta_key = v1_pod_meta_key(pod) if layout1 else pod_meta_key(pod)
    ebs, groups = await client.hmget(meta_key, "engine_block_size", "groups")
    stores: list[StoreBlock] = []
    cursor = 0
    while True:
        cursor, part = await client.hscan(blocks_key, cursor, count=chunk)
        items = [(text(k), text(v)) for k, v in part.items()]
        if layout1:  # layout 1 kept no request keys: engine:<key> says them
            async with client.pipeline(transaction=False) as pipe:
                for bk, _ in items:
                    pipe.zrange(engine_key_name(int(bk.split("|", 1)[0])), 0, -1)
                members = await pipe.execute() if items else []
        for j, (bk, held) in enumerate(items):
            if layout1:  # "<id>[*<copies>]", or the field itself (written before field ids)
                head, star, n = held.rpartition("*") if held[-1:].isdigit() and "*" in held else (held, "", "")
                fid = head if star else held
                held = f"{'f' if not fid.isdigit() else fid}{star}{n}:{','.join(text(r) for r in members[j])}"
                if not fid.isdigit():
                    fields = {**fields, "f": fid}
            block, copies = parse_v3_block(bk, held, fields)
            if parse_entry(block.entry_field) is None:
                continue  # not a field any llm-d reader would count
            stores.extend([block] * copies)
        if cursor == 0:
            break
    # its groups first: a hybrid pod's prefix group (full attention) decides which presence field each block sets
    state = PodState(parse_groups(groups), engine_block_size=int(text(ebs)) if ebs and text(ebs).isdigit() else None,
                     pod_id=pod)
    return state.plan(stores).after


async def _write_pod(client, pod: str, state: PodState, model: str) -> None:
    """The pod's state as a snapshot, and its meta (layout 1's copied first), in one transaction."""
    old = await client.hgetall(v1_pod_meta_key(pod))
    batches = old.get(b"batches") or await client.hget(pod_meta_key(pod), "batches") or b"0"
    orphans = state.orphan_count
    async with client.pipeline(transaction=True) as pipe:
        if old:
            pipe.hset(pod_meta_key(pod), mapping=old)
        pipe.delete(pod_state_key(pod))
        pipe.hset(pod_state_key(pod), "s", encode_snapshot(state, 1))
        pipe.hset(pod_meta_key(pod), mapping={"gen": "1:migrate", "blocks": len(state), "batches": batches,
                                              "orphan_at": batches, **({"model": model} if model else {})})
        if orphans is None:
            pipe.hdel(pod_meta_key(pod), "orphan_keys", "orphan_at")
        else:
            pipe.hset(pod_meta_key(pod), "orphan_keys", orphans)
        await pipe.execute()
    if model:
        await client.hset(PODS_KEY, pod, model)


async def _delete_matching(client, patterns: tuple[str, ...], chunk: int, only=None) -> None:
    """Every key matching the patterns (and ``only``, if given), deleted in chunks (redis-py splits a
    cluster's by slot)."""
    for pattern in patterns:
        batch = []
        async for key in client.scan_iter(match=pattern, count=chunk):
            if only is not None and not only(key):
                continue
            batch.append(key)
            if len(batch) >= chunk:
                await client.delete(*batch)
                batch = []
        if batch:
            await client.delete(*batch)


__all__ = ["migrate", "parse_v3_block"]
