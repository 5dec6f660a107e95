"""The foundation's promise, against a real vLLM: a prediction made just before a request
equals the ``cached_tokens`` the engine then reports, through shared prefixes and eviction."""
from __future__ import annotations

import random

import httpx
import pytest

from tests.e2e.conftest import VllmSpec
from kv_preflight.cli.accuracy import run_workload, summarize
from tests.e2e.harness import kvpf_stack

pytestmark = pytest.mark.e2e
VLLM_ENGINES = (VllmSpec("e2e-acc", 24),)


def workload(seed: int = 7, n: int = 40) -> list[dict]:
    """Shared system prompts and documents, revisited in random order; 23 usable blocks of 32
    tokens cannot hold them all, so vLLM evicts as it goes."""
    rng = random.Random(seed)
    # First, on the fresh engine: a prompt of exactly 2 blocks, twice. The second recomputes its last
    # block and vLLM caches that copy under the same hash; fillers then evict the original copy
    # (BlockRemoved of a hash the engine still holds), and the prompt returns with 2 cached blocks.
    twice = [rng.randrange(10, 8000) for _ in range(64)]
    fillers = [[rng.randrange(10, 8000) for _ in range(n)] for n in (320, 320, 32)]
    reqs = [{"token_ids": twice}, {"token_ids": twice}, *({"token_ids": f} for f in fillers),
            {"token_ids": twice + [rng.randrange(10, 8000) for _ in range(10)]}]
    systems = [[rng.randrange(10, 8000) for _ in range(rng.choice([70, 100, 130]))] for _ in range(4)]
    docs = [[rng.randrange(10, 8000) for _ in range(rng.choice([40, 64, 90]))] for _ in range(6)]
    for i in range(n):
        s, d = rng.choice(systems), rng.choice(docs)
        tail = [rng.randrange(10, 8000) for _ in range(rng.randrange(1, 40))]
        reqs.append({"token_ids": s + d + tail})
    # Text inputs go through the engine's tokenizer on both sides.
    reqs.insert(11, {"prompt": "The quick brown fox jumps over the lazy dog. " * 12})
    reqs.insert(15, {"prompt": "The quick brown fox jumps over the lazy dog. " * 12 + "Again?"})
    msgs = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Hello there"}]
    reqs.insert(18, {"messages": msgs})
    reqs.insert(21, {"messages": msgs[:1] + [{"role": "user", "content": "Hello again, friend"}]})
    return reqs


@pytest.fixture(scope="module")
def vllm(vllm_pool):
    engine = vllm_pool.take(VLLM_ENGINES[0])
    yield engine
    engine.stop()


def test_predictions_equal_vllm_cached_tokens(vllm, valkey_url):
    with kvpf_stack(valkey_url, ["--engine", vllm.url], ["--engine-url", f"tiny={vllm.url}"], "e2e-acc") as stack:
        results = run_workload(vllm.url, stack.predictor_url, "tiny", workload())
        stats = httpx.get(stack.predictor_url + "/stats", timeout=5).json()
    summary = summarize(results)
    print(f"\naccuracy against vLLM 0.32: {summary}")
    assert summary["requests_with_hits"] >= 10, "the workload must exercise real cache hits"
    pod = next(p for p in stats["pods"] if p["pod_id"] == vllm.pod_id)
    assert pod["counters"].get("removed", 0) > 0, "the workload must force eviction"
    assert results[5].actual == 64, "the duplicate-copy scenario did not play out as on vLLM 0.32"
    mismatches = [(r.index, r.predicted, r.actual) for r in results if not r.exact]
    assert not mismatches, f"(request, predicted, actual): {mismatches}"
