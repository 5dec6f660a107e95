"""llm-d v0.10 compatibility: pods named by serving endpoint (--pod-id endpoint), the xxh64 request keys.

llm-d-router (commit 392ae7ebf5d0d8a9245f29cb9120a4cdd02ac70a, PR #2233) writes PodIdentifier
"<pod IP>:<InferencePool target port of the rank>" (preciseprefixcache/extractor.go ``sourceEndpoint``),
and since PR #2237 (c027acfc6e33ed38a4a87a07fd13a28f3a10196f) can key blocks with XXH64. Real Valkey, the
ingester's own frame handling, the predictor app.
"""
from __future__ import annotations

import time

import httpx
import pytest

from kv_preflight.ingester.ingester import Ingester
from kv_preflight.engines import engine
from kv_preflight.engines.endpoints import serving_address
from kv_preflight.ingester.discovery import sources_from
from kv_preflight.ingester.sources import Source
from kv_preflight.predictor.http.app import create_app
from kv_preflight.config import Config
from kv_preflight.index.entries import parse_entry
from kv_preflight.events import BlockStored, EventBatch, encode_frames, make_topic
from kv_preflight.keys.chain import request_keys

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


def test_serving_address_is_llm_d_routers():
    assert serving_address("http://10.0.0.1:8000", 0) == "10.0.0.1:8000"
    assert serving_address("http://10.0.0.1:8000", 3) == "10.0.0.1:8003"
    assert serving_address("http://10.0.0.1:8000", 1, (8000, 8200)) == "10.0.0.1:8200"
    assert serving_address("http://[fd00::7]:8000", 0) == "fd00::7:8000"  # Go's "%s:%s", no brackets
    assert serving_address("http://localhost:8000", 0) in ("127.0.0.1:8000", "::1:8000")  # the pod IP, resolved
    body = {"0": {"endpoint": "tcp://*:5557", "topic": "kv@vllm-0@m"}, "1": {"endpoint": "tcp://*:5558", "topic": "kv@vllm-0@m"}}
    assert [s.serving for s in sources_from(engine("vllm"), "http://10.0.0.1:8000", body)] == ["10.0.0.1:8000",
                                                                                              "10.0.0.1:8001"]


def event_frames(pod: str, seq: int, tokens: list[int]) -> list[bytes]:
    ev = BlockStored(block_hashes=[100 + i for i in range(len(tokens) // 32)], parent_block_hash=None, token_ids=tokens,
                     block_size=32, lora_id=None, medium="GPU", lora_name=None)
    return encode_frames(make_topic(pod, "tiny"), seq, EventBatch(ts=time.time(), events=[ev], data_parallel_rank=0))


async def test_pod_id_endpoint_indexes_under_the_serving_address(ix, valkey_url):
    cfg = Config(valkey_url=valkey_url, pod_id="endpoint")
    src = Source("tcp://127.0.0.1:1", topic="kv@vllm-0@tiny", rank=0, serving="10.0.0.1:8000")
    ing = Ingester(cfg, ix, [src])
    tokens = list(range(1, 97))
    await ing.handle_messages([(src, event_frames("vllm-0", 0, tokens))])
    fields = await ix.fields_per_key(request_keys(tokens, model="tiny"))
    assert len(fields) == 6
    assert {parse_entry(f).PodIdentifier for f in fields[0]} == {"10.0.0.1:8000"}
    assert await ix.meta.pod_ids() == {"10.0.0.1:8000": "tiny"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(cfg, ix)), base_url="http://p") as c:
        for name in ("vllm-0", "10.0.0.1:8000"):  # either form in a pods filter
            p = (await c.post("/v1/cache/predict", json={"model": "tiny", "token_ids": tokens + [1], "pods": [name]})).json()
            assert (p["best_pod"], p["predicted_cached_tokens"]) == ("10.0.0.1:8000", 96), name
        p = (await c.post("/v1/cache/predict", json={"model": "tiny", "token_ids": tokens + [1], "pods": ["vllm-1"]})).json()
        assert p["predicted_cached_tokens"] == 0


async def test_pod_id_topic_is_unchanged(ix, valkey_url):
    src = Source("tcp://127.0.0.1:1", topic="kv@vllm-0@tiny", rank=0, serving="10.0.0.1:8000")
    ing = Ingester(Config(valkey_url=valkey_url), ix, [src])
    await ing.handle_messages([(src, event_frames("vllm-0", 0, list(range(1, 33))))])
    assert await ix.meta.pod_ids() == {"vllm-0": "tiny"}


async def test_xxh64_keys_written_and_read(ix, valkey_url):
    tokens = list(range(5, 5 + 96))
    src = Source("tcp://127.0.0.1:1")
    cfg = Config(valkey_url=valkey_url, hash_algo="xxh64")
    ing = Ingester(cfg, ix, [src])
    await ing.handle_messages([(src, event_frames("vllm-0", 0, tokens))])
    # an llm-d v0.10 reader configured with hashAlgorithm xxh64 walks these keys
    fields = await ix.fields_per_key(request_keys(tokens, model="tiny", hash_algo="xxh64"))
    assert len(fields) == 6
    assert await ix.fields_per_key(request_keys(tokens, model="tiny")) == []
    for algo, expected in (("xxh64", 96), ("fnv64a", 0)):
        app = create_app(Config(valkey_url=valkey_url, hash_algo=algo), ix)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
            for extra in ({}, {"cache_salt": None}):
                p = (await c.post("/v1/cache/predict", json={"model": "tiny", "token_ids": tokens + [1]} | extra)).json()
                assert p["predicted_cached_tokens"] == expected, algo


NEWER_ENTRY = ('{"PodIdentifier":"10.0.0.1:8003","DeviceTier":"cpu","Speculative":false,"HasGroup":true,'
               '"GroupIdx":1,"RetrievalSpan":{"start":0},"DataParallelRank":2}')


async def test_entry_fields_llm_d_does_not_know_yet_are_read(ix, valkey_url):
    """A PodEntry of a newer llm-d (fields added after v0.10) is read, by Python and by the lookup scripts."""
    e = parse_entry(NEWER_ENTRY)
    assert e is not None and (e.PodIdentifier, e.DeviceTier, e.GroupIdx) == ("10.0.0.1:8003", "cpu", 1)
    tokens = list(range(1, 49))
    for k in request_keys(tokens, model="tiny"):
        await ix.client.hset(str(k), NEWER_ENTRY, "")
    await ix.client.hset("kvpf:registry", "10.0.0.1:8003", "tiny")
    for lookup in ("script", "pipeline"):
        app = create_app(Config(valkey_url=valkey_url, lookup=lookup), ix)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
            p = (await c.post("/v1/cache/predict", json={"model": "tiny", "token_ids": tokens + [1]})).json()
            assert p["pod_affinities"][0] | {"estimated_ttft_ms": 0} == {
                "pod_id": "10.0.0.1:8003", "cached_blocks": 3, "cached_tokens": 48, "device_tier": "cpu",
                "estimated_ttft_ms": 0}, lookup


async def test_two_ranks_of_one_topic_as_llm_d_routers_fixture(ix, valkey_url):
    """llm-d-router's own fixture (pkg/kvevents/zmq_subscriber_test.go at ebab687927f5331c1b39defcb579a07951bce56c):
    two subscribers with source endpoints 10.0.0.1:8000 and 10.0.0.1:8003 both receive topic
    kv@10.0.0.1:8000@TestModel, and the index ends with a PodEntry for each endpoint. Read back by an
    llm-d-style reader (tests/integration/test_llmd_interop.py), keys in xxh64 as a router with
    hashAlgorithm xxh64 computes them."""
    import redis

    from tests.integration.test_llmd_interop import llmd_lookup

    cfg = Config(valkey_url=valkey_url, pod_id="endpoint", hash_algo="xxh64")
    srcs = [Source(f"tcp://127.0.0.1:{p}", topic="kv@10.0.0.1:8000@TestModel", rank=r, serving=f"10.0.0.1:{s}")
            for r, (p, s) in enumerate([(1, 8000), (2, 8003)])]
    ing = Ingester(cfg, ix, srcs)
    tokens = list(range(1, 33))
    for src in srcs:
        ev = BlockStored(block_hashes=[100, 101], parent_block_hash=None, token_ids=tokens, block_size=16,
                         lora_id=None, medium="GPU", lora_name=None)
        await ing.handle_messages([(src, encode_frames("kv@10.0.0.1:8000@TestModel", 0,
                                                       EventBatch(ts=time.time(), events=[ev], data_parallel_rank=0)))])
    r = redis.Redis.from_url(valkey_url)
    try:
        found = llmd_lookup(r, request_keys(tokens, model="TestModel", hash_algo="xxh64"))
    finally:
        r.close()
    assert len(found) == 2
    for entries in found.values():
        assert sorted(e["PodIdentifier"] for e in entries) == ["10.0.0.1:8000", "10.0.0.1:8003"]
        assert all(e == {"PodIdentifier": e["PodIdentifier"], "DeviceTier": "gpu", "Speculative": False,
                         "HasGroup": False, "GroupIdx": 0} for e in entries)
