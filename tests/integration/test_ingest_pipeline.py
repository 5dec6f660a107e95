"""Pipelined application of many queued messages equals applying them one by one."""
from __future__ import annotations

import pytest
import redis

from kv_preflight.ingester.ingester import Ingester
from kv_preflight.ingester.sources import Source
from kv_preflight.config import Config
from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_frames, make_topic
from kv_preflight.index.index import Index, RemoveBlock, StoreBlock, encode_entry, make_entry
from kv_preflight.index.entries import CHAIN_ROOT
from kv_preflight.keys.chain import request_keys
from kv_preflight.index.layout import engine_key_name, pod_state_keys
from kv_preflight.index.transfer import export_blocks, held_blocks

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

SRC = Source("tcp://test", bind=False, replay=None)


def stored(hashes, parent, first_token, size=32):
    toks = list(range(first_token, first_token + size * len(hashes)))
    return BlockStored(hashes, parent, toks, size, medium="GPU", group_idx=0, extra_keys=[None] * len(hashes))


def stream(pod: str, seqs, *, ts0: float = 1000.0, base: int = 0, size: int = 32):
    """Batches of one pod: chained stores, some removals, a clear; one message per seq. ``size``: the engine's
    block size (not a multiple of the request blocks' 16: blocks end mid key, their carries key the next)."""
    out = []
    prev = None
    for n, seq in enumerate(seqs):
        h = base + 100 + 10 * n
        events = [stored([h, h + 1], prev, 5000 + 2 * size * n + base, size)]
        if n % 3 == 2:
            events.append(BlockRemoved([h - 20, h - 19], medium="GPU"))
        if n == 7:
            events.append(AllBlocksCleared())
        prev = h + 1
        out.append(encode_frames(make_topic(pod, "m"), seq, EventBatch(ts0 + seq, events, 0)))
    return out


def snapshot(url: str) -> dict:
    r = redis.Redis.from_url(url, decode_responses=True, encoding_errors="backslashreplace")  # bitmaps are bytes
    out = {}
    for k in r.scan_iter():
        t = r.type(k)
        if t == "hash":
            v = r.hgetall(k)
            if k.startswith("kvpf:{") and k.endswith("}:meta"):
                v = {f: x for f, x in v.items() if f not in ("last_event_time",)}
                if "gen" in v:  # "<batches applied>:<writer>": two processes wrote these, one each
                    v["gen"] = v["gen"].split(":", 1)[0]
            if k == "kvpf:{nums}:next":
                v = {f: x for f, x in v.items() if f != "epoch"}  # when the numbering began
            out[k] = v
        else:
            out[k] = r.zrange(k, 0, -1, withscores=True)
    return out


async def ingest(url: str, messages, *, pipelined: bool):
    ing = Ingester(Config(valkey_url=url), Index.from_url(url), [])
    if pipelined:
        await ing.handle_messages([(SRC, m) for m in messages])
    else:
        for m in messages:
            await ing.handle_messages([(SRC, m)])
    await ing.index.close()
    return ing.counters.counts


@pytest.mark.parametrize("size", [32, 24, 8])
@pytest.mark.parametrize("case", ["clean", "gap", "restart", "dup"])
async def test_pipelined_equals_one_by_one(valkey_url, case, size, monkeypatch):
    import kv_preflight.ingester.pipeline as pipeline

    monkeypatch.setattr(pipeline, "PIPELINE_BATCHES", 4)  # several runs in flight
    a = stream("pod-a", range(12), size=size)
    b = stream("pod-b", range(12), base=7, size=size)
    msgs = [m for pair in zip(a, b) for m in pair]
    if case == "gap":
        msgs = [m for m in msgs if m is not a[5]]  # pod-a's seq 5 never arrives (no replay socket)
    if case == "restart":  # pod-a's engine restarts after seq 8: seq from 0 again, newer ts
        msgs += stream("pod-a", range(4), ts0=9000.0, base=50, size=size)
    if case == "dup":
        msgs += msgs[:9]  # another copy of the first messages (a second ingester got there first)
    url0, url1 = valkey_url, valkey_url.rsplit("/", 1)[0] + "/1"
    redis.Redis.from_url(url1).flushdb()
    one = await ingest(url0, msgs, pipelined=False)
    many = await ingest(url1, msgs, pipelined=True)
    assert snapshot(url0) == snapshot(url1)
    assert one == many
    if case == "gap":
        assert many["gaps_unrecovered"] == 1
    if case == "restart":
        assert many["engine_restarts"] == 1
    if case == "dup":
        assert many["duplicates_skipped"] == 9


async def test_pod_state_keeps_each_block_and_its_request_keys(valkey_url):
    ix = Index.from_url(valkey_url)
    f_gpu = encode_entry(make_entry("pod-a", "GPU", 0))
    f_cpu = encode_entry(make_entry("pod-a", "CPU", 0))

    async def apply(seq, muts):
        return await ix.apply_batch(pod_id="pod-a", rank=0, seq=seq, ts=1.0 + seq, model="m", engine_block_size=32,
                                    mutations=muts)

    await apply(0, [StoreBlock(11, "gpu", f_gpu, (101, 102)), StoreBlock(11, "cpu", f_cpu, (101, 102)),
                    StoreBlock(12, "gpu", f_gpu, (103,))])
    r = redis.Redis.from_url(valkey_url, decode_responses=True)
    assert await held_blocks(ix.writer, "pod-a") == {(11, "gpu", 0): ((101, 102), 1), (11, "cpu", 0): ((101, 102), 1),
                                             (12, "gpu", 0): ((103,), 1)}
    assert sorted(r.hkeys("101")) == sorted([f_gpu, f_cpu])
    await apply(1, [RemoveBlock(11, "cpu")])
    assert r.hkeys("101") == [f_gpu] and r.zrange("engine:11", 0, -1) == ["101", "102"]
    exported = sorted([s async for s in export_blocks(ix.writer, "pod-a")], key=lambda s: s.engine_key)
    assert exported == [StoreBlock(11, "gpu", f_gpu, (101, 102)), StoreBlock(12, "gpu", f_gpu, (103,))]
    assert await ix.clear_pod("pod-a", forget=True) == 2
    assert not r.exists("101", "103", "engine:11", "engine:12", *pod_state_keys("pod-a"))
    await ix.close()


async def test_hybrid_model_groups_store_and_evict_one_hash_each(valkey_url):
    """vLLM 0.32 emits BlockStored/BlockRemoved per KV-cache group of a hybrid model (full and
    sliding-window attention), the same block hash in each, told apart by group_idx. Evicting the
    hash from every group must leave nothing behind, and a group's eviction leaves the other."""
    ing = Ingester(Config(valkey_url=valkey_url), Index.from_url(valkey_url), [])
    toks = list(range(7000, 7032))

    def s(g):
        return BlockStored([41], None, toks, 32, medium="GPU", group_idx=g, extra_keys=[None])

    msgs = [encode_frames(make_topic("pod-h", "m"), seq, EventBatch(1000.0 + seq, events, 0)) for seq, events in enumerate([
        [s(0), s(1)],
        [BlockRemoved([41], medium="GPU", group_idx=1)],  # the sliding-window group lets it go
        [BlockRemoved([41], medium="GPU", group_idx=0)],
    ])]
    keys = request_keys(toks, model="m")
    await ing.handle_messages([(SRC, msgs[0])])
    f0, f1 = encode_entry(make_entry("pod-h", "GPU", 0)), encode_entry(make_entry("pod-h", "GPU", 1))
    exported = sorted([b async for b in export_blocks(ing.index.writer, "pod-h")], key=lambda b: b.group)
    # (the parent of each block's first key comes back too: a chain's first block starts at the root)
    assert exported == [StoreBlock(41, "gpu", f0, tuple(keys), 0, parent=CHAIN_ROOT),
                        StoreBlock(41, "gpu", f1, tuple(keys), 1, parent=CHAIN_ROOT)]
    await ing.handle_messages([(SRC, msgs[1])])
    r = redis.Redis.from_url(valkey_url, decode_responses=True)
    assert r.hkeys(str(keys[0])) == [f0]  # group 0 still holds it
    exported = [b async for b in export_blocks(ing.index.writer, "pod-h")]
    assert [(b.engine_key, b.tier, b.entry_field) for b in exported] == [(41, "gpu", f0)]
    await ing.handle_messages([(SRC, msgs[2])])
    assert await ing.index.lookup(keys) == []
    assert not r.exists(*[str(k) for k in keys], "engine:41")
    assert (await ing.index.meta.pod_info("pod-h")).blocks == 0
    await ing.index.close()


async def test_parent_resolved_from_valkey_is_the_pods_own_model_chain(valkey_url):
    """Engines of two models with the same hash seed (llm-d sets PYTHONHASHSEED fleet-wide) give
    the same engine key to the same tokens (vLLM's hash has no model in it), so engine:<key>
    holds both models' request keys. An ingester that did not see the parent (restarted, LRU)
    must chain pod-a's child from model-a's key, not from whichever member sorts last."""
    t0, t1 = list(range(2000, 2032)), list(range(2032, 2064))

    def msg(pod, model, seq, ev):
        return encode_frames(make_topic(pod, model), seq, EventBatch(1000.0 + seq, [ev], 0))

    first = Ingester(Config(valkey_url=valkey_url), Index.from_url(valkey_url), [])
    await first.handle_messages([(SRC, msg("pod-a", "model-a", 0, BlockStored([41], None, t0, 32, medium="GPU", group_idx=0)))])
    await first.handle_messages([(SRC, msg("pod-b", "model-b", 0, BlockStored([41], None, t0, 32, medium="GPU", group_idx=0)))])
    await first.index.close()
    cold = Ingester(Config(valkey_url=valkey_url), Index.from_url(valkey_url), [])
    await cold.handle_messages([(SRC, msg("pod-a", "model-a", 1, BlockStored([42], 41, t1, 32, medium="GPU", group_idx=0)))])
    await cold.handle_messages([(SRC, msg("pod-b", "model-b", 1, BlockStored([42], 41, t1, 32, medium="GPU", group_idx=0)))])
    got_a = {m.pod_id: m.blocks for m in await cold.index.lookup(request_keys(t0 + t1, model="model-a"))}
    got_b = {m.pod_id: m.blocks for m in await cold.index.lookup(request_keys(t0 + t1, model="model-b"))}
    assert (got_a, got_b) == ({"pod-a": 4}, {"pod-b": 4})
    assert not (await cold.index.meta.pod_info("pod-a")).incomplete
    await cold.index.close()


async def test_parent_the_pod_holds_is_found_in_its_own_state(valkey_url):
    """Another pod's engine restart empties the ingester's chain state (content-addressed, shared by every
    pod). A child whose parent its own pod holds is then chained from the pod's state (the writer's), with
    no read of Valkey's engine map: here ``engine:<parent>`` is gone, so that read would have found nothing
    and the child would have been an orphan (its pod flagged incomplete)."""
    t0, t1 = list(range(3000, 3032)), list(range(3032, 3064))

    def msg(pod, seq, ts, ev):
        return encode_frames(make_topic(pod, "m"), seq, EventBatch(ts, [ev], 0))

    ing = Ingester(Config(valkey_url=valkey_url), Index.from_url(valkey_url), [])
    await ing.handle_messages([(SRC, msg("pod-a", 0, 1000.0, BlockStored([51], None, t0, 32, medium="GPU", group_idx=0)))])
    for seq in (0, 1):
        await ing.handle_messages([(SRC, msg("pod-b", seq, 1000.0 + seq, BlockStored([61 + seq], None, t0, 32,
                                                                                       medium="GPU", group_idx=0)))])
    await ing.handle_messages([(SRC, msg("pod-b", 0, 2000.0, BlockStored([71], None, t1, 32, medium="GPU", group_idx=0)))])
    assert ing.counters.counts["engine_restarts"] == 1 and len(ing.applier.state) == 1  # pod-b's new block only
    assert redis.Redis.from_url(valkey_url).delete(engine_key_name(51)) == 1
    await ing.handle_messages([(SRC, msg("pod-a", 1, 1001.0, BlockStored([52], 51, t1, 32, medium="GPU", group_idx=0)))])
    got = {m.pod_id: m.blocks for m in await ing.index.lookup(request_keys(t0 + t1, model="m"))}
    assert got == {"pod-a": 4}
    assert not (await ing.index.meta.pod_info("pod-a")).incomplete
    assert ing.counters.counts.get("orphan_blocks", 0) == 0
    await ing.index.close()


async def test_a_lost_reply_does_not_lose_the_incomplete_flag(valkey_url):
    """Valkey ran the run (a batch with an orphan among it) but the replies never came back: the
    run is sent again and answers dup. The pod must still be flagged, so the flag is written by
    the same script that applies the batch, not by a call after its reply."""
    import asyncio

    ing = Ingester(Config(valkey_url=valkey_url), Index.from_url(valkey_url), [])
    toks = list(range(100, 164))
    msgs = [encode_frames(make_topic("pod-a", "m"), 0, EventBatch(1.0, [stored([1], None, 100)], 0)),
            encode_frames(make_topic("pod-a", "m"), 1, EventBatch(2.0, [BlockStored([3], 999, toks, 32)], 0))]
    await ing.index.client.script_load(ing.index.backend._apply.script)
    real, dropped = ing.index.send_batches, []

    async def send_then_lose_the_replies(batches):
        sent = await real(batches)
        if not dropped:
            dropped.append(True)
            proto = ing.index.backend.fast._proto
            proto.data_received = lambda data: None  # replies lost on the way back
            while (await observer.meta.pod_info("pod-a")).seqs.get("0") != 1:
                await asyncio.sleep(0.01)  # Valkey has run both scripts
            proto.transport.close()
        return sent

    # Watched on a connection of its own: the ingester's lean one is the one made to lose its replies (its
    # metadata reads go over it too).
    observer = Index.from_url(valkey_url)
    ing.index.send_batches = send_then_lose_the_replies
    await ing.handle_messages([(SRC, m) for m in msgs])
    await observer.close()
    assert ing.counters.counts["duplicates_skipped"] == 2
    info = await ing.index.meta.pod_info("pod-a")
    assert info.incomplete and "unknown parent" in info.incomplete_reason
    await ing.index.close()


# ---- where a parent is found without a chain state kept for the process: the run's, the pod's state, Valkey

def one(pod, seq, ts, *events):
    return encode_frames(make_topic(pod, "m"), seq, EventBatch(ts, list(events), 0))


async def flagged(ing, pod) -> bool:
    return (await ing.index.meta.pod_info(pod)).incomplete


async def test_a_carry_is_kept_in_the_pods_state_across_runs_and_a_reload(valkey_url):
    """Engine blocks of 24 tokens, request blocks of 16: a block ends mid key, and its child's first key needs the
    leftover tokens, which neither the pod's log nor Valkey holds. Each block comes in a run of its own, and a
    duplicate between them makes the writer load the pod again from its log: the carry stays with the pod's
    state, and the chain is keyed whole."""
    toks = list(range(7000, 7072))
    ing = Ingester(Config(valkey_url=valkey_url), Index.from_url(valkey_url), [])
    await ing.handle_messages([(SRC, one("pod-a", 0, 1000.0, BlockStored([1], None, toks[:24], 24, medium="GPU", group_idx=0)))])
    await ing.handle_messages([(SRC, one("pod-a", 1, 1001.0, BlockStored([2], 1, toks[24:48], 24, medium="GPU", group_idx=0)))])
    await ing.handle_messages([(SRC, one("pod-a", 1, 1001.0, BlockStored([2], 1, toks[24:48], 24, medium="GPU", group_idx=0)))])
    assert ing.counters.counts["duplicates_skipped"] == 1 and "pod-a" not in ing.index.writer.pods  # loaded again next
    await ing.handle_messages([(SRC, one("pod-a", 2, 1002.0, BlockStored([3], 2, toks[48:72], 24, medium="GPU", group_idx=0)))])
    got = {m.pod_id: m.blocks for m in await ing.index.lookup(request_keys(toks, model="m"))}
    assert got == {"pod-a": 4}
    assert ing.counters.counts.get("orphan_blocks", 0) == 0 and not await flagged(ing, "pod-a")
    await ing.index.close()


async def test_a_restarted_engines_batch_takes_no_parent_from_the_old_processes_blocks(valkey_url):
    """A batch applied as a reset (the engine restarted: the pod is cleared before it applies) names a parent only
    the old process stored: the pod's state still holds it when the batch is planned, but it is not this
    engine's block. The child is an orphan (the pod flagged), not chained from the old process's keys."""
    t0, t1 = list(range(3000, 3032)), list(range(3032, 3064))
    ing = Ingester(Config(valkey_url=valkey_url), Index.from_url(valkey_url), [])
    await ing.handle_messages([(SRC, one("pod-a", 0, 1000.0, BlockStored([51], None, t0, 32, medium="GPU", group_idx=0)))])
    await ing.handle_messages([(SRC, one("pod-a", 1, 1001.0, BlockStored([52], None, t1, 32, medium="GPU", group_idx=0)))])
    assert redis.Redis.from_url(valkey_url).delete(engine_key_name(51)) == 1  # only the pod's state could answer
    await ing.handle_messages([(SRC, one("pod-a", 0, 2000.0, BlockStored([53], 51, t1, 32, medium="GPU", group_idx=0)))])
    assert ing.counters.counts["engine_restarts"] == 1
    assert ing.counters.counts["orphan_blocks"] == 1 and await flagged(ing, "pod-a")
    assert await ing.index.lookup(request_keys(t0 + t1, model="m")) == []
    await ing.index.close()


@pytest.mark.parametrize("together", [False, True])
async def test_a_parent_evicted_from_every_tier_before_its_child_leaves_the_child_an_orphan(valkey_url, together):
    """vLLM holds a request's blocks while it runs, so a block's parent is not evicted before the block is stored;
    a BlockStored whose parent the pod let go of in an earlier batch means events the index never saw. The
    child is not keyed from a memory of the parent (the pod's state no longer holds it, nor does Valkey): an
    orphan, the pod flagged. The same when the three batches come together (pipelined: the child waits for the
    eviction to apply, then is planned as alone)."""
    toks = list(range(4000, 4096))
    ing = Ingester(Config(valkey_url=valkey_url), Index.from_url(valkey_url), [])
    msgs = [(SRC, one("pod-a", 0, 1000.0, BlockStored([1, 2], None, toks[:64], 32, medium="GPU", group_idx=0))),
            (SRC, one("pod-a", 1, 1001.0, BlockRemoved([2], medium="GPU"))),
            (SRC, one("pod-a", 2, 1002.0, BlockStored([3], 2, toks[64:], 32, medium="GPU", group_idx=0)))]
    for batch in ([msgs] if together else [[m] for m in msgs]):
        await ing.handle_messages(batch)
    assert ing.counters.counts["orphan_blocks"] == 1 and await flagged(ing, "pod-a")
    got = {m.pod_id: m.blocks for m in await ing.index.lookup(request_keys(toks, model="m"))}
    assert got == {"pod-a": 2}  # block 1's keys; block 3 not indexed
    await ing.index.close()


async def test_a_parent_evicted_from_the_gpu_but_held_on_the_cpu_tier_keys_its_child(valkey_url):
    """An offload tier: the parent left the GPU but its copy on the CPU tier is still held, so its keys are in the
    pod's state (any tier) and the child is keyed, the pod exact."""
    toks = list(range(4000, 4096))
    ing = Ingester(Config(valkey_url=valkey_url), Index.from_url(valkey_url), [])
    await ing.handle_messages([(SRC, one("pod-a", 0, 1000.0, BlockStored([1, 2], None, toks[:64], 32, medium="GPU", group_idx=0)))])
    await ing.handle_messages([(SRC, one("pod-a", 1, 1001.0, BlockStored([1, 2], None, toks[:64], 32, medium="CPU", group_idx=0)))])
    await ing.handle_messages([(SRC, one("pod-a", 2, 1002.0, BlockRemoved([1, 2], medium="GPU")))])
    await ing.handle_messages([(SRC, one("pod-a", 3, 1003.0, BlockStored([3], 2, toks[64:], 32, medium="GPU", group_idx=0)))])
    assert ing.counters.counts.get("orphan_blocks", 0) == 0 and not await flagged(ing, "pod-a")
    keys = request_keys(toks, model="m")
    assert (await ing.index.pod_state("pod-a")).block_keys(3) == (tuple(keys[4:]), keys[3])
    await ing.index.close()




@pytest.mark.parametrize("case", ["one_long_prompt", "churn", "pipelined"])
async def test_a_carry_planned_when_the_pods_carries_are_pruned_is_kept(valkey_url, case):
    """Engine blocks of 24 tokens, request blocks of 16: every block leaves a carry. The carries of blocks a pod
    let go of go (PodState.plan keeps one exactly while its block is held); the blocks a batch stores, and those
    of the batches planned before it in the same call, are not held before they apply: their carries must stay. Otherwise a child stored in a later
    call finds its parent held but its leftover tokens gone: an orphan, the pod flagged, though every event came.
    ``one_long_prompt``: one batch stores more blocks than the pruning's floor; ``churn``: blocks stored and
    evicted before, the floor crossed by the next store; ``pipelined``: two batches in one call cross it, the
    child's parent in the first."""
    n = 1030 if case == "one_long_prompt" else 600
    toks = list(range(20_000, 20_000 + 24 * (n + 1)))
    ing = Ingester(Config(valkey_url=valkey_url), Index.from_url(valkey_url), [])
    seq = 0
    if case == "churn":
        old = list(range(100_000, 100_000 + n))
        gone = list(range(50_000, 50_000 + 24 * n))
        await ing.handle_messages([(SRC, one("pod-a", 0, 1000.0, BlockStored(old, None, gone, 24, medium="GPU", group_idx=0)))])
        await ing.handle_messages([(SRC, one("pod-a", 1, 1001.0, BlockRemoved(old, medium="GPU")))])
        seq = 2
    eks = list(range(1, n + 1))
    first = [(SRC, one("pod-a", seq, 1002.0, BlockStored(eks, None, toks[:24 * n], 24, medium="GPU", group_idx=0)))]
    if case == "pipelined":  # another prompt's 500 blocks planned after the parent's, in the same call
        other = list(range(200_000, 200_500))
        first.append((SRC, one("pod-a", seq + 1, 1002.5, BlockStored(other, None, list(range(60_000, 60_000 + 24 * 500)),
                                                                     24, medium="GPU", group_idx=0))))
    await ing.handle_messages(first)
    seq += len(first)
    await ing.handle_messages([(SRC, one("pod-a", seq, 1003.0, BlockStored([n + 1], n, toks[24 * n:], 24, medium="GPU", group_idx=0)))])
    assert ing.counters.counts.get("orphan_blocks", 0) == 0 and not await flagged(ing, "pod-a")
    got = {m.pod_id: m.blocks for m in await ing.index.lookup(request_keys(toks, model="m"))}
    assert got == {"pod-a": len(toks) // 16}
    if case == "churn":  # the let-go blocks' carries are pruned all the same
        carries = (await ing.index.pod_state("pod-a")).carries
        assert not set(carries) & set(old) and len(carries) == n + 1
    await ing.index.close()
