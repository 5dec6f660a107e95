"""Valkey Cluster: the index's backend when Valkey is sharded. The write path without cross-slot scripts
(``writes.py``), the sharded lookup (``lookup.py``), the replication barrier (``barrier.py``) and where keys
live (``routing.py``)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from kv_preflight.index.backend import VALKEY_ERRORS, Looked, ms_of, read_pipeline, ready
from kv_preflight.index.cluster.lookup import EXACT_BUDGET, ClusterLookup
from kv_preflight.index.cluster.merge import merge_shards, pod_bisectable
from kv_preflight.index.cluster.markers import SlotMarkers, numbering_copies
from kv_preflight.index.cluster.routing import Shards, by_primary, cluster_client, node_for, probe_cluster, writer_id
from kv_preflight.index.cluster.writes import TAKEOVER_MS, ClusterWrites
from kv_preflight.index.entries import ApplyResult, Lookup
from kv_preflight.index.presence import NamesFor
from kv_preflight.index.resp import script_sha
from kv_preflight.index import scripts
from kv_preflight.index.writer import Prepared


class ClusterBackend:
    """Valkey Cluster: batches in three steps (writes.py), lookups in at most three rounds (lookup.py)."""

    cluster = True
    label = "Valkey Cluster"
    # On a cluster the shard holding one key (the registry's, a meta) may be the one down while the others
    # answer: a caller goes on, and the lookup says how far it could read ("partial")
    partial_reads = True
    fast = None  # redis-py's cluster client routes every command

    def __init__(self, client: RedisCluster, *, writer: str | None = None, takeover_ms: int = TAKEOVER_MS):
        self.client = client
        self.shards = Shards(client, resend_scripts={script_sha(scripts.LOOKUP), script_sha(scripts.LOOKUP_BITS)})
        self.writes = ClusterWrites(client, self.shards, writer=writer or writer_id(), takeover_ms=takeover_ms)
        self.lookups = ClusterLookup(client, self.shards)

    @property
    def gap_walks(self) -> int:
        return self.lookups.gap_walks

    @property
    def numbering_copies(self) -> tuple[str, ...]:
        return numbering_copies()

    @property
    def late_reads(self) -> int:
        return self.lookups.late_reads

    async def send(self, preps: Sequence[Prepared]) -> "Any":
        return ready(await self.writes.send(preps))

    def write_counts(self) -> dict[str, int]:
        w = self.writes
        return {"unreplicated": w.unreplicated, "confirmed_late": w.confirmed_late, "late_runs": w.late_runs}

    def nodes(self) -> list[tuple[str, int]]:
        return [(n.host, int(n.port)) for n in self.client.get_nodes()]

    def forget(self, pods: Iterable[str]) -> None:
        self.writes.forget(pods)

    def left_to_drain(self, pod_id: str) -> bool:
        return self.writes.left_to_drain(pod_id)

    async def drain_outbox(self, pod_id: str, *, stale_only: bool) -> int:
        # not stale_only (before a clearing): this writer's entries all run again, but another writer's only once
        # stale: a live writer's young entry is on its way, and the clearing waits for it (ClusterWrites.drain)
        if stale_only:
            return await self.writes.drain(pod_id, older_than_ms=self.writes.takeover_ms)
        return await self.writes.drain(pod_id, others_older_than_ms=self.writes.takeover_ms)

    async def drain_outboxes(self, pods: Sequence[str], *, at_once: int) -> dict[str, int | Exception]:
        """Side by side: a pod's drain waits up to the barrier's timeout (WAIT, 200 ms) while a replica is down
        and its entries stay, so one pod after another would hold its caller up that long per pod."""
        limit = asyncio.Semaphore(at_once)

        async def one(pod: str) -> int | Exception:
            async with limit:
                try:
                    return await self.drain_outbox(pod, stale_only=True)
                except VALKEY_ERRORS as exc:
                    return exc

        return dict(zip(pods, await asyncio.gather(*(one(p) for p in pods))))

    async def read_timed(self, fill: Callable[[Any], None]) -> tuple[int, list[Any]]:
        """``TIME`` alone (no pipeline may hold a keyless command on a cluster), then one pipeline routed per
        shard."""
        now = await self.client.time()
        return ms_of(now), await read_pipeline(self.client, fill)

    async def look_at_shards(self, epoch: str) -> Looked:
        return await SlotMarkers(self.client).look(epoch)

    async def mark_shards(self, epoch: str) -> None:
        await SlotMarkers(self.client).mark(epoch)

    async def lookup(self, request_keys: Sequence[int], pods: Sequence[str] | None, mode: str) -> tuple[Lookup, int]:
        return await self.lookups.lookup(request_keys, pods, mode)

    async def lookup_bits(self, request_keys: Sequence[int], names: NamesFor) -> tuple[Lookup | None, int]:
        return await self.lookups.lookup_bits(request_keys, names)

    async def read_commands(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        return await self.shards.commands(commands)

    async def key_count(self) -> int:
        n = await self.client.dbsize(target_nodes=RedisCluster.PRIMARIES)
        return int(sum(n.values()) if isinstance(n, dict) else n)

    async def memory_usage(self) -> int | None:
        infos = await self.client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        if isinstance(infos, dict) and "used_memory" in infos:
            return int(infos["used_memory"])
        return sum(int(v.get("used_memory", 0)) for v in infos.values() if isinstance(v, dict))

    async def close(self) -> None:
        await self.writes.close()
        await self.shards.close()


__all__ = ["ApplyResult", "ClusterBackend", "EXACT_BUDGET", "TAKEOVER_MS", "by_primary", "cluster_client",
           "merge_shards", "node_for", "pod_bisectable", "probe_cluster", "writer_id"]
