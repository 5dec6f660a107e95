"""llm-d-router's xxh64 request keys (kv_preflight/keys/xxh64.py) against vectors from an independent implementation.

tests/fixtures/llmd-xxh64-request-keys.json was computed with the ``xxhash`` Python package (its
streaming XXH64, fed in the write order of llm-d-router's ``hashXXH64``, commit c027acfc6e33ed38a4a87a07fd13a28f3a10196f);
the digest itself is also compared with the package when it is installed.
"""
from __future__ import annotations

import json
import random

import pytest

from kv_preflight.keys import xxh64
from kv_preflight.keys.chain import request_keys, salted_request_keys
from tests.conftest import fixture_path

CASES = json.loads(fixture_path("llmd-xxh64-request-keys.json").read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_vectors(case):
    n = len(case["tokens"]) // case["block_size"]
    extras = [case["extras"].get(str(i)) for i in range(n)]
    got = request_keys(case["tokens"], model=case["model"], hash_seed=case["hash_seed"], block_size=case["block_size"],
                       parent=int(case["parent"]) if case["parent"] else None,
                       extra_per_block=extras if any(extras) else None, hash_algo="xxh64")
    assert [str(k) for k in got] == case["keys"]


def test_pure_python_digest_equals_the_package():
    xxhash = pytest.importorskip("xxhash", reason="the xxhash package is not installed; the fixture vectors still run")
    rng = random.Random(5)
    for n in [*range(70), 255, 1024]:
        data = bytes(rng.randrange(256) for _ in range(n))
        for seed in (0, 1, 2 ** 64 - 1):
            assert xxh64.xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed=seed)


def test_pure_python_chain_equals_the_fast_one(monkeypatch):
    tokens = list(range(100, 164))
    fast = xxh64.request_keys(tokens, model="m", extra_per_block=[["s"], None, None, None])
    monkeypatch.setattr(xxh64, "_digest", None)
    xxh64.root_key.cache_clear()
    try:
        assert xxh64.request_keys(tokens, model="m", extra_per_block=[["s"], None, None, None]) == fast
    finally:
        xxh64.root_key.cache_clear()


def test_salt_is_the_last_extra_of_block_0():
    salted = salted_request_keys(list(range(64)), model="tiny", cache_salt="tenant-a", hash_algo="xxh64")
    case = next(c for c in CASES if c["name"].startswith("cache salt"))
    assert salted != request_keys(list(range(64)), model="tiny", hash_algo="xxh64")
    assert len(salted) == 4 and case["extras"]["0"][-1] == "tenant-a"
