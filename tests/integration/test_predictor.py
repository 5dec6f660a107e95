"""The predictor against a real valkey-server, with the index written as an ingester writes it.

The engine's /tokenize is a tiny real HTTP server (uvicorn, on a free port) that
tokenizes characters to their code points; real vLLM is covered by the e2e tests.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.predictor.http.app import create_app
from kv_preflight.config import Config
from kv_preflight.index.index import Index, StoreBlock
from kv_preflight.predictor.scoring.ttft import PrefillModel
from kv_preflight.keys.chain import HAS_C_EXTENSION, MAX_TOKEN_ID, request_keys

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

MODEL = "test-model"
C = 16
PREDICT = "/v1/cache/predict"
REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- index writing, as the ingester does


class IndexWriter:
    """Stores a prompt's engine blocks on a pod: request keys chained block by block from the parent's."""

    def __init__(self, index: Index):
        self.index = index
        self.seqs: dict[str, int] = {}

    async def store(self, pod: str, tokens: Sequence[int], *, engine_block: int = C, model: str = MODEL,
                    medium: str | None = "GPU", n_blocks: int | None = None) -> None:
        n = len(tokens) // engine_block if n_blocks is None else n_blocks
        mutations = []
        parent: int | None = None
        field = self.index.entry_field(pod, medium, None)
        for i in range(n):
            chunk = tokens[i * engine_block:(i + 1) * engine_block]
            rks = request_keys(chunk, model=model, block_size=C, parent=parent)
            engine_key = rks[-1] ^ 0x5EED  # content-derived, like vLLM's own block hashes
            mutations.append(StoreBlock(engine_key, medium.lower() if medium else "gpu", field, tuple(rks)))
            parent = rks[-1]
        seq = self.seqs.get(pod, -1) + 1
        self.seqs[pod] = seq
        result = await self.index.apply_batch(pod_id=pod, rank=0, seq=seq, ts=time.time(), model=model,
                                              engine_block_size=engine_block, mutations=mutations)
        assert result.status == "applied"


@pytest.fixture
def writer(ix):
    return IndexWriter(ix)


# ---------------------------------------------------------------- a stub engine /tokenize


def stub_tokens(body: dict) -> list[int]:
    if "messages" in body:
        text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
        if body.get("add_generation_prompt"):
            text += "<assistant>"
    else:
        text = body["prompt"]
    return [ord(c) for c in text]


class StubEngine:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(
            Starlette(routes=[Route("/tokenize", self.tokenize, methods=["POST"])]),
            host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
        ))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def tokenize(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        prompt = body.get("prompt")
        if prompt == "__slow__":
            await asyncio.sleep(5)
        if prompt == "__fail__":
            return JSONResponse({"error": "boom"}, 500)
        if prompt == "__reject__":
            return JSONResponse({"error": {"message": "This model's maximum context length is 8 tokens"}}, 400)
        if prompt == "__garbage__":
            return JSONResponse({"tokens": "not a list"})
        if prompt == "__nothing__":
            return JSONResponse({"tokens": []})
        tokens = stub_tokens(body)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": 4096})

    def start(self) -> "StubEngine":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "stub engine did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def engine():
    stub = StubEngine().start()
    yield stub
    stub.stop()


# ---------------------------------------------------------------- the predictor under test


@pytest.fixture
async def make_client(valkey_url, engine):
    made = []

    async def make(**overrides) -> httpx.AsyncClient:
        fields = {"valkey_url": valkey_url, "engine_urls": {MODEL: engine.url}, "block_size": C} | overrides
        app = create_app(Config(**fields))
        await app.state.predictor.fleet.read_once()  # as the lifespan does before serving (not run here)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://predictor")
        made.append((app, client))
        return client

    yield make
    for app, client in made:
        await client.aclose()
        await app.state.predictor.aclose()


@pytest.fixture
async def client(make_client):
    return await make_client()


def tokens_of(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def ttft(prompt_tokens: int, cached_tokens: int) -> float:
    """The estimate with the documented default prefill model (no --ttft-model)."""
    return PrefillModel().estimate_ms(prompt_tokens, cached_tokens)


def affinities(doc: dict) -> list[tuple]:
    return [(a["pod_id"], a["cached_blocks"], a["cached_tokens"], a["device_tier"]) for a in doc["pod_affinities"]]


# ---------------------------------------------------------------- predictions


async def test_predicts_longest_prefix_per_pod(client, writer):
    prompt = tokens_of(100)
    await writer.store("pod-a", prompt[:64])  # 4 blocks
    await writer.store("pod-b", prompt[:32])  # 2 blocks
    await writer.store("pod-c", tokens_of(64, start=5))  # another prompt entirely
    r = await client.post(PREDICT, json={"model": MODEL, "token_ids": prompt})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc == {
        "predicted_cached_tokens": 64,
        "total_prompt_tokens": 100,
        "blocks_total": 6,
        "blocks_cached": 4,
        "cache_hit_ratio": 0.64,
        "best_pod": "pod-a",
        "pod_affinities": [
            {"pod_id": "pod-a", "cached_blocks": 4, "cached_tokens": 64, "device_tier": "gpu",
             "estimated_ttft_ms": ttft(100, 64)},
            {"pod_id": "pod-b", "cached_blocks": 2, "cached_tokens": 32, "device_tier": "gpu",
             "estimated_ttft_ms": ttft(100, 32)},
        ],
        "estimated_ttft_ms": ttft(100, 64),
        "warnings": [],
        # no ingester lease names these pods (written in-process): their ingestion state is not known, so the
        # answer cannot vouch for what it says they hold (issue 40)
        "freshness": {"state": "degraded", "reasons": ["ingestion unknown for pod-a, pod-b (no ingester's lease "
                                                       "covers it)"],
                      "pods": {"pod-a": {"state": "unknown"}, "pod-b": {"state": "unknown"}}},
    }


async def test_nothing_cached(client, writer):
    await writer.store("pod-a", tokens_of(64))
    doc = (await client.post(PREDICT, json={"model": MODEL, "token_ids": tokens_of(64, start=7)})).json()
    assert (doc["predicted_cached_tokens"], doc["best_pod"], doc["pod_affinities"]) == (0, None, [])
    assert doc["blocks_total"] == 4
    # a prompt shorter than one block has no key at all
    doc = (await client.post(PREDICT, json={"model": MODEL, "token_ids": [1, 2, 3]})).json()
    assert (doc["predicted_cached_tokens"], doc["blocks_total"], doc["total_prompt_tokens"]) == (0, 0, 3)


async def test_a_break_in_the_chain_ends_the_prefix(client, writer):
    prompt = tokens_of(96)
    await writer.store("pod-a", prompt)
    changed = prompt[:40] + [7] + prompt[41:]  # differs inside block 2
    doc = (await client.post(PREDICT, json={"model": MODEL, "token_ids": changed})).json()
    assert affinities(doc) == [("pod-a", 2, 32, "gpu")]


async def test_engine_block_32_and_last_token_rule(client, writer):
    prompt = tokens_of(64)
    await writer.store("pod-32", prompt, engine_block=32)  # 2 engine blocks = 4 canonical
    await writer.store("pod-16", prompt, engine_block=16)
    # the whole prompt is cached, but the engine recomputes the last token: at most 63 tokens reusable
    doc = (await client.post(PREDICT, json={"model": MODEL, "token_ids": prompt})).json()
    assert affinities(doc) == [("pod-16", 4, 48, "gpu"), ("pod-32", 4, 32, "gpu")]
    assert (doc["best_pod"], doc["predicted_cached_tokens"], doc["blocks_cached"]) == ("pod-16", 48, 4)
    # one more token: every cached block counts
    doc = (await client.post(PREDICT, json={"model": MODEL, "token_ids": prompt + [1]})).json()
    assert affinities(doc) == [("pod-16", 4, 64, "gpu"), ("pod-32", 4, 64, "gpu")]


async def test_pods_filter(client, writer):
    prompt = tokens_of(100)
    await writer.store("pod-a", prompt[:64])
    await writer.store("pod-b", prompt[:32])
    doc = (await client.post(PREDICT, json={"model": MODEL, "token_ids": prompt, "pods": ["pod-b", "pod-x"]})).json()
    assert affinities(doc) == [("pod-b", 2, 32, "gpu")]
    assert (doc["best_pod"], doc["predicted_cached_tokens"]) == ("pod-b", 32)
    doc = (await client.post(PREDICT, json={"model": MODEL, "token_ids": prompt, "pods": ["pod-x"]})).json()
    assert (doc["best_pod"], doc["pod_affinities"]) == (None, [])
    doc = (await client.post(PREDICT, json={"model": MODEL, "token_ids": prompt, "pods": []})).json()
    assert (doc["best_pod"], doc["predicted_cached_tokens"]) == (None, 0)


async def test_pipeline_lookup_agrees_with_script(make_client, writer):
    prompt = tokens_of(100)
    await writer.store("pod-a", prompt[:64])
    await writer.store("pod-b", prompt[:48], medium="CPU")
    script = await make_client(lookup="script")
    pipeline = await make_client(lookup="pipeline")
    body = {"model": MODEL, "token_ids": prompt, "pods": ["pod-a", "pod-b"]}
    a = (await script.post(PREDICT, json=body)).json()
    b = (await pipeline.post(PREDICT, json=body)).json()
    assert a == b
    assert affinities(a) == [("pod-a", 4, 64, "gpu"), ("pod-b", 3, 48, "cpu")]


async def test_ties_in_pod_id_order(client, writer):
    prompt = tokens_of(80)
    for pod in ("pod-z", "pod-a", "pod-m"):
        await writer.store(pod, prompt[:48])
    doc = (await client.post(PREDICT, json={"model": MODEL, "token_ids": prompt})).json()
    assert [a["pod_id"] for a in doc["pod_affinities"]] == ["pod-a", "pod-m", "pod-z"]
    assert doc["best_pod"] == "pod-a"


async def test_incomplete_pod_is_flagged(client, writer, ix):
    prompt = tokens_of(64)
    await writer.store("pod-a", prompt)
    await writer.store("pod-b", prompt)
    await ix.meta.mark_incomplete("pod-b", "gap in event sequence")
    doc = (await client.post(PREDICT, json={"model": MODEL, "token_ids": prompt + [1]})).json()
    assert doc["pod_affinities"] == [
        {"pod_id": "pod-a", "cached_blocks": 4, "cached_tokens": 64, "device_tier": "gpu",
         "estimated_ttft_ms": ttft(65, 64)},
        {"pod_id": "pod-b", "cached_blocks": 4, "cached_tokens": 64, "device_tier": "gpu",
         "estimated_ttft_ms": ttft(65, 64), "incomplete": True},
    ]


async def test_pod_info_is_cached_about_a_second(client, writer, ix):
    prompt = tokens_of(64)
    await writer.store("pod-a", prompt, engine_block=16)
    body = {"model": MODEL, "token_ids": prompt + [1]}
    assert (await client.post(PREDICT, json=body)).json()["pod_affinities"][0].get("incomplete") is None
    await ix.meta.mark_incomplete("pod-a", "test")
    # within the TTL the cached info is used: no second round trip, so the flag is not seen yet
    assert (await client.post(PREDICT, json=body)).json()["pod_affinities"][0].get("incomplete") is None
    await asyncio.sleep(1.1)
    assert (await client.post(PREDICT, json=body)).json()["pod_affinities"][0].get("incomplete") is True


async def test_model_name_is_part_of_the_key(client, writer, engine):
    prompt = tokens_of(64)
    await writer.store("pod-lora", prompt, model="my-adapter")
    await writer.store("pod-base", prompt[:32])
    # a model the index knows but with no engine URL is fine for token_ids
    doc = (await client.post(PREDICT, json={"model": "my-adapter", "token_ids": prompt + [1]})).json()
    assert affinities(doc) == [("pod-lora", 4, 64, "gpu")]
    doc = (await client.post(PREDICT, json={"model": MODEL, "token_ids": prompt + [1]})).json()
    assert affinities(doc) == [("pod-base", 2, 32, "gpu")]


async def test_unknown_model(client, writer):
    await writer.store("pod-lora", tokens_of(32), model="my-adapter")
    r = await client.post(PREDICT, json={"model": "nope", "token_ids": tokens_of(32)})
    assert r.status_code == 400
    assert r.json()["error"].startswith("unknown model 'nope'")
    assert "and no --engine-url or --tokenizer names it" in r.json()["error"]  # serve's flags (a gateway adds --engine)
    r = await client.post(PREDICT, json={"model": "nope", "prompt": "hello"})
    assert r.status_code == 400 and "unknown model" in r.json()["error"]
    # known from the index, but prompts need an engine to tokenize and none answers: the server's, a 503
    r = await client.post(PREDICT, json={"model": "my-adapter", "prompt": "hello"})
    assert r.status_code == 503
    assert "no --engine-url" in r.json()["error"] and "token_ids" in r.json()["error"]


async def test_model_appearing_in_the_index_is_known_at_once(client, writer):
    await writer.store("pod-a", tokens_of(32), model="first")
    assert (await client.post(PREDICT, json={"model": "first", "token_ids": tokens_of(32)})).status_code == 200
    await writer.store("pod-b", tokens_of(32), model="second")
    await asyncio.sleep(0.15)  # past the unknown-model recheck interval, well within the 1 s TTL
    r = await client.post(PREDICT, json={"model": "second", "token_ids": tokens_of(33)})
    assert r.status_code == 200, r.text
    assert r.json()["best_pod"] == "pod-b"


# ---------------------------------------------------------------- prompts and messages via the engine


async def test_prompt_is_tokenized_by_the_engine(client, writer, engine):
    text = "The quick brown fox jumps over the lazy dog, twice over: the quick brown fox."
    tokens = [ord(c) for c in text]
    await writer.store("pod-a", tokens[:64])
    engine.requests.clear()
    r = await client.post(PREDICT, json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert (doc["total_prompt_tokens"], doc["predicted_cached_tokens"], doc["best_pod"]) == (len(tokens), 64, "pod-a")
    assert engine.requests == [{"model": MODEL, "prompt": text}]


async def test_messages_are_tokenized_with_the_chat_template(client, writer, engine):
    messages = [{"role": "system", "content": "You are a terse assistant." * 3},
                {"role": "user", "content": "Say hi."}]
    tokens = stub_tokens({"messages": messages, "add_generation_prompt": True})
    await writer.store("pod-a", tokens[:80])
    engine.requests.clear()
    r = await client.post(PREDICT, json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    assert (r.json()["total_prompt_tokens"], r.json()["predicted_cached_tokens"]) == (len(tokens), 80)
    assert engine.requests == [{"model": MODEL, "messages": messages, "add_generation_prompt": True}]


async def test_tokenized_prompt_over_the_limit(make_client, engine):
    client = await make_client(max_tokens=10)
    r = await client.post(PREDICT, json={"model": MODEL, "prompt": "x" * 11})
    assert r.status_code == 400 and "10" in r.json()["error"] and "too many tokens" in r.json()["error"]


@pytest.mark.parametrize(
    ("prompt", "status", "needle"),
    [
        ("__fail__", 503, "failed (500)"),
        ("__garbage__", 503, "no usable token list"),
        ("__reject__", 400, "maximum context length"),
        ("__nothing__", 400, "no tokens"),
    ],
)
async def test_engine_failures(client, prompt, status, needle):
    r = await client.post(PREDICT, json={"model": MODEL, "prompt": prompt})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]


@pytest.mark.serial(reason="bounds the 503's wall time (2 s), which another test's CPU could stretch")
async def test_engine_timeout_is_a_fast_503(make_client):
    client = await make_client(engine_timeout_s=0.3)
    t0 = time.monotonic()
    r = await client.post(PREDICT, json={"model": MODEL, "prompt": "__slow__"})
    assert r.status_code == 503 and "within 0.3s" in r.json()["error"]
    assert time.monotonic() - t0 < 2


async def test_engine_down_is_a_503(make_client):
    dead = f"http://127.0.0.1:{free_port()}"
    client = await make_client(engine_urls={MODEL: dead})
    r = await client.post(PREDICT, json={"model": MODEL, "prompt": "hello"})
    assert r.status_code == 503
    assert "unreachable" in r.json()["error"] and dead in r.json()["error"]


# ---------------------------------------------------------------- bad input


BAD_INPUTS = [
    (b"{not json", "invalid JSON"),
    (b"", "empty body"),
    (b"[1, 2]", "JSON object"),
    (b'{"token_ids": [1, 2]}', "missing model"),
    (b'{"model": "", "token_ids": [1, 2]}', "missing model"),
    (b'{"model": 7, "token_ids": [1, 2]}', "model must be a string"),
    (b'{"model": "test-model"}', "give one of token_ids, prompt, messages"),
    (b'{"model": "test-model", "token_ids": [1], "prompt": "hi"}', "only one of"),
    (b'{"model": "test-model", "prompt": "hi", "messages": [{"role": "user", "content": "x"}]}', "only one of"),
    (b'{"model": "test-model", "token_ids": []}', "token_ids is empty"),
    (b'{"model": "test-model", "prompt": ""}', "prompt is empty"),
    (b'{"model": "test-model", "messages": []}', "messages is empty"),
    (b'{"model": "test-model", "messages": "hi"}', "messages must be a list"),
    (b'{"model": "test-model", "prompt": 5}', "prompt must be a string"),
    (b'{"model": "test-model", "token_ids": [1, "2"]}', "token_ids must be a list of integers"),
    (b'{"model": "test-model", "token_ids": [1, 2.5]}', "token_ids must be a list of integers"),
    (b'{"model": "test-model", "token_ids": [1, 2.0]}', "token_ids must be a list of integers"),
    (b'{"model": "test-model", "token_ids": [1, true]}', "token_ids must be a list of integers"),
    (b'{"model": "test-model", "token_ids": [1, null]}', "token_ids must be a list of integers"),
    (b'{"model": "test-model", "token_ids": [1, -1]}', ">= 0"),
    (b'{"model": "test-model", "token_ids": [1, %d]}' % (MAX_TOKEN_ID + 1), f"<= {MAX_TOKEN_ID}"),
    (b'{"model": "test-model", "token_ids": [1, 99999999999999999999999]}', "token_ids must be"),
    (b'{"model": "test-model", "token_ids": 5}', "token_ids must be a list"),
    (b'{"model": "test-model", "token_ids": [1], "pods": "pod-a"}', "pods must be a list of pod id strings"),
    (b'{"model": "test-model", "token_ids": [1], "pods": ["pod-a", 3]}', "pods must be a list of pod id strings"),
]


@pytest.mark.parametrize(("body", "needle"), BAD_INPUTS, ids=[b.decode()[:60] for b, _ in BAD_INPUTS])
async def test_bad_input_is_a_400_saying_what_is_wrong(client, body, needle):
    r = await client.post(PREDICT, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    assert needle in r.json()["error"], r.json()


async def test_max_token_id_itself_is_accepted(client, writer):
    await writer.store("pod-a", tokens_of(16))
    r = await client.post(PREDICT, json={"model": MODEL, "token_ids": [0, MAX_TOKEN_ID] * 8})
    assert r.status_code == 200, r.text


async def test_too_many_tokens_names_the_limit(make_client, writer):
    await writer.store("pod-a", tokens_of(16))
    client = await make_client(max_tokens=64)
    assert (await client.post(PREDICT, json={"model": MODEL, "token_ids": tokens_of(64)})).status_code == 200
    r = await client.post(PREDICT, json={"model": MODEL, "token_ids": tokens_of(65)})
    assert r.status_code == 400
    assert "too many tokens: 65" in r.json()["error"] and "limit of 64" in r.json()["error"]


async def test_body_over_the_limit_is_a_413(make_client):
    client = await make_client(max_body_bytes=1024)
    body = {"model": MODEL, "token_ids": tokens_of(400)}
    r = await client.post(PREDICT, json=body)
    assert r.status_code == 413 and "1024" in r.json()["error"]

    async def chunked():  # no Content-Length: the limit must hold while streaming
        for _ in range(10):
            yield b" " * 200
        yield b'{"model": "test-model", "token_ids": [1]}'

    r = await client.post(PREDICT, content=chunked())
    assert r.status_code == 413 and "1024" in r.json()["error"]


async def test_unknown_route_and_method_are_json(client):
    r = await client.get("/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = await client.get(PREDICT)
    assert r.status_code == 405 and "error" in r.json()


# ---------------------------------------------------------------- health, stats, valkey outage


async def test_health(client):
    r = await client.get("/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


async def test_stats(client, writer, ix):
    prompt = tokens_of(64)
    await writer.store("pod-a", prompt, engine_block=32)
    await writer.store("pod-a", tokens_of(32, start=9))
    await writer.store("pod-b", prompt[:16])
    await ix.meta.mark_incomplete("pod-b", "gap 3..7")
    await ix.meta.count("decode_errors", 2)
    assert (await client.post(PREDICT, json={"model": MODEL, "token_ids": prompt})).status_code == 200
    assert (await client.post(PREDICT, json={"model": MODEL, "token_ids": []})).status_code == 400
    assert (await client.post(PREDICT, json={"model": "nope", "token_ids": [1]})).status_code == 400
    r = await client.get("/stats")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["index_keys"] == await ix.key_count() > 0
    pods = {p["pod_id"]: p for p in doc["pods"]}
    assert set(pods) == {"pod-a", "pod-b"}
    a = pods["pod-a"]
    assert (a["model"], a["last_seq"], a["blocks"], a["incomplete"]) == (MODEL, {"0": 1}, 4, False)
    assert a["engine_block_size"] == 16  # the latest batch's engine block size
    assert 0 <= a["last_event_age_s"] < 10
    assert {k: a["counters"][k] for k in ("batches", "stored", "removed", "cleared")} == {
        "batches": 2, "stored": 4, "removed": 0, "cleared": 0,
    }
    assert (pods["pod-b"]["incomplete"], pods["pod-b"]["incomplete_reason"]) == (True, "gap 3..7")
    assert doc["index_counters"] == {"decode_errors": 2}
    assert doc["process"]["predictions"] == 1
    assert doc["c_extension"] is HAS_C_EXTENSION  # whether the C block-key routine is in
    assert doc["process"]["errors"] == {"bad_request": 1, "unknown_model": 1}


@pytest.mark.serial(reason="bounds the 503s' wall time (5 s), which another test's CPU could stretch")
async def test_valkey_down_is_a_fast_503_and_recovers(client, writer, valkey_server):
    prompt = tokens_of(64)
    await writer.store("pod-a", prompt)
    body = {"model": MODEL, "token_ids": prompt + [1]}
    assert (await client.post(PREDICT, json=body)).json()["predicted_cached_tokens"] == 64
    valkey_server.stop()
    try:
        t0 = time.monotonic()
        r = await client.post(PREDICT, json=body)
        assert r.status_code == 503, r.text
        assert "valkey" in r.json()["error"]
        r = await client.post(PREDICT, json={"model": "unseen-model", "token_ids": prompt})
        assert r.status_code == 503, r.text
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        r = await client.get("/stats")
        assert r.status_code == 503 and "valkey" in r.json()["error"]
        assert time.monotonic() - t0 < 5
        # bad input is still a 400, whatever Valkey's state
        assert (await client.post(PREDICT, json={"model": MODEL, "token_ids": [-1]})).status_code == 400
    finally:
        valkey_server.start()
    deadline = time.monotonic() + 5
    while (await client.get("/health")).status_code != 200:
        assert time.monotonic() < deadline, "predictor did not recover after valkey came back"
        await asyncio.sleep(0.1)
    r = await client.post(PREDICT, json=body)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- the real server, via the CLI


@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_under_uvicorn(valkey_url, writer, workers):
    prompt = tokens_of(64)
    await writer.store("pod-a", prompt)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kv_preflight.cli.main import main; main()", "serve", "--valkey-url", valkey_url,
         "--port", str(port), "--workers", str(workers)],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, proc.stderr.read().decode()
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "server did not come up"
                await asyncio.sleep(0.1)
            for _ in range(4):  # with 2 workers, likely reaches both
                r = await http.post(PREDICT, json={"model": MODEL, "token_ids": prompt + [1]})
                assert r.status_code == 200, r.text
                assert (r.json()["best_pod"], r.json()["predicted_cached_tokens"]) == ("pod-a", 64)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", ["predictor", "gateway"])
async def test_a_served_worker_runs_with_the_collector_tuned_and_leaves_it_as_it_was(valkey_url, kind):
    """kv_preflight/collector.py: while a predictor's or gateway's app runs (its lifespan), what the worker loaded
    at start is frozen out of the collector's passes and the passes are rarer; the previous settings come back
    when the app stops (tests and scripts/bench run apps in one process)."""
    import gc

    from kv_preflight.collector import THRESHOLDS
    from kv_preflight.predictor.gateway.app import create_gateway_app

    before = gc.get_threshold()
    app = (create_app if kind == "predictor" else create_gateway_app)(Config(valkey_url=valkey_url))
    async with app.router.lifespan_context(app):
        assert gc.get_threshold() == THRESHOLDS
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
