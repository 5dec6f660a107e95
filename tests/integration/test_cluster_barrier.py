"""The replication barrier on a brand-new cluster (real valkey-server processes).

A replica that has received nothing yet (replication offset 0) is left out of CLUSTER SLOTS, so a client
that learned the slot map before the cluster's first write (an ingester started with a new cluster) saw
shards without replicas, and its barrier confirmed every write without a WAIT: a failover could then lose
effects whose outbox entries were already deleted. Where the map lists no replica, the barrier also reads
the shard's own node table (CLUSTER NODES).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
import redis

from kv_preflight.cli.valkey_cluster import ValkeyCluster
from kv_preflight.index.index import Index, StoreBlock, encode_entry, make_entry
from kv_preflight.index.layout import pod_outbox_key
from tests.integration.test_cluster import drain_until_empty, outbox_entry, outbox_keys

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


@contextlib.asynccontextmanager
async def cluster_with_index(tmp_path):
    """A new 3-master cluster with a replica each, an Index and a client on it, and the pids a test stopped
    (SIGCONT again at the end, whatever happens)."""
    cluster = ValkeyCluster(tmp_path / "cluster").start()
    ix = Index.from_url(cluster.url)
    sync = redis.RedisCluster.from_url(cluster.url)
    stopped: list[int] = []
    try:
        cluster.wait_ok()
        yield cluster, ix, sync, stopped
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        await ix.close()
        sync.close()
        cluster.stop()


async def held_shard(cluster, ix, sync, stopped):
    """A first batch applied and confirmed (the replicas have offsets), then a request key ``rk`` on a master
    (``victim``) other than pod-a's, whose replica is stopped and cut off: what goes there is confirmed by no
    replica from here on. Returns (pod-a's entry field, rk, victim, its replica)."""
    f = encode_entry(make_entry("pod-a", "gpu", None))
    r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=0, ts=1.0, model="m", engine_block_size=32,
                             mutations=[StoreBlock(1, "gpu", f, (11, 12))])
    assert r.status == "applied"
    await drain_until_empty(ix, sync, timeout=10)
    await ix.backend.writes.shards.ready()
    pod_master = sync.get_node_from_key(pod_outbox_key("pod-a")).port
    rk = next(k for k in range(1000, 100_000) if sync.get_node_from_key(str(k)).port != pod_master)
    victim = next(n for n in cluster.masters_now() if n.port == sync.get_node_from_key(str(rk)).port)
    [replica] = cluster.hold_replicas(victim)  # the replica takes nothing from here on
    stopped.append(replica.proc.pid)
    return f, rk, victim, replica


async def promote_behind(cluster, victim, replica, stopped: list[int]) -> redis.Redis:
    """The victim killed, then its held replica let go: it is promoted with what it had when held. Returns a
    client of it, once it is a master."""
    victim.stop(kill=True)
    os.kill(replica.proc.pid, signal.SIGCONT)
    stopped.clear()
    deadline = time.monotonic() + 30
    while replica.port not in {n.port for n in cluster.masters_now()}:
        assert time.monotonic() < deadline, "the replica was not promoted"
        await asyncio.sleep(0.1)
    return redis.Redis(port=replica.port)


async def test_a_new_clusters_first_writes_wait_for_their_replicas(tmp_path):
    async with cluster_with_index(tmp_path) as (cluster, ix, sync, stopped):
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
        assert ix.write_counts()["unreplicated"] == 1
        assert outbox_keys(sync) == [pod_outbox_key("pod-a")]
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped.clear()
        cluster.wait_ok()
        # replicas back: the entry runs again (as the ingester's chores run it) until a replica confirms it
        await drain_until_empty(ix, sync, timeout=10)


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
        assert ix.write_counts()["unreplicated"] == 0
        assert outbox_keys(sync) == []
    finally:
        await ix.close()
        sync.close()
        cluster.stop()


async def test_a_run_stalled_across_a_failover_is_not_acked_and_runs_again(tmp_path):
    """A run's writes went to a master whose replica had stopped taking them; the writer stalled before its
    ack (a SIGSTOP, a long pause) while the master died and that replica was promoted. The ack asked the
    primaries of the touched keys now: the promoted replica, with no replica of its own, confirmed at once,
    and the outbox entry was deleted with its writes lost (seen once in CI under load,
    test_cluster_failover.py::test_master_killed_under_load). The slot map moved since the run began, so the
    ack now refuses, and the entry runs again on the new master."""
    from kv_preflight.index.pod_state import EngineAdd, KeyChange

    async with cluster_with_index(tmp_path) as (cluster, ix, sync, stopped):
        f, rk, victim, replica = await held_shard(cluster, ix, sync, stopped)
        cw = ix.backend.writes
        changes = [EngineAdd(7, (rk,)), KeyChange(rk, f, 1, "gpu", 1)]
        payload = outbox_entry(changes, 0)
        sync.hset(pod_outbox_key("pod-a"), "9|w|0", payload)  # the batch's entry, as its pod step wrote it
        _, _, touched = await cw.run([cw_ops(changes)])  # rounds A-D: the entry's writes, on the victim
        assert sync.hkeys(str(rk)) == [f.encode()]
        # the writer stalls; the victim dies; its replica, which never got the write, is promoted
        promoted = await promote_behind(cluster, victim, replica, stopped)
        assert not promoted.hexists(str(rk), f), "the promoted replica had the write: nothing is tested"
        deadline = time.monotonic() + 30
        # the writer goes on: its later rounds find the old master gone and learn the slot map again
        cw.shards.forget_table()
        while True:  # (redis-py may try the dead node first, as its rounds' retries do)
            try:
                await cw.client.nodes_manager.initialize()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the slot map was not learnt again"
                await asyncio.sleep(0.2)
        # the run's ack (ClusterWrites.apply, the drain): the primaries it wrote to, whose replicas must confirm;
        # the slot map moved since the run began, so they are not known, and the entry is kept
        assert await cw._written_to(touched) is None
        after = redis.RedisCluster(host="127.0.0.1", port=replica.port)  # a client that knows the new map
        try:
            assert after.hexists(pod_outbox_key("pod-a"), "9|w|0")  # kept: it runs again, on the new master
            await drain_until_empty(ix, after, timeout=20)
            assert after.hkeys(str(rk)) == [f.encode()]
        finally:
            after.close()


def cw_ops(changes):
    from kv_preflight.index.cluster.outbox_ops import OutboxEntry

    return OutboxEntry(0, b"", changes)


async def test_kept_entries_run_again_once_their_master_failed_over_unseen(tmp_path):
    """An entry kept for a replica (its run wrote to a master whose replica had stopped) is not run again while
    the slot map holds: the chores' drain only asks the barrier again (a replica's outage of minutes leaves
    thousands of entries, and running them all every second cost as much as the outbox held). Its master then
    dies and that replica, which never got the run's writes, is promoted, with nothing else sent by this writer
    (a quiet engine: no batch of its finds the map moved): the barrier finds the old master not answering, the
    slot map is read again, and the entry runs on the promoted replica (without that read it stayed, its
    writes lost)."""
    async with cluster_with_index(tmp_path) as (cluster, ix, sync, stopped):
        f, rk, victim, replica = await held_shard(cluster, ix, sync, stopped)
        cw = ix.backend.writes
        unreplicated = cw.unreplicated
        r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=1, ts=1.0, model="m", engine_block_size=32,
                                 mutations=[StoreBlock(7, "gpu", f, (rk,))])
        assert r.status == "applied" and cw.unreplicated == unreplicated + 1
        assert sync.hkeys(str(rk)) == [f.encode()]
        [field] = sync.hkeys(pod_outbox_key("pod-a"))
        effects = int(redis.Redis(port=victim.port).info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
        for _ in range(2):  # the chores, twice: the barrier asked again, nothing run again
            assert await ix.drain_outbox("pod-a", stale_only=True) == 0
            await cw.client.nodes_manager.initialize()  # the same map, read again: it did not move
        assert sync.hkeys(pod_outbox_key("pod-a")) == [field] and cw.confirmed_late == 0
        assert int(redis.Redis(port=victim.port).info("commandstats")["cmdstat_evalsha"]["calls"]) == effects
        # The replica back: the entry is confirmed and deleted, not run again.
        os.kill(replica.proc.pid, signal.SIGCONT)
        stopped.clear()
        deadline = time.monotonic() + 30
        while sync.exists(pod_outbox_key("pod-a")):
            assert time.monotonic() < deadline, "the kept entry was not confirmed once its replica was back"
            assert await ix.drain_outbox("pod-a", stale_only=True) == 0
            await asyncio.sleep(0.3)
        assert cw.confirmed_late == 1
        assert int(redis.Redis(port=victim.port).info("commandstats")["cmdstat_evalsha"]["calls"]) == effects
        # Again, and this time the master dies before its replica caught up.
        os.kill(replica.proc.pid, signal.SIGSTOP)
        stopped.append(replica.proc.pid)
        redis.Redis(port=victim.port).execute_command("CLIENT", "KILL", "TYPE", "replica")
        rk = next(k for k in range(rk + 1, 100_000) if sync.get_node_from_key(str(k)).port == victim.port)
        r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=2, ts=1.0, model="m", engine_block_size=32,
                                 mutations=[StoreBlock(8, "gpu", f, (rk,))])
        assert r.status == "applied" and sync.hkeys(str(rk)) == [f.encode()]
        assert sync.hlen(pod_outbox_key("pod-a")) == 1
        promoted = await promote_behind(cluster, victim, replica, stopped)
        assert not promoted.hexists(str(rk), f), "the promoted replica had the write: nothing is tested"
        after = redis.RedisCluster(host="127.0.0.1", port=replica.port)  # a client that knows the new map
        try:
            deadline = time.monotonic() + 30
            while after.exists(pod_outbox_key("pod-a")):  # the chores, and nothing else of this writer's
                assert time.monotonic() < deadline, "the kept entry did not run again after the failover"
                await ix.drain_outbox("pod-a", stale_only=True)
                await asyncio.sleep(0.3)
            assert after.hkeys(str(rk)) == [f.encode()]
            assert cw.confirmed_late == 1
        finally:
            after.close()


async def test_kept_entries_run_again_on_a_master_restarted_without_its_data(tmp_path):
    """An entry kept for a replica (down) must not be deleted on the barrier's word alone after its master
    restarted without a failover (faster than the node timeout, or with its replica down: no failover is
    possible) and without the run's writes (no persistence): the replica, back, syncs from that master, so a
    WAIT then confirms a dataset without them. The master's run id changed, so the entry runs again (a
    second review found this: with the slot map unchanged, the entry was confirmed and deleted, its changes
    lost on both)."""
    import shutil

    async with cluster_with_index(tmp_path) as (cluster, ix, sync, stopped):
        f, rk, victim, replica = await held_shard(cluster, ix, sync, stopped)
        cw = ix.backend.writes
        r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=1, ts=1.0, model="m", engine_block_size=32,
                                 mutations=[StoreBlock(7, "gpu", f, (rk,))])
        assert r.status == "applied" and sync.hkeys(str(rk)) == [f.encode()]
        assert await ix.drain_outbox("pod-a", stale_only=True) == 0  # kept, and not run again
        assert sync.hlen(pod_outbox_key("pod-a")) == 1
        victim.stop(kill=True)
        shutil.rmtree(victim.data_dir / "appendonlydir", ignore_errors=True)  # as if it ran without persistence
        victim.start()
        back = redis.Redis(port=victim.port)
        deadline = time.monotonic() + 30
        while back.cluster("info")["cluster_state"] != "ok":  # it rejoined, still a master
            assert time.monotonic() < deadline, "the restarted master did not rejoin"
            await asyncio.sleep(0.1)
        assert back.info("replication")["role"] == "master"
        assert not back.exists(str(rk)), "the restarted master kept the write: nothing is tested"
        os.kill(replica.proc.pid, signal.SIGCONT)  # back: it syncs from the restarted master, without the write
        stopped.clear()
        deadline = time.monotonic() + 30
        while sync.exists(pod_outbox_key("pod-a")):  # the chores
            assert time.monotonic() < deadline, "the kept entry was never confirmed"
            await ix.drain_outbox("pod-a", stale_only=True)
            await asyncio.sleep(0.3)
        assert redis.Redis(port=victim.port).hkeys(str(rk)) == [f.encode()]  # ran again (then confirmed)
