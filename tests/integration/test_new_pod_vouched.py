"""A pod's first hits are routed by, with real processes: a valkey-server, a zero-config ``kv-preflight serve``, a
``kv-preflight simulate`` engine and a ``kv-preflight ingest --engine URL`` started after the engine cached a
prompt. A route weighs only blocks some ingester's lease vouches for (an ``unknown`` pod's are not routed by), so
the first answer that finds the new pod's blocks must already find a lease listing it: the ingester puts one
before the pod's first write (ingester/lease.py ``vouch``), and the predictor reads the records again when
a holder is one its last read knows nothing of (predictor/fleet_view.py ``catch_up``). Before, the pod read
``unknown`` for up to two renewal intervals after its first blocks landed, and its hits were routed as misses
(CI: tests/e2e/test_vllm_hybrid.py, a route answering 0 where predict answered 128)."""
from __future__ import annotations

import time

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.sim import sim_engine
from tests.integration.test_fleet import FAST, FAST_ENV

pytestmark = [pytest.mark.integration]


def test_the_first_answer_finding_a_new_pods_blocks_routes_by_them(valkey_url, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pred = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port)], str(tmp_path / "pred.log"))
    engine = sim_engine("sim-new", tmp_path).start()
    ing = None
    try:
        wait_http(base + "/health")
        prompt = list(range(100, 180))  # five blocks of 16
        assert engine.complete(prompt) == 0
        ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", engine.url, *FAST],
                    str(tmp_path / "ing.log"), env=FAST_ENV)
        body = {"model": "sim", "token_ids": prompt, "pods": ["sim-new"]}
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=5) as client:
            while True:  # the first answer that finds the blocks (the replay of the engine's batch at attach)
                r = client.post(base + "/v1/cache/predict", json=body)
                if r.status_code == 200 and r.json()["predicted_cached_tokens"] > 0:
                    break
                assert time.monotonic() < deadline, (r.status_code, r.text)
                time.sleep(0.005)
            predicted = r.json()
            route = client.post(base + "/v1/cache/route", json=body).json()
        assert predicted["predicted_cached_tokens"] == 64, predicted  # the last block is recomputed
        assert predicted["freshness"]["pods"]["sim-new"]["state"] != "unknown", predicted["freshness"]
        assert route["pod_id"] == "sim-new" and route["cached_tokens"] == 64, route
        assert route["freshness"]["pods"]["sim-new"]["state"] != "unknown", route["freshness"]
    finally:
        if ing is not None:
            stop(ing)
        engine.stop()
        stop(pred)
