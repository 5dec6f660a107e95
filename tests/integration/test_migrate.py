"""Layouts 1 (kv-preflight 0.1) and 2 to layout 3: refused until migrated, `kv-preflight index migrate`
moves them with llm-d's keys untouched, and a layout-1 writer appearing later stops our ingester."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import redis

from kv_preflight.index.index import Index, LayoutError, RemoveBlock, encode_entry, make_entry
from kv_preflight.index.layout import LAYOUT_KEY, PODS_KEY, V1_PODS_KEY, engine_members_key, pod_blocks_key, pod_rks_key
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
    return subprocess.run([sys.executable, "-m", "kv_preflight", *args], capture_output=True, text=True, timeout=60)


async def test_layout_1_is_refused_then_migrated(valkey_url):
    r = redis.Redis.from_url(valkey_url, decode_responses=True)
    write_layout_1(r)
    llmd_before = {k: r.hkeys(k) for k in ("70", "71", "72", "73")} | {k: r.zrange(k, 0, -1) for k in ("engine:7", "engine:8")}
    ix = Index.from_url(valkey_url)
    try:
        with pytest.raises(LayoutError, match="index migrate"):
            await ix.check_layout()
        refused = cli("index", "stats", "--valkey-url", valkey_url)
        assert refused.returncode != 0 and "index migrate" in refused.stderr
        done = cli("index", "migrate", "--valkey-url", valkey_url, "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"pods": 1, "blocks": 2, "keys": 4}
        assert await ix.check_layout() == "3"
        # llm-d's keys did not move; ours are layout 2; layout 1's are gone.
        assert {k: r.hkeys(k) for k in ("70", "71", "72", "73")} | {k: r.zrange(k, 0, -1) for k in ("engine:7", "engine:8")} == llmd_before
        assert not r.exists(V1_PODS_KEY, "kvpf:pod:old-pod", "kvpf:blocks:old-pod", "kvpf:fields:old-pod")
        assert r.hgetall(pod_blocks_key("old-pod")) == {"7|gpu": "1*2:70,71", "8|gpu": "1:72,73"}
        assert r.hget(pod_rks_key("old-pod"), "72|1") == "1"
        assert r.hgetall(engine_members_key(7)) == {"old-pod|gpu": "1"}
        assert r.hget(PODS_KEY, "old-pod") == "m" and r.hget(LAYOUT_KEY, "version") == "3"
        info = await ix.pod_info("old-pod")
        assert info.seqs == {"0": 41} and info.counters["batches"] == 42 and info.blocks == 2
        assert [m.blocks for m in await ix.lookup([70, 71, 72, 73], mode="linear")] == [4]
        assert [m.blocks for m in await ix.lookup([70, 71, 72, 73])] == [4]  # the bitmaps, built by migrate
        # The migrated pod goes on at its next seq: copies kept, evictions find their request keys.
        for seq, muts in ((42, [RemoveBlock(7, "gpu")]), (43, [RemoveBlock(7, "gpu"), RemoveBlock(8, "gpu")])):
            res = await ix.apply_batch(pod_id="old-pod", rank=0, seq=seq, ts=6.0, model="m", engine_block_size=32,
                                       mutations=muts)
            assert res.status == "applied"
            if seq == 42:
                assert r.hkeys("70") == [F]  # one of two copies evicted: still held
        assert not r.exists("70", "71", "72", "73", "engine:7", "engine:8", engine_members_key(7))
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


def by_name(r: redis.Redis) -> dict:
    """The index's keys with pod numbers replaced by pod names (migrate numbers pods in its own order)."""
    from tests.integration.test_cluster import dump

    from kv_preflight.index.layout import NUMS_BYID_KEY
    from kv_preflight.index.presence import as_int, numbers

    names = {int(k): v.decode() for k, v in r.hgetall(NUMS_BYID_KEY).items()}
    out = {}
    for k, v in dump(r).items():
        if k.startswith("kvpf:{nums}") or k == "kvpf:layout":
            continue
        if k.endswith(":meta"):
            v = {f: x for f, x in v.items() if f != "num"}
        if k.endswith(":bits"):
            raw = r.hgetall(k)
            v = {f.decode(): (x.decode() if f == b"#n" else sorted(names[n] for n in numbers(as_int(x))))
                 for f, x in raw.items()}
        out[k] = v
    return out


def strip_to_layout_2(r: redis.Redis, *, version: bool = True) -> None:
    """What layout 2 had: no bitmaps, no numbers, no per-tier link counts."""
    for k in list(r.scan_iter("kvpf:{*")):
        if k.endswith(b":bits") or k.startswith(b"kvpf:{nums}"):
            r.delete(k)
        elif k.endswith(b":rks"):
            for f in r.hkeys(k):
                if b"|~" in f:
                    r.hdel(k, f)
        elif k.endswith(b":meta"):
            r.hdel(k, "num")
    if version:
        r.hset(LAYOUT_KEY, "version", "2")


async def test_layout_2_is_refused_then_migrated_to_the_same_keys(valkey_url):
    """An index written by this build, taken back to layout 2, refused, then migrated: every key is
    what this build had written (bitmaps, numbers, counts), and the lookup equals the linear walk."""
    from tests.integration.test_cluster import apply_all, random_batches

    r = redis.Redis.from_url(valkey_url)
    ix = Index.from_url(valkey_url)
    try:
        await apply_all(ix, random_batches(3))
        r.hset("75", "llmd-only@gpu", "")  # an llm-d writer's entry: never counted as ours
        before = by_name(r)
        strip_to_layout_2(r)
        assert by_name(r) != before
        fresh = Index.from_url(valkey_url)
        with pytest.raises(LayoutError, match="layout 2.*index migrate"):
            await fresh.check_layout()
        await fresh.close()
        done = cli("index", "migrate", "--valkey-url", valkey_url, "--json")
        assert done.returncode == 0, done.stderr
        assert by_name(r) == before
        for k in range(1, 400):
            chain = [k * 10 + j for j in range(3)]
            want = sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(chain, mode="linear"))
            assert sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(chain)) == want
    finally:
        r.close()
        await ix.close()


async def test_layout_2_on_a_cluster_is_migrated_to_the_same_bitmaps(cluster_url):
    """The same on Valkey Cluster, where the keys to rebuild sit on every shard (the command runs through
    redis-py's cluster client: pipelines routed per key, one SCAN per primary)."""
    from tests.integration.test_cluster import apply_all, random_batches

    ix = Index.from_url(cluster_url)
    sync = redis.RedisCluster.from_url(cluster_url)
    try:
        await apply_all(ix, random_batches(3))
        chains = [[k * 10 + j for j in range(3)] for k in range(1, 400)]
        want = [sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(c, mode="linear")) for c in chains]
        bits = sorted(sync.scan_iter("kvpf:{*}:bits", target_nodes=redis.RedisCluster.PRIMARIES))
        assert bits
        for node in sync.get_primaries():
            strip_to_layout_2(redis.Redis(host=node.host, port=node.port), version=False)
        sync.hset(LAYOUT_KEY, "version", "2")
        assert not list(sync.scan_iter("kvpf:{*}:bits", target_nodes=redis.RedisCluster.PRIMARIES))
        done = cli("index", "migrate", "--valkey-url", cluster_url, "--json")
        assert done.returncode == 0, done.stderr
        assert sorted(sync.scan_iter("kvpf:{*}:bits", target_nodes=redis.RedisCluster.PRIMARIES)) == bits
        fresh = Index.from_url(cluster_url)
        try:
            assert await fresh.check_layout() == "3"
            assert [sorted((m.pod_id, m.blocks, m.tier) for m in await fresh.lookup(c)) for c in chains] == want
        finally:
            await fresh.close()
    finally:
        sync.close()
        await ix.close()
