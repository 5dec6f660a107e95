"""The default lookup against an exact walk on layouts WITH gaps: a pod holds a request key but not the key
before it (an out-of-order eviction, a store that arrives before its parent's, a second KV cache group holding
keys the first does not). Written through our own apply path, so the presence bitmaps and the pods' orphan
counts (kv_preflight/index/pod_state.py) are what the lookup reads: few pods on long chains, so the script
bisects whoever it may (kind 1) and walks the rest. A Python model of each pod's blocks gives, after every
batch, what the default lookup must answer (each pod's prefix in its prefix group, group 0 here: these pods
name no KV cache group kinds), what llm-d's own walk over the entries must answer (any group: ``mode="linear"``,
read from Valkey), and the orphan count; on a cluster every batch is first left half applied (its changes on
some shards only), the lookup compared there too, then drained."""
from __future__ import annotations

import random

import pytest

from kv_preflight.index.entries import CHAIN_ROOT, ClearPod, better_tier, parse_entry
from kv_preflight.index.index import Index, RemoveBlock, StoreBlock, encode_entry, make_entry
from kv_preflight.index.layout import pod_meta_key
from kv_preflight.index.transfer import export_blocks, import_blocks

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
        # per pod: (engine key, tier, group) -> (its keys, whether its parent was given)
        self.held: dict[str, dict[tuple[int, str, int], tuple[tuple[int, int], bool]]] = {}
        self.parent = {rk: (b[2] if j == 0 else b[1][0]) for b in self.blocks for j, rk in enumerate(b[1])}

    def prefix_keys(self, pod: str) -> dict[int, bool]:
        """The keys the pod holds in its prefix group (0), each with whether its parent is known (a block
        stored without its parent knows its first key's parent only from another block)."""
        out: dict[int, bool] = {}
        for (ek, tier, group), (rks, known) in self.held.get(pod, {}).items():
            if group == 0:
                for j, rk in enumerate(rks):
                    out[rk] = out.get(rk, False) or known or j > 0
        return out

    def known(self, pod: str) -> bool:
        return all(self.prefix_keys(pod).values())

    def orphans(self, pod: str) -> int:
        keys = self.prefix_keys(pod)
        return sum(1 for rk in keys if self.parent[rk] != CHAIN_ROOT and self.parent[rk] not in keys)

    def expected(self, chain: list[int], pods, prefix_only: bool) -> list[tuple[str, int, str]]:
        """The exact walk: per pod the keys it holds from the chain's first (in group 0 only, or in any
        group: llm-d's count), its tier at the last gpu if held there, else the first by name."""
        out = []
        for pod, held in self.held.items():
            if pods is not None and pod not in pods:
                continue
            tiers: dict[int, str] = {}
            for (ek, tier, group), (rks, _) in held.items():
                if group == 0 or not prefix_only:
                    for rk in rks:
                        if better_tier(tier, tiers.get(rk)):
                            tiers[rk] = tier
            n = 0
            while n < len(chain) and chain[n] in tiers:
                n += 1
            if n:
                out.append((pod, n, tiers[chain[n - 1]]))
        return sorted(out)

    def batch(self, pod: str) -> list:
        """A random batch: stores of a run of blocks from anywhere (gaps), removals from the middle, whole
        prefixes (closing gaps), a second KV cache group, now and then a clear or a store whose parent is
        not known (index import of an older export: the count is unknown while such a key is held)."""
        rng, held = self.rng, self.held.setdefault(pod, {})
        fld = {t: encode_entry(make_entry(pod, t.upper(), 0)) for t in ("gpu", "cpu")}
        roll = rng.random()
        chain = rng.choice(self.of_chain)
        if roll < 0.05 and held:
            held.clear()
            return [ClearPod()]
        if roll < 0.45:
            start = 0 if rng.random() < 0.4 else rng.randrange(len(chain))
            end = rng.randrange(start + 1, len(chain) + 1)
            tier, group = rng.choice(TIERS), (1 if rng.random() < 0.15 else 0)
            unknown = rng.random() < 0.04
            out = []
            for ek, rks, parent in chain[start:end]:
                if (ek, tier, group) in held:
                    continue
                held[(ek, tier, group)] = (rks, not unknown)
                f = encode_entry(make_entry(pod, tier.upper(), group)) if group else fld[tier]
                out.append(StoreBlock(ek, tier, f, rks, group, parent=None if unknown else parent))
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


async def entries_walk(ix: Index, chain: list[int], pods, group: int | None) -> list[tuple[str, int, str]]:
    """The exact walk over llm-d's entries as Valkey holds them now, in one KV cache group (None: any, as
    llm-d counts), computed here: per pod the keys it holds from the chain's first, its tier at the last."""
    async with ix.client.pipeline(transaction=False) as pipe:
        for k in chain:
            pipe.hkeys(str(k))
        fields = await pipe.execute()
    tiers: dict[str, dict[int, str]] = {}
    for i, fs in enumerate(fields):
        for f in fs:
            e = parse_entry(f)
            if e is None or e.Speculative or (group is not None and e.GroupIdx != group):
                continue
            if pods is not None and e.PodIdentifier not in pods:
                continue
            at = tiers.setdefault(e.PodIdentifier, {})
            if better_tier(e.DeviceTier, at.get(i)):
                at[i] = e.DeviceTier
    out = []
    for pod, at in tiers.items():
        n = 0
        while n in at:
            n += 1
        if n:
            out.append((pod, n, at[n - 1]))
    return sorted(out)


async def agree(ix: Index, world: World, pods: list[str], rng: random.Random, rounds=None, settled=True) -> int:
    """On both chains, for every pod and for some: the default lookup equals the exact walk over the entries
    of each pod's prefix group (group 0 here), and llm-d's walk (``mode="linear"``, the lookup script) the
    exact walk over every group's entries; ``settled`` (every batch fully applied): both equal the model's
    too. Returns the longest prefix seen (so a test can tell it read something). With ``rounds`` (a cluster's:
    Rounds in test_cluster_lookup.py), each default lookup takes at most 3 sequential rounds too."""
    longest = 0
    for chain in world.chains:
        for asked in (None, rng.sample(pods, k=min(2, len(pods))) + ["nope"]):
            linear = sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(chain, asked, mode="linear"))
            assert linear == await entries_walk(ix, chain, asked, None)
            want = await entries_walk(ix, chain, asked, 0)
            if settled:
                assert linear == world.expected(chain, asked, prefix_only=False)
                assert want == world.expected(chain, asked, prefix_only=True)
            if rounds is None:
                found = await ix.lookup(chain, asked)
            else:
                found, depth = await rounds.of(ix.lookup(chain, asked))
                assert depth <= 3, rounds.calls  # at most 3 sequential rounds
            got = sorted((m.pod_id, m.blocks, m.tier) for m in found)
            assert got == want
            longest = max([longest, *(b for _, b, _ in want)])
    return longest


async def orphan_counts_agree(ix: Index, world: World, pods: list[str]) -> None:
    for pod in pods:
        if pod not in world.held or not await ix.client.hexists(pod_meta_key(pod), "batches"):
            continue  # no batch applied yet
        found = await ix.client.hget(pod_meta_key(pod), "orphan_keys")
        if world.known(pod):
            assert found is not None and int(found) == world.orphans(pod), pod
        else:
            assert found is None, pod  # unknown while a key whose parent nobody gave is held: walked


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
        if all(world.known(p) and world.orphans(p) == 0 for p in world.held):
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
    await import_blocks(ix, pod, "m", 32, stores)
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


async def test_a_count_is_unknown_exactly_while_a_key_of_unknown_parent_is_held(ix):
    """The count is a function of the pod's blocks (kv_preflight/index/pod_state.py): unknown while the pod
    holds a key whose parent no block of it gave (a store without its parent), known again as soon as it
    does not, whatever came before (no clear needed); and exact, so a pod known with no orphan is bisected."""
    world = World(random.Random(9), 60, 14)
    blocks = world.of_chain[0]

    async def step(pod: str, seq: int, muts: list) -> bytes | None:
        await ix.apply_batch(pod_id=pod, rank=0, seq=seq, ts=1.0, model="m", engine_block_size=32, mutations=muts)
        return await ix.client.hget(pod_meta_key(pod), "orphan_keys")

    pod = "emptied-pod"
    fld = encode_entry(make_entry(pod, "GPU", 0))
    assert await step(pod, 0, [StoreBlock(blocks[10][0], "gpu", fld, blocks[10][1])]) is None  # parent not known
    assert await step(pod, 1, [RemoveBlock(blocks[10][0], "gpu")]) == b"0"  # it holds nothing: known
    assert await step(pod, 2, [StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks[20:30]]) == b"1"
    assert await step(pod, 3, [StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks[:20]]) == b"0"
    walks = ix.gap_walks
    want = [(m.pod_id, m.blocks) for m in await ix.lookup(world.chains[0], mode="linear")]
    assert want == [(pod, 60)]
    assert [(m.pod_id, m.blocks) for m in await ix.lookup(world.chains[0])] == want
    assert ix.gap_walks == walks  # bisected: the count is known and 0

    pod = "cpu-copy-pod"
    fld, cpu = encode_entry(make_entry(pod, "GPU", 0)), encode_entry(make_entry(pod, "CPU", 0))
    assert await step(pod, 0, [StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks[:5]]) == b"0"
    # block 10 stored without its parent: unknown, and still so once its cpu copy (with its parent) comes and
    # goes, until some block of the pod names that parent while the key is held
    assert await step(pod, 1, [StoreBlock(blocks[10][0], "gpu", fld, blocks[10][1])]) is None
    assert await step(pod, 2, [StoreBlock(blocks[10][0], "cpu", cpu, blocks[10][1], parent=blocks[10][2]),
                               RemoveBlock(blocks[10][0], "cpu")]) is None
    walks = ix.gap_walks
    assert [(m.pod_id, m.blocks) for m in await ix.lookup(world.chains[0], [pod])] == [(pod, 10)]
    assert ix.gap_walks == walks + 1  # walked, never guessed
    assert await step(pod, 3, [StoreBlock(blocks[10][0], "cpu", cpu, blocks[10][1], parent=blocks[10][2])]) == b"1"
    assert await step(pod, 4, [StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks[5:10]]) == b"0"


@pytest.mark.parametrize("seed", (*range(4), 9))
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
            await agree(ix, world, pods, rng, rounds, settled=False)  # half applied: no pod bisected unless every version is closed
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
    from kv_preflight.index.cluster import node_for
    from tests.integration.test_cluster_lookup import pod_step, run_on_some_shards

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
            await run_on_some_shards(ix, payload, rng, skip=skip)

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
    exported = [b async for b in export_blocks(ix.writer, pod)]
    assert {b.parent for b in exported} >= {CHAIN_ROOT, blocks[59][2]}
    await ix.clear_pod(pod, forget=True)
    await import_blocks(ix, pod, "m", 32, exported)
    assert await ix.client.hget(pod_meta_key(pod), "orphan_keys") == b"1"  # known: the gap at block 30
    assert [m.blocks for m in await ix.lookup(world.chains[0])] == [60]
    await import_blocks(ix, pod, "m", 32, [StoreBlock(blocks[30][0], "gpu", fld, blocks[30][1], parent=blocks[30][2])])
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
    await import_blocks(ix, "st-old", "m", 32, [StoreBlock(blocks[0][0], "gpu", encode_entry(make_entry("st-old", "GPU", 0)),
                                                          blocks[0][1])])
    def run(*args: str) -> str:  # the CLI runs its own event loop: in a thread
        return CliRunner().invoke(cli, ["index", "stats", "--valkey-url", valkey_url, *args], catch_exceptions=False).output

    out = await asyncio.to_thread(run, "--json")
    rows = {p["pod_id"]: p["orphan_keys"] for p in json.loads(out)["pods"]}
    assert rows == {"st-closed": 0, "st-gap": 1, "st-old": None}
    table = await asyncio.to_thread(run)
    assert "(orphan keys: 1)" in table and "(orphan keys: unknown)" in table


async def test_a_count_not_written_at_the_pods_last_batch_is_not_trusted(ix):
    """Readers trust a pod's orphan count only when it was written at the pod's last batch (the "orphan_at"
    stamp): a writer that applied a batch without keeping the count (a later batch count than the stamp)
    makes the pod walked, not guessed, until a batch of ours writes the count again, exact, from the pod's
    whole state."""
    world = World(random.Random(5), 150, 13)
    pod = "rolling-pod"
    fld = encode_entry(make_entry(pod, "GPU", 0))
    blocks = world.of_chain[0]
    await ix.apply_batch(pod_id=pod, rank=0, seq=0, ts=1.0, model="m", engine_block_size=32,
                         mutations=[StoreBlock(ek, "gpu", fld, rks, parent=p) for ek, rks, p in blocks])
    walks = ix.gap_walks
    assert [m.blocks for m in await ix.lookup(world.chains[0])] == [300] and ix.gap_walks == walks
    await ix.client.hincrby(pod_meta_key(pod), "batches", 1)  # a batch applied with no count kept
    assert (await ix.meta.pod_info(pod)).orphan_keys is None
    assert [m.blocks for m in await ix.lookup(world.chains[0])] == [300] and ix.gap_walks == walks + 1
    await ix.apply_batch(pod_id=pod, rank=0, seq=1, ts=1.0, model="m", engine_block_size=32,
                         mutations=[RemoveBlock(blocks[100][0], "gpu")])
    assert (await ix.meta.pod_info(pod)).orphan_keys == 1
    assert [m.blocks for m in await ix.lookup(world.chains[0])] == [200]
    await ix.apply_batch(pod_id=pod, rank=0, seq=2, ts=1.0, model="m", engine_block_size=32, mutations=[ClearPod()])
    assert (await ix.meta.pod_info(pod)).orphan_keys == 0
