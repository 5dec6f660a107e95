"""Data-parallel ranks in the index (kv_preflight/index/rank_pods.py): every rank of a pod is an index pod of its
own, and the ranks share the pod's llm-d entry, which stays while any rank holds the block. Against a real
valkey-server and a real Valkey Cluster."""
from __future__ import annotations

import random

import pytest
import redis

from kv_preflight.index.entries import ClearPod, RemoveBlock, StoreBlock, encode_entry, make_entry
from kv_preflight.index.index import Index
from kv_preflight.index.layout import engine_key_name, presence_key

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

POD = "vllm-0"
RANKS = [POD, f"{POD}@dp1", f"{POD}@dp2"]
ENTRY = encode_entry(make_entry(POD, "GPU", 0))
OTHER = encode_entry(make_entry("vllm-9", "GPU", 0))


class Feed:
    """Each index pod's next seq, for batches applied in order."""

    def __init__(self, ix: Index):
        self.ix = ix
        self.seq: dict[str, int] = {}

    async def apply(self, pod: str, muts: list) -> None:
        seq = self.seq.get(pod, 0)
        self.seq[pod] = seq + 1
        rank = int(pod.rsplit("@dp", 1)[1]) if "@dp" in pod else 0
        r = await self.ix.apply_batch(pod_id=pod, rank=rank, seq=seq, ts=1000.0 + seq, model="m",
                                      engine_block_size=32, mutations=muts)
        assert r.status == "applied", (pod, r)


def store(ek: int, rks: tuple[int, ...], pod: str = POD) -> StoreBlock:
    base = pod.split("@dp")[0]
    return StoreBlock(ek, "gpu", encode_entry(make_entry(base, "GPU", 0)), rks, 0, True, -1)


def entries(sync: redis.Redis, rk: int) -> set[str]:
    return set(sync.hkeys(str(rk)))


def presence_count(sync: redis.Redis, rk: int) -> int | None:
    """The n of the presence field (how many llm-d entries its bits stand for), None when absent."""
    v = sync.hget(presence_key(rk), "gpu")
    return None if v is None else int(v.split(b":", 1)[0])


@pytest.fixture(params=["single", "cluster"])
async def dp_ix(request, valkey_url):
    if request.param == "single":
        url, sync = valkey_url, redis.Redis.from_url(valkey_url)
    else:
        url = request.getfixturevalue("cluster_url")
        sync = redis.RedisCluster.from_url(url)
    ix = Index.from_url(url)
    yield ix, sync
    await ix.close()
    sync.close()


async def test_ranks_share_the_pods_llmd_entry_until_the_last_lets_go(dp_ix):
    ix, sync = dp_ix
    feed = Feed(ix)
    await feed.apply(RANKS[1], [store(7, (101, 102), RANKS[1])])
    await feed.apply(RANKS[0], [store(7, (101, 102), RANKS[0])])
    # one llm-d entry naming the pod, two bits standing for it
    assert entries(sync, 101) == {ENTRY.encode()} and presence_count(sync, 101) == 1
    found = {m.pod_id: m.blocks for m in await ix.lookup([101, 102])}
    assert found == {RANKS[0]: 2, RANKS[1]: 2}
    # rank 1 lets go: the entry stays (rank 0 holds it), rank 1 is no longer found
    await feed.apply(RANKS[1], [RemoveBlock(7, "gpu")])
    assert entries(sync, 101) == {ENTRY.encode()} and presence_count(sync, 101) == 1
    assert {m.pod_id: m.blocks for m in await ix.lookup([101, 102])} == {RANKS[0]: 2}
    assert sync.exists(engine_key_name(7))
    # rank 0 lets go too: nothing left (llm-d's pruning rule drops engine:<ek> with the last entry)
    await feed.apply(RANKS[0], [RemoveBlock(7, "gpu")])
    assert not sync.exists("101") and not sync.exists(presence_key(101)) and not sync.exists(engine_key_name(7))
    assert await ix.lookup([101, 102]) == []


async def test_a_rank_cleared_leaves_its_siblings_blocks_and_entries(dp_ix):
    ix, sync = dp_ix
    feed = Feed(ix)
    for pod in RANKS:
        await feed.apply(pod, [store(7, (101,), pod), store(8, (201,), pod)])
    await feed.apply(RANKS[2], [ClearPod()])
    assert entries(sync, 101) == {ENTRY.encode()} and presence_count(sync, 101) == 1
    assert {m.pod_id for m in await ix.lookup([101])} == {RANKS[0], RANKS[1]}
    await ix.clear_pod(RANKS[0])
    await ix.clear_pod(RANKS[1])
    assert not sync.exists("101") and not sync.exists("201")


async def test_random_rank_histories_leave_entries_equal_to_what_the_ranks_hold(dp_ix):
    """Stores, removals and clears in random order over three ranks and another pod: after each batch the
    llm-d entries of a request key are exactly the pods some rank of which holds it, the presence count says
    how many entries the bits stand for, and the lookup names exactly the ranks holding it."""
    ix, sync = dp_ix
    feed = Feed(ix)
    rng = random.Random(7)
    held: dict[str, dict[int, int]] = {p: {} for p in [*RANKS, "vllm-9"]}  # pod -> ek -> copies
    blocks = {ek: (1000 + ek,) for ek in range(1, 7)}
    for _ in range(120):
        pod = rng.choice(list(held))
        roll = rng.random()
        if roll < 0.5:
            ek = rng.choice(list(blocks))
            await feed.apply(pod, [store(ek, blocks[ek], pod)])
            held[pod][ek] = held[pod].get(ek, 0) + 1
        elif roll < 0.95:
            ek = rng.choice(list(blocks))
            await feed.apply(pod, [RemoveBlock(ek, "gpu")])
            if held[pod].get(ek):
                held[pod][ek] -= 1
                if not held[pod][ek]:
                    del held[pod][ek]
        else:
            await feed.apply(pod, [ClearPod()])
            held[pod] = {}
        for ek, (rk,) in blocks.items():
            holders = {p for p, h in held.items() if h.get(ek)}
            want = ({ENTRY.encode()} if holders & set(RANKS) else set()) | ({OTHER.encode()} if "vllm-9" in holders else set())
            assert entries(sync, rk) == want, (ek, holders)
            assert presence_count(sync, rk) == (len(want) or None), (ek, holders)
            assert {m.pod_id for m in await ix.lookup([rk])} == holders, (ek, holders)
