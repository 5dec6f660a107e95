"""Data-parallel ranks against a real vLLM 0.32 (``--data-parallel-size 2``: two engine cores behind one HTTP
port, each with its own prefix cache, publishing on the event and replay ports + rank; a request pinned to a rank
with vLLM's ``X-data-parallel-rank`` header). The ingester finds both ranks through ``--engine`` (vLLM's
``/kv_event_sources``); the predictor is zero-config.

Every request is pinned to a rank and predicted for that rank just before it is sent: 100 % equal to the
``cached_tokens`` vLLM reports, through shared prefixes asked of both ranks and eviction; the workload is one
where a merged answer (the ranks as one cache, what kv-preflight answered before) is wrong, so the test can fail.
``/v1/cache/route``'s rank is honoured: sent with the decision's headers, vLLM reports the cached tokens the
decision predicted. Then the same through a Valkey Cluster."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from kv_preflight.cli.accuracy import EventWatcher, _send, pod_of, wait_caught_up
from tests.e2e.conftest import VllmSpec
from tests.e2e.harness import kvpf_stack

pytestmark = pytest.mark.e2e
VLLM_ENGINES = (VllmSpec("e2e-dp", 40, dp_size=2),)


@pytest.fixture(scope="module")
def vllm(vllm_pool):
    engine = vllm_pool.take(VLLM_ENGINES[0])
    yield engine
    engine.stop()


def workload(seed: int, n: int) -> list[dict]:
    """System prompts and documents revisited on random ranks (a prefix cached on one rank is asked of the
    other), enough distinct blocks that 40 per rank evict."""
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 8000) for _ in range(rng.choice([64, 100]))] for _ in range(3)]
    docs = [[rng.randrange(10, 8000) for _ in range(rng.randrange(30, 200))] for _ in range(6)]
    out = []
    for _ in range(n):
        q = [rng.randrange(10, 8000) for _ in range(rng.randrange(1, 40))]
        out.append({"token_ids": (rng.choice(systems) + rng.choice(docs) + q)[:480], "dp_rank": rng.randrange(2)})
    return out


def measured(engine_url: str, predictor_url: str, reqs: list[dict]) -> list[tuple[int, int, int, dict | None]]:
    """Per request: (predicted for its rank, the ranks merged (the best of them), vLLM's cached_tokens, and every
    fifth request the route decision it was sent by instead of its own rank)."""
    watcher = EventWatcher.for_engine(engine_url)
    assert watcher is not None
    pod = pod_of(engine_url)
    deadline = time.monotonic() + 60
    while httpx.post(predictor_url + "/v1/cache/predict", json={"model": "tiny", "token_ids": [1] * 40},
                     timeout=10).status_code != 200:  # until the ingester has reported the engine's pod
        assert time.monotonic() < deadline, "the engine's pod was never reported"
        time.sleep(0.2)
    out = []
    try:
        with httpx.Client() as client:
            for i, req in enumerate(reqs):
                wait_caught_up(predictor_url, watcher)
                body = {"model": "tiny", "token_ids": req["token_ids"]}
                decision = None
                if i % 5 == 4:  # routed: the decision picks the rank, its headers pin it
                    decision = client.post(predictor_url + "/v1/cache/route", json=body, timeout=30).json()
                    req = {**req, "dp_rank": decision["dp_rank"]}
                pred = client.post(predictor_url + "/v1/cache/predict", json={**body, "pods": [pod]}, timeout=30).json()
                mine = next((a["cached_tokens"] for a in pred["pod_affinities"] if a["dp_rank"] == req["dp_rank"]), 0)
                _, actual = _send(client, engine_url, "tiny", req)
                out.append((mine, pred["predicted_cached_tokens"], actual, decision))
    finally:
        watcher.close()
    return out


def check(results: list[tuple[int, int, int, dict | None]]) -> None:
    assert sum(a > 0 for _, _, a, _ in results) >= 10, "the workload must exercise real cache hits"
    merged_wrong = sum(m != a for _, m, a, _ in results)
    assert merged_wrong > 0, "the workload must be one where the ranks merged give wrong answers"
    wrong = [(i, p, a) for i, (p, _, a, _) in enumerate(results) if p != a]
    assert not wrong, f"(request, predicted for its rank, vLLM's cached_tokens): {wrong}"
    routed = [(d, a) for _, _, a, d in results if d is not None]
    assert routed and all(d["headers"] == {"X-data-parallel-rank": str(d["dp_rank"])} for d, _ in routed), routed
    assert all(d["cached_tokens"] == a for d, a in routed), [(d["dp_rank"], d["cached_tokens"], a) for d, a in routed]


def test_each_rank_predicted_exactly_and_routes_honoured(vllm, valkey_url):
    with kvpf_stack(valkey_url, ["--engine", vllm.url], [], "e2e-dp") as stack:
        results = measured(vllm.url, stack.predictor_url, workload(4, 40))
        stats = httpx.get(stack.predictor_url + "/stats", timeout=5).json()
    print(f"\nDP 2 vLLM 0.32: {sum(p == a for p, _, a, _ in results)}/{len(results)} exact per rank; merged "
          f"{sum(m == a for _, m, a, _ in results)}/{len(results)}")
    pods = {p["pod_id"] for p in stats["pods"]}
    assert {vllm.pod_id, f"{vllm.pod_id}@dp1"} <= pods, pods
    assert any(p["counters"].get("removed", 0) for p in stats["pods"]), "the workload must force eviction"
    check(results)


def test_ranks_through_a_valkey_cluster(vllm, cluster_url):
    httpx.post(vllm.url + "/reset_prefix_cache", timeout=30).raise_for_status()  # both ranks start empty
    with kvpf_stack(cluster_url, ["--engine", vllm.url], [], "e2e-dp-cluster") as stack:
        results = measured(vllm.url, stack.predictor_url, workload(8, 30))
    check(results)
