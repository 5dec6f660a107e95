"""Local tokenization with its start-up check, TTFT estimates, routing on scraped engine load
(LoRA included), API keys, /metrics and /openapi.json: the predictor app against a real
valkey-server and engine HTTP stubs on real ports."""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.predictor.http.app import create_app
from kv_preflight.predictor.tokens.local import LocalTokenizer
from kv_preflight.predictor.scoring.ttft import PrefillModel
from kv_preflight.config import Config
from kv_preflight.index.index import Index
from kv_preflight.keys.chain import request_keys
from tests.integration.leases import vouch
from tests.integration.http_engine import HttpEngine
from tests.prom import metric
from tests.integration.test_predictor import IndexWriter
from tests.tokenizer_files import BOS, write_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

M = "tok-model"
C = 16


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return LocalTokenizer.load(tok_dir)


@pytest.fixture
def writer(ix):
    return IndexWriter(ix)


@pytest.fixture
def engines():
    started: list[HttpEngine] = []

    def make(pod: str, models: list[str], **kw) -> HttpEngine:
        e = HttpEngine(pod, models, **kw).start()
        started.append(e)
        return e

    yield make
    for e in started:
        e.stop()


@asynccontextmanager
async def running(cfg: Config):
    """The app with its lifespan (start-up checks, load scraping) and a client."""
    app = create_app(cfg)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as client:
            yield app, client


def engine_like(tok: LocalTokenizer, *, double_bos_for_messages: bool = False):
    def tokenize(body: dict) -> list[int]:
        if "messages" in body:
            ids = tok.encode_messages(body["messages"])
            return [ids[0]] + ids if double_bos_for_messages else ids
        return tok.encode_prompt(body["prompt"])
    return tokenize


# ---------------------------------------------------------------- local tokenization


async def test_local_tokenizer_passes_the_check_and_serves_without_the_engine(valkey_url, engines, tok, tok_dir, writer):
    eng = engines("pod-a", [M], tokenize_fn=engine_like(tok))
    cfg = Config(valkey_url=valkey_url, block_size=C, engine_urls={M: eng.url}, tokenizers={M: str(tok_dir)})
    prompt = "A prefix cache keeps the KV blocks of earlier prompts so a shared prefix is not computed again. " * 2
    tokens = tok.encode_prompt(prompt)
    await writer.store("pod-a", tokens, model=M)
    async with running(cfg) as (app, client):
        stats = (await client.get("/stats")).json()
        assert stats["tokenization"][M]["source"] == "local"
        assert stats["tokenization"][M]["check"] == "passed", stats["tokenization"]
        checked = len(eng.tokenize_requests)
        assert checked >= 10  # the built-in samples went through the engine once
        r = await client.post("/v1/cache/predict", json={"model": M, "prompt": prompt})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["total_prompt_tokens"] == len(tokens)
        assert doc["best_pod"] == "pod-a" and doc["predicted_cached_tokens"] == (len(tokens) - 1) // C * C
        msgs = [{"role": "user", "content": "Hello there!"}]
        r = await client.post("/v1/cache/predict", json={"model": M, "messages": msgs})
        assert r.json()["total_prompt_tokens"] == len(tok.encode_messages(msgs))
        assert len(eng.tokenize_requests) == checked, "prompt and messages must not reach the engine"
        text = (await client.get("/metrics")).text
        assert metric(text, "kvpf_tokenizations_total", model=M, source="local") == 2


async def test_a_failing_check_falls_back_to_the_engine_and_says_why(valkey_url, engines, tok, tok_dir):
    eng = engines("pod-a", [M], tokenize_fn=engine_like(tok, double_bos_for_messages=True))
    cfg = Config(valkey_url=valkey_url, block_size=C, engine_urls={M: eng.url}, tokenizers={M: str(tok_dir)})
    async with running(cfg) as (app, client):
        status = (await client.get("/stats")).json()["tokenization"][M]
        assert (status["source"], status["check"]) == ("engine", "failed")
        assert "duplicate BOS" in status["detail"] and BOS in status["detail"]
        before = len(eng.tokenize_requests)
        msgs = [{"role": "user", "content": "Hi"}]
        r = await client.post("/v1/cache/predict", json={"model": M, "messages": msgs})
        assert r.status_code == 200
        assert r.json()["total_prompt_tokens"] == len(tok.encode_messages(msgs)) + 1  # the engine's tokens
        assert len(eng.tokenize_requests) == before + 1
        text = (await client.get("/metrics")).text
        assert metric(text, "kvpf_tokenizations_total", model=M, source="engine") == 1


async def test_unreachable_engine_leaves_the_check_pending(valkey_url, tok_dir):
    cfg = Config(valkey_url=valkey_url, engine_urls={M: f"http://127.0.0.1:{free_port()}"},
                 tokenizers={M: str(tok_dir)}, engine_timeout_s=1.0)
    async with running(cfg) as (app, client):
        status = (await client.get("/stats")).json()["tokenization"][M]
        assert (status["source"], status["check"]) == ("local", "pending")
        assert "not reachable" in status["detail"]
        r = await client.post("/v1/cache/predict", json={"model": M, "prompt": "hello"})
        assert r.status_code == 200, r.text


async def test_local_only_model_and_template_errors(valkey_url, tmp_path):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('conversation must start with user') }}" \
             "{% endif %}{{ bos_token }}{{ messages[0]['content'] }}"
    d = write_tokenizer(tmp_path, chat_template=strict)
    cfg = Config(valkey_url=valkey_url, tokenizers={"solo": str(d)})
    async with running(cfg) as (app, client):
        assert (await client.get("/stats")).json()["tokenization"]["solo"]["check"] == "unchecked"
        ok = await client.post("/v1/cache/predict", json={"model": "solo", "messages": [{"role": "user", "content": "x"}]})
        assert ok.status_code == 200, ok.text
        bad = await client.post("/v1/cache/predict",
                                json={"model": "solo", "messages": [{"role": "system", "content": "x"}]})
        assert bad.status_code == 400
        assert "conversation must start with user" in bad.json()["error"]
        too_long = await client.post("/v1/cache/predict", json={"model": "solo", "prompt": "word " * 50})
        assert too_long.status_code == 200
    small = Config(valkey_url=valkey_url, tokenizers={"solo": str(d)}, max_tokens=8)
    async with running(small) as (app, client):
        r = await client.post("/v1/cache/predict", json={"model": "solo", "prompt": "word " * 50})
        assert r.status_code == 400 and "too many tokens" in r.json()["error"]


# ---------------------------------------------------------------- TTFT


async def test_ttft_estimates_follow_the_model_file(valkey_url, writer, tmp_path):
    model_file = tmp_path / "ttft.json"
    model_file.write_text(json.dumps({"models": {"m": {"overhead_ms": 10, "prefill_tokens_per_s": 1000}}}))
    await writer.store("pod-a", list(range(1000, 1064)), model="m")
    cfg = Config(valkey_url=valkey_url, block_size=C, ttft_model=str(model_file))
    async with running(cfg) as (app, client):
        doc = (await client.post("/v1/cache/predict", json={"model": "m", "token_ids": list(range(1000, 1100))})).json()
    assert doc["pod_affinities"][0]["estimated_ttft_ms"] == 10 + (100 - 64)
    assert doc["estimated_ttft_ms"] == 46.0
    cold = PrefillModel(overhead_ms=10, prefill_tokens_per_s=1000).estimate_ms(100, 0)
    assert cold == 110.0


# ---------------------------------------------------------------- routing


async def scrape(app) -> None:
    """The engines' load, and the fleet's records (the leases vouching for the pods), read once."""
    async with httpx.AsyncClient(timeout=2) as c:
        await app.state.predictor.load.scrape_once(c)
    await app.state.predictor.fleet.read_once()


async def test_route_prefers_overlap_until_the_pod_is_overloaded(valkey_url, engines, writer):
    prompt = list(range(5000, 5128))
    a = engines("pod-a", ["m"], running=10, waiting=5)
    b = engines("pod-b", ["m"], running=1)
    c = engines("pod-c", ["m"])
    await writer.store("pod-a", prompt[:96], model="m")
    await writer.store("pod-b", prompt[:64], model="m")
    await vouch(writer.index, "pod-a", "pod-b", "pod-c")
    cfg = Config(valkey_url=valkey_url, block_size=C,
                 pod_metrics={"pod-a": a.url, "pod-b": b.url + "/metrics", "pod-c": c.url})
    app = create_app(cfg)  # no lifespan: scrapes are driven by the test
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as client:
        await scrape(app)
        r = await client.post("/v1/cache/route", json={"model": "m", "token_ids": prompt})
        assert r.status_code == 200, r.text
        d = r.json()
        assert (d["pod_id"], d["reason"], d["best_overlap_pod"]) == ("pod-b", "least_loaded_good_match", "pod-a")
        assert d["cached_tokens"] == 64 and d["total_prompt_tokens"] == 128
        cands = {x["pod_id"]: x for x in d["candidates"]}
        assert set(cands) == {"pod-a", "pod-b", "pod-c"}
        assert cands["pod-a"]["overloaded"] and cands["pod-a"]["load"] == 20 and cands["pod-c"]["load"] == 0
        a.running, a.waiting = 2, 0
        await scrape(app)
        d = (await client.post("/v1/cache/route", json={"model": "m", "token_ids": prompt})).json()
        assert (d["pod_id"], d["reason"]) == ("pod-a", "best_overlap")
        # a pod filter limits the candidates
        d = (await client.post("/v1/cache/route", json={"model": "m", "token_ids": prompt, "pods": ["pod-c"]})).json()
        assert (d["pod_id"], d["reason"]) == ("pod-c", "no_overlap")
        # an engine whose metrics stop answering is left out while others remain
        a.running, a.waiting, b.metrics_ok = 2, 0, False
        await scrape(app)
        d = (await client.post("/v1/cache/route", json={"model": "m", "token_ids": prompt})).json()
        assert {x["pod_id"] for x in d["candidates"]} == {"pod-a", "pod-c"}
        stats = (await client.get("/stats")).json()["engine_load"]
        assert stats["pod-a"]["running"] == 2 and stats["pod-b"]["error"]
        text = (await client.get("/metrics")).text
        assert metric(text, "kvpf_route_decisions_total", reason="best_overlap") == 2
        assert metric(text, "kvpf_predictions_total", endpoint="route", outcome="hit") == 3
        assert metric(text, "kvpf_engine_scrape_errors_total") == 1  # pod-b's metrics, the once they failed
    await app.state.predictor.aclose()


async def test_engines_that_refuse_connections_are_counted(valkey_url):
    """A --pod-metrics URL and an --engine-url whose ports nothing listens on: each scrape of each fails (the
    second one's pod id cannot even be discovered), is counted, and /stats says which and why."""
    cfg = Config(valkey_url=valkey_url, pod_metrics={"pod-gone": f"http://127.0.0.1:{free_port()}"},
                 engine_urls={"m": f"http://127.0.0.1:{free_port()}"})
    app = create_app(cfg)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as client:
        for scrapes in (1, 2):
            await scrape(app)
            assert metric((await client.get("/metrics")).text, "kvpf_engine_scrape_errors_total") == 2 * scrapes
        stats = (await client.get("/stats")).json()["engine_load"]
        assert "ConnectError" in stats["pod-gone"]["error"]
        assert [v["error"] for k, v in stats.items() if k != "pod-gone"] == ["pod id not discovered yet"]
    await app.state.predictor.aclose()


async def test_route_respects_lora_adapters(valkey_url, engines, writer):
    """Adapter blocks are keyed by the adapter name: base-model blocks never attract an adapter request,
    and pods that do not serve the adapter are not candidates."""
    prompt = list(range(7000, 7096))
    base = engines("pod-base", ["llama"], tokenize_fn=None)
    lora = engines("pod-lora", ["llama", "sql-adapter"])
    await writer.store("pod-base", prompt, model="llama")
    await writer.store("pod-lora", prompt[:32], model="sql-adapter")
    await vouch(writer.index, "pod-base", "pod-lora")
    cfg = Config(valkey_url=valkey_url, block_size=C, engine_urls={"llama": base.url, "sql-adapter": lora.url})
    app = create_app(cfg)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as client:
        await scrape(app)  # discovers pod ids from /kv_event_sources
        await scrape(app)
        d = (await client.post("/v1/cache/route", json={"model": "sql-adapter", "token_ids": prompt})).json()
        assert (d["pod_id"], d["cached_tokens"]) == ("pod-lora", 32)
        assert [x["pod_id"] for x in d["candidates"]] == ["pod-lora"]
        d = (await client.post("/v1/cache/route", json={"model": "llama", "token_ids": prompt})).json()
        assert (d["pod_id"], d["reason"]) == ("pod-base", "best_overlap")
        assert {x["pod_id"] for x in d["candidates"]} == {"pod-base", "pod-lora"}
        # nothing cached for the adapter: still only pods that serve it
        d = (await client.post("/v1/cache/route", json={"model": "sql-adapter", "token_ids": list(range(50))})).json()
        assert (d["pod_id"], d["reason"]) == ("pod-lora", "no_overlap")
        p = (await client.post("/v1/cache/predict", json={"model": "sql-adapter", "token_ids": prompt})).json()
        assert [a["pod_id"] for a in p["pod_affinities"]] == ["pod-lora"]
    await app.state.predictor.aclose()


async def test_route_load_is_scraped_in_the_background(valkey_url, engines, writer):
    e = engines("pod-x", ["m"], running=3, waiting=1, kv_usage=0.25)
    await writer.store("pod-x", list(range(64)), model="m")
    cfg = Config(valkey_url=valkey_url, block_size=C, pod_metrics={"pod-x": e.url}, metrics_interval_s=0.05)
    async with running(cfg) as (app, client):
        for _ in range(200):
            load = (await client.get("/stats")).json()["engine_load"]["pod-x"]
            # /metrics and /v1/models are fetched separately: wait for both.
            if load["running"] is not None and load["models"]:
                break
            await asyncio.sleep(0.02)
        assert (load["running"], load["waiting"], load["kv_usage"], load["models"]) == (3, 1, 0.25, ["m"])
        d = (await client.post("/v1/cache/route", json={"model": "m", "token_ids": list(range(80))})).json()
        assert d["candidates"][0]["running"] == 3 and d["pod_id"] == "pod-x"


async def test_route_with_no_known_pod(valkey_url, tok_dir):
    cfg = Config(valkey_url=valkey_url, tokenizers={M: str(tok_dir)})
    async with running(cfg) as (app, client):
        d = (await client.post("/v1/cache/route", json={"model": M, "prompt": "hello"})).json()
        assert (d["pod_id"], d["reason"], d["candidates"]) == (None, "no_candidates", [])
        assert d["estimated_ttft_ms"] > 0


# ---------------------------------------------------------------- API keys, errors, metrics, OpenAPI


async def test_api_keys(valkey_url, tmp_path, caplog, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("file-key-123\n")
    monkeypatch.setenv("KVPF_API_KEYS", "env-key-456")
    cfg = Config.load(valkey_url=valkey_url, api_keys_file=str(keys))
    assert "env-key-456" not in repr(cfg)
    caplog.set_level(logging.DEBUG)
    async with running(cfg) as (app, client):
        body = {"model": "m", "token_ids": [1, 2, 3]}
        assert (await client.get("/health")).status_code == 200
        r = await client.post("/v1/cache/predict", json=body)
        assert r.status_code == 401 and r.json()["error"].startswith("missing or invalid API key")
        assert (await client.get("/stats")).status_code == 401
        assert (await client.get("/metrics")).status_code == 401
        for key in ("file-key-123", "env-key-456"):
            r = await client.post("/v1/cache/predict", json=body, headers={"Authorization": f"Bearer {key}"})
            # past auth: an empty index knows no model yet, so not ready (503)
            assert r.status_code == 503 and "no ingester has reported" in r.json()["error"]
        r = await client.post("/v1/cache/predict", json=body, headers={"Authorization": "Bearer file-key-12"})
        assert r.status_code == 401
        text = (await client.get("/metrics", headers={"Authorization": "Bearer env-key-456"})).text
        assert metric(text, "kvpf_unauthorized_requests_total") == 4
        doc = (await client.get("/openapi.json", headers={"Authorization": "Bearer env-key-456"})).json()
        assert doc["security"] == [{"bearer": []}]
    assert "file-key-123" not in caplog.text and "env-key-456" not in caplog.text


async def test_metrics_count_outcomes_and_valkey_errors(valkey_url, writer):
    await writer.store("pod-a", list(range(64)), model="m")
    cfg = Config(valkey_url=valkey_url, block_size=C)
    async with running(cfg) as (app, client):
        await client.post("/v1/cache/predict", json={"model": "m", "token_ids": list(range(80))})
        await client.post("/v1/cache/predict", json={"model": "m", "token_ids": list(range(900, 980))})
        await client.post("/v1/cache/predict", json={"model": "m", "token_ids": [-1]})
        r = await client.get("/metrics")
        assert r.headers["content-type"].startswith("text/plain")
        text = r.text
    assert metric(text, "kvpf_predictions_total", endpoint="predict", outcome="hit") == 1
    assert metric(text, "kvpf_predictions_total", endpoint="predict", outcome="miss") == 1
    assert metric(text, "kvpf_predictions_total", endpoint="predict", outcome="bad_request") == 1
    assert metric(text, "kvpf_request_duration_seconds_count", endpoint="predict") == 3
    down = Config(valkey_url=f"redis://127.0.0.1:{free_port()}/0", valkey_timeout_s=0.2)
    async with running(down) as (app, client):
        r = await client.post("/v1/cache/predict", json={"model": "m", "token_ids": [1, 2]})
        assert r.status_code == 503 and "valkey" in r.json()["error"]
        assert metric((await client.get("/metrics")).text, "kvpf_valkey_errors_total") == 1


async def test_openapi_document_describes_the_real_api(valkey_url, tok_dir):
    cfg = Config(valkey_url=valkey_url, tokenizers={M: str(tok_dir)}, max_tokens=4096)
    async with running(cfg) as (app, client):
        doc = (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) >= {"/v1/cache/predict", "/v1/cache/route", "/health", "/stats", "/metrics"}
    req = doc["components"]["schemas"]["PredictRequest"]
    assert [v["required"] for v in req["oneOf"]] == [["model", "token_ids"], ["model", "prompt"], ["model", "messages"]]
    assert req["oneOf"][0]["properties"]["token_ids"]["maxItems"] == 4096
    assert req["oneOf"][0]["properties"]["model"]["examples"] == [M]
    pred = doc["components"]["schemas"]["Prediction"]["properties"]
    assert {"predicted_cached_tokens", "best_pod", "pod_affinities", "estimated_ttft_ms"} <= set(pred)
    assert "estimated_ttft_ms" in doc["components"]["schemas"]["PodAffinity"]["properties"]
    assert "security" not in doc


# ---------------------------------------------------------------- Valkey with a password, and over TLS


@pytest.fixture(scope="module")
def password_valkey(tmp_path_factory):
    from kv_preflight.cli.valkey_server import ValkeyServer

    server = ValkeyServer(tmp_path_factory.mktemp("vk-pw"), requirepass="p@ss:w/rd", appendonly=False).start()
    yield server
    server.stop()


async def test_password_protected_valkey(password_valkey, writer):
    url = password_valkey.url
    assert url.startswith("redis://:p%40ss%3Aw%2Frd@")
    ix = Index.from_url(url)
    try:
        await ix.client.flushall()
        await IndexWriter(ix).store("pod-a", list(range(64)), model="m")
    finally:
        await ix.close()
    async with running(Config(valkey_url=url, block_size=C)) as (app, client):
        assert (await client.get("/health")).status_code == 200
        doc = (await client.post("/v1/cache/predict", json={"model": "m", "token_ids": list(range(80))})).json()
        assert doc["best_pod"] == "pod-a"
    wrong = url.replace("p%40ss", "nope")
    async with running(Config(valkey_url=wrong, valkey_timeout_s=0.5)) as (app, client):
        r = await client.get("/health")
        assert r.status_code == 503 and "valkey" in r.json()["error"]
        r = await client.post("/v1/cache/predict", json={"model": "m", "token_ids": [1]})
        assert r.status_code == 503


async def test_tls_valkey(tmp_path):
    from kv_preflight.cli.valkey_server import ValkeyServer
    from tests.integration.tls import self_signed

    cert, key = self_signed(tmp_path)
    server = ValkeyServer(tmp_path / "data", appendonly=False, requirepass="tls-pw", tls_cert=cert, tls_key=key)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        pytest.skip(f"this valkey-server has no TLS: {exc}")
    try:
        assert server.url.startswith("rediss://")
        ix = Index.from_url(server.url)
        await IndexWriter(ix).store("pod-t", list(range(32)), model="m")
        keys = request_keys(list(range(32)), model="m", block_size=C)
        assert [m.pod_id for m in await ix.lookup(keys)] == ["pod-t"]
        await ix.close()
        async with running(Config(valkey_url=server.url, block_size=C)) as (app, client):
            assert (await client.get("/health")).status_code == 200
            doc = (await client.post("/v1/cache/predict", json={"model": "m", "token_ids": list(range(40))})).json()
            assert (doc["best_pod"], doc["predicted_cached_tokens"]) == ("pod-t", 32)
    finally:
        server.stop()
