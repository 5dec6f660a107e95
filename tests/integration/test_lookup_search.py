"""The default lookup (pod bitmaps, or entries read whole where others wrote them) against the exact
walks over llm-d's entries (linear script, pipelined HKEYS)."""
from __future__ import annotations

import random

import pytest
import redis

from kv_preflight.index.index import Index, StoreBlock, encode_entry, make_entry

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def hold(ix: Index, pod: str, chain: list[int], n: int, medium: str = "GPU", group: int | None = 0) -> None:
    fld = encode_entry(make_entry(pod, medium, group))
    await ix.apply_batch(pod_id=pod, rank=0, seq=0, ts=0.0, model="m", engine_block_size=16, mode="import",
                         mutations=[StoreBlock(10_000 + k, medium.lower(), fld, (k,)) for k in chain[:n]])


async def all_modes(ix: Index, chain: list[int], pods=None) -> dict[str, dict[str, tuple[int, str]]]:
    return {mode: {m.pod_id: (m.blocks, m.tier) for m in await ix.lookup(chain, pods, mode=mode)}
            for mode in ("script", "linear", "pipeline")}


@pytest.mark.parametrize("seed", range(12))
async def test_prefix_holding_pods_agree_in_every_mode(ix, seed):
    rng = random.Random(seed)
    length = rng.choice([1, 2, 3, 7, 64, 100, 257, 1000])
    chain = [rng.randrange(1, 2**64) for _ in range(length)]
    pods = [f"pod-{i}" for i in range(rng.choice([1, 2, 5, 17]))]
    for pod in pods:
        if rng.random() < 0.8:
            await hold(ix, pod, chain, rng.randint(1, length))
        if rng.random() < 0.3:  # also offloaded: a shorter or longer prefix in the cpu tier
            await hold(ix, pod, chain, rng.randint(1, length), medium="CPU")
    got = await all_modes(ix, chain)
    assert got["script"] == got["linear"] == got["pipeline"]
    wanted = rng.sample(pods, k=max(1, len(pods) // 2)) + ["nope"]
    got = await all_modes(ix, chain, wanted)
    assert got["script"] == got["linear"] == got["pipeline"]


async def test_tier_and_fields_that_appear_past_the_first_key(ix, valkey_url):
    chain = list(range(301, 321))
    await hold(ix, "pod-a", chain, 12)  # gpu 1..12
    await hold(ix, "pod-a", chain, 17, medium="CPU")  # cpu 1..17: last matched block is cpu
    sync = redis.Redis.from_url(valkey_url)
    for k in chain[:3]:
        sync.hset(str(k), "v08@gpu", "")
    for k in chain[3:9]:  # the same pod under another field from key 4 on
        sync.hset(str(k), "v08@cpu", "")
    for k in chain[:5]:
        sync.hset(str(k), "spec@gpu[speculative]", "")
    got = await all_modes(ix, chain)
    assert got["script"] == got["linear"] == got["pipeline"] == {"pod-a": (17, "cpu"), "v08": (9, "cpu")}


async def test_a_missing_first_key_means_no_match(ix):
    chain = [11, 12, 13]
    await hold(ix, "pod-a", chain[1:], 2)
    assert (await all_modes(ix, chain))["script"] == {}
    assert await ix.lookup([]) == []


@pytest.mark.parametrize("seed", range(25))
async def test_fields_that_come_and_go_agree_in_every_mode(ix, valkey_url, seed):
    """Each pod holds a prefix, but through a random mix of its fields per key (tiers, v0.8 and JSON
    forms): no single field forms a prefix. Speculative entries are sprinkled anywhere."""
    rng = random.Random(1000 + seed)
    length = rng.choice([1, 2, 5, 33, 200])
    chain = [rng.randrange(1, 2**64) for _ in range(length)]
    sync = redis.Redis.from_url(valkey_url)
    pods = [f"p{i}" for i in range(rng.choice([1, 3, 8, 20]))]
    for pod in pods:
        forms = [encode_entry(make_entry(pod, "GPU", 0)), encode_entry(make_entry(pod, "CPU", 0)),
                 f"{pod}@gpu", f"{pod}@cpu", encode_entry(make_entry(pod, "DISK", 1))]
        held = rng.randint(0, length)
        for k in chain[:held]:
            for f in rng.sample(forms, k=rng.randint(1, 2)):
                sync.hset(str(k), f, "")
    for k in rng.sample(chain, k=min(len(chain), 5)):
        sync.hset(str(k), f"spec{rng.randrange(3)}@gpu[speculative]", "")
    got = await all_modes(ix, chain)
    assert got["script"] == got["linear"] == got["pipeline"]
    wanted = rng.sample(pods, k=max(1, len(pods) // 3))
    got = await all_modes(ix, chain, wanted)
    assert got["script"] == got["linear"] == got["pipeline"]


@pytest.mark.parametrize("seed", range(6))
async def test_written_layouts_with_gaps_agree_in_every_mode_when_many_pods_hold_the_chain(ix, seed):
    """Written by our apply path (so the default lookup reads its bitmaps), then blocks evicted from the
    middle of chains: no prefix per pod any more. With pods x log2(keys) >= keys (a prefix many pods
    hold) the script returns every key's bitmaps and the walk is exact on any layout."""
    from kv_preflight.index.index import RemoveBlock

    rng = random.Random(300 + seed)
    n_keys, n_pods = rng.choice([(5, 3), (40, 12), (200, 40), (256, 1000 // 20)])
    chain = [rng.randrange(1, 2**64) for _ in range(n_keys)]
    pods = [f"pod-{i}" for i in range(n_pods)]
    for pod in pods:
        await hold(ix, pod, chain, len(chain) if pod == pods[0] else rng.randint(1, len(chain)),
                   medium=rng.choice(["GPU", "CPU"]))
        if pod == pods[0]:
            continue  # one pod holds it all: every pod is still at key 1 when the script decides
        gone = rng.sample(range(len(chain)), k=rng.randrange(0, max(1, len(chain) // 4)))
        await ix.apply_batch(pod_id=pod, rank=0, seq=0, ts=0.0, model="m", engine_block_size=16, mode="import",
                             mutations=[RemoveBlock(10_000 + chain[i], t) for i in gone for t in ("gpu", "cpu")])
    got = await all_modes(ix, chain)
    assert got["script"] == got["linear"] == got["pipeline"]
    assert any(b for b, _ in got["linear"].values())
    got = await all_modes(ix, chain, rng.sample(pods, k=2) + ["nope"])
    assert got["script"] == got["linear"] == got["pipeline"]


async def test_many_pods_and_another_writer_past_the_first_key(ix, valkey_url):
    """A prefix many pods hold (the script sends every key's bitmaps), where another writer (an llm-d
    indexer on the same Valkey) deleted one of our entries past key 1, so the bitmaps there say more than
    llm-d's hash, and, on a second chain, made a key past key 1 a string: the lookup walks the entries
    where they disagree, and reads the string as a miss, counted."""
    sync = redis.Redis.from_url(valkey_url)
    chain = list(range(501, 541))
    pods = [f"pod-{i}" for i in range(12)]  # 12 pods x log2(40 keys) >= 40: every key's bitmaps are sent
    for i, pod in enumerate(pods):
        await hold(ix, pod, chain, 40 - i)
    sync.hdel(str(chain[6]), encode_entry(make_entry("pod-3", "GPU", 0)))
    got = await all_modes(ix, chain)
    assert got["script"] == got["linear"] == got["pipeline"]
    assert got["linear"]["pod-3"] == (6, "gpu") and got["linear"]["pod-0"] == (40, "gpu")

    other = list(range(601, 641))
    for i, pod in enumerate(pods):
        await hold(ix, pod, other, 40 - i)
    sync.delete(str(other[11]))
    sync.set(str(other[11]), "not a hash")
    before = ix.foreign_reads
    got = {m.pod_id: m.blocks for m in await ix.lookup(other)}
    assert got == {pod: 11 for pod in pods}
    assert ix.foreign_reads == before + 1
