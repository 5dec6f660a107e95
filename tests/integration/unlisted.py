"""Pods that have keys but no registry row (issue 26: no pod may have keys that no listing shows), read as one
snapshot, and a probe that takes that snapshot after every command an Index sends.

What a pod leaves in Valkey, all of it looked at: its per-pod keys (``kvpf:{<pod>}:*``), its number
(``kvpf:{nums}:byname``), its bit in the presence hashes (``kvpf:{<rk>}``, each bit named through
``kvpf:{nums}:byid``; a bit of a number nobody holds any more is a freed pod's, shown as ``#<n>``: the issue's
finding 4 was such bits, left on hundreds of keys) and its llm-d entries (the fields of the request-key
hashes, which name the pod themselves).

The snapshot is one script (registry, numbering and every key, read in one step), not a registry read
followed by a SCAN: a writer lists a pod and then writes its keys, so a SCAN that ran after the registry was
read saw a pod listed a moment later as unlisted (CI: ``test_any_lifecycle_sequence_leaves_every_pod_with_keys_listed``
failed so while the ingester took back a pod that ``index clear --forget`` had just dropped).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
import redis.asyncio as aioredis

from kv_preflight.index.entries import parse_entry
from kv_preflight.index.layout import NUMS_BYID_KEY, NUMS_BYNAME_KEY, OUR_PREFIX, PODS_KEY

# Single node only (KEYS, and keys the script does not declare), which is what these tests run on. Every key
# is read once: per-pod keys by name, presence hashes' bitmaps and llm-d entries' fields (each distinct field
# once) returned whole, decoded in Python by the same rules as the index's.
SNAPSHOT = """
local prefix, nums = ARGV[1], ARGV[2]
local pod_keys, bitmaps, fields, seen = {}, {}, {}, {}
for _, k in ipairs(redis.call('KEYS', '*')) do
  if string.match(k, '^%d+$') then
    for _, f in ipairs(redis.call('HKEYS', k)) do
      if not seen[f] then seen[f] = true; fields[#fields + 1] = f end
    end
  elseif string.sub(k, 1, #prefix + 1) == prefix .. '{' and string.match(k, '^{%d+}$', #prefix + 1) then
    for _, v in ipairs(redis.call('HVALS', k)) do bitmaps[#bitmaps + 1] = v end
  elseif string.sub(k, 1, #prefix + 1) == prefix .. '{' and string.sub(k, 1, #nums) ~= nums
      and string.find(k, '}:', 1, true) then
    pod_keys[#pod_keys + 1] = k
  end
end
return {redis.call('HKEYS', KEYS[1]), pod_keys, redis.call('HKEYS', KEYS[2]), redis.call('HGETALL', KEYS[3]),
        bitmaps, fields}
"""
NUMS_PREFIX = OUR_PREFIX + "{nums}"
SNAPSHOT_KEYS = (PODS_KEY, NUMS_BYNAME_KEY, NUMS_BYID_KEY)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _bits(value: Any) -> list[int]:
    """The pod numbers a presence value ``<n>:<bitmap>`` holds (bit k: byte k // 8, value 1 << k % 8)."""
    raw = value if isinstance(value, bytes) else value.encode("latin-1")
    bitmap = raw.partition(b":")[2]
    return [8 * i + b for i, byte in enumerate(bitmap) for b in range(8) if byte >> b & 1]


def _unlisted(reply: list) -> set[str]:
    listed, keys, numbered = ({_text(v) for v in part} for part in reply[:3])
    flat = reply[3]
    byid = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}
    with_keys = {_text(k)[len(OUR_PREFIX) + 1:].rsplit("}:", 1)[0] for k in keys}
    with_bits = {byid.get(str(n), f"#{n}") for value in reply[4] for n in _bits(value)}
    with_entries = {e.PodIdentifier for e in map(parse_entry, reply[5]) if e is not None}
    return (with_keys | numbered | with_bits | with_entries) - listed


def unlisted_pods(valkey_url: str) -> set[str]:
    """Pods that have keys (metadata, a state log, a number, presence bits, llm-d entries) but no registry
    row: what no listing shows."""
    r = redis.Redis.from_url(valkey_url)
    try:
        return _unlisted(r.eval(SNAPSHOT, len(SNAPSHOT_KEYS), *SNAPSHOT_KEYS, OUR_PREFIX, NUMS_PREFIX))
    finally:
        r.close()


async def unlisted_now(client: aioredis.Redis) -> set[str]:
    return _unlisted(await client.eval(SNAPSHOT, len(SNAPSHOT_KEYS), *SNAPSHOT_KEYS, OUR_PREFIX, NUMS_PREFIX))


@asynccontextmanager
async def every_command_probed(index, valkey_url: str) -> AsyncIterator[list[set[str]]]:
    """After each command ``index``'s redis-py client sends, the snapshot above (on a connection of its own):
    every moment between two of its steps, as any reader may see it. Yields the list the snapshots go to.
    (Its pipelines and its lean connection are not probed between their commands: each is one step.)"""
    seen: list[set[str]] = []
    watcher = aioredis.Redis.from_url(valkey_url)
    send = index.client.execute_command

    async def probed(*args, **options):
        try:
            return await send(*args, **options)
        finally:
            seen.append(await unlisted_now(watcher))

    index.client.execute_command = probed
    try:
        yield seen
    finally:
        index.client.execute_command = send
        await watcher.aclose()
