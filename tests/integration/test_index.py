"""The Valkey layout and the apply script, against a real valkey-server."""
from __future__ import annotations

import time

import pytest
import redis

from kv_preflight.index.index import (
    ClearPod, Index, RemoveBlock, StoreBlock, encode_entry, engine_key_name, longest_prefix, make_entry,
)
from kv_preflight.index.layout import (
    NUMS_BYID_KEY, NUMS_BYNAME_KEY, NUMS_KEYS, PODS_KEY, nums_copy_key, pod_meta_key, pod_state_keys, presence_key,
)
from kv_preflight.index.numbering import give_numbers
from kv_preflight.index.transfer import export_blocks, held_blocks
from tests.integration.unlisted import every_command_probed, unlisted_now

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

F0 = encode_entry(make_entry("pod-a", "GPU", 0))
FB = encode_entry(make_entry("pod-b", "GPU", 0))


async def apply(ix, seq, muts, pod="pod-a", ts=None, mode="check"):
    return await ix.apply_batch(pod_id=pod, rank=0, seq=seq, ts=ts if ts is not None else 1000.0 + seq,
                                model="m", engine_block_size=32, mutations=muts, mode=mode)


async def test_store_writes_llmd_layout(ix, valkey_url):
    r = await apply(ix, 0, [StoreBlock(11, "gpu", F0, (101, 102)), StoreBlock(12, "gpu", F0, (103, 104))])
    assert (r.status, r.last_seq) == ("applied", -1)
    sync = redis.Redis.from_url(valkey_url, decode_responses=True)
    assert sync.hgetall("101") == {F0: ""}
    assert sync.type("engine:11") == "zset"
    assert sync.zrange("engine:11", 0, -1, withscores=True) == [("101", 0.0), ("102", 1.0)]
    assert F0 == '{"PodIdentifier":"pod-a","DeviceTier":"gpu","Speculative":false,"HasGroup":true,"GroupIdx":0}'
    # llm-d's Clear() runs HKEYS on every key not starting with "engine:": each must be a HASH.
    for key in sync.scan_iter():
        if not key.startswith("engine:"):
            sync.hkeys(key)
            assert sync.type(key) == "hash", key
    meta = sync.hgetall(pod_meta_key("pod-a"))
    assert meta["seq:0"] == "0" and meta["engine_block_size"] == "32" and meta["model"] == "m"


async def test_seq_check_dup_gap_restart(ix):
    assert (await apply(ix, 0, [StoreBlock(11, "gpu", F0, (101,))])).status == "applied"
    assert (await apply(ix, 0, [StoreBlock(11, "gpu", F0, (101,))])).status == "dup"
    gap = await apply(ix, 3, [])
    assert (gap.status, gap.last_seq) == ("gap", 0)
    assert (await apply(ix, 1, [])).status == "applied"
    # seq back to 0 with a newer timestamp: the engine restarted.
    assert (await apply(ix, 0, [], ts=5000.0)).status == "restart"
    assert (await apply(ix, 0, [StoreBlock(13, "gpu", F0, (105,))], ts=5000.0, mode="reset")).status == "applied"
    assert await ix.client.exists("101") == 0 and await ix.client.exists("105") == 1
    # An unseen pod that starts past seq 0 has missed history.
    assert (await apply(ix, 4, [], pod="pod-new")).status == "gap"
    assert (await apply(ix, 4, [], pod="pod-new", mode="force")).status == "applied"


async def test_remove_prunes_and_keeps_other_pods(ix):
    await apply(ix, 0, [StoreBlock(11, "gpu", F0, (101, 102))])
    await apply(ix, 0, [StoreBlock(11, "gpu", FB, (101, 102))], pod="pod-b")
    await apply(ix, 1, [RemoveBlock(11, "gpu")])
    assert await ix.client.hkeys("101") == [FB.encode()]
    assert await ix.client.exists(engine_key_name(11)) == 1  # pod-b still holds it
    await apply(ix, 1, [RemoveBlock(11, "gpu")], pod="pod-b")
    assert await ix.client.exists("101", "102", engine_key_name(11)) == 0
    # Removing what is not there is a no-op, not an error.
    assert (await apply(ix, 2, [RemoveBlock(99, "gpu"), RemoveBlock(11, "cpu")])).status == "applied"


async def test_clear_pod_is_per_pod(ix):
    await apply(ix, 0, [StoreBlock(11, "gpu", F0, (101,)), StoreBlock(12, "gpu", F0, (102,))])
    await apply(ix, 0, [StoreBlock(11, "gpu", FB, (101,))], pod="pod-b")
    await apply(ix, 1, [ClearPod(), StoreBlock(13, "gpu", F0, (103,))])
    assert await ix.client.hkeys("101") == [FB.encode()]
    assert await ix.client.exists("102") == 0 and await ix.client.exists("103") == 1
    assert await ix.clear_pod("pod-b", forget=True) == 1
    assert await ix.client.exists("101", pod_meta_key("pod-b")) == 0
    assert "pod-b" not in await ix.meta.pod_ids()


async def test_forgetting_a_pod_shows_no_moment_of_keys_unlisted(ix, valkey_url):
    """Issue 26, between the steps of ``clear_pod(forget=True)`` (``index clear --forget``, retention): a
    reader sees the pod listed, or gone whole, never a key or number of it without its registry row. The row
    was dropped before the number was freed; a snapshot between the two saw ``{nums}:byname`` name a pod that
    no listing showed (caught under load while the lifecycle property test ran)."""
    await apply(ix, 0, [StoreBlock(11, "gpu", F0, (101,))])
    async with every_command_probed(ix, valkey_url) as seen:
        await ix.clear_pod("pod-a", forget=True)
    assert len(seen) >= 3 and all(not s for s in seen), seen
    assert "pod-a" not in await ix.meta.pod_ids() and not await unlisted_now(ix.client)


async def test_the_unlisted_check_sees_a_freed_pods_presence_bits_and_llmd_entries(ix):
    """The check the lifecycle tests lean on (tests/integration/unlisted.py) must see every trace a pod leaves:
    the issue's finding 4 was presence bits of a pod no listing showed, which a check of per-pod keys and
    numbers alone passed. Here a pod's row, number and per-pod keys go by hand and its entry and bit stay."""
    await apply(ix, 0, [StoreBlock(11, "gpu", F0, (101,))])
    num = (await ix.numbering.pod_numbers(["pod-a"]))["pod-a"]
    assert not await unlisted_now(ix.client)
    await ix.client.delete(*pod_state_keys("pod-a"))
    await ix.client.hdel(PODS_KEY, "pod-a")
    await ix.client.hdel(NUMS_BYNAME_KEY, "pod-a")
    await ix.client.hdel(NUMS_BYID_KEY, str(num))
    assert await unlisted_now(ix.client) == {f"#{num}", "pod-a"}  # its bit (a number nobody holds), its entry
    await ix.client.delete("101")
    assert await unlisted_now(ix.client) == {f"#{num}"}
    await ix.client.delete(presence_key(101))
    assert not await unlisted_now(ix.client)


async def test_a_pod_forgotten_under_its_writer_is_listed_before_it_is_numbered_again(ix, valkey_url):
    """A writer whose pod another process forgot (its row, number and meta gone) gets "nonum" for its next
    batch and takes the pod back: the registry row first, then the number. Before, the apply script's check
    for a missing number compared HMGET's false with nil and never answered: the writer wrote the pod's meta,
    state and bits under the number it remembered (freed), with no registry row. And once it answered, the
    pod was numbered before it was listed: ``{nums}:byname`` and meta ``num`` with no row until the row came."""
    await apply(ix, 0, [StoreBlock(11, "gpu", F0, (101,))])  # listed, numbered; this Index remembers both
    other = Index.from_url(valkey_url)
    try:
        await other.clear_pod("pod-a", forget=True)
    finally:
        await other.close()
    async with every_command_probed(ix, valkey_url) as seen:
        # past a gap (the ingester's batch when the replay buffer no longer reaches back), and not seq 0,
        # which always writes the row: the writer's cached row and number are all it has to go by
        result = await apply(ix, 5, [StoreBlock(12, "gpu", F0, (102,))], mode="force")
    assert result.status == "applied" and not await unlisted_now(ix.client)
    assert seen and all(not s for s in seen), seen
    assert "pod-a" in await ix.meta.pod_ids()
    num = (await ix.numbering.pod_numbers(["pod-a"]))["pod-a"]  # numbered again, and its meta says the same number
    assert int(await ix.client.hget(pod_meta_key("pod-a"), "num")) == num
    assert [m.pod_id for m in await ix.lookup([102])] == ["pod-a"]


async def test_a_pod_numbered_again_gets_the_number_its_meta_holds_and_new_ones_start_past_the_copies(ix):
    """give_numbers after the numbering was lost (``kvpf:{nums}:*`` gone, as with a cluster shard that came back
    empty) while the pods' metas and the high-water mark's copies survived: each pod gets its own number back,
    unless another pod has it by then; a meta's "num" that is no number of the lost numbering is ignored; a new
    number is past the copies' mark, which it raises (never lowers), and a copy that lags is raised too. In a
    numbering never lost, a meta's leftover "num" is never taken (a freed number waits its time)."""
    copies = [nums_copy_key(1), nums_copy_key(2)]
    assert await give_numbers(ix.client, ["pod-a", "pod-b", "pod-c"], copies) == {"pod-a": 0, "pod-b": 1, "pod-c": 2}
    assert [await ix.client.hget(k, "next") for k in copies] == [b"3", b"3"]
    await ix.client.hset(pod_meta_key("pod-gone"), "num", 0)  # a forgotten pod's leftover: pod-a's number
    assert await give_numbers(ix.client, ["pod-gone"], copies) == {"pod-gone": 3}
    assert [await ix.client.hget(k, "next") for k in copies] == [b"4", b"4"]

    await ix.client.delete(*NUMS_KEYS)  # lost; pod-gone's meta now says 3, pod-a's 0, pod-b's 1, pod-c's 2
    await ix.client.hset(copies[1], "next", 2)  # a copy that lags (its shard was down at the last give)
    assert await give_numbers(ix.client, ["pod-new", "pod-c"], copies) == {"pod-new": 4, "pod-c": 2}
    assert [await ix.client.hget(k, "next") for k in copies] == [b"5", b"5"]
    await ix.client.hset(NUMS_BYID_KEY, "0", "pod-other")  # pod-a's number, someone else's by now
    assert await give_numbers(ix.client, ["pod-a", "pod-b"], copies) == {"pod-a": 5, "pod-b": 1}
    assert int(await ix.client.hget(pod_meta_key("pod-a"), "num")) == 5
    for i, bad in enumerate(["1.5", "-1", "x", "01", "²", "99999999999999999999", "4"]):  # 4: not of the lost one
        await ix.client.hset(pod_meta_key(f"pod-bad{i}"), "num", bad)
    assert await give_numbers(ix.client, [f"pod-bad{i}" for i in range(7)], copies) == {
        f"pod-bad{i}": 6 + i for i in range(7)}
    await ix.client.hset(copies[1], "next", 80)  # (a copy another writer raised meanwhile: kept)
    assert await give_numbers(ix.client, ["pod-g"], copies) == {"pod-g": 80}
    assert [await ix.client.hget(k, "next") for k in copies] == [b"81", b"81"]


async def test_a_bit_nobody_holds_reads_the_names_again_at_most_once_a_second_a_new_pod_at_once(ix):
    """Bits under a number nobody holds (a pod lost with its cluster shard's data and numbered anew) stand on the
    keys they are on: each lookup meeting them read the whole numbering again. Now an unknown number below the
    numbering's next is read again at most every UNNAMED_RECHECK_S; a new pod's (at or past it) at once."""
    import time

    from kv_preflight.index.numbering import UNNAMED_RECHECK_S

    def reads() -> int:  # of the numbering, by this server's count
        return int(redis_sync.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0))

    redis_sync = redis.Redis(**{k: v for k, v in ix.client.connection_pool.connection_kwargs.items()
                                if k in ("host", "port", "db", "password", "username")})
    try:
        await give_numbers(ix.client, ["pod-a", "pod-b"])
        await ix.client.hdel(NUMS_BYID_KEY, "1")  # bit 1 names nobody now
        await ix.numbering.pod_names(refresh=True)
        start, t0 = reads(), time.monotonic()
        for _ in range(20):
            assert await ix.numbering.names_for(0b11) == {0: "pod-a"}
        assert reads() - start <= 1 + (time.monotonic() - t0) / UNNAMED_RECHECK_S
        await give_numbers(ix.client, ["pod-c"])  # number 2: past the next the names were read with
        start = reads()
        assert await ix.numbering.names_for(0b101) == {0: "pod-a", 2: "pod-c"}
        assert await ix.numbering.names_for([2]) == {0: "pod-a", 2: "pod-c"}
        assert reads() - start == 1
    finally:
        redis_sync.close()


async def test_lookup_script_equals_pipeline_and_llmd_forms(ix, valkey_url):
    chain = [201, 202, 203, 204]
    await apply(ix, 0, [StoreBlock(1, "gpu", F0, tuple(chain))])
    await apply(ix, 0, [StoreBlock(2, "gpu", FB, tuple(chain[:2]))], pod="pod-b")
    sync = redis.Redis.from_url(valkey_url)
    sync.hset("201", "llmd-v08@gpu", "")  # written by an llm-d v0.8 scheduler
    sync.hset("201", "spec-pod@gpu[speculative]", "")  # not confirmed: never counts
    sync.hset("202", "llmd-v08@cpu", "")
    for mode in ("script", "pipeline"):
        got = {m.pod_id: (m.blocks, m.tier) for m in await ix.lookup(chain, mode=mode)}
        assert got == {"pod-a": (4, "gpu"), "pod-b": (2, "gpu"), "llmd-v08": (2, "cpu")}, mode
        got = {m.pod_id: m.blocks for m in await ix.lookup(chain, ["pod-b", "nope"], mode=mode)}
        assert got == {"pod-b": 2}
    assert await ix.lookup([999, 201]) == []  # the chain breaks at its first block


def test_longest_prefix_pure():
    a, b = "a@gpu", "b@gpu"
    assert {m.pod_id: m.blocks for m in longest_prefix([[a, b], [a], [a, b], []])} == {"a": 3, "b": 1}
    assert longest_prefix([[], [a]]) == []


async def test_duplicate_copies_of_one_hash_need_as_many_removals(ix):
    """vLLM 0.32 caches a recomputed last block as a second copy under the same hash (seen on a
    real engine: BlockStored of the same hash twice) and reports each copy's eviction."""
    await apply(ix, 0, [StoreBlock(11, "gpu", F0, (101, 102))])
    await apply(ix, 1, [StoreBlock(11, "gpu", F0, (101, 102))])  # the copy
    await apply(ix, 2, [RemoveBlock(11, "gpu")])  # one copy evicted: the engine still holds the hash
    assert await ix.client.hkeys("101") == [F0.encode()]
    exported = [b async for b in export_blocks(ix.writer, "pod-a")]
    assert len(exported) == 1
    await apply(ix, 3, [StoreBlock(11, "gpu", F0, (101, 102)), RemoveBlock(11, "gpu"), RemoveBlock(11, "gpu")])
    assert await ix.client.exists("101", "102", engine_key_name(11)) == 0
    assert (await ix.meta.pod_info("pod-a")).blocks == 0
    # Export carries the copies, so an import restores the same count.
    await apply(ix, 4, [StoreBlock(12, "gpu", F0, (103,)), StoreBlock(12, "gpu", F0, (103,))])
    assert len([b async for b in export_blocks(ix.writer, "pod-a")]) == 2


async def test_force_and_reset_never_apply_a_batch_at_or_below_the_persisted_seq(ix):
    """Two ingesters that both hit an unrecoverable gap both force the same batch; two that both
    saw a restart both reset. The second must not apply it again (seq back, copies doubled)."""
    await apply(ix, 0, [])
    b5 = [StoreBlock(11, "gpu", F0, (101,))]
    assert (await apply(ix, 5, b5, mode="force")).status == "applied"  # ingester X
    assert (await apply(ix, 6, [])).status == "applied"
    r = await apply(ix, 5, b5, mode="force")  # ingester Y, a moment later
    assert (r.status, r.last_seq) == ("dup", 6)
    assert (await ix.meta.pod_info("pod-a")).seqs == {"0": 6}
    assert (await held_blocks(ix.writer, "pod-a"))[(11, "gpu", 0)] == ((101,), 1)  # one copy, not two
    assert (await apply(ix, 7, [RemoveBlock(11, "gpu")])).status == "applied"
    assert await ix.lookup([101]) == []
    # A forced batch from a restarted engine (seq back, newer ts) is still a restart.
    assert (await apply(ix, 3, [], ts=9000.0, mode="force")).status == "restart"

    # Restart seen by both: X resets and applies seq 0 and 1 of the new engine; Y's reset of
    # seq 0 comes after and must neither clear X's work nor move the seq back.
    new = [StoreBlock(12, "gpu", F0, (102,))]
    assert (await apply(ix, 0, new, ts=10_000.0, mode="reset")).status == "applied"  # X
    assert (await apply(ix, 1, [StoreBlock(13, "gpu", F0, (103,))], ts=10_001.0)).status == "applied"
    assert (await apply(ix, 0, new, ts=10_000.0, mode="reset")).status == "dup"  # Y
    assert (await ix.meta.pod_info("pod-a")).seqs == {"0": 1}
    assert {m.pod_id: m.blocks for m in await ix.lookup([102, 103])} == {"pod-a": 2}
    assert (await held_blocks(ix.writer, "pod-a"))[(12, "gpu", 0)] == ((102,), 1)
    # Y's reset of a seq X has not reached yet applies it as the next batch, without clearing.
    assert (await apply(ix, 2, [], ts=10_002.0, mode="reset")).status == "applied"
    assert {m.pod_id: m.blocks for m in await ix.lookup([102, 103])} == {"pod-a": 2}
    assert (await ix.meta.pod_info("pod-a")).counters["restarts"] == 1


async def test_a_reader_never_names_pods_from_a_flushed_numbering(ix, valkey_url):
    """Pod numbers restart at 0 when the index is flushed under a running predictor: the lookup sees the
    numbering's new epoch and reads the names again, rather than name pod-b's bit after pod-a."""
    from kv_preflight.index.index import Index

    reader = Index.from_url(valkey_url)
    try:
        await apply(ix, 0, [StoreBlock(11, "gpu", F0, (101, 102))])
        assert [m.pod_id for m in await reader.lookup([101, 102])] == ["pod-a"]  # names now cached
        await ix.client.flushall()
        writer = Index.from_url(valkey_url)
        await apply(writer, 0, [StoreBlock(11, "gpu", FB, (101, 102))], pod="pod-b")  # number 0 again
        await writer.close()
        assert [(m.pod_id, m.blocks) for m in await reader.lookup([101, 102])] == [("pod-b", 2)]
    finally:
        await reader.close()


async def test_a_large_snapshot_is_chunked_and_read_back_whole(ix, valkey_url):
    """A pod's state snapshot past 8,186 bytes is written in chunks ("s", "s:1", ...) that fill the allocator's
    8 KB size class (as one value a 35 KB snapshot took a 40 KB class); a writer that loads the pod joins them
    back into the same state, and the next snapshot replaces every chunk (a shorter one leaves none behind)."""
    from kv_preflight.index.index import Index
    from kv_preflight.index.layout import pod_state_key
    from kv_preflight.index.pod_log import encode_snapshot

    def same(a, b) -> bool:  # the states, compared as what a snapshot of each holds
        return encode_snapshot(a.writer.pods["pod-a"].state, 1) == encode_snapshot(b.writer.pods["pod-a"].state, 1)

    n = 1500  # ~20 bytes a block in a snapshot: three chunks
    muts = [StoreBlock(10_000 + i, "gpu", F0, (500_000 + i,), parent=500_000 + i - 1 if i else None)
            for i in range(n)]
    await apply(ix, 0, muts)
    sync = redis.Redis.from_url(valkey_url)
    fields = sorted(f.decode() for f in sync.hkeys(pod_state_key("pod-a")))
    chunks = [f for f in fields if f == "s" or f.startswith("s:")]
    assert chunks == ["s", "s:1", "s:2"], fields
    assert all(len(sync.hget(pod_state_key("pod-a"), f)) == 8186 for f in ("s", "s:1"))
    fresh = Index.from_url(valkey_url)
    try:
        await fresh.writer.load(["pod-a"])
        assert len(fresh.writer.pods["pod-a"].state.blocks) == n and same(fresh, ix)
        # remove most blocks: the snapshot that follows is one chunk, and no stale chunk is left
        seq = 1
        for i in range(0, n - 10, 100):
            await apply(ix, seq, [RemoveBlock(10_000 + j, "gpu") for j in range(i, min(i + 100, n - 10))])
            seq += 1
        left = {f.decode() for f in sync.hkeys(pod_state_key("pod-a"))}
        assert "s:2" not in left, left
        again = Index.from_url(valkey_url)
        try:
            await again.writer.load(["pod-a"])
            assert len(again.writer.pods["pod-a"].state.blocks) == 10 and same(again, ix)
        finally:
            await again.close()
    finally:
        await fresh.close()
        sync.close()


@pytest.mark.parametrize("foreign_too", [False, True])
def test_a_shard_at_maxmemory_fails_its_effects_whole_never_as_a_foreign_key(valkey_url, foreign_too):
    """A cluster shard's share of a batch (effects.lua) on a node at maxmemory under noeviction: Valkey refuses its
    writes with OOM (before a script's first write only, so nothing was changed). Each refusal was counted as a
    write that hit "a key of a foreign type", so the caller flagged the pod incomplete and dropped the changes,
    though nothing foreign was there. Now the script fails with the OOM error itself: a transient error the
    writer retries (kv_preflight/ingester/valkey_retry.py), with the changes kept in the pod's outbox. A key of a
    foreign type (a LIST at a request key) in the same run is no reason to flag either while the node is full."""
    from redis.exceptions import OutOfMemoryError

    from kv_preflight.index.changes import shard_args
    from kv_preflight.index.pod_state import KeyChange
    from kv_preflight.index.scripts import EFFECTS
    from kv_preflight.ingester.valkey_retry import transient

    r = redis.Redis.from_url(valkey_url)
    if foreign_too:
        r.rpush("104", "x")
    ops = [KeyChange(rk, F0, 1, "0", 1) for rk in (101, 102, 103, 104)]
    args, _, _ = shard_args(ops, [(0, b"")] * len(ops))
    sha = r.script_load(EFFECTS)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)
    try:
        with pytest.raises(OutOfMemoryError) as failed:
            reply = r.evalsha(sha, 0, *args)
            print("the script answered", reply)
        assert transient(failed.value)
        assert not r.exists("101", presence_key(101))  # nothing was written
    finally:
        r.config_set("maxmemory", 0)
    reply = r.evalsha(sha, 0, *args)  # room again: the same changes run, the foreign key alone refused
    assert int(reply[1]) == (1 if foreign_too else 0)
    assert r.hkeys("101") == [F0.encode()] and r.exists(presence_key(101))
    r.close()


def test_a_shard_whose_cluster_is_down_fails_its_effects_whole_never_as_a_foreign_key(tmp_path):
    """A cluster shard's share of a batch (effects.lua) on a node that sees its cluster down (a master restarted and
    not yet back in the cluster: seen under load in the two-ingester outage test, test_cluster.py): Valkey refuses
    every command of the script that names a key ("ERR Script attempted to execute a command while the cluster is
    down"). Each refusal was counted as a write that hit "a key of a foreign type": the pod flagged with that
    reason, its changes dropped (a removal dropped leaves an entry its state no longer lists, which no clearing
    finds). Now the script fails as CLUSTERDOWN, a transient error the writer retries with the changes kept in the
    pod's outbox; and once the cluster is up, the same changes run."""
    from redis.exceptions import ClusterDownError

    from kv_preflight.cli.valkey_server import ValkeyServer
    from kv_preflight.index.changes import shard_args
    from kv_preflight.index.pod_state import KeyChange
    from kv_preflight.index.scripts import EFFECTS
    from kv_preflight.ingester.valkey_retry import transient

    # one node serving every slot but the last, and asking for full coverage: its cluster is down
    node = ValkeyServer(tmp_path, appendonly=False,
                        extra_args=("--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf"),
                                    "--cluster-require-full-coverage", "yes")).start()
    r = redis.Redis(port=node.port)

    def state() -> str:
        return r.execute_command("CLUSTER", "INFO").decode().splitlines()[0].partition(":")[2]
    try:
        r.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16382)
        assert state() == "fail"
        ops = [KeyChange(rk, F0, 1, "0", 1) for rk in (101, 102, 103)]
        args, _, _ = shard_args(ops, [(0, b"")] * len(ops))
        sha = r.script_load(EFFECTS)
        with pytest.raises(ClusterDownError) as failed:
            reply = r.evalsha(sha, 0, *args)
            print("the script answered", reply)
        assert transient(failed.value)
        r.execute_command("CLUSTER", "ADDSLOTS", 16383)
        deadline = time.monotonic() + 10
        while state() != "ok":
            assert time.monotonic() < deadline, "the one-node cluster did not come up"
            time.sleep(0.05)
        reply = r.evalsha(sha, 0, *args)  # the cluster up: the same changes run, none refused
        assert int(reply[1]) == 0
        assert r.hkeys("101") == [F0.encode()] and r.exists(presence_key(101))
    finally:
        r.close()
        node.stop()
