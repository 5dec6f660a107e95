"""Data-parallel ranks end to end with real processes: a ``kv-preflight simulate --dp-size 2`` engine (two engine
cores behind one HTTP port, each with its own prefix cache and publisher, vLLM's X-data-parallel-rank header),
an ingester that found it through ``--engine``, and a zero-config predictor.

Each rank is a candidate of its own: a prefix cached on rank 0 is not predicted for rank 1; answers list one
entry per rank with ``dp_rank``; ``/v1/cache/route`` names the rank and the header that pins it, and the
engine, pinned so, reports exactly the cached tokens the decision predicted; a pods filter naming the pod covers
its ranks; llm-d's entries name the pod alone.
"""
from __future__ import annotations

import random
import time

import httpx
import pytest
import redis

from kv_preflight.cli.accuracy import run_workload, summarize
from kv_preflight.cli.valkey_server import free_port
from kv_preflight.index.entries import parse_entry
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.sim import sim_engine

pytestmark = pytest.mark.integration

HEADER = "X-data-parallel-rank"


def workload(n: int, seed: int) -> list[dict]:
    """Shared prefixes sent to both ranks in turn and at random, so a prefix cached on one rank is asked of the
    other (the merged index predicted it there) and of the same one (it must be found)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 8000) for _ in range(16 * 3 + 5)] for _ in range(3)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(10, 8000) for _ in range(rng.randrange(3, 30))]
        reqs.append({"token_ids": systems[i % 3] + tail, "dp_rank": rng.randrange(2)})
    return reqs


def test_each_rank_is_predicted_and_routed_as_its_own_cache(tmp_path, valkey_url):
    engine = sim_engine("sim-dp", tmp_path, dp_size=2).start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", engine.url], str(tmp_path / "ing.log"))
    pred = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port)], str(tmp_path / "pred.log"))
    try:
        wait_http(base + "/health")
        deadline = time.monotonic() + 30
        while httpx.post(base + "/v1/cache/predict", json={"model": "sim", "token_ids": [1] * 20},
                         timeout=5).status_code != 200:  # until the ingester has reported the engine's pod
            assert time.monotonic() < deadline, "the engine's pod was never reported"
            time.sleep(0.1)
        work = workload(24, seed=5)
        results = run_workload(engine.url, base, "sim", work)
        s = summarize(results)
        assert s["exact"] == s["requests"], [(r.index, work[r.index]["dp_rank"], r.predicted, r.actual)
                                             for r in results if not r.exact]
        assert s["requests_with_hits"] > 0
        # a prompt both ranks were asked for: one entry per rank, each with its rank
        body = {"model": "sim", "token_ids": work[0]["token_ids"]}
        doc = httpx.post(base + "/v1/cache/predict", json=body, timeout=10).json()
        ranks = {a["dp_rank"]: a["cached_tokens"] for a in doc["pod_affinities"]}
        assert {a["pod_id"] for a in doc["pod_affinities"]} == {"sim-dp"} and set(ranks) <= {0, 1}, doc
        assert doc["best_pod"] == "sim-dp" and doc["best_dp_rank"] in ranks, doc
        # a new prefix on rank 1 only: predicted for rank 1, not for rank 0
        fresh = [random.Random(9).randrange(10, 8000) for _ in range(16 * 4 + 3)]
        httpx.post(engine.url + "/v1/completions", json={"model": "sim", "prompt": fresh, "max_tokens": 1},
                   headers={HEADER: "1"}, timeout=10).raise_for_status()
        run_workload(engine.url, base, "sim", [])  # (nothing sent: waits for the index to catch up)
        follow = fresh + [11, 12, 13]
        doc = httpx.post(base + "/v1/cache/predict", json={"model": "sim", "token_ids": follow, "pods": ["sim-dp"]},
                         timeout=10).json()
        assert [(a["dp_rank"], a["cached_tokens"]) for a in doc["pod_affinities"]] == [(1, 64)], doc
        # the route names rank 1 and the header; the engine, pinned so, reports what the decision predicted
        dec = httpx.post(base + "/v1/cache/route", json={"model": "sim", "token_ids": follow}, timeout=10).json()
        assert (dec["pod_id"], dec["dp_rank"], dec["headers"]) == ("sim-dp", 1, {HEADER: "1"}), dec
        got = httpx.post(engine.url + "/v1/completions", json={"model": "sim", "prompt": follow, "max_tokens": 1},
                         headers=dec["headers"], timeout=10).json()
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == dec["cached_tokens"] == 64
        # llm-d's entries name the pod alone (its readers know no ranks)
        sync = redis.Redis.from_url(valkey_url)
        pods = {parse_entry(f).PodIdentifier for k in sync.scan_iter() if not k.startswith((b"engine:", b"kvpf:"))
                for f in sync.hkeys(k)}
        assert pods == {"sim-dp"}, pods
        # each rank's freshness under its index name
        assert {"sim-dp", "sim-dp@dp1"} <= set(doc["freshness"]["pods"]), doc["freshness"]
        # /explain per rank: the chains name the pod and the rank
        exp = httpx.post(base + "/v1/cache/explain", json={"model": "sim", "token_ids": follow, "pods": ["sim-dp"]},
                         timeout=10).json()
        chains = {(c["pod_id"], c["dp_rank"]): c["reused_tokens"] for c in exp["pods"]}
        assert chains == {("sim-dp", 0): 0, ("sim-dp", 1): 64}, exp["pods"]
        assert (exp["best_pod"], exp["best_dp_rank"]) == ("sim-dp", 1), exp
        # each rank has its fleet record and its own load, scraped from the engine's per-rank series
        fleet = httpx.get(base + "/stats", timeout=10).json()["fleet"]["pods"]
        assert {"sim-dp", "sim-dp@dp1"} <= set(fleet), fleet
        assert all(fleet[p]["load_fresh"] for p in ("sim-dp", "sim-dp@dp1")), fleet
    finally:
        stop(pred)
        stop(ing)
        engine.stop()


def test_a_pod_written_with_its_ranks_merged_is_reset_once_and_stays_exact(tmp_path, valkey_url):
    """An index written before each rank was a pod of its own holds rank 1's blocks in the pod (rank 0's name),
    with rank 1's seq in its meta. The ingester resets such a pod once, when rank 1 first shows up, so rank 0 is
    replayed from its engine alone: without that, rank 1's blocks would be predicted for rank 0 for good."""
    import asyncio

    from kv_preflight.engines.vllm import ENGINE as VLLM
    from kv_preflight.index.index import Index
    from kv_preflight.ingester.bridge import ChainState, plan_batch

    engine = sim_engine("sim-up", tmp_path, dp_size=2).start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    work = workload(16, seed=3)
    for req in work[:8]:  # the engine caches on both ranks before any ingester of this version runs
        httpx.post(engine.url + "/v1/completions", json={"model": "sim", "prompt": req["token_ids"], "max_tokens": 1},
                   headers={HEADER: str(req["dp_rank"])}, timeout=10).raise_for_status()

    async def merged() -> None:  # what an older ingester wrote: every rank into the pod, each with its seq
        ix = Index.from_url(valkey_url)
        state = ChainState()
        try:
            for rank in (0, 1):
                for seq, batch in enumerate(engine.published(rank)):
                    plan = plan_batch(batch, pod_id="sim-up", topic_model="sim", state=state, hash_seed="",
                                      block_size=16, entry_field=ix.entry_field, extra_keys=VLLM.extra_keys)
                    r = await ix.apply_batch(pod_id="sim-up", rank=rank, seq=seq, ts=batch.ts, model="sim",
                                             engine_block_size=plan.engine_block_size, mutations=plan.mutations)
                    assert r.status == "applied", r
        finally:
            await ix.close()

    asyncio.run(merged())
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", engine.url], str(tmp_path / "ing.log"))
    pred = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port)], str(tmp_path / "pred.log"))
    try:
        wait_http(base + "/health")
        results = run_workload(engine.url, base, "sim", work[8:])
        s = summarize(results)
        assert s["exact"] == s["requests"] and s["requests_with_hits"], [
            (r.index, work[8 + r.index]["dp_rank"], r.predicted, r.actual) for r in results if not r.exact]
        log = (tmp_path / "ing.log").read_text()
        assert "holds the blocks of its data-parallel rank 1" in log and "sim-up: rebuilt whole" in log, log
    finally:
        stop(pred)
        stop(ing)
        engine.stop()
