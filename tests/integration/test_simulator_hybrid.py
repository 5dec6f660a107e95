"""A hybrid simulated engine (``simulate --sliding-window 64``: a sliding-window KV cache group beside a
full-attention one, block size 32, as vLLM 0.32 runs the launcher's tiny-hybrid-model) behind a real ingester
and predictor: every prediction made just before a request equals the ``cached_tokens`` the engine then
reports, through shared prefixes, window-cut hits and eviction. The workload is one where counting a pod's
full-attention blocks alone would be wrong, so the test can fail."""
from __future__ import annotations

import random

import httpx

from kv_preflight.cli.accuracy import EventWatcher, _send, pod_of, wait_caught_up
from kv_preflight.simulator import tokenizer
from kv_preflight.simulator.engine import Generation, run_request
from kv_preflight.simulator.hybrid_cache import FULL_ATTENTION, SLIDING_WINDOW, HybridPrefixCache, KVCacheGroup
from tests.e2e.harness import kvpf_stack
from tests.integration.sim import sim_engine

BLOCK_SIZE = 32
WINDOW = 64
BLOCKS = 40


def workload(seed: int, n: int) -> list[list[int]]:
    """System prompts and documents revisited in random order, some prompts cut at the document's end (the
    window group keeps only the blocks ending where a request stopped); 39 blocks for two groups cannot hold
    it all."""
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 8000) for _ in range(rng.choice([64, 100, 150]))] for _ in range(2)]
    docs = [[rng.randrange(10, 8000) for _ in range(rng.randrange(30, 200))] for _ in range(6)]
    out = []
    for _ in range(n):
        s, d = rng.choice(systems), rng.choice(docs)
        q = [rng.randrange(10, 8000) for _ in range(rng.randrange(1, 60))]
        r = rng.random()
        out.append((s + d + q if r < 0.5 else (d + q if r < 0.8 else s + d))[:480])
    return out


def full_attention_only(prompts: list[list[int]]) -> list[int]:
    """What each request would reuse if the full-attention group alone decided (the engine's blocks as the
    same requests leave them): the cached run from block 0, the last token recomputed."""
    cache = HybridPrefixCache(BLOCKS, BLOCK_SIZE, (KVCacheGroup(SLIDING_WINDOW, WINDOW), KVCacheGroup(FULL_ATTENTION)))
    out = []
    for prompt in prompts:
        req = cache.new_request(prompt)
        out.append(len(cache._full_hit(req, len(prompt) - 1)) * BLOCK_SIZE)
        for _ in run_request(cache, Generation(prompt_ids=prompt, max_tokens=1), tokenizer.OUTPUT_ALPHABET):
            pass
    return out


def test_hybrid_simulator_predictions_equal_cached_tokens(valkey_url, tmp_path):
    engine = sim_engine("sim-hybrid", tmp_path, blocks=BLOCKS)
    engine.block_size, engine.sliding_window = BLOCK_SIZE, WINDOW
    engine.start()
    prompts = workload(9, 60)
    results: list[tuple[int, int]] = []
    try:
        with kvpf_stack(valkey_url, ["--engine", engine.url], ["--engine-url", f"sim={engine.url}"],
                        "sim-hybrid") as stack:
            watcher = EventWatcher.for_engine(engine.url)
            pod = pod_of(engine.url)
            try:
                with httpx.Client() as client:
                    for prompt in prompts:
                        wait_caught_up(stack.predictor_url, watcher)
                        body = {"model": "sim", "token_ids": prompt, "pods": [pod]}
                        pred = client.post(stack.predictor_url + "/v1/cache/predict", json=body, timeout=30).json()
                        actual = _send(client, engine.url, "sim", {"token_ids": prompt})[1]
                        results.append((pred["predicted_cached_tokens"], actual))
            finally:
                if watcher is not None:
                    watcher.close()
            stats = httpx.get(stack.predictor_url + "/stats", timeout=5).json()
        published = engine.published()
    finally:
        engine.stop()

    blind = full_attention_only(prompts)
    print(f"\nhybrid simulator: {sum(p == a for p, a in results)}/{len(results)} exact; "
          f"full attention alone: {sum(b == a for b, (_, a) in zip(blind, results))}/{len(results)}")
    assert sum(a > 0 for _, a in results) >= 15, "the workload must exercise cache hits"
    assert any(b != a for b, (_, a) in zip(blind, results)), "the window group must cut some hits"
    assert any(e.__class__.__name__ == "BlockRemoved" for b in published for e in b.events), \
        "the workload must force eviction"
    pod_stats = next(p for p in stats["pods"] if p["pod_id"] == pod)
    assert pod_stats["counters"].get("removed", 0) > 0
    mismatches = [(i, p, a) for i, (p, a) in enumerate(results) if p != a]
    assert not mismatches, f"(request, predicted, actual): {mismatches}"
