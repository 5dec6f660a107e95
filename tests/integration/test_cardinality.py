"""Thousands of pods must not make ``/stats`` or ``/metrics`` grow with them: the review saw 6.7 s and
4.4 MB for ``/stats`` and a 7.4 MB ingester scrape at 20K pods. Real valkey-server, real write path
(the ingester's apply script), a real ``kv-preflight ingest`` process with real ZMQ."""
from __future__ import annotations

import re
import time

import httpx
import pytest
import zmq

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.predictor.http.app import create_app
from kv_preflight.config import Config
from kv_preflight.events import encode_frames
from kv_preflight.index.index import StoreBlock
from kv_preflight.keys.chain import request_keys
from kv_preflight.metrics import OTHER_POD
from tests.e2e.harness import stop, wait_http
from tests.integration.test_ingester import batch, stored
from tests.integration.test_metrics_procs import spawn
from tests.prom import metric

pytestmark = [pytest.mark.integration]

MODEL = "card-model"
N_PODS = 3000


def pod_name(i: int) -> str:
    return f"pod-{i:05d}"


async def write_pods(ix, n: int, *, incomplete_every: int = 0) -> None:
    """``n`` pods, each holding one block (pod i holds i % 3 + 1 blocks), written by the apply script."""
    batches = []
    for i in range(n):
        pod = pod_name(i)
        field = ix.entry_field(pod, "GPU", None)
        stores = []
        parent = None
        for b in range(i % 3 + 1):
            rks = request_keys(list(range(b * 16, b * 16 + 16)), model=MODEL, block_size=16, parent=parent)
            stores.append(StoreBlock(rks[-1] ^ 0x5EED, "gpu", field, tuple(rks)))
            parent = rks[-1]
        batches.append({"pod_id": pod, "rank": 0, "seq": 0, "ts": time.time(), "model": MODEL,
                        "engine_block_size": 16, "mutations": stores})
    for start in range(0, n, 500):
        results = await ix.apply_batches(batches[start:start + 500])
        assert {r.status for r in results} == {"applied"}
    if incomplete_every:
        for i in range(0, n, incomplete_every):
            await ix.meta.mark_incomplete(pod_name(i), "gap 1..2")


@pytest.fixture
async def predictor(valkey_url):
    app = create_app(Config(valkey_url=valkey_url, block_size=16))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://predictor")
    yield client
    await client.aclose()
    await app.state.predictor.aclose()


@pytest.mark.anyio
async def test_stats_is_a_summary_and_a_page_of_pods(predictor, ix):
    await write_pods(ix, N_PODS, incomplete_every=100)
    r = await predictor.get("/stats")
    assert r.status_code == 200, r.text
    assert len(r.content) < 100_000, len(r.content)  # a page, not every pod
    doc = r.json()
    assert doc["summary"] == {
        "pods": N_PODS, "incomplete_pods": N_PODS // 100, "models": 1,
        "blocks": sum(i % 3 + 1 for i in range(N_PODS)),
        "counters": {"batches": N_PODS, "stored": sum(i % 3 + 1 for i in range(N_PODS)), "removed": 0, "cleared": 0},
    }
    assert (doc["pods_offset"], doc["pods_limit"], doc["pods_next_offset"]) == (0, 100, 100)
    assert [p["pod_id"] for p in doc["pods"]] == [pod_name(i) for i in range(100)]
    first = doc["pods"][0]
    assert (first["model"], first["blocks"], first["incomplete"], first["incomplete_reason"]) == (
        MODEL, 1, True, "gap 1..2")
    assert doc["pods"][2]["blocks"] == 3 and doc["pods"][2]["last_seq"] == {"0": 0}

    # every pod exactly once, page by page
    seen: list[str] = []
    offset: int | None = 0
    while offset is not None:
        page = (await predictor.get("/stats", params={"pods_offset": offset, "pods_limit": 1000})).json()
        seen += [p["pod_id"] for p in page["pods"]]
        offset = page["pods_next_offset"]
    assert seen == [pod_name(i) for i in range(N_PODS)]
    last = (await predictor.get("/stats", params={"pods_offset": N_PODS - 5})).json()
    assert len(last["pods"]) == 5 and last["pods_next_offset"] is None
    assert (await predictor.get("/stats", params={"pods_offset": N_PODS + 7})).json()["pods"] == []
    assert (await predictor.get("/stats", params={"pods_limit": 0})).json()["pods"] == []

    one = (await predictor.get("/stats", params={"pod": pod_name(1234)})).json()
    assert [p["pod_id"] for p in one["pods"]] == [pod_name(1234)] and one["pods"][0]["blocks"] == 1234 % 3 + 1
    assert "summary" not in one
    r = await predictor.get("/stats", params={"pod": "no-such-pod"})
    assert r.status_code == 404 and "no-such-pod" in r.json()["error"]


@pytest.mark.anyio
@pytest.mark.parametrize("params", [{"pods_limit": "1001"}, {"pods_limit": "-1"}, {"pods_offset": "-3"},
                                    {"pods_offset": "ten"}, {"pods_limit": "1.5"}, {"pod": ""}])
async def test_stats_refuses_bad_paging(predictor, params):
    r = await predictor.get("/stats", params=params)
    assert r.status_code == 400, r.text
    name = next(iter(params))
    assert name in r.json()["error"]


@pytest.mark.anyio
async def test_the_predictors_metrics_have_no_pod_series(predictor, ix):
    await write_pods(ix, N_PODS)
    prompt = list(range(48)) + [7]
    for _ in range(3):
        r = await predictor.post("/v1/cache/predict", json={"model": MODEL, "token_ids": prompt})
        assert r.status_code == 200 and len(r.json()["pod_affinities"]) == N_PODS
        r = await predictor.post("/v1/cache/route", json={"model": MODEL, "token_ids": prompt,
                                                          "pods": [pod_name(i) for i in range(1000)]})
        assert r.status_code == 200, r.text
    text = (await predictor.get("/metrics")).text
    assert 'pod="' not in text and "pod-0" not in text
    assert len(text) < 30_000


def pod_values(text: str, name: str) -> set[str]:
    return {m.group(1) for line in text.splitlines() if line.startswith(name + "{")
            for m in [re.search(r'pod="([^"]*)"', line)] if m}


def total(text: str, name: str, **labels: str) -> float:
    out = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            out += float(line.rsplit(" ", 1)[1])
    return out


def test_the_ingester_process_keeps_at_most_max_pod_series_pods(valkey_url):
    """2000 pods through one engine socket into ``kv-preflight ingest``: 256 pods keep series of their own
    (the default --max-pod-series), the others are summed under pod="_other", and nothing is lost."""
    n, limit = 2000, 256
    zport, mport = free_port(), free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{zport}")
    proc = spawn(["ingest", "--valkey-url", valkey_url, "--source", f"tcp://127.0.0.1:{zport}",
                  "--metrics-port", str(mport)])
    url = f"http://127.0.0.1:{mport}/metrics"
    try:
        wait_http(url)
        deadline = time.monotonic() + 30
        seq = 0
        while True:  # the first pod, until its batch lands (ZMQ slow joiner)
            pub.send_multipart(encode_frames(f"kv@{pod_name(0)}@{MODEL}", seq, batch(stored([1], None, 0))))
            seq += 1
            text = httpx.get(url, timeout=5).text
            if total(text, "kvpf_ingest_batches_total", result="applied") >= 1:
                break
            assert time.monotonic() < deadline, "the ingester applied nothing"
            time.sleep(0.1)
        for i in range(1, n):
            pub.send_multipart(encode_frames(f"kv@{pod_name(i)}@{MODEL}", 0, batch(stored([1000 + i], None, 0))))
        deadline = time.monotonic() + 60
        # one socket, in order: once the last folded pod's batch is counted, every earlier one is
        while total(text, "kvpf_ingest_batches_total", result="applied", pod=OTHER_POD) < n - limit:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, total(text, "kvpf_ingest_batches_total", result="applied")
            time.sleep(0.2)
            text = httpx.get(url, timeout=5).text
    finally:
        stop(proc)
        pub.close(0)
        ctx.term()
    applied = pod_values(text, "kvpf_ingest_batches_total")
    assert len(applied) == limit + 1 and OTHER_POD in applied
    assert applied - {OTHER_POD} == {pod_name(i) for i in range(limit)}  # first come
    for name in ("kvpf_ingest_events_total", "kvpf_ingest_last_lag_seconds"):
        values = pod_values(text, name)
        assert values == applied, (name, len(values))  # the same pods keep series in every metric
    warm_up = metric(text, "kvpf_ingest_batches_total", pod=pod_name(0), result="applied")
    assert total(text, "kvpf_ingest_batches_total", result="applied") == warm_up + n - 1  # nothing lost
    assert total(text, "kvpf_ingest_events_total", type="BlockStored") == warm_up + n - 1
    assert total(text, "kvpf_ingest_batches_total", result="applied", pod=OTHER_POD) == n - limit
    assert metric(text, "kvpf_ingest_pods_folded") == n - limit
    assert len(text) < 150_000, len(text)
