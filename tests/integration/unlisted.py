"""Pods that have keys but no registry row (issue 26: no pod may have keys that no listing shows), read as one
snapshot, and a probe that takes that snapshot after every command an Index sends.

The snapshot is one script (registry, per-pod keys, numbering, read in one step), not a registry read followed
by a SCAN: a writer lists a pod and then writes its keys, so a SCAN that ran after the registry was read saw a
pod listed a moment later as unlisted (CI: ``test_any_lifecycle_sequence_leaves_every_pod_with_keys_listed``
failed so while the ingester took back a pod that ``index clear --forget`` had just dropped).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
import redis.asyncio as aioredis

from kv_preflight.index.layout import NUMS_BYNAME_KEY, OUR_PREFIX, PODS_KEY

# Single node only (KEYS and keys the script does not declare), which is what these tests run on.
SNAPSHOT = """
return {redis.call('HKEYS', KEYS[1]), redis.call('KEYS', ARGV[1]), redis.call('HKEYS', KEYS[2])}
"""
POD_KEYS = OUR_PREFIX + "{*}:*"
NUMS_PREFIX = OUR_PREFIX + "{nums}"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _unlisted(reply: list) -> set[str]:
    listed, keys, numbered = ([_text(v) for v in part] for part in reply)
    with_keys = {k[len(OUR_PREFIX) + 1:].rsplit("}:", 1)[0] for k in keys if not k.startswith(NUMS_PREFIX)}
    return (with_keys | set(numbered)) - set(listed)


def unlisted_pods(valkey_url: str) -> set[str]:
    """Pods that have keys (metadata, a state log, a number) but no registry row: what no listing shows."""
    r = redis.Redis.from_url(valkey_url)
    try:
        return _unlisted(r.eval(SNAPSHOT, 2, PODS_KEY, NUMS_BYNAME_KEY, POD_KEYS))
    finally:
        r.close()


async def unlisted_now(client: aioredis.Redis) -> set[str]:
    return _unlisted(await client.eval(SNAPSHOT, 2, PODS_KEY, NUMS_BYNAME_KEY, POD_KEYS))


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
