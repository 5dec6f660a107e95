"""The cluster's lookup (kv_preflight/index/lua/lookup.lua on every shard, merged by merge_shards) against the single
node's exact linear walk: past the exact-walk budget (a prefix a whole fleet holds, where each shard
bisects) on prefix layouts with tiers and fields that come and go, and in mode "linear" on layouts that
are not prefixes at all."""
from __future__ import annotations

import itertools
import random

import pytest
import redis

from kv_preflight.index.cluster import EXACT_BUDGET
from kv_preflight.index.index import Index, RemoveBlock, StoreBlock, encode_entry, make_entry
from kv_preflight.index.slots import key_slot

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


class Rounds:
    """The sequential depth of a cluster lookup's Valkey I/O, without timings: each I/O entry point of the
    backend takes a tick from one counter when it starts and another when it ends; the depth is the longest
    chain of calls each starting after the one before it ended (issue 9 item 4: at most 3 rounds). The pod
    names (``Numbering.names_for``) are a cache, read again for a pod numbered since: not counted."""

    ENTRY_POINTS = (("shards", "script_on"), ("lookups", "pods_with_gaps"), ("lookups", "_read_routed"),
                    ("lookups", "_read_keys"))

    def __init__(self, backend):
        self.ticks = itertools.count()
        self.calls: list[tuple[int, int, str]] = []
        for part, name in self.ENTRY_POINTS:
            obj = getattr(backend, part)
            setattr(obj, name, self._timed(name, getattr(obj, name)))

    def _timed(self, name: str, fn):
        async def timed(*args, **kwargs):
            start = next(self.ticks)
            try:
                return await fn(*args, **kwargs)
            finally:
                self.calls.append((start, next(self.ticks), name))
        return timed

    def depth(self) -> int:
        """The longest chain of calls, each started after the previous one ended."""
        chain: list[int] = []
        calls = sorted(self.calls)
        for j, (start, _, _) in enumerate(calls):
            chain.append(1 + max((chain[i] for i in range(j) if calls[i][1] < start), default=0))
        return max(chain, default=0)

    async def of(self, lookup) -> tuple[object, int]:
        """A lookup's result and its depth."""
        self.calls.clear()
        found = await lookup
        return found, self.depth()


def write(urls: tuple[str, str], layout: dict[int, list[str]]) -> None:
    """The same request-key hashes on the single node and on the cluster."""
    one, many = redis.Redis.from_url(urls[0]), redis.RedisCluster.from_url(urls[1])
    try:
        for client in (one, many):
            pipe = client.pipeline(transaction=False)
            for key, fields in layout.items():
                if fields:
                    pipe.hset(str(key), mapping={f: "" for f in fields})
            pipe.execute()
    finally:
        one.close()
        many.close()


async def compare(urls: tuple[str, str], chain: list[int], pods, mode: str = "script") -> None:
    single, cluster = Index.from_url(urls[0]), Index.from_url(urls[1])
    try:
        want = sorted((m.pod_id, m.blocks, m.tier) for m in await single.lookup(chain, pods, mode="linear"))
        got = sorted((m.pod_id, m.blocks, m.tier) for m in await cluster.lookup(chain, pods, mode=mode))
        assert got == want
    finally:
        await single.close()
        await cluster.close()


@pytest.mark.parametrize("seed", range(4))
async def test_a_fleet_wide_prefix_is_bisected_on_each_shard_and_equals_the_linear_walk(valkey_url, cluster_url, seed):
    rng = random.Random(seed)
    n = rng.choice([200, 300])
    chain = [rng.randrange(1, 2**63) for _ in range(n)]
    pods = [f"pod-{i}" for i in range(rng.choice([120, 200]))]
    layout: dict[int, list[str]] = {k: [] for k in chain}
    for pod in pods:
        forms = [encode_entry(make_entry(pod, "GPU", 0)), encode_entry(make_entry(pod, "CPU", 0)), f"{pod}@gpu"]
        # mostly one field per pod (the fleet case); some pods switch fields along the chain
        mixed = rng.random() < 0.2
        for k in chain[:rng.randint(0, n)]:
            layout[k] += rng.sample(forms, k=rng.randint(1, 2)) if mixed else forms[:1]
    # a pod known at key 1 by one field only, holding its last keys by another (its cpu copy, say): the
    # bisection misses it there, and only the check where it seems to stop finds it
    late = pods[0]
    gpu, cpu = encode_entry(make_entry(late, "GPU", 0)), encode_entry(make_entry(late, "CPU", 0))
    for j, k in enumerate(chain[:n - 3]):
        layout[k] = [f for f in layout[k] if f not in (gpu, cpu)] + [gpu if j < n - 8 else cpu]
    for k in rng.sample(chain, k=5):
        layout[k].append(f"spec{rng.randrange(3)}@gpu[speculative]")
    assert sum(map(len, layout.values())) > 3 * EXACT_BUDGET  # every shard goes past its exact walk
    write((valkey_url, cluster_url), layout)
    await compare((valkey_url, cluster_url), chain, None)
    await compare((valkey_url, cluster_url), chain, rng.sample(pods, k=7) + ["nope"])


@pytest.mark.parametrize("seed", range(4))
async def test_linear_mode_on_a_cluster_is_exact_on_any_layout(valkey_url, cluster_url, seed):
    """Keys held with gaps (a batch half applied): no prefix per pod, so only an exact walk agrees."""
    rng = random.Random(100 + seed)
    chain = [rng.randrange(1, 2**63) for _ in range(rng.choice([40, 200]))]
    pods = [f"pod-{i}" for i in range(40)]
    layout = {k: [encode_entry(make_entry(p, rng.choice(["GPU", "CPU"]), 0)) for p in pods if rng.random() < 0.9]
              for k in chain}
    write((valkey_url, cluster_url), layout)
    await compare((valkey_url, cluster_url), chain, None, mode="linear")


def move_slot(cluster, slot: int) -> None:
    """Move one slot to another master by hand (what `valkey-cli --cluster reshard` does per slot), so a
    client that read the slot map before still sends that slot's keys to the old owner."""
    ports = [m.port for m in cluster.masters_now()]
    nodes = {p: redis.Redis(port=p) for p in ports}
    ids = {p: nodes[p].execute_command("CLUSTER", "MYID").decode() for p in ports}
    src = next(int(primary[1]) for start, end, primary, *_ in nodes[ports[0]].execute_command("CLUSTER", "SLOTS")
               if start <= slot <= end)
    dst = next(p for p in ports if p != src)
    nodes[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
    nodes[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
    for key in nodes[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
        nodes[src].execute_command("MIGRATE", "127.0.0.1", dst, key, 0, 5000)
    for node in nodes.values():
        node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
        node.close()


async def test_a_key_that_moved_since_the_map_was_read_is_read_where_it_went(valkey_url, valkey_cluster, cluster_url):
    """The lean per-shard connection does not follow MOVED: the script reports keys that are not local
    any more, and those shards' keys are read through the cluster's routing (which follows it)."""
    rng = random.Random(9)
    chain = [rng.randrange(1, 2**63) for _ in range(30)]
    pods = [f"pod-{i}" for i in range(6)]
    layout = {k: [encode_entry(make_entry(p, "GPU", 0)) for j, p in enumerate(pods) if i < 5 * (j + 1)]
              for i, k in enumerate(chain)}
    write((valkey_url, cluster_url), layout)
    single, ix = Index.from_url(valkey_url), Index.from_url(cluster_url)
    try:
        want = sorted((m.pod_id, m.blocks, m.tier) for m in await single.lookup(chain, mode="linear"))
        assert sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(chain)) == want  # the map is read
        move_slot(valkey_cluster, redis.RedisCluster.from_url(cluster_url).keyslot(str(chain[3])))
        assert sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(chain)) == want
        assert sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(chain)) == want
    finally:
        await single.close()
        await ix.close()


async def test_a_drop_whose_key_moved_since_the_map_was_read_still_prunes_its_engine_key(valkey_cluster, cluster_url):
    """A removal whose request key moved away since the write path read the slot map is refused by the old
    owner and goes again through the cluster's routing; the probe of its block's drop, which rode on that
    removal (no probe of its own was sent), goes with it, so the engine key loses the request key as on a
    single node."""
    rng = random.Random(31)
    pod, ek, rk = "moved-drop", rng.randrange(1, 2**63), rng.randrange(1, 2**63)
    client = redis.RedisCluster.from_url(cluster_url)
    ix = Index.from_url(cluster_url)
    try:
        r = await ix.apply_batch(pod_id=pod, rank=0, seq=0, ts=1.0, model="m", engine_block_size=16,
                                 mutations=[StoreBlock(ek, "gpu", encode_entry(make_entry(pod, "GPU", 0)), (rk,))])
        assert r.status == "applied", r
        assert client.zrange(f"engine:{ek}", 0, -1) == [str(rk).encode()]
        move_slot(valkey_cluster, client.keyslot(str(rk)))
        r = await ix.apply_batch(pod_id=pod, rank=0, seq=1, ts=1.0, model="m", engine_block_size=16,
                                 mutations=[RemoveBlock(ek, "gpu")])
        assert r.status == "applied", r
        assert not client.exists(str(rk)) and not client.exists(f"engine:{ek}")
    finally:
        await ix.close()
        client.close()


async def pod_step(ix: Index, pod: str, seq: int, muts: list) -> tuple[str, bytes]:
    """Step 1 of a cluster batch alone (the pod's seq and state, its outbox entry); its changes not run."""
    from kv_preflight.index.backend import evalsha_pipeline
    from kv_preflight.index.entries import apply_result, text
    from tests.integration.test_cluster import outbox_entry

    writes = ix.backend.writes
    (prep,) = await ix.plan_batches([dict(pod_id=pod, rank=0, seq=seq, ts=1.0, model="m", engine_block_size=16,
                                          mutations=muts)])
    payload = outbox_entry(prep.changes, prep.num)
    args = prep.head + [writes.writer_arg(), "1" if prep.gap else "0", payload]
    (reply,) = await evalsha_pipeline(ix.client, writes._pod_step, [prep.keys], [args])
    assert text(reply[0]) == "applied" and text(reply[5]), reply
    assert not ix.writer.settle([prep], [apply_result(reply[:5])])
    return text(reply[5]), payload


async def run_on_some_shards(ix: Index, payload: bytes, rng: random.Random, skip: str | None = None) -> None:
    """Round A of step 2 (the request keys' entries and bits, what a lookup reads) on some shards only: a
    random subset, or every shard but ``skip``. The batch is half applied, as when its writer is killed while
    the shards' runs are on their way."""
    from kv_preflight.index.cluster import node_for
    from kv_preflight.index.cluster.outbox_ops import key_op_args, read_payload
    from kv_preflight.index.pod_state import KeyChange

    entry = read_payload(payload)
    assert entry is not None
    ops = [c for c in entry.changes if type(c) is KeyChange]
    nodes = sorted({node_for(ix.client, str(op.rk)).name for op in ops})
    chosen = set(nodes) - {skip} if skip is not None else set(rng.sample(nodes, k=rng.randrange(0, len(nodes) + 1)))
    script = ix.backend.writes._effects
    for name in chosen:
        node = ix.client.get_node(node_name=name)
        args = [a for op in ops if node_for(ix.client, str(op.rk)).name == name for a in key_op_args(op, entry)]
        await script.registered_client.script_load(script.script)
        await ix.client.execute_command("EVALSHA", script.sha, 0, *args, target_nodes=node)


@pytest.mark.parametrize("seed", range(3))
async def test_bitmaps_equal_the_linear_walk_with_tiers_and_half_applied_batches(cluster_url, seed):
    """Written by our own apply path (so the bitmaps are what is read): pods at different lengths on
    two tiers, stores and tail evictions, and every batch first left half applied (its effects run on
    some shards only, so a pod's keys have gaps across shards, each shard's own keys still a prefix),
    then finished by a drain. The default lookup equals the exact linear walk over llm-d's entries at
    every step, whether a shard bisects (few pods at its first key) or walks every key (many)."""
    rng = random.Random(700 + seed)
    chain = [rng.randrange(1, 2**63) for _ in range(48)]
    pods = [f"half{seed}-{i}" for i in range(10)]  # names no other test on this cluster uses
    ix = Index.from_url(cluster_url)
    rounds = Rounds(ix.backend)
    try:
        await ix.ensure_numbers(pods)
        seqs = {p: -1 for p in pods}
        held: dict[str, set[int]] = {p: set() for p in pods}
        for _ in range(30):
            pod = rng.choice(pods)
            muts: list = []
            if rng.random() < 0.6 or not held[pod]:
                for i in range(rng.randrange(1, len(chain) + 1)):
                    if i not in held[pod]:
                        tier = rng.choice(["gpu", "gpu", "cpu"])
                        muts.append(StoreBlock(10_000 + i, tier, encode_entry(make_entry(pod, tier.upper(), 0)),
                                               (chain[i],)))
                        held[pod].add(i)
            else:  # evicted from the tail, as an engine does (the head of a chain outlives its tail)
                keep = rng.randrange(0, len(held[pod]))
                for i in sorted(held[pod], reverse=True)[:len(held[pod]) - keep]:
                    muts.append(RemoveBlock(10_000 + i, "gpu"))
                    muts.append(RemoveBlock(10_000 + i, "cpu"))
                    held[pod].discard(i)
            if not muts:  # it held all of that already
                continue
            seqs[pod] += 1
            _, payload = await pod_step(ix, pod, seqs[pod], muts)
            await run_on_some_shards(ix, payload, rng)
            for mode_pods in (None, rng.sample(pods, k=3)):
                want = sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(chain, mode_pods, mode="linear"))
                found, depth = await rounds.of(ix.lookup(chain, mode_pods))
                assert sorted((m.pod_id, m.blocks, m.tier) for m in found) == want
                assert depth <= 3, rounds.calls  # issue 9 item 4: at most 3 sequential rounds
            await ix.drain_outbox(pod)
            want = sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(chain, mode="linear"))
            found, depth = await rounds.of(ix.lookup(chain))
            assert sorted((m.pod_id, m.blocks, m.tier) for m in found) == want
            assert depth <= 3, rounds.calls
        assert any(m.blocks for m in await ix.lookup(chain))  # the walk saw some prefixes at all
        assert ix.backend.late_reads == 0  # every tier the merge wanted was known or read beside the walk
    finally:
        await ix.close()


async def test_each_key_is_sent_to_the_primary_serving_its_slot(cluster_url):
    """The lookup groups a chain's keys by shard through a slot table (kv_preflight/index/slots.py, in C). A wrong
    grouping would still answer right (the shard's script reports keys it does not own and the caller
    reads them through the routing) but with a second round for every prediction: compare with redis-py's
    own routing and with CLUSTER KEYSLOT instead."""
    rng = random.Random(7)
    chain = [rng.randrange(0, 2**64) for _ in range(2000)]
    ix = Index.from_url(cluster_url)
    ref = redis.RedisCluster.from_url(cluster_url)
    try:
        by_node, unanswered = await ix.backend.lookups._keys_by_node(chain)
        assert not unanswered
        assert sorted(i for _, idx in by_node.values() for i in idx) == list(range(len(chain)))
        for name, (_, idx) in by_node.items():
            for i in idx[::50]:
                assert ref.get_node_from_key(str(chain[i])).name == name
                assert key_slot(str(chain[i])) == int(ref.cluster_keyslot(str(chain[i])))  # Valkey's own
    finally:
        ref.close()
        await ix.close()


async def test_the_worst_case_takes_three_rounds(valkey_cluster, cluster_url):
    """A chain looked up for the first time (so no pod's meta is prefetched beside the first round): a pod
    with a gap (its meta read in round 2, then walked on the shards in round 3, its tier changing along the
    keys they walk) and a closed pod whose last batch is half applied (bisected; on the shard holding its
    last key it holds keys past that one on another tier, so its tier there must be read). Both answers
    equal the linear walk's in at most 3 sequential rounds; the chain again, its pods' meta read beside
    the shards, in 2; and in 3 still when a slot has moved too (its shard's keys read beside round 2). A
    slot moved under a key that only the walk reads (a bisection reads few keys) costs a 4th round, counted."""
    from kv_preflight.index.cluster import node_for
    from kv_preflight.index.entries import CHAIN_ROOT

    rng = random.Random(31)
    chain = [rng.randrange(1, 2**63) for _ in range(120)]
    gap, half = "worst-gap", "worst-half"
    ix = Index.from_url(cluster_url)
    try:
        await ix.ensure_numbers([gap, half])
        owner = [node_for(ix.client, str(k)).name for k in chain]
        q = next(i for i in range(30, 50) if owner[i - 1] != owner[i])  # the gap's block; its key before elsewhere
        k = next(i for i in range(80, 100) if owner[i - 1] != owner[i])  # where the half-applied batch starts

        def stores(pod: str, lo: int, hi: int, tier_of) -> list:
            return [StoreBlock(50_000 + i, tier_of(i), encode_entry(make_entry(pod, tier_of(i).upper(), 0)),
                               (chain[i],), parent=CHAIN_ROOT if i == 0 else chain[i - 1]) for i in range(lo, hi)]

        async def batch(pod: str, seq: int, muts: list, skip: str = "") -> None:
            _, payload = await pod_step(ix, pod, seq, muts)
            if not skip:
                await ix.drain_outbox(pod)
                return
            await run_on_some_shards(ix, payload, random.Random(0), skip=skip)

        await batch(gap, 0, stores(gap, 0, len(chain), lambda i: "gpu" if i < 60 else "cpu"))
        await batch(gap, 1, [RemoveBlock(50_000 + q, "gpu")])  # a gap: key q+1's parent gone (orphan count 1)
        await batch(half, 0, stores(half, 0, k, lambda i: "gpu"))
        await batch(half, 1, stores(half, k, len(chain), lambda i: "cpu"), skip=owner[k])  # not on k's shard

        fresh = Index.from_url(cluster_url)  # nothing prefetched: a chain it never looked up
        try:
            rounds = Rounds(fresh.backend)
            want = sorted((m.pod_id, m.blocks, m.tier) for m in await fresh.lookup(chain, mode="linear"))
            assert want == [(gap, q, "gpu"), (half, k, "gpu")]
            walks = fresh.gap_walks
            for depth_at_most in (3, 2):  # the second time, the pods' meta is read beside the first round
                found, depth = await rounds.of(fresh.lookup(chain))
                assert sorted((m.pod_id, m.blocks, m.tier) for m in found) == want
                assert depth <= depth_at_most, rounds.calls
            assert fresh.gap_walks > walks  # the gapped pod was walked, not bisected
            assert fresh.backend.late_reads == 0  # every tier needed was read beside the walk
        finally:
            await fresh.close()
        for seen_in_round_1 in (True, False):
            stale = Index.from_url(cluster_url)  # it learns the slot map, then a slot moves
            try:
                rounds = Rounds(stale.backend)
                await stale.lookup(chain[60:])
                owner = [node_for(stale.client, str(key)).name for key in chain]
                if seen_in_round_1:  # a shard's first key: every shard reads its own
                    moved = 0
                else:  # the 5th key of a shard holding the gapped pod past the gap's key: only the walk reads it
                    moved = [i for i in range(len(chain)) if owner[i] == owner[q - 1]][4]
                move_slot(valkey_cluster, key_slot(str(chain[moved])))
                found, depth = await rounds.of(stale.lookup(chain))
                assert sorted((m.pod_id, m.blocks, m.tier) for m in found) == want
                assert "_read_keys" in {name for _, _, name in rounds.calls}  # the moved slot's shard, read whole
                if seen_in_round_1:
                    assert depth <= 3, rounds.calls
                    assert stale.backend.late_reads == 0
                else:
                    assert stale.backend.late_reads == 1
            finally:
                await stale.close()
    finally:
        await ix.close()
