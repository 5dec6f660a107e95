"""The default lookup against the exact linear walk on layouts WITH gaps (issue 9, item 4): a pod holds a
request key but not the key before it (an out-of-order eviction, a hybrid model's sliding-window group
dropping early blocks, a store that arrives before its parent's). Written through our own apply path,
so the bitmaps and the pods' orphan counts (kv_preflight/index/lua/pod.lua) are what the lookup reads: few pods on
long chains, so the script bisects whoever it may (kind 1) and walks the rest. A Python model of each
pod's held keys checks the orphan count itself after every batch; on a cluster every batch is first
left half applied (its effects on some shards only), the lookup compared there too, then drained."""
from __future__ import annotations

import random

import pytest

from kv_preflight.index.entries import CHAIN_ROOT, ClearPod
from kv_preflight.index.index import Index, RemoveBlock, StoreBlock, encode_entry, make_entry
from kv_preflight.index.layout import pod_meta_key

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

TIERS = ("gpu", "gpu", "cpu")


class World:
    """Two chains sharing their first blocks (a common prefix, so a key has two children), engine blocks
    of two request keys, and per pod a model of what it holds: (engine key, tier, group) -> its keys."""

    def __init__(self, rng: random.Random, n_blocks: int, tag: int):
        self.rng = rng
        main = [rng.randrange(1, 2**63) for _ in range(2 * n_blocks)]
        shared = rng.randrange(1, n_blocks // 2)
        branch = main[:2 * shared] + [rng.randrange(1, 2**63) for _ in range(2 * (n_blocks - shared))]
        self.chains = [main, branch]
        self.blocks: list[tuple[int, tuple[int, int], int]] = []  # (engine key, its keys, parent)
        seen = set()
        for c, chain in enumerate(self.chains):
            for i in range(n_blocks):
                ek = tag * 1_000_000 + (i if i < shared or c == 0 else 100_000 + i)
                if ek not in seen:
                    seen.add(ek)
                    self.blocks.append((ek, (chain[2 * i], chain[2 * i + 1]), CHAIN_ROOT if i == 0 else chain[2 * i - 1]))
        sets = [set(chain) for chain in self.chains]
        self.of_chain = [[b for b in self.blocks if b[1][0] in keys] for keys in sets]
        self.held: dict[str, dict[tuple[int, str, int], tuple[int, int]]] = {}
        self.known: dict[str, bool] = {}
        # Per pod: whether its refs may keep "<rk>|>" fields of keys evicted while the count was unknown
        # (pod.lua keeps the refs only while it is known): the count became unknown while the pod held a
        # key with a parent. Such a pod stays unknown until its next clear; one whose refs are empty (it
        # holds no key, none left behind) starts its next batch known (0), as a new pod does.
        self.stale_refs: dict[str, bool] = {}
        self.parent = {rk: (b[2] if j == 0 else b[1][0]) for b in self.blocks for j, rk in enumerate(b[1])}

    def orphans(self, pod: str) -> int:
        keys = {rk for rks in self.held[pod].values() for rk in rks}
        return sum(1 for rk in keys if self.parent[rk] != CHAIN_ROOT and self.parent[rk] not in keys)

    def batch(self, pod: str) -> list:
        """A random batch: stores of a run of blocks from anywhere (gaps), removals from the middle, whole
        prefixes (closing gaps), a hybrid model's second group, now and then a clear or a store whose
        parent is not known (index import: the count is unknown until the next clear, or until the pod
        holds no key again with no refs left behind: ``stale_refs``)."""
        rng, held = self.rng, self.held.setdefault(pod, {})
        self.known.setdefault(pod, True)
        empty = not held and not self.stale_refs.get(pod)  # the pod step then finds no refs: count known, 0
        fld = {t: encode_entry(make_entry(pod, t.upper(), 0)) for t in ("gpu", "cpu")}
        roll = rng.random()
        chain = rng.choice(self.of_chain)
        if roll < 0.05 and held:
            held.clear()
            self.known[pod], self.stale_refs[pod] = True, False
            return [ClearPod()]
        if roll < 0.45:
            start = 0 if rng.random() < 0.4 else rng.randrange(len(chain))
            end = rng.randrange(start + 1, len(chain) + 1)
            tier, group = rng.choice(TIERS), (1 if rng.random() < 0.15 else 0)
            unknown = rng.random() < 0.04
            chained = any(self.parent[rk] != CHAIN_ROOT for rks in held.values() for rk in rks)
            out = []
            for ek, rks, parent in chain[start:end]:
                if (ek, tier, group) in held:
                    continue
                held[(ek, tier, group)] = rks
                f = encode_entry(make_entry(pod, tier.upper(), group)) if group else fld[tier]
                out.append(StoreBlock(ek, tier, f, rks, group, parent=None if unknown else parent))
            if out and empty:
                self.known[pod] = True
            if unknown and out:
                if self.known[pod]:
                    self.stale_refs[pod] = chained
                self.known[pod] = False
            return out
        # removals: from the middle (a gap), or the tail (as an engine does)
        if not held:
            return []
        mine = sorted(held)
        if rng.random() < 0.6:
            gone = rng.sample(mine, k=rng.randint(1, max(1, len(mine) // 5)))
        else:
            gone = mine[-rng.randint(1, len(mine)):]
        for b in gone:
            del held[b]
        return [RemoveBlock(ek, tier, group) for ek, tier, group in gone]


async def agree(ix: Index, world: World, pods: list[str], rng: random.Random, rounds=None) -> int:
    """The default lookup equals the linear walk on both chains, for every pod and for some; returns the
    longest prefix seen (so a test can tell it read something). With ``rounds`` (a cluster's: Rounds in
    test_cluster_lookup.py), each default lookup takes at most 3 sequential rounds too."""
    longest = 0
    for chain in world.chains:
        for asked in (None, rng.sample(pods, k=min(2, len(pods))) + ["nope"]):
            want = sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(chain, asked, mode="linear"))
            if rounds is None:
                found = await ix.lookup(chain, asked)
            else:
                found, depth = await rounds.of(ix.lookup(chain, asked))
                assert depth <= 3, rounds.calls  # issue 9 item 4
            got = sorted((m.pod_id, m.blocks, m.tier) for m in found)
            assert got == want
            longest = max([longest, *(b for _, b, _ in want)])
    return longest


async def orphan_counts_agree(ix: Index, world: World, pods: list[str]) -> None:
    for pod in pods:
        if pod not in world.held or not await ix.client.hexists(pod_meta_key(pod), "batches"):
            continue  # no batch applied yet
        found = await ix.client.hget(pod_meta_key(pod), "orphan_keys")
        if world.known[pod]:
            assert found is not None and int(found) == world.orphans(pod), pod
        else:
            assert found is None, pod  # unknown until the pod's next clear: the lookup walks it


@pytest.mark.parametrize("seed", range(6))
async def test_gapped_layouts_read_as_the_linear_walk_on_a_single_node(ix, seed):
    rng = random.Random(4200 + seed)
    world = World(rng, rng.choice([100, 300]), seed + 1)
    pods = [f"gap-{i}" for i in range(rng.choice([1, 2, 4]))]
    seqs = {p: -1 for p in pods}
    gapped = longest = 0
    for _ in range(40):
        pod = rng.choice(pods)
        muts = world.batch(pod)
        if not muts:
            continue
        seqs[pod] += 1
        r = await ix.apply_batch(pod_id=pod, rank=0, seq=seqs[pod], ts=1.0, model="m", engine_block_size=32,
                                 mutations=muts)
        assert r.status == "applied"
        before = ix.gap_walks
        longest = max(longest, await agree(ix, world, pods, rng))
        await orphan_counts_agree(ix, world, pods)
        if all(world.known[p] and world.orphans(p) == 0 for p in world.held):
            assert ix.gap_walks == before  # closed pods are bisected, never walked
        gapped += any(world.orphans(p) for p in world.held)
    assert gapped and ix.gap_walks  # layouts with gaps were read, by the few-pods lookup (kind 1)
    assert longest > 1


async def test_a_pod_written_before_the_count_existed_is_walked_until_its_next_clear(ix):
    """State with no orphan count (index migrate, an older writer, index import) reads as unknown: walked,
    so exact even with a gap; a clear makes the count known (0) again."""
    rng = random.Random(7)
    world = World(rng, 200, 9)
    pod = "old-pod"
    fld = encode_entry(make_entry(pod, "GPU", 0))
    chain = world.of_chain[0]
    # imported without parents, with a gap: blocks 0..99 but not 10
    stores = [StoreBlock(ek, "gpu", fld, rks) for i, (ek, rks, _) in enumerate(chain[:100]) if i != 10]
    await ix.import_blocks(pod, "m", 32, stores)
    assert await ix.client.hget(pod_meta_key(pod), "orphan_keys") is None
    walks = ix.gap_walks
    assert [(m.blocks) for m in await ix.lookup(world.chains[0])] == [20]
    assert ix.gap_walks == walks + 1
    await ix.apply_batch(pod_id=pod, rank=0, seq=0, ts=1.0, model="m", engine_block_size=32, mutations=[ClearPod()])
    assert await ix.client.hget(pod_meta_key(pod), "orphan_keys") == b"0"
    await ix.apply_batch(pod_id=pod, rank=0, seq=1, ts=1.0, model="m", engine_block_size=32,
                         mutations=[StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in chain[:50]])
    assert [(m.blocks) for m in await ix.lookup(world.chains[0])] == [100]
    assert ix.gap_walks == walks + 1  # bisected again


async def test_a_pod_whose_count_went_unknown_is_known_again_once_it_holds_no_key(ix):
    """Unknown (a store without its parent) is not forever: a pod step that starts with the pod's refs
    empty (it holds no key, and no "<rk>|>" was left behind) counts from 0, as for a new pod; that count is
    exact, since every key stored from there comes with its parent. Refs kept from before the count went
    unknown (keys evicted meanwhile are not uncounted) keep it unknown until the pod's next clear."""
    world = World(random.Random(9), 60, 14)
    blocks = world.of_chain[0]

    async def step(pod: str, seq: int, muts: list) -> bytes | None:
        await ix.apply_batch(pod_id=pod, rank=0, seq=seq, ts=1.0, model="m", engine_block_size=32, mutations=muts)
        return await ix.client.hget(pod_meta_key(pod), "orphan_keys")

    pod = "emptied-pod"
    fld = encode_entry(make_entry(pod, "GPU", 0))
    assert await step(pod, 0, [StoreBlock(blocks[10][0], "gpu", fld, blocks[10][1])]) is None  # parent not known
    assert await step(pod, 1, [RemoveBlock(blocks[10][0], "gpu")]) is None  # (the step started unknown)
    assert await step(pod, 2, [StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks[20:30]]) == b"1"
    assert await step(pod, 3, [StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks[:20]]) == b"0"
    walks = ix.gap_walks
    want = [(m.pod_id, m.blocks) for m in await ix.lookup(world.chains[0], mode="linear")]
    assert want == [(pod, 60)]
    assert [(m.pod_id, m.blocks) for m in await ix.lookup(world.chains[0])] == want
    assert ix.gap_walks == walks  # bisected: the count is known and 0

    pod = "stale-refs-pod"
    fld = encode_entry(make_entry(pod, "GPU", 0))
    assert await step(pod, 0, [StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks[:5]]) == b"0"
    assert await step(pod, 1, [StoreBlock(blocks[10][0], "gpu", fld, blocks[10][1])]) is None
    assert await step(pod, 2, [RemoveBlock(ek, "gpu") for ek, _, _ in blocks[:5] + [blocks[10]]]) is None
    assert await step(pod, 3, [StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks[:20]]) is None
    walks = ix.gap_walks
    assert [(m.pod_id, m.blocks) for m in await ix.lookup(world.chains[0], [pod])] == [(pod, 40)]
    assert ix.gap_walks == walks + 1  # walked, never guessed
    assert await step(pod, 4, [ClearPod()]) == b"0"


@pytest.mark.parametrize("seed", (*range(4), 9))  # 9: a pod emptied while its count was unknown
async def test_gapped_layouts_read_as_the_linear_walk_on_a_cluster_with_half_applied_batches(cluster_url, seed):
    from tests.integration.test_cluster_lookup import Rounds, pod_step, run_on_some_shards

    rng = random.Random(4300 + seed)
    world = World(rng, 150, 20 + seed)
    pods = [f"gapc{seed}-{i}" for i in range(rng.choice([2, 3]))]  # names no other test on this cluster uses
    ix = Index.from_url(cluster_url)
    rounds = Rounds(ix.backend)
    try:
        await ix.ensure_numbers(pods)
        seqs = {p: -1 for p in pods}
        gapped = longest = 0
        for _ in range(25):
            pod = rng.choice(pods)
            muts = world.batch(pod)
            if not muts:
                continue
            seqs[pod] += 1
            _, payload = await pod_step(ix, pod, seqs[pod], muts)
            await run_on_some_shards(ix, payload, rng)
            await agree(ix, world, pods, rng, rounds)  # half applied: no pod bisected unless every version is closed
            await ix.drain_outbox(pod)
            longest = max(longest, await agree(ix, world, pods, rng, rounds))
            await orphan_counts_agree(ix, world, pods)
            gapped += any(world.orphans(p) for p in world.held)
        assert gapped and ix.gap_walks  # layouts with gaps were read, by the few-pods lookup (kind 1)
        assert longest > 1
        assert ix.backend.late_reads == 0  # every tier the merge wanted was known or read beside the walk
    finally:
        await ix.close()


async def test_a_gap_closed_by_a_batch_still_on_its_way_is_not_bisected_on_a_cluster(cluster_url):
    """The pod step counts 0 orphan keys as soon as the gap is filled, before the filling store reaches
    every shard: a shard still behind shows the gap. The pod is walked until that outbox entry is gone."""
    from kv_preflight.index.cluster import effect_list, node_for
    from tests.integration.test_cluster_lookup import pod_step

    rng = random.Random(77)
    world = World(rng, 150, 40)
    chain, blocks = world.chains[0], world.of_chain[0]
    pod = "gapfill-0"
    fld = encode_entry(make_entry(pod, "GPU", 0))
    ix = Index.from_url(cluster_url)
    try:
        await ix.ensure_numbers([pod])

        async def step(seq: int, muts: list, skip: str | None = None) -> None:
            _, payload = await pod_step(ix, pod, seq, muts)
            if skip is None:
                await ix.drain_outbox(pod)
                return
            script = ix.backend.effects._effects
            await script.registered_client.script_load(script.script)
            effects = effect_list(payload)
            for name in {node_for(ix.client, key).name for _, key, _ in effects} - {skip}:
                args = [a for _, key, flat in effects if node_for(ix.client, key).name == name for a in flat]
                await ix.client.execute_command("EVALSHA", script.sha, 0, *args,
                                                target_nodes=ix.client.get_node(node_name=name))

        await step(0, [StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks])
        await step(1, [RemoveBlock(blocks[40][0], "gpu")])
        assert await ix.client.hget(pod_meta_key(pod), "orphan_keys") == b"1"
        # the gap filled again, its request keys' shard for chain[81] left behind
        behind = node_for(ix.client, str(chain[81])).name
        await step(2, [StoreBlock(blocks[40][0], "gpu", fld, blocks[40][1], parent=blocks[40][2])], skip=behind)
        assert await ix.client.hget(pod_meta_key(pod), "orphan_keys") == b"0"
        want = [(m.pod_id, m.blocks) for m in await ix.lookup(chain, mode="linear")]
        assert want == [(pod, 81)]
        assert [(m.pod_id, m.blocks) for m in await ix.lookup(chain)] == want
        await ix.drain_outbox(pod)
        walks = ix.gap_walks
        assert [(m.pod_id, m.blocks) for m in await ix.lookup(chain)] == [(pod, 300)]
        assert ix.gap_walks == walks  # the entry gone, every shard shows a closed pod: bisected again
    finally:
        await ix.close()


async def test_an_export_keeps_the_parents_so_an_import_keeps_the_count_known(ix):
    rng = random.Random(8)
    world = World(rng, 120, 11)
    pod = "exp-pod"
    fld = encode_entry(make_entry(pod, "GPU", 0))
    blocks = world.of_chain[0]
    await ix.apply_batch(pod_id=pod, rank=0, seq=0, ts=1.0, model="m", engine_block_size=32,
                         mutations=[StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks[:60]]
                         + [RemoveBlock(blocks[30][0], "gpu")])
    assert await ix.client.hget(pod_meta_key(pod), "orphan_keys") == b"1"
    exported = [b async for b in ix.export_blocks(pod)]
    assert {b.parent for b in exported} >= {CHAIN_ROOT, blocks[59][2]}
    await ix.clear_pod(pod, forget=True)
    await ix.import_blocks(pod, "m", 32, exported)
    assert await ix.client.hget(pod_meta_key(pod), "orphan_keys") == b"1"  # known: the gap at block 30
    assert [m.blocks for m in await ix.lookup(world.chains[0])] == [60]
    await ix.import_blocks(pod, "m", 32, [StoreBlock(blocks[30][0], "gpu", fld, blocks[30][1], parent=blocks[30][2])])
    assert await ix.client.hget(pod_meta_key(pod), "orphan_keys") == b"0"
    walks = ix.gap_walks
    assert [m.blocks for m in await ix.lookup(world.chains[0])] == [120]
    assert ix.gap_walks == walks


async def test_index_stats_shows_each_pods_orphan_keys(ix, valkey_url):
    import asyncio
    import json

    from click.testing import CliRunner

    from kv_preflight.cli.main import cli

    world = World(random.Random(3), 40, 12)
    blocks = world.of_chain[0]
    for pod, gone in (("st-closed", []), ("st-gap", [RemoveBlock(blocks[5][0], "gpu")])):
        fld = encode_entry(make_entry(pod, "GPU", 0))
        await ix.apply_batch(pod_id=pod, rank=0, seq=0, ts=1.0, model="m", engine_block_size=32,
                             mutations=[StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks] + gone)
    await ix.import_blocks("st-old", "m", 32, [StoreBlock(blocks[0][0], "gpu", encode_entry(make_entry("st-old", "GPU", 0)),
                                                          blocks[0][1])])
    def run(*args: str) -> str:  # the CLI runs its own event loop: in a thread
        return CliRunner().invoke(cli, ["index", "stats", "--valkey-url", valkey_url, *args], catch_exceptions=False).output

    out = await asyncio.to_thread(run, "--json")
    rows = {p["pod_id"]: p["orphan_keys"] for p in json.loads(out)["pods"]}
    assert rows == {"st-closed": 0, "st-gap": 1, "st-old": None}
    table = await asyncio.to_thread(run)
    assert "(orphan keys: 1)" in table and "(orphan keys: unknown)" in table


async def test_a_writer_of_an_earlier_build_makes_the_count_unknown(ix):
    """During a rolling upgrade an ingester of an earlier build applies batches without keeping the count
    (its batches still count in meta "batches"): the count is not trusted from there, the pod is walked,
    and a later batch of ours keeps it unknown until the pod's next clear."""
    world = World(random.Random(5), 150, 13)
    pod = "rolling-pod"
    fld = encode_entry(make_entry(pod, "GPU", 0))
    blocks = world.of_chain[0]
    await ix.apply_batch(pod_id=pod, rank=0, seq=0, ts=1.0, model="m", engine_block_size=32,
                         mutations=[StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks])
    walks = ix.gap_walks
    assert [m.blocks for m in await ix.lookup(world.chains[0])] == [300] and ix.gap_walks == walks
    # the earlier build's batch: a block from the middle evicted, no count kept (what its script did)
    sync = ix.client
    await sync.hincrby(pod_meta_key(pod), "batches", 1)
    assert (await ix.pod_info(pod)).orphan_keys is None
    assert [m.blocks for m in await ix.lookup(world.chains[0])] == [300] and ix.gap_walks == walks + 1
    await ix.apply_batch(pod_id=pod, rank=0, seq=1, ts=1.0, model="m", engine_block_size=32,
                         mutations=[RemoveBlock(blocks[100][0], "gpu")])
    assert (await ix.pod_info(pod)).orphan_keys is None
    assert [m.blocks for m in await ix.lookup(world.chains[0])] == [200]
    await ix.apply_batch(pod_id=pod, rank=0, seq=2, ts=1.0, model="m", engine_block_size=32, mutations=[ClearPod()])
    assert (await ix.pod_info(pod)).orphan_keys == 0
