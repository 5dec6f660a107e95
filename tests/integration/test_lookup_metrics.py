"""The lookup's own counters on the predictor's /metrics: pods walked instead of bisected (orphan keys),
request keys of a foreign type read as misses, and cluster lookups that took a 4th round."""
from __future__ import annotations

import re

import httpx
import pytest
import redis

from kv_preflight.predictor.http.app import create_app
from kv_preflight.config import Config
from kv_preflight.index.entries import CHAIN_ROOT
from kv_preflight.index.index import RemoveBlock, StoreBlock
from kv_preflight.keys.chain import request_keys

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

MODEL = "m"


def value(text: str, name: str) -> float:
    found = re.search(rf"^{name}_total (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


async def test_gap_walks_and_foreign_keys_reach_metrics(ix, valkey_url):
    tokens = list(range(1000, 1000 + 16 * 12))
    keys = request_keys(tokens, model=MODEL, block_size=16)
    field = ix.entry_field("pod-gap", "GPU", None)
    stores = [StoreBlock(70_000 + i, "gpu", field, (k,), parent=CHAIN_ROOT if i == 0 else keys[i - 1])
              for i, k in enumerate(keys)]
    await ix.apply_batch(pod_id="pod-gap", rank=0, seq=0, ts=0.0, model=MODEL, engine_block_size=16,
                         mutations=stores)
    await ix.apply_batch(pod_id="pod-gap", rank=0, seq=1, ts=0.0, model=MODEL, engine_block_size=16,
                         mutations=[RemoveBlock(70_005, "gpu")])  # keys 7.. now have no parent: walked
    other = list(range(5000, 5000 + 32))
    sync = redis.Redis.from_url(valkey_url)
    sync.set(str(request_keys(other, model=MODEL, block_size=16)[0]), "a string, not llm-d's hash")
    sync.close()

    app = create_app(Config(valkey_url=valkey_url, block_size=16))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://predictor") as client:
        try:
            text = (await client.get("/metrics")).text
            assert value(text, "kvpf_lookup_gap_walks") == 0 and value(text, "kvpf_lookup_late_reads") == 0
            r = await client.post("/v1/cache/predict", json={"model": MODEL, "token_ids": tokens})
            assert r.status_code == 200 and r.json()["blocks_cached"] == 5, r.text
            r = await client.post("/v1/cache/predict", json={"model": MODEL, "token_ids": other})
            assert r.status_code == 200 and r.json()["blocks_cached"] == 0, r.text
            text = (await client.get("/metrics")).text
            assert value(text, "kvpf_lookup_gap_walks") == 1
            assert value(text, "kvpf_lookup_foreign_keys") == 1
            assert value(text, "kvpf_lookup_late_reads") == 0
        finally:
            await app.state.predictor.aclose()
