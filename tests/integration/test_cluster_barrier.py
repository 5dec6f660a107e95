"""The replication barrier on a brand-new cluster (real valkey-server processes).

A replica that has received nothing yet (replication offset 0) is left out of CLUSTER SLOTS, so a client
that learned the slot map before the cluster's first write (an ingester started with a new cluster) saw
shards without replicas, and its barrier confirmed every write without a WAIT: a failover could then lose
effects whose outbox entries were already deleted. Where the map lists no replica, the barrier also reads
the shard's own node table (CLUSTER NODES).
"""
from __future__ import annotations

import os
import signal

import pytest
import redis

from kv_preflight.cli.valkey_cluster import ValkeyCluster
from kv_preflight.index.index import Index, StoreBlock, encode_entry, make_entry
from kv_preflight.index.layout import pod_outbox_key
from tests.integration.test_cluster import drain_until_empty, outbox_keys

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_a_new_clusters_first_writes_wait_for_their_replicas(tmp_path):
    cluster = ValkeyCluster(tmp_path / "cluster").start()
    ix = Index.from_url(cluster.url)
    sync = redis.RedisCluster.from_url(cluster.url)
    stopped: list[int] = []
    try:
        cluster.wait_ok()
        await ix.backend.client.initialize()  # the slot map learned before any write, as a new ingester does
        masters = {n.port for n in cluster.masters_now()}
        replicas = [n for n in cluster.nodes if n.port not in masters]
        assert len(replicas) == 3
        for node in replicas:  # every replica stops acknowledging: a WAIT cannot succeed now
            os.kill(node.proc.pid, signal.SIGSTOP)
            stopped.append(node.proc.pid)
        f = encode_entry(make_entry("pod-a", "gpu", None))
        r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=0, ts=1.0, model="m", engine_block_size=32,
                                 mutations=[StoreBlock(1, "gpu", f, (11, 12))])
        assert r.status == "applied"
        # not confirmed on a replica, so the entry stays to run again (it would be deleted with no WAIT)
        assert ix.backend.unreplicated == 1
        assert outbox_keys(sync) == [pod_outbox_key("pod-a")]
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped.clear()
        cluster.wait_ok()
        # replicas back: the entry runs again (as the ingester's chores run it) until a replica confirms it
        await drain_until_empty(ix, sync, timeout=10)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        await ix.close()
        sync.close()
        cluster.stop()


async def test_a_cluster_without_replicas_confirms_at_once(tmp_path):
    """Shards with no replica have nothing to wait for: entries are deleted right after their effects
    (a barrier that counted replicas wrongly would keep every entry and wait 200 ms a batch)."""
    cluster = ValkeyCluster(tmp_path / "cluster", replicas=0).start()
    ix = Index.from_url(cluster.url)
    sync = redis.RedisCluster.from_url(cluster.url)
    try:
        cluster.wait_ok()
        f = encode_entry(make_entry("pod-a", "gpu", None))
        for seq in range(3):
            r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=seq, ts=1.0, model="m", engine_block_size=32,
                                     mutations=[StoreBlock(seq + 1, "gpu", f, (11 + seq,))])
            assert r.status == "applied"
        assert ix.backend.unreplicated == 0
        assert outbox_keys(sync) == []
    finally:
        await ix.close()
        sync.close()
        cluster.stop()
