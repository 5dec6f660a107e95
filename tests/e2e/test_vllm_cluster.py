"""The accuracy promise on a Valkey Cluster: the same workload as test_vllm_accuracy.py, against a
fresh real vLLM, with the index sharded over a local cluster (3 masters + 3 replicas): every
prediction equals the engine's cached_tokens, before and after the master holding the pod's own
state (its seq and outbox) is killed with kill -9 halfway and its replica promoted."""
from __future__ import annotations

import time

import httpx
import pytest
import redis

from kv_preflight.cli.accuracy import run_workload, summarize
from kv_preflight.index.layout import pod_outbox_key
from tests.e2e.conftest import VllmSpec
from tests.e2e.harness import kvpf_stack
from tests.e2e.test_vllm_accuracy import workload

pytestmark = pytest.mark.e2e
VLLM_ENGINES = (VllmSpec("e2e-cluster", 24),)


@pytest.fixture(scope="module")
def vllm(vllm_pool):
    engine = vllm_pool.take(VLLM_ENGINES[0])
    yield engine
    engine.stop()


def kill_master_of(valkey_cluster, cluster_url: str, key: str, timeout_s: float = 30.0) -> int:
    """kill -9 the master serving ``key``'s slot; returns the port of the replica promoted in its place."""
    client = redis.RedisCluster.from_url(cluster_url)
    try:
        victim = valkey_cluster.node_at(client.get_node_from_key(key).port)
    finally:
        client.close()
    replicas = {n.port for n in valkey_cluster.replicas_of(victim)}
    victim.stop(kill=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        promoted = replicas & {n.port for n in valkey_cluster.masters_now()}
        if promoted:
            return promoted.pop()
        time.sleep(0.1)
    raise AssertionError(f"no replica of {victim.port} was promoted in {timeout_s}s")


def wait_full_answer(predictor_url: str, timeout_s: float = 30.0) -> None:
    """Until the predictor answers a prediction whole again (200, not partial) after the failover."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            body = {"model": "tiny", "token_ids": list(range(1, 65))}
            last = httpx.post(predictor_url + "/v1/cache/predict", json=body, timeout=5)
            if last.status_code == 200 and not last.json().get("partial"):
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"the predictor did not answer whole after the failover: {last!r}")


def test_predictions_equal_vllm_cached_tokens_on_a_cluster(vllm, valkey_cluster, cluster_url):
    work = workload()
    half = len(work) // 2
    with kvpf_stack(cluster_url, ["--engine", vllm.url], ["--engine-url", f"tiny={vllm.url}"], "e2e-cluster") as stack:
        results = run_workload(vllm.url, stack.predictor_url, "tiny", work[:half])
        kill_master_of(valkey_cluster, cluster_url, pod_outbox_key(vllm.pod_id))
        wait_full_answer(stack.predictor_url)
        after = run_workload(vllm.url, stack.predictor_url, "tiny", work[half:])
        results += after
        stats = httpx.get(stack.predictor_url + f"/stats?pod={vllm.pod_id}", timeout=5).json()
        assert stack.ingester.poll() is None and stack.predictor.poll() is None, "a process exited in the failover"
    summary = summarize(results)
    print(f"\naccuracy against vLLM 0.32 on a Valkey Cluster, a master killed halfway: {summary}")
    assert summary["requests_with_hits"] >= 10, "the workload must exercise real cache hits"
    assert summarize(after)["requests_with_hits"] >= 5, "the failover must be followed by real cache hits"
    pod = next(p for p in stats["pods"] if p["pod_id"] == vllm.pod_id)
    assert pod["counters"].get("removed", 0) > 0, "the workload must force eviction"
    mismatches = [(i, r.predicted, r.actual) for i, r in enumerate(results) if not r.exact]
    assert not mismatches, f"(request, predicted, actual): {mismatches}"
