"""cache_salt against a real vLLM 0.32 (CPU, block size 32): salted prompts are keyed as the engine keys them.

vLLM puts the salt in the extra keys of the prompt's first block (kv_cache_utils
``generate_block_hash_extra_keys``) and publishes it there; a salted prompt only hits blocks cached
under the same salt. The predictor (``cache_salt`` on /v1/cache/predict) and the Dynamo API
(``cache_salt`` on /query) must say exactly what the engine then reports as cached.
"""
from __future__ import annotations

import random

import httpx
import pytest

from kv_preflight.cli.accuracy import EventWatcher, _send, wait_caught_up
from kv_preflight.cli.valkey_server import free_port
from tests.e2e.conftest import VllmSpec
from tests.e2e.harness import kvpf_stack, wait_http

pytestmark = pytest.mark.e2e
VLLM_ENGINES = (VllmSpec("e2e-salt", 64),)


@pytest.fixture(scope="module")
def vllm(vllm_pool):
    engine = vllm_pool.take(VLLM_ENGINES[0])
    yield engine
    engine.stop()


def test_salted_prompts_predicted_exactly(vllm, valkey_url):
    rng = random.Random(11)
    doc = [rng.randrange(100, 8000) for _ in range(200)]
    dynamo_port = free_port()
    with kvpf_stack(valkey_url, ["--engine", vllm.url], ["--engine-url", f"tiny={vllm.url}", "--dynamo-port", str(dynamo_port)], "e2e-salt") as stack:
        wait_http(f"http://127.0.0.1:{dynamo_port}/health")
        watcher = EventWatcher.for_engine(vllm.url)
        rows = []
        try:
            with httpx.Client() as client:
                # first sight of each salt caches the document under it; repeats must hit only their own salt
                for i, salt in enumerate(["tenant-a", "tenant-b", "tenant-a", None, "tenant-b", "tenant-c"]):
                    tokens = doc + [7000 + i]
                    wait_caught_up(stack.predictor_url, watcher)
                    body = {"model": "tiny", "token_ids": tokens, "pods": [vllm.pod_id]}
                    if salt:
                        body["cache_salt"] = salt
                    predicted = client.post(stack.predictor_url + "/v1/cache/predict", json=body, timeout=30).json()
                    q = {"token_ids": tokens, "model_name": "tiny"} | ({"cache_salt": salt} if salt else {})
                    dyn = client.post(f"http://127.0.0.1:{dynamo_port}/query", json=q, timeout=30).json()
                    req = {"token_ids": tokens} | ({"cache_salt": salt} if salt else {})
                    _, actual = _send(client, vllm.url, "tiny", req)
                    gpu = max((s["gpu"] for s in dyn.get("instances", {}).values()), default=0)  # 404 before any event
                    rows.append((salt, predicted["predicted_cached_tokens"], gpu, actual))
        finally:
            if watcher:
                watcher.close()
    print("\n(salt, predicted, dynamo /query gpu, vLLM cached_tokens):", rows)
    assert [r[3] for r in rows][:3] == [0, 0, 192], "vLLM did not isolate the salts as expected"
    assert all(p == a for _, p, _, a in rows), rows
    # /query counts whole blocks held (no last-token rule): here every hit covers 192 of 201 tokens either way
    assert all(g == a for _, _, g, a in rows), rows
