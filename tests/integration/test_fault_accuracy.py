"""After every fault, predictions still equal the engine's reported cached_tokens.

Real processes throughout: a simulated engine (kv-preflight simulate: vLLM 0.32's cache rules and
event protocol), an ingester, the predictor, and a real valkey-server with AOF.
"""
from __future__ import annotations

import time

import httpx
import pytest

from kv_preflight.cli.accuracy import run_workload, shared_prefix_workload, summarize
from kv_preflight.cli.valkey_server import ValkeyServer, free_port
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.sim import sim_engine

pytestmark = pytest.mark.integration


def exact(results) -> None:
    s = summarize(results)
    assert s["exact"] == s["requests"], [(r.index, r.predicted, r.actual) for r in results if not r.exact]
    assert s["requests_with_hits"] > 0


def wait_restart_noticed(predictor_url: str, pod: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = httpx.get(predictor_url + "/stats", timeout=5).json()
        if any(p["pod_id"] == pod and p["counters"].get("restarts") for p in stats["pods"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine restart was not noticed in {timeout_s}s")


def blind(url: str, reqs: list[dict]) -> None:
    """Requests nobody predicts: the engine's cache changes while the index may not be listening."""
    for r in reqs:
        httpx.post(url + "/v1/completions", json={"model": "sim", "prompt": r["token_ids"], "max_tokens": 1},
                   timeout=10).raise_for_status()


def test_faults_keep_predictions_exact(tmp_path):
    valkey = ValkeyServer(tmp_path / "valkey", appendonly=True).start()
    engine = sim_engine("sim-fault", tmp_path).start()
    port = free_port()
    predictor_url = f"http://127.0.0.1:{port}"
    ing_args = ["ingest", "--valkey-url", valkey.url, "--engine", engine.url]
    ing = spawn(ing_args, str(tmp_path / "ing-1.log"))
    pred = spawn(["serve", "--valkey-url", valkey.url, "--port", str(port), "--engine-url", f"sim={engine.url}"],
                 str(tmp_path / "pred.log"))
    work = shared_prefix_workload(n=48, seed=11, block=16)
    try:
        wait_http(predictor_url + "/health")
        exact(run_workload(engine.url, predictor_url, "sim", work[:8]))

        # 1. kill -9 the ingester; the engine keeps caching; a new ingester catches up by replay.
        stop(ing, kill=True)
        blind(engine.url, work[8:14])
        ing = spawn(ing_args, str(tmp_path / "ing-2.log"))
        exact(run_workload(engine.url, predictor_url, "sim", work[14:22]))

        # 2. Valkey goes away and comes back (AOF); the predictor answers 503 meanwhile.
        valkey.stop()
        assert httpx.get(predictor_url + "/health", timeout=5).status_code == 503
        blind(engine.url, work[22:26])
        valkey.start()
        wait_http(predictor_url + "/health")
        exact(run_workload(engine.url, predictor_url, "sim", work[26:34]))

        # 3. The engine restarts: empty cache, seq from 0 again. The ingester notices on reconnect
        # (its replay probe), before the new engine publishes anything.
        engine.stop(kill=True)
        engine.start()
        wait_restart_noticed(predictor_url, "sim-fault")
        exact(run_workload(engine.url, predictor_url, "sim", work[34:48]))
        stats = httpx.get(predictor_url + "/stats", timeout=5).json()
        pod = next(p for p in stats["pods"] if p["pod_id"] == "sim-fault")
        assert pod["counters"].get("restarts") == 1 and not pod["incomplete"]
    finally:
        stop(ing)
        stop(pred)
        engine.stop()
        valkey.stop()
