"""Valkey Cluster: noticing a shard that came back without its data.

On a single node, Valkey restarting empty takes the index's epoch key (``kvpf:epoch``) with it, and every
ingester notices (``Ingester.check_epoch``) and rebuilds its pods. On a cluster that key lives on one shard. A
master that restarts without persistence and without a failover (faster than the node timeout, or with its
replica down) comes back empty and still serving its slots; unless it held the epoch key, nothing said so, and
the request keys it held had lost their entries and presence bits while every pod's private state still
counted them, for good.

So every hash slot holds a marker (``slot_marker_key``), written once per epoch (``mark``). Each second an
ingester reads, per primary, the marker of the first slot it serves (``look``): a marker gone from a primary
that restarted since the markers were written (its uptime says) is a shard that lost its data. A marker moves
with its slot when the cluster is resharded, and a replica promoted by a failover has them (written long
before), so neither looks like a loss; a shard restarted from its own persistence has them too. One gone from a
primary that ran all along was evicted (an ``allkeys-*`` policy: a marker is read with EXISTS, which leaves its
age, so it goes first) or deleted by hand: it is written again, and that is no loss. 16,384 small hashes: about
1.5 MB over the cluster, and one read per primary a second.
"""
from __future__ import annotations

import asyncio
import functools
from binascii import crc_hqx
from collections.abc import Iterable
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from kv_preflight.index.backend import Looked, ms_of, read_pipeline
from kv_preflight.index.entries import text
from kv_preflight.index.layout import EPOCH_KEY, NUMS_COPIES, NUMS_NEXT_KEY, nums_copy_key, slot_marker_key

SLOTS = 16384
MARK_CHUNK = 2048  # markers per pipeline when marking


def least_tags(slots: Iterable[int]) -> dict[int, int]:
    """Per slot wanted, the least n whose tag ``{m<n>}`` puts a key in that slot (Valkey's slot of a tagged key:
    CRC16 of the tag)."""
    first = dict.fromkeys(slots, -1)
    left, n = len(first), 0
    while left:
        slot = crc_hqx(b"m%d" % n, 0) & (SLOTS - 1)
        if first.get(slot) == -1:
            first[slot] = n
            left -= 1
        n += 1
    return first


@functools.cache
def slot_markers() -> tuple[str, ...]:
    """Per hash slot, its marker's key name: ``slot_marker_key(n)`` for the least n whose key is in that slot
    (about 170,000 candidates are hashed to fill every slot: a fraction of a second, once per process)."""
    first = least_tags(range(SLOTS))
    return tuple(slot_marker_key(first[slot]) for slot in range(SLOTS))


@functools.cache
def numbering_copies() -> tuple[str, ...]:
    """The keys of the numbering high-water mark's copies (``nums_copy_key``): one in every
    SLOTS // NUMS_COPIES-th slot, tagged as that slot's marker is, so every primary of a cluster of up to
    NUMS_COPIES evenly split masters holds one."""
    first = least_tags(range(0, SLOTS, SLOTS // NUMS_COPIES))
    return tuple(nums_copy_key(first[slot]) for slot in sorted(first))


async def _slot_markers() -> tuple[str, ...]:
    """``slot_markers``, made once per process off the event loop (a fraction of a second), then as cached."""
    if slot_markers.cache_info().currsize:
        return slot_markers()
    return await asyncio.to_thread(slot_markers)


def first_slots(slots_cache: dict[int, list[Any]]) -> dict[str, int]:
    """Per primary (by name) in a redis-py slot map (slot -> [primary, replicas...]), the first slot it serves."""
    firsts: dict[str, int] = {}
    for slot, holders in slots_cache.items():
        if holders and (slot < firsts.get(holders[0].name, SLOTS)):
            firsts[holders[0].name] = slot
    return dict(sorted(firsts.items()))


def _one(reply: Any, node: str) -> Any:
    """A command's answer from one node: redis-py keys it by node name in some versions."""
    if isinstance(reply, dict) and node in reply and len(reply) == 1:
        return reply[node]
    return reply



class SlotMarkers:
    """The markers of the module docstring, written and read through redis-py's cluster client."""

    def __init__(self, client: RedisCluster):
        self.client = client

    async def marked(self) -> tuple[str, int, int]:
        """The epoch every slot's marker was written in ("" before any), when (Valkey ms), and when the
        index's epoch began (``id_at``; 0 if not known)."""
        found = await self.client.hmget(EPOCH_KEY, ["marked", "marked_at", "id_at"])
        at, began = (text(v) if v is not None else "" for v in found[1:])
        return (text(found[0]) if found[0] is not None else "", int(at) if at.isdigit() else 0,
                int(began) if began.isdigit() else 0)

    async def mark(self, epoch: str) -> None:
        """Every slot's marker written (one there already is kept), then ``epoch`` recorded as marked, with
        the time: from then on a marker gone from a primary that restarted since is that shard's data gone.
        Idempotent, and two ingesters marking at once write the same; one stopped halfway leaves "marked" as
        it was, so the next look marks again. Not recorded if the epoch moved on meanwhile (an older marking
        must not stand for a newer epoch's)."""
        if (await self.marked())[0] == epoch:
            return
        names = await _slot_markers()
        at = ms_of(await self.client.time())
        for i in range(0, SLOTS, MARK_CHUNK):
            async with self.client.pipeline(transaction=False) as pipe:
                for name in names[i:i + MARK_CHUNK]:
                    pipe.hsetnx(name, "id", epoch)
                await pipe.execute()
        if text(await self.client.hget(EPOCH_KEY, "id") or b"") == epoch:
            await self.client.hset(EPOCH_KEY, mapping={"marked": epoch, "marked_at": at})

    async def look(self, epoch: str) -> Looked:
        """Per primary, the marker of its first slot. One gone, from a primary up for less time than the
        markers have been there, is that shard's data gone (``lost``); from one up since before, it was
        evicted or deleted: written again (``rewritten``). When the slots were not marked in ``epoch`` (a new
        index, an upgrade, a new epoch whose marking was cut short) they are marked now; with no marking ever
        made, nothing is judged."""
        marked, at, began = await self.marked()
        # A shard started before the epoch began lost nothing its rebuild does not cover: judged from the later
        # of the two (a marking cut short after a loss must not find that loss again)
        looked = await self._judge(epoch, max(at, began)) if at else Looked([], [])
        if marked != epoch and not looked.lost:
            await self.mark(epoch)
        return looked

    async def _judge(self, epoch: str, at: int) -> Looked:
        """``look``'s verdicts, against markers written from ``at`` on (the last marking, whichever epoch: a
        marking cut short by a shard down keeps the older markers, and a shard that comes back empty meanwhile
        is still seen)."""
        if not self.client.nodes_manager.slots_cache:
            await self.client.initialize()
        slots_cache = self.client.nodes_manager.slots_cache
        firsts = first_slots(slots_cache)
        names = await _slot_markers()

        def fill(pipe) -> None:
            for slot in firsts.values():
                pipe.exists(names[slot])

        found = await read_pipeline(self.client, fill)  # a shard that does not answer is not judged now
        gone = [(node, slot) for (node, slot), n in zip(firsts.items(), found) if n == 0]
        if not gone:
            return Looked([], [])
        looked = Looked([], [])
        for node, slot in gone:
            primary = slots_cache[slot][0]
            info = _one(await self.client.execute_command("INFO", "server", target_nodes=primary), node)
            # its clock, read after its uptime. Valkey counts the uptime as the difference of two whole seconds
            # (now's and its start's), which may say a second more than it ran: so a start up to a second before
            # the marking counts as after it (a restart after the marking is never taken for an eviction; an
            # eviction is taken for a loss only from a node started within that second)
            now = ms_of(_one(await self.client.execute_command("TIME", target_nodes=primary), node))
            if now - int(info["uptime_in_seconds"]) * 1000 + 1000 > at:  # started after the markers were written
                looked.lost.append(node)
                nums = slots_cache.get(key_slot(NUMS_NEXT_KEY.encode()))
                if nums and nums[0].name == node:
                    looked = looked._replace(numbering=True)
            else:
                await self.client.hsetnx(names[slot], "id", epoch)
                looked.rewritten.append(node)
        return looked


__all__ = ["SLOTS", "Looked", "SlotMarkers", "first_slots", "numbering_copies", "slot_markers"]
