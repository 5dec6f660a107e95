"""The accuracy promise on a Valkey Cluster: the same workload as test_vllm_accuracy.py, against a
fresh real vLLM, with the index sharded over a local cluster (3 masters + 3 replicas): every
prediction equals the engine's cached_tokens."""
from __future__ import annotations

import httpx
import pytest

from kv_preflight.cli.accuracy import run_workload, summarize
from kv_preflight.cli.valkey_server import free_port
from tests.e2e.conftest import start_vllm
from tests.e2e.harness import kvpf_stack
from tests.e2e.test_vllm_accuracy import workload

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def vllm():
    engine = start_vllm(pod="e2e-cluster", port=free_port(), zmq_port=free_port(), replay_port=free_port(), blocks=24)
    yield engine
    engine.stop()


def test_predictions_equal_vllm_cached_tokens_on_a_cluster(vllm, cluster_url):
    with kvpf_stack(cluster_url, ["--engine", vllm.url], ["--engine-url", f"tiny={vllm.url}"], "e2e-cluster") as stack:
        results = run_workload(vllm.url, stack.predictor_url, "tiny", workload())
        stats = httpx.get(stack.predictor_url + f"/stats?pod={vllm.pod_id}", timeout=5).json()
    summary = summarize(results)
    print(f"\naccuracy against vLLM 0.32 on a Valkey Cluster: {summary}")
    assert summary["requests_with_hits"] >= 10, "the workload must exercise real cache hits"
    pod = next(p for p in stats["pods"] if p["pod_id"] == vllm.pod_id)
    assert pod["counters"].get("removed", 0) > 0, "the workload must force eviction"
    mismatches = [(r.index, r.predicted, r.actual) for r in results if not r.exact]
    assert not mismatches, f"(request, predicted, actual): {mismatches}"
