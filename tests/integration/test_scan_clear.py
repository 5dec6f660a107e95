"""``kv-preflight index clear --pod P --scan`` (kv_preflight/index/scan_clear.py): a pod whose state log does not
read, cleared by a scan of the keyspace, on a single node and on a Valkey Cluster, by the real CLI process."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from kv_preflight.index.entries import CHAIN_ROOT, StoreBlock, encode_entry, make_entry
from kv_preflight.index.index import Index
from kv_preflight.index.layout import (ENGINE_KEY_MATCH, REQUEST_KEY_MATCH, engine_key_name, is_request_key_name,
                                       pod_meta_key, pod_state_key, presence_key)
from kv_preflight.index.pod_log import PodLogError
from kv_preflight.index.presence import presence_value
from kv_preflight.index.scan_clear import clear_by_scan
from kv_preflight.index.transfer import held_blocks

pytestmark = pytest.mark.integration

CHAIN = [1000 + i for i in range(20)]  # pod-a's chain; pod-b shares its first 10 keys
B_CHAIN = CHAIN[:10] + [1020 + i for i in range(5)]
JUNK = b"\xc1junk"


def kvpf(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kv_preflight", *args], capture_output=True, text=True, timeout=120)


def blocks(pod: str, rks: list[int], tier: str = "gpu", group: int = 0) -> list[StoreBlock]:
    entry = encode_entry(make_entry(pod, tier, group))
    return [StoreBlock(rk - 500, tier, entry, (rk,), group=group, parent=CHAIN_ROOT if i == 0 else rks[i - 1])
            for i, rk in enumerate(rks)]


async def fill(ix: Index) -> None:
    """pod-a: its chain on gpu, its first 5 keys on cpu too, 3 keys of a second KV cache group; pod-b: the chain's
    first 10 keys (the same engine blocks: shared request keys and engine keys) and 5 of its own; pod-c a key of
    pod-a's alone."""
    await ix.apply_batch(pod_id="pod-a", rank=0, seq=0, ts=1.0, model="m", engine_block_size=16,
                         mutations=blocks("pod-a", CHAIN) + blocks("pod-a", CHAIN[:5], "cpu")
                         + blocks("pod-a", CHAIN[:3], group=1))
    await ix.apply_batch(pod_id="pod-b", rank=0, seq=0, ts=1.0, model="m", engine_block_size=16,
                         mutations=blocks("pod-b", B_CHAIN))
    await ix.apply_batch(pod_id="pod-c", rank=0, seq=0, ts=1.0, model="m", engine_block_size=16,
                         mutations=blocks("pod-c", CHAIN[15:16], "cpu"))


async def keyspace(ix: Index) -> dict[str, object]:
    """Every request key's entries, every presence hash's fields, every engine key's members."""
    out: dict[str, object] = {}
    async for name in ix.client.scan_iter(match=REQUEST_KEY_MATCH):
        if is_request_key_name(name):
            out[name.decode()] = sorted(f.decode() for f in await ix.client.hkeys(name))
            pres = await ix.client.hgetall(presence_key(name.decode()))
            if pres:
                out["bits " + name.decode()] = {k.decode(): presence_value(v) for k, v in pres.items()}
    async for name in ix.client.scan_iter(match=ENGINE_KEY_MATCH):
        out[name.decode()] = sorted(await ix.client.zrange(name, 0, -1))
    return out


def without(space: dict[str, object], pod: str, num: int) -> dict[str, object]:
    """What the keyspace is with the pod's entries and bit gone, and keys left with nothing dropped (llm-d's
    pruning of engine keys whose request keys hold no entry)."""
    out: dict[str, object] = {}
    for k, v in space.items():
        if k.startswith("bits "):
            continue
        if is_request_key_name(k):
            kept = [f for f in v if json.loads(f)["PodIdentifier"] != pod]
            if kept:
                out[k] = kept
    for k, v in space.items():
        if k.startswith("bits ") and k[5:] in out:
            bits = {}
            for name, (n, bm) in v.items():
                mine = len(bm) > num // 8 and bm[num // 8] & (1 << num % 8)
                rest = bytearray(bm)
                if mine:
                    rest[num // 8] &= ~(1 << num % 8) & 0xFF
                rest = bytes(rest).rstrip(b"\0")
                if rest:
                    bits[name] = (n - 1 if mine else n, rest)
            if bits:
                out[k] = bits
        elif k.startswith(ENGINE_KEY_MATCH[:-1]) and all(m.decode() in out for m in v):
            out[k] = v
    return out


@pytest.fixture(params=["single", "cluster"])
def url(request):
    return request.getfixturevalue("valkey_url" if request.param == "single" else "cluster_url")


def test_clear_scan_removes_a_pod_whose_log_does_not_read_and_nothing_of_the_others(url):
    """A pod whose state log holds junk could not be cleared: its entries stayed in the index, flagged, for good
    ("nothing clears it yet"). `index clear --scan` finds them without the log: the pod's entries (both tiers,
    both groups) and its bits go, pod-b's entries on the same request keys and engine keys stay, and lookups of
    pod-b answer as before; the pod is then empty, numbered, flagged as a clear leaves it, and its next batch
    applies. Run again it is refused (the log reads), as it is for pod-b."""
    async def before():
        async with Index.from_url(url) as ix:
            await fill(ix)
            space = await keyspace(ix)
            await ix.client.hset(pod_state_key("pod-a"), "s", JUNK)
            nums = await ix.ensure_numbers(["pod-a"])
            assert {m.pod_id: m.blocks for m in await ix.lookup(B_CHAIN)} == {"pod-a": 10, "pod-b": 15}
            b_bits = [m for m in await ix.lookup(B_CHAIN) if m.pod_id == "pod-b"]
            b_linear = [m for m in await ix.lookup(B_CHAIN, mode="linear") if m.pod_id == "pod-b"]
            return space, nums["pod-a"], b_bits, b_linear, await ix.lookup(CHAIN)

    space, num, b_bits, b_linear, a_chain = asyncio.run(before())
    assert {m.pod_id: m.blocks for m in a_chain} == {"pod-a": 20, "pod-b": 10}
    out = kvpf("index", "clear", "--pod", "pod-a", "--scan", "--json", "--valkey-url", url)
    assert out.returncode == 0, out.stderr
    tally = json.loads(out.stdout)
    assert tally["fields_removed"] == 28 and tally["bits_cleared"] == 28 and tally["keys_held"] == 20, tally
    assert tally["engine_members_removed"] == 9 and tally["request_keys_scanned"] >= 25, tally
    assert "request key(s) scanned" in out.stderr and "Traceback" not in out.stderr

    async def after():
        async with Index.from_url(url) as ix:
            got = await keyspace(ix)
            assert got == without(space, "pod-a", num)
            assert await ix.lookup(B_CHAIN) == b_bits and await ix.lookup(B_CHAIN, mode="linear") == b_linear, \
                (await ix.lookup(B_CHAIN), b_bits)
            assert {m.pod_id: m.blocks for m in await ix.lookup(CHAIN)} == {"pod-b": 10}
            info = await ix.meta.pod_info("pod-a")
            assert info.blocks == 0 and info.incomplete and "--scan" in info.incomplete_reason, info
            assert info.seqs == {"0": 0}  # kept, as a clear keeps them
            assert await held_blocks(ix.writer, "pod-a") == {}  # the log reads
            assert (await ix.ensure_numbers(["pod-a"]))["pod-a"] == num
            r = await ix.apply_batch(pod_id="pod-a", rank=0, seq=1, ts=2.0, model="m", engine_block_size=16,
                                     mutations=blocks("pod-a", CHAIN[:4]))
            assert r.status == "applied"
            assert {m.pod_id: m.blocks for m in await ix.lookup(CHAIN)} == {"pod-a": 4, "pod-b": 10}
            return got

    got = asyncio.run(after())
    for pod in ("pod-a", "pod-b"):  # run again (its log reads now), and on a pod whose log reads: refused
        out = kvpf("index", "clear", "--pod", pod, "--scan", "--valkey-url", url)
        assert out.returncode == 1 and out.stderr.strip().splitlines() == [
            f"Error: pod {pod}: its state log reads: `index clear --pod {pod}` clears it from its log (--scan is "
            "for a pod whose state log does not read)"], out.stderr

    async def unchanged():
        async with Index.from_url(url) as ix:
            assert (await keyspace(ix))["1020"] == got["1020"]
            assert {m.pod_id: m.blocks for m in await ix.lookup(CHAIN)} == {"pod-a": 4, "pod-b": 10}

    asyncio.run(unchanged())


def test_clear_scan_cut_short_leaves_the_pod_flagged_and_refused_and_runs_again(valkey_url):
    """A scan cut short (here after its request keys, before its engine keys) leaves the pod's log as it was, so
    the pod stays flagged and its batches refused, even those of a writer that planned from the state it held
    before the log went bad (the scan moved the pod's generation first); run again, it finishes."""
    class Cut(Exception):
        pass

    async def go():
        async with Index.from_url(valkey_url) as ix, Index.from_url(valkey_url) as writer:
            await fill(ix)
            await writer.apply_batch(pod_id="pod-a", rank=0, seq=1, ts=2.0, model="m", engine_block_size=16,
                                     mutations=blocks("pod-a", CHAIN[:2], "disk"))  # it holds the pod's state
            await ix.client.hset(pod_state_key("pod-a"), "s", JUNK)  # (its generation kept)
            refused = []

            def cut(tally):
                if tally.phase == "engine keys":
                    raise Cut()

            with pytest.raises(Cut):
                await clear_by_scan(ix, "pod-a", progress=cut)
            with pytest.raises(PodLogError):
                await writer.apply_batch(pod_id="pod-a", rank=0, seq=2, ts=3.0, model="m", engine_block_size=16,
                                         mutations=blocks("pod-a", CHAIN[:6]))
            info = await ix.meta.pod_info("pod-a")
            assert info.incomplete and "being cleared by a scan" in info.incomplete_reason and info.seqs == {"0": 1}
            assert await ix.client.hget(pod_state_key("pod-a"), "s") == JUNK
            assert {m.pod_id for m in await ix.lookup(CHAIN)} == {"pod-b"}
            assert await ix.client.exists(engine_key_name(CHAIN[16] - 500))  # not pruned yet
            tally = await clear_by_scan(ix, "pod-a", progress=refused.append)
            assert tally.done and tally.fields_removed == 0 and tally.engine_members_removed == 9, tally
            assert refused and refused[-1].phase == "engine keys"
            assert not await ix.client.exists(engine_key_name(CHAIN[16] - 500))
            assert (await ix.client.hgetall(presence_key(CHAIN[15])) or {}) != {}  # pod-c's bit, kept
            assert {m.pod_id for m in await ix.lookup(CHAIN)} == {"pod-b"}
            info = await ix.meta.pod_info("pod-a")
            assert info.incomplete and "--scan" in info.incomplete_reason and info.blocks == 0
            r = await writer.apply_batch(pod_id="pod-a", rank=0, seq=2, ts=3.0, model="m", engine_block_size=16,
                                         mutations=blocks("pod-a", CHAIN[:6]))
            assert r.status == "applied"
            assert await ix.client.hget(pod_meta_key("pod-a"), "blocks") == b"6"

    asyncio.run(go())


def test_clear_scan_of_a_data_parallel_rank_leaves_the_entries_its_sibling_holds(valkey_url):
    """A rank's llm-d entries name its pod, shared with its sibling ranks: the scan of rank 1 deletes an entry only
    where no sibling's bit is left (rank 0 holds the chain's first 5 keys: their entries stay, rank 1's bit goes),
    and lookups of rank 0 answer as before."""
    async def go():
        async with Index.from_url(valkey_url) as ix:
            await ix.ensure_numbers(["vllm-0", "vllm-0@dp1"])
            for rank, rks in ((0, CHAIN[:5]), (1, CHAIN[:8])):
                await ix.apply_batch(pod_id="vllm-0@dp1" if rank else "vllm-0", rank=0, seq=0, ts=1.0, model="m",
                                     engine_block_size=16, mutations=blocks("vllm-0", rks))
            assert {m.pod_id: m.blocks for m in await ix.lookup(CHAIN)} == {"vllm-0": 5, "vllm-0@dp1": 8}
            rank0 = [m for m in await ix.lookup(CHAIN) if m.pod_id == "vllm-0"]
            await ix.client.hset(pod_state_key("vllm-0@dp1"), "s", JUNK)
            tally = await clear_by_scan(ix, "vllm-0@dp1")
            assert tally.fields_removed == 3 and tally.bits_cleared == 8, tally
            assert tally.request_keys_scanned == 8 and tally.engine_keys_scanned == 8, tally
            assert {m.pod_id: m.blocks for m in await ix.lookup(CHAIN)} == {"vllm-0": 5}
            assert [m for m in await ix.lookup(CHAIN) if m.pod_id == "vllm-0"] == rank0
            assert [m for m in await ix.lookup(CHAIN, mode="linear")] == rank0  # (llm-d's entries name the pod)
            assert [len(await ix.client.hkeys(str(rk))) for rk in CHAIN[:8]] == [1] * 5 + [0] * 3
            assert await held_blocks(ix.writer, "vllm-0") != {}  # rank 0's log untouched

    asyncio.run(go())


def test_clear_scan_with_forget_leaves_nothing_of_the_pod(valkey_url):
    """--scan --forget: cleared by the scan (its log then reads), then forgotten as any pod is."""
    async def before():
        async with Index.from_url(valkey_url) as ix:
            await fill(ix)
            await ix.client.hset(pod_state_key("pod-a"), "s", JUNK)

    asyncio.run(before())
    out = kvpf("index", "clear", "--pod", "pod-a", "--scan", "--forget", "--valkey-url", valkey_url)
    assert out.returncode == 0, out.stderr
    assert "removed 28 entry field(s)" in out.stdout and "the pod forgotten" in out.stdout, out.stdout

    async def after():
        async with Index.from_url(valkey_url) as ix:
            assert "pod-a" not in await ix.meta.pod_ids()
            assert not await ix.client.exists(pod_meta_key("pod-a"), pod_state_key("pod-a"))
            assert {m.pod_id: m.blocks for m in await ix.lookup(CHAIN)} == {"pod-b": 10}

    asyncio.run(after())
