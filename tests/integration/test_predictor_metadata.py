"""The predictor's pod metadata cache (predictor/metadata.py) on a real Valkey, on a clock of its own."""
from __future__ import annotations

import asyncio

import pytest

from kv_preflight.predictor.metadata import IndexMetadata
from kv_preflight.index.index import StoreBlock, encode_entry, make_entry

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_an_entry_past_half_its_ttl_is_answered_at_once_and_renewed_behind(ix):
    await ix.apply_batch(pod_id="pod-a", rank=0, seq=0, ts=1.0, model="m", engine_block_size=32, mode="import",
                         mutations=[StoreBlock(1, "gpu", encode_entry(make_entry("pod-a", "GPU", 0)), (11,))])
    now = [100.0]
    meta = IndexMetadata(ix, ttl_s=1.0, clock=lambda: now[0])
    assert not (await meta.pod_infos(["pod-a"]))["pod-a"].incomplete
    await ix.meta.mark_incomplete("pod-a", "test")
    now[0] += 0.3  # young: the cache, nothing read
    assert not (await meta.pod_infos(["pod-a"]))["pod-a"].incomplete
    await asyncio.sleep(0.05)
    assert not (await meta.pod_infos(["pod-a"]))["pod-a"].incomplete
    now[0] += 0.4  # past half its ttl: the cached answer now, a read behind it
    assert not (await meta.pod_infos(["pod-a"]))["pod-a"].incomplete
    for _ in range(100):
        await asyncio.sleep(0.01)
        if (await meta.pod_infos(["pod-a"]))["pod-a"].incomplete:
            break
    assert (await meta.pod_infos(["pod-a"]))["pod-a"].incomplete  # renewed: expires a ttl from that read
    await ix.meta.mark_complete("pod-a")
    now[0] += 1.1  # expired: read before answering
    assert not (await meta.pod_infos(["pod-a"]))["pod-a"].incomplete


async def test_pods_read_together_are_renewed_apart_and_read_lean(ix, valkey_url):
    """A thousand pods matched by one prompt are read together once; their renewals must not come as one
    read of all of them a second later (that lump stalled the requests behind it: the p99 of a fleet-wide
    prefix). Each pod renews at its own fraction of the ttl, so at mid-ttl only a share of them is re-read;
    and each read is one HMGET of what scoring needs, not the whole meta hash."""
    import redis.asyncio as aioredis

    pods = [f"pod-{i}" for i in range(200)]
    for p in pods:
        await ix.apply_batch(pod_id=p, rank=0, seq=0, ts=1.0, model="m", engine_block_size=32, mode="import",
                             mutations=[StoreBlock(1, "gpu", encode_entry(make_entry(p, "GPU", 0)), (11,))])
    now = [100.0]
    meta = IndexMetadata(ix, ttl_s=1.0, clock=lambda: now[0])
    raw = aioredis.from_url(valkey_url)
    try:
        await raw.config_resetstat()
        infos = await meta.pod_infos(pods)
        assert {i.engine_block_size for i in infos.values()} == {32}
        stats = await raw.info("commandstats")
        assert stats["cmdstat_hmget"]["calls"] == 200 and "cmdstat_hgetall" not in stats
        now[0] += 0.5
        await meta.pod_infos(pods)  # answered from the cache; the due share is read behind
        for _ in range(100):
            await asyncio.sleep(0.01)
            if meta._renewing is None:
                break
        renewed = (await raw.info("commandstats"))["cmdstat_hmget"]["calls"] - 200
        assert 30 <= renewed <= 170, renewed  # a share of them, neither none nor all
    finally:
        await raw.aclose()
