"""Layouts 1 (kv-preflight 0.1), 2 and 3 to layout 4: refused until migrated, `kv-preflight index migrate` moves
them with llm-d's keys untouched and writes what this build would have written, and a layout-1 writer appearing
later stops our ingester. Layout-3 indexes are made from layout-4 ones here (``to_layout_3``: each pod's reverse
index, field ids and reference counts, the engine keys' membership hashes, the old bitmaps), so "the same keys"
has a reference: the layout-4 index the ingester wrote."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import redis

from kv_preflight.index.entries import CHAIN_ROOT
from kv_preflight.index.index import Index, RemoveBlock, StoreBlock, encode_entry, make_entry
from kv_preflight.index.layout_version import LayoutError, check_layout
from kv_preflight.index.layout import (LAYOUT_KEY, NUMS_BYID_KEY, PODS_KEY, V1_PODS_KEY, is_presence_key, pod_meta_key, pod_state_key,
                                       v3_bits_key, v3_members_key, v3_pod_keys)
from kv_preflight.index.presence import as_int, numbers, presence_value
from kv_preflight.index.transfer import export_blocks, held_blocks
from tests.e2e.harness import spawn, stop

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

F = encode_entry(make_entry("old-pod", "GPU", 0))


def write_layout_1(r: redis.Redis) -> None:
    """What kv-preflight 0.1 left: two blocks (one held twice), one field written before ids."""
    r.hset(V1_PODS_KEY, "old-pod", "m")
    r.hset("kvpf:pod:old-pod", mapping={"model": "m", "seq:0": "41", "ts:0": "5.0", "batches": "42",
                                        "engine_block_size": "32"})
    r.hset("kvpf:fields:old-pod", "1", F)
    r.hset("kvpf:blocks:old-pod", mapping={"7|gpu": "1*2", "8|gpu": F})
    for ek, rks in ((7, ["70", "71"]), (8, ["72", "73"])):
        r.zadd(f"engine:{ek}", {rk: i for i, rk in enumerate(rks)})
        for rk in rks:
            r.hset(rk, F, "")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kv_preflight", *args], capture_output=True, text=True, timeout=120)


async def test_layout_1_is_refused_then_migrated(valkey_url):
    r = redis.Redis.from_url(valkey_url, decode_responses=True)
    write_layout_1(r)
    llmd_before = {k: r.hkeys(k) for k in ("70", "71", "72", "73")} | {k: r.zrange(k, 0, -1) for k in ("engine:7", "engine:8")}
    ix = Index.from_url(valkey_url)
    try:
        with pytest.raises(LayoutError, match="index migrate"):
            await check_layout(ix.client)
        refused = cli("index", "stats", "--valkey-url", valkey_url)
        assert refused.returncode != 0 and "index migrate" in refused.stderr
        done = cli("index", "migrate", "--valkey-url", valkey_url, "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"pods": 1, "blocks": 2, "keys": 4}
        assert await check_layout(ix.client) == "4"
        # llm-d's keys did not move; ours are layout 4; layout 1's are gone.
        assert {k: r.hkeys(k) for k in ("70", "71", "72", "73")} | {k: r.zrange(k, 0, -1) for k in ("engine:7", "engine:8")} == llmd_before
        assert not r.exists(V1_PODS_KEY, "kvpf:pod:old-pod", "kvpf:blocks:old-pod", "kvpf:fields:old-pod")
        assert await held_blocks(ix.writer, "old-pod") == {(7, "gpu", 0): ((70, 71), 2), (8, "gpu", 0): ((72, 73), 1)}
        assert r.hget(PODS_KEY, "old-pod") == "m" and r.hget(LAYOUT_KEY, "version") == "4"
        info = await ix.meta.pod_info("old-pod")
        assert info.seqs == {"0": 41} and info.counters["batches"] == 42 and info.blocks == 2
        assert info.orphan_keys is None  # layout 1 kept no parents: walked until known
        assert [m.blocks for m in await ix.lookup([70, 71, 72, 73], mode="linear")] == [4]
        assert [m.blocks for m in await ix.lookup([70, 71, 72, 73])] == [4]  # the presence, built by migrate
        # The migrated pod goes on at its next seq: copies kept, evictions find their request keys.
        for seq, muts in ((42, [RemoveBlock(7, "gpu")]), (43, [RemoveBlock(7, "gpu"), RemoveBlock(8, "gpu")])):
            res = await ix.apply_batch(pod_id="old-pod", rank=0, seq=seq, ts=6.0, model="m", engine_block_size=32,
                                       mutations=muts)
            assert res.status == "applied"
            if seq == 42:
                assert r.hkeys("70") == [F]  # one of two copies evicted: still held
        assert not r.exists("70", "71", "72", "73", "engine:7", "engine:8", "kvpf:{70}")
        again = cli("index", "migrate", "--valkey-url", valkey_url, "--json")  # idempotent
        assert again.returncode == 0 and json.loads(again.stdout)["pods"] == 0
    finally:
        r.close()
        await ix.close()


async def test_ingester_stops_when_a_layout_1_writer_appears(valkey_url, tmp_path):
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--source", "tcp://127.0.0.1:1"], str(tmp_path / "ing.log"))
    r = redis.Redis.from_url(valkey_url)
    try:
        deadline = time.monotonic() + 10
        while not r.hget(LAYOUT_KEY, "version") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert ing.poll() is None
        r.hset(V1_PODS_KEY, "someone", "m")  # a kv-preflight 0.1 ingester writes beside us
        deadline = time.monotonic() + 10
        while ing.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert ing.poll() is not None, "the ingester kept writing beside a layout-1 writer"
        assert "layout 1" in (tmp_path / "ing.log").read_text()
    finally:
        stop(ing)
        r.close()


def keys_of(client) -> list[bytes]:
    nodes = client.get_primaries() if isinstance(client, redis.RedisCluster) else [None]
    return [k for node in nodes for k in (client.keys("*", target_nodes=node) if node else client.keys("*"))]


async def to_layout_3(ix: Index, client, *, version: str = "3") -> None:
    """Rewrite a layout-4 index as layout 3 (or 2: no bitmaps, no parents) had it: per pod its reverse
    index ("<ek>|<tier>[|<group>]" -> "<id>[*<copies>]:<rk>,..[^<parent>]"), field ids and reference counts,
    per engine key its holders, per request key its bitmaps and our entry count; no state logs, no presence."""
    pods = {k.decode(): v.decode() for k, v in client.hgetall(PODS_KEY).items()}
    members: dict[int, dict[str, int]] = {}
    bits: dict[int, dict[str, int]] = {}
    counts: dict[int, int] = {}
    nums = {v.decode(): int(k) for k, v in client.hgetall(NUMS_BYID_KEY).items()}
    for pod in pods:
        held = await held_blocks(ix.writer, pod)
        blocks_key, fields_key, rks_key = v3_pod_keys(pod)
        reader = ix.writer.__class__(ix.client, cluster=ix.cluster)
        await reader.load([pod])
        state = reader.pods[pod].state
        fields: dict[str, int] = {}
        refs: dict[str, int] = {}
        for (ek, tier, group), b in state.blocks.items():
            fid = fields.setdefault(b.field, len(fields) + 1)
            slot = f"{tier}|{group}" if group else tier
            head = f"{fid}*{b.copies}" if b.copies > 1 else str(fid)
            tail = "" if version == "2" or b.parent is None else "^" + ("" if b.parent == CHAIN_ROOT else str(b.parent))
            client.hset(blocks_key, f"{ek}|{slot}", f"{head}:{','.join(map(str, b.rks))}{tail}")
            members.setdefault(ek, {})[f"{pod}|{slot}"] = 1
            for rk in b.rks:
                refs[f"{rk}|{fid}"] = refs.get(f"{rk}|{fid}", 0) + 1
        assert len(held) == len(state.blocks)
        if fields:
            client.hset(fields_key, mapping={str(i): f for f, i in fields.items()})
            client.hset(rks_key, mapping=refs)
        for (rk, name), _ in state.bit_refs.items():
            if version == "3":
                tier = name.split("|", 1)[0]
                bits.setdefault(rk, {})[tier] = bits.get(rk, {}).get(tier, 0) | 1 << nums[pod]
        for (rk, _), _ in state.entry_refs.items():
            counts[rk] = counts.get(rk, 0) + 1
        client.delete(pod_state_key(pod))
        client.hdel(pod_meta_key(pod), "gen", "blocks")
    for ek, m in members.items():
        client.hset(v3_members_key(ek), mapping=m)
    for rk, tiers in bits.items():
        client.hset(v3_bits_key(rk), mapping={**{t: b.to_bytes((b.bit_length() + 7) // 8, "little") for t, b in tiers.items()},
                                              "#n": counts[rk]})
    for k in keys_of(client):
        if is_presence_key(k):
            client.delete(k)
    client.hset(LAYOUT_KEY, "version", version)


def by_name(client) -> dict:
    """The index's keys with pod numbers replaced by pod names and pods' states by what they hold (migrate
    writes a snapshot where the ingester left a snapshot and batches; numbers follow the writers' order)."""
    from tests.integration.test_cluster import dump

    names = {int(k): v.decode() for k, v in client.hgetall(NUMS_BYID_KEY).items()}
    out = {}
    for k, v in dump(client).items():
        if k.startswith("kvpf:{nums}") or k == "kvpf:layout" or k.endswith("}:state"):
            continue
        if k.endswith(":meta"):
            v = {f: x for f, x in v.items() if f not in ("num", "gen", "orphan_at", "batches")}
        if is_presence_key(k):
            v = {}
            for f, x in client.hgetall(k).items():
                n, bitmap = presence_value(x)
                v[f.decode()] = (n, sorted(names[i] for i in numbers(as_int(bitmap))))
        out[k] = v
    return out


async def held_by_pod(ix: Index, client) -> dict:
    pods = [k.decode() for k in client.hkeys(PODS_KEY)]
    return {p: await held_blocks(ix.writer, p) for p in sorted(pods)}


async def apply_hybrid(ix: Index) -> None:
    """A hybrid pod whose full-attention group is group 1 (its sliding-window group 0 holds blocks 1 and 3): its
    prefix group, and so which presence fields its blocks set, comes from its groups, which migrate must keep."""
    from kv_preflight.engines.hit_rules import FULL, SLIDING, GroupSpec
    from kv_preflight.index.index import StoreBlock

    groups = {0: GroupSpec(SLIDING, 32, 64), 1: GroupSpec(FULL, 32)}
    stores = [StoreBlock(900 + b, "gpu", encode_entry(make_entry("pod-h", "GPU", g)), (9000 + 2 * b, 9001 + 2 * b), g)
              for b in range(4) for g in (0, 1) if g == 1 or b in (1, 3)]
    r = await ix.apply_batch(pod_id="pod-h", rank=0, seq=0, ts=1.0, model="m", engine_block_size=32,
                             mutations=stores, groups=groups)
    assert r.status == "applied", r


@pytest.mark.parametrize("version", ["3", "2"])
async def test_layouts_2_and_3_are_refused_then_migrated_to_what_layout_4_writes(valkey_url, version):
    """An index this build wrote, taken back to layout 3 (or 2), refused, then migrated: every key is what
    this build had written (presence, meta, pods' blocks and copies; a hybrid pod's groups), and the lookup
    equals the linear walk."""
    from tests.integration.test_cluster import apply_all, random_batches

    r = redis.Redis.from_url(valkey_url)
    ix = Index.from_url(valkey_url)
    try:
        await apply_all(ix, random_batches(3))
        await apply_hybrid(ix)
        r.hset("75", "llmd-only@gpu", "")  # an llm-d writer's entry: never counted as ours
        before, held = by_name(r), await held_by_pod(ix, r)
        await to_layout_3(ix, r, version=version)
        assert by_name(r) != before
        fresh = Index.from_url(valkey_url)
        with pytest.raises(LayoutError, match=f"layout {version}.*index migrate"):
            await check_layout(fresh.client)
        await fresh.close()
        done = cli("index", "migrate", "--valkey-url", valkey_url, "--json")
        assert done.returncode == 0, done.stderr
        assert by_name(r) == before
        assert await held_by_pod(ix, r) == held
        assert not [k for k in keys_of(r) if k.endswith((b":bits", b"}:blocks", b"}:fields", b"}:rks", b"}:pods"))]
        for k in range(1, 400):
            chain = [k * 10 + j for j in range(3)]
            want = sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(chain, mode="linear"))
            assert sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(chain)) == want
    finally:
        r.close()
        await ix.close()


async def test_layout_3_on_a_cluster_is_migrated_to_what_layout_4_writes(cluster_url):
    """The same on Valkey Cluster, where the keys to rebuild sit on every shard (the command runs through
    redis-py's cluster client: pipelines routed per key, one SCAN per primary)."""
    from tests.integration.test_cluster import apply_all, drain_until_empty, random_batches

    ix = Index.from_url(cluster_url)
    sync = redis.RedisCluster.from_url(cluster_url)
    try:
        await apply_all(ix, random_batches(3))
        await apply_hybrid(ix)
        await drain_until_empty(ix, sync)
        chains = [[k * 10 + j for j in range(3)] for k in range(1, 400)]
        want = [sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(c, mode="linear")) for c in chains]
        before, held = by_name(sync), await held_by_pod(ix, sync)
        await to_layout_3(ix, sync)
        assert [k for k in keys_of(sync) if k.endswith(b":bits")]
        done = cli("index", "migrate", "--valkey-url", cluster_url, "--json")
        assert done.returncode == 0, done.stderr
        assert by_name(sync) == before and await held_by_pod(ix, sync) == held
        fresh = Index.from_url(cluster_url)
        try:
            assert await check_layout(fresh.client) == "4"
            assert [sorted((m.pod_id, m.blocks, m.tier) for m in await fresh.lookup(c)) for c in chains] == want
        finally:
            await fresh.close()
    finally:
        sync.close()
        await ix.close()


async def test_layout_3_is_migrated_while_its_engines_go_on_publishing(valkey_url, tmp_path):
    """The upgrade as CHANGELOG.md gives it, under live ingestion: two engines publish throughout; their
    ingester (the old build) stops and leaves a layout-3 index; a new ingester started before the migration
    refuses, saying what to run; ``index migrate`` runs while the engines publish; the new ingester then
    replays what it missed from each engine's buffer and the index is exact (every pod's blocks are the
    engine's stored-minus-removed, every request key lists them, no pod incomplete), and the lookup equals the
    linear walk over llm-d's entries."""
    from kv_preflight.cli.valkey_server import free_port
    from tests.integration.engine_stub import EngineStub
    from tests.integration.test_faults import Workload, publish, wait_for_seq
    from tests.integration.truth import engine_truth, index_state

    pods = ("pod-a", "pod-b")
    engines, sources, loads = {}, [], {}
    for i, pod in enumerate(pods):
        zport, rport = free_port(), free_port()
        # a replay buffer of 60 batches, like an engine's bounded one: what the ingester missed while it was
        # down (30 batches) and what comes after (20) is there, the first 30 batches are not: only the migrated
        # state knows them
        engines[pod] = EngineStub(f"tcp://127.0.0.1:{zport}", f"tcp://127.0.0.1:{rport}", f"kv@{pod}@tiny", buffer=60)
        sources += ["--source", f"tcp://127.0.0.1:{zport},replay=tcp://127.0.0.1:{rport}"]
        loads[pod] = Workload(seed=i + 7)

    async def publish_all(n: int) -> None:
        await asyncio.gather(*(publish(engines[p], loads[p], n) for p in pods))

    def counts() -> dict[str, int]:  # taken before an ingester starts: its subscription may come at once
        return {p: e.count_subscriptions() for p, e in engines.items()}

    async def subscribed(since: dict[str, int]) -> None:
        for p, e in engines.items():
            await e.subscribed(since[p] + 1)

    r = redis.Redis.from_url(valkey_url)
    ix = Index.from_url(valkey_url)
    seen = counts()
    ing = spawn(["ingest", "--valkey-url", valkey_url, *sources], str(tmp_path / "old.log"))
    try:
        await subscribed(seen)
        await publish_all(40)
        for p in pods:
            await wait_for_seq(ix, p, engines[p].seq - 1)
        stop(ing)  # the old build's ingester stops ...
        await to_layout_3(ix, r)  # ... and leaves its layout
        await publish_all(15)  # the engines go on; nobody listens
        early = spawn(["ingest", "--valkey-url", valkey_url, *sources], str(tmp_path / "early.log"))
        assert early.wait(timeout=60) != 0
        said = (tmp_path / "early.log").read_text()
        assert "layout 3" in said and "index migrate" in said, said
        done, _ = await asyncio.gather(asyncio.to_thread(cli, "index", "migrate", "--valkey-url", valkey_url, "--json"),
                                       publish_all(15))
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["pods"] == 2
        assert r.hget(LAYOUT_KEY, "version") == b"4"
        seen = counts()
        ing = spawn(["ingest", "--valkey-url", valkey_url, *sources], str(tmp_path / "new.log"))
        await subscribed(seen)
        await publish_all(20)
        fresh = Index.from_url(valkey_url)
        try:
            for p in pods:
                await wait_for_seq(fresh, p, engines[p].seq - 1, timeout=30.0)
                assert await index_state(fresh, p) == engine_truth(loads[p].batches)
                assert not (await fresh.meta.pod_info(p)).incomplete
            # nothing left behind in llm-d's keys: the blocks stored before the upgrade were evicted after it
            # (the engines keep 40 live), and only the migrated state knew their request keys
            held_rks: dict[str, set[bytes]] = {}
            fields: dict[str, bytes] = {}
            live_eks = set()
            for p in pods:
                async for blk in export_blocks(fresh.writer, p):
                    fields[p] = blk.entry_field.encode()
                    held_rks.setdefault(p, set()).update(str(rk).encode() for rk in blk.request_keys)
                    live_eks.add(blk.engine_key)
            llmd = [k for k in r.keys("*") if not k.startswith((b"kvpf:", b"engine:"))]
            for p in pods:
                assert {k for k in llmd if r.hexists(k, fields[p])} == held_rks[p], p
            assert {k for k in r.keys("engine:*")} == {f"engine:{ek}".encode() for ek in live_eks}
            # chains through each engine's live request keys, from their first: the lookup and the linear walk
            for p in pods:
                held = sorted([(s.engine_key, s.request_keys) async for s in export_blocks(fresh.writer, p)])
                for _, rks in held[:40]:
                    chain = list(rks)
                    want = sorted((m.pod_id, m.blocks, m.tier) for m in await fresh.lookup(chain, mode="linear"))
                    assert want and sorted((m.pod_id, m.blocks, m.tier) for m in await fresh.lookup(chain)) == want
        finally:
            await fresh.close()
    finally:
        stop(ing)
        for e in engines.values():
            e.close()
        r.close()
        await ix.close()


async def test_migrate_says_layout_4_refuses_live_ingesters_and_leaves_a_layout_4_index_alone(valkey_url):
    """Issue 42, item 3: `index migrate` said "layout 3" on a layout-4 index and ran without a word while
    ingesters were live, though its help said to stop them; run on a layout-4 index it deleted every presence
    hash and rebuilt none (no pod had an old reverse index), so every lookup missed. Its help and answer now
    say layout 4, it refuses while an ingester's lease is live (--force runs it), and it leaves a layout-4
    index as it is."""
    from kv_preflight.fleet.records import IngesterLease

    assert "to layout 4" in cli("index", "migrate", "--help").stdout
    r = redis.Redis.from_url(valkey_url)
    ix = Index.from_url(valkey_url)
    try:
        await check_layout(ix.client)  # a layout-4 index, as this build's processes leave it
        await ix.apply_batch(pod_id="p4", rank=0, seq=0, ts=1.0, model="m", engine_block_size=16,
                             mutations=[StoreBlock(
                                 7, "gpu", encode_entry(make_entry("p4", "GPU", 0)), (70, 71))])
        presence = sorted(k for k in keys_of(r) if is_presence_key(k))
        assert presence and [m.blocks for m in await ix.lookup([70, 71])] == [2]
        now_ms = int(time.time() * 1000)
        await ix.fleet.put_lease("ing-live", IngesterLease(expires_ms=now_ms + 600_000, started_ms=now_ms))
        done = cli("index", "migrate", "--valkey-url", valkey_url)
        assert done.returncode == 0 and "already of layout 4: nothing to migrate" in done.stdout, done.stdout + done.stderr
        assert sorted(k for k in keys_of(r) if is_presence_key(k)) == presence
        assert [m.blocks for m in await ix.lookup([70, 71])] == [2]

        r.hset(LAYOUT_KEY, "version", "3")  # an old index whose ingester is still live
        refused = cli("index", "migrate", "--valkey-url", valkey_url)
        assert refused.returncode == 1 and "ing-live" in refused.stderr and "--force" in refused.stderr, refused.stderr
        assert r.hget(LAYOUT_KEY, "version") == b"3"
        forced = cli("index", "migrate", "--valkey-url", valkey_url, "--force")
        assert forced.returncode == 0 and "layout 4" in forced.stdout and "layout 3" not in forced.stdout, forced.stdout
        assert r.hget(LAYOUT_KEY, "version") == b"4"
    finally:
        r.close()
        await ix.close()
