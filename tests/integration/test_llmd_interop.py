"""One index, two readers: what kv-preflight writes, llm-d reads; what llm-d writes, kv-preflight reads.

``llmd_lookup`` below follows llm-d-kv-cache's RedisIndex.Lookup (v0.9): one pipelined HKEYS per
request key, each field decoded as a PodEntry, stopping at the first key with no pods. It is
written from that behaviour, independently of kv_preflight/index/index.py.
"""
from __future__ import annotations

import base64
import json

import httpx
import pytest
import redis

from kv_preflight.ingester.ingester import Ingester
from kv_preflight.predictor.http.app import create_app
from kv_preflight.config import Config
from kv_preflight.engines.vllm import ENGINE as VLLM
from kv_preflight.index.index import Index
from kv_preflight.keys.chain import request_keys
from kv_preflight.index.layout import PODS_KEY
from tests.conftest import load_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


def llmd_lookup(r: redis.Redis, keys: list[int]) -> dict[int, list[dict]]:
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.hkeys(str(k))
    found: dict[int, list[dict]] = {}
    for k, fields in zip(keys, pipe.execute()):
        entries = []
        for f in fields:
            text = f.decode()
            if text.startswith("{"):
                entries.append(json.loads(text))
            else:  # v0.8: pod@tier[annotation]
                pod, tier = text.split("@", 1)
                entries.append({"PodIdentifier": pod, "DeviceTier": tier.split("[")[0],
                                "Speculative": "[speculative]" in tier})
        if not entries:
            break
        found[k] = entries
    return found


async def test_llmd_reads_what_kv_preflight_ingested_from_real_vllm_frames(valkey_url):
    frames = [VLLM.decode_frames([base64.b64decode(x) for x in o["frames_b64"]])
              for o in load_jsonl("vllm-0.32-replay-frames.jsonl")]
    frames = [f for f in frames if f.batch is not None]
    ix = Index.from_url(valkey_url)
    ing = Ingester(Config(valkey_url=valkey_url), ix, [])
    for f in frames:
        assert await ing.applier.apply(f.topic.pod_id, f.topic.model, f.seq, f.batch) == "applied"
    # The last stored chain: rebuild its full token list from the events, as the engine saw it.
    last = [e for e in frames[-1].batch.events if type(e).__name__ == "BlockStored"][-1]
    by_hash = {}
    for f in frames:
        for e in f.batch.events:
            if type(e).__name__ == "BlockStored":
                for i, h in enumerate(e.block_hashes):
                    by_hash[h] = (e.parent_block_hash if i == 0 else e.block_hashes[i - 1],
                                  e.token_ids[i * 32:(i + 1) * 32])
    chain, h = [], last.block_hashes[-1]
    while h is not None:
        parent, toks = by_hash[h]
        chain.insert(0, toks)
        h = parent
    tokens = [t for toks in chain for t in toks]
    keys = request_keys(tokens, model="tiny")
    r = redis.Redis.from_url(valkey_url)
    found = llmd_lookup(r, keys)
    assert len(found) == len(keys) == 2 * len(chain)
    for entries in found.values():
        assert entries == [{"PodIdentifier": "vllm-0", "DeviceTier": "gpu", "Speculative": False,
                            "HasGroup": True, "GroupIdx": 0}]
    # llm-d's Clear() HKEYS every non-engine key: all of ours must be hashes.
    for key in r.scan_iter():
        if not key.startswith(b"engine:"):
            assert r.type(key) == b"hash", key
    r.close()
    await ix.close()


@pytest.mark.parametrize("form", ["v09-json", "v08"])
async def test_predictor_reads_what_llmd_wrote(valkey_url, form):
    tokens = list(range(3000, 3000 + 16 * 6))
    keys = request_keys(tokens, model="llmd-model")
    r = redis.Redis.from_url(valkey_url)
    for i, k in enumerate(keys):
        # An llm-d scheduler's Add(): HSET <request key> <PodEntry> "" and SET-free engine mapping.
        if form == "v08":
            r.hset(str(k), "llmd-pod@gpu", "")
            if i < 3:
                r.hset(str(k), "other-pod@cpu", "")
        else:
            r.hset(str(k), json.dumps({"PodIdentifier": "llmd-pod", "DeviceTier": "gpu", "Speculative": False,
                                       "HasGroup": False, "GroupIdx": 0}, separators=(",", ":")), "")
            if i < 3:
                r.hset(str(k), '{"PodIdentifier":"other-pod","DeviceTier":"cpu","Speculative":false}', "")
        r.hset(str(k), "spec-pod@gpu[speculative]", "")  # predicted, not confirmed: never counted
    r.hset(PODS_KEY, mapping={"llmd-pod": "llmd-model"})
    r.close()
    app = create_app(Config(valkey_url=valkey_url))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            resp = await c.post("/v1/cache/predict", json={"model": "llmd-model", "token_ids": tokens + [1]})
    body = resp.json()
    assert resp.status_code == 200, body
    aff = {a["pod_id"]: (a["cached_blocks"], a["device_tier"]) for a in body["pod_affinities"]}
    assert aff == {"llmd-pod": (6, "gpu"), "other-pod": (3, "cpu")}
    assert body["best_pod"] == "llmd-pod" and body["predicted_cached_tokens"] == 96
