"""LoRA adapters against a real vLLM 0.32 (CPU) serving the tiny model and two adapters made by the launcher's
make-lora.py, with no flag naming any adapter: every model in turn (the base, ``a``, ``b``, and ``c`` loaded at
run time), salted and not, with eviction, each prediction equal to the ``cached_tokens`` vLLM then reports.

The predictor is given nothing but the Valkey URL: it learns the adapters from the events (their
``lora_name``, recorded per pod by the ingester). First on one Valkey with the engine subscribed by its ZMQ
source alone (no engine URL anywhere, as ``--bind``/``--source`` feeds are); then on a Valkey Cluster with
the engine found by ``--engine`` (its fleet record lists /v1/models), where unloading an adapter takes its
pod out of that adapter's routes."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from kv_preflight.cli.accuracy import EventWatcher, _send, run_workload, summarize, wait_caught_up
from tests.e2e.conftest import VllmSpec, make_lora
from tests.e2e.harness import kvpf_stack

pytestmark = pytest.mark.e2e
VLLM_ENGINES = (VllmSpec("e2e-lora", 24, loras=("a", "b")),)
MODELS = ("tiny", "a", "b")


@pytest.fixture(scope="module")
def vllm(vllm_pool):
    engine = vllm_pool.take(VLLM_ENGINES[0])
    yield engine
    engine.stop()


def workload(seed: int, n: int, models: tuple[str, ...]) -> list[dict]:
    """Sessions (a model, a salt or none, a system prompt) revisited with documents in random order; 23 usable
    blocks of 32 tokens cannot hold them all, so vLLM evicts as it goes. Two sessions share a system prompt under
    two models, and one prompt goes to each model in turn first: cached under one, a miss under the others."""
    rng = random.Random(seed)
    first = [rng.randrange(10, 8000) for _ in range(100)]
    reqs = [{"model": m, "token_ids": first} for m in (*models, models[1])]
    systems = [[rng.randrange(10, 8000) for _ in range(rng.choice([70, 100, 130]))] for _ in range(3)]
    docs = [[rng.randrange(10, 8000) for _ in range(rng.choice([40, 64, 90]))] for _ in range(3)]
    sessions = [(m, salt, rng.choice(systems)) for m in models for salt in (None, rng.choice(["t1", "t2"]))]
    sessions.append((models[-1], None, sessions[0][2]))  # the base model's system prompt under an adapter
    for _ in range(n):
        model, salt, system = rng.choice(sessions)
        tail = [rng.randrange(10, 8000) for _ in range(rng.randrange(1, 30))]
        reqs.append({"model": model, "token_ids": system + rng.choice(docs) + tail, **({"cache_salt": salt} if salt else {})})
    return reqs


def check(results, reqs, what: str) -> None:
    summary = summarize(results)
    print(f"\n{what}: {summary}")
    mismatches = [(r.index, reqs[r.index].get("model"), reqs[r.index].get("cache_salt"), r.predicted, r.actual)
                  for r in results if not r.exact]
    assert not mismatches, f"(request, model, salt, predicted, actual): {mismatches}"
    adapter_hits = [r for r in results if reqs[r.index]["model"] != "tiny" and r.actual > 0]
    assert len(adapter_hits) >= 3 and summary["requests_with_hits"] >= len(results) // 4, "the workload must hit"


def load_adapter(vllm, name: str, seed: int) -> None:
    path = make_lora(f"/tmp/kvpf-lora-{vllm.pod_id}-{name}", seed)
    r = httpx.post(vllm.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)
    assert r.status_code == 200, r.text


def serve_once(vllm, predictor_url: str, models: tuple[str, ...], seed: int) -> None:
    """One request per model, straight to the engine, until the index has it: a model (an adapter) is known to a
    predictor given no flag once blocks of it are indexed (an engine found by URL: once /v1/models is read)."""
    rng = random.Random(seed)
    watcher = EventWatcher.for_engine(vllm.url)
    try:
        with httpx.Client() as client:
            for m in models:
                _send(client, vllm.url, m, {"token_ids": [rng.randrange(10, 8000) for _ in range(40)]})
        wait_caught_up(predictor_url, watcher)
    finally:
        watcher.close()


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_model_exact_with_adapters_learnt_from_the_events(vllm, valkey_url):
    source = f"{vllm.zmq},replay={vllm.replay}"  # the engine's sockets alone: no URL, no /v1/models
    with kvpf_stack(valkey_url, ["--source", source], [], "e2e-lora") as stack:
        serve_once(vllm, stack.predictor_url, MODELS, 20)
        reqs = workload(21, 26, MODELS)
        results = run_workload(vllm.url, stack.predictor_url, "tiny", reqs)
        check(results, reqs, "LoRA accuracy, adapters from the events")
        stats = httpx.get(stack.predictor_url + f"/stats?pod={vllm.pod_id}", timeout=5).json()
        assert stats["pods"][0]["counters"].get("removed", 0) > 0, "the workload must force eviction"

        # an adapter loaded at run time: known as soon as its first blocks are in the index
        load_adapter(vllm, "c", 3)
        assert httpx.post(stack.predictor_url + "/v1/cache/predict", json={"model": "c", "token_ids": [1] * 40},
                          timeout=30).status_code == 400  # not served yet: unknown, as a typo is
        serve_once(vllm, stack.predictor_url, ("c",), 24)
        more = workload(22, 10, (*MODELS, "c"))
        check(run_workload(vllm.url, stack.predictor_url, "tiny", more), more, "with an adapter loaded at run time")

        # explain names where a prompt is cached when it is asked under another name; route keeps to the adapter's pods
        rng = random.Random(23)
        prompt = [rng.randrange(10, 8000) for _ in range(90)]
        watcher = EventWatcher.for_engine(vllm.url)
        try:
            with httpx.Client() as client:
                _send(client, vllm.url, "a", {"token_ids": prompt})
            wait_caught_up(stack.predictor_url, watcher)
        finally:
            watcher.close()
        e = post(stack.predictor_url, "/v1/cache/explain", {"model": "b", "token_ids": prompt})
        assert any("another LoRA adapter, 'a', of the same base model 'tiny'" in f["detail"]
                   for f in e["findings"] if f["kind"] == "other_model"), e["findings"]
        e = post(stack.predictor_url, "/v1/cache/explain", {"model": "tiny", "token_ids": prompt})
        assert any("LoRA adapter 'a' of this base model" in f["detail"]
                   for f in e["findings"] if f["kind"] == "other_model"), e["findings"]
        d = post(stack.predictor_url, "/v1/cache/route", {"model": "a", "token_ids": prompt})
        assert (d["pod_id"], d["cached_tokens"]) == (vllm.pod_id, 64), d


def test_every_model_exact_on_a_cluster_and_an_unloaded_adapter_is_not_routed_to(vllm, cluster_url):
    """The engine found by URL: its fleet record lists its models, re-read every 10 s, so an adapter unloaded
    leaves that list and its routes; the predictor still has no flag."""
    r = httpx.post(vllm.url + "/reset_prefix_cache", timeout=30)  # what the first test cached is of no use here
    assert r.status_code == 200, r.text
    with kvpf_stack(cluster_url, ["--engine", vllm.url], [], "e2e-lora-cluster") as stack:
        serve_once(vllm, stack.predictor_url, (*MODELS, "c"), 30)
        reqs = workload(31, 16, (*MODELS, "c"))
        results = run_workload(vllm.url, stack.predictor_url, "tiny", reqs)
        check(results, reqs, "LoRA accuracy on a Valkey Cluster")
        prompt = reqs[0]["token_ids"]
        assert post(stack.predictor_url, "/v1/cache/route", {"model": "c", "token_ids": prompt})["pod_id"] == vllm.pod_id
        r = httpx.post(vllm.url + "/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 40
        while True:
            d = post(stack.predictor_url, "/v1/cache/route", {"model": "c", "token_ids": prompt})
            if d["pod_id"] is None:
                break
            assert time.monotonic() < deadline, f"the pod is still routed to for the unloaded adapter: {d}"
            time.sleep(0.5)
        assert d["reason"] == "no_candidates", d
        assert post(stack.predictor_url, "/v1/cache/route", {"model": "a", "token_ids": prompt})["pod_id"] == vllm.pod_id
