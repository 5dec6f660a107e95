"""Errors that tell the truth (issue 27, findings 3, 4 and 5), with real processes: a valkey-server, a
zero-config ``kv-preflight serve``, a ``kv-preflight simulate`` engine and a ``kv-preflight ingest``.

- before any ingester has reported a pod, a predict is a 503 (retryable: not ready), not a 400;
- a model nobody serves is a 400 that says no ingester has reported a pod of it, lists the known models
  and asks "did you mean" case-insensitively;
- an unknown pod in a predict's ``pods`` filter is a warning in the answer;
- the engine down, a prompt cannot be tokenized: a 503 (the server's dependency), not a 400;
- an engine's 4xx on /tokenize is a 400 only when it judges the input (400, 413, 422); a 401, 403, 404 or
  429 is the server's set-up or state: a 503 naming the engine, its status and the fix.
"""
from __future__ import annotations

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.index.index import Index
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.http_engine import HttpEngine
from tests.integration.sim import sim_engine
from tests.integration.test_fleet import FAST, FAST_ENV, until

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_errors_name_their_cause_and_503_is_for_the_server(valkey_url, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pred = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port)], str(tmp_path / "pred.log"))
    engine = sim_engine("sim-t", tmp_path)
    ing = None
    ix = Index.from_url(valkey_url)
    try:
        wait_http(base + "/health")
        ready = httpx.get(base + "/ready", timeout=5)
        assert ready.status_code == 200, ready.text  # the fleet records were read (there are none)
        # 4: nothing reported yet: the predictor cannot judge the model, a 503 naming why
        r = httpx.post(base + "/v1/cache/predict", json={"model": "sim", "token_ids": list(range(40))}, timeout=5)
        assert r.status_code == 503, r.text
        assert "no ingester has reported a pod" in r.json()["error"]

        engine.start()
        ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", engine.url, *FAST],
                    str(tmp_path / "ing.log"), env=FAST_ENV)

        async def live():
            rec = (await ix.fleet.fleet_view()).pods.get("sim-t")
            return rec is not None and rec.state == "live" and rec.models

        await until(live, "sim-t live with its models")

        def served() -> bool:
            return httpx.post(base + "/v1/cache/predict", json={"model": "sim", "prompt": "hello"},
                              timeout=5).status_code == 200

        await until(lambda: _async(served), "the predictor tokenizing through the engine")
        # 4: a model nobody serves, while others are known: the client's mistake, a 400 that helps
        r = httpx.post(base + "/v1/cache/predict", json={"model": "Sim", "token_ids": list(range(40))}, timeout=5)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "no ingester has reported a pod of this model yet" in error, error
        assert "known models: 'sim'" in error and "did you mean 'sim'?" in error, error

        # 5: an unknown pod in a pods filter is not silently "not cached"
        r = httpx.post(base + "/v1/cache/predict",
                       json={"model": "sim", "token_ids": list(range(40)), "pods": ["newbie-1"]}, timeout=5)
        assert r.status_code == 200, r.text
        kinds = [w["kind"] for w in r.json()["warnings"]]
        assert kinds == ["unknown_pod"] and "'newbie-1'" in r.json()["warnings"][0]["detail"]
        r = httpx.post(base + "/v1/cache/predict",
                       json={"model": "sim", "token_ids": list(range(40)), "pods": ["sim-t"]}, timeout=5)
        assert r.json()["warnings"] == []

        # 3: the engine stops: a prompt cannot be tokenized, and that is the server's side (503)
        engine.stop(kill=True)

        async def unreachable():
            rec = (await ix.fleet.fleet_view()).pods.get("sim-t")
            return rec is not None and rec.state == "unreachable"

        await until(unreachable, "sim-t unreachable")

        def refused():  # until the predictor's fleet view has it down, /tokenize itself fails: a 503 too
            r = httpx.post(base + "/v1/cache/predict", json={"model": "sim", "prompt": "hello"}, timeout=15)
            assert r.status_code in (200, 503), r.text
            return r if "cannot tokenize" in r.text else None

        r = await until(lambda: _async(refused), "a refusal once the fleet view has the engine down")
        assert r.status_code == 503, r.text
        assert "cannot tokenize for model 'sim'" in r.json()["error"] and "token_ids" in r.json()["error"]
        # token ids need no engine: still answered
        r = httpx.post(base + "/v1/cache/predict", json={"model": "sim", "token_ids": list(range(40))}, timeout=5)
        assert r.status_code == 200, r.text
        # a route whose pods filter names only that pod goes nowhere, and says why (it said no pod serves the model)
        r = httpx.post(base + "/v1/cache/route", json={"model": "sim", "token_ids": list(range(40)), "pods": ["sim-t"]},
                       timeout=5)
        assert r.status_code == 200 and r.json()["pod_id"] is None, r.text
        assert r.json()["reason"] == "no_candidates" and "sim-t unreachable" in r.json()["detail"], r.text
    finally:
        if ing is not None:
            stop(ing)
        stop(pred)
        engine.stop()
        await ix.close()


async def _async(fn):
    return fn()


async def test_not_ready_until_the_fleet_records_are_read(valkey_url):
    """Finding 4: a zero-config predictor that had passed /health answered 400 "unknown model" to routers in
    its first second, before it had read the fleet records. Until then /ready and such a request are 503."""
    from kv_preflight.config import Config
    from kv_preflight.predictor.http.app import create_app

    app = create_app(Config(valkey_url=valkey_url))  # its lifespan (which reads the records) not run yet
    predictor = app.state.predictor
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as client:
        try:
            assert (await client.get("/health")).status_code == 200  # alive, Valkey answers
            r = await client.get("/ready")
            assert r.status_code == 503 and "fleet records have not been read" in r.json()["error"], r.text
            r = await client.post("/v1/cache/predict", json={"model": "tiny", "token_ids": list(range(40))})
            assert r.status_code == 503 and r.json()["error"].startswith("not ready"), r.text
            await predictor.fleet.read_once()
            assert (await client.get("/ready")).status_code == 200
        finally:
            await predictor.aclose()


# the engine's /tokenize status for a model named after it, and what the predictor must answer
ENGINE_STATUSES = {"m401": (401, 503), "m403": (403, 503), "m404": (404, 503), "m429": (429, 503),
                   "m400": (400, 400), "m413": (413, 400), "m422": (422, 400)}


def test_only_the_engines_verdict_on_the_input_is_a_400(valkey_url, tmp_path):
    """An engine's 4xx on /tokenize was always a 400 (EngineRejected): a 401 from an engine that wants an API
    key, a 404 from a wrong URL or model, a 429 from its rate limit read as the client's fault, and a router
    would not retry. Only 400, 413 and 422 judge the input; the rest is a 503 naming the engine, its status
    and the fix. A real ``serve`` against an engine stub on a real port."""
    engine = HttpEngine("stub", list(ENGINE_STATUSES), tokenize_fn=lambda body: [1, 2, 3],
                        tokenize_status=lambda body: ENGINE_STATUSES[body["model"]][0]).start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    urls = [f"--engine-url={m}={engine.url}" for m in ENGINE_STATUSES]
    pred = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), "--no-tokenizer-check", *urls],
                 str(tmp_path / "pred.log"))
    try:
        wait_http(base + "/ready")
        for model, (engine_status, want) in ENGINE_STATUSES.items():
            r = httpx.post(base + "/v1/cache/predict", json={"model": model, "prompt": "hello"}, timeout=15)
            assert r.status_code == want, (model, r.text)
            error = r.json()["error"]
            assert engine.url in error and f"({engine_status})" in error, error
            if want == 503:
                assert "; " in error.split(f"({engine_status}): stub refusal {engine_status}")[1], error  # a fix
        r = httpx.post(base + "/v1/cache/predict", json={"model": "m401", "prompt": "hello"}, timeout=15)
        assert "API key" in r.json()["error"], r.text
        r = httpx.post(base + "/v1/cache/predict", json={"model": "m404", "prompt": "hello"}, timeout=15)
        assert "check the engine URL" in r.json()["error"], r.text
    finally:
        stop(pred)
        engine.stop()
