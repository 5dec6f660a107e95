"""The remote-indexer API (``serve --dynamo-port``, predictor/dynamo/api.py) against a real valkey-server.

The index is filled the way an ingester fills it: vLLM-shaped BlockStored events planned by the
ingester's bridge (ingester/bridge.py) and applied with Index.apply_batch. Expected answers are
Dynamo's documented ones: docs/components/router/standalone-indexer.md (the /query example, as the
docs for v1.4.0 to v1.6.2 and dev show it) and the status codes and error texts of
lib/kv-router/src/services/indexer/server.rs @ 47022ee4c6f1a997794ed038af8582a5e5df347e and
registry.rs @ 317eb30e8639550dbc7692723387a6dc2ae97ef5.
"""
from __future__ import annotations

import time

import httpx
import pytest

from kv_preflight.engines.vllm import ENGINE as VLLM
from kv_preflight.ingester.bridge import ChainState, plan_batch
from kv_preflight.predictor.http.app import create_app
from kv_preflight.predictor.dynamo.api import create_dynamo_app
from kv_preflight.predictor.dynamo.wire import stable_instance_id
from kv_preflight.config import Config
from kv_preflight.events import BlockStored, EventBatch
from tests.integration.leases import vouch

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

MODEL = "llama-3-8b"


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dynamo")


async def ingest(ix, pod: str, events: list, seq: int, model: str = MODEL, state: ChainState | None = None) -> None:
    """One batch through the ingester's bridge into the index, as an ingester applies it."""
    batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=0)
    plan = plan_batch(batch, pod_id=pod, topic_model=model, state=state if state is not None else ChainState(), hash_seed="",
                      block_size=16, entry_field=ix.entry_field, extra_keys=VLLM.extra_keys)
    result = await ix.apply_batch(pod_id=pod, rank=0, seq=seq, ts=batch.ts, model=model,
                                  engine_block_size=plan.engine_block_size, mutations=plan.mutations)
    assert result.status == "applied" and not plan.orphans


def stored(hashes, parent, tokens, *, medium="GPU", extra_keys=None):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=16, lora_id=None,
                       medium=medium, lora_name=None, extra_keys=extra_keys)


REGISTER_1 = {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5557", "model_name": MODEL, "block_size": 16}
REGISTER_2 = {"instance_id": 2, "endpoint": "tcp://127.0.0.1:5558", "model_name": MODEL, "block_size": 16,
              "dp_rank": 1}


async def test_query_answers_dynamos_documented_example(ix, valkey_url):
    """Worker 1 holds two blocks on the GPU and a third in host memory; worker 2 (dp rank 1) nothing:
    exactly the example of Dynamo's standalone-indexer docs."""
    cfg = Config(valkey_url=valkey_url)
    async with client(create_dynamo_app(cfg, ix)) as c:
        assert (await c.post("/register", json=REGISTER_1)).status_code == 201
        r = await c.post("/register", json=REGISTER_2)
        assert (r.status_code, r.json()) == (201, {"status": "ok"})
        tokens = list(range(100, 164))  # four blocks of 16
        state = ChainState()
        await ingest(ix, "dynamo-1", [stored([11, 12], None, tokens[:32])], 0, state=state)
        await ingest(ix, "dynamo-1", [stored([13], 12, tokens[32:48], medium="CPU")], 1, state=state)
        r = await c.post("/query", json={"token_ids": tokens, "model_name": MODEL})
        assert r.status_code == 200
        answer = r.json()
        # kv-preflight's one addition: how fresh the answer is (no ingester lease names these pods here, so
        # what worker 1 holds is not vouched for; worker 2 holds nothing)
        assert answer.pop("freshness") == {
            "state": "degraded", "reasons": ["ingestion unknown for 1 (no ingester's lease covers it)"],
            "pods": {"1": {"state": "unknown"}, "2/1": {"state": "unknown"}}}
        assert answer == {
            "scores": {"1": {"0": 32}, "2": {"1": 0}},
            "frequencies": [1, 1],
            "instances": {
                "1": {"longest_matched": 48, "gpu": 32, "dp": {"0": 32}, "cpu": 48, "disk": 48},
                "2": {"longest_matched": 0, "gpu": 0, "dp": {"1": 0}, "cpu": 0, "disk": 0},
            },
        }
        # Dynamo ignores tenant_id; an unknown routing group or model has no indexer
        r = await c.post("/query", json={"token_ids": tokens, "model_name": MODEL, "tenant_id": "x"})
        assert r.json()["instances"]["1"]["gpu"] == 32
        r = await c.post("/query", json={"token_ids": tokens, "model_name": MODEL, "routing_group": "acme"})
        assert (r.status_code, r.json()) == (404, {"error": f"no indexer for model={MODEL} routing_group=acme"})
        r = await c.post("/query", json={"token_ids": tokens, "model_name": "other"})
        assert r.status_code == 404
        assert (await c.post("/query", json={"model_name": MODEL})).status_code == 422
        assert (await c.post("/query", content=b"{not json")).status_code == 400


async def test_register_and_unregister_write_the_run_time_engines(ix, valkey_url):
    cfg = Config(valkey_url=valkey_url)
    async with client(create_dynamo_app(cfg, ix)) as c:
        body = REGISTER_1 | {"replay_endpoint": "tcp://127.0.0.1:5560", "routing_group": "acme"}
        assert (await c.post("/register", json=body)).status_code == 201
        engines = await ix.fleet.registered_engines()
        rec = engines["dynamo:1:0"]
        assert (rec.source, rec.replay, rec.pod, rec.model, rec.instance_id, rec.block_size, rec.dp_rank,
                rec.routing_group) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5560", "dynamo-1", MODEL, 1, 16, 0,
                                       "acme")
        r = await c.post("/register", json=body)
        assert (r.status_code, r.json()) == (409, {"error": "instance 1 dp_rank 0 already registered"})
        r = await c.post("/register", json=REGISTER_1 | {"dp_rank": 1})
        assert (r.status_code, r.json()) == (409, {"error": f"instance 1 is already registered for model={MODEL} "
                                                            "routing_group=acme"})
        r = await c.post("/register", json=REGISTER_2 | {"instance_id": 3, "block_size": 32, "routing_group": "acme"})
        assert (r.status_code, r.json()) == (409, {"error": f"block_size mismatch for model={MODEL} routing_group=acme: "
                                                            "existing=16, requested=32"})
        assert (await c.post("/register", json=body | {"dp_rank": 1, "endpoint": "tcp://127.0.0.1:5558"})).status_code == 201

        workers = (await c.get("/workers")).json()
        assert workers == [{"instance_id": 1, "source": "zmq", "status": "pending", "model_name": MODEL,
                            "routing_group": "acme", "block_size": 16,
                            "endpoints": {"0": "tcp://127.0.0.1:5557", "1": "tcp://127.0.0.1:5558"},
                            "listeners": {"0": {"endpoint": "tcp://127.0.0.1:5557", "status": "pending"},
                                          "1": {"endpoint": "tcp://127.0.0.1:5558", "status": "pending"}}}]
        await ingest(ix, "dynamo-1", [stored([11], None, list(range(16)))], 0)
        workers = (await c.get("/workers?routing_group=acme")).json()
        assert workers[0]["listeners"]["0"]["status"] == "active" and workers[0]["status"] == "pending"
        assert (await c.get("/workers?model_name=nonexistent")).json() == []

        r = await c.post("/unregister", json={"instance_id": 1, "model_name": "other"})
        assert (r.status_code, r.json()) == (404, {"error": f"instance 1 is registered for model={MODEL} "
                                                            "routing_group=acme"})
        r = await c.post("/unregister", json={"instance_id": 1, "model_name": MODEL, "routing_group": "acme",
                                              "dp_rank": 1})
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        assert set(await ix.fleet.registered_engines()) == {"dynamo:1:0"}
        assert (await c.post("/unregister", json={"instance_id": 1, "model_name": MODEL})).status_code == 200
        assert await ix.fleet.registered_engines() == {}
        assert "dynamo-1" not in await ix.meta.pod_ids()  # its entries went with it, as Dynamo drops a worker's blocks
        r = await c.post("/unregister", json={"instance_id": 1, "model_name": MODEL})
        assert (r.status_code, r.json()) == (404, {"error": "instance 1 not found"})


async def test_unregister_of_a_worker_whose_state_log_does_not_read_is_a_clear_error_and_flags_it(ix, valkey_url):
    """/unregister clears the worker's entries, reading its pod's state log; junk there (a hand edit, a bug, a build
    that writes another format) was a bare 500 with the decoder's traceback in the log, the pod left refused by
    every ingester. Now: the registration goes, the entries stay (they cannot be found to clear), the pod flagged
    with the reason and not refused, and the answer says so."""
    from kv_preflight.index.layout import FORGET_KEY, pod_state_key

    async with client(create_dynamo_app(Config(valkey_url=valkey_url), ix)) as c:
        assert (await c.post("/register", json=REGISTER_1)).status_code == 201
        await ingest(ix, "dynamo-1", [stored([11], None, list(range(16)))], 0)
        await ix.client.hset(pod_state_key("dynamo-1"), "s", b"\xc1junk")
        r = await c.post("/unregister", json={"instance_id": 1, "model_name": MODEL})
        assert r.status_code == 500 and "pod dynamo-1: its state log does not read" in r.json()["error"], r.text
        assert await ix.fleet.registered_engines() == {}
        info = await ix.meta.pod_info("dynamo-1")
        assert info.blocks == 1 and info.incomplete and "state log does not read" in info.incomplete_reason, info
        assert not await ix.client.hexists(FORGET_KEY, "dynamo-1")


async def test_register_checks_endpoints_and_the_allow_list(ix, valkey_url):
    async with client(create_dynamo_app(Config(valkey_url=valkey_url), ix)) as c:
        for bad in ("tcp://host", "tcp://:5558", "udp://host:5558", "not-an-endpoint"):
            r = await c.post("/register", json=REGISTER_1 | {"endpoint": bad})
            assert r.status_code == 400 and "invalid endpoint" in r.json()["error"], bad
        r = await c.post("/register", json=REGISTER_1 | {"replay_endpoint": "tcp://host"})
        assert r.status_code == 400 and r.json()["error"].startswith("invalid replay endpoint")
        for refused in ("tcp://10.0.0.7:5557", "tcp://*:5557", "inproc://listener"):
            r = await c.post("/register", json=REGISTER_1 | {"endpoint": refused})
            assert r.status_code == 403, refused
        assert (await c.post("/register", json={"instance_id": 1})).status_code == 422
        assert (await c.post("/register", content=b"[")).status_code == 400
        assert await ix.fleet.registered_engines() == {}
    cfg = Config(valkey_url=valkey_url, register_allow=("10.0.0.0/8", "engine-0"))
    async with client(create_dynamo_app(cfg, ix)) as c:
        assert (await c.post("/register", json=REGISTER_1 | {"endpoint": "tcp://10.0.0.7:5557"})).status_code == 201
        assert (await c.post("/register", json=REGISTER_2 | {"endpoint": "tcp://engine-0:5557"})).status_code == 201
        assert (await c.post("/register", json=REGISTER_2 | {"instance_id": 5,
                                                              "endpoint": "tcp://127.0.0.1:5557"})).status_code == 403


async def test_register_needs_an_api_key_when_keys_are_set(ix, valkey_url):
    cfg = Config(valkey_url=valkey_url, api_keys=("k1",))
    async with client(create_dynamo_app(cfg, ix)) as c:
        assert (await c.post("/register", json=REGISTER_1)).status_code == 401
        assert (await c.post("/register", json=REGISTER_1, headers={"authorization": "Bearer no"})).status_code == 401
        assert await ix.fleet.registered_engines() == {}
        r = await c.post("/register", json=REGISTER_1, headers={"authorization": "Bearer k1"})
        assert r.status_code == 201
        assert (await c.get("/health")).status_code == 200


async def test_pods_nobody_registered_answer_under_a_stable_id(ix, valkey_url):
    tokens = list(range(7, 7 + 48))
    await ingest(ix, "vllm-0", [stored([21, 22, 23], None, tokens)], 0)
    async with client(create_dynamo_app(Config(valkey_url=valkey_url), ix)) as c:
        sid = stable_instance_id("vllm-0")
        r = await c.post("/query", json={"token_ids": tokens + [1, 2], "model_name": MODEL})
        assert r.json() == {"scores": {str(sid): {"0": 48}}, "frequencies": [1, 1, 1],
                            "instances": {str(sid): {"longest_matched": 48, "gpu": 48, "dp": {"0": 48},
                                                     "cpu": 48, "disk": 48}},
                            "freshness": {"state": "degraded",
                                          "reasons": [f"ingestion unknown for {sid} (no ingester's lease covers it)"],
                                          "pods": {str(sid): {"state": "unknown"}}}}
        workers = (await c.get("/workers")).json()
        assert workers == [{"instance_id": sid, "source": "zmq", "status": "active", "model_name": MODEL,
                            "routing_group": "default", "block_size": 16, "endpoints": {}, "listeners": {}}]
        for path, method in (("/query_by_hash", "post"), ("/dump", "get")):
            r = await getattr(c, method)(path, **({"json": {"block_hashes": [1], "model_name": MODEL}}
                                                  if method == "post" else {}))
            assert r.status_code == 501 and "not implemented" in r.json()["error"]


async def test_cache_salt_keys_like_vllm_on_query_predict_and_route(ix, valkey_url):
    """vLLM 0.32 publishes a salted prompt's first block with extra_keys ("<salt>",) (kv_cache_utils
    to_event_extra_keys); engine blocks of 32 tokens, request keys of 16, as on vLLM CPU."""
    tokens = list(range(300, 300 + 96))
    ev = BlockStored(block_hashes=[31, 32, 33], parent_block_hash=None, token_ids=tokens, block_size=32, lora_id=None,
                     medium="GPU", lora_name=None, extra_keys=[("tenant-a",), None, None])
    await ingest(ix, "vllm-0", [ev], 0)
    await vouch(ix, "vllm-0")  # a route weighs only blocks an ingester vouches for
    sid = str(stable_instance_id("vllm-0"))
    cfg = Config(valkey_url=valkey_url)
    async with client(create_dynamo_app(cfg, ix)) as c:
        salted = (await c.post("/query", json={"token_ids": tokens, "model_name": MODEL, "cache_salt": "tenant-a"})).json()
        assert salted["instances"][sid]["gpu"] == 96
        for other in ({}, {"cache_salt": "tenant-b"}):
            got = (await c.post("/query", json={"token_ids": tokens, "model_name": MODEL} | other)).json()
            assert got["instances"] == {}
    app = create_app(cfg, ix)
    await app.state.predictor.fleet.read_once()  # the lease vouching for vllm-0 (the lifespan is not run here)
    async with client(app) as c:
        body = {"model": MODEL, "token_ids": tokens + [5], "cache_salt": "tenant-a"}
        p = (await c.post("/v1/cache/predict", json=body)).json()
        assert (p["best_pod"], p["predicted_cached_tokens"]) == ("vllm-0", 96)
        r = (await c.post("/v1/cache/route", json=body)).json()
        assert (r["pod_id"], r["cached_tokens"]) == ("vllm-0", 96)
        p = (await c.post("/v1/cache/predict", json=body | {"cache_salt": None})).json()
        assert p["predicted_cached_tokens"] == 0
        r = await c.post("/v1/cache/predict", json=body | {"cache_salt": 7})
        assert r.status_code == 400 and "cache_salt must be a string" in r.json()["error"]


def test_serve_dynamo_port_runs_and_stops_with_the_server(valkey_url, tmp_path):
    """The real CLI: the Dynamo API answers on its own port beside the predictor and ends with it."""
    import os
    import signal
    import subprocess
    import sys

    from kv_preflight.cli.valkey_server import free_port
    from tests.e2e.harness import spawn, wait_http

    port, dport = free_port(), free_port()
    proc = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), "--dynamo-port", str(dport),
                  "--workers", "2"], str(tmp_path / "serve.log"))
    try:
        wait_http(f"http://127.0.0.1:{dport}/health")
        wait_http(f"http://127.0.0.1:{port}/health")
        r = httpx.post(f"http://127.0.0.1:{dport}/register", json=REGISTER_1, timeout=5)
        assert r.status_code == 201
        assert httpx.get(f"http://127.0.0.1:{dport}/workers", timeout=5).json()[0]["instance_id"] == 1
    finally:
        proc.terminate()  # the server alone, as a supervisor stops it: the API's process must follow
        proc.wait(timeout=20)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{dport}/health", timeout=1)
        except httpx.HTTPError:
            break
        time.sleep(0.2)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the Dynamo API process outlived the server")
    bad = subprocess.run([sys.executable, "-m", "kv_preflight", "serve", "--valkey-url", valkey_url, "--dynamo-port", "1",
                          "--register-allow", "not a host!"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "--register-allow" in bad.stderr


async def test_query_scores_each_data_parallel_rank_of_an_engine_nobody_registered(ix, valkey_url):
    """An engine found through --engine or --bind with data-parallel ranks: each rank is its own index pod
    (``vllm-0``, ``vllm-0@dp1``: kv_preflight/index/rank_pods.py), and /query answers under the pod's stable id
    with one score per rank, as Dynamo scores its workers per (instance, dp_rank)."""
    tokens = list(range(7, 7 + 48))
    await ingest(ix, "vllm-0", [stored([21, 22], None, tokens[:32])], 0)
    await ingest(ix, "vllm-0@dp1", [stored([21, 22, 23], None, tokens)], 0)
    async with client(create_dynamo_app(Config(valkey_url=valkey_url), ix)) as c:
        sid = str(stable_instance_id("vllm-0"))
        r = (await c.post("/query", json={"token_ids": tokens + [1, 2], "model_name": MODEL})).json()
        assert r["scores"] == {sid: {"0": 32, "1": 48}}, r
        assert r["instances"][sid]["dp"] == {"0": 32, "1": 48} and r["instances"][sid]["gpu"] == 48, r
        assert r["frequencies"] == [2, 2, 1], r
        workers = (await c.get("/workers")).json()
        assert [w["instance_id"] for w in workers] == [int(sid)], workers


def test_register_refuses_what_no_engine_publishes_on_and_workers_refuses_negative_paging(valkey_url, tmp_path):
    """A real ``serve --dynamo-port``: /register refused (each was accepted before) an instance_id past u64 (Dynamo's
    type; 422 as serde's range error), an endpoint on Valkey's own port, on the predictor's or this API's HTTP port
    or on an engine's HTTP port (an ingester would speak ZMTP to them, and reconnect, while the registration
    stands), and an ipc:// path outside --register-ipc-dir once normalized (``ipc:///../../etc/passwd``); /workers
    refuses a negative offset and a limit below 1 (400) where it clamped them to 0 and 1."""
    from kv_preflight.cli.valkey_server import free_port
    from tests.e2e.harness import spawn, stop, wait_http

    port, dport, engine_port = free_port(), free_port(), free_port()
    valkey_port = int(valkey_url.rsplit(":", 1)[1].split("/")[0])
    proc = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), "--dynamo-port", str(dport),
                  "--engine-url", f"{MODEL}=http://localhost:{engine_port}", "--tokenizer-check"],
                 str(tmp_path / "serve.log"))
    try:
        wait_http(f"http://127.0.0.1:{dport}/health")
        api = f"http://127.0.0.1:{dport}"

        def register(**change) -> httpx.Response:
            return httpx.post(f"{api}/register", json=REGISTER_1 | change, timeout=10)

        r = register(instance_id=2 ** 64)
        assert r.status_code == 422, r.text
        for endpoint, what in ((f"tcp://127.0.0.1:{valkey_port}", "Valkey"),
                               (f"tcp://localhost:{port}", "the predictor's HTTP port"),
                               (f"tcp://127.0.0.2:{dport}", "this remote-indexer API's HTTP port"),
                               (f"tcp://[::1]:{engine_port}", "an engine's HTTP port")):
            r = register(endpoint=endpoint)
            assert r.status_code == 403 and what in r.json()["error"], (endpoint, r.text)
            r = register(replay_endpoint=endpoint)
            assert r.status_code == 403 and what in r.json()["error"], (endpoint, r.text)
        for outside in ("ipc:///../../etc/passwd", "ipc:///tmp/../etc/x.sock", "ipc://relative.sock", "ipc://@abstract"):
            r = register(endpoint=outside)
            assert r.status_code == 403 and "--register-ipc-dir" in r.json()["error"], (outside, r.text)
        assert httpx.get(f"{api}/workers", timeout=10).json() == []  # none of those was registered
        assert register(instance_id=2 ** 64 - 1, endpoint="ipc:///tmp/kvpf-test-engine.sock").status_code == 201
        assert register().status_code == 201
        for query in ("offset=-1", "limit=-5", "limit=0", "offset=-3&limit=-3"):
            r = httpx.get(f"{api}/workers?{query}", timeout=10)
            assert r.status_code == 400 and "offset must be 0 or more" in r.json()["error"], (query, r.text)
        page = httpx.get(f"{api}/workers?offset=1&limit=1", timeout=10)
        assert page.status_code == 200 and [w["instance_id"] for w in page.json()] == [2 ** 64 - 1]
    finally:
        stop(proc)
