"""/metrics and --log-json of the real processes: the ingester (events, gaps, replays, lag) and
``serve --workers 2``, whose counters must add up across workers whichever one answers a scrape."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.events import AllBlocksCleared, BlockRemoved
from kv_preflight.index.index import Index
from tests.e2e.harness import stop, wait_http
from tests.integration.engine_stub import EngineStub
from tests.integration.test_ingester import Harness, batch, stored
from tests.prom import metric

pytestmark = [pytest.mark.integration]


@pytest.mark.anyio
async def test_ingester_metrics_count_events_gaps_and_lag(valkey_url):
    h = Harness(valkey_url)
    ix = Index.from_url(valkey_url)
    try:
        ing = await h.start_ingester()
        h.engine.publish(batch(stored([11, 12], None, 0)))
        h.engine.publish(batch(BlockRemoved([12], medium="GPU")))
        h.engine.publish(batch(stored([13], None, 3)), send=False)  # lost on the wire: a gap, replayed
        h.engine.publish(batch(AllBlocksCleared()))
        h.engine.send_raw([b"kv@pod-a@tiny", (99).to_bytes(8, "big"), b"\xc1 not msgpack"])
        await h.wait_seq(ix, 3)
        # Valkey holds seq 3 once its script ran; the ingester counts the batch when the answer is back, and the
        # frame that does not decode may be counted before it (while the gap held the pod): both awaited
        for _ in range(250):
            if ing.counters.counts.get("decode_errors") and ing.counters.counts.get("batches_applied", 0) >= 4:
                break
            await asyncio.sleep(0.02)
        text = ing.metrics.exposition().decode()
    finally:
        await h.close()
        await ix.close()
    assert metric(text, "kvpf_ingest_events_total", type="BlockStored", pod="pod-a") == 2
    assert metric(text, "kvpf_ingest_events_total", type="BlockRemoved", pod="pod-a") == 1
    assert metric(text, "kvpf_ingest_events_total", type="AllBlocksCleared", pod="pod-a") == 1
    assert metric(text, "kvpf_ingest_batches_total", pod="pod-a", result="applied") == 4
    assert metric(text, "kvpf_ingest_batches_total", pod="pod-a", result="gap") == 1
    assert metric(text, "kvpf_ingest_gaps_total", pod="pod-a") == 1
    assert metric(text, "kvpf_ingest_replays_total", pod="pod-a") == 1
    assert metric(text, "kvpf_ingest_decode_errors_total") == 1
    assert metric(text, "kvpf_ingest_lag_seconds_count") == 4
    assert 0 <= metric(text, "kvpf_ingest_last_lag_seconds", pod="pod-a") < 60


def spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kv_preflight", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_ingest_process_serves_metrics_and_logs_json(valkey_url):
    zport, rport, mport = free_port(), free_port(), free_port()
    engine = EngineStub(f"tcp://127.0.0.1:{zport}", f"tcp://127.0.0.1:{rport}", "kv@pod-p@tiny", bind=True)
    proc = spawn(["ingest", "--valkey-url", valkey_url, "--source",
                  f"tcp://127.0.0.1:{zport},replay=tcp://127.0.0.1:{rport}", "--metrics-port", str(mport),
                  "--log-json"])
    try:
        wait_http(f"http://127.0.0.1:{mport}/metrics")
        deadline = time.monotonic() + 20
        text = ""
        while time.monotonic() < deadline:  # publish until one batch lands (ZMQ slow joiner)
            engine.publish(batch(stored([21], None, 0)))
            text = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=2).text
            if metric(text, "kvpf_ingest_batches_total", pod="pod-p", result="applied") >= 1:
                break
            time.sleep(0.1)
        assert metric(text, "kvpf_ingest_events_total", type="BlockStored", pod="pod-p") >= 1
    finally:
        stop(proc)
        engine.close()
    err = proc.stderr.read()
    records = json_lines(err)  # every line is JSON: raises otherwise
    assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records)


def test_serve_workers_sum_metrics_and_log_json(valkey_url):
    port = free_port()
    # one model configured, so "m" is a client's unknown model (400), not "no model known yet" (503)
    proc = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), "--workers", "2", "--log-json",
                  "--engine-url", f"other=http://127.0.0.1:{free_port()}"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health")
        with httpx.Client(base_url=url, timeout=5) as c:
            for i in range(20):  # new connections, so both workers get some
                with httpx.Client(base_url=url, timeout=5) as one:
                    assert one.post("/v1/cache/predict", json={"model": "m", "token_ids": [i]}).status_code == 400
            totals = set()
            for _ in range(6):
                with httpx.Client(base_url=url, timeout=5) as one:
                    text = one.get("/metrics").text
                totals.add(metric(text, "kvpf_predictions_total", endpoint="predict", outcome="unknown_model"))
            assert totals == {20.0}, "every scrape must see both workers' counts"
            assert metric(text, "kvpf_request_duration_seconds_count", endpoint="predict") == 20
            assert c.get("/health").status_code == 200
    finally:
        stop(proc)
    records = json_lines(proc.stderr.read())
    assert any("uvicorn" in r["logger"] for r in records)


def test_predictor_metrics_say_pods_blocks_lag_memory_and_answers_by_freshness(valkey_url, tmp_path):
    """Issue 42, item 6: the predictor's /metrics had no gauge of pods, blocks, index lag or freshness (only
    /stats JSON). With an engine, its ingester and `serve --workers 2`, every scrape, whichever worker answers,
    says: one live pod, current; the blocks the index holds, in all and for the pod, and its share of Valkey's
    memory; the index lag; and the answers given, by freshness state."""
    from tests.integration.sim import sim_engine

    sim = sim_engine("sim-m", tmp_path).start()
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", sim.url, "--ingester-id", "ing-m"])
    port = free_port()
    srv = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), "--workers", "2"])
    url = f"http://127.0.0.1:{port}"
    tokens = list(range(1000, 1100))
    try:
        wait_http(url + "/ready")
        deadline = time.monotonic() + 60
        blocks = 0
        while time.monotonic() < deadline:  # until the ingester reported the pod and indexed what it cached
            httpx.post(sim.url + "/v1/completions", json={"model": "sim", "prompt": tokens, "max_tokens": 1}, timeout=10)
            with httpx.Client(base_url=url, timeout=5) as one:
                got = one.post("/v1/cache/predict", json={"model": "sim", "token_ids": tokens}).json()
            if got.get("predicted_cached_tokens") and got["freshness"]["state"] == "exact":
                break
            time.sleep(0.3)
        assert got["predicted_cached_tokens"] == 96, got
        for _ in range(3):
            with httpx.Client(base_url=url, timeout=5) as one:
                assert one.post("/v1/cache/route", json={"model": "sim", "token_ids": tokens}).status_code == 200
        async def held() -> int:
            ix = Index.from_url(valkey_url)
            try:
                return (await ix.meta.pod_info("sim-m")).blocks
            finally:
                await ix.close()

        blocks = asyncio.run(held())
        assert blocks > 0
        deadline, seen = time.monotonic() + 30, 0
        while seen < 6 and time.monotonic() < deadline:  # the pod's fleet record comes once it passed the
            # membership hold, and its lag once a lease renewal carried the pod's newest batch time; each worker
            # reads the records every second: until both workers show both
            text = httpx.get(url + "/metrics", timeout=5).text
            shown = metric(text, "kvpf_pods", state="live") == 1 and "kvpf_index_lag_seconds " in text
            seen = seen + 1 if shown else 0
            time.sleep(0.1)
        for _ in range(4):  # new connections: both workers answer scrapes
            with httpx.Client(base_url=url, timeout=5) as one:
                text = one.get("/metrics").text
            assert metric(text, "kvpf_pods", state="live") == 1, text
            assert metric(text, "kvpf_pods", state="retired") == 0
            assert metric(text, "kvpf_pods_freshness", state="current") == 1
            assert metric(text, "kvpf_index_pods") == 1 and metric(text, "kvpf_index_pods_incomplete") == 0
            assert metric(text, "kvpf_index_blocks") == blocks
            assert metric(text, "kvpf_index_keys") > 0
            used = metric(text, "kvpf_valkey_used_memory_bytes")
            assert used > 0 and 'pod="' not in text  # /metrics never has a series per pod
            with httpx.Client(base_url=url, timeout=5) as one:
                per_pod = one.get("/metrics/pods").text
            assert metric(per_pod, "kvpf_index_pod_blocks", pod="sim-m") == blocks
            assert metric(per_pod, "kvpf_index_pod_memory_bytes", pod="sim-m") > 0
            assert "kvpf_index_lag_seconds " in text and "kvpf_index_staleness_seconds " in text
            assert metric(text, "kvpf_answers_total", endpoint="route", freshness="exact") == 3
            assert metric(text, "kvpf_answers_total", endpoint="predict", freshness="exact") >= 1
    finally:
        stop(srv)
        stop(ing)
        sim.stop()
