"""Valkey Cluster: noticing a shard that came back without its data.

On a single node, Valkey restarting empty takes the index's epoch key (``kvpf:epoch``) with it, and every
ingester notices (``Ingester.check_epoch``) and rebuilds its pods. On a cluster that key lives on one shard. A
master that restarts without persistence and without a failover (faster than the node timeout, or with its
replica down) comes back empty and still serving its slots; unless it held the epoch key, nothing said so, and
the request keys it held had lost their entries and presence bits while every pod's private state still
counted them, for good.

So every hash slot holds a marker (``slot_marker_key``), written once per epoch (``mark``). Each second an
ingester reads, per primary, the marker of the first slot it serves (``lost``): a marker gone is a shard that
lost its data. A marker moves with its slot when the cluster is resharded, and a replica promoted by a failover
has them (written long before), so neither looks like a loss; a shard restarted from its own persistence has
them too. 16,384 small hashes: about 1.5 MB over the cluster, and one read per primary a second.
"""
from __future__ import annotations

import asyncio
import functools
from binascii import crc_hqx
from typing import Any

from redis.asyncio.cluster import RedisCluster

from kv_preflight.index.backend import read_pipeline
from kv_preflight.index.entries import text
from kv_preflight.index.layout import EPOCH_KEY, slot_marker_key

SLOTS = 16384
MARK_CHUNK = 2048  # markers per pipeline when marking


@functools.cache
def slot_markers() -> tuple[str, ...]:
    """Per hash slot, its marker's key name: ``slot_marker_key(n)`` for the least n whose key is in that slot
    (about 170,000 candidates are hashed to fill every slot: a fraction of a second, once per process)."""
    first: list[int] = [-1] * SLOTS
    left, n = SLOTS, 0
    while left:
        slot = crc_hqx(b"m%d" % n, 0) & (SLOTS - 1)  # Valkey's slot of a key tagged {m<n>}: CRC16 of the tag
        if first[slot] < 0:
            first[slot] = n
            left -= 1
        n += 1
    return tuple(slot_marker_key(n) for n in first)


def first_slots(slots_cache: dict[int, list[Any]]) -> dict[str, int]:
    """Per primary (by name) in a redis-py slot map (slot -> [primary, replicas...]), the first slot it serves."""
    firsts: dict[str, int] = {}
    for slot, holders in slots_cache.items():
        if holders and (slot < firsts.get(holders[0].name, SLOTS)):
            firsts[holders[0].name] = slot
    return dict(sorted(firsts.items()))


class SlotMarkers:
    """The markers of the module docstring, written and read through redis-py's cluster client."""

    def __init__(self, client: RedisCluster):
        self.client = client

    async def marked(self) -> str:
        """The epoch every slot's marker was written in ("" before any)."""
        found = await self.client.hget(EPOCH_KEY, "marked")
        return text(found) if found is not None else ""

    async def mark(self, epoch: str) -> None:
        """Every slot's marker written (one there already is kept), then ``epoch`` recorded as marked: from
        then on a marker gone is a shard's data gone. Idempotent, and two ingesters marking at once write the
        same; one stopped halfway leaves "marked" as it was, so the next look marks again."""
        if await self.marked() == epoch:
            return
        names = await asyncio.to_thread(slot_markers)  # once per process; not on the event loop
        for i in range(0, SLOTS, MARK_CHUNK):
            async with self.client.pipeline(transaction=False) as pipe:
                for name in names[i:i + MARK_CHUNK]:
                    pipe.hsetnx(name, "id", epoch)
                await pipe.execute()
        await self.client.hset(EPOCH_KEY, "marked", epoch)

    async def lost(self, epoch: str) -> list[str]:
        """The primaries (host:port) whose first slot's marker is gone: each came back without its data. When
        the slots were not marked in ``epoch`` (a new index, an upgrade, a marking cut short) they are marked
        now and nothing is judged."""
        if await self.marked() != epoch:
            await self.mark(epoch)
            return []
        if not self.client.nodes_manager.slots_cache:
            await self.client.initialize()
        firsts = first_slots(self.client.nodes_manager.slots_cache)
        names = await asyncio.to_thread(slot_markers)

        def fill(pipe) -> None:
            for slot in firsts.values():
                pipe.exists(names[slot])

        found = await read_pipeline(self.client, fill)
        for r in found:
            if isinstance(r, Exception):
                raise r
        return [node for node, n in zip(firsts, found) if n == 0]


__all__ = ["SLOTS", "SlotMarkers", "first_slots", "slot_markers"]
