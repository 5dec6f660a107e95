"""Pipelined reads of many pods' state on a Valkey Cluster (``ClusterBackend.read_commands``): grouped by
primary on the lean connections, and routed through redis-py where a key's slot moved meanwhile."""
from __future__ import annotations

import pytest
import redis

from kv_preflight.index.index import Index
from kv_preflight.index.pod_meta import ScoringInfo
from kv_preflight.index.layout import pod_meta_key
from tests.integration.test_cluster_lookup import move_slot

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_many_pods_metadata_read_per_primary_and_after_a_slot_moved(valkey_cluster, cluster_url):
    pods = [f"reads-pod-{i}" for i in range(60)]  # names no other test on this cluster uses
    sync = redis.RedisCluster.from_url(cluster_url)
    for i, pod in enumerate(pods):
        if i % 7:  # every seventh pod has no meta at all
            sync.hset(pod_meta_key(pod), mapping={"engine_block_size": 16 * (1 + i % 3),
                                                  "incomplete": "1" if i % 5 == 0 else "0"})
    sync.hset(pod_meta_key(pods[1]), "engine_block_size", "sixteen")  # not ours: read as incomplete
    sync.delete(pod_meta_key(pods[2]))
    sync.set(pod_meta_key(pods[2]), "a string")  # a key of another type: incomplete, not an error
    want = [ScoringInfo(p, 16 * (1 + i % 3) if i % 7 and i != 1 else None, bool(i % 7 and i % 5 == 0) or i in (1, 2))
            for i, p in enumerate(pods)]
    want[2] = ScoringInfo(pods[2], None, True)
    ix = Index.from_url(cluster_url)
    try:
        assert await ix.meta.scoring_infos(pods) == want
        assert ix.backend.shards._fast  # the primaries' lean connections carried it
        moved = pods[10]
        move_slot(valkey_cluster, sync.keyslot(pod_meta_key(moved)))  # the client's map is now stale there
        assert await ix.meta.scoring_infos(pods) == want
        assert await ix.meta.scoring_infos(pods) == want
    finally:
        await ix.close()
        sync.close()
