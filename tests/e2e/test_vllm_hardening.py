"""A hash reported stored twice by a real vLLM 0.32 without a second copy, checked against the
engine's own ``cached_tokens`` after eviction (where a miscount shows).

``kv_cache_report_mode: "full"`` (sampling ``extra_args``, sent as ``vllm_xargs``) makes vLLM re-send
BlockStored for the cached blocks a request reuses (vllm/v1/core/kv_cache_manager.py,
block_pool.emit_cached_block_events): no new copy, so no later BlockRemoved for one. Counted as a copy,
the entry would outlive the block. (``cache_salt`` is checked at the index level only: vLLM 0.32 puts
the salt in block 0's ``extra_keys``, which the bridge keys like a multimodal identifier, so salted and
unsalted prompts get different request keys here; see tests/integration/test_hardening_ingest.py.)
"""
from __future__ import annotations

import random

import httpx
import pytest
import redis

from kv_preflight.cli.accuracy import EventWatcher, _send, pod_of, wait_caught_up
from kv_preflight.index.layout import pod_meta_key
from tests.e2e.conftest import VllmSpec
from tests.e2e.harness import kvpf_stack

pytestmark = pytest.mark.e2e
VLLM_ENGINES = (VllmSpec("e2e-hard", 24),)


@pytest.fixture
def vllm(vllm_pool):
    # 24 blocks (23 usable) of 32 tokens: small enough to evict on purpose.
    engine = vllm_pool.take(VLLM_ENGINES[0])
    yield engine
    engine.stop()


def predict(predictor_url: str, pod: str, tokens: list[int]) -> int:
    r = httpx.post(predictor_url + "/v1/cache/predict", json={"model": "tiny", "token_ids": tokens, "pods": [pod]},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["predicted_cached_tokens"]


def test_report_mode_full_is_not_a_copy_against_vllm(vllm, valkey_url):
    rng = random.Random(21)
    toks = lambda n: [rng.randrange(10, 8000) for _ in range(n)]  # noqa: E731
    p = toks(96)  # three full blocks
    with kvpf_stack(valkey_url, ["--engine", vllm.url, "--kv-cache-report-mode", "full"], [], "e2e-hard") as stack, httpx.Client() as client:
        watcher = EventWatcher.for_engine(vllm.url)
        pod = pod_of(vllm.url)

        def send(req: dict) -> int:
            wait_caught_up(stack.predictor_url, watcher)
            return _send(client, vllm.url, "tiny", req)[1]

        try:
            # --- report mode "full": the re-sent blocks are not copies
            assert send({"token_ids": p + toks(10)}) == 0
            full = {"token_ids": p + toks(10), "vllm_xargs": {"kv_cache_report_mode": "full"}}
            assert send(full) == 96
            wait_caught_up(stack.predictor_url, watcher)
            # Fillers evict all of p's blocks (LRU); a copy miscounted would keep p listed.
            for n in (320, 320, 200):
                send({"token_ids": toks(n)})
            probe = p + toks(10)
            wait_caught_up(stack.predictor_url, watcher)
            predicted = predict(stack.predictor_url, pod, probe)
            actual = send({"token_ids": probe})
            assert actual == 0, "the fillers did not evict the prompt as planned"
            assert predicted == actual, "a re-announced block was counted as a second copy and outlived its eviction"
            meta = redis.Redis.from_url(valkey_url).hgetall(pod_meta_key(pod))
            assert int(meta.get(b"reannounced", 0)) >= 3, "vLLM did not re-send the reused blocks"

        finally:
            if watcher:
                watcher.close()
