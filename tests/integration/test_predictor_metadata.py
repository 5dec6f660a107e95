"""The predictor's pod metadata cache (predictor/metadata.py) on a real Valkey, on a clock of its own."""
from __future__ import annotations

import asyncio

import pytest

from kv_preflight.predictor.metadata import IndexMetadata
from kv_preflight.shared.index import StoreBlock, encode_entry, make_entry

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_an_entry_past_half_its_ttl_is_answered_at_once_and_renewed_behind(ix):
    await ix.apply_batch(pod_id="pod-a", rank=0, seq=0, ts=1.0, model="m", engine_block_size=32, mode="import",
                         mutations=[StoreBlock(1, "gpu", encode_entry(make_entry("pod-a", "GPU", 0)), (11,))])
    now = [100.0]
    meta = IndexMetadata(ix, ttl_s=1.0, clock=lambda: now[0])
    assert not (await meta.pod_infos(["pod-a"]))["pod-a"].incomplete
    await ix.mark_incomplete("pod-a", "test")
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
    await ix.mark_complete("pod-a")
    now[0] += 1.1  # expired: read before answering
    assert not (await meta.pod_infos(["pod-a"]))["pod-a"].incomplete
