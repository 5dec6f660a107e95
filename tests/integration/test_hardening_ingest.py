"""Hardening findings of the write path, each reproduced with real processes (a real
``kv-preflight ingest``, real ZMQ, real Valkey): resume before any frame, forged seqs, keys of a
foreign type, and the two ways one request key is backed twice (copies, cache_salt)."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.events import BlockRemoved, BlockStored, EventBatch, encode_frames
from kv_preflight.index.index import Index, RemoveBlock, StoreBlock, encode_entry, make_entry
from kv_preflight.index.layout import pod_meta_key, pod_state_key, presence_key
from kv_preflight.index.transfer import held_blocks
from tests.e2e.harness import spawn, stop
from tests.integration.engine_stub import EngineStub
from tests.integration.test_faults import Workload, assert_exact, publish, wait_for_seq
from tests.integration.truth import engine_truth, index_state

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

F0 = encode_entry(make_entry("pod-a", "GPU", 0))


def stub(topic: str = "kv@pod-f@tiny", **kw) -> tuple[EngineStub, str]:
    zport, rport = free_port(), free_port()
    engine = EngineStub(f"tcp://127.0.0.1:{zport}", f"tcp://127.0.0.1:{rport}", topic, bind=True, **kw)
    return engine, f"tcp://127.0.0.1:{zport},replay=tcp://127.0.0.1:{rport}"


@pytest.mark.parametrize("replay_topic", [True, False], ids=["vllm-replay", "replay-without-topic"])
async def test_restarted_ingester_resumes_before_the_engine_publishes(valkey_url, tmp_path, replay_topic):
    """With --source (no topic known before the first frame) a restarted ingester must not wait for the
    engine to publish again: the pod a replay socket serves is persisted, so the restart catches up at
    start, also when replies carry no topic (SGLang)."""
    engine, source = stub(replay_topic=replay_topic)
    wl = Workload(11)
    ix = Index.from_url(valkey_url)
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--source", source], str(tmp_path / "ing1.log"))
    try:
        await engine.subscribed()
        await publish(engine, wl, 30)
        await wait_for_seq(ix, "pod-f", engine.seq - 1)
        stop(ing, kill=True)
        await publish(engine, wl, 25)  # nobody listening; the engine then goes quiet
        ing = spawn(["ingest", "--valkey-url", valkey_url, "--source", source], str(tmp_path / "ing2.log"))
        # No frame is published from here on: only the resume at start can close the gap.
        await wait_for_seq(ix, "pod-f", engine.seq - 1, timeout=10.0)
        assert await index_state(ix, "pod-f") == engine_truth(wl.batches)
        assert not (await ix.meta.pod_info("pod-f")).incomplete
    finally:
        stop(ing)
        engine.close()
        await ix.close()


async def test_forged_seqs_are_refused_counted_and_never_fatal(valkey_url, tmp_path):
    """Seq 2^63-1 overflows Lua's doubles (the apply would recurse without bound, and the process die
    again after each restart), so seqs are compared exactly; one more than 2^32 past the persisted seq
    is corrupt: refused, counted, the pod flagged, and the next real batch applies as the next seq (no
    "restart" that would clear the pod)."""
    engine, source = stub()
    wl = Workload(12)
    ix = Index.from_url(valkey_url)
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--source", source], str(tmp_path / "ing.log"))
    try:
        await engine.subscribed()
        await publish(engine, wl, 10)
        await wait_for_seq(ix, "pod-f", engine.seq - 1)
        forged = wl.next_batch()
        wl.batches.pop()  # never applied: not part of the truth
        for seq in (2**63 - 1, 2**62, 2**32 + 10_000, -5):
            engine.send_raw(encode_frames("kv@pod-f@tiny", seq, forged))
        await asyncio.sleep(0.5)
        await publish(engine, wl, 10)
        await wait_for_seq(ix, "pod-f", engine.seq - 1)
        assert ing.poll() is None, "the ingester died"
        assert await index_state(ix, "pod-f") == engine_truth(wl.batches)
        info = await ix.meta.pod_info("pod-f")
        assert info.counters.get("restarts", 0) == 0
        assert info.seqs == {"0": engine.seq - 1}
        assert info.incomplete and "refused" in info.incomplete_reason
        assert (await ix.meta.counters()).get("corrupt_batches", 0) >= 3
        assert "not applied" in (tmp_path / "ing.log").read_text()
    finally:
        stop(ing)
        engine.close()
        await ix.close()


async def test_foreign_typed_keys_never_stall_or_double_count(valkey_url, tmp_path):
    """A LIST at engine:<key> must not fail the batch script after partial writes (each retry would count
    copies again, every other pod would stall, and after eviction the pod would stay listed): the write to
    the foreign key stands alone (pod flagged, counted); the block is still indexed (its request keys are in
    the pod's own state, so its eviction needs nothing from engine:<key>), the seq moves on, other pods go
    on, and nothing is counted twice."""
    a, src_a = stub("kv@pod-a@tiny")
    b, src_b = stub("kv@pod-b@tiny")
    sync = redis.Redis.from_url(valkey_url)
    ix = Index.from_url(valkey_url)
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--source", src_a, "--source", src_b], str(tmp_path / "ing.log"))
    rng = random.Random(5)
    toks = [rng.randrange(1, 30000) for _ in range(64)]
    try:
        await a.subscribed()
        await b.subscribed()
        sync.rpush("engine:123", "x")  # somebody else's LIST where our engine key goes
        sync.set("engine:456", "y")
        a.publish(EventBatch(time.time(), [BlockStored([123], None, toks[:32], 32, medium="GPU")], 0))
        a.publish(EventBatch(time.time(), [BlockStored([789], None, toks[32:], 32, medium="GPU")], 0))
        for k in range(5):
            b.publish(EventBatch(time.time(), [BlockStored([1000 + k], None, toks[:32], 32, medium="GPU")], 0))
        await wait_for_seq(ix, "pod-a", 1)
        await wait_for_seq(ix, "pod-b", 4)
        held = await held_blocks(ix.writer, "pod-a")
        assert set(held) == {(123, "gpu", 0), (789, "gpu", 0)} and all(c == 1 for _, c in held.values())
        assert sync.lrange("engine:123", 0, -1) == [b"x"]  # untouched
        info = await ix.meta.pod_info("pod-a")
        assert info.incomplete and "foreign" in info.incomplete_reason and "engine:123" in info.incomplete_reason
        assert info.counters.get("foreign_keys", 0) == 1
        # the index-wide counter is the ingester's, written after the batch (the pod's is in the batch's script)
        deadline = time.monotonic() + 10
        while (await ix.meta.counters()).get("foreign_keys", 0) < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert (await ix.meta.counters()).get("foreign_keys", 0) == 1
        assert info.counters["batches"] == 2 and info.counters["stored"] == 2
        # Both evicted: their entries go, the foreign key stays as it was.
        a.publish(EventBatch(time.time(), [BlockRemoved([123, 789], medium="GPU")], 0))
        await wait_for_seq(ix, "pod-a", 2)
        assert await held_blocks(ix.writer, "pod-a") == {}
        assert not sync.exists("engine:789") and sync.lrange("engine:123", 0, -1) == [b"x"]
        assert ing.poll() is None
    finally:
        stop(ing)
        a.close()
        b.close()
        sync.close()
        await ix.close()


@pytest.mark.parametrize("topology", ["single", "cluster"])
async def test_foreign_typed_keys_inside_a_run_of_blocks_stand_alone(topology, valkey_url, cluster_url):
    """A batch's blocks go as runs (changes.lua's S and R; a cluster shard's s and r), each command checked
    only when its reply is not the usual 0 or 1: a LIST at one request key, a STRING where another's presence
    hash goes and one where its engine key goes fail those commands alone, counted, the blocks beside them
    written and let go as usual, the same on a single node and on a cluster. The request keys share one slot
    (CRC16 6480), so on a cluster too they are one shard's run, whatever the slot map."""
    url = valkey_url if topology == "single" else cluster_url
    sync = (redis.Redis if topology == "single" else redis.RedisCluster).from_url(url)
    ix = Index.from_url(url)
    rks = (3660, 6112, 9885, 10840)
    try:
        sync.rpush("6112", "foreign")
        sync.set(presence_key(9885), "foreign")
        sync.set("engine:13", "foreign")
        r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=0, ts=1.0, model="m", engine_block_size=32,
                                 mutations=[StoreBlock(11 + k, "gpu", F0, (rk,)) for k, rk in enumerate(rks)])
        assert r.status == "applied"
        assert sync.lrange("6112", 0, -1) == [b"foreign"] and sync.get(presence_key(9885)) == b"foreign"
        assert not sync.exists(presence_key(6112))  # no entry written, so no bit either
        for rk in (3660, 9885, 10840):  # the entries beside them, 9885's without its bit
            assert sync.hkeys(str(rk)) == [F0.encode()], rk
        assert sync.exists(presence_key(3660)) and sync.exists(presence_key(10840))
        assert sync.zrange("engine:14", 0, -1) == [b"10840"] and sync.get("engine:13") == b"foreign"
        info = await ix.meta.pod_info("pod-a")
        # HSET at 6112, HSETNX at 9885's presence key, ZADD at engine:13
        assert info.counters.get("foreign_keys") == 3 and info.incomplete and "6112" in info.incomplete_reason
        r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=1, ts=2.0, model="m", engine_block_size=32,
                                 mutations=[RemoveBlock(11 + k, "gpu") for k in range(4)])
        assert r.status == "applied"
        for rk, ek in ((3660, 11), (10840, 14)):  # gone whole: entry, presence hash, engine key
            assert not sync.exists(str(rk)) and not sync.exists(presence_key(rk)) and not sync.exists(f"engine:{ek}")
        # 9885's entry and presence key (the STRING: our key name) go; its engine key's ZREM fails, counted
        assert not sync.exists("9885") and not sync.exists(presence_key(9885)) and sync.get("engine:13") == b"foreign"
        # 6112 still holds someone's LIST, so llm-d's rule keeps its engine key: HDEL and HLEN failed, counted
        assert sync.lrange("6112", 0, -1) == [b"foreign"] and sync.zrange("engine:12", 0, -1) == [b"6112"]
        assert (await ix.meta.pod_info("pod-a")).counters.get("foreign_keys") == 6
    finally:
        sync.close()
        await ix.close()


async def test_foreign_request_key_is_a_counted_miss_on_read(ix):
    """Read path: a foreign-typed request key is a miss, not "valkey unavailable"."""
    await ix.apply_batch(pod_id="pod-a", rank=0, seq=0, ts=1.0, model="m", engine_block_size=32,
                         mutations=[StoreBlock(11, "gpu", F0, (101, 102)), StoreBlock(12, "gpu", F0, (103,))])
    await ix.client.delete("102")
    await ix.client.rpush("102", "foreign")
    for mode in ("script", "linear", "pipeline"):
        before = ix.foreign_reads
        matches = await ix.lookup([101, 102, 103], mode=mode)
        assert [(m.pod_id, m.blocks) for m in matches] == [("pod-a", 1)], mode
        assert ix.foreign_reads == before + 1, mode


async def test_foreign_pod_key_refuses_the_batch_before_any_write(ix):
    await ix.client.rpush(pod_state_key("pod-a"), "x")
    r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=0, ts=1.0, model="m", engine_block_size=32,
                             mutations=[StoreBlock(11, "gpu", F0, (101,))])
    assert r.status == "corrupt" and pod_state_key("pod-a") in r.detail
    assert not await ix.client.exists("101") and not await ix.client.exists("engine:11")


async def test_non_integer_seq_in_state_flags_the_pod(ix):
    """A non-integer seq in a pod's state is corrupt state, the pod flagged, not a 500."""
    await ix.apply_batch(pod_id="pod-a", rank=0, seq=0, ts=1.0, model="m", engine_block_size=32,
                         mutations=[StoreBlock(11, "gpu", F0, (101,))])
    await ix.client.hset(pod_meta_key("pod-a"), "seq:0", "not-a-number")
    info = await ix.meta.pod_info("pod-a")
    assert info.incomplete and "seq:0" in info.incomplete_reason
    # The script treats it as unknown: the next batch is a gap from the start, never a crash.
    r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=1, ts=2.0, model="m", engine_block_size=32, mutations=[])
    assert r.status == "gap" and r.last_seq == -1
    r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=1, ts=2.0, model="m", engine_block_size=32, mutations=[],
                             mode="force")
    assert r.status == "applied" and (await ix.meta.pod_info("pod-a")).seqs == {"0": 1}


async def test_seqs_compare_exactly_past_2_pow_53(ix):
    """Doubles cannot tell 2^53 from 2^53+1; the script compares decimal strings."""
    big = 2**53
    await ix.client.hset(pod_meta_key("pod-a"), mapping={"seq:0": str(big), "ts:0": "1.0"})
    r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=big + 1, ts=1.0, model="m", engine_block_size=32, mutations=[])
    assert r.status == "applied" and r.last_seq == big
    r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=big + 1, ts=1.0, model="m", engine_block_size=32, mutations=[])
    assert r.status == "dup" and r.last_seq == big + 1
    assert (await ix.meta.pod_info("pod-a")).seqs == {"0": big + 1}


async def test_a_parentless_run_of_held_blocks_is_a_second_copy_by_default(ix):
    """With vLLM's default kv_cache_report_mode ("incremental") nothing is re-announced: a parentless run from
    a prompt's start that the pod already holds is a second physical copy (concurrent requests that computed
    one prefix at once each cache it from block 0), and each copy's eviction comes in turn. Read as a
    re-announcement, the first eviction dropped blocks vLLM still held (a hybrid model under concurrent
    clients under-predicted: tests/e2e/test_vllm_hybrid.py)."""
    async def apply(seq, muts):
        return await ix.apply_batch(pod_id="pod-a", rank=0, seq=seq, ts=1.0, model="m", engine_block_size=32,
                                    mutations=muts)
    first = [StoreBlock(11, "gpu", F0, (101,), parentless=True), StoreBlock(12, "gpu", F0, (102,), parentless=True)]
    await apply(0, first)
    await apply(1, first)  # the same prefix computed again at once: a second copy of each block
    held = await held_blocks(ix.writer, "pod-a")
    assert held[(11, "gpu", 0)] == ((101,), 2) and held[(12, "gpu", 0)] == ((102,), 2)
    await apply(2, [RemoveBlock(11, "gpu"), RemoveBlock(12, "gpu")])  # one copy of each evicted
    assert await ix.client.hkeys("101") == [F0.encode()] and await ix.client.hkeys("102") == [F0.encode()]


async def test_reannounced_block_is_not_a_second_copy(valkey_url):
    """vLLM re-sends BlockStored, parentless, for reused blocks under
    kv_cache_report_mode "full" (ingest --kv-cache-report-mode full); a real second copy (recomputed last
    block) has a parent."""
    ix = Index.from_url(valkey_url, reannouncements=True)
    try:
        await ix.client.flushdb()

        async def apply(seq, muts):
            return await ix.apply_batch(pod_id="pod-a", rank=0, seq=seq, ts=1.0, model="m", engine_block_size=32,
                                        mutations=muts)
        first = [StoreBlock(11, "gpu", F0, (101,), parentless=True), StoreBlock(12, "gpu", F0, (102,), parentless=True)]
        await apply(0, first)
        await apply(1, first)  # the re-announcement: no copy counted
        await apply(2, [StoreBlock(12, "gpu", F0, (102,))])  # a real copy of block 12 (it has a parent)
        held = await held_blocks(ix.writer, "pod-a")
        assert held[(11, "gpu", 0)] == ((101,), 1) and held[(12, "gpu", 0)] == ((102,), 2)
        assert (await ix.meta.pod_info("pod-a")).counters["reannounced"] == 2
        await apply(3, [RemoveBlock(11, "gpu"), RemoveBlock(12, "gpu")])  # one eviction each
        assert not await ix.client.exists("101")  # the only copy went
        assert await ix.client.hkeys("102") == [F0.encode()]  # one copy of 12 is left
    finally:
        await ix.close()


async def test_cache_salt_two_engine_keys_one_request_key(ix):
    """A salted and an unsalted prompt give two engine keys and the same request keys;
    evicting one must not drop the entry the other still backs."""
    async def apply(seq, muts):
        await ix.apply_batch(pod_id="pod-a", rank=0, seq=seq, ts=1.0, model="m", engine_block_size=32, mutations=muts)
    await apply(0, [StoreBlock(11, "gpu", F0, (101, 102), parentless=True)])
    await apply(1, [StoreBlock(91, "gpu", F0, (101, 102), parentless=True)])  # same tokens, salted hash
    await apply(2, [RemoveBlock(11, "gpu")])
    assert [m.blocks for m in await ix.lookup([101, 102], mode="linear")] == [2]
    await apply(3, [RemoveBlock(91, "gpu")])
    assert await ix.lookup([101, 102], mode="linear") == []
    assert not await ix.client.exists("engine:11", "engine:91", "101", "102")
    assert await held_blocks(ix.writer, "pod-a") == {}
