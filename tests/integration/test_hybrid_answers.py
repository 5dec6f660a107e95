"""Issue 24 item 4: every answer counts a hybrid pod as its engine does. A real valkey-server, a real ingester
subscribed over ZMQ to publishers of vLLM 0.32's frames (``group_idx``, ``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window`` as ``KVCacheManager.take_events`` fills them), of SGLang's map frames and of
TensorRT-LLM's; the predictor's app, the Dynamo app and ``kv-preflight index inspect`` (a subprocess) read what
the ingester wrote.

The hybrid pod holds a prompt's 4 engine blocks (32 tokens) in its full-attention group (0), but its
sliding-window group (1, window 64 tokens: ceil(63 / 32) = 2 contiguous blocks needed) has lost blocks 1 and
2 (vLLM frees a window group's blocks outside the window): vLLM's ``SlidingWindowManager`` then finds no run
of 2 ending at a hit point, and only the run from block 0 (1 block) counts, so the engine reuses 32 tokens
where a group-blind rule says 128."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from contextlib import asynccontextmanager

import httpx
import msgspec
import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.config import Config, parse_group_specs
from kv_preflight.events import BlockRemoved, BlockStored, EventBatch
from kv_preflight.index.index import Index
from kv_preflight.ingester.ingester import Ingester
from kv_preflight.ingester.sources import Source
from kv_preflight.predictor.dynamo.api import create_dynamo_app
from kv_preflight.predictor.dynamo.wire import stable_instance_id
from kv_preflight.predictor.http.app import create_app
from tests.integration.engine_stub import EngineStub
from tests.integration.leases import vouch

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

B = 32  # engine block size (the launcher's tiny hybrid model runs 32-token blocks in both groups)
TOKENS = list(range(3000, 3000 + 4 * B))
PROMPT = TOKENS + [7]  # 129 tokens: at most 128 reused (the last prompt token is always recomputed)
HASHES = [101, 102, 103, 104]


def vllm_stored(group: int, kind: str, window: int | None = None, tokens=TOKENS, hashes=HASHES) -> BlockStored:
    """A vLLM 0.32 BlockStored of one KV cache group (vllm/distributed/kv_events.py; the same block hashes in
    every group: vLLM hashes tokens, not groups)."""
    return BlockStored(hashes, None, tokens, B, medium="GPU", group_idx=group, extra_keys=[None] * len(hashes),
                       kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)


def sglang_payload(tokens=TOKENS, hashes=HASHES) -> bytes:
    """SGLang after PR #37482: a positional batch ``[ts, events, attn_dp_rank]`` of tagged maps, with no group
    or window field at all (/work/shared/research/peer-formats-2026-11.md section 2.1; sgl-project/sglang
    python/sglang/srt/mem_cache/events.py ``KVCacheEventRecorder.record_store``: one event per page, the
    full-attention radix tree's nodes, also for SWARadixCache, whose SWA eviction (tombstoning) sends nothing)."""
    events = [{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": hashes[i - 1] if i else None,
               "token_ids": tokens[i * B:(i + 1) * B], "block_size": B, "lora_id": None, "medium": "GPU"}
              for i, h in enumerate(hashes)]
    return msgspec.msgpack.encode([time.time(), events, None])


def trtllm_payload(tokens=TOKENS, hashes=HASHES) -> bytes:
    """TensorRT-LLM's streaming publisher (PR #17023): vLLM-compatible tagged maps, consecutive stores merged,
    ``group_idx``/``kv_cache_spec_*`` never set, and only the layer group whose window is the largest (the
    "target lifecycle") published (peer-formats-2026-11.md section 3.3): a variable sliding window model's
    smaller windows are not in its events."""
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
          "block_size": B, "lora_id": None, "medium": "GPU", "lora_name": None}
    return msgspec.msgpack.encode([time.time(), [ev], 0])


class Fleet:
    """One ingester over four publishers: a hybrid vLLM pod, a plain vLLM pod, a vLLM pod with a chunked
    local attention group (whose chunk size its events do not carry), an SGLang pod and a TensorRT-LLM pod."""

    def __init__(self, valkey_url: str):
        self.valkey_url = valkey_url
        self.stubs: dict[str, EngineStub] = {}
        self.sources = []
        for pod, engine in (("pod-h", "vllm"), ("pod-p", "vllm"), ("pod-c", "vllm"), ("pod-s", "sglang"),
                            ("pod-t", "trtllm")):
            zport, rport = free_port(), free_port()
            replay = f"tcp://127.0.0.1:{rport}"
            topic = f"kv@{pod}@tiny" if engine == "vllm" else ""
            self.stubs[pod] = EngineStub(f"tcp://127.0.0.1:{zport}", replay, topic,
                                         replay_topic=engine != "sglang")
            named = {} if engine == "vllm" else {"pod": pod, "model": "tiny"}
            self.sources.append(Source(f"tcp://127.0.0.1:{zport}", replay=replay, engine=engine, **named))
        self.ingester: Ingester | None = None
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        before = {p: s.count_subscriptions() for p, s in self.stubs.items()}
        self.ingester = Ingester(Config(valkey_url=self.valkey_url, replay_timeout_s=1.0),
                                 Index.from_url(self.valkey_url), self.sources)
        self.ingester.start()
        self.task = asyncio.create_task(self.ingester.run())
        for pod, stub in self.stubs.items():
            await stub.subscribed(before[pod] + 1)
        started = asyncio.ensure_future(self.ingester.started.wait())
        await asyncio.wait([self.task, started], timeout=10, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        assert self.ingester.started.is_set()

    async def close(self) -> None:
        if self.ingester is not None and self.task is not None:
            self.ingester.stop()
            await asyncio.wait_for(self.task, 5)
            await self.ingester.index.close()
        for stub in self.stubs.values():
            stub.close()


async def wait_seq(ix: Index, pod: str, seq: int, timeout: float = 10.0) -> None:
    """Until the pod's batch ``seq`` is applied and visible: on a cluster its seq is written with the pod's state
    before its changes run on the other shards (``pending_effects``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = await ix.meta.pod_info(pod)
        if max((int(v) for v in info.seqs.values()), default=-1) >= seq and not info.pending_effects:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{pod} not at seq {seq}: {await ix.meta.pod_info(pod)}")


@asynccontextmanager
async def loaded_fleet(url: str, ix: Index):
    """The five pods' events published and written (``url``: a single node or a Valkey Cluster; ``ix`` reads it)."""
    f = Fleet(url)
    await f.start()
    try:
        s = f.stubs
        s["pod-h"].publish(EventBatch(time.time(), [vllm_stored(1, "sliding_window", 64),
                                                    vllm_stored(0, "full_attention")], 0))
        s["pod-h"].publish(EventBatch(time.time(), [BlockRemoved([102, 103], medium="GPU", group_idx=1)], 0))
        s["pod-p"].publish(EventBatch(time.time(), [vllm_stored(0, "full_attention")], 0))
        s["pod-c"].publish(EventBatch(time.time(), [vllm_stored(0, "full_attention"),
                                                    vllm_stored(1, "chunked_local_attention")], 0))
        s["pod-s"].publish_payload(sglang_payload())
        s["pod-t"].publish_payload(trtllm_payload())
        for pod, seq in (("pod-h", 1), ("pod-p", 0), ("pod-c", 0), ("pod-s", 0), ("pod-t", 0)):
            await wait_seq(ix, pod, seq)
        # its ingester's lease lists the pods at its next renewal (within a second); this one vouches for them now
        await vouch(ix, "pod-h", "pod-p", "pod-c", "pod-s", "pod-t")
        yield f
    finally:
        await f.close()


@pytest.fixture
async def fleet(valkey_url, ix):
    async with loaded_fleet(valkey_url, ix) as f:
        yield f


@asynccontextmanager
async def client(app):
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
            yield c


def by_pod(answer: dict) -> dict[str, int]:
    return {a["pod_id"]: a["cached_tokens"] for a in answer["pod_affinities"]}


async def test_predict_route_and_ttft_use_the_group_rule(fleet, valkey_url):
    async with client(create_app(Config(valkey_url=valkey_url))) as c:
        body = {"model": "tiny", "token_ids": PROMPT}
        pred = (await c.post("/v1/cache/predict", json=body)).json()
        assert by_pod(pred)["pod-h"] == 32  # the window group's rule cuts the full-attention prefix (128)
        assert by_pod(pred)["pod-p"] == 128
        hybrid = (await c.post("/v1/cache/predict", json=body | {"pods": ["pod-h"]})).json()
        assert hybrid["predicted_cached_tokens"] == 32
        plain = (await c.post("/v1/cache/predict", json=body | {"pods": ["pod-p"]})).json()
        # TTFT follows the tokens the engine reuses: more to compute on the hybrid pod
        assert hybrid["estimated_ttft_ms"] > plain["estimated_ttft_ms"]
        route = (await c.post("/v1/cache/route", json=body | {"pods": ["pod-h"]})).json()
        assert (route["pod_id"], route["cached_tokens"]) == ("pod-h", 32)
        assert route["estimated_ttft_ms"] == hybrid["estimated_ttft_ms"]
        route = (await c.post("/v1/cache/route", json=body | {"pods": ["pod-h", "pod-p"]})).json()
        assert {x["pod_id"]: x["cached_tokens"] for x in route["candidates"]} == {"pod-h": 32, "pod-p": 128}


async def test_explain_names_the_group_and_the_evicted_window_blocks(fleet, valkey_url):
    async with client(create_app(Config(valkey_url=valkey_url))) as c:
        r = await c.post("/v1/cache/explain", json={"model": "tiny", "token_ids": PROMPT, "pods": ["pod-h"]})
        assert r.status_code == 200, r.text
        ex = r.json()
    assert ex["predicted_cached_tokens"] == 32
    assert [p["pod_id"] for p in ex["pods"]] == ["pod-h"]
    cut = [f for f in ex["findings"] if f["kind"] == "group_cut"]
    assert len(cut) == 1 and cut[0]["token_index"] == 32, ex["findings"]
    detail = cut[0]["detail"]
    assert "KV cache group 1" in detail and "sliding window of 64 tokens" in detail, detail
    assert "#1, #2" in detail and "128 tokens" in detail and "reuses 32" in detail, detail


async def test_dynamo_query_uses_the_group_rule(fleet, valkey_url):
    async with client(create_dynamo_app(Config(valkey_url=valkey_url))) as c:
        r = await c.post("/query", json={"token_ids": PROMPT, "model_name": "tiny"})
        assert r.status_code == 200, r.text
        got = r.json()["instances"]
    # Dynamo's overlap has no last-token rule: the plain pod's 4 whole blocks, the hybrid pod's 1
    assert got[str(stable_instance_id("pod-p"))]["gpu"] == 128
    assert got[str(stable_instance_id("pod-h"))]["gpu"] == 32


async def test_index_inspect_shows_groups_and_the_reused_tokens(fleet, valkey_url):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kv_preflight", "index", "inspect", "--valkey-url", valkey_url, "--model", "tiny",
        "--tokens", json.dumps(PROMPT), "--json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    data = json.loads(out)
    assert data["cached_tokens_per_pod"]["pod-h"] == 32
    assert data["cached_tokens_per_pod"]["pod-p"] == 128
    assert data["prefix_blocks_per_pod"]["pod-h"] == 8  # its full-attention chain: 8 request keys of 16
    assert data["groups_per_pod"]["pod-h"] == {"0": "full_attention", "1": "sliding_window"}
    groups_at_key_3 = {h["group"] for h in data["blocks"][3]["holders"] if h["pod_id"] == "pod-h"}
    assert groups_at_key_3 == {0}  # block 1's last key: the window group evicted it
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kv_preflight", "index", "inspect", "--valkey-url", valkey_url, "--model", "tiny",
        "--tokens", json.dumps(PROMPT), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert "pod-h: chain holds 8 block(s); the engine reuses 32 tokens (KV cache groups 0=full_attention, " \
           "1=sliding_window)" in text, text
    assert "pod-p: chain holds 8 block(s); the engine reuses 128 tokens\n" in text, text


async def test_incomplete_groups_are_a_lower_bound_that_says_so_until_given(fleet, valkey_url):
    body = {"model": "tiny", "token_ids": PROMPT, "pods": ["pod-c"]}
    async with client(create_app(Config(valkey_url=valkey_url))) as c:
        pred = (await c.post("/v1/cache/predict", json=body)).json()
        route = (await c.post("/v1/cache/route", json=body)).json()
    assert pred["predicted_cached_tokens"] == 0  # the chunked group's rule lacks its chunk size: accepts nothing
    kinds = {w["kind"]: w["detail"] for w in pred["warnings"]}
    assert "hybrid_groups_incomplete" in kinds and "'pod-c'" in kinds["hybrid_groups_incomplete"]
    assert "chunk size" in kinds["hybrid_groups_incomplete"]
    assert "hybrid_groups_incomplete" in {w["kind"] for w in route["warnings"]}
    # --group-spec gives the chunk size: a chunk of 64 tokens; the prompt's last chunk starts at token 128,
    # so every block before it counts as computed, and the hit is the full-attention group's 128
    cfg = Config.load(valkey_url=valkey_url, group_specs=parse_group_specs(["tiny:1=chunked/chunk=64"]))
    async with client(create_app(cfg)) as c:
        pred = (await c.post("/v1/cache/predict", json=body)).json()
    assert pred["predicted_cached_tokens"] == 128
    assert not [w for w in pred.get("warnings", []) if w["kind"].startswith("hybrid")]


async def test_sglang_and_trtllm_pods_of_a_hybrid_model_are_not_claimed_exact(fleet, valkey_url):
    body = {"model": "tiny", "token_ids": PROMPT, "pods": ["pod-s", "pod-t"]}
    async with client(create_app(Config(valkey_url=valkey_url))) as c:
        pred = (await c.post("/v1/cache/predict", json=body)).json()
    assert by_pod(pred) == {"pod-s": 128, "pod-t": 128}  # what their events describe
    assert not [w for w in pred.get("warnings", []) if w["kind"].startswith("hybrid")]  # not known to be hybrid
    cfg = Config.load(valkey_url=valkey_url,
                      group_specs=parse_group_specs(["tiny:0=full", "tiny:1=sliding_window/window=64"]))
    async with client(create_app(cfg)) as c:
        pred = (await c.post("/v1/cache/predict", json=body)).json()
        route = (await c.post("/v1/cache/route", json=body)).json()
        explain = (await c.post("/v1/cache/explain", json=body)).json()
    for answer in (pred, route, explain):
        notes = [w for w in answer["warnings"] if w["kind"] == "hybrid_not_exact"]
        assert len(notes) == 1, answer["warnings"]
        assert "'pod-s'" in notes[0]["detail"] and "'pod-t'" in notes[0]["detail"]
    # the vLLM pods' events name their groups: no such warning for them
    async with client(create_app(cfg)) as c:
        pred = (await c.post("/v1/cache/predict", json={"model": "tiny", "token_ids": PROMPT, "pods": ["pod-h"]})).json()
    assert pred["predicted_cached_tokens"] == 32 and not pred.get("warnings")


async def test_a_sliding_window_only_pod_is_scored_by_its_rule(valkey_url, ix):
    """One KV cache group, of the sliding-window kind (its events name it so): vLLM runs that group's rule alone,
    so with EAGLE (``--group-spec``) the pod reuses 96 tokens of its 4 blocks (a run of ceil(63 / 32) + 1 = 3
    blocks ending at block 3, whose last block is dropped), not the 128 a plain pod would; the answer says the
    count is a lower bound (the rule sees the pod's prefix only)."""
    from kv_preflight.engines.hit_rules import SLIDING, GroupSpec
    from kv_preflight.index.index import StoreBlock, encode_entry, make_entry
    from kv_preflight.keys.chain import request_keys

    cfg = Config.load(valkey_url=valkey_url, group_specs=parse_group_specs(["tiny:0=sliding_window/window=64/eagle"]))
    keys = request_keys(TOKENS, model="tiny", hash_seed=cfg.hash_seed, block_size=cfg.block_size)
    per = B // cfg.block_size
    stores = [StoreBlock(500 + b, "gpu", encode_entry(make_entry("pod-w", "GPU", 0)), tuple(keys[b * per:(b + 1) * per]))
              for b in range(4)]
    r = await ix.apply_batch(pod_id="pod-w", rank=0, seq=0, ts=1.0, model="tiny", engine_block_size=B,
                             mutations=stores, groups={0: GroupSpec(SLIDING, B, 64)})
    assert r.status == "applied", r
    async with client(create_app(cfg)) as c:
        pred = (await c.post("/v1/cache/predict", json={"model": "tiny", "token_ids": PROMPT, "pods": ["pod-w"]})).json()
    assert pred["predicted_cached_tokens"] == 96, pred
    kinds = {w["kind"]: w["detail"] for w in pred["warnings"]}
    assert "'pod-w'" in kinds["single_group_lower_bound"]
    async with client(create_app(Config.load(valkey_url=valkey_url))) as c:
        pred = (await c.post("/v1/cache/predict", json={"model": "tiny", "token_ids": PROMPT, "pods": ["pod-w"]})).json()
    assert pred["predicted_cached_tokens"] == 128  # no EAGLE: the window's rule over a full prefix, as plain
    assert "single_group_lower_bound" in {w["kind"] for w in pred["warnings"]}
